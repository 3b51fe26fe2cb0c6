"""What every protocol module checks or names the same way: the ids a caller passes (engine,
model), a request's page list against this rank's cache, how a peer rank is named in logs and
metrics, and the bounded memory of recent things (``remember``). Below ``endpoint`` and the
request records, so both may use them without importing the loop."""

from __future__ import annotations

import numpy as np

from kvstage.errors import ConfigError
from kvstage.layout import pages_needed
from kvstage.protocol.messages import MAX_ENGINE_ID, MAX_MODEL_ID
from kvstage.staging.cache import RankCache


def _printable_id(value, field: str, limit: int, meaning: str) -> str:
    if not isinstance(value, str) or len(value) > limit or not value.isprintable():
        raise ConfigError(
            f"{field}={str(value)[:40]!r}: must be a string of at most {limit} printable characters ({meaning})"
        )
    return value


def check_engine(engine) -> str:
    """An engine id as given by a caller: a string of at most ``MAX_ENGINE_ID`` printable characters."""
    return _printable_id(engine, "engine", MAX_ENGINE_ID, "the same on every rank of one engine")


def check_model_id(model) -> str:
    """A model identity as an engine gives it (``""``: none, nothing is compared)."""
    return _printable_id(
        model, "model", MAX_MODEL_ID, "the engine's model name or path and a hash of what shapes its KV"
    )


def peer_label(engine: str | None, rank: int | None = None) -> str:
    """A peer as a metrics label: ``engine/rank``, or ``engine/*`` for every rank of that engine a
    request involves (few distinct values: one per peer engine and rank); the unnamed engine's
    peers are ``rank`` and ``*``."""
    who = "*" if rank is None else str(rank)
    return f"{engine}/{who}" if engine else who


def rank_name(engine: str, role: str, rank: int) -> str:
    """How a peer rank is named in logs and failures: ``source rank 2`` or ``source rank 2 of engine E``."""
    return f"{role} rank {rank}" + (f" of engine {engine}" if engine else "")


def remember(recent: dict, key, value, most: int) -> None:
    """Put ``key`` last in ``recent`` (insertion order = age), keeping at most ``most`` entries: the oldest go."""
    recent.pop(key, None)
    recent[key] = value
    while len(recent) > most:
        recent.pop(next(iter(recent)))


def check_pages(cache: RankCache, page_ids, tokens: int) -> np.ndarray:
    """Validate a request's page list against this rank's cache (caller's thread), and
    keep a copy of it: a chunk's copy reads it later, on the host or in its launch.
    The checks work on a Python list: on a request's critical path, which runs cold,
    that is about half the time of numpy's reductions and ``unique``."""
    if not isinstance(tokens, (int, np.integer)) or isinstance(tokens, (bool, np.bool_)) or tokens < 1:
        raise ConfigError(f"tokens={tokens!r}: must be a positive integer (not a bool)")
    try:
        given = np.array(page_ids)  # a copy: the caller may reuse its list once this returns
    except (ValueError, TypeError) as e:  # ragged, or not a sequence numpy can read
        raise ConfigError(f"page_ids: must be a flat sequence of integers: {e}") from None
    if given.size and given.dtype.kind not in "iu":  # a float would be truncated, a bool or string read as a number
        raise ConfigError(
            f"page_ids: must be integers, got {given.dtype} values (e.g. {given.reshape(-1)[:3].tolist()})"
        )
    ids = given.astype(np.int64, copy=False).reshape(-1) if given.size else np.zeros(0, dtype=np.int64)
    need = pages_needed(int(tokens), cache.spec.page.page_size)
    if len(ids) < need:
        raise ConfigError(
            f"page_ids: {len(ids)} pages given, {tokens} tokens of page size {cache.spec.page.page_size} need {need}"
        )
    ids = ids[:need]
    values = ids.tolist()
    low, high = min(values), max(values)
    if low < 0 or high >= cache.pages:
        raise ConfigError(f"page_ids: values must lie in [0, {cache.pages}); got {low}..{high}")
    if len(set(values)) != len(values):
        raise ConfigError("page_ids: a page appears twice; each token needs its own place")
    return ids


def b64(data: bytes | None) -> str:
    """Bytes as the wire carries them (a ticket, a handle): base64 text, ``""`` for none."""
    import base64

    return base64.b64encode(data).decode() if data else ""


def unb64(text: str) -> bytes:
    import base64

    return base64.b64decode(text) if text else b""
