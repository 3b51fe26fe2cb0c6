"""Chunk checksums end to end: which requests carry one, what each reader must find, and the
check where the bytes land.

Under ``checksum=all`` every request is checksummed, under ``sampled`` one in ``SAMPLE_EVERY``,
whatever its path. On the read path the source's gather sums the box per segment as it reads the
cache (``staging.checksum``), and each destination rank is told, with each chunk, the total of
its span of that box; the destination's scatter sums its slot's piece as it reads it. On the
ipc, direct and pages paths, which gather nothing, the source sums each destination rank's piece
over its pages as a head-major gather of it would (``page_sums``, no copy) and says ``sums``; the
destination sums what it read (the ipc kernel as it reads, the others a pass over the pages the
piece landed in). A different total fails the request at stage ``checksum``, naming the source
rank. Pure, but for the sum passes and the one log line per peer.
"""

from __future__ import annotations

import logging
import zlib

from kvstage.protocol.outgoing import Box
from kvstage.staging.checksum import ChunkSums, span_total
from kvstage.staging.copy import TokenIndex
from kvstage.staging.region import Order, RegionPiece, end_to_end
from kvstage.tp import Piece

log = logging.getLogger("kvstage")

#: ``checksum=sampled`` checks one request in this many, chosen by its id so every rank of an engine picks
#: the same ones: the share that keeps the default's cost near 1% where ``all`` costs most
#: (docs/benchmarks.md, "Checksums")
SAMPLE_EVERY = 32


def checksummed(setting: str, req: str) -> bool:
    """Whether request ``req`` carries a checksum under the ``checksum`` setting."""
    if setting == "all":
        return True
    if setting == "sampled":
        return zlib.crc32(req.encode()) % SAMPLE_EVERY == 0
    return False


def expected(sums: ChunkSums, box: Box, piece: Piece, count: int) -> int:
    """The total a destination rank reading ``piece`` of a chunk of ``count`` tokens gathered into ``box``
    must find in the bytes it read."""
    offset, nbytes = box.piece_span(piece, count)
    return span_total(sums, box.piece(), box.spec.geometry.head_bytes(), count, offset, nbytes)


def page_sums(cache, pages, kernel_pages, count: int, pieces: list[Piece], side: str, start: int = 0) -> ChunkSums:
    """Each of ``pieces``' checksum over ``cache``'s pages ``pages`` (tokens ``start .. start + count``), as a
    head-major gather of it from token ``start`` would sum it, with no copy (``Copier.sum_cache``; on a GPU
    queued on the current stream). ``side``: whose heads the pieces name here, "source" or "destination".
    ``total(k)`` is piece ``k``'s once a fence closed after this has passed."""
    hb = cache.spec.geometry.head_bytes()
    regions = end_to_end(
        [
            RegionPiece(p.src_offset if side == "source" else p.dst_offset, p.heads.count, p.buffers, 0, Order.HEADS)
            for p in pieces
        ],
        hb,
        count,
    )
    sums = ChunkSums.of(regions, hb, count)
    cache.copier.sum_cache(TokenIndex(cache, pages, start, count, kernel_pages), regions, sums)
    return sums


def mismatches(landed: ChunkSums, expect: list) -> list[tuple[int, int, int]]:
    """(piece, expected, landed) of each piece of a slot whose landed total is not its writer's (a writer
    that sent no checksum, None in ``expect``, is not checked)."""
    out = []
    for k, want in enumerate(expect):
        if want is None:
            continue
        got = landed.total(k)
        if got != want:
            out.append((k, want, got))
    return out


class Warned:
    """The peers a checksum mismatch has been logged for: one ERROR line each, the rest are counted
    (``kvstage_checksum_failures_total``) and fail their requests in their own lines."""

    def __init__(self):
        self._peers: set = set()

    def first(self, peer: str) -> bool:
        """Whether ``peer`` is new here (it is remembered from now on)."""
        if peer in self._peers:
            return False
        if len(self._peers) > 4096:
            self._peers.clear()
        self._peers.add(peer)
        return True

    def once(self, rank: int, peer: str, req: str, what: str, want: int, got: int) -> None:
        """``what`` of ``req`` from ``peer`` ("chunk 3", "its piece") landed with sum ``got``, not ``want``."""
        if not self.first(peer):
            return
        log.error(
            "dst %d: %s of %s from %s landed with checksum %#010x, the source summed %#010x: its bytes "
            "changed between the source's read and this rank's (later mismatches from this peer are "
            "counted in kvstage_checksum_failures_total)",
            rank,
            what,
            req,
            peer,
            got,
            want,
        )
