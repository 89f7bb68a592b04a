"""The driver of `maxsim verify`: check the options, open the queries and the corpus, then `_verify` runs
the steps in order:

- `_context`: the queries as the kernel sees them, on the device, with the ingredients of the bound B;
- `_plan`: which pairs are scored (all documents, a seeded sample, or a run's candidates);
- `_score`: each batch scored both ways and folded into the per-pair numbers and counters (`batches`);
- the statistics (`stats.score_statistics`, `kernel_ranking`), the tolerance (`checks.score_tolerance`)
  and the kernel's checks (`checks.score_checks`);
- `_quantization` and `_gradient_check` where asked for;
- `_worst_score` and `_setup`, the report's details.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from maxsim_cli.agreement import score_errors
from maxsim_cli.codecs import CODE_QUANTIZATIONS
from maxsim_cli.devices import check_backend_option, resolve_device
from maxsim_cli.errors import InputError, MaxsimError, UsageError
from maxsim_cli.queries import read_queries
from maxsim_cli.scoring.resources import corpus_name
from maxsim_cli.shards import Corpus, DocBatch, check_kernel_dim, open_corpus
from maxsim_cli.verify.batches import BatchContext, score_all_pairs, score_candidates
from maxsim_cli.verify.checks import (
    UNIT_ROUNDOFF,
    Check,
    ScoreTolerance,
    Tolerances,
    gradient_verdict,
    quantization_check,
    quantization_min_overlap,
    query_score_factors,
    score_checks,
    score_tolerance,
    similarity_error,
)
from maxsim_cli.verify.inputs import (
    locations_of,
    query_values,
    read_locations,
    rows_of,
    sample_documents,
    select_candidates,
)
from maxsim_cli.verify.report import Quantization, VerifyReport, near_tie_margin_text
from maxsim_cli.verify.stats import (
    Counters,
    Scored,
    ScoreStats,
    dequantized_norms,
    judged_queries,
    kernel_ranking,
    overlap_depths,
    quantization_ranking,
    score_statistics,
)

GRAD_QUERIES = 8
GRAD_DOCS = 64
# Every scored pair keeps a few float64 numbers in memory: past this many, ask for a sample.
MAX_SCORES = 50_000_000
# Document tokens per scored batch (the kernel's argmax [Tq, docs] is the largest array per batch).
DEFAULT_BATCH_TOKENS = 1 << 19


@dataclass
class _Plan:
    """Which pairs are scored: every query x `selection` (mode "all" or "sample"), or each query x its
    own candidates `per_query` (mode "candidates")."""

    mode: str
    selection: np.ndarray | None = None  # corpus-wide document numbers, sorted
    per_query: list[np.ndarray] | None = None  # per query, corpus-wide document numbers in run order
    skipped: int = 0  # queries without candidates
    missing: int = 0  # candidates not in the corpus
    pairs: int = 0  # (query, document) pairs to score


def verify(
    queries: str,
    corpus: Sequence[str],
    *,
    sample_docs: int | None = None,
    seed: int = 0,
    candidates: str | None = None,
    device: str = "auto",
    backend: str = "auto",
    allow_tf32: bool = False,
    tolerances: Tolerances | None = None,
    reference_corpus: Sequence[str] | None = None,
    grad: bool = False,
    max_tokens: int = DEFAULT_BATCH_TOKENS,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Score the queries against (a sample of, or the run candidates of) the corpus with the fused kernel
    and with the independent reference; return the report and its verdict (see `maxsim_cli.verify`).
    ``progress(pairs_done, pairs_total)`` is called after each scored batch."""
    started = time.perf_counter()
    tol = tolerances or Tolerances()
    _check_options(queries, sample_docs, candidates, tol, max_tokens)
    dev = resolve_device(device)
    chosen_backend = check_backend_option(backend, dev)
    if chosen_backend == "auto":  # the report names the backend that actually ran
        chosen_backend = "triton" if dev.type == "cuda" else "torch"

    qbatch = read_queries(queries).batch  # a query shard, a folder of them, or stdin
    docs_corpus = open_corpus(list(corpus))
    ref_corpus = open_corpus(list(reference_corpus)) if reference_corpus else None
    try:
        if docs_corpus.quantization in CODE_QUANTIZATIONS:  # no per-token argmax: recall and error instead
            raise UsageError(
                f"{corpus_name(list(corpus))}: holds {docs_corpus.quantization} codes; verify checks a "
                "compressed tier against the float corpus it was quantized from: add --exact-from CORPUS"
            )
        _check_inputs(queries, qbatch, docs_corpus, ref_corpus)
        return _verify(
            queries, qbatch, docs_corpus, ref_corpus, sample_docs, seed, candidates, dev, chosen_backend,
            allow_tf32, tol, grad, max_tokens, started, progress,
        )  # fmt: skip
    finally:
        docs_corpus.close()
        if ref_corpus is not None:
            ref_corpus.close()


