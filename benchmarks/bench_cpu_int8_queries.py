"""Many queries against int8 documents on the CPU: `maxsim_varlen_int8`'s document groups
(`maxsim_kernels.cpu.maxsim_int8_docs_cpu`, products in integers or on fp32 values) beside the blocked torch
path it replaced (`int8_host._varlen_torch`) and the float path on the same documents, alternating rounds in
one process, every int8 result checked bitwise against the blocked path's.

    python benchmarks/bench_cpu_int8_queries.py --out benchmarks/results/cpu/cpu-int8-queries.json
    python benchmarks/bench_cpu_int8_queries.py --smoke --out /tmp/cpu-int8-queries.json

Documents: ``--docs`` L2-normalised random vectors (d = 128), 20-300 tokens each (uniform), int8 per token
(`quantize_per_token`); ``--queries`` queries of 32 tokens. Each time is the median of ``--repeats`` calls, in
``--rounds`` rounds that alternate the order of the paths.

  fp32           `maxsim_varlen` on the float tokens (the float path's document groups)
  int8           `maxsim_varlen_int8`: the document groups, products in integers (`torch._int_mm`)
  int8_fp32      the same, the int8 values multiplied as fp32 (where the CPU has no int8 dot products)
  int8_blocked   `int8_host._varlen_torch`: blocks of documents in order on the caller's thread
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import (
    SMOKE,
    add_cpu_rounds_args,
    alternating_host_rounds,
    cpu_int8_products,
    make_log,
    meta,
    offsets_of,
    smoke_size,
    write_json,
)

log = make_log("cpu-int8-queries", clock=True)


def main() -> None:
    from maxsim_kernels import cpu, int8_host, maxsim_varlen
    from maxsim_kernels.int8_host import quantize_per_token

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cpu_rounds_args(parser, docs=4000)
    parser.add_argument("--queries", type=int, default=64)
    args = parser.parse_args()
    SMOKE["on"] = args.smoke
    n, nq = smoke_size(args.docs, 20), smoke_size(args.queries, 5)
    if args.smoke:
        args.repeats, args.rounds = 1, 1
    gen = torch.Generator().manual_seed(0)
    offsets = offsets_of(torch.randint(20, 301, (n,), generator=gen))
    x = torch.nn.functional.normalize(torch.randn(int(offsets[-1]), 128, generator=gen), dim=1)
    q = torch.nn.functional.normalize(torch.randn(32 * nq, 128, generator=gen), dim=1)
    q_off = torch.arange(0, 32 * nq + 1, 32)
    q8, sq = quantize_per_token(q)
    d8, s8 = quantize_per_token(x)

    def int8() -> torch.Tensor:
        return int8_host.maxsim_varlen_int8(q8, q_off, d8, offsets, doc_scales=s8, query_scales=sq)

    paths = {
        "fp32": lambda: maxsim_varlen(q, q_off, x, offsets),
        "int8": cpu_int8_products(True, int8),
        "int8_fp32": cpu_int8_products(False, int8),
        "int8_blocked": lambda: int8_host._varlen_torch(q8, sq, q_off, d8, s8, offsets, False)[0],
    }
    record: dict = {"meta": meta(docs=n, tokens=int(offsets[-1]), dim=128, queries=nq, query_tokens=32)}
    results = {name: fn() for name, fn in paths.items()}
    record["bitwise_equal"] = {
        way: bool(torch.equal(results[way], results["int8_blocked"])) for way in ("int8", "int8_fp32")
    }
    log(f"bitwise equal to the blocked path: {record['bitwise_equal']}")
    record["ms"] = alternating_host_rounds(paths, args.rounds, args.repeats, log)
    med = record["median_ms"] = {k: statistics.median(v) for k, v in record["ms"].items()}
    record["over_blocked"] = {k: med["int8_blocked"] / med[k] for k in ("int8", "int8_fp32")}
    record["over_fp32"] = {k: med[k] / med["fp32"] for k in ("int8", "int8_fp32", "int8_blocked")}
    record["int8_products_chosen"] = cpu.int8_products(128)
    log(f"medians: { {k: round(v, 1) for k, v in med.items()} }")
    write_json(args.out, record)


if __name__ == "__main__":
    main()
