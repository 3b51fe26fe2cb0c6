"""A destination's door: the thread that accepts connections on its listening socket, and the
arena slots it lends to ``kvstage probe --peer`` (probe leases). Kept apart from the request path:
neither touches a request."""

from __future__ import annotations

import logging
import time

from kvstage.errors import ProtocolError
from kvstage.protocol.handshake import (
    HANDSHAKE_TIMEOUT_S,
    check_token,
    check_transport,
    check_version,
    md_to_wire,
)
from kvstage.protocol.messages import (
    Probe,
)
from kvstage.protocol.wire import Connection
from kvstage.transports.base import Region

log = logging.getLogger("kvstage")


#: a probe's lent slot goes back this long after it was lent: a measured write takes milliseconds
PROBE_LEASE_S = 10.0


#: probes hold at most this share of the arena's slots at once (at least one): requests keep the rest
PROBE_SHARE = 0.25


#: after a failed accept (out of descriptors), the listener waits this long, doubling to ``ACCEPT_BACKOFF_MAX_S``
ACCEPT_BACKOFF_S = 0.01


ACCEPT_BACKOFF_MAX_S = 1.0


#: a burst of failed accepts ends with an accept this long after the last failure
ACCEPT_QUIET_S = 2 * ACCEPT_BACKOFF_MAX_S


def accept(dst) -> None:
    """Accept connections until closed. A failed accept (out of descriptors, a connection
    aborted before it was taken) is logged once per burst; the listener backs off and goes on,
    and says so when it has accepted again with no failure for ``ACCEPT_QUIET_S``."""
    failed, last_failure, backoff = 0, 0.0, ACCEPT_BACKOFF_S
    while not dst._closing:
        try:
            sock, addr = dst._listener.accept()
        except OSError as e:
            if dst._closing or dst._listener.fileno() < 0:
                return
            if not failed:
                log.warning(
                    "dst %d: accept failed: %s; retrying, backing off up to %g s",
                    dst.rank,
                    e,
                    ACCEPT_BACKOFF_MAX_S,
                )
            failed, last_failure = failed + 1, time.monotonic()
            time.sleep(backoff)
            backoff = min(2 * backoff, ACCEPT_BACKOFF_MAX_S)
            continue
        backoff = ACCEPT_BACKOFF_S
        if failed and time.monotonic() - last_failure > ACCEPT_QUIET_S:
            log.warning("dst %d: accepting again after %d failed accepts", dst.rank, failed)
            failed = 0
        try:
            conn = Connection(sock, f"{addr[0]}:{addr[1]}")
        except OSError:  # reset before its options could be set
            sock.close()
            continue
        dst._watch(conn, authenticate_within=HANDSHAKE_TIMEOUT_S)


def on_probe(dst, conn: Connection, msg: Probe) -> None:
    """``kvstage probe --peer``: lend one free arena slot for a measured write.

    The prober writes into that slot only, the same memory KV chunks are read
    into. A lease needs this rank's secret (the auth token, or the secret in
    its address; a destination without either lends nothing), one per
    connection, at most ``PROBE_SHARE`` of the slots at once; the slot
    returns when the prober disconnects or after ``PROBE_LEASE_S``, when its
    connection is closed."""
    if conn in dst._probes:
        raise ProtocolError("one probe per connection")
    check_version(msg.version, "prober")
    check_token(msg.token, dst.secret)
    check_transport(msg.transport, dst.transport.name, "prober")
    if not dst.secret:
        raise ProtocolError(
            "probe: this destination has no auth token and lends slots only to peers presenting "
            "one; set KVSTAGE_AUTH_TOKEN on both sides"
        )
    if not dst.transport.one_sided:
        raise ProtocolError(
            f"probe: this destination moves bytes with transport={dst.transport.name}; `kvstage probe --peer` "
            "measures NIXL writes only; the ucx transport logs the UCX it runs at connect (docs/transports.md)"
        )
    nbytes = min(msg.nbytes, dst.arena.slot_bytes)
    most = max(1, int(dst.arena.allocator.count * PROBE_SHARE))
    if len(dst._probes) >= most:
        raise ProtocolError(f"busy: {len(dst._probes)} probes hold the {most} slots probes may use; probe again later")
    slot = dst.arena.allocator.acquire()
    if slot is None:
        raise ProtocolError(f"busy: all {dst.arena.allocator.count} arena slots are in use; probe again later")
    dst._probes[conn] = (slot, msg.agent, time.monotonic() + PROBE_LEASE_S)
    dst._admit(conn)
    base = dst.arena_region
    region = Region(base.addr + dst.arena.offset(slot), nbytes, base.device, base.device_id)
    conn.send(
        {
            "type": "probe_ok",
            "facts": dst.facts,
            "metadata": md_to_wire(dst.transport.metadata()),
            "region": region.to_wire(),
            "rank": dst.rank,
            "lease_s": PROBE_LEASE_S,
        }
    )
    log.info(
        "dst %d: lent slot %d (%d bytes) to a probe from %s for %g s",
        dst.rank,
        slot,
        nbytes,
        conn.peer,
        PROBE_LEASE_S,
    )


def end_leases(dst, now: float) -> None:
    for conn, (slot, _, until) in list(dst._probes.items()):
        if now > until:
            log.info(
                "dst %d: the probe lease of %s ended after %g s: slot %d returns",
                dst.rank,
                conn.peer,
                PROBE_LEASE_S,
                slot,
            )
            conn.close()
            dst._drop(conn, "probe lease ended")
