"""Per-device tuning of the fp16 kernel's HBM-bound shape classes ("few": one query against a corpus;
"cands": per-query candidates), with the peers side by side.

Workloads (`common.make_workload`, BRIEF section 4): one_query = 1 query x 32 tokens against 100K documents of
20-300 tokens (packed); rerank = 64 queries x 32 tokens, each against its own 1000 candidates of 180 tokens,
scattered over the pool and read in place. fp16, d = 128, L2-normalised random vectors.

Two steps in one process on one GPU:
  1. sweep: every configuration of the grid below, its scores compared bit for bit with the table's entry
     in force (a configuration whose scores differ is reported and never chosen), one do_bench median each;
  2. rounds: the entry in force, the sweep's fastest few, flash-maxsim 0.3.0 and late-interaction-kernels
     0.4.5 (when importable), timed in `--rounds` rounds whose order alternates, medians over the rounds.

    python benchmarks/tune_memory_bound.py --out benchmarks/results/kernels/tune-memory-bound-h100.json
    TRITON_INTERPRET=1 python benchmarks/tune_memory_bound.py --smoke    # the script itself, on the CPU
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
from common import SMOKE, device, flash, lik, make_log, make_workload, median_ms, meta, sync, write_json

log = make_log("tune_memory_bound", clock=True)

# workload -> the kernel's shape class
CLASSES = {"one_query": "few", "rerank": "cands"}


def grid(cls: str) -> list[Any]:
    """The configurations swept for a class: document-major tiles of 64-256 tokens (32 lost everywhere on
    the H100), 1-16 documents (or 1-8 candidates) a program, 2 or 4 warps, 2-5 pipeline stages; a few
    query-major tiles."""
    from maxsim_kernels.maxsim_forward import KernelConfig

    per = (1, 2, 4, 8, 16) if cls == "few" else (1, 2, 4, 8)
    out = []
    for block_t, docs, warps, stages in itertools.product((64, 128, 256), per, (2, 4), (2, 3, 4, 5)):
        if block_t == 256 and warps == 2:
            continue  # a 256 x 32 fp32 tile and its running max on 64 threads spill
        out.append(KernelConfig(32, block_t, docs, warps, stages, doc_major=True))
    for docs, warps in itertools.product(per, (2, 4)):
        out.append(KernelConfig(32, 64, docs, warps, 3))
    return out


def ours(w: dict[str, Any], cfg: Any) -> Callable[[], torch.Tensor]:
    from maxsim_kernels.maxsim_forward import maxsim_candidates_forward_triton, maxsim_varlen_forward_triton

    q, qo, d, do = w["queries"], w["q_off"], w["docs"], w["d_off"]
    if w["name"] == "rerank":
        co, cd = w["cand_offsets"], w["cand_docs"].to(device())
        return lambda: maxsim_candidates_forward_triton(q, qo, d, do, co, cd, config=cfg).view(w["nq"], -1)
    return lambda: maxsim_varlen_forward_triton(q, qo, d, do, config=cfg)


def table_entry(w: dict[str, Any]) -> Any:
    """The configuration the launchers pick on this device today."""
    from maxsim_kernels import check_inputs
    from maxsim_kernels import maxsim_forward as mf

    layout = check_inputs(w["queries"], w["q_off"], w["docs"], w["d_off"])
    if w["name"] == "rerank":
        return mf.candidates_config(layout, w["docs"].device)[0]
    return mf.varlen_config(layout, device=w["docs"].device)[1]


def sweep(w: dict[str, Any], rep_ms: int) -> tuple[Any, list[dict[str, Any]]]:
    base_cfg = table_entry(w)
    configs = grid(CLASSES[w["name"]])[: 3 if SMOKE["on"] else None]
    base = ours(w, base_cfg)()
    sync()
    rows = []
    for cfg in configs:
        row: dict[str, Any] = {"workload": w["name"], "config": cfg.__dict__}
        try:
            fn = ours(w, cfg)
            out = fn()
            sync()
            row["bitwise_equal"] = bool(torch.equal(out, base))
            row["ms"] = median_ms(fn, rep_ms)
            row["tb_s"] = w["bytes"] / row["ms"] / 1e9
        except Exception as exc:  # a tile the compiler refuses is recorded, not fatal
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        log(f"sweep {w['name']} {cfg}: {row.get('ms', row.get('error'))} equal={row.get('bitwise_equal')}")
        rows.append(row)
    return base_cfg, rows


def rounds(w: dict[str, Any], base_cfg: Any, rows: list[dict[str, Any]], n_rounds: int, top: int,
           rep_ms: int) -> dict[str, Any]:  # fmt: skip
    from maxsim_kernels.maxsim_forward import KernelConfig

    ok = sorted((r for r in rows if r.get("bitwise_equal")), key=lambda r: r["ms"])
    variants: dict[str, Callable[[], torch.Tensor]] = {"table": ours(w, base_cfg)}
    for i, r in enumerate(ok[:top]):
        variants[f"sweep{i}"] = ours(w, KernelConfig(**r["config"]))
    configs = {"table": base_cfg.__dict__} | {f"sweep{i}": r["config"] for i, r in enumerate(ok[:top])}
    for name, make in (("flash_maxsim", flash), ("lik", lik)):
        try:
            fn = make(w)
            fn()
            variants[name] = fn
        except Exception as exc:  # a peer that is not installed is left out
            log(f"{name}: left out ({type(exc).__name__}: {str(exc)[:120]})")
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(n_rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(median_ms(variants[name], rep_ms))
        log(f"round {r} {w['name']}: " + ", ".join(f"{k} {times[k][-1]:.4f}" for k in names))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"times_ms": times, "median_ms": med, "configs": configs,
            "tb_s": {k: w["bytes"] / v / 1e9 for k, v in med.items()}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--workloads", default="one_query,rerank")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--top", type=int, default=3, help="the sweep's fastest entries timed in the rounds")
    parser.add_argument("--rep-ms", type=int, default=150)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one call each (CPU, interpreter)")
    args = parser.parse_args()
    SMOKE["on"] = args.smoke
    record: dict[str, Any] = {"meta": meta(dtype="float16", dim=128), "workloads": {}}
    for name in args.workloads.split(","):
        w = make_workload(name)
        base_cfg, rows = sweep(w, args.rep_ms)
        result = rounds(w, base_cfg, rows, 1 if args.smoke else args.rounds, args.top, args.rep_ms)
        record["workloads"][name] = {"sweep": rows, **result}
        write_json(args.out, record)
        del w
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for name, res in record["workloads"].items():
        line = ", ".join(f"{k} {v:.4f} ms" for k, v in sorted(res["median_ms"].items(), key=lambda kv: kv[1]))
        print(f"{name}: {line}")
        for k, c in res["configs"].items():
            print(f"  {k}: {c}")


if __name__ == "__main__":
    sys.exit(main())
