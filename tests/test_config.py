"""Settings: each one's variable, default and refusal; few enough to hold in one's head."""

import dataclasses
import pathlib
import re

import pytest

from kvstage.config import Settings
from kvstage.errors import ConfigError

DOCS = pathlib.Path(__file__).parent.parent / "docs" / "configuration.md"
#: every setting there is; a new one must earn its place here (and in the docs table)
NAMES = ("transport", "auth_token", "arena_mb", "arena", "path", "checksum", "ready_timeout_s", "stall_timeout_s", "peer_timeout_s",
         "allow_unauthenticated", "metrics_port")


def test_the_settings_are_these_eleven():
    """Everything else is a constant or a rule beside its code: the list stays short on purpose."""
    assert tuple(f.name for f in dataclasses.fields(Settings)) == NAMES


def test_defaults_without_variables(monkeypatch):
    for f in dataclasses.fields(Settings):
        monkeypatch.delenv(f"KVSTAGE_{f.name.upper()}", raising=False)
    s = Settings()
    assert (s.transport, s.auth_token, s.arena_mb, s.arena, s.path) == ("nixl", "", None, "auto", "auto")
    assert (s.ready_timeout_s, s.stall_timeout_s, s.peer_timeout_s) == (120.0, 30.0, 30.0)
    assert s.allow_unauthenticated is False and s.arena_bytes is None and s.metrics_port is None
    assert not s.offers_pages  # no token: no peer is given this rank's KV pages


@pytest.mark.parametrize("name,raw,want", [
    ("transport", "ucx", "ucx"), ("arena_mb", "1.5", 1.5), ("arena", "host", "host"), ("path", "read", "read"),
    ("path", "ipc", "ipc"), ("ready_timeout_s", "7", 7.0), ("stall_timeout_s", "3.5", 3.5),
    ("peer_timeout_s", "30", 30.0), ("allow_unauthenticated", "yes", True), ("allow_unauthenticated", "0", False),
    ("auth_token", "s3cret", "s3cret"), ("metrics_port", "9400", 9400),
])
def test_each_setting_reads_its_variable(monkeypatch, name, raw, want):
    monkeypatch.delenv("KVSTAGE_PATH", raising=False)
    monkeypatch.delenv("KVSTAGE_TRANSPORT", raising=False)
    monkeypatch.setenv(f"KVSTAGE_{name.upper()}", raw)
    assert getattr(Settings(), name) == want


def test_an_empty_variable_is_the_default(monkeypatch):
    monkeypatch.setenv("KVSTAGE_PATH", "")
    monkeypatch.setenv("KVSTAGE_ARENA_MB", "")
    s = Settings()
    assert s.path == "auto" and s.arena_mb is None


@pytest.mark.parametrize("var,raw,needle", [
    ("KVSTAGE_ARENA_MB", "lots", "KVSTAGE_ARENA_MB='lots': must be a float"),
    ("KVSTAGE_ALLOW_UNAUTHENTICATED", "maybe", "KVSTAGE_ALLOW_UNAUTHENTICATED='maybe': must be a bool"),
    ("KVSTAGE_PEER_TIMEOUT_S", "soon", "KVSTAGE_PEER_TIMEOUT_S='soon': must be a float"),
    ("KVSTAGE_METRICS_PORT", "http", "KVSTAGE_METRICS_PORT='http': must be a int"),
    ("KVSTAGE_PATH", "fast", "path='fast': must be one of auto, ipc, direct, pages, read"),
])
def test_a_malformed_variable_is_refused_by_name(monkeypatch, var, raw, needle):
    monkeypatch.setenv(var, raw)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        Settings()


@pytest.mark.parametrize("kw,needle", [
    ({"arena_mb": 0.001}, "arena_mb=0.001: must be at least 4 KiB"),
    ({"arena_mb": True}, "arena_mb=True"),
    ({"transport": "tcp"}, "transport='tcp': must be one of nixl, ucx, cma"),
    ({"path": "staged"}, "path='staged': must be one of auto, ipc, direct, pages, read"),
    ({"path": "direct", "transport": "ucx"}, "path='direct' with transport='ucx'"),
    ({"path": "pages", "transport": "ucx"}, "path='pages' with transport='ucx'"),
    ({"arena": "gpu"}, "arena='gpu': must be one of auto, device, host"),
    ({"peer_timeout_s": 1.5}, "peer_timeout_s=1.5: must be >= 2 s"),
    ({"stall_timeout_s": 0}, "stall_timeout_s=0: must be a number of seconds > 0"),
    ({"ready_timeout_s": float("nan")}, "ready_timeout_s=nan"),
    ({"ready_timeout_s": "5"}, "ready_timeout_s='5': must be a number of seconds > 0"),
    ({"allow_unauthenticated": "yes"}, "allow_unauthenticated='yes': must be true or false"),
    ({"auth_token": 7}, "auth_token=7: must be a string"),
    ({"metrics_port": 70000}, "metrics_port=70000: must be a port number in 1..65535, or unset"),
    ({"metrics_port": True}, "metrics_port=True: must be a port number"),
    ({"metrics_port": "9400"}, "metrics_port='9400': must be a port number"),
])
def test_a_bad_value_is_refused_naming_field_value_and_rule(kw, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        Settings(**kw)


def test_a_forced_path_a_two_sided_transport_can_take_is_accepted():
    """ucx cannot read a peer's pages one-sidedly, but the read path and the ipc path (CUDA IPC, no
    transport read) need no such read."""
    assert Settings(transport="ucx", path="read").path == "read"
    assert Settings(transport="ucx", path="ipc").path == "ipc"


def test_a_rank_offers_its_pages_only_with_a_token_and_a_path_that_reads_them():
    assert Settings(auth_token="t").offers_pages
    assert Settings(auth_token="t", path="ipc").offers_pages
    assert Settings(auth_token="t", path="pages", transport="cma").offers_pages
    assert not Settings(auth_token="t", path="read").offers_pages  # only the arena is read
    assert not Settings(auth_token="").offers_pages  # a peer is given the pages only when it presented a token


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


def test_checksum_is_off_sampled_or_all_on_every_path():
    assert Settings(checksum="all").checksum == "all"
    with pytest.raises(ConfigError, match="checksum='every': must be one of off, sampled, all"):
        Settings(checksum="every")
    for path in ("ipc", "direct", "pages", "read"):  # every path carries the checksum (protocol.checksums)
        assert Settings(checksum="all", path=path, auth_token="t" * 16).checksum == "all"
