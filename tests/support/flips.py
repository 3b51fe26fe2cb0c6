"""A fault between a source's read and the decode's landing, for the engine tests' checksum cases
(tests only): the next gather of this process flips one bit of the staging region it wrote, after
the copy read and summed it, so the chunk checksum must catch it."""

from __future__ import annotations


def flip_after_next_gather() -> None:
    """The next ``Copier.gather`` in this process flips bit 5 of the middle byte of its region; later
    gathers are left alone."""
    import torch

    from kvstage.staging import copier

    real = copier.Copier.gather

    def gather(self, idx, pieces, region, sums=None):
        real(self, idx, pieces, region, sums)
        copier.Copier.gather = real
        flat = region.view(torch.uint8).reshape(-1)
        flat[flat.numel() // 2] ^= 0x20

    copier.Copier.gather = gather
