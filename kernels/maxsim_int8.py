"""INT8 x INT8 MaxSim with per-token symmetric scales: the Triton kernels on the tensor cores and their
launchers (`quantize_triton`, `launch_varlen`, `launch_candidates` and the Gluon kernels' plans). The
public entry points, the checks, the torch CPU path and the float64 reference of the same integer math are
in `int8_host`, which imports no Triton and calls these.

Quantization (per token, symmetric): for a vector x of `dim` values,

    s = absmax(x) / 127            (fp32, correctly rounded; s := 1 when it is 0, so nothing divides by 0)
    x8 = clamp(round_half_even(x / s), -127, 127)       (int8; x ~= s * x8)

Scoring, with q8/s_q a query's quantized tokens and scales and d8/s_d a document's:

    acc[i, j]  = sum_k q8[i, k] * d8[j, k]             int32, exact: |acc| <= 128^2 * dim < 2^31
    score(q, d) = sum_i s_q[i] * max_j (s_d[j] * acc[i, j])

The document scale goes *before* the max (it differs per document token), the query scale after it (it
is positive and constant over j). Every kernel and the CPU path compute `s_d[j] * acc[i, j]` as one fp32
product of the exact integer `acc` (exact in fp32 while |acc| < 2^24, i.e. dim <= 1024) and the fp32
scale, so the max and its argmax are the same everywhere; the query-scale products and the sum over i
are fp32 and differ from the float64 reference only by their rounding. Ties of the max go to the lowest
document-token index.

Tiling (Triton). Queries are quantized by a small kernel (one program per block of tokens). The
all-pairs kernel cuts the queries into groups of a fixed number of consecutive queries, sized from the
shapes alone so that queries of the mean length fill one BLOCK_Q-row tile (nothing is read back from the
device to plan a launch); a program takes one group and DOCS_PER_PROG consecutive documents, keeps the
group's int8 query tile on chip, and walks the documents' BLOCK_D-token int8 tiles (each document's
first tile starts at its first token, the last one is masked) in one flat loop, as the fp16 kernel in
`maxsim_forward` does, so that the software pipeliner prefetches across documents. Per tile: `tl.dot`
(int8 x int8 -> int32 on the tensor cores), the doc scale and an out-of-document bias (0 or -inf) in one
FMA, a running row max (and argmax) per query token; at a document's last tile the query scales, a sum
per query of the group, and one store per score. Programs with the same documents are adjacent in launch
order, so a document is read from HBM once and from L2 by every group. A group longer than its tile
(queries longer than planned) is walked tile by tile for each document instead. The candidates kernel
takes CANDS_PER_PROG consecutive entries of the flat candidate list (their query found by binary search
in candidate_offsets, on the device) and does the same, reading each candidate in place through its index.

Cost: FLOPs = 2 * Tq * Td * dim integer MACs (all pairs) or 2 * sum_c |q_c| * |d_c| * dim (candidates);
HBM bytes ~= Td * (dim + 4) once (int8 tokens + fp32 scale), half the fp16 bytes, plus 4 bytes per score.
Past the MMA, each (query token, document token) pair costs the same CUDA-core work as in fp16 (the
conversion, one FMA, the max) and every tile the same loop, load and reduction overhead, so halving the
MMA time does not halve the tile time: all pairs run at 1.23x the fp16 kernel's rate, not 2x.
HBM-bound shapes read at 3.5 TB/s with these TMA tiles
on Hopper (fp16: 4.4): with cp.async loads they reached 2.9-3.1, three programs an SM (the registers of
the per-thread addresses) each keeping two 8 KB tiles in flight where fp16 keeps three 16 KB ones. The
tiles are query-major: document-major ones, as the fp16 kernel uses for one query and for candidates,
lost on every shape. The measurements: docs/kernel-notes.md, "INT8: what limits it" and "INT8 on
HBM-bound shapes: TMA tiles". On Hopper (sm_90, the Triton release of the Gluon kernels, scores only, dim
128), all pairs of several queries go to the Gluon kernel of `maxsim_int8_hopper` (offsets on the device
are read back once per tensor for its plan), and one query against
every document or candidates with host query offsets (queries of at most 64 tokens) to the Gluon stream
kernel of `maxsim_int8_hopper_stream` (3.6-4.1 TB/s: docs/kernel-notes.md, "INT8 on HBM-bound shapes:
the Gluon stream kernel").

int32 -> fp32 by the accumulator's bits: the MMA accumulator starts at the bit pattern of 1.5 * 2^23
(0x4B400000) instead of 0, so its bits, read as fp32, are 1.5 * 2^23 + acc exactly while |acc| < 2^22
(dim <= 255 with |codes| <= 128); one subtraction gives acc. Wider vectors use the conversion
instruction, which in these tiles is no faster (one instruction either way: docs/kernel-notes.md, "INT8:
what limits it"); the Gluon kernel, whose accumulator starts at
zero, uses the instruction. Rounding half to even in the quantize
kernel uses the same constant: (y + 1.5 * 2^23) - 1.5 * 2^23 for |y| < 2^22.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from .launch import gluon_module, hopper_device, launch_fitting_shared_memory
from .running_max import document_max, fold_row_max, fold_tile, restart, tile_count
from .validation import (
    cdiv,
    host_offsets,
    interpreting,
    memo,
    memo_pair,
)

_MAGIC_MAX_DIM = 255  # |acc| <= 128^2 * dim < 2^22: the accumulator-bias conversion is exact
_MAGIC_BITS = 0x4B400000  # bits of 1.5 * 2^23
_MAGIC_FLOAT = 12582912.0  # 1.5 * 2^23

# Tuning constants: `benchmarks/bench_int8.py gpu` tile sweeps (triton 3.6, dim 128); every sweep's
# alternatives: docs/kernel-notes.md, "INT8: what limits it". All pairs 66.5 vs 70.8 ms (8 warps, row max).
_VARLEN_BLOCK_Q = 256  # query tokens per program in the all-pairs kernel (8 queries of 32 tokens)
_VARLEN_BLOCK_D = 32  # document tokens per tile
_VARLEN_DOCS_PER_PROG = 64  # documents per program
_VARLEN_WARPS = 4
_VARLEN_STAGES = 2
_VARLEN_ELEMENT_MAX = True  # running max per tile element (scores only; see kernels/running_max.py)
# The few-queries tiles below are for memory-bound shapes: at most _FEW_QUERIES_MAX_ROWS query tokens in
# all (2 queries of 32 tokens faster on them, 4 slower: docs/kernel-notes.md, "The int8 Gluon kernel").
_FEW_QUERIES_MAX_ROWS = 64
_FEW_QUERIES_BLOCK_D = 64
_FEW_QUERIES_DOCS_PER_PROG = 32
_FEW_QUERIES_WARPS = 4
_FEW_QUERIES_STAGES = 3
_FEW_QUERIES_ELEMENT_MAX = True
# Candidates: 64 queries x 1000 own documents 0.463 vs 0.502 ms for the previous entry.
_CAND_BLOCK_D = 64
_CAND_PER_PROG = 16  # candidates per program
_CAND_WARPS = 4
_CAND_STAGES = 3
_CAND_ELEMENT_MAX = True
# Document tiles by TMA bulk copies (sm_90+, dim a power of two) instead of per-thread cp.async loads: one
# query 0.600 vs 0.679 ms, rerank 0.441 vs 0.517, all pairs 69.8 vs 66.7 (so not there); a rotated start
# of each candidate run lost 2-6%: docs/kernel-notes.md, "INT8 on HBM-bound shapes: TMA tiles".
_VARLEN_TMA = False
_FEW_QUERIES_TMA = True
_CAND_TMA = True
_ROTATE_CANDIDATES = False
_MAX_QUERIES_PER_GROUP = 32  # queries per all-pairs program at most (short queries)
_QUANT_BLOCK_R = 16  # tokens per program of the quantize kernel


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["n_rows"])
def _quantize_rows_kernel(
    # pointers
    x_ptr,
    codes_ptr,
    scales_ptr,
    # sizes
    n_rows,
    dim,
    # strides
    stride_x,
    stride_codes,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """codes[r] = clamp(round_half_even(x[r] / s[r]), -127, 127), s[r] = absmax(x[r]) / 127 (1 if 0)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < dim)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    codes, scale = quantize_rows(x)
    tl.store(codes_ptr + rows[:, None] * stride_codes + cols[None, :], codes, mask=mask)
    tl.store(scales_ptr + rows, scale, mask=row_ok)


