"""Run `maxsim` with the scoring pass traced, per batch, in the process's own run (for fresh processes).

    PASS_TRACE=trace.json python benchmarks/pass_trace.py score QUERIES CORPUS -k 1000 -o run.trec ...

Nothing is imported before the command imports it: the engine is wrapped when `maxsim_cli.scoring.engine`
is first imported (an import hook), so the process's start, its threads and its imports are those of
``python -m maxsim_cli``. Written at exit to ``PASS_TRACE`` (JSON):

- the pass's host clock: when `run_exhaustive` was entered (after the set-up), when each document batch's
  scoring (`_Engine._score_block`, the kernel call and the top-k merge) began and ended, and when the
  loop ended (`RunningTopK.result`) and the run's writing began and ended;
- the GPU's clock for the same batches: each batch's start and end events (the engine's own timers),
  as milliseconds after a reference event that the pass's start records and waits for, so that both
  clocks start together (within the wait's wake-up): a batch whose GPU start trails its host start is
  one the GPU was behind on; one that starts with it was waiting for the host;
- Python's garbage collections (generation, duration) from the import of the engine to the exit, with
  those inside the pass marked.

``PASS_TRACE_GC`` changes the collector for the pass, to measure what it costs: ``freeze`` (`gc.freeze` as
the pass starts: objects made before it are never scanned again) or ``off`` (`gc.disable` during it).
"""

from __future__ import annotations

import atexit
import gc
import importlib.abc
import importlib.machinery
import json
import os
import runpy
import sys
import threading
import time

TRACE: dict = {"batches": [], "gc": [], "events": []}
_gc_started: list[float] = []
_pass: dict = {}


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_started[:] = [time.perf_counter()]
    elif _gc_started:
        started = _gc_started[0]
        TRACE["gc"].append(
            {"generation": info["generation"], "at": started, "s": time.perf_counter() - started,
             "collected": info.get("collected")}
        )  # fmt: skip


