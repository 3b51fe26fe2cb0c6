"""Corrupted KV bytes are caught: a byte flipped between the source's read and the destination's
landing fails its request at stage ``checksum``, naming the source rank and the chunk, and nothing
else changes (``protocol.checksums``).

Real endpoints (a destination and two sources in this process, prefill TP 2 -> decode TP 1, real
transports); the fault is injected in the test's own caches' copiers, after the copy that sums: in a
source's arena after its gather (what its destination then reads), or in the destination's slot
before its scatter. Every injected corruption must be caught, the next request must be byte-exact,
and no slot may be left held.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kvstage.config import Settings
from kvstage.protocol.checksums import SAMPLE_EVERY, checksummed
from support import fault_ranks as fr
from support.marks import TRANSPORTS, needs

TOKENS = 70  # three chunks of the sources' 16 KiB slots


def _flip(region: torch.Tensor) -> None:
    """One bit of the middle byte of ``region`` (on its device, queued on the current stream)."""
    flat = region.view(torch.uint8).reshape(-1)
    flat[flat.numel() // 2] ^= 0x20


def corrupt_gathers(cache, count: list) -> None:
    """Every gather of ``cache`` flips one byte of its region after the copy summed it."""
    real = cache.copier.gather

    def gather(idx, pieces, region, sums=None):
        real(idx, pieces, region, sums)
        _flip(region)
        count.append(1)

    cache.copier.gather = gather


def corrupt_scatters(cache, count: list) -> None:
    """Every prepared scatter of ``cache`` flips one byte of its slot before it runs (after the reads landed)."""
    real = cache.copier.prepare_scatter

    def prepare_scatter(idx, pieces, region, threads=None, sums=None):
        run = real(idx, pieces, region, threads, sums)

        def corrupted():
            _flip(region)
            count.append(1)
            run()

        return corrupted

    cache.copier.prepare_scatter = prepare_scatter


def _checksum_failures() -> float:
    from prometheus_client import REGISTRY

    return sum(
        s.value for m in REGISTRY.collect() if m.name == "kvstage_checksum_failures" for s in m.samples
        if s.name.endswith("_total")
    )


def _wait(handles, limit=30.0):
    for h in handles:
        fr.until(h.done, limit)


@pytest.mark.parametrize("side", ["source", "destination"])
@pytest.mark.parametrize("copier", ["native", "torch"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_flipped_byte_fails_its_request_by_name_and_the_next_is_byte_exact(transport, copier, side, caplog):
    needs(transport)
    _flipped_byte_case(transport, copier, side, caplog, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("side", ["source", "destination"])
@pytest.mark.parametrize("copier", ["cuda", "torch"])
def test_on_a_gpu_a_flipped_byte_fails_its_request_by_name_and_the_next_is_byte_exact(copier, side, caplog):
    """The kernel's fused sums (``cuda``) and the torch pass, caches and arenas on GPU 0."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _flipped_byte_case("nixl", copier, side, caplog, "cuda:0")


def _flipped_byte_case(transport, copier, side, caplog, device):
    settings = Settings(**(fr.SETTINGS | {"transport": transport, "checksum": "all"}))
    dst, srcs, dpages, spages = fr.two_to_one(settings, 3, TOKENS, seed=5, content=50, copier=copier, device=device)
    before = _checksum_failures()
    flipped: list = []
    try:
        for k in (0, 1):  # two corrupted requests: both caught, one ERROR line for the peer
            if side == "source":
                real = srcs[0].cache.copier.gather
                corrupt_gathers(srcs[0].cache, flipped)
            else:
                real = dst.cache.copier.prepare_scatter
                corrupt_scatters(dst.cache, flipped)
            with caplog.at_level(logging.ERROR, logger="kvstage"):
                h = dst.expect(f"c{k}", dpages[k], TOKENS)
                sent = [s.send(f"c{k}", p[k], TOKENS) for s, p in zip(srcs, spages)]
                _wait([h, *sent])
            if side == "source":
                srcs[0].cache.copier.gather = real
            else:
                dst.cache.copier.prepare_scatter = real
            assert flipped, "the fault was never injected"
            assert h.error is not None and h.error.stage == "checksum", h.error
            assert ("source rank 0" if side == "source" else "source rank") in h.error.peer, h.error.peer
            assert "source rank" in h.error.peer and "chunk" in h.error.cause and "checksum" in h.error.cause
            assert all(s.error is not None for s in sent), [s.error for s in sent]
        lines = [r for r in caplog.records if "landed with checksum" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]  # once per peer
        if _metrics_on():
            assert _checksum_failures() - before == 2
        print(f"\n{transport} {copier} {device} ({side}): {len(flipped)} flipped bytes in 2 requests, both failed "
              f"at stage checksum; the next request byte-exact")
        h = dst.expect("c2", dpages[2], TOKENS)  # nothing corrupted: byte-exact, no false failure
        sent = [s.send("c2", p[2], TOKENS) for s, p in zip(srcs, spages)]
        _wait([h, *sent])
        assert h.error is None and h.path == "read", (h.error, h.path)
        assert fr.check(dst.cache, 52, dpages[2], TOKENS) == []
        fr.until(lambda: fr.free(dst.stats()) and all(fr.free(s.stats()) for s in srcs), 10)
    finally:
        dst.close()
        for s in srcs:
            s.close()


