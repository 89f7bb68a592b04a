"""The independent float reference of `maxsim verify`: float64 and float32 MaxSim of queries x documents.

One shared pass (float shards)
------------------------------
Documents are sorted by length and cut into padded groups (padding masked with -inf); one float32 GEMM
per group gives ``S32 = D Q^T``, its max, argmax ``a32`` and second max, hence the float32 reference and
the float32 gap ``g32``. The float64 reference is derived from the same pass instead of a second, 4x
slower float64 GEMM: any fp32 summation order satisfies ``|S32 - S| <= E = gamma_K |q_i| max_j |d_j|``
(K = dim, Higham's ``gamma_n = n u / (1 - n u)``), so where ``g32 > 2E + margin`` the float64 argmax is
``a32`` and the pair is not a near-tie, and its float64 max is the float64 dot product of ``q_i`` with
that one token; every other pair (near-ties, exact ties) is recomputed over the whole document in
float64. The result is the float64 materialised reference, at the cost of the float32 one.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from maxsim_cli.verify.checks import ACCUMULATION_ROUNDOFF, gamma
from maxsim_cli.verify.stats import segment_max

# Reference pass sizes. CPU, measured on one core of the 2-core dev machine (dim 128, 3200 query tokens,
# documents of 20-300 tokens): blocks of 4M similarities (1024 query rows x ~4096 padded document tokens,
# 16 MB, the kernel's CPU block too) ran 500 documents in 3.9 s against 3.8-4.9 s for 2M-16M; a max with
# argmax over the last dim (query-major layout) takes 6.7 ms per block against 9.7 ms over the middle
# dim. The fix-up gathers rows for 16 MB worth of documents at a time (4-16 documents: 35 ms per 64
# documents, flat). CUDA: sized to keep temporaries near 1-2 GiB; not tuned (no GPU measurement yet).
_CPU_SIM_ELEMS = 1 << 22
_CUDA_SIM_ELEMS = 1 << 28
_CPU_QUERY_ROWS = 1024
_CUDA_QUERY_ROWS = 1 << 30
_CPU_FIXUP_BYTES = 16 << 20
_CUDA_FIXUP_BYTES = 256 << 20
# Documents up to this many tokens get a plain float64 GEMM: its cost per (query token, document) grows
# with the length, the certified fix-up's (one gathered float64 row) does not; 64 documents of 160
# tokens x 3200 query tokens, dim 128: float64 GEMM 200 ms vs fix-up 29 ms, so the two meet near 24.
FULL_FLOAT64_WIDTH = 24


@dataclass
class FloatReference:
    """Reference results for queries x documents, laid out like `maxsim_varlen`'s outputs."""

    score64: torch.Tensor  # float64 [nq, nd]
    score32: torch.Tensor  # float32 [nq, nd]
    argmax64: torch.Tensor  # int32 [Tq, nd], lowest index on ties, -1 for an empty document
    argmax32: torch.Tensor  # int32 [Tq, nd]
    near_tie: torch.Tensor  # bool [Tq, nd]: the two best float64 similarities within the margin
    recomputed: int  # pairs whose float64 max was recomputed over the whole document
    # float32 sums of maxima of similarities computed by plain torch.mm in `plain_dtype` (the yardstick)
    score_plain: torch.Tensor | None = None