def _wrap_engine(engine_module) -> None:  # noqa: ANN001
    import torch

    engine = engine_module._Engine
    run_exhaustive, score_block = engine.run_exhaustive, engine._score_block
    timer_end = engine._timer_end
    depth = [0]

    def traced_run_exhaustive(self, *args, **kwargs):  # noqa: ANN001, ANN202
        if self.cuda:
            ref = torch.cuda.Event(enable_timing=True)
            ref.record()
            ref.synchronize()
            _pass["ref"] = ref
        _pass["start"] = time.perf_counter()
        mode = os.environ.get("PASS_TRACE_GC", "")
        if mode == "freeze":
            gc.freeze()
        elif mode == "off":
            gc.disable()
        try:
            return run_exhaustive(self, *args, **kwargs)
        finally:
            if mode == "off":
                gc.enable()

    def traced_score_block(self, batch, a, b, *args, **kwargs):  # noqa: ANN001, ANN202
        depth[0] += 1
        started = time.perf_counter()
        try:
            return score_block(self, batch, a, b, *args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                TRACE["batches"].append(
                    {"host_start": started, "host_end": time.perf_counter(), "docs": b - a}
                )

    def traced_timer_end(self, start) -> None:  # noqa: ANN001
        timer_end(self, start)
        if self.cuda:
            TRACE["events"].append(self.score_events[-1])

    engine.run_exhaustive, engine._score_block = traced_run_exhaustive, traced_score_block
    engine._timer_end = traced_timer_end

    pipeline = sys.modules["maxsim_cli.scoring.pipeline"]
    for owner, name in (
        (engine, "_query_slice"), (engine, "_fold_times"), (pipeline.BatchStream, "_copy"),
        (pipeline.BatchStream, "_check_values"), (pipeline.BatchStream, "close"),
    ):  # fmt: skip
        _time_calls(owner, name)

    topk_module = sys.modules["maxsim_cli.scoring.topk"]
    result = topk_module.RunningTopK.result

    def traced_result(self):  # noqa: ANN001, ANN202
        if "start" not in _pass or threading.current_thread() is not threading.main_thread():
            return result(self)  # not the pass's (the kernels' warm-up makes one too)
        _pass.setdefault("loop_end", time.perf_counter())
        if self._keys is not None and self._keys.is_cuda:
            torch.cuda.synchronize(self._keys.device)  # the GPU's remaining work, apart from the result's
            _pass.setdefault("result_synced", time.perf_counter())
        out = result(self)
        _pass.setdefault("result_end", time.perf_counter())
        return out

    topk_module.RunningTopK.result = traced_result
    write_topk = engine_module.write_topk

    def traced_write_topk(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        _pass.setdefault("write_start", time.perf_counter())
        try:
            return write_topk(*args, **kwargs)
        finally:
            _pass["write_end"] = time.perf_counter()

    engine_module.write_topk = traced_write_topk


def _time_calls(owner: type, name: str) -> None:
    """Record when the pass's first call of ``owner.name`` began and ended, and all its calls' seconds."""
    method = getattr(owner, name)
    key = f"{owner.__name__}.{name}"

    def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            ended = time.perf_counter()
            if "start" in _pass and threading.current_thread() is threading.main_thread():
                _pass.setdefault(f"{key}:first_start", started)
                _pass.setdefault(f"{key}:first_end", ended)
                TRACE.setdefault("calls", {}).setdefault(key, []).append(ended - started)

    setattr(owner, name, timed)


class _Hook(importlib.abc.MetaPathFinder):
    """Wraps the engine right after its module is first executed."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        if name != "maxsim_cli.scoring.engine":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_wrap(module) -> None:  # noqa: ANN001
            exec_module(module)
            _wrap_engine(module)

        loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
        return spec


def _write() -> None:
    path = os.environ.get("PASS_TRACE")
    if not path:
        return
    ref = _pass.get("ref")
    gpu = []
    if ref is not None:
        for start, end in TRACE["events"]:
            end.synchronize()
            gpu.append((ref.elapsed_time(start), ref.elapsed_time(end)))
    origin = _pass.get("start", 0.0)
    out = {
        "gc_mode": os.environ.get("PASS_TRACE_GC", ""),
        "pass": {k: v - origin for k, v in _pass.items() if k != "ref"},
        "batches": [
            {
                "host_start_ms": (b["host_start"] - origin) * 1e3,
                "host_end_ms": (b["host_end"] - origin) * 1e3,
                "docs": b["docs"],
            }
            for b in TRACE["batches"]
        ],  # fmt: skip
        "gpu_ms": gpu,
        "gc": [{**g, "at": g["at"] - origin} for g in TRACE["gc"]],
        "calls_ms": {k: [len(v), round(sum(v) * 1e3, 2)] for k, v in TRACE.get("calls", {}).items()},
    }
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(out, fh)


def summarize(trace: dict) -> dict:
    """One run's trace in a few numbers (milliseconds from the pass's start)."""
    import numpy as np

    batches, gpu, passed = trace["batches"], trace["gpu_ms"], trace["pass"]
    out: dict = {k: round(v * 1e3, 2) for k, v in passed.items()}
    if batches:
        starts = np.array([b["host_start_ms"] for b in batches])
        busy = np.array([b["host_end_ms"] - b["host_start_ms"] for b in batches])
        out.update(
            batches=len(batches), first_batch_host_ms=round(float(starts[0]), 2),
            host_cycle_ms_median=round(float(np.median(np.diff(starts))), 3) if len(starts) > 1 else None,
            host_score_block_ms_sum=round(float(busy.sum()), 1),
            host_score_block_ms_median=round(float(np.median(busy)), 3),
        )  # fmt: skip
    if gpu:
        g = np.array(gpu)
        spans, gaps = g[:, 1] - g[:, 0], g[1:, 0] - g[:-1, 1]
        out.update(
            gpu_first_start_ms=round(float(g[0, 0]), 2), gpu_last_end_ms=round(float(g[-1, 1]), 2),
            gpu_spans_ms_sum=round(float(spans.sum()), 1),
            gpu_span_ms_median=round(float(np.median(spans)), 3),
            gpu_gaps_ms_sum=round(float(gaps.sum()), 1) if len(gaps) else 0.0,
        )  # fmt: skip
        if batches and len(batches) == len(gpu):
            lag = g[:, 0] - starts
            out["gpu_lag_ms"] = {q: round(float(np.percentile(lag, q)), 3) for q in (10, 50, 90)}
            tenth = max(len(lag) // 10, 1)
            out["gpu_lag_ms_by_tenth"] = [
                round(float(np.median(lag[i : i + tenth])), 2) for i in range(0, len(lag), tenth)
            ]
    in_pass = [c for c in trace["gc"] if 0 <= c["at"] <= passed.get("result_end", float("inf"))]
    out["gc_in_pass"] = {
        f"gen{n}": [len([c for c in in_pass if c["generation"] == n]),
                    round(sum(c["s"] for c in in_pass if c["generation"] == n) * 1e3, 2)]
        for n in (0, 1, 2)
    }  # fmt: skip
    out["calls_ms"] = trace.get("calls_ms", {})
    out["gc_gen2_whole_ms"] = [round(c["s"] * 1e3, 1) for c in trace["gc"] if c["generation"] == 2]
    return out


if __name__ == "__main__":
    gc.callbacks.append(_on_gc)
    sys.meta_path.insert(0, _Hook())
    atexit.register(_write)  # registered before the command's own handlers: runs after them
    sys.argv[0] = "maxsim"
    runpy.run_module("maxsim_cli", run_name="__main__", alter_sys=True)