@triton.jit
def quantize_rows(x):
    """`quantize_per_token` of a block of rows x fp32 [R, K] (zeros past the dim): (codes int8 [R, K],
    scales fp32 [R])."""
    absmax = tl.max(tl.abs(x), axis=1)
    # div_rn: correctly rounded like torch's division (Triton's `/` is not, on the GPU).
    scale = tl.math.div_rn(absmax, 127.0)
    scale = tl.where(scale > 0.0, scale, 1.0)
    y = tl.math.div_rn(x, scale[:, None])
    y = (y + 12582912.0) - 12582912.0  # round half to even (|y| <= 127.5 << 2^22)
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    return y.to(tl.int8), scale


@triton.jit
def _scaled_tile(
    q,
    d_ptr,
    d_scale_ptr,
    tok,
    doc_end,
    dim,
    stride_d,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MAGIC: tl.constexpr,
    TMA: tl.constexpr,
):
    """fp32(s_d[j] * (q8 . d8[j])) for the BLOCK_D document tokens tok.., -inf from doc_end on.

    TMA: `d_ptr` is a tensor descriptor of the codes (block [BLOCK_D, BLOCK_K], BLOCK_K == dim): the tile
    comes by one bulk copy, rows past the document included (their columns get the -inf bias)."""
    cols = tok + tl.arange(0, BLOCK_D)
    col_ok = cols < doc_end
    if TMA:
        d = d_ptr.load([tok.to(tl.int32), 0])
    else:
        k = tl.arange(0, BLOCK_K)
        d = tl.load(
            d_ptr + cols[:, None] * stride_d + k[None, :], mask=col_ok[:, None] & (k < dim)[None, :], other=0
        )
    s = tl.load(d_scale_ptr + cols, mask=col_ok, other=1.0)
    # 0 inside the document, -inf past its end: applied in the same FMA as the scale.
    bias = tl.where(col_ok, 0.0, float("-inf"))
    if MAGIC:
        acc = tl.dot(q, tl.trans(d), tl.full([BLOCK_Q, BLOCK_D], 0x4B400000, tl.int32), out_dtype=tl.int32)
        exact = acc.to(tl.float32, bitcast=True) - 12582912.0
    else:
        exact = tl.dot(q, tl.trans(d), out_dtype=tl.int32).to(tl.float32)
    return exact * s[None, :] + bias[None, :]


