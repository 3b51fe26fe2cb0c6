"""The SGLang backend's decode side: a decode rank's one kvstage ``Destination`` and its rooms.

A decode rank reads each prefill's layout once (``/kvstage/layout``), expects a room's pages in its
Destination and tells every prefill rank where to send them (``KVSTAGE_ROOM``); a room is Success
once its pages are scattered and its metadata row (``KVSTAGE_AUX``) landed. A room this rank fails
is failed on the other decode ranks of its engine with its cause first (``KVSTAGE_CAUSE``), so each
rank's ``failure_exception()`` names it. ``KVStageReceiver`` is what SGLang's decode scheduler holds
per request.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import requests
from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import CommonKVManager, CommonKVReceiver
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils.network import NetworkAddress

from kvstage.errors import ConfigError
from kvstage.plugin.sglang.layout import SglangKVLayout, decode_spec, kv_buffers
from kvstage.plugin.sglang.shared import (
    AUX_TAG,
    CAUSE_ACK_TAG,
    CAUSE_ACK_TIMEOUT_S,
    CAUSE_TAG,
    LAYOUT_ROUTE,
    ROOM_TAG,
    ManagerBase,
    decode_engine_id,
    log,
    rows_of,
)
from kvstage.protocol.request import State, TransferHandle
from kvstage.staging.cache import RankCache
from kvstage.tp import SideSpec

if TYPE_CHECKING:
    from kvstage.protocol.destination import Destination


@dataclass
class _Incoming:
    """A room on a decode rank."""

    handle: TransferHandle | None  # None when no page is transferred
    aux_index: int
    state: list[tuple[int, list[int]]]  # (component, rows) this rank expects
    aux_done: bool = False


@dataclass
class _Prefill:
    """A prefill engine's bootstrap address as a decode rank knows it (read from ``/kvstage/layout``)."""

    layout: dict  # its published KV layout (wire form)
    engines: dict[int, str]  # prefill DP rank -> engine id
    refused: str | None = None  # why this decode rank cannot receive from it (its rooms fail with this)


@dataclass
class _Telling:
    """A decode rank's failed room whose cause the other decode ranks are being told."""

    waiting: set[int]  # decode ranks that have not acknowledged the cause yet
    deadline: float  # time.monotonic(): report Failed anyway after this


