"""The torch CPU backend against maxsim-cpu 0.1.0 (Rust, libxsmm) on the same data, on this machine.

Data: 4000 documents of 20-300 tokens (uniform), dim 128, L2-normalised random fp32 vectors (maxsim-cpu
takes fp32 numpy arrays); queries of 32 tokens. Workloads: 1 query x 4000 documents and 64 queries x
4000 documents (maxsim-cpu scores one query per call, so it is called once per query). Each method runs
`--repeats` times, interleaved with the others so that load from other processes hits all alike; the
report gives the best and the median time, documents per second (query-document pairs / s for 64
queries), GFLOP/s (2 * Tq * Td * dim) and the fraction of this machine's fp32 matrix-product rate
(4096^3 `torch.mm`), both as measured at the start of the run and as measured again in every round of
the workload, next to the methods (the best of those rounds): the machine's speed drifts within a run.
maxsim-cpu is optional: `pip install maxsim-cpu==0.1.0`.

    python benchmarks/bench_cpu.py --out benchmarks/results/cpu/cpu-2core.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from maxsim_kernels import maxsim_reference, maxsim_varlen

DIM = 128


def log(msg: str) -> None:
    print(f"[bench_cpu] {msg}", file=sys.stderr, flush=True)


def sgemm_gflops(repeats: int) -> float:
    a, b = torch.randn(4096, 4096), torch.randn(4096, 4096)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * 4096**3 / best / 1e9


def make_methods(
    q_t: torch.Tensor,
    q_off: torch.Tensor,
    docs_t: torch.Tensor,
    d_off: torch.Tensor,
    queries: np.ndarray,
    doc_list: list[np.ndarray],
    maxsim_cpu: Any,
) -> dict[str, Callable[[], np.ndarray]]:
    """Each method scores every query against every document: [nq, nd]."""
    nq = len(q_off) - 1

    def ours() -> np.ndarray:
        return maxsim_varlen(q_t, q_off, docs_t, d_off, backend="torch").numpy()

    def peer() -> np.ndarray:  # one query per call
        return np.stack(
            [maxsim_cpu.maxsim_scores_variable(queries[q_off[i] : q_off[i + 1]], doc_list) for i in range(nq)]
        )

    methods = {"maxsim (torch backend)": ours}
    if maxsim_cpu is not None:
        methods["maxsim-cpu 0.1.0"] = peer
    return methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON results here")
    parser.add_argument("--docs", type=int, default=4000, help="number of documents")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per method and workload")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    lens = rng.integers(20, 301, args.docs)
    offsets = np.zeros(args.docs + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    docs = rng.standard_normal((int(offsets[-1]), DIM), dtype=np.float32)
    docs /= np.linalg.norm(docs, axis=1, keepdims=True)
    doc_list = [docs[offsets[i] : offsets[i + 1]] for i in range(args.docs)]
    docs_t, d_off = torch.from_numpy(docs), torch.from_numpy(offsets)
    try:
        import maxsim_cpu
    except ImportError:
        maxsim_cpu = None
        log("maxsim-cpu is not installed: measuring this project only")

    rows: list[dict[str, Any]] = []
    rate = sgemm_gflops(args.repeats)
    log(f"fp32 matrix product (4096^3): {rate:.0f} GFLOP/s, {torch.get_num_threads()} threads")
    for nq in (1, 64):
        queries = rng.standard_normal((nq * 32, DIM), dtype=np.float32)
        queries /= np.linalg.norm(queries, axis=1, keepdims=True)
        q_t, q_off = torch.from_numpy(queries), torch.arange(nq + 1, dtype=torch.int64) * 32
        methods = make_methods(q_t, q_off, docs_t, d_off, queries, doc_list, maxsim_cpu)
        ref = maxsim_reference(q_t, q_off, docs_t, d_off).numpy()
        times: dict[str, list[float]] = {name: [] for name in methods}
        errors = {name: float(np.abs(fn() - ref).max()) for name, fn in methods.items()}  # also warms up
        sgemm_rates = []  # the matmul rate measured again in every round, next to the methods
        for _ in range(args.repeats):
            sgemm_rates.append(sgemm_gflops(1))
            for name, fn in methods.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        interleaved_rate = max(sgemm_rates)
        log(f"{nq} queries: fp32 matrix product in the same rounds, best {interleaved_rate:.0f} GFLOP/s")
        flops = 2.0 * nq * 32 * int(offsets[-1]) * DIM
        for name in methods:
            best, median = min(times[name]), statistics.median(times[name])
            row = {
                "workload": f"{nq} x {args.docs} docs",
                "method": name,
                "best_s": best,
                "median_s": median,
                "docs_per_s": nq * args.docs / best,
                "gflops": flops / best / 1e9,
                "fraction_of_sgemm": flops / best / 1e9 / rate,
                "sgemm_gflops_same_rounds": interleaved_rate,
                "fraction_of_sgemm_same_rounds": flops / best / 1e9 / interleaved_rate,
                "max_abs_err_vs_fp64": errors[name],
            }
            rows.append(row)
            log(
                f"{row['workload']:>18} {name:>24}: best {best * 1e3:8.1f} ms  median {median * 1e3:8.1f} ms"
                f"  {row['docs_per_s']:9.0f} docs/s  {row['gflops']:6.1f} GFLOP/s"
                f" ({row['fraction_of_sgemm']:.0%} of sgemm at the start,"
                f" {row['fraction_of_sgemm_same_rounds']:.0%} in the same rounds)"
                f"  err {row['max_abs_err_vs_fp64']:.1e}"
            )
    result = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "load_average_1m": os.getloadavg()[0],
            "command": " ".join(["python", "benchmarks/bench_cpu.py", *sys.argv[1:]]),
        },
        "sgemm_gflops": rate,
        "rows": rows,
    }
    if args.out:
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
