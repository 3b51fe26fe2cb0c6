"""UCX transport through UCXX: two-sided tag messages behind the transport contract.

UCXX (``ucxx-cu13``/``ucxx-cu12``) is the maintained Python API over UCX; its
predecessor ucx-py is archived. kvstage uses UCXX's synchronous layer
(``ucxx._lib.libucxx``: context, worker, endpoints from worker addresses, tag
send/receive, ``worker.progress()``) and drives progress from the endpoint's
own loop thread, like NIXL: no progress thread, no asyncio.

Two-sided, so a byte moves only where both sides posted the matching message:

- a write: the receiver calls ``expect(peer, spans)`` when it grants memory;
  that posts one tag receive per span, with tags ``base .. base+n-1`` from a
  counter that never repeats in this process, and returns the ticket
  ``(base, n)``; the writer's ``write(..., ticket)`` sends span ``i`` with tag
  ``base+i``, then a notification message (tag ``_NOTIF_TAG``) naming the
  ticket and the writer, which the receiver hands out of ``notifications()``
  only once every receive of that ticket has completed (it arrives after the
  bytes, as with NIXL);
- a read, the same reversed: the source's ``offer(peer, spans)`` posts one tag
  send per span, tags from the same counter marked ``_OFFER_BIT`` and carrying
  this endpoint's random offer key (in its metadata: a reader refuses a ticket
  without its source's key, and two sources' offers share no tag unless their
  keys and counters both collide), and returns the ticket; the reader's
  ``read(..., ticket)`` posts the matching receives into its spans.

Tags never repeat, so a stale message can never match a later receive. The UCX
context runs with ``RNDV_THRESH=0`` (every message uses the rendezvous
protocol): a send then completes only once the receiver matched it and the
bytes moved, so a completed write means landed bytes, as it does with NIXL,
and the protocol's "no write of mine is in flight" (abort_ack) stays true.

``RNDV_SCHEME=get_zcopy`` (unless ``UCX_RNDV_SCHEME`` is set): the receiver
fetches each message's bytes from the sender's memory (cma, cuda_ipc, RDMA
get) once it matched the sender's rendezvous request, so a read completes
while the source's process is stopped or busy; its progress only completes
the offer's handle. ``put_zcopy`` (the sender writes, as NIXL's writers do)
needs the sender's process for every byte. Writes work the same under
get_zcopy, with the receiver now doing every writer's copy. Two conditions
for a stopped source: its endpoint resolved the peer's once (``connect`` sends
a hello message for that: a first rendezvous otherwise waits for a wireup
reply the stopped process never reads), and every rendezvous request of the
offer left this process, which a shared-memory receive FIFO caps at its size:
``MM_FIFO_SIZE`` below (UCX's default, 256, held 254 requests; the rest wait
in this side's queue for its next progress).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import random
import struct
import threading
import time
import uuid
import weakref
from typing import Any

from kvstage.errors import TransportError
from kvstage.transports.base import Region, Spans, Transport, WriteState

log = logging.getLogger(__name__)

_MD_MAGIC = b"KVSTAGE-UCX2\n"
_NOTIF_MAGIC = b"KVN1"
_HELLO_MAGIC = b"KVH1"  # a notification message that only resolves the endpoint (``connect``)
_NOTIF_TAG = (1 << 63) | 0x4B5653  # data tags stay below 1 << 62
_TAG_BITS = 41  # counter bits of a data tag: expect's tags are the counter itself
_OFFER_BIT = 1 << 62  # offer tags: this bit, the offering endpoint's key, the counter
_KEY_BITS = 62 - _TAG_BITS
_NOTIF_MAX = 4096  # bytes of one notification message, header included
_NOTIF_POSTED = 16  # notification receives kept posted
#: how long ``close`` progresses this side's open sends to live peers (hellos, offers, writes) before
#: closing their endpoints: closing one over an open rendezvous makes UCX 1.21 abort it, and that abort
#: crashed the process (SIGSEGV invalidating the send's memory registration)
CLOSE_DRAIN_S = 0.5
_MAX_DISCARD = 1 << 16  # messages of one stray write received and thrown away
_TICKET = struct.Struct("!QI")  # first tag, number of spans
_HEAD = struct.Struct("!4sI12sH")  # magic, total length, ticket, sender id length
_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
#: environment variables ``import ucxx`` sets for Dask-style use; kvstage puts back what was there
_UCXX_ENV = ("UCX_MEMTYPE_CACHE", "UCX_RNDV_THRESH", "UCX_RNDV_FRAG_MEM_TYPE", "UCX_CUDA_COPY_MAX_REG_RATIO")
#: UCX options of kvstage's context (see the module docstring); always applied
UCX_OPTIONS = {"RNDV_THRESH": "0"}
#: applied unless the environment sets them (``UCX_<name>``): the receiver fetches the bytes (reads
#: complete while the source is stopped); a shared-memory receive FIFO holds the rendezvous requests
#: of an offer of that many spans (128 bytes each, per interface); and the shared-memory transports
#: claim what UCX's error handling asks of them (``ERROR_HANDLING``): posix/sysv the support UCX 1.21
#: keeps off by default (their keepalive checks the peer's pid), cma the memory invalidation it asks
#: of a rendezvous lane (a dead peer's process holds nothing that could be written later)
UCX_DEFAULTS = {
    "RNDV_SCHEME": "get_zcopy",
    "MM_FIFO_SIZE": "8192",
    "MM_ERROR_HANDLING": "y",
    "CMA_MEMORY_INVALIDATE": "y",
}
#: added to ``UCX_DEFAULTS`` where this process sees a GPU (UCX refuses an option of a component it did
#: not load): cuda_ipc's get, which UCX turns off where it sees no NVLink (one GPU, PCIe), so a fetch
#: of device memory on one host would go over tcp (``nixl.UCX_ENGINE_CONFIG``)
UCX_CUDA_DEFAULTS = {"CUDA_IPC_ENABLE_GET_ZCOPY": "on"}


def _defaults() -> dict:
    import torch

    return UCX_DEFAULTS | (UCX_CUDA_DEFAULTS if torch.cuda.is_available() else {})


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
        self.__cuda_array_interface__ = {
            "shape": (length,),
            "typestr": "|u1",
            "data": (addr, False),
            "strides": None,
            "version": 3,
        }


def _span_buffer(addr: int, length: int, device: str):
    if device == "cuda":
        return _CudaSpan(addr, length)
    return (ctypes.c_uint8 * length).from_address(addr)


class _Expected:
    __slots__ = ("peer", "base", "count", "requests", "buffers")

    def __init__(self, peer, base, count, requests, buffers):
        self.peer, self.base, self.count, self.requests, self.buffers = peer, base, count, requests, buffers


class _Transfer:
    """A write, an offer or a read: its requests, and the buffers UCX reads or fills until they end."""

    __slots__ = ("peer", "what", "requests", "buffers", "failed", "__weakref__")

    def __init__(self, peer, what, requests, buffers):
        self.peer, self.what, self.requests, self.buffers, self.failed = peer, what, requests, buffers, None


def _error_of(request) -> str | None:
    try:
        request.check_error()
    except Exception as e:  # UCXX raises its own exception types
        return f"{type(e).__name__}: {e}"
    return None


def _canceller():
    """UCXX 0.52's Python requests have no ``cancel``; its C++ ``ucxx::Request::cancel`` (exported by
    libucxx, which ``import ucxx`` loaded) calls ``ucp_request_cancel``, which ends a tag receive that
    no message has matched yet (and nothing else). None where the symbol is not there."""
    try:
        fn = ctypes.CDLL("libucxx.so")._ZN4ucxx7Request6cancelEv
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = None, [ctypes.c_void_p]
    return fn


#: UCX's peer-failure handling on endpoints is on: without it a receiver fetching from a process that
#: died (cma's process_vm_readv failing with ESRCH) is aborted by UCX, and with get_zcopy every read and
#: write fetches. UCX 1.21 uses cma and shared memory with it only given ``UCX_DEFAULTS``' last two;
#: without them it moved host bytes over tcp/lo (about 7x slower), eagerly, a send done before the
#: bytes landed
ERROR_HANDLING = True


class UcxTransport(Transport["_Transfer"]):
    name = "ucx"
    one_sided = False
    reads_offered = True
    #: one rendezvous message per span: ~9-12 us each on the CPU machine (512 B and 4 KiB alike); on CUDA
    #: not measured, charged NIXL's 12 us per cuda_ipc descriptor as the least it can be
    read_span_cost_s = {"cuda": 12e-6, "cpu": 10e-6}

    def __init__(self, label: str = "kvstage"):
        self._api, self._Array = load_ucxx()
        api = self._api
        self._id = f"{label}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            options = {k: v for k, v in _defaults().items() if f"UCX_{k}" not in os.environ} | UCX_OPTIONS
            self._ctx = api.UCXContext(options, feature_flags=(api.Feature.TAG,))
            self._worker = api.UCXWorker(self._ctx, enable_delayed_submission=False, enable_python_future=False)
        except Exception as e:
            raise TransportError(f"UCX context/worker for {self._id} failed to start: {type(e).__name__}: {e}") from e
        self._address = self._worker.address.tobytes()
        self._eps: dict[str, Any] = {}  # peer -> its ucxx Endpoint
        self._registered: list = []
        self._cuda_devices: set[int] = set()
        self._thread_cuda = threading.local()
        self._next_tag = random.randrange(1, 1 << (_TAG_BITS - 2))
        self._offer_key = random.randrange(1 << _KEY_BITS)
        self._peer_keys: dict[str, int] = {}  # peer -> the key its offers' tags carry
        self._hellos: list = []  # (request, buffer) of each connect's hello until it completed
        self._cancel = _canceller()
        self._expected: dict[int, _Expected] = {}
        self._held: list[tuple[str, int, int, bytes]] = []  # (sender, base, count, notification)
        self._discards: list = []  # (request, 1-byte buffer) receiving stray messages
        self._transfers: dict[str, weakref.WeakSet] = {}  # peer -> its writes, offers, reads not yet released
        self._orphans: list = []  # buffers of transfers failed while UCX still held them
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
        return [_span_buffer(int(a), int(n), kind) for a, n in zip(addrs, spans.lengths, strict=True)]

    def _progress(self) -> None:
        self._worker.progress()

    def facts(self) -> dict:
        """What UCXX says about the UCX it runs (the probe's facts, replacing NIXL's bundled UCX)."""
        import glob
        import re

        from kvstage.link.finding import fact

        out = {
            "ucx_version": fact(
                ".".join(map(str, self._api.get_ucx_version())),
                "queried",
                "ucxx get_ucx_version() (the libucp UCXX loaded)",
            )
        }
        try:
            info = self._ctx.info
            tls = sorted(
                {r.split()[-1].split("/")[0] for r in re.findall(r"^#.*resource.*md.*dev.*flags.*$", info, re.M)}
            )
            out["ucx_transports"] = fact(
                tls, "queried", "resources of this transport's UCX context (as ucxx.get_active_transports)"
            )
        except Exception as e:  # an introspection failure is a fact too
            out["ucx_transports"] = fact(None, "queried", f"UCX context info unreadable: {e}")
        try:
            import libucx

            folder = os.path.join(os.path.dirname(libucx.__file__), "lib", "ucx")
            names = sorted(
                {
                    re.sub(r"\.so.*$", "", os.path.basename(p))[len("libuct_") :]
                    for p in glob.glob(os.path.join(folder, "libuct_*.so*"))
                }
            )
            out["ucx_modules"] = fact(
                names, "queried", "libuct_*.so in the UCX modules folder of the libucx wheel UCXX loads"
            )
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
        return _MD_MAGIC + _U16.pack(len(ident)) + ident + _U32.pack(self._offer_key) + self._address

    def connect(self, peer_metadata: bytes) -> str:
        md = bytes(peer_metadata)
        if not md.startswith(_MD_MAGIC):
            raise TransportError(
                "ucx: the peer's metadata is not from a kvstage UCX transport of this version (is the peer "
                "running transport=nixl? both sides must use the same KVSTAGE_TRANSPORT)"
            )
        at = len(_MD_MAGIC)
        (n,) = _U16.unpack_from(md, at)
        peer = md[at + 2 : at + 2 + n].decode()
        (key,) = _U32.unpack_from(md, at + 2 + n)
        address = md[at + 6 + n :]
        if peer in self._eps:
            return peer
        try:
            addr = self._api.UCXAddress.create_from_buffer(bytearray(address))
            ep = self._worker.create_endpoint_from_worker_address(addr, ERROR_HANDLING)
        except Exception as e:
            raise TransportError(
                f"ucx: could not reach peer {peer} from its worker address: {type(e).__name__}: {e}"
            ) from e
        self._eps[peer], self._peer_keys[peer] = ep, key
        self._hello(peer, ep)
        return peer

    def _hello(self, peer: str, ep) -> None:
        """A small message the peer's notification receives take and drop: its rendezvous makes UCX
        resolve the peer's endpoint now, while both processes run, so that no later offer waits on it."""
        ident = self._id.encode()
        total = _HEAD.size + len(ident)
        buf = bytearray(_HEAD.pack(_HELLO_MAGIC, total, bytes(_TICKET.size), len(ident)) + ident)
        try:
            self._hellos.append((ep.tag_send(self._Array(buf), self._api.UCXXTag(_NOTIF_TAG)), buf))
        except Exception as e:  # the first offer or write then resolves it
            log.debug("ucx: hello to %s not sent: %s", peer, e)

    def disconnect(self, peer: str) -> None:
        for t in self._transfers.pop(peer, ()):  # a live peer's never end, nor a read's receives ever
            if not all(r.completed for r in t.requests):
                if t.what == "read from":
                    self._cancel_receives(t)
                t.failed = f"peer {peer} disconnected before the {t.what.split()[0]} completed"
        self._peer_keys.pop(peer, None)
        ep = self._eps.pop(peer, None)
        if ep is not None:
            # non-blocking: a blocking close of an endpoint whose peer died crashed UCXX 0.52 (segfault);
            # the endpoint object lives until the worker goes, so the close never outlives it
            try:
                if ep.alive:  # a failed endpoint's close() returns a null request that segfaults when freed
                    ep.close()
            except Exception as e:  # already gone is fine
                log.debug("ucx: closing the endpoint to %s: %s", peer, e)
            self._closed_eps.append(ep)

    @property
    def id(self) -> str:
        return self._id

    def _tags(self, n: int) -> int:
        """``n`` tags never used before in this process: the first of them."""
        base = self._next_tag
        if base + n >= 1 << _TAG_BITS:
            raise TransportError(f"ucx: tags exhausted (2**{_TAG_BITS} messages matched by this process)")
        self._next_tag += n
        return base

    def _track(self, t: _Transfer) -> _Transfer:
        self._transfers.setdefault(t.peer, weakref.WeakSet()).add(t)
        return t

    def expect(self, peer: str, spans: Spans) -> bytes:
        try:
            spans.check("expected spans")
        except ValueError as e:
            raise TransportError(f"ucx expect from {peer}: {e}") from e
        n = len(spans)
        base = self._tags(n)
        requests, buffers = self._receive(peer, base, spans)
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
            raise TransportError(
                f"ucx write to {peer}: notification of {len(notification)} bytes exceeds "
                f"{_NOTIF_MAX - _HEAD.size - len(ident)} bytes"
            )
        note = bytearray(_HEAD.pack(_NOTIF_MAGIC, total, bytes(ticket), len(ident)) + ident + bytes(notification))
        buffers = self._buffers(local) + [note]
        tag = self._api.UCXXTag
        try:
            requests = [ep.tag_send(self._Array(b), tag(base + i)) for i, b in enumerate(buffers[:-1])]
            requests.append(ep.tag_send(self._Array(note), tag(_NOTIF_TAG)))
        except Exception as e:
            raise TransportError(f"ucx write to {peer} could not be posted: {type(e).__name__}: {e}") from e
        return self._track(_Transfer(peer, "write to", requests, buffers))

    def offer(self, peer, local):
        try:
            local.check("offered spans")
        except ValueError as e:
            raise TransportError(f"ucx offer to {peer}: {e}") from e
        ep = self._eps.get(peer)
        if ep is None:
            raise TransportError(f"ucx offer to {peer}: peer not connected")
        n = len(local)
        base = _OFFER_BIT | (self._offer_key << _TAG_BITS) | self._tags(n)
        buffers = self._buffers(local)
        tag = self._api.UCXXTag
        try:
            requests = [ep.tag_send(self._Array(b), tag(base + i)) for i, b in enumerate(buffers)]
        except Exception as e:
            raise TransportError(f"ucx offer to {peer} could not be posted: {type(e).__name__}: {e}") from e
        return _TICKET.pack(base, n), self._track(_Transfer(peer, "offer to", requests, buffers))

    def read(self, peer, local, remote, ticket=b""):
        try:
            Spans.check_pair(local, remote)
        except ValueError as e:
            raise TransportError(f"ucx read from {peer}: {e}") from e
        key = self._peer_keys.get(peer)
        if key is None:
            raise TransportError(f"ucx read from {peer}: peer not connected")
        if len(ticket) != _TICKET.size:
            raise TransportError(
                f"ucx read from {peer}: ticket={bytes(ticket)!r} is not a ticket from the peer's offer(); "
                "UCX is two-sided, the peer must post sends of these spans first"
            )
        base, count = _TICKET.unpack(ticket)
        if not base & _OFFER_BIT or (base >> _TAG_BITS) & ((1 << _KEY_BITS) - 1) != key:
            raise TransportError(f"ucx read from {peer}: the ticket is not one of {peer}'s offers")
        if count != len(local):
            raise TransportError(f"ucx read from {peer}: {len(local)} spans, but the peer offered {count}")
        requests, buffers = self._receive(peer, base, local)
        return self._track(_Transfer(peer, "read from", requests, buffers))

    def _receive(self, peer: str, base: int, spans: Spans) -> tuple[list, list]:
        """One tag receive per span, tags ``base``, ``base + 1``, ...: (their requests, their buffers)."""
        buffers = self._buffers(spans)
        tag = self._api.UCXXTag
        try:
            requests = [self._worker.tag_recv(self._Array(b), tag(base + i)) for i, b in enumerate(buffers)]
        except Exception as e:
            raise TransportError(
                f"ucx: posting {len(buffers)} receives for {peer} failed: {type(e).__name__}: {e}"
            ) from e
        return requests, buffers

    def poll(self, handle: _Transfer) -> WriteState:
        if handle.failed:
            raise TransportError(f"UCX {handle.what} {handle.peer} failed: {handle.failed}")
        self._progress()
        if not all(r.completed for r in handle.requests):
            ep = self._eps.get(handle.peer)
            if handle.what == "read from" and ep is not None and not ep.alive:
                # UCX fails the endpoint's own sends; receives are the worker's and would wait forever
                self._cancel_receives(handle)
                handle.failed = f"UCX found peer {handle.peer} gone"
                raise TransportError(f"UCX read from {handle.peer} failed: {handle.failed}")
            return WriteState.PENDING
        for r in handle.requests:
            err = _error_of(r)
            if err:
                raise TransportError(f"UCX {handle.what} {handle.peer} failed: {err}")
        return WriteState.DONE

    def abandon(self, handle: _Transfer) -> bool:
        """A read's receives that no message matched yet are cancelled (nothing can land in them
        later); matched ones are fetching and end by themselves. An offer's sends cannot be
        cancelled (UCX cancels receives only): it ends when the reader took it, or fails at
        ``disconnect``, after which a live reader holding its ticket could still take the bytes."""
        self._progress()
        if handle.what == "read from":
            self._cancel_receives(handle)
        return all(r.completed for r in handle.requests)

    def _cancel_receives(self, t: _Transfer) -> None:
        if self._cancel is None:
            return
        for r in t.requests:
            if not r.completed:
                self._cancel(r.ucxx_ptr)
        self._progress()  # cancelled receives complete (UCS_ERR_CANCELED) in the next progress

    def release(self, handle: _Transfer) -> None:
        self._transfers.get(handle.peer, set()).discard(handle)
        if not all(r.completed for r in handle.requests):  # UCX may still hold the buffers: keep them alive
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
        self._hellos = [(r, b) for r, b in self._hellos if not r.completed]
        out, still = [], []
        for sender, base, count, note in self._held:
            exp = self._expected.get(base)
            if exp is None or exp.peer != sender or exp.count != count:
                log.warning(
                    "ucx: notification from %s names ticket (%d, %d), which this side did not issue to it; dropped%s",
                    sender,
                    base,
                    count,
                    "" if exp else ", its bytes are discarded",
                )
                if exp is None:
                    self._discard(base, count)
                continue
            if not all(r.completed for r in exp.requests):
                still.append((sender, base, count, note))
                continue
            del self._expected[base]
            errors = [e for e in map(_error_of, exp.requests) if e]
            if errors:
                log.warning(
                    "ucx: a write from %s into %d expected spans failed (%s); its notification is dropped",
                    sender,
                    count,
                    errors[0],
                )
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
            if magic not in (_NOTIF_MAGIC, _HELLO_MAGIC) or not _HEAD.size + n <= total <= _NOTIF_MAX:
                raise ValueError("bad header")
            if magic == _HELLO_MAGIC:  # its work was done when UCX matched it
                return
            sender = bytes(buf[_HEAD.size : _HEAD.size + n]).decode()
            note = bytes(buf[_HEAD.size + n : total])
            base, count = _TICKET.unpack(ticket)
        except (ValueError, struct.error, UnicodeDecodeError) as e:
            log.warning("ucx: dropped a malformed notification message: %s", e)
            return
        self._held.append((sender, base, count, note))

    def _drain_sends(self) -> None:
        """Progress (taking notifications, so peers' hellos to this side end too) until no send to a live
        peer is open, or ``CLOSE_DRAIN_S`` passed."""

        def open_sends() -> bool:
            live = {p for p, ep in self._eps.items() if ep.alive}
            hellos = any(not r.completed for r, _ in self._hellos)
            return hellos or any(
                not r.completed
                for p in live
                for t in self._transfers.get(p, ())
                if t.what != "read from"
                for r in t.requests
            )

        deadline = time.monotonic() + CLOSE_DRAIN_S
        while open_sends() and time.monotonic() < deadline:
            self.notifications()
            time.sleep(0.001)

    def close(self) -> None:
        if getattr(self, "_worker", None) is None:
            return
        self._drain_sends()
        try:
            self._worker.cancel_inflight_requests()
        except Exception as e:
            log.debug("ucx: cancelling requests: %s", e)
        for peer in list(self._eps):
            self.disconnect(peer)
        for _ in range(10):
            self._progress()
        self._closed_eps.clear()
        self._hellos.clear()
        self._expected.clear()
        self._held.clear()
        self._discards.clear()
        self._notif = []
        self._registered.clear()
        # Destroy worker and context now, while the interpreter is whole.
        worker, ctx, self._worker, self._ctx = self._worker, self._ctx, None, None
        del worker, ctx
        gc.collect()
