"""Settings: each one's variable, default and refusal; few enough to hold in one's head."""

import dataclasses
import pathlib
import re

import pytest

from kvstage.config import Settings
from kvstage.errors import ConfigError

DOCS = pathlib.Path(__file__).parent.parent / "docs" / "configuration.md"


def test_at_most_thirteen_settings():
    assert len(dataclasses.fields(Settings)) <= 13, [f.name for f in dataclasses.fields(Settings)]


def test_defaults_without_variables(monkeypatch):
    for f in dataclasses.fields(Settings):
        monkeypatch.delenv(f"KVSTAGE_{f.name.upper()}", raising=False)
    s = Settings()
    assert (s.transport, s.auth_token, s.arena_mb, s.arena, s.direct, s.mapped) == ("nixl", "", None, "auto", None, "auto")
    assert (s.ready_timeout_s, s.stall_timeout_s, s.peer_timeout_s, s.late_write_hold_s) == (120.0, 30.0, 30.0, 60.0)
    assert s.allow_unauthenticated is False and s.arena_bytes is None and s.metrics_port is None
    assert not s.may_go_direct  # no token: no peer is given the KV pages' regions


@pytest.mark.parametrize("name,raw,want", [
    ("transport", "ucx", "ucx"), ("arena_mb", "1.5", 1.5), ("direct", "off", False), ("direct", "1", True),
    ("mapped", "on", "on"), ("peer_timeout_s", "30", 30.0), ("allow_unauthenticated", "yes", True),
    ("auth_token", "s3cret", "s3cret"), ("metrics_port", "9400", 9400),
])
def test_each_setting_reads_its_variable(monkeypatch, name, raw, want):
    monkeypatch.setenv(f"KVSTAGE_{name.upper()}", raw)
    if name == "transport":
        monkeypatch.delenv("KVSTAGE_DIRECT", raising=False)
    assert getattr(Settings(), name) == want


@pytest.mark.parametrize("var,raw,needle", [
    ("KVSTAGE_ARENA_MB", "lots", "KVSTAGE_ARENA_MB='lots': must be a float"),
    ("KVSTAGE_DIRECT", "maybe", "KVSTAGE_DIRECT='maybe': must be a bool"),
    ("KVSTAGE_PEER_TIMEOUT_S", "soon", "KVSTAGE_PEER_TIMEOUT_S='soon': must be a float"),
    ("KVSTAGE_METRICS_PORT", "http", "KVSTAGE_METRICS_PORT='http': must be a int"),
])
def test_a_malformed_variable_is_refused_by_name(monkeypatch, var, raw, needle):
    monkeypatch.setenv(var, raw)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        Settings()


@pytest.mark.parametrize("kw,needle", [
    ({"arena_mb": 0.001}, "arena_mb=0.001: must be at least 4 KiB"),
    ({"arena_mb": True}, "arena_mb=True"),
    ({"transport": "tcp"}, "transport='tcp': must be one of nixl, ucx, cma"),
    ({"transport": "ucx", "direct": True}, "direct=True with transport='ucx'"),
    ({"mapped": "maybe"}, "mapped='maybe': must be one of auto, on, off"),
    ({"transport": "ucx", "mapped": "on", "direct": None}, "mapped='on' with transport='ucx'"),
    ({"arena": "gpu"}, "arena='gpu': must be one of auto, device, host"),
    ({"peer_timeout_s": 1.5}, "peer_timeout_s=1.5: must be >= 2 s"),
    ({"stall_timeout_s": 0}, "stall_timeout_s=0: must be a number of seconds > 0"),
    ({"ready_timeout_s": float("nan")}, "ready_timeout_s=nan"),
    ({"allow_unauthenticated": "yes"}, "allow_unauthenticated='yes': must be true or false"),
    ({"auth_token": 7}, "auth_token=7: must be a string"),
    ({"auth_token": "", "direct": True}, "direct=True without auth_token"),
    ({"metrics_port": 70000}, "metrics_port=70000: must be a port number in 1..65535, or unset"),
    ({"metrics_port": True}, "metrics_port=True: must be a port number"),
    ({"metrics_port": "9400"}, "metrics_port='9400': must be a port number"),
])
def test_a_bad_value_is_refused_naming_field_value_and_rule(kw, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        Settings(**kw)


def test_the_direct_path_needs_a_one_sided_transport_and_a_token():
    assert not Settings(transport="ucx", auth_token="t").may_go_direct
    assert not Settings(direct=False, auth_token="t").may_go_direct
    assert Settings(transport="cma", auth_token="t").may_go_direct
    assert not Settings(transport="cma", auth_token="").may_go_direct


def test_every_setting_and_variable_is_in_the_docs_table():
    text = DOCS.read_text()
    for f in dataclasses.fields(Settings):
        assert f"`{f.name}`" in text and f"`KVSTAGE_{f.name.upper()}`" in text, f.name


def test_every_variable_kvstage_reads_is_in_the_docs_table():
    root = pathlib.Path(__file__).parent.parent / "kvstage"
    read = set()
    for path in root.rglob("*.py"):
        read |= set(re.findall(r'(?<![b\w])["\'](KVSTAGE_[A-Z_]+)["\']', path.read_text()))
    fields = {f"KVSTAGE_{f.name.upper()}" for f in dataclasses.fields(Settings)}
    text = DOCS.read_text()
    assert not {v for v in read - fields if f"`{v}`" not in text}
