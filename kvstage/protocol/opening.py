"""What an endpoint opens as it is made, in order: its transport (made here, or the caller's,
checked against the path setting), this process's facts, and its staging arena, placed and sized
by the rule with one log line. Apart from the loop, which only uses them."""

from __future__ import annotations

import logging
import os

import torch

from kvstage.errors import ConfigError
from kvstage.link.facts import collect_local, value
from kvstage.staging.arena import ArenaSize, StagingArena, arena_size, choose_arena
from kvstage.transports.base import Transport

log = logging.getLogger("kvstage")


def _plugins(transport: Transport) -> list[str] | None:
    plugins = getattr(transport, "plugins", None)
    return plugins() if callable(plugins) else None


def open_transport(ep, transport: Transport | None) -> tuple[Transport, bool]:
    """The transport this endpoint drives, and whether it made it (then it closes it)."""
    if transport is None:
        from kvstage.transports import make_transport

        return make_transport(ep.settings.transport, f"kvstage-{ep.role}{ep.rank}"), True
    if ep.settings.path in ("direct", "pages") and not transport.one_sided:
        raise ConfigError(
            f"path={ep.settings.path!r} with a {transport.name} transport: {transport.name} is two-sided and "
            f"cannot read a peer's pages; pass Settings(transport={transport.name!r}) or another path"
        )
    return transport, False


def local_facts(ep) -> dict:
    """This process's facts, with the transport's own account of its UCX where it gives one."""
    facts = collect_local(agent_plugins=_plugins(ep.transport))
    own = getattr(ep.transport, "facts", None)
    if callable(own):  # the transport's own introspection (UCXX's UCX, not NIXL's bundled one)
        facts.update(own())
    return facts


def make_arena(ep) -> tuple[StagingArena, str]:
    """The staging arena, where ``choose_arena`` puts it and as big as ``arena_size`` says (one log line)."""
    cache = ep.cache
    where, why = choose_arena(ep.settings.arena, cache.device, value(ep.facts, "ucx_modules"), os.environ)
    on_gpu = where == "device"
    size = rank_arena_size(ep, where)
    arena = StagingArena(
        size.slot_bytes,
        size.slots,
        cache.device if on_gpu else torch.device("cpu"),
        pinned=cache.device.type == "cuda",
    )
    place = (
        f"{cache.device} memory" if on_gpu else "pinned host memory" if cache.device.type == "cuda" else "host memory"
    )
    log.info(
        "%s %d: staging arena of %d slots x %.4g MiB in %s (%s; %s)",
        ep.role,
        ep.rank,
        size.slots,
        size.slot_bytes / 2**20,
        place,
        size.why,
        why,
    )
    return arena, where


def rank_arena_size(ep, where: str) -> ArenaSize:
    """The rule's arena for this rank (``staging.arena.arena_size``), at most its KV cache's size."""
    free = None
    if where == "device":
        free = torch.cuda.mem_get_info(ep.cache.device)[0]
    pool = sum(b.numel() * b.element_size() for b in ep.cache.buffers)
    return arena_size(ep.settings.arena_bytes, ep.token_bytes, where, free, pool)
