"""NIXL transport (UCX backend): one-sided reads, and writes with notifications.

Uses the real NIXL Python API. ``nixl`` (the meta package, which picks a CUDA
build), ``nixl_cu13`` and ``nixl_cu12`` are tried in that order.

A READ must complete while the peer's process is stopped or busy. NIXL ends
every transfer with a UCX endpoint flush, and over UCX's ``tcp`` transport a
flush after any active message (a notification, a wireup message, the
keepalive UCX sends every 20 s) waits for the peer's UCX to acknowledge a
zero-byte put: its process must run. On one host with NIXL's default
peer-failure handling, ``tcp`` is the only transport UCX 1.21 may use for
active messages and keepalive, because its shared-memory transports
(posix, sysv) do not claim error handling unless ``MM_ERROR_HANDLING=y``. The
UCX backend is therefore started with that option (``UCX_ENGINE_CONFIG``,
NIXL's ``engine_config``; the environment's ``UCX_MM_ERROR_HANDLING`` wins):
messages and keepalive then go through shared memory, whose flush needs
nothing from the peer, and a dead peer is still found (its pid, and cma's
errors). Between hosts (not tried here) they go over RDMA or TCP; over TCP the
same handshake applies.

A READ of device memory on one host needs cuda_ipc's get, which UCX turns off
where it sees no NVLink (one GPU, or GPUs on PCIe): the READ then goes over tcp
(on one H100, 1 GB read in 1.3 s, 0.8 GB/s, where a WRITE of the same bytes
takes 1.4 ms). ``CUDA_IPC_ENABLE_GET_ZCOPY=on`` turns it on (NIXL's later
releases do the same).
"""

from __future__ import annotations

import importlib
import logging
import os
import uuid
from typing import TYPE_CHECKING

import numpy as np

from kvstage.errors import TransportError
from kvstage.transports.base import Failed, ReadyWrite, Region, Spans, Transport, WriteState

if TYPE_CHECKING:
    from typing import TypeAlias

    from nixl._api import nixl_xfer_handle  # the same class as nixl_cu13's and nixl_cu12's

    #: a posted transfer, or a read that failed at its post (``poll`` raises its cause)
    NixlHandle: TypeAlias = nixl_xfer_handle | Failed

log = logging.getLogger(__name__)

_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
#: UCX options of the UCX backend's context (see the module docstring); a ``UCX_<name>`` variable wins
UCX_ENGINE_CONFIG = {"MM_ERROR_HANDLING": "y", "CUDA_IPC_ENABLE_GET_ZCOPY": "on"}


def load_nixl():
    """Import NIXL's API module, or raise TransportError saying how to install it."""
    errors = []
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as e:  # try the next build
            errors.append(f"{name}: {e}")
    raise TransportError(
        "NIXL is not importable (" + "; ".join(errors) + "). Install it with "
        "`pip install nixl-cu13` (CUDA 13 or CPU-only) or `pip install nixl-cu12` (CUDA 12)."
    )


def _mem_type(device: str) -> str:
    return "VRAM" if device == "cuda" else "DRAM"


def _descs(spans: Spans) -> np.ndarray:
    arr = np.empty((len(spans), 3), dtype=np.uint64)
    arr[:, 0] = spans.addresses()
    arr[:, 1] = spans.lengths.astype(np.uint64)
    arr[:, 2] = spans.device[1]
    return arr


