"""Fault controls for the real-server tests (tests only, never shipped).

Loaded by sglang_site/sitecustomize.py in every process of a server launched
with ``KVSTAGE_TEST_FAULTS=<folder>``. When ``kvstage.plugin.sglang.conn`` is
imported, its ``KVStageManager.add_transfer_request`` is wrapped: on prefill
rank 0, at a request's last chunk (its forward is done, kvstage has not sent a
byte), a file in the folder arms one fault for the next such request:

- ``die-next``: the rank sleeps as many seconds as the file says (0 when it is empty: the other
  requests sent meanwhile reach both servers and wait), then SIGKILLs itself, so the prefill server
  dies with requests in flight;
- ``stall-next``: the rank sleeps as many seconds as the file says (a slow
  forward), so a client can give up on the request while it is in flight;
- ``corrupt-next``: one byte of the request's KV changes in the prefill's pool
  before kvstage reads it: byte 3 of layer 0's V on the chunk's first page
  becomes 0x7f. That is the most significant byte of a float32 element, or of
  the second element in 16-bit floats: a huge or non-finite value, which a
  decode computing from that KV must show.
- ``flip-next``: one byte of the request's first gathered chunk changes in the
  prefill's staging arena right after kvstage's gather read (and summed) it, so
  the bytes change between the source's read and the decode's landing: the
  chunk checksum (``KVSTAGE_CHECKSUM=all`` on the prefill) must fail the request.

The hook removes the file it acts on and writes ``<fault>.fired`` with the
room and the wall-clock time it acted at (for ``die-next``: right before the
kill), so the test knows the control really ran, and when.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.machinery
import logging
import os
import signal
import sys
import time

TARGET = "kvstage.plugin.sglang.conn"
FAULTS = ("die-next", "corrupt-next", "stall-next", "flip-next")
log = logging.getLogger("kvstage.tests.faults")


def install(folder: str) -> None:
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"KVSTAGE_TEST_FAULTS={folder!r}: no such folder")
    if TARGET in sys.modules:
        _patch(sys.modules[TARGET], folder)
    else:
        sys.meta_path.insert(0, _AfterImport(folder))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches ``TARGET`` right after it executes, wherever it is first imported."""

    def __init__(self, folder: str):
        self.folder = folder

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        exec_module, folder = spec.loader.exec_module, self.folder

        def exec_and_patch(module):
            exec_module(module)
            _patch(module, folder)

        spec.loader.exec_module = exec_and_patch
        return spec


def _patch(conn, folder: str) -> None:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    original = conn.KVStageManager.add_transfer_request

    def add_transfer_request(self, bootstrap_room, kv_indices, index_slice, is_last_chunk, *args, **kwargs):
        if is_last_chunk and self.disaggregation_mode == DisaggregationMode.PREFILL and self.attn_tp_rank == 0:
            fault, text = _claim(folder)
            if fault == "die-next":
                time.sleep(float(text or 0))
                _fired(folder, fault, bootstrap_room)
                log.warning("test fault: prefill rank 0 kills itself before sending room %s", bootstrap_room)
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault == "stall-next":
                _fired(folder, fault, bootstrap_room)
                log.warning("test fault: prefill rank 0 stalls %s s before sending room %s", text, bootstrap_room)
                time.sleep(float(text))
            elif fault == "corrupt-next":
                _fired(folder, fault, bootstrap_room)
                _corrupt_one_byte(self.kv_args, int(kv_indices[0]))
                log.warning("test fault: one KV byte of room %s corrupted on prefill rank 0", bootstrap_room)
            elif fault == "flip-next":
                _fired(folder, fault, bootstrap_room)
                from support.flips import flip_after_next_gather

                flip_after_next_gather()
                log.warning("test fault: the next gather on prefill rank 0 (room %s) is flipped", bootstrap_room)
        return original(self, bootstrap_room, kv_indices, index_slice, is_last_chunk, *args, **kwargs)

    conn.KVStageManager.add_transfer_request = add_transfer_request


def _fired(folder: str, fault: str, room) -> None:
    with open(os.path.join(folder, fault + ".fired"), "w") as f:
        f.write(f"{room} {time.time()!r}")


def _claim(folder: str) -> tuple:
    """(fault, the file's text) of an armed fault, its file removed; (None, None) when none is."""
    for fault in FAULTS:
        path = os.path.join(folder, fault)
        try:
            with open(path) as f:
                text = f.read().strip()
            os.unlink(path)
        except FileNotFoundError:
            continue
        return fault, text
    return None, None


def _corrupt_one_byte(kv_args, page: int) -> None:
    """Byte 3 of ``page`` in layer 0's V buffer := 0x7f."""
    layers = len(kv_args.kv_data_ptrs) // 2  # MHA pools: all K layers, then all V layers
    at = int(kv_args.kv_data_ptrs[layers]) + page * int(kv_args.kv_item_lens[layers]) + 3
    ctypes.c_uint8.from_address(at).value = 0x7F
