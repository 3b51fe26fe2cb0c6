"""The source's checksum of a request that no gather reads (the ipc, direct and pages paths): a pass
over its pages that sums each destination rank's piece as a head-major gather of it would
(``Copier.sum_cache``: no copy), after the ``ready``, and a ``sums`` to each of those ranks once it is
over. The destination checks what it read against it (``protocol.reads``). The functions take the
``Source``, under its state lock."""

from __future__ import annotations

from dataclasses import dataclass

from kvstage.protocol.checksums import page_sums
from kvstage.protocol.messages import Sums
from kvstage.protocol.outgoing import Outgoing, Target
from kvstage.staging.checksum import ChunkSums
from kvstage.staging.copy import upload_pages
from kvstage.staging.fence import CopyFence


@dataclass
class Summing:
    """One request's sum pass: its sums (one piece per target, in order) once ``fence`` has passed."""

    out: Outgoing
    targets: list[Target]
    sums: ChunkSums
    fence: CopyFence


def start(src, out: Outgoing, targets: list[Target]) -> None:
    """Sum ``out``'s pieces for ``targets`` over this rank's pages (queued behind the caller's work on a
    GPU; at once on the host) and say ``sums`` to each once the pass is over."""
    if src.cache.device.type == "cuda" and out.kernel_pages is None:
        out.kernel_pages = upload_pages(src.cache, out.pages, checked=True)
    fence = CopyFence(src.cache.device)
    pieces = [p for p in (out.piece_of(t) for t in targets) if p is not None]
    assert len(pieces) == len(targets)  # ``announce`` routes only the targets it has a piece for
    try:
        sums = page_sums(src.cache, out.pages, out.kernel_pages, out.handle.tokens, pieces, "source")
    except Exception as e:
        return src._fail(out.key, "local", "checksum", f"{type(e).__name__}: {e}", tell=True)
    summing = Summing(out, targets, sums, fence.close())
    if summing.fence.done():
        tell(src, summing)
    else:
        src._summing.append(summing)


def poll(src) -> None:
    """Say ``sums`` for every sum pass that has passed its fence."""
    still = []
    for s in src._summing:
        if s.fence.done():
            tell(src, s)
        else:
            still.append(s)
    src._summing = still


def tell(src, s: Summing) -> None:
    out = s.out
    if out.handle.done():
        return
    for k, t in enumerate(s.targets):
        if (t.engine, t.rank) in out.told and (out.bound is None or out.bound == t.engine):
            src._tell(t, Sums(out.handle.req, s.sums.total(k), out.layers_wire, out.span_wire))
