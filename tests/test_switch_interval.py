"""``switch_interval_us``: the interpreter's switch interval while the endpoints that ask
for it are open, put back when the last of them closes (``protocol.switch_interval``;
real endpoints over real NIXL)."""

from __future__ import annotations

import logging
import math
import sys

import pytest

import fault_ranks as fr
from kvstage.config import Settings
from kvstage.errors import ConfigError
from kvstage.protocol import switch_interval
from kvstage.protocol.destination import Destination
from kvstage.protocol.source import Source
from kvstage.staging.cache import RankCache


@pytest.fixture
def interval():
    """The interval before the test, put back after it whatever the test did."""
    before = sys.getswitchinterval()
    yield before
    while switch_interval.holders():
        switch_interval.release("test")
    sys.setswitchinterval(before)


def near(seconds: float) -> bool:
    """The interpreter keeps the interval in whole microseconds, rounding down."""
    return abs(sys.getswitchinterval() - seconds) <= 1.5e-6


def test_settings_refuse_an_interval_out_of_range(monkeypatch):
    for bad in (5, 2_000_000, -1, math.nan, math.inf, True, "500"):
        with pytest.raises(ConfigError, match=r"switch_interval_us=.*: must be a number of microseconds in "
                                              r"\[10, 1000000\], or unset"):
            Settings(switch_interval_us=bad)
    monkeypatch.setenv("KVSTAGE_SWITCH_INTERVAL_US", "short")
    with pytest.raises(ConfigError, match="KVSTAGE_SWITCH_INTERVAL_US='short': must be a float"):
        Settings()
    monkeypatch.setenv("KVSTAGE_SWITCH_INTERVAL_US", "250")
    assert Settings().switch_interval_us == 250
    monkeypatch.delenv("KVSTAGE_SWITCH_INTERVAL_US")
    assert Settings().switch_interval_us is None


def test_claims_nest_the_last_one_sets_and_the_last_release_puts_the_interval_back(interval):
    switch_interval.claim(1000, "a")
    assert near(1e-3) and switch_interval.holders() == 1
    switch_interval.claim(200, "b")
    assert near(2e-4) and switch_interval.holders() == 2
    switch_interval.release("a")
    assert near(2e-4) and switch_interval.holders() == 1
    switch_interval.release("b")
    assert sys.getswitchinterval() == interval and switch_interval.holders() == 0
    switch_interval.release("c")  # nothing held: nothing changes
    assert sys.getswitchinterval() == interval and switch_interval.holders() == 0


def test_an_interval_changed_outside_kvstage_is_left_as_it_is(interval, caplog):
    switch_interval.claim(1000, "a")
    sys.setswitchinterval(0.002)
    with caplog.at_level(logging.INFO, logger="kvstage"):
        switch_interval.release("a")
    assert near(0.002)
    assert "changed to 2000 µs outside kvstage; left as it is" in caplog.text


def test_endpoints_hold_the_interval_while_open_and_an_endpoint_without_the_setting_leaves_it(interval, caplog):
    settings = Settings(**fr.SETTINGS, switch_interval_us=500)
    with caplog.at_level(logging.INFO, logger="kvstage"):
        plain = Destination(RankCache.allocate(fr.dst_spec(), 0, 8), Settings(**fr.SETTINGS))
        try:
            assert sys.getswitchinterval() == interval and switch_interval.holders() == 0
        finally:
            plain.close()
        dst = Destination(RankCache.allocate(fr.dst_spec(), 0, 8), settings)
        src = Source(RankCache.allocate(fr.src_spec(1), 0, 8), settings)
        try:
            src.connect([dst.address])
            assert near(5e-4) and switch_interval.holders() == 2
            dst.close()
            assert near(5e-4) and switch_interval.holders() == 1  # the source still holds it
        finally:
            src.close()
            dst.close()
    assert sys.getswitchinterval() == interval and switch_interval.holders() == 0
    lines = [r.getMessage() for r in caplog.records if "switch interval" in r.getMessage()]
    assert len(lines) == 2, lines  # one line per change: set by the first claim, put back by the last release
    assert "is now 500 µs" in lines[0] and f"is back to {interval * 1e6:g} µs" in lines[1]
