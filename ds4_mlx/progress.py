"""Progress bars on stderr for long waits (loading 81 GB, long prefills); silent when stderr is not a terminal."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    ProgressColumn,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.progress import Progress as RichProgress
from rich.text import Text


class TokenRateColumn(ProgressColumn):
    def render(self, task) -> Text:
        return Text(f"{task.speed:.0f} tok/s" if task.speed else "")


class Bar:
    """One progress bar; `update(done, total)` may be called from a callback. Does nothing when disabled."""

    def __init__(self, progress: RichProgress | None, description: str) -> None:
        self._progress = progress
        self._description = description
        self._task = None

    def update(self, done: int, total: int) -> None:
        if self._progress is None:
            return
        if self._task is None:
            self._progress.start()
            self._task = self._progress.add_task(self._description, total=total)
        self._progress.update(self._task, completed=done, total=total)

    def close(self) -> None:
        """Removes the bar (e.g. when the answer starts printing on the same terminal)."""
        if self._progress is not None and self._task is not None:
            self._progress.stop()
        self._progress = None


class Progress:
    """Makes bars for bytes (loading) or tokens (prefill), or silent ones with --quiet or a non-terminal stderr."""

    def __init__(self, quiet: bool = False) -> None:
        self.enabled = not quiet and sys.stderr.isatty()

    @contextmanager
    def bar(self, description: str, unit: str = "tokens") -> Iterator[Bar]:
        rich = None
        if self.enabled:
            rate = [DownloadColumn(), TransferSpeedColumn()] if unit == "bytes" else [MofNCompleteColumn(), TokenRateColumn()]
            rich = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                TaskProgressColumn(),
                *rate,
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )
        bar = Bar(rich, description)
        try:
            yield bar
        finally:
            bar.close()
