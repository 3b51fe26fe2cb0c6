"""What the probe says about one peer: a severity, the path, the evidence.

Every piece of evidence carries where it came from:

- ``queried``: read from the system (NVML, /sys, /proc, an env var, a library);
- ``measured``: observed in a run (a timed write, the protocol UCX printed);
- ``assumed``: taken as true without checking;
- ``expected``: inferred from the facts, not observed (a path UCX should pick,
  a bandwidth the path should give).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

SOURCES = ("queried", "measured", "assumed", "expected")


class Severity(str, enum.Enum):
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"

    @property
    def level(self) -> int:
        return {"INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR}[self.value]


def fact(value, source: str, how: str) -> dict:
    """One gathered fact as JSON-able data: its value, its source, how it was obtained."""
    if source not in SOURCES:
        raise ValueError(f"fact source {source!r} must be one of {SOURCES}")
    return {"value": value, "source": source, "how": how}


@dataclass(frozen=True)
class Evidence:
    source: str
    text: str

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"evidence source {self.source!r} must be one of {SOURCES}")

    def __str__(self) -> str:
        return f"{self.source}: {self.text}"


@dataclass
class Finding:
    """The probe's verdict on one peer; ``line()`` is the one log line."""

    severity: Severity
    peer: str
    path: str
    gbps: float | None = None
    evidence: list[Evidence] = field(default_factory=list)
    cause: str | None = None
    fix: str | None = None
    best: str | None = None
    details: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """A working path exists (INFO or WARNING)."""
        return self.severity is not Severity.ERROR

    def line(self) -> str:
        bw = f"{self.gbps:.2f} GB/s measured" if self.gbps is not None else "bandwidth not measured"
        parts = [f"{self.severity.value} kvstage link to {self.peer}: {self.path}, {bw}"]
        if self.cause:
            parts.append(f"cause: {self.cause}")
        if self.fix:
            parts.append(f"fix: {self.fix}")
        if self.evidence:
            parts.append("evidence: " + "; ".join(str(e) for e in self.evidence))
        return " | ".join(parts)

    def log(self, logger: logging.Logger) -> None:
        """Log ``line()`` at the finding's severity (what the engine does once per peer)."""
        logger.log(self.severity.level, "%s", self.line())

    def to_dict(self) -> dict:
        return {
            "severity": self.severity.value,
            "peer": self.peer,
            "path": self.path,
            "gbps": self.gbps,
            "best": self.best,
            "cause": self.cause,
            "fix": self.fix,
            "evidence": [{"source": e.source, "text": e.text} for e in self.evidence],
            "line": self.line(),
            "details": self.details,
        }
