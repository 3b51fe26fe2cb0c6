"""What one benchmark run measures: both sides' specs, the request size, the modes.

A ``Scenario`` is one point: a TP pair, a token count, a concurrency. A sweep
is a list of points; points that share a TP pair (and everything else but
tokens and concurrency) form a ``Group`` that runs in one set of rank
processes, sized for its largest point.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

from kvstage.config import Settings
from kvstage.errors import ConfigError, IncompatibleGeometry
from kvstage.layout import KVGeometry, PageLayout, pages_needed, token_bytes
from kvstage.staging.arena import arena_size
from kvstage.tp import SideSpec, TransferPlan, plan

MODES = ("staged", "bulk", "per-slice")

#: Model presets: (layers, kv_heads, head_dim, mla). Explicit flags override.
PRESETS = {
    "llama3-8b": (32, 8, 128, False),
    "llama3-70b": (80, 8, 128, False),
    "qwen2.5-7b": (28, 4, 128, False),
    "deepseek-v3": (61, 1, 576, True),
}


@dataclass
class Scenario:
    geometry: KVGeometry
    src_tp: int
    dst_tp: int
    tokens: int
    src_page: PageLayout
    dst_page: PageLayout
    modes: tuple[str, ...] = MODES
    device: str = "cpu"
    iters: int = 3
    warmup: int = 1
    seed: int = 0
    verify: bool = True
    arena_mb: float | None = None  # None: sized by rule (``staging.arena.arena_size``)
    copier: str | None = None  # force a copier by name (a diagnostic); None: the rule's
    settings_extra: dict = field(default_factory=dict)
    concurrency: int = 1
    src_gpu: int = 0  # CUDA device of every source rank (device=cuda)
    dst_gpu: int = 0  # CUDA device of every destination rank
    transport: str = "nixl"  # nixl (one-sided) or ucx (two-sided, UCXX); every mode uses it

    def __post_init__(self) -> None:
        self.modes = tuple(self.modes)
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ConfigError(f"mode={','.join(bad)}: must be one of {', '.join(MODES)} or all")
        if len(set(self.modes)) != len(self.modes):
            raise ConfigError(f"mode={','.join(self.modes)}: a mode is named twice")
        if self.tokens < 1:
            raise ConfigError(f"tokens={self.tokens}: must be >= 1")
        if self.concurrency < 1:
            raise ConfigError(f"concurrency={self.concurrency}: must be >= 1")
        if self.iters < 1 or self.warmup < 0:
            raise ConfigError(f"iters={self.iters}, warmup={self.warmup}: need iters >= 1 and warmup >= 0")
        if self.copier not in (None, "cuda", "native", "torch"):
            raise ConfigError(f"copier={self.copier!r}: must be cuda, native or torch, or unset for the rule's choice")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device={self.device!r}: must be cpu or cuda")
        for name in ("src_gpu", "dst_gpu"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be a CUDA device index >= 0")
        self.settings()  # validates arena and slot sizes
        self.plan  # validates the pair before any process or memory exists

    @property
    def src(self) -> SideSpec:
        return SideSpec.of(self.geometry, self.src_tp, self.src_page, "source")

    @property
    def dst(self) -> SideSpec:
        return SideSpec.of(self.geometry, self.dst_tp, self.dst_page, "destination")

    @property
    def plan(self) -> TransferPlan:
        return plan(self.src, self.dst)

    def torch_device(self, side: str):
        """Where ``side``'s ("src" or "dst") rank buffers live."""
        import torch

        if self.device != "cuda":
            return torch.device("cpu")
        return torch.device("cuda", self.src_gpu if side == "src" else self.dst_gpu)

    def settings(self) -> Settings:
        return Settings(**{"arena_mb": self.arena_mb, "transport": self.transport, **self.settings_extra})

    def pages(self, side: SideSpec) -> int:
        """Cache size per rank: room for every concurrent request plus as much
        again unused, so page ids are scattered and stray writes show."""
        return (self.concurrency + 1) * pages_needed(self.tokens, side.page.page_size) + 1

    def payload_bytes(self) -> int:
        """Bytes every destination rank receives together for one request."""
        return self.tokens * token_bytes(self.geometry, self.dst.local_heads()) * self.dst_tp

    def arena_bytes(self, side: str = "dst") -> int:
        """Staging arena a rank of ``side`` registers, by the rule (on a GPU before its cap
        by free memory, which only the rank process knows)."""
        spec = self.src if side == "src" else self.dst
        where = "device" if self.device == "cuda" else "host"
        return arena_size(self.settings().arena_bytes, token_bytes(self.geometry, spec.local_heads()), where).nbytes

    def group_key(self) -> tuple:
        """Points with equal keys share one set of rank processes."""
        d = self.to_dict()
        for k in ("tokens", "concurrency", "payload_bytes"):
            d.pop(k)
        return tuple(sorted((k, repr(v)) for k, v in d.items()))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["modes"] = list(self.modes)
        d["payload_bytes"] = self.payload_bytes()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Scenario":
        d = dict(d)
        d.pop("payload_bytes", None)
        d["geometry"] = KVGeometry(**d["geometry"])
        d["src_page"] = PageLayout(**d["src_page"])
        d["dst_page"] = PageLayout(**d["dst_page"])
        d["modes"] = tuple(d["modes"])
        return cls(**d)


