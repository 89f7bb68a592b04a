"""MaxSim from torch ops in memory-bounded blocks: the CPU backend (every core), also valid on CUDA.

    score(q, d) = sum_i max_j <q_i, d_j>

Plan. Documents are sorted by length and cut into groups of consecutive lengths holding at most
`_GROUP_TOKENS` padded tokens. A group of n documents with longest length L is gathered into an
[n * L, dim] fp32 block in which position l >= len of a document holds a copy of its last token: a
duplicate cannot change a max, so the padding needs no mask at all (and an argmax that lands on a copy
is mapped back to len - 1, the token it copies). One matrix product of the block with all query tokens
(or `_QUERY_ROWS` of them at a time) gives the similarities [n * L, Tq]; a max over L of the
[n, L, Tq] view gives each token's max per document, and an index_add over query tokens gives the
scores of every query at once. Sorting keeps the padding small (uniform lengths 20-300 in groups of
consecutive lengths pad by ~1%), and the matrix product is large enough to run at the BLAS rate.

Precision: fp16/bf16 inputs are upcast to fp32 in blocks and everything accumulates in fp32 (float64
inputs stay float64). Cost: 2 * Tq * Td' * dim FLOPs with Td' the padded token count, one read of the
documents, and n * L * Tq similarities that stay in cache-sized blocks.
A document with no tokens scores -inf and has argmax -1.

Checking values on the way (``check_finite``): a document token with a NaN or +-Inf component has a
non-finite similarity with *every* finite query token (x * NaN = NaN, 0 * Inf = NaN, x * Inf = +-Inf for
x != 0, and a non-finite term keeps the fp32 sum non-finite), so the similarities of one query token,
already computed, find every such token: `NonFiniteDocuments` is raised. Within fp16's range finite
tokens cannot overflow the fp32 sum (|q . d| <= dim * 65504^2); larger finite values (bf16, fp32) can,
which raises the same error on finite values: a caller that needs to tell the two apart checks those
documents' values itself.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ._validate import Layout, check_candidates, check_inputs

# Padded document tokens per group and query tokens per matrix product. Measured on the 2-core dev
# machine (Xeon with AVX-512, torch 2.13, fp32, dim 128), 64 queries x 32 tokens against 4000 documents
# of 20-300 tokens, 4 interleaved rounds, best / median (sgemm 4096^3 at 317-324 GFLOP/s in the same
# process): groups x rows = 2048 x 512 -> 1.69 / 1.72 s (200 GFLOP/s), 2048 x 256 1.64 / 1.74,
# 4096 x 128 1.67 / 1.77, 1024 x 1024 1.72 / 1.77, 1024 x 512 1.72-1.75 / 1.77-1.79, 512 x 1024 1.95 /
# 1.96, 512 x 2048 (the previous choice, from a run when other jobs held the cores) 1.88-1.93 / 1.95-2.01,
# 256 x 512 2.19 / 2.28: about 1M similarities a block, with longer document groups. (An earlier sweep
# on 1000 documents, with other jobs on the cores and sgemm at 90 GFLOP/s, ranked them otherwise:
# 512 x 2048 81 GFLOP/s, 2048 x 2048 58, 2048 x 512 18.)
_GROUP_TOKENS = 2048
_QUERY_ROWS = 512


# Few query tokens (one query, or a handful): stream the documents in their packed order instead, with
# no gather: S = D_chunk . Q^T [chunk, Tq] (the orientation of the blocked path, so the similarities are
# the same bits) and a scatter max of each token row into its document's row, chunks spread over one
# thread per core. Below _STREAM_MAX_ROWS query rows this reads the documents once and touches Tq floats
# per token, against dim floats per token for the gather of the blocked path. Measured on the 2-core dev
# machine, 1 query x 4000 documents of 20-300 tokens, fp32, 12 interleaved rounds (medians): 16K-token
# chunks with S^T = Q . D^T and np.maximum.reduceat 69.4 ms, 32K 64.0, 64K 67.3; this path with 32K
# chunks 62.7 ms (sgemm on cold [chunk, 128] x [128, 32] runs at ~130 GFLOP/s, 40% of the 4096^3 rate,
# and is ~75% of the time; the scatter max ~15%).
_STREAM_MAX_ROWS = 128
_STREAM_CHUNK_TOKENS = 32768

# Batch invariance: MKL's sgemm switches to other kernels, with other summation orders along dim, when
# either operand has fewer than ~8 rows (seen with torch 2.13 on AVX-512: 1 x 50, 3 x 7, 300 x 5 and
# 2 x 3000 products differ in the last bit from the same rows inside a large product; from 8 rows on
# they agree). Padding both operands to _MIN_GEMM_ROWS rows makes a similarity independent of which
# other queries and documents share its product, so scores do not depend on batch sizes or budgets.
_MIN_GEMM_ROWS = 16


# The stream's worker threads live across calls: starting two threads took ~4 ms of a 63 ms call (1 query
# x 4000 documents, 2-core dev machine). A new pool when torch's thread count changes, and in a forked
# child (which has none of the parent's threads). One worker a core, each running its products on one
# thread (torch's thread count is per thread): otherwise every worker's product opens an OpenMP team as
# wide as the machine and the cores are oversubscribed; 52.4 / 55.6 ms best / median against 58.9 / 62.7
# (12 interleaved rounds, maxsim-cpu 92.2 / 96.1 in the same rounds).
_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (workers, pool)
_POOL_LOCK = threading.Lock()


def _stream_pool(workers: int) -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != workers:
            if _POOL is not None:
                _POOL[1].shutdown(wait=False)
            _POOL = (
                workers,
                ThreadPoolExecutor(
                    workers, thread_name_prefix="maxsim-cpu", initializer=torch.set_num_threads, initargs=(1,)
                ),
            )
        return _POOL[1]


def _forget_pool_after_fork() -> None:
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


class NonFiniteDocuments(ValueError):
    """A document token's similarities are NaN or Inf: it holds NaN/Inf values (or, for bf16 and fp32
    documents, values so large that the fp32 sum overflows). Raised by ``check_finite``."""


def _require_finite(similarities: torch.Tensor) -> None:
    """One query token's similarities with a set of document tokens (any shape) must all be finite."""
    if not bool(torch.isfinite(similarities).all()):
        raise NonFiniteDocuments(
            "a document token has NaN or Inf similarities: its embedding holds NaN or Inf values"
        )


