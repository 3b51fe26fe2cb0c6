"""One SGLang scheduler rank (prefill or decode) driving the kvstage backend the way
SGLang 0.5.23's disaggregation schedulers do, on CPU. Run by tests/test_sglang_backend.py,
one process per rank, ranks of one side in one gloo group:

    python tests/support/sglang_rank.py '<json config>'

Real SGLang components: the runtime config (``ServerArgs`` published), the
plugin loader, ``MHATokenToKVPool`` / ``MLATokenToKVPool`` on CPU,
``MetadataBuffers``, ``get_kv_transfer_buf_infos``, the bootstrap server, the
poll all-reduce functions, and the Common sender/receiver lifecycle. KV pages
and metadata rows hold deterministic bytes per (room, layer, plane, head,
token); the decode rank compares what landed, byte for byte, and prints one
JSON line with its results.

With ``"state": true`` the rank also registers state buffers as a hybrid
model's scheduler does: the pool is SGLang's ``SWAKVPool`` (full-attention
layers move as KV, the SWA sub-pool is a state component) and
``setup_state_kv_args`` fills ``KVArgs.state_*`` from it; a ``MAMBA``
component is appended with ``append_state_component`` in the shape
``MambaPool.get_contiguous_buf_infos`` gives (one tensor per layer and state
field, one row per request slot). ``state_indices`` take SGLang's forms: SWA
window pages from ``kv_to_page_indices``, the mamba slot as a one-element list
of an array. The decode compares its own rows (other pages, another slot) with
the prefill's bytes.

A decode rank may receive from several prefill engines: a request's
``"bootstrap_port"`` names its prefill engine (default: the config's). With
``"report_engines": true`` the decode also reports how many prefill engines its
one kvstage Destination serves. ``"dtype"`` and ``"head_dim"`` set what a
prefill engine serves (another model identity, another KV geometry: refused controls).
``"model_path"`` (default ``"dummy"``, no checkpoint) is the model a rank says it serves: a
checkpoint directory makes its identity cover the weights there (a fingerprint, taken when the
manager starts); with ``"ready_file"`` the rank writes its identity to that file once it has it.

A request with ``"corrupt": true`` has one byte of its KV, of its metadata row
and of each state component changed on the prefill after the bytes the decode
expects are fixed: the decode's comparison must report exactly those.

A prefill rank also reports, under ``"metrics"``, its Source's failed requests and
failures in kvstage's metrics and the rooms its log reported failed, taken together.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the tests folder
from support import sglang_cpu  # noqa: E402

sglang_cpu.install()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

LAYERS, HEAD_DIM, PAGE, POOL_TOKENS = 3, 8, 4, 512
INJECTED = "injected on decode rank 1: its kvstage request aborted"
INJECTED_SGLANG = "injected on decode rank 1: SGLang failed the room (as its heartbeat does for a lost prefill)"
KV_LORA = 24  # MLA latent width (elements)
SWA_LAYERS, SWA_TOKENS, SWA_WINDOW = 2, 256, 8  # "state" runs: sliding-window layers beside the LAYERS full ones
MAMBA_LAYERS, MAMBA_SLOTS = 2, 8  # and a mamba-style state: conv and temporal tensors per layer, a row per slot


def full_kv(room: int, layer: int, plane: int, tokens: int, heads: int, dim: int) -> torch.Tensor:
    """The whole model's KV of one request, layer and plane: bytes [tokens, heads, dim*2] (bf16)."""
    g = torch.Generator().manual_seed((room * 7919 + layer * 31 + plane) % (2**62))
    return torch.randint(0, 256, (tokens, heads, dim * 2), generator=g, dtype=torch.uint8)


def aux_rows(room: int, item_lens: list[int]) -> list[torch.Tensor]:
    """A metadata row per buffer; the last buffer is bootstrap_room, whose first uint64 is the room."""
    g = torch.Generator().manual_seed(room % (2**62) + 17)
    rows = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in item_lens]
    rows[-1][:8] = torch.frombuffer(bytearray(int(room).to_bytes(8, "little")), dtype=torch.uint8)
    return rows


