"""What the SGLang backend's prefill and decode sides share: the control messages' tags, the
settings and model identity both endpoints are made with, the engine ids, the manager's base, and
the bootstrap server's ``/kvstage/layout`` route (prefill ranks publish there, decode ranks read).

Nothing here is one role's: ``prefill.py`` and ``decode.py`` hold those, ``conn.py`` joins them.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer, CommonKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.runtime_context import get_device, get_disagg, get_parallel
from sglang.srt.utils.network import NetworkAddress

from kvstage.config import Settings
from kvstage.errors import ConfigError
from kvstage.plugin.sglang.layout import RowBuffers

if TYPE_CHECKING:
    from kvstage.protocol.endpoint import Endpoint

log = logging.getLogger("kvstage.sglang")
E = TypeVar("E", bound="Endpoint")

ROOM_TAG = b"KVSTAGE_ROOM"
AUX_TAG = b"KVSTAGE_AUX"
HELLO_TAG = b"KVSTAGE_HELLO"
CAUSE_TAG = b"KVSTAGE_CAUSE"  # decode rank -> the other decode ranks of its engine: why a room failed
CAUSE_ACK_TAG = b"KVSTAGE_CAUSE_ACK"
CAUSE_ACK_TIMEOUT_S = 30.0  # a rank marks its room Failed without every ack after this long (a stopped sibling)
LAYOUT_ROUTE = "/kvstage/layout"
MAX_FAILED_ROOMS = 4096  # failed rooms remembered so a late decode message is answered Failed


def settings_for(mode: DisaggregationMode) -> Settings:
    """kvstage Settings, with SGLang's staging variables mapped where they mean the same.

    ``SGLANG_DISAGG_STAGING_POOL_SIZE_MB`` is the decode side's staging memory
    registered with the transport: kvstage's destination arena (``arena_mb``),
    unless ``KVSTAGE_ARENA_MB`` is set. docs/sglang.md has the table."""
    pool = os.environ.get("SGLANG_DISAGG_STAGING_POOL_SIZE_MB")
    if mode == DisaggregationMode.DECODE and pool and not os.environ.get("KVSTAGE_ARENA_MB"):
        try:
            arena_mb = float(pool)
        except ValueError:
            raise ConfigError(f"SGLANG_DISAGG_STAGING_POOL_SIZE_MB={pool!r}: must be a number of MiB") from None
        return Settings(arena_mb=arena_mb)
    return Settings()


def check_supported(mode: DisaggregationMode) -> None:
    """Refuse, naming the setting, what this backend does not implement."""
    flag = os.environ.get("SGLANG_DISAGG_STAGING_BUFFER", "")
    if flag.lower() in ("1", "true", "yes", "on"):
        raise ConfigError(
            f"SGLANG_DISAGG_STAGING_BUFFER={flag}: that switches on SGLang's own staging machinery, which the kvstage "
            "backend replaces; kvstage stages heterogeneous TP by itself. Unset it (KVSTAGE_ARENA_MB sizes "
            "kvstage's staging)"
        )
    par = get_parallel()
    for name in ("pp_size", "attn_cp_size", "attn_dcp_size"):
        value = getattr(par, name, 1)
        if value != 1:
            raise ConfigError(
                f"{name}={value}: the kvstage backend supports tensor parallelism (and attention DP) "
                "only; pipeline and context parallelism need another backend"
            )
    if getattr(par, "enable_kv_cache_sharding", False):
        raise ConfigError("enable_kv_cache_sharding=True: not supported by the kvstage backend")
    policy = get_disagg().disaggregation_decode_allocation_policy
    if policy != "early":
        raise ConfigError(f"disaggregation_decode_allocation_policy={policy!r}: the kvstage backend implements 'early'")


#: the fields of the model's config that shape its KV or its tokens: hashed into the model identity
CONFIG_FIELDS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "rope_theta",
    "max_position_embeddings",
    "sliding_window",
)


def model_identity(server_args, kv_args, mla: bool) -> str:
    """What kvstage's handshake compares between a prefill and a decode engine: the model's path or
    name and a hash of its config, dtype and KV layout (as vLLM's compatibility hash). KV of another
    model of the same shapes would move and decode wrong tokens; a mismatch is refused by name.
    The config is read from local files only (the engine loaded them already): no network call."""
    import hashlib

    import sglang

    config = None
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(
            server_args.model_path,
            revision=getattr(server_args, "revision", None),
            trust_remote_code=bool(getattr(server_args, "trust_remote_code", False)),
            local_files_only=True,
        )
        text = hf.get_text_config().to_dict()
        config = {k: text.get(k) for k in CONFIG_FIELDS + ("torch_dtype", "dtype")}
    except Exception as e:  # a model path with no config on this host (the class-level harness: "dummy")
        log.info(
            "kvstage: no model config at %r (%s): the model identity is its path and KV layout",
            str(server_args.model_path)[-200:],
            type(e).__name__,
        )
    factors = {
        "sglang": sglang.__version__,
        "model": str(server_args.model_path),
        "config": config,
        "dtype": str(getattr(server_args, "dtype", "")),
        "kv_cache_dtype": str(getattr(kv_args, "kv_cache_dtype_str", "")),
        "page_size": int(kv_args.page_size),
        "kv_buffers": len(kv_args.kv_data_ptrs),
        "mla": bool(mla),
    }
    digest = hashlib.sha256(json.dumps(factors, sort_keys=True, default=str).encode()).hexdigest()[:16]
    from kvstage.plugin.fingerprint import identity_part

    weights = (
        identity_part(str(server_args.model_path), getattr(server_args, "revision", None), log.name)
        if config is not None
        else ""
    )  # the class-level harness's "dummy" model has no checkpoint
    return f"{str(server_args.model_path)[-400:]}#{digest}{weights}"


def prefill_engine_id(host: str, bootstrap_port: int, dp: int) -> str:
    """A prefill engine's id: its bootstrap address and DP rank, the same on all its ranks."""
    return f"sglang-prefill {NetworkAddress(host, bootstrap_port).to_host_port_str()} dp{dp}"


def decode_engine_id(ip: str, port: int) -> str:
    """A decode engine's id: the control address of its attention-TP rank 0."""
    return f"sglang-decode {NetworkAddress(ip, port).to_host_port_str()}"


def device_of(kv_args) -> torch.device:
    """The device of SGLang's KV pool on this rank (its GPU, or the CPU)."""
    kind = str(get_device().device)
    return torch.device(kind, int(kv_args.gpu_id)) if kind == "cuda" else torch.device(kind)


def rows_of(states: list[RowBuffers], indices) -> list[tuple[int, list[int]]]:
    """State components that carry rows for this request: (component, rows)."""
    out = []
    for c, ix in enumerate(indices or []):
        if ix is not None and len(ix) and c < len(states):
            out.append((c, [int(x) for x in np.asarray(ix).reshape(-1)]))
    return out


# -- the manager's base ---------------------------------------------------------------------------


class ManagerBase(CommonKVManager):
    """What a prefill and a decode manager both hold: set up by ``conn.KVStageManager.__init__``,
    used by the role mixins (``prefill.PrefillManager``, ``decode.DecodeManager``)."""

    mla: bool
    device: torch.device
    settings: Settings
    model: str  # this engine's model identity (``model_identity``), carried by its endpoint
    engine_id: str  # this engine's id (prefill: set by register_to_bootstrap, which publishes it)
    aux: RowBuffers  # SGLang's metadata rows (host memory)
    states: list[RowBuffers]  # one per state component (mamba, SWA, ...)
    _lock: threading.Lock  # the rooms' bookkeeping
    _connect_lock: threading.Lock  # one handshake (prefill) or one Destination (decode) at a time
    _pool: concurrent.futures.ThreadPoolExecutor

    def _registered(self, ep: E) -> E:
        """``ep`` with the KV pool registered now where a page path may read it (host memory, or equal TP),
        so the first request of a peer engine does not wait for the registration."""
        if self.settings.offers_pages and ep.transport.one_sided:
            ep.kv_regions()
        return ep

    def _serve(self, handler: Callable[[list], None]) -> None:
        """The control thread: every message on this rank's ZMQ socket, handled in arrival order."""
        while True:
            msg = self.server_socket.recv_multipart()
            try:
                handler(msg)
            except Exception:  # one malformed message must not stop the control thread
                log.exception("kvstage: control message %r dropped", msg[:1])


# -- bootstrap server ----------------------------------------------------------------------------


class KVStageBootstrapServer(CommonKVBootstrapServer):
    """SGLang's bootstrap server plus ``/kvstage/layout``: the prefill ranks' KV layout and their
    engine id per DP rank."""

    def _setup_routes(self):
        super()._setup_routes()
        self.app.router.add_route("*", LAYOUT_ROUTE, self._handle_kvstage_layout)

    async def _handle_kvstage_layout(self, request):
        from aiohttp import web

        ranks = self.__dict__.setdefault("_kvstage_ranks", {})  # (dp, rank) -> (layout, engine id)
        if request.method == "PUT":
            data = await request.json()
            layout, engine, dp = data.get("layout"), data.get("engine"), data.get("dp")
            if not isinstance(engine, str) or not engine:
                return web.Response(
                    status=400, text=f"prefill rank {data.get('rank')}: engine={engine!r}, must be a non-empty string"
                )
            for (d, r), (other, other_engine) in ranks.items():
                if other != layout:
                    return web.Response(
                        status=400,
                        text=f"prefill rank {data.get('rank')} publishes KV layout "
                        f"{layout}, rank {r} published {other}",
                    )
                if d == dp and other_engine != engine:
                    return web.Response(
                        status=400,
                        text=f"prefill rank {data.get('rank')} of DP rank {dp} publishes "
                        f"engine {engine!r}, rank {r} published {other_engine!r}",
                    )
            ranks[(dp, data.get("rank"))] = (layout, engine)
            return web.Response(text="OK", status=200)
        if request.method == "GET":
            if not ranks:
                return web.Response(status=503, text="no prefill rank has published its kvstage layout yet")
            layout = next(iter(ranks.values()))[0]
            return web.json_response({"layout": layout, "engines": {str(d): e for (d, _), (_, e) in ranks.items()}})
        return web.Response(status=405, text="Method not allowed")
