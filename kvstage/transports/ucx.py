"""UCX transport through UCXX: two-sided tag messages behind the transport contract.

UCXX (``ucxx-cu13``/``ucxx-cu12``) is the maintained Python API over UCX; its
predecessor ucx-py is archived. kvstage uses UCXX's synchronous layer
(``ucxx._lib.libucxx``: context, worker, endpoints from worker addresses, tag
send/receive, ``worker.progress()``) and drives progress from the endpoint's
own loop thread, like NIXL: no progress thread, no asyncio.

Two-sided, so a byte lands only where the receiver posted a receive:

- the receiver calls ``expect(peer, spans)`` when it grants memory; that posts
  one tag receive per span, with tags ``base .. base+n-1`` from a counter that
  never repeats in this process, and returns the ticket ``(base, n)``;
- the writer's ``write(peer, local, remote, notification, ticket)`` sends span
  ``i`` with tag ``base+i``, then a notification message (tag ``_NOTIF_TAG``)
  naming the ticket and the writer;
- the receiver hands the notification out of ``notifications()`` only when
  every receive of that ticket has completed: the same guarantee as a NIXL
  notification (it arrives after the bytes).

Tags never repeat, so a stale message can never match a later grant's
receive. The UCX context runs with ``RNDV_THRESH=0`` (every message uses the
rendezvous protocol): a send then completes only once the receiver matched it
and the bytes moved, so a completed write means landed bytes, as it does with
NIXL, and the protocol's "no write of mine is in flight" (abort_ack) stays true.
``RNDV_SCHEME=put_zcopy`` (unless ``UCX_RNDV_SCHEME`` is set) makes each sender
write its own bytes, as NIXL's writers do.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import random
import struct
import threading
import uuid
import weakref

import numpy as np

from kvstage.errors import TransportError
from kvstage.transports.base import Region, Spans, Transport, WriteState

log = logging.getLogger(__name__)

_MD_MAGIC = b"KVSTAGE-UCX1\n"
_NOTIF_MAGIC = b"KVN1"
_NOTIF_TAG = (1 << 63) | 0x4B5653  # data tags stay below 1 << 62
_NOTIF_MAX = 4096  # bytes of one notification message, header included
_NOTIF_POSTED = 16  # notification receives kept posted
_MAX_DISCARD = 1 << 16  # messages of one stray write received and thrown away
_TICKET = struct.Struct("!QI")  # first tag, number of spans
_HEAD = struct.Struct("!4sI12sH")  # magic, total length, ticket, sender id length
_U16 = struct.Struct("!H")
#: environment variables ``import ucxx`` sets for Dask-style use; kvstage puts back what was there
_UCXX_ENV = ("UCX_MEMTYPE_CACHE", "UCX_RNDV_THRESH", "UCX_RNDV_FRAG_MEM_TYPE", "UCX_CUDA_COPY_MAX_REG_RATIO")
#: UCX options of kvstage's context (see the module docstring); always applied
UCX_OPTIONS = {"RNDV_THRESH": "0"}
#: applied unless the environment sets them (``UCX_<name>``): the sender writes into the
#: receiver's buffer (cma, cuda_ipc, RDMA put), so every source rank copies its own bytes in
#: parallel; the default lets the receiver read, and one destination then does every writer's
#: copy itself (CPU, 4->1: bulk 4.3 GB/s vs 13.1 with put_zcopy, NIXL 12.6)
UCX_DEFAULTS = {"RNDV_SCHEME": "put_zcopy"}


def load_ucxx():
    """Import UCXX's synchronous API; returns ``(libucxx, Array)`` or raises TransportError."""
    before = {k: os.environ.get(k) for k in _UCXX_ENV}
    try:
        import ucxx._lib.libucxx as api
        from ucxx._lib.arr import Array
    except ImportError as e:
        raise TransportError(
            f"transport=ucx needs UCXX, which is not importable ({e}). Install it with "
            "`pip install ucxx-cu13` (CUDA 13 or CPU-only) or `pip install ucxx-cu12` (CUDA 12)."
        ) from e
    finally:
        # ``import ucxx`` writes UCX_* variables into os.environ for every UCX in this
        # process (NIXL's too); UCX 1.21 does not know UCX_MEMTYPE_CACHE and warns.
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return api, Array


def ucx_version() -> str:
    api, _ = load_ucxx()
    return ".".join(map(str, api.get_ucx_version()))


class _CudaSpan:
    """``length`` bytes of device memory at ``addr``, for UCXX's ``Array``."""

    def __init__(self, addr: int, length: int):
        self.__cuda_array_interface__ = {"shape": (length,), "typestr": "|u1", "data": (addr, False),
                                         "strides": None, "version": 3}


