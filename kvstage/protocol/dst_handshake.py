"""The destination's half of the handshake with each source rank: the hello's answer (``welcome``),
the offer, the pages opened for the ipc kernel, and the first read of the source's arena before
``opened``. Apart from the request path, which starts only once a writer is offered."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from kvstage.errors import IncompatibleGeometry, KVStageError, ProtocolError
from kvstage.link.context import link_context
from kvstage.protocol import dst_grants, dst_requests
from kvstage.protocol.common import peer_label, rank_name
from kvstage.protocol.handshake import (
    HANDSHAKE_TIMEOUT_S,
    check_hello,
    check_same_model,
    proof,
    spec_to_wire,
)
from kvstage.protocol.incoming import SourceEngine, Writer
from kvstage.protocol.messages import (
    PROTOCOL_VERSION,
    Error,
    Hello,
    Offer,
    Opened,
    Welcome,
)
from kvstage.protocol.route import Path
from kvstage.protocol.wire import Connection
from kvstage.transports.base import Region, WriteState

log = logging.getLogger("kvstage")


def on_hello(dst, conn: Connection, msg: Hello) -> None:
    src, rank = check_hello(msg, dst.secret, dst.transport.name)  # nothing of this side is told before it
    check_same_model(msg.model, dst.model, "source")
    from kvstage.tp import plan

    p = plan(src, dst.spec)
    engine = msg.engine
    eng = dst.engines.get(engine)
    if eng is not None and p.src != eng.plan.src:
        if eng.writers or any(inc.engine == engine for inc in dst.requests.values()):
            raise IncompatibleGeometry(
                f"source spec {src} differs from the spec {eng.plan.src} engine {engine!r}'s "
                "other ranks connected with; one engine's ranks share one spec"
            )
        log.info("dst %d: prefill engine %r comes back with spec %s (was %s)", dst.rank, engine, src, eng.plan.src)
        eng = None
    piece = next((x for x in p.writers_of(dst.rank) if x.src_rank == rank), None)
    welcome = Welcome(
        PROTOCOL_VERSION,
        dst.engine,
        dst.model,
        spec_to_wire(dst.spec),
        dst.rank,
        dst.transport.name,
        None,
        None,
        None,
        None,
        piece is not None,
    )
    if piece is None:  # nothing to read from it here; the source closes this connection
        dst._admit(conn)
        conn.send(welcome.to_wire())
        return
    if eng is None:
        eng = dst.engines[engine] = SourceEngine(engine, p)
        dst._gone.pop(engine, None)
        log.info("dst %d: prefill engine %r connects: %s -> %s", dst.rank, engine, p.src, p.dst)
    old = eng.writers.get(rank)
    if old is not None:  # the same identity again: the new connection replaces the old one
        dst._replace_peer(old.conn, old.name, conn.peer)
        eng = dst.engines.setdefault(engine, eng)  # kept anew if the old connection was its last
    name = rank_name(engine, "source", rank)
    conn.peer = f"{name} ({conn.peer})"
    paths = dst.paths & frozenset(Path(x) for x in msg.paths if x in {p.value for p in Path})
    writer = eng.writers[rank] = Writer(engine, rank, conn, dst.transport.connect(msg.metadata), piece, src, paths)
    eng.lost.pop(rank, None)  # back: its later requests are read again
    try:
        same_host = link_context(dst.facts, msg.facts).same_host
    except Exception:  # a peer's malformed facts: not known to be on this host
        same_host = None
    writer.local = same_host is True and msg.uid == os.getuid()
    dst._writers[conn] = writer
    dst._admit(conn)
    dst._log_link(msg.facts, conn.peer, msg.kv_facts, pages=bool(paths - {Path.READ}), label=peer_label(engine, rank))
    if p.direct and Path.DIRECT in paths:
        dst.kv_regions()  # registered before any direct read lands in these pages
    # a source needs this rank's metadata only to offer its bytes over a two-sided transport: one-sided, it
    # is not given it, so it holds no key to this rank's memory
    conn.send(
        dataclasses.replace(
            welcome,
            metadata=dst.transport.metadata() if dst.transport.reads_offered else None,
            slot_bytes=dst.arena.slot_bytes,
            facts=dst.facts,
            paths=sorted(x.value for x in paths),
            proof=proof(dst.secret, msg.nonce) if dst.secret else None,
        ).to_wire()
    )
    log.debug(
        "dst %d: %s connected, heads %d..%d, buffers %d..%d",
        dst.rank,
        conn.peer,
        piece.heads.start,
        piece.heads.stop,
        piece.buffers.start,
        piece.buffers.stop,
    )


def on_offer(dst, w: Writer, msg: Offer) -> None:
    """What the source made readable: its arena, its KV buffers, and on this host its pages and event
    (opened here for the ipc path, or said why not)."""
    if w.offered:
        raise ProtocolError("offer sent twice")
    try:
        w.arena = Region.from_wire(msg.arena)
        w.kv = [Region.from_wire(r) for r in msg.kv]
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"offer: a region is malformed: {e}") from None
    if w.kv and len(w.kv) != w.spec.geometry.buffers:
        raise ProtocolError(f"offer: {len(w.kv)} KV regions; the source's spec has {w.spec.geometry.buffers} buffers")
    if not w.kv:
        w.paths -= {Path.DIRECT, Path.PAGES}
    why = open_pages(dst, w, msg.ipc) if msg.ipc is not None else "not offered"
    if w.ipc is None:
        w.paths -= {Path.IPC}
    w.why_not_ipc = why or ""
    w.warm = warm_read(dst, w, msg.warm)
    if w.warm is None:
        offered(dst, w)


def warm_read(dst, w: Writer, ticket: bytes | None = None):
    """A first read of a few bytes of the source's arena, before any request: it makes the transport's
    connection to the source (whose wire-up needs the source's process, which waits for ``opened`` and
    drives its transport meanwhile), so no later read needs that process. A two-sided transport reads
    the source's warm offer (``ticket``). None where nothing is needed."""
    if w.arena is None or (dst.transport.reads_offered and not ticket):
        return None
    from kvstage.transports.base import Spans

    if dst._scratch is None:
        import torch

        buf = torch.zeros(4096, dtype=torch.uint8, device=dst.arena.buffer.device)
        dst._scratch = (buf, dst.transport.register(buf))
    local = Spans.single(dst._scratch[1], [0], [16])
    remote = Spans.single(w.arena, [0], [16])
    return dst.transport.read(w.agent, local, remote, ticket or b""), time.monotonic() + HANDSHAKE_TIMEOUT_S


