"""INT8 x INT8 MaxSim against this project's fp16 kernel: same run, same data, plus ranking quality.

``gpu`` (one H200; inputs L2-normalised random fp16 vectors, d = 128, documents of 20-300 tokens unless
stated, int8 = the same vectors through `quantize_per_token`; times are `triton.testing.do_bench`
medians with its L2 flush, both paths called through their public functions):

  1. exhaustive - 512 queries x 32 tokens against 50K documents (8.0M tokens), all pairs;
  2. one query  - 1 query x 32 tokens against 100K documents (16M tokens);
  3. rerank     - 64 queries x 32 tokens, each against its own 1000 candidates of 180 tokens, scattered
                  over a 64K-document pool (read in place through their indices);
     each with the offsets on the GPU and, as `maxsim score` passes them, on the host (the int8 all-pairs
     call takes the Gluon kernel on Hopper, `maxsim_int8_hopper`, wherever its offsets live: device ones
     are read back once per tensor for its plan); workload 1 also with 16-128 queries, the Gluon kernel
     against the Triton tiles and fp16; a small tile sweep
     for the int8 Triton kernel first (the best configuration is reported and becomes the default);
  4. quality    - top-10/top-100 overlap and Kendall tau-b (over each query's fp16 top 1000) of the int8
                  scores against the fp16 ones, on workload 1's random corpus and on a topic-structured
                  synthetic corpus (documents and queries are noisy copies of per-topic concept vectors);
  5. end to end - `maxsim score` (in this process, warm Triton cache and page cache) with 512 queries over
                  workload 1's documents written as fp16 shards and as int8 shards made by
                  `maxsim quantize` (also timed).

``cpu`` (2 cores): `sample_data/` (real all-MiniLM-L6-v2 embeddings, d = 384, fp16): the 200 real
queries against all 400 documents with the torch backend in fp16 and in int8 - ranking agreement,
nDCG@10 of both against the qrels, and the time of each.

    python benchmarks/bench_int8.py gpu --out benchmarks/results/int8/int8-h200.json
    python benchmarks/bench_int8.py cpu --out benchmarks/results/int8/int8-cpu-sample-data.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from common import (
    DIM,
    QUERY_TOKENS,
    SMOKE,
    START,
    int8_kernel,
    make_log,
    median_ms,
    normal_tokens,
    offsets_of,
    ragged,
    smoke_size,
    sync,
    write_json,
)
from maxsim_kernels import maxsim_candidates, maxsim_varlen
from maxsim_kernels.int8_host import maxsim_candidates_int8, maxsim_varlen_int8, quantize_per_token
from maxsim_kernels.maxsim_int8 import launch_candidates_with_tiles, launch_varlen_with_tiles

from maxsim_cli.agreement import ranking_agreement

# `gpu --smoke` (common.SMOKE): the whole script on the CPU at 1/1000 of the sizes (Triton under its
# interpreter), to check it before spending GPU time.
size = smoke_size
log = make_log("bench_int8", clock=True)
RECORD: dict[str, Any] = {"results": {}}
OUT = {"path": None}


def checkpoint() -> None:
    """Write what is measured so far (a run cut short still leaves its numbers)."""
    write_json(OUT["path"], RECORD)


# --------------------------------------------------------------------------------------------------
# data


def topic_corpus(n_docs: int, n_queries: int, gen: torch.Generator, device: torch.device):
    """Documents and queries made of noisy copies of their topic's concept vectors (200 topics x 32)."""
    topics, concepts, noise = 200, 32, 0.5
    centres = torch.nn.functional.normalize(
        torch.randn(topics, concepts, DIM, generator=gen, device=device), dim=2
    )

    def draw(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        topic = torch.randint(0, topics, (lengths.numel(),), generator=gen, device=device)
        token_topic = torch.repeat_interleave(topic, lengths)
        pick = torch.randint(0, concepts, (token_topic.numel(),), generator=gen, device=device)
        g = torch.randn(token_topic.numel(), DIM, generator=gen, device=device) / DIM**0.5
        values = torch.nn.functional.normalize(centres[token_topic, pick] + noise * g, dim=1)
        return values.half(), offsets_of(lengths)

    docs = draw(torch.randint(20, 301, (n_docs,), generator=gen, device=device))
    queries = draw(torch.full((n_queries,), QUERY_TOKENS, device=device))
    return docs, queries


# --------------------------------------------------------------------------------------------------
# measurement


def agreement(int8_scores: torch.Tensor, fp16_scores: torch.Tensor) -> dict:
    stats = ranking_agreement(list(int8_scores.float().cpu()), list(fp16_scores.float().cpu()), (10, 100))
    return {
        "top10_overlap_mean": stats.overlap[10].mean,
        "top10_overlap_min": stats.overlap[10].min,
        "top100_overlap_mean": stats.overlap[100].mean,
        "top100_overlap_min": stats.overlap[100].min,
        "kendall_tau_b_mean": stats.kendall_tau.mean,
        "kendall_tau_b_min": stats.kendall_tau.min,
        "tau_depth": stats.tau_depth,
        "queries": len(int8_scores),
    }


def sweep(name: str, launch: Callable[..., Any], configs: list[dict], rep_ms: int) -> tuple[dict, list]:
    """Time the int8 launcher under each tile configuration; returns (best, all rows)."""
    rows = []
    for cfg in configs:
        try:
            ms = median_ms(lambda cfg=cfg: launch(**cfg), rep_ms)
        except Exception as exc:  # a configuration the compiler refuses (shared memory) is skipped
            log(f"  {name} {cfg}: failed ({type(exc).__name__}: {str(exc)[:120]})")
            continue
        rows.append({**cfg, "ms": ms})
        log(f"  {name} {cfg}: {ms:.3f} ms")
    best = min(rows, key=lambda r: r["ms"])
    return best, rows


# --------------------------------------------------------------------------------------------------
# gpu


def memory_bound_tiles(per_prog: str, counts: tuple[int, ...]) -> list[dict]:
    """Sweep entries for the HBM-bound shapes (one query, candidates), element max on: 64-token tiles on
    2 or 4 warps, and 128-token tiles (twice the bytes a loop iteration) on 4 or 8 warps."""
    tiles = [(64, 4, 3), (64, 4, 4), (64, 2, 4), (128, 4, 2), (128, 4, 3), (128, 4, 4), (128, 8, 3)]
    return [
        {"block_d": d, "num_warps": w, "num_stages": st, per_prog: n, "element_max": True}
        for n in counts
        for d, w, st in tiles
    ]


def bench_kernels(args: argparse.Namespace, device: torch.device) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    docs16, doc_off = ragged(size(100_000), 20, 300, gen, device)
    queries16, q_off = ragged(max(64, size(512)), QUERY_TOKENS, QUERY_TOKENS, gen, device)
    t0 = time.perf_counter()
    docs8, scales = quantize_per_token(docs16)
    sync()
    quant_ms = median_ms(lambda: quantize_per_token(docs16))
    log(f"data: {docs16.shape[0]} doc tokens; quantize {docs16.shape[0] / quant_ms / 1e6:.2f} G tokens/s")
    n_ex = size(50_000)
    ex_tokens = int(doc_off[n_ex])
    ex = (docs16[:ex_tokens], doc_off[: n_ex + 1], docs8[:ex_tokens], scales[:ex_tokens])
    one_q, one_off = queries16[:QUERY_TOKENS], q_off[:2]

    pool_n, per_query, cand_len, n_rq = size(64_000), size(1000), 180, 64
    pool_n = max(pool_n, n_rq * per_query)
    pool16 = normal_tokens(pool_n * cand_len, gen, device)
    pool_off = torch.arange(pool_n + 1, device=device, dtype=torch.int64) * cand_len
    pool8, pool_scales = quantize_per_token(pool16)
    cand_docs = torch.randperm(pool_n, generator=gen, device=device)[: n_rq * per_query]
    cand_off = torch.arange(n_rq + 1, device=device, dtype=torch.int64) * per_query
    rq, rq_off = queries16[: n_rq * QUERY_TOKENS], q_off[: n_rq + 1]
    sync()
    log(f"inputs ready in {time.perf_counter() - t0:.1f} s")

    results: dict[str, Any] = RECORD["results"]
    results["quantize_tokens_per_s"] = docs16.shape[0] / quant_ms * 1e3
    rep = args.rep_ms

    # -- tile sweeps (int8 launchers, offsets on the GPU) --
    def varlen_launcher(q, qo, d8, do, sd):
        q8, sq = quantize_per_token(q)
        return lambda **cfg: launch_varlen_with_tiles(q8, sq, qo, d8, sd, do, False, **cfg)

    sweeps: dict[str, Any] = {}
    if args.sweep:
        log("sweep: exhaustive")
        best, rows = sweep(
            "exhaustive",
            varlen_launcher(queries16, q_off, ex[2], ex[1], ex[3]),
            [  # first: the constants in force
                dict(block_q=256, block_d=32, docs_per_prog=64, num_warps=4, num_stages=2, element_max=True),
                dict(block_q=256, block_d=32, docs_per_prog=64, num_warps=8, num_stages=3, element_max=False),
                dict(block_q=256, block_d=32, docs_per_prog=64, num_warps=4, num_stages=3, element_max=True),
                dict(block_q=256, block_d=32, docs_per_prog=64, num_warps=4, num_stages=2, element_max=False),
                dict(block_q=256, block_d=64, docs_per_prog=64, num_warps=8, num_stages=3, element_max=True),
                dict(block_q=128, block_d=64, docs_per_prog=64, num_warps=4, num_stages=2, element_max=True),
                dict(block_q=256, block_d=32, docs_per_prog=64, num_warps=8, num_stages=4),
            ],
            rep,
        )
        sweeps["exhaustive"] = {"best": best, "rows": rows}
        checkpoint()
        log("sweep: one query")
        best, rows = sweep(
            "one_query",
            varlen_launcher(one_q, one_off, docs8, doc_off, scales),
            [  # first: the constants in force
                dict(block_d=64, docs_per_prog=32, num_warps=4, num_stages=3, element_max=True),
                dict(block_d=64, docs_per_prog=32, num_warps=4, num_stages=3, element_max=False),
                *memory_bound_tiles("docs_per_prog", (8, 16, 32)),
            ],
            rep,
        )
        sweeps["one_query"] = {"best": best, "rows": rows}
        checkpoint()
        log("sweep: rerank")
        rq8, rsq = quantize_per_token(rq)
        best, rows = sweep(
            "rerank",
            lambda **cfg: launch_candidates_with_tiles(
                rq8, rsq, rq_off, pool8, pool_scales, pool_off, cand_off, cand_docs, False, **cfg
            ),
            [
                dict(block_d=64, cands_per_prog=16, num_warps=4, num_stages=3, element_max=True),
                dict(block_d=64, cands_per_prog=16, num_warps=4, num_stages=3, element_max=False),
                *memory_bound_tiles("cands_per_prog", (4, 8, 16)),
            ],
            rep,
        )
        sweeps["rerank"] = {"best": best, "rows": rows}
    results["sweeps"] = sweeps

    # -- the figures: public functions, same inputs, default tiles (and the sweep's best) --
    def both(name, fp16_fn, int8_fn, flops, int8_bytes, fp16_bytes, best_fn=None):
        row = {"fp16_ms": median_ms(fp16_fn, rep), "int8_ms": median_ms(int8_fn, rep)}
        if best_fn is not None:
            row["int8_best_tiles_ms"] = median_ms(best_fn, rep)
        row["int8_over_fp16_time"] = row["int8_ms"] / row["fp16_ms"]
        row["int8_TOPS"] = flops / row["int8_ms"] / 1e9
        row["fp16_TFLOPS"] = flops / row["fp16_ms"] / 1e9
        row["int8_TBps"] = int8_bytes / row["int8_ms"] / 1e9
        row["fp16_TBps"] = fp16_bytes / row["fp16_ms"] / 1e9
        ratio = row["int8_over_fp16_time"]
        log(f"{name}: fp16 {row['fp16_ms']:.3f} ms, int8 {row['int8_ms']:.3f} ms ({ratio:.2f}x)")
        results[name.replace(" (", "_").replace(")", "").replace(" ", "_")] = row
        checkpoint()
        return row

    def best_varlen(key, q, qo, d8, do, sd):
        if key not in sweeps:
            return None
        cfg = {k: v for k, v in sweeps[key]["best"].items() if k != "ms"}
        q8, sq = quantize_per_token(q)
        return lambda: launch_varlen_with_tiles(q8, sq, qo, d8, sd, do, False, **cfg)

    d16, do, d8, sd = ex
    flops = 2.0 * queries16.shape[0] * d16.shape[0] * DIM
    for where, qo_, do_ in (("gpu_offsets", q_off, do), ("host_offsets", q_off.cpu(), do.cpu())):
        log(f"exhaustive ({where}): int8 kernel {int8_kernel(queries16, qo_, d8, do_)}")
        results[f"exhaustive_{where}"] = both(
            f"exhaustive ({where})",
            lambda qo_=qo_, do_=do_: maxsim_varlen(queries16, qo_, d16, do_),
            lambda qo_=qo_, do_=do_: maxsim_varlen_int8(queries16, qo_, d8, do_, doc_scales=sd),
            flops,
            d8.numel() + 4 * d8.shape[0],
            d16.numel() * 2,
            best_varlen("exhaustive", queries16, q_off, d8, do, sd) if where == "gpu_offsets" else None,
        )
    results["exhaustive_host_offsets"]["int8_kernel"] = int8_kernel(queries16, q_off.cpu(), d8, do.cpu())
    results["exhaustive_gpu_offsets"]["int8_kernel"] = int8_kernel(queries16, q_off, d8, do)
    # fewer queries against the same documents: the int8 kernels side by side (the Gluon kernel where it
    # takes the problem, its tile tables made once per offsets tensor and reused; the Triton tiles through
    # their launcher); and the full query set with fresh host offsets at every call, as
    # `maxsim score` makes them for each block of documents (the tables made at every call)
    few = {}
    do_host = do.cpu()
    for nq in (16, 32, 64, 128, 512):
        q_, qo_ = queries16[: nq * QUERY_TOKENS], q_off[: nq + 1]
        qo_host = qo_.cpu()
        row = {
            "int8_kernel_host_offsets": int8_kernel(q_, qo_host, d8, do_host),
            "int8_host_offsets_ms": median_ms(
                lambda q_=q_, qo_host=qo_host: maxsim_varlen_int8(q_, qo_host, d8, do_host, doc_scales=sd),
                rep,
            ),
            "int8_gpu_offsets_ms": median_ms(
                lambda q_=q_, qo_=qo_: maxsim_varlen_int8(q_, qo_, d8, do, doc_scales=sd), rep
            ),
            "int8_triton_ms": median_ms(varlen_launcher(q_, qo_, d8, do, sd), rep),
            "fp16_ms": median_ms(lambda q_=q_, qo_=qo_: maxsim_varlen(q_, qo_, d16, do), rep),
        }
        if nq == 512:
            row["int8_fresh_host_offsets_ms"] = median_ms(
                lambda q_=q_, qo_host=qo_host: maxsim_varlen_int8(q_, qo_host, d8, do.cpu(), doc_scales=sd),
                rep,
            )
        log(f"exhaustive, {nq} queries: {row}")
        few[str(nq)] = row
    results["exhaustive_fewer_queries"] = few
    checkpoint()
    flops = 2.0 * QUERY_TOKENS * docs16.shape[0] * DIM
    for where, qo_, do_ in (
        ("gpu_offsets", one_off, doc_off),
        ("host_offsets", one_off.cpu(), doc_off.cpu()),
    ):
        results[f"one_query_{where}"] = both(
            f"one query ({where})",
            lambda qo_=qo_, do_=do_: maxsim_varlen(one_q, qo_, docs16, do_),
            lambda qo_=qo_, do_=do_: maxsim_varlen_int8(one_q, qo_, docs8, do_, doc_scales=scales),
            flops,
            docs8.numel() + 4 * docs8.shape[0],
            docs16.numel() * 2,
            best_varlen("one_query", one_q, one_off, docs8, doc_off, scales)
            if where == "gpu_offsets"
            else None,
        )
    flops = 2.0 * QUERY_TOKENS * cand_len * n_rq * per_query * DIM
    cand_bytes8 = n_rq * per_query * cand_len * (DIM + 4)
    for where in ("gpu_offsets", "host_offsets"):
        on = (lambda t: t) if where == "gpu_offsets" else (lambda t: t.cpu())
        rerank_args = (rq, on(rq_off), on(pool_off), on(cand_off), on(cand_docs))
        best_fn = None
        if "rerank" in sweeps and where == "gpu_offsets":
            cfg = {k: v for k, v in sweeps["rerank"]["best"].items() if k != "ms"}
            rq8, rsq = quantize_per_token(rq)
            best_fn = functools.partial(
                launch_candidates_with_tiles,
                rq8,
                rsq,
                rq_off,
                pool8,
                pool_scales,
                pool_off,
                cand_off,
                cand_docs,
                False,
                **cfg,
            )
        q_, qo_, po_, co_, cd_ = rerank_args
        results[f"rerank_{where}"] = both(
            f"rerank ({where})",
            functools.partial(maxsim_candidates, q_, qo_, pool16, po_, co_, cd_),
            functools.partial(maxsim_candidates_int8, q_, qo_, pool8, po_, co_, cd_, doc_scales=pool_scales),
            flops,
            cand_bytes8,
            n_rq * per_query * cand_len * DIM * 2,
            best_fn,
        )

    # -- quality on the random corpus of workload 1 --
    fp16_scores = maxsim_varlen(queries16, q_off, d16, do)
    int8_scores = maxsim_varlen_int8(queries16, q_off, d8, do, doc_scales=sd)
    results["quality_random"] = agreement(int8_scores, fp16_scores)
    log(f"quality (random corpus): {results['quality_random']}")
    checkpoint()
    results["_e2e_inputs"] = (queries16.cpu(), q_off.cpu(), d16.cpu(), do.cpu())
    return results


def bench_topics(device: torch.device) -> dict:
    gen = torch.Generator(device=device).manual_seed(7)
    (docs, doc_off), (queries, q_off) = topic_corpus(size(50_000), max(64, size(512)), gen, device)
    d8, sd = quantize_per_token(docs)
    result = agreement(
        maxsim_varlen_int8(queries, q_off, d8, doc_off, doc_scales=sd),
        maxsim_varlen(queries, q_off, docs, doc_off),
    )
    log(f"quality (topic corpus): {result}")
    return result


def bench_e2e(work: str, inputs, device: torch.device) -> dict:
    from maxsim_cli.quantize import quantize_corpus
    from maxsim_cli.scoring.entry import score
    from maxsim_cli.shards import write_shard

    queries, q_off, docs, d_off = inputs
    fp16_dir, int8_dir = os.path.join(work, "fp16"), os.path.join(work, "int8")
    os.makedirs(fp16_dir)
    n_docs = d_off.numel() - 1
    t0 = time.perf_counter()
    per_shard = size(12_500)
    for s, a in enumerate(range(0, n_docs, per_shard)):
        b = min(n_docs, a + per_shard)
        t_a, t_b = int(d_off[a]), int(d_off[b])
        write_shard(
            os.path.join(fp16_dir, f"shard-{s:03d}.safetensors"),
            [f"d{i:07d}" for i in range(a, b)],
            docs[t_a:t_b],
            offsets=d_off[a : b + 1] - t_a,
            normalized=True,
        )
    qpath = os.path.join(work, "queries.safetensors")
    write_shard(qpath, [f"q{i:03d}" for i in range(q_off.numel() - 1)], queries, offsets=q_off)
    log(f"e2e: fp16 shards written in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    report = quantize_corpus([fp16_dir], int8_dir, device=device.type)
    quantize_s = time.perf_counter() - t0
    log(f"e2e: {report.summary()} in {quantize_s:.1f} s; {report.quality.summary()}")
    small = [os.path.join(fp16_dir, "shard-000.safetensors")]
    small8 = [os.path.join(int8_dir, "shard-000.safetensors")]
    out: dict[str, Any] = {
        "quantize_s": quantize_s,
        "quantize": report.as_dict(),
        "documents": n_docs,
        "tokens": int(d_off[-1]),
        "queries": q_off.numel() - 1,
    }
    for top_k in (1000, 100):
        score(qpath, small, output=os.path.join(work, "warm.trec"), top_k=top_k, log=lambda m: None)
        score(qpath, small8, output=os.path.join(work, "warm.trec"), top_k=top_k, log=lambda m: None)
        times: dict[str, list[float]] = {"fp16": [], "int8": []}
        stats: dict[str, Any] = {}
        for _ in range(2):
            for name, corpus in (("fp16", [fp16_dir]), ("int8", [int8_dir])):
                t0 = time.perf_counter()
                st = score(
                    qpath, corpus, output=os.path.join(work, f"{name}.trec"), top_k=top_k, log=lambda m: None
                )
                times[name].append(time.perf_counter() - t0)
                stats[name] = st.as_dict()
        row = {
            "fp16_s": min(times["fp16"]),
            "int8_s": min(times["int8"]),
            "all_times": times,
            "stats": stats,
        }
        row["int8_over_fp16_time"] = row["int8_s"] / row["fp16_s"]
        out[f"score_top{top_k}"] = row
        ratio = row["int8_over_fp16_time"]
        log(f"e2e top-{top_k}: fp16 {row['fp16_s']:.3f} s, int8 {row['int8_s']:.3f} s ({ratio:.2f}x)")
    return out


def bench_gpu(args: argparse.Namespace) -> dict:
    device = torch.device("cpu" if args.smoke else "cuda")
    results = bench_kernels(args, device)
    inputs = results.pop("_e2e_inputs")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    results["quality_topics"] = bench_topics(device)
    checkpoint()
    if args.e2e:
        with tempfile.TemporaryDirectory(dir=args.workdir) as work:
            results["end_to_end"] = bench_e2e(work, inputs, device)
    return results


# --------------------------------------------------------------------------------------------------
# cpu (sample_data)


def bench_cpu(args: argparse.Namespace) -> dict:
    from maxsim_cli.evaluate import evaluate_run
    from maxsim_cli.run_files import RunWriter
    from maxsim_cli.shards import open_corpus, read_queries

    torch.set_num_threads(os.cpu_count() or 1)
    corpus = open_corpus([os.path.join(args.sample_data, "corpus")])
    batches = [s.read_docs(0, s.num_docs) for s in corpus.shards]
    docs = torch.cat([b.embeddings for b in batches])
    lengths = torch.cat([b.lengths() for b in batches])
    d_off = offsets_of(lengths)
    ids = [i for b in batches for i in b.ids]
    q = read_queries(os.path.join(args.sample_data, "queries.safetensors"))
    queries = q.embeddings.to(docs.dtype)
    d8, sd = quantize_per_token(docs)
    fp16_fn = lambda: maxsim_varlen(queries, q.offsets, docs, d_off, backend="torch")  # noqa: E731
    int8_fn = lambda: maxsim_varlen_int8(queries, q.offsets, d8, d_off, doc_scales=sd, backend="torch")  # noqa: E731
    fp16_scores, int8_scores = fp16_fn(), int8_fn()
    timings = {}
    for name, fn in (("fp16", fp16_fn), ("int8", int8_fn)):
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        timings[f"{name}_s"] = best
    result: dict[str, Any] = {
        "documents": len(ids),
        "tokens": int(d_off[-1]),
        "dim": docs.shape[1],
        "dtype": str(docs.dtype),
        "queries": len(q.ids),
        **timings,
        "quality": agreement(int8_scores, fp16_scores),
        "quantize_check": {
            "max_abs_dequantization_error": float((d8.float() * sd[:, None] - docs.float()).abs().max()),
        },
    }
    qrels = os.path.join(args.sample_data, "qrels.txt")
    with tempfile.TemporaryDirectory() as work:
        for name, scores in (("fp16", fp16_scores), ("int8", int8_scores)):
            path = os.path.join(work, f"{name}.trec")
            with RunWriter(path) as writer:
                for qi, qid in enumerate(q.ids):
                    writer.write_query(qid, ids, scores[qi].tolist())
            try:
                result[f"eval_{name}"] = evaluate_run(path, qrels, ["nDCG@10", "RR@10"]).values
            except Exception as exc:  # ir-measures is the optional `eval` extra
                result[f"eval_{name}"] = f"unavailable: {type(exc).__name__}: {exc}"
    log(json.dumps(result["quality"]))
    return result


# --------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=["gpu", "cpu"])
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument(
        "--rep-ms", type=int, default=300, help="gpu: do_bench repetition time per measurement"
    )
    parser.add_argument("--no-sweep", dest="sweep", action="store_false", help="gpu: skip the tile sweep")
    parser.add_argument(
        "--no-e2e", dest="e2e", action="store_false", help="gpu: skip `maxsim score` end to end"
    )
    parser.add_argument("--workdir", default=None, help="gpu: where the end-to-end shards go (temporary)")
    parser.add_argument("--sample-data", default="sample_data", help="cpu: the sample_data directory")
    parser.add_argument("--repeats", type=int, default=3, help="cpu: timing repetitions, best kept")
    parser.add_argument(
        "--smoke", action="store_true", help="gpu: tiny sizes on the CPU (a check of the script)"
    )
    args = parser.parse_args()
    if args.smoke:
        SMOKE["on"] = True  # run as TRITON_INTERPRET=1 python benchmarks/bench_int8.py gpu --smoke
    import triton

    OUT["path"] = args.out
    RECORD.update(
        {
            "benchmark": f"bench_int8 {args.which}",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name()
            if torch.cuda.is_available()
            else platform.processor() or "cpu",
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
            "command": " ".join(["python", *sys.argv]),
        }
    )
    RECORD["results"] = bench_gpu(args) if args.which == "gpu" else bench_cpu(args)
    RECORD["seconds"] = time.perf_counter() - START
    checkpoint()
    print(json.dumps(RECORD, indent=1, default=str))


if __name__ == "__main__":
    main()
