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


# -- arena_size: the rule that sizes an arena from the model and the device ---------------------
from kvstage.staging.arena import CHUNK_TOKENS_DEVICE, MIN_SLOTS, SLOT_BYTES_HOST, SLOTS, arena_size  # noqa: E402

LLAMA_TP1 = 32 * 2 * 8 * 128 * 2  # bytes per token of Llama-3-8B's whole KV at TP 1


def test_a_device_slot_holds_a_chunk_of_tokens_and_the_arena_four_of_them():
    size = arena_size(None, LLAMA_TP1, "device", free_bytes=140 << 30)
    assert size.slot_bytes == LLAMA_TP1 * CHUNK_TOKENS_DEVICE == 512 << 20
    assert size.slots == SLOTS["device"] == 4 and size.nbytes == 2 << 30
    assert f"{CHUNK_TOKENS_DEVICE} tokens of {LLAMA_TP1} B" in size.why


def test_a_device_arena_takes_at_most_a_sixteenth_of_free_memory():
    size = arena_size(None, LLAMA_TP1, "device", free_bytes=8 << 30)
    assert size.nbytes <= (8 << 30) // 16 and size.slots == 4 and size.slot_bytes % 4096 == 0
    assert "free on the GPU" in size.why


def test_the_host_keeps_its_measured_default_whatever_the_model():
    for tb in (1024, LLAMA_TP1, 10 * LLAMA_TP1):
        size = arena_size(None, tb, "host")
        assert (size.slot_bytes, size.slots) == (SLOT_BYTES_HOST, SLOTS["host"])


@pytest.mark.parametrize("where", ["device", "host"])
def test_a_small_asked_arena_gets_slots_that_fit_not_a_refusal(where):
    size = arena_size(1 << 20, LLAMA_TP1, where, free_bytes=140 << 30)  # --arena-mb 1
    assert size.slots == MIN_SLOTS and size.slot_bytes == 256 << 10 and size.nbytes <= 1 << 20
    assert "arena_mb=1 cut into 4 slots" in size.why


def test_a_large_asked_arena_keeps_the_rules_slot_and_holds_more_of_them():
    size = arena_size(4 << 30, LLAMA_TP1, "device", free_bytes=140 << 30)
    assert size.slot_bytes == 512 << 20 and size.slots == 8


def test_an_arena_smaller_than_a_page_is_refused_and_slots_stay_page_aligned():
    with pytest.raises(ValueError, match="at least one 4096-byte slot"):
        arena_size(1000, LLAMA_TP1, "host")
    for asked in (4096, 5000, 3 << 20, (3 << 20) + 17):
        size = arena_size(asked, LLAMA_TP1, "host")
        assert size.slot_bytes % 4096 == 0 and size.nbytes <= asked
