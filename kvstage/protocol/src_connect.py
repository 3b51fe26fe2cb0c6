"""The source's peer connections: the handshake with each destination rank (``hello`` to
``opened``, on the caller's thread), the KV pages it shares over CUDA IPC, and each connected
rank's ``Target``. Apart from the request path, which needs a connection made."""

from __future__ import annotations

import logging
import os
import secrets
import select
import socket
import time

from kvstage.errors import KVStageError, ProtocolError, TransferFailed
from kvstage.link.context import link_context
from kvstage.protocol import route, src_requests
from kvstage.protocol.common import b64, peer_label, rank_name, remember
from kvstage.protocol.handshake import (
    HANDSHAKE_TIMEOUT_S,
    check_same_model,
    check_transport,
    check_version,
    check_welcome_proof,
    spec_from_wire,
    spec_to_wire,
)
from kvstage.protocol.messages import (
    PROTOCOL_VERSION,
    Error,
    Hello,
    Offer,
    Opened,
    Ping,
    Welcome,
    decode,
)
from kvstage.protocol.outgoing import DestinationEngine, Target
from kvstage.protocol.route import Path
from kvstage.protocol.src_requests import MAX_IDLE_ADDRESSES
from kvstage.protocol.wire import Connection
from kvstage.tp import Piece, TransferPlan, plan
from kvstage.transports.base import Spans, WriteState

log = logging.getLogger("kvstage")


def share_pages(src):
    """This rank's KV pages and ready event, shared over CUDA IPC with destinations of this host
    that open them (the ``ipc`` path), or None (said in one line when it cannot be)."""
    if src.cache.device.type != "cuda" or not src.settings.offers_pages or "ipc" not in allowed(src.settings):
        return None
    from kvstage.staging.shared_buffers import NotShareable, ReadyEvent, share_buffers

    try:
        shared = {"buffers": share_buffers(src.cache.buffers), "event": None}
        event = ReadyEvent(src.cache.device)
    except NotShareable as e:
        log.warning(
            "src %d: KV pages not shared over CUDA IPC: %s; destinations on this host read them through "
            "the arena (the read path) instead of one pass (the ipc path)",
            src.rank,
            e,
        )
        return None
    shared["event"] = event
    log.info(
        "src %d: KV pages shared over CUDA IPC with destinations of this host and user that open them "
        "(%d allocations): their kernel reads these pages in one pass (the ipc path)",
        src.rank,
        len(shared["buffers"]["allocations"]),
    )
    return shared


def known(src, address: tuple) -> int | None:
    """The destination rank already connected at ``address`` (-1: known, served by another
    source rank), or None: a handshake is needed."""
    for t in src._targets.values():
        if t.address == address and not t.conn.closed:
            return t.rank
    idle = src._idle.get(address)
    if idle is not None and idle[0] in src.engines:
        return -1
    return None


def handshake(src, host: str, port: int, token: str) -> int | None:
    """``token``: what this source presents there (the destination's secret, or the auth token), and
    what the welcome must prove the destination holds."""
    peer = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT_S)
    except OSError as e:
        raise TransferFailed("-", f"destination {peer}", "handshake", f"cannot connect: {e}") from e
    conn = Connection(sock, peer)
    nonce = secrets.token_hex(16)
    try:
        conn.send(
            Hello(
                PROTOCOL_VERSION,
                token,
                src.engine,
                src.model,
                os.getuid(),
                spec_to_wire(src.spec),
                src.rank,
                src.transport.id,
                src.transport.name,
                src.transport.metadata(),
                src.slot_bytes,
                src.facts,
                src.kv_facts(),
                sorted(p.value for p in allowed(src.settings)),
                nonce,
            ).to_wire()
        )
        msg = _expect(conn, Welcome)
        check_version(msg.version, "destination")
        check_transport(msg.transport, src.transport.name, "destination")
        check_same_model(msg.model, src.model, "destination")
        dst = spec_from_wire(msg.spec)
        p = plan(src.spec, dst)
        if msg.rank >= dst.tp:
            raise ProtocolError(f"welcome: rank={msg.rank} is past the destination's tp={dst.tp}")
        piece = next((x for x in p.targets_of(src.rank) if x.dst_rank == msg.rank), None)
        if piece is None:  # another source rank covers this destination rank
            conn.close()
            src._call(lambda: set_idle(src, msg.engine, p, msg.rank, (host, port), conn))
            return None
        check_welcome_proof(msg, token, nonce)
        if msg.slot_bytes is None or (msg.metadata is None and src.transport.reads_offered):
            raise ProtocolError("welcome lacks the destination's slot size, or the metadata its offers need")
        warm = warm_offer(src, msg.metadata)
        offer = make_offer(src, p, msg, warm[0] if warm else None)
        conn.send(offer.to_wire())
        opened = await_opened(src, conn, warm[1] if warm else None)
    except TransferFailed:
        conn.close()
        raise
    except (OSError, ConnectionError, KVStageError, ValueError) as e:
        conn.close()
        raise TransferFailed("-", f"destination {peer}", "handshake", str(e)) from e
    conn.sock.settimeout(None)
    src._call(lambda: add_target(src, msg, p, piece, conn, opened, (host, port)))
    src._watch(conn)
    return msg.rank


