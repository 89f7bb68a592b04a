"""MaxSim over documents stored as codes below 8 bits: Triton scan kernels that decode in registers, a torch
CPU path, and the codecs' packing (encode and decode of the stored bytes).

Three codecs; a token is one row of bytes of a uint8 ``[T, width]`` tensor:

- **int4** (``width = dim / 2``, dim even): per-token symmetric scale ``s = absmax(x) / 7`` (1 for an
  all-zero token) and ``c_k = clamp(round_half_even(x_k / s), -7, 7)``, two's-complement nibbles, value
  ``2m`` in the low nibble of byte ``m`` and ``2m + 1`` in the high one; the scale is a separate fp32
  ``doc_scales [T]``, as for int8. Decoded value: ``s * c_k``.
- **residual2** (``width = 4 + dim / 4``, dim a multiple of 4), the ColBERTv2 residual scheme: bytes 0-3
  the id of the token's nearest k-means centroid (uint32, little-endian), then a 2-bit bucket per
  dimension, dimension ``4m + i`` in bits ``2i, 2i + 1`` of byte ``4 + m``. A `ResidualCodebook` gives
  the centroids ``C`` (fp16 ``[K, dim]``) and per-dimension bucket values ``W`` (fp32 ``[dim, 4]``).
  Decoded value: ``x_k = C[c, k] + W[k, b_k]`` (exact; the CPU path rounds it once to fp32).
- **int2** (``width = dim / 4``, dim a multiple of 4): per dimension four evenly spaced values, an
  `Int2Levels` grid (``offsets`` and ``steps``, fp32 ``[dim]``: `maxsim_cli.codecs.fit_int2_levels` fits
  them), and a scale a token (fp32 ``doc_scales [T]``, `encode_int2`): code v of dimension ``4m + p``
  in bits ``2p, 2p + 1`` of byte m, its odd value ``c = 2v - 3``. Decoded value: ``x_k = offsets[k] + s *
  steps[k] * c_k``. No centroid: nothing is gathered per token (residual2's table: 4 Lq bytes a token).

Scoring. Queries are quantized per token to int8 exactly as for the int8 corpus
(`int8_host.quantize_per_token`: codes ``q8`` and scales ``s_q``), or given so with ``query_scales``:

    int4:       score(q, d) = sum_i s_q[i] * max_j (s_d[j] * (q8[i] . c[j]))     q8 . c in int32, exact
    residual2:  score(q, d) = sum_i s_q[i] * max_j (q8[i] . x[j])
    int2:       score(q, d) = sum_i (q[i] . offsets + s_w[i] * max_j (s_d[j] * (w8[i] . c[j])))

where for int2 ``w8, s_w`` are the int8 codes and scales of ``q * steps`` (`int2_queries`: the float query,
not its int8 codes, is weighted) and ``q[i] . offsets`` is float64 rounded once: ``q . x = q . offsets + s *
(q * steps) . c`` exactly, so int2 is scored by the int8 products, maxima and sums of int4, bit for bit
the int8 kernels' on the decoded odd values, plus one constant a query row.

The int4 max is over exact integers times one fp32 scale, so the max and its winner are those of the
float64 evaluation of the decoded values. The residual2 scan kernels split the product in two (the centroid's
term as in PLAID; `residual2_query_tables`):

    q8 . x = q8 . (C[c] + W[:, 0])  +  sum_v (q8 * D_v) . plane_v(b)

the first term a table over the codebook's centroids (float64, rounded once to fp32) gathered by the
token's centroid id, the second three tensor-core products with the token's bucket bits: W[k, b] =
W[k, 0] + b0 D_0[k] + b1 D_1[k] + b0 b1 D_2[k] for the bucket b = b0 + 2 b1, exactly, so the bit planes
(0 or 1, exact in fp16) replace a decode of the values; the query planes q8 * D_v are rounded to fp16
(relative 2^-11) and the products summed in fp32. `maxsim_kernels.reference.maxsim_codes_reference`
evaluates the decoded values in float64; the tests state the tolerance. A document with no tokens scores
-inf. A centroid id outside the codebook is never dereferenced: the Triton kernels score its document
NaN; the CPU path raises ValueError naming it.

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
(int8, whole documents, at most `DECODE_CHUNK_BYTES` at a time; a rerank's candidates gathered first) and
scored by the int8 kernels of `maxsim_int8` with their scales. All
pairs of enough queries to be bound by the tensor cores decode the documents a bounded chunk at a time
into int8 rows and score them on the Gluon all-pairs kernel of `maxsim_int8_hopper` (`_decoded_varlen`:
the decode's bytes are ~1% of such a call's time; chunks alternate between two streams, so that neither
the decode nor the end of each launch waits on the tensor cores).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from .code_unpacking import INT4_NIBBLES_ASM, PLANE_UNIT_ASM, bucket_planes_asm
from .cpu import int8_columns, int8_stream_applies, maxsim_int8_varlen_cpu, thread_buffer
from .int8_host import (
    backend_and_offsets,
    device_offsets,
    maxsim_candidates_int8,
    maxsim_varlen_int8,
    quantize_per_token,
    segment_ids,
    segment_max,
    sum_rows_in_order,
)
from .launch import launch_fitting_shared_memory
from .maxsim_int8 import candidate_query, hopper_allpairs, hopper_stream, quantize_rows
from .running_max import document_max, fold_tile, restart, tile_count
from .validation import (
    cdiv,
    check_candidate_docs,
    host_offsets,
    interpreting,
    memo,
    resolve_backend,
)

CODECS = ("int4", "residual2", "int2")
INT4_ABSMAX = 7.0
RESIDUAL_BUCKETS = 4  # 2 bits a dimension
ID_BYTES = 4  # the residual2 centroid id: uint32, little-endian, first in the row
MAX_DIM = 1024  # int4: |q8 . c| <= 128 * 8 * dim < 2^24, exact in fp32


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

# CPU path: at most this many fp32 similarities (and decoded values) materialised at once (64 MiB).
_TORCH_BLOCK_ELEMS = 1 << 24


class ResidualCodebook(NamedTuple):
    """The residual2 codebook: ``centroids`` fp16 ``[K, dim]`` and ``bucket_weights`` fp32 ``[dim, 4]``
    (the value of each 2-bit bucket, per dimension), on the documents' device."""

    centroids: torch.Tensor
    bucket_weights: torch.Tensor

    def to(self, device: torch.device | str) -> ResidualCodebook:
        return ResidualCodebook(self.centroids.to(device), self.bucket_weights.to(device))


