"""Why is the first `maxsim score` pass of a process slower than the next? (H200 diagnosis)

On the H200 machines the first pass over a 10 GB corpus in a fresh process took 1.15-1.35 s of
scoring-stream time against 0.51-0.53 s for the second, with the staging arena already locked, the
reader ahead of the scoring and the copies at full rate (`docs/benchmarks.md`). This script scores the
same corpus ``--runs`` times in one fresh process and, for each run, records:

- the engine's stats (set-up, pass, read / copy / score times);
- per document batch, the host time the scoring loop spent launching the batch's work and the GPU time
  between the batch's start and end events on the scoring stream (the figure `score_s` sums): a one-time
  stall shows as a few long batches, a slow GPU (clocks ramping up) as a slow start that recovers;
- the SM clock sampled by ``nvidia-smi`` every 20 ms, averaged over the run;
- the CUDA caching allocator's counters (device allocations, frees, retries) as deltas over the run;
- with ``--profile``, a `torch.profiler` table of the first run's host-side calls by self CPU time.

``--warm small`` scores a 32 MB corpus first (as `bench_score.py` does); ``--spin S`` keeps the GPU busy
with matrix products for S seconds right before the first run. Comparing fresh processes with and
without them (and with ``CUDA_MODULE_LOADING=EAGER``) separates a slow GPU from one-time host work.
Corpus: the `score` benchmark's generator (`common.build_corpus`: fp16, d = 128, 20-300 tokens), 512
queries x 32 tokens.

What it found (benchmarks/results/score/first-pass-*.txt): the whole difference sat in the first batch, on the
host (0.66-0.82 s: the process's first Triton launch, see profile_first_launch.py), with the SM clock at
1980 MHz throughout; after a warm-up on a small corpus the first run was as fast as the next, once the
plan no longer split a small corpus's queries into one-query passes (docs/benchmarks.md).

    python benchmarks/profile_first_pass.py --workdir /var/tmp/mb --warm none --runs 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

import numpy as np
import torch
from common import (
    BATCHES,
    batch_report,
    build_corpus,
    build_queries,
    copy_bandwidth,
    instrument_batches,
    read_files,
)

from maxsim_cli.score import score
from maxsim_cli.units import parse_size

COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms")


def counters() -> dict[str, int]:
    stats = torch.cuda.memory_stats()
    return {name: int(stats.get(name, 0)) for name in COUNTERS}


class ClockTrace:
    """``nvidia-smi`` sampling the SM clock every 20 ms in the background, with host timestamps."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "20",
             "-i", str(torch.cuda.current_device())],
            stdout=subprocess.PIPE, text=True, bufsize=1,
        )  # fmt: skip
        self.samples: list[tuple[float, float, float]] = []
        import threading

        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                sm, power = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.perf_counter(), sm, power))

    def window(self, t0: float, t1: float) -> str:
        got = [(sm, p) for t, sm, p in self.samples if t0 <= t <= t1]
        if not got:
            return "no clock samples"
        sm = np.array([g[0] for g in got])
        return (
            f"SM clock over the run: min {sm.min():.0f} / mean {sm.mean():.0f} / max {sm.max():.0f} MHz "
            f"({len(sm)} samples; first five {[int(x) for x in sm[:5]]}); "
            f"power mean {np.mean([g[1] for g in got]):.0f} W"
        )

    def close(self) -> None:
        self.proc.terminate()


def one_run(
    name: str, queries: str, paths: list[str], out: str, clocks: ClockTrace, rows: int, prof: bool
) -> str:
    before = counters()
    start = time.perf_counter()
    if prof:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            stats = score(queries, paths, output=out, log=lambda _m: None, device="cuda")
        table = p.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60
        )
    else:
        stats = score(queries, paths, output=out, log=lambda _m: None, device="cuda")
        table = ""
    end = time.perf_counter()
    delta = {k: v - before[k] for k, v in counters().items()}
    split = {k: round(getattr(stats, k), 3) for k in ("setup_s", "copy_s", "score_s", "wait_s", "write_s")}
    split["arena_ready_s"] = stats.extra.get("arena_ready_s")
    pass_s = stats.wall_s - stats.setup_s - stats.write_s
    return (
        f"===== {name}: engine {stats.wall_s:.3f} s, pass {pass_s:.3f} s {split}\n"
        f"{clocks.window(start, end)}\nallocator deltas: {delta}\n{batch_report()}\n{table}\n"
    )


def spin(seconds: float) -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/var/tmp/mb")
    parser.add_argument("--size", default="10GB")
    parser.add_argument("--warm", choices=("none", "small"), default="none")
    parser.add_argument(
        "--spin", type=float, default=0.0, help="seconds of matrix products before the first run"
    )
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument(
        "--copy-first", action="store_true", help="bench_score.py's pinned copy-bandwidth step first"
    )
    parser.add_argument("--profile", action="store_true", help="torch.profiler table of the first run")
    parser.add_argument("--rows", type=int, default=25, help="rows of the profiler table")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=None, help="append the report here")
    args = parser.parse_args()
    device = torch.device("cuda")
    paths = build_corpus(os.path.join(args.workdir, "corpus"), parse_size(args.size), 512 << 20, device)
    queries = os.path.join(args.workdir, "queries.safetensors")
    build_queries(queries, 512, device)
    small = build_corpus(os.path.join(args.workdir, "small"), 32 << 20, 16 << 20, device, seed=5)
    read_files(paths, os.cpu_count() or 1)  # page cache warm
    if args.copy_first:
        copy_bandwidth(sum(os.path.getsize(p) for p in paths), device)
    instrument_batches()
    clocks = ClockTrace()
    if args.warm == "small":
        score(
            queries, small, output=os.path.join(args.workdir, "warm.trec"), log=lambda _m: None, device="cuda"
        )
        BATCHES.clear()
    if args.spin:
        spin(args.spin)
    time.sleep(0.2)
    loading = os.environ.get("CUDA_MODULE_LOADING", "")
    header = (
        f"######## {args.label} warm={args.warm} spin={args.spin} copy-first={args.copy_first} "
        f"CUDA_MODULE_LOADING={loading}\n"
    )
    report = header + "".join(
        one_run(f"run {i + 1}", queries, paths, os.path.join(args.workdir, f"run{i}.trec"), clocks, args.rows,
                args.profile and i == 0)
        for i in range(args.runs)
    )  # fmt: skip
    clocks.close()
    print(report)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as fh:
            fh.write(report)


if __name__ == "__main__":
    main()
