"""Gather a head slice of some tokens into a staging region, and scatter it back.

A region holds, for ``count`` tokens and ``heads`` heads, the bytes of every
(layer, plane) buffer in order: ``[buffers, count, heads, head_dim]``. The
source gathers with its own page size and layout; the destination scatters
with its own, which is how page size and NHD/HND conversion happen.

On CUDA (with CuPy) one fused kernel launch moves a whole chunk
(``cuda_copy``), into device memory or a pinned host arena. On the host one
native call per chunk and piece copies the chunk's spans (``hostcopy``,
``Settings.host_copy``); where that is not built, or not chosen, these are
torch/numpy ops.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvstage.errors import ConfigError
from kvstage.layout import token_major, token_positions
from kvstage.staging import hostcopy
from kvstage.staging.cache import RankCache
from kvstage.staging.spans import buffer_spans
from kvstage.staging.words import chunk_pages


def copy_stream(device: torch.device):
    """Where a rank's copies go, whichever thread launches them: the device's default
    stream (a fresh thread's current one). A request's page ids are uploaded on it and
    read by its later chunks' copies, so every copy of the rank must be on the same
    stream. A context that is empty when the caller is on it already."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from kvstage.staging.cuda_copy import current_stream, default_stream

    default = default_stream(device)
    if current_stream(device) is default:
        return contextlib.nullcontext()
    return torch.cuda.stream(default)


def upload_pages(cache: RankCache, page_ids: np.ndarray, checked: bool = False) -> torch.Tensor | np.ndarray | None:
    """A request's page ids where the CUDA kernel reads them (on the device, or for
    a small request on the host, passed in each launch: ``cuda_copy.INLINE_PAGES``),
    or None where the kernel does not run. Done once per request, when it is
    posted, so no chunk's copy waits for an upload or a bounds check (pass the
    result to ``TokenIndex``). ``checked``: the ids were checked against this cache
    already (an endpoint's ``check_pages``), so the bounds are not checked twice."""
    copier = _copier(cache)
    if copier is None:
        return None
    if not checked:
        _check_bounds(cache, page_ids)
    return copier.upload_pages(page_ids)


def _check_bounds(cache: RankCache, pages: np.ndarray) -> None:
    if len(pages) and (pages.min() < 0 or pages.max() >= cache.pages):
        raise IndexError(f"page ids must lie in [0, {cache.pages}); got {pages.min()}..{pages.max()}")


class TokenIndex:
    """Where tokens ``start .. start+count`` of a request sit in one rank's cache.
    ``kernel_pages``: the request's page ids from ``upload_pages``, if any."""

    def __init__(self, cache: RankCache, page_ids: np.ndarray, start: int, count: int,
                 kernel_pages: torch.Tensor | np.ndarray | None = None):
        P = cache.spec.page.page_size
        # the chunk's pages and the first token's offset: all the CUDA kernel needs
        self.kernel_pages, self.first_page, self.first = kernel_pages, start // P, start % P
        if kernel_pages is None:
            self.chunk_pages, _ = chunk_pages(page_ids, P, start, count)
            _check_bounds(cache, self.chunk_pages)
        elif len(kernel_pages) != len(page_ids):  # checked against the cache by upload_pages or its caller
            raise ValueError(f"kernel_pages holds {len(kernel_pages)} page ids, page_ids {len(page_ids)}")
        self.page_ids, self.start, self.count = page_ids, start, count
        self._cache = cache
        if _copier(cache) is not None:
            return  # the kernel path: the token arrays below are built only if a torch path asks
        self._positions()

    def _positions(self) -> None:
        cache, start, count = self._cache, self.start, self.count
        page = cache.spec.page
        pid, off = token_positions(self.page_ids, page.page_size, start, count)
        self.flat_order = token_major(cache.spec.geometry, page)
        self.on_cpu = cache.device.type == "cpu"
        # Whole pages at the front of the range (the range starts on a page
        # boundary) can move as page rows: 16x fewer, larger rows at page size 16.
        P = page.page_size
        self.full_pages = count // P if (start % P == 0 and P > 1 and self.flat_order) else 0
        self.pages_np = pid[: self.full_pages * P : P]
        self.flat_np = pid * P + off if self.flat_order else None
        self.page_np, self.offset_np = pid, off
        self._device = cache.device
        self._on_device: dict = {}

    def __getattr__(self, name: str):
        """Token arrays for the torch paths, built on first use."""
        if "_cache" not in self.__dict__ or "_on_device" in self.__dict__:
            raise AttributeError(name)
        self._positions()
        return object.__getattribute__(self, name)

    def _dev(self, name: str) -> torch.Tensor:
        """Index arrays reach the device only when a torch path needs them."""
        if name not in self._on_device:
            self._on_device[name] = torch.from_numpy(getattr(self, name + "_np")).to(self._device)
        return self._on_device[name]

    pages = property(lambda self: self._dev("pages"))
    flat = property(lambda self: self._dev("flat"))
    page = property(lambda self: self._dev("page"))
    offset = property(lambda self: self._dev("offset"))


_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _word(cache: RankCache) -> tuple[int, torch.dtype]:
    """The widest integer word that tiles one head: copies are bytes, and
    torch's indexed copies run per element, so wider elements copy faster."""
    hb = cache.spec.geometry.head_bytes()
    return next((n, dt) for n, dt in _WIDE if hb % n == 0)


def _region_view(region: torch.Tensor, cache: RankCache, count: int, heads: int) -> torch.Tensor:
    geo = cache.spec.geometry
    n, dt = _word(cache)
    return region.view(dt).view(geo.buffers, count, heads, geo.head_bytes() // n)


def _words(buf: torch.Tensor, cache: RankCache) -> torch.Tensor:
    """A buffer as words, keeping its shape but the last dim (head_dim elements -> words)."""
    n, dt = _word(cache)
    return buf.view(torch.uint8).view(dt)


def _flat(buf: torch.Tensor, cache: RankCache) -> torch.Tensor:
    geo = cache.spec.geometry
    n, _ = _word(cache)
    return _words(buf, cache).view(-1, 1 if geo.mla else cache.spec.local_heads(), geo.head_bytes() // n)


def _heads(cache: RankCache) -> int:
    return 1 if cache.spec.geometry.mla else cache.spec.local_heads()


def _page_rows(buf: torch.Tensor, cache: RankCache) -> torch.Tensor:
    """A token-major buffer as one row of words per page."""
    return _words(buf, cache).view(cache.pages, -1)


def region_bytes(cache: RankCache, count: int, heads: int) -> int:
    geo = cache.spec.geometry
    return geo.buffers * count * heads * geo.head_bytes()


def _copier(cache: RankCache):
    """The fused CUDA copier for this cache, or None where it does not apply."""
    c = getattr(cache, "_copier", False)  # decided once per cache: this is on every chunk's launch path
    if c is False:
        c = None
        if cache.device.type == "cuda":
            from kvstage.staging import cuda_copy

            c = cuda_copy.WordCopier(cache.spec, cache.buffers) if cuda_copy.available() else None
        cache._copier = c
    return c


def _kernel_for(cache: RankCache, idx: TokenIndex, pieces, region: torch.Tensor):
    """The fused copier if it can run these pieces of ``region``, else None (the torch paths)."""
    copier = _copier(cache)
    return copier if copier is not None and copier.supports(region, pieces, idx.count) else None


def _prepared(cache: RankCache, idx: TokenIndex, pieces, region: torch.Tensor, to_region: bool):
    """The whole chunk as one prepared kernel launch, or None to use the torch paths."""
    copier = _kernel_for(cache, idx, pieces, region)
    return None if copier is None else _prepare(copier, idx, pieces, region, to_region)


def _prepare(copier, idx: TokenIndex, pieces, region: torch.Tensor | None, to_region: bool, now: bool = False):
    """The chunk's kernel launch, prepared (``now`` False) or launched at once."""
    run = copier.launch if now else copier.prepare
    if idx.kernel_pages is None:
        return run(idx.chunk_pages, idx.first, idx.count, pieces, region, to_region)
    return run(idx.kernel_pages, idx.first, idx.count, pieces, region, to_region, idx.first_page)


def _fused(cache: RankCache, idx: TokenIndex, pieces, region: torch.Tensor, to_region: bool) -> bool:
    """Run the whole chunk as one kernel launch if possible; False to fall back."""
    copier = _kernel_for(cache, idx, pieces, region)
    if copier is not None:
        _prepare(copier, idx, pieces, region, to_region, now=True)
    return copier is not None


def use_host_copies(cache: RankCache, mode: str) -> tuple[str, str]:
    """Decide how this host cache's gathers and scatters copy (``Settings.host_copy``):
    ("native", why) for ``hostcopy``'s streaming span copies, ("numpy", why) for numpy/torch ops."""
    if mode == "numpy":
        cache._spans = False
        return "numpy", "numpy/torch ops (host_copy='numpy')"
    cache._spans = hostcopy.available()
    if cache._spans:
        return "native", "streaming span copies (kvstage.staging._spans)"
    if mode == "native":
        raise ConfigError(f"host_copy='native': {hostcopy.why_unavailable()}")
    return "numpy", f"numpy/torch ops: {hostcopy.why_unavailable()}"


def _spans_native(cache: RankCache, region: torch.Tensor) -> bool:
    """Whether this host cache's copies with ``region`` run as native span copies; a cache
    no endpoint decided for (``use_host_copies``) uses them where they are built."""
    if cache.device.type != "cpu" or region.device.type != "cpu" or not region.is_contiguous():
        return False
    native = getattr(cache, "_spans", None)
    return hostcopy.available() if native is None else native


def _gather_spans(cache: RankCache, idx: TokenIndex, head_lo: int, heads: int, region: torch.Tensor) -> None:
    """``gather`` as one native call: each buffer's spans laid end to end in its part of the region."""
    offsets, lengths = buffer_spans(cache, idx.page_ids, idx.start, idx.count, head_lo, heads)
    copy = hostcopy.SpanCopy(np.cumsum(lengths) - lengths, offsets, lengths)
    per, base = copy.nbytes, region.data_ptr()
    room = region.nbytes
    copy.run([(base + b * per, max(0, min(per, room - b * per))) for b in range(len(cache.buffers))],
             [(buf.data_ptr(), buf.nbytes) for buf in cache.buffers])


def _scatter_spans(cache: RankCache, idx: TokenIndex, pieces, region: torch.Tensor, threads: "CopyThreads | None"):
    """A chunk's scatter as native span copies, set up now: a callable that runs it."""
    copies = []
    for lo, n, base in pieces:
        offsets, lengths = buffer_spans(cache, idx.page_ids, idx.start, idx.count, lo, n)
        copy = hostcopy.SpanCopy(offsets, np.cumsum(lengths) - lengths, lengths)
        copies.append((copy, base, copy.nbytes))
    dst = [(b.data_ptr(), b.nbytes) for b in cache.buffers]
    at, room = region.data_ptr(), region.nbytes
    B = len(dst)
    n = 1 if threads is None else threads.threads
    # each share's (copy, its buffers, their parts of the region), so running it only copies
    shares = [([(copy, [dst[i] for i in range(k, B, n)],
                 [(at + base + i * per, max(0, min(per, room - base - i * per))) for i in range(k, B, n)])
                for copy, base, per in copies],) for k in range(n)]

    def run_share(share) -> None:
        for copy, to, frm in share:
            copy.run(to, frm)

    if threads is None:
        return lambda: run_share(shares[0][0])
    return lambda: threads.run(run_share, shares)


class CopyThreads:
    """Threads that take a share of a host scatter's buffers beside the caller's own:
    numpy's copies and the native span copies release the GIL, so the scatter runs on ``threads`` cores. Worth it
    only where a core is free: with ``cma`` the sources leave most of one (docs/benchmarks.md, session 18)."""

    def __init__(self, threads: int):
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="kvstage-scatter")

    def run(self, place, items: list) -> None:
        """``place(*item)`` for every item, items dealt round-robin; the caller's share first."""
        shares = [items[k :: self.threads] for k in range(self.threads)]
        others = [self._pool.submit(lambda share=share: [place(*x) for x in share]) for share in shares[1:] if share]
        try:
            for x in shares[0]:
                place(*x)
        finally:
            for f in others:
                f.result()  # re-raises a failed share's error, after every share has stopped

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def prepare_scatter(cache: RankCache, idx: TokenIndex, pieces, region: torch.Tensor, threads: CopyThreads | None = None):
    """``scatter_chunk`` made ready ahead of time (when the chunk is granted): a
    callable that runs it. On CUDA all set-up happens here and the call is one
    kernel launch; elsewhere the call does the whole scatter."""
    launch = _prepared(cache, idx, pieces, region, to_region=False)
    if launch is None and _spans_native(cache, region):
        return _scatter_spans(cache, idx, pieces, region, threads)
    return launch if launch is not None else (lambda: scatter_chunk(cache, idx, pieces, region, threads))


def prepare_piece_scatters(cache: RankCache, idx: TokenIndex, pieces, region: torch.Tensor) -> list | None:
    """One prepared kernel launch per piece, so each writer's piece can be scattered
    the moment it lands and only the last writer's is left when the chunk is
    complete; None where the kernel does not run the chunk (the torch and numpy
    paths scatter a chunk's pieces in one pass: ``prepare_scatter``)."""
    copier = _kernel_for(cache, idx, pieces, region)
    return None if copier is None else [_prepare(copier, idx, [piece], region, False) for piece in pieces]


def _bounce(cache: RankCache, region: torch.Tensor) -> torch.Tensor | None:
    """A device copy of a region on another device (a host arena without the
    kernel): the torch paths below need both sides on one device."""
    return None if region.device == cache.device else torch.empty_like(region, device=cache.device)


def scatter_chunk(cache: RankCache, idx: TokenIndex, pieces, region: torch.Tensor,
                  threads: CopyThreads | None = None) -> None:
    """Scatter every writer's region of a slot: ``pieces`` = [(head_lo, heads, byte offset in region)].
    ``threads``: share a host cache's scatter among them, by buffer (with numpy, only a tiled
    scatter: NHD pieces laid end to end)."""
    if _fused(cache, idx, pieces, region, to_region=False):
        return
    if _spans_native(cache, region):
        return _scatter_spans(cache, idx, pieces, region, threads)()
    tmp = _bounce(cache, region)
    if tmp is not None:
        tmp.copy_(region)
        region = tmp
    tiled = _tiling(cache, idx.count, pieces) if cache.device.type == "cpu" else None
    if tiled is not None:
        return _scatter_tiled(cache, idx, *tiled, region, threads)
    for lo, n, base in pieces:
        scatter(cache, idx, lo, n, region[base : base + region_bytes(cache, idx.count, n)])


def _tiling(cache: RankCache, count: int, pieces) -> tuple[int, int, int, int] | None:
    """``(head_lo, writers, heads each, base)`` when the pieces, in region order, are
    equal-width runs of adjacent heads laid end to end: the region is then one
    ``[writers, buffers, count, heads, words]`` array that a single indexed
    assignment per buffer can place (each destination token written whole)."""
    if len(pieces) < 2 or not token_major(cache.spec.geometry, cache.spec.page):
        return None
    lo, n, base = pieces[0]
    size = region_bytes(cache, count, n)
    for k, (lo_k, n_k, base_k) in enumerate(pieces):
        if n_k != n or lo_k != lo + k * n or base_k != base + k * size:
            return None
    return lo, len(pieces), n, base


def _scatter_tiled(cache: RankCache, idx: TokenIndex, lo: int, k: int, n: int, base: int, region: torch.Tensor,
                   threads: CopyThreads | None = None) -> None:
    geo = cache.spec.geometry
    words, dt = _word(cache)
    hw = geo.head_bytes() // words
    size = region_bytes(cache, idx.count, n)
    src = region[base : base + k * size].view(dt).numpy().reshape(k, geo.buffers, idx.count, n, hw)
    whole = idx.full_pages if k * n == _heads(cache) else 0
    P = cache.spec.page.page_size
    t0 = whole * P
    # whole pages: one writer's heads of one token as one numpy element ("V<bytes>"), so each
    # element moves as one block straight from the slot to its page, with no temporary that
    # interleaves the writers first (~1.3x on the Intel CPU machine; docs/benchmarks.md, session 15)
    piece = np.dtype(f"V{n * geo.head_bytes()}")
    pieces = src.reshape(-1).view(piece).reshape(k, geo.buffers, idx.count)

    def place(i: int, buf: torch.Tensor) -> None:
        if whole:  # [pages, tokens, writers] in the cache <- [writers, tokens] of the slot, transposed
            pages = buf.view(torch.uint8).numpy().reshape(-1).view(piece).reshape(cache.pages, P, k)
            pages[idx.pages_np] = pieces[:, i, :t0].T.reshape(whole, P, k)
        if t0 < idx.count:  # the tokens past the whole pages, as rows of [writers, heads, words]
            rows = src[:, i].transpose(1, 0, 2, 3)
            _flat(buf, cache).numpy()[idx.flat_np[t0:], lo : lo + k * n] = rows[t0:].reshape(-1, k * n, hw)

    if threads is None:
        for i, buf in enumerate(cache.buffers):
            place(i, buf)
    else:
        threads.run(place, list(enumerate(cache.buffers)))


def gather(cache: RankCache, idx: TokenIndex, head_lo: int, heads: int, region: torch.Tensor) -> None:
    """Copy local heads ``[head_lo, head_lo+heads)`` of the indexed tokens into ``region``."""
    if _fused(cache, idx, [(head_lo, heads, 0)], region, to_region=True):
        return
    if _spans_native(cache, region):
        return _gather_spans(cache, idx, head_lo, heads, region)
    tmp = _bounce(cache, region)
    if tmp is not None:
        gather(cache, idx, head_lo, heads, tmp)
        region.copy_(tmp)
        return
    out = _region_view(region, cache, idx.count, heads)
    whole = idx.full_pages if heads == _heads(cache) else 0
    t0 = whole * cache.spec.page.page_size
    for i, buf in enumerate(cache.buffers):
        if whole:
            torch.index_select(_page_rows(buf, cache), 0, idx.pages, out=out[i, :t0].reshape(whole, -1))
        if t0 == idx.count:
            continue
        if idx.flat_order:
            torch.index_select(_flat(buf, cache)[:, head_lo : head_lo + heads], 0, idx.flat[t0:], out=out[i, t0:])
        else:
            out[i].copy_(_words(buf, cache)[idx.page, head_lo : head_lo + heads, idx.offset])


def gather_pieces(cache: RankCache, idx: TokenIndex, pieces) -> None:
    """Gather several head slices of the same tokens, each into its own region:
    ``pieces`` = [(head_lo, heads, region)]. On CUDA one kernel launch fills them
    all (a 1->N source's pieces of one chunk, each in its destination's mapped
    arena); elsewhere, or where a region is out of the kernel's reach, one
    ``gather`` per piece."""
    copier = _copier(cache)
    if copier is not None and all(copier.supports(r, [(lo, n, 0)], idx.count) for lo, n, r in pieces):
        return _prepare(copier, idx, [(lo, n, r.data_ptr()) for lo, n, r in pieces], None, True, now=True)
    for lo, n, r in pieces:
        gather(cache, idx, lo, n, r)


def scatter(cache: RankCache, idx: TokenIndex, head_lo: int, heads: int, region: torch.Tensor) -> None:
    """Copy ``region`` into local heads ``[head_lo, head_lo+heads)`` of the indexed tokens."""
    if _spans_native(cache, region):
        return _scatter_spans(cache, idx, [(head_lo, heads, 0)], region, None)()
    tmp = _bounce(cache, region)
    if tmp is not None:
        tmp.copy_(region)
        region = tmp
    src = _region_view(region, cache, idx.count, heads)
    whole = idx.full_pages if heads == _heads(cache) else 0
    t0 = whole * cache.spec.page.page_size
    for i, buf in enumerate(cache.buffers):
        if idx.on_cpu:
            # numpy's indexed assignment copies each row as a block: ~2x torch's index_copy_ on CPU
            if whole:
                _page_rows(buf, cache).numpy()[idx.pages_np] = src[i, :t0].reshape(whole, -1).numpy()
            if t0 == idx.count:
                continue
            if idx.flat_order:
                _flat(buf, cache).numpy()[idx.flat_np[t0:], head_lo : head_lo + heads] = src[i, t0:].numpy()
            else:
                _words(buf, cache).numpy()[idx.page_np, head_lo : head_lo + heads, idx.offset_np] = src[i].numpy()
            continue
        if whole:
            _page_rows(buf, cache).index_copy_(0, idx.pages, src[i, :t0].reshape(whole, -1))
        if t0 == idx.count:
            continue
        if idx.flat_order:
            _flat(buf, cache)[:, head_lo : head_lo + heads].index_copy_(0, idx.flat[t0:], src[i, t0:])
        else:
            _words(buf, cache)[idx.page, head_lo : head_lo + heads, idx.offset] = src[i]
