"""CPU reranks whose candidates are dense: each rerank path beside every query scored against every document
the queries list (the exhaustive path's document groups over those documents), by the density of the
candidates (their pairs over the queries x the distinct documents listed), alternating rounds in one
process, every result checked bitwise against the path it is timed beside.

    python benchmarks/bench_cpu_rerank_dense.py --out benchmarks/results/cpu/cpu-rerank-dense.json
    python benchmarks/bench_cpu_rerank_dense.py --smoke --out /tmp/cpu-rerank-dense.json

Workloads: ``--queries`` queries of 32 tokens, each listing ``--candidates`` documents of 20-300 tokens
(uniform) drawn without replacement from a pool of ``candidates / density`` documents (``--densities``),
dim 128, L2-normalised random vectors; ``sample-shape``: 200 queries of 11 tokens x 400 documents of 7-12
tokens at dim 384, each query listing every document (sample_data's shape: a two-stage search whose depth
reaches the corpus); ``--few`` queries each listing all of a pool of ``--candidates`` documents; and 8 and
16 queries listing a quarter and a tenth of that pool (each document listed ~2 times). Float documents as
``--dtypes`` (fp16: the format of `maxsim score`'s shards; fp32), int8 documents with per-token scales.
Each time is the median of ``--repeats`` calls in ``--rounds`` rounds.

  rerank       `maxsim_candidates_cpu` with all pairs off (`cpu.DENSE_CANDIDATES` = inf): its query groups
  all_pairs    the same with all pairs always (the fractions and the sharing at 0)
  int8_torch   `int8_host._candidates_torch`: each query's candidates gathered on the caller's thread (the
               CPU's int8 rerank before the query groups)
  int8_groups  `maxsim_candidates_int8` on the CPU with all pairs off: groups of one query's candidates
  int8_all     the same with all pairs always: every query against every listed document
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
from common import SMOKE, add_cpu_rounds_args, alternating_host_rounds, make_log, meta, offsets_of, write_json

log = make_log("cpu-rerank-dense", clock=True)


def with_dense(always: bool, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run with all pairs always (``always``) or never (`cpu.DENSE_CANDIDATES`, `DENSE_SHARING`), the
    tuned thresholds restored after it."""
    from maxsim_kernels import cpu

    names = ("DENSE_CANDIDATES", "DENSE_SHARING")
    forced = (0.0, 0.0) if always else (float("inf"), 0.0)

    def call() -> Any:
        tuned = [getattr(cpu, name) for name in names]
        for name, value in zip(names, forced, strict=True):
            setattr(cpu, name, value)
        try:
            return fn()
        finally:
            for name, value in zip(names, tuned, strict=True):
                setattr(cpu, name, value)

    return call