class Int2Levels(NamedTuple):
    """The int2 codec's grid, per dimension: code v (0..3) of dimension k decodes to ``offsets[k] + s *
    steps[k] * (2v - 3)`` for the token's scale s; fp32 ``[dim]`` each, on the documents' device."""

    offsets: torch.Tensor
    steps: torch.Tensor

    def to(self, device: torch.device | str) -> Int2Levels:
        return Int2Levels(self.offsets.to(device), self.steps.to(device))


def code_width(codec: str, dim: int) -> int:
    """Bytes a token of ``dim`` values takes in the codes tensor (the int4 and int2 scales are stored
    beside it)."""
    if codec == "int4":
        return dim // 2
    if codec == "int2":
        return dim // 4
    if codec == "residual2":
        return ID_BYTES + dim // 4
    raise ValueError(f"unknown codec {codec!r} (expected one of {', '.join(CODECS)})")


def check_codec_dim(codec: str, dim: int) -> None:
    """ValueError (one line) for a dim the codec does not store: int4 needs an even dim, residual2 a
    multiple of 4 (whole bytes a token), both at most MAX_DIM."""
    if codec == "int4" and (dim < 2 or dim % 2 or dim > MAX_DIM):
        raise ValueError(f"int4 codes need an even dim from 2 to {MAX_DIM} (two values a byte), got {dim}")
    if codec in ("residual2", "int2") and (dim < 4 or dim % 4 or dim > MAX_DIM):
        raise ValueError(
            f"{codec} codes need a dim that is a multiple of 4 from 4 to {MAX_DIM} (four values a "
            f"byte), got {dim}"
        )
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r} (expected one of {', '.join(CODECS)})")


# ----------------------------------------------------------------------------------------------------------
# Packing (torch; CPU or GPU tensors)
# ----------------------------------------------------------------------------------------------------------


def encode_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 codes of ``x`` [T, dim] (dim even): (uint8 [T, dim / 2], fp32 scales [T]), computed in fp32.

    ``s = absmax / 7`` (1 for an all-zero token), ``c = clamp(round_half_even(x / s), -7, 7)``, so
    ``|x - s * c| <= s / 2`` per value."""
    check_codec_dim("int4", x.shape[1])
    xf = x.float()
    absmax = xf.abs().amax(dim=1)
    scale = absmax / torch.full_like(absmax, INT4_ABSMAX)  # a tensor divisor: the correctly rounded quotient
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(xf / scale[:, None]).clamp_(-INT4_ABSMAX, INT4_ABSMAX).to(torch.int16)
    nibbles = (codes & 0xF).to(torch.uint8)
    return (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).contiguous(), scale


def decode_int4(codes: torch.Tensor) -> torch.Tensor:
    """The signed int4 values of uint8 codes [T, dim / 2] as int8 [T, dim] (any nibble: -8..7)."""
    low = (codes & 0xF).to(torch.int16)
    high = (codes >> 4).to(torch.int16)
    values = torch.stack([low, high], dim=2).reshape(codes.shape[0], -1)
    return ((values ^ 8) - 8).to(torch.int8)


# Values encoded at once by `encode_residual2` (~16 B of temporaries each): bounded memory on any corpus.
ENCODE_BLOCK_ELEMS = 1 << 24


def encode_residual2(
    x: torch.Tensor, centroid_ids: torch.Tensor, centroids: torch.Tensor, cutoffs: torch.Tensor
) -> torch.Tensor:
    """residual2 rows (uint8 [T, 4 + dim / 4]) of ``x`` [T, dim] with their centroid ids [T] (int64):
    the bucket of dimension k is the number of ``cutoffs[k]`` (fp32 [dim, 3], ascending) that the
    residual ``x_k - C[id, k]`` reaches or exceeds."""
    dim = x.shape[1]
    check_codec_dim("residual2", dim)
    out = torch.empty(x.shape[0], ID_BYTES + dim // 4, dtype=torch.uint8, device=x.device)
    cut = cutoffs.float()[None]
    # a block of rows at a time: the comparisons take 3 * dim bytes and the residuals 4 * dim a row
    step = max(1, ENCODE_BLOCK_ELEMS // dim)
    for a in range(0, x.shape[0], step):
        rows = slice(a, a + step)
        residual = x[rows].float() - centroids[centroid_ids[rows]].float()
        buckets = (residual[:, :, None] >= cut).sum(dim=2, dtype=torch.uint8)  # [rows, dim] 0..3
        b = buckets.view(-1, dim // 4, 4)
        out[rows, ID_BYTES:] = b[:, :, 0] | (b[:, :, 1] << 2) | (b[:, :, 2] << 4) | (b[:, :, 3] << 6)
        ids = centroid_ids[rows].to(torch.int64)
        for i in range(ID_BYTES):
            out[rows, i] = ((ids >> (8 * i)) & 0xFF).to(torch.uint8)
    return out


def encode_int2(x: torch.Tensor, levels: Int2Levels) -> tuple[torch.Tensor, torch.Tensor]:
    """int2 codes of ``x`` [T, dim] (dim a multiple of 4): (uint8 [T, dim / 4], fp32 scales [T]).

    Per dimension the nearest of the grid's four odd values ``c = 2v - 3`` to ``(x_k - offsets[k]) /
    steps[k]`` (ties to even, clamped), then the token's least-squares scale ``s = <x - offsets, steps * c>
    / |steps * c|^2`` (float64, rounded once; 0 where every step is 0, never negative: each c_k has the
    sign of its value): the decoded ``offsets + s * steps *
    c`` is the nearest point of the token's line. A dimension of step 0 (one that does not vary) decodes to
    its offset. Code v of dimension ``4m + p`` is bits 2p and 2p + 1 of byte m."""
    dim = x.shape[1]
    check_codec_dim("int2", dim)
    offsets = levels.offsets.to(x.device, torch.float32)
    steps = levels.steps.to(x.device, torch.float32)
    codes = torch.empty(x.shape[0], dim // 4, dtype=torch.uint8, device=x.device)
    scales = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    step = max(1, ENCODE_BLOCK_ELEMS // dim)
    for a in range(0, x.shape[0], step):
        rows = slice(a, a + step)
        centred = x[rows].float() - offsets
        v = int2_grid_codes(centred, steps)
        spread = steps.double() * (2.0 * v.double() - 3.0)
        norm = (spread * spread).sum(dim=1)
        fit = (centred.double() * spread).sum(dim=1) / torch.where(norm > 0, norm, torch.ones_like(norm))
        scales[rows] = fit.float()
        b = v.to(torch.uint8).view(-1, dim // 4, 4)
        codes[rows] = b[:, :, 0] | (b[:, :, 1] << 2) | (b[:, :, 2] << 4) | (b[:, :, 3] << 6)
    return codes, scales


def int2_grid_codes(centred: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The codes v (0..3, in ``centred``'s float dtype) of the grid's odd values 2v - 3 nearest to
    ``centred / steps`` per dimension (ties to even, clamped; a dimension of step 0 takes v = 2): what
    `encode_int2` stores and `maxsim_cli.codecs.fit_int2_levels` fits the grid to."""
    stepped = torch.where(steps > 0, centred / steps, torch.zeros_like(centred))
    return torch.round((stepped + 3.0) / 2.0).clamp_(0, 3)


