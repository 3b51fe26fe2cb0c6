"""Same-host transport over cross-memory attach (``process_vm_readv``/``process_vm_writev``).

Why it exists: a NIXL transfer posts one UCX request per descriptor (~3 µs each
on the CPU machine), so a list of page rows costs far more than one span of
the same bytes. ``process_vm_readv``/``writev`` take up to ``IOV_MAX`` spans a
side in one system call and walk them at about the speed of one contiguous
copy: UCX's ``cma`` transport makes the same calls, one span at a time. Here a
read or a write of any span list is a few calls, so a reader can take a
source's page rows as they lie.

A read needs nothing from the peer's process: the kernel copies out of its
memory while it runs, sleeps or is stopped (SIGSTOP); the peer's metadata
names its pid and the regions it registered, and nothing else is read.

What it asks of the host: both processes on one kernel, in one PID and one
network namespace (notifications go over an abstract Unix socket), and each
allowed to ptrace the other (same user; under Yama's ptrace_scope 1 an
endpoint of this transport allows any process of its user, and says so).
Host memory only. A read or a write is complete when its call returns; a
write's notification is sent after the last byte landed, on a stream the
writer opened at ``connect`` (datagrams would do, but Linux queues only
``max_dgram_qlen``, often 10, of them). The receiver accepts a stream only
from a process of its own user, and its first frame, the writer's id, must
name that process (the kernel says who connected).
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import select
import socket
import struct
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from kvstage.errors import TransportError
from kvstage.transports.base import ReadyWrite, Region, Spans, Transport, WriteState

log = logging.getLogger(__name__)

IOV_MAX = 1024  # Linux UIO_MAXIOV: spans per side in one process_vm_readv/writev call
#: threads a reader's process_vm_readv calls run on: one per core, at most four (a destination reads every
#: source rank's pieces itself; on the 2-core CPU machine two threads read 4 -> 1 in about half the time of one)
READ_THREADS = max(1, min(4, os.cpu_count() or 1))
MAX_CALL_BYTES = 1 << 30  # per call: Linux moves at most MAX_RW_COUNT (2 GiB - 4 KiB) and says so only by a short count
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1)
_MAX_NOTIFICATION = 1 << 16  # bytes of one notification (a notice is ~100)
_SEND_TIMEOUT_S = 5.0  # a receiver that reads no notification this long is stuck
_FORMAT = 1

_libc = ctypes.CDLL(None, use_errno=True)
_writev, _readv = _libc.process_vm_writev, _libc.process_vm_readv
for _call in (_writev, _readv):
    _call.restype = ctypes.c_ssize_t
    _call.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
_WHY = {
    errno.ESRCH: "its process has exited",
    errno.EPERM: "not allowed into its memory (another user, or Yama ptrace_scope 2-3)",
    errno.EFAULT: "a span is not mapped on one side",
}


def _host_identity() -> dict:
    """What two processes must share for this transport: the kernel (boot id), namespaces, user."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return {
        "boot_id": boot,
        "pid_ns": os.stat("/proc/self/ns/pid").st_ino,
        "net_ns": os.stat("/proc/self/ns/net").st_ino,
        "uid": os.getuid(),
    }


def _yama_scope() -> int | None:
    """Yama's ptrace_scope, or None where Yama is not loaded."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _runs(addr: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per span: True where it starts a new run (it does not continue the one before in memory)."""
    new = np.ones(len(addr), dtype=bool)
    new[1:] = addr[1:] != addr[:-1] + lengths[:-1].astype(np.uint64)
    return new


