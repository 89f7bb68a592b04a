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

Only the argmax ``a`` (the winning token's index *within* its document: int16 when every document is
shorter than 2^15 tokens, else int32) and the offsets are kept from the forward; the similarity tensor is
never stored.

Subgradient at ties: ``max`` is not differentiable where two document tokens tie for a query token. We
route the whole gradient to the token the forward's argmax picked, the lowest index among the tied ones
(torch autograd of ``amax`` splits it evenly among them instead; both are valid subgradients).

Inverse map (CSR) and determinism
---------------------------------
Every pair ``p`` (a query token and a scored document) has a key ``k(p)``: the global row of its winning
document token. The CSR lists, for each document token ``j``, the pairs with ``k(p) = j`` in increasing
order. All pairs: a document's pairs only land on its own tokens, and every query token has exactly one
winner in each non-empty document, so document d's lists fill the fixed region ``[d*Tq, (d+1)*Tq)`` of
the list array. One launch builds them: a program per (segment of up to _CSR_MAX_SEGMENT query tokens,
document) sorts its segment by (winner, query token) in registers, writes the sorted tokens to its part
of the region, and derives each document token's row pointer and count from the runs of equal winners
(one CSR per segment; a token's list is its segments' lists in segment order). Every write has a single
owner: no atomics, no host synchronisation, 2 bytes a pair.
Candidates (lists may share documents): a stable sort of the keys (``torch.sort(stable=True)``, a
deterministic radix sort on CUDA) and a binary search. One program per document token ``j`` then sums
``G * Q_i`` over its list in that fixed order with fp32 accumulators and writes its row once, in the
input dtype: no atomics, no fp32 gradient buffer, and the same bits from run to run.
The query gradient is owned by query-token blocks, which loop over the documents in index order.
A document token that no query token chose gets an exact zero row.

