"""SGLang transfer backend ``kvstage``: manager, sender, receiver, bootstrap server.

They subclass SGLang's Common classes (the schedulers call Common-only members
directly) and translate SGLang's rooms, pages and metadata rows into kvstage
requests; the bytes move with kvstage's planner, staging and NIXL.

One request (a "room"):

1. The prefill ranks publish their KV layout on the bootstrap server
   (``/kvstage/layout``, beside SGLang's ``/route``). A decode rank reads it
   once per prefill engine and opens a kvstage ``Destination`` for it.
2. Decode ``send_metadata``: ``Destination.expect(room, its pages)``, then a
   ``KVSTAGE_ROOM`` message to **every** prefill rank with its Destination's
   address, page count, metadata row and state rows (kvstage's plan, not
   SGLang's rank mapping, decides who writes where).
3. Prefill: once the last chunk is queued and every decode rank's message is
   in, ``Source.send(room, its pages)`` (one ``Source`` per decode engine).
   The first writer of each decode rank sends it the metadata row (and, at
   equal TP, the state rows) in a ``KVSTAGE_AUX`` message.
4. Decode Success = its ``Destination`` handle DONE (scattered) and the aux
   row written. Prefill Success = its ``Source`` handle DONE (writes landed).
   A failure anywhere aborts the kvstage request on both sides and travels as
   SGLang's ``KV_STATUS`` / ``ABORT`` messages, so both schedulers see Failed
   with the cause in ``failure_exception()``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import requests
import torch

from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import (
    ABORT_TAG,
    AbortNotification,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.runtime_context import get_device, get_disagg, get_parallel, get_serving
from sglang.srt.utils.network import NetworkAddress

from kvstage.config import Settings
from kvstage.errors import ConfigError
from kvstage.plugin.sglang.layout import RowBuffers, SglangKVLayout, decode_spec, kv_buffers, prefill_layout
from kvstage.protocol.request import State
from kvstage.staging.cache import RankCache
from kvstage.tp import SideSpec, plan

log = logging.getLogger("kvstage.sglang")

ROOM_TAG = b"KVSTAGE_ROOM"
AUX_TAG = b"KVSTAGE_AUX"
HELLO_TAG = b"KVSTAGE_HELLO"
LAYOUT_ROUTE = "/kvstage/layout"
MAX_FAILED_ROOMS = 4096  # failed rooms remembered so a late decode message is answered Failed


def settings_for(mode: DisaggregationMode) -> Settings:
    """kvstage Settings, with SGLang's staging variables mapped where they mean the same.

    ``SGLANG_DISAGG_STAGING_POOL_SIZE_MB`` is the decode side's staging memory
    registered with the transport: kvstage's destination arena (``arena_mb``),
    unless ``KVSTAGE_ARENA_MB`` is set. docs/sglang.md has the table."""
    kw = {}
    pool = os.environ.get("SGLANG_DISAGG_STAGING_POOL_SIZE_MB")
    if mode == DisaggregationMode.DECODE and pool and not os.environ.get("KVSTAGE_ARENA_MB"):
        try:
            kw["arena_mb"] = float(pool)
        except ValueError:
            raise ConfigError(f"SGLANG_DISAGG_STAGING_POOL_SIZE_MB={pool!r}: must be a number of MiB") from None
    return Settings(**kw)


def check_supported(mode: DisaggregationMode) -> None:
    """Refuse, naming the setting, what this backend does not implement."""
    flag = os.environ.get("SGLANG_DISAGG_STAGING_BUFFER", "")
    if flag.lower() in ("1", "true", "yes", "on"):
        raise ConfigError(
            f"SGLANG_DISAGG_STAGING_BUFFER={flag}: that switches on SGLang's own staging machinery, which the kvstage "
            "backend replaces; kvstage stages heterogeneous TP by itself. Unset it (KVSTAGE_ARENA_MB sizes "
            "kvstage's staging)")
    par = get_parallel()
    for name in ("pp_size", "attn_cp_size", "attn_dcp_size"):
        value = getattr(par, name, 1)
        if value != 1:
            raise ConfigError(f"{name}={value}: the kvstage backend supports tensor parallelism (and attention DP) "
                              "only; pipeline and context parallelism need another backend")
    if getattr(par, "enable_kv_cache_sharding", False):
        raise ConfigError("enable_kv_cache_sharding=True: not supported by the kvstage backend")
    policy = get_disagg().disaggregation_decode_allocation_policy
    if policy != "early":
        raise ConfigError(f"disaggregation_decode_allocation_policy={policy!r}: the kvstage backend implements 'early'")


def _device(kv_args) -> torch.device:
    kind = str(get_device().device)
    return torch.device(kind, int(kv_args.gpu_id)) if kind == "cuda" else torch.device(kind)


def _rows_of(states, indices) -> list:
    """State components that carry rows for this request: (component, rows)."""
    out = []
    for c, ix in enumerate(indices or []):
        if ix is not None and len(ix) and c < len(states):
            out.append((c, [int(x) for x in np.asarray(ix).reshape(-1)]))
    return out


# -- per-room bookkeeping --------------------------------------------------------------------

@dataclass
class _Outgoing:
    """A room on a prefill rank."""

    pages: list = field(default_factory=list)  # page index arrays, in chunk order
    npages: int = 0
    complete: bool = False  # last chunk queued
    aux: list | None = None  # snapshot of this rank's metadata row (frames)
    state: dict = field(default_factory=dict)  # component -> frames (snapshot)
    peers: dict = field(default_factory=dict)  # decode rank -> its KVSTAGE_ROOM header
    started: bool = False
    handle: object = None  # kvstage TransferHandle (None: nothing to write)
    sent: bool = False  # send() issued and aux rows sent
    failed: str | None = None
    concluded: bool = False

    def status_targets(self) -> list:
        return [tuple(h["status"]) for _, h in sorted(self.peers.items())]


@dataclass
class _Incoming:
    """A room on a decode rank."""

    handle: object  # kvstage TransferHandle, None when no page is transferred
    aux_index: int
    state: list  # (component, rows) this rank expects
    aux_done: bool = False


# -- manager -----------------------------------------------------------------------------------

class KVStageManager(CommonKVManager):
    """One per scheduler rank: owns this rank's kvstage endpoints and control threads."""

    kv_status_msg_tag = b"KV_STATUS"
    kv_status_msg_carries_reason = True

    def __init__(self, args, disaggregation_mode: DisaggregationMode, server_args, is_mla_backend: Optional[bool] = False):
        check_supported(disaggregation_mode)
        self.mla = bool(is_mla_backend)
        self.device = _device(args)
        self.settings = settings_for(disaggregation_mode)
        self._lock = threading.Lock()
        self._connect_lock = threading.Lock()
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.layout = prefill_layout(args, self.mla)  # published by register_to_bootstrap below
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.aux = RowBuffers.of(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens, torch.device("cpu"))
        self.states = [RowBuffers.of(p, n, i, self.device) for p, n, i in
                       zip(args.state_data_ptrs or [], args.state_data_lens or [], args.state_item_lens or [])]
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvstage-sglang")
        if disaggregation_mode == DisaggregationMode.PREFILL:
            spec = self.layout.spec(self.attn_tp_size)
            self.cache = RankCache(spec, self.attn_tp_rank, kv_buffers(args, spec, self.device))
            self._rooms: dict[int, _Outgoing] = {}
            self._failed: collections.OrderedDict[int, str] = collections.OrderedDict()
            self._sources: dict[tuple, object] = {}  # decode Destination addresses -> Source
            threading.Thread(target=self._serve, args=(self._on_decode_message,), daemon=True,
                             name="kvstage-sglang-prefill").start()
        else:
            self._dsts: dict[str, object] = {}  # prefill bootstrap address -> Destination
            self._incoming: dict[int, _Incoming] = {}
            threading.Thread(target=self._serve, args=(self._on_prefill_message,), daemon=True,
                             name="kvstage-sglang-decode").start()
            self._start_heartbeat_checker_thread()

    def _serve(self, handler) -> None:
        while True:
            msg = self.server_socket.recv_multipart()
            try:
                handler(msg)
            except Exception:  # one malformed message must not stop the control thread
                log.exception("kvstage: control message %r dropped", msg[:1])

    # -- bootstrap server: the layout route ---------------------------------------------------
    def register_to_bootstrap(self):
        """Publish this prefill rank's KV layout next to SGLang's registration (which follows)."""
        host = (NetworkAddress.parse(self.dist_init_addr).resolved().host if self.dist_init_addr
                else {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.bootstrap_host, self.bootstrap_host))
        url = NetworkAddress(host, self.bootstrap_port).to_url() + LAYOUT_ROUTE
        body = {"dp": self.attn_dp_rank, "rank": self.attn_tp_rank, "layout": self.layout.to_wire()}
        for attempt in range(10):
            try:
                r = requests.put(url, json=body, timeout=5)
                if r.status_code == 200:
                    break
                raise ConfigError(f"bootstrap server refused this prefill rank's kvstage layout: {r.status_code} {r.text}")
            except requests.RequestException as e:
                if attempt == 9:
                    log.error("kvstage: could not publish the KV layout to %s: %s", url, e)
                time.sleep(0.5)
        super().register_to_bootstrap()

    # -- prefill side ----------------------------------------------------------------------------
    def add_transfer_request(self, bootstrap_room: int, kv_indices, index_slice: slice, is_last_chunk: bool,
                             aux_index: Optional[int] = None, state_indices=None, **_):
        if self.cache.device.type == "cuda":  # the forward that wrote these pages must have finished
            torch.cuda.current_stream(self.cache.device).synchronize()
        with self._lock:
            out = self._rooms.setdefault(bootstrap_room, _Outgoing())
            if out.failed or out.complete:
                return
            start = index_slice.start or 0
            if start != out.npages:
                return self._fail_locked(bootstrap_room, out, f"chunk starts at page {start}, {out.npages} queued before")
            out.pages.append(np.asarray(kv_indices, dtype=np.int64).reshape(-1))
            out.npages += len(out.pages[-1])
            if not is_last_chunk:
                return
            out.complete = True
            try:
                if aux_index is None:
                    raise ConfigError("the last chunk came without its metadata row (aux_index)")
                out.aux = self.aux.read([aux_index])
                out.state = {c: self.states[c].read(rows) for c, rows in _rows_of(self.states, state_indices)}
            except Exception as e:
                return self._fail_locked(bootstrap_room, out, f"reading the metadata/state rows: {e}")
            self._maybe_start_locked(bootstrap_room, out)

    def _on_decode_message(self, msg: list) -> None:
        tag = msg[0]
        if tag == HELLO_TAG:
            return
        if tag == ABORT_TAG:
            note = AbortNotification.from_zmq(msg)
            if note is not None:
                self.fail_room(note.room, "the decode aborted the request (abort or its waiting timeout)")
            return
        if tag != ROOM_TAG:
            log.warning("kvstage: prefill rank %d ignored a message tagged %r", self.attn_tp_rank, tag[:20])
            return
        room, header = int(msg[1]), json.loads(msg[2])
        with self._lock:
            reason = self._failed.get(room)
            if reason is not None:
                targets = [tuple(header["status"])]
            else:
                out = self._rooms.setdefault(room, _Outgoing())
                out.peers[int(header["rank"])] = header
                if len(out.peers) == int(header["tp"]):
                    self.req_to_decode_prefix_len[room] = int(header.get("prefix_len") or 0)
                    if room in self.request_status:
                        self.update_status(room, KVPoll.WaitingForInput)
                self._maybe_start_locked(room, out)
        if reason is not None:
            self.send_kv_status_message(targets=targets, bootstrap_room=room, status=KVPoll.Failed, failure_reason=reason)

    def sender_created(self, room: int) -> None:
        """A Sender exists now: if every decode rank already called in, the room may proceed."""
        with self._lock:
            out = self._rooms.get(room)
            if out is not None and out.peers and len(out.peers) == int(next(iter(out.peers.values()))["tp"]):
                self.update_status(room, KVPoll.WaitingForInput)

    def _maybe_start_locked(self, room: int, out: _Outgoing) -> None:
        if out.started or out.failed or not out.complete or not out.peers:
            return
        tp = int(next(iter(out.peers.values()))["tp"])
        if len(out.peers) < tp:
            return
        out.started = True
        self._pool.submit(self._start, room, out)

    def _start(self, room: int, out: _Outgoing) -> None:
        """Connect (once per decode engine), send the pages, send the metadata rows (pool thread)."""
        try:
            peers = [out.peers[d] for d in range(len(out.peers))]
            pages = np.concatenate(out.pages) if out.pages else np.zeros(0, dtype=np.int64)
            want = {int(h["pages"]) for h in peers}
            if want != {len(pages)}:
                raise ConfigError(f"the decode ranks allocated {sorted(want)} pages, this prefill rank holds {len(pages)}")
            if out.state and len(peers) != self.attn_tp_size:  # refused before any byte moves
                raise ConfigError(f"state buffers (mamba/SWA/...) with prefill TP {self.attn_tp_size} and decode TP "
                                  f"{len(peers)}: the kvstage backend moves state rows at equal TP only")
            # the same plan the endpoints will agree on: a rank that writes nothing (MLA, replicated
            # heads) finishes here, without waiting for any decode rank
            spec = self.cache.spec
            p = plan(spec, SideSpec(spec.geometry, len(peers), spec.page))
            handle = None
            if p.targets_of(self.attn_tp_rank):
                src = self._source(tuple(tuple(h["dst"]) for h in peers))
                if len(pages):
                    handle = src.send(str(room), pages, len(pages) * spec.page.page_size)
            with self._lock:
                out.handle = handle
            if handle is not None:
                self.update_status(room, KVPoll.Transferring)
            for d, h in enumerate(peers):
                if p.writers_of(d)[0].src_rank == self.attn_tp_rank:  # the first writer sends the rows
                    self._send_aux(room, out, h)
            with self._lock:
                out.sent = True
        except Exception as e:
            self.fail_room(room, f"prefill rank {self.attn_tp_rank}: {type(e).__name__}: {e}")

    def _send_aux(self, room: int, out: _Outgoing, header: dict) -> None:
        frames, parts = [], []
        if out.state:  # equal TP (checked in _start): this rank's rows are the decode rank's
            want = {int(c): rows for c, rows in header.get("state") or []}
            for c, data in sorted(out.state.items()):
                if c not in want:
                    raise ConfigError(f"state component {c}: this prefill rank has rows, decode rank {header['rank']} expects none")
                parts.append([c, want[c], len(data)])
                frames += data
        meta = {"aux_index": header["aux_index"], "aux": len(out.aux), "state": parts}
        msg = [AUX_TAG, str(room).encode(), str(self.attn_tp_rank).encode(), json.dumps(meta).encode()] + out.aux + frames
        na = NetworkAddress(*header["status"])
        self._send_multipart_locked(na.to_tcp(), msg, is_ipv6=na.is_ipv6)

    def _source(self, addrs: tuple):
        """This rank's kvstage Source to one decode engine's Destinations."""
        from kvstage.protocol.source import Source

        with self._connect_lock:  # one Source per decode engine, even when rooms start together
            for key, s in list(self._sources.items()):  # decode engines that went away
                if s.plan is not None and not s.targets:
                    s.close()
                    del self._sources[key]
            src = self._sources.get(addrs)
            if src is None:
                src = Source(self.cache, self.settings)
                try:
                    src.connect([tuple(a) for a in addrs])
                except BaseException:
                    src.close()
                    raise
                self._sources[addrs] = src
            return src

    def conclude_if_done(self, room: int) -> None:
        """Sender.poll: report Success once the writes landed and the rows were sent, Failed on failure."""
        with self._lock:
            out = self._rooms.get(room)
            if out is None or out.concluded or not out.sent:
                return
            h = out.handle
            if h is not None and not h.done():
                return
            out.concluded = True
            targets = out.status_targets()
        if h is None or h.state is State.DONE:
            self.conclude_transfer(bootstrap_room=room, status=KVPoll.Success, targets=targets)
        else:
            self.fail_room(room, str(h.error))

    def fail_room(self, room: int, reason: str) -> None:
        with self._lock:
            self._fail_locked(room, self._rooms.get(room), reason)

    def _fail_locked(self, room: int, out: _Outgoing | None, reason: str) -> None:
        """Abort the kvstage request, mark the room Failed and tell the decode ranks known so far.
        The room stays remembered as failed, so a decode rank calling in later is told too."""
        if out is None:
            self._failed.setdefault(room, reason)
            while len(self._failed) > MAX_FAILED_ROOMS:
                self._failed.popitem(last=False)
            return
        first = out.failed is None
        out.failed = out.failed or reason
        out.concluded = True
        self._failed[room] = out.failed
        while len(self._failed) > MAX_FAILED_ROOMS:
            self._failed.popitem(last=False)
        if out.handle is not None and not out.handle.done():
            out.handle.abort(reason)
        if not first:
            return
        log.warning("kvstage: prefill rank %d, room %d failed: %s", self.attn_tp_rank, room, reason)
        targets = out.status_targets()
        self._pool.submit(self._tell_failed, room, reason, targets)

    def _tell_failed(self, room: int, reason: str, targets: list) -> None:
        if room in self.request_status:
            self.conclude_failure(bootstrap_room=room, failure_reason=reason, targets=targets)
        else:
            self.send_kv_status_message(targets=targets, bootstrap_room=room, status=KVPoll.Failed, failure_reason=reason)

    def forget_room(self, room: int) -> None:
        with self._lock:
            out = self._rooms.pop(room, None)
        if out is not None and out.handle is not None and not out.handle.done():
            out.handle.abort("the prefill request was cleared")

    # -- decode side -----------------------------------------------------------------------------
    def _resolve_rank_mapping(self, info) -> None:
        """Every decode rank talks to every prefill rank: kvstage's plan decides who writes where."""
        super()._resolve_rank_mapping(info)
        info.target_tp_rank = None
        info.target_tp_ranks = list(range(info.attn_tp_size))
        info.required_dst_info_num = self.attn_tp_size
        info.required_prefill_response_num = info.attn_tp_size

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        if not super().try_ensure_parallel_info(bootstrap_addr):
            return False
        if bootstrap_addr in self._dsts:
            return True
        r = requests.get(f"http://{bootstrap_addr}{LAYOUT_ROUTE}", timeout=5)
        if r.status_code == 503:
            return False
        if r.status_code != 200:
            raise ConfigError(f"the prefill at {bootstrap_addr} serves no kvstage layout ({r.status_code} {r.text[:200]}): "
                              "start it with --disaggregation-transfer-backend kvstage too")
        from kvstage.protocol.destination import Destination

        spec = decode_spec(self.kv_args, self.mla, SglangKVLayout.from_wire(r.json()), self.attn_tp_size)
        cache = RankCache(spec, self.attn_tp_rank, kv_buffers(self.kv_args, spec, self.device))
        dst = Destination(cache, self.settings, listen=(self.local_ip, 0))
        with self._lock:
            self._dsts[bootstrap_addr] = dst
        log.info("kvstage: decode rank %d receives from prefill %s on %s:%d", self.attn_tp_rank, bootstrap_addr, *dst.address)
        return True

    def expect(self, bootstrap_addr: str, room: int, kv_indices, aux_index: int, state_indices) -> tuple:
        """Open the kvstage request for ``room``; return the header every prefill rank gets."""
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        dst = self._dsts[bootstrap_addr]
        handle = dst.expect(str(room), pages, len(pages) * self.kv_args.page_size) if len(pages) else None
        state = _rows_of(self.states, state_indices)
        with self._lock:
            self._incoming[room] = _Incoming(handle, int(aux_index), state)
        return {"tp": self.attn_tp_size, "rank": self.attn_tp_rank, "dst": list(dst.address),
                "status": [self.local_ip, self.rank_port], "aux_index": int(aux_index), "pages": len(pages),
                "state": state}

    def check_room(self, room: int) -> None:
        """Receiver.poll: Success once scattered and the metadata row landed; Failed on failure."""
        with self._lock:
            inc = self._incoming.get(room)
        if inc is None:
            return
        h = inc.handle
        if h is not None and h.state is State.FAILED:
            self.first_failure(room, str(h.error))
            self.update_status(room, KVPoll.Failed)
        elif (h is None or h.state is State.DONE) and inc.aux_done:
            self.update_status(room, KVPoll.Success)
        elif h is not None and h.state is State.TRANSFERRING:
            self.update_status(room, KVPoll.Transferring)

    def abort_incoming(self, room: int, reason: str, forget: bool = False) -> None:
        with self._lock:
            inc = self._incoming.pop(room, None) if forget else self._incoming.get(room)
        if inc is not None and inc.handle is not None and not inc.handle.done():
            inc.handle.abort(reason)

    def _on_prefill_message(self, msg: list) -> None:
        if self.handle_abort_ack_message(msg):
            return
        if msg[0] == AUX_TAG:
            return self._on_aux(msg)
        parsed = self.parse_kv_status_message(msg)
        if parsed is None:
            log.warning("kvstage: decode rank %d ignored a message tagged %r", self.attn_tp_rank, msg[0][:20])
            return
        room, status, prefill_rank, reason = parsed
        if status == KVPoll.Failed and room in self.request_status:
            reason = f"prefill rank {prefill_rank}: {reason or self.DEFAULT_PREFILL_FAILURE_REASON}"
            self.first_failure(room, reason)
            self.update_status(room, KVPoll.Failed)
            self.abort_incoming(room, reason)

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
                return  # cleared, or a stale message for an earlier use of this room
            try:
                n = int(meta["aux"])
                self.aux.write([inc.aux_index], frames[:n])
                at = n
                want = dict(inc.state)
                got = {}
                for c, rows, count in meta["state"]:
                    if want.get(c) != rows:
                        raise ConfigError(f"state component {c}: rows {rows} received, this rank expects {want.get(c)}")
                    self.states[c].write(rows, frames[at:at + count])
                    at += count
                    got[c] = rows
                if got != want:
                    raise ConfigError(f"state components {sorted(set(want) - set(got))} expected, not received")
                inc.aux_done = True
                return
            except Exception as e:
                reason = f"metadata/state rows from prefill rank {msg[2].decode()}: {e}"
        self.first_failure(room, reason)
        self.update_status(room, KVPoll.Failed)
        self.abort_incoming(room, reason)


