"""The handshake's checks, in one place: what a hello (or a probe's request) must
carry before a destination gives it anything, and what a source checks in a welcome.

A peer is accepted only with the same protocol version, the auth token, the same
transport and a spec this side can plan with. Every refusal names the field.
"""

from __future__ import annotations

import base64
import hmac

from kvstage.errors import ConfigError, ProtocolError
from kvstage.layout import KVGeometry, PageLayout
from kvstage.protocol.wire import MAX_ENGINE_ID, MAX_MODEL_ID, PROTOCOL_VERSION, field
from kvstage.tp import SideSpec

#: a connection sends its hello (a destination) or answers it (a source) within this: a live peer
#: answers in milliseconds, and a silent one must not hold a descriptor longer
HANDSHAKE_TIMEOUT_S = 5.0


def spec_to_wire(spec: SideSpec) -> dict:
    g = spec.geometry
    return {
        "layers": g.layers, "kv_heads": g.kv_heads, "head_dim": g.head_dim, "dtype": g.dtype, "mla": g.mla,
        "tp": spec.tp, "page_size": spec.page.page_size, "order": spec.page.order,
    }


def spec_from_wire(d: dict) -> SideSpec:
    try:
        geo = KVGeometry(
            field(d, "layers", int), field(d, "kv_heads", int), field(d, "head_dim", int),
            field(d, "dtype", str), field(d, "mla", bool),
        )
        return SideSpec(geo, field(d, "tp", int), PageLayout(field(d, "page_size", int), field(d, "order", str)))
    except ConfigError as e:
        raise ProtocolError(f"peer's spec is invalid: {e}") from e


def md_to_wire(md: bytes) -> str:
    return base64.b64encode(md).decode()


def md_from_wire(s: str) -> bytes:
    try:
        return base64.b64decode(s, validate=True)
    except ValueError as e:
        raise ProtocolError("agent metadata is not base64") from e


def check_version(msg: dict, who: str) -> None:
    version = field(msg, "version", int)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"version: the {who} speaks protocol version {version}, this side {PROTOCOL_VERSION}")


def check_transport(msg: dict, mine: str, who: str) -> None:
    """Both sides of a connection must move bytes with the same transport."""
    theirs = msg.get("transport", "nixl")
    if theirs != mine:
        raise ProtocolError(
            f"transport: the {who} uses {str(theirs)[:32]!r}, this side {mine!r}; set the same KVSTAGE_TRANSPORT on both sides"
        )


def check_token(msg: dict, token: str) -> None:
    """The peer's ``token`` equals ours (compared in constant time)."""
    if not hmac.compare_digest(str(msg.get("token", "")).encode(), token.encode()):
        raise ProtocolError("token: the auth token does not match KVSTAGE_AUTH_TOKEN on the destination")


def check_peer(msg: dict, token: str, transport: str, who: str) -> None:
    """A hello's or a probe request's admission: version, token, transport (in that order)."""
    check_version(msg, who)
    check_token(msg, token)
    check_transport(msg, transport, who)


def peer_engine(msg: dict) -> str:
    """The engine a hello or a welcome names: its ranks share one plan (``MAX_ENGINE_ID`` printable characters)."""
    engine = field(msg, "engine", str)
    if len(engine) > MAX_ENGINE_ID or not engine.isprintable():
        raise ProtocolError(f"engine: {engine[:40]!r} is not an engine id (at most {MAX_ENGINE_ID} printable characters)")
    return engine


def check_model(msg: dict, mine: str, who: str) -> None:
    """Both sides serve the same model, where both say which (an engine's identity of it: its name
    or path and a hash of what shapes its KV). KV of another model's weights moves as well as the
    right one and gives wrong tokens: a pair that says it differs is refused, naming both."""
    theirs = msg.get("model", "")
    if not isinstance(theirs, str) or len(theirs) > MAX_MODEL_ID:
        raise ProtocolError(f"model: the {who} sent {str(theirs)[:40]!r}, not a model identity")
    if theirs and mine and theirs != mine:
        raise ProtocolError(f"model: the {who} serves {theirs!r}, this side {mine!r}; both sides of a KV transfer "
                            "must serve the same model")


def hello_spec(msg: dict) -> tuple[SideSpec, int]:
    """The spec and rank a hello announces, checked against each other."""
    spec = spec_from_wire(field(msg, "spec", dict))
    return spec, field(msg, "rank", int, minimum=0, maximum=spec.tp - 1)
