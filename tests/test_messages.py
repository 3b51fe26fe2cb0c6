"""Every control message has one definition (``protocol.messages``): decoded and checked in one
place, a bad field refused by name, round trips exact."""

import pytest

from kvstage.errors import ProtocolError
from kvstage.protocol.messages import (MAX_ID, Abort, Chunk, Done, Error, Offer, Opened, Ping, Read, Ready, Sums,
                                       decode)


@pytest.mark.parametrize("msg", [
    Ready("r1", 10, "read", None, 4, 3, [[0, 4096, ""]]),
    Ready("r1", 10, "ipc", [3, 1, 2]),
    Chunk("r1", 2, 8192, b"\x01\x02"),
    Chunk("r1", 2, 8192),
    Ready("r1", 10, "read", None, 4, 3, [[0, 4096, "", 0xFFFFFFFF]], "heads", checksum=True),
    Chunk("r1", 2, 8192, checksum=0x1234ABCD),
    Ready("r1", 10, "ipc", [3, 1, 2], checksum=True),
    Sums("r1", 0xFFFFFFFF),
    Sums("r1", 0, [0, 2], [16, 32]),
    Read("r1", 1),
    Done("r1"),
    Abort("r1", "why"),
    Opened(True, ""),
    Offer({"addr": 1}, [], None),
])
def test_round_trip(msg):
    assert decode(msg.to_wire()) == msg


@pytest.mark.parametrize("raw,needle", [
    ({"type": "nope"}, "unknown message type 'nope'"),
    ({"type": "read", "req": "r"}, "lacks field 'index'"),
    ({"type": "read", "req": "r", "index": -1}, "index=-1"),
    ({"type": "read", "req": "r", "index": True}, "must be int"),
    ({"type": "read", "req": "x" * (MAX_ID + 1), "index": 0}, "printable text of at most"),
    ({"type": "done", "req": "a\nb"}, "printable text"),
    ({"type": "ready", "req": "r", "tokens": 0, "path": "read"}, "below 1"),
    ({"type": "ready", "req": "r", "tokens": 4, "path": "ipc", "pages": [1, -2]}, "non-negative integer"),
    ({"type": "ready", "req": "r", "tokens": 4, "path": "ipc", "pages": [1, 2.0]}, "non-negative integer"),
    ({"type": "ready", "req": "r", "tokens": 4, "path": "ipc", "pages": [True]}, "non-negative integer"),
    ({"type": "chunk", "req": "r", "index": 0, "offset": 0, "ticket": "%%%"}, "not base64"),
    ({"type": "chunk", "req": "r", "index": 0, "offset": 0, "checksum": 1 << 32}, "checksum=4294967296: above"),
    ({"type": "chunk", "req": "r", "index": 0, "offset": 0, "checksum": -1}, "checksum=-1: below 0"),
    ({"type": "ready", "req": "r", "tokens": 4, "path": "read", "checksum": 1}, "checksum=1: must be bool"),
    ({"type": "sums", "req": "r"}, "lacks field 'checksum'"),
    ({"type": "sums", "req": "r", "checksum": 1 << 32}, "checksum=4294967296: above"),
    ({"type": "sums", "req": "r", "checksum": True}, "must be int"),
])
def test_a_bad_field_is_refused_by_name(raw, needle):
    with pytest.raises(ProtocolError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        decode(raw)


def test_error_and_ping_take_what_they_can_and_bound_it():
    e = decode({"type": "error", "reason": "x" * 5000, "about": 7, "req": "r"})
    assert isinstance(e, Error) and len(e.reason) == 300 and e.about == "7" and e.req == "r"
    assert decode({"type": "error", "reason": "x", "req": "a\nb"}).req is None
    assert decode({"type": "ping", "loop_s": 0.5}) == Ping(0.5)
    assert decode({"type": "ping", "loop_s": "late"}) == Ping(None)
    assert len(decode({"type": "abort", "req": "r", "reason": "y" * 1000}).reason) == 300