class DecodeManager(ManagerBase):
    """The manager's decode-side methods (a mixin of ``conn.KVStageManager``): SGLang calls them on
    a decode rank only (``update_status`` on both: a prefill rank has no siblings, it is SGLang's
    own there), and the control thread hands them the prefill ranks' and sibling ranks' messages."""

    dst: Destination | None  # this rank's one kvstage endpoint, made when the first prefill's layout is read
    _prefills: dict[str, _Prefill]  # prefill bootstrap address -> what it published
    _incoming: dict[int, _Incoming]
    _telling: dict[int, _Telling]  # failed rooms, until cleared
    _siblings: dict[int, tuple[str, int]]  # the other decode ranks of this engine: rank -> (ip, control port)

    def _start_decode(self) -> None:
        """The decode half of ``__init__``, after SGLang's: this engine's id and the control thread (the
        Destination waits for the first prefill's layout)."""
        self.dst = None
        self._prefills = {}
        self._incoming = {}
        self._telling = {}
        self._siblings, self.engine_id = self._decode_siblings()
        threading.Thread(
            target=self._serve, args=(self._on_prefill_message,), daemon=True, name="kvstage-sglang-decode"
        ).start()
        self._start_heartbeat_checker_thread()

    def _resolve_rank_mapping(self, info) -> None:
        """Every decode rank talks to every prefill rank: kvstage's plan decides who writes where."""
        super()._resolve_rank_mapping(info)
        info.target_tp_rank = None
        info.target_tp_ranks = list(range(info.attn_tp_size))
        info.required_dst_info_num = self.attn_tp_size
        info.required_prefill_response_num = info.attn_tp_size

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's parallel info, and the prefill's kvstage layout and engine ids: read once per
        prefill address (again after SGLang dropped a lost prefill). The first layout read makes this
        rank's Destination; a later prefill whose layout gives another spec here is refused, room by
        room, with the reason."""
        known = bootstrap_addr in self.prefill_info_table
        if not super().try_ensure_parallel_info(bootstrap_addr):
            return False
        if known and bootstrap_addr in self._prefills:
            return True
        published = self._read_layout(bootstrap_addr)
        if published is None:
            return False
        layout, engines = published
        refused = None
        try:
            spec = decode_spec(self.kv_args, self.mla, SglangKVLayout.from_wire(layout), self.attn_tp_size)
            dst = self._destination(spec)
            if dst.spec != spec:
                raise ConfigError(
                    f"its KV layout {layout} gives this decode rank the spec {spec}; this rank's "
                    f"Destination receives with {dst.spec} (the first prefill's): every prefill engine "
                    "of one decode engine must serve the same model with the same KV dtype and page size"
                )
        except ConfigError as e:
            refused = f"the prefill at {bootstrap_addr} cannot send to this decode: {e}"
            log.error("kvstage: decode rank %d: %s", self.attn_tp_rank, refused)
        with self._lock:
            self._prefills[bootstrap_addr] = _Prefill(layout, engines, refused)
        if refused is None:
            log.info(
                "kvstage: decode rank %d receives from prefill %s (engines %s) on %s:%d",
                self.attn_tp_rank,
                bootstrap_addr,
                sorted(engines.values()),
                *dst.address,
            )
        return True

    def _read_layout(self, bootstrap_addr: str) -> tuple[dict, dict] | None:
        """(layout, {DP rank: engine id}) the prefill at ``bootstrap_addr`` published; None: not yet."""
        r = requests.get(f"http://{bootstrap_addr}{LAYOUT_ROUTE}", timeout=5)
        if r.status_code == 503:
            return None
        if r.status_code != 200:
            raise ConfigError(
                f"the prefill at {bootstrap_addr} serves no kvstage layout ({r.status_code} {r.text[:200]}): "
                "start it with --disaggregation-transfer-backend kvstage too"
            )
        data = r.json()
        return data["layout"], {int(dp): str(e) for dp, e in data["engines"].items()}

    def _destination(self, spec: SideSpec):
        """This rank's one Destination, made for ``spec`` the first time (it serves every prefill engine)."""
        from kvstage.protocol.destination import Destination

        with self._connect_lock:
            if self.dst is None:
                cache = RankCache(spec, self.attn_tp_rank, kv_buffers(self.kv_args, spec, self.device))
                self.dst = self._registered(
                    Destination(
                        cache, self.settings, listen=(self.local_ip, 0), engine=self.engine_id, model=self.model
                    )
                )
                log.info(
                    "kvstage: decode rank %d of engine %r receives from every prefill engine on %s:%d (%s, model %s)",
                    self.attn_tp_rank,
                    self.engine_id,
                    *self.dst.address,
                    spec,
                    self.model,
                )
            return self.dst

    def prefill_engine(self, bootstrap_addr: str, dp: int) -> str:
        """The engine id of the prefill at ``bootstrap_addr``, DP rank ``dp``; ConfigError when this
        rank cannot receive from it."""
        with self._lock:
            pf = self._prefills.get(bootstrap_addr)
        if pf is None:
            raise ConfigError(f"the prefill at {bootstrap_addr}: its kvstage layout was never read")
        if pf.refused:
            raise ConfigError(pf.refused)
        if dp not in pf.engines:  # a DP rank that published after this rank read the route
            published = self._read_layout(bootstrap_addr)
            if published is not None:
                pf.engines.update(published[1])
        if dp not in pf.engines:
            raise ConfigError(
                f"the prefill at {bootstrap_addr} has no DP rank {dp} with kvstage (it has {sorted(pf.engines)})"
            )
        return pf.engines[dp]

    def expect(self, bootstrap_addr: str, dp: int, room: int, kv_indices, aux_index: int | None, state_indices) -> dict:
        """Open the kvstage request for ``room``; return the header every prefill rank gets."""
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        engine = self.prefill_engine(bootstrap_addr, dp)
        dst = self.dst
        if dst is None:  # not reached: a prefill that prefill_engine() accepts made it (_destination)
            raise ConfigError(f"the prefill at {bootstrap_addr}: this decode rank has no Destination yet")
        if aux_index is None:
            raise ConfigError("the room came without its metadata row (aux_index)")
        handle = (
            dst.expect(str(room), pages, len(pages) * self.kv_args.page_size, engine=engine) if len(pages) else None
        )
        state = rows_of(self.states, state_indices)
        with self._lock:
            self._incoming[room] = _Incoming(handle, int(aux_index), state)
        log.debug(
            "kvstage: decode rank %d, room %d: expecting %d pages from %r, metadata row %d",
            self.attn_tp_rank,
            room,
            len(pages),
            engine,
            aux_index,
        )
        return {
            "tp": self.attn_tp_size,
            "rank": self.attn_tp_rank,
            "engine": self.engine_id,
            "dst": dst.address.url,
            "status": [self.local_ip, self.rank_port],
            "aux_index": int(aux_index),
            "pages": len(pages),
            "state": state,
        }

    def check_room(self, room: int) -> None:
        """Receiver.poll: Success once scattered and the metadata row landed; Failed on failure
        (once the other decode ranks hold the cause, see ``fail_incoming``)."""
        with self._lock:
            inc = self._incoming.get(room)
            told = self._telling.get(room)
            waiting: list[int] = []
            if told is not None and told.waiting and time.monotonic() > told.deadline:
                waiting, told.waiting = sorted(told.waiting), set()
        if waiting:
            log.warning(
                "kvstage: decode rank %d, room %d: decode ranks %s did not acknowledge the failure's cause "
                "in %.0f s; reporting Failed without them",
                self.attn_tp_rank,
                room,
                waiting,
                CAUSE_ACK_TIMEOUT_S,
            )
            self._report_failed(room)
        if inc is None or told is not None:
            return
        h = inc.handle
        if h is not None and h.state is State.FAILED:
            self.fail_incoming(room, str(h.error))
        elif (h is None or h.state is State.DONE) and inc.aux_done:
            if self.request_status.get(room) != KVPoll.Success:
                log.debug("kvstage: decode rank %d, room %d: received", self.attn_tp_rank, room)
            self.update_status(room, KVPoll.Success)
        elif h is not None and h.state is State.TRANSFERRING:
            self.update_status(room, KVPoll.Transferring)

    def abort_incoming(self, room: int, reason: str, forget: bool = False) -> None:
        with self._lock:
            inc = self._incoming.pop(room, None) if forget else self._incoming.get(room)
            if forget:
                self._telling.pop(room, None)
        if inc is not None and inc.handle is not None and not inc.handle.done():
            inc.handle.abort(reason)

    def _decode_siblings(self) -> tuple[dict, str]:
        """The other decode ranks of this engine (its attention-TP group, whose polls SGLang
        all-reduces), rank -> (ip, control port), and this engine's id. One all-gather at start-up,
        in every rank."""
        if self.attn_tp_size == 1:
            return {}, decode_engine_id(self.local_ip, self.rank_port)
        rows = get_parallel().attn_tp_group.all_gather_object((self.attn_tp_rank, self.local_ip, self.rank_port))
        ranks = {int(r): (ip, int(port)) for r, ip, port in rows}
        return {r: a for r, a in ranks.items() if r != self.attn_tp_rank}, decode_engine_id(*ranks[0])

    def fail_incoming(self, room: int, reason: str) -> None:
        """This decode rank failed ``room``: keep the cause, abort the kvstage request, and tell
        the other decode ranks the cause; the room turns Failed here when each has acknowledged it
        (``CAUSE_ACK_TIMEOUT_S`` at most). SGLang MIN-all-reduces the polls, so Failed here fails
        the room on every rank, and each rank raises its own ``failure_exception()``."""
        self.first_failure(room, reason)
        self.abort_incoming(room, reason)
        with self._lock:
            if room in self._telling:
                return
            self._telling[room] = _Telling(set(self._siblings), time.monotonic() + CAUSE_ACK_TIMEOUT_S)
        if not self._siblings:
            self._report_failed(room)
            return
        with self.failure_lock:
            cause = self.failure_records.get(room, reason)
        msg = [CAUSE_TAG, str(room).encode(), str(self.attn_tp_rank).encode(), cause.encode()]
        for ip, port in self._siblings.values():
            na = NetworkAddress(ip, port)
            self._send_multipart_locked(na.to_tcp(), msg, is_ipv6=na.is_ipv6)

    def update_status(self, bootstrap_room: int, status: KVPoll):
        """A decode room that SGLang itself fails here (a lost prefill, a timeout, no bootstrap info)
        goes through ``fail_incoming`` too, so the other decode ranks hold its cause first."""
        if status == KVPoll.Failed and getattr(self, "_siblings", None) and bootstrap_room in self.request_status:
            with self.failure_lock:
                reason = self.failure_records.get(bootstrap_room)
            self.fail_incoming(bootstrap_room, reason or "failed on this decode rank")
            return
        super().update_status(bootstrap_room, status)

    def _report_failed(self, room: int) -> None:
        """Failed in the status SGLang polls (the other decode ranks hold the cause by now)."""
        CommonKVManager.update_status(self, room, KVPoll.Failed)

    def _on_cause(self, msg: list) -> None:
        """Another decode rank's failure of a room: take its cause, fail the room here, acknowledge."""
        room, rank = int(msg[1]), int(msg[2])
        if room in self.request_status:  # else cleared here already, or never seen: nothing to report
            cause = f"decode rank {rank}: {msg[3].decode(errors='replace')}"
            self.first_failure(room, cause)
            self.abort_incoming(room, cause)
        if rank in self._siblings:
            na = NetworkAddress(*self._siblings[rank])
            self._send_multipart_locked(
                na.to_tcp(), [CAUSE_ACK_TAG, msg[1], str(self.attn_tp_rank).encode()], is_ipv6=na.is_ipv6
            )

    def _on_cause_ack(self, msg: list) -> None:
        room, rank = int(msg[1]), int(msg[2])
        with self._lock:
            told = self._telling.get(room)
            if told is None or rank not in told.waiting:
                return
            told.waiting.discard(rank)
            done = not told.waiting
        if done:
            self._report_failed(room)

    def _on_prefill_message(self, msg: list) -> None:
        if self.handle_abort_ack_message(msg):
            return
        if msg[0] == AUX_TAG:
            return self._on_aux(msg)
        if msg[0] == CAUSE_TAG:
            return self._on_cause(msg)
        if msg[0] == CAUSE_ACK_TAG:
            return self._on_cause_ack(msg)
        parsed = self.parse_kv_status_message(msg)
        if parsed is None:
            log.warning("kvstage: decode rank %d ignored a message tagged %r", self.attn_tp_rank, msg[0][:20])
            return
        room, status, prefill_rank, reason = parsed
        if status == KVPoll.Failed and room in self.request_status:
            self.fail_incoming(room, f"prefill rank {prefill_rank}: {reason or self.DEFAULT_PREFILL_FAILURE_REASON}")

    def first_failure(self, room: int, reason: str) -> None:
        """Record ``reason`` unless a cause is already recorded: the root cause wins over its echoes
        (a decode's own timeout, answered Failed by the prefill it aborted)."""
        with self.failure_lock:
            self.failure_records.setdefault(room, reason)

    def _on_aux(self, msg: list) -> None:
        room, meta = int(msg[1]), json.loads(msg[3])
        frames = msg[4:]
        with self._lock:  # held while writing: clear() cannot hand the row to another request meanwhile
            inc = self._incoming.get(room)
            if inc is None or inc.aux_index != int(meta["aux_index"]):
                log.debug(
                    "kvstage: decode rank %d, room %d: metadata row from prefill rank %s dropped (request "
                    "cleared, or an earlier use of the room)",
                    self.attn_tp_rank,
                    room,
                    msg[2].decode(),
                )
                return
            try:
                n = int(meta["aux"])
                self.aux.write([inc.aux_index], frames[:n])
                at = n
                want = dict(inc.state)
                got = {}
                for c, rows, count in meta["state"]:
                    if want.get(c) != rows:
                        raise ConfigError(f"state component {c}: rows {rows} received, this rank expects {want.get(c)}")
                    self.states[c].write(rows, frames[at : at + count])
                    at += count
                    got[c] = rows
                if got != want:
                    raise ConfigError(f"state components {sorted(set(want) - set(got))} expected, not received")
                inc.aux_done = True
                return
            except Exception as e:
                reason = f"metadata/state rows from prefill rank {msg[2].decode()}: {e}"
        self.fail_incoming(room, reason)


