"""Parse what UCX prints with ``UCX_PROTO_INFO=y``: the protocol it selected.

UCX prints one table per (endpoint configuration, operation, source memory,
destination memory) the first time that combination is used::

    [1795965927.303451] [vm:440  :0]   +--------+-------------+---------------+
    [1795965927.303451] [vm:440  :0]   | a intra-node cfg#2                   |
    [1795965927.303451] [vm:440  :0]   | remote memory write by ucp_put*(multi) from cuda/GPU0 to cuda/dev[1] |
    [1795965927.303451] [vm:440  :0]   +--------+-------------+---------------+
    [1795965927.303451] [vm:440  :0]   | Range  | Description |    Config     |
    [1795965927.303451] [vm:440  :0]   +--------+-------------+---------------+
    [1795965927.303451] [vm:440  :0]   | 0..inf | zero-copy   | cuda_ipc/cuda |
    [1795965927.303451] [vm:440  :0]   +--------+-------------+---------------+

The title names the worker (NIXL passes its agent name), the endpoint scope
(``self`` is the loopback endpoint, ``intra-node``/``inter-node`` a peer) and
the configuration number. Each row gives a message-size range, the protocol and
the lanes (``cma/memory``, ``52% on tcp/lo and 48% on tcp/eth0``).

Pure functions: text in, data out. Output of several processes may be mixed in
one capture; lines are grouped by their ``[host:pid:thread]`` prefix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_PREFIX = re.compile(r"^\[(?P<ts>[\d.]+)\]\s+\[(?P<host>[^\]:]*):(?P<pid>\d+)\s*:(?P<tid>\d+)\]\s?(?P<body>.*)$")
_TITLE = re.compile(r"^(?:(?P<worker>.*\S)\s+)?(?P<scope>\S+)\s+cfg#(?P<cfg>\d+)$")
_LANE = re.compile(r"(?:(?P<share>\d+)% on )?(?P<tl>[A-Za-z][A-Za-z0-9_]*)/(?P<dev>[^\s,]+)")
_UCX_MSG = re.compile(r"\bUCX\s+(?P<level>WARN|ERROR|FATAL)\s+(?P<text>.*)$")
_NIXL_MSG = re.compile(r"^(?P<level>[EWF])\d{4} [\d:.]+\s+\d+ (?P<where>[^\]]+)\] (?P<text>.*)$")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclass(frozen=True)
class Lane:
    transport: str  # UCX transport layer, e.g. "cma", "tcp", "cuda_ipc", "rc_mlx5"
    device: str  # e.g. "memory", "lo", "cuda", "mlx5_0:1"
    share: int | None = None  # percent of the bytes, when UCX splits across lanes


@dataclass(frozen=True)
class ProtoRow:
    lo: int
    hi: int | None  # None: no upper bound ("inf")
    description: str  # "zero-copy", "short", "software emulation", ...
    config: str  # the raw Config cell
    lanes: tuple[Lane, ...]

    def covers(self, size: int) -> bool:
        return self.lo <= size and (self.hi is None or size <= self.hi)

    @property
    def summary(self) -> str:
        return f"{self.description} | {self.config}"


@dataclass
class ProtoTable:
    stream: str  # "host:pid:thread" of the process that printed it
    worker: str
    scope: str  # "self", "intra-node", "inter-node"
    cfg: int
    operation: str  # "remote memory write", "active message", ...
    api: str  # "ucp_put*(multi)", ...
    src: str  # normalised memory type: "host", "cuda", ...
    dst: str | None
    src_raw: str
    dst_raw: str | None
    rows: list[ProtoRow] = field(default_factory=list)

    def row_for(self, size: int) -> ProtoRow | None:
        for row in self.rows:
            if row.covers(size):
                return row
        return None


def memory_type(text: str) -> str:
    """``host memory``/``host`` → ``host``; ``cuda/GPU0``/``cuda/dev[1]`` → ``cuda``."""
    text = text.strip()
    if text.endswith(" memory"):
        text = text[: -len(" memory")]
    return text.split("/", 1)[0].strip()


def _size(text: str) -> int | None:
    text = text.strip()
    if text == "inf":
        return None
    m = re.fullmatch(r"(\d+)\s*([KMGT]?)B?", text)
    if not m:
        raise ValueError(f"bad size {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2)]


def _range(text: str) -> tuple[int, int | None]:
    if ".." in text:
        lo, hi = text.split("..", 1)
        return _size(lo) or 0, _size(hi)
    v = _size(text)
    return (v or 0), v


def _operation(text: str):
    op, _, rest = text.partition(" by ")
    api, _, mem = rest.partition(" from ")
    src, _, dst = mem.partition(" to ")
    if not api or not src:
        return None
    return op.strip(), api.strip(), src.strip(), (dst.strip() or None)


def _streams(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for raw in text.splitlines():
        m = _PREFIX.match(raw)
        if m:
            key, body = f"{m['host']}:{m['pid']}:{m['tid']}", m["body"]
        else:
            key, body = "", raw
        body = body.strip()
        if body.startswith("|") or body.startswith("+"):
            out.setdefault(key, []).append(body)
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_proto_info(text: str) -> list[ProtoTable]:
    """Every protocol table in ``text`` (one or more processes' output), in order."""
    tables: list[ProtoTable] = []
    for stream, lines in _streams(text).items():
        current: ProtoTable | None = None
        pending_title = None
        for line in lines:
            if line.startswith("+"):
                continue
            cells = _cells(line)
            if len(cells) == 1:
                title = _TITLE.match(cells[0])
                if title:
                    pending_title, current = title, None
                    continue
                op = _operation(cells[0])
                if op and pending_title is not None:
                    current = ProtoTable(
                        stream=stream,
                        worker=pending_title["worker"] or "",
                        scope=pending_title["scope"],
                        cfg=int(pending_title["cfg"]),
                        operation=op[0],
                        api=op[1],
                        src=memory_type(op[2]),
                        dst=memory_type(op[3]) if op[3] else None,
                        src_raw=op[2],
                        dst_raw=op[3],
                    )
                    tables.append(current)
                pending_title = None
                continue
            if current is None or len(cells) != 3 or cells[0] == "Range":
                continue
            try:
                lo, hi = _range(cells[0])
            except ValueError:
                continue
            lanes = tuple(
                Lane(m["tl"], m["dev"], int(m["share"]) if m["share"] else None) for m in _LANE.finditer(cells[2])
            )
            current.rows.append(ProtoRow(lo, hi, cells[1], cells[2], lanes))
    return tables


@dataclass
class Selection:
    """The protocol UCX selected for one kind of transfer, as it printed it."""

    operation: str
    src: str
    dst: str
    size: int
    rows: list[ProtoRow]
    tables: list[ProtoTable]

    @property
    def transports(self) -> list[str]:
        seen: list[str] = []
        for row in self.rows:
            for lane in row.lanes:
                if lane.transport not in seen:
                    seen.append(lane.transport)
        return seen

    @property
    def descriptions(self) -> list[str]:
        return sorted({r.description for r in self.rows})

    @property
    def summary(self) -> str:
        return "; ".join(sorted({r.summary for r in self.rows}))

    def to_dict(self) -> dict:
        return {
            "operation": self.operation,
            "src": self.src,
            "dst": self.dst,
            "size": self.size,
            "summary": self.summary,
            "transports": self.transports,
            "descriptions": self.descriptions,
            "tables": [
                f"{t.worker} {t.scope} cfg#{t.cfg}: {t.operation} by {t.api} from {t.src_raw} to {t.dst_raw}"
                for t in self.tables
            ],
        }


def select(
    tables: list[ProtoTable],
    src: str,
    dst: str,
    size: int,
    operation: str = "remote memory write",
    worker: str | None = None,
    include_self: bool = False,
) -> Selection | None:
    """What UCX picked for ``operation`` of ``size`` bytes from ``src`` to ``dst`` memory.

    Loopback (``self``) endpoints are left out unless asked for: they say how a
    process writes to itself, not to its peer. ``worker`` keeps only tables of
    that worker (a NIXL agent name). None when UCX printed no such table.
    """
    chosen = [
        t
        for t in tables
        if t.operation == operation
        and t.src == src
        and t.dst == dst
        and (include_self or t.scope != "self")
        and (worker is None or t.worker == worker)
    ]
    rows = [r for r in (t.row_for(size) for t in chosen) if r is not None]
    if not rows:
        return None
    return Selection(operation, src, dst, size, rows, chosen)


def by_memory_pair(tables: list[ProtoTable], size: int, include_self: bool = False) -> dict[str, list[str]]:
    """``"operation: src->dst"`` → the protocols UCX printed for ``size`` bytes (for reports)."""
    out: dict[str, list[str]] = {}
    for t in tables:
        if t.scope == "self" and not include_self:
            continue
        row = t.row_for(size)
        if row is None:
            continue
        key = f"{t.operation}: {t.src}->{t.dst or '-'}"
        if row.summary not in out.setdefault(key, []):
            out[key].append(row.summary)
    return out


def ucx_messages(text: str) -> list[str]:
    """UCX's WARN/ERROR/FATAL lines and NIXL's E/W/F log lines, without timestamps, once each."""
    out = []
    for raw in text.splitlines():
        m = _UCX_MSG.search(raw)
        if m:
            out.append(f"UCX {m['level']} {m['text'].strip()}")
            continue
        m = _NIXL_MSG.match(raw.strip())
        if m:
            level = {"E": "ERROR", "W": "WARN", "F": "FATAL"}[m["level"]]
            out.append(f"NIXL {level} {m['text'].strip()}")
    return list(dict.fromkeys(out))