def state_bytes(room: int, comp: int, buf: int, rank: int, rows: int, item: int) -> torch.Tensor:
    """A request's rows of one state buffer (the same on the prefill and decode rank of equal TP)."""
    g = torch.Generator().manual_seed((room * 104729 + comp * 997 + buf * 13 + rank) % (2**62))
    return torch.randint(0, 256, (rows, item), generator=g, dtype=torch.uint8)


def heads_of(total: int, tp: int, rank: int) -> range:
    if tp <= total:
        per = total // tp
        return range(rank * per, (rank + 1) * per)
    return range(rank // (tp // total), rank // (tp // total) + 1)


def main(cfg: dict) -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()  # first, as SGLang's processes do: the names imported below are the hooked ones
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode, KVClassType, MetadataBuffers, TransferBackend, get_kv_class,
        append_state_component, get_kv_transfer_buf_infos, poll_and_all_reduce, setup_state_kv_args,
    )
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.mem_cache.common import kv_to_page_indices
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    role, tp, rank, mla, with_state = cfg["role"], cfg["tp"], cfg["rank"], cfg["mla"], cfg.get("state", False)
    head_dim = cfg.get("head_dim", HEAD_DIM)
    backend = TransferBackend("kvstage")
    args = ServerArgs(model_path=cfg.get("model_path", "dummy"), dtype=cfg.get("dtype", "auto"), device="cpu",
                      tp_size=tp, host="127.0.0.1", port=cfg["http_port"],
                      disaggregation_mode=role, disaggregation_transfer_backend="kvstage",
                      disaggregation_bootstrap_port=cfg["bootstrap_port"], page_size=PAGE)
    publish(args, role="scheduler")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['store_port']}", world_size=tp, rank=rank)
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    # the scheduler's attention-TP group: its CPU group is what SGLang all-reduces polls over
    attn_tp = GroupCoordinator([list(range(tp))], rank, "gloo", use_pynccl=False, use_mscclpp=False,
                               use_custom_allreduce=False, use_torch_symm_mem_all_reduce=False,
                               use_hpu_communicator=False, use_xpu_communicator=False, group_name="attn_tp")
    group = attn_tp.cpu_group
    get_parallel().override_permanently(tp_rank=rank, attn_tp_rank=rank, attn_tp_size=tp, attn_dp_rank=0,
                                        attn_cp_rank=0, pp_rank=0, pp_group=None, attn_tp_group=attn_tp)
    server = None
    if role == "prefill" and rank == 0:
        server = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", cfg["bootstrap_port"])

    total_heads = cfg["kv_heads"]
    if mla:
        pool = MLATokenToKVPool(POOL_TOKENS, PAGE, torch.bfloat16, KV_LORA, 0, LAYERS, "cpu", False)
        local = range(1)
    else:
        local = heads_of(total_heads, tp, rank)
        if with_state:  # a hybrid SWA model: model layers 0, 2, 4 full attention, 1 and 3 sliding-window
            pool = SWAKVPool(size=POOL_TOKENS, size_swa=SWA_TOKENS, page_size=PAGE, dtype=torch.bfloat16,
                             head_num=len(local), head_dim=head_dim, device="cpu", enable_memory_saver=False,
                             swa_attention_layer_ids=[2 * i + 1 for i in range(SWA_LAYERS)],
                             full_attention_layer_ids=[2 * i for i in range(LAYERS)])
        else:
            pool = MHATokenToKVPool(POOL_TOKENS, PAGE, torch.bfloat16, len(local), head_dim, LAYERS, "cpu", False)
    meta = MetadataBuffers(8, hidden_size=16, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=16)
    kv_args = get_kv_class(backend, KVClassType.KVARGS)()
    kv_args.engine_rank, kv_args.pp_rank, kv_args.system_dp_rank = rank, 0, 0
    kv_args.kv_cache_dtype_str, kv_args.kv_layout = "bfloat16", None
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = get_kv_transfer_buf_infos(pool)
    kv_args.num_draft_entries, kv_args.page_size = 0, PAGE
    if role == "prefill" and not mla:
        kv_args.kv_head_num, kv_args.total_kv_head_num = len(local), total_heads
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = meta.get_buf_infos()
    kv_args.ib_device, kv_args.gpu_id, kv_args.prefill_start_layer = None, 0, 0
    setup_state_kv_args(kv_args, pool)  # as the schedulers do: KVArgs.state_* from the pool (none for a plain one)
    if with_state:
        assert kv_args.state_types == [StateType.SWA], kv_args.state_types
        mamba = [torch.zeros((MAMBA_SLOTS, 3, 16), dtype=torch.bfloat16) for _ in range(MAMBA_LAYERS)] + \
            [torch.zeros((MAMBA_SLOTS, 2, 8), dtype=torch.float32) for _ in range(MAMBA_LAYERS)]  # conv, temporal
        append_state_component(kv_args, StateType.MAMBA, [t.data_ptr() for t in mamba], [t.nbytes for t in mamba],
                               [t[0].nbytes for t in mamba])
    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    failed_rooms = _FailedRooms()  # the prefill's "room N failed" WARNINGs, from the first room on
    logging.getLogger("kvstage.sglang").addFilter(failed_rooms)  # a filter: the log still goes where it went
    mgr = get_kv_class(backend, KVClassType.MANAGER)(kv_args, mode, args, mla)
    if cfg.get("ready_file"):  # the manager holds its model identity (its weights fingerprinted at load)
        with open(cfg["ready_file"] + ".tmp", "w") as f:
            f.write(mgr.model)
        os.rename(cfg["ready_file"] + ".tmp", cfg["ready_file"])

    kv_pool = pool.full_kv_pool if with_state else pool
    bufs = [pool.kv_buffer[layer] for layer in range(LAYERS)] if mla else \
        [b for layer in range(LAYERS) for b in (kv_pool.k_buffer[layer], kv_pool.v_buffer[layer])]
    planes = 1 if mla else 2
    dim = KV_LORA if mla else head_dim
    heads_total = 1 if mla else total_heads
    # [{"room", "tokens", "abort": None|"prefill"|"decode"|"never_decode"|"decode_rank1"|"decode_rank1_sglang"}]
    reqs = cfg["requests"]
    rng = np.random.default_rng(1000 + rank + (100 if role == "decode" else 0))
    free_pages = rng.permutation(np.arange(1, POOL_TOKENS // PAGE))
    free_swa = rng.permutation(np.arange(1, SWA_TOKENS // PAGE))
    pages_of, state_of = {}, {}
    at = swa_at = 0
    for i, r in enumerate(reqs):
        n = -(-r["tokens"] // PAGE)
        pages_of[r["room"]] = free_pages[at:at + n]
        at += n
        if with_state:  # SGLang's payloads: the window's SWA pages; the request's mamba slot, a list of one array
            start = max(0, r["tokens"] - SWA_WINDOW) // PAGE * PAGE
            m = -(-(r["tokens"] - start) // PAGE)
            swa_locs = torch.as_tensor(_locs(free_swa[swa_at:swa_at + m])[:r["tokens"] - start])
            swa_at += m
            slot = 1 + i if role == "prefill" else MAMBA_SLOTS - 1 - i
            state_of[r["room"]] = [kv_to_page_indices(swa_locs, PAGE), [torch.tensor([slot], dtype=torch.int32).numpy()]]
    results = {}
    addr = f"127.0.0.1:{cfg['bootstrap_port']}"
    deadline = time.monotonic() + cfg.get("deadline_s", 120)

    def poll_all(pollers, decode_reqs=None):
        return poll_and_all_reduce(pollers, group, decode_reqs=decode_reqs,
                                   metadata_buffers=meta if decode_reqs is not None else None)

    def outcome(obj, poll):
        try:
            obj.failure_exception()
        except Exception as e:
            return {"state": "failed", "error": f"{type(e).__name__}: {e}"}
        return {"state": "failed", "error": None}

    if role == "prefill":
        active = [r for r in reqs if r.get("abort") != "never_prefill"]
        senders = {r["room"]: get_kv_class(backend, KVClassType.SENDER)(mgr, addr, r["room"]) for r in active}
        waiting = dict(senders)
        sent = {}
        for slot, r in enumerate(active):  # the "forward": this rank's head slice of every token
            tokens, p = r["tokens"], pages_of[r["room"]]
            locs = (torch.as_tensor(p).repeat_interleave(PAGE) * PAGE + torch.arange(PAGE).repeat(len(p)))[:tokens]
            for layer in range(LAYERS):
                for plane in range(planes):
                    full = full_kv(r["room"], layer, plane, tokens, heads_total, dim)
                    mine = full[:, local.start:local.stop] if not mla else full[:, 0]
                    bufs[layer * planes + plane].view(torch.uint8).view(bufs[0].shape[0], -1)[locs] = \
                        mine.reshape(tokens, -1)
            r["slot"] = slot
            if with_state:
                for c, views in enumerate(_state_views(kv_args)):
                    rows = _state_rows(state_of[r["room"]][c])
                    for b, v in enumerate(views):
                        v[rows] = state_bytes(r["room"], c, b, rank, len(rows), v.shape[1])
            if r.get("corrupt"):  # after the expected bytes are fixed: one byte of the last KV buffer
                bufs[-1].view(torch.uint8).view(bufs[0].shape[0], -1)[locs[-1], 0] ^= 0xFF
                if with_state:
                    for c, views in enumerate(_state_views(kv_args)):
                        views[-1][_state_rows(state_of[r["room"]][c])[-1], -1] ^= 0xFF
        while (waiting or sent) and time.monotonic() < deadline:
            rooms = list(waiting) + list(sent)
            polls = poll_all([waiting.get(x) or sent.get(x) for x in rooms])
            for room, poll in zip(rooms, polls):
                s = waiting.get(room) or sent.get(room)
                r = next(q for q in active if q["room"] == room)
                if room in waiting and r.get("abort") == "prefill" and poll == KVPoll.WaitingForInput:
                    s.abort()
                    poll = KVPoll.Failed
                if poll == KVPoll.Failed:
                    results[room] = outcome(s, poll)
                    s.clear()
                    waiting.pop(room, None), sent.pop(room, None)
                elif room in waiting and poll == KVPoll.WaitingForInput:
                    if time.monotonic() - r.setdefault("ready_at", time.monotonic()) < r.get("hold_s", 0):
                        continue  # a slow prefill forward: the decode may abort meanwhile
                    p = pages_of[room]
                    s.init(len(p), r["slot"])
                    for view, row in zip(_aux_views(meta), aux_rows(room, kv_args.aux_item_lens)):
                        view[r["slot"]] = row  # set_buf's fields, bootstrap_room included
                    if r.get("corrupt"):
                        _aux_views(meta)[0][r["slot"], 0] ^= 0xFF
                    half = max(1, len(p) // 2)
                    s.send(kv_to_page_indices(torch.as_tensor(_locs(p[:half])), PAGE))
                    s.send(kv_to_page_indices(torch.as_tensor(_locs(p[half:])), PAGE), state_of.get(room))
                    sent[room] = waiting.pop(room)
                elif room in sent and poll == KVPoll.Success:
                    results[room] = {"state": "success"}
                    s.clear()
                    sent.pop(room)
            time.sleep(0.01)
        for room in list(waiting) + list(sent):
            results[room] = {"state": "hung"}
        with mgr._lock:  # where a room's failure is logged and counted: both at once here
            results["metrics"] = dict(_failed_counts(), logged=list(failed_rooms.rooms))
    else:
        def addr_of(r):
            return f"127.0.0.1:{r.get('bootstrap_port', cfg['bootstrap_port'])}"

        for a in dict.fromkeys(addr_of(r) for r in reqs):  # in order: the first prefill read sizes the Destination
            while not mgr.try_ensure_parallel_info(a):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"prefill parallel info at {a} never became available")
                time.sleep(0.2)
        active = [r for r in reqs if r.get("abort") != "never_decode"]
        recvs = {}
        for slot, r in enumerate(active):
            rec = get_kv_class(backend, KVClassType.RECEIVER)(mgr, addr_of(r), r["room"])
            rec.init(0)
            recvs[r["room"]] = rec
            r["slot"] = slot
        pending, transferring = dict(recvs), {}

        class DecodeReq:  # what the metadata gate reads of SGLang's DecodeRequest
            def __init__(self, slot):
                self.metadata_buffer_index = slot
                self.req = type("Req", (), {"bootstrap_host": "127.0.0.1"})()

        while (pending or transferring) and time.monotonic() < deadline:
            rooms = list(pending)
            for room, poll in zip(rooms, poll_all([pending[x] for x in rooms])):
                rec, r = pending[room], next(q for q in active if q["room"] == room)
                if poll == KVPoll.Failed:
                    results[room] = outcome(rec, poll)
                    rec.clear()
                    pending.pop(room)
                elif poll == KVPoll.WaitingForInput:
                    meta.clear_slot(r["slot"])
                    rec.send_metadata(pages_of[room], r["slot"], state_of.get(room))
                    transferring[room] = pending.pop(room)
                    if r.get("abort") == "decode_rank1" and rank == 1:  # a failure only this rank sees
                        mgr.abort_incoming(room, INJECTED)
                    if r.get("abort") == "decode_rank1_sglang" and rank == 1:  # SGLang's own, on this rank only
                        mgr.record_failure(room, INJECTED_SGLANG)
                        mgr.update_status(room, KVPoll.Failed)
            rooms = list(transferring)
            gate = [DecodeReq(next(q for q in active if q["room"] == x)["slot"]) for x in rooms]
            for room, poll in zip(rooms, poll_all([transferring[x] for x in rooms], gate)):
                rec, r = transferring[room], next(q for q in active if q["room"] == room)
                if r.get("abort") == "decode" and poll in (KVPoll.WaitingForInput, KVPoll.Transferring):
                    rec.abort()
                    poll = KVPoll.Failed
                if poll == KVPoll.Failed:
                    results[room] = outcome(rec, poll)
                    rec.clear()
                    transferring.pop(room)
                elif poll == KVPoll.Success:
                    results[room] = {"state": "success", **_check(r, pages_of[room], bufs, meta, kv_args, local,
                                                                   planes, dim, heads_total, mla, rank,
                                                                   state_of.get(room))}
                    rec.clear()
                    transferring.pop(room)
            time.sleep(0.01)
        for room in list(pending) + list(transferring):
            results[room] = {"state": "hung"}
        if cfg.get("report_engines"):
            results["engines"] = mgr.dst.stats().engines
    print("RESULT " + json.dumps({"role": role, "rank": rank, "results": {str(k): v for k, v in results.items()}}),
          flush=True)
    dist.barrier(group)
    if role == "prefill":
        time.sleep(cfg.get("linger_s", 2.0))  # decode ranks may still read the bootstrap server or call in
    os._exit(0)


class _FailedRooms(logging.Filter):
    """Notes the prefill manager's WARNING for each failed room (what an operator reads in its log)."""

    def __init__(self):
        super().__init__()
        self.rooms: list[str] = []

    def filter(self, record):
        m = re.match(r"kvstage: prefill rank \d+, room (\d+) failed: ", record.getMessage())
        if m and record.levelno == logging.WARNING:
            self.rooms.append(m.group(1))
        return True


def _failed_counts() -> dict:
    """This process's kvstage metrics of its Source (role src): failed requests (``kvstage_requests_total``,
    result failed) and failures (``kvstage_failures_total``), summed over their labels, and the failures by
    (stage, cause)."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvstage import metrics

    out: dict = {"failed": 0, "failures": 0, "by_cause": {}}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            if sample.labels.get("role") != "src":
                continue
            if sample.name == "kvstage_requests_total" and sample.labels["result"] == "failed":
                out["failed"] += int(sample.value)
            elif sample.name == "kvstage_failures_total":
                out["failures"] += int(sample.value)
                key = f"{sample.labels['stage']}/{sample.labels['cause']}"
                out["by_cause"][key] = out["by_cause"].get(key, 0) + int(sample.value)
    return out


def _locs(pages) -> np.ndarray:
    """Token locations of whole pages (what SGLang's req_to_token holds)."""
    return (np.repeat(np.asarray(pages), PAGE) * PAGE + np.tile(np.arange(PAGE), len(pages))).astype(np.int64)


def _aux_views(meta) -> list[torch.Tensor]:
    ptrs, lens, items = meta.get_buf_infos()
    from kvstage.plugin.sglang.layout import raw_bytes

    return [raw_bytes(p, n, torch.device("cpu")).view(n // i, i) for p, n, i in zip(ptrs, lens, items)]


def _state_views(kv_args) -> list[list[torch.Tensor]]:
    """Per state component, its buffers as [rows, item] bytes (over KVArgs.state_*)."""
    from kvstage.plugin.sglang.layout import raw_bytes

    return [[raw_bytes(p, n, torch.device("cpu")).view(n // i, i) for p, n, i in zip(ps, ns, its)]
            for ps, ns, its in zip(kv_args.state_data_ptrs, kv_args.state_data_lens, kv_args.state_item_lens)]


def _state_rows(indices) -> torch.Tensor:
    return torch.as_tensor(np.asarray(indices).reshape(-1).astype(np.int64))


def _check(r, pages, bufs, meta, kv_args, local, planes, dim, heads_total, mla, rank, state) -> dict:
    """Compare this rank's pages, metadata row and state rows with the expected bytes."""
    tokens = r["tokens"]
    locs = torch.as_tensor(_locs(pages)[:tokens])
    bad = []
    for layer in range(LAYERS):
        for plane in range(planes):
            full = full_kv(r["room"], layer, plane, tokens, heads_total, dim)
            want = (full[:, 0] if mla else full[:, local.start:local.stop]).reshape(tokens, -1)
            got = bufs[layer * planes + plane].view(torch.uint8).view(bufs[0].shape[0], -1)[locs]
            if not torch.equal(got, want):
                bad.append(f"layer {layer} plane {plane}")
    rows = [v[r["slot"]] for v in _aux_views(meta)]
    want_rows = aux_rows(r["room"], kv_args.aux_item_lens)
    aux_bad = [i for i, (g, w) in enumerate(zip(rows, want_rows)) if not torch.equal(g, w)]
    out = {"kv_mismatch": bad, "aux_mismatch": aux_bad, "room_row": int(meta.bootstrap_room[r["slot"], 0].item())}
    if state is not None:  # equal TP: this rank's rows hold what the prefill rank of the same index wrote
        out["state_mismatch"] = [f"component {c} buffer {b}" for c, views in enumerate(_state_views(kv_args))
                                 for b, v in enumerate(views)
                                 if not torch.equal(v[_state_rows(state[c])],
                                                    state_bytes(r["room"], c, b, rank, len(_state_rows(state[c])), v.shape[1]))]
        out["state_rows"] = [len(_state_rows(ix)) for ix in state]
    return out


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