def corrupt_landed(cache, pages, count: list) -> None:
    """Every pass that sums ``cache``'s landed pages finds one byte of ``pages`` (its first) flipped first."""
    real = cache.copier.sum_cache

    def sum_cache(idx, pieces, sums):
        fr.flip_page(cache, pages[0])
        count.append(1)
        real(idx, pieces, sums)

    cache.copier.sum_cache = sum_cache


#: the paths that gather nothing, on a pair each can carry: (path, sources, destination page size). The ipc path
#: needs its sources in other processes (CUDA cannot open its own IPC handles): its own test is below
PAGE_PATHS = [("pages", 2, 4), ("direct", 1, 16)]


@pytest.mark.parametrize("side", ["source", "destination"])
@pytest.mark.parametrize("path,src_tp,dst_page", PAGE_PATHS)
def test_on_the_page_paths_a_flipped_byte_fails_its_request_by_name_and_the_next_is_byte_exact(
        path, src_tp, dst_page, side, caplog):
    """``source``: a byte of the source's pages changes after its sum pass and before the destination reads
    them (a page reused too early); ``destination``: a byte of the pages the piece landed in changes before
    their sum. Each is caught by the ``sums`` total, on the path it took."""
    settings = Settings(**(fr.SETTINGS | {"path": path, "checksum": "all"}))
    dst, srcs, dpages, spages = fr.connected(settings, 3, TOKENS, seed=7, content=70, src_tp=src_tp,
                                             dst_page=dst_page)
    before = _checksum_failures()
    flipped: list = []
    try:
        for k in (0, 1):
            real = dst.cache.copier.sum_cache
            if side == "destination":
                corrupt_landed(dst.cache, dpages[k], flipped)
            with caplog.at_level(logging.ERROR, logger="kvstage"):
                sent = [s.send(f"p{k}", p[k], TOKENS) for s, p in zip(srcs, spages)]
                if side == "source":  # summed at send; the destination reads nothing before expect
                    fr.flip_page(srcs[0].cache, spages[0][k][0])
                    flipped.append(1)
                h = dst.expect(f"p{k}", dpages[k], TOKENS)
                _wait([h, *sent])
            dst.cache.copier.sum_cache = real
            assert flipped, "the fault was never injected"
            assert h.error is not None and h.error.stage == "checksum", (h.error, h.path)
            assert "source rank 0" in h.error.peer and "checksum" in h.error.cause, h.error
            assert h.path == path and all(s.error is not None for s in sent), (h.path, [s.error for s in sent])
        lines = [r for r in caplog.records if "landed with checksum" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]  # once per peer
        if _metrics_on():
            assert _checksum_failures() - before == 2
        h = dst.expect("p2", dpages[2], TOKENS)
        sent = [s.send("p2", p[2], TOKENS) for s, p in zip(srcs, spages)]
        _wait([h, *sent])
        assert h.error is None and h.path == path, (h.error, h.path)
        assert fr.check(dst.cache, 72, dpages[2], TOKENS) == []
        fr.until(lambda: fr.free(dst.stats()) and all(fr.free(s.stats()) for s in srcs), 10)
    finally:
        dst.close()
        for s in srcs:
            s.close()


