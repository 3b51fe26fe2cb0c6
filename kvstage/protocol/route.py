"""Which way a request's bytes go to one destination rank: the one route decision.

Pure: from what the handshake learned of the link (``Link``), the request's
size and page runs (``Request``) and the settings (``Link.allowed``, both
sides' ``path``), one function (``choose``) gives the path and the reason, and
the path travels in the ``ready`` message; nothing else re-derives it. Every
path is driven by the destination: the source only makes its bytes readable.

- ``ipc``: one host, CUDA memory: the destination's own kernel reads this rank's
  pages (shared over CUDA IPC at the handshake) and writes its pages, in its
  page size and layout, one pass over the bytes, no arena on either side;
- ``direct``: whole shards, equal paging: the destination reads page runs from
  this rank's KV buffers straight into its own pages (one span per run and buffer);
- ``pages``: host memory: the destination reads this rank's head slices straight
  from its pages into its arena, and scatters; no gather here;
- ``read``: this rank gathers its slices into its own arena when the request is
  ready, the destination reads one span per chunk and scatters.

A checksummed request (``protocol.checksums``) takes the same path as any other: the
read path's gather sums its chunks, and on the others the source sums its pages in a
pass of its own. A one-pass path wins where it can run (``ipc``); else each candidate is
costed as the times it copies every byte at the memory's copy speed plus its
spans at the transport's per-span price (``COPIES``, ``COPY_BPS``), and the
cheapest runs; a request whose gather would not fit the source's free slots now
goes ``pages`` where it can, so that nothing waits for the source's process.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


class Path(str, enum.Enum):
    """A request's path: one word in settings, messages, logs, bench rows and metrics."""

    IPC = "ipc"
    DIRECT = "direct"
    PAGES = "pages"
    READ = "read"

    def __str__(self) -> str:
        return self.value


#: ``Settings.path``: "auto" (by this module's rule) or one path, forced
PATH_SETTINGS = ("auto",) + tuple(p.value for p in Path)
#: how many times a path copies every byte: read gathers, reads and scatters; pages reads and
#: scatters; direct reads into the pages; ipc reads and writes them once in one kernel
COPIES = {Path.READ: 3, Path.PAGES: 2, Path.DIRECT: 1, Path.IPC: 1}
#: bytes per second of one large copy, by memory: a device-to-device copy on one H200 (bytes moved
#: once), and a NIXL write on the 2-core CPU machine (docs/benchmarks.md, shared notes)
COPY_BPS = {"cuda": 1.4e12, "cpu": 5.0e9}


def allowed_paths(setting: str) -> frozenset:
    """The paths a ``path`` setting allows: all for "auto", else the one it names."""
    return frozenset(Path) if setting == "auto" else frozenset({Path(setting)})


@dataclass(frozen=True)
class Link:
    """What the handshake learned of one destination rank, as the route needs it."""

    memory: str  # "cuda" or "cpu": where this rank's KV pages are
    ipc: bool  # the destination opened this rank's KV pages and event (same host, CUDA IPC)
    pages: bool  # this rank's KV buffers are registered and offered for one-sided reads
    direct: bool  # the plan's pieces are whole shards with equal paging (``TransferPlan.direct``)
    span_cost_s: float  # what one span of a read costs the transport, whatever its size
    allowed: frozenset = frozenset(Path)  # the paths both sides' settings allow


@dataclass(frozen=True)
class Request:
    """One request as this rank sends it to one destination rank."""

    nbytes: int  # bytes of this rank's piece of the request
    run_spans: int  # spans of a direct read: page runs x buffers of the piece
    page_spans: int  # spans of a pages read of the piece (``staging.spans.piece_spans``, cheapest order)
    fits: bool  # the gather of its chunks fits this rank's free arena slots now


@dataclass(frozen=True)
class Route:
    """The path of one request to one destination rank and why (logged once per peer and path);
    ``path`` None: no allowed path can carry it, and ``reason`` says why."""

    path: Path | None
    reason: str


def page_runs(page_ids) -> int:
    """Runs of consecutive page ids (a run moves as one span per buffer)."""
    ids = np.asarray(page_ids, dtype=np.int64)
    if len(ids) == 0:
        return 0
    return int(np.count_nonzero(np.diff(ids) != 1)) + 1


def cost_s(path: Path, link: Link, req: Request) -> float:
    """The modelled seconds of ``path`` for ``req``: its copies of the bytes plus its spans."""
    spans = {Path.DIRECT: req.run_spans, Path.PAGES: req.page_spans}.get(path, 1)
    return COPIES[path] * req.nbytes / COPY_BPS[link.memory] + spans * link.span_cost_s


def choose(link: Link, req: Request) -> Route:
    """The path of ``req`` to the destination rank behind ``link``, and the reason."""
    possible = {Path.READ: "", Path.IPC: "", Path.DIRECT: "", Path.PAGES: ""}
    if not link.ipc:
        possible[Path.IPC] = (
            "the destination did not open this rank's pages (another host, host memory, or "
            "memory that cannot be shared)"
        )
    if not link.direct:
        possible[Path.DIRECT] = "the pieces are not whole shards with equal paging"
    elif not link.pages:
        possible[Path.DIRECT] = "this rank's KV buffers are not offered for one-sided reads"
    if link.memory != "cpu":
        possible[Path.PAGES] = "its spans cost a device descriptor each (pages is for host memory)"
    elif not link.pages:
        possible[Path.PAGES] = "this rank's KV buffers are not offered for one-sided reads"
    can = [p for p in Path if not possible[p] and p in link.allowed]
    if not can:
        why = "; ".join(
            f"{p.value}: {possible[p] or 'not allowed by the path setting'}" for p in Path if p in link.allowed
        )
        return Route(None, f"no allowed path can carry it ({why})")
    if Path.IPC in can:
        return Route(Path.IPC, "one host, CUDA memory: the destination's kernel reads this rank's pages, one pass")
    costs = {p: cost_s(p, link, req) for p in can}
    est = ", ".join(f"{p.value} ~{costs[p] * 1e3:.3g} ms" for p in can)
    if not req.fits and Path.PAGES in can:
        return Route(
            Path.PAGES,
            f"its gather does not fit this rank's free arena slots now: the destination reads "
            f"the pages straight ({est})",
        )
    best = min(can, key=lambda p: (costs[p], COPIES[p]))
    if len(can) == 1:
        return Route(best, f"the only path allowed and possible ({est})")
    return Route(
        best,
        f"expected fastest ({est}; {req.run_spans} direct spans, {req.page_spans} page spans at "
        f"{link.span_cost_s * 1e6:g} us each)",
    )
