"""A fingerprint of the weights an engine serves: part of the model identity the handshake compares.

Two engines may load the same path with the same shapes and still serve other weights (a
``/models/current`` re-pointed between the decode's start and the prefill's, during a rolling
update): the KV of one then decodes wrong tokens in the other, with nothing logged. So each
engine hashes a fixed sample of its weights once, at load: the tensors in name order, at most
``MAX_TENSORS`` of them spread evenly over that order (always the first and the last), and of each
its name, dtype, shape and ``SAMPLE_BYTES`` from its start, its middle and its end. Two checkpoints
that differ in a sampled tensor differ here; the cost is bounded whatever the model's size
(``MAX_TENSORS * 3 * SAMPLE_BYTES`` bytes read: 768 KiB).

``checkpoint`` reads the sample from a checkpoint's safetensors files (their headers say where
each tensor lies: at most 192 reads of 4 KiB); ``tensors`` from tensors in memory (the same
fingerprint for the same names and bytes). Pure Python and torch; no engine import.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

#: tensors sampled at most (spread evenly over the name order)
MAX_TENSORS = 64
#: bytes taken from the start, the middle and the end of each sampled tensor
SAMPLE_BYTES = 4096
#: a fingerprint's length in hex characters
DIGITS = 16
#: a safetensors header larger than this is not one (the format's own limit is 100 MB)
MAX_HEADER = 100 << 20


def _chosen(count: int) -> list[int]:
    """Which of ``count`` tensors (in name order) are sampled: all, or ``MAX_TENSORS`` spread evenly."""
    if count <= MAX_TENSORS:
        return list(range(count))
    return sorted({round(i * (count - 1) / (MAX_TENSORS - 1)) for i in range(MAX_TENSORS)})


def _windows(nbytes: int) -> list[tuple[int, int]]:
    """(offset, length) of the start, middle and end samples of a tensor of ``nbytes`` bytes."""
    if nbytes <= 3 * SAMPLE_BYTES:
        return [(0, nbytes)]
    mid = (nbytes - SAMPLE_BYTES) // 2
    return [(0, SAMPLE_BYTES), (mid, SAMPLE_BYTES), (nbytes - SAMPLE_BYTES, SAMPLE_BYTES)]


def _digest(entries) -> str:
    """entries: (name, dtype, shape, reader) in name order, where ``reader(offset, length)`` gives bytes."""
    h = hashlib.sha256(b"kvstage-weights-1")
    for name, dtype, shape, nbytes, read in entries:
        h.update(json.dumps([name, dtype, list(shape), nbytes]).encode())
        for offset, length in _windows(nbytes):
            h.update(read(offset, length))
    return h.hexdigest()[:DIGITS]


#: safetensors' dtype names as torch names them, so both readers hash the same text
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def tensors(named: dict) -> str:
    """The fingerprint of ``named`` (tensor name -> torch tensor, on any device): what ``checkpoint`` gives
    for a safetensors checkpoint of the same names and bytes."""
    import torch

    names = sorted(named)
    entries = []
    for i in _chosen(len(names)):
        t = named[names[i]]
        flat = t.detach().reshape(-1)
        size = flat.element_size()
        nbytes = flat.numel() * size

        def read(offset, length, flat=flat, size=size):
            part = flat[offset // size : (offset + length) // size]
            return part.contiguous().cpu().view(torch.uint8).numpy().tobytes()

        entries.append((names[i], str(t.dtype).removeprefix("torch."), tuple(t.shape), nbytes, read))
    return _digest(entries)


def _safetensors_index(path: str) -> dict:
    """name -> (file, dtype, shape, start, end) of every tensor of one safetensors file."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise ValueError(f"{path}: not a safetensors file (a header of {n} bytes)")
        header = json.loads(f.read(n))
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        out[name] = (
            path,
            _SAFETENSORS_DTYPES.get(info["dtype"], info["dtype"]),
            tuple(info["shape"]),
            base + start,
            base + end,
        )
    return out


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of a checkpoint directory, in name order ([] where it has none)."""
    try:
        names = sorted(os.listdir(model_dir))
    except OSError:
        return []
    return [os.path.join(model_dir, n) for n in names if n.endswith(".safetensors")]


def checkpoint(model_dir: str) -> str | None:
    """The fingerprint of the weights in ``model_dir``'s safetensors files, or None where it has none (another
    format, or not a local directory)."""
    files = checkpoint_files(model_dir)
    if not files:
        return None
    index: dict = {}
    for path in files:
        index.update(_safetensors_index(path))
    names = sorted(index)
    handles: dict = {}
    try:
        entries = []
        for i in _chosen(len(names)):
            path, dtype, shape, start, end = index[names[i]]
            f = handles.get(path) or handles.setdefault(path, open(path, "rb"))

            def read(offset, length, f=f, start=start):
                return os.pread(f.fileno(), length, start + offset)

            entries.append((names[i], dtype, shape, end - start, read))
        return _digest(entries)
    finally:
        for f in handles.values():
            f.close()


def local_dir(model: str, revision: str | None = None) -> str | None:
    """The local directory of a model given by path or by hub name (the engine downloaded it already:
    no network call), or None."""
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, local_files_only=True)
    except Exception:  # not a hub name, or not in the local cache
        return None


def identity_part(model: str, revision=None, logger: str = "kvstage") -> str:
    """What an engine appends to its model identity: ``" weights=FINGERPRINT"`` of the checkpoint it loaded
    (``protocol.handshake.WEIGHTS``), timed and logged once; "" where it has no local safetensors files (said
    in one WARNING: the identity then covers the path and the shapes only)."""
    import logging
    import time

    from kvstage.protocol.handshake import WEIGHTS

    log = logging.getLogger(logger)
    began = time.perf_counter()
    where = local_dir(model, revision)
    try:
        got = checkpoint(where) if where else None
    except (OSError, ValueError, KeyError) as e:
        log.warning(
            "kvstage: the checkpoint at %r could not be fingerprinted (%s): the model identity covers its "
            "path and shapes, not its weights",
            model[-200:],
            e,
        )
        return ""
    if got is None:
        log.warning(
            "kvstage: no local safetensors checkpoint at %r: the model identity covers its path and shapes, "
            "not its weights",
            model[-200:],
        )
        return ""
    log.info("kvstage: weights fingerprint %s of %r (%.1f ms)", got, model[-200:], 1e3 * (time.perf_counter() - began))
    return WEIGHTS + got
