"""Scoring the planned pairs both ways, batch by batch: the fused kernel exactly as `maxsim score` calls
it, the reference on the same inputs (and, with a reference corpus, the exact float scores), each batch
folded into the per-pair numbers (`Scored`) and the accumulators (`Counters`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from maxsim_cli.errors import InputError, MaxsimError
from maxsim_cli.shards import Corpus, DocBatch
from maxsim_cli.verify.inputs import batch_subset, batches_of, locations_of, read_locations, rows_of
from maxsim_cli.verify.reference import FloatReference, float_reference, yardstick_dtype
from maxsim_cli.verify.stats import Counters, Scored, dequantized_norms, segment_max


@dataclass
class BatchContext:
    """What every batch needs: the queries on the device, the options, the bounds' ingredients."""

    device: torch.device
    backend: str
    allow_tf32: bool
    int8: bool
    sim_error: float
    queries: torch.Tensor  # [Tq, dim] on the device, in the kernel's input dtype
    query_offsets: np.ndarray
    query_ids: list[str]
    query_norm_sum: np.ndarray  # sum_i |q_i| per query (int8: dequantized), float64
    score_factor: np.ndarray  # e_sim + gamma_Lq per query (int8: 2u + gamma_Lq)
    reference_corpus: Corpus | None
    reference_queries: torch.Tensor | None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kernel(
    ctx: BatchContext,
    queries: torch.Tensor,
    query_offsets: np.ndarray,
    batch: DocBatch,
    candidates: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel on the device: scores and argmax, exactly as `maxsim score` calls it."""
    import maxsim_kernels

    dev = ctx.device
    kwargs: dict[str, Any] = dict(
        return_argmax=True,
        allow_tf32=ctx.allow_tf32,
        backend=ctx.backend,
        doc_scales=None if batch.scales is None else batch.scales.to(dev),
    )
    args = (
        queries,
        torch.from_numpy(query_offsets).to(dev),
        batch.embeddings.to(dev),
        batch.offsets.to(dev),
    )
    try:
        if candidates is None:
            scores, argmax = maxsim_kernels.maxsim_varlen(*args, **kwargs)
        else:
            c_off, c_docs = (torch.from_numpy(x).to(dev) for x in candidates)
            scores, argmax = maxsim_kernels.maxsim_candidates(*args, c_off, c_docs, **kwargs)
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise MaxsimError(f"the kernel refused the inputs: {exc}") from None
    _sync(dev)
    return scores, argmax


def _reference(
    ctx: BatchContext, queries: torch.Tensor, query_offsets: np.ndarray, batch: DocBatch
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None, FloatReference | None]:
    """(float64 scores, float32 scores, argmax, near-tie mask, float pass) of queries x batch."""
    dev = ctx.device
    docs = batch.embeddings.to(dev)
    if ctx.int8:
        from maxsim_kernels.int8_host import maxsim_int8_reference

        assert batch.scales is not None
        score64, argmax = maxsim_int8_reference(
            queries,
            torch.from_numpy(query_offsets),
            docs,
            batch.offsets.to(dev),
            doc_scales=batch.scales.to(dev),
            return_argmax=True,
        )
        return score64, None, argmax, None, None
    ref = float_reference(
        queries, query_offsets, docs, batch.offsets.numpy(), sim_error=ctx.sim_error,
        plain_dtype=yardstick_dtype(queries, dev),
    )  # fmt: skip
    return ref.score64, ref.score32, ref.argmax64, ref.near_tie, ref


def _exact_float_scores(
    ctx: BatchContext,
    corpus: Corpus,
    doc_ids: Sequence[str],
    query_rows: np.ndarray,
    query_offsets: np.ndarray,
) -> np.ndarray:
    """float64 scores of the reference corpus's documents `doc_ids` (quantization impact)."""
    assert ctx.reference_queries is not None
    index = corpus.candidate_index(doc_ids)
    try:
        locations = np.array([index[i] for i in doc_ids], dtype=np.int64).reshape(-1, 2)
    except KeyError as exc:
        raise InputError(
            f"{corpus.paths[0]}: document {exc.args[0]} is not in the reference corpus; "
            "--reference-corpus must hold every scored document (the shards the int8 ones came from)"
        ) from None
    batch = read_locations(corpus, locations)
    queries = ctx.reference_queries[torch.from_numpy(query_rows).to(ctx.device)]
    ref = float_reference(
        queries, query_offsets, batch.embeddings.to(ctx.device), batch.offsets.numpy(), sim_error=0.0
    )
    return ref.score64.cpu().numpy()


def _fold_argmax(
    counters: Counters,
    kernel_arg: torch.Tensor,
    ref_arg: torch.Tensor,
    near_tie: torch.Tensor | None,
    fref: FloatReference | None,
    describe: Callable[[int, int, int, int], dict[str, Any]],
) -> None:
    """Add one batch's argmax agreement: the kernel's against the reference, and (float shards) the
    float32 reference's against float64, with the pairs the float64 pass recomputed."""
    counters.argmax.add(kernel_arg, ref_arg, near_tie, describe)
    if fref is not None:
        counters.float32_argmax.add(fref.argmax32, fref.argmax64, fref.near_tie)
        counters.recomputed += fref.recomputed


def score_all_pairs(
    ctx: BatchContext, corpus: Corpus, selection: np.ndarray, max_tokens: int, counters: Counters
) -> Scored:
    """Every query against the selected documents (corpus-wide numbers), batch by batch."""
    nq = len(ctx.query_ids)
    n = selection.size
    kernel = np.zeros((nq, n))
    ref64 = np.zeros((nq, n))
    ref32 = None if ctx.int8 else np.zeros((nq, n))
    ref_plain: np.ndarray | None = None
    quant = None if ctx.reference_corpus is None else np.zeros((nq, n))
    allowed = np.zeros((nq, n))
    all_rows = np.arange(ctx.queries.shape[0])
    token_query = np.repeat(np.arange(nq), np.diff(ctx.query_offsets))
    token_local = all_rows - ctx.query_offsets[token_query]
    col = 0
    for docs in batches_of(corpus, selection, max_tokens):
        batch = read_locations(corpus, locations_of(corpus, docs))
        cols = slice(col, col + docs.size)
        t0 = time.perf_counter()
        k_scores, k_arg = _kernel(ctx, ctx.queries, ctx.query_offsets, batch)
        t1 = time.perf_counter()
        score64, score32, r_arg, near_tie, fref = _reference(ctx, ctx.queries, ctx.query_offsets, batch)
        _sync(ctx.device)
        t2 = time.perf_counter()
        counters.kernel_s += t1 - t0
        counters.reference_s += t2 - t1
        kernel[:, cols] = k_scores.double().cpu().numpy()
        ref64[:, cols] = score64.cpu().numpy()
        if ref32 is not None and score32 is not None:
            ref32[:, cols] = score32.double().cpu().numpy()
        if fref is not None and fref.score_plain is not None:
            if ref_plain is None:
                ref_plain = np.zeros((nq, n))
            ref_plain[:, cols] = fref.score_plain.double().cpu().numpy()
        doc_norm = segment_max(dequantized_norms(batch.embeddings, batch.scales), batch.offsets.numpy())
        allowed[:, cols] = (ctx.score_factor * ctx.query_norm_sum)[:, None] * doc_norm.numpy()[None, :]
        ids = batch.ids

        def describe(token: int, doc: int, got: int, want: int, ids: list[str] = ids) -> dict[str, Any]:
            q = int(token_query[token])
            return {
                "qid": ctx.query_ids[q],
                "query_token": int(token_local[token]),
                "docno": ids[doc],
                "kernel_argmax": got,
                "reference_argmax": want,
            }

        _fold_argmax(counters, k_arg, r_arg, near_tie, fref, describe)
        if quant is not None:
            t3 = time.perf_counter()
            quant[:, cols] = _exact_float_scores(
                ctx, ctx.reference_corpus, batch.ids, all_rows, ctx.query_offsets
            )
            counters.quantization_s += time.perf_counter() - t3
        col += docs.size
        counters.advance(nq * docs.size)
    return Scored(
        docs=[selection] * nq,
        kernel=list(kernel),
        ref64=list(ref64),
        ref32=None if ref32 is None else list(ref32),
        allowed=list(allowed),
        quant_ref=None if quant is None else list(quant),
        ref_plain=None if ref_plain is None else list(ref_plain),
    )


def score_candidates(
    ctx: BatchContext,
    corpus: Corpus,
    per_query: list[np.ndarray],
    max_tokens: int,
    counters: Counters,
) -> Scored:
    """Each query against its own candidates (corpus-wide numbers), queries grouped under `max_tokens`."""
    nq = len(ctx.query_ids)
    lengths = np.concatenate([np.diff(s.offsets) for s in corpus.shards])
    out_kernel: list[np.ndarray] = [np.zeros(0)] * nq
    out64: list[np.ndarray] = [np.zeros(0)] * nq
    out32: list[np.ndarray] = [np.zeros(0)] * nq
    out_plain: list[np.ndarray] = [np.zeros(0)] * nq
    has_plain = False
    outq: list[np.ndarray] = [np.zeros(0)] * nq
    allowed: list[np.ndarray] = [np.zeros(0)] * nq
    q = 0
    while q < nq:
        # a group of consecutive queries whose distinct candidates fit the token budget
        group = [q]
        pool = set(per_query[q].tolist())
        q += 1
        while q < nq:
            grown = pool | set(per_query[q].tolist())
            if int(lengths[np.fromiter(grown, np.int64)].sum()) > max_tokens:
                break
            pool = grown
            group.append(q)
            q += 1
        pool_docs = np.array(sorted(pool), dtype=np.int64)
        batch = read_locations(corpus, locations_of(corpus, pool_docs))
        chosen = np.array(group)
        rows, g_offsets = rows_of(ctx.query_offsets, chosen)
        queries = ctx.queries[torch.from_numpy(rows).to(ctx.device)]
        cand = [np.searchsorted(pool_docs, per_query[g]) for g in group]
        c_off = np.concatenate([[0], np.cumsum([c.size for c in cand])]).astype(np.int64)
        c_docs = np.concatenate(cand).astype(np.int64) if cand else np.zeros(0, np.int64)
        t0 = time.perf_counter()
        k_scores, k_arg = _kernel(ctx, queries, g_offsets, batch, (c_off, c_docs))
        counters.kernel_s += time.perf_counter() - t0
        k_scores = k_scores.double().cpu().numpy()
        pool_offsets = batch.offsets.numpy()
        doc_norm = segment_max(dequantized_norms(batch.embeddings, batch.scales), pool_offsets).numpy()
        for i, g in enumerate(group):
            picked = cand[i]
            if picked.size == 0:
                continue
            sub = batch_subset(batch, picked)
            q_rows = np.arange(g_offsets[i], g_offsets[i + 1])
            q_off = np.array([0, q_rows.size], dtype=np.int64)
            q_vals = queries[torch.from_numpy(q_rows).to(ctx.device)]
            t1 = time.perf_counter()
            score64, score32, r_arg, near_tie, fref = _reference(ctx, q_vals, q_off, sub)
            _sync(ctx.device)
            counters.reference_s += time.perf_counter() - t1
            out_kernel[g] = k_scores[c_off[i] : c_off[i + 1]]
            out64[g] = score64[0].cpu().numpy()
            if score32 is not None:
                out32[g] = score32[0].double().cpu().numpy()
            if fref is not None and fref.score_plain is not None:
                out_plain[g] = fref.score_plain[0].double().cpu().numpy()
                has_plain = True
            allowed[g] = ctx.score_factor[g] * ctx.query_norm_sum[g] * doc_norm[picked]
            kernel_arg = k_arg[c_off[i] : c_off[i + 1], : q_rows.size].T
            ids = sub.ids

            def describe(
                token: int, doc: int, got: int, want: int, ids: list[str] = ids, g: int = g
            ) -> dict[str, Any]:
                return {
                    "qid": ctx.query_ids[g],
                    "query_token": token,
                    "docno": ids[doc],
                    "kernel_argmax": got,
                    "reference_argmax": want,
                }

            _fold_argmax(counters, kernel_arg, r_arg, near_tie, fref, describe)
            if ctx.reference_corpus is not None:
                t3 = time.perf_counter()
                outq[g] = _exact_float_scores(
                    ctx, ctx.reference_corpus, sub.ids, np.arange(*ctx.query_offsets[g : g + 2]), q_off
                )[0]
                counters.quantization_s += time.perf_counter() - t3
        counters.advance(int(c_off[-1]))
    return Scored(
        docs=per_query,
        kernel=out_kernel,
        ref64=out64,
        ref32=None if ctx.int8 else out32,
        allowed=allowed,
        quant_ref=None if ctx.reference_corpus is None else outq,
        ref_plain=out_plain if has_plain else None,
    )