def int2_values(codes: torch.Tensor) -> torch.Tensor:
    """The odd values 2v - 3 (int8 [T, dim], -3..3) of int2 codes [T, dim / 4]."""
    packed = codes.to(torch.int16)
    v = torch.stack([(packed >> (2 * i)) & 3 for i in range(4)], dim=2).reshape(codes.shape[0], -1)
    return (2 * v - 3).to(torch.int8)


def decode_int2(codes: torch.Tensor, scales: torch.Tensor, levels: Int2Levels) -> torch.Tensor:
    """Decoded int2 values, fp32 [T, dim]: ``offsets + s * steps * c`` evaluated in float64, rounded once."""
    c = int2_values(codes).double()
    return (levels.offsets.double() + scales.double()[:, None] * levels.steps.double() * c).float()


class Int2Queries(NamedTuple):
    """The query side of an int2 scan (`int2_queries`): the int8 codes and scales of ``q * steps`` and each
    query row's ``q . offsets``."""

    q8: torch.Tensor  # int8 [Tq, dim]
    scales: torch.Tensor  # fp32 [Tq]
    row_offsets: torch.Tensor  # fp32 [Tq]
    query_sums: torch.Tensor | None = None  # fp32 [nq]: each query's sum of row_offsets (with query offsets)


def int2_queries(
    queries: torch.Tensor,
    levels: Int2Levels,
    backend: str = "torch",
    query_offsets: torch.Tensor | None = None,
) -> Int2Queries:
    """The query side of int2 scores (module docstring): ``q . x = q . offsets + s * (q * steps) . c``, so
    the kernels of int8 score ``q * steps`` (quantized per token to int8, as any query) against the codes'
    odd values c with the tokens' scales s, and each query row adds ``q . offsets`` (float64, rounded
    once) to its maximum. With `query_offsets` (int64 [nq + 1], checked, on the queries' device) also each
    query's sum of its rows' offsets (`query_sums`, float64 sums rounded once); the Triton backend then
    makes everything in one launch: q8 and the scales `quantize_per_token`'s bits, the offsets' float64
    sums added in another order than torch's product and `_query_sums`."""
    if query_offsets is not None and resolve_backend(backend, queries.device) == "triton":
        return _int2_queries_triton(queries, levels, query_offsets)
    q = queries.float()
    weighted = q * levels.steps.to(q.device, torch.float32)
    q8, sq = quantize_per_token(weighted, backend=backend)
    row_offsets = (queries.double() @ levels.offsets.to(q.device, torch.float64)).float()
    sums = None if query_offsets is None else _query_sums(row_offsets, query_offsets)
    return Int2Queries(q8, sq, row_offsets, sums)


