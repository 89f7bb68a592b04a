"""Autograd MaxSim: a deterministic, atomic-free backward through the inverse of the forward argmax.

Math
----
Packed ragged layout: query ``q`` owns the token rows ``Q_i``, ``i in [qo[q], qo[q+1])``; document ``d`` owns
``D_j``, ``j in [do[d], do[d+1])``. The forward computes, for every scored pair,

    S[q, d]   = sum_{i in q} <Q_i, D_{a(i, d)}>,      a(i, d) = argmax_{j in d} <Q_i, D_j>

(all pairs: ``S`` is ``[nq, nd]``; per-query candidates: pair ``c`` joins query ``q_c`` with document
``d_c`` and ``S`` is ``[C]``). With the upstream gradient ``G = dL/dS`` the gradients are

    dL/dQ_i = sum_{d}                  G[q(i), d] * D_{a(i, d)}         (gather: one row per pair)
    dL/dD_j = sum_{(i, d): a(i,d) = j} G[q(i), d] * Q_i                 (reduce through the inverse map)

Only the argmax ``a`` (int32, the winning token's index *within* its document) and the offsets are kept
from the forward; the similarity tensor is never stored.

Subgradient at ties: ``max`` is not differentiable where two document tokens tie for a query token. We
route the whole gradient to the token the forward's argmax picked, the lowest index among the tied ones
(torch autograd of ``amax`` splits it evenly among them instead; both are valid subgradients).

Inverse map (CSR) and determinism
---------------------------------
Every pair ``p`` (a query token and a scored document) has a key ``k(p)``: the global row of its winning
document token. A stable sort of the keys (``torch.sort(stable=True)``, a radix sort on CUDA, itself
deterministic) gives ``order``, the pair indices grouped by key and increasing within a group;
``row_ptr[j] = #{p : k(p) < j}`` (``searchsorted``). One program per document token ``j`` sums
``G * Q_i`` over ``order[row_ptr[j] : row_ptr[j+1]]`` in that fixed order with fp32 accumulators and
writes its row once, in the input dtype: no atomics, no fp32 gradient buffer, and the same bits from run
to run. For all pairs a document's pairs only ever land on its own tokens, so the CSR is built for a chunk
of documents at a time (at most _CSR_PAIRS_PER_CHUNK pairs), which bounds the sort's scratch memory.
The query gradient is owned by query-token blocks, which loop over the documents in index order.
A document token that no query token chose gets an exact zero row.

INT8 documents (``doc_scales``): ``D_j = s_j * d8_j``; the query gradient uses the dequantized rows (the
forward's on-the-fly query quantization is passed straight through), and int8 documents get no gradient.
Float64 inputs (used by ``torch.autograd.gradcheck``) are scored by the package's float64 reference
(``maxsim_reference``) and return float64 scores; every other dtype returns fp32 scores, as the forward does.

Cost, with P the number of scored (query token, document) pairs (Tq * nd for all pairs): the backward
gathers P document rows (dQ) and P query rows (dD), 2 * P * dim * bytes, mostly from L2 at training batch
sizes, plus a radix sort of P int32 keys; memory beyond the two gradients is the forward's int32 argmax
(4 B a pair) and one chunk's CSR.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

# --- tuning constants ------------------------------------------------------------------------------
# Query-gradient kernel: a program owns _DQ_BLOCK_T query tokens and gathers _DQ_BLOCK_C winning rows
# per token per step ([T, C, dim] in flight, which is what hides the gather latency).
_DQ_BLOCK_T = 8
_DQ_BLOCK_C = 8
_DQ_NUM_WARPS = 4
# Document-gradient kernel: one program per document token; it reads its CSR entries _DD_BLOCK_E at a
# time (the mean list length is (query tokens x docs) / doc tokens: 23 for ColBERT 128x32 vs 180-token
# docs, 32 for ColPali 32x1024 vs 1024-token docs).
_DD_BLOCK_E = 16
_DD_NUM_WARPS = 2
# Pairs per inverse-CSR build (all pairs): the sort's transient (int32 keys in and out, int64 order, CUB
# scratch: ~36 B a pair) stays near 9 MiB at 2^18 pairs.
_CSR_PAIRS_PER_CHUNK = 1 << 18
# Columns per program: a wider vector is split over a grid axis, so the register tiles stay at the size of
# the measured dim-128 case whatever the dim (up to 4096).
_MAX_BLOCK_DIM = 128
# Torch path: pairs gathered per step, bounding the [pairs, dim] fp32 temporaries to ~64 MiB at dim 128.
_TORCH_PAIRS_PER_STEP = 1 << 17

_BACKENDS = ("auto", "triton", "torch")


# =====================================================================================================
# Triton kernels
# =====================================================================================================


@triton.jit
def _maxsim_grad_queries_kernel(
    # pointers
    docs_ptr,
    doc_scales_ptr,
    doc_offsets_ptr,
    argmax_ptr,
    grad_scores_ptr,
    query_offsets_ptr,
    token_query_ptr,
    candidate_offsets_ptr,
    candidate_docs_ptr,
    grad_queries_ptr,
    # sizes
    num_query_tokens,
    num_docs,
    max_query_len,
    dim,
    # strides
    stride_doc_token,
    stride_grad_token,
    # meta
    CANDIDATES: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    """dQ_i = sum over the scored documents d of G[q(i), d] * D[a(i, d)], documents in index order.

    All pairs: program (b, 0, k) owns global query tokens [b*BLOCK_T, (b+1)*BLOCK_T) (they may belong to
    several queries; token_query maps each to its query). Candidates: program (q, b, k) owns tokens
    [b*BLOCK_T, (b+1)*BLOCK_T) of query q and loops over q's candidates. k picks BLOCK_DIM columns.
    """
    dims = tl.program_id(2) * BLOCK_DIM + tl.arange(0, BLOCK_DIM)
    dim_ok = dims < dim
    cols = tl.arange(0, BLOCK_C)
    if CANDIDATES:
        query = tl.program_id(0)
        local = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        q_start = tl.load(query_offsets_ptr + query)
        q_end = tl.load(query_offsets_ptr + query + 1)
        tokens = q_start + local
        token_ok = tokens < q_end
        col_start = tl.load(candidate_offsets_ptr + query)
        col_end = tl.load(candidate_offsets_ptr + query + 1)
    else:
        tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        token_ok = tokens < num_query_tokens
        token_query = tl.load(token_query_ptr + tokens, mask=token_ok, other=0).to(tl.int64)
        col_start = 0
        col_end = num_docs

    acc = tl.zeros([BLOCK_T, BLOCK_DIM], dtype=tl.float32)
    for col0 in range(col_start, col_end, BLOCK_C):
        col = (col0 + cols).to(tl.int64)
        col_ok = col < col_end
        pair_ok = token_ok[:, None] & col_ok[None, :]
        if CANDIDATES:
            doc = tl.load(candidate_docs_ptr + col, mask=col_ok, other=0)
            weight = tl.load(grad_scores_ptr + col, mask=col_ok, other=0.0)[None, :]
            winner = tl.load(
                argmax_ptr + col[None, :] * max_query_len + local[:, None], mask=pair_ok, other=-1
            )
        else:
            doc = col
            weight = tl.load(
                grad_scores_ptr + token_query[:, None] * num_docs + col[None, :], mask=pair_ok, other=0.0
            )
            winner = tl.load(argmax_ptr + tokens[:, None] * num_docs + col[None, :], mask=pair_ok, other=-1)
        doc_start = tl.load(doc_offsets_ptr + doc, mask=col_ok, other=0)
        hit = pair_ok & (winner >= 0)
        row = doc_start[None, :] + winner.to(tl.int64)
        weight = tl.where(hit, weight, 0.0)
        if HAS_SCALES:
            weight = weight * tl.load(doc_scales_ptr + row, mask=hit, other=0.0)
        vals = tl.load(
            docs_ptr + row[:, :, None] * stride_doc_token + dims[None, None, :],
            mask=hit[:, :, None] & dim_ok[None, None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(vals * weight[:, :, None], axis=1)

    out = grad_queries_ptr + tokens.to(tl.int64)[:, None] * stride_grad_token + dims[None, :]
    tl.store(out, acc.to(grad_queries_ptr.dtype.element_ty), mask=token_ok[:, None] & dim_ok[None, :])


@triton.jit
def _maxsim_grad_docs_kernel(
    # pointers
    queries_ptr,
    grad_scores_ptr,
    order_ptr,
    row_ptr_ptr,
    token_query_ptr,
    query_offsets_ptr,
    candidate_query_ptr,
    grad_docs_ptr,
    # sizes
    num_docs,
    first_doc,
    chunk_docs,
    max_query_len,
    dim,
    # strides
    stride_query_token,
    stride_grad_token,
    # meta
    CANDIDATES: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    """dD_j = sum over the CSR list of doc token j of G[pair] * Q[query token of pair], in list order.

    A list entry is a flat pair index. All pairs, built per chunk of documents [first_doc, first_doc +
    chunk_docs): p = i * chunk_docs + (d - first_doc), over argmax[:, chunk] ([Tq, chunk_docs]), and
    G[q, d] at q * num_docs + d. Candidates: p = c * max_query_len + t (argmax [C, max_query_len]), query
    token qo[q_c] + t. Program (j, k) writes columns [k*BLOCK_DIM, (k+1)*BLOCK_DIM) of row j (rows and
    row_ptr relative to the chunk's first document token).
    """
    token = tl.program_id(0).to(tl.int64)
    dims = tl.program_id(1) * BLOCK_DIM + tl.arange(0, BLOCK_DIM)
    dim_ok = dims < dim
    start = tl.load(row_ptr_ptr + token)
    end = tl.load(row_ptr_ptr + token + 1)
    acc = tl.zeros([BLOCK_E, BLOCK_DIM], dtype=tl.float32)
    for e0 in range(start, end, BLOCK_E):
        entry = e0 + tl.arange(0, BLOCK_E)
        entry_ok = entry < end
        pair = tl.load(order_ptr + entry, mask=entry_ok, other=0)
        if CANDIDATES:
            cand = pair // max_query_len
            query = tl.load(candidate_query_ptr + cand, mask=entry_ok, other=0)
            qtok = tl.load(query_offsets_ptr + query, mask=entry_ok, other=0) + (pair - cand * max_query_len)
            weight = tl.load(grad_scores_ptr + cand, mask=entry_ok, other=0.0)
        else:
            qtok = pair // chunk_docs
            doc = first_doc + (pair - qtok * chunk_docs)
            query = tl.load(token_query_ptr + qtok, mask=entry_ok, other=0).to(tl.int64)
            weight = tl.load(grad_scores_ptr + query * num_docs + doc, mask=entry_ok, other=0.0)
        rows = tl.load(
            queries_ptr + qtok[:, None] * stride_query_token + dims[None, :],
            mask=entry_ok[:, None] & dim_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += rows * weight[:, None]
    out = tl.sum(acc, axis=0)
    tl.store(
        grad_docs_ptr + token * stride_grad_token + dims, out.to(grad_docs_ptr.dtype.element_ty), mask=dim_ok
    )


# =====================================================================================================
# Host side: layout helpers, inverse CSR, launchers
# =====================================================================================================


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    return backend


def _owner_of(offsets: torch.Tensor, count: int) -> torch.Tensor:
    """Segment index of each of ``count`` items for CSR ``offsets`` (int32 [count]); no host sync."""
    items = torch.arange(count, device=offsets.device, dtype=offsets.dtype)
    return (torch.searchsorted(offsets, items, right=True) - 1).to(torch.int32)


def _pair_keys(
    argmax: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_docs: torch.Tensor | None,
    num_doc_tokens: int,
) -> torch.Tensor:
    """Global winning document row of every pair, flattened in argmax order; ``num_doc_tokens`` where none.

    All pairs: argmax [Tq, nd], key = do[d] + a. Candidates: argmax [C, L], key = do[cand_docs[c]] + a.
    int32 keys when they fit (half the radix-sort passes of int64).
    """
    key_dtype = torch.int32 if num_doc_tokens < 2**31 - 1 else torch.int64
    starts = doc_offsets[:-1] if candidate_docs is None else doc_offsets[candidate_docs]
    starts = starts.to(key_dtype)
    # built in place in one pair-sized row-major buffer (argmax may be a column slice)
    keys = argmax.to(key_dtype, memory_format=torch.contiguous_format, copy=True)
    keys += starts[None, :] if candidate_docs is None else starts[:, None]
    keys.masked_fill_(argmax < 0, num_doc_tokens)
    return keys.reshape(-1)


def build_inverse_csr(keys: torch.Tensor, num_doc_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of the argmax map: ``(row_ptr int64 [Td+1], order int64 [E])``.

    ``order[row_ptr[j]:row_ptr[j+1]]`` are the flat pair indices whose winning row is ``j``, increasing.
    Keys equal to ``num_doc_tokens`` (no winner) sort last and fall outside every row. Built with a stable
    sort and a binary search, both deterministic on CUDA and CPU.
    """
    sorted_keys, order = torch.sort(keys, stable=True)
    bounds = torch.arange(num_doc_tokens + 1, device=keys.device, dtype=keys.dtype)
    row_ptr = torch.searchsorted(sorted_keys, bounds)
    return row_ptr, order


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _grad_queries_triton(
    docs: torch.Tensor,
    doc_scales: torch.Tensor | None,
    doc_offsets: torch.Tensor,
    argmax: torch.Tensor,
    grad_scores: torch.Tensor,
    query_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor | None,
    candidate_docs: torch.Tensor | None,
    num_query_tokens: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    dim = docs.shape[1]
    grad_queries = torch.empty((num_query_tokens, dim), device=docs.device, dtype=out_dtype)
    if num_query_tokens == 0:
        return grad_queries
    num_queries = query_offsets.numel() - 1
    candidates = candidate_docs is not None
    block_dim = min(_next_pow2(dim), _MAX_BLOCK_DIM)
    dim_blocks = triton.cdiv(dim, block_dim)
    if candidates:
        max_query_len = argmax.shape[1]
        num_docs = 0
        token_query = query_offsets  # unused
        grid = (num_queries, triton.cdiv(max(max_query_len, 1), _DQ_BLOCK_T), dim_blocks)
    else:
        max_query_len = 0
        num_docs = argmax.shape[1]
        token_query = _owner_of(query_offsets, num_query_tokens)
        grid = (triton.cdiv(num_query_tokens, _DQ_BLOCK_T), 1, dim_blocks)
    dummy = doc_offsets
    _maxsim_grad_queries_kernel[grid](
        docs,
        doc_scales if doc_scales is not None else grad_scores,
        doc_offsets,
        argmax,
        grad_scores,
        query_offsets,
        token_query,
        candidate_offsets if candidates else dummy,
        candidate_docs if candidates else dummy,
        grad_queries,
        num_query_tokens,
        num_docs,
        max_query_len,
        dim,
        docs.stride(0),
        grad_queries.stride(0),
        CANDIDATES=candidates,
        HAS_SCALES=doc_scales is not None,
        BLOCK_T=_DQ_BLOCK_T,
        BLOCK_C=_DQ_BLOCK_C,
        BLOCK_DIM=block_dim,
        num_warps=_DQ_NUM_WARPS,
    )
    return grad_queries


def _grad_docs_triton(
    queries: torch.Tensor,
    grad_scores: torch.Tensor,
    argmax: torch.Tensor,
    query_offsets: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor | None,
    candidate_docs: torch.Tensor | None,
    num_doc_tokens: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    dim = queries.shape[1]
    grad_docs = torch.empty((num_doc_tokens, dim), device=queries.device, dtype=out_dtype)
    if num_doc_tokens == 0:
        return grad_docs
    block_dim = min(_next_pow2(dim), _MAX_BLOCK_DIM)

    def reduce(order, row_ptr, out, token_query, candidate_query, num_docs, first_doc, chunk_docs, max_len):
        _maxsim_grad_docs_kernel[(out.shape[0], triton.cdiv(dim, block_dim))](
            queries,
            grad_scores,
            order,
            row_ptr,
            token_query,
            query_offsets,
            candidate_query,
            out,
            num_docs,
            first_doc,
            chunk_docs,
            max_len,
            dim,
            queries.stride(0),
            out.stride(0),
            CANDIDATES=candidate_docs is not None,
            BLOCK_E=_DD_BLOCK_E,
            BLOCK_DIM=block_dim,
            num_warps=_DD_NUM_WARPS,
        )

    if candidate_docs is not None:
        # candidates may share documents, so destinations do not split by candidate: one CSR for all
        keys = _pair_keys(argmax, doc_offsets, candidate_docs, num_doc_tokens)
        row_ptr, order = build_inverse_csr(keys, num_doc_tokens)
        del keys
        candidate_query = _owner_of(candidate_offsets, candidate_docs.numel())
        reduce(order, row_ptr, grad_docs, candidate_query, candidate_query, 0, 0, 1, argmax.shape[1])
        return grad_docs

    # All pairs: doc d's destinations are its own tokens, so the CSR is built per chunk of documents,
    # which bounds the sort's transient memory to ~36 bytes x _CSR_PAIRS_PER_CHUNK.
    num_query_tokens, num_docs = argmax.shape
    token_query = _owner_of(query_offsets, num_query_tokens)
    doc_starts = doc_offsets.tolist()  # one host read; the forward already checked the offsets on the host
    docs_per_chunk = max(1, _CSR_PAIRS_PER_CHUNK // max(num_query_tokens, 1))
    for d0 in range(0, num_docs, docs_per_chunk):
        d1 = min(num_docs, d0 + docs_per_chunk)
        t0, t1 = doc_starts[d0], doc_starts[d1]
        if t1 == t0:
            continue
        keys = _pair_keys(argmax[:, d0:d1], doc_offsets[d0 : d1 + 1] - t0, None, t1 - t0)
        row_ptr, order = build_inverse_csr(keys, t1 - t0)
        del keys
        reduce(order, row_ptr, grad_docs[t0:t1], token_query, token_query, num_docs, d0, d1 - d0, 0)
        del row_ptr, order
    return grad_docs


# =====================================================================================================
# Torch path (CPU backend; also runs on CUDA tensors): same gradients, other summation order
# =====================================================================================================


def _pairs_torch(
    argmax: torch.Tensor,
    query_offsets: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor | None,
    candidate_docs: torch.Tensor | None,
    num_query_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every pair with a winner as (query token, global doc row, index into the flat grad_scores)."""
    device = argmax.device
    if candidate_docs is None:
        num_docs = argmax.shape[1]
        token_query = _owner_of(query_offsets, num_query_tokens).long()
        query_tok = torch.arange(num_query_tokens, device=device)[:, None].expand(-1, num_docs)
        doc = torch.arange(num_docs, device=device)[None, :].expand(num_query_tokens, -1)
        score_idx = token_query[:, None] * num_docs + doc
    else:
        num_cands, max_len = argmax.shape
        cand_query = _owner_of(candidate_offsets, num_cands).long()
        query_tok = query_offsets[cand_query][:, None] + torch.arange(max_len, device=device)[None, :]
        doc = candidate_docs.long()[:, None].expand(-1, max_len)
        score_idx = torch.arange(num_cands, device=device)[:, None].expand(-1, max_len)
    hit = argmax >= 0
    rows = doc_offsets[doc[hit]] + argmax[hit].long()
    return query_tok[hit].long(), rows, score_idx[hit].long()


def _grads_torch(
    queries: torch.Tensor,
    docs: torch.Tensor,
    doc_scales: torch.Tensor | None,
    grad_scores: torch.Tensor,
    argmax: torch.Tensor,
    query_offsets: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor | None,
    candidate_docs: torch.Tensor | None,
    need_queries: bool,
    need_docs: bool,
    acc_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Both gradients by gather + ``index_put_(accumulate=True)`` (sequential on CPU) in ``acc_dtype``."""
    query_tok, rows, score_idx = _pairs_torch(
        argmax, query_offsets, doc_offsets, candidate_offsets, candidate_docs, queries.shape[0]
    )
    weight = grad_scores.reshape(-1).to(acc_dtype)[score_idx]
    dim = queries.shape[1]
    grad_q = (
        torch.zeros((queries.shape[0], dim), device=queries.device, dtype=acc_dtype) if need_queries else None
    )
    grad_d = torch.zeros((docs.shape[0], dim), device=docs.device, dtype=acc_dtype) if need_docs else None
    for s in range(0, rows.numel(), _TORCH_PAIRS_PER_STEP):
        sl = slice(s, s + _TORCH_PAIRS_PER_STEP)
        w = weight[sl, None]
        if grad_q is not None:
            doc_rows = docs[rows[sl]].to(acc_dtype)
            if doc_scales is not None:
                doc_rows = doc_rows * doc_scales[rows[sl]].to(acc_dtype)[:, None]
            grad_q.index_put_((query_tok[sl],), doc_rows * w, accumulate=True)
        if grad_d is not None:
            grad_d.index_put_((rows[sl],), queries[query_tok[sl]].to(acc_dtype) * w, accumulate=True)
    return grad_q, grad_d


# =====================================================================================================
# Forward (scores + argmax) and the float64 path
# =====================================================================================================


def _reference(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor | None,
    candidate_docs: torch.Tensor | None,
    doc_scales: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 scores and lowest-index argmax from the package's reference (materialised similarities)."""
    import maxsim_kernels

    kwargs: dict[str, Any] = dict(dtype=torch.float64, return_argmax=True, doc_scales=doc_scales)
    if candidate_docs is None:
        return maxsim_kernels.maxsim_reference(queries, query_offsets, docs, doc_offsets, **kwargs)
    return maxsim_kernels.maxsim_candidates_reference(
        queries, query_offsets, docs, doc_offsets, candidate_offsets, candidate_docs, **kwargs
    )


def _forward(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor | None,
    candidate_docs: torch.Tensor | None,
    allow_tf32: bool,
    backend: str,
    doc_scales: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    import maxsim_kernels  # resolved at call time: the package imports this module lazily

    if queries.dtype == torch.float64:
        return _reference(
            queries, query_offsets, docs, doc_offsets, candidate_offsets, candidate_docs, doc_scales
        )

    kwargs: dict[str, Any] = dict(
        return_argmax=True, allow_tf32=allow_tf32, backend=backend, doc_scales=doc_scales
    )
    with torch.no_grad():
        if candidate_docs is None:
            return maxsim_kernels.maxsim_varlen(queries, query_offsets, docs, doc_offsets, **kwargs)
        return maxsim_kernels.maxsim_candidates(
            queries, query_offsets, docs, doc_offsets, candidate_offsets, candidate_docs, **kwargs
        )


# =====================================================================================================
# Public backward entry point and the autograd Functions
# =====================================================================================================


def maxsim_backward(
    grad_scores: torch.Tensor,
    argmax: torch.Tensor,
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    *,
    candidate_offsets: torch.Tensor | None = None,
    candidate_docs: torch.Tensor | None = None,
    doc_scales: torch.Tensor | None = None,
    need_queries: bool = True,
    need_docs: bool = True,
    backend: str = "auto",
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients ``(dL/dqueries, dL/ddocs)`` from the forward's argmax; see the module docstring.

    ``grad_scores`` has the scores' shape ([nq, nd], or [C] with ``candidate_docs``); ``argmax`` the
    forward's layout (int32 [Tq, nd], or [C, max_query_len] with -1 padding). Gradients come back in the
    inputs' dtypes (fp32 accumulation; float64 inputs accumulate in float64 on the torch path). The
    document gradient is None when not needed or when the documents are int8.
    """
    backend = _resolve_backend(backend, queries.device)
    need_docs = need_docs and docs.is_floating_point()
    grad_scores = grad_scores.contiguous()
    queries = queries.contiguous()
    docs = docs.contiguous()
    if backend == "torch" or queries.dtype == torch.float64:
        acc_dtype = torch.float64 if queries.dtype == torch.float64 else torch.float32
        grad_q, grad_d = _grads_torch(
            queries,
            docs,
            doc_scales,
            grad_scores,
            argmax,
            query_offsets,
            doc_offsets,
            candidate_offsets,
            candidate_docs,
            need_queries,
            need_docs,
            acc_dtype,
        )
        return (
            grad_q.to(queries.dtype) if grad_q is not None else None,
            grad_d.to(docs.dtype) if grad_d is not None else None,
        )
    grad_scores = grad_scores.to(torch.float32)
    argmax = argmax.contiguous()
    grad_q = grad_d = None
    if need_queries:
        grad_q = _grad_queries_triton(
            docs,
            doc_scales,
            doc_offsets,
            argmax,
            grad_scores,
            query_offsets,
            candidate_offsets,
            candidate_docs,
            queries.shape[0],
            queries.dtype,
        )
    if need_docs:
        grad_d = _grad_docs_triton(
            queries,
            grad_scores,
            argmax,
            query_offsets,
            doc_offsets,
            candidate_offsets,
            candidate_docs,
            docs.shape[0],
            docs.dtype,
        )
    return grad_q, grad_d


class MaxSimVarlenFunction(torch.autograd.Function):
    """All-pairs MaxSim scores [nq, nd] whose backward goes through the saved argmax."""

    @staticmethod
    def forward(ctx, queries, docs, query_offsets, doc_offsets, doc_scales, allow_tf32, backend):
        scores, argmax = _forward(
            queries, query_offsets, docs, doc_offsets, None, None, allow_tf32, backend, doc_scales
        )
        ctx.save_for_backward(queries, docs, query_offsets, doc_offsets, argmax, doc_scales)
        ctx.backend = backend
        ctx.mark_non_differentiable(argmax)
        return scores, argmax

    @staticmethod
    def backward(ctx, grad_scores, _grad_argmax):
        queries, docs, query_offsets, doc_offsets, argmax, doc_scales = ctx.saved_tensors
        grad_q, grad_d = maxsim_backward(
            grad_scores,
            argmax,
            queries,
            query_offsets,
            docs,
            doc_offsets,
            doc_scales=doc_scales,
            need_queries=ctx.needs_input_grad[0],
            need_docs=ctx.needs_input_grad[1],
            backend=ctx.backend,
        )
        return grad_q, grad_d, None, None, None, None, None


class MaxSimCandidatesFunction(torch.autograd.Function):
    """Per-query-candidate MaxSim scores [C] whose backward goes through the saved argmax."""

    @staticmethod
    def forward(
        ctx,
        queries,
        docs,
        query_offsets,
        doc_offsets,
        candidate_offsets,
        candidate_docs,
        doc_scales,
        allow_tf32,
        backend,
    ):
        scores, argmax = _forward(
            queries,
            query_offsets,
            docs,
            doc_offsets,
            candidate_offsets,
            candidate_docs,
            allow_tf32,
            backend,
            doc_scales,
        )
        ctx.save_for_backward(
            queries, docs, query_offsets, doc_offsets, candidate_offsets, candidate_docs, argmax, doc_scales
        )
        ctx.backend = backend
        ctx.mark_non_differentiable(argmax)
        return scores, argmax

    @staticmethod
    def backward(ctx, grad_scores, _grad_argmax):
        queries, docs, query_offsets, doc_offsets, cand_offsets, cand_docs, argmax, doc_scales = (
            ctx.saved_tensors
        )
        grad_q, grad_d = maxsim_backward(
            grad_scores,
            argmax,
            queries,
            query_offsets,
            docs,
            doc_offsets,
            candidate_offsets=cand_offsets,
            candidate_docs=cand_docs,
            doc_scales=doc_scales,
            need_queries=ctx.needs_input_grad[0],
            need_docs=ctx.needs_input_grad[1],
            backend=ctx.backend,
        )
        return grad_q, grad_d, None, None, None, None, None, None, None


def maxsim_varlen_autograd(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    *,
    return_argmax: bool = False,
    allow_tf32: bool = False,
    backend: str = "auto",
    doc_scales: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``maxsim_varlen``: scores [nq, nd] (fp32; float64 for float64 inputs).

    Gradients flow to ``queries`` and ``docs`` (not to int8 docs); see the module docstring for the
    math, the tie rule and determinism.
    """
    _resolve_backend(backend, queries.device)
    scores, argmax = MaxSimVarlenFunction.apply(
        queries, docs, query_offsets, doc_offsets, doc_scales, allow_tf32, backend
    )
    return (scores, argmax) if return_argmax else scores


def maxsim_candidates_autograd(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor,
    candidate_docs: torch.Tensor,
    *,
    return_argmax: bool = False,
    allow_tf32: bool = False,
    backend: str = "auto",
    doc_scales: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``maxsim_candidates``: scores [C] (query i's candidates are
    ``candidate_docs[candidate_offsets[i]:candidate_offsets[i+1]]``); gradients as in the module docstring.
    """
    _resolve_backend(backend, queries.device)
    scores, argmax = MaxSimCandidatesFunction.apply(
        queries,
        docs,
        query_offsets,
        doc_offsets,
        candidate_offsets,
        candidate_docs,
        doc_scales,
        allow_tf32,
        backend,
    )
    return (scores, argmax) if return_argmax else scores


# =====================================================================================================
# Gradient check against float64 (for `maxsim verify --grad`)
# =====================================================================================================


def _rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    x = x.to(torch.float64)
    denom = torch.linalg.vector_norm(ref).item()
    err = torch.linalg.vector_norm(x - ref).item()
    return err / denom if denom > 0 else err


def gradient_check(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    *,
    candidate_offsets: torch.Tensor | None = None,
    candidate_docs: torch.Tensor | None = None,
    doc_scales: torch.Tensor | None = None,
    seed: int = 0,
    allow_tf32: bool = False,
    backend: str = "auto",
) -> dict[str, Any]:
    """Gradients of the autograd path against float64, for a random upstream gradient from ``seed``.

    G ~ N(0, 1) with the scores' shape. The reference scores every pair exactly in float64
    (``maxsim_reference``: materialised similarities, lowest-index argmax) and reduces the same formulas in
    float64 with its own argmax. Returns ``dq_rel_error`` and ``dd_rel_error`` (||g - g_ref|| / ||g_ref||;
    ``dd_rel_error`` is None for int8 documents), the max absolute errors, ``score_max_abs_error``,
    ``argmax_agreement`` (fraction of (query token, document) pairs whose winner equals the reference's),
    ``bitwise_repeatable`` (a second backward gives the same bits), ``pairs`` and ``seed``.
    """
    candidates = candidate_docs is not None
    q = queries.detach().clone().requires_grad_(True)
    d = docs.detach().clone()
    docs_grad = d.is_floating_point()
    d.requires_grad_(docs_grad)

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        q.grad = None
        d.grad = None
        kw: dict[str, Any] = dict(
            return_argmax=True, allow_tf32=allow_tf32, backend=backend, doc_scales=doc_scales
        )
        if candidates:
            s, a = maxsim_candidates_autograd(
                q, query_offsets, d, doc_offsets, candidate_offsets, candidate_docs, **kw
            )
        else:
            s, a = maxsim_varlen_autograd(q, query_offsets, d, doc_offsets, **kw)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        upstream = torch.randn(s.shape, generator=gen, dtype=torch.float64)
        s.backward(upstream.to(device=s.device, dtype=s.dtype))
        return s.detach(), q.grad.detach().clone(), d.grad.detach().clone() if docs_grad else None, a

    scores, grad_q, grad_d, argmax = run()
    _, grad_q2, grad_d2, _ = run()
    repeatable = torch.equal(grad_q, grad_q2) and (grad_d is None or torch.equal(grad_d, grad_d2))

    ref_scores, ref_argmax = _reference(
        queries.detach(),
        query_offsets,
        docs.detach(),
        doc_offsets,
        candidate_offsets,
        candidate_docs,
        doc_scales,
    )
    gen = torch.Generator(device="cpu").manual_seed(seed)
    upstream = torch.randn(ref_scores.shape, generator=gen, dtype=torch.float64).to(ref_scores.device)
    ref_q, ref_d = _grads_torch(
        queries.detach().to(torch.float64),
        docs.detach().to(torch.float64),
        doc_scales,
        upstream,
        ref_argmax,
        query_offsets,
        doc_offsets,
        candidate_offsets,
        candidate_docs,
        True,
        docs_grad,
        torch.float64,
    )
    valid = ref_argmax >= 0
    finite = torch.isfinite(ref_scores)  # an empty document scores -inf on both sides
    score_error = (scores.double() - ref_scores)[finite].abs().max().item() if finite.any() else 0.0
    agreement = (
        (argmax.to(ref_argmax.device) == ref_argmax)[valid].double().mean().item() if valid.any() else 1.0
    )
    return {
        "dq_rel_error": _rel_error(grad_q, ref_q),
        "dd_rel_error": _rel_error(grad_d, ref_d) if grad_d is not None else None,
        "dq_max_abs_error": (grad_q.double() - ref_q).abs().max().item() if ref_q.numel() else 0.0,
        "dd_max_abs_error": (grad_d.double() - ref_d).abs().max().item()
        if grad_d is not None and ref_d.numel()
        else None,
        "score_max_abs_error": score_error,
        "argmax_agreement": agreement,
        "bitwise_repeatable": bool(repeatable),
        "pairs": int(valid.sum().item()),
        "seed": seed,
    }
