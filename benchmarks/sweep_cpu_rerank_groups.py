"""The CPU rerank's group budget (`cpu._QUERY_GROUP_BYTES`: a group of one query's candidates, its padded
block and similarities within the budget, is one product) swept on this machine, beside the exhaustive
path's time a pair and the rerank with MKL's product in place of oneDNN's, alternating rounds in one
process, every rerank checked bitwise against the first.

    python benchmarks/sweep_cpu_rerank_groups.py --out benchmarks/results/cpu/cpu-rerank-groups.json
    python benchmarks/sweep_cpu_rerank_groups.py --smoke --out /tmp/cpu-rerank-groups.json

Workload: bench_cpu_rerank.py's ``disjoint`` (``--queries`` queries of 32 tokens, each with ``--candidates``
documents of its own, 20-300 tokens, dim 128, in random order), fp16 documents (``--dtype``: fp16, fp32,
or int8 documents with per-token scales, scored by `maxsim_candidates_int8`'s CPU query groups). Paths:

  budget_<MiB>   `maxsim_candidates_cpu` with that group budget (the library's own is marked in the JSON)
  mkl_<MiB>      the same at the library's budget with MKL's product (`cpu._similarities`) in place of
                 oneDNN's (the same bits where the library takes oneDNN's; float documents)
  exhaustive     `maxsim_varlen_cpu` (int8: `maxsim_varlen_int8`): every query against the first
                 ``--exhaustive-docs`` documents

Each time is the median of ``--repeats`` calls a round, in microseconds a scored pair (the wall clock over
the pairs: all workers together).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
from bench_cpu_rerank import workload
from common import SMOKE, add_rounds_args, alternating_host_rounds, make_log, meta, write_json
from maxsim_kernels import cpu, int8_host

log = make_log("cpu-rerank-groups", clock=True)


def with_group_budget(budget: int, fn: Callable[[], Any], mkl: bool = False) -> Callable[[], Any]:
    """``fn`` run with the rerank's group budget at ``budget`` bytes (and MKL's product with ``mkl``), the
    library's own restored after it."""

    def call() -> Any:
        own, linear = cpu._QUERY_GROUP_BYTES, cpu._onednn_linear
        cpu._QUERY_GROUP_BYTES = budget
        if mkl:
            cpu._onednn_linear = lambda block, weight: cpu._similarities(block, weight.T.contiguous())
        try:
            return fn()
        finally:
            cpu._QUERY_GROUP_BYTES, cpu._onednn_linear = own, linear

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--candidates", type=int, default=1000)
    parser.add_argument("--exhaustive-docs", type=int, default=2000)
    parser.add_argument("--dtype", default="float16", choices=["float16", "float32", "int8"])
    parser.add_argument("--budgets", default="1,2,4,8,16,32", help="group budgets swept, MiB")
    add_rounds_args(parser, repeats=1, rounds=5)
    args = parser.parse_args()
    if args.smoke:
        SMOKE["on"] = True
        args.queries, args.candidates, args.exhaustive_docs, args.rounds, args.budgets = 2, 20, 10, 1, "1,4"
    args.shared_pool = 0
    int8 = args.dtype == "int8"
    w = workload("disjoint", args, torch.float16 if int8 else getattr(torch, args.dtype), 0)
    own = cpu._QUERY_GROUP_BYTES
    q, q_off, c_off, cand = w["queries"], w["q_off"], w["c_off"], w["cand"]
    if int8:
        d8, s8 = int8_host.quantize_per_token(w["docs"])
        exh_tokens = w["exh_docs_t"].shape[0]

        def rerank() -> torch.Tensor:
            return int8_host.maxsim_candidates_int8(q, q_off, d8, w["d_off"], c_off, cand, doc_scales=s8)

        def exhaustive() -> torch.Tensor:
            return int8_host.maxsim_varlen_int8(
                q, q_off, d8[:exh_tokens], w["exh_d_off"], doc_scales=s8[:exh_tokens]
            )
    else:

        def rerank() -> torch.Tensor:
            return cpu.maxsim_candidates_cpu(q, q_off, w["docs"], w["d_off"], c_off, cand)

        def exhaustive() -> torch.Tensor:
            return cpu.maxsim_varlen_cpu(q, q_off, w["exh_docs_t"], w["exh_d_off"])

    budgets = [int(float(b) * (1 << 20)) for b in args.budgets.split(",")]
    paths: dict[str, Callable[[], Any]] = {
        f"budget_{b / (1 << 20):g}": with_group_budget(b, rerank) for b in budgets
    }
    if not int8:
        paths[f"mkl_{own / (1 << 20):g}"] = with_group_budget(own, rerank, mkl=True)
    paths["exhaustive"] = exhaustive
    first = None
    for name, fn in paths.items():  # warm-up (oneDNN's primitives for each shape) and the bits
        out = fn()
        if name != "exhaustive":
            first = out if first is None else first
            assert torch.equal(out, first), f"{name}: other bits"
    ms = alternating_host_rounds(paths, args.rounds, args.repeats, log)
    per_pair = {
        name: [
            t * 1e3 / (w["pairs"] if name != "exhaustive" else args.queries * w["exh_docs"]) for t in times
        ]
        for name, times in ms.items()
    }
    results = {name: {"us_a_pair": round(statistics.median(v), 2), "rounds": [round(x, 2) for x in v]}
               for name, v in per_pair.items()}  # fmt: skip
    for name, r in results.items():
        log(f"{name}: {r['us_a_pair']} us a pair")
    record = {
        "meta": meta(
            library_budget_mib=own / (1 << 20), workers=cpu._worker_count(), onednn=cpu._onednn_product(128)
        ),
        "workload": {
            "queries": args.queries,
            "candidates": args.candidates,
            "dtype": args.dtype,
            "cand_tokens": w["cand_tokens"],
            "exhaustive_docs": w["exh_docs"],
        },  # fmt: skip
        "paths": results,
    }
    write_json(args.out, record)


if __name__ == "__main__":
    main()
