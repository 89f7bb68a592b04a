"""Keeping a server's event loop awake while a message is due within a few milliseconds.

An event loop with nothing ready sleeps in the kernel's poll, and the message it waits for has to wake
its process first. On the H200 host a served rerank request crossed from its HTTP worker to the
scoring process and back in 0.34 + 0.36 ms of socket time, each side waking from a sleep of a few
milliseconds, where the same bytes' whole round trip between two event loops idle for 0.5 ms took
0.18 ms (`python benchmarks/probe_hop_trace.py`, `python benchmarks/probe_worker_hop.py`;
docs/serve.md, "Busy polling"). `Awake` keeps the loop turning instead: a task that yields at every
turn, so the loop polls its sockets with a zero timeout, while an answer is due (`waiting`) and for
``linger_s`` after a message that announces more (`linger`). It costs a core while it turns, and
turns only then.

The loop stops turning once several answers are due at once, or ``paused()`` is true, until the next
`linger` or `waiting`: a loaded loop (several answers due, requests queued) has work enough to stay
awake, and a loop that shares its process with a scoring thread (the scoring process, or `--workers
0`) must not take the interpreter lock from that thread. (Sleeping in short steps instead would
not do: uvloop rounds a timer to whole milliseconds, and a 0.5 ms sleep to none.)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator

# The longest a loop turns for one `waiting` (an answer that takes longer, a large batch, is waited for
# asleep past this).
MAX_WAIT_S = 0.05


class Awake:
    """Turns the running event loop while an answer is due, and for ``linger_s`` after `linger` (module
    doc). ``linger_s`` <= 0 turns it off. Use it from the loop's own thread."""

    def __init__(self, linger_s: float, *, paused: Callable[[], bool] | None = None) -> None:
        self.linger_s = linger_s
        self.paused = paused
        self._until = 0.0  # turn until then, waiters or not
        self._waiters = 0
        self._wait_until = 0.0  # ... and, while there are waiters, until then
        self._task: asyncio.Task | None = None

    @property
    def on(self) -> bool:
        return self.linger_s > 0

    def linger(self) -> None:
        """Turn for ``linger_s`` from now (a message came that others follow closely)."""
        if self.on:
            self._until = max(self._until, time.perf_counter() + self.linger_s)
            self._start()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Turn while the block waits for an answer (at most `MAX_WAIT_S`), and ``linger_s`` after."""
        if not self.on:
            yield
            return
        self._waiters += 1
        self._wait_until = max(self._wait_until, time.perf_counter() + MAX_WAIT_S)
        self._start()
        try:
            yield
        finally:
            self._waiters -= 1
            self._until = max(self._until, time.perf_counter() + self.linger_s)

    def _start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._turn())

    def _due(self, now: float) -> bool:
        return now < self._until or (self._waiters > 0 and now < self._wait_until)

    def _loaded(self) -> bool:
        return self._waiters > 1 or (self.paused is not None and self.paused())

    async def _turn(self) -> None:
        try:
            while self._due(time.perf_counter()) and not self._loaded():
                await asyncio.sleep(0)
        finally:
            self._task = None

    async def close(self) -> None:
        """Stop turning (the loop is about to stop)."""
        self._until = self._wait_until = 0.0
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
