"""SGLang transfer backend ``kvstage``: manager, sender, receiver, bootstrap server.

They subclass SGLang's Common classes (the schedulers call Common-only members
directly) and translate SGLang's rooms, pages and metadata rows into kvstage
requests; the bytes move with kvstage's planner, staging and NIXL.

Endpoints: one per rank and role, for the engine's life. A prefill rank makes
its one kvstage ``Source`` at start and sends every decode engine's rooms with
it; a decode rank makes its one ``Destination`` when it first reads a prefill's
layout and receives every prefill engine's rooms with it. Engines are told
apart by id: a prefill engine's is its bootstrap address and DP rank (the same
on all its ranks), published with its layout; a decode engine's is the control
address of its attention-TP rank 0, gathered once at start.

One request (a "room"):

1. The prefill ranks publish their KV layout and engine id on the bootstrap
   server (``/kvstage/layout``, beside SGLang's ``/route``). A decode rank
   reads it once per prefill address; the first one sizes its Destination, a
   later one must describe the same per-rank KV, or its rooms fail, saying so.
2. Decode ``send_metadata``: ``Destination.expect(room, its pages, engine=the
   prefill's id)``, then a ``KVSTAGE_ROOM`` message to **every** prefill rank
   with its Destination's address, its engine id, page count, metadata row and
   state rows (kvstage's plan, not SGLang's rank mapping, decides who writes
   where).
3. Prefill: once every decode rank's message is in, ``Source.connect`` (known
   addresses are reused), then each chunk of a chunked prefill is sent as soon
   as it is queued (its forward ended), as its token span of the room:
   ``Source.send(room, its pages, tokens, engine=the decode's id, span=)``; the
   decode reads it while the next chunk computes. After the last chunk, the
   first writer of each decode rank sends it the metadata row (and, at equal
   TP, the state rows) in a ``KVSTAGE_AUX`` message.
4. Decode Success = its ``Destination`` handle DONE (scattered) and the aux
   row written. Prefill Success = every chunk's ``Source`` handle DONE.
   A failure anywhere aborts the kvstage request on both sides and travels as
   SGLang's ``KV_STATUS`` / ``ABORT`` messages, so both schedulers see Failed
   with the cause in ``failure_exception()``.
5. SGLang MIN-all-reduces the polls of a TP group, and each rank then raises
   its own ``failure_exception()``; the client gets rank 0's. So a decode rank
   that fails a room (kvstage's cause, or SGLang's own: a lost prefill, a
   timeout) tells the other decode ranks of its engine the cause
   (``KVSTAGE_CAUSE``) and reports Failed only once each has acknowledged it:
   every decode rank reports the cause, not SGLang's "unknown reason from
   another rank".

Both endpoints carry the model's identity (``model_identity``: path, config,
and a fingerprint of the checkpoint's weights): kvstage's handshake refuses a
peer that serves another model, naming both, or the same path and shapes with
other weights, naming both fingerprints. A decode rank's Destination makes a
secret of its own where no token is set; its ``KVSTAGE_ROOM`` header carries its
address with that secret (``Address.url``), which the prefill presents.
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
from sglang.srt.runtime_context import get_device, get_disagg, get_parallel
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
CAUSE_TAG = b"KVSTAGE_CAUSE"  # decode rank -> the other decode ranks of its engine: why a room failed
CAUSE_ACK_TAG = b"KVSTAGE_CAUSE_ACK"
CAUSE_ACK_TIMEOUT_S = 30.0  # a rank marks its room Failed without every ack after this long (a stopped sibling)
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
            "kvstage's staging)"
        )
    par = get_parallel()
    for name in ("pp_size", "attn_cp_size", "attn_dcp_size"):
        value = getattr(par, name, 1)
        if value != 1:
            raise ConfigError(
                f"{name}={value}: the kvstage backend supports tensor parallelism (and attention DP) "
                "only; pipeline and context parallelism need another backend"
            )
    if getattr(par, "enable_kv_cache_sharding", False):
        raise ConfigError("enable_kv_cache_sharding=True: not supported by the kvstage backend")
    policy = get_disagg().disaggregation_decode_allocation_policy
    if policy != "early":
        raise ConfigError(f"disaggregation_decode_allocation_policy={policy!r}: the kvstage backend implements 'early'")


#: the fields of the model's config that shape its KV or its tokens: hashed into the model identity
CONFIG_FIELDS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "rope_theta",
    "max_position_embeddings",
    "sliding_window",
)


def model_identity(server_args, kv_args, mla: bool) -> str:
    """What kvstage's handshake compares between a prefill and a decode engine: the model's path or
    name and a hash of its config, dtype and KV layout (as vLLM's compatibility hash). KV of another
    model of the same shapes would move and decode wrong tokens; a mismatch is refused by name.
    The config is read from local files only (the engine loaded them already): no network call."""
    import hashlib

    import sglang

    config = None
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(
            server_args.model_path,
            revision=getattr(server_args, "revision", None),
            trust_remote_code=bool(getattr(server_args, "trust_remote_code", False)),
            local_files_only=True,
        )
        text = hf.get_text_config().to_dict()
        config = {k: text.get(k) for k in CONFIG_FIELDS + ("torch_dtype", "dtype")}
    except Exception as e:  # a model path with no config on this host (the class-level harness: "dummy")
        log.info(
            "kvstage: no model config at %r (%s): the model identity is its path and KV layout",
            str(server_args.model_path)[-200:],
            type(e).__name__,
        )
    factors = {
        "sglang": sglang.__version__,
        "model": str(server_args.model_path),
        "config": config,
        "dtype": str(getattr(server_args, "dtype", "")),
        "kv_cache_dtype": str(getattr(kv_args, "kv_cache_dtype_str", "")),
        "page_size": int(kv_args.page_size),
        "kv_buffers": len(kv_args.kv_data_ptrs),
        "mla": bool(mla),
    }
    digest = hashlib.sha256(json.dumps(factors, sort_keys=True, default=str).encode()).hexdigest()[:16]
    from kvstage.plugin.fingerprint import identity_part

    weights = (
        identity_part(str(server_args.model_path), getattr(server_args, "revision", None), log.name)
        if config is not None
        else ""
    )  # the class-level harness's "dummy" model has no checkpoint
    return f"{str(server_args.model_path)[-400:]}#{digest}{weights}"


def prefill_engine_id(host: str, bootstrap_port: int, dp: int) -> str:
    """A prefill engine's id: its bootstrap address and DP rank, the same on all its ranks."""
    return f"sglang-prefill {NetworkAddress(host, bootstrap_port).to_host_port_str()} dp{dp}"


def decode_engine_id(ip: str, port: int) -> str:
    """A decode engine's id: the control address of its attention-TP rank 0."""
    return f"sglang-decode {NetworkAddress(ip, port).to_host_port_str()}"


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
    chunks_sent: int = 0  # chunks sent so far, each as a token span of the room (``Source.send(span=)``)
    handles: list = field(default_factory=list)  # kvstage TransferHandles of the chunks sent
    ready: object = None  # (engine, peers, writes) once the room may be sent: its decode ranks are connected
    sending: bool = False  # a pool thread sends its chunks now
    aux: list | None = None  # snapshot of this rank's metadata row (frames)
    state: dict = field(default_factory=dict)  # component -> frames (snapshot)
    peers: dict = field(default_factory=dict)  # decode rank -> its KVSTAGE_ROOM header
    sent: bool = False  # every chunk sent and the aux rows sent
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


@dataclass
class _Prefill:
    """A prefill engine's bootstrap address as a decode rank knows it (read from ``/kvstage/layout``)."""

    layout: dict  # its published KV layout (wire form)
    engines: dict  # prefill DP rank -> engine id
    refused: str | None = None  # why this decode rank cannot receive from it (its rooms fail with this)


@dataclass
class _Telling:
    """A decode rank's failed room whose cause the other decode ranks are being told."""

    waiting: set  # decode ranks that have not acknowledged the cause yet
    deadline: float  # time.monotonic(): report Failed anyway after this


# -- manager -----------------------------------------------------------------------------------


class KVStageManager(CommonKVManager):
    """One per scheduler rank: owns this rank's one kvstage endpoint (a ``Source`` on a prefill
    rank, a ``Destination`` on a decode rank), which serves every peer engine, and the control
    threads."""

    kv_status_msg_tag = b"KV_STATUS"
    kv_status_msg_carries_reason = True

    def __init__(self, args, disaggregation_mode: DisaggregationMode, server_args, is_mla_backend: bool | None = False):
        check_supported(disaggregation_mode)
        self.mla = bool(is_mla_backend)
        self.device = _device(args)
        self.settings = settings_for(disaggregation_mode)
        self._lock = threading.Lock()
        self._connect_lock = threading.Lock()
        self.model = model_identity(server_args, args, self.mla)
        self.engine_id = ""  # this engine's id (prefill: set by register_to_bootstrap, which publishes it)
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.layout = prefill_layout(args, self.mla)  # published by register_to_bootstrap below
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.aux = RowBuffers.of(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens, torch.device("cpu"))
        self.states = [
            RowBuffers.of(p, n, i, self.device)
            for p, n, i in zip(
                args.state_data_ptrs or [], args.state_data_lens or [], args.state_item_lens or [], strict=False
            )  # SGLang's lists, as it gives them
        ]
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvstage-sglang")
        if disaggregation_mode == DisaggregationMode.PREFILL:
            spec = self.layout.spec(self.attn_tp_size)
            self.cache = RankCache(spec, self.attn_tp_rank, kv_buffers(args, spec, self.device))
            self._rooms: dict[int, _Outgoing] = {}
            self._failed: collections.OrderedDict[int, str] = collections.OrderedDict()
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
        else:
            self.dst = None  # this rank's Destination, made when the first prefill's layout is read
            self._prefills: dict[str, _Prefill] = {}  # prefill bootstrap address -> what it published
            self._incoming: dict[int, _Incoming] = {}
            self._telling: dict[int, _Telling] = {}  # failed rooms, until cleared
            self._siblings, self.engine_id = self._decode_siblings()
            threading.Thread(
                target=self._serve, args=(self._on_prefill_message,), daemon=True, name="kvstage-sglang-decode"
            ).start()
            self._start_heartbeat_checker_thread()

    def _registered(self, ep):
        """``ep`` with the KV pool registered now where a page path may read it (host memory, or equal TP),
        so the first request of a peer engine does not wait for the registration."""
        if self.settings.offers_pages and ep.transport.one_sided:
            ep.kv_regions()
        return ep

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

    # -- prefill side ----------------------------------------------------------------------------
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
            out.pages.append(np.asarray(kv_indices, dtype=np.int64).reshape(-1))
            out.npages += len(out.pages[-1])
            if not is_last_chunk:  # streamed: the chunk moves now, while the next one's forward runs
                self._maybe_send_locked(bootstrap_room, out)
                return
            out.complete = True
            try:
                if aux_index is None:
                    raise ConfigError("the last chunk came without its metadata row (aux_index)")
                out.aux = self.aux.read([aux_index])
                out.state = {c: self.states[c].read(rows) for c, rows in _rows_of(self.states, state_indices)}
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
            for d, h in enumerate(peers):
                if p.writers_of(d)[0].src_rank == self.attn_tp_rank:  # the first writer sends the rows
                    self._send_aux(room, out, h)
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
        if out.state:  # equal TP (checked in _start): this rank's rows are the decode rank's
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
        log.warning("kvstage: prefill rank %d, room %d failed: %s", self.attn_tp_rank, room, reason)
        targets = out.status_targets()
        self._pool.submit(self._tell_failed, room, reason, targets)

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

    # -- decode side -----------------------------------------------------------------------------
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
                *self.dst.address,
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

    def expect(self, bootstrap_addr: str, dp: int, room: int, kv_indices, aux_index: int, state_indices) -> tuple:
        """Open the kvstage request for ``room``; return the header every prefill rank gets."""
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        engine = self.prefill_engine(bootstrap_addr, dp)
        handle = (
            self.dst.expect(str(room), pages, len(pages) * self.kv_args.page_size, engine=engine)
            if len(pages)
            else None
        )
        state = _rows_of(self.states, state_indices)
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
            "dst": self.dst.address.url,
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
            late = told is not None and told.waiting and time.monotonic() > told.deadline
            if late:
                waiting, told.waiting = sorted(told.waiting), set()
        if late:
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
    def send_metadata(
        self,
        kv_indices,
        aux_index: int | None = None,
        state_indices=None,
        decode_prefix_len: int | None = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
        device_kv_indices=None,
    ):
        mgr: KVStageManager = self.kv_mgr
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


# -- bootstrap server ----------------------------------------------------------------------------


class KVStageBootstrapServer(CommonKVBootstrapServer):
    """SGLang's bootstrap server plus ``/kvstage/layout``: the prefill ranks' KV layout and their
    engine id per DP rank."""

    def _setup_routes(self):
        super()._setup_routes()
        self.app.router.add_route("*", LAYOUT_ROUTE, self._handle_kvstage_layout)

    async def _handle_kvstage_layout(self, request):
        from aiohttp import web

        ranks = self.__dict__.setdefault("_kvstage_ranks", {})  # (dp, rank) -> (layout, engine id)
        if request.method == "PUT":
            data = await request.json()
            layout, engine, dp = data.get("layout"), data.get("engine"), data.get("dp")
            if not isinstance(engine, str) or not engine:
                return web.Response(
                    status=400, text=f"prefill rank {data.get('rank')}: engine={engine!r}, must be a non-empty string"
                )
            for (d, r), (other, other_engine) in ranks.items():
                if other != layout:
                    return web.Response(
                        status=400,
                        text=f"prefill rank {data.get('rank')} publishes KV layout "
                        f"{layout}, rank {r} published {other}",
                    )
                if d == dp and other_engine != engine:
                    return web.Response(
                        status=400,
                        text=f"prefill rank {data.get('rank')} of DP rank {dp} publishes "
                        f"engine {engine!r}, rank {r} published {other_engine!r}",
                    )
            ranks[(dp, data.get("rank"))] = (layout, engine)
            return web.Response(text="OK", status=200)
        if request.method == "GET":
            if not ranks:
                return web.Response(status=503, text="no prefill rank has published its kvstage layout yet")
            layout = next(iter(ranks.values()))[0]
            return web.json_response({"layout": layout, "engines": {str(d): e for (d, _), (_, e) in ranks.items()}})
        return web.Response(status=405, text="Method not allowed")
