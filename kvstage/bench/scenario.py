"""What one benchmark run measures: both sides' specs, the request size, the modes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvstage.config import Settings
from kvstage.errors import ConfigError
from kvstage.layout import KVGeometry, PageLayout, pages_needed, token_bytes
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
    arena_mb: float = 512.0
    slot_mb: float = 64.0
    settings_extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in MODES]
        if bad:
            raise ConfigError(f"mode={','.join(bad)}: must be one of {', '.join(MODES)} or all")
        if self.tokens < 1:
            raise ConfigError(f"tokens={self.tokens}: must be >= 1")
        if self.iters < 1 or self.warmup < 0:
            raise ConfigError(f"iters={self.iters}, warmup={self.warmup}: need iters >= 1 and warmup >= 0")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device={self.device!r}: must be cpu or cuda")
        self.settings()  # validates arena and slot sizes
        self.plan  # validates the pair before any process or memory exists

    @property
    def src(self) -> SideSpec:
        return SideSpec(self.geometry, self.src_tp, self.src_page)

    @property
    def dst(self) -> SideSpec:
        return SideSpec(self.geometry, self.dst_tp, self.dst_page)

    @property
    def plan(self) -> TransferPlan:
        return plan(self.src, self.dst)

    def settings(self) -> Settings:
        return Settings(arena_mb=self.arena_mb, slot_mb=self.slot_mb, **self.settings_extra)

    def pages(self, side: SideSpec) -> int:
        """Cache size per rank: twice what a request needs, so page ids can be scattered."""
        return 2 * pages_needed(self.tokens, side.page.page_size) + 1

    def payload_bytes(self) -> int:
        """Bytes every destination rank receives together (the figure GB/s is computed on)."""
        return self.tokens * token_bytes(self.geometry, self.dst.local_heads()) * self.dst_tp

    def to_dict(self) -> dict:
        d = asdict(self)
        d["payload_bytes"] = self.payload_bytes()
        return d