def poll_warm(dst) -> None:
    for w in list(dst._writers.values()):
        if w.warm is None:
            continue
        handle, deadline = w.warm
        try:
            over = dst.transport.poll(handle) is not WriteState.PENDING
        except KVStageError as e:
            dst.transport.release(handle)
            w.warm = None
            refuse_writer(dst, w, f"the first read of its arena failed: {e}")
            continue
        if over:
            dst.transport.release(handle)
            w.warm = None
            offered(dst, w)
        elif time.monotonic() > deadline:
            w.warm = None
            refuse_writer(dst, w, f"the first read of its arena did not complete within {HANDSHAKE_TIMEOUT_S:g} s")


def refuse_writer(dst, w: Writer, why: str) -> None:
    log.warning("dst %d: %s refused: %s", dst.rank, w.name, why)
    dst._tell(w, Error(why, "offer"))
    w.conn.close()


def offered(dst, w: Writer) -> None:
    """The source's offer is in and its connection made: it may now be read, and hears ``opened``."""
    w.offered = True
    dst._tell(w, Opened(w.ipc is not None, w.why_not_ipc))
    while w.held:
        dst._tell(w, w.held.popleft())
    dst._pinged_peer(w.conn)  # from now on: a ping inside the handshake would come where the source
    # waits for its welcome or its opened
    for inc in list(dst.requests.values()):  # requests expected before every writer was connected
        if inc.engine == w.engine:
            dst_requests.refresh(dst, inc)
    dst_grants.start_chunks(dst)


def open_pages(dst, w: Writer, ipc: dict) -> str | None:
    """Open a source's shared pages and ready event for this rank's kernel; None, or why not."""
    if Path.IPC not in w.paths:
        return "the ipc path is not allowed here (path setting, no token, or no CUDA cache)"
    from kvstage.staging import ipc_read
    from kvstage.staging.shared_buffers import OpenedEvent, open_buffers

    why = ipc_read.refusal(w.spec, dst.spec)
    if why:
        return why
    if not w.local:
        return "the source runs on another host, or as another user"
    try:
        opened = open_buffers(ipc.get("buffers"), dst.cache.device)
    except KVStageError as e:
        return str(e)
    try:
        event = ipc.get("event")
        if not isinstance(event, str):
            raise ProtocolError("offer: the ipc event handle must be base64 text")
        import base64

        w.event = OpenedEvent(base64.b64decode(event, validate=True), dst.cache.device)
        w.ipc = dst._ipc_copier(w.engine).source(opened.spans)
        w.opened = opened
    except (KVStageError, ValueError) as e:  # a malformed handle, or spans the kernel cannot read
        opened.close()
        w.event = None
        return str(e)
    return None