@dataclass
class Group:
    """Points sharing a TP pair and settings; run by one set of rank processes."""

    points: list[Scenario]

    def __post_init__(self) -> None:
        if not self.points or len({p.group_key() for p in self.points}) != 1:
            raise ValueError("a group needs at least one point, all alike but for tokens and concurrency")

    @property
    def base(self) -> Scenario:
        return self.points[0]

    @property
    def label(self) -> str:
        return f"{self.base.src_tp}->{self.base.dst_tp}"

    def pages(self, side: SideSpec) -> int:
        return max(p.pages(side) for p in self.points)

    def schedule(self) -> list[tuple[int, str, int]]:
        """Every (point, mode, iteration) step, in the order all ranks walk them."""
        return [(i, m, it) for i, p in enumerate(self.points) for m in p.modes for it in range(p.warmup + p.iters)]

    def to_wire(self) -> dict:
        return {"points": [p.to_dict() for p in self.points]}

    @classmethod
    def from_wire(cls, d: dict) -> "Group":
        return cls([Scenario.from_dict(p) for p in d["points"]])

    def host_bytes(self, roles=("src", "dst")) -> int:
        """Memory the rank processes of ``roles`` allocate together (caches,
        arenas, bulk buffers): what the up-front memory check compares."""
        b = self.base
        total = 0
        for role in roles:
            side = b.src if role == "src" else b.dst
            tp = b.src_tp if role == "src" else b.dst_tp
            cache = self.pages(side) * side.page.page_size * token_bytes(b.geometry, side.local_heads())
            bulk = max(p.concurrency * p.tokens for p in self.points) * token_bytes(b.geometry, side.local_heads())
            total += tp * (cache + b.arena_bytes(role) + (bulk if "bulk" in b.modes else 0))
        return total


def parse_int_list(name: str, text) -> list[int]:
    """``"1,2,8"`` (or an int, or a list of ints) -> ``[1, 2, 8]``; duplicates dropped, order kept."""
    if isinstance(text, bool):
        raise ConfigError(f"{name}={text!r}: must be an integer or a comma list of integers")
    if isinstance(text, int):
        items = [text]
    elif isinstance(text, (list, tuple)):
        items = list(text)
    else:
        parts = [s.strip() for s in str(text).split(",")]
        if not parts or any(not s for s in parts):
            raise ConfigError(f"{name}={text!r}: must be an integer or a comma list of integers, like 1,2,8")
        items = parts
    out = []
    for s in items:
        try:
            v = int(s) if not isinstance(s, bool) else None
        except (TypeError, ValueError):
            v = None
        if v is None or (isinstance(s, float) and s != v):
            raise ConfigError(f"{name}={text!r}: {s!r} is not an integer")
        if v not in out:
            out.append(v)
    if not out:
        raise ConfigError(f"{name}: empty list")
    return out


@dataclass
class Sweep:
    """The cross product of TP pairs, token counts and concurrencies, validated up front."""

    groups: list[Group]
    skipped: list[str] = field(default_factory=list)  # pairs left out by ``skip_invalid``

    @property
    def points(self) -> list[Scenario]:
        return [p for g in self.groups for p in g.points]

    @classmethod
    def build(cls, src_tps, dst_tps, tokens, concurrency, skip_invalid: bool = False, **common) -> "Sweep":
        """Validate every point before anything runs.

        Errors that do not depend on the TP pair (a bad dtype, tokens=0) are
        raised at once. Pairs that cannot be planned are collected and raised
        together as one ``IncompatibleGeometry`` naming each, unless
        ``skip_invalid`` is set (then they are listed in ``skipped``)."""
        bad_pairs, groups = [], []
        for s, d in itertools.product(src_tps, dst_tps):
            points = []
            try:
                for t, c in itertools.product(tokens, concurrency):
                    points.append(Scenario(src_tp=s, dst_tp=d, tokens=t, concurrency=c, **common))
            except IncompatibleGeometry as e:
                bad_pairs.append(f"src_tp={s} -> dst_tp={d}: {e}")
                continue
            groups.append(Group(points))
        if bad_pairs and (not skip_invalid or not groups):
            n = len(src_tps) * len(dst_tps)
            head = "" if n == 1 else f"{len(bad_pairs)} of {n} TP pairs cannot run (nothing was started; --skip-invalid runs the others):\n  "
            raise IncompatibleGeometry(head + "\n  ".join(bad_pairs) if n > 1 else bad_pairs[0].split(": ", 1)[1])
        return cls(groups, bad_pairs)
