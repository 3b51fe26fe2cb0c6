"""The names kvstage gives the things it keys by, said once.

Plain aliases (no runtime cost, no conversion): a signature that says ``ReqKey``
instead of ``tuple`` tells its reader what the tuple holds. Below every layer, so
that any module may use them (tests/test_layers.py).
"""

from __future__ import annotations

from typing import TypeAlias

#: a serving engine instance, as its ranks name it in the handshake (a prefill or a decode engine)
EngineId: TypeAlias = str
#: a request's id, unique within the engine that sends it
ReqId: TypeAlias = str
#: a request across engines: (the source engine, its request id); a destination keys its requests by it
ReqKey: TypeAlias = tuple[EngineId, ReqId]
#: a request as an endpoint keys it by its peer engine: (that engine, None on a source while any may read it; its id)
PeerReqKey: TypeAlias = tuple[EngineId | None, ReqId]
#: a group of layers or a span of tokens as a key: (start, stop); None for all of them
RangeKey: TypeAlias = tuple[int, int]
#: a streamed request's part (``outgoing.part_key``): its layer group and token span; None for the whole request
PartKey: TypeAlias = tuple[RangeKey | None, RangeKey | None]
#: one part of a request on a source, as the source keys what it sends: its ``PeerReqKey`` and its part
OutKey: TypeAlias = tuple[EngineId | None, ReqId, PartKey | None]
#: a TP rank within its engine
Rank: TypeAlias = int
#: a transport endpoint's id as its peers see it (``Transport.id``, ``Transport.connect``'s result)
PeerId: TypeAlias = str
