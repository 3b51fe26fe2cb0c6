"""Writes from a source the destination has lost: its control connection closed,
but its NIXL agent still reaches the arena (UCX keeps its own connections; a cut
link delivers what it queued once it is back). Such a write must not land in a
slot granted to someone else: the lost writer's slots stay out of use until the
write's notice says it is over, or ``late_write_hold_s`` passes.

A real destination and hand-driven sources (tests/support/fake_peers.py) with real NIXL
agents, so the late write is a real one-sided write at its old grant's offset.
"""

from __future__ import annotations

import logging
import time

import pytest

from support import fault_ranks as fr
from support.fake_peers import FakeSource, expect_reversed as _expect
from kvstage.config import Settings
from kvstage.errors import TransferFailed
from kvstage.protocol.destination import ANSWERED_HOLD_S, Destination
from kvstage.protocol.request import State
from kvstage.staging.cache import RankCache
from kvstage.tp import SideSpec

TOKEN = "late-write-test"
CHUNK = 32  # tokens per chunk: 16 KiB slots, 512 B a token (fault_ranks geometry, source TP 1)


def _dst(hold: float, **over) -> Destination:
    # peer_timeout_s: the fake sources answer grants but do not ping like a real one
    return Destination(RankCache.allocate(fr.dst_spec(), 0, 1024),
                       Settings(**fr.SETTINGS, auth_token=TOKEN, peer_timeout_s=600, late_write_hold_s=hold, **over))


def _lost_with_four_grants(dst: Destination, answered: bool):
    """A source granted all four slots for request 'old', then lost before writing
    any; its NIXL agent stays connected. ``answered``: it closes its control
    connection (the destination reads the end of stream). Otherwise the
    destination drops the connection as it does when a read fails with
    ETIMEDOUT (a cut link; tests/test_link_cut.py cuts a real one)."""
    old = FakeSource(dst.address, TOKEN)
    h, _ = _expect(dst, "old", 4 * CHUNK, 0)
    old.announce("old", 4 * CHUNK, 3)
    grants = {c: old.grant("old", c) for c in range(4)}
    assert dst.slots_free() == 0
    if answered:
        old.conn.close()
    else:
        dst._call(lambda: dst._drop(dst.engines[""].writers[0].conn, "[Errno 110] Connection timed out", answered=False))
    with pytest.raises(TransferFailed) as err:
        h.wait(10)
    assert err.value.peer == "source rank 0" and "connection lost" in err.value.cause, err.value
    return old, grants


def test_a_lost_writers_slots_wait_for_its_late_writes(caplog):
    dst = _dst(hold=600)
    old = new = None
    try:
        old, grants = _lost_with_four_grants(dst, answered=False)
        assert dst.slots_free() == 0 and dst.late_write_holds() == 4 and dst.tracks("old")
        lost = [r.getMessage() for r in caplog.records if "was lost with" in r.getMessage()]
        assert lost and "4 granted chunks not landed" in lost[0] and "600 s pass" in lost[0], lost

        # the same rank comes back (a new agent) with a new request: nothing can be granted yet
        new = FakeSource(dst.address, TOKEN)
        h2, ids2 = _expect(dst, "new", 4 * CHUNK, 200)
        new.announce("new", 4 * CHUNK, 7)
        with pytest.raises(TimeoutError):
            new.grant("new", 0, timeout=0.5)
        assert h2.state is State.TRANSFERRING

        # the lost writer's write of chunk 2 lands late, at its old grant, with its notice: that slot alone is free
        old.write("old", grants[2])
        g0 = new.grant("new", 0)
        assert g0["offset"] == grants[2]["offset"] and dst.late_write_holds() == 3
        late = [r.getMessage() for r in caplog.records if "after the loss" in r.getMessage()]
        assert late and "chunk 2 of old from lost source rank 0 landed" in late[0], late

        # the new request runs through that one slot while the others wait; a late write of chunk 0 lands
        # between new's chunks, into its own old slot, which is still held, so new stays byte-exact
        new.write("new", g0)
        old.write("old", grants[0])
        for c in range(1, 4):
            new.write("new", new.grant("new", c))
        h2.wait(10)
        assert fr.check(dst.cache, 7, ids2, 4 * CHUNK) == []
        # old's chunk-0 notice came from another agent than new's: read in its own time, not before h2's end
        fr.until(lambda: dst.late_write_holds() == 2 and dst.slots_free() == 2)
        assert dst.tracks("old")

        for c in (1, 3):
            old.write("old", grants[c])
        fr.until(lambda: dst.slots_free() == 4)
        assert dst.late_write_holds() == 0 and not dst.tracks("old")
    finally:
        for s in (old, new):
            if s is not None:
                s.close()
        dst.close()