# -- sender (prefill) ----------------------------------------------------------------------------

class KVStageSender(CommonKVSender):
    def __init__(self, mgr: KVStageManager, bootstrap_addr: str, bootstrap_room: int, *args, **kwargs):
        super().__init__(mgr, bootstrap_addr, bootstrap_room, *args, **kwargs)
        mgr.sender_created(bootstrap_room)

    def poll(self) -> KVPoll:
        self.kv_mgr.conclude_if_done(self.bootstrap_room)
        status = super().poll()
        if status == KVPoll.Failed:
            with self.kv_mgr.failure_lock:
                reason = self.kv_mgr.failure_records.get(self.bootstrap_room)
            self.kv_mgr.fail_room(self.bootstrap_room, reason or "failed on another prefill rank")
        return status

    def abort(self):
        super().abort()
        self.kv_mgr.fail_room(self.bootstrap_room, "the prefill aborted the request")

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.forget_room(self.bootstrap_room)


# -- receiver (decode) ---------------------------------------------------------------------------

class KVStageReceiver(CommonKVReceiver):
    def send_metadata(self, kv_indices, aux_index: Optional[int] = None, state_indices=None,
                      decode_prefix_len: Optional[int] = None,
                      destination: KVTransferDestination = KVTransferDestination.DEVICE, device_kv_indices=None):
        mgr: KVStageManager = self.kv_mgr
        if self.conclude_state == KVPoll.Failed:
            return
        if destination != KVTransferDestination.DEVICE:
            raise NotImplementedError("Host KV destinations are not supported")
        if getattr(self, "bootstrap_infos", None) is None:
            mgr.record_failure(self.bootstrap_room, f"Could not fetch prefill parallel info from bootstrap_addr: {self.bootstrap_addr}")
            mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            return
        try:
            header = mgr.expect(self.bootstrap_addr, self.bootstrap_room, kv_indices, aux_index, state_indices)
        except Exception as e:
            mgr.record_failure(self.bootstrap_room, f"kvstage could not receive into this rank: {type(e).__name__}: {e}")
            mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            return
        header["prefix_len"] = int(decode_prefix_len or 0)
        message = [ROOM_TAG, str(self.bootstrap_room).encode(), json.dumps(header).encode()]
        for info in self.bootstrap_infos:
            if not self._send_bootstrap_message(bootstrap_info=info, message=message, operation="send_metadata"):
                self.invalidate_cached_bootstrap_infos()
                mgr.abort_incoming(self.bootstrap_room, "could not reach a prefill rank")
                return
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
        super().abort()
        self.kv_mgr.abort_incoming(self.bootstrap_room, "the decode aborted the request")

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.abort_incoming(self.bootstrap_room, "the decode request was cleared", forget=True)


# -- bootstrap server ----------------------------------------------------------------------------

class KVStageBootstrapServer(CommonKVBootstrapServer):
    """SGLang's bootstrap server plus ``/kvstage/layout``: the prefill ranks' KV layout."""

    def _setup_routes(self):
        super()._setup_routes()
        self.app.router.add_route("*", LAYOUT_ROUTE, self._handle_kvstage_layout)

    async def _handle_kvstage_layout(self, request):
        from aiohttp import web

        layouts = self.__dict__.setdefault("_kvstage_layouts", {})
        if request.method == "PUT":
            data = await request.json()
            layout = data.get("layout")
            other = next(iter(layouts.values()), None)
            if other is not None and other != layout:
                return web.Response(status=400, text=f"prefill rank {data.get('rank')} publishes KV layout {layout}, "
                                                     f"another rank published {other}")
            layouts[(data.get("dp"), data.get("rank"))] = layout
            return web.Response(text="OK", status=200)
        if request.method == "GET":
            if not layouts:
                return web.Response(status=503, text="no prefill rank has published its kvstage layout yet")
            return web.json_response(next(iter(layouts.values())))
        return web.Response(status=405, text="Method not allowed")