@contextlib.contextmanager
def _ieee_float32_matmul() -> Iterator[None]:
    """float32 GEMMs in full IEEE precision (no TF32 / bf16 shortcuts) inside the block."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def _length_groups(lengths: np.ndarray, rows: int, max_elems: int) -> list[np.ndarray]:
    """Non-empty documents sorted by length, cut into groups with rows * n * longest <= max_elems."""
    order = np.argsort(lengths, kind="stable")
    order = order[lengths[order] > 0]
    sorted_lens = lengths[order]
    per_group = max(1, max_elems // max(rows, 1))  # padded document tokens per group
    groups = []
    start = 0
    while start < order.size:
        limit = min(order.size - start, max(1, per_group // int(sorted_lens[start])))
        k = np.arange(1, limit + 1)
        fits = int(np.count_nonzero(k * sorted_lens[start : start + limit] <= per_group))
        stop = start + max(1, fits)
        groups.append(order[start:stop])
        start = stop
    return groups


def _top2(
    sims: torch.Tensor, padding: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Max, first argmax and second max over the last dim of `sims`, leaving out where `padding` is true.

    Overwrites `sims`. The second max is -inf for a one-token document. `padding` None: no padding.
    """
    if padding is not None:
        sims.masked_fill_(padding, -math.inf)
    best, arg = sims.max(dim=-1)  # the first maximal index on ties
    sims.scatter_(-1, arg.unsqueeze(-1), -math.inf)
    return best, arg, sims.amax(dim=-1)


