"""NIXL transport (UCX backend): one-sided writes with notifications.

Uses the real NIXL Python API. ``nixl`` (the meta package, which picks a CUDA
build), ``nixl_cu13`` and ``nixl_cu12`` are tried in that order.
"""

from __future__ import annotations

import importlib
import logging
import os
import uuid

import numpy as np

from kvstage.errors import TransportError
from kvstage.transports.base import ReadyWrite, Region, Spans, Transport, WriteState

log = logging.getLogger(__name__)

_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")


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


class NixlTransport(Transport):
    name = "nixl"

    def __init__(self, label: str = "kvstage", backend: str = "UCX"):
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        api = load_nixl()
        self.agent_name = f"{label}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self._agent = api.nixl_agent(self.agent_name, api.nixl_agent_config(enable_prog_thread=False, backends=[backend]))
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
        return self._post(self._request(peer, local, remote, notification), peer)

    def prepare_write(self, peer, local, remote, notification, ticket=b""):
        handle = self._request(peer, local, remote, notification)
        return ReadyWrite(lambda: self._post(handle, peer), lambda: self.release(handle))

    def _request(self, peer, local, remote, notification):
        """A NIXL transfer request for the write, not posted yet."""
        try:
            Spans.check_pair(local, remote)
        except ValueError as e:
            raise TransportError(f"NIXL write to {peer}: {e}") from e
        try:
            lds = self._agent.get_xfer_descs(_descs(local), _mem_type(local.device[0]))
            rds = self._agent.get_xfer_descs(_descs(remote), _mem_type(remote.device[0]))
            return self._agent.initialize_xfer("WRITE", lds, rds, peer, notification)
        except Exception as e:
            raise TransportError(f"NIXL write to {peer} could not be created: {e}") from e

    def prepare(self, peer, spans):
        try:
            spans.check("prepared spans")
            return self._agent.prep_xfer_dlist(peer or "NIXL_INIT_AGENT", _descs(spans), _mem_type(spans.device[0]))
        except Exception as e:
            raise TransportError(f"NIXL could not prepare {len(spans)} descriptors for {peer or 'local'}: {e}") from e

    def write_prepared(self, peer, local, local_index, remote, remote_index, notification, ticket=b""):
        try:
            handle = self._agent.make_prepped_xfer(
                "WRITE", local, np.asarray(local_index, dtype=np.int32), remote, np.asarray(remote_index, dtype=np.int32), notification
            )
        except Exception as e:
            raise TransportError(f"NIXL prepared write to {peer} could not be created: {e}") from e
        return self._post(handle, peer)

    def _post(self, handle, peer):
        try:
            state = self._agent.transfer(handle)
        except Exception as e:
            raise TransportError(f"NIXL write to {peer} could not be posted: {e}") from e
        if state == "ERR":
            raise TransportError(f"NIXL write to {peer} failed when posted")
        return handle

    def poll(self, handle) -> WriteState:
        try:
            state = self._agent.check_xfer_state(handle)
        except Exception as e:  # e.g. nixlRemoteDisconnectError when the peer died
            raise TransportError(f"NIXL write failed: {type(e).__name__}: {e}") from e
        if state == "DONE":
            return WriteState.DONE
        if state == "PROC":
            return WriteState.PENDING
        raise TransportError("NIXL reported the write failed (peer gone or link down)")

    def release(self, handle) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as e:
            log.debug("nixl: releasing a write handle: %s", e)

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
