"""The SGLang backend's prefill side: a prefill rank's one kvstage ``Source`` and its rooms.

A room is sent chunk by chunk as SGLang queues each one (its forward ended), once every decode rank
of the room has called in (``KVSTAGE_ROOM``); after the last chunk the first writer of each decode
rank sends it the metadata row (``KVSTAGE_AUX``). ``_fail_locked`` is the one place a room fails:
it aborts the kvstage requests, tells the decode ranks, logs and counts it. ``KVStageSender`` is
what SGLang's prefill scheduler holds per request.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import requests
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification, CommonKVSender
from sglang.srt.utils.network import NetworkAddress

from kvstage.errors import ConfigError
from kvstage.plugin.sglang.layout import SglangKVLayout, kv_buffers
from kvstage.plugin.sglang.shared import (
    AUX_TAG,
    HELLO_TAG,
    LAYOUT_ROUTE,
    MAX_FAILED_ROOMS,
    ROOM_TAG,
    ManagerBase,
    log,
    prefill_engine_id,
    rows_of,
)
from kvstage.protocol.request import State, TransferHandle
from kvstage.staging.cache import RankCache
from kvstage.tp import SideSpec, plan

if TYPE_CHECKING:
    from kvstage.protocol.source import Source


#: each chunk of a chunked prefill leaves as its forward ends, read by the decode while the next chunk
#: computes; ``False`` holds every chunk until the last (benchmarks/sglang_streaming.py measures both)
STREAM_CHUNKS = True


@dataclass
class _Outgoing:
    """A room on a prefill rank."""

    pages: list = field(default_factory=list)  # page index arrays, in chunk order
    npages: int = 0
    complete: bool = False  # last chunk queued
    chunks_sent: int = 0  # chunks sent so far, each as a token span of the room (``Source.send(span=)``)
    handles: list[TransferHandle] = field(default_factory=list)  # the chunks sent, in order
    # (engine, peers, writes) once the room may be sent: its decode ranks are connected
    ready: tuple[str, list[dict], bool] | None = None
    sending: bool = False  # a pool thread sends its chunks now
    aux: list = field(default_factory=list)  # snapshot of this rank's metadata row (frames), with the last chunk
    state: dict = field(default_factory=dict)  # component -> frames (snapshot)
    peers: dict[int, dict] = field(default_factory=dict)  # decode rank -> its KVSTAGE_ROOM header
    sent: bool = False  # every chunk sent and the aux rows sent
    failed: str | None = None
    concluded: bool = False

    def status_targets(self) -> list[tuple]:
        return [tuple(h["status"]) for _, h in sorted(self.peers.items())]


class PrefillManager(ManagerBase):
    """The manager's prefill-side methods (a mixin of ``conn.KVStageManager``): SGLang calls them
    on a prefill rank only, and the control thread hands them the decode ranks' messages."""

    layout: SglangKVLayout  # this rank's KV layout, published on the bootstrap server
    cache: RankCache
    src: Source  # this rank's one kvstage endpoint: it sends to every decode engine
    _rooms: dict[int, _Outgoing]
    _failed: collections.OrderedDict[int, str]  # room -> why it failed (the last MAX_FAILED_ROOMS)

    def _start_prefill(self, args) -> None:
        """The prefill half of ``__init__``, after SGLang's: this rank's Source and its control thread."""
        spec = self.layout.spec(self.attn_tp_size)
        self.cache = RankCache(spec, self.attn_tp_rank, kv_buffers(args, spec, self.device))
        self._rooms = {}
        self._failed = collections.OrderedDict()
        from kvstage.protocol.source import Source

        self.src = self._registered(Source(self.cache, self.settings, engine=self.engine_id, model=self.model))
        log.info(
            "kvstage: prefill rank %d of engine %r sends to every decode engine (model %s)",
            self.attn_tp_rank,
            self.engine_id,
            self.model,
        )
        threading.Thread(
            target=self._serve, args=(self._on_decode_message,), daemon=True, name="kvstage-sglang-prefill"
        ).start()

    def register_to_bootstrap(self):
        """Publish this prefill rank's KV layout next to SGLang's registration (which follows)."""
        host = (
            NetworkAddress.parse(self.dist_init_addr).resolved().host
            if self.dist_init_addr
            else {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.bootstrap_host, self.bootstrap_host)
        )
        url = NetworkAddress(host, self.bootstrap_port).to_url() + LAYOUT_ROUTE
        self.engine_id = prefill_engine_id(host, self.bootstrap_port, self.attn_dp_rank)
        body = {
            "dp": self.attn_dp_rank,
            "rank": self.attn_tp_rank,
            "layout": self.layout.to_wire(),
            "engine": self.engine_id,
        }
        for attempt in range(10):
            try:
                r = requests.put(url, json=body, timeout=5)
                if r.status_code == 200:
                    break
                raise ConfigError(
                    f"bootstrap server refused this prefill rank's kvstage layout: {r.status_code} {r.text}"
                )
            except requests.RequestException as e:
                if attempt == 9:
                    log.error("kvstage: could not publish the KV layout to %s: %s", url, e)
                time.sleep(0.5)
        super().register_to_bootstrap()

    # -- rooms --------------------------------------------------------------------------------------
    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices,
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: int | None = None,
        state_indices=None,
        **_,
    ):
        if self.cache.device.type == "cuda":  # the forward that wrote these pages must have finished
            torch.cuda.current_stream(self.cache.device).synchronize()
        with self._lock:
            out = self._rooms.setdefault(bootstrap_room, _Outgoing())
            if out.failed or out.complete:
                return
            start = index_slice.start or 0
            if start != out.npages:
                return self._fail_locked(
                    bootstrap_room, out, f"chunk starts at page {start}, {out.npages} queued before"
                )
            pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
            if out.pages and not STREAM_CHUNKS:  # held: the room leaves as one span after its last chunk
                out.pages[-1] = np.concatenate([out.pages[-1], pages])
            else:
                out.pages.append(pages)
            out.npages += len(pages)
            if not is_last_chunk:
                if STREAM_CHUNKS:  # the chunk moves now, while the next one's forward runs
                    self._maybe_send_locked(bootstrap_room, out)
                return
            out.complete = True
            try:
                if aux_index is None:
                    raise ConfigError("the last chunk came without its metadata row (aux_index)")
                out.aux = self.aux.read([aux_index])
                out.state = {c: self.states[c].read(rows) for c, rows in rows_of(self.states, state_indices)}
            except Exception as e:
                return self._fail_locked(bootstrap_room, out, f"reading the metadata/state rows: {e}")
            self._maybe_send_locked(bootstrap_room, out)

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
        if header.get("failed"):  # this decode rank cannot receive the room
            with self._lock:
                out = self._rooms.setdefault(room, _Outgoing())
                out.peers[int(header["rank"])] = header
                self._fail_locked(room, out, f"decode rank {header.get('rank')}: {header['failed']}")
            return
        log.debug(
            "kvstage: prefill rank %d, room %d: decode rank %s of %s called in (%s pages)",
            self.attn_tp_rank,
            room,
            header.get("rank"),
            header.get("tp"),
            header.get("pages"),
        )
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
                self._maybe_send_locked(room, out)
        if reason is not None:
            self.send_kv_status_message(
                targets=targets, bootstrap_room=room, status=KVPoll.Failed, failure_reason=reason
            )

    def sender_created(self, room: int) -> None:
        """A Sender exists now: if every decode rank already called in, the room may proceed."""
        with self._lock:
            out = self._rooms.get(room)
            failed = out.failed if out is not None else None
            if (
                failed is None
                and out is not None
                and out.peers
                and len(out.peers) == int(next(iter(out.peers.values()))["tp"])
            ):
                self.update_status(room, KVPoll.WaitingForInput)
        if failed is not None:  # a decode rank failed it before this Sender existed
            self.record_failure(room, failed)
            self.update_status(room, KVPoll.Failed)

    def _maybe_send_locked(self, room: int, out: _Outgoing) -> None:
        """Once every decode rank called in: send the chunks queued and not sent yet, on a pool thread (one
        per room at a time); the metadata rows follow the last chunk."""
        if out.failed or out.sending or out.sent or not out.peers or not out.pages:
            return
        tp = int(next(iter(out.peers.values()))["tp"])
        if len(out.peers) < tp or (out.chunks_sent == len(out.pages) and not out.complete):
            return
        out.sending = True
        self._pool.submit(self._send_chunks, room, out)

    def _send_chunks(self, room: int, out: _Outgoing) -> None:
        """Send every queued chunk not sent yet as its token span of the room, then (after the last) the
        metadata rows (pool thread)."""
        try:
            if out.ready is None:
                out.ready = self._connect_room(room, out)
            engine, peers, writes = out.ready
            size = self.cache.spec.page.page_size
            total = int(peers[0]["pages"]) * size
            while True:
                with self._lock:
                    if out.failed or out.chunks_sent == len(out.pages):
                        complete = out.complete and not out.failed
                        out.sending = False
                        break
                    k = out.chunks_sent
                    start, chunk = sum(len(p) for p in out.pages[:k]), out.pages[k]
                    last = out.complete and k == len(out.pages) - 1
                if last and start + len(chunk) != total // size:
                    raise ConfigError(
                        f"the decode ranks allocated {total // size} pages, this prefill rank holds "
                        f"{start + len(chunk)}"
                    )
                if writes and len(chunk):
                    stop = total if last else (start + len(chunk)) * size
                    h = self.src.send(str(room), chunk, total, engine=engine, span=range(start * size, stop))
                    with self._lock:
                        out.handles.append(h)
                    if len(out.handles) == 1:
                        self.update_status(room, KVPoll.Transferring)
                with self._lock:
                    out.chunks_sent = k + 1
            if not complete:
                return
            log.debug(
                "kvstage: prefill rank %d, room %d: %s %d pages to decode TP %d in %d chunks",
                self.attn_tp_rank,
                room,
                "sent" if writes else "writes none of",
                out.npages,
                len(peers),
                len(out.pages),
            )
            spec = self.cache.spec
            p = plan(spec, SideSpec(spec.geometry, len(peers), spec.page))
            for d, header in enumerate(peers):
                if p.writers_of(d)[0].src_rank == self.attn_tp_rank:  # the first writer sends the rows
                    self._send_aux(room, out, header)
            with self._lock:
                out.sent = True
        except Exception as e:
            with self._lock:
                out.sending = False
            self.fail_room(room, f"{type(e).__name__}: {e}")  # the decode names this rank

    def _connect_room(self, room: int, out: _Outgoing) -> tuple:
        """The room's decode engine, its ranks' headers and whether this rank writes to them, once every
        decode rank called in: checked, and connected to (known addresses are reused)."""
        peers = [out.peers[d] for d in range(len(out.peers))]
        want = {int(h["pages"]) for h in peers}
        if len(want) != 1 or (out.complete and want != {out.npages}) or out.npages > max(want):
            raise ConfigError(
                f"the decode ranks allocated {sorted(want)} pages, this prefill rank holds {out.npages}"
                + ("" if out.complete else " so far")
            )
        engines = {str(h.get("engine", "")) for h in peers}
        if len(engines) != 1:
            raise ConfigError(
                f"the decode ranks of room {room} name engines {sorted(engines)}: one engine's ranks share one id"
            )
        # refused before any byte moves: a model with state buffers has state rows in every room, though they
        # come with its last chunk
        if (out.state or self.states) and len(peers) != self.attn_tp_size:
            raise ConfigError(
                f"state buffers (mamba/SWA/...) with prefill TP {self.attn_tp_size} and decode TP "
                f"{len(peers)}: the kvstage backend moves state rows at equal TP only"
            )
        # the same plan the endpoints will agree on: a rank that writes nothing (MLA, replicated heads)
        # finishes here, without waiting for any decode rank
        spec = self.cache.spec
        writes = bool(plan(spec, SideSpec(spec.geometry, len(peers), spec.page)).targets_of(self.attn_tp_rank))
        if writes:
            with self._connect_lock:  # rooms of a new decode engine that start together handshake once
                self.src.connect([h["dst"] for h in peers])  # each decode rank's address, with its secret
        return engines.pop(), peers, writes

    def _send_aux(self, room: int, out: _Outgoing, header: dict) -> None:
        frames, parts = [], []
        if out.state:  # equal TP (checked in _connect_room): this rank's rows are the decode rank's
            want = {int(c): rows for c, rows in header.get("state") or []}
            for c, data in sorted(out.state.items()):
                if c not in want:
                    raise ConfigError(
                        f"state component {c}: this prefill rank has rows, decode rank {header['rank']} expects none"
                    )
                parts.append([c, want[c], len(data)])
                frames += data
        meta = {"aux_index": header["aux_index"], "aux": len(out.aux), "state": parts}
        msg = (
            [AUX_TAG, str(room).encode(), str(self.attn_tp_rank).encode(), json.dumps(meta).encode()] + out.aux + frames
        )
        na = NetworkAddress(*header["status"])
        self._send_multipart_locked(na.to_tcp(), msg, is_ipv6=na.is_ipv6)

    def conclude_if_done(self, room: int) -> None:
        """Sender.poll: report Success once the writes landed and the rows were sent, Failed on failure."""
        with self._lock:
            out = self._rooms.get(room)
            if out is None or out.concluded or not out.sent:
                return
            if not all(h.done() for h in out.handles):
                return
            out.concluded = True
            targets = out.status_targets()
            bad = next((h for h in out.handles if h.state is not State.DONE), None)
        if bad is None:
            log.debug("kvstage: prefill rank %d, room %d: sent", self.attn_tp_rank, room)
            self.conclude_transfer(bootstrap_room=room, status=KVPoll.Success, targets=targets)
        else:
            self.fail_room(room, str(bad.error))

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
        for h in out.handles:
            if not h.done():
                h.abort(reason)
        if not first:
            return
        self._log_and_count(room, out, reason)
        targets = out.status_targets()
        self._pool.submit(self._tell_failed, room, reason, targets)

    def _log_and_count(self, room: int, out: _Outgoing, reason: str) -> None:
        """A failed room's one WARNING and its count in this rank's kvstage metrics, side by side so the two
        agree. The Source counts each chunk of the room that fails there (the aborts above included); a room
        with none (it failed before a chunk was sent, or after all were read) is counted here, once."""
        log.warning("kvstage: prefill rank %d, room %d failed: %s", self.attn_tp_rank, room, reason)
        if any(h.state is not State.DONE for h in out.handles):
            return  # failed in the Source, or aborted just now: the Source counts each
        from kvstage.protocol.common import peer_label

        peer = peer_label(str(next(iter(out.peers.values()), {}).get("engine", "")))  # the decode engine
        self.src.metrics.failure(peer, "other" if out.handles else "start", reason)  # start: before any chunk
        self.src.metrics.request_finished(peer, False, 0.0, 0)

    def _tell_failed(self, room: int, reason: str, targets: list) -> None:
        if room in self.request_status:
            self.conclude_failure(bootstrap_room=room, failure_reason=reason, targets=targets)
        else:
            self.send_kv_status_message(
                targets=targets, bootstrap_room=room, status=KVPoll.Failed, failure_reason=reason
            )

    def forget_room(self, room: int) -> None:
        with self._lock:
            out = self._rooms.pop(room, None)
        for h in out.handles if out is not None else ():
            if not h.done():
                h.abort("the prefill request was cleared")


# -- sender ----------------------------------------------------------------------------------------


class KVStageSender(CommonKVSender):
    """One prefill request, as SGLang's prefill scheduler holds it; the manager does the work."""

    kv_mgr: PrefillManager

    def __init__(self, mgr: PrefillManager, bootstrap_addr: str, bootstrap_room: int, *args, **kwargs):
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