@pytest.mark.parametrize("answered", [False, True], ids=["stopped-answering", "closed"])
def test_a_lost_writers_slots_come_back_when_the_hold_ends(caplog, answered):
    """Stopped answering: ``late_write_hold_s``. Closed by its host (a killed
    process: the link is up, what it queued arrives within round trips): about a
    second, whatever ``late_write_hold_s`` says."""
    caplog.set_level(logging.INFO, "kvstage")
    dst = _dst(hold=600 if answered else 2.0)
    old = None
    try:
        old, grants = _lost_with_four_grants(dst, answered)
        assert dst.late_write_holds() == 4
        fr.until(lambda: dst.slots_free() == 4, limit=10)
        assert dst.late_write_holds() == 0 and not dst.tracks("old")
        lost = [r for r in caplog.records if "was lost with" in r.getMessage()]
        over = [r for r in caplog.records if "hold over for lost source rank 0" in r.getMessage()]
        assert len(over) == 1 and "4 chunks released with no notice of their writes" in over[0].getMessage(), over
        assert over[0].levelno == (logging.INFO if answered else logging.WARNING)
        took = over[0].created - lost[0].created  # both logged by the destination's loop: the hold as it ran
        hold = ANSWERED_HOLD_S if answered else 2.0
        assert hold - 0.05 < took < hold + 3, took  # the loss line is logged just after its hold is set
    finally:
        if old is not None:
            old.close()
        dst.close()


def test_an_abort_ack_from_a_writer_that_came_back_does_not_free_a_lost_writers_slots():
    """The same rank reconnected says it has no write of 'old' in flight: true of
    the new process, not of what the lost one queued."""
    dst = _dst(hold=600)
    old = new = None
    try:
        old, grants = _lost_with_four_grants(dst, answered=False)
        new = FakeSource(dst.address, TOKEN)
        new.conn.send({"type": "abort_ack", "req": "old"})
        time.sleep(0.3)
        assert dst.late_write_holds() == 4 and dst.slots_free() == 0
    finally:
        for s in (old, new):
            if s is not None:
                s.close()
        dst.close()


def test_a_lost_direct_writer_keeps_its_requests_pages_held():
    """The direct path writes into the request's own pages, not a slot: those stay
    held (``tracks``) until the hold ends, so an engine does not reuse them."""
    dst = _dst(hold=2.0, direct=True)
    old = None
    try:
        old = FakeSource(dst.address, TOKEN, spec=SideSpec(fr.GEO, 1, fr.dst_spec().page))  # same paging: direct
        h, _ = _expect(dst, "d", 4 * CHUNK, 0)
        old.announce("d", 4 * CHUNK, 3)
        g = old.grant("d", 0)
        assert g["chunks"] == 1 and "pages" in g, g  # one direct write into the request's pages
        dst._call(lambda: dst._drop(dst.engines[""].writers[0].conn, "[Errno 110] Connection timed out", answered=False))
        with pytest.raises(TransferFailed):
            h.wait(10)
        t_lost = time.monotonic()
        assert dst.tracks("d") and dst.late_write_holds() == 0 and dst.slots_free() == 4
        fr.until(lambda: not dst.tracks("d"), limit=10)
        assert 1.8 < time.monotonic() - t_lost < 5
    finally:
        if old is not None:
            old.close()
        dst.close()