@pytest.mark.gpu
def test_on_the_ipc_path_a_flipped_byte_fails_its_request_by_name_and_the_next_is_byte_exact(caplog):
    """The ipc kernel's sums end to end, TP 2 -> 1 on GPU 0, each source rank a process of its own (CUDA opens
    no IPC handle of its own process): a byte of source rank 0's pages changes after its sum pass and before
    the destination's kernel reads them (it reads nothing before ``expect``), and the sum the kernel adds up
    as it reads differs from the source's ``sums``."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from kvstage.layout import pages_needed
    from kvstage.protocol.destination import Destination
    from kvstage.staging.cache import RankCache

    settings = fr.SETTINGS | {"path": "ipc", "checksum": "all"}
    dcache = RankCache.allocate(fr.dst_spec(), 0, 3 * pages_needed(TOKENS, 4) + 4, "cuda:0")
    dst = Destination(dcache, Settings(**settings))
    dpages = np.random.default_rng(8).permutation(dcache.pages)[: 3 * pages_needed(TOKENS, 4)].reshape(3, -1)
    srcs: list = []
    before = _checksum_failures()
    try:
        for rank in (0, 1):
            srcs.append(fr.Rank(fr.source_rank, 2, rank, 3 * pages_needed(TOKENS, 16) + 2, settings, "", fr.GEO, 16,
                                "cuda:0"))
            srcs[-1].call("connect", [dst.address])
        fr.until(dst.connected, 60)
        for k in (0, 1, 2):
            req = f"i{k}"
            with caplog.at_level(logging.ERROR, logger="kvstage"):
                assert [s.call("send", [(req, TOKENS, 80 + k)]) for s in srcs] == [{req: "ipc"}] * 2
                if k < 2:
                    srcs[0].call("flip", req)
                h = dst.expect(req, dpages[k], TOKENS)
                _wait([h])
            told = [s.call("wait", 30)[req] for s in srcs]
            assert h.path == "ipc", h.path
            if k < 2:
                assert h.error is not None and h.error.stage == "checksum", h.error
                assert "source rank 0" in h.error.peer and "checksum" in h.error.cause, h.error
                assert all(err is not None for _, err in told), told
            else:  # nothing corrupted: byte-exact, no false failure
                assert h.error is None and told == [("done", None)] * 2, (h.error, told)
                assert fr.check(dcache, 82, dpages[2], TOKENS) == []
        lines = [r for r in caplog.records if "landed with checksum" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]  # once per peer
        if _metrics_on():
            assert _checksum_failures() - before == 2
        fr.until(lambda: fr.free(dst.stats()), 10)
    finally:
        for s in srcs:
            s.close()
        dst.close()


def _metrics_on() -> bool:
    from kvstage import metrics

    return metrics.available()


def test_sampled_checks_its_sampled_requests_and_no_others():
    """``sampled``: a request whose id is sampled is summed and checked (its corruption fails it); one whose id
    is not passes the flipped byte through, as with ``off`` (the share is the rule's, not a promise)."""
    settings = Settings(**(fr.SETTINGS | {"checksum": "sampled"}))
    ids = [f"s{i}" for i in range(400)]
    picked = next(r for r in ids if checksummed("sampled", r))
    unpicked = next(r for r in ids if not checksummed("sampled", r))
    dst, srcs, dpages, spages = fr.two_to_one(settings, 2, TOKENS, seed=6, content=60)
    try:
        flipped: list = []
        corrupt_gathers(srcs[0].cache, flipped)
        outcome = {}
        for k, req in enumerate((picked, unpicked)):
            h = dst.expect(req, dpages[k], TOKENS)
            sent = [s.send(req, p[k], TOKENS) for s, p in zip(srcs, spages)]
            _wait([h, *sent])
            outcome[req] = (h.error.stage if h.error else None, fr.check(dst.cache, 60 + k, dpages[k], TOKENS))
        assert outcome[picked][0] == "checksum", outcome
        assert outcome[unpicked][0] is None and outcome[unpicked][1], outcome  # not checked: the bytes differ
    finally:
        dst.close()
        for s in srcs:
            s.close()


def test_sampled_checks_a_fixed_share_of_requests_the_same_on_every_rank():
    ids = [f"req-{i}" for i in range(20_000)]
    picked = [checksummed("sampled", r) for r in ids]
    assert picked == [checksummed("sampled", r) for r in ids]  # by id alone: every source rank agrees
    share = sum(picked) / len(ids)
    assert abs(share - 1 / SAMPLE_EVERY) < 0.25 / SAMPLE_EVERY, share
    assert all(checksummed("all", r) for r in ids[:50]) and not any(checksummed("off", r) for r in ids[:50])
