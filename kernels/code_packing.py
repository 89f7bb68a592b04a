"""The codecs below 8 bits: what a stored row of codes holds, and its encode and decode (torch, on CPU or
GPU tensors; no Triton).

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

The scores of codes (`codes_host`, and the scan kernels of `maxsim_codes`) and `maxsim_cli.codecs` (the
files, the fitted codebooks) build on these definitions.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

CODECS = ("int4", "residual2", "int2")
INT4_ABSMAX = 7.0
RESIDUAL_BUCKETS = 4  # 2 bits a dimension
ID_BYTES = 4  # the residual2 centroid id: uint32, little-endian, first in the row
MAX_DIM = 1024  # int4: |q8 . c| <= 128 * 8 * dim < 2^24, exact in fp32


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


__all__ = [
    "CODECS",
    "ResidualCodebook",
    "Int2Levels",
    "Int2Queries",
    "code_width",
    "check_codec_dim",
    "encode_int4",
    "decode_int4",
    "encode_residual2",
    "decode_residual2",
    "residual2_ids",
    "residual2_buckets",
    "encode_int2",
    "decode_int2",
    "int2_values",
    "int2_grid_codes",
]
