"""Where a rank's staging arena lives (device or pinned host), and the setting behind it."""

import pytest
import torch

from kvstage.config import Settings
from kvstage.errors import ConfigError
from kvstage.staging.arena import choose_arena

CUDA = torch.device("cuda", 0)
MODS = ["cma", "cuda_copy", "cuda_ipc", "ib", "rdmacm"]


def test_host_cache_always_stages_through_host_memory():
    assert choose_arena("device", torch.device("cpu"), MODS, {})[0] == "host"


@pytest.mark.parametrize("setting", ["device", "host"])
def test_explicit_setting_wins(setting):
    where, why = choose_arena(setting, CUDA, [], {"UCX_TLS": "tcp"})
    assert where == setting and "asked for" in why


@pytest.mark.parametrize("tls,where", [
    (None, "device"), ("all", "device"), ("tcp,cuda_copy", "device"), ("rc,cuda_ipc,cuda_copy", "device"),
    ("cuda", "device"), ("^cuda_ipc", "device"), ("tcp", "host"), ("rc,sm,self", "host"),
    ("^cuda", "host"), ("^cuda_copy,cuda_ipc", "host"),
])
def test_auto_follows_ucx_tls(tls, where):
    env = {} if tls is None else {"UCX_TLS": tls}
    got, why = choose_arena("auto", CUDA, MODS, env)
    assert got == where, why
    if where == "host":
        assert f"UCX_TLS={tls}" in why


def test_auto_without_cuda_transport_modules_uses_host():
    where, why = choose_arena("auto", CUDA, ["cma", "ib"], {})
    assert where == "host" and "no CUDA transport module" in why


def test_auto_with_unknown_modules_trusts_ucx_tls():
    assert choose_arena("auto", CUDA, None, {})[0] == "device"


def test_setting_is_checked(monkeypatch):
    with pytest.raises(ConfigError, match="arena='gpu'.*auto, device, host"):
        Settings(arena="gpu")
    monkeypatch.setenv("KVSTAGE_ARENA", "host")
    assert Settings().arena == "host"