def warm_offer(src, metadata: bytes):
    """A two-sided transport: connect to the destination now and offer it the first 16 bytes of the arena,
    (ticket, handle), which it reads before its ``opened`` while this rank drives its transport: the
    connection's wire-up in both directions happens then, so no later read of a request waits for this
    process (a source stopped right after ``send`` is read all the same). None for a one-sided transport
    (the destination's first read of the arena does the same without an offer)."""
    if not src.transport.reads_offered:
        return None

    def offer():
        agent = src.transport.connect(metadata)
        return src.transport.offer(agent, Spans.single(src.arena_region, [0], [16]))

    return src._here(offer)


def make_offer(src, p: TransferPlan, welcome: Welcome, warm: bytes | None = None) -> Offer:
    """What the destination may read of this rank: its arena, its KV buffers where a page path can
    read them, and on this host its shared pages and event (ipc)."""
    kv = []
    if src._reads_pages() and (p.direct or src.cache.device.type == "cpu"):
        kv = [r.to_wire() for r in src.kv_regions()]
    ipc = None
    same_host = link_context(src.facts, welcome.facts).same_host if isinstance(welcome.facts, dict) else None
    if src._ipc is not None and same_host is True and "ipc" in (welcome.paths or ()):
        ipc = {"buffers": src._ipc["buffers"], "event": b64(src._ipc["event"].handle())}
    return Offer(src.arena_region.to_wire(), kv, ipc, warm)


def await_opened(src, conn: Connection, warm=None) -> Opened:
    """The destination's ``opened``, while this rank's transport is driven: the destination's first read
    of the arena (its connection's wire-up) needs this process's transport to answer. A source receives
    no notifications, so draining them is only the drive. ``warm``: the handle of a two-sided transport's
    warm offer (``warm_offer``), released once its reader took it."""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    answer = select.poll()  # not select(2): it sees no descriptor past 1023
    answer.register(conn.sock, select.POLLIN)
    try:
        while not answer.poll(1):  # milliseconds
            if time.monotonic() > deadline:
                raise ProtocolError(f"no opened within {HANDSHAKE_TIMEOUT_S:g} s")
            src._here(src.transport.notifications)
        opened = _expect(conn, Opened)
        while warm is not None and src._here(lambda: src.transport.poll(warm)) is WriteState.PENDING:
            if time.monotonic() > deadline:
                raise ProtocolError(f"the destination did not take the first read within {HANDSHAKE_TIMEOUT_S:g} s")
            time.sleep(0.0005)
        return opened
    finally:
        if warm is not None:
            src._here(lambda: (src.transport.abandon(warm), src.transport.release(warm)))


def set_idle(src, engine: str, p: TransferPlan, rank: int, address: tuple, conn: Connection) -> None:
    decode_engine(src, engine, p, conn)
    remember(src._idle, address, (engine, rank), MAX_IDLE_ADDRESSES)


