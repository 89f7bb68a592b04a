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

`block_best_keys` fuses the keys with the first step of a top-k: for a small k it keeps, of every run of
`BEST_BLOCK` documents of a row, the ``K >= k`` largest keys (found one at a time: the block's largest,
then the largest of the rest, ...). The best k keys of a row are among them, since every key of a block
that is not among that block's K best is below K keys, all of the row. Keys are distinct (the ranks
are), so the k best are one set whichever way it is found. For one query against 200K documents that is
98 blocks x 16 keys, sorted on the host, where `torch.topk` over the 200K keys launched a radix selection
of several kernels a pass, one pass a byte of the key: host time per search, which is what a small
search costs (docs/kernel-notes.md, "The API's search and rerank: the host around one launch").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import SpecialisedLaunch

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
        launch = _key_launches.get((scores.device, per_score))
        if launch is None:  # its compiled launcher from the second call on, not Triton's JIT each call
            meta = dict(PER_SCORE=per_score, BLOCK=BLOCK)
            launch = _key_launches[(scores.device, per_score)] = SpecialisedLaunch(
                _order_keys_kernel, meta, scores.device
            )
        launch((triton.cdiv(n, BLOCK),), scores, ranks, keys, n, max(nd, 1))
    return keys


_key_launches: dict[tuple, SpecialisedLaunch] = {}


# `block_best_keys`: documents a program and the largest K it keeps. 2048 scores over 8 warps are 8
# keys a thread; each of the K steps is one max over the block. k is rounded up to a power of two, so
# at most six compiled variants (K = 1 ... 32) serve every k up to BEST_MAX_K.
BEST_BLOCK = 2048
BEST_WARPS = 8
BEST_MAX_K = 32
_LEFT_OUT = tl.constexpr(-9223372036854775808)  # topk.LEFT_OUT: the smallest int64


@triton.jit
def _block_best_kernel(
    scores_ptr, ranks_ptr, hidden_ptr, best_ptr, nd, num_blocks,
    HAS_HIDDEN: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0) // num_blocks
    block = tl.program_id(0) % num_blocks
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < nd
    s = tl.load(scores_ptr + row.to(tl.int64) * nd + cols, mask=mask, other=0.0)
    s = tl.where(s == 0.0, 0.0, s)  # as _order_keys_kernel
    s = tl.where(s != s, float("inf"), s)
    bits = s.to(tl.int32, bitcast=True)
    key32 = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    r = tl.load(ranks_ptr + cols, mask=mask, other=-1)
    key = (key32.to(tl.int64) << 32) | r
    left_out = r < 0  # deleted, or past the row's end
    if HAS_HIDDEN:
        left_out = left_out | (tl.load(hidden_ptr + cols, mask=mask, other=0) != 0)
    key = tl.where(left_out, _LEFT_OUT, key)
    out = best_ptr + tl.program_id(0).to(tl.int64) * K
    for i in tl.static_range(K):
        best = tl.max(key, 0)
        tl.store(out + i, best)
        # keys are distinct but for _LEFT_OUT, which is the smallest: once it is the best, the rest is too
        key = tl.where(key == best, _LEFT_OUT, key)


_best_launches: dict[tuple, SpecialisedLaunch] = {}


def block_best_keys(
    scores: torch.Tensor, ranks: torch.Tensor, k: int, hidden: torch.Tensor | None = None
) -> torch.Tensor:
    """int64 keys ``[nq, num_blocks * K]``: of each run of `BEST_BLOCK` columns of float32 ``scores``
    ``[nq, nd]`` (contiguous), the ``K`` largest order keys (`order_keys_triton`'s, with int64 ``ranks``
    ``[nd]``), K the power of two at least ``k`` (``1 <= k <= BEST_MAX_K``); `_LEFT_OUT` where a block
    has fewer than K documents to give, and for the columns where bool ``hidden [nd]`` is True (a
    filter's). Every row's ``k`` best keys are among its own. `scores` is not modified."""
    if scores.dtype != torch.float32 or scores.dim() != 2 or not scores.is_contiguous():
        raise TypeError(f"block_best_keys: scores must be contiguous float32 [nq, nd], got {scores.dtype}")
    if not 1 <= k <= BEST_MAX_K:
        raise ValueError(f"block_best_keys: k must be in [1, {BEST_MAX_K}], got {k}")
    nq, nd = scores.shape
    if ranks.shape != (nd,) or ranks.dtype != torch.int64 or ranks.device != scores.device:
        raise ValueError(f"block_best_keys: ranks must be int64 [{nd}] on the scores' device")
    K = triton.next_power_of_2(k)
    num_blocks = triton.cdiv(nd, BEST_BLOCK)
    best = torch.empty((nq, num_blocks * K), dtype=torch.int64, device=scores.device)
    if nq and nd:
        has_hidden = hidden is not None
        key = (scores.device, K, has_hidden)
        launch = _best_launches.get(key)
        if launch is None:
            meta = dict(HAS_HIDDEN=has_hidden, K=K, BLOCK=BEST_BLOCK, num_warps=BEST_WARPS, num_stages=1)
            launch = _best_launches[key] = SpecialisedLaunch(_block_best_kernel, meta, scores.device)
        hidden_arg = hidden.view(torch.uint8) if has_hidden else ranks
        launch((nq * num_blocks,), scores, ranks, hidden_arg, best, nd, num_blocks)
    return best
