"""What one benchmark run measures: both sides' specs, the request size, the modes.

A ``Scenario`` is one point: a TP pair, a token count, a concurrency. A sweep
is a list of points; points that share a TP pair (and everything else but
tokens and concurrency) form a ``Group`` that runs in one set of rank
processes, sized for its largest point.

A multi-engine point (``src_engines`` / ``dst_engines``) has several source
engines, several destination engines, or both, one per TP size listed: every
source engine sends ``concurrency`` requests per step to every destination
engine at once, and each (source engine, destination engine) pair is a result
of its own. Source engine ``i`` is ``s{i}``, destination engine ``j`` is ``d{j}``.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any

from kvstage.config import Settings
from kvstage.errors import ConfigError, IncompatibleGeometry
from kvstage.layout import KVGeometry, PageLayout, pages_needed, token_bytes
from kvstage.staging.arena import arena_size
from kvstage.tp import SideSpec, TransferPlan, plan

#: every mode a run can measure; ``content_seed`` numbers them, so a new one goes at the end
MODES = ("staged", "bulk", "per-slice", "streamed")

#: what ``--mode all`` runs: ``streamed`` is named on its own (it differs from staged only while a
#: forward runs, ``--prefill-ms``)
ALL_MODES = ("staged", "bulk", "per-slice")

#: the modes that move the bytes through kvstage (``Source`` and ``Destination``), not a baseline's writes
KVSTAGE_MODES = ("staged", "streamed")

#: engines per side a multi-engine run may have (each is TP-many rank processes on this host)
MAX_ENGINES = 16

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
    modes: tuple[str, ...] | None = None  # None: every mode; staged only with several engines
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
    #: TP size of each source engine of a multi-engine run (() : one engine of ``src_tp``); when given,
    #: ``src_tp`` is set to the first engine's TP
    src_engines: tuple[int, ...] = ()
    dst_engines: tuple[int, ...] = ()  # the same for the destination engines
    #: a simulated prefill forward before (staged, bulk, per-slice) or under (streamed) each step's
    #: transfer, its layers finished evenly over this many milliseconds (``bench.forward``); 0: none
    prefill_ms: float = 0.0

    def __post_init__(self) -> None:
        self.src_engines, self.dst_engines = tuple(self.src_engines), tuple(self.dst_engines)
        if self.multi:
            self._check_engines()
        self.modes = (("staged",) if self.multi else ALL_MODES) if self.modes is None else tuple(self.modes)
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ConfigError(
                f"mode={','.join(bad)}: must be one of {', '.join(MODES)}, or all ({','.join(ALL_MODES)})"
            )
        if len(set(self.modes)) != len(self.modes):
            raise ConfigError(f"mode={','.join(self.modes)}: a mode is named twice")
        if self.multi and self.modes != ("staged",):
            raise ConfigError(
                f"mode={','.join(self.modes)}: a run with several engines ({self.engines_text()}) measures staged "
                "only; bulk and per-slice are baselines of one engine pair (run kvstage bench --src-tp S --dst-tp D "
                "--mode staged,bulk for each pair); drop --mode or give --mode staged"
            )
        if not 0 <= self.prefill_ms < float("inf"):
            raise ConfigError(f"prefill_ms={self.prefill_ms}: must be >= 0 (milliseconds of simulated forward)")
        if self.multi and self.prefill_ms:
            raise ConfigError(
                f"prefill_ms={self.prefill_ms:g}: a run with several engines ({self.engines_text()}) "
                "has no simulated forward; give --prefill-ms to a run of one engine pair"
            )
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
        if not self.multi:
            _ = self.plan  # validates the pair before any process or memory exists
            return
        for i, j in self.pairs():  # every pair, each named
            try:
                self.pair_plan(i, j)
            except IncompatibleGeometry as e:
                raise IncompatibleGeometry(f"{self.pair_name(i, j)}: {e}") from None

    @property
    def run_modes(self) -> tuple[str, ...]:
        """``modes`` as ``__post_init__`` resolved it: None (every mode) is only ever given, never kept."""
        assert self.modes is not None, "__post_init__ resolves modes"
        return self.modes

    def _check_engines(self) -> None:
        for name in ("src_engines", "dst_engines"):
            tps = getattr(self, name)
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tps):
                raise ConfigError(f"{name}={','.join(map(str, tps))}: every entry is a TP size >= 1")
            if len(tps) > MAX_ENGINES:
                raise ConfigError(f"{name}={','.join(map(str, tps))}: at most {MAX_ENGINES} engines per side")
        self.src_engines = self.src_engines or (self.src_tp,)
        self.dst_engines = self.dst_engines or (self.dst_tp,)
        self.src_tp, self.dst_tp = self.src_engines[0], self.dst_engines[0]

    # -- engines ---------------------------------------------------------------------
    @property
    def multi(self) -> bool:
        """Several engines on a side (or engines named at all): one result per engine pair."""
        return bool(self.src_engines or self.dst_engines)

    def engines(self, role: str) -> tuple[int, ...]:
        """TP size of each engine of ``role`` ("src" or "dst"); one engine unless ``multi``."""
        if role == "src":
            return self.src_engines or (self.src_tp,)
        return self.dst_engines or (self.dst_tp,)

    def pairs(self) -> list[tuple[int, int]]:
        """Every (source engine, destination engine) index pair, in the order results list them."""
        return list(itertools.product(range(len(self.engines("src"))), range(len(self.engines("dst")))))

    def side(self, role: str, engine: int = 0) -> SideSpec:
        """The spec of engine ``engine`` of ``role``."""
        tp = self.engines(role)[engine]
        if role == "src":
            return SideSpec.of(self.geometry, tp, self.src_page, "source")
        return SideSpec.of(self.geometry, tp, self.dst_page, "destination")

    def pair_plan(self, i: int, j: int) -> TransferPlan:
        return plan(self.side("src", i), self.side("dst", j))

    def pair_name(self, i: int, j: int) -> str:
        return (
            f"source engine s{i} (TP {self.engines('src')[i]}) -> destination engine d{j} (TP {self.engines('dst')[j]})"
        )

    def engines_text(self) -> str:
        return (
            f"src_engines={','.join(map(str, self.engines('src')))}, "
            f"dst_engines={','.join(map(str, self.engines('dst')))}"
        )

    def requests_per_rank(self, role: str) -> int:
        """Requests one rank of ``role`` holds in a step: ``concurrency`` to or from every peer engine."""
        return self.concurrency * len(self.engines("dst" if role == "src" else "src"))

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

    def pages(self, side: SideSpec, requests: int | None = None) -> int:
        """Cache size per rank: room for every concurrent request (``requests``, default
        ``concurrency``) plus as much again unused, so page ids are scattered and stray writes show."""
        n = self.concurrency if requests is None else requests
        return (n + 1) * pages_needed(self.tokens, side.page.page_size) + 1

    def payload_bytes(self, dst_engine: int = 0) -> int:
        """Bytes every destination rank (of destination engine ``dst_engine``) receives together for one request."""
        spec = self.side("dst", dst_engine)
        return self.tokens * token_bytes(self.geometry, spec.local_heads()) * spec.tp

    def arena_bytes(self, side: str = "dst", engine: int = 0) -> int:
        """Staging arena a rank of ``side`` (of its engine ``engine``) registers, by the rule (on a
        GPU before its cap by free memory, which only the rank process knows)."""
        spec = self.side(side, engine)
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
        d["modes"] = list(self.run_modes)
        for k in ("src_engines", "dst_engines"):  # a one-engine run's record is as it always was
            if d[k]:
                d[k] = list(d[k])
            else:
                d.pop(k)
        d["payload_bytes"] = self.payload_bytes()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Scenario:
        d = dict(d)
        d.pop("payload_bytes", None)
        d["geometry"] = KVGeometry(**d["geometry"])
        d["src_page"] = PageLayout(**d["src_page"])
        d["dst_page"] = PageLayout(**d["dst_page"])
        d["modes"] = tuple(d["modes"])
        for k in ("src_engines", "dst_engines"):
            d[k] = tuple(d.get(k) or ())
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
        """The TP pair, "4->1"; with several engines each side's engines' TPs, "2,4->1"."""
        b = self.base
        return f"{','.join(map(str, b.engines('src')))}->{','.join(map(str, b.engines('dst')))}"

    def pages(self, side: SideSpec, role: str | None = None) -> int:
        """Cache pages of one rank with spec ``side``, for the largest point; ``role`` ("src"
        or "dst") counts the requests of every peer engine, which a multi-engine rank holds at once."""
        return max(p.pages(side, p.requests_per_rank(role) if role else None) for p in self.points)

    def processes(self, role: str) -> list[tuple[int | None, int]]:
        """(engine, rank) of every rank process of ``role``; engine None in a one-engine group."""
        b = self.base
        if not b.multi:
            return [(None, r) for r in range(b.src_tp if role == "src" else b.dst_tp)]
        return [(e, r) for e, tp in enumerate(b.engines(role)) for r in range(tp)]

    def schedule(self) -> list[tuple[int, str, int]]:
        """Every (point, mode, iteration) step, in the order all ranks walk them."""
        return [(i, m, it) for i, p in enumerate(self.points) for m in p.run_modes for it in range(p.warmup + p.iters)]

    def to_wire(self) -> dict:
        return {"points": [p.to_dict() for p in self.points]}

    @classmethod
    def from_wire(cls, d: dict) -> Group:
        return cls([Scenario.from_dict(p) for p in d["points"]])

    def host_bytes(self, roles=("src", "dst")) -> int:
        """Memory the rank processes of ``roles`` allocate together (caches,
        arenas, bulk buffers): what the up-front memory check compares."""
        b = self.base
        total = 0
        for role in roles:
            for e, tp in enumerate(b.engines(role)):  # every engine of the side
                side = b.side(role, e)
                cache = self.pages(side, role) * side.page.page_size * token_bytes(b.geometry, side.local_heads())
                bulk = max(p.concurrency * p.tokens for p in self.points) * token_bytes(b.geometry, side.local_heads())
                total += tp * (cache + b.arena_bytes(role, e) + (bulk if "bulk" in b.run_modes else 0))
        return total


def parse_int_list(name: str, text, duplicates: bool = False) -> list[int]:
    """``"1,2,8"`` (or an int, or a list of ints) -> ``[1, 2, 8]``; duplicates dropped (kept with
    ``duplicates``: ``--src-engines 2,2`` is two engines), order kept."""
    if isinstance(text, bool):
        raise ConfigError(f"{name}={text!r}: must be an integer or a comma list of integers")
    items: list[Any]  # a given list's entries may be anything: each is checked below
    if isinstance(text, int):
        items = [text]
    elif isinstance(text, (list, tuple)):
        items = list(text)
    else:
        parts = [s.strip() for s in str(text).split(",")]
        if not parts or any(not s for s in parts):
            raise ConfigError(f"{name}={text!r}: must be an integer or a comma list of integers, like 1,2,8")
        items = parts
    out: list[int] = []
    for s in items:
        try:
            v = int(s) if not isinstance(s, bool) else None
        except (TypeError, ValueError):
            v = None
        if v is None or (isinstance(s, float) and s != v):
            raise ConfigError(f"{name}={text!r}: {s!r} is not an integer")
        if duplicates or v not in out:
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
    def build(cls, src_tps, dst_tps, tokens, concurrency, skip_invalid: bool = False, **common) -> Sweep:
        """Validate every point before anything runs.

        Errors that do not depend on the TP pair (a bad dtype, tokens=0) are
        raised at once. Pairs that cannot be planned are collected and raised
        together as one ``IncompatibleGeometry`` naming each, unless
        ``skip_invalid`` is set (then they are listed in ``skipped``).

        With ``src_engines`` (``dst_engines``) in ``common``, each group has those
        source (destination) engines, and ``src_tps`` (``dst_tps``) must be their
        first TP alone: the other side's TP list still sweeps."""
        bad_pairs, groups = [], []
        for name, tps in (("src", src_tps), ("dst", dst_tps)):
            engines = tuple(common.get(f"{name}_engines") or ())
            if engines and list(tps) != [engines[0]]:
                raise ConfigError(
                    f"{name}_tp={','.join(map(str, tps))} with {name}_engines={','.join(map(str, engines))}: "
                    f"{name}_engines gives each engine's TP size; give one or the other"
                )
        for s, d in itertools.product(src_tps, dst_tps):
            points = []
            try:
                for t, c in itertools.product(tokens, concurrency):
                    points.append(Scenario(src_tp=s, dst_tp=d, tokens=t, concurrency=c, **common))
            except IncompatibleGeometry as e:
                src = (
                    f"src_engines={','.join(map(str, common['src_engines']))}"
                    if common.get("src_engines")
                    else f"src_tp={s}"
                )
                dst = (
                    f"dst_engines={','.join(map(str, common['dst_engines']))}"
                    if common.get("dst_engines")
                    else f"dst_tp={d}"
                )
                bad_pairs.append(f"{src} -> {dst}: {e}")
                continue
            groups.append(Group(points))
        if bad_pairs and (not skip_invalid or not groups):
            n = len(src_tps) * len(dst_tps)
            head = (
                ""
                if n == 1
                else f"{len(bad_pairs)} of {n} TP pairs cannot run "
                "(nothing was started; --skip-invalid runs the others):\n  "
            )
            raise IncompatibleGeometry(head + "\n  ".join(bad_pairs) if n > 1 else bad_pairs[0].split(": ", 1)[1])
        return cls(groups, bad_pairs)


def engine_id(role: str, engine: int) -> str:
    """The engine id a multi-engine rank's endpoint is made with, and its name in results: ``s0``, ``d1``."""
    return f"{'s' if role == 'src' else 'd'}{engine}"
