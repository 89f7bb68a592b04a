"""Order keys of a score block in one launch (the running top-k of `maxsim score`).

For float32 scores ``s`` and int64 docno ranks ``r`` (``0 <= r < 2**32``) the key is

    key = (ord32(s) << 32) | r,    ord32(s) = bits(s) ^ ((bits(s) >> 31) & 0x7FFFFFFF)

(the smallest int64 where ``r < 0``: a deleted document), with ``-0.0`` read as ``+0.0`` and NaN as
``+inf`` first (the two zeros tie, as they print the same; a
NaN ranks first, where the run writer refuses it). ``ord32`` keeps the bits
of non-negative floats and flips the 31 low bits of negative ones, so comparing keys as signed int64
compares scores first and, on equal scores, ranks: trec_eval's order. The torch form of the same
arithmetic (`maxsim_cli.scoring.topk.order_keys`) is nine operations; the scoring thread of `maxsim score`
issues every batch's work, so on CUDA this is one launch instead. Memory-bound: 4 B read and 8 B written per
score (plus 8 per rank read), ~2 us for a 512 x 1300 block at HBM speed; what it saves is host time per
batch, not GPU time: in `maxsim score`, no change beyond noise (docs/kernel-notes.md, "`maxsim score`: the
pass against the kernel").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements a program: 4 warps x 32 lanes x 8 elements, ~650 programs for a 512 x 1300 block. Not tuned:
# at these sizes the kernel is a few microseconds against the launch it replaces nine of.
BLOCK = 1024


@triton.jit
def _order_keys_kernel(scores_ptr, ranks_ptr, keys_ptr, n, nd, PER_SCORE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    s = tl.load(scores_ptr + offs, mask=mask, other=0.0)
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 == 0.0: both zeros become +0.0
    s = tl.where(s != s, float("inf"), s)  # NaN ranks first, as +inf (see maxsim_cli.scoring.topk.order_keys)
    bits = s.to(tl.int32, bitcast=True)
    key32 = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # arithmetic shift: -1 for negative floats
    if PER_SCORE:
        r = tl.load(ranks_ptr + offs, mask=mask, other=0)
    else:
        r = tl.load(ranks_ptr + offs % nd, mask=mask, other=0)
    key = (key32.to(tl.int64) << 32) | r
    key = tl.where(r < 0, -9223372036854775808, key)  # rank -1: a deleted document, below every key
    tl.store(keys_ptr + offs, key, mask=mask)


def order_keys_triton(scores: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """int64 order keys ``[nq, nd]`` of float32 ``scores [nq, nd]`` and int64 ``ranks`` ``[nd]`` (one per
    document) or ``[nq, nd]`` (one per score), on the scores' device. `scores` is not modified."""
    if scores.dtype != torch.float32 or scores.dim() != 2:
        got = f"{scores.dtype} {tuple(scores.shape)}"
        raise TypeError(f"order_keys: scores must be float32 [nq, nd], got {got}")
    nq, nd = scores.shape
    per_score = ranks.dim() == 2
    if ranks.shape != ((nq, nd) if per_score else (nd,)):
        raise ValueError(f"order_keys: ranks {tuple(ranks.shape)} do not match scores {(nq, nd)}")
    scores = scores.contiguous()
    ranks = ranks.to(device=scores.device, dtype=torch.int64).contiguous()
    keys = torch.empty((nq, nd), dtype=torch.int64, device=scores.device)
    n = nq * nd
    if n:
        grid = (triton.cdiv(n, BLOCK),)
        _order_keys_kernel[grid](scores, ranks, keys, n, max(nd, 1), PER_SCORE=per_score, BLOCK=BLOCK)
    return keys