def _similarities(a: torch.Tensor, b_t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a [m, dim] . b_t [dim, n] as a contiguous [m, n], computed identically whatever m and n are
    (into ``out``, a contiguous [m, n], when given and no padding is needed).

    The right operand comes transposed and contiguous (the query tokens as columns): MKL multiplies
    [n_tokens, 128] x [128, 32] 2-8% faster that way than through a transposed view (2-core dev machine,
    1 query x 4000 documents, 12 interleaved rounds: 56.8 / 59.0 ms best / median against 58.2 / 64.2)."""
    m, n = a.shape[0], b_t.shape[1]
    if m >= _MIN_GEMM_ROWS and n >= _MIN_GEMM_ROWS and out is not None:
        return torch.mm(a, b_t, out=out)
    if m < _MIN_GEMM_ROWS:
        a = torch.cat([a, a.new_zeros(_MIN_GEMM_ROWS - m, a.shape[1])])
    if n < _MIN_GEMM_ROWS:
        b_t = torch.cat([b_t, b_t.new_zeros(b_t.shape[0], _MIN_GEMM_ROWS - n)], dim=1)
    product = torch.mm(a, b_t)
    return product if product.shape == (m, n) else product[:m, :n].contiguous()


# Each stream worker's upcast chunk and similarity block live in buffers kept per thread (2 x 16 MB
# at 32K tokens, d = 128, 128 query tokens): fresh 16 MB tensors were mapped and unmapped by malloc on
# every chunk, a page fault per 4 KB each time. 1 GB of fp16 documents, 4 queries, 2 cores, interleaved
# (benchmarks/ab_cpu_score.py, results/cpu-score-ab.txt): from memory 1.31-1.73 s -> 1.04-1.34 s.
_SCRATCH = threading.local()


def _scratch(name: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous [rows, cols] view of this thread's reusable buffer ``name`` (grown when too small)."""
    need = shape[0] * shape[1]
    buf = getattr(_SCRATCH, name, None)
    if buf is None or buf.dtype != dtype or buf.numel() < need:
        buf = torch.empty(need, dtype=dtype)
        setattr(_SCRATCH, name, buf)
    return buf[:need].view(shape)


def _score_stream(
    q: torch.Tensor,
    q_offsets: np.ndarray,
    docs: torch.Tensor,
    d_offsets: np.ndarray,
    scores: torch.Tensor,
    check_finite: bool = False,
) -> None:
    """All documents in packed order (CPU tensors, no argmax): fills scores [nq, nd]."""
    lens = np.diff(d_offsets)
    nd = len(lens)
    out = scores.numpy()
    out[:, lens == 0] = -np.inf
    # chunk boundaries (document indices) of about _STREAM_CHUNK_TOKENS tokens each
    cuts = np.searchsorted(d_offsets, np.arange(0, d_offsets[-1], _STREAM_CHUNK_TOKENS), side="right") - 1
    bounds = np.unique(np.concatenate([cuts, [nd]]))
    nq = len(q_offsets) - 1
    token_query = torch.from_numpy(np.repeat(np.arange(nq), np.diff(q_offsets)))
    q_t = q.T.contiguous()

    def work(a: int, b: int) -> None:
        t0, t1 = int(d_offsets[a]), int(d_offsets[b])
        full = np.flatnonzero(lens[a:b] > 0) + a
        if t1 == t0 or len(full) == 0:
            return
        chunk = docs[t0:t1]
        if chunk.dtype != q.dtype:  # upcast into this thread's buffer
            chunk = _scratch("chunk", tuple(chunk.shape), q.dtype).copy_(chunk)
        # [tokens, Tq], as the blocked path computes it
        sim = _similarities(chunk, q_t, out=_scratch("sim", (t1 - t0, q_t.shape[1]), q.dtype))
        if check_finite:
            _require_finite(sim[:, 0])
        owner = torch.from_numpy(np.repeat(np.arange(b - a), lens[a:b]))[:, None].expand(-1, sim.shape[1])
        best = sim.new_full((b - a, sim.shape[1]), -torch.inf).scatter_reduce_(0, owner, sim, "amax")
        best = best[torch.from_numpy(full - a)]  # [docs, Tq]
        # the same sequential sum over query tokens as the blocked path (np.add.reduceat sums in
        # another order), so a score does not depend on which path its batch took
        out[:, full] = best.new_zeros(len(full), nq).index_add_(1, token_query, best).T.numpy()

    list(_stream_pool(max(1, torch.get_num_threads())).map(work, bounds[:-1], bounds[1:]))


def _groups(lens: np.ndarray, group_tokens: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Non-empty documents sorted by length, cut into runs whose padded size n * L_max <= group_tokens."""
    order = np.argsort(lens, kind="stable")
    order = order[lens[order] > 0]
    sorted_lens = lens[order]
    spans = []
    start, count = 0, len(order)
    while start < count:
        # a run [start, start + k) pads to sorted_lens[start + k - 1]: take the largest k that fits
        limit = min(count - start, max(1, group_tokens // int(sorted_lens[start])))
        k = np.arange(1, limit + 1)
        fits = int(np.count_nonzero(k * sorted_lens[start : start + limit] <= group_tokens))
        stop = start + max(1, fits)
        spans.append((start, stop))
        start = stop
    return order, spans


def _score_docs(
    q: torch.Tensor,
    token_query: torch.Tensor,
    num_queries: int,
    docs: torch.Tensor,
    doc_scales: torch.Tensor | None,
    starts: np.ndarray,
    lens: np.ndarray,
    scores: torch.Tensor,
    argmax: torch.Tensor | None,
    check_finite: bool = False,
) -> None:
    """Fill scores[:, k] (and argmax[:, k]) for the documents k with rows [starts[k], starts[k] + lens[k]).

    `q` [Tq, dim] is already in the compute dtype; `token_query` [Tq] maps each query token to its query.
    """
    compute, device = q.dtype, q.device
    tq = q.shape[0]
    order, spans = _groups(lens, _GROUP_TOKENS)
    q_t_blocks = [q[r0 : r0 + _QUERY_ROWS].T.contiguous() for r0 in range(0, tq, _QUERY_ROWS)]
    scores[:, torch.from_numpy(np.flatnonzero(lens == 0)).to(device)] = -torch.inf
    for lo, hi in spans:
        picked = torch.from_numpy(order[lo:hi]).to(device)
        g_lens = lens[order[lo:hi]]
        width = int(g_lens[-1])
        rows = starts[order[lo:hi], None] + np.minimum(np.arange(width)[None, :], g_lens[:, None] - 1)
        rows_t = torch.from_numpy(rows.reshape(-1)).to(device)
        block = docs.index_select(0, rows_t).to(compute)
        if doc_scales is not None:
            block *= doc_scales.index_select(0, rows_t).to(compute)[:, None]
        n = len(picked)
        best = torch.empty(n, tq, dtype=compute, device=device)
        for r0, q_t in zip(range(0, tq, _QUERY_ROWS), q_t_blocks, strict=True):
            r1 = min(tq, r0 + _QUERY_ROWS)
            sim = _similarities(block, q_t).view(n, width, r1 - r0)
            if check_finite and r0 == 0:
                _require_finite(sim[:, :, 0])
            if argmax is None:
                torch.amax(sim, dim=1, out=best[:, r0:r1])
            else:
                vals, idx = sim.max(dim=1)
                best[:, r0:r1] = vals
                last = torch.from_numpy(g_lens - 1).to(device)[:, None]
                argmax[r0:r1, picked] = torch.minimum(idx, last).T.to(torch.int32)
        per_query = torch.zeros(n, num_queries, dtype=compute, device=device).index_add_(1, token_query, best)
        scores[:, picked] = per_query.T.to(scores.dtype)


def _compute_dtype(queries: torch.Tensor) -> torch.dtype:
    return torch.float64 if queries.dtype == torch.float64 else torch.float32


def maxsim_varlen_cpu(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    *,
    return_argmax: bool = False,
    doc_scales: torch.Tensor | None = None,
    layout: Layout | None = None,
    check_finite: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Every query against every document with torch ops: fp32 scores [nq, nd] (+ int32 argmax [Tq, nd]).

    Float documents only (int8 documents go through `maxsim_kernels.maxsim_int8`); `doc_scales`, when
    given, multiplies each document token before the max. Pass a `layout` from `check_inputs` to skip
    the checks. ``check_finite``: raise `NonFiniteDocuments` if a document token holds NaN/Inf (see the
    module docstring; the queries must be finite).
    """
    if layout is None:
        layout = check_inputs(
            queries, query_offsets, docs, doc_offsets, doc_scales=doc_scales, allow_float64=True
        )
    compute = _compute_dtype(queries)
    out_dtype = torch.float64 if compute == torch.float64 else torch.float32
    nq, nd = layout.num_queries, layout.num_docs
    device = docs.device
    scores = torch.zeros(nq, nd, dtype=out_dtype, device=device)
    argmax = (
        torch.full((queries.shape[0], nd), -1, dtype=torch.int32, device=device) if return_argmax else None
    )
    stream = (
        device.type == "cpu"
        and not return_argmax
        and doc_scales is None
        and queries.shape[0] <= _STREAM_MAX_ROWS
    )
    if nq and nd and stream:
        _score_stream(
            queries.to(compute).contiguous(), layout.q_offsets, docs, layout.d_offsets, scores, check_finite
        )
    elif nq and nd:
        token_query = torch.from_numpy(np.repeat(np.arange(nq), layout.q_lens)).to(device)
        _score_docs(
            queries.to(compute).contiguous(),
            token_query,
            nq,
            docs,
            doc_scales,
            layout.d_offsets[:-1],
            layout.d_lens,
            scores,
            argmax,
            check_finite,
        )
    return (scores, argmax) if return_argmax else scores


def maxsim_candidates_cpu(
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
    """Query i against candidate_docs[candidate_offsets[i]:candidate_offsets[i+1]] with torch ops.

    Returns fp32 scores [C] (+ int32 argmax [C, max_query_len], -1 past a query's length). Documents are
    read in place through their indices; each query's candidates are scored as one block problem.
    ``check_finite`` as in `maxsim_varlen_cpu` (for the candidates' tokens).
    """
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
