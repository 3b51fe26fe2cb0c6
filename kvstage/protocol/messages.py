"""Every control message, one typed definition each, checked in one place.

A message on the wire is a JSON object with a ``type`` (framed by ``wire``).
``decode`` turns it into one of the classes below or raises ``ProtocolError``
naming the field, its value and the rule; nothing past this module reads a
peer's dict. Each class lists its fields once (``FIELDS``): name, kind, bounds,
whether it may be absent; ``to_wire`` writes the same names.

The handshake (a source connects to a destination):
``hello`` (source) -> ``welcome`` (destination) -> ``offer`` (source: what its
arena, its KV pages and, on one host, its shared pages and event are) ->
``opened`` (destination: whether it opened those pages). Per request:
``ready`` (source: the request is readable, by one path), ``chunk`` (source: a
later chunk of a ``read`` request is gathered), ``read`` (destination: it has
read a chunk, whose slot the source may reuse), ``done`` (destination: every
byte is in its pages). A streamed request's ``ready``, ``chunk``, ``read`` and
``done`` name its layer group (``layers``); each group is read on its own.
``abort`` (either side), ``error`` (a refused message), ``ping``.
``probe``/``probe_ok``: ``kvstage probe --peer``.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, fields
from typing import ClassVar, TypeVar

from kvstage.errors import ProtocolError

#: the handshake refuses a peer of another version by name. 9: the decode reads the bytes (``ready``,
#: ``read``, ``done``); no grants. 10: layer groups (``layers``) and token spans (``span``) of streamed requests.
#: 11: chunk checksums (``chunk.checksum``, a gathered entry's fourth item). 12: checksums on the ipc, direct
#: and pages paths (``sums``)
PROTOCOL_VERSION = 12
MAX_ID = 256
#: an engine id names one engine's ranks on the wire and in logs: short, printable
MAX_ENGINE_ID = 128
#: a model identity (name or path, and a hash): both sides of a link must serve the same model
MAX_MODEL_ID = 512
MAX_REASON = 300
#: page ids one message may carry: a 1M-token request at page size 1
MAX_PAGES = 1 << 20
#: chunks one ``ready`` may list
MAX_CHUNKS = 1 << 16


@dataclass(frozen=True)
class F:
    """One field of a message: its wire name, kind and rule. ``kind`` is a Python type, or
    "ids" (a list of non-negative ints), "text" (a printable string of at most ``most`` chars),
    "b64" (base64 text, decoded to bytes)."""

    name: str
    kind: type | str
    least: int | None = None
    most: int | None = None
    optional: bool = False


def _check(msg: dict, f: F):
    if f.name not in msg or msg[f.name] is None:
        if f.optional:
            return None
        raise ProtocolError(f"{msg.get('type')} message lacks field {f.name!r}")
    v = msg[f.name]
    shown = repr(v)
    what = f"{msg.get('type')} field {f.name}={shown[:60]}{'...' if len(shown) > 60 else ''}"
    if f.kind == "ids":
        if not isinstance(v, list) or (f.most is not None and len(v) > f.most):
            raise ProtocolError(f"{what}: must be a list of at most {f.most} page ids")
        if not all(type(x) is int and x >= 0 for x in v):
            raise ProtocolError(f"{what}: every page id must be a non-negative integer")
        return v
    if f.kind == "text":
        if not isinstance(v, str) or len(v) > (f.most or MAX_ID) or not v.isprintable():
            raise ProtocolError(f"{what}: must be printable text of at most {f.most or MAX_ID} characters")
        return v
    if f.kind == "b64":
        if not isinstance(v, str) or len(v) > (f.most or MAX_ID) * 2:
            raise ProtocolError(f"{what}: must be base64 text")
        try:
            return base64.b64decode(v, validate=True)
        except ValueError:
            raise ProtocolError(f"{what}: not base64") from None
    assert isinstance(f.kind, type), f.kind  # every string kind returned above
    if not isinstance(v, f.kind) or (f.kind is int and isinstance(v, bool)):
        raise ProtocolError(f"{what}: must be {getattr(f.kind, '__name__', f.kind)}")
    if isinstance(v, int) and not isinstance(v, bool):
        if f.least is not None and v < f.least:
            raise ProtocolError(f"{what}: below {f.least}")
        if f.most is not None and v > f.most:
            raise ProtocolError(f"{what}: above {f.most}")
    elif f.most is not None and isinstance(v, (str, list)) and len(v) > f.most:
        raise ProtocolError(f"{what}: longer than {f.most}")
    return v


_M = TypeVar("_M", bound="Message")


class Message:
    """Base of every message: ``TYPE`` on the wire, ``FIELDS`` in order (the dataclass's own)."""

    TYPE: ClassVar[str] = ""
    FIELDS: ClassVar[tuple[F, ...]] = ()

    @classmethod
    def parse(cls: type[_M], msg: dict) -> _M:
        if cls.FIELDS and cls.FIELDS[0].name == "version":  # first: another version's fields differ
            v = msg.get("version")
            if type(v) is int and v != PROTOCOL_VERSION:
                raise ProtocolError(f"version: the peer speaks protocol version {v}, this side {PROTOCOL_VERSION}")
        got = cls(**{f.name: _check(msg, f) for f in cls.FIELDS})
        for name in ("layers", "span"):
            v = getattr(got, name, None)
            if v is not None and (len(v) != 2 or v[0] >= v[1]):
                raise ProtocolError(f"{cls.TYPE} field {name}={v!r}: must be [first, stop) with first < stop")
        return got

    def to_wire(self) -> dict:
        out: dict = {"type": self.TYPE}
        kinds = {f.name: f.kind for f in self.FIELDS}
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if v is None:
                continue
            out[f.name] = base64.b64encode(v).decode() if kinds.get(f.name) == "b64" else v
        return out


_REQ = F("req", "text", most=MAX_ID)
#: a streamed request's layer group, [first, stop): each group is read on its own (absent: every layer)
_LAYERS = F("layers", "ids", most=2, optional=True)


#: a streamed request's token span, [first, stop): the tokens of one chunk of a chunked prefill (absent: all)
_SPAN = F("span", "ids", most=2, optional=True)


class Grouped:
    """A per-request message that may name one part of a streamed request: a layer group, a token span
    (a chunk of a chunked prefill), or both."""

    layers: list | None
    span: list | None

    @property
    def group(self) -> range | None:
        return None if self.layers is None else range(self.layers[0], self.layers[1])

    @property
    def tokens_span(self) -> range | None:
        return None if self.span is None else range(self.span[0], self.span[1])


_ENGINE = F("engine", "text", most=MAX_ENGINE_ID)


@dataclass(frozen=True)
class Hello(Message):
    TYPE = "hello"
    FIELDS = (
        F("version", int),
        F("token", str, most=4096),
        _ENGINE,
        F("model", str, most=MAX_MODEL_ID),
        F("uid", int, least=0),
        F("spec", dict),
        F("rank", int, least=0),
        F("agent", "text", most=MAX_ID),
        F("transport", "text", most=32),
        F("metadata", "b64", most=1 << 19),
        F("slot_bytes", int, least=0),
        F("facts", dict),
        F("kv_facts", dict),
        F("paths", list, most=8),
        F("nonce", "text", most=64),
    )
    version: int
    token: str
    engine: str
    model: str
    uid: int
    spec: dict
    rank: int
    agent: str
    transport: str
    metadata: bytes
    slot_bytes: int
    facts: dict
    kv_facts: dict
    paths: list
    nonce: str  # the destination proves it holds the token by an HMAC of this (``Welcome.proof``)


@dataclass(frozen=True)
class Welcome(Message):
    TYPE = "welcome"
    FIELDS = (
        F("version", int),
        _ENGINE,
        F("model", str, most=MAX_MODEL_ID),
        F("spec", dict),
        F("rank", int, least=0),
        F("transport", "text", most=32),
        F("metadata", "b64", most=1 << 19, optional=True),
        F("slot_bytes", int, least=0, optional=True),
        F("facts", dict, optional=True),
        F("paths", list, most=8, optional=True),
        F("writes", bool),
        F("proof", "text", most=128, optional=True),
    )
    version: int
    engine: str
    model: str
    spec: dict
    rank: int
    transport: str
    metadata: bytes | None
    slot_bytes: int | None
    facts: dict | None
    paths: list | None
    writes: bool  # False: this source rank has no piece for that destination rank (it closes the connection)
    proof: str | None = None  # HMAC-SHA256 of the hello's nonce under the token, where there is one


@dataclass(frozen=True)
class Offer(Message):
    """What a destination may read of this source rank: its arena, its KV buffers (registered only where
    a path reads pages) and, on one host with CUDA memory, its KV pages and event shared over CUDA IPC.
    ``warm``: a two-sided transport's ticket of the first 16 bytes of its arena, which the destination reads
    before its ``opened`` (the transport's connection wired up while both processes run)."""

    TYPE = "offer"
    FIELDS = (
        F("arena", dict),
        F("kv", list, most=1 << 16),
        F("ipc", dict, optional=True),
        F("warm", "b64", most=4096, optional=True),
    )
    arena: dict
    kv: list
    ipc: dict | None
    warm: bytes | None = None


@dataclass(frozen=True)
class Opened(Message):
    TYPE = "opened"
    FIELDS = (F("ipc", bool), F("reason", str, most=MAX_REASON))
    ipc: bool
    reason: str


@dataclass(frozen=True)
class Ready(Grouped, Message):
    """A request this source rank can be read for, by ``path``. ``pages``: its page ids (the paths that
    read them: ipc, pages, direct); ``chunk_tokens`` and ``chunks``: how a ``read`` request is cut, and
    ``gathered``: the chunks in the arena already, as [index, arena offset, ticket (base64, ucx)], and a
    fourth item, the checksum its reader must find, where ``checksum`` says the request has them
    (``protocol.checksums``);
    ``layers``: the layer group it makes readable, where the request is streamed."""

    TYPE = "ready"
    FIELDS = (
        _REQ,
        F("tokens", int, least=1, most=1 << 30),
        F("path", "text", most=16),
        F("pages", "ids", most=MAX_PAGES, optional=True),
        F("chunk_tokens", int, least=1, optional=True),
        F("chunks", int, least=1, most=MAX_CHUNKS, optional=True),
        F("gathered", list, most=MAX_CHUNKS, optional=True),
        F("order", "text", most=16, optional=True),
        _LAYERS,
        _SPAN,
        F("checksum", bool, optional=True),
    )
    req: str
    tokens: int
    path: str
    pages: list | None = None
    chunk_tokens: int | None = None
    chunks: int | None = None
    gathered: list | None = None
    order: str | None = None  # the read path: how each chunk's piece is laid out (``staging.region.Order``)
    layers: list | None = None
    span: list | None = None
    checksum: bool | None = None  # read: every chunk's listing carries its checksum; else a ``sums`` follows


@dataclass(frozen=True)
class Chunk(Grouped, Message):
    TYPE = "chunk"
    FIELDS = (
        _REQ,
        F("index", int, least=0, most=MAX_CHUNKS),
        F("offset", int, least=0),
        F("ticket", "b64", most=4096, optional=True),
        _LAYERS,
        _SPAN,
        F("checksum", int, least=0, most=0xFFFFFFFF, optional=True),
    )
    req: str
    index: int
    offset: int
    ticket: bytes | None = None
    layers: list | None = None
    span: list | None = None
    checksum: int | None = None  # the sum its reader must find in the bytes it read (``protocol.checksums``)


@dataclass(frozen=True)
class Sums(Grouped, Message):
    """What a destination rank reading a checksummed request (or part) by the ipc, direct or pages path
    must find in its piece: the total of its piece over the source's pages (``protocol.checksums``), sent
    once the source's sum pass is over."""

    TYPE = "sums"
    FIELDS = (_REQ, F("checksum", int, least=0, most=0xFFFFFFFF), _LAYERS, _SPAN)
    req: str
    checksum: int
    layers: list | None = None
    span: list | None = None


@dataclass(frozen=True)
class Read(Grouped, Message):
    TYPE = "read"
    FIELDS = (_REQ, F("index", int, least=0, most=MAX_CHUNKS), _LAYERS, _SPAN)
    req: str
    index: int
    layers: list | None = None
    span: list | None = None


@dataclass(frozen=True)
class Done(Grouped, Message):
    TYPE = "done"
    FIELDS = (_REQ, _LAYERS, _SPAN)
    req: str
    layers: list | None = None
    span: list | None = None


@dataclass(frozen=True)
class Abort(Message):
    TYPE = "abort"
    FIELDS = (_REQ, F("reason", str))
    req: str
    reason: str

    @classmethod
    def parse(cls, msg: dict) -> Abort:
        got = super().parse(msg)
        return cls(got.req, got.reason[:MAX_REASON])


@dataclass(frozen=True)
class Error(Message):
    TYPE = "error"
    FIELDS = (F("reason", str), F("about", str, optional=True), F("req", "text", most=MAX_ID, optional=True))
    reason: str
    about: str | None = None
    req: str | None = None

    @classmethod
    def parse(cls, msg: dict) -> Error:
        req = msg.get("req")
        return cls(
            str(msg.get("reason"))[:MAX_REASON],
            str(msg.get("about"))[:32],
            req if isinstance(req, str) and len(req) <= MAX_ID and req.isprintable() else None,
        )


@dataclass(frozen=True)
class Ping(Message):
    TYPE = "ping"
    FIELDS = (F("loop_s", float, optional=True),)
    loop_s: float | None = None

    @classmethod
    def parse(cls, msg: dict) -> Ping:
        v = msg.get("loop_s")  # absent: the peer's loop pinged itself
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
            return cls(float(v))
        return cls(None)


@dataclass(frozen=True)
class Probe(Message):
    TYPE = "probe"
    FIELDS = (
        F("version", int),
        F("token", str, most=4096),
        F("transport", "text", most=32),
        F("nbytes", int, least=1),
        F("agent", "text", most=MAX_ID),
    )
    version: int
    token: str
    transport: str
    nbytes: int
    agent: str


MESSAGES: dict[str, type[Message]] = {
    m.TYPE: m for m in (Hello, Welcome, Offer, Opened, Ready, Chunk, Sums, Read, Done, Abort, Error, Ping, Probe)
}


def decode(msg: dict) -> Message:
    """The message a decoded frame holds; ``ProtocolError`` for an unknown type or a bad field."""
    kind = msg.get("type")
    cls = MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {str(kind)[:32]!r}")
    return cls.parse(msg)
