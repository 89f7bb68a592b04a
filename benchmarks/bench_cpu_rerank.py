"""CPU rerank: `maxsim_candidates_cpu` against the paths it replaced and against the exhaustive CPU path,
per scored (query, document) pair, on this machine.

Workloads (fp32 by default, as `bench_cpu.py`; ``--dtype float16`` for the corpus format of `maxsim
score`): `--queries` queries of 32 tokens, each with `--candidates` candidates among documents of 20-300
tokens (uniform), dim 128, L2-normalised random vectors.

- ``disjoint``: a pool of queries x candidates documents, each the candidate of exactly one query, in
  random order (the BRIEF's rerank shape, ragged): every pair reads its own document from memory;
- ``shared``: a pool of `--shared-pool` documents, each query's candidates drawn from it without
  replacement (~queries x candidates / pool queries list each document).

Methods, timed in turn within each round (`--repeats` rounds, the order reversed every other round), so
that load from other processes hits all alike: ``old loop`` (the per-query loop of e934bbd, copied
below), ``document units`` (the library's MKL path, which scored every rerank from 0317f1c on and still
does where oneDNN's product is missing or gives other bits), ``batched`` (the library's
`maxsim_candidates_cpu` as it runs here: query groups through oneDNN) and ``exhaustive``
(`maxsim_varlen_cpu`: every query against the first `--exhaustive-docs` documents of the same pool).
Each is reported per pair (median and best over the rounds) and in GFLOP/s (2 * q_len * d_len * dim per
pair); the ratios are medians of the per-round ratios. Every round also measures the 4096^3 fp32 matrix
product (MKL through torch.mm, the rate the exhaustive path runs at): a round whose rate is below 80% of
the best counts as loaded, and the ratios are also given over the other rounds. The machine's rates,
measured at the start: that product, the rerank's product shape, a read of 2 GiB from memory, and
oneDNN's fp32 product. ``--profile`` adds where a ``batched`` pair's time goes: the phases of its groups
timed one by one on one thread (`profile_phases`).

    python benchmarks/bench_cpu_rerank.py --profile --out benchmarks/results/cpu/cpu-rerank-2core.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from common import DIM, MAX_LEN, MIN_LEN, QUERY_TOKENS, make_log, meta, offsets_of, write_json
from maxsim_kernels import cpu, maxsim_candidates_reference
from maxsim_kernels.cpu import _compute_dtype, _score_docs, maxsim_candidates_cpu, maxsim_varlen_cpu
from maxsim_kernels.validation import Layout, check_candidates, check_inputs

log = make_log("bench_cpu_rerank")


def old_candidates_cpu(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor,
    candidate_docs: torch.Tensor,
    *,
    return_argmax: bool = False,
    doc_scales: torch.Tensor | None = None,
    layout: Layout | None = None,
    check_finite: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`maxsim_candidates_cpu` as of commit e934bbd: one blocked problem per query, in a Python loop."""
    if layout is None:
        layout = check_inputs(
            queries, query_offsets, docs, doc_offsets, doc_scales=doc_scales, allow_float64=True
        )
    c_off, c_docs = check_candidates(candidate_offsets, candidate_docs, layout.num_queries, layout.num_docs)
    compute = _compute_dtype(queries)
    out_dtype = torch.float64 if compute == torch.float64 else torch.float32
    num_c = len(c_docs)
    device = docs.device
    scores = torch.zeros(num_c, dtype=out_dtype, device=device)
    argmax = (
        torch.full((num_c, layout.max_query_len), -1, dtype=torch.int32, device=device)
        if return_argmax
        else None
    )
    starts_all = layout.d_offsets[:-1]
    for i in range(layout.num_queries):
        c0, c1 = int(c_off[i]), int(c_off[i + 1])
        if c0 == c1:
            continue
        q0, q1 = int(layout.q_offsets[i]), int(layout.q_offsets[i + 1])
        picked = c_docs[c0:c1]
        row_scores = torch.zeros(1, c1 - c0, dtype=out_dtype, device=device)
        row_argmax = (
            torch.full((q1 - q0, c1 - c0), -1, dtype=torch.int32, device=device) if return_argmax else None
        )
        _score_docs(
            queries[q0:q1].to(compute).contiguous(),
            torch.zeros(q1 - q0, dtype=torch.int64, device=device),
            1,
            docs,
            doc_scales,
            starts_all[picked],
            layout.d_lens[picked],
            row_scores,
            row_argmax,
            check_finite,
        )
        scores[c0:c1] = row_scores[0]
        if argmax is not None:
            argmax[c0:c1, : q1 - q0] = row_argmax.T
    return (scores, argmax) if return_argmax else scores