def _check_options(
    queries: str, sample_docs: int | None, candidates: str | None, tol: Tolerances, max_tokens: int
) -> None:
    """Usage errors in the options, before anything is read."""
    if sample_docs is not None and candidates is not None:
        raise UsageError("--sample-docs and --candidates exclude each other: verify a sample or a run")
    if queries == "-" and candidates == "-":
        raise UsageError("queries and --candidates both read stdin; give one of them as a file")
    if sample_docs is not None and sample_docs < 1:
        raise UsageError(f"--sample-docs {sample_docs}: give a positive number of documents")
    for name, value in (("--atol", tol.atol), ("--rtol", tol.rtol)):
        if value is not None and not (value >= 0 and math.isfinite(value)):
            raise UsageError(f"{name} {value}: give a finite number >= 0")
    for name, value in (
        ("--min-overlap", tol.min_overlap),
        ("--min-argmax-agreement", tol.min_argmax_agreement),
    ):
        if value is not None and not 0.0 <= value <= 1.0:
            raise UsageError(f"{name} {value}: give a fraction between 0 and 1")
    if max_tokens < 1:
        raise UsageError(f"--batch-tokens {max_tokens}: give a positive number of tokens")


def _check_inputs(queries: str, qbatch: DocBatch, corpus: Corpus, ref_corpus: Corpus | None) -> None:
    """The queries, the corpus and the reference corpus fit together (some queries, one dim, float
    reference shards)."""
    if qbatch.num_docs == 0:
        raise InputError(f"{queries}: no queries")
    if qbatch.embeddings.shape[1] != corpus.dim:
        raise InputError(
            f"{queries}: queries have dim {qbatch.embeddings.shape[1]} but the corpus "
            f"{corpus.paths[0]} has dim {corpus.dim}; use queries from the same encoder"
        )
    check_kernel_dim(corpus)
    if ref_corpus is not None and ref_corpus.dim != corpus.dim:
        raise InputError(
            f"{ref_corpus.paths[0]}: reference corpus has dim {ref_corpus.dim} but the corpus "
            f"{corpus.paths[0]} has dim {corpus.dim}; give the shards it was made from"
        )
    if ref_corpus is not None and ref_corpus.dtype == "int8":
        raise InputError(
            f"{ref_corpus.paths[0]}: the reference corpus is int8; --reference-corpus takes float shards"
        )