def workload(
    nq: int, q_len: int, per_q: int, pool: int, lengths: tuple[int, int], dim: int, seed: int
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    d_off = offsets_of(torch.randint(lengths[0], lengths[1] + 1, (pool,), generator=gen))
    docs = torch.nn.functional.normalize(torch.randn(int(d_off[-1]), dim, generator=gen), dim=1)
    queries = torch.nn.functional.normalize(torch.randn(nq * q_len, dim, generator=gen), dim=1)
    c_docs = torch.cat([torch.randperm(pool, generator=gen)[:per_q] for _ in range(nq)])
    distinct = len(torch.unique(c_docs))
    return {"docs": docs, "d_off": d_off, "queries": queries, "q_off": torch.arange(nq + 1) * q_len,
            "c_off": torch.arange(nq + 1) * per_q, "c_docs": c_docs, "density": nq * per_q / (nq * distinct),
            "pairs": nq * per_q}  # fmt: skip


def run_case(w: dict, dtypes: list[str], args: argparse.Namespace) -> dict:
    from maxsim_kernels import int8_host
    from maxsim_kernels.cpu import maxsim_candidates_cpu

    q, q_off, c_off, c_docs = w["queries"], w["q_off"], w["c_off"], w["c_docs"]
    paths: dict[str, Callable[[], Any]] = {}
    pairs: list[tuple[str, str]] = []  # (path, the path it must equal bit for bit)
    for name in dtypes:
        docs = w["docs"].to(getattr(torch, name))
        queries = q.to(docs.dtype)

        def rerank(docs=docs, queries=queries) -> torch.Tensor:
            return maxsim_candidates_cpu(queries, q_off, docs, w["d_off"], c_off, c_docs)

        paths[f"{name}_rerank"] = with_dense(False, rerank)
        paths[f"{name}_all_pairs"] = with_dense(True, rerank)
        pairs.append((f"{name}_all_pairs", f"{name}_rerank"))
    d8, s8 = int8_host.quantize_per_token(w["docs"])
    q8, sq = int8_host.quantize_per_token(q)

    def int8() -> torch.Tensor:
        return int8_host.maxsim_candidates_int8(q8, q_off, d8, w["d_off"], c_off, c_docs, doc_scales=s8,
                                                query_scales=sq)  # fmt: skip

    def int8_torch() -> torch.Tensor:
        return int8_host._candidates_torch(q8, sq, q_off, d8, s8, w["d_off"], c_off, c_docs, False)[0]

    paths["int8_torch"] = int8_torch
    paths["int8_groups"] = with_dense(False, int8)
    paths["int8_all"] = with_dense(True, int8)
    pairs += [("int8_groups", "int8_torch"), ("int8_all", "int8_torch")]
    results = {name: fn() for name, fn in paths.items()}
    record: dict[str, Any] = {
        "density": w["density"],
        "pairs": w["pairs"],
        "bitwise_equal": {
            a: bool(torch.allclose(results[a], results[b], rtol=0, atol=0, equal_nan=True)) for a, b in pairs
        },  # fmt: skip
    }
    log(f"density {w['density']:.2f}: bitwise equal {record['bitwise_equal']}")
    record["ms"] = alternating_host_rounds(paths, args.rounds, args.repeats, log)
    med = record["median_ms"] = {k: statistics.median(v) for k, v in record["ms"].items()}
    record["speedup_of_all_pairs"] = {a: med[b] / med[a] for a, b in pairs if "all" in a}
    record["speedup_of_int8_groups"] = med["int8_torch"] / med["int8_groups"]
    log(f"density {w['density']:.2f}: medians { {k: round(v, 1) for k, v in med.items()} }")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cpu_rounds_args(parser, docs=0)
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--candidates", type=int, default=1000)
    parser.add_argument("--densities", default="1,0.77,0.5,0.25")
    parser.add_argument("--dtypes", default="float16,float32")
    parser.add_argument("--few", default="1,2,4,8", help="query counts of the cases of fewer queries")
    args = parser.parse_args()
    SMOKE["on"] = args.smoke
    if args.smoke:
        args.repeats, args.rounds, args.queries, args.candidates, args.few = 1, 1, 3, 20, "1,2"
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    record: dict[str, Any] = {"meta": meta(queries=args.queries, candidates=args.candidates), "cases": {}}
    cases = [("sample-shape", workload(200 if not args.smoke else 5, 11, 400 if not args.smoke else 10,
                                       400 if not args.smoke else 10, (7, 12), 384, 0))]  # fmt: skip
    for density in (float(d) for d in args.densities.split(",")):
        pool = round(args.candidates / density)
        cases.append(
            (f"density-{density:g}", workload(args.queries, 32, args.candidates, pool, (20, 300), 128, 1))
        )
    per_q = args.candidates
    for nq in (int(n) for n in args.few.split(",") if n.strip()):  # every query lists the whole pool
        cases.append((f"queries-{nq}", workload(nq, 32, per_q, per_q, (20, 300), 128, 2)))
    for nq, part in ((8, per_q // 4), (16, per_q // 10)):  # each document listed ~2 times
        cases.append((f"queries-{nq}x{part}", workload(nq, 32, part, per_q, (20, 300), 128, 3)))
    for name, w in cases:
        record["cases"][name] = run_case(w, dtypes, args)
        write_json(args.out, record)


if __name__ == "__main__":
    main()
