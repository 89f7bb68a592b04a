"""The nearest centroid of each row on a GPU in one pass: `maxsim quantize --bits 2`'s assignment of every
token to its k-means centroid (`maxsim_cli.codecs.nearest_centroids`).

A program holds a tile of rows and walks every centroid a tile at a time: the tensor cores multiply fp16
rows by fp16 centroids with fp32 accumulation, the tile's scores ``x . c - |c|^2 / 2`` are reduced to
their maximum (the first index of a tie) in registers and kept where they beat the running best. No
[rows, K] score matrix reaches memory: as a torch product, subtraction and argmax it is written and read
four times (16 bytes a score; 2 * 10^12 scores for 31M tokens and 65,536 centroids), which bounds that
path by memory bandwidth, not by the tensor cores.

Each product of two fp16 values is exact in fp32, so the scores are those of the fp32 product up to the
order of the summation; the subtraction of ``|c|^2 / 2`` (given in fp32) rounds once, as in torch.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 128
BLOCK_CENTROIDS = 128
MAX_RESIDENT_DIM = 256  # up to this dim a program loads its rows once; wider rows are read a chunk at a time
DIM_CHUNK = 64
_WARPS = 8
_STAGES = 3


@triton.jit(do_not_specialize=["n_rows"])  # one build for every batch size
def _nearest_centroid_kernel(
    x_ptr, c_ptr, half_norm_ptr, out_ptr, n_rows, n_centroids, dim, stride_x, stride_c,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, RESIDENT: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    d = tl.arange(0, BLOCK_D)
    x_rows = x_ptr + rows[:, None] * stride_x
    if RESIDENT:  # the whole row in one tile: loaded once for every centroid tile
        x = tl.load(x_rows + d[None, :], mask=row_ok[:, None] & (d < dim)[None, :], other=0.0)
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK_M], tl.int32)
    for n0 in tl.range(0, n_centroids, BLOCK_N, num_stages=STAGES):  # centroid tiles prefetched
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < n_centroids
        c_rows = c_ptr + cols[:, None].to(tl.int64) * stride_c
        if RESIDENT:
            c = tl.load(c_rows + d[None, :], mask=col_ok[:, None] & (d < dim)[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(c), out_dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for d0 in range(0, dim, BLOCK_D):
                dd = d0 + d
                xk = tl.load(x_rows + dd[None, :], mask=row_ok[:, None] & (dd < dim)[None, :], other=0.0)
                ck = tl.load(c_rows + dd[None, :], mask=col_ok[:, None] & (dd < dim)[None, :], other=0.0)
                acc = tl.dot(xk, tl.trans(ck), acc, out_dtype=tl.float32)
        half_norm = tl.load(half_norm_ptr + cols, mask=col_ok, other=0.0)
        scores = tl.where(col_ok[None, :], acc - half_norm[None, :], float("-inf"))
        tile_best, tile_id = tl.max(scores, axis=1, return_indices=True, return_indices_tie_break_left=True)
        better = tile_best > best  # strictly: an earlier tile keeps a tie
        best = tl.where(better, tile_best, best)
        best_id = tl.where(better, tile_id + n0, best_id)
    tl.store(out_ptr + rows, best_id.to(tl.int64), mask=row_ok)


def launch_config(dim: int) -> dict[str, int | bool]:
    """The kernel's constexprs and warps for rows of ``dim`` values. Built for sm_90 with triton's ptxas
    (tests/test_codecs.py): no spills, the products on wgmma; 8 warps hold the fp32 tile of 128 x 128 scores
    in 64 registers a thread. Rows read a chunk at a time take centroid tiles of 64 (128 spills)."""
    resident = dim <= MAX_RESIDENT_DIM
    return {
        "BLOCK_M": BLOCK_ROWS,
        "BLOCK_N": BLOCK_CENTROIDS if resident else BLOCK_CENTROIDS // 2,
        "BLOCK_D": max(16, triton.next_power_of_2(dim)) if resident else DIM_CHUNK,
        "RESIDENT": resident,
        "STAGES": _STAGES,
        "num_warps": _WARPS,
    }


def nearest_centroid_ids(
    x: torch.Tensor, centroids: torch.Tensor, half_norm: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """int64 [n]: for each row of ``x`` (fp16 [n, dim]) the index of the row of ``centroids`` (fp16 [K, dim])
    with the largest ``x . c - half_norm`` (``half_norm``: fp32 [K], ``|c|^2 / 2``), the first of a tie;
    into ``out`` when given. All on one device (a GPU, or the CPU under Triton's interpreter)."""
    n, dim = x.shape
    k = centroids.shape[0]
    if x.dtype != torch.float16 or centroids.dtype != torch.float16 or half_norm.dtype != torch.float32:
        raise TypeError("nearest_centroid_ids takes fp16 rows and centroids and fp32 half norms")
    if centroids.shape[1] != dim or half_norm.shape != (k,) or k < 1:
        raise ValueError(f"centroids {tuple(centroids.shape)} and half norms {tuple(half_norm.shape)} "
                         f"do not fit rows of dim {dim}")  # fmt: skip
    out = torch.empty(n, dtype=torch.int64, device=x.device) if out is None else out
    if n == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    centroids = centroids if centroids.stride(1) == 1 else centroids.contiguous()
    half_norm = half_norm.contiguous()
    grid = (triton.cdiv(n, BLOCK_ROWS),)
    # triton launches on the current device: make it the tensors' (cuda:1 from a process on cuda:0)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _nearest_centroid_kernel[grid](
            x, centroids, half_norm, out, n, k, dim, x.stride(0), centroids.stride(0), **launch_config(dim)
        )
    return out
