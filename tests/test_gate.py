"""The control port's gate rules on their own (pure: the clock is the caller's)."""

import logging

import pytest

from kvstage.config import Settings
from kvstage.errors import ConfigError
from kvstage.protocol import gate
from kvstage.protocol.gate import REFUSAL_INTERVAL_S, RefusalLog, check_listen, host_of, is_loopback


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_repeats_of_one_refusal_are_counted_and_reported_once_the_interval_ends(caplog):
    log = RefusalLog(logging.getLogger("kvstage.test_gate"), "dst 0")
    with caplog.at_level(logging.WARNING, logger="kvstage.test_gate"):
        for i in range(5):
            log.refuse("10.0.0.9", "bad token", now=i * 0.1)
        log.refuse("10.0.0.9", "not JSON", now=0.5)  # another cause: its own line
        log.flush(now=REFUSAL_INTERVAL_S - 0.1)  # the interval has not ended
        assert _lines(caplog) == ["dst 0: refused 10.0.0.9: bad token", "dst 0: refused 10.0.0.9: not JSON"]
        log.flush(now=REFUSAL_INTERVAL_S + 1)
        assert _lines(caplog)[2:] == [f"dst 0: refused 10.0.0.9 4 more times in {REFUSAL_INTERVAL_S:.0f} s: bad token"]
        log.refuse("10.0.0.9", "bad token", now=REFUSAL_INTERVAL_S + 2)  # a new interval: a line again
        assert _lines(caplog)[-1] == "dst 0: refused 10.0.0.9: bad token"


def test_a_refusal_after_its_interval_reports_the_repeats_then_logs_anew(caplog):
    log = RefusalLog(logging.getLogger("kvstage.test_gate"), "dst 0")
    with caplog.at_level(logging.WARNING, logger="kvstage.test_gate"):
        log.refuse("h", "c", now=0.0)
        log.refuse("h", "c", now=1.0)
        log.refuse("h", "c", now=REFUSAL_INTERVAL_S + 1)
    assert _lines(caplog) == ["dst 0: refused h: c", f"dst 0: refused h 1 more times in {REFUSAL_INTERVAL_S:.0f} s: c",
                              "dst 0: refused h: c"]


def test_the_oldest_key_goes_first_past_the_cap(monkeypatch, caplog):
    monkeypatch.setattr(gate, "MAX_REFUSAL_KEYS", 2)
    log = RefusalLog(logging.getLogger("kvstage.test_gate"), "dst 0")
    with caplog.at_level(logging.WARNING, logger="kvstage.test_gate"):
        log.refuse("a", "c", now=0.0)
        log.refuse("a", "c", now=0.1)
        log.refuse("b", "c", now=0.2)
        log.refuse("d", "c", now=0.3)  # past the cap: a's repeats are reported now
    assert _lines(caplog) == ["dst 0: refused a: c", "dst 0: refused b: c",
                              f"dst 0: refused a 1 more times in {REFUSAL_INTERVAL_S:.0f} s: c", "dst 0: refused d: c"]


@pytest.mark.parametrize("peer,host", [("127.0.0.1:4100", "127.0.0.1"), ("::1:4100", "::1"), ("source rank 0", "source rank 0")])
def test_a_peer_address_without_its_port(peer, host):
    assert host_of(peer) == host


@pytest.mark.parametrize("host,want", [("127.0.0.1", True), ("::1", True), ("localhost", True), ("0.0.0.0", False),
                                       ("", False), ("10.1.2.3", False)])
def test_loopback_addresses(host, want):
    assert is_loopback(host) is want


def test_a_tokenless_port_off_loopback_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"x: listen address '10.1.2.3' is not loopback.*KVSTAGE_AUTH_TOKEN"):
        check_listen(Settings(auth_token=""), ("10.1.2.3", 0), "x")
    check_listen(Settings(auth_token=""), ("127.0.0.1", 0), "x")
    check_listen(Settings(auth_token="t"), ("10.1.2.3", 0), "x")
    check_listen(Settings(auth_token="", allow_unauthenticated=True), ("10.1.2.3", 0), "x")