def _verify(
    queries_path: str,
    qbatch: DocBatch,
    corpus: Corpus,
    ref_corpus: Corpus | None,
    sample_docs: int | None,
    seed: int,
    candidates: str | None,
    dev: torch.device,
    backend: str,
    allow_tf32: bool,
    tol: Tolerances,
    grad: bool,
    max_tokens: int,
    started: float,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """The steps of `verify` on opened inputs: plan, score both ways, measure, judge, report."""
    ctx = _context(queries_path, qbatch, corpus, ref_corpus, dev, backend, allow_tf32)
    plan = _plan(ctx, corpus, sample_docs, seed, candidates, queries_path)
    setup_s = time.perf_counter() - started
    counters = Counters(total_pairs=plan.pairs, progress=progress)
    scored = _score(ctx, corpus, plan, max_tokens, counters)

    stats = score_statistics(scored, corpus.dtype)
    tolerance = score_tolerance(scored, stats, tol, ctx.int8)
    judged = judged_queries(scored)
    ks = overlap_depths(scored)
    ranking = kernel_ranking(scored, tolerance.per_query, judged, ks)
    argmax = counters.argmax.stats()
    checks = score_checks(stats, tolerance, argmax, ranking, tol, dtype=corpus.dtype, allow_tf32=allow_tf32)
    quantization = None
    if scored.quant_ref is not None:
        assert ref_corpus is not None
        quantization, quantization_verdict = _quantization(ref_corpus, scored, stats, judged, ks, tol)
        checks.append(quantization_verdict)
    grad_result = None
    grad_s = 0.0
    if grad:
        t0 = time.perf_counter()
        key = "tf32" if allow_tf32 and corpus.dtype == "float32" else corpus.dtype
        grad_result, grad_check = _gradient_check(ctx, corpus, scored, seed, key)
        checks.append(grad_check)
        grad_s = time.perf_counter() - t0

    return VerifyReport(
        setup=_setup(ctx, corpus, plan, scored, stats, counters, queries_path, candidates, sample_docs, seed),
        kernel_errors=stats.kernel_errors,
        float32_errors=stats.float32_errors,
        tolerance=tolerance.check,
        tolerance_rule=tolerance.rule,
        max_allowed=tolerance.max_allowed,
        argmax=argmax,
        float32_argmax=None if ctx.int8 else counters.float32_argmax.stats(),
        near_tie_margin=near_tie_margin_text(ctx.int8, ctx.sim_error),
        ranking=ranking,
        nonfinite_kernel=stats.nonfinite_kernel,
        nonfinite_reference=stats.nonfinite_reference,
        worst=_worst_score(ctx, corpus, scored, stats, tolerance),
        first_argmax_mismatch=counters.argmax.first_mismatch,
        quantization=quantization,
        grad=grad_result,
        checks=checks,
        timings={
            "setup": setup_s,
            "kernel": counters.kernel_s,
            "reference": counters.reference_s,
            "quantization": counters.quantization_s,
            "grad": grad_s,
            "total": time.perf_counter() - started,
        },
    )


def _context(
    queries_path: str,
    qbatch: DocBatch,
    corpus: Corpus,
    ref_corpus: Corpus | None,
    dev: torch.device,
    backend: str,
    allow_tf32: bool,
) -> BatchContext:
    """The queries as the kernel sees them, on the device, and the per-query ingredients of the bound B."""
    int8 = corpus.dtype == "int8"
    q_values = query_values(qbatch, corpus.dtype, queries_path)
    q_offsets = qbatch.offsets.numpy().astype(np.int64)
    nq = qbatch.num_docs
    sim_error = 0.0 if int8 else similarity_error(corpus.dtype, corpus.dim, allow_tf32)
    if int8:
        from maxsim_kernels.int8_host import quantize_per_token

        codes, q_scales = quantize_per_token(q_values, backend="torch")
        q_norms = dequantized_norms(codes, q_scales)
        base = 2.0 * UNIT_ROUNDOFF
    else:
        q_norms = dequantized_norms(q_values, None)
        base = sim_error
    norm_sum = np.add.reduceat(q_norms.numpy(), q_offsets[:-1]) if q_norms.numel() else np.zeros(nq)
    ref_queries = None
    if ref_corpus is not None:
        ref_queries = query_values(qbatch, ref_corpus.dtype, queries_path).to(dev)
    return BatchContext(
        device=dev,
        backend=backend,
        allow_tf32=allow_tf32,
        int8=int8,
        sim_error=sim_error,
        queries=q_values.to(dev),
        query_offsets=q_offsets,
        query_ids=list(qbatch.ids),
        query_norm_sum=norm_sum,
        score_factor=query_score_factors(q_offsets, base),
        reference_corpus=ref_corpus,
        reference_queries=ref_queries,
    )


def _plan(
    ctx: BatchContext,
    corpus: Corpus,
    sample_docs: int | None,
    seed: int,
    candidates: str | None,
    queries_path: str,
) -> _Plan:
    """Which pairs are scored: the run's candidates, a seeded sample, or every document; refused past
    `MAX_SCORES` pairs."""
    nq = len(ctx.query_ids)
    if candidates is not None:
        per_query, skipped, missing = select_candidates(candidates, corpus, ctx.query_ids, queries_path)
        plan = _Plan("candidates", per_query=per_query, skipped=skipped, missing=missing)
        pairs = int(sum(p.size for p in per_query))
        if pairs == 0:
            raise InputError(
                f"{candidates}: no candidate of any query of {queries_path} is in the corpus "
                f"{corpus.paths[0]}; verify the run against the corpus it was made for"
            )
    else:
        deleted = corpus.deleted_mask()  # deleted documents are not the corpus's: never verified
        live = np.arange(corpus.num_docs, dtype=np.int64) if deleted is None else np.flatnonzero(~deleted)
        if sample_docs is not None and sample_docs < live.size:
            plan = _Plan("sample", selection=live[sample_documents(live.size, sample_docs, seed)])
        else:
            plan = _Plan("all", selection=live)
        assert plan.selection is not None
        pairs = nq * plan.selection.size
    plan.pairs = pairs
    if pairs > MAX_SCORES:
        raise UsageError(
            f"{pairs:,} scores ({nq} queries x documents) is more than verify keeps in memory "
            f"({MAX_SCORES:,}); pass --sample-docs N (a seeded sample) or fewer queries"
        )
    return plan


def _score(ctx: BatchContext, corpus: Corpus, plan: _Plan, max_tokens: int, counters: Counters) -> Scored:
    """Score the planned pairs with the kernel and the reference, batch by batch."""
    if plan.per_query is not None:
        return score_candidates(ctx, corpus, plan.per_query, max_tokens, counters)
    assert plan.selection is not None
    return score_all_pairs(ctx, corpus, plan.selection, max_tokens, counters)


def _quantization(
    ref_corpus: Corpus, scored: Scored, stats: ScoreStats, judged: list[int], ks: list[int], tol: Tolerances
) -> tuple[Quantization, Check]:
    """The quantized kernel's scores against the exact float scores of the reference corpus, judged."""
    q_min = quantization_min_overlap(tol)
    q_ranking = quantization_ranking(scored, judged, ks)
    quantization = Quantization(
        reference_corpus=ref_corpus.paths,
        reference_dtype=ref_corpus.dtype,
        errors=score_errors(stats.kernel, scored.flat("quant_ref")),
        ranking=q_ranking,
        min_overlap=q_min,
    )
    return quantization, quantization_check(q_ranking, q_min)


def _gradient_check(
    ctx: BatchContext, corpus: Corpus, scored: Scored, seed: int, dtype_key: str
) -> tuple[dict[str, Any], Check]:
    """`maxsim_kernels.maxsim_backward.gradient_check` on a seeded sample of queries x scored documents."""
    try:
        from maxsim_kernels.maxsim_backward import gradient_check
    except ImportError as exc:
        raise MaxsimError(f"--grad needs maxsim_kernels.maxsim_backward.gradient_check: {exc}") from None
    rng = np.random.default_rng(seed)
    with_docs = [q for q, d in enumerate(scored.docs) if d.size]
    chosen = np.sort(rng.choice(with_docs, size=min(GRAD_QUERIES, len(with_docs)), replace=False))
    pool = np.unique(np.concatenate([scored.docs[q] for q in chosen]))
    docs = np.sort(rng.choice(pool, size=min(GRAD_DOCS, pool.size), replace=False))
    batch = read_locations(corpus, locations_of(corpus, docs))
    rows, offsets = rows_of(ctx.query_offsets, chosen)
    dev = ctx.device
    try:
        result = gradient_check(
            ctx.queries[torch.from_numpy(rows).to(dev)],
            torch.from_numpy(offsets).to(dev),
            batch.embeddings.to(dev),
            batch.offsets.to(dev),
            doc_scales=None if batch.scales is None else batch.scales.to(dev),
            seed=seed,
            allow_tf32=ctx.allow_tf32,
            backend=ctx.backend,
        )
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise MaxsimError(f"the gradient check refused the inputs: {exc}") from None
    return gradient_verdict(result, int(chosen.size), int(docs.size), dtype_key)


def _worst_score(
    ctx: BatchContext,
    corpus: Corpus,
    scored: Scored,
    stats: ScoreStats,
    tolerance: ScoreTolerance,
) -> dict[str, Any] | None:
    """The score nearest to (or furthest past) its bound, by query and document id; None without scores."""
    if tolerance.check.worst_index < 0:
        return None
    per_query_tol = tolerance.per_query
    kernel_flat, ref_flat = stats.kernel, stats.reference
    q_of_pair = np.repeat(np.arange(len(ctx.query_ids)), [d.size for d in scored.docs])
    first_pair = np.concatenate([[0], np.cumsum([d.size for d in scored.docs])])
    i = tolerance.check.worst_index
    q = int(q_of_pair[i])
    doc = int(scored.docs[q][i - first_pair[q]])
    shard, local = locations_of(corpus, np.array([doc]))[0]
    return {
        "qid": ctx.query_ids[q],
        "docno": corpus.shards[int(shard)].ids[int(local)],
        "kernel": float(kernel_flat[i]),
        "reference": float(ref_flat[i]),
        "abs_error": float(abs(kernel_flat[i] - ref_flat[i])),
        "allowed": float(
            per_query_tol[q] if np.ndim(per_query_tol[q]) == 0 else per_query_tol[q][i - first_pair[q]]
        ),
    }


def _setup(
    ctx: BatchContext,
    corpus: Corpus,
    plan: _Plan,
    scored: Scored,
    stats: ScoreStats,
    counters: Counters,
    queries_path: str,
    candidates: str | None,
    sample_docs: int | None,
    seed: int,
) -> dict[str, Any]:
    """What was verified, where and how: the report's setup section."""
    dev = ctx.device
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {
        "queries": queries_path,
        "corpus": corpus.paths,
        "mode": plan.mode,
        "candidates": candidates,
        "sample_docs": sample_docs if plan.mode == "sample" else None,
        "seed": seed,
        "num_queries": len(judged_queries(scored)),
        "queries_without_candidates": plan.skipped,
        "candidates_not_in_corpus": plan.missing,
        "num_docs": int(np.unique(np.concatenate(scored.docs)).size) if scored.docs else 0,
        "corpus_docs": corpus.num_docs,
        "pairs": int(stats.kernel.size),
        "dtype": corpus.dtype,
        "dim": corpus.dim,
        "device": str(dev),
        "device_name": device_name,
        "backend": ctx.backend,
        "allow_tf32": ctx.allow_tf32,
        "similarity_error": ctx.sim_error,
        "recomputed_pairs": counters.recomputed,
        "torch": torch.__version__,
    }