@contextlib.contextmanager
def _one_thread(device: torch.device) -> Iterator[None]:
    """Run a loop of small CPU ops on one thread: a second thread gains little on these memory-bound
    ops and, on a busy machine, makes every op wait for it (measured 30x slower under load)."""
    if device.type != "cpu":
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _certified_float64(
    block64: torch.Tensor,
    padding: torch.Tensor | None,
    q64: torch.Tensor,
    best32: torch.Tensor,
    arg32: torch.Tensor,
    second32: torch.Tensor,
    gemm_bound: torch.Tensor,
    margin: torch.Tensor,
    fixup_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Float64 max, argmax and near-tie flag of every (query row, document) from the float32 pass.

    `block64` [n, width, dim] holds the documents in float64, `q64` [rows, dim] the query rows;
    `best32`, `arg32`, `second32` [rows, n] are the float32 results and `gemm_bound` [rows, n] bounds
    |S32 - S|. Where the float32 gap exceeds 2 * gemm_bound + margin the float32 winner is the float64
    one and the pair is no near-tie: one float64 dot product gives its max. The other pairs are
    recomputed over the whole document. Returns (best64, arg64, near_tie, recomputed pairs), [rows, n].
    """
    n, width, dim = block64.shape
    rows = q64.shape[0]
    device = block64.device
    gap32 = best32.double() - second32.double()  # inf for one-token documents
    certain = gap32 > 2.0 * gemm_bound + margin
    # one dot product per pair, a few documents at a time so the gathered rows stay in cache
    best64 = torch.empty(n, rows, dtype=torch.float64, device=device)
    flat = block64.view(n * width, dim)
    winners = (torch.arange(n, device=device)[:, None] * width + arg32.T).reshape(-1)  # [n * rows]
    per_step = max(1, fixup_bytes // max(1, rows * dim * 8))
    # one buffer reused: fresh multi-MB temporaries per document cost more in page faults than the math
    buffer = torch.empty(min(n, per_step) * rows, dim, dtype=torch.float64, device=device)
    with _one_thread(device):
        for j0 in range(0, n, per_step):
            j1 = min(n, j0 + per_step)
            picked = buffer[: (j1 - j0) * rows]
            torch.index_select(flat, 0, winners[j0 * rows : j1 * rows], out=picked)
            picked = picked.view(j1 - j0, rows, dim)
            picked.mul_(q64)
            torch.sum(picked, dim=2, out=best64[j0:j1])
    best64 = best64.T.contiguous()
    arg64 = arg32.clone()
    tie = torch.zeros(rows, n, dtype=torch.bool, device=device)
    unsure = (~certain).nonzero()
    per_pair = max(1, fixup_bytes // max(1, width * dim * 8))
    for p0 in range(0, unsure.shape[0], per_pair):
        rr, jj = unsure[p0 : p0 + per_pair].unbind(1)
        full = torch.bmm(block64[jj], q64[rr].unsqueeze(2)).squeeze(2)  # [pairs, width]
        top, where, second = _top2(full, None if padding is None else padding[jj])
        best64[rr, jj] = top
        arg64[rr, jj] = where
        tie[rr, jj] = (top - second) <= margin[rr, jj]
    return best64, arg64, tie, int(unsure.shape[0])


def float_reference(
    queries: torch.Tensor,
    query_offsets: np.ndarray,
    docs: torch.Tensor,
    doc_offsets: np.ndarray,
    *,
    sim_error: float,
    doc_scales: torch.Tensor | None = None,
    plain_dtype: torch.dtype | None = None,
) -> FloatReference:
    """Float64 and float32 references of all queries x all documents, in one float32 pass.

    `queries` [Tq, dim] and `docs` [Td, dim] are float tensors on one device (the values the kernel
    sees); `doc_scales` (optional, [Td]) multiplies document tokens exactly in float64 (float32 pass:
    in float32). `sim_error` is the kernel's relative similarity error, which sets the near-tie margin
    ``2 * sim_error * |q_i| * max_j |d_j|``. See the module docstring for why the result equals a
    float64 materialised reference. With `plain_dtype`, also the scores of plain PyTorch at that
    precision (similarities by `torch.mm` in `plain_dtype`, their maxima summed in float32): the
    FlashAttention yardstick's baseline.
    """
    device = docs.device
    tq, dim = queries.shape
    nq = len(query_offsets) - 1
    nd = len(doc_offsets) - 1
    lengths = np.diff(doc_offsets)
    q64 = queries.to(torch.float64)
    q32 = queries.to(torch.float32).contiguous()
    d32 = docs.to(torch.float32)
    if doc_scales is not None:
        d32 = d32 * doc_scales.to(torch.float32)[:, None]
    doc_norm = segment_max(torch.linalg.vector_norm(d32.double(), dim=1), doc_offsets)  # max_j |d_j|
    q_norm = torch.linalg.vector_norm(q64, dim=1)
    gemm_error = gamma(dim, ACCUMULATION_ROUNDOFF)  # bound on |S32 - S| / (|q_i| |d_j|)
    token_query = torch.from_numpy(np.repeat(np.arange(nq), np.diff(query_offsets))).to(device)

    score64 = torch.zeros(nq, nd, dtype=torch.float64, device=device)
    score32 = torch.zeros(nq, nd, dtype=torch.float32, device=device)
    score_plain = None if plain_dtype is None else torch.zeros(nq, nd, dtype=torch.float32, device=device)
    q_plain = None if plain_dtype is None else queries.to(plain_dtype).contiguous()
    argmax64 = torch.full((tq, nd), -1, dtype=torch.int32, device=device)
    argmax32 = torch.full((tq, nd), -1, dtype=torch.int32, device=device)
    near_tie = torch.zeros(tq, nd, dtype=torch.bool, device=device)
    empty = torch.from_numpy(np.flatnonzero(lengths == 0)).to(device)
    score64[:, empty] = -math.inf  # max over no tokens, as the kernels define it
    score32[:, empty] = -math.inf
    if score_plain is not None:
        score_plain[:, empty] = -math.inf
    recomputed = 0
    if tq == 0 or nd == 0:
        return FloatReference(score64, score32, argmax64, argmax32, near_tie, 0, score_plain)

    cuda = device.type == "cuda"
    sim_elems = _CUDA_SIM_ELEMS if cuda else _CPU_SIM_ELEMS
    fixup_bytes = _CUDA_FIXUP_BYTES if cuda else _CPU_FIXUP_BYTES
    row_cap = _CUDA_QUERY_ROWS if cuda else _CPU_QUERY_ROWS
    rows_per_step = max(1, min(tq, row_cap, sim_elems // max(1, int(lengths.max()))))
    starts = doc_offsets[:-1]
    with _ieee_float32_matmul():
        for group in _length_groups(lengths, rows_per_step, sim_elems):
            n = group.size
            g_lens = lengths[group]
            width = int(g_lens.max())
            pos = np.arange(width)[None, :]
            rows = starts[group, None] + np.minimum(pos, g_lens[:, None] - 1)
            rows_t = torch.from_numpy(rows.reshape(-1)).to(device)
            padded = pos >= g_lens[:, None]  # [n, width]
            padding = torch.from_numpy(padded).to(device) if padded.any() else None
            # -inf into the padded columns only (a full masked pass costs 40x more)
            pad_columns = None if padding is None else torch.from_numpy(np.flatnonzero(padded)).to(device)
            block32 = d32.index_select(0, rows_t)  # [n * width, dim]
            block64 = docs.index_select(0, rows_t).to(torch.float64)
            if doc_scales is not None:
                block64 *= doc_scales.index_select(0, rows_t).to(torch.float64)[:, None]
            cols = torch.from_numpy(group).to(device)
            g_norm = doc_norm[cols]
            for r0 in range(0, tq, rows_per_step):
                r1 = min(tq, r0 + rows_per_step)
                q_rows64 = q64[r0:r1]
                sims = torch.mm(q32[r0:r1], block32.T)
                if pad_columns is not None:
                    sims.index_fill_(1, pad_columns, -math.inf)
                best32, arg32, second32 = _top2(sims.view(r1 - r0, n, width), None)
                del sims
                scale = q_norm[r0:r1, None] * g_norm[None, :]  # |q_i| max_j |d_j|, [rows, n]
                margin = 2.0 * sim_error * scale
                if width <= FULL_FLOAT64_WIDTH:
                    sims64 = torch.mm(q_rows64, block64.T)
                    if pad_columns is not None:
                        sims64.index_fill_(1, pad_columns, -math.inf)
                    best64, arg64, second64 = _top2(sims64.view(r1 - r0, n, width), None)
                    del sims64
                    tie = (best64 - second64) <= margin
                else:
                    best64, arg64, tie, count = _certified_float64(
                        block64.view(n, width, dim),
                        padding,
                        q_rows64,
                        best32,
                        arg32,
                        second32,
                        gemm_error * scale,
                        margin,
                        fixup_bytes,
                    )
                    recomputed += count
                argmax64[r0:r1, cols] = arg64.to(torch.int32)
                argmax32[r0:r1, cols] = arg32.to(torch.int32)
                near_tie[r0:r1, cols] = tie
                tq_rows = token_query[r0:r1]
                score64[:, cols] += torch.zeros(nq, n, dtype=torch.float64, device=device).index_add_(
                    0, tq_rows, best64
                )
                score32[:, cols] += torch.zeros(nq, n, dtype=torch.float32, device=device).index_add_(
                    0, tq_rows, best32
                )
                if score_plain is not None and q_plain is not None:
                    plain = torch.mm(q_plain[r0:r1], docs.index_select(0, rows_t).to(plain_dtype).T)
                    if pad_columns is not None:
                        plain.index_fill_(1, pad_columns, -math.inf)
                    best_plain = plain.view(r1 - r0, n, width).amax(dim=2).to(torch.float32)
                    del plain
                    score_plain[:, cols] += torch.zeros(nq, n, dtype=torch.float32, device=device).index_add_(
                        0, tq_rows, best_plain
                    )
    return FloatReference(score64, score32, argmax64, argmax32, near_tie, recomputed, score_plain)


def yardstick_dtype(queries: torch.Tensor, device: torch.device) -> torch.dtype | None:
    """The precision of the yardstick's plain PyTorch baseline, where it differs from float32.

    On a GPU, 16-bit inputs go through the tensor cores, whose fp32 accumulation of fp16/bf16 products
    does not round like IEEE float32 sums; the FlashAttention rule therefore measures a fused kernel
    against plain PyTorch at the same low precision. On the CPU both the kernel and the float32
    reference sum in IEEE float32, so the float32 reference is the baseline there.
    """
    if device.type == "cuda" and queries.dtype in (torch.float16, torch.bfloat16):
        return queries.dtype
    return None