class NixlTransport(Transport["NixlHandle"]):
    name = "nixl"
    #: one UCX get per span, as one put per span for writes: ~12 us over cuda_ipc on one H200 (measured
    #: for writes); ~2 us over cma on the 2-core CPU machine (512 B: 1.97 us a span, 32 KiB: 9.2 us)
    read_span_cost_s = {"cuda": 12e-6, "cpu": 2e-6}

    def __init__(self, label: str = "kvstage", backend: str = "UCX"):
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        api = load_nixl()
        self.agent_name = f"{label}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        engine_config = ",".join(f"{k}={v}" for k, v in UCX_ENGINE_CONFIG.items())
        params = {"engine_config": engine_config} if backend == "UCX" else {}
        try:
            self._agent = api.nixl_agent(self.agent_name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
            self._agent.create_backend(backend, params)
        except Exception as e:  # NIXL raises plain exceptions from its bindings
            raise TransportError(f"NIXL agent {self.agent_name} with backend {backend} failed to start: {e}") from e
        if backend not in self._agent.backends:
            raise TransportError(
                f"NIXL backend {backend} is not available (plugins found: {', '.join(self._agent.plugin_list)})"
            )
        self.backend = backend
        self._registered: list = []
        self._peers: set[str] = set()

    def plugins(self) -> list[str]:
        return list(self._agent.plugin_list)

    def register(self, tensor) -> Region:
        if not tensor.is_contiguous():
            raise TransportError("register: tensor must be contiguous")
        device = "cuda" if tensor.is_cuda else "cpu"
        try:
            descs = self._agent.register_memory(tensor)
        except Exception as e:
            raise TransportError(f"NIXL could not register {tensor.nbytes} bytes of {device} memory: {e}") from e
        self._registered.append((descs, tensor))
        device_id = (tensor.device.index or 0) if tensor.is_cuda else 0
        return Region(tensor.data_ptr(), tensor.nbytes, device, device_id)

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def connect(self, peer_metadata: bytes) -> str:
        try:
            peer = self._agent.add_remote_agent(peer_metadata)
        except Exception as e:
            raise TransportError(f"NIXL rejected a peer's metadata: {e}") from e
        peer = peer.decode() if isinstance(peer, bytes) else peer
        self._peers.add(peer)
        try:  # every backend's endpoints to the peer now (UCX made its own above), none at a first read
            self._agent.make_connection(peer)
        except Exception as e:
            raise TransportError(f"NIXL could not connect to {peer}: {e}") from e
        return peer

    def disconnect(self, peer: str) -> None:
        if peer in self._peers:
            self._peers.discard(peer)
            try:
                self._agent.remove_remote_agent(peer)
            except Exception as e:  # already gone is fine; say so once
                log.debug("nixl: removing peer %s: %s", peer, e)

    @property
    def id(self) -> str:
        return self.agent_name

    def write(self, peer, local, remote, notification, ticket=b""):
        return self._post(self._request("WRITE", peer, local, remote, notification), peer)

    def prepare_write(self, peer, local, remote, notification, ticket=b""):
        handle = self._request("WRITE", peer, local, remote, notification)
        return ReadyWrite(lambda: self._post(handle, peer), lambda: self.release(handle))

    def read(self, peer, local, remote, ticket=b""):
        handle = self._request("READ", peer, local, remote, b"")
        try:
            return self._post(handle, peer, "read from")
        except TransportError as e:  # the peer gone: reported by poll, as a failure after the post is
            self.release(handle)
            return Failed(str(e))

    def _request(self, op, peer, local, remote, notification):
        """A NIXL transfer request, not posted yet; NIXL refuses remote spans outside what the peer registered."""
        what = "write to" if op == "WRITE" else "read from"
        try:
            Spans.check_pair(local, remote)
        except ValueError as e:
            raise TransportError(f"NIXL {what} {peer}: {e}") from e
        try:
            lds = self._agent.get_xfer_descs(_descs(local), _mem_type(local.device[0]))
            rds = self._agent.get_xfer_descs(_descs(remote), _mem_type(remote.device[0]))
            return self._agent.initialize_xfer(op, lds, rds, peer, notification)
        except Exception as e:
            raise TransportError(f"NIXL {what} {peer} could not be created: {type(e).__name__}: {e}") from e

    def _post(self, handle, peer, what="write to"):
        try:
            state = self._agent.transfer(handle)
        except Exception as e:
            raise TransportError(f"NIXL {what} {peer} could not be posted: {type(e).__name__}: {e}") from e
        if state == "ERR":
            raise TransportError(f"NIXL {what} {peer} failed when posted")
        return handle

    def poll(self, handle: NixlHandle) -> WriteState:
        if isinstance(handle, Failed):
            raise TransportError(handle.cause)
        try:
            state = self._agent.check_xfer_state(handle)
        except Exception as e:  # e.g. nixlRemoteDisconnectError when the peer died
            raise TransportError(f"NIXL transfer failed: {type(e).__name__}: {e}") from e
        if state == "DONE":
            return WriteState.DONE
        if state == "PROC":
            return WriteState.PENDING
        raise TransportError("NIXL reported the transfer failed (peer gone or link down)")

    def abandon(self, handle: NixlHandle) -> bool:
        """NIXL's release of a running transfer asks UCX to cancel it, which UCX does not do for
        reads and writes of memory (``ucp_request_cancel`` cancels tag receives only): a read still
        running may land later, so it is kept and polled, never cancelled."""
        try:
            return self.poll(handle) is WriteState.DONE
        except TransportError:
            return True  # failed: over

    def release(self, handle: NixlHandle) -> None:
        if isinstance(handle, Failed):
            return
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as e:
            log.debug("nixl: releasing a transfer handle: %s", e)

    def notifications(self):
        out = []
        for peer, msgs in self._agent.get_new_notifs().items():
            peer = peer.decode() if isinstance(peer, bytes) else peer
            out.extend((peer, m) for m in msgs)
        return out

    def close(self) -> None:
        for peer in list(self._peers):
            self.disconnect(peer)
        for descs, _ in self._registered:
            try:
                self._agent.deregister_memory(descs)
            except Exception as e:
                log.debug("nixl: deregistering: %s", e)
        self._registered.clear()
        # Destroy the agent now, while the interpreter is whole: left to exit-time
        # finalization, its backend threads can outlive it and abort the process.
        agent, self._agent = self._agent, None
        del agent
        import gc

        gc.collect()
