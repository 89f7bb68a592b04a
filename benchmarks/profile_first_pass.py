"""Why is the first `maxsim score` pass of a process slower than the next? (H200 diagnosis)

On the H200 machines the first pass over a 10 GB corpus in a fresh process took 1.15-1.35 s of
scoring-stream time against 0.51-0.53 s for the second, with the staging arena already locked, the
reader ahead of the scoring and the copies at full rate (`docs/benchmarks.md`). This script scores the
same corpus twice in one fresh process, after a warm-up on a small corpus, and for each run records:

- the engine's stats (set-up, pass, read / copy / score times);
- the CUDA caching allocator's counters (`torch.cuda.memory_stats`: device allocations and frees,
  retries) as deltas over the run: a first pass that calls cudaMalloc where the second reuses blocks
  shows here;
- a `torch.profiler` table of the run's host-side CUDA API calls and operators by self CPU time
  (cudaMalloc, module loading, launches, synchronisations), to compare the two runs line by line.

Corpus: `bench_score.py`'s generator (fp16, d = 128, 20-300 tokens), 512 queries x 32 tokens.

    python benchmarks/profile_first_pass.py --workdir /var/tmp/mb --out first-pass-h200.txt
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_score  # noqa: E402

from maxsim_cli.units import parse_size  # noqa: E402

COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms")


def counters() -> dict[str, int]:
    stats = torch.cuda.memory_stats()
    return {name: int(stats.get(name, 0)) for name in COUNTERS}


def profiled_run(name: str, queries: str, paths: list[str], out: str, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    before = counters()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        stats = bench_score.score(queries, paths, output=out, log=lambda _m: None, device="cuda")
    wall = time.perf_counter() - start
    after = counters()
    delta = {k: after[k] - before[k] for k in COUNTERS}
    split = {k: round(getattr(stats, k), 3) for k in ("setup_s", "read_s", "copy_s", "score_s", "wait_s")}
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)
    pass_s = stats.wall_s - stats.setup_s - stats.write_s
    return (
        f"===== {name}: wall {wall:.3f} s (engine {stats.wall_s:.3f} s, pass {pass_s:.3f} s) {split}\n"
        f"allocator deltas: {delta}\n{table}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/var/tmp/mb")
    parser.add_argument("--size", default="10GB")
    parser.add_argument("--rows", type=int, default=25, help="rows of each profiler table")
    parser.add_argument("--out", default=None, help="also write the report here")
    args = parser.parse_args()
    device = torch.device("cuda")
    paths = bench_score.build_corpus(
        os.path.join(args.workdir, "corpus"), parse_size(args.size), 512 << 20, device
    )
    queries = os.path.join(args.workdir, "queries.safetensors")
    bench_score.build_queries(queries, 512, device)
    small = bench_score.build_corpus(os.path.join(args.workdir, "small"), 32 << 20, 16 << 20, device, seed=5)
    bench_score.read_files(paths, os.cpu_count() or 1)  # page cache warm
    quiet = lambda _m: None  # noqa: E731
    bench_score.score(
        queries, small, output=os.path.join(args.workdir, "warm.trec"), log=quiet, device="cuda"
    )
    report = "".join(
        profiled_run(name, queries, paths, os.path.join(args.workdir, f"{name}.trec"), args.rows)
        for name in ("first", "second")
    )
    print(report)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(report)


if __name__ == "__main__":
    main()
