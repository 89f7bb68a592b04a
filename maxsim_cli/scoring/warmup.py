"""A process's first Triton launch, made in a background thread while a CUDA run sets up.

A fresh process pays once, on its first kernel launch, with the kernel already in Triton's disk cache:
importing triton (0.3 s on the H200 machine, where its sources were compiled to bytecode at every start),
the key of Triton's cache (a hash of Triton's own libraries, 0.42 s, once a process; now read back from a
saved copy, `tuning.remember_triton_key`), loading the compiled kernel and Triton's launcher
(docs/benchmarks.md, "What a fresh process pays once"). Without this thread the pass's first batch pays
all of it.

`KernelWarmup.start` starts the thread as soon as a run knows it will launch Triton kernels on a GPU,
before the corpus is opened: it imports the kernels, gets the cache key and makes the device current
in its thread, loads the reductions of the batches' value check (`pipeline.batch_check`), then waits
for `load`, which gives it the run's first launches (the run's queries against one small document:
`maxsim_cli.scoring.files`), and makes them on a stream of its own. The run calls
`wait` before its first launch and `close` on every exit path, so no thread outlives the run, an error
or Ctrl-C included (the thread stops at its next step). The thread never raises: a launch that fails
here fails again in the pass, which reports it. It changes no result: the pass launches the same
kernels with the same arguments either way.

While it runs, Python's lock is handed over every `tuning.THREAD_SWITCH_S` instead of every 5 ms: the
imports hold the lock, and the set-up beside them (opening shards, sorting ids) takes and drops it at
every read and would otherwise wait out each interval (an earlier warm-up thread without it slowed the
set-up by more than it saved; docs/kernel-notes.md, "A fresh process's first batch").

``MAXSIM_KERNEL_WARMUP=0`` turns the thread off: the first batch then pays the first launch, as before
(`maxsim_cli.settings`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import torch

from maxsim_cli import settings, timeline, tuning


class _Cancelled(Exception):
    pass


class KernelWarmup:
    """The background thread of the module docstring. ``times`` holds each step's seconds (for the
    stats), ``error`` what stopped the thread, if anything (never raised)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: dict[str, float] = {}
        self.error: str | None = None
        self._launch: Callable[[], None] | None = None
        self._given = threading.Event()  # `load` or `close` was called
        self._cancelled = threading.Event()
        self._switches: contextlib.AbstractContextManager[None] | None = tuning.quick_thread_switches()
        self._switches.__enter__()
        # a daemon only as a safety net: every run joins it (`close`)
        self._thread = threading.Thread(target=self._run, name="maxsim-warmup", daemon=True)
        self._thread.start()

    @staticmethod
    def wanted(device: torch.device, backend: str) -> bool:
        """Whether a run on ``device`` with ``backend`` launches Triton kernels on a GPU from this
        process's main thread (a rank thread of a job does not: the job's threads share the process) and
        the warm-up is not turned off."""
        if not settings.kernel_warmup() or device.type != "cuda":
            return False
        if threading.current_thread() is not threading.main_thread():
            return False
        from maxsim_kernels import resolve_backend

        return resolve_backend(backend, device) == "triton"

    @classmethod
    def start(cls, device: torch.device, backend: str) -> KernelWarmup | None:
        """A started warm-up where `wanted`, else None."""
        return cls(device) if cls.wanted(device, backend) else None

    def _step(self, name: str, work: Callable[[], object]) -> None:
        if self._cancelled.is_set():
            raise _Cancelled
        started = time.perf_counter()
        work()
        self.times[f"{name}_s"] = round(time.perf_counter() - started, 4)
        timeline.mark(name)

    def _run(self) -> None:
        try:
            self._step("triton_imported", _import_kernels)
            self._step("cache_key", _cache_key)
            if self.device.type == "cuda":
                self._step("cuda_ready", self._make_current)
                self._step("checks_loaded", self._load_checks)
            self._given.wait()
            if self._launch is not None:
                self._step("kernels_ready", self._first_launches)
        except _Cancelled:
            pass
        except Exception as exc:  # noqa: BLE001 - the pass's own launches meet it and report it
            self.error = f"{type(exc).__name__}: {exc}"

    def _make_current(self) -> None:
        torch.cuda.set_device(self.device)
        torch.cuda.current_stream(self.device)

    def _load_checks(self) -> None:
        """The values' check of a pass's batches (`pipeline.batch_check`), on a few zeros of each dtype
        a corpus can have: it loads PyTorch's reduction kernels while the thread would otherwise wait for
        the run's queries (on the H200, 45-140 ms of waiting), where the pass's first batch paid 13-24 ms
        for them (docs/kernel-notes.md, "The pass, traced")."""
        from maxsim_cli.scoring.pipeline import batch_check

        stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            out = torch.empty((), dtype=torch.float32, device=self.device)
            for dtype in (torch.float16, torch.bfloat16, torch.float32):
                batch_check(torch.zeros(16, dtype=dtype, device=self.device), None, out=out)
            scales = torch.ones(16, dtype=torch.float32, device=self.device)
            batch_check(torch.zeros(16, dtype=torch.int8, device=self.device), scales, out=out)
        stream.synchronize()

    def _first_launches(self) -> None:
        assert self._launch is not None
        if self.device.type != "cuda":  # the interpreter (tests)
            self._launch()
            return
        stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            self._launch()
        stream.synchronize()

    def load(self, launch: Callable[[], None]) -> None:
        """Make ``launch``'s calls in the thread, once its imports are done."""
        self._launch = launch
        self._given.set()

    def wait(self) -> float:
        """Block until the thread is done (with `load`'s launches made, when given); returns the seconds
        waited."""
        started = time.perf_counter()
        self._given.set()
        self._thread.join()
        self._restore_interval()
        return time.perf_counter() - started

    def close(self) -> None:
        """End the thread: it skips its remaining steps (the one under way finishes) and is joined."""
        self._cancelled.set()
        self._given.set()
        self._thread.join()
        self._restore_interval()

    def stats(self) -> dict[str, object]:
        """The steps' seconds, and the error that stopped the thread, if any."""
        return {**self.times, **({"error": self.error} if self.error else {})}

    def _restore_interval(self) -> None:
        if self._switches is not None:
            self._switches.__exit__(None, None, None)
            self._switches = None


def _import_kernels() -> None:
    import maxsim_kernels.maxsim_forward  # noqa: F401 - imports triton
    import maxsim_kernels.order_keys  # noqa: F401


def _cache_key() -> None:
    """Triton's compile-cache key, read back from the copy kept beside Triton's cache where its files
    are unchanged (`tuning.remember_triton_key`, in the command line's process only), else computed once
    a process (an lru_cache inside Triton)."""
    try:
        from triton.runtime import cache as triton_cache
    except ImportError:  # pragma: no cover - not where this Triton release keeps it: the launch computes it
        return
    remembered = settings.triton_key_cache() and tuning.in_one_shot_process()
    if not remembered or not tuning.remember_triton_key(triton_cache):
        triton_cache.triton_key()
