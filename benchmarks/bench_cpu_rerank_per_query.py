"""CPU reranks by candidates a query: the query groups (oneDNN's product, a group of one query's candidates)
beside the document units (MKL's batched product, each document once against the queries that list it),
alternating rounds in one process, every result checked bitwise against the first.

    python benchmarks/bench_cpu_rerank_per_query.py \
        --out benchmarks/results/cpu/cpu-rerank-per-query-xeon.json
    python benchmarks/bench_cpu_rerank_per_query.py --smoke --out /tmp/cpu-rerank-per-query.json

A `maxsim score --candidates` run on the CPU scores its candidates a batch of documents at a time, so a
query with 150 candidates has ~9 in each of 16 batches: the per-query count of a call is often small.
Workload: bench_cpu_rerank.py's ``disjoint`` (``--queries`` queries of 32 tokens, each with N candidates of
its own for N in ``--per-query``, 20-300 tokens, dim 128), ``--dtype`` documents. Paths:

  groups   `maxsim_candidates_cpu` through the query groups (where oneDNN gives MKL's bits, as the
           library checks)
  units    the same call through the document units (oneDNN's check answered no)
  library  the same call as the library dispatches it

Times are medians of ``--rounds`` rounds, microseconds a scored pair (wall clock, all workers).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
from bench_cpu_rerank import workload
from common import SMOKE, add_rounds_args, alternating_host_rounds, make_log, meta, write_json
from maxsim_kernels import cpu

log = make_log("cpu-rerank-per-query", clock=True)


def through(groups: bool | None, fn: Callable[[], Any], dim: int) -> Callable[[], Any]:
    """``fn`` with the query groups on (True) or off (False: `cpu._onednn_product` answers no), or as the
    library chooses (None)."""
    onednn = cpu._onednn_product(dim)  # checked once here, not in the timed calls

    def call() -> Any:
        if groups is None:
            return fn()
        minimum = cpu._QUERY_GROUP_MIN_PAIRS
        cpu._ONEDNN_SAME_BITS[dim] = groups and onednn
        cpu._QUERY_GROUP_MIN_PAIRS = 0
        try:
            return fn()
        finally:
            cpu._QUERY_GROUP_MIN_PAIRS = minimum
            cpu._ONEDNN_SAME_BITS[dim] = onednn

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--per-query", default="9,20,32,40,80,150", help="candidates a query, swept")
    parser.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    add_rounds_args(parser, repeats=3, rounds=5)
    args = parser.parse_args()
    if args.smoke:
        SMOKE["on"] = True
        args.queries, args.per_query, args.rounds, args.repeats = 2, "3,8", 1, 1
    args.shared_pool, args.exhaustive_docs = 0, 1
    results: dict[str, Any] = {}
    for n in [int(x) for x in args.per_query.split(",")]:
        args.candidates = n
        w = workload("disjoint", args, getattr(torch, args.dtype), 0)
        dim = w["docs"].shape[1]

        def rerank(w: dict[str, Any] = w) -> torch.Tensor:
            return cpu.maxsim_candidates_cpu(
                w["queries"], w["q_off"], w["docs"], w["d_off"], w["c_off"], w["cand"]
            )

        paths = {name: through(groups, rerank, dim) for name, groups in (("groups", True), ("units", False),
                                                                          ("library", None))}  # fmt: skip
        first = None
        for name, fn in paths.items():  # warm-up and the bits
            out = fn()
            first = out if first is None else first
            assert torch.equal(out, first), f"{n} a query, {name}: other bits"
        ms = alternating_host_rounds(paths, args.rounds, args.repeats, log)
        per_pair = {name: statistics.median(v) * 1e3 / w["pairs"] for name, v in ms.items()}
        results[str(n)] = {name: round(v, 2) for name, v in per_pair.items()}
        log(f"{n} a query: {results[str(n)]} us a pair")
    write_json(args.out, {"meta": meta(workers=cpu._worker_count(), threshold=cpu._QUERY_GROUP_MIN_PAIRS),
                          "dtype": args.dtype, "queries": args.queries, "us_a_pair": results})  # fmt: skip


if __name__ == "__main__":
    main()
