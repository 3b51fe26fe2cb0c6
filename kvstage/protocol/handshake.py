"""The handshake's checks, in one place: what a hello (or a probe's request) must
carry before a destination gives it anything, and what a source checks in a welcome.

A peer is accepted only with the same protocol version, the destination's secret
(its own, or the deployment's auth token), the same transport, the same model
and weights, and a spec this side can plan with, checked in that order: a peer
that fails authentication is told only that. Every refusal names the field. With a
token, the welcome proves the destination holds it too (an HMAC of the hello's
nonce), before the source offers its KV pages.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

from kvstage.errors import ConfigError, ProtocolError
from kvstage.layout import KVGeometry, PageLayout
from kvstage.protocol.messages import PROTOCOL_VERSION, Hello, Welcome
from kvstage.protocol.wire import field
from kvstage.tp import SideSpec

#: a connection sends its hello (a destination) or answers it (a source) within this: a live peer
#: answers in milliseconds, and a silent one must not hold a descriptor longer
HANDSHAKE_TIMEOUT_S = 5.0


def spec_to_wire(spec: SideSpec) -> dict:
    g = spec.geometry
    return {
        "layers": g.layers,
        "kv_heads": g.kv_heads,
        "head_dim": g.head_dim,
        "dtype": g.dtype,
        "mla": g.mla,
        "tp": spec.tp,
        "page_size": spec.page.page_size,
        "order": spec.page.order,
    }


def spec_from_wire(d: dict) -> SideSpec:
    try:
        geo = KVGeometry(
            field(d, "layers", int),
            field(d, "kv_heads", int),
            field(d, "head_dim", int),
            field(d, "dtype", str),
            field(d, "mla", bool),
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


def _mine(who: str) -> str:
    """This side, named by its role where the peer's is known: a refusal is relayed to the peer and logged
    there, so "this side" would read backwards."""
    return {"source": "the destination", "destination": "the source"}.get(who, "this side")


def check_version(version: int, who: str) -> None:
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"version: the {who} speaks protocol version {version}, {_mine(who)} {PROTOCOL_VERSION}")


def check_transport(theirs: str, mine: str, who: str) -> None:
    """Both sides of a connection must move bytes with the same transport."""
    if theirs != mine:
        raise ProtocolError(
            f"transport: the {who} uses {str(theirs)[:32]!r}, {_mine(who)} {mine!r}; "
            "set the same KVSTAGE_TRANSPORT on both sides"
        )


#: all a peer that fails authentication is told: nothing of this side's model, spec or memory
AUTH_FAILED = (
    "authentication failed: present the destination's secret (the one in the address it handed out) "
    "or the deployment's auth token (KVSTAGE_AUTH_TOKEN)"
)


def check_token(given: str, token: str) -> None:
    """The peer's token equals ours (compared in constant time). The refusal says only that
    authentication failed: it is checked before anything of this side is compared or told."""
    if not hmac.compare_digest(str(given).encode(), token.encode()):
        raise ProtocolError(AUTH_FAILED)


#: where a model identity names the fingerprint of its weights: ``NAME#SHAPES`` + ``WEIGHTS`` + fingerprint
WEIGHTS = " weights="


def check_same_model(theirs: str, mine: str, who: str) -> None:
    """Both sides serve the same model, where both say which (an engine's identity of it: its name
    or path, a hash of what shapes its KV, and a fingerprint of its weights). KV of another model's
    weights moves as well as the right one and gives wrong tokens: a pair that says it differs is
    refused, naming both; one that differs only in its weights (the same path and shapes: a
    checkpoint re-pointed between the two engines' starts) is refused naming both fingerprints."""
    if not (theirs and mine) or theirs == mine:
        return
    their_model, _, their_weights = theirs.partition(WEIGHTS)
    my_model, _, my_weights = mine.partition(WEIGHTS)
    if their_model == my_model and their_weights and my_weights:
        raise ProtocolError(
            f"model weights: the {who} serves {their_model!r} with weights fingerprint "
            f"{their_weights}, {_mine(who)} weights fingerprint {my_weights}: the same model path and "
            "shapes but different weights (was the checkpoint replaced between the two engines' "
            "starts?); both sides of a KV transfer must load the same checkpoint"
        )
    raise ProtocolError(
        f"model: the {who} serves {theirs!r}, {_mine(who)} {mine!r}; both sides of a KV transfer "
        "must serve the same model"
    )


def check_hello(hello: Hello, token: str, transport: str) -> tuple[SideSpec, int]:
    """A hello's admission, in this order: version, token (the destination's secret, or the deployment's
    token; ``""`` only where the operator opted out by name), transport; then the spec and rank it
    announces. The model and the plan are compared after this, by the caller: a peer that fails
    authentication learns nothing of them."""
    check_version(hello.version, "source")
    check_token(hello.token, token)
    check_transport(hello.transport, transport, "source")
    spec = spec_from_wire(hello.spec)
    if hello.rank >= spec.tp:
        raise ProtocolError(f"hello: rank={hello.rank} is past the source's tp={spec.tp}")
    return spec, hello.rank


def proof(token: str, nonce: str) -> str:
    """What a destination holding ``token`` answers to a hello's ``nonce``."""
    return hmac.new(token.encode(), b"kvstage-welcome:" + nonce.encode(), hashlib.sha256).hexdigest()


def check_welcome_proof(welcome: Welcome, token: str, nonce: str) -> None:
    """With a token (the auth token, or the secret of the destination's address), the destination must
    have proved it holds it: a source offers its memory to nobody else who happens to listen at the
    address it was given."""
    if token and not hmac.compare_digest(str(welcome.proof or ""), proof(token, nonce)):
        raise ProtocolError(
            "welcome: the destination did not prove it holds KVSTAGE_AUTH_TOKEN (or the secret of its address)"
        )
