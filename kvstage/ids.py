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
#: a TP rank within its engine
Rank: TypeAlias = int
#: a transport endpoint's id as its peers see it (``Transport.id``, ``Transport.connect``'s result)
PeerId: TypeAlias = str