def _iovecs(addr: np.ndarray, lengths: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Adjacent spans merged into ``struct iovec`` rows (base, length)."""
    starts = np.flatnonzero(new)
    iov = np.empty((len(starts), 2), dtype=np.uint64)
    iov[:, 0] = addr[starts]
    iov[:, 1] = np.add.reduceat(lengths.astype(np.uint64), starts)
    return iov


def _split_long(la: np.ndarray, ra: np.ndarray, ln: np.ndarray):
    """Spans longer than ``MAX_CALL_BYTES`` cut into pieces of at most that."""
    k = -(-ln // MAX_CALL_BYTES)
    if len(k) == 0 or k.max() <= 1:
        return la, ra, ln
    idx = np.repeat(np.arange(len(ln)), k)
    off = (np.arange(len(idx)) - np.repeat(np.cumsum(k) - k, k)) * MAX_CALL_BYTES
    return la[idx] + off.astype(np.uint64), ra[idx] + off.astype(np.uint64), np.minimum(ln[idx] - off, MAX_CALL_BYTES)


def plan_calls(local_addr, remote_addr, lengths) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """The system calls that copy between span ``i`` of ``local_addr`` and span ``i`` of ``remote_addr``:
    ``(local iovecs, remote iovecs, bytes)`` each, adjacent spans merged, at most ``IOV_MAX`` a side
    and ``MAX_CALL_BYTES`` a call."""
    la, ra, ln = _split_long(
        np.asarray(local_addr, dtype=np.uint64),
        np.asarray(remote_addr, dtype=np.uint64),
        np.asarray(lengths, dtype=np.int64),
    )
    nl, nr = _runs(la, ln), _runs(ra, ln)
    cl, cr = np.cumsum(nl), np.cumsum(nr)  # runs started up to and including span i, per side
    cb = np.cumsum(ln)  # bytes up to and including span i
    calls, s = [], 0
    while s < len(ln):
        # the call from span s ends before either side would start its (IOV_MAX+1)-th run, or pass the byte cap
        e = int(
            min(
                np.searchsorted(cl, cl[s] - 1 + IOV_MAX, side="right"),
                np.searchsorted(cr, cr[s] - 1 + IOV_MAX, side="right"),
                np.searchsorted(cb, cb[s] - ln[s] + MAX_CALL_BYTES, side="right"),
            )
        )
        first_l, first_r = nl[s:e].copy(), nr[s:e].copy()
        first_l[0] = first_r[0] = True
        calls.append((_iovecs(la[s:e], ln[s:e], first_l), _iovecs(ra[s:e], ln[s:e], first_r), int(ln[s:e].sum())))
        s = e
    return calls


def _frame(payload: bytes) -> bytes:
    return struct.pack("!I", len(payload)) + payload


class _Peer:
    """A peer this side reads from and writes to: its process, its regions, the stream for notifications."""

    def __init__(self, md: dict, me: bytes):
        self.id, self.pid = str(md["id"]), int(md["pid"])
        self.regions = [(int(a), int(n)) for a, n in md["regions"]]
        address = str(md["address"]).encode("latin-1")
        try:
            self.pidfd = os.pidfd_open(self.pid)  # the very process connected to, even if its pid is reused
        except OSError as e:
            raise TransportError(f"cma peer {self.id}: process {self.pid} is not reachable: {e}") from e
        self.notes = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.notes.settimeout(_SEND_TIMEOUT_S)
            self.notes.connect(address)
            self.notes.sendall(_frame(me))
        except OSError as e:
            self.close()
            raise TransportError(
                f"cma peer {self.id}: its notification socket is not reachable ({e}); "
                "is it in another network namespace?"
            ) from e

    def close(self) -> None:
        self.notes.close()
        os.close(self.pidfd)

    def gone(self) -> bool:
        """Whether the process has exited (its pidfd turns readable). poll(2), not select(2):
        in an engine's process a new descriptor is often past select's 1,023."""
        p = select.poll()
        p.register(self.pidfd, select.POLLIN)
        return bool(p.poll(0))

    def holds(self, region: Region) -> bool:
        return any(a <= region.addr and region.addr + region.nbytes <= a + n for a, n in self.regions)


class _Inbound:
    """A writer's stream of notifications: frames, the first one its id."""

    def __init__(self, conn: socket.socket, pid: int):
        self.conn, self.pid, self.id, self.buf = conn, pid, None, bytearray()

    def frames(self) -> list[bytes]:
        out = []
        while len(self.buf) >= 4:
            (n,) = struct.unpack_from("!I", self.buf)
            if n > _MAX_NOTIFICATION:
                raise ValueError(f"a frame of {n} bytes")
            if len(self.buf) < 4 + n:
                break
            out.append(bytes(self.buf[4 : 4 + n]))
            del self.buf[: 4 + n]
        return out


class _Done:
    """A finished read or write: ``process_vm_readv``/``writev`` return once the bytes are in place."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int):
        self.nbytes = nbytes


class CmaTransport(Transport["_Done | Future"]):
    name = "cma"
    host_only = True
    #: process_vm_writev walks up to 1,024 spans per call: 512-byte spans move at ~1.1 GB/s, ~0.5 us each
    span_cost_s = {"cpu": 0.5e-6}
    #: process_vm_readv likewise: 512-byte spans are read at ~0.6 us each
    read_span_cost_s = {"cpu": 0.6e-6}

    def __init__(self, label: str = "kvstage"):
        self._identity = _host_identity()
        self._id = f"{label}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._address = f"\0kvstage-cma-{self._id}".encode()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(self._address)
            self._listener.listen(socket.SOMAXCONN)
            self._listener.setblocking(False)
        except OSError as e:
            self._listener.close()
            raise TransportError(f"cma: could not open its notification socket: {e}") from e
        if _yama_scope() == 1:  # only ancestors may write into this process unless it allows others
            _libc.prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)
            log.info(
                "cma: Yama ptrace_scope is 1: this process lets any process of its user write into it "
                "(PR_SET_PTRACER_ANY), as cma peers must"
            )
        self._inbound: list[_Inbound] = []
        self._pool: ThreadPoolExecutor | None = None  # the reads' threads, made at the first read
        self._regions: list[tuple[int, int]] = []
        self._keep: list = []
        self._peers: dict[str, _Peer] = {}

    def register(self, tensor) -> Region:
        if tensor.is_cuda:
            raise TransportError(
                "cma: moves host memory only (process_vm_writev); "
                f"a {tensor.nbytes}-byte tensor on {tensor.device} needs nixl or ucx"
            )
        if not tensor.is_contiguous():
            raise TransportError("register: tensor must be contiguous")
        self._keep.append(tensor)
        self._regions.append((tensor.data_ptr(), tensor.nbytes))
        return Region(tensor.data_ptr(), tensor.nbytes, "cpu", 0)

    def metadata(self) -> bytes:
        return json.dumps(
            {
                "format": _FORMAT,
                "id": self._id,
                "pid": os.getpid(),
                "host": self._identity,
                "address": self._address.decode("latin-1"),
                "regions": self._regions,
            }
        ).encode()

    def connect(self, peer_metadata: bytes) -> str:
        try:
            md = json.loads(peer_metadata)
            if md.get("format") != _FORMAT:
                raise ValueError(f"format {md.get('format')!r}, this side reads {_FORMAT}")
            host = md["host"]
            for key, what in (
                ("boot_id", "kernel (boot id)"),
                ("pid_ns", "PID namespace"),
                ("net_ns", "network namespace"),
                ("uid", "user"),
            ):
                if host.get(key) != self._identity[key]:
                    raise TransportError(
                        f"cma: peer {md.get('id')} runs under another {what} ({host.get(key)!r}, this side "
                        f"{self._identity[key]!r}); cma moves bytes only between processes of one host, namespace "
                        "and user: use nixl or ucx"
                    )
            peer = _Peer(md, self._id.encode())
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise TransportError(f"cma: a peer's metadata is not this transport's: {e}") from e
        self.disconnect(peer.id)
        self._peers[peer.id] = peer
        return peer.id

    def disconnect(self, peer: str) -> None:
        p = self._peers.pop(peer, None)
        if p is not None:
            p.close()

    @property
    def id(self) -> str:
        return self._id

    def _peer(self, peer: str, op: str) -> _Peer:
        p = self._peers.get(peer)
        if p is None:
            raise TransportError(f"cma: {op} {peer}: not connected")
        return p

    def _calls(self, peer: str, local: Spans, remote: Spans, op: str):
        """The peer and the planned calls of a read or a write; TransportError, before anything moves,
        for spans that do not pair up or lie outside what the peer registered."""
        try:
            Spans.check_pair(local, remote)
            if local.device[0] != "cpu" or remote.device[0] != "cpu":
                raise ValueError("cma moves host memory only")
        except ValueError as e:
            raise TransportError(f"cma {op} {peer}: {e}") from e
        p = self._peer(peer, op)
        stray = next((r for r in remote.regions if not p.holds(r)), None)
        if stray is not None:
            raise TransportError(
                f"cma {op} {peer}: remote region at {stray.addr:#x} ({stray.nbytes} bytes) "
                "is not one the peer registered before its metadata was taken"
            )
        return p, plan_calls(local.addresses(), remote.addresses(), local.lengths)

    @staticmethod
    def _copy(p: _Peer, calls, call, op: str) -> int:
        """Run the planned calls of ``call`` (``_readv`` or ``_writev``) on the peer's process; the bytes
        moved, or TransportError naming the cause."""
        if p.gone():
            raise TransportError(f"cma {op} {p.id}: its process {p.pid} has exited")
        total = 0
        for liov, riov, nbytes in calls:
            n = call(p.pid, liov.ctypes.data, len(liov), riov.ctypes.data, len(riov), 0)
            if n != nbytes:
                err = ctypes.get_errno() if n < 0 else 0
                cause = _WHY.get(err, os.strerror(err)) if n < 0 else f"moved {n} of {nbytes} bytes (a span not mapped)"
                raise TransportError(f"cma {op} {p.id} (process {p.pid}) failed after {total} bytes: {cause}")
            total += n
        return total

    def _send(self, p: _Peer, calls, notification: bytes) -> _Done:
        if len(notification) > _MAX_NOTIFICATION:
            raise TransportError(f"cma: a notification of {len(notification)} bytes; at most {_MAX_NOTIFICATION}")
        total = self._copy(p, calls, _writev, "write to")
        try:
            p.notes.sendall(_frame(notification))
        except OSError as e:  # a timeout: it stopped reading; EPIPE: it closed
            raise TransportError(f"cma: notification to {p.id} not sent: {e}") from e
        return _Done(total)

    def write(self, peer, local, remote, notification, ticket=b""):
        p, calls = self._calls(peer, local, remote, "write to")
        return self._send(p, calls, notification)

    def prepare_write(self, peer, local, remote, notification, ticket=b""):
        p, calls = self._calls(peer, local, remote, "write to")  # the iovecs are built now, the copy at post
        return ReadyWrite(lambda: self._send(p, calls, notification))

    def read(self, peer, local, remote, ticket=b""):
        """The read runs on one of this transport's threads (``READ_THREADS``; the call releases the GIL),
        so a reader of several peers copies from them in parallel, and its caller goes on meanwhile."""
        p, calls = self._calls(peer, local, remote, "read from")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvstage-cma-read")
        return self._pool.submit(self._copy, p, calls, _readv, "read from")

    def poll(self, handle: _Done | Future) -> WriteState:
        if isinstance(handle, Future):
            if not handle.done():
                return WriteState.PENDING
            handle.result()  # the peer's fault, raised here as TransportError
        return WriteState.DONE

    def abandon(self, handle: _Done | Future) -> bool:
        """A read not started is cancelled; one whose call runs ends with it (True once it returned)."""
        return not isinstance(handle, Future) or handle.cancel() or handle.done()

    def release(self, handle: _Done | Future) -> None:
        pass

    def notifications(self):
        self._accept()
        out = []
        for w in list(self._inbound):
            closed = False
            try:
                while True:
                    data = w.conn.recv(1 << 16)
                    if not data:
                        closed = True
                        break
                    w.buf += data
            except BlockingIOError:
                pass
            except OSError:
                closed = True
            try:  # what a writer sent before it went is still handed out
                for frame in w.frames():
                    if w.id is None:
                        w.id = frame.decode("utf-8", "replace")
                        parts = w.id.rsplit("-", 2)
                        if len(parts) != 3 or parts[1] != str(w.pid):
                            raise ValueError(f"its id {w.id[:80]!r} does not name process {w.pid}")
                    else:
                        out.append((w.id, frame))
            except ValueError as e:  # not a writer of this transport
                log.warning("cma: dropped the notification stream of process %d: %s", w.pid, e)
                closed = True
            if closed:
                self._inbound.remove(w)
                w.conn.close()
        return out

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != self._identity["uid"]:
                log.warning("cma: refused a notification stream from process %d of user %d", pid, uid)
                conn.close()
                continue
            conn.setblocking(False)
            self._inbound.append(_Inbound(conn, pid))

    def close(self) -> None:
        for peer in list(self._peers):
            self.disconnect(peer)
        for w in self._inbound:
            w.conn.close()
        self._inbound.clear()
        if self._pool is not None:  # reads still running end first: they copy into memory freed after this
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._regions.clear()
        self._keep.clear()
        self._listener.close()
