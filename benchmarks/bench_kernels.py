"""The fused MaxSim forward against naive PyTorch and the peers, on the four workloads of BRIEF section 4.

All inputs are fp16, dim 128, L2-normalised random vectors; document lengths uniform in [20, 300]
unless stated; times are `triton.testing.do_bench` medians (a single timed call after one warm-up call
for the slow naive baselines). One run measures, on the same tensors:

  exhaustive  512 queries x 32 tokens against 50K documents (8.0M tokens), all pairs      (tensor cores)
  one_query   1 query x 32 tokens against 100K documents (16M tokens, packed)              (HBM)
  colpali     1 query x 1024 tokens against 1000 documents x 1024 tokens                   (tensor cores)
  rerank      64 queries x 32 tokens, each against its own 1000 candidates of 180 tokens    (HBM)

Methods: `maxsim` (this project: `maxsim_varlen` / `maxsim_candidates` on the packed tensors),
`naive_fp16` / `naive_fp32` (padded einsum, -inf masked amax, sum; chunked over documents to stay under
~10 GB of similarities), `flash_maxsim` 0.3.0 and `lik` (late-interaction-kernels 0.4.5), each through
its own fastest public entry point for the layout (padded where it has no packed path). Reported per
method: median time, TFLOP/s (true FLOPs 2 * Tq * Td * dim, no padding) or TB/s (document bytes read
once) against the measured ceilings (fp16 8192^3 matmul, device copy), peak extra GPU memory, and the
max |score error| against the float64 reference of the same fp16 inputs (on a subset of documents for
`exhaustive`). `--cold` also times each method's first call in a fresh process with an empty
TRITON_CACHE_DIR. `--sweep` times this project's kernel over a grid of tile configurations instead.

    python benchmarks/bench_kernels.py --out benchmarks/results/kernels/kernels-h200.json --cold
    python benchmarks/bench_kernels.py --sweep --out benchmarks/results/kernels/kernels-sweep-h200.json
    python benchmarks/bench_kernels.py --smoke   # CPU, Triton interpreter, tiny sizes: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from common import (
    DIM,
    SMOKE,
    WORKLOADS,
    device,
    flash,
    lik,
    make_log,
    make_workload,
    meta,
    padded_inputs,
    sync,
    time_ms,
    write_json,
)

log = make_log("bench_kernels", clock=True)


# --------------------------------------------------------------------------------------------------
# methods: each returns fn() -> scores ([nq, nd], or [nq, per_q] for rerank), built on the same tensors


def ours(w: dict[str, Any], config: Any = None) -> Callable[[], torch.Tensor]:
    from maxsim_kernels import maxsim_candidates, maxsim_varlen
    from maxsim_kernels.maxsim_forward import maxsim_candidates_forward_triton, maxsim_varlen_forward_triton

    q, qo, d, do = w["queries"], w["q_off"], w["docs"], w["d_off"]
    if w["name"] == "rerank":
        co, cd = w["cand_offsets"], w["cand_docs"].to(device())
        if config is not None:
            return lambda: maxsim_candidates_forward_triton(q, qo, d, do, co, cd, config=config).view(
                w["nq"], -1
            )
        return lambda: maxsim_candidates(q, qo, d, do, co, cd).view(w["nq"], -1)
    if config is not None:
        return lambda: maxsim_varlen_forward_triton(q, qo, d, do, config=config)
    return lambda: maxsim_varlen(q, qo, d, do)


def naive(w: dict[str, Any], dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """Padded einsum in `dtype`, -inf masked amax over document tokens, fp32 sum over query tokens."""
    w = padded_inputs(w)
    qp, dp, mask = w["qp"], w["dp"], w["dmask"]
    budget = 10e9  # bytes of similarities per chunk
    if w["name"] == "rerank":
        per_chunk = max(1, int(budget // (qp.shape[1] * dp.shape[1] * dp.shape[2] * dtype.itemsize)))

        def run_rerank() -> torch.Tensor:
            out = []
            for b0 in range(0, qp.shape[0], per_chunk):
                q, d = qp[b0 : b0 + per_chunk].to(dtype), dp[b0 : b0 + per_chunk].to(dtype)
                sim = torch.einsum("bid,bcjd->bcij", q, d)
                sim = sim.masked_fill(~mask[b0 : b0 + per_chunk, :, None, :], float("-inf"))
                out.append(sim.amax(-1).float().sum(-1))
            return torch.cat(out)

        return run_rerank
    per_chunk = max(1, int(budget // (qp.shape[0] * qp.shape[1] * dp.shape[1] * dtype.itemsize)))
    q = qp.to(dtype)

    def run() -> torch.Tensor:
        out = []
        for n0 in range(0, dp.shape[0], per_chunk):
            sim = torch.einsum("qid,njd->qnij", q, dp[n0 : n0 + per_chunk].to(dtype))
            sim = sim.masked_fill(~mask[None, n0 : n0 + per_chunk, None, :], float("-inf"))
            out.append(sim.amax(-1).float().sum(-1))
        return torch.cat(out, dim=1)

    return run


def flash_splitk(w: dict[str, Any]) -> Callable[[], torch.Tensor]:
    import flash_maxsim as fm

    w = padded_inputs(w)
    return lambda: fm.flash_maxsim(w["queries"], w["dp"], splitk=True)[None]


METHODS: dict[str, Callable[..., Callable[[], torch.Tensor]]] = {
    "maxsim": ours,
    "naive_fp16": lambda w: naive(w, torch.float16),
    "naive_fp32": lambda w: naive(w, torch.float32),
    "flash_maxsim": flash,
    "flash_maxsim_splitk": flash_splitk,
    "lik": lik,
}


def methods_for(name: str) -> list[str]:
    out = ["maxsim", "naive_fp16", "naive_fp32", "flash_maxsim", "lik"]
    if name == "colpali":
        out.insert(4, "flash_maxsim_splitk")
    return out


# --------------------------------------------------------------------------------------------------
# measurement


def reference(w: dict[str, Any]) -> tuple[torch.Tensor, slice]:
    """float64 reference scores of the same fp16 inputs, on a column subset for `exhaustive`."""
    from maxsim_kernels import maxsim_candidates_reference, maxsim_reference

    q, qo, d, do = w["queries"], w["q_off"], w["docs"], w["d_off"]
    if w["name"] == "rerank":
        ref = maxsim_candidates_reference(q, qo, d, do, w["cand_offsets"], w["cand_docs"])
        return ref.view(w["nq"], -1), slice(None)
    cols = slice(0, min(w["nd"], 2000)) if w["name"] == "exhaustive" else slice(None)
    n = cols.stop if cols.stop is not None else w["nd"]
    return maxsim_reference(q, qo, d[: int(do[n])], do[: n + 1]), cols


def peak_extra_bytes(fn: Callable[[], Any]) -> int:
    if not torch.cuda.is_available():
        return 0
    sync()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    sync()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def ceilings() -> dict[str, float]:
    if SMOKE["on"] or not torch.cuda.is_available():
        return {"fp16_matmul_tflops": 675.0, "copy_tbps": 4.22}
    import triton

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    mm = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    cp = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    return {"fp16_matmul_tflops": 2 * 8192**3 / mm / 1e9, "copy_tbps": 2 * 2 * 1024**3 / cp / 1e9}


def measure(
    w: dict[str, Any], method: str, fn: Callable[[], torch.Tensor], ref, cols, ceil
) -> dict[str, Any]:
    slow = method.startswith("naive") and w["name"] in ("exhaustive", "one_query")
    row: dict[str, Any] = {"workload": w["name"], "method": method}
    try:
        out = fn()
        sync()
        err = (out[:, cols].double() - ref).abs().max().item()
        del out
        row["max_abs_err_vs_fp64"] = err
        row["ms"] = time_ms(fn, slow)
        row["peak_extra_gb"] = peak_extra_bytes(fn) / 1e9
    except Exception as exc:  # a peer that fails on a layout is reported, not fatal
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        log(f"{w['name']} {method}: {row['error']}")
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        return row
    if w["name"] in ("exhaustive", "colpali"):
        row["tflops"] = w["flops"] / row["ms"] / 1e9
        row["fraction_of_bound"] = row["tflops"] / ceil["fp16_matmul_tflops"]
    else:
        row["tbps"] = w["bytes"] / row["ms"] / 1e9
        row["fraction_of_bound"] = row["tbps"] / ceil["copy_tbps"]
    log(
        f"{w['name']:>10} {method:>20} {row['ms']:9.3f} ms  err {row['max_abs_err_vs_fp64']:.2e}"
        f"  peak {row['peak_extra_gb']:.2f} GB  bound {row['fraction_of_bound']:.2f}"
    )
    return row


# --------------------------------------------------------------------------------------------------
# cold start: first call in a fresh process with an empty Triton cache


def cold_child(method: str, workloads: list[str]) -> None:
    out = {}
    for name in workloads:
        w = make_workload(name, seed=1)
        try:
            fn = METHODS[method](w)
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            out[name] = time.perf_counter() - t0
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        del w
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(json.dumps(out))


def cold_starts(methods: list[str], workloads: list[str], peer_workloads: list[str]) -> dict[str, Any]:
    results = {}
    for method in methods:
        names = workloads if method == "maxsim" else peer_workloads
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TRITON_CACHE_DIR=cache)
            cmd = [sys.executable, __file__, "--cold-child", method, "--workloads", ",".join(names)]
            if SMOKE["on"]:
                cmd.append("--smoke")
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            try:
                results[method] = json.loads(proc.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                results[method] = {"error": proc.stderr[-500:]}
        log(f"cold start {method}: {results[method]}")
    return results


# --------------------------------------------------------------------------------------------------
# tile sweep of this project's kernel


def sweep_configs(name: str) -> list[Any]:
    from maxsim_kernels.maxsim_forward import KernelConfig as C

    # first entry of each list = the tuning table in force; the rest are its neighbours. A sixth field
    # True = document-major tiles (S^T = D . Q^T, running max per element); a seventh True = running max
    # per element on query-major tiles.
    E = (False, True)
    if name == "exhaustive":
        grid = [(256, 32, 64, 4, 2, *E), (256, 32, 64, 4, 2), (256, 64, 64, 8, 2, *E),
                (256, 32, 64, 4, 3, *E), (128, 64, 64, 4, 3, *E), (256, 64, 64, 8, 3), (256, 32, 64, 4, 3),
                (512, 32, 64, 8, 2), (128, 64, 64, 4, 3)]  # fmt: skip
    elif name == "one_query":
        grid = [(32, 64, 64, 4, 4, True), (32, 64, 16, 4, 4, True), (32, 64, 64, 4, 3, True),
                (32, 64, 32, 4, 4, True), (32, 64, 64, 4, 4), (32, 64, 16, 4, 4)]  # fmt: skip
    elif name == "colpali":
        grid = [(128, 64, 1, 4, 2), (128, 64, 1, 4, 2, *E), (128, 64, 1, 4, 3, *E), (128, 128, 1, 8, 2, *E),
                (128, 64, 1, 4, 3), (128, 64, 1, 4, 2, True), (128, 64, 1, 4, 3, True),
                (256, 64, 1, 8, 2, True), (128, 128, 1, 4, 2, True)]  # fmt: skip
    else:
        grid = [(32, 64, 8, 4, 4, True), (32, 64, 16, 4, 4, True), (32, 64, 8, 4, 3, True),
                (32, 64, 32, 4, 4, True), (32, 64, 8, 4, 4), (32, 64, 16, 4, 4)]  # fmt: skip
    return [C(*entry[:5], *entry[5:7]) for entry in grid]


def sweep_workload(
    w: dict[str, Any], ref: Any, cols: Any, rows: list[dict[str, Any]], quick: bool = True
) -> Any:
    """Time every sweep configuration on `w`; return the fastest one whose scores pass the error check."""
    best, best_ms = None, float("inf")
    limit = 1e-5 * w["lq"] * 4 + 1e-6 * ref.abs().max().item()  # fp32 accumulation bound, see tests
    for cfg in sweep_configs(w["name"]):
        row: dict[str, Any] = {"workload": w["name"], "config": cfg.__dict__}
        try:
            fn = ours(w, cfg)
            out = fn()
            sync()
            row["max_abs_err_vs_fp64"] = (out[:, cols].double() - ref).abs().max().item()
            del out
            row["ms"] = time_ms(fn, slow=False, quick=quick)
            row["passed"] = row["max_abs_err_vs_fp64"] <= limit
            if row["passed"] and row["ms"] < best_ms:
                best, best_ms = cfg, row["ms"]
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        log(f"sweep {w['name']} {cfg}: {row.get('ms', row.get('error'))} passed={row.get('passed')}")
        rows.append(row)
    return best


def run_sweep(workloads: list[str], out_path: str | None) -> None:
    rows: list[dict[str, Any]] = []
    for name in workloads:
        w = make_workload(name)
        ref, cols = reference(w)
        sweep_workload(w, ref, cols, rows, quick=False)
        write_json(out_path, {"sweep": rows, "meta": meta(dtype="float16", dim=DIM)})
        del w
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


# --------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON results here")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    parser.add_argument("--methods", default=None, help="comma-separated subset of methods")
    parser.add_argument(
        "--cold", action="store_true", help="also time first calls with an empty Triton cache"
    )
    parser.add_argument("--sweep", action="store_true", help="tile sweep of this project's kernel only")
    parser.add_argument("--tune", action="store_true", help="sweep first, then measure with the best tiles")
    parser.add_argument("--cold-workloads", default=None, help="workloads for the peers' cold starts")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (Triton interpreter)")
    parser.add_argument("--cold-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    SMOKE["on"] = args.smoke
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    workloads = args.workloads.split(",")
    if args.cold_child:
        cold_child(args.cold_child, workloads)
        return
    if args.sweep:
        run_sweep(workloads, args.out)
        return
    ceil = ceilings()
    log(f"ceilings: {ceil}")
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {"meta": meta(dtype="float16", dim=DIM), "ceilings": ceil, "rows": rows}
    for name in workloads:
        w = make_workload(name)
        ref, cols = reference(w)
        log(f"{name}: nq={w['nq']} lq={w['lq']} nd={w['nd']} Td={w['td']}")
        best = None
        if args.tune:
            best = sweep_workload(w, ref, cols, result.setdefault("sweep", []))
            result.setdefault("tuned", {})[name] = best.__dict__ if best is not None else None
            write_json(args.out, result)
        for method in args.methods.split(",") if args.methods else methods_for(name):
            if method not in methods_for(name):
                continue
            if method == "maxsim" and best is not None:
                # the sweep's winner (then written into the tuning table) and the table in force for this run
                rows.append(measure(w, "maxsim", ours(w, best), ref, cols, ceil) | {"config": best.__dict__})
                rows.append(measure(w, "maxsim_table_default", ours(w), ref, cols, ceil))
            else:
                rows.append(measure(w, method, METHODS[method](w), ref, cols, ceil))
            write_json(args.out, result)
        del w, ref
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.cold:
        cold_methods = [m for m in ("maxsim", "flash_maxsim", "lik") if not args.methods or m in args.methods]
        peer_workloads = args.cold_workloads.split(",") if args.cold_workloads else workloads
        result["cold_start_s"] = cold_starts(cold_methods, workloads, peer_workloads)
        write_json(args.out, result)


if __name__ == "__main__":
    main()
