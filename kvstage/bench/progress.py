"""The run's progress on stderr while it measures (rich, imported only once a bar is shown).

Apart from the result's presentation: it watches a run, it does not read a result.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress
    from rich.progress import TaskID


class Progress:
    """A rich progress bar on stderr, shown once the run has taken ``delay``
    seconds (short runs print nothing extra). By default only on a terminal;
    forced on elsewhere (``--progress`` into a log) it prints one plain line
    per phase (a TP pair starting, measuring, done) instead of a bar."""

    def __init__(self, enabled: bool | None = None, delay: float = 2.0):
        self.tty = sys.stderr.isatty()
        self.enabled = self.tty if enabled is None else enabled
        self.delay = delay
        self.start = time.monotonic()
        self._bar: RichProgress | None = None  # rich is imported only once a bar is shown
        self._task: TaskID | None = None

    def __call__(self, done: int, total: int, what: str, phase: bool = False) -> None:
        if not self.enabled:
            return
        if not self.tty:
            if phase:
                print(
                    f"kvstage bench: [{done}/{total} steps, {time.monotonic() - self.start:.0f} s] {what}",
                    file=sys.stderr,
                    flush=True,
                )
            return
        if self._bar is None:
            if time.monotonic() - self.start < self.delay:
                return
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[progress.description]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
                refresh_per_second=4,
            )
            self._bar.start()
            self._task = self._bar.add_task(what, total=total)
        assert self._task is not None, "added with the bar"
        self._bar.update(self._task, completed=done, total=total, description=what)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