def decode_engine(src, engine: str, p: TransferPlan, conn: Connection) -> DestinationEngine:
    """The decode engine ``engine`` with plan ``p``: one engine's ranks share one spec. An engine
    none of whose ranks is connected any more may come back with another."""
    eng = src.engines.get(engine)
    if eng is not None and p.dst != eng.plan.dst:
        if eng.targets:
            conn.close()
            raise TransferFailed(
                "-",
                conn.peer,
                "handshake",
                f"destination spec {p.dst} differs from "
                f"{eng.plan.dst}, which engine {engine!r}'s other ranks connected with",
            )
        eng = None
    if eng is None:
        eng = src.engines[engine] = DestinationEngine(engine, p)
        log.info("src %d: decode engine %r: %s -> %s", src.rank, engine, p.src, p.dst)
    return eng


def add_target(
    src, welcome: Welcome, p: TransferPlan, piece: Piece, conn: Connection, opened: Opened, address: tuple
) -> None:
    eng = decode_engine(src, welcome.engine, p, conn)
    old = eng.targets.get(welcome.rank)
    if old is not None:  # the same identity again: the new connection replaces the old one
        src._replace_peer(old.conn, old.name, conn.peer)
        eng = decode_engine(src, welcome.engine, p, conn)  # made anew if the old connection was its last
    # a one-sided transport's reads need nothing of the destination here: its metadata is not even loaded,
    # so this rank holds no key to the destination's memory; a two-sided one's offers go to its endpoint
    assert welcome.slot_bytes is not None  # _on_welcome refuses a welcome without it
    agent = ""
    if src.transport.reads_offered:
        assert welcome.metadata is not None  # _on_welcome refuses a welcome without it for this transport
        agent = src.transport.connect(welcome.metadata)
    name = rank_name(welcome.engine, "destination", welcome.rank)
    conn.peer = f"{name} ({conn.peer})"
    paths = allowed(src.settings) & frozenset(Path(x) for x in (welcome.paths or ()) if x in route.PATH_SETTINGS)
    target = eng.targets[welcome.rank] = Target(
        welcome.engine,
        welcome.rank,
        conn,
        agent,
        p,
        piece,
        address,
        opened.ipc,
        paths,
        max(1, welcome.slot_bytes // max(1, p.dst_token_bytes())),
    )
    src._targets[conn] = target
    src._pinged_peer(conn)
    if opened.ipc:
        log.info("src %d: %s opened this rank's KV pages (CUDA IPC): it reads them in one pass", src.rank, conn.peer)
    elif src._ipc is not None and opened.reason:
        log.info("src %d: %s did not open this rank's KV pages (%s)", src.rank, conn.peer, opened.reason)
    log.debug(
        "src %d: connected to %s, heads %d..%d, buffers %d..%d",
        src.rank,
        conn.peer,
        piece.heads.start,
        piece.heads.stop,
        piece.buffers.start,
        piece.buffers.stop,
    )
    src._log_link(welcome.facts, conn.peer, None, pages=False, label=peer_label(welcome.engine, welcome.rank))
    for out in list(src.requests.values()):  # requests sent to any engine before this one connected
        if out.engine is None and out.bound is None and not out.handle.done():
            src_requests.announce(src, out, [target])


def allowed(settings) -> frozenset:
    """The paths this rank's settings allow: ``path`` (auto: all), with no page path without a token."""
    paths = route.allowed_paths(settings.path)
    return paths if settings.auth_token else paths & {Path.READ}


def _expect(conn: Connection, cls):
    """The next message on a handshaking connection, which must be a ``cls`` (an ``error`` is a refusal). A
    ping is passed over: the destination pings a source from its hello on, so one may come before its answer."""
    try:
        msg = decode(conn.recv())
        while isinstance(msg, Ping):
            msg = decode(conn.recv())
    except TimeoutError:  # the socket's timeout is the handshake's
        raise ProtocolError(f"no {cls.TYPE} within {HANDSHAKE_TIMEOUT_S:g} s: timed out") from None
    if isinstance(msg, Error):
        log.warning("destination %s refused this source: %s", conn.peer, msg.reason)
        raise TransferFailed("-", f"destination {conn.peer}", "handshake", f"refused: {msg.reason}")
    if not isinstance(msg, cls):
        raise ProtocolError(f"expected {cls.TYPE}, got {msg.TYPE}")
    return msg