@triton.jit
def _doc_row_max(
    q,
    d_ptr,
    d_scale_ptr,
    start,
    stop,
    dim,
    stride_d,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MAGIC: tl.constexpr,
    RETURN_ARGMAX: tl.constexpr,
    TMA: tl.constexpr,
):
    """max_j s_d[j] * (q8 @ d8[j]) over the document's tokens start <= j < stop, per row of the q tile.

    Returns (row max fp32 [BLOCK_Q], argmax int32 [BLOCK_Q] as an index within the document, lowest on ties).
    """
    row_max = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    row_arg = tl.full([BLOCK_Q], -1, tl.int32)  # stays -1 for a document with no tokens
    for t in range(start, stop, BLOCK_D):
        val = _scaled_tile(
            q, d_ptr, d_scale_ptr, t, stop, dim, stride_d, BLOCK_Q, BLOCK_D, BLOCK_K, MAGIC, TMA
        )
        row_max, row_arg = fold_row_max(val, row_max, row_arg, t, start, RETURN_ARGMAX)
    return row_max, row_arg


@triton.jit
def _query_tile(
    q_ptr, q_scale_ptr, row_first, row_last, dim, stride_q, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr
):
    """Rows row_first.. (< row_last) of the int8 queries and their scales (0 past the end)."""
    rows = row_first + tl.arange(0, BLOCK_Q)
    row_ok = rows < row_last
    k = tl.arange(0, BLOCK_K)
    q = tl.load(
        q_ptr + rows[:, None] * stride_q + k[None, :], mask=row_ok[:, None] & (k[None, :] < dim), other=0
    )
    sq = tl.load(q_scale_ptr + rows, mask=row_ok, other=1.0)  # padding rows are masked out by row_ok
    return q, sq, rows, row_ok