def _span_buffer(addr: int, length: int, device: str):
    if device == "cuda":
        return _CudaSpan(addr, length)
    return (ctypes.c_uint8 * length).from_address(addr)


class _Expected:
    __slots__ = ("peer", "base", "count", "requests", "buffers")

    def __init__(self, peer, base, count, requests, buffers):
        self.peer, self.base, self.count, self.requests, self.buffers = peer, base, count, requests, buffers


class _Write:
    __slots__ = ("peer", "requests", "buffers", "failed", "__weakref__")

    def __init__(self, peer, requests, buffers):
        self.peer, self.requests, self.buffers, self.failed = peer, requests, buffers, None


def _error_of(request) -> str | None:
    try:
        request.check_error()
    except Exception as e:  # UCXX raises its own exception types
        return f"{type(e).__name__}: {e}"
    return None


#: UCX's peer-failure handling on endpoints stays off: with it UCX 1.21 moves host-to-host bytes of one
#: host over tcp/lo (about 7x slower) and may finish a send eagerly before the bytes landed, which the
#: protocol's completion relies on; without it ``disconnect`` (called when a peer's control connection
#: closes) fails a dead peer's writes, which is all kvstage needs
ERROR_HANDLING = False


class UcxTransport(Transport):
    name = "ucx"
    one_sided = False

    def __init__(self, label: str = "kvstage"):
        self._api, self._Array = load_ucxx()
        api = self._api
        self._id = f"{label}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            options = {k: v for k, v in UCX_DEFAULTS.items() if f"UCX_{k}" not in os.environ} | UCX_OPTIONS
            self._ctx = api.UCXContext(options, feature_flags=(api.Feature.TAG,))
            self._worker = api.UCXWorker(self._ctx, enable_delayed_submission=False, enable_python_future=False)
        except Exception as e:
            raise TransportError(f"UCX context/worker for {self._id} failed to start: {type(e).__name__}: {e}") from e
        self._address = self._worker.address.tobytes()
        self._eps: dict[str, object] = {}
        self._registered: list = []
        self._cuda_devices: set[int] = set()
        self._thread_cuda = threading.local()
        self._next_tag = random.randrange(1, 1 << 40)
        self._expected: dict[int, _Expected] = {}
        self._held: list[tuple[str, int, int, bytes]] = []  # (sender, base, count, notification)
        self._discards: list = []  # (request, 1-byte buffer) receiving stray messages
        self._writes: dict[str, weakref.WeakSet] = {}  # peer -> its writes not yet released
        self._orphans: list = []  # buffers of writes failed while UCX still held them
        self._closed_eps: list = []  # endpoints closed by disconnect, kept alive until close()
        self._notif = [self._post_notif(bytearray(_NOTIF_MAX)) for _ in range(_NOTIF_POSTED)]

    # -- helpers ---------------------------------------------------------------
    def _post_notif(self, buf: bytearray):
        return buf, self._worker.tag_recv(self._Array(buf), self._api.UCXXTag(_NOTIF_TAG))

    def _cuda_current(self, device_id: int) -> None:
        """UCX's CUDA transports work in the calling thread's CUDA context."""
        done = getattr(self._thread_cuda, "devices", None)
        if done is None:
            done = self._thread_cuda.devices = set()
        if device_id not in done:
            import torch

            torch.cuda.set_device(device_id)
            done.add(device_id)

    def _buffers(self, spans: Spans) -> list:
        kind, device_id = spans.device
        if kind == "cuda":
            self._cuda_current(device_id)
        addrs = spans.addresses()
        return [_span_buffer(int(a), int(n), kind) for a, n in zip(addrs, spans.lengths)]

    def _progress(self) -> None:
        self._worker.progress()

    def facts(self) -> dict:
        """What UCXX says about the UCX it runs (the probe's facts, replacing NIXL's bundled UCX)."""
        import glob
        import re

        from kvstage.link.finding import fact

        out = {"ucx_version": fact(".".join(map(str, self._api.get_ucx_version())), "queried",
                                   "ucxx get_ucx_version() (the libucp UCXX loaded)")}
        try:
            info = self._ctx.info
            tls = sorted({r.split()[-1].split("/")[0] for r in re.findall(r"^#.*resource.*md.*dev.*flags.*$", info, re.M)})
            out["ucx_transports"] = fact(tls, "queried", "resources of this transport's UCX context (as ucxx.get_active_transports)")
        except Exception as e:  # an introspection failure is a fact too
            out["ucx_transports"] = fact(None, "queried", f"UCX context info unreadable: {e}")
        try:
            import libucx

            folder = os.path.join(os.path.dirname(libucx.__file__), "lib", "ucx")
            names = sorted({re.sub(r"\.so.*$", "", os.path.basename(p))[len("libuct_"):]
                            for p in glob.glob(os.path.join(folder, "libuct_*.so*"))})
            out["ucx_modules"] = fact(names, "queried", "libuct_*.so in the UCX modules folder of the libucx wheel UCXX loads")
        except ImportError:
            out["ucx_modules"] = fact(None, "queried", "no libucx wheel (UCXX uses a system UCX)")
        return out

    # -- the contract ------------------------------------------------------------
    def register(self, tensor) -> Region:
        if not tensor.is_contiguous():
            raise TransportError("register: tensor must be contiguous")
        device = "cuda" if tensor.is_cuda else "cpu"
        device_id = (tensor.device.index or 0) if tensor.is_cuda else 0
        if tensor.is_cuda:
            self._cuda_devices.add(device_id)
            self._cuda_current(device_id)
        # UCX registers (and caches) memory on first use; keeping the tensor alive is our part
        self._registered.append(tensor)
        return Region(tensor.data_ptr(), tensor.nbytes, device, device_id)

    def metadata(self) -> bytes:
        ident = self._id.encode()
        return _MD_MAGIC + _U16.pack(len(ident)) + ident + self._address

    def connect(self, peer_metadata: bytes) -> str:
        md = bytes(peer_metadata)
        if not md.startswith(_MD_MAGIC):
            raise TransportError(
                "ucx: the peer's metadata is not from a kvstage UCX transport (is the peer running "
                "transport=nixl? both sides must use the same KVSTAGE_TRANSPORT)"
            )
        at = len(_MD_MAGIC)
        (n,) = _U16.unpack_from(md, at)
        peer = md[at + 2 : at + 2 + n].decode()
        address = md[at + 2 + n :]
        if peer in self._eps:
            return peer
        try:
            addr = self._api.UCXAddress.create_from_buffer(bytearray(address))
            self._eps[peer] = self._worker.create_endpoint_from_worker_address(addr, ERROR_HANDLING)
        except Exception as e:
            raise TransportError(f"ucx: could not reach peer {peer} from its worker address: {type(e).__name__}: {e}") from e
        return peer

    def disconnect(self, peer: str) -> None:
        for w in self._writes.pop(peer, ()):  # without UCX error handling nothing else ever ends them
            if not all(r.completed for r in w.requests):
                w.failed = f"peer {peer} disconnected before the write completed"
        ep = self._eps.pop(peer, None)
        if ep is not None:
            # non-blocking: a blocking close of an endpoint whose peer died crashed UCXX 0.52 (segfault);
            # the endpoint object lives until the worker goes, so the close never outlives it
            try:
                ep.close()
            except Exception as e:  # already gone is fine
                log.debug("ucx: closing the endpoint to %s: %s", peer, e)
            self._closed_eps.append(ep)

    @property
    def id(self) -> str:
        return self._id

    def expect(self, peer: str, spans: Spans) -> bytes:
        try:
            spans.check("expected spans")
        except ValueError as e:
            raise TransportError(f"ucx expect from {peer}: {e}") from e
        n = len(spans)
        base = self._next_tag
        self._next_tag += n
        if self._next_tag >= 1 << 62:
            raise TransportError("ucx: receive tags exhausted (2**62 receives posted by this process)")
        buffers = self._buffers(spans)
        tag = self._api.UCXXTag
        try:
            requests = [self._worker.tag_recv(self._Array(b), tag(base + i)) for i, b in enumerate(buffers)]
        except Exception as e:
            raise TransportError(f"ucx: posting {n} receives for {peer} failed: {type(e).__name__}: {e}") from e
        self._expected[base] = _Expected(peer, base, n, requests, buffers)
        return _TICKET.pack(base, n)

    def write(self, peer, local, remote, notification, ticket=b""):
        try:
            Spans.check_pair(local, remote)
        except ValueError as e:
            raise TransportError(f"ucx write to {peer}: {e}") from e
        if len(ticket) != _TICKET.size:
            raise TransportError(
                f"ucx write to {peer}: ticket={bytes(ticket)!r} is not a ticket from the receiver's expect(); "
                "UCX is two-sided, the receiver must post receives for these spans first"
            )
        base, count = _TICKET.unpack(ticket)
        if count != len(local):
            raise TransportError(f"ucx write to {peer}: {len(local)} spans, but the receiver expects {count}")
        ep = self._eps.get(peer)
        if ep is None:
            raise TransportError(f"ucx write to {peer}: peer not connected")
        ident = self._id.encode()
        total = _HEAD.size + len(ident) + len(notification)
        if total > _NOTIF_MAX:
            raise TransportError(f"ucx write to {peer}: notification of {len(notification)} bytes exceeds "
                                 f"{_NOTIF_MAX - _HEAD.size - len(ident)} bytes")
        note = bytearray(_HEAD.pack(_NOTIF_MAGIC, total, bytes(ticket), len(ident)) + ident + bytes(notification))
        buffers = self._buffers(local) + [note]
        tag = self._api.UCXXTag
        try:
            requests = [ep.tag_send(self._Array(b), tag(base + i)) for i, b in enumerate(buffers[:-1])]
            requests.append(ep.tag_send(self._Array(note), tag(_NOTIF_TAG)))
        except Exception as e:
            raise TransportError(f"ucx write to {peer} could not be posted: {type(e).__name__}: {e}") from e
        w = _Write(peer, requests, buffers)
        self._writes.setdefault(peer, weakref.WeakSet()).add(w)
        return w

    def prepare(self, peer, spans):
        try:
            spans.check("prepared spans")
        except ValueError as e:
            raise TransportError(f"ucx could not prepare {len(spans)} spans for {peer or 'local'}: {e}") from e
        return spans

    def write_prepared(self, peer, local, local_index, remote, remote_index, notification, ticket=b""):
        def pick(s: Spans, idx) -> Spans:
            idx = np.asarray(idx, dtype=np.int64)
            return Spans(s.regions, s.index[idx], s.offsets[idx], s.lengths[idx])

        return self.write(peer, pick(local, local_index), pick(remote, remote_index), notification, ticket)

    def poll(self, handle) -> WriteState:
        if handle.failed:
            raise TransportError(f"UCX write to {handle.peer} failed: {handle.failed}")
        self._progress()
        if not all(r.completed for r in handle.requests):
            return WriteState.PENDING
        for r in handle.requests:
            err = _error_of(r)
            if err:
                raise TransportError(f"UCX write to {handle.peer} failed: {err}")
        return WriteState.DONE

    def release(self, handle) -> None:
        self._writes.get(handle.peer, set()).discard(handle)
        if handle.failed:  # UCX may still hold the buffers: keep them alive with the transport
            self._orphans.append(handle.buffers)
        handle.requests, handle.buffers = [], []

    def notifications(self):
        self._progress()
        for i, (buf, req) in enumerate(self._notif):
            if not req.completed:
                continue
            err = _error_of(req)
            if err:
                log.warning("ucx: a notification message was lost: %s", err)
            else:
                self._take_notif(buf)
            self._notif[i] = self._post_notif(buf)
        self._discards = [(r, b) for r, b in self._discards if not r.completed]
        out, still = [], []
        for sender, base, count, note in self._held:
            exp = self._expected.get(base)
            if exp is None or exp.peer != sender or exp.count != count:
                log.warning("ucx: notification from %s names ticket (%d, %d), which this side did not issue to it; "
                            "dropped%s", sender, base, count, "" if exp else ", its bytes are discarded")
                if exp is None:
                    self._discard(base, count)
                continue
            if not all(r.completed for r in exp.requests):
                still.append((sender, base, count, note))
                continue
            del self._expected[base]
            errors = [e for e in map(_error_of, exp.requests) if e]
            if errors:
                log.warning("ucx: a write from %s into %d expected spans failed (%s); its notification is dropped",
                            sender, count, errors[0])
                continue
            out.append((sender, note))
        self._held = still
        return out

    def _discard(self, base: int, count: int) -> None:
        """Receive a stray write's messages into one byte each (UCX ends them truncated): an unmatched
        message would otherwise stay queued, and UCXX's worker destructor waits for it forever."""
        for i in range(min(count, _MAX_DISCARD)):
            buf = bytearray(1)
            self._discards.append((self._worker.tag_recv(self._Array(buf), self._api.UCXXTag(base + i)), buf))

    def _take_notif(self, buf: bytearray) -> None:
        try:
            magic, total, ticket, n = _HEAD.unpack_from(buf, 0)
            if magic != _NOTIF_MAGIC or not _HEAD.size + n <= total <= _NOTIF_MAX:
                raise ValueError("bad header")
            sender = bytes(buf[_HEAD.size : _HEAD.size + n]).decode()
            note = bytes(buf[_HEAD.size + n : total])
            base, count = _TICKET.unpack(ticket)
        except (ValueError, struct.error, UnicodeDecodeError) as e:
            log.warning("ucx: dropped a malformed notification message: %s", e)
            return
        self._held.append((sender, base, count, note))

    def close(self) -> None:
        if getattr(self, "_worker", None) is None:
            return
        try:
            self._worker.cancel_inflight_requests()
        except Exception as e:
            log.debug("ucx: cancelling requests: %s", e)
        for peer in list(self._eps):
            self.disconnect(peer)
        for _ in range(10):
            self._progress()
        self._closed_eps.clear()
        self._expected.clear()
        self._held.clear()
        self._discards.clear()
        self._notif = []
        self._registered.clear()
        # Destroy worker and context now, while the interpreter is whole.
        worker, ctx, self._worker, self._ctx = self._worker, self._ctx, None, None
        del worker, ctx
        gc.collect()
