"""SGLang transfer backend ``kvstage``: manager, sender, receiver, bootstrap server.

This module is the facade SGLang imports (``kvstage.plugin.sglang.kv_class`` looks its four
classes up here); the work is in ``prefill.py``, ``decode.py`` and ``shared.py``, as SGLang splits
its own disaggregation code by role. README.md in this folder gives the reading path.

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

import concurrent.futures
import threading

import torch
from sglang.srt.disaggregation.utils import DisaggregationMode

from kvstage.plugin.sglang.decode import DecodeManager, KVStageReceiver
from kvstage.plugin.sglang.layout import RowBuffers, prefill_layout
from kvstage.plugin.sglang.prefill import KVStageSender, PrefillManager
from kvstage.plugin.sglang.shared import (
    KVStageBootstrapServer,
    check_supported,
    device_of,
    model_identity,
    settings_for,
)

__all__ = ["KVStageBootstrapServer", "KVStageManager", "KVStageReceiver", "KVStageSender"]


class KVStageManager(PrefillManager, DecodeManager):
    """One per scheduler rank: owns this rank's one kvstage endpoint (a ``Source`` on a prefill
    rank, a ``Destination`` on a decode rank), which serves every peer engine, and the control
    threads. Its methods are its role's mixin's (``PrefillManager``, ``DecodeManager``); this
    class only builds what both need, in the order SGLang's ``CommonKVManager`` requires."""

    kv_status_msg_tag = b"KV_STATUS"
    kv_status_msg_carries_reason = True

    def __init__(self, args, disaggregation_mode: DisaggregationMode, server_args, is_mla_backend: bool | None = False):
        check_supported(disaggregation_mode)
        self.mla = bool(is_mla_backend)
        self.device = device_of(args)
        self.settings = settings_for(disaggregation_mode)
        self._lock = threading.Lock()
        self._connect_lock = threading.Lock()
        self.model = model_identity(server_args, args, self.mla)
        self.engine_id = ""  # this engine's id (prefill: set by register_to_bootstrap, which publishes it)
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.layout = prefill_layout(args, self.mla)  # published by register_to_bootstrap, which SGLang's calls
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
            self._start_prefill(args)
        else:
            self._start_decode()