# Sizes are not specialized (see maxsim_forward: no recompiles when one is 1 or a multiple of 16).
@triton.jit(
    do_not_specialize=["n_queries", "n_groups", "n_docs", "stride_out", "stride_arg"],
    do_not_specialize_on_alignment=["q_off_ptr", "d_off_ptr"],
)
def _maxsim_int8_varlen_kernel(
    # pointers
    q_ptr,
    q_scale_ptr,
    q_off_ptr,
    d_ptr,
    d_scale_ptr,
    d_off_ptr,
    out_ptr,
    arg_ptr,
    # sizes
    n_queries,
    n_groups,
    n_docs,
    dim,
    # strides
    stride_q,
    stride_d,
    stride_out,
    stride_arg,
    DOCS_PER_PROG: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    QUERIES_PER_GROUP: tl.constexpr,
    MAX_Q: tl.constexpr,
    MAGIC: tl.constexpr,
    RETURN_ARGMAX: tl.constexpr,
    ONE_QUERY: tl.constexpr,
    ELEMENT_MAX: tl.constexpr,
    TMA: tl.constexpr = False,
):
    """Scores of QUERIES_PER_GROUP consecutive queries against DOCS_PER_PROG consecutive documents.

    MAX_Q = max(2, QUERIES_PER_GROUP) is the length of the per-query vectors (a power of two).
    """
    if ONE_QUERY:
        # One query is its own bucket with the sizes folded to constants: 0.81 vs 1.07 ms for 1 query x
        # 100K documents (docs/kernel-notes.md, version 3).
        n_queries = 1
        n_groups = 1
    pid = tl.program_id(0)
    # Group fastest: the programs that share a document chunk run together and share it through L2.
    group = pid % n_groups
    doc_first = (pid // n_groups).to(tl.int64) * DOCS_PER_PROG
    doc_last = tl.minimum(doc_first + DOCS_PER_PROG, n_docs)
    q_first = group.to(tl.int64) * QUERIES_PER_GROUP
    q_last = tl.minimum(q_first + QUERIES_PER_GROUP, n_queries)
    row_first = tl.load(q_off_ptr + q_first)
    row_last = tl.load(q_off_ptr + q_last)
    kq = tl.arange(0, MAX_Q)
    q_ok = q_first + kq < q_last
    # End row of each query of the group; a row belongs to local query #(ends <= row).
    q_ends = tl.load(q_off_ptr + q_first + 1 + kq, mask=q_ok, other=9223372036854775807)
    out_rows = out_ptr + (q_first + kq) * stride_out
    if row_last - row_first <= BLOCK_Q:
        # The group fits one tile (the planned case): the query tile stays on chip, and the tiles of all
        # the program's documents run in ONE loop, so that the pipeliner prefetches across documents.
        q, sq, rows, row_ok = _query_tile(
            q_ptr, q_scale_ptr, row_first, row_last, dim, stride_q, BLOCK_Q, BLOCK_K
        )
        local = tl.sum((rows[:, None] >= q_ends[None, :]).to(tl.int32), axis=1)
        member = (local[:, None] == kq[None, :]) & row_ok[:, None]
        dd = doc_first + tl.arange(0, DOCS_PER_PROG)
        d_in = dd < n_docs
        n_tiles = tile_count(d_off_ptr, dd, d_in, d_in, BLOCK_D)  # an empty doc: 1 tile
        doc = doc_first
        doc_start = tl.load(d_off_ptr + doc)
        doc_end = tl.load(d_off_ptr + doc + 1)
        tok = doc_start
        row_max = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        row_arg = tl.full([BLOCK_Q], -1, tl.int32)
        m_tile = tl.full((BLOCK_Q, BLOCK_D) if ELEMENT_MAX else (1, 1), float("-inf"), tl.float32)
        for _ in range(n_tiles):
            val = _scaled_tile(
                q, d_ptr, d_scale_ptr, tok, doc_end, dim, stride_d, BLOCK_Q, BLOCK_D, BLOCK_K, MAGIC, TMA
            )
            row_max, row_arg, m_tile = fold_tile(
                val, row_max, row_arg, m_tile, tok, doc_start, ELEMENT_MAX, RETURN_ARGMAX
            )
            last = tok + BLOCK_D >= doc_end
            if last:
                row_max = document_max(row_max, m_tile, 1, ELEMENT_MAX)
                contrib = tl.where(row_ok, sq * row_max, 0.0)
                tl.store(out_rows + doc, tl.sum(tl.where(member, contrib[:, None], 0.0), axis=0), mask=q_ok)
                if RETURN_ARGMAX:
                    tl.store(arg_ptr + rows * stride_arg + doc, row_arg, mask=row_ok)
                row_max, row_arg, m_tile = restart(row_max, row_arg, m_tile, ELEMENT_MAX, RETURN_ARGMAX)
            # next tile, or the next document's first (the state stays free of the running max)
            next_end = tl.load(d_off_ptr + tl.minimum(doc + 2, n_docs))
            tok = tl.where(last, doc_end, tok + BLOCK_D)
            doc_start = tl.where(last, doc_end, doc_start)
            doc_end = tl.where(last, next_end, doc_end)
            doc = doc + last.to(tl.int64)
    else:
        # Longer queries than planned: walk the group's rows in tiles, for each document.
        for doc in range(doc_first, doc_last):
            start = tl.load(d_off_ptr + doc)
            stop = tl.load(d_off_ptr + doc + 1)
            scores = tl.zeros([MAX_Q], tl.float32)
            for r in range(row_first, row_last, BLOCK_Q):
                q, sq, rows, row_ok = _query_tile(
                    q_ptr, q_scale_ptr, r, row_last, dim, stride_q, BLOCK_Q, BLOCK_K
                )
                local = tl.sum((rows[:, None] >= q_ends[None, :]).to(tl.int32), axis=1)
                member = (local[:, None] == kq[None, :]) & row_ok[:, None]
                row_max, row_arg = _doc_row_max(
                    q,
                    d_ptr,
                    d_scale_ptr,
                    start,
                    stop,
                    dim,
                    stride_d,
                    BLOCK_Q,
                    BLOCK_D,
                    BLOCK_K,
                    MAGIC,
                    RETURN_ARGMAX,
                    TMA,
                )
                contrib = tl.where(row_ok, sq * row_max, 0.0)
                scores += tl.sum(tl.where(member, contrib[:, None], 0.0), axis=0)
                if RETURN_ARGMAX:
                    tl.store(arg_ptr + rows * stride_arg + doc, row_arg, mask=row_ok)
            tl.store(out_rows + doc, scores, mask=q_ok)


@triton.jit
def candidate_query(cand_off_ptr, c, n_queries):
    """The query whose candidate list holds flat candidate c: the largest q with cand_off[q] <= c."""
    lo = c * 0
    hi = lo + n_queries
    while hi - lo > 1:
        mid = (lo + hi) // 2
        below = tl.load(cand_off_ptr + mid) <= c
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    return lo


@triton.jit(
    do_not_specialize=["n_queries", "n_cand", "n_docs", "stride_arg"],
    do_not_specialize_on_alignment=["q_off_ptr", "cand_off_ptr", "cand_docs_ptr", "d_off_ptr"],
)
def _maxsim_int8_candidates_kernel(
    # pointers
    q_ptr,
    q_scale_ptr,
    q_off_ptr,
    cand_off_ptr,
    cand_docs_ptr,
    d_ptr,
    d_scale_ptr,
    d_off_ptr,
    out_ptr,
    arg_ptr,
    # sizes
    n_queries,
    n_cand,
    n_docs,
    dim,
    # strides
    stride_q,
    stride_d,
    stride_arg,
    CANDS_PER_PROG: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MAGIC: tl.constexpr,
    RETURN_ARGMAX: tl.constexpr,
    ELEMENT_MAX: tl.constexpr,
    TMA: tl.constexpr = False,
    ROTATE: tl.constexpr = False,
):
    """Scores of CANDS_PER_PROG consecutive (query, candidate) pairs of the flat candidate list.

    TMA as in `_scaled_tile`; ROTATE as in maxsim_forward's candidates kernel (the run is walked from its
    (pid mod n)-th candidate on, wrapping around). A candidate index outside [0, n_docs) is never
    dereferenced: it is walked as an empty document and scored NaN (argmax -1)."""
    c_first = tl.program_id(0).to(tl.int64) * CANDS_PER_PROG
    c_last = tl.minimum(c_first + CANDS_PER_PROG, n_cand)
    query = candidate_query(cand_off_ptr, c_first, n_queries)
    row_first = tl.load(q_off_ptr + query)
    row_last = tl.load(q_off_ptr + query + 1)
    if (tl.load(cand_off_ptr + query + 1) >= c_last) & (row_last - row_first <= BLOCK_Q):
        # One query, one tile (the planned case): the query tile stays on chip, all the tiles of the run's
        # candidates in ONE loop (prefetch across candidates).
        q, sq, rows, row_ok = _query_tile(
            q_ptr, q_scale_ptr, row_first, row_last, dim, stride_q, BLOCK_Q, BLOCK_K
        )
        cc = c_first + tl.arange(0, CANDS_PER_PROG)
        c_in = cc < c_last
        cdocs = tl.load(cand_docs_ptr + cc, mask=c_in, other=0)
        c_ok = c_in & (cdocs >= 0) & (cdocs < n_docs)  # a bad index: one tile of an empty document
        n_tiles = tile_count(d_off_ptr, cdocs, c_ok, c_in, BLOCK_D)
        c = c_first
        if ROTATE:
            c = c_first + tl.program_id(0) % (c_last - c_first)
        doc = tl.load(cand_docs_ptr + c)
        doc_ok = (doc >= 0) & (doc < n_docs)
        doc_start = tl.load(d_off_ptr + doc, mask=doc_ok, other=0)
        doc_end = tl.load(d_off_ptr + doc + 1, mask=doc_ok, other=0)
        tok = doc_start
        row_max = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        row_arg = tl.full([BLOCK_Q], -1, tl.int32)
        m_tile = tl.full((BLOCK_Q, BLOCK_D) if ELEMENT_MAX else (1, 1), float("-inf"), tl.float32)
        for _ in range(n_tiles):
            val = _scaled_tile(
                q, d_ptr, d_scale_ptr, tok, doc_end, dim, stride_d, BLOCK_Q, BLOCK_D, BLOCK_K, MAGIC, TMA
            )
            row_max, row_arg, m_tile = fold_tile(
                val, row_max, row_arg, m_tile, tok, doc_start, ELEMENT_MAX, RETURN_ARGMAX
            )
            last = tok + BLOCK_D >= doc_end
            if last:
                row_max = document_max(row_max, m_tile, 1, ELEMENT_MAX)
                score = tl.sum(tl.where(row_ok, sq * row_max, 0.0), axis=0)
                tl.store(out_ptr + c, tl.where(doc_ok, score, float("nan")))
                if RETURN_ARGMAX:
                    tl.store(arg_ptr + c * stride_arg + (rows - row_first), row_arg, mask=row_ok)
                row_max, row_arg, m_tile = restart(row_max, row_arg, m_tile, ELEMENT_MAX, RETURN_ARGMAX)
            c_next = c + 1
            if ROTATE:
                c_next = tl.where(c_next >= c_last, c_first, c_next)
            next_doc = tl.load(cand_docs_ptr + tl.minimum(c_next, n_cand - 1))
            next_ok = (next_doc >= 0) & (next_doc < n_docs)
            next_start = tl.load(d_off_ptr + next_doc, mask=next_ok, other=0)
            next_end = tl.load(d_off_ptr + next_doc + 1, mask=next_ok, other=0)
            tok = tl.where(last, next_start, tok + BLOCK_D)
            doc_start = tl.where(last, next_start, doc_start)
            doc_end = tl.where(last, next_end, doc_end)
            doc_ok = tl.where(last, next_ok, doc_ok)
            c = tl.where(last, c_next, c)
    else:
        # The run crosses into the next query(s), or a query is longer than one tile.
        for c in range(c_first, c_last):
            query = candidate_query(cand_off_ptr, c, n_queries)
            row_first = tl.load(q_off_ptr + query)
            row_last = tl.load(q_off_ptr + query + 1)
            doc = tl.load(cand_docs_ptr + c).to(tl.int64)
            doc_ok = (doc >= 0) & (doc < n_docs)
            start = tl.load(d_off_ptr + doc, mask=doc_ok, other=0)
            stop = tl.load(d_off_ptr + doc + 1, mask=doc_ok, other=0)
            contrib = tl.zeros([BLOCK_Q], tl.float32)
            for r in range(row_first, row_last, BLOCK_Q):
                q, sq, rows, row_ok = _query_tile(
                    q_ptr, q_scale_ptr, r, row_last, dim, stride_q, BLOCK_Q, BLOCK_K
                )
                row_max, row_arg = _doc_row_max(
                    q,
                    d_ptr,
                    d_scale_ptr,
                    start,
                    stop,
                    dim,
                    stride_d,
                    BLOCK_Q,
                    BLOCK_D,
                    BLOCK_K,
                    MAGIC,
                    RETURN_ARGMAX,
                    TMA,
                )
                contrib += tl.where(row_ok, sq * row_max, 0.0)
                if RETURN_ARGMAX:
                    tl.store(arg_ptr + c * stride_arg + (rows - row_first), row_arg, mask=row_ok)
            tl.store(out_ptr + c, tl.where(doc_ok, tl.sum(contrib, axis=0), float("nan")))


# ----------------------------------------------------------------------------------------------------------
# Host side: checks, quantization, launchers
# ----------------------------------------------------------------------------------------------------------


def quantize_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x if x.stride(1) == 1 else x.contiguous()
    n, dim = x.shape
    codes = torch.empty((n, dim), dtype=torch.int8, device=x.device)
    scales = torch.empty((n,), dtype=torch.float32, device=x.device)
    if n:
        block_k = triton.next_power_of_2(dim)
        block_r = max(1, min(_QUANT_BLOCK_R, 8192 // block_k))
        _quantize_rows_kernel[(cdiv(n, block_r),)](
            x, codes, scales, n, dim, x.stride(0), codes.stride(0), BLOCK_R=block_r, BLOCK_K=block_k
        )
    return codes, scales


def _block_k(dim: int) -> int:
    return max(32, triton.next_power_of_2(dim))  # int8 tl.dot needs K >= 32


def _row_cap(block_k: int) -> int:
    return _VARLEN_BLOCK_Q if block_k <= 256 else 64  # wide vectors: keep the tiles within shared memory


def _varlen_plan(n_rows: int, n_queries: int, dim: int) -> tuple[int, int, int]:
    """(BLOCK_Q, queries per group, BLOCK_K) from the shapes alone (no look at the offsets' values).

    Groups hold a fixed number of consecutive queries, sized so that queries of the mean length (rounded
    up to a power of two) fill one BLOCK_Q tile; a group that turns out longer is walked in tiles.
    """
    block_k = _block_k(dim)
    cap = _row_cap(block_k)
    mean = triton.next_power_of_2(max(1, -(-n_rows // max(1, n_queries))))
    if mean >= cap:
        return cap, 1, block_k
    per_group = min(_MAX_QUERIES_PER_GROUP, cap // mean, triton.next_power_of_2(n_queries))
    return max(16, min(cap, per_group * mean)), per_group, block_k


def _tma_codes(d8: torch.Tensor, block_d: int, block_k: int, wanted: bool) -> Any:
    """A TMA descriptor of the document codes for tiles [block_d, block_k] where `wanted` and the GPU and
    layout allow it (sm_90+, block_k == dim, 16-byte aligned rows and base), else None (pointer loads)."""
    if not wanted or d8.device.type != "cuda" or d8.shape[1] != block_k or d8.shape[0] == 0:
        return None
    if d8.data_ptr() % 16 or d8.stride(0) % 16 or not hopper_device(d8.device):
        return None
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover - a Triton release without host descriptors
        return None
    return TensorDescriptor.from_tensor(d8, [block_d, block_k])


@dataclass(frozen=True)
class Tiles:
    """One Triton launch's tile choices: the tuning constants above (`_varlen_tiles`, `_candidate_tiles`),
    or a sweep's (`launch_varlen_with_tiles`, `launch_candidates_with_tiles`)."""

    block_q: int  # query rows a tile
    block_d: int  # document tokens a tile
    per_prog: int  # documents (all pairs) or candidates a program
    num_warps: int
    num_stages: int
    element_max: bool  # running max per tile element (scores only: never with the argmax)
    tma: bool  # document tiles by TMA where the GPU and the layout allow it (`_tma_codes`)
    queries_per_group: int = 1  # all pairs: consecutive queries a program
    rotate: bool = False  # candidates: each run of a document's tiles starts at a rotated tile
    maxnreg: int | None = None  # ptxas's register cap a thread (sweeps only: `_register_cap`)


def _register_cap(maxnreg: int | None) -> dict[str, int]:
    """ptxas's register cap a thread as a launch option, for sweeps: the HBM-bound tiles gained nothing
    from one (docs/kernel-notes.md), so the tuned tiles set none. Compiled launches only (the interpreter
    takes no such option)."""
    return {"maxnreg": maxnreg} if maxnreg and not interpreting() else {}


def _varlen_tiles(n_rows: int, n_queries: int, dim: int) -> Tiles:
    """The all-pairs tiles from the tuning constants: the few-queries entry for at most
    `_FEW_QUERIES_MAX_ROWS` query tokens in all (bound by HBM, not by the tensor cores)."""
    block_q, per_group, block_k = _varlen_plan(n_rows, n_queries, dim)
    few = n_rows <= _FEW_QUERIES_MAX_ROWS
    block_d = _FEW_QUERIES_BLOCK_D if few else _VARLEN_BLOCK_D
    return Tiles(
        block_q=block_q,
        block_d=min(block_d, 32) if block_k > 256 else block_d,
        per_prog=_FEW_QUERIES_DOCS_PER_PROG if few else _VARLEN_DOCS_PER_PROG,
        num_warps=_FEW_QUERIES_WARPS if few else _VARLEN_WARPS,
        num_stages=_FEW_QUERIES_STAGES if few else _VARLEN_STAGES,
        element_max=_FEW_QUERIES_ELEMENT_MAX if few else _VARLEN_ELEMENT_MAX,
        tma=_FEW_QUERIES_TMA if few else _VARLEN_TMA,
        queries_per_group=per_group,
    )


def _varlen_outputs(
    q8: torch.Tensor, nq: int, nd: int, device: torch.device, return_argmax: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    out = torch.empty((nq, nd), dtype=torch.float32, device=device)
    arg = torch.empty((q8.shape[0], nd), dtype=torch.int32, device=device) if return_argmax else None
    return out, arg


def launch_varlen(
    q8: torch.Tensor,
    sq: torch.Tensor,
    query_offsets: torch.Tensor,
    d8: torch.Tensor,
    sd: torch.Tensor,
    doc_offsets: torch.Tensor,
    return_argmax: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """All-pairs Triton launch with the tuned tiles (no host synchronisation)."""
    return launch_varlen_with_tiles(q8, sq, query_offsets, d8, sd, doc_offsets, return_argmax)


def launch_varlen_with_tiles(
    q8: torch.Tensor,
    sq: torch.Tensor,
    query_offsets: torch.Tensor,
    d8: torch.Tensor,
    sd: torch.Tensor,
    doc_offsets: torch.Tensor,
    return_argmax: bool,
    *,
    block_q: int | None = None,
    block_d: int | None = None,
    docs_per_prog: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    element_max: bool | None = None,
    tma: bool | None = None,
    maxnreg: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`launch_varlen` with some of its tiles replaced (None keeps the tuned choice), for the tile sweeps
    in benchmarks/; the library never calls it. A `block_q` other than the planned one takes as many
    queries a group as the tile holds at the mean query length."""
    nq, nd = query_offsets.numel() - 1, doc_offsets.numel() - 1
    out, arg = _varlen_outputs(q8, nq, nd, d8.device, return_argmax)
    if not out.numel():
        return out, arg
    tiles = _varlen_tiles(q8.shape[0], nq, d8.shape[1])
    changes: dict[str, Any] = {
        "block_d": block_d, "per_prog": docs_per_prog, "num_warps": num_warps, "num_stages": num_stages,
        "element_max": element_max, "tma": tma, "maxnreg": maxnreg,
    }  # fmt: skip
    if block_q and block_q != tiles.block_q:
        mean = triton.next_power_of_2(max(1, -(-q8.shape[0] // nq)))
        per_group = max(1, min(_MAX_QUERIES_PER_GROUP, block_q // mean, triton.next_power_of_2(nq)))
        changes.update(block_q=block_q, queries_per_group=per_group)
    tiles = replace(tiles, **{k: v for k, v in changes.items() if v is not None})
    _run_varlen(q8, sq, query_offsets, d8, sd, doc_offsets, out, arg, tiles)
    return out, arg


def _run_varlen(
    q8: torch.Tensor,
    sq: torch.Tensor,
    query_offsets: torch.Tensor,
    d8: torch.Tensor,
    sd: torch.Tensor,
    doc_offsets: torch.Tensor,
    out: torch.Tensor,
    arg: torch.Tensor | None,
    tiles: Tiles,
) -> None:
    nq, nd = out.shape
    dim = d8.shape[1]
    block_k = _block_k(dim)
    n_groups = cdiv(nq, tiles.queries_per_group)
    grid = (n_groups * cdiv(nd, tiles.per_prog),)
    codes = _tma_codes(d8, tiles.block_d, block_k, tiles.tma)
    launch_fitting_shared_memory(
        _maxsim_int8_varlen_kernel, grid,
        q8, sq, query_offsets, d8 if codes is None else codes, sd, doc_offsets, out,
        out if arg is None else arg,
        nq, n_groups, nd, dim,
        q8.stride(0), d8.stride(0), out.stride(0), nd,
        DOCS_PER_PROG=tiles.per_prog, BLOCK_Q=tiles.block_q, BLOCK_D=tiles.block_d, BLOCK_K=block_k,
        QUERIES_PER_GROUP=tiles.queries_per_group, MAX_Q=max(2, tiles.queries_per_group),
        MAGIC=dim <= _MAGIC_MAX_DIM, RETURN_ARGMAX=arg is not None, ONE_QUERY=nq == 1,
        ELEMENT_MAX=tiles.element_max and arg is None, TMA=codes is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **_register_cap(tiles.maxnreg),
    )  # fmt: skip


def hopper_allpairs(
    query_offsets: torch.Tensor,
    doc_offsets: torch.Tensor,
    q8: torch.Tensor,
    d8: torch.Tensor,
    return_argmax: bool,
) -> Any:
    """The Gluon all-pairs module (`maxsim_int8_hopper`) where it takes the problem, else None.

    It plans from host copies of the offsets. Offsets given on the device are read back once per tensor
    (memoised with the tensor, checked like host offsets): one synchronisation per new offsets tensor,
    taken only for problems of several query groups, which are tensor-core bound and long (512 queries x
    50K documents: ~40-65 ms a call), so that a library user's device tensors get the same kernel as the
    engine's host offsets (the Triton tiles are ~1.3x slower there)."""
    if return_argmax:
        return None
    hopper = gluon_module("maxsim_int8_hopper", d8.device)
    if hopper is None:
        return None
    on_device = query_offsets.device.type != "cpu" or doc_offsets.device.type != "cpu"
    if on_device and query_offsets.numel() - 1 < hopper.MIN_GROUPS:
        return None  # too few queries for the kernel whatever their lengths: never read the offsets back
    return hopper if hopper.supports(_query_lengths(query_offsets, q8.shape[0]), d8, return_argmax) else None


def hopper_stream(
    query_offsets: torch.Tensor,
    q8: torch.Tensor,
    d8: torch.Tensor,
    return_argmax: bool,
    residual: bool = False,
    int2: bool = False,
) -> tuple[Any, int] | None:
    """(the Gluon module `maxsim_int8_hopper_stream`, the longest query) where it takes an HBM-bound
    problem (one query against every document, or candidates), else None. The query lengths come from
    the host: offsets given there, or the queries' rows when there is one query (no synchronisation).
    `residual`: d8 holds residual2 codes (`supports_residual`); `int2`: int2 codes (`maxsim_codes`)."""
    if return_argmax:
        return None
    stream = gluon_module("maxsim_int8_hopper_stream", d8.device)
    if stream is None:
        return None
    if query_offsets.numel() == 2:
        q_lens = np.array([q8.shape[0]])
    elif query_offsets.device.type == "cpu":
        q_lens = _query_lengths(query_offsets, q8.shape[0])
    else:
        return None
    if residual:
        taken = stream.supports_residual(q_lens, d8)
    else:
        taken = stream.supports(q_lens, d8, return_argmax, int2)
    return (stream, int(q_lens.max())) if taken else None


def _query_lengths(query_offsets: torch.Tensor, n_tokens: int) -> np.ndarray:
    """The queries' lengths from their host offsets (memoised per offsets tensor)."""
    return memo(query_offsets, ("lens", n_tokens),
                lambda: np.diff(host_offsets("query_offsets", query_offsets, n_tokens)))  # fmt: skip


def launch_hopper(
    hopper: Any,
    query_offsets: torch.Tensor,
    doc_offsets: torch.Tensor,
    device_query_offsets: torch.Tensor,
    device_doc_offsets: torch.Tensor,
    q8: torch.Tensor,
    sq: torch.Tensor,
    d8: torch.Tensor,
    sd: torch.Tensor,
) -> torch.Tensor:
    """All pairs on the Gluon kernel, from the host offsets (the plan, and the tile table of a few
    thousand documents) and their device copies (what the kernel reads; nothing here waits for the
    device). The tables (`maxsim_int8_hopper.device_tables`) are kept on the host doc offsets tensor per
    scales tensor (freed with the offsets: in `maxsim score` every block of documents has its own)."""
    from .maxsim_forward import hopper_docs_per_program

    q_lens = _query_lengths(query_offsets, q8.shape[0])

    def tables() -> tuple[torch.Tensor, ...]:
        d_host = host_offsets("doc_offsets", doc_offsets, d8.shape[0])
        return hopper.device_tables(d_host, device_doc_offsets, sd)

    tiles = memo_pair(doc_offsets, sd, ("int8-hopper-tiles", hopper.BLOCK_T), tables)
    nq, nd = len(q_lens), len(tiles[2]) - 1
    queries_a_group = hopper.queries_per_group(int(q_lens.max()))
    docs_per_prog = hopper_docs_per_program(hopper, cdiv(nq, queries_a_group), nd, d8.device)
    return hopper.maxsim_int8_allpairs(
        q8, sq, device_query_offsets, d8, tiles, queries_a_group, docs_per_prog
    )


def _candidate_tiles(n_rows: int, n_queries: int, dim: int) -> Tiles:
    """The candidates' tiles from the tuning constants: a tile of the mean query length's rows."""
    block_k = _block_k(dim)
    mean = triton.next_power_of_2(max(1, -(-n_rows // n_queries)))
    return Tiles(
        block_q=max(16, min(_row_cap(block_k), mean)),
        block_d=min(_CAND_BLOCK_D, 32) if block_k > 256 else _CAND_BLOCK_D,
        per_prog=_CAND_PER_PROG,
        num_warps=_CAND_WARPS,
        num_stages=_CAND_STAGES,
        element_max=_CAND_ELEMENT_MAX,
        tma=_CAND_TMA,
        rotate=_ROTATE_CANDIDATES,
    )


def _candidate_outputs(
    query_offsets: torch.Tensor, n_cand: int, device: torch.device, return_argmax: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scores and argmax outputs; sizing the argmax synchronises (the longest query)."""
    nq = query_offsets.numel() - 1
    out = torch.empty((n_cand,), dtype=torch.float32, device=device)
    arg = None
    if return_argmax:
        max_len = int(query_offsets.diff().max()) if nq else 0
        arg = torch.full((n_cand, max_len), -1, dtype=torch.int32, device=device)
    return out, arg


def launch_candidates(
    q8: torch.Tensor,
    sq: torch.Tensor,
    query_offsets: torch.Tensor,
    d8: torch.Tensor,
    sd: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor,
    candidate_docs: torch.Tensor,
    return_argmax: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-query-candidates Triton launch with the tuned tiles; synchronises only to size the argmax."""
    return launch_candidates_with_tiles(
        q8, sq, query_offsets, d8, sd, doc_offsets, candidate_offsets, candidate_docs, return_argmax
    )


def launch_candidates_with_tiles(
    q8: torch.Tensor,
    sq: torch.Tensor,
    query_offsets: torch.Tensor,
    d8: torch.Tensor,
    sd: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor,
    candidate_docs: torch.Tensor,
    return_argmax: bool,
    *,
    block_d: int | None = None,
    cands_per_prog: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    element_max: bool | None = None,
    tma: bool | None = None,
    rotate: bool | None = None,
    maxnreg: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`launch_candidates` with some of its tiles replaced (None keeps the tuned choice), for the tile
    sweeps in benchmarks/; the library never calls it."""
    out, arg = _candidate_outputs(query_offsets, candidate_docs.numel(), d8.device, return_argmax)
    if not out.numel():
        return out, arg
    tiles = _candidate_tiles(q8.shape[0], query_offsets.numel() - 1, d8.shape[1])
    changes: dict[str, Any] = {
        "block_d": block_d, "per_prog": cands_per_prog, "num_warps": num_warps, "num_stages": num_stages,
        "element_max": element_max, "tma": tma, "rotate": rotate, "maxnreg": maxnreg,
    }  # fmt: skip
    tiles = replace(tiles, **{k: v for k, v in changes.items() if v is not None})
    _run_candidates(
        q8, sq, query_offsets, d8, sd, doc_offsets, candidate_offsets, candidate_docs, out, arg, tiles
    )
    return out, arg


def _run_candidates(
    q8: torch.Tensor,
    sq: torch.Tensor,
    query_offsets: torch.Tensor,
    d8: torch.Tensor,
    sd: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor,
    candidate_docs: torch.Tensor,
    out: torch.Tensor,
    arg: torch.Tensor | None,
    tiles: Tiles,
) -> None:
    n_cand = out.numel()
    dim = d8.shape[1]
    block_k = _block_k(dim)
    codes = _tma_codes(d8, tiles.block_d, block_k, tiles.tma)
    launch_fitting_shared_memory(
        _maxsim_int8_candidates_kernel, (cdiv(n_cand, tiles.per_prog),),
        q8, sq, query_offsets, candidate_offsets, candidate_docs, d8 if codes is None else codes, sd,
        doc_offsets, out, out if arg is None else arg,
        query_offsets.numel() - 1, n_cand, doc_offsets.numel() - 1, dim,
        q8.stride(0), d8.stride(0), 0 if arg is None else arg.stride(0),
        CANDS_PER_PROG=tiles.per_prog, BLOCK_Q=tiles.block_q, BLOCK_D=tiles.block_d, BLOCK_K=block_k,
        MAGIC=dim <= _MAGIC_MAX_DIM, RETURN_ARGMAX=arg is not None,
        ELEMENT_MAX=tiles.element_max and arg is None, TMA=codes is not None, ROTATE=tiles.rotate,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **_register_cap(tiles.maxnreg),
    )  # fmt: skip
