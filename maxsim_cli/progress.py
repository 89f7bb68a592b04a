"""Progress for a person at a terminal: a rich bar on stderr, drawn only when stderr is a terminal.

`ScoreProgress` is `maxsim score`'s bar: it counts tokens scored (documents scored are shown beside it)
and shows documents/s, tokens/s and the time left. `progress_bar` is every other long command's: one
count (tokens quantized, pairs verified) with its rate and the time left. When disabled, or when stderr
is not a terminal (a pipeline, a log file, a test runner), nothing at all is written: stdout carries
data only, and stderr stays clean for the summary line.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.text import Text

from maxsim_cli.units import format_si as _si


class _RateColumn(ProgressColumn):
    """``12.3K docs/s  4.56M tokens/s`` from the task's elapsed time."""

    def render(self, task: Task) -> Text:
        elapsed = task.elapsed or 0.0
        if elapsed <= 0:
            return Text("")
        docs = task.fields.get("docs", 0) / elapsed
        tokens = task.completed / elapsed
        return Text(f"{_si(docs)} docs/s  {_si(tokens)} tokens/s", style="progress.data.speed")


def progress_enabled(quiet: bool) -> bool:
    """Whether a bar may be drawn: not ``--quiet`` and stderr is a terminal."""
    return not quiet and sys.stderr.isatty()


class ScoreProgress:
    """Context manager; `advance(docs, tokens)` after each scored batch. A no-op when disabled.

    A `shared` bar serves several scoring threads (the rank threads of `--devices`): it starts empty,
    each thread adds its own work with `add_total` before it starts, and `advance` is safe to call from
    any of them. A bar that is not shared and has nothing to count is not drawn."""

    def __init__(self, enabled: bool, total_tokens: int, *, shared: bool = False) -> None:
        self.enabled = bool(enabled) and (total_tokens > 0 or shared) and sys.stderr.isatty()
        self.total_tokens = total_tokens
        self.docs = 0
        self.tokens = 0
        self._progress: Progress | None = None
        self._task = None
        self._last = 0.0
        self._lock = threading.Lock()

    def __enter__(self) -> ScoreProgress:
        if self.enabled:
            self._progress = Progress(
                TextColumn("scoring"),
                BarColumn(),
                TextColumn("{task.percentage:>3.0f}%"),
                _RateColumn(),
                TimeRemainingColumn(),
                console=Console(file=sys.stderr),
                transient=True,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task("score", total=self.total_tokens, docs=0)
        return self

    def add_total(self, tokens: int) -> None:
        """Add work to the bar's total (a scoring thread that shares the bar, before it starts)."""
        with self._lock:
            self.total_tokens += tokens
            if self._progress is not None:
                self._progress.update(self._task, total=self.total_tokens)

    def advance(self, docs: int, tokens: int) -> None:
        """Count one scored batch."""
        with self._lock:
            self.docs += docs
            self.tokens += tokens
            if self._progress is None:
                return
            now = time.monotonic()
            self._progress.update(self._task, advance=tokens, docs=self.docs, refresh=now - self._last > 0.5)
            self._last = now

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(None, None, None)
            self._progress = None


class _CountColumn(ProgressColumn):
    """``1.23M/4.56M tokens, 512K/s`` from the task's counts and elapsed time."""

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        total = f"/{_si(task.total)}" if task.total else ""
        elapsed = task.elapsed or 0.0
        rate = f", {_si(task.completed / elapsed)}/s" if elapsed > 0 else ""
        return Text(f"{_si(task.completed)}{total} {self.unit}{rate}", style="progress.data.speed")


@contextmanager
def progress_bar(label: str, enabled: bool, unit: str) -> Iterator[Callable[[int, int], None]]:
    """A transient bar on stderr labelled ``label``, counting ``unit`` (tokens, pairs); yields
    ``update(done, total)``. Nothing is drawn when not ``enabled`` or when stderr is not a terminal."""
    if not progress_enabled(not enabled):
        yield lambda done, total: None
        return
    with Progress(
        TextColumn(label),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        _CountColumn(unit),
        TimeRemainingColumn(),
        console=Console(file=sys.stderr),
        transient=True,
    ) as bar:
        task = bar.add_task(label, total=None)
        last = [0.0]

        def update(done: int, total: int) -> None:
            now = time.monotonic()
            bar.update(task, completed=done, total=total or None, refresh=now - last[0] > 0.5)
            last[0] = now

        yield update
