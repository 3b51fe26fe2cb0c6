"""vLLM's KV cache tensors described with kvstage's layout types (no vLLM needed).

The transfer cases build vLLM-shaped per-rank tensors from one full model
cache, move them through real kvstage endpoints (NIXL, in one process) using
only what ``kvstage.plugin.vllm.layout`` says, and compare whole blocks.
"""

import numpy as np
import pytest
import torch

from kvstage.config import Settings
from kvstage.errors import ConfigError
from kvstage.plugin.vllm.layout import VllmKVLayout, describe, physical_order
from kvstage.protocol.destination import Destination
from kvstage.protocol.source import Source
from kvstage.staging.cache import RankCache

HEADS, CONTENT, PAGE, BLOCKS = 4, 64, 32, 12


def layer_tensor(full_layer: torch.Tensor, heads: slice, order: str) -> torch.Tensor:
    """One rank's layer as vLLM 0.32 hands it over: logical [B, H, N, C], physical ``order``."""
    part = full_layer[:, heads]  # [B, h, N, C]
    if order == "hnd":
        return part.contiguous()
    return part.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)  # stored [B, N, h, C]


def rank_caches(full, tp, order):
    per = HEADS // tp
    return [{f"model.layers.{l}.self_attn.attn": layer_tensor(full[l], slice(r * per, (r + 1) * per), order)
             for l in range(len(full))} for r in range(tp)]


def transfer(full, src_tp, dst_tp, order, blocks_of_request, block_size=PAGE, tokens_in_request=None):
    """Prefill ranks (src_tp) send a request's blocks to decode ranks (dst_tp); returns decode tensors and block ids."""
    rng = np.random.default_rng(7)
    src_blocks = rng.permutation(BLOCKS)[:blocks_of_request].tolist()
    dst_blocks = rng.permutation(BLOCKS)[:blocks_of_request].tolist()
    src = rank_caches(full, src_tp, order)
    dst = rank_caches(torch.zeros_like(full), dst_tp, order)
    settings = Settings(arena_mb=1)
    hint = {"hnd": "LBHNC", "nhd": "LBNHC"}[order]  # vLLM's resolved layout, as the connector passes it
    dsts, srcs = [], []
    try:
        for r, kv in enumerate(dst):
            lay = describe(kv, HEADS, block_size, hint)
            assert lay.order == order
            dsts.append((lay, Destination(RankCache(lay.spec(dst_tp), r, lay.buffers(kv)), settings)))
        handles = [d.expect("req", lay.pages(dst_blocks), lay.tokens(len(dst_blocks))) for lay, d in dsts]
        for r, kv in enumerate(src):
            lay = describe(kv, HEADS, block_size, hint)
            assert lay.order == order
            s = Source(RankCache(lay.spec(src_tp), r, lay.buffers(kv)), settings)
            srcs.append(s)
            s.connect([d.address for _, d in dsts])
            handles.append(s.send("req", lay.pages(src_blocks), lay.tokens(len(src_blocks))))
        for h in handles:
            h.wait(30)
        paths = {h.path for h in handles}
    finally:
        for s in srcs:
            s.close()
        for _, d in dsts:
            d.close()
    return dst, src_blocks, dst_blocks, paths


def check(full, dst, dst_tp, src_blocks, dst_blocks, ppb=1):
    per = HEADS // dst_tp
    sb = (np.asarray(src_blocks)[:, None] * ppb + np.arange(ppb)).ravel()
    db = (np.asarray(dst_blocks)[:, None] * ppb + np.arange(ppb)).ravel()
    untouched = np.setdiff1d(np.arange(full[0].shape[0]), db)
    for r, kv in enumerate(dst):
        for l, name in enumerate(sorted(kv)):
            got = kv[name]
            want = full[l][:, r * per:(r + 1) * per]
            assert torch.equal(got[db], want[sb]), f"rank {r} layer {l}: blocks differ"
            assert not got[untouched].any(), f"rank {r} layer {l}: a block outside the request was written"


def full_cache(layers, ppb=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, BLOCKS * ppb, HEADS, PAGE, CONTENT, generator=g)


