"""What the vLLM connector's two roles share: its configuration, the model identity, and what
travels from the scheduler to the workers (``KVStageMeta``) and from the workers to the
scheduler at start (``KVStageHandshake``). Imports vLLM's base classes only."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from kvstage.config import Settings
from kvstage.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: the kvstage part of a request's ``kv_transfer_params``; a decode refuses another version's
#: (3: ``remote_secrets``, one per prefill rank, that its connect port asks for)
PARAMS_VERSION = 3

#: ``kv_connector_extra_config`` keys and their defaults (docs/vllm.md lists them)
DEFAULTS = {
    "host": "127.0.0.1",  # address this engine's ranks listen on and advertise
    "lease_s": 120.0,  # a prefilled request's blocks wait this long for a decode to read them
    "pull_timeout_s": 15.0,  # a decode rank waits this long for a prefill rank to connect to it
    "kv_cache_layout": None,  # ask vLLM for "NHD" or "HND"; None keeps the engine's choice
    # true: a prefill sends each prompt's KV layer group by layer group during its last forward (save_kv_layer).
    # Off by default: vLLM's decode learns of a request from its prefill's answer, after the forward, so nothing
    # overlaps and the groups only add steps (docs/benchmarks.md, vLLM streaming)
    "stream_layers": False,
}
#: the layouts ``kv_cache_layout`` may ask for: vLLM's own names of them
KV_CACHE_LAYOUTS = ("NHD", "HND")
#: keys passed to kvstage's Settings, every one of them (the KVSTAGE_* environment variables are the defaults)
SETTINGS_KEYS = tuple(f.name for f in dataclasses.fields(Settings))
#: kvstage's own ready timeout is minutes; a decode waiting on a dead prefill should give up sooner
READY_TIMEOUT_S = 30.0


def extra_config(vllm_config: VllmConfig) -> dict:
    """``kv_connector_extra_config`` with the defaults filled in; an unknown key or a bad layout is
    refused by name."""
    cfg = vllm_config.kv_transfer_config
    extra = dict(getattr(cfg, "kv_connector_extra_config", None) or {})
    unknown = set(extra) - set(DEFAULTS) - set(SETTINGS_KEYS)
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config: unknown keys {sorted(unknown)}; known: "
            f"{sorted(set(DEFAULTS) | set(SETTINGS_KEYS))}"
        )
    if not isinstance(extra.get("stream_layers", False), bool):
        raise ConfigError(f"kv_connector_extra_config: stream_layers={extra['stream_layers']!r}: must be true or false")
    layout = extra.get("kv_cache_layout")
    if layout is not None and layout not in KV_CACHE_LAYOUTS:
        raise ConfigError(
            f"kv_connector_extra_config: kv_cache_layout={layout!r}: must be one of "
            f"{', '.join(KV_CACHE_LAYOUTS)}, or unset to keep the engine's choice"
        )
    return {**DEFAULTS, **extra}


def decode_settings(extra: dict) -> Settings:
    """A consumer rank's kvstage settings: every Settings key of the extra config, and a ready
    timeout of ``READY_TIMEOUT_S`` unless one is set."""
    kw = {k: extra[k] for k in SETTINGS_KEYS if k in extra}
    if "ready_timeout_s" not in kw and not os.environ.get("KVSTAGE_READY_TIMEOUT_S"):
        kw["ready_timeout_s"] = READY_TIMEOUT_S
    return Settings(**kw)


def prefill_settings(extra: dict) -> Settings:
    """A producer rank's: the same keys, and ``lease_s`` as its ready timeout (a prefilled request
    that no decode reads within it is given up, and its blocks freed)."""
    kw = {k: extra[k] for k in SETTINGS_KEYS if k in extra}
    kw.setdefault("ready_timeout_s", float(extra["lease_s"]))
    return Settings(**kw)


def model_identity(vllm_config: VllmConfig) -> str:
    """What kvstage's handshake compares between two engines: the model's name or path and a hash
    of what shapes its KV (as vLLM's own NixlConnector's compatibility hash). Another model of the
    same shapes would take the KV and decode wrong tokens; a mismatch is refused by name."""
    from vllm import __version__ as vllm_version

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    factors = {
        "vllm": vllm_version,
        "model": mc.model,
        "dtype": str(mc.dtype),
        "kv_heads": mc.get_total_num_kv_heads(),
        "head_size": mc.get_head_size(),
        "layers": mc.get_total_num_hidden_layers(),
        "cache_dtype": str(cc.cache_dtype),
    }
    digest = hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:16]
    return f"{str(mc.model)[-400:]}#{digest}" + weights_part(str(mc.model), getattr(mc, "revision", None))


def weights_part(model: str, revision=None) -> str:
    from kvstage.plugin.fingerprint import identity_part

    return identity_part(model, revision, "kvstage.vllm")


def pull_secret(rank_secret: str, req_id: str) -> str:
    """What a decode must present at a prefill rank's connect port to have it connect for request ``req_id``
    (carried in that request's ``kv_transfer_params``): an HMAC of the id under the rank's own secret, which
    never leaves the prefill engine."""
    import hmac

    return hmac.new(rank_secret.encode(), b"kvstage-pull:" + req_id.encode(), hashlib.sha256).hexdigest()


def is_remote_prefill(params: dict | None) -> bool:
    return bool(params and params.get("do_remote_prefill") and params.get("kvstage") == PARAMS_VERSION)


def kvreq_of(engine: str, req_id: str) -> str:
    """The kvstage request id both sides use: unique per prefill engine."""
    return f"{engine}:{req_id}"


@dataclass
class Recv:
    """Decode: load ``blocks`` (this engine's) from the prefill named by ``params``."""

    req_id: str
    blocks: list[int]
    skip: int  # prefill blocks to skip (already computed here)
    params: dict


@dataclass
class KVStageMeta(KVConnectorMetadata):
    recv: list[Recv] = field(default_factory=list)
    cancel: list[str] = field(default_factory=list)  # decode requests finished while loading
    release: list[dict] = field(default_factory=list)  # prefills the decode will not read
    produce: dict = field(
        default_factory=dict
    )  # prefill req -> (block ids, prompt computed after this step, prompt tokens)
    preempted: list[str] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)  # prefill requests finished without a hand-off
    delay_freed: list[str] = field(default_factory=list)  # prefill requests whose blocks wait for a decode


@dataclass
class KVStageHandshake(KVConnectorHandshakeMetadata):
    rank: int
    connect: tuple | None  # a producer rank's port where a decode rank asks it to connect
    layout: dict
    secret: str = ""  # the producer rank's own secret: its scheduler derives each request's ``pull_secret`` from it