One-hot document gradient (all pairs, fp16/bf16, queries of at most 128 tokens, small batches: see
``_ONEHOT_*``): no inverse map. A program owns a block of a document's tokens and, for each query in index
order, multiplies the 0/1 matrix [j == a(i, d)] into the query's rows on the tensor cores (exact products,
fp32 sums), scales the result by G[q, d] in fp32 and adds it to its accumulator; it writes each row once.
Deterministic and atomic-free as well; the sums group by query, so its bits differ from the inverse map's
(by ~4e-6 relative, far under the fp16 output's rounding). A non-finite value in any query row of the
batch reaches every document token of the block (0 x inf), where the inverse map would confine it to
the tokens it won; such a batch's loss is not finite either.

INT8 documents (``doc_scales``): ``D_j = s_j * d8_j``; the query gradient uses the dequantized rows (the
forward's on-the-fly query quantization is passed straight through), and int8 documents get no gradient.
Float64 inputs (used by ``torch.autograd.gradcheck``) are scored by the package's float64 reference
(``maxsim_reference``) and return float64 scores; every other dtype returns fp32 scores, as the forward does.

Cost, with P the number of scored (query token, document) pairs (Tq * nd for all pairs): the backward
gathers P document rows (dQ) and P query rows (dD), 2 * P * dim * bytes, mostly from L2 at training batch
sizes, and reads the argmax twice (dQ, the inverse map). Memory beyond the two gradients: the forward's
argmax (2 B a pair on the Triton path with documents under 2^15 tokens, else 4 B) and, for all pairs,
the int16 lists (2 B a pair) and row pointers and counts (4 B x Td x ceil(Tq / segment)), freed before
the query gradient is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from .launch import KernelLaunch
from .validation import (
    alignment_key,
    cdiv,
    check_candidates,
    host_offsets,
    memo,
    memo_plan,
    next_pow2,
    on_device,
    resolve_backend,
)

# --- tuning constants (triton 3.6, dim 128; the alternatives' times: docs/kernel-notes.md,
# "Training: the inverse map, the host and the argmax tile")
# Query-gradient kernel: a program owns _DQ_BLOCK_T query tokens and gathers _DQ_BLOCK_C winning rows
# per token per step ([T, C, dim] in flight, which is what hides the gather latency); within noise of the
# best variant swept.
_DQ_BLOCK_T = 8
_DQ_BLOCK_C = 8
_DQ_NUM_WARPS = 4
# Document-gradient kernel: one program per document token reads its CSR list _DD_BLOCK_E entries at a
# time: 53 / 96 us at ColBERT 128 / 256 docs against 62 / 115 us for 16 entries on 2 warps.
_DD_BLOCK_E = 8
_DD_NUM_WARPS = 1
# All-pairs inverse CSR: a program sorts the winners of up to _CSR_MAX_SEGMENT query tokens against one
# document in registers. Segment: 1024 query tokens when there are >= _CSR_MANY_DOCS documents (programs
# enough from the documents alone), else 4096 (fewer segments keep the dD kernel's per-token loop short);
# fixed per class so that batch sizes never recompile the kernel. CSR build + dD at ColBERT 128 docs 0.080
# ms with 1024, ColPali 0.289 with 4096.
_CSR_MAX_SEGMENT = 4096
_CSR_MANY_DOCS_SEGMENT = 1024
_CSR_MANY_DOCS = 64
_CSR_DOC_BLOCK = 256  # document tokens a step of the suffix minimum (fixed: no recompiles by length)
# Document gradient without the inverse map (16-bit inputs, queries of at most 128 tokens): a program per
# (document, _ONEHOT_BLOCK_J of its tokens) forms, for each query, the one-hot matrix [token == winner] and
# multiplies it into the query's rows on the tensor cores. Its cost grows with queries x documents x token
# blocks, the inverse map's with the pairs, plus a fixed sort of 4096-token segments below _CSR_MANY_DOCS
# documents. So it is taken below _CSR_MANY_DOCS documents and up to _ONEHOT_MAX_STEPS steps: 16K steps
# 0.075 vs 0.131 ms, 65K steps 0.258 vs 0.066 (docs/kernel-notes.md, "Training: short queries against long
# documents").
_DD_PATH = "auto"  # "auto", "csr" or "onehot" (the benchmark's A/B switch; read when a plan is made)
_ONEHOT_BLOCK_J = 64
_ONEHOT_BLOCK_I = 32
_ONEHOT_NUM_WARPS = 4
_ONEHOT_MAX_STEPS = 1 << 15
# Columns per program: a wider vector is split over a grid axis, so the register tiles stay at the size of
# the measured dim-128 case whatever the dim (up to 4096).
_MAX_BLOCK_DIM = 128
# Torch path: pairs gathered per step, bounding the [pairs, dim] fp32 temporaries to ~64 MiB at dim 128.
_TORCH_PAIRS_PER_STEP = 1 << 17


# =====================================================================================================
# Triton kernels
# =====================================================================================================


@triton.jit
def _run_start_combine(winner_a, start_a, winner_b, start_b):
    # scan over a sorted vector: b continues a's run of equal winners, or starts its own
    return winner_b, tl.where(winner_a == winner_b, start_a, start_b)


@triton.jit
def _min_combine(a, b):
    return tl.minimum(a, b)


# Sizes are not specialized (see maxsim_forward: no recompiles when one is 1 or a multiple of 16).
@triton.jit(do_not_specialize=["num_query_tokens", "num_docs", "num_doc_tokens"])
def _maxsim_inverse_csr_kernel(
    # pointers
    argmax_ptr,
    doc_offsets_ptr,
    order_ptr,
    row_start_ptr,
    row_count_ptr,
    # sizes
    num_query_tokens,
    num_docs,
    num_doc_tokens,
    # meta
    SEGMENT: tl.constexpr,
    LOG_SEGMENT: tl.constexpr,
    DOC_BLOCK: tl.constexpr,
):
    """Inverse map of one (query segment s, document d): a stable sort of the segment by winner.

    The SEGMENT query tokens i of segment s (global i = s*SEGMENT + local) are sorted in registers by the
    key (a(i, d) << LOG_SEGMENT) | local, so ties keep increasing i. The sorted locals go to the region of
    (s, d) in `order` (int16, region start d*Tq + s*SEGMENT); a scan over the sorted winners marks the first
    position of each run, which becomes row_start[s, j] of its document token j; tokens without pairs take
    the next run's start (a suffix minimum), and row_count[s, j] = row_start[s, j+1] - row_start[s, j].
    One program owns every write it makes, so the build needs no atomics and no host synchronisation.
    """
    seg = tl.program_id(0)
    doc = tl.program_id(1)
    doc_start = tl.load(doc_offsets_ptr + doc)
    doc_len = tl.load(doc_offsets_ptr + doc + 1) - doc_start
    lanes = tl.arange(0, SEGMENT)
    tokens = (seg * SEGMENT + lanes).to(tl.int64)
    winner = tl.load(argmax_ptr + tokens * num_docs + doc, mask=tokens < num_query_tokens, other=-1)
    winner = winner.to(tl.int32)  # the argmax may be int16: the key needs 32 bits
    key = tl.sort(tl.where(winner >= 0, (winner << LOG_SEGMENT) | lanes, 2147483647))
    listed = key != 2147483647
    num_listed = tl.sum(listed.to(tl.int32), axis=0)
    region = doc.to(tl.int64) * num_query_tokens + seg * SEGMENT
    tl.store(order_ptr + region + lanes, (key & (SEGMENT - 1)).to(order_ptr.dtype.element_ty), mask=listed)
    sorted_winner = key >> LOG_SEGMENT
    _, run_start = tl.associative_scan((sorted_winner, lanes), 0, _run_start_combine)
    starts = row_start_ptr + seg.to(tl.int64) * num_doc_tokens + doc_start
    counts = row_count_ptr + seg.to(tl.int64) * num_doc_tokens + doc_start
    blocks = tl.cdiv(doc_len, DOC_BLOCK)
    for b in range(0, blocks):
        j = b * DOC_BLOCK + tl.arange(0, DOC_BLOCK)
        tl.store(starts + j, num_listed.to(row_start_ptr.dtype.element_ty), mask=j < doc_len)
    tl.debug_barrier()  # every token reads "no pairs" before the runs are written
    tl.store(
        starts + sorted_winner, lanes.to(row_start_ptr.dtype.element_ty), mask=listed & (run_start == lanes)
    )
    tl.debug_barrier()
    next_start = num_listed
    for b in range(0, blocks):  # from the last block of tokens to the first: suffix minimum
        j = (blocks - 1 - b) * DOC_BLOCK + tl.arange(0, DOC_BLOCK)
        first = tl.load(starts + j, mask=j < doc_len, other=SEGMENT).to(tl.int32)
        first = tl.associative_scan(tl.minimum(first, next_start), 0, _min_combine, reverse=True)
        tl.store(starts + j, first.to(row_start_ptr.dtype.element_ty), mask=j < doc_len)
        next_start = tl.min(first, axis=0)
    tl.debug_barrier()
    for b in range(0, blocks):
        j = b * DOC_BLOCK + tl.arange(0, DOC_BLOCK)
        first = tl.load(starts + j, mask=j < doc_len, other=0).to(tl.int32)
        end = tl.load(starts + j + 1, mask=j + 1 < doc_len, other=num_listed).to(tl.int32)  # last: all
        tl.store(counts + j, (end - first).to(row_count_ptr.dtype.element_ty), mask=j < doc_len)


@triton.jit(do_not_specialize=["num_query_tokens", "num_docs", "max_query_len"])
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


@triton.jit(
    do_not_specialize=["num_docs", "max_query_len", "num_query_tokens", "num_segments", "num_doc_tokens"]
)
def _maxsim_grad_docs_kernel(
    # pointers
    queries_ptr,
    grad_scores_ptr,
    order_ptr,
    row_start_ptr,
    row_count_ptr,
    owner_ptr,
    token_doc_ptr,
    query_offsets_ptr,
    grad_docs_ptr,
    # sizes
    num_docs,
    max_query_len,
    num_query_tokens,
    num_segments,
    num_doc_tokens,
    dim,
    # strides
    stride_query_token,
    stride_grad_token,
    # meta
    CANDIDATES: tl.constexpr,
    SEGMENT: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    """dD_j = sum over the inverse-map lists of doc token j of G[pair] * Q[query token of pair], in order.

    All pairs: segment s's list of j holds the locals order[r + row_start[s, j] + e], e < row_count[s, j],
    r = d*Tq + s*SEGMENT, d = token_doc[j]: query token i = s*SEGMENT + local, owner[i] its query, weight
    G[owner[i], d]; segments in increasing s, so the sum runs over i in increasing order.
    Candidates (one segment): the list is order[row_start[j] + e], each a flat pair index
    p = c * max_query_len + t (argmax [C, max_query_len]), owner[c] the query of candidate c, the query
    token qo[owner[c]] + t and the weight G[c].
    Program (j, k) writes columns [k*BLOCK_DIM, (k+1)*BLOCK_DIM) of row j.
    """
    token = tl.program_id(0).to(tl.int64)
    dims = tl.program_id(1) * BLOCK_DIM + tl.arange(0, BLOCK_DIM)
    dim_ok = dims < dim
    if not CANDIDATES:
        doc_of_token = tl.load(token_doc_ptr + token).to(tl.int64)
    acc = tl.zeros([BLOCK_E, BLOCK_DIM], dtype=tl.float32)
    for seg in range(0, num_segments):
        pointer = seg * num_doc_tokens.to(tl.int64) + token
        start = tl.load(row_start_ptr + pointer).to(tl.int64)
        count = tl.load(row_count_ptr + pointer).to(tl.int32)
        if CANDIDATES:
            base = start
        else:
            base = doc_of_token * num_query_tokens + seg * SEGMENT + start
        for e0 in range(0, count, BLOCK_E):
            entry = e0 + tl.arange(0, BLOCK_E)
            entry_ok = entry < count
            pair = tl.load(order_ptr + base + entry, mask=entry_ok, other=0).to(tl.int64)
            if CANDIDATES:
                cand = pair // max_query_len
                query = tl.load(owner_ptr + cand, mask=entry_ok, other=0)
                qtok = tl.load(query_offsets_ptr + query, mask=entry_ok, other=0) + (
                    pair - cand * max_query_len
                )
                weight = tl.load(grad_scores_ptr + cand, mask=entry_ok, other=0.0)
            else:
                qtok = seg * SEGMENT + pair
                query = tl.load(owner_ptr + qtok, mask=entry_ok, other=0).to(tl.int64)
                weight = tl.load(grad_scores_ptr + query * num_docs + doc_of_token, mask=entry_ok, other=0.0)
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


@triton.jit(do_not_specialize=["num_queries", "num_docs"])
def _maxsim_grad_docs_onehot_kernel(
    # pointers
    queries_ptr,
    grad_scores_ptr,
    argmax_ptr,
    query_offsets_ptr,
    doc_offsets_ptr,
    grad_docs_ptr,
    # sizes
    num_queries,
    num_docs,
    dim,
    # strides
    stride_query_token,
    stride_grad_token,
    # meta
    BLOCK_J: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    """dD_j = sum over queries q of G[q, d] * (sum of the rows Q_i of q whose winner in d is j), queries in
    index order, for the BLOCK_J tokens j of document d from token b*BLOCK_J on (program (d, b, k)).

    Per query the inner sum is a product on the tensor cores, [j == a(i, d)] (0/1, exact in the inputs'
    16-bit type) times Q_q [BLOCK_I, BLOCK_DIM], accumulated in fp32; then scaled by G[q, d] in fp32. No
    inverse map, no atomics; every row of the block is written once, zero where no query token chose it.
    Each query has at most BLOCK_I tokens (the launcher checks).
    """
    doc = tl.program_id(0)
    doc_start = tl.load(doc_offsets_ptr + doc)
    doc_len = (tl.load(doc_offsets_ptr + doc + 1) - doc_start).to(tl.int32)
    first = tl.program_id(1) * BLOCK_J
    if first < doc_len:
        local = first + tl.arange(0, BLOCK_J)
        dims = tl.program_id(2) * BLOCK_DIM + tl.arange(0, BLOCK_DIM)
        dim_ok = dims < dim
        lanes = tl.arange(0, BLOCK_I)
        acc = tl.zeros([BLOCK_J, BLOCK_DIM], dtype=tl.float32)
        for query in range(0, num_queries):
            q_start = tl.load(query_offsets_ptr + query)
            q_end = tl.load(query_offsets_ptr + query + 1)
            tokens = q_start + lanes
            token_ok = tokens < q_end
            winner = tl.load(argmax_ptr + tokens * num_docs + doc, mask=token_ok, other=-1).to(tl.int32)
            rows = tl.load(
                queries_ptr + tokens[:, None] * stride_query_token + dims[None, :],
                mask=token_ok[:, None] & dim_ok[None, :],
                other=0.0,
            )
            onehot = (local[:, None] == winner[None, :]).to(rows.dtype)
            weight = tl.load(grad_scores_ptr + query * num_docs + doc)  # nq * nd < 2^31: the launcher checks
            acc += tl.dot(onehot, rows) * weight
        out = grad_docs_ptr + (doc_start + local.to(tl.int64))[:, None] * stride_grad_token + dims[None, :]
        tl.store(
            out, acc.to(grad_docs_ptr.dtype.element_ty), mask=(local < doc_len)[:, None] & dim_ok[None, :]
        )


# =====================================================================================================
# Host side: layout helpers, inverse CSR, launchers
# =====================================================================================================


def _owner_of(offsets: torch.Tensor, count: int) -> torch.Tensor:
    """Segment index of each of ``count`` items for CSR ``offsets`` (int32 [count]); no host sync.

    Memoised per offsets tensor: a training loop passes the same offsets to every step."""

    def compute() -> torch.Tensor:
        items = torch.arange(count, device=offsets.device, dtype=offsets.dtype)
        return torch.searchsorted(offsets, items, right=True, out_int32=True) - 1

    return memo(offsets, ("owner", count), compute)


def build_inverse_csr(keys: torch.Tensor, num_doc_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of a flat key map by stable sort: ``(row_ptr int64 [Td+1], order int64 [E])``.

    ``order[row_ptr[j]:row_ptr[j+1]]`` are the indices p with ``keys[p] == j``, increasing. Keys equal to
    ``num_doc_tokens`` (no winner) sort last and fall outside every row. A stable sort and a binary search,
    both deterministic on CUDA and CPU. Used for the candidates layout, where candidates share documents.
    """
    sorted_keys, order = torch.sort(keys, stable=True)
    bounds = torch.arange(num_doc_tokens + 1, device=keys.device, dtype=keys.dtype)
    row_ptr = torch.searchsorted(sorted_keys, bounds)
    return row_ptr, order


@dataclass(frozen=True)
class InverseMap:
    """The all-pairs inverse map, one CSR per segment of ``segment`` query tokens.

    Segment s's list of document token j (in document d) is ``order[r + row_start[s, j] :
    r + row_start[s, j] + row_count[s, j]]`` with ``r = d * Tq + s * segment``: the query tokens
    ``s * segment + local`` whose winner in d is j, increasing. int16 throughout (values < segment).
    """

    order: torch.Tensor  # int16 [Tq * nd]
    row_start: torch.Tensor  # int16 [S, Td]
    row_count: torch.Tensor  # int16 [S, Td]
    segment: int


def _csr_segment(num_docs: int, max_doc_len: int) -> int:
    """Query tokens a CSR program sorts: the class's segment (by document count), halved only for
    documents so long (2^19 tokens and more) that the key (winner << log2(segment)) | local would not
    fit in int31."""
    segment = _CSR_MAX_SEGMENT if num_docs < _CSR_MANY_DOCS else min(_CSR_MAX_SEGMENT, _CSR_MANY_DOCS_SEGMENT)
    winner_bits = max(1, int(max_doc_len).bit_length())
    return min(segment, 1 << (31 - winner_bits))


def _csr_launch(
    num_query_tokens: int, num_docs: int, num_doc_tokens: int, max_doc_len: int, device: torch.device
) -> tuple[KernelLaunch, int, int, tuple[int, ...]]:
    """The all-pairs inverse-map launch: (launch, segment, segments, int arguments)."""
    if num_query_tokens * num_docs >= 2**31:
        raise ValueError(
            f"{num_query_tokens} query tokens x {num_docs} documents is 2^31 pairs or more: split the batch"
        )
    if max_doc_len >= 1 << 22:
        raise ValueError(f"a document of {max_doc_len} tokens is too long for the backward (limit 2^22)")
    segment = _csr_segment(num_docs, max_doc_len)
    segments = cdiv(num_query_tokens, segment)
    meta = dict(
        SEGMENT=segment,
        LOG_SEGMENT=segment.bit_length() - 1,
        DOC_BLOCK=_CSR_DOC_BLOCK,
        num_warps=8 if segment >= 4096 else 4,
        num_stages=3,
    )
    launch = KernelLaunch(_maxsim_inverse_csr_kernel, (segments, num_docs), meta, device)
    return launch, segment, segments, (num_query_tokens, num_docs, num_doc_tokens)


def _run_csr(
    launch: KernelLaunch, ints: tuple[int, ...], segment: int, segments: int, argmax: torch.Tensor,
    doc_offsets: torch.Tensor, num_doc_tokens: int,
) -> InverseMap:  # fmt: skip
    device = argmax.device
    order = torch.empty(argmax.numel(), device=device, dtype=torch.int16)
    row_start, row_count = torch.empty(
        (2, segments, num_doc_tokens), device=device, dtype=torch.int16
    ).unbind(0)
    if argmax.numel():
        launch(argmax, doc_offsets, order, row_start, row_count, *ints)
    return InverseMap(order, row_start, row_count, segment)


def build_inverse_csr_all_pairs(
    argmax: torch.Tensor, doc_offsets: torch.Tensor, num_doc_tokens: int, max_doc_len: int
) -> InverseMap:
    """Inverse of the all-pairs argmax [Tq, nd] (see `InverseMap`): one launch of
    ``_maxsim_inverse_csr_kernel``, a program per (segment, document); deterministic, no atomics, no host
    synchronisation, 2 B a pair plus 4 B x S x Td."""
    launch, segment, segments, ints = _csr_launch(*argmax.shape, num_doc_tokens, max_doc_len, argmax.device)
    return _run_csr(launch, ints, segment, segments, argmax, doc_offsets, num_doc_tokens)


def _dim_blocked_launch(
    kernel: Any, grid_rows: tuple[int, ...], dim: int, device: torch.device, **meta: Any
) -> KernelLaunch:
    """A gradient launch whose last grid extent walks `dim` in BLOCK_DIM columns (3 stages)."""
    block_dim = min(next_pow2(dim), _MAX_BLOCK_DIM)
    meta.update(BLOCK_DIM=block_dim, num_stages=3)
    return KernelLaunch(kernel, (*grid_rows, cdiv(dim, block_dim)), meta, device)


def _dq_launch(
    dim: int, device: torch.device, grid_rows: tuple[int, int], candidates: bool, has_scales: bool
) -> KernelLaunch:
    """The query-gradient launch; grid_rows = the grid's first two extents (the third walks dim)."""
    return _dim_blocked_launch(
        _maxsim_grad_queries_kernel, grid_rows, dim, device, CANDIDATES=candidates, HAS_SCALES=has_scales,
        BLOCK_T=_DQ_BLOCK_T, BLOCK_C=_DQ_BLOCK_C, num_warps=_DQ_NUM_WARPS,
    )  # fmt: skip


def _dd_launch(
    dim: int, device: torch.device, num_doc_tokens: int, candidates: bool, segment: int
) -> KernelLaunch:
    """The document-gradient launch: a program per document token (and block of dim)."""
    return _dim_blocked_launch(
        _maxsim_grad_docs_kernel, (num_doc_tokens,), dim, device, CANDIDATES=candidates, SEGMENT=segment,
        BLOCK_E=_DD_BLOCK_E, num_warps=_DD_NUM_WARPS,
    )  # fmt: skip


def _grad_queries_triton(
    docs: torch.Tensor,
    doc_scales: torch.Tensor | None,
    doc_offsets: torch.Tensor,
    argmax: torch.Tensor,
    grad_scores: torch.Tensor,
    query_offsets: torch.Tensor,
    token_query: torch.Tensor | None,
    candidate_offsets: torch.Tensor | None,
    candidate_docs: torch.Tensor | None,
    num_query_tokens: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    dim = docs.shape[1]
    grad_queries = torch.empty((num_query_tokens, dim), device=docs.device, dtype=out_dtype)
    if num_query_tokens == 0:
        return grad_queries
    candidates = candidate_docs is not None
    if candidates:
        num_docs, max_query_len = 0, argmax.shape[1]
        grid_rows = (query_offsets.numel() - 1, cdiv(max(max_query_len, 1), _DQ_BLOCK_T))
    else:
        num_docs, max_query_len = argmax.shape[1], 0
        grid_rows = (cdiv(num_query_tokens, _DQ_BLOCK_T), 1)
    unused = doc_offsets  # a valid pointer for the arguments a layout does not read
    _dq_launch(dim, docs.device, grid_rows, candidates, doc_scales is not None)(
        docs,
        doc_scales if doc_scales is not None else unused,
        doc_offsets,
        argmax,
        grad_scores,
        query_offsets,
        token_query if token_query is not None else unused,
        candidate_offsets if candidates else unused,
        candidate_docs if candidates else unused,
        grad_queries,
        num_query_tokens,
        num_docs,
        max_query_len,
        dim,
        docs.stride(0),
        grad_queries.stride(0),
    )
    return grad_queries


def _grad_docs_candidates(
    queries: torch.Tensor,
    grad_scores: torch.Tensor,
    argmax: torch.Tensor,
    query_offsets: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor,
    candidate_docs: torch.Tensor,
    num_doc_tokens: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The document gradient of the per-query-candidates layout (the all-pairs one: `_AllPairsBackward`).

    Candidates may share documents: one stable sort of the winning rows of every pair."""
    dim = queries.shape[1]
    grad_docs = torch.empty((num_doc_tokens, dim), device=queries.device, dtype=out_dtype)
    if num_doc_tokens == 0:
        return grad_docs
    key_dtype = torch.int32 if num_doc_tokens < 2**31 - 1 else torch.int64  # int32: half the radix passes
    starts = doc_offsets[candidate_docs].to(key_dtype)[:, None]
    keys = torch.where(argmax >= 0, starts + argmax.to(key_dtype), num_doc_tokens).reshape(-1)
    row_ptr, order = build_inverse_csr(keys, num_doc_tokens)
    del keys, starts
    row_start, row_count = row_ptr[:-1], (row_ptr[1:] - row_ptr[:-1]).to(torch.int32)
    owner = _owner_of(candidate_offsets, candidate_docs.numel())
    unused = row_count  # the all-pairs layout's token -> document map
    _dd_launch(dim, queries.device, num_doc_tokens, True, 1)(
        queries, grad_scores, order, row_start, row_count, owner, unused, query_offsets, grad_docs,
        0, argmax.shape[1], argmax.shape[0], 1, num_doc_tokens, dim, queries.stride(0), grad_docs.stride(0),
    )  # fmt: skip
    return grad_docs


def _onehot_block_i(
    dtype: torch.dtype, num_queries: int, num_query_tokens: int, num_docs: int, max_query_len: int,
    max_doc_len: int,
) -> int | None:  # fmt: skip
    """BLOCK_I of the one-hot document gradient where it takes the batch (see _ONEHOT_*), else None."""
    if _DD_PATH == "csr" or dtype not in (torch.float16, torch.bfloat16):
        return None
    block_i = max(_ONEHOT_BLOCK_I, next_pow2(max(max_query_len, 1)))
    if block_i > 128 or num_query_tokens * num_docs >= 2**31:
        return None
    steps = num_queries * num_docs * cdiv(max_doc_len, _ONEHOT_BLOCK_J)
    if _DD_PATH == "onehot" or (num_docs < _CSR_MANY_DOCS and steps <= _ONEHOT_MAX_STEPS):
        return block_i
    return None


def _onehot_launch(
    dim: int, device: torch.device, num_docs: int, max_doc_len: int, block_i: int
) -> KernelLaunch:
    """The one-hot document-gradient launch: a program per (document, block of its tokens, block of dim)."""
    block_dim = min(max(16, next_pow2(dim)), _MAX_BLOCK_DIM)  # tl.dot needs N >= 16
    meta = dict(
        BLOCK_J=_ONEHOT_BLOCK_J, BLOCK_I=block_i, BLOCK_DIM=block_dim, num_warps=_ONEHOT_NUM_WARPS,
        num_stages=3,
    )  # fmt: skip
    grid = (num_docs, cdiv(max(max_doc_len, 1), _ONEHOT_BLOCK_J), cdiv(dim, block_dim))
    return KernelLaunch(_maxsim_grad_docs_onehot_kernel, grid, meta, device)


class _AllPairsBackward:
    """The all-pairs backward's launches and derived tensors for one set of shapes and offsets, kept for
    the next step with the same ones (a training loop): a step then costs four allocations and three
    launches through the compiled kernels' own launchers (`KernelLaunch`)."""

    def __init__(
        self,
        queries: torch.Tensor,
        docs: torch.Tensor,
        argmax: torch.Tensor,
        query_offsets: torch.Tensor,
        doc_offsets: torch.Tensor,
        max_doc_len: int,
        max_query_len: int,
    ) -> None:
        device = queries.device
        num_query_tokens, num_docs = argmax.shape
        num_doc_tokens, dim = docs.shape
        # (the offsets themselves are not kept: the plan lives in their memo, see `memo_pair`)
        self.token_query = _owner_of(query_offsets, num_query_tokens)
        self.dq = _dq_launch(dim, device, (cdiv(num_query_tokens, _DQ_BLOCK_T), 1), False, False)
        self.dq_ints = (num_query_tokens, num_docs, 0, dim, docs.stride(0), dim)
        # the inverse map and dD launches, made on the first document gradient: a backward for the
        # queries alone (frozen or int8 documents) never meets the inverse map's size limits
        self.shapes = (
            num_query_tokens,
            num_docs,
            num_doc_tokens,
            dim,
            queries.stride(0),
            max_doc_len,
            device,
        )
        self.docs_launches: tuple | None = None
        self.onehot: KernelLaunch | None = None
        num_queries = query_offsets.numel() - 1
        block_i = _onehot_block_i(
            queries.dtype, num_queries, num_query_tokens, num_docs, max_query_len, max_doc_len
        )
        if block_i is not None:
            self.onehot = _onehot_launch(dim, device, num_docs, max_doc_len, block_i)
            self.onehot_ints = (num_queries, num_docs, dim, queries.stride(0), dim)

    def _docs_launches(self, doc_offsets: torch.Tensor) -> tuple:
        if self.docs_launches is None:
            num_query_tokens, num_docs, num_doc_tokens, dim, query_stride, max_doc_len, device = self.shapes
            csr, segment, segments, csr_ints = _csr_launch(
                num_query_tokens, num_docs, num_doc_tokens, max_doc_len, device
            )
            dd = _dd_launch(dim, device, num_doc_tokens, False, segment)
            dd_ints = (num_docs, 0, num_query_tokens, segments, num_doc_tokens, dim, query_stride, dim)
            token_doc = _owner_of(doc_offsets, num_doc_tokens)
            self.docs_launches = (csr, segment, segments, csr_ints, dd, dd_ints, token_doc)
        return self.docs_launches

    def grad_docs(
        self,
        queries: torch.Tensor,
        docs: torch.Tensor,
        grad_scores: torch.Tensor,
        argmax: torch.Tensor,
        query_offsets: torch.Tensor,
        doc_offsets: torch.Tensor,
    ) -> torch.Tensor:
        grad_docs = torch.empty(docs.shape, device=docs.device, dtype=docs.dtype)
        if docs.shape[0] == 0:
            return grad_docs
        if self.onehot is not None:
            self.onehot(
                queries, grad_scores, argmax, query_offsets, doc_offsets, grad_docs, *self.onehot_ints
            )
            return grad_docs
        csr, segment, segments, csr_ints, dd, dd_ints, token_doc = self._docs_launches(doc_offsets)
        inverse = _run_csr(csr, csr_ints, segment, segments, argmax, doc_offsets, docs.shape[0])
        dd(
            queries, grad_scores, inverse.order, inverse.row_start, inverse.row_count, self.token_query,
            token_doc, query_offsets, grad_docs, *dd_ints,
        )  # fmt: skip
        return grad_docs

    def grad_queries(
        self,
        queries: torch.Tensor,
        docs: torch.Tensor,
        grad_scores: torch.Tensor,
        argmax: torch.Tensor,
        query_offsets: torch.Tensor,
        doc_offsets: torch.Tensor,
    ) -> torch.Tensor:
        grad_queries = torch.empty(queries.shape, device=queries.device, dtype=queries.dtype)
        if queries.shape[0] == 0:
            return grad_queries
        unused = doc_offsets
        self.dq(
            docs, unused, doc_offsets, argmax, grad_scores, query_offsets, self.token_query,
            unused, unused, grad_queries, *self.dq_ints,
        )  # fmt: skip
        return grad_queries


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
    """Both gradients by gather + ``index_add_`` in ``acc_dtype``.

    ``index_add_`` adds the rows in index order on CPU, so the sums are bitwise repeatable with any number
    of threads; ``index_put_(accumulate=True)`` is not (it splits duplicate rows across threads).
    """
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
            grad_q.index_add_(0, query_tok[sl], doc_rows * w)
        if grad_d is not None:
            grad_d.index_add_(0, rows[sl], queries[query_tok[sl]].to(acc_dtype) * w)
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
    from .reference import maxsim_candidates_reference, maxsim_reference

    kwargs: dict[str, Any] = dict(dtype=torch.float64, return_argmax=True, doc_scales=doc_scales)
    if candidate_docs is None:
        return maxsim_reference(queries, query_offsets, docs, doc_offsets, **kwargs)
    return maxsim_candidates_reference(
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
    if candidate_docs is not None:
        # The forward kernels score a bad index of candidates on the GPU NaN, unchecked by the host; the
        # backward's kernels would read through it, so the differentiable path checks them on the host,
        # before any launch.
        num_queries, num_docs = query_offsets.numel() - 1, doc_offsets.numel() - 1
        check_candidates(candidate_offsets, candidate_docs, num_queries, num_docs)
    return _forward_scores(
        queries, query_offsets, docs, doc_offsets, candidate_offsets, candidate_docs, allow_tf32, backend,
        doc_scales,
    )  # fmt: skip


def _forward_scores(
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
    if queries.dtype == torch.float64:
        return _reference(
            queries, query_offsets, docs, doc_offsets, candidate_offsets, candidate_docs, doc_scales
        )

    if docs.dtype != torch.int8 and resolve_backend(backend, docs.device) == "triton":
        # The Triton forward directly, keeping an int16 argmax where every document is shorter than
        # 2^15 tokens: it lives until the backward, 2 B a pair instead of 4. (autograd.Function.forward
        # already runs without grad recording.)
        from . import maxsim_forward as fwd

        if candidate_docs is None:
            return fwd.maxsim_varlen_forward_triton(
                queries, query_offsets, docs, doc_offsets, return_argmax=True, allow_tf32=allow_tf32,
                argmax_dtype=None,
            )  # fmt: skip
        return fwd.maxsim_candidates_forward_triton(
            queries, query_offsets, docs, doc_offsets, candidate_offsets, candidate_docs,
            return_argmax=True, allow_tf32=allow_tf32, argmax_dtype=None,
        )  # fmt: skip
    # int8 documents: the int8 module's forward; float documents on the torch backend: the CPU path
    # (this module imports neither the package root nor anything that imports it)
    with torch.no_grad():
        if docs.dtype == torch.int8:
            from . import int8_host

            kwargs: dict[str, Any] = dict(
                return_argmax=True, allow_tf32=allow_tf32, backend=backend, doc_scales=doc_scales
            )
            if candidate_docs is None:
                return int8_host.maxsim_varlen_int8(queries, query_offsets, docs, doc_offsets, **kwargs)
            return int8_host.maxsim_candidates_int8(
                queries, query_offsets, docs, doc_offsets, candidate_offsets, candidate_docs, **kwargs
            )
        from .cpu import maxsim_candidates_cpu, maxsim_varlen_cpu

        if candidate_docs is None:
            return maxsim_varlen_cpu(
                queries, query_offsets, docs, doc_offsets, return_argmax=True, doc_scales=doc_scales
            )
        return maxsim_candidates_cpu(
            queries, query_offsets, docs, doc_offsets, candidate_offsets, candidate_docs,
            return_argmax=True, doc_scales=doc_scales,
        )  # fmt: skip


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
    backend = resolve_backend(backend, queries.device)
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
    # the forward accepts offsets and candidate lists on the host; the kernels read them on the device
    device = queries.device
    doc_offsets_in, query_offsets_in = doc_offsets, query_offsets
    query_offsets, doc_offsets = on_device(query_offsets, device), on_device(doc_offsets, device)
    if doc_scales is not None:
        doc_scales = doc_scales.to(device)
    # The document gradient first: its inverse map is freed when it returns, before the query gradient
    # is allocated, so the two never coexist (the peak drops by the smaller of the two).
    grad_q = grad_d = None
    if candidate_docs is None:
        plan = memo_plan(
            doc_offsets,
            query_offsets,
            alignment_key(queries, docs, argmax, grad_scores),
            lambda: _AllPairsBackward(
                queries,
                docs,
                argmax,
                query_offsets,
                doc_offsets,
                _max_len(doc_offsets_in, docs.shape[0]),
                _max_len(query_offsets_in, queries.shape[0], "query_offsets"),
            ),
        )
        args = (queries, docs, grad_scores, argmax, query_offsets, doc_offsets)
        grad_d = plan.grad_docs(*args) if need_docs else None
        if need_queries and doc_scales is None:
            grad_q = plan.grad_queries(*args)
        elif need_queries:  # int8 documents: the query gradient gathers dequantized rows
            grad_q = _grad_queries_triton(
                docs, doc_scales, doc_offsets, argmax, grad_scores, query_offsets, plan.token_query,
                None, None, queries.shape[0], queries.dtype,
            )  # fmt: skip
        return grad_q, grad_d
    candidate_offsets = on_device(candidate_offsets, device)
    candidate_docs = on_device(candidate_docs, device)
    if need_docs:
        grad_d = _grad_docs_candidates(
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
    if need_queries:
        grad_q = _grad_queries_triton(
            docs,
            doc_scales,
            doc_offsets,
            argmax,
            grad_scores,
            query_offsets,
            None,
            candidate_offsets,
            candidate_docs,
            queries.shape[0],
            queries.dtype,
        )
    return grad_q, grad_d


def _max_len(offsets: torch.Tensor, total: int, name: str = "doc_offsets") -> int:
    """Longest item of packed ``offsets`` (memoised; the forward's checks already hold a host copy)."""

    def compute() -> int:
        lens = np.diff(host_offsets(name, offsets, total))
        return int(lens.max()) if len(lens) else 0

    return memo(offsets, ("max_len", total), compute)


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
        # no zero-filled stand-in for the argmax's gradient (nor for an unused output's): 2 MB and a
        # fill launch per step at ColBERT 128 x 128, about a third of the host time of a step
        ctx.set_materialize_grads(False)
        return scores, argmax

    @staticmethod
    def backward(ctx, grad_scores, _grad_argmax):
        if grad_scores is None:  # the scores took no part in the loss
            return None, None, None, None, None, None, None
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
        # no zero-filled stand-in for the argmax's gradient (nor for an unused output's): 2 MB and a
        # fill launch per step at ColBERT 128 x 128, about a third of the host time of a step
        ctx.set_materialize_grads(False)
        return scores, argmax

    @staticmethod
    def backward(ctx, grad_scores, _grad_argmax):
        if grad_scores is None:  # the scores took no part in the loss
            return None, None, None, None, None, None, None, None, None
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
    resolve_backend(backend, queries.device)
    scores, argmax = MaxSimVarlenFunction.apply(
        queries, docs, query_offsets, doc_offsets, doc_scales, allow_tf32, backend
    )
    return (scores, argmax.to(torch.int32)) if return_argmax else scores  # int32, as documented


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
    resolve_backend(backend, queries.device)
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
    return (scores, argmax.to(torch.int32)) if return_argmax else scores  # int32, as documented


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