@triton.jit(do_not_specialize=["n_rows", "dim"])
def _int2_query_kernel(
    x_ptr, steps_ptr, offsets_ptr, q_off_ptr, codes_ptr, scales_ptr, row_offsets_ptr, sums_ptr,
    n_rows, dim, stride_x, stride_codes,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Query q's int2 side (`int2_queries`): its rows x times the steps quantized per token (codes, scales),
    each row's x . offsets in float64 rounded to fp32 (row_offsets), and their sum in float64, rounded
    (sums[q]).
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


def _int2_queries_triton(
    queries: torch.Tensor, levels: Int2Levels, query_offsets: torch.Tensor
) -> Int2Queries:
    """`int2_queries` in one launch (`_int2_query_kernel`): a program a query."""
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


def residual2_ids(codes: torch.Tensor) -> torch.Tensor:
    """The centroid ids (int64 [T]) of residual2 rows."""
    raw = codes[:, :ID_BYTES].to(torch.int64)
    return raw[:, 0] | (raw[:, 1] << 8) | (raw[:, 2] << 16) | (raw[:, 3] << 24)


def residual2_buckets(codes: torch.Tensor) -> torch.Tensor:
    """The 2-bit buckets (int64 [T, dim]) of residual2 rows."""
    packed = codes[:, ID_BYTES:].to(torch.int64)
    return torch.stack([(packed >> (2 * i)) & 3 for i in range(4)], dim=2).reshape(codes.shape[0], -1)


def decode_residual2(codes: torch.Tensor, codebook: ResidualCodebook) -> torch.Tensor:
    """Decoded residual2 values, fp32 [T, dim]: ``C[id, k] + W[k, bucket_k]`` rounded once to fp32. Raises
    ValueError naming the first row whose centroid id is outside the codebook."""
    ids = residual2_ids(codes)
    k = codebook.centroids.shape[0]
    bad = (ids >= k).nonzero()
    if bad.numel():
        row = int(bad[0, 0])
        raise ValueError(f"token row {row}: centroid id {int(ids[row])} outside the codebook's {k} centroids")
    buckets = residual2_buckets(codes)
    weights = codebook.bucket_weights.float().gather(1, buckets.T).T  # [T, dim]
    return codebook.centroids[ids].float() + weights


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


def _codec_of(doc_scales: torch.Tensor | None, codebook: ResidualCodebook | Int2Levels | None) -> str:
    if isinstance(codebook, Int2Levels):
        if doc_scales is None:
            raise ValueError("int2 codes take doc_scales (fp32 [T]) beside their levels")
        return "int2"
    if codebook is not None and doc_scales is not None:
        raise ValueError("uint8 codes take doc_scales (int4) or a codebook (residual2), not both")
    if codebook is None and doc_scales is None:
        raise ValueError(
            "uint8 documents are codes: give doc_scales (int4, fp32 [T]), codebook= (residual2) or both "
            "(int2: its Int2Levels)"
        )
    return "int4" if codebook is None else "residual2"


def _prepare(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    doc_scales: torch.Tensor | None,
    query_scales: torch.Tensor | None,
    codebook: ResidualCodebook | None,
    backend: str,
) -> tuple:
    """Validate; pick the codec and the backend; quantize float queries to int8.

    Returns (codec, dim, backend, q8, s_q, query_offsets, codes, s_d or None, doc_offsets, codebook); for
    int2, q8 and s_q are those of `int2_queries` and the last entry its `Int2Queries`."""
    codec = _codec_of(doc_scales, codebook)
    if not isinstance(docs, torch.Tensor) or docs.dtype != torch.uint8 or docs.dim() != 2:
        got = f"{docs.dtype} {tuple(docs.shape)}" if isinstance(docs, torch.Tensor) else type(docs)
        raise ValueError(f"{codec} MaxSim expects uint8 codes [tokens, width], got {got}")
    if not isinstance(queries, torch.Tensor) or queries.dim() != 2:
        raise ValueError(f"queries must be a 2-D [tokens, dim] tensor, got {type(queries)}")
    dim = queries.shape[1]
    check_codec_dim(codec, dim)
    if docs.shape[1] != code_width(codec, dim):
        raise ValueError(
            f"{codec} codes of dim {dim} are {code_width(codec, dim)} bytes a token, but the documents "
            f"have {docs.shape[1]}; the queries and the codes come from different encoders or codecs"
        )
    device = docs.device
    if queries.device != device:
        raise ValueError(f"queries are on {queries.device}, documents on {device}")
    if codec in ("int4", "int2"):
        assert doc_scales is not None
        if doc_scales.shape != (docs.shape[0],) or doc_scales.device != device:
            raise ValueError(
                f"doc_scales must be [{docs.shape[0]}] on {device}, got {tuple(doc_scales.shape)}"
            )
        doc_scales = doc_scales.float().contiguous()
    if codec == "int2":
        offsets, steps = codebook
        if offsets.shape != (dim,) or steps.shape != (dim,):
            raise ValueError(
                f"int2 levels {tuple(offsets.shape)} and {tuple(steps.shape)} do not fit dim {dim} "
                f"(expected [{dim}] each)"
            )
        codebook = Int2Levels(offsets.to(device, torch.float32), steps.to(device, torch.float32))
    elif codec == "residual2":
        assert codebook is not None
        cent, wts = codebook
        if cent.dim() != 2 or cent.shape[1] != dim or wts.shape != (dim, RESIDUAL_BUCKETS):
            raise ValueError(
                f"codebook centroids {tuple(cent.shape)} and bucket weights {tuple(wts.shape)} do not fit "
                f"dim {dim} (expected [K, {dim}] and [{dim}, {RESIDUAL_BUCKETS}])"
            )
        codebook = ResidualCodebook(
            cent.to(device, torch.float16).contiguous(), wts.to(device, torch.float32).contiguous()
        )
    backend, query_offsets, doc_offsets = backend_and_offsets(
        backend, device, query_offsets, queries.shape[0], doc_offsets, docs.shape[0]
    )
    if queries.dtype == torch.int8:
        if query_scales is None or query_scales.shape != (queries.shape[0],):
            raise ValueError(f"int8 queries need query_scales (fp32 [{queries.shape[0]}])")
        q8, sq = queries, query_scales.to(device).float()
    elif queries.is_floating_point():
        q8, sq = (None, None) if codec == "int2" else quantize_per_token(queries, backend=backend)
    else:
        raise ValueError(f"queries must be float16/bfloat16/float32 or int8, got {queries.dtype}")
    if codec == "int2":  # the int8 scan of q * steps (`int2_queries`), from the float queries
        given = queries if q8 is None else q8.float() * sq[:, None]
        codebook = int2_queries(given, codebook, backend=backend, query_offsets=query_offsets)
        q8, sq = codebook.q8, codebook.scales
    codes = docs if docs.stride(1) == 1 else docs.contiguous()
    q8 = q8 if q8.stride(1) == 1 else q8.contiguous()
    return codec, dim, backend, q8, sq.contiguous(), query_offsets, codes, doc_scales, doc_offsets, codebook


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


def _launch_varlen(
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


def _launch_candidates(
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


def launch_varlen_with_tiles(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    tiles: Tiles | None,
    *,
    doc_scales: torch.Tensor | None = None,
    codebook: ResidualCodebook | None = None,
) -> torch.Tensor:
    """`maxsim_varlen_codes` on the Triton scan kernel, with the tile plan `tiles` in place of the planned
    one (None: the planned one; never the Gluon stream kernel): for tile sweeps and for timing the scan
    beside the stream kernel (`benchmarks/bench_codes.py`), not for production."""
    codec, dim, _, q8, sq, q_off, codes, sd, d_off, cb = _prepare(
        queries, query_offsets, docs, doc_offsets, doc_scales, None, codebook, "triton"
    )
    return _launch_varlen(codec, dim, q8, sq, q_off, codes, sd, d_off, cb, tiles=tiles)


# ----------------------------------------------------------------------------------------------------------
# CPU path (torch ops, documents decoded a bounded block at a time; also runs on CUDA tensors)
# ----------------------------------------------------------------------------------------------------------


def _decoded_block(
    codes: torch.Tensor, rows: slice | torch.Tensor, doc_scales: torch.Tensor | None, codebook
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(decoded values as fp32 [t, dim], the int4 scales [t] or None) of the token rows ``rows``."""
    block = codes[rows]
    if codebook is None:
        assert doc_scales is not None
        return decode_int4(block).float(), doc_scales[rows]
    ids = residual2_ids(block)
    bad = (ids >= codebook.centroids.shape[0]).nonzero()
    if bad.numel():  # name the row of the whole codes tensor
        i = int(bad[0, 0])
        row = rows.start + i if isinstance(rows, slice) else int(rows[i])
        raise ValueError(
            f"document token row {row}: centroid id {int(ids[i])} outside the codebook's "
            f"{codebook.centroids.shape[0]} centroids; the codes and the codebook do not belong together"
        )
    return decode_residual2(block, codebook).float(), None


def _block_sims(
    q_float: torch.Tensor,
    codes: torch.Tensor,
    rows: slice | torch.Tensor,
    doc_scales: torch.Tensor | None,
    codebook: ResidualCodebook | None,
) -> torch.Tensor:
    """Similarities [query rows, t] of the query rows with the decoded token rows ``rows``: int4's integer
    products are exact in fp32 and take the one fp32 rounding of ``s_d * acc``, as in the kernels."""
    values, scales = _decoded_block(codes, rows, doc_scales, codebook)
    sim = q_float @ values.T
    if scales is not None:
        sim.mul_(scales)
    return sim


def _varlen_torch(
    q8: torch.Tensor,
    sq: torch.Tensor,
    query_offsets: torch.Tensor,
    codes: torch.Tensor,
    doc_scales: torch.Tensor | None,
    doc_offsets: torch.Tensor,
    codebook: ResidualCodebook | None,
) -> torch.Tensor:
    nq, nd = query_offsets.numel() - 1, doc_offsets.numel() - 1
    device = codes.device
    dim = q8.shape[1]
    q_float = q8.float()
    row_query = torch.repeat_interleave(torch.arange(nq, device=device), query_offsets.diff())
    d_host = doc_offsets.tolist()
    out = torch.empty((nq, nd), dtype=torch.float32, device=device)
    budget = max(1, _TORCH_BLOCK_ELEMS // max(1, q8.shape[0], dim))  # document tokens per block
    first = 0
    while first < nd:
        last = first + 1
        while last < nd and d_host[last + 1] - d_host[first] <= budget:
            last += 1
        sim = _block_sims(q_float, codes, slice(d_host[first], d_host[last]), doc_scales, codebook)
        segment, _ = segment_ids(doc_offsets[first : last + 1].diff())
        best, _ = segment_max(sim, segment, last - first, None)
        out[:, first:last] = torch.zeros((nq, last - first), device=device).index_add_(
            0, row_query, sq[:, None] * best
        )
        first = last
    return out


def _candidates_torch(
    q8: torch.Tensor,
    sq: torch.Tensor,
    query_offsets: torch.Tensor,
    codes: torch.Tensor,
    doc_scales: torch.Tensor | None,
    doc_offsets: torch.Tensor,
    codebook: ResidualCodebook | None,
    candidate_offsets: torch.Tensor,
    candidate_docs: torch.Tensor,
) -> torch.Tensor:
    q_host = query_offsets.tolist()
    cand_host = candidate_offsets.tolist()
    nq = len(q_host) - 1
    dim = q8.shape[1]
    out = torch.empty((candidate_docs.numel(),), dtype=torch.float32, device=codes.device)
    cand_start = doc_offsets[candidate_docs]
    cand_len = doc_offsets[candidate_docs + 1] - cand_start
    len_host = cand_len.tolist()
    for query in range(nq):
        r0, r1 = q_host[query], q_host[query + 1]
        q_float = q8[r0:r1].float()
        budget = max(1, _TORCH_BLOCK_ELEMS // max(1, r1 - r0, dim))
        first, stop = cand_host[query], cand_host[query + 1]
        while first < stop:
            last, tokens = first + 1, len_host[first]
            while last < stop and tokens + len_host[last] <= budget:
                tokens += len_host[last]
                last += 1
            segment, local = segment_ids(cand_len[first:last])
            token = cand_start[first:last][segment] + local
            sim = _block_sims(q_float, codes, token, doc_scales, codebook)
            best, _ = segment_max(sim, segment, last - first, None)
            out[first:last] = sum_rows_in_order(sq[r0:r1, None] * best)
            first = last
    return out


# ----------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------


def maxsim_varlen_codes(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    *,
    doc_scales: torch.Tensor | None = None,
    codebook: ResidualCodebook | None = None,
    query_scales: torch.Tensor | None = None,
    return_argmax: bool = False,
    allow_tf32: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Every query against every document stored as codes: fp32 scores [nq, nd].

    docs: uint8 codes [Td, width] with `doc_scales` fp32 [Td] (int4, width dim / 2) or `codebook` (a
    `ResidualCodebook`: residual2, width 4 + dim / 4); queries [Tq, dim] float (quantized per token to
    int8 here) or int8 with `query_scales`. Scores as in the module docstring; a document with no tokens
    scores -inf. backend: "auto" (Triton on CUDA, torch on CPU), "triton", "torch". Offsets are checked
    on the host except by the Triton path on CUDA tensors. `allow_tf32` has no effect (the products are
    int8 or fp16); `return_argmax` is not available for codes.
    """
    del allow_tf32
    if return_argmax:
        raise ValueError("return_argmax is not available for compressed documents; score the float corpus")
    codec, dim, backend, q8, sq, q_off, codes, sd, d_off, cb = _prepare(
        queries, query_offsets, docs, doc_offsets, doc_scales, query_scales, codebook, backend
    )
    stream = _code_stream(codec, backend, query_offsets, q8, codes, cb) if q_off.numel() == 2 else None
    if stream is not None:
        scores = stream(q8, sq, q_off, None, None, codes, sd, d_off)[None]
    elif codec in _BYTE_TABLES and backend == "torch" and int8_stream_applies(q8, codes.device):
        # int4 or int2 against a few query rows on the CPU: decoded a chunk at a time on each worker
        decoded = functools.partial(_decoded_rows, codec, codes)
        products = _Int4Products(codes, q8) if codec == "int4" else None  # used where products are integers
        scores = maxsim_int8_varlen_cpu(q8, sq, q_off.numpy(), decoded, sd, d_off.numpy(), products)
    elif codec == "int2" or (
        codec == "int4"
        and backend == "triton"
        and q_off.numel() > 2
        and _int4_allpairs_on_hopper(query_offsets, doc_offsets, q8, codes)
    ):  # int2's query sums added to each chunk's scores as they are placed
        sums = cb.query_sums if codec == "int2" else None
        return _decoded_varlen(codec, backend, query_offsets, doc_offsets, q8, sq, codes, sd, sums)
    else:
        if backend == "triton":
            return _launch_varlen(codec, dim, q8, sq, q_off, codes, sd, d_off, cb)
        return _varlen_torch(q8, sq, q_off, codes, sd, d_off, cb)
    if codec == "int2":  # each query row's q . offsets (`int2_queries`)
        scores.add_(cb.query_sums[:, None])
    return scores


def maxsim_candidates_codes(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor,
    candidate_docs: torch.Tensor,
    *,
    doc_scales: torch.Tensor | None = None,
    codebook: ResidualCodebook | None = None,
    query_scales: torch.Tensor | None = None,
    return_argmax: bool = False,
    allow_tf32: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Each query against its own candidates, documents stored as codes: fp32 scores [C].

    Query i's candidates are ``candidate_docs[candidate_offsets[i]:candidate_offsets[i+1]]`` (int64
    indices into doc_offsets, read in place). Inputs as in `maxsim_varlen_codes`. Candidate indices on the
    host, or with the torch backend, are checked (ValueError naming the entry); on the GPU with the
    Triton backend a bad index is never read through and scores NaN.
    """
    del allow_tf32
    if return_argmax:
        raise ValueError("return_argmax is not available for compressed documents; score the float corpus")
    codec, dim, backend, q8, sq, q_off, codes, sd, d_off, cb = _prepare(
        queries, query_offsets, docs, doc_offsets, doc_scales, query_scales, codebook, backend
    )
    nq, nd = q_off.numel() - 1, d_off.numel() - 1
    device = codes.device
    if not isinstance(candidate_docs, torch.Tensor) or candidate_docs.dtype != torch.int64:
        raise ValueError("candidate_docs must be a 1-D int64 tensor [C] of document indices")
    if not isinstance(candidate_offsets, torch.Tensor) or candidate_offsets.shape != (nq + 1,):
        raise ValueError(f"candidate_offsets must have nq+1 = {nq + 1} entries")
    check = backend == "torch" or device.type != "cuda"
    c_off = device_offsets(
        "candidate_offsets", candidate_offsets, candidate_docs.numel(), device, empty_ok=True, check=check
    )
    stream = _code_stream(codec, backend, query_offsets, q8, codes, cb)
    # the kernels guard each index on the GPU; int2's decoded path gathers the candidates' rows first
    guarded = backend == "triton" and (stream is not None or codec != "int2")
    if candidate_docs.numel():
        check_candidate_docs(candidate_docs, nd, guarded=guarded)
    c_docs = candidate_docs.to(device)
    if stream is not None:
        scores = stream(q8, sq, q_off, c_off, c_docs, codes, sd, d_off)
    elif codec == "int2":
        scores = _int2_decoded_candidates(backend, query_offsets, q8, sq, codes, sd, d_off, c_off, c_docs)
    elif backend == "triton":
        return _launch_candidates(codec, dim, q8, sq, q_off, codes, sd, d_off, cb, c_off, c_docs)
    else:
        return _candidates_torch(q8, sq, q_off, codes, sd, d_off, cb, c_off, c_docs)
    if codec == "int2":  # each candidate's query's sum of q . offsets (`int2_queries`)
        scores.add_(cb.query_sums[_owners(c_off, c_docs.numel())])
    return scores


def _code_stream(
    codec: str,
    backend: str,
    given_q_off: torch.Tensor,
    q8: torch.Tensor,
    codes: torch.Tensor,
    codebook: ResidualCodebook | Int2Queries | None,
) -> Callable[..., torch.Tensor] | None:
    """The Gluon stream kernel's launch, ``launch(q8, sq, q_off, item_off, items, codes, sd, d_off)`` (its
    longest query and the codec's query side bound: `maxsim_int8_hopper_stream.maxsim_int8_stream`), where
    it takes the scan, else None: on an sm_90 GPU with the Triton backend, one query or query offsets given
    on the host (`maxsim_int8.hopper_stream`), dim 128; int4 codes of queries of at most 64 tokens, int2
    codes of queries of at most 32, or residual2 codes of separable buckets, queries of at most 32 tokens
    and a centroid table of one launch."""
    if backend != "triton":
        return None
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


# int4 and int2 all pairs (`_decoded_varlen`): documents decoded to int8 rows, this many bytes of buffers
# in all (on CUDA two of half the size, a chunk of documents each, on two streams), each chunk scored by
# the int8 kernels (on sm_90 the Gluon all-pairs kernel). A bound on the scratch memory, not a tuned size.
# 512 x 50K (8.0M tokens) one chunk after another in one buffer: 0.986-0.995x the int8 rate, the products
# of four launches 1.5 ms longer than int8's one (allpairs-profile-h100-9b3c1b4.json); on two streams, each
# launch's end filled by the next chunk's, 1.008-1.022x for int4 and int2 in four runs beside 0.986-0.999x
# in five of the one buffer, alternating processes on one H100 (allpairs-two-streams-h100-*.json,
# allpairs-one-buffer-h100-e76e3b0-*.json, codes-h100-9fd970e.json; benchmarks/results/codes/)
DECODE_CHUNK_BYTES = 256 << 20
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


def _byte_table(values_of_byte: Callable[[torch.Tensor], torch.Tensor]) -> np.ndarray:
    """Every byte's int8 values (`decode_int4` or `int2_values` of the byte) as one little-endian word a
    byte: a table that `np.take` decodes a chunk of codes with (the CPU stream; 3x faster than int4's torch
    ops on a 32K-token chunk)."""
    rows = values_of_byte(torch.arange(256, dtype=torch.uint8)[:, None]).numpy()
    return rows.view({2: np.uint16, 4: np.uint32}[rows.shape[1]])[:, 0].copy()


_BYTE_TABLES = {"int4": _byte_table(decode_int4), "int2": _byte_table(int2_values)}


def _decoded_rows(codec: str, codes: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
    """Rows t0 .. t1 - 1 of int4 or int2 ``codes`` (CPU) decoded to their int8 values, `decode_int4`'s or
    `int2_values`'s: a chunk of the CPU stream (`cpu.maxsim_int8_varlen_cpu`), valid until this thread
    decodes the next."""
    chunk = codes[t0:t1]
    table = _BYTE_TABLES[codec]
    out = thread_buffer(f"{codec}_byte_values", (chunk.shape[0], chunk.shape[1] * table.itemsize), torch.int8)
    # into the worker thread's buffer (`cpu.thread_buffer`): 1.02 against 1.20 ms a new array, int2's
    # 32K-token chunk; "wrap", which a byte never needs (256 entries), spares the bounds check's copy
    np.take(table, chunk.numpy(), out=out.numpy().view(table.dtype), mode="wrap")
    return out


class _Int4Products:
    """The int32 products of rows of int4 codes (CPU) with int8 query rows ``q8`` [rows, dim], made
    without interleaving the codes' values (`cpu.maxsim_int8_varlen_cpu`'s ``int_products``): the low
    nibbles (values 2m) sign-extended by two shifts into the first half of each row of a buffer, the high
    ones (2m + 1) by one into the second, and multiplied with the query's even columns followed by its odd
    ones: exactly `decode_int4`'s values times q8. A 32K-token chunk at d = 128 against 32 rows on one
    thread: 1.8 ms with the product, against 3.2 ms for `_decoded_rows` (a table's values, interleaved)
    and 0.8 for the product after it. The buffers are the worker thread's (`cpu.thread_buffer`), not
    fresh tensors each chunk."""

    def __init__(self, codes: torch.Tensor, q8: torch.Tensor) -> None:
        self.codes = codes
        self.columns = int8_columns(torch.cat([q8[:, 0::2], q8[:, 1::2]], dim=1))

    def __call__(self, t0: int, t1: int, out: torch.Tensor) -> torch.Tensor:
        chunk = self.codes[t0:t1]
        rows, width = chunk.shape
        shifted = thread_buffer("int4_shifted", (rows, width), torch.uint8)
        values = thread_buffer("int4_values", (rows, 2 * width), torch.int8)
        torch.bitwise_left_shift(chunk, 4, out=shifted)
        torch.bitwise_right_shift(shifted.view(torch.int8), 4, out=values[:, :width])  # arithmetic shifts
        torch.bitwise_right_shift(chunk.view(torch.int8), 4, out=values[:, width:])
        return torch._int_mm(values, self.columns, out=out)


def _int8_values(codec: str, backend: str, codes: torch.Tensor, out: torch.Tensor) -> None:
    """int4 or int2 ``codes`` [T, width] decoded into ``out`` [T, dim] as their int8 values (`decode_int4`'s,
    `int2_values`'): by the Triton decode with the Triton backend, else by those torch functions."""
    if backend == "triton":
        (int4_to_int8 if codec == "int4" else int2_to_int8)(codes, out)
    else:
        out.copy_((decode_int4 if codec == "int4" else int2_values)(codes))


def _odd_values(codes: torch.Tensor, backend: str) -> torch.Tensor:
    """int2 codes' odd values (int8, `_int8_values`)."""
    out = torch.empty((codes.shape[0], 4 * codes.shape[1]), dtype=torch.int8, device=codes.device)
    _int8_values("int2", backend, codes, out)
    return out


def int4_to_int8(codes: torch.Tensor, out: torch.Tensor) -> None:
    """The int4 ``codes`` [T, width] decoded into ``out`` [T, 2 * width] (int8 values -7..7, `decode_int4`'s
    values without their scales), on the codes' device (Triton; on the CPU under TRITON_INTERPRET)."""
    _decode_rows("int4_to_int8", _int4_to_int8_kernel, codes, out, 2)


def _int4_allpairs_on_hopper(
    given_q_off: torch.Tensor, given_d_off: torch.Tensor, q8: torch.Tensor, codes: torch.Tensor
) -> bool:
    """Whether all pairs of these queries against int4 codes go to the Gluon all-pairs kernel of int8 on
    their decoded values (`_decoded_varlen`): where that kernel takes the problem
    (`maxsim_int8.hopper_allpairs`: sm_90, dim 128, enough query groups); else the Triton scan of the codes.

    Scoring many queries is bound by the tensor cores, not by the bytes: 512 queries x 50K documents are
    ~53 ms of int8 products, where decoding their 8.0M tokens (0.5 GB of codes into 1.0 GB of int8 rows)
    moves 1.5 GB, ~0.5 ms at HBM speed."""
    if codes.shape[1] * 2 != 128 or codes.device.type != "cuda" or codes.shape[0] == 0:
        return False
    probe = torch.empty((1, 128), dtype=torch.int8, device=codes.device)  # the kernel's operand, as a shape
    return hopper_allpairs(given_q_off, given_d_off, q8, probe, False) is not None


def _document_chunks(d_host: np.ndarray, chunk: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Runs of whole documents [first, stop) of at most ``chunk`` tokens (one document where it alone is
    longer) over the host offsets ``d_host``, with their offsets from their first token (int64, host)."""
    nd, first = len(d_host) - 1, 0
    while first < nd:
        t0 = int(d_host[first])
        stop = max(int(np.searchsorted(d_host, t0 + chunk, side="right")) - 1, first + 1)
        yield first, stop, torch.from_numpy(np.ascontiguousarray(d_host[first : stop + 1] - t0))
        first = stop


def _owners(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """The segment of each of ``total`` entries of consecutive segments bounded by ``offsets`` [n + 1] (their
    count given: no wait for the device)."""
    segments = torch.arange(offsets.numel() - 1, device=offsets.device)
    return torch.repeat_interleave(segments, offsets.diff(), output_size=total)


def _query_sums(row_values: torch.Tensor, q_off: torch.Tensor) -> torch.Tensor:
    """Each query's sum of its rows' values (fp32 [nq], summed in float64): int2's ``sum_i q_i . offsets``."""
    sums = torch.zeros(q_off.numel() - 1, dtype=torch.float64, device=row_values.device)
    return sums.index_add_(0, _owners(q_off, row_values.numel()), row_values.double()).float()


def _decoded_varlen(
    codec: str,
    backend: str,
    given_q_off: torch.Tensor,
    given_d_off: torch.Tensor,
    q8: torch.Tensor,
    sq: torch.Tensor,
    codes: torch.Tensor,
    sd: torch.Tensor,
    query_sums: torch.Tensor | None = None,
) -> torch.Tensor:
    """All pairs of int4 or int2 codes as the int8 kernels score their values, plus ``query_sums[i]`` for
    query i where given (int2's sums of the query rows' offsets, `int2_queries`): the documents decoded
    into reused buffers of int8 rows a chunk of whole documents at a time (`_int8_values`;
    `DECODE_CHUNK_BYTES` in all, or one document alone where it is longer), each chunk scored by
    `maxsim_varlen_int8` with its scales and host offsets (the Gluon all-pairs kernel's plan reads them
    there): its exact integer products and maxima, bit for bit. Where one chunk holds every document its
    scores are the answer as they are; documents with no tokens score -inf. On CUDA, several chunks
    alternate between two buffers and two streams (`_chunk_streams`), so that one chunk's decode and the
    start of its products fill the end of the previous chunk's launch."""
    d_host = host_offsets("doc_offsets", given_d_off, codes.shape[0])
    nq, nd, dim = given_q_off.numel() - 1, len(d_host) - 1, q8.shape[1]
    total, longest = int(d_host[-1]), int(np.diff(d_host).max(initial=0))
    if total * dim <= DECODE_CHUNK_BYTES or nd == 1:  # one chunk: one buffer, the scores as they are
        scores = _scored_chunk(codec, backend, given_q_off, q8, sq, codes, sd, d_host, (0, nd), None)
        return scores if query_sums is None else scores.add_(query_sums[:, None])
    streams = _chunk_streams(codes.device)
    chunk = max(1, DECODE_CHUNK_BYTES // (len(streams) * dim))  # a buffer a stream, in the same bound
    buffers = [torch.empty((min(total, max(chunk, longest)), dim), dtype=torch.int8, device=codes.device)
               for _ in streams]  # fmt: skip
    out = torch.empty((nq, nd), dtype=torch.float32, device=codes.device)
    side = streams[1:]
    for stream in side:  # the side stream starts once its inputs, buffers and output are made
        stream.wait_stream(streams[0])
    try:
        for i, (first, stop, offsets) in enumerate(_document_chunks(d_host, chunk)):
            with _on_stream(streams[i % len(streams)]):
                part = _scored_chunk(codec, backend, given_q_off, q8, sq, codes, sd, d_host, (first, stop),
                                     buffers[i % len(streams)], offsets)  # fmt: skip
                if query_sums is None:
                    out[:, first:stop] = part
                else:  # the sums added in the copy, on the chunk's stream
                    torch.add(part, query_sums[:, None], out=out[:, first:stop])
    finally:  # also on an error (out of memory): the buffers are not freed under the side stream's work
        for stream in side:
            streams[0].wait_stream(stream)
    return out


def _scored_chunk(
    codec: str,
    backend: str,
    given_q_off: torch.Tensor,
    q8: torch.Tensor,
    sq: torch.Tensor,
    codes: torch.Tensor,
    sd: torch.Tensor,
    d_host: np.ndarray,
    documents: tuple[int, int],
    buffer: torch.Tensor | None,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Documents [first, stop) of `_decoded_varlen` decoded into ``buffer`` (a new one where None) and
    scored: fp32 [nq, stop - first], -inf where they have no tokens. ``offsets``: theirs from their first
    token (host), where the caller has them."""
    first, stop = documents
    t0, t1 = int(d_host[first]), int(d_host[stop])
    if t1 == t0:
        return torch.full((given_q_off.numel() - 1, stop - first), float("-inf"), dtype=torch.float32,
                          device=codes.device)  # fmt: skip
    if offsets is None:
        offsets = torch.from_numpy(np.ascontiguousarray(d_host[first : stop + 1] - t0))
    if buffer is None:
        buffer = torch.empty((t1 - t0, q8.shape[1]), dtype=torch.int8, device=codes.device)
    values = buffer[: t1 - t0]
    _int8_values(codec, backend, codes[t0:t1], values)
    return maxsim_varlen_int8(q8, given_q_off, values, offsets, doc_scales=sd[t0:t1], query_scales=sq,
                              backend=backend)  # fmt: skip


def _chunk_streams(device: torch.device) -> tuple:
    """The streams `_decoded_varlen` alternates its chunks between: on CUDA the current stream and one side
    stream of the device (from torch's pool), elsewhere one placeholder."""
    if device.type != "cuda":
        return (None,)
    return torch.cuda.current_stream(device), torch.cuda.Stream(device)


def _on_stream(stream: Any) -> Any:
    """``torch.cuda.stream(stream)``, or no change where ``stream`` is None (the CPU)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def _int2_decoded_candidates(
    backend: str,
    given_q_off: torch.Tensor,
    q8: torch.Tensor,
    sq: torch.Tensor,
    codes: torch.Tensor,
    sd: torch.Tensor,
    d_off: torch.Tensor,
    c_off: torch.Tensor,
    c_docs: torch.Tensor,
) -> torch.Tensor:
    """int2 candidates without the query rows' offsets, decoded: the candidates' documents (indices checked)
    gathered once each, decoded to their odd values and scored by the int8 candidates kernels."""
    if c_docs.numel() == 0:
        return torch.empty(0, dtype=torch.float32, device=codes.device)
    unique, local = torch.unique(c_docs, return_inverse=True)
    starts = d_off[unique]
    lengths = d_off[unique + 1] - starts
    offsets = torch.zeros(unique.numel() + 1, dtype=torch.int64, device=codes.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    segment, within = segment_ids(lengths)
    rows = starts[segment] + within
    return maxsim_candidates_int8(
        q8, given_q_off, _odd_values(codes[rows], backend), offsets, c_off, local,
        doc_scales=sd[rows], query_scales=sq, backend=backend,
    )  # fmt: skip


def quantized_queries(queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 codes and scales the kernels score float queries with (for references and tests)."""
    return quantize_per_token(queries, backend="torch")


__all__ = [
    "CODECS",
    "ResidualCodebook",
    "code_width",
    "check_codec_dim",
    "encode_int4",
    "decode_int4",
    "encode_residual2",
    "decode_residual2",
    "residual2_ids",
    "Int2Levels",
    "encode_int2",
    "decode_int2",
    "int2_values",
    "int2_grid_codes",
    "int2_queries",
    "int2_to_int8",
    "maxsim_varlen_codes",
    "maxsim_candidates_codes",
    "quantized_queries",
]
