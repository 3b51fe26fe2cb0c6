"""Chunk checksums end to end: which requests carry one, what each reader must find, and the
check where the bytes land.

Under ``checksum=all`` every request is checksummed and goes the read path (``route.choose``);
under ``sampled`` one request in ``SAMPLE_EVERY`` is, of those the route sends read anyway (a
sampled request never changes path). Its source's gather sums the box per segment as it reads
the cache (``staging.checksum``), and each destination rank is told, with each chunk, the total
of its span of that box. The destination's scatter sums
its slot's piece as it reads it; a different total fails the request at stage
``checksum``, naming the source rank and the chunk. Pure, but for the one log line per
peer.
"""

from __future__ import annotations

import logging
import zlib

from kvstage.protocol.outgoing import Box
from kvstage.staging.checksum import ChunkSums, span_total
from kvstage.tp import Piece

log = logging.getLogger("kvstage")

#: ``checksum=sampled`` checks one read-path request in this many, chosen by its id so every rank of a
#: source engine picks the same ones: the share that keeps the default's cost near 1% where ``all`` cost
#: most, the read path on one GPU (docs/benchmarks.md, "Checksums")
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

    def once(self, rank: int, peer: str, req: str, chunk: int, want: int, got: int) -> None:
        if peer in self._peers:
            return
        if len(self._peers) > 4096:
            self._peers.clear()
        self._peers.add(peer)
        log.error(
            "dst %d: chunk %d of %s from %s landed with checksum %#010x, the source summed %#010x: its bytes "
            "changed between the source's read and this rank's scatter (later mismatches from this peer are "
            "counted in kvstage_checksum_failures_total)",
            rank,
            chunk,
            req,
            peer,
            got,
            want,
        )