# -- receiver --------------------------------------------------------------------------------------


class KVStageReceiver(CommonKVReceiver):
    """One decode request, as SGLang's decode scheduler holds it; the manager does the work."""

    kv_mgr: DecodeManager

    def send_metadata(
        self,
        kv_indices,
        aux_index: int | None = None,
        state_indices=None,
        decode_prefix_len: int | None = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
        device_kv_indices=None,
    ):
        mgr = self.kv_mgr
        if self.conclude_state == KVPoll.Failed:
            return
        if destination != KVTransferDestination.DEVICE:
            raise NotImplementedError("Host KV destinations are not supported")
        if getattr(self, "bootstrap_infos", None) is None:
            mgr.record_failure(
                self.bootstrap_room, f"Could not fetch prefill parallel info from bootstrap_addr: {self.bootstrap_addr}"
            )
            mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            return
        try:
            header = mgr.expect(
                self.bootstrap_addr,
                int(getattr(self, "prefill_dp_rank", 0) or 0),
                self.bootstrap_room,
                kv_indices,
                aux_index,
                state_indices,
            )
        except Exception as e:  # the prefill ranks are told too: they fail the room now, not at their timeout
            cause = f"kvstage could not receive into this rank: {type(e).__name__}: {e}"
            mgr.fail_incoming(self.bootstrap_room, cause)
            header = {
                "tp": mgr.attn_tp_size,
                "rank": mgr.attn_tp_rank,
                "status": [mgr.local_ip, mgr.rank_port],
                "failed": cause,
            }
        header["prefix_len"] = int(decode_prefix_len or 0)
        message = [ROOM_TAG, str(self.bootstrap_room).encode(), json.dumps(header).encode()]
        for info in self.bootstrap_infos:
            if not self._send_bootstrap_message(bootstrap_info=info, message=message, operation="send_metadata"):
                self.invalidate_cached_bootstrap_infos()
                mgr.abort_incoming(self.bootstrap_room, "could not reach a prefill rank")
                return
        if "failed" not in header:
            self.init_time = time.time()

    def _register_kv_args(self) -> bool:
        return self.bootstrap_infos is not None  # nothing to register: the room message carries it all

    def poll(self) -> KVPoll:
        self.kv_mgr.check_room(self.bootstrap_room)
        status = super().poll()
        if status == KVPoll.Failed:
            self.kv_mgr.abort_incoming(self.bootstrap_room, "the decode side failed the request")
        return status

    def abort(self):
        # first: SGLang's abort fails the room through ``fail_incoming``, which would abort the kvstage
        # request with SGLang's record ("Aborted by AbortReq.") instead of saying the decode did it
        self.kv_mgr.abort_incoming(self.bootstrap_room, "the decode aborted the request")
        super().abort()

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.abort_incoming(self.bootstrap_room, "the decode request was cleared", forget=True)
