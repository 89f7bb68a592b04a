"""MaxSim over documents stored as codes below 8 bits (`code_packing`), on the GPU: Triton scan kernels that
decode in registers, the decode of int4 and int2 codes to int8 rows, and their launchers. The entry
points, checks and CPU paths are `codes_host`'s, which imports this module at the first call that launches
a kernel; scores as its docstring gives them.

The residual2 scan kernels split the product in two (the centroid's term as in PLAID;
`residual2_query_tables`):

    q8 . x = q8 . (C[c] + W[:, 0])  +  sum_v (q8 * D_v) . plane_v(b)

the first term a table over the codebook's centroids (float64, rounded once to fp32) gathered by the
token's centroid id, the second three tensor-core products with the token's bucket bits: W[k, b] =
W[k, 0] + b0 D_0[k] + b1 D_1[k] + b0 b1 D_2[k] for the bucket b = b0 + 2 b1, exactly, so the bit planes
(0 or 1, exact in fp16) replace a decode of the values; the query planes q8 * D_v are rounded to fp16
(relative 2^-11) and the products summed in fp32. A centroid id outside the codebook is never
dereferenced: the kernels score its document NaN.

Cost per document token, one query of Lq tokens, dim d (d = 128 in the figures):

    bytes from HBM:  int4      d / 2 + 4 = 68      (codes + fp32 scale)
                     int2      d / 4 + 4 = 36      (codes + fp32 scale)
                     residual2 d / 4 + 4 = 36      (codes + centroid id), + 4 Lq bytes of the centroid
                                                   table from L2 (fp32 [K, Lq]: 1 MB at K = 8192, Lq = 32)
    FLOPs:           int4: 2 * Lq * d int8 x int8 -> int32; residual2: 3 * 2 * Lq * d fp16 x fp16 -> fp32
                     (three bit planes; two where the buckets are separable, D_2 = 0, as `maxsim
                     quantize` fits them); unpacking (inline PTX, four bytes a register):
                     int4 7 integer instructions per 8 values, residual2 ~2.5 per 2 plane values

One query of 32 tokens is 8192 (int4) or 24576 (residual2) tensor-core FLOPs a token against 68 (36)
bytes: 120 (680) FLOP/B. The int4 scan is bound by HBM at 68 B/token: on an H100 (3.35 TB/s) 16 M tokens
read in 0.33 ms at best, against 1.2 ms for fp16's 256 B/token. The residual2 scan is past the fp16 ridge
(~300 FLOP/B): 16 M tokens are 393 GFLOP, 0.40 ms at the H100's 989 TFLOP/s, against 0.17 ms for its
bytes; the centroid table's gather (128 B a token from L2 at Lq = 32) comes on top. The decode cost is
paid once per (query group, token): with many queries a group of up to BLOCK_Q query tokens shares each
decoded tile, as in the int8 all-pairs kernel.

Tiling (Triton). A row of codes is read once as whole bytes and split into its parts (int4: the low and
high nibbles, values 2m and 2m + 1; residual2: the four 2-bit buckets of byte 4 + m, values 4m + p, each
as three bit planes), each part multiplied with the query columns it holds (the query planes are in
part-major column order, so that a part is one contiguous run). All pairs: a program takes a group of
consecutive queries (sized from the shapes so that queries of the mean length fill one BLOCK_Q-row tile,
as in `maxsim_int8`) and DOCS_PER_PROG consecutive documents; the group's query tile stays on chip and the
BLOCK_D-token tiles of all its documents run in one loop (a document's first tile starts at its first
token, the last is masked with -inf), the running max kept per tile element and reduced once a document.
Candidates: a program takes consecutive entries of the flat candidate list, one loop over their tiles when
they belong to one query (else candidate by candidate, their query found by binary search in
candidate_offsets). The residual2 centroid table of one launch is at most `_CENTROID_TABLE_BYTES`; more
query rows are scanned in launches of whole queries. The plans (`Tiles`) and their measurements:
docs/kernel-notes.md, "Codes below 8 bits". Scores only (no argmax).

On an sm_90 GPU, int4 at dim 128 with one query, or candidates with query offsets on the host (queries of
at most 64 tokens), runs on the Gluon stream kernel of `maxsim_int8_hopper_stream` instead (TMA ring,
nibbles unpacked into wgmma's register operand; the same maxima, the query sums in its own order); so does
residual2 at dim 128 with separable buckets (queries of at most 32 tokens, a centroid table of one launch:
cp.async ring, the bit planes made in wgmma's register operand, the same eight products a tile); so does
int2 at dim 128, queries of at most 32 tokens (TMA ring, the odd values unpacked into wgmma's register
operand, four int8 products a tile); everywhere else int2 documents are decoded to their odd values
(`int2_to_int8`; `codes_host`: whole documents, at most `codes_host.DECODE_CHUNK_BYTES` at a time, a
rerank's candidates gathered first) and scored by the int8 kernels of `maxsim_int8` with their scales. All
pairs of enough queries to be bound by the tensor cores (`int4_allpairs_on_hopper`) decode int4 documents
the same way (`int4_to_int8`) and score them on the Gluon all-pairs kernel of `maxsim_int8_hopper`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .code_packing import Int2Levels, Int2Queries, ResidualCodebook
from .code_unpacking import INT4_NIBBLES_ASM, PLANE_UNIT_ASM, bucket_planes_asm
from .launch import launch_fitting_shared_memory
from .maxsim_int8 import candidate_query, hopper_allpairs, hopper_stream, quantize_rows
from .running_max import document_max, fold_tile, restart, tile_count
from .validation import cdiv, interpreting, memo


# Tile sizes (`Tiles`): the all-pairs plan for many query rows a program, the few-rows plan for one or a
# few queries (the HBM-bound scan) and the candidates plan; the int8 kernel's (maxsim_int8) as the
# starting point, chosen on the GPU by `benchmarks/bench_codes.py --sweep` (docs/kernel-notes.md).
class Tiles(NamedTuple):
    block_q: int  # query rows a program at most (its group's tile)
    block_d: int  # document tokens a tile
    docs_per_prog: int  # documents (all pairs) or candidates a program
    warps: int
    stages: int
    doc_major: bool = False  # documents the first operand of the products (see `_code_tile`)
    decode: bool = False  # residual2: decode the values (`_residual2_part`) in place of the bit planes


# residual2, 512 x 50K on an H100 (codes-h100-68c6411.json): the bit planes' three products a part took
# 856 ms where decoding the values took 353 (a decoded tile serves 256 query rows)
_ALL_PAIRS = Tiles(block_q=256, block_d=32, docs_per_prog=64, warps=4, stages=2, decode=True)
# one query x 100K documents, H100 (codes-sweep-h100-68c6411.json, unpacking by inline PTX, residual2 by
# bit planes): documents as the first operand, int4 0.674 ms (2 or 3 stages alike; query-major 1.277),
# residual2 3.245 ms with 16 documents a program and 2 stages against 3.441 with 64 and 3 (4.699 query-major)
_FEW_ROWS = {
    "int4": Tiles(block_q=64, block_d=64, docs_per_prog=64, warps=4, stages=3, doc_major=True),
    "residual2": Tiles(block_q=64, block_d=128, docs_per_prog=16, warps=4, stages=2, doc_major=True),
}
_CANDIDATES = Tiles(block_q=64, block_d=64, docs_per_prog=16, warps=4, stages=3)
_FEW_ROWS_MAX = 64  # query rows at most for the few-rows plan (one or two queries of 32 tokens)
_MAX_QUERIES_PER_GROUP = 32


@triton.jit(do_not_specialize=["n_rows", "dim"])
def _int2_query_kernel(
    x_ptr, steps_ptr, offsets_ptr, q_off_ptr, codes_ptr, scales_ptr, row_offsets_ptr, sums_ptr,
    n_rows, dim, stride_x, stride_codes,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Query q's int2 side (`codes_host.int2_queries`): its rows x times the steps quantized per token
    (codes, scales), each row's x . offsets in float64 rounded to fp32 (row_offsets), and their sum in
    float64, rounded (sums[q]).
    Rows outside [0, n_rows) (offsets not checked on the host) are neither read nor written."""
    q = tl.program_id(0)
    r0 = tl.load(q_off_ptr + q)
    r1 = tl.load(q_off_ptr + q + 1)
    cols = tl.arange(0, BLOCK_K)
    col_ok = cols < dim
    steps = tl.load(steps_ptr + cols, mask=col_ok, other=0.0)
    offsets = tl.load(offsets_ptr + cols, mask=col_ok, other=0.0).to(tl.float64)
    total = tl.zeros([BLOCK_R], dtype=tl.float64)
    for start in range(r0, r1, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        row_ok = (rows < r1) & (rows >= 0) & (rows < n_rows)
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        codes, scale = quantize_rows(x * steps[None, :])
        tl.store(codes_ptr + rows[:, None] * stride_codes + cols[None, :], codes, mask=mask)
        tl.store(scales_ptr + rows, scale, mask=row_ok)
        row = tl.sum(x.to(tl.float64) * offsets[None, :], axis=1).to(tl.float32)
        tl.store(row_offsets_ptr + rows, row, mask=row_ok)
        total += tl.where(row_ok, row.to(tl.float64), 0.0)
    tl.store(sums_ptr + q, tl.sum(total, axis=0).to(tl.float32))


def int2_queries_triton(
    queries: torch.Tensor, levels: Int2Levels, query_offsets: torch.Tensor
) -> Int2Queries:
    """`codes_host.int2_queries` in one launch (`_int2_query_kernel`): a program a query."""
    x = queries if queries.stride(1) == 1 else queries.contiguous()
    n, dim = x.shape
    dev = x.device
    q8 = torch.empty((n, dim), dtype=torch.int8, device=dev)
    scales = torch.empty((n,), dtype=torch.float32, device=dev)
    row_offsets = torch.empty((n,), dtype=torch.float32, device=dev)
    sums = torch.empty((query_offsets.numel() - 1,), dtype=torch.float32, device=dev)
    if sums.numel():
        block_k = triton.next_power_of_2(dim)
        _int2_query_kernel[(sums.numel(),)](
            x, levels.steps.to(dev, torch.float32), levels.offsets.to(dev, torch.float32), query_offsets,
            q8, scales, row_offsets, sums, n, dim, x.stride(0), q8.stride(0),
            BLOCK_R=max(1, min(16, 4096 // block_k)), BLOCK_K=block_k,
        )  # fmt: skip
    return Int2Queries(q8, scales, row_offsets, sums)


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------

# Unpacking on the GPU: inline PTX, four bytes of codes a 32-bit register (`code_unpacking`); Triton's
# interpreter runs the tl ops of `_int4_nibbles` / `_bucket_planes` instead, which give the same values.
_INT4_NIBBLES_ASM: tl.constexpr = tl.constexpr(INT4_NIBBLES_ASM)


_PLANES_ASM_0: tl.constexpr = tl.constexpr(bucket_planes_asm(0))
_PLANES_ASM_1: tl.constexpr = tl.constexpr(bucket_planes_asm(1))
_PLANES_ASM_2: tl.constexpr = tl.constexpr(bucket_planes_asm(2))
_PLANES_ASM_3: tl.constexpr = tl.constexpr(bucket_planes_asm(3))


@triton.jit
def _int4_nibbles(packed, ASM: tl.constexpr):
    """The low and high nibbles of uint8 codes as int8 (two's complement)."""
    if ASM:
        low, high = tl.inline_asm_elementwise(
            _INT4_NIBBLES_ASM, "=r,=r,r", [packed], dtype=(tl.int8, tl.int8), is_pure=True, pack=4
        )
    else:
        wide = packed.to(tl.int32)
        low = (((wide & 0xF) ^ 8) - 8).to(tl.int8)
        high = (((wide >> 4) ^ 8) - 8).to(tl.int8)
    return low, high


@triton.jit
def _planes_from_asm(packed, ASM_TEXT: tl.constexpr):
    return tl.inline_asm_elementwise(
        ASM_TEXT, "=r,=r,=r,=r,=r,=r,r", [packed], dtype=(tl.float16, tl.float16, tl.float16), is_pure=True,
        pack=4,
    )


@triton.jit
def _bucket_planes(packed, PART: tl.constexpr, ASM: tl.constexpr):
    """Bucket PART of each uint8 byte as three fp16 planes: bit 0, bit 1 and both bits, each 0 or one
    unit (1.0; 2^-14 = PLANE_UNIT_ASM with ASM)."""
    if ASM:
        if PART == 0:
            b0, b1, both = _planes_from_asm(packed, _PLANES_ASM_0)
        elif PART == 1:
            b0, b1, both = _planes_from_asm(packed, _PLANES_ASM_1)
        elif PART == 2:
            b0, b1, both = _planes_from_asm(packed, _PLANES_ASM_2)
        else:
            b0, b1, both = _planes_from_asm(packed, _PLANES_ASM_3)
    else:
        bucket = (packed.to(tl.int32) >> (2 * PART)) & 3
        b0 = (bucket & 1).to(tl.float16)
        b1 = (bucket >> 1).to(tl.float16)
        both = (bucket == 3).to(tl.float16)
    return b0, b1, both


@triton.jit
def _query_planes(
    q_ptr,
    q_scale_ptr,
    row_first,
    row_last,
    dim,
    stride_q,
    stride_plane,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CODEC: tl.constexpr,
    DECODE: tl.constexpr,
):
    """Rows row_first.. (< row_last) of the query side, split as the codes are packed, and their scales.

    int4: a tuple (q[:, 0::2], q[:, 1::2]) of the int8 queries, the values of each byte's low and high
    nibbles. residual2: the fp16 query planes (`residual2_query_tables`, [3, rows, dim] in part-major
    column order at q_ptr), a tuple of 12: plane v of part p at 3p + v (CODEC 2, separable buckets: plane
    2 is zero and not loaded, its place holding plane 0, never multiplied); with DECODE, the int8 queries
    (q[:, 0::4], .., q[:, 3::4]) as fp16 (exact). BLOCK_K is the width of one part (a power of two >= the
    tensor cores' minimum K)."""
    rows = row_first + tl.arange(0, BLOCK_Q)
    row_ok = rows < row_last
    k = tl.arange(0, BLOCK_K)
    sq = tl.load(q_scale_ptr + rows, mask=row_ok, other=1.0)
    if CODEC == 0:
        ok = row_ok[:, None] & (k < dim // 2)[None, :]
        base = q_ptr + rows[:, None] * stride_q + 2 * k[None, :]
        qp = (tl.load(base, mask=ok, other=0), tl.load(base + 1, mask=ok, other=0))
    elif DECODE:
        ok = row_ok[:, None] & (k < dim // 4)[None, :]
        base = q_ptr + rows[:, None] * stride_q + 4 * k[None, :]
        qp = (
            tl.load(base, mask=ok, other=0).to(tl.float16),
            tl.load(base + 1, mask=ok, other=0).to(tl.float16),
            tl.load(base + 2, mask=ok, other=0).to(tl.float16),
            tl.load(base + 3, mask=ok, other=0).to(tl.float16),
        )
    elif CODEC == 2:  # separable buckets: no third plane (its place holds the first, never multiplied)
        quarter = dim // 4
        ok = row_ok[:, None] & (k < quarter)[None, :]
        base = q_ptr + rows[:, None] * stride_q + k[None, :]
        p0 = tl.load(base, mask=ok, other=0.0)
        p1 = tl.load(base + quarter, mask=ok, other=0.0)
        p2 = tl.load(base + 2 * quarter, mask=ok, other=0.0)
        p3 = tl.load(base + 3 * quarter, mask=ok, other=0.0)
        qp = (
            p0, tl.load(base + stride_plane, mask=ok, other=0.0), p0,
            p1, tl.load(base + stride_plane + quarter, mask=ok, other=0.0), p1,
            p2, tl.load(base + stride_plane + 2 * quarter, mask=ok, other=0.0), p2,
            p3, tl.load(base + stride_plane + 3 * quarter, mask=ok, other=0.0), p3,
        )  # fmt: skip
    else:
        quarter = dim // 4
        ok = row_ok[:, None] & (k < quarter)[None, :]
        base = q_ptr + rows[:, None] * stride_q + k[None, :]
        qp = (
            tl.load(base, mask=ok, other=0.0),
            tl.load(base + stride_plane, mask=ok, other=0.0),
            tl.load(base + 2 * stride_plane, mask=ok, other=0.0),
            tl.load(base + quarter, mask=ok, other=0.0),
            tl.load(base + stride_plane + quarter, mask=ok, other=0.0),
            tl.load(base + 2 * stride_plane + quarter, mask=ok, other=0.0),
            tl.load(base + 2 * quarter, mask=ok, other=0.0),
            tl.load(base + stride_plane + 2 * quarter, mask=ok, other=0.0),
            tl.load(base + 2 * stride_plane + 2 * quarter, mask=ok, other=0.0),
            tl.load(base + 3 * quarter, mask=ok, other=0.0),
            tl.load(base + stride_plane + 3 * quarter, mask=ok, other=0.0),
            tl.load(base + 2 * stride_plane + 3 * quarter, mask=ok, other=0.0),
        )
    return qp, sq, rows, row_ok


@triton.jit
def _product(acc, doc_part, q_part, DOC_MAJOR: tl.constexpr):
    """acc + the products of a decoded document part with a query part ([BLOCK_D, BLOCK_Q] with DOC_MAJOR:
    the decoded tile is the first operand, fed to the tensor cores from registers)."""
    if DOC_MAJOR:
        acc = tl.dot(doc_part, tl.trans(q_part), acc, out_dtype=acc.dtype)
    else:
        acc = tl.dot(q_part, tl.trans(doc_part), acc, out_dtype=acc.dtype)
    return acc


@triton.jit
def _residual2_part(acc, q_part, packed, cent_rows, id_ok, wts_ptr, m, m_ok, quarter, PART: tl.constexpr,
                    DOC_MAJOR: tl.constexpr):  # fmt: skip
    """acc + the products of part PART (dimensions 4m + PART) with the values decoded, x = fp16(C[id,
    4m + PART] + W[4m + PART, b]) (the sum rounded once to fp16: 2^-11 relative).

    The codebook is in part-major order (`_parts_major`): part PART of a centroid is the contiguous
    columns PART * quarter + m, and so are the rows of W."""
    bucket = (packed.to(tl.int32) >> (2 * PART)) & 3
    cent = tl.load(cent_rows + PART * quarter, mask=id_ok[:, None] & m_ok[None, :], other=0.0).to(tl.float32)
    w_row = wts_ptr + (PART * quarter + m) * 4
    w0 = tl.load(w_row, mask=m_ok, other=0.0)[None, :]
    w1 = tl.load(w_row + 1, mask=m_ok, other=0.0)[None, :]
    w2 = tl.load(w_row + 2, mask=m_ok, other=0.0)[None, :]
    w3 = tl.load(w_row + 3, mask=m_ok, other=0.0)[None, :]
    odd = (bucket & 1) != 0
    weight = tl.where((bucket & 2) != 0, tl.where(odd, w3, w2), tl.where(odd, w1, w0))
    return _product(acc, (cent + weight).to(tl.float16), q_part, DOC_MAJOR)


@triton.jit
def _code_tile(
    qp,
    rows,
    row_ok,
    d_ptr,
    d_scale_ptr,
    qc_ptr,
    wts_ptr,
    tok,
    doc_end,
    n_centroids,
    dim,
    stride_d,
    stride_qc,
    plane_scale,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CODEC: tl.constexpr,
    DOC_MAJOR: tl.constexpr,
    ASM: tl.constexpr,
    DECODE: tl.constexpr,
):
    """Similarities of the query tile with document tokens tok.. decoded in registers, [BLOCK_Q, BLOCK_D]
    ([BLOCK_D, BLOCK_Q] with DOC_MAJOR); -inf from doc_end on, +inf for a token whose centroid id is
    outside the codebook (flagged later).

    Each row of codes is read once as whole bytes (contiguous, vectorised loads) and unpacked into its
    parts (two nibbles; four 2-bit buckets, each as three bit planes), each part multiplied with the query
    columns it holds. residual2 adds the query rows' products with the token's centroid, gathered from the
    table at qc_ptr ([K, stride_qc] fp32, `residual2_query_tables`); with DECODE, qc_ptr and wts_ptr are
    the part-major codebook (`_parts_major`) and the values are decoded (`_residual2_part`)."""
    cols = tok + tl.arange(0, BLOCK_D)
    col_ok = cols < doc_end
    m = tl.arange(0, BLOCK_K)
    bias = tl.where(col_ok, 0.0, float("-inf"))
    row_start = d_ptr + cols.to(tl.int64) * stride_d
    if CODEC == 0:
        # int4: byte m holds value 2m in its low nibble and 2m + 1 in its high one (two's complement)
        m_ok = m < dim // 2
        packed = tl.load(row_start[:, None] + m[None, :], mask=col_ok[:, None] & m_ok[None, :], other=0)
        low, high = _int4_nibbles(packed, ASM)
        s = tl.load(d_scale_ptr + cols, mask=col_ok, other=1.0)
        if DOC_MAJOR:
            acc = tl.zeros([BLOCK_D, BLOCK_Q], tl.int32)
        else:
            acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.int32)
        acc = _product(acc, low, qp[0], DOC_MAJOR)
        acc = _product(acc, high, qp[1], DOC_MAJOR)  # exact below 2^24
        if DOC_MAJOR:
            sim = acc.to(tl.float32) * s[:, None] + bias[:, None]
        else:
            sim = acc.to(tl.float32) * s[None, :] + bias[None, :]
        return sim
    else:
        # residual2: the centroid id from bytes 0-3, then byte 4 + m holds the buckets of 4m .. 4m + 3
        cid = tl.zeros([BLOCK_D], tl.int64)
        for i in tl.static_range(4):
            part = tl.load(row_start + i, mask=col_ok, other=0).to(tl.int64)
            cid = cid | (part << (8 * i))
        id_ok = col_ok & (cid < n_centroids)
        m_ok = m < dim // 4
        packed = tl.load(row_start[:, None] + 4 + m[None, :], mask=col_ok[:, None] & m_ok[None, :], other=0)
        if DOC_MAJOR:
            acc = tl.zeros([BLOCK_D, BLOCK_Q], tl.float32)
        else:
            acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
        bad = col_ok & (cid >= n_centroids)
        extra = tl.where(bad, float("inf"), bias)
        if DECODE:
            cent_rows = qc_ptr + cid[:, None] * dim + m[None, :]
            quarter = dim // 4
            for p in tl.static_range(4):
                acc = _residual2_part(acc, qp[p], packed, cent_rows, id_ok, wts_ptr, m, m_ok, quarter, p,
                                      DOC_MAJOR)  # fmt: skip
            if DOC_MAJOR:
                sim = acc + extra[:, None]
            else:
                sim = acc + extra[None, :]
        else:
            for p in tl.static_range(4):
                b0, b1, both = _bucket_planes(packed, p, ASM)
                acc = _product(acc, b0, qp[3 * p], DOC_MAJOR)
                acc = _product(acc, b1, qp[3 * p + 1], DOC_MAJOR)
                if CODEC == 1:  # (separable buckets, CODEC 2: D_2 = 0, no third product)
                    acc = _product(acc, both, qp[3 * p + 2], DOC_MAJOR)
            if DOC_MAJOR:
                at = qc_ptr + cid[:, None] * stride_qc + rows[None, :]
                centroid = tl.load(at, mask=id_ok[:, None] & row_ok[None, :], other=0.0)
                sim = acc * plane_scale + centroid + extra[:, None]
            else:
                at = qc_ptr + cid[None, :] * stride_qc + rows[:, None]
                centroid = tl.load(at, mask=id_ok[None, :] & row_ok[:, None], other=0.0)
                sim = acc * plane_scale + centroid + extra[None, :]
        return sim


@triton.jit
def _doc_sums(
    qp,
    sq,
    rows,
    row_ok,
    member,
    d_ptr,
    d_scale_ptr,
    qc_ptr,
    wts_ptr,
    start,
    stop,
    n_centroids,
    dim,
    stride_d,
    stride_qc,
    plane_scale,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CODEC: tl.constexpr,
    DOC_MAJOR: tl.constexpr,
    ASM: tl.constexpr,
    DECODE: tl.constexpr,
):
    """Per query of the group ([MAX_Q]): sum over its rows of the tile of s_q * max over one document."""
    row_max = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    for t in range(start, stop, BLOCK_D):
        sim = _code_tile(
            qp, rows, row_ok, d_ptr, d_scale_ptr, qc_ptr, wts_ptr, t, stop, n_centroids, dim, stride_d,
            stride_qc, plane_scale, BLOCK_Q, BLOCK_D, BLOCK_K, CODEC, DOC_MAJOR, ASM, DECODE,
        )  # fmt: skip
        row_max = tl.maximum(row_max, tl.max(sim, axis=0 if DOC_MAJOR else 1))
    contrib = tl.where(row_ok, sq * row_max, 0.0)
    return tl.sum(tl.where(member, contrib[:, None], 0.0), axis=0)


@triton.jit
def _flag_bad_ids(scores):
    """+inf comes only from a centroid id outside the codebook (the codebook is finite): NaN."""
    return tl.where(scores == float("inf"), float("nan"), scores)


@triton.jit(
    do_not_specialize=[
        "n_queries", "n_groups", "n_docs", "n_centroids", "stride_out", "stride_plane", "stride_qc"
    ],
    do_not_specialize_on_alignment=["q_off_ptr", "d_off_ptr"],
)
def _maxsim_codes_varlen_kernel(
    # pointers
    q_ptr,
    q_scale_ptr,
    q_off_ptr,
    d_ptr,
    d_scale_ptr,
    d_off_ptr,
    qc_ptr,
    wts_ptr,
    out_ptr,
    # sizes
    n_queries,
    n_groups,
    n_docs,
    n_centroids,
    dim,
    # strides
    stride_q,
    stride_d,
    stride_out,
    stride_plane,
    stride_qc,
    plane_scale,
    CODEC: tl.constexpr,
    DOCS_PER_PROG: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    QUERIES_PER_GROUP: tl.constexpr,
    MAX_Q: tl.constexpr,
    DOC_MAJOR: tl.constexpr,
    ASM: tl.constexpr,
    DECODE: tl.constexpr,
):
    """Scores of QUERIES_PER_GROUP consecutive queries against DOCS_PER_PROG consecutive documents."""
    pid = tl.program_id(0)
    group = pid % n_groups  # group fastest: programs sharing a document chunk run together (L2)
    doc_first = (pid // n_groups).to(tl.int64) * DOCS_PER_PROG
    doc_last = tl.minimum(doc_first + DOCS_PER_PROG, n_docs)
    q_first = group.to(tl.int64) * QUERIES_PER_GROUP
    q_last = tl.minimum(q_first + QUERIES_PER_GROUP, n_queries)
    row_first = tl.load(q_off_ptr + q_first)
    row_last = tl.load(q_off_ptr + q_last)
    kq = tl.arange(0, MAX_Q)
    q_ok = q_first + kq < q_last
    q_ends = tl.load(q_off_ptr + q_first + 1 + kq, mask=q_ok, other=9223372036854775807)
    out_rows = out_ptr + (q_first + kq) * stride_out
    if row_last - row_first <= BLOCK_Q:
        # The planned case: the group's query tile stays on chip, and the tiles of all the program's
        # documents run in ONE loop (the pipeliner prefetches across documents), the running max kept per
        # tile element and reduced once a document (as in maxsim_int8).
        qp, sq, rows, row_ok = _query_planes(
            q_ptr, q_scale_ptr, row_first, row_last, dim, stride_q, stride_plane, BLOCK_Q, BLOCK_K, CODEC,
            DECODE,
        )
        local = tl.sum((rows[:, None] >= q_ends[None, :]).to(tl.int32), axis=1)
        member = (local[:, None] == kq[None, :]) & row_ok[:, None]
        dd = doc_first + tl.arange(0, DOCS_PER_PROG)
        d_in = dd < n_docs
        n_tiles = tile_count(d_off_ptr, dd, d_in, d_in, BLOCK_D)
        doc = doc_first
        doc_start = tl.load(d_off_ptr + doc)
        doc_end = tl.load(d_off_ptr + doc + 1)
        tok = doc_start
        row_max = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        row_arg = tl.full([BLOCK_Q], -1, tl.int32)
        m_tile = tl.full((BLOCK_D, BLOCK_Q) if DOC_MAJOR else (BLOCK_Q, BLOCK_D), float("-inf"), tl.float32)
        for _ in range(n_tiles):
            sim = _code_tile(
                qp, rows, row_ok, d_ptr, d_scale_ptr, qc_ptr, wts_ptr, tok, doc_end, n_centroids, dim,
                stride_d, stride_qc, plane_scale, BLOCK_Q, BLOCK_D, BLOCK_K, CODEC, DOC_MAJOR, ASM, DECODE,
            )  # fmt: skip
            row_max, row_arg, m_tile = fold_tile(sim, row_max, row_arg, m_tile, tok, doc_start, True, False)
            last = tok + BLOCK_D >= doc_end
            if last:
                row_max = document_max(row_max, m_tile, 0 if DOC_MAJOR else 1, True)
                contrib = tl.where(row_ok, sq * row_max, 0.0)
                scores = tl.sum(tl.where(member, contrib[:, None], 0.0), axis=0)
                tl.store(out_rows + doc, _flag_bad_ids(scores), mask=q_ok)
                row_max, row_arg, m_tile = restart(row_max, row_arg, m_tile, True, False)
            next_end = tl.load(d_off_ptr + tl.minimum(doc + 2, n_docs))
            tok = tl.where(last, doc_end, tok + BLOCK_D)
            doc_start = tl.where(last, doc_end, doc_start)
            doc_end = tl.where(last, next_end, doc_end)
            doc = doc + last.to(tl.int64)
    else:
        # longer queries than planned: the group's rows in tiles, for each document
        for doc in range(doc_first, doc_last):
            start = tl.load(d_off_ptr + doc)
            stop = tl.load(d_off_ptr + doc + 1)
            scores = tl.zeros([MAX_Q], tl.float32)
            for r in range(row_first, row_last, BLOCK_Q):
                qp, sq, rows, row_ok = _query_planes(
                    q_ptr, q_scale_ptr, r, row_last, dim, stride_q, stride_plane, BLOCK_Q, BLOCK_K, CODEC,
                    DECODE,
                )
                local = tl.sum((rows[:, None] >= q_ends[None, :]).to(tl.int32), axis=1)
                member = (local[:, None] == kq[None, :]) & row_ok[:, None]
                scores += _doc_sums(
                    qp, sq, rows, row_ok, member, d_ptr, d_scale_ptr, qc_ptr, wts_ptr, start, stop,
                    n_centroids, dim, stride_d, stride_qc, plane_scale, BLOCK_Q, BLOCK_D, BLOCK_K, CODEC,
                    DOC_MAJOR, ASM, DECODE,
                )  # fmt: skip
            tl.store(out_rows + doc, _flag_bad_ids(scores), mask=q_ok)


@triton.jit(
    do_not_specialize=["n_queries", "n_cand", "n_docs", "n_centroids", "stride_plane", "stride_qc"],
    do_not_specialize_on_alignment=["q_off_ptr", "cand_off_ptr", "cand_docs_ptr", "d_off_ptr"],
)
def _maxsim_codes_candidates_kernel(
    # pointers
    q_ptr,
    q_scale_ptr,
    q_off_ptr,
    cand_off_ptr,
    cand_docs_ptr,
    d_ptr,
    d_scale_ptr,
    d_off_ptr,
    qc_ptr,
    wts_ptr,
    out_ptr,
    # sizes
    n_queries,
    n_cand,
    n_docs,
    n_centroids,
    dim,
    # strides
    stride_q,
    stride_d,
    stride_plane,
    stride_qc,
    plane_scale,
    CODEC: tl.constexpr,
    CANDS_PER_PROG: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOC_MAJOR: tl.constexpr,
    ASM: tl.constexpr,
    DECODE: tl.constexpr,
):
    """Scores of CANDS_PER_PROG consecutive (query, candidate) pairs of the flat candidate list. A
    candidate index outside [0, n_docs) is never dereferenced: it scores NaN."""
    c_first = tl.program_id(0).to(tl.int64) * CANDS_PER_PROG
    c_last = tl.minimum(c_first + CANDS_PER_PROG, n_cand)
    query = candidate_query(cand_off_ptr, c_first, n_queries)
    row_first = tl.load(q_off_ptr + query)
    row_last = tl.load(q_off_ptr + query + 1)
    kq = tl.arange(0, 2)
    if (tl.load(cand_off_ptr + query + 1) >= c_last) & (row_last - row_first <= BLOCK_Q):
        # One query, one tile (the planned case): all the tiles of the program's candidates in ONE loop.
        qp, sq, rows, row_ok = _query_planes(
            q_ptr, q_scale_ptr, row_first, row_last, dim, stride_q, stride_plane, BLOCK_Q, BLOCK_K, CODEC,
            DECODE,
        )
        cc = c_first + tl.arange(0, CANDS_PER_PROG)
        c_in = cc < c_last
        cdocs = tl.load(cand_docs_ptr + cc, mask=c_in, other=0)
        c_ok = c_in & (cdocs >= 0) & (cdocs < n_docs)  # a bad index: one tile of an empty document
        n_tiles = tile_count(d_off_ptr, cdocs, c_ok, c_in, BLOCK_D)
        c = c_first
        doc = tl.load(cand_docs_ptr + c)
        doc_ok = (doc >= 0) & (doc < n_docs)
        doc_start = tl.load(d_off_ptr + doc, mask=doc_ok, other=0)
        doc_end = tl.load(d_off_ptr + doc + 1, mask=doc_ok, other=0)
        tok = doc_start
        row_max = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        row_arg = tl.full([BLOCK_Q], -1, tl.int32)
        m_tile = tl.full((BLOCK_D, BLOCK_Q) if DOC_MAJOR else (BLOCK_Q, BLOCK_D), float("-inf"), tl.float32)
        for _ in range(n_tiles):
            sim = _code_tile(
                qp, rows, row_ok, d_ptr, d_scale_ptr, qc_ptr, wts_ptr, tok, doc_end, n_centroids, dim,
                stride_d, stride_qc, plane_scale, BLOCK_Q, BLOCK_D, BLOCK_K, CODEC, DOC_MAJOR, ASM, DECODE,
            )  # fmt: skip
            row_max, row_arg, m_tile = fold_tile(sim, row_max, row_arg, m_tile, tok, doc_start, True, False)
            last = tok + BLOCK_D >= doc_end
            if last:
                row_max = document_max(row_max, m_tile, 0 if DOC_MAJOR else 1, True)
                score = _flag_bad_ids(tl.sum(tl.where(row_ok, sq * row_max, 0.0), axis=0))
                tl.store(out_ptr + c, tl.where(doc_ok, score, float("nan")))
                row_max, row_arg, m_tile = restart(row_max, row_arg, m_tile, True, False)
                # the next candidate (read in bounds: the loop ends before c passes c_last - 1)
                c = c + 1
                doc = tl.load(cand_docs_ptr + tl.minimum(c, c_last - 1))
                doc_ok = (doc >= 0) & (doc < n_docs)
                doc_start = tl.load(d_off_ptr + doc, mask=doc_ok, other=0)
                doc_end = tl.load(d_off_ptr + doc + 1, mask=doc_ok, other=0)
                tok = doc_start
            else:
                tok = tok + BLOCK_D
    else:
        for c in range(c_first, c_last):
            query = candidate_query(cand_off_ptr, c, n_queries)
            row_first = tl.load(q_off_ptr + query)
            row_last = tl.load(q_off_ptr + query + 1)
            doc = tl.load(cand_docs_ptr + c).to(tl.int64)
            doc_ok = (doc >= 0) & (doc < n_docs)
            start = tl.load(d_off_ptr + doc, mask=doc_ok, other=0)
            stop = tl.load(d_off_ptr + doc + 1, mask=doc_ok, other=0)
            total = tl.zeros([2], tl.float32)
            for r in range(row_first, row_last, BLOCK_Q):
                qp, sq, rows, row_ok = _query_planes(
                    q_ptr, q_scale_ptr, r, row_last, dim, stride_q, stride_plane, BLOCK_Q, BLOCK_K, CODEC,
                    DECODE,
                )
                member = row_ok[:, None] & (kq[None, :] == 0)
                total += _doc_sums(
                    qp, sq, rows, row_ok, member, d_ptr, d_scale_ptr, qc_ptr, wts_ptr, start, stop,
                    n_centroids, dim, stride_d, stride_qc, plane_scale, BLOCK_Q, BLOCK_D, BLOCK_K, CODEC,
                    DOC_MAJOR, ASM, DECODE,
                )  # fmt: skip
            score = _flag_bad_ids(tl.sum(total, axis=0))
            tl.store(out_ptr + c, tl.where(doc_ok, score, float("nan")))


# ----------------------------------------------------------------------------------------------------------
# Host side: checks and launchers
# ----------------------------------------------------------------------------------------------------------


# fp32 zeros past the centroid table's last row (`residual2_query_tables`): the Gluon stream kernel reads N
# columns of a row from the query's first, unmasked (`maxsim_int8_hopper_stream._tile_centroids`; a mask of
# the query's columns made its candidates build spill 640 bytes)
TABLE_SLACK = 64


class QueryTables(NamedTuple):
    """The query side of a residual2 scan (`residual2_query_tables`) for R query rows of dim d."""

    planes: torch.Tensor  # fp16 [3, R, d]: q8 * D_v * 2^-e, columns in part-major order
    by_centroid: torch.Tensor  # fp32 [K, R]: q8 . (C[c] + W[:, 0]) for every centroid c
    plane_scale: float  # 2^e: the planes' products times this are in q8 units
    separable: bool  # D_2 is zero in every dimension: the third plane's products are skipped


def residual2_plane_weights(bucket_weights: torch.Tensor) -> torch.Tensor:
    """float64 [3, dim]: the bucket values as bit planes, W[k, b] = W[k, 0] + b0 * D_0[k] + b1 * D_1[k]
    + b0 * b1 * D_2[k] for the bucket b = b0 + 2 * b1, exactly (in float64)."""
    w = bucket_weights.double()
    return torch.stack([w[:, 1] - w[:, 0], w[:, 2] - w[:, 0], w[:, 3] - w[:, 2] - w[:, 1] + w[:, 0]])


@functools.cache
def _part_major_order(dim: int, device: torch.device) -> torch.Tensor:
    """Column p * dim / 4 + m holds dimension 4m + p: a part of a row is one contiguous run. Made once per
    (dim, device): every residual2 call's query planes are indexed by it (`residual2_query_tables`)."""
    return torch.arange(dim, device=device).view(dim // 4, 4).T.reshape(-1)


def residual2_query_tables(q8: torch.Tensor, codebook: ResidualCodebook) -> QueryTables:
    """The residual2 scan's query side for int8 query rows ``q8`` [R, dim]:

        q8 . x = q8 . (C[c] + W[:, 0])  +  sum_v (q8 * D_v) . plane_v(b)           (x the decoded token)

    The first term is a table over the codebook's centroids, computed in float64 and rounded once to fp32
    (the scan gathers it by the token's centroid id); the second runs on the tensor cores with the query
    planes q8 * D_v (`residual2_plane_weights`) rounded to fp16 after scaling by a power of two 2^-e that
    keeps them below 2^15 (`_plane_weights_and_exponent`: from the codebook alone, no host round trip a
    call). Relative error of a plane value: 2^-11 (2^-25 * 2^e absolute below fp16's normal range); the
    tests' bound states the rest."""
    dim = q8.shape[1]
    device = q8.device
    q = q8.double()
    base = codebook.centroids.double() + codebook.bucket_weights.double()[:, 0][None, :]
    # [K, R], in storage with TABLE_SLACK zeros past it: the stream kernel reads a row's N columns unmasked
    k, rows = base.shape[0], q8.shape[0]
    storage = torch.empty(k * rows + TABLE_SLACK, dtype=torch.float32, device=device)
    storage[k * rows :].zero_()
    by_centroid = storage[: k * rows].view(k, rows)
    by_centroid.copy_(base @ q.T)
    weights, exponent, separable = _plane_weights_and_exponent(codebook.bucket_weights)
    planes = q[None, :, :] * weights.to(device)[:, None, :]
    planes = (planes * 2.0**-exponent).to(torch.float16)[:, :, _part_major_order(dim, device)].contiguous()
    return QueryTables(planes, by_centroid, 2.0**exponent, separable)


def _plane_weights_and_exponent(bucket_weights: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    """`residual2_plane_weights`, the exponent e of the query planes' scale 2^-e (|q8| <= 128, so 128 *
    max |D_v| * 2^-e < 2^15 <= fp16's max for any int8 queries) and whether D_2 is zero everywhere (the
    separable buckets `maxsim quantize` fits: `maxsim_cli.codecs.fit_buckets`). Made once per
    bucket-weights tensor (`memo`; one host synchronisation)."""

    def compute() -> tuple[torch.Tensor, int, bool]:
        weights = residual2_plane_weights(bucket_weights)
        top, third = (float(x) for x in torch.stack([weights.abs().max(), weights[2].abs().max()]).cpu())
        return weights, (math.frexp(128.0 * top)[1] - 15) if top > 0 else 0, third == 0.0

    return memo(bucket_weights, "plane_weights", compute)


def _part_width(codec: str, dim: int) -> int:
    """BLOCK_K: the width of one part of a row (int4: dim / 2 nibbles of each kind; residual2: dim / 4
    buckets of each position), at least the tensor cores' K (32 for int8, 16 for fp16)."""
    if codec == "int4":
        return max(32, triton.next_power_of_2(dim // 2))
    return max(16, triton.next_power_of_2(dim // 4))


# Shared memory for a program's query tile at most (int4: two parts of int8; residual2: 4 parts x 3 planes
# of fp16, or 4 parts of fp16 where the plan decodes): the all-pairs plan's 256 rows at dim 128 take 32 KB
# (int4) and 64 KB (residual2, decoding); 256 rows of bit planes would take 192 KB (capped at 128: 96 KB).
# H100: residual2 at dim 384 with 256 rows once asked for 311 KB of the 227 KB an SM has.
_QUERY_TILE_BYTES = 96 << 10


def _query_rows_cap(tiles: Tiles, codec: str, dim: int) -> int:
    """The query rows a program takes at most: the plan's, fewer where its query tile would pass
    `_QUERY_TILE_BYTES` (wide rows)."""
    parts_bytes = 2 if codec == "int4" else (8 if tiles.decode else 24)  # int8 x 2, fp16 x 4, fp16 x 12
    row_bytes = _part_width(codec, dim) * parts_bytes
    fitting = 1 << max(4, (_QUERY_TILE_BYTES // row_bytes).bit_length() - 1)  # a power of two, >= 16
    return min(tiles.block_q, fitting)


# residual2: the centroid table (fp32 [K, query rows]) of one launch at most; more query rows are scanned
# in launches of whole queries (a query's rows are never split; one query may pass it alone).
_CENTROID_TABLE_BYTES = 128 << 20


def _table_fits(rows: int, codebook: ResidualCodebook) -> bool:
    """Whether the centroid table of `rows` query rows (fp32 [K, rows]) fits one launch."""
    return rows * 4 * codebook.centroids.shape[0] <= _CENTROID_TABLE_BYTES


def _use_asm(device: torch.device) -> bool:
    """The kernels' inline PTX runs on CUDA; Triton's interpreter takes the tl ops that compute the same."""
    return device.type == "cuda" and not interpreting()


class _Launch(NamedTuple):
    """What a launch of the scan kernels takes beside the documents, for one chunk of query rows."""

    q: torch.Tensor  # int4: int8 queries [R, dim]; residual2: the fp16 planes [3, R, dim]
    stride_q: int
    stride_plane: int
    scales_or_codes: torch.Tensor  # int4: the documents' fp32 scales; residual2: any tensor (unused)
    table: torch.Tensor  # residual2: the centroid table [K, R] (decode: the part-major centroids)
    weights: torch.Tensor  # residual2 decode: the part-major bucket values; else any tensor (unused)
    stride_table: int
    plane_scale: float
    n_centroids: int
    codec_id: int  # the kernels' CODEC: 0 int4, 1 residual2, 2 residual2 of separable buckets (no D_2)
    asm: bool


def _launch_args(
    q8: torch.Tensor,
    codes: torch.Tensor,
    doc_scales: torch.Tensor | None,
    codebook: ResidualCodebook | None,
    decode: bool,
) -> _Launch:
    asm = _use_asm(codes.device)
    if codebook is None:
        assert doc_scales is not None
        return _Launch(q8, q8.stride(0), 0, doc_scales, codes, codes, 0, 1.0, 0, 0, asm)
    if decode:
        cent, wts = _parts_major(codebook)
        return _Launch(q8, q8.stride(0), 0, codes, cent, wts, 0, 1.0, cent.shape[0], 1, asm)
    tables = residual2_query_tables(q8, codebook)
    rows = q8.shape[0]
    unit = PLANE_UNIT_ASM if asm else 1.0
    return _Launch(
        tables.planes, q8.shape[1], rows * q8.shape[1], codes, tables.by_centroid, codes, rows,
        tables.plane_scale / unit, codebook.centroids.shape[0], 2 if tables.separable else 1, asm,
    )  # fmt: skip


def _parts_major(codebook: ResidualCodebook) -> tuple[torch.Tensor, torch.Tensor]:
    """The codebook in part-major order for the decoding kernels (`_residual2_part`). Made once per
    codebook tensor (`memo`: a copy of the whole codebook, 64 MiB at 2^18 centroids, is not repeated every
    launch)."""
    dim = codebook.centroids.shape[1]
    order = _part_major_order(dim, codebook.centroids.device)
    centroids = memo(codebook.centroids, "parts_major", lambda: codebook.centroids[:, order].contiguous())
    weights = memo(
        codebook.bucket_weights, "parts_major", lambda: codebook.bucket_weights[order].contiguous()
    )
    return centroids, weights


def _query_chunks(
    codebook: ResidualCodebook | None, q8: torch.Tensor, query_offsets: torch.Tensor, tiles: Tiles
) -> list[tuple[int, int, int, int]]:
    """(first query, last query, first row, last row) of each launch: one for int4, for a decoding plan and
    where the residual2 centroid table fits `_CENTROID_TABLE_BYTES` (no host synchronisation), else whole
    queries a chunk."""
    nq, rows = query_offsets.numel() - 1, q8.shape[0]
    if codebook is None or tiles.decode or _table_fits(rows, codebook):
        return [(0, nq, 0, rows)]
    fitting = max(1, _CENTROID_TABLE_BYTES // (4 * codebook.centroids.shape[0]))
    host = query_offsets.tolist()
    chunks, first = [], 0
    while first < nq:
        last = first + 1
        while last < nq and host[last + 1] - host[first] <= fitting:
            last += 1
        chunks.append((first, last, host[first], host[last]))
        first = last
    return chunks


def _rebased(offsets: torch.Tensor, first: int, last: int, whole: bool) -> torch.Tensor:
    return offsets if whole else offsets[first : last + 1] - offsets[first]


def launch_varlen(
    codec: str,
    dim: int,
    q8: torch.Tensor,
    sq: torch.Tensor,
    query_offsets: torch.Tensor,
    codes: torch.Tensor,
    doc_scales: torch.Tensor | None,
    doc_offsets: torch.Tensor,
    codebook: ResidualCodebook | None,
    *,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """All-pairs launch (no host synchronisation unless the residual2 centroid table is split);
    `tiles` overrides the plan (tests and tile sweeps)."""
    nq, nd = query_offsets.numel() - 1, doc_offsets.numel() - 1
    out = torch.empty((nq, nd), dtype=torch.float32, device=codes.device)
    if nq == 0 or nd == 0:
        return out
    tiles = tiles or (_FEW_ROWS[codec] if q8.shape[0] <= _FEW_ROWS_MAX else _ALL_PAIRS)
    chunks = _query_chunks(codebook, q8, query_offsets, tiles)
    for q_first, q_last, r_first, r_last in chunks:
        offsets = _rebased(query_offsets, q_first, q_last, len(chunks) == 1)
        _launch_varlen_chunk(
            codec, dim, q8[r_first:r_last], sq[r_first:r_last], offsets, codes, doc_scales, doc_offsets,
            codebook, out[q_first:q_last], tiles,
        )  # fmt: skip
    return out


def _launch_varlen_chunk(codec, dim, q8, sq, query_offsets, codes, doc_scales, doc_offsets, codebook, out,
                         tiles: Tiles) -> None:  # fmt: skip
    nq, nd = query_offsets.numel() - 1, doc_offsets.numel() - 1
    cap = _query_rows_cap(tiles, codec, dim)
    mean = triton.next_power_of_2(max(1, -(-q8.shape[0] // nq)))
    if mean >= cap:
        per_group, block_q = 1, cap
    else:
        per_group = min(_MAX_QUERIES_PER_GROUP, cap // mean, triton.next_power_of_2(nq))
        block_q = max(16, min(cap, per_group * mean))
    n_groups = cdiv(nq, per_group)
    la = _launch_args(q8, codes, doc_scales, codebook, tiles.decode)
    launch_fitting_shared_memory(
        _maxsim_codes_varlen_kernel, (n_groups * cdiv(nd, tiles.docs_per_prog),),
        la.q, sq, query_offsets, codes, la.scales_or_codes, doc_offsets, la.table, la.weights, out,
        nq, n_groups, nd, la.n_centroids, dim,
        la.stride_q, codes.stride(0), out.stride(0), la.stride_plane, la.stride_table, la.plane_scale,
        CODEC=la.codec_id, DOCS_PER_PROG=tiles.docs_per_prog, BLOCK_Q=block_q, BLOCK_D=tiles.block_d,
        BLOCK_K=_part_width(codec, dim), QUERIES_PER_GROUP=per_group, MAX_Q=max(2, per_group),
        DOC_MAJOR=tiles.doc_major, ASM=la.asm, DECODE=tiles.decode, num_warps=tiles.warps,
        num_stages=tiles.stages,
    )  # fmt: skip


def launch_candidates(
    codec: str,
    dim: int,
    q8: torch.Tensor,
    sq: torch.Tensor,
    query_offsets: torch.Tensor,
    codes: torch.Tensor,
    doc_scales: torch.Tensor | None,
    doc_offsets: torch.Tensor,
    codebook: ResidualCodebook | None,
    candidate_offsets: torch.Tensor,
    candidate_docs: torch.Tensor,
    *,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """Per-query-candidates launch (no host synchronisation unless the residual2 centroid table is split)."""
    n_cand = candidate_docs.numel()
    out = torch.empty((n_cand,), dtype=torch.float32, device=codes.device)
    if n_cand == 0:
        return out
    tiles = tiles or _CANDIDATES
    chunks = _query_chunks(codebook, q8, query_offsets, tiles)
    whole = len(chunks) == 1
    cand_host = [] if whole else candidate_offsets.tolist()  # a split table: each chunk's candidates
    for q_first, q_last, r_first, r_last in chunks:
        c_first, c_last = (0, n_cand) if whole else (cand_host[q_first], cand_host[q_last])
        if c_last == c_first:
            continue
        q8c, sqc = q8[r_first:r_last], sq[r_first:r_last]
        q_off = _rebased(query_offsets, q_first, q_last, whole)
        nq = q_off.numel() - 1
        mean = triton.next_power_of_2(max(1, -(-q8c.shape[0] // nq)))
        block_q = max(16, min(_query_rows_cap(tiles, codec, dim), mean))
        la = _launch_args(q8c, codes, doc_scales, codebook, tiles.decode)
        launch_fitting_shared_memory(
            _maxsim_codes_candidates_kernel, (cdiv(c_last - c_first, tiles.docs_per_prog),),
            la.q, sqc, q_off, _rebased(candidate_offsets, q_first, q_last, whole),
            candidate_docs[c_first:c_last], codes, la.scales_or_codes, doc_offsets, la.table, la.weights,
            out[c_first:c_last],
            nq, c_last - c_first, doc_offsets.numel() - 1, la.n_centroids, dim,
            la.stride_q, codes.stride(0), la.stride_plane, la.stride_table, la.plane_scale,
            CODEC=la.codec_id, CANDS_PER_PROG=tiles.docs_per_prog, BLOCK_Q=block_q, BLOCK_D=tiles.block_d,
            BLOCK_K=_part_width(codec, dim), DOC_MAJOR=tiles.doc_major, ASM=la.asm, DECODE=tiles.decode,
            num_warps=tiles.warps, num_stages=tiles.stages,
        )  # fmt: skip
    return out


def code_stream(
    codec: str,
    given_q_off: torch.Tensor,
    q8: torch.Tensor,
    codes: torch.Tensor,
    codebook: ResidualCodebook | Int2Queries | None,
) -> Callable[..., torch.Tensor] | None:
    """The Gluon stream kernel's launch, ``launch(q8, sq, q_off, item_off, items, codes, sd, d_off)`` (its
    longest query and the codec's query side bound: `maxsim_int8_hopper_stream.maxsim_int8_stream`), where
    it takes the scan (with the Triton backend), else None: on an sm_90 GPU, one query or query offsets
    given on the host (`maxsim_int8.hopper_stream`), dim 128; int4 codes of queries of at most 64 tokens,
    int2 codes of queries of at most 32, or residual2 codes of separable buckets, queries of at most 32
    tokens and a centroid table of one launch."""
    tables = None
    if codec == "residual2":
        assert isinstance(codebook, ResidualCodebook)
        separable = _plane_weights_and_exponent(codebook.bucket_weights)[2]
        if not separable or not _table_fits(q8.shape[0], codebook):
            return None
    stream = hopper_stream(given_q_off, q8, codes, False, residual=codec == "residual2", int2=codec == "int2")
    if stream is None:
        return None
    module, longest = stream
    if codec == "residual2":
        tables = residual2_query_tables(q8, codebook)
    return functools.partial(module.maxsim_int8_stream, max_query_len=longest, residual=tables,
                             int2=codec == "int2")  # fmt: skip


_DECODE_ROWS = 64  # rows a program of `_int4_to_int8_kernel`


@triton.jit
def _int4_to_int8_kernel(codes, out, n_rows, WIDTH: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Rows of int4 codes [n_rows, WIDTH] (value 2m in byte m's low nibble, 2m + 1 in its high one) to
    int8 values [n_rows, 2 * WIDTH]: the scan kernels' unpacking (`_int4_nibbles`, its tl ops: the decode
    is ~1% of an all-pairs call), values interleaved."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    keep = rows[:, None] < n_rows
    row_at = rows.to(tl.int64)[:, None]
    packed = tl.load(codes + row_at * WIDTH + tl.arange(0, WIDTH)[None, :], mask=keep, other=0)
    low, high = _int4_nibbles(packed, False)
    values = tl.interleave(low, high)
    tl.store(out + row_at * (2 * WIDTH) + tl.arange(0, 2 * WIDTH)[None, :], values, mask=keep)


@triton.jit
def _int2_to_int8_kernel(
    codes, out, n_rows, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_ROWS: tl.constexpr
):
    """Rows of int2 codes [n_rows, WIDTH] (code v of value 4m + p in bits 2p, 2p + 1 of byte m) to their odd
    values 2v - 3 as int8 [n_rows, 4 * WIDTH] (BLOCK_W: WIDTH to a power of two). The four values of a byte
    are put in order by two rounds of interleaves, so that each row is stored whole: a store per value at a
    stride of 4 bytes took 4.3 ms a 256 MiB chunk on the H100, 33x int4's decode of the same rows
    (docs/kernel-notes.md, "int2 all pairs: the decode's stores")."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    m = tl.arange(0, BLOCK_W)[None, :]
    keep = (rows[:, None] < n_rows) & (m < WIDTH)
    row_at = rows.to(tl.int64)[:, None]
    packed = tl.load(codes + row_at * WIDTH + m, mask=keep, other=0).to(tl.int32)
    v0 = ((packed & 3) * 2 - 3).to(tl.int8)
    v1 = (((packed >> 2) & 3) * 2 - 3).to(tl.int8)
    v2 = (((packed >> 4) & 3) * 2 - 3).to(tl.int8)
    v3 = (((packed >> 6) & 3) * 2 - 3).to(tl.int8)
    values = tl.interleave(tl.interleave(v0, v2), tl.interleave(v1, v3))  # v0 v1 v2 v3 of byte 0, then 1 ...
    cols = tl.arange(0, 4 * BLOCK_W)[None, :]
    tl.store(out + row_at * (4 * WIDTH) + cols, values, mask=(rows[:, None] < n_rows) & (cols < 4 * WIDTH))


def int2_to_int8(codes: torch.Tensor, out: torch.Tensor) -> None:
    """The int2 ``codes`` [T, width] decoded into ``out`` [T, 4 * width] (int8 odd values, `int2_values`),
    on the codes' device (Triton; on the CPU under TRITON_INTERPRET)."""
    block_w = triton.next_power_of_2(codes.shape[1])
    _decode_rows("int2_to_int8", _int2_to_int8_kernel, codes, out, 4, BLOCK_W=block_w)


def _decode_rows(
    name: str,
    kernel: triton.JITFunction,
    codes: torch.Tensor,
    out: torch.Tensor,
    per_byte: int,
    **consts: int,
) -> None:
    """Launch a decode ``kernel`` of codes [T, width] into int8 ``out`` [T, per_byte * width], checked."""
    rows, width = codes.shape
    if out.shape != (rows, per_byte * width) or out.dtype != torch.int8:
        got = f"{out.dtype} {tuple(out.shape)}"
        raise ValueError(f"{name}: out must be int8 [{rows}, {per_byte * width}], got {got}")
    if rows:
        grid = (cdiv(rows, _DECODE_ROWS),)
        kernel[grid](codes, out, rows, WIDTH=width, BLOCK_ROWS=_DECODE_ROWS, num_warps=4, **consts)


def int4_to_int8(codes: torch.Tensor, out: torch.Tensor) -> None:
    """The int4 ``codes`` [T, width] decoded into ``out`` [T, 2 * width] (int8 values -7..7, `decode_int4`'s
    values without their scales), on the codes' device (Triton; on the CPU under TRITON_INTERPRET)."""
    _decode_rows("int4_to_int8", _int4_to_int8_kernel, codes, out, 2)


def int4_allpairs_on_hopper(
    given_q_off: torch.Tensor, given_d_off: torch.Tensor, q8: torch.Tensor, codes: torch.Tensor
) -> bool:
    """Whether all pairs of these queries against int4 codes go to the Gluon all-pairs kernel of int8 on
    their decoded values (`codes_host._decoded_varlen`): where that kernel takes the problem
    (`maxsim_int8.hopper_allpairs`: sm_90, dim 128, enough query groups); else the Triton scan of the codes.

    Scoring many queries is bound by the tensor cores, not by the bytes: 512 queries x 50K documents are
    ~53 ms of int8 products, where decoding their 8.0M tokens (0.5 GB of codes into 1.0 GB of int8 rows)
    moves 1.5 GB, ~0.5 ms at HBM speed."""
    if codes.shape[1] * 2 != 128 or codes.device.type != "cuda" or codes.shape[0] == 0:
        return False
    probe = torch.empty((1, 128), dtype=torch.int8, device=codes.device)  # the kernel's operand, as a shape
    return hopper_allpairs(given_q_off, given_d_off, q8, probe, False) is not None
