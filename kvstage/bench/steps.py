"""What every rank derives for a step from the group's seeds alone: page ids, content seeds, tags.

One place for both sides and both kinds of group, so that a source rank derives a
destination rank's page ids (the per-slice baseline writes straight into them) and a
destination rank the bytes a source filled, exactly as they did.
"""

from __future__ import annotations

import numpy as np

from kvstage.bench.scenario import MAX_ENGINES, MODES, Group
from kvstage.layout import pages_needed

#: how long a rank waits for the coordinator's next message, a transfer or its writes
WAIT_S = 600.0


def request_pages(g: Group, pi: int, side: str, rank: int, it: int, engine: int | None = None) -> list[np.ndarray]:
    """Page ids of each of the point's concurrent requests on one rank: disjoint, scattered.

    ``engine``: the rank's engine in a multi-engine group; then every request the rank holds in
    the step, request k of peer engine e at index ``e * concurrency + k`` (``request_index``)."""
    sc = g.points[pi]
    if engine is None:
        spec = sc.src if side == "src" else sc.dst
        need = pages_needed(sc.tokens, spec.page.page_size)
        rng = np.random.default_rng([sc.seed, pi, it, 0 if side == "src" else 1, rank])
        perm = rng.permutation(g.pages(spec))
        return [perm[k * need : (k + 1) * need] for k in range(sc.concurrency)]
    spec = sc.side(side, engine)
    need = pages_needed(sc.tokens, spec.page.page_size)
    rng = np.random.default_rng([sc.seed, pi, it, 0 if side == "src" else 1, rank, engine])
    perm = rng.permutation(g.pages(spec, side))
    return [perm[k * need : (k + 1) * need] for k in range(sc.requests_per_rank(side))]


def request_index(sc, peer: int, k: int) -> int:
    """Where request ``k`` to or from peer engine ``peer`` is in ``request_pages`` of a multi-engine rank."""
    return peer * sc.concurrency + k


def content_seed(g: Group, pi: int, mode: str, it: int, k: int, pair: tuple[int, int] | None = None) -> int:
    """The seed of request ``k``'s bytes in one step; ``pair``: (source engine, destination
    engine) of a multi-engine group, each pair's request k with a seed of its own."""
    sc = g.points[pi]
    seed = (((sc.seed * 1009 + pi) * 7 + MODES.index(mode)) * 1009 + it) * 4099 + k
    if pair is None:
        return seed
    i, j = pair
    return (seed * MAX_ENGINES + i) * MAX_ENGINES + j


def tag(pi: int, mode: str, it: int, k: int) -> str:
    return f"{mode}-p{pi}-i{it}-r{k}"