def document_units_cpu(*args: torch.Tensor) -> torch.Tensor:
    """`maxsim_candidates_cpu` through its MKL document units, as if oneDNN's product gave other bits."""
    saved = dict(cpu._ONEDNN_SAME_BITS)
    cpu._ONEDNN_SAME_BITS[int(args[0].shape[1])] = False
    try:
        return maxsim_candidates_cpu(*args)
    finally:
        cpu._ONEDNN_SAME_BITS.clear()
        cpu._ONEDNN_SAME_BITS.update(saved)


def profile_phases(w: dict[str, Any], limit_pairs: int = 16000) -> dict[str, Any]:
    """The groups of the library's query path (`cpu._query_groups`, the first `limit_pairs` pairs), each
    phase of `cpu._score_query_group` timed on its own on one thread: the gather of the documents' rows
    (with the upcast), the product, the max over each document's rows and the sum over query tokens.
    Seconds a pair for one core; divide by the cores for the wall time of a call."""
    queries, q_off, docs, d_off, c_off, cand = (
        w[k] for k in ("queries", "q_off", "docs", "d_off", "c_off", "cand")
    )
    layout = check_inputs(queries, q_off, docs, d_off)
    c_off_np, c_docs = check_candidates(c_off, cand, layout.num_queries, layout.num_docs)
    pair_query = np.repeat(np.arange(layout.num_queries), np.diff(c_off_np))[:limit_pairs]
    pair_doc = c_docs[:limit_pairs]
    w_cols = -(-layout.q_lens // cpu._ONEDNN_COLS) * cpu._ONEDNN_COLS
    assert bool((w_cols == layout.q_lens).all()), "queries of a multiple of 16 tokens"
    weights = queries.float()
    order = np.lexsort((pair_doc, layout.d_lens[pair_doc], pair_query))
    s_query, s_doc = pair_query[order], pair_doc[order]
    s_len = layout.d_lens[s_doc]
    s_start = layout.d_offsets[:-1][s_doc]
    pair_bytes = s_len.astype(np.int64) * (layout.dim + w_cols[s_query]) * 4
    spans = cpu._query_groups(s_query, pair_bytes, cpu._QUERY_GROUP_BYTES)
    phases = dict.fromkeys(("gather", "product", "max", "sum"), 0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for p0, p1 in spans:
            i = int(s_query[p0])
            weight = weights[int(layout.q_offsets[i]) : int(layout.q_offsets[i + 1])]
            lens = s_len[p0:p1]
            n, width = p1 - p0, int(lens[-1])
            m = n * width
            t0 = time.perf_counter()
            rows = torch.from_numpy(
                (s_start[p0:p1, None] + np.minimum(np.arange(width), lens[:, None] - 1)).reshape(-1)
            )
            block = cpu.thread_buffer(
                "rerank_block", (-(-m // cpu._ONEDNN_ROWS) * cpu._ONEDNN_ROWS, DIM), torch.float32
            )
            if docs.dtype == torch.float32:
                torch.index_select(docs, 0, rows, out=block[:m])
            else:
                block[:m].copy_(docs.index_select(0, rows))
            block[m:].zero_()
            t1 = time.perf_counter()
            sim = cpu._onednn_linear(block, weight)[:m].view(n, width, -1)
            t2 = time.perf_counter()
            best = torch.amax(sim, dim=1)
            t3 = time.perf_counter()
            torch.zeros(n, 1).index_add_(1, torch.zeros(best.shape[1], dtype=torch.int64), best)
            t4 = time.perf_counter()
            for name, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                phases[name] += dt
    finally:
        torch.set_num_threads(threads)
    pairs = len(order)
    return {
        "pairs": pairs,
        "groups": len(spans),
        "group_bytes": cpu._QUERY_GROUP_BYTES,
        "us_per_pair_one_core": {name: dt / pairs * 1e6 for name, dt in phases.items()},
    }


# --------------------------------------------------------------------------------------------------
# inputs


def unit_vectors(n: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """n L2-normalised random vectors of DIM, made in chunks (bounded fp32 temporaries)."""
    out = torch.empty(n, DIM, dtype=dtype)
    for a in range(0, n, 1 << 20):
        b = min(n, a + (1 << 20))
        out[a:b] = torch.nn.functional.normalize(torch.randn(b - a, DIM, generator=gen), dim=1)
    return out


def workload(name: str, args: argparse.Namespace, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    nq, per_q = args.queries, args.candidates
    pool = nq * per_q if name == "disjoint" else args.shared_pool
    d_lens = torch.randint(MIN_LEN, MAX_LEN + 1, (pool,), generator=gen)
    d_off = offsets_of(d_lens)
    docs = unit_vectors(int(d_off[-1]), gen, dtype)
    queries = unit_vectors(nq * QUERY_TOKENS, gen, dtype)
    q_off = torch.arange(nq + 1, dtype=torch.int64) * QUERY_TOKENS
    if name == "disjoint":
        cand = torch.randperm(pool, generator=gen)
    else:
        cand = torch.cat([torch.randperm(pool, generator=gen)[:per_q] for _ in range(nq)])
    c_off = torch.arange(nq + 1, dtype=torch.int64) * per_q
    n_exh = min(args.exhaustive_docs, pool)
    lens = d_lens.numpy()
    distinct = np.unique(cand.numpy())
    return {
        "name": name,
        "queries": queries,
        "q_off": q_off,
        "docs": docs,
        "d_off": d_off,
        "cand": cand,
        "c_off": c_off,
        "pairs": nq * per_q,
        "pool": pool,
        "exh_docs": n_exh,
        "exh_d_off": d_off[: n_exh + 1],
        "exh_docs_t": docs[: int(d_off[n_exh])],
        "flops": 2.0 * QUERY_TOKENS * DIM * float(lens[cand.numpy()].sum()),
        "exh_flops": 2.0 * QUERY_TOKENS * DIM * nq * float(lens[:n_exh].sum()),
        "cand_tokens": int(lens[cand.numpy()].sum()),
        "distinct_docs": len(distinct),
        "distinct_tokens": int(lens[distinct].sum()),
    }


# --------------------------------------------------------------------------------------------------
# machine rates


def best_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def sgemm_gflops(repeats: int = 1) -> float:
    a, b = torch.randn(4096, 4096), torch.randn(4096, 4096)
    return 2 * 4096**3 / best_time(lambda: a @ b, repeats) / 1e9


def machine_rates(repeats: int) -> dict[str, float | None]:
    rates: dict[str, float | None] = {"sgemm_4096_gflops": sgemm_gflops(repeats)}
    a, b = torch.randn(16384, DIM), torch.randn(DIM, QUERY_TOKENS)
    rates["sgemm_16384x128x32_gflops"] = 2 * 16384 * DIM * QUERY_TOKENS / best_time(lambda: a @ b, 20) / 1e9
    big = torch.ones(1 << 29)  # 2 GiB
    rates["memory_read_gb_s"] = big.numel() * 4 / best_time(big.sum, repeats) / 1e9
    del big
    try:  # oneDNN's fp32 product (its AVX-512 kernels): what these cores can do in fp32
        linear = torch.ops.mkldnn._linear_pointwise
        x, w = torch.randn(4096, 4096), torch.randn(4096, 4096)
        t = best_time(lambda: linear(x, w, None, "none", [], ""), repeats)
        rates["onednn_fp32_4096_gflops"] = 2 * 4096**3 / t / 1e9
    except (AttributeError, RuntimeError):
        rates["onednn_fp32_4096_gflops"] = None
    return rates


# --------------------------------------------------------------------------------------------------


def run(w: dict[str, Any], repeats: int, profile: bool) -> dict[str, Any]:
    args = (w["queries"], w["q_off"], w["docs"], w["d_off"], w["c_off"], w["cand"])
    methods: dict[str, tuple[Callable[[], Any], int, float]] = {
        "old loop": (lambda: old_candidates_cpu(*args), w["pairs"], w["flops"]),
        "document units": (lambda: document_units_cpu(*args), w["pairs"], w["flops"]),
        "batched": (lambda: maxsim_candidates_cpu(*args), w["pairs"], w["flops"]),
        "exhaustive": (
            lambda: maxsim_varlen_cpu(w["queries"], w["q_off"], w["exh_docs_t"], w["exh_d_off"]),
            (len(w["q_off"]) - 1) * w["exh_docs"],
            w["exh_flops"],
        ),
    }
    # exactness (also the warm-up): the batched scores are bitwise those of the old loop, of the document
    # units and of the exhaustive path (for the pairs it scores); all against the float64 reference
    new, old, units = maxsim_candidates_cpu(*args), old_candidates_cpu(*args), document_units_cpu(*args)
    ref = maxsim_candidates_reference(*args)
    exh = maxsim_varlen_cpu(w["queries"], w["q_off"], w["exh_docs_t"], w["exh_d_off"])
    pair_query = torch.repeat_interleave(torch.arange(len(w["q_off"]) - 1), torch.diff(w["c_off"]))
    in_exh = w["cand"] < w["exh_docs"]
    check = {
        "batched_uses_onednn": cpu._onednn_product(DIM),
        "batched_equals_old_loop_bitwise": bool(torch.equal(new, old)),
        "batched_equals_document_units_bitwise": bool(torch.equal(new, units)),
        "batched_equals_exhaustive_bitwise": bool(
            torch.equal(new[in_exh], exh[pair_query[in_exh], w["cand"][in_exh]])
        ),
        "pairs_compared_with_exhaustive": int(in_exh.sum()),
        "max_abs_err_vs_fp64": float((new.double() - ref).abs().max()),
        "max_rel_err_vs_fp64": float(((new.double() - ref).abs() / ref.abs().clamp_min(1e-30)).max()),
    }
    log(f"{w['name']}: {check}")
    methods["exhaustive"][0]()
    times: dict[str, list[float]] = {name: [] for name in methods}
    sgemm_rounds = []
    for r in range(repeats):
        sgemm_rounds.append(sgemm_gflops())
        order = list(methods) if r % 2 == 0 else list(reversed(methods))
        for name in order:
            fn, pairs, _ = methods[name]
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) / pairs)
        log(
            f"{w['name']} round {r}: sgemm {sgemm_rounds[-1]:.0f} GFLOP/s, "
            + ", ".join(f"{n} {times[n][-1] * 1e6:.2f} us/pair" for n in methods)
        )
    quiet = [r for r in range(repeats) if sgemm_rounds[r] >= 0.8 * max(sgemm_rounds)]

    def ratio(a: str, b: str, rounds: list[int]) -> float | None:
        return statistics.median(times[a][r] / times[b][r] for r in rounds) if rounds else None

    rows = []
    for name, (_, pairs, flops) in methods.items():
        med, best = statistics.median(times[name]), min(times[name])
        rows.append(
            {
                "method": name,
                "pairs": pairs,
                "us_per_pair_median": med * 1e6,
                "us_per_pair_best": best * 1e6,
                "us_per_pair_median_quiet": statistics.median(times[name][r] for r in quiet) * 1e6,
                "gflops_median": flops / (med * pairs) / 1e9,
                "gflops_best": flops / (best * pairs) / 1e9,
                "seconds": times[name],
            }
        )
    return {
        "workload": w["name"],
        "queries": len(w["q_off"]) - 1,
        "pairs": w["pairs"],
        "pool_docs": w["pool"],
        "distinct_candidate_docs": w["distinct_docs"],
        "exhaustive_docs": w["exh_docs"],
        "flops": w["flops"],
        "candidate_bytes": w["cand_tokens"] * DIM * w["docs"].element_size(),
        "distinct_candidate_bytes": w["distinct_tokens"] * DIM * w["docs"].element_size(),
        "check": check,
        "sgemm_gflops_rounds": sgemm_rounds,
        "quiet_rounds": quiet,
        "ratio_batched_to_exhaustive": ratio("batched", "exhaustive", list(range(repeats))),
        "ratio_batched_to_exhaustive_quiet": ratio("batched", "exhaustive", quiet),
        "ratio_old_to_exhaustive": ratio("old loop", "exhaustive", list(range(repeats))),
        "ratio_old_to_exhaustive_quiet": ratio("old loop", "exhaustive", quiet),
        "speedup_batched_over_old": ratio("old loop", "batched", list(range(repeats))),
        "speedup_batched_over_old_quiet": ratio("old loop", "batched", quiet),
        "ratio_document_units_to_exhaustive": ratio("document units", "exhaustive", list(range(repeats))),
        "ratio_document_units_to_exhaustive_quiet": ratio("document units", "exhaustive", quiet),
        "profile": profile_phases(w) if profile else None,
        "rows": rows,
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON results here")
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--candidates", type=int, default=1000, help="candidates per query")
    parser.add_argument("--shared-pool", type=int, default=8000, help="documents of the shared workload")
    parser.add_argument("--exhaustive-docs", type=int, default=2000, help="documents of the exhaustive path")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    parser.add_argument("--workloads", default="disjoint,shared")
    parser.add_argument("--repeats", type=int, default=9, help="rounds (each method once per round)")
    parser.add_argument(
        "--profile", action="store_true", help="also time the phases of the batched path on one thread"
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    load_before = os.getloadavg()
    rates = machine_rates(3)
    log(f"machine: {rates}, {torch.get_num_threads()} threads, load {load_before}")
    results = []
    for i, name in enumerate(args.workloads.split(",")):
        w = workload(name, args, dtype, seed=i)
        log(
            f"{name}: {w['pairs']} pairs, {w['distinct_docs']} distinct documents "
            f"({w['distinct_tokens'] * DIM * w['docs'].element_size() / 1e9:.2f} GB), "
            f"{w['flops'] / 1e9:.1f} GFLOP"
        )
        results.append(run(w, args.repeats, args.profile))
        res = results[-1]
        for row in res["rows"]:
            log(
                f"{name:>9} {row['method']:>26}: median {row['us_per_pair_median']:6.2f} us/pair "
                f"(best {row['us_per_pair_best']:6.2f}), {row['gflops_median']:6.1f} GFLOP/s"
            )
        log(
            f"{name}: batched / exhaustive {res['ratio_batched_to_exhaustive']:.2f} "
            f"(quiet rounds {res['ratio_batched_to_exhaustive_quiet']:.2f}), document units / exhaustive "
            f"{res['ratio_document_units_to_exhaustive']:.2f}, old loop / batched "
            f"{res['speedup_batched_over_old']:.2f}"
        )
        if res["profile"]:
            log(f"{name}: phases on one core, us a pair: {res['profile']['us_per_pair_one_core']}")
        del w
    write_json(
        args.out,
        {
            "meta": meta(
                cpu=cpu_model(),
                cores=os.cpu_count(),
                threads=torch.get_num_threads(),
                dtype=args.dtype,
                load_average_before=load_before,
                load_average_after=os.getloadavg(),
            ),
            "rates": rates,
            "workloads": results,
        },
    )


if __name__ == "__main__":
    main()