@pytest.mark.parametrize("src_tp,dst_tp,order,layers", [
    (2, 1, "hnd", 2),  # the CPU backend's layout, prefill TP 2 -> decode TP 1
    (1, 2, "hnd", 2),
    (2, 1, "nhd", 2),  # GPU FlashAttention's default layout (LBNHC)
    (1, 4, "nhd", 2),
    (4, 2, "hnd", 3),  # an odd layer count: the last layer fills both buffers of the last kvstage layer
])
def test_whole_blocks_move_between_tp_sizes(src_tp, dst_tp, order, layers):
    full = full_cache(layers)
    dst, sb, db, paths = transfer(full, src_tp, dst_tp, order, blocks_of_request=5)
    check(full, dst, dst_tp, sb, db)
    assert paths <= {"read", "pages"} and paths, paths  # the decode reads the prefill arena or its pages


def test_equal_tp_takes_the_direct_path():
    full = full_cache(2)
    dst, sb, db, paths = transfer(full, 2, 2, "hnd", blocks_of_request=4)
    check(full, dst, 2, sb, db)
    assert paths == {"direct"}


def test_kernel_blocks_smaller_than_scheduler_blocks():
    """vLLM may split a scheduler block into kernel blocks: block b is pages 2b, 2b+1."""
    full = full_cache(2, ppb=2)
    dst, sb, db, _ = transfer(full, 2, 1, "hnd", blocks_of_request=3, block_size=2 * PAGE)
    check(full, dst, 1, sb, db, ppb=2)


def test_cpu_block_interior_moves_whole():
    """The CPU backend stores K transposed inside a (block, head) unit: only
    whole units are meaningful, and whole units are what moves."""
    lay = describe(rank_caches(full_cache(2), 1, "hnd")[0], HEADS, PAGE)
    assert lay.tokens(3) == 3 * PAGE
    assert list(lay.pages([5, 1])) == [5, 1]
    assert (lay.geometry.layers, lay.geometry.head_dim, lay.page.order) == (1, CONTENT, "hnd")


def test_describe_reads_the_physical_order():
    t = torch.zeros(4, 2, PAGE, CONTENT)
    assert physical_order(t) == "hnd"
    assert physical_order(t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)) == "nhd"
    one_head = torch.zeros(4, 1, PAGE, CONTENT)  # both orders are the same bytes: vLLM's layout decides
    assert physical_order(one_head, "LBNHC") == "nhd"
    assert physical_order(one_head, "LBHNC") == "hnd"


def test_block_outer_layout_is_refused_with_the_fix():
    base = torch.zeros(4, 2, 2, PAGE, CONTENT)  # [B, L, H, N, C]: layers interleaved per block (BLHNC)
    with pytest.raises(ConfigError, match="VLLM_KV_CACHE_LAYOUT"):
        describe({"l0": base[:, 0], "l1": base[:, 1]}, 2, PAGE)


def test_shared_layers_counted_once_and_natural_order():
    t = [torch.zeros(4, 2, PAGE, CONTENT) for _ in range(11)]
    kv = {f"model.layers.{i}.attn": t[i] for i in range(11)}
    kv["model.layers.11.attn"] = t[3]  # cross-layer KV sharing
    lay = describe(kv, 2, PAGE)
    assert lay.names == tuple(f"model.layers.{i}.attn" for i in range(11))
    assert lay.duplicated_last and lay.geometry.layers == 6


def test_mixed_layers_refused():
    kv = {"a": torch.zeros(4, 2, PAGE, CONTENT), "b": torch.zeros(4, 2, PAGE, 2 * CONTENT)}
    with pytest.raises(ConfigError, match="one shape"):
        describe(kv, 2, PAGE)


def test_heads_must_match_tp():
    lay = describe({"a": torch.zeros(4, 2, PAGE, CONTENT)}, 8, PAGE)
    with pytest.raises(ConfigError, match="2 heads"):
        lay.spec(2)  # 8 heads at TP 2 would be 4 per rank


def test_peer_check_names_the_field():
    lay = VllmKVLayout(("a", "b"), 4, 2, 64, 32, "hnd", "float32")
    lay.check_peer(lay.to_wire())
    with pytest.raises(ConfigError, match="page_size"):
        lay.check_peer(dict(lay.to_wire(), page_size=16))
    with pytest.raises(ConfigError, match="order"):
        lay.check_peer(dict(lay.to_wire(), order="nhd"))
