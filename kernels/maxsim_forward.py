"""Fused MaxSim forward in Triton: packed ragged queries x packed ragged documents, never padded.

    S[i, j]      = <q_i, d_j>                               (fp32 accumulation on the tensor cores)
    score(q, d)  = sum_{i in q} max_{j in d} S[i, j]
    argmax(i, d) = min { j - start(d) : S[i, j] = max_{j' in d} S[i, j'] }

Layouts. `maxsim_varlen`: every query against every document -> [nq, nd]. `maxsim_candidates`: query i
against its own documents candidate_docs[candidate_offsets[i]:candidate_offsets[i+1]], read in place
through their indices -> [C].

Tiling. A program holds a query tile of BLOCK_Q token rows on chip for its whole life and streams
documents past it:

- query rows: QPB whole queries of at most ROWS = BLOCK_Q / QPB tokens each (rows past a query's length
  are zero and are dropped before the sum). A query longer than BLOCK_Q is cut into chunks of BLOCK_Q
  rows, one program row-block each, whose partial sums are added afterwards (a deterministic torch sum);
- documents: the all-pairs kernel takes `docs_per_prog` consecutive documents (a runtime value up to
  DOCS_PER_PROG, lowered for small problems so that the grid still fills the GPU), the candidates kernel a run
  of one query's candidates. Each document is walked in BLOCK_T-token tiles that start at the
  document's first token (a document of n tokens takes ceil(n / BLOCK_T) tiles, the last one masked), all
  the program's tiles in ONE flat loop so that Triton's software pipeliner prefetches the next tile
  (possibly of the next document) while the tensor cores work on this one;
- per tile: S = Q_tile . D_tile^T ([BLOCK_Q, BLOCK_T], `tl.dot`, dim walked in BLOCK_K chunks),
  out-of-document columns set to -inf (never 0: similarities may all be negative), and a running max
  (and argmax) per query row kept in registers. At the document's last tile the maxima of each query's
  rows are summed (in a fixed pairwise order, so the bits do not depend on the tile shape) and only the
  scores (and argmax rows) are written;
- document-major tiles (the one-query and candidates classes, scores only): S^T = D_tile . Q_tile^T
  ([BLOCK_T, BLOCK_Q]) puts the document tokens on the tensor-core instruction's 64-row side, which a
  32-token query would leave half empty, and the running max is kept per element and reduced over the
  document's tokens once, at its last tile.

In the all-pairs launch, the programs that share a document run are adjacent in launch order, so a
document tile is read from HBM once and then from L2 by every query block.

Cost. FLOPs: 2 * dim * sum over (query block, document) of BLOCK_Q * BLOCK_T * ceil(len_d / BLOCK_T),
i.e. 2 * Tq * Td * dim plus row padding (queries padded to ROWS) and tile padding (< BLOCK_T per
document). HBM bytes: the documents once per wave of query blocks (Td * dim * 2 bytes in fp16; from L2
for the other blocks), the queries once per program, 4 bytes per score. With many queries
(Tq >~ 200 rows) the kernel is tensor-core bound; with one query or per-query candidates it is
HBM-bound: the loop then reads each document byte once, 16 B per load, with enough programs in flight.

Precision: fp16/bf16 inputs, fp32 products and accumulation. fp32 inputs use exact fp32 products
(`input_precision="ieee"`) unless `allow_tf32=True`. All index arithmetic is int64 (offsets past 2^31
elements). Sizes are runtime arguments that Triton does not specialize on, and maximum lengths enter
only through power-of-two buckets, so new batch sizes or lengths within a bucket never recompile.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from .launch import KernelLaunch, SpecialisedLaunch, gluon_module
from .running_max import document_max, fold_tile, restart
from .validation import (
    FLOAT_DTYPES,
    Layout,
    alignment_key,
    cdiv,
    check_candidates,
    check_inputs,
    host_to_device,
    memo,
    memo_plan,
    next_pow2,
    on_device,
)

# ============================================================================================
# Triton kernels
# ============================================================================================


@triton.jit
def _load_query_tile(
    q_ptr,
    q_off_ptr,
    num_queries,
    group,
    chunk,
    stride_q,
    k0,
    dim,
    QPB: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """QPB queries x ROWS tokens (chunk `chunk`): values [QPB*ROWS, BLOCK_K], token ids, row validity."""
    r = tl.arange(0, QPB * ROWS)
    qi = group * QPB + r // ROWS
    q_in = qi < num_queries
    q_start = tl.load(q_off_ptr + qi, mask=q_in, other=0)
    q_end = tl.load(q_off_ptr + qi + 1, mask=q_in, other=0)
    tok = q_start + chunk.to(tl.int64) * ROWS + (r % ROWS)
    row_ok = q_in & (tok < q_end)
    k = k0 + tl.arange(0, BLOCK_K)
    ptrs = q_ptr + tok[:, None] * stride_q + k[None, :]
    if EVEN_K:
        q = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        q = tl.load(ptrs, mask=row_ok[:, None] & (k < dim)[None, :], other=0.0)
    return q, tok, row_ok


@triton.jit
def _query_sums(row_max, QPB: tl.constexpr, ROWS: tl.constexpr):
    """[QPB * ROWS] row maxima -> [QPB] sums, added in a fixed pairwise tree (rows 2i and 2i + 1, then the
    pairs of pairs, ...). tl.sum's order follows the register layout, which differs between tile shapes
    and orientations; this order does not, so a score's bits do not depend on the shape class its batch
    falls in (or on whether the argmax was asked for)."""
    x = tl.reshape(row_max, (QPB, ROWS))
    for _ in tl.static_range(ROWS.bit_length() - 1):  # ROWS is a power of two
        left, right = tl.split(tl.reshape(x, (QPB, x.shape[1] // 2, 2)))
        x = left + right
    return tl.reshape(x, (QPB,))


@triton.jit
def _tile_similarities(
    q_resident,
    q_ptr,
    q_off_ptr,
    num_queries,
    group,
    chunk,
    stride_q,
    d_ptr,
    rows,
    rows_ok,
    partial,
    stride_d,
    dim,
    QPB: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    DOC_MAJOR: tl.constexpr,
):
    """S = Q . D^T for one document tile [BLOCK_T rows]: fp32 [QPB*ROWS, BLOCK_T], -inf off the document.

    DOC_MAJOR: S^T = D . Q^T instead, [BLOCK_T, QPB*ROWS], -inf on the rows off the document.
    """
    k = tl.arange(0, BLOCK_K)
    if NUM_K == 1:
        ptrs = d_ptr + rows[:, None] * stride_d + k[None, :]
        if EVEN_K:
            d = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
        else:
            d = tl.load(ptrs, mask=rows_ok[:, None] & (k < dim)[None, :], other=0.0)
        if DOC_MAJOR:  # q_resident is the transposed tile [BLOCK_K, QPB*ROWS]
            s = tl.dot(d, q_resident, input_precision=PRECISION)
        else:
            s = tl.dot(q_resident, tl.trans(d), input_precision=PRECISION)
    else:
        if DOC_MAJOR:
            s = tl.zeros((BLOCK_T, QPB * ROWS), dtype=tl.float32)
        else:
            s = tl.zeros((QPB * ROWS, BLOCK_T), dtype=tl.float32)
        for kc in tl.static_range(NUM_K):
            kk = kc * BLOCK_K + k
            ptrs = d_ptr + rows[:, None] * stride_d + kk[None, :]
            d = tl.load(ptrs, mask=rows_ok[:, None] & (kk < dim)[None, :], other=0.0)
            q, _, _ = _load_query_tile(
                q_ptr,
                q_off_ptr,
                num_queries,
                group,
                chunk,
                stride_q,
                kc * BLOCK_K,
                dim,
                QPB,
                ROWS,
                BLOCK_K,
                False,
            )
            if DOC_MAJOR:
                s = tl.dot(d, tl.trans(q), s, input_precision=PRECISION)
            else:
                s = tl.dot(q, tl.trans(d), s, input_precision=PRECISION)
    if partial:  # only a document's last tile can reach past its end
        if DOC_MAJOR:
            s = tl.where(rows_ok[:, None], s, float("-inf"))
        else:
            s = tl.where(rows_ok[None, :], s, float("-inf"))
    return s


# Sizes (and stride_arg, which is one) are not specialized: Triton would otherwise compile again whenever
# one of them happens to be 1 or a multiple of 16. Index pointers may be slices of the caller's tensors, so
# their alignment is not specialized either; the embedding pointers stay 16-byte aligned (dim % 8 == 0).
@triton.jit(
    do_not_specialize=["num_queries", "num_docs", "num_blocks", "num_chunks", "docs_per_prog", "stride_arg"],
    do_not_specialize_on_alignment=["q_off_ptr", "d_off_ptr"],
)
def _maxsim_varlen_kernel(
    # pointers
    q_ptr,
    q_off_ptr,
    d_ptr,
    d_off_ptr,
    out_ptr,
    arg_ptr,
    # sizes
    num_queries,
    num_docs,
    num_blocks,
    num_chunks,
    docs_per_prog,
    dim,
    # strides
    stride_q,
    stride_d,
    stride_arg,
    # meta
    QPB: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOCS_PER_PROG: tl.constexpr,
    PRECISION: tl.constexpr,
    RETURN_ARGMAX: tl.constexpr,
    DOC_MAJOR: tl.constexpr,
    ELEMENT_MAX: tl.constexpr,
):
    """One program: query block `blk` (QPB queries, chunk `chunk`) x documents [d0, d0 + docs_per_prog).

    DOC_MAJOR (scores only: the launcher never sets it with RETURN_ARGMAX): each tile is S^T = D . Q^T,
    so the document tokens fill the tensor-core instruction's 64-row side (a 32-row query tile would fill
    half of it); the running max is kept per element of [BLOCK_T, BLOCK_Q] and reduced over the
    document's tokens once, at its last tile, not once per tile. The tuning table uses it where it was
    measured faster: one query and per-query candidates.
    """
    pid = tl.program_id(0).to(tl.int64)
    blk = pid % num_blocks  # query blocks vary fastest: they share the document run through L2
    group = blk // num_chunks
    chunk = blk % num_chunks
    d0 = (pid // num_blocks) * docs_per_prog
    BLOCK_Q: tl.constexpr = QPB * ROWS

    q, q_tok, q_ok = _load_query_tile(
        q_ptr, q_off_ptr, num_queries, group, chunk, stride_q, 0, dim, QPB, ROWS, BLOCK_K, EVEN_K
    )
    qi = group * QPB + tl.arange(0, QPB)
    if DOC_MAJOR:
        # transposed once, here: inside the loop Triton would copy the tile to shared memory every iteration
        q = tl.trans(q)

    # tiles of this program's documents (an empty document still takes one fully masked tile)
    dd = d0 + tl.arange(0, DOCS_PER_PROG)
    d_in = (dd < num_docs) & (tl.arange(0, DOCS_PER_PROG) < docs_per_prog)
    lens = tl.load(d_off_ptr + dd + 1, mask=d_in, other=0) - tl.load(d_off_ptr + dd, mask=d_in, other=0)
    total = tl.sum(tl.where(d_in, tl.maximum(tl.cdiv(lens, BLOCK_T), 1), 0))

    doc = d0
    doc_start = tl.load(d_off_ptr + tl.minimum(doc, num_docs))
    doc_end = tl.load(d_off_ptr + tl.minimum(doc + 1, num_docs))
    tok = doc_start
    m = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
    a = tl.full((BLOCK_Q,), -1, tl.int32)
    m_tile = tl.full(
        (BLOCK_T, BLOCK_Q) if DOC_MAJOR else ((BLOCK_Q, BLOCK_T) if ELEMENT_MAX else (1, 1)),
        float("-inf"),
        tl.float32,
    )
    for _ in range(total):
        rows = tok + tl.arange(0, BLOCK_T)
        s = _tile_similarities(
            q, q_ptr, q_off_ptr, num_queries, group, chunk, stride_q,
            d_ptr, rows, rows < doc_end, tok + BLOCK_T > doc_end, stride_d, dim,
            QPB, ROWS, BLOCK_T, BLOCK_K, NUM_K, EVEN_K, PRECISION, DOC_MAJOR,
        )  # fmt: skip
        m, a, m_tile = fold_tile(s, m, a, m_tile, tok, doc_start, ELEMENT_MAX, RETURN_ARGMAX)
        last = tok + BLOCK_T >= doc_end
        if last:
            m = document_max(m, m_tile, 0 if DOC_MAJOR else 1, ELEMENT_MAX)
            part = _query_sums(tl.where(q_ok, m, 0.0), QPB, ROWS)
            o = (chunk * num_queries + qi) * num_docs + doc
            tl.store(out_ptr + o, part, mask=qi < num_queries)
            if RETURN_ARGMAX:
                tl.store(arg_ptr + q_tok * stride_arg + doc, a, mask=q_ok)
            m, a, m_tile = restart(m, a, m_tile, ELEMENT_MAX, RETURN_ARGMAX)
        # advance to the next tile, or to the next document (state kept free of the running max)
        next_end = tl.load(d_off_ptr + tl.minimum(doc + 2, num_docs))
        tok = tl.where(last, doc_end, tok + BLOCK_T)
        doc_start = tl.where(last, doc_end, doc_start)
        doc_end = tl.where(last, next_end, doc_end)
        doc = doc + last.to(tl.int64)


@triton.jit(
    do_not_specialize=["num_queries", "num_cands", "num_chunks", "num_docs", "stride_arg"],
    do_not_specialize_on_alignment=[
        "q_off_ptr",
        "d_off_ptr",
        "cand_ptr",
        "blk_query_ptr",
        "blk_first_ptr",
        "blk_last_ptr",
    ],
)
def _maxsim_candidates_kernel(
    # pointers
    q_ptr,
    q_off_ptr,
    d_ptr,
    d_off_ptr,
    cand_ptr,
    blk_query_ptr,
    blk_first_ptr,
    blk_last_ptr,
    out_ptr,
    arg_ptr,
    # sizes
    num_queries,
    num_cands,
    num_chunks,
    num_docs,
    dim,
    # strides
    stride_q,
    stride_d,
    stride_arg,
    # meta
    ROWS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    CANDS_PER_PROG: tl.constexpr,
    PRECISION: tl.constexpr,
    RETURN_ARGMAX: tl.constexpr,
    DOC_MAJOR: tl.constexpr,
    ELEMENT_MAX: tl.constexpr,
    ROTATE: tl.constexpr = False,
):
    """One program: query `qi` (rows of chunk `chunk`) x its candidates [c_first, c_last).

    DOC_MAJOR as in `_maxsim_varlen_kernel` (scores only). ROTATE: block `blk` walks its candidates
    from the (blk mod n)-th on and wraps around, so that programs running side by side over candidates
    that lie one after another in memory do not read addresses in lockstep (see `_ROTATE_CANDIDATES`).
    A candidate index outside [0, num_docs) is never dereferenced: it is walked as an empty document and
    scored NaN (argmax -1), so indices that were not checked on the host (candidates on the GPU) cannot
    read out of bounds.
    """
    pid = tl.program_id(0).to(tl.int64)
    blk = pid // num_chunks
    chunk = pid % num_chunks
    qi = tl.load(blk_query_ptr + blk).to(tl.int64)
    c_first = tl.load(blk_first_ptr + blk)
    c_last = tl.load(blk_last_ptr + blk)

    q, q_tok, q_ok = _load_query_tile(
        q_ptr, q_off_ptr, num_queries, qi, chunk, stride_q, 0, dim, 1, ROWS, BLOCK_K, EVEN_K
    )
    q_row = chunk * ROWS + tl.arange(0, ROWS)  # token index within the query (argmax column)
    if DOC_MAJOR:
        q = tl.trans(q)  # once, outside the loop (see _maxsim_varlen_kernel)

    cc = c_first + tl.arange(0, CANDS_PER_PROG)
    c_in = cc < c_last
    docs = tl.load(cand_ptr + cc, mask=c_in, other=0)
    c_ok = c_in & (docs >= 0) & (docs < num_docs)  # a bad index: one tile of an empty document
    lens = tl.load(d_off_ptr + docs + 1, mask=c_ok, other=0) - tl.load(d_off_ptr + docs, mask=c_ok, other=0)
    total = tl.sum(tl.where(c_in, tl.maximum(tl.cdiv(lens, BLOCK_T), 1), 0))

    c = c_first
    if ROTATE:
        c = c_first + blk % (c_last - c_first)
    doc = tl.load(cand_ptr + c)
    doc_ok = (doc >= 0) & (doc < num_docs)
    doc_start = tl.load(d_off_ptr + doc, mask=doc_ok, other=0)
    doc_end = tl.load(d_off_ptr + doc + 1, mask=doc_ok, other=0)
    tok = doc_start
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    a = tl.full((ROWS,), -1, tl.int32)
    m_tile = tl.full(
        (BLOCK_T, ROWS) if DOC_MAJOR else ((ROWS, BLOCK_T) if ELEMENT_MAX else (1, 1)),
        float("-inf"),
        tl.float32,
    )
    for _ in range(total):
        rows = tok + tl.arange(0, BLOCK_T)
        s = _tile_similarities(
            q, q_ptr, q_off_ptr, num_queries, qi, chunk, stride_q,
            d_ptr, rows, rows < doc_end, tok + BLOCK_T > doc_end, stride_d, dim,
            1, ROWS, BLOCK_T, BLOCK_K, NUM_K, EVEN_K, PRECISION, DOC_MAJOR,
        )  # fmt: skip
        m, a, m_tile = fold_tile(s, m, a, m_tile, tok, doc_start, ELEMENT_MAX, RETURN_ARGMAX)
        last = tok + BLOCK_T >= doc_end
        if last:
            m = document_max(m, m_tile, 0 if DOC_MAJOR else 1, ELEMENT_MAX)
            part = tl.sum(_query_sums(tl.where(q_ok, m, 0.0), 1, ROWS), axis=0)  # one query: [1] -> scalar
            tl.store(out_ptr + chunk * num_cands + c, tl.where(doc_ok, part, float("nan")))
            if RETURN_ARGMAX:
                tl.store(arg_ptr + c * stride_arg + q_row, a, mask=q_ok)
            m, a, m_tile = restart(m, a, m_tile, ELEMENT_MAX, RETURN_ARGMAX)
        c_next = c + 1
        if ROTATE:
            c_next = tl.where(c_next >= c_last, c_first, c_next)
        next_doc = tl.load(cand_ptr + tl.minimum(c_next, num_cands - 1))
        next_ok = (next_doc >= 0) & (next_doc < num_docs)
        next_start = tl.load(d_off_ptr + next_doc, mask=next_ok, other=0)
        next_end = tl.load(d_off_ptr + next_doc + 1, mask=next_ok, other=0)
        tok = tl.where(last, next_start, tok + BLOCK_T)
        doc_start = tl.where(last, next_start, doc_start)
        doc_end = tl.where(last, next_end, doc_end)
        doc_ok = tl.where(last, next_ok, doc_ok)
        c = tl.where(last, c_next, c)


# ============================================================================================
# Host launchers: checks, shape-class tuning table, allocation, launch
# ============================================================================================


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch parameters of one shape class (see `_TUNING`)."""

    block_q: int  # query token rows per program (QPB * ROWS)
    block_t: int  # document tokens per tile
    docs_per_prog: int  # documents (all-pairs) or candidates (per-query) per program
    num_warps: int
    num_stages: int
    doc_major: bool = False  # scores only: S^T = D . Q^T tiles (see _maxsim_varlen_kernel)
    element_max: bool = False  # scores only: running max per tile element (implied by doc_major)

    def tile_variant(self, return_argmax: bool) -> dict[str, bool]:
        """The kernels' DOC_MAJOR and ELEMENT_MAX: both scores-only (an argmax needs the per-row max)."""
        return {
            "DOC_MAJOR": self.doc_major and not return_argmax,
            "ELEMENT_MAX": (self.doc_major or self.element_max) and not return_argmax,
        }

    def __post_init__(self) -> None:
        for name in ("block_q", "block_t", "docs_per_prog"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two, got {value}")
        if self.block_q < 16 or self.block_t < 16:
            raise ValueError("KernelConfig.block_q and block_t must be >= 16 (tl.dot's minimum)")


# Shape classes -> configuration (triton 3.6, fp16, dim 128, L2-normalised random vectors).
#   "many":  all-pairs with >= 256 query rows (tensor-core bound: 512 queries x 32 tokens x 50K docs);
#   "some":  all-pairs with 128 to 255 query rows (a 256-row tile would be half padding);
#   "few":   all-pairs with < 128 query rows (HBM bound: 1 query x 100K docs of 20-300 tokens);
#   "long":  queries longer than 128 tokens (1 ColPali query of 1024 tokens x 1000 docs of 1024);
#   "cands": per-query candidates (HBM bound: 64 queries x their own 1000 docs of 180 tokens).
# Each entry is its class's fastest in `python benchmarks/bench_kernels.py --sweep` / `--tune` on the H200,
# against its alternatives: docs/kernel-notes.md, "The forward tuning table, entry by entry".
# sm_90 builds of every entry (triton's ptxas, no GPU needed): no spills; the loads are cp.async-pipelined,
# the dots wgmma for >= 64 rows (and for document-major tiles).
_TUNING: dict[str, KernelConfig] = {
    "many": KernelConfig(
        block_q=256, block_t=32, docs_per_prog=64, num_warps=4, num_stages=2, element_max=True
    ),
    "some": KernelConfig(block_q=128, block_t=64, docs_per_prog=64, num_warps=4, num_stages=3),
    "few": KernelConfig(block_q=32, block_t=64, docs_per_prog=64, num_warps=4, num_stages=4, doc_major=True),
    "long": KernelConfig(block_q=128, block_t=64, docs_per_prog=1, num_warps=4, num_stages=2),
    "cands": KernelConfig(block_q=32, block_t=64, docs_per_prog=8, num_warps=4, num_stages=4, doc_major=True),
}
# Per-device entries that replace `_TUNING`'s on that device. On a GPU with slower HBM and a smaller L2 the
# HBM-bound classes want one document (two candidates) a program; scores bitwise equal to `_TUNING`'s.
# few 1.2845 vs 1.3285 ms, cands 0.9414 vs 0.9461 on one H100 (tune_memory_bound.py): docs/benchmarks.md
_DEVICE_TUNING: dict[str, dict[str, KernelConfig]] = {
    "H100": {
        "few": KernelConfig(
            block_q=32, block_t=64, docs_per_prog=1, num_warps=4, num_stages=2, doc_major=True
        ),
        "cands": KernelConfig(block_q=32, block_t=64, docs_per_prog=2, num_warps=2, num_stages=3),
    },
}


@functools.cache
def _device_family(device: torch.device) -> str | None:
    """The `_DEVICE_TUNING` key of a CUDA device ("H100" for every H100 variant), None elsewhere."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((family for family in _DEVICE_TUNING if family in name), None)


def tuning(cls: str, device: torch.device | None = None) -> KernelConfig:
    """Shape class `cls`'s configuration on `device` (its `_DEVICE_TUNING` entry, else `_TUNING`'s)."""
    family = None if device is None else _device_family(torch.device(device))
    return _DEVICE_TUNING.get(family, {}).get(cls, _TUNING[cls]) if family else _TUNING[cls]


# With return_argmax (the training forward) the all-pairs kernel keeps a running max and argmax per query
# row, not per tile element, so the scores-only winners above need not win.
# many 0.103 / 0.171 vs 0.137 / 0.241 ms (ColBERT 128 / 256 docs): docs/kernel-notes.md, "The argmax tile"
_ARGMAX_TUNING: dict[str, KernelConfig] = {
    "many": KernelConfig(block_q=256, block_t=64, docs_per_prog=64, num_warps=8, num_stages=2),
}
# Candidates kernel: ROTATE starts each program's run at a rotated candidate, so that programs over candidates
# that lie one after another never read in lockstep. Off: in order 0.668 vs shuffled 0.675 ms without it,
# rotated 0.672 / 0.679 (docs/kernel-notes.md, "Rerank: candidates in order").
_ROTATE_CANDIDATES = False
_MIN_ROWS = 16  # tl.dot needs M, N, K >= 16


def _precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    if dtype == torch.float32:
        return "tf32" if allow_tf32 else "ieee"
    return "tf32"  # ignored by tl.dot for 16-bit inputs


def _k_blocking(dim: int) -> tuple[int, int, bool]:
    """(BLOCK_K, NUM_K, EVEN_K): dim <= 128 in one chunk (padded to a power of two), else 128-wide chunks."""
    block_k = max(16, min(next_pow2(dim), 128))
    num_k = cdiv(dim, block_k)
    return block_k, num_k, dim % block_k == 0


def _match_dtypes(queries: torch.Tensor, docs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries in the documents' dtype (queries are small; the documents set the precision), both with
    unit stride along dim. Anything that is not a pair of float tensors is left for the checks to refuse."""
    if not (isinstance(queries, torch.Tensor) and isinstance(docs, torch.Tensor)):
        return queries, docs
    if queries.dtype != docs.dtype and queries.dtype in FLOAT_DTYPES and docs.dtype in FLOAT_DTYPES:
        queries = queries.to(docs.dtype)
    if queries.dim() == 2 and queries.stride(1) != 1:
        queries = queries.contiguous()
    if docs.dim() == 2 and docs.stride(1) != 1 and docs.dtype in FLOAT_DTYPES:
        docs = docs.contiguous()
    return queries, docs


# Programs a launch should have at least, per SM: the sweeps' winners take 64 documents a program, which
# leaves a small problem (one query x 1000 documents: 16 programs) with most SMs idle. Four waves of two
# programs an SM keep every SM busy and the tail short.
_MIN_PROGRAMS_PER_SM = 8


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: small, so that the CPU tests take the lowered path as well


def _docs_per_program(cap: int, num_blocks: int, num_docs: int, device: torch.device) -> int:
    """Documents a program: `cap` (the table's), halved while the grid would be under
    _MIN_PROGRAMS_PER_SM programs an SM. A runtime argument, so it never recompiles the kernel."""
    want = _MIN_PROGRAMS_PER_SM * _sm_count(device)
    per = cap
    while per > 1 and num_blocks * cdiv(num_docs, per) < want:
        per //= 2
    return per


def persistent_docs_per_program(num_blocks: int, num_docs: int, slots: int, start_docs: float) -> int:
    """Documents a program for a kernel whose programs each walk a run of documents for one query block:
    the run length that minimizes waves x (documents a program + a program's start, in documents), where
    `slots` programs run at once. At ColPali's shape (8 chunks of one query, 1000 documents, 264 slots)
    that is 31: 33 runs x 8 chunks fill the slots once. Up to 16 waves are considered; past that the
    quantization costs under 1/16 and the longest runs win."""
    best_cost, best = float("inf"), num_docs
    for runs in range(1, min(num_docs, max(1, 16 * slots // max(num_blocks, 1))) + 1):
        per = cdiv(num_docs, runs)
        waves = cdiv(num_blocks * cdiv(num_docs, per), slots)
        cost = waves * (per + start_docs)
        if cost < best_cost:
            best_cost, best = cost, per
    return max(best, 1)


def hopper_docs_per_program(hopper: Any, num_blocks: int, num_docs: int, device: torch.device) -> int:
    """Documents a program of the Hopper long-query kernel (module `hopper`): persistent runs sized to its
    programs an SM on this device."""
    slots = hopper.PROGRAMS_PER_SM * _sm_count(device)
    return persistent_docs_per_program(num_blocks, num_docs, slots, hopper.PROGRAM_START_DOCS)


def varlen_config(
    layout: Layout, return_argmax: bool = False, device: torch.device | None = None
) -> tuple[str, KernelConfig, int, int]:
    """Shape class, config, QPB (queries per block) and ROWS (rows per query) for an all-pairs problem on
    `device` (`_ARGMAX_TUNING` overrides the class's entry when the argmax is asked for)."""
    q_pad = max(_MIN_ROWS, next_pow2(layout.max_query_len))
    if q_pad > 128:
        cls = "long"
    elif layout.num_queries * q_pad >= 256:
        cls = "many"
    elif layout.num_queries * q_pad >= 128:
        cls = "some"
    else:
        cls = "few"
    cfg = _ARGMAX_TUNING.get(cls, _TUNING[cls]) if return_argmax else tuning(cls, device)
    rows = min(q_pad, cfg.block_q)
    if cls == "few":
        cfg = replace(cfg, block_q=max(rows, min(cfg.block_q, next_pow2(layout.num_queries * q_pad))))
    return cls, cfg, cfg.block_q // rows, rows


def _argmax_dtype(argmax_dtype: torch.dtype | None, layout: Layout) -> torch.dtype:
    """The argmax's element type: the kernels store the winner's index (< the longest document) in it.
    None picks int16 where every document is shorter than 2^15 tokens (half the bytes), else int32."""
    if argmax_dtype is None:
        return torch.int16 if layout.max_doc_len < 1 << 15 else torch.int32
    if argmax_dtype == torch.int16 and layout.max_doc_len >= 1 << 15:
        raise ValueError(
            f"an int16 argmax needs documents under 2^15 tokens; the longest has {layout.max_doc_len}"
        )
    if argmax_dtype not in (torch.int16, torch.int32):
        raise ValueError(f"argmax_dtype must be torch.int16 or torch.int32, got {argmax_dtype}")
    return argmax_dtype


@dataclass(frozen=True)
class _Plan:
    """Everything a forward launch derives from its inputs' shapes and offsets, kept for the next call
    with the same ones (`memo_plan`): output shapes, the launch and its int arguments (the checks passed).
    It holds no offsets tensor (see `memo_pair`); the launch gets their device copies at each call."""

    num_chunks: int
    scores_shape: tuple[int, ...]
    argmax_shape: tuple[int, ...]
    argmax_dtype: torch.dtype
    argmax_fill: int | None  # the argmax's initial value (None: every entry is written)
    launch: KernelLaunch | None  # None: nothing to score
    ints: tuple[int, ...]  # the kernel's runtime int arguments


def _finish(
    plan: _Plan,
    queries: torch.Tensor,
    docs: torch.Tensor,
    return_argmax: bool,
    before_docs: tuple[torch.Tensor, ...],
    after_docs: tuple[torch.Tensor, ...],
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Allocate the outputs, launch the plan (the kernels take queries, `before_docs`, docs, `after_docs`,
    the outputs, then the ints), and fold the chunks of long queries."""
    device = docs.device
    scores = torch.empty(plan.scores_shape, dtype=torch.float32, device=device)
    argmax = None
    if return_argmax:
        if plan.argmax_fill is None:
            argmax = torch.empty(plan.argmax_shape, dtype=plan.argmax_dtype, device=device)
        else:
            argmax = torch.full(plan.argmax_shape, plan.argmax_fill, dtype=plan.argmax_dtype, device=device)
    if plan.launch is not None:
        plan.launch(
            queries, *before_docs, docs, *after_docs, scores,
            argmax if argmax is not None else scores, *plan.ints,
        )  # fmt: skip
    out = scores if plan.num_chunks == 1 else scores.sum(0)
    return (out, argmax) if return_argmax else out


def maxsim_varlen_forward_triton(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    *,
    return_argmax: bool = False,
    allow_tf32: bool = False,
    layout: Layout | None = None,
    config: KernelConfig | None = None,
    argmax_dtype: torch.dtype | None = torch.int32,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Every query against every document with the fused Triton kernel (CUDA tensors, or the interpreter).

    Returns fp32 scores [nq, nd] and, with `return_argmax`, int32 [Tq, nd] (index within the document of
    the winning token, lowest on ties, -1 for an empty document). `config` overrides the tuning table
    (benchmark sweeps); `layout` (from `check_inputs`) skips the checks. `argmax_dtype` int16 halves the
    argmax where every document is shorter than 2^15 tokens; None picks int16 wherever that holds (the
    autograd path's choice). The checks and launch arguments are remembered per pair of offsets tensors
    and input shapes, so a repeated call (a training step) costs an allocation and a launch.
    """
    queries, docs = _match_dtypes(queries, docs)
    key = alignment_key(queries, docs)
    if key is not None:
        key += ("varlen", return_argmax, allow_tf32, config, argmax_dtype)
    plan = memo_plan(
        doc_offsets,
        query_offsets,
        key,
        lambda: _varlen_plan(
            queries, query_offsets, docs, doc_offsets, return_argmax, allow_tf32, layout, config, argmax_dtype
        ),
    )
    device = docs.device
    before, after = (on_device(query_offsets, device),), (on_device(doc_offsets, device),)
    return _finish(plan, queries, docs, return_argmax, before, after)


def _checked_layout(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    layout: Layout | None,
) -> Layout:
    if layout is None:
        layout = check_inputs(queries, query_offsets, docs, doc_offsets)
    if docs.dtype not in FLOAT_DTYPES:
        raise ValueError(f"the Triton forward takes float16/bfloat16/float32 docs, got {docs.dtype}")
    return layout


def _hopper_long(queries: torch.Tensor, docs: torch.Tensor, return_argmax: bool) -> Any:
    """The Gluon module for long queries (`maxsim_forward_hopper`) where it takes the problem, else None
    (other GPUs, the interpreter, the argmax, fp32; or a Triton without Gluon's Hopper API)."""
    hopper = gluon_module("maxsim_forward_hopper", docs.device)
    return hopper if hopper is not None and hopper.supports(queries, docs, return_argmax) else None


def _varlen_plan(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    return_argmax: bool,
    allow_tf32: bool,
    layout: Layout | None,
    config: KernelConfig | None,
    argmax_dtype: torch.dtype | None,
) -> _Plan:
    layout = _checked_layout(queries, query_offsets, docs, doc_offsets, layout)
    device = docs.device
    nq, nd, dim = layout.num_queries, layout.num_docs, layout.dim
    cls, cfg, qpb, rows = varlen_config(layout, return_argmax, device)
    if config is not None:
        cfg = config
        if layout.max_query_len > rows:  # chunked long queries: one query a block, block_q rows a chunk
            qpb, rows = 1, cfg.block_q
        else:
            qpb = max(1, cfg.block_q // rows)
            rows = cfg.block_q // qpb
    num_chunks = cdiv(layout.max_query_len, rows) if qpb == 1 else 1
    num_groups = cdiv(nq, qpb)
    num_blocks = num_groups * num_chunks
    argmax_dtype = _argmax_dtype(argmax_dtype, layout) if return_argmax else torch.int32
    launch = None
    hopper = (
        _hopper_long(queries, docs, return_argmax)
        if cls == "long" and config is None and rows == 128
        else None
    )
    if nq and nd and hopper is not None:  # long queries, scores only, on Hopper: maxsim_forward_hopper
        docs_per_prog = hopper_docs_per_program(hopper, num_blocks, nd, device)
        launch = hopper.LongLaunch((num_blocks * cdiv(nd, docs_per_prog),))
        ints = (nq, nd, num_chunks, docs_per_prog, queries.stride(0))
    elif nq and nd:
        block_k, num_k, even_k = _k_blocking(dim)
        docs_per_prog = _docs_per_program(cfg.docs_per_prog, num_blocks, nd, device)
        meta = dict(
            QPB=qpb, ROWS=rows, BLOCK_T=cfg.block_t, BLOCK_K=block_k, NUM_K=num_k, EVEN_K=even_k,
            DOCS_PER_PROG=cfg.docs_per_prog, PRECISION=_precision(docs.dtype, allow_tf32),
            RETURN_ARGMAX=return_argmax, **cfg.tile_variant(return_argmax),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        grid = (num_blocks * cdiv(nd, docs_per_prog),)
        launch = KernelLaunch(_maxsim_varlen_kernel, grid, meta, device)
        ints = (nq, nd, num_blocks, num_chunks, docs_per_prog, dim, queries.stride(0), docs.stride(0), nd)
    else:
        ints = ()
    return _Plan(
        num_chunks=num_chunks,
        scores_shape=(nq, nd) if num_chunks == 1 else (num_chunks, nq, nd),  # chunks: partial sums
        argmax_shape=(queries.shape[0], nd),
        argmax_dtype=argmax_dtype,
        argmax_fill=None,
        launch=launch,
        ints=ints,
    )


def candidates_config(layout: Layout, device: torch.device | None = None) -> tuple[KernelConfig, int]:
    """Config and ROWS (query rows per program) for a per-query-candidates problem on `device`."""
    return _candidates_config(layout.max_query_len, device)


def _candidates_config(max_query_len: int, device: torch.device | None = None) -> tuple[KernelConfig, int]:
    rows = min(max(_MIN_ROWS, next_pow2(max_query_len)), 128)
    return replace(tuning("cands", device), block_q=rows), rows


def _candidates_meta(
    cfg: KernelConfig, rows: int, dim: int, dtype: torch.dtype, allow_tf32: bool, return_argmax: bool
) -> dict[str, Any]:
    """The candidates kernel's compile-time arguments (with num_warps and num_stages)."""
    block_k, num_k, even_k = _k_blocking(dim)
    return dict(
        ROWS=rows, BLOCK_T=cfg.block_t, BLOCK_K=block_k, NUM_K=num_k, EVEN_K=even_k,
        CANDS_PER_PROG=cfg.docs_per_prog, PRECISION=_precision(dtype, allow_tf32),
        RETURN_ARGMAX=return_argmax, **cfg.tile_variant(return_argmax), ROTATE=_ROTATE_CANDIDATES,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def _candidate_blocks(c_off: np.ndarray, per_prog: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of at most `per_prog` candidates of one query: (query, first, last) per program block."""
    if len(c_off) == 2:  # one query (a served or API rerank): its runs, without the table's arithmetic
        first = np.arange(c_off[0], c_off[1], per_prog, dtype=np.int64)
        return np.zeros(len(first), dtype=np.int64), first, np.minimum(first + per_prog, c_off[1])
    counts = np.diff(c_off)
    n_blk = (counts + per_prog - 1) // per_prog
    query = np.repeat(np.arange(len(counts), dtype=np.int64), n_blk)
    blk_start = np.repeat(np.cumsum(n_blk) - n_blk, n_blk)
    first = c_off[query] + (np.arange(len(query)) - blk_start) * per_prog
    last = np.minimum(first + per_prog, c_off[query + 1])
    return query, first, last


class ResidentCandidates:
    """Many small reranking calls against one corpus that stays on its device (a server's requests): the
    kernel of `maxsim_candidates_forward_triton`, with each call's host inputs written into one reused
    page-locked buffer and sent in one copy, and the scores back through another.

    The generic launcher checks its inputs, plans, and copies the query offsets, the candidates and the
    program table each in its own pinned staging buffer (torch's caching host allocator) at every call:
    for 1 query x 1,000 candidates 0.53 ms a call against a 22 us kernel (docs/history.md, "Kept:
    `ResidentCandidates`"). Here the
    call's host arrays go into the buffer with numpy, one transfer takes them to the device, the
    compiled kernel of their specialisation is launched (`SpecialisedLaunch`), and the scores come back
    in a second transfer: the scores are those of `maxsim_candidates_forward_triton` (the same kernel,
    configuration and inputs). Calls are serialised (a lock): the buffers are reused.

    ``docs`` float16 / bfloat16 / float32 [T, dim] and ``doc_offsets`` int64 [N + 1], both on the device
    (CUDA; the CPU under the Triton interpreter, for tests). A call takes the queries as a host tensor
    [Tq, dim] (converted to ``docs``' dtype as they are staged), their offsets [nq + 1], and per-query
    candidate offsets and corpus ordinals (int64 numpy). It returns None, for the caller's generic path,
    where a query is longer than one program's rows (`candidates_config`: chunked queries).
    """

    def __init__(self, docs: torch.Tensor, doc_offsets: torch.Tensor) -> None:
        if docs.dtype not in FLOAT_DTYPES or docs.dim() != 2 or docs.stride(1) != 1:
            raise ValueError(
                f"ResidentCandidates takes 2-D float16/bfloat16/float32 documents, got {docs.dtype}"
            )
        if doc_offsets.dtype != torch.int64 or doc_offsets.device != docs.device:
            raise ValueError("ResidentCandidates: doc_offsets must be int64 on the documents' device")
        self.docs, self.doc_offsets, self.device = docs, doc_offsets, docs.device
        self.num_docs, self.dim = doc_offsets.numel() - 1, docs.shape[1]
        self._lock = threading.Lock()
        self._launches: dict[int, SpecialisedLaunch] = {}  # per ROWS
        self._host = self._dev = torch.empty(0, dtype=torch.uint8)
        self._scores = self._scores_host = torch.empty(0, dtype=torch.float32)

    def __call__(
        self,
        queries: torch.Tensor,
        query_offsets: np.ndarray,
        candidate_offsets: np.ndarray,
        candidate_docs: np.ndarray,
    ) -> np.ndarray | None:
        num_q, num_c = len(query_offsets) - 1, len(candidate_docs)
        if (
            query_offsets[0] != 0
            or query_offsets[-1] != queries.shape[0]
            or len(candidate_offsets) != num_q + 1
            or candidate_offsets[-1] != num_c
            or queries.shape[1] != self.dim
        ):
            raise ValueError(
                "ResidentCandidates: queries, query offsets, candidate offsets and candidates disagree"
            )
        if not num_c:
            return np.zeros(0, dtype=np.float32)
        if int(candidate_docs.min()) < 0 or int(candidate_docs.max()) >= self.num_docs:
            raise ValueError(
                f"ResidentCandidates: a candidate is not a document index in [0, {self.num_docs})"
            )
        query_lengths = np.diff(query_offsets)
        max_len = int(query_lengths.max())
        if max_len > 128 or int(query_lengths.min()) < 1:
            return None
        launch = self._launch(max_len)
        blocks = _candidate_blocks(candidate_offsets, launch.meta["CANDS_PER_PROG"])
        num_blocks = len(blocks[0])
        # the buffer: queries (the documents' dtype), then int64 query offsets, candidates and the
        # program table, each part at a 16-byte boundary (Triton specialises pointers on it)
        q_bytes = cdiv(queries.shape[0] * self.dim * self.docs.element_size(), 16) * 16
        ints = (num_q + 1, num_c, num_blocks, num_blocks, num_blocks)
        starts = [q_bytes]
        for n in ints:
            starts.append(starts[-1] + cdiv(8 * n, 16) * 16)
        with self._lock:
            self._reserve(starts[-1], num_c)
            numel = queries.numel()
            self._host_q[:numel].view(queries.shape).copy_(queries)
            host = self._host_np
            for part, at in zip((query_offsets, candidate_docs, *blocks), starts[:-1], strict=True):
                host[at // 8 : at // 8 + len(part)] = part
            if self._dev is not self._host:
                self._dev[: starts[-1]].copy_(self._host[: starts[-1]], non_blocking=True)
            # views of the buffer made once (`_reserve`): a slice of each a call
            dev = self._dev_i64
            views = [dev[a // 8 : a // 8 + n] for a, n in zip(starts[:-1], ints, strict=True)]
            q_dev = self._dev_q[:numel].view(queries.shape)
            scores = self._scores[:num_c]
            try:
                launch(
                    (num_blocks,), q_dev, views[0], self.docs, self.doc_offsets, views[1], views[2], views[3],
                    views[4], scores, scores,
                    num_q, num_c, 1, self.num_docs, self.dim, self.dim, self.docs.stride(0), max_len,
                )  # fmt: skip
                if self._scores_host is self._scores:
                    return scores.numpy().copy()
                self._scores_host[:num_c].copy_(scores, non_blocking=True)
            finally:
                if self.device.type == "cuda":  # the buffers are free again once the stream is done
                    torch.cuda.current_stream(self.device).synchronize()
            return self._scores_host_np[:num_c].copy()

    def _launch(self, max_query_len: int) -> SpecialisedLaunch:
        """The launch site of this ROWS class (`candidates_config`'s), made at its first call."""
        cfg, rows = _candidates_config(max_query_len, self.device)
        launch = self._launches.get(rows)
        if launch is None:
            meta = _candidates_meta(cfg, rows, self.dim, self.docs.dtype, False, False)
            launch = self._launches[rows] = SpecialisedLaunch(_maxsim_candidates_kernel, meta, self.device)
        return launch

    def _reserve(self, nbytes: int, num_c: int) -> None:
        """Buffers of at least ``nbytes`` and ``num_c`` scores (grown by doubling, kept)."""
        on_cuda = self.device.type == "cuda"
        if self._host.numel() < nbytes:
            size = max(nbytes, 2 * self._host.numel(), 1 << 16)  # a multiple of 16, as every part's end
            self._host = torch.empty(size, dtype=torch.uint8, pin_memory=on_cuda)
            self._dev = torch.empty(size, dtype=torch.uint8, device=self.device) if on_cuda else self._host
            # the views a call takes slices of: the queries' dtype at the start, int64 after
            self._host_q = self._host.view(self.docs.dtype)
            self._host_np = self._host.numpy().view(np.int64)
            self._dev_q, self._dev_i64 = self._dev.view(self.docs.dtype), self._dev.view(torch.int64)
        if self._scores.numel() < num_c:
            size = max(num_c, 2 * self._scores.numel(), 1 << 12)
            self._scores = torch.empty(size, dtype=torch.float32, device=self.device)
            self._scores_host = (
                torch.empty(size, dtype=torch.float32, pin_memory=True) if on_cuda else self._scores
            )
            self._scores_host_np = self._scores_host.numpy()


def maxsim_candidates_forward_triton(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor,
    candidate_docs: torch.Tensor,
    *,
    return_argmax: bool = False,
    allow_tf32: bool = False,
    layout: Layout | None = None,
    config: KernelConfig | None = None,
    argmax_dtype: torch.dtype | None = torch.int32,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Query i against candidate_docs[candidate_offsets[i]:candidate_offsets[i+1]], fused, documents in place.

    Returns fp32 scores [C] and, with `return_argmax`, int32 [C, max_query_len] (-1 past a query's length;
    `argmax_dtype` as in `maxsim_varlen_forward_triton`). Candidates on the host are checked there
    (ValueError for an index outside [0, num_docs)); candidates on the GPU are not read by the host: the
    kernel scores a bad index NaN (argmax -1) without reading through it. `candidate_offsets` are read on
    the host to plan the launch (on the GPU: one copy and wait per new offsets tensor).
    """
    queries, docs = _match_dtypes(queries, docs)
    # planned afresh each call: candidate lists change from one reranking batch to the next
    plan, tensors = _candidates_plan(
        queries, query_offsets, docs, doc_offsets, candidate_offsets, candidate_docs,
        return_argmax, allow_tf32, layout, config, argmax_dtype,
    )  # fmt: skip
    return _finish(plan, queries, docs, return_argmax, tensors[:1], tensors[1:])


def _candidates_plan(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor,
    candidate_docs: torch.Tensor,
    return_argmax: bool,
    allow_tf32: bool,
    layout: Layout | None,
    config: KernelConfig | None,
    argmax_dtype: torch.dtype | None,
) -> tuple[_Plan, tuple[torch.Tensor, ...]]:
    """The plan and the tensors the kernel takes besides queries, documents and outputs."""
    layout = _checked_layout(queries, query_offsets, docs, doc_offsets, layout)
    # candidates on the GPU are not read back (the kernel guards each index); the offsets are, to plan
    c_off, _ = check_candidates(
        candidate_offsets, candidate_docs, layout.num_queries, layout.num_docs, guarded=True
    )
    device = docs.device
    num_c, dim = int(c_off[-1]), layout.dim
    cfg, rows = candidates_config(layout, device)
    if config is not None:
        cfg, rows = config, config.block_q
    num_chunks = cdiv(layout.max_query_len, rows) if num_c else 1
    argmax_dtype = _argmax_dtype(argmax_dtype, layout) if return_argmax else torch.int32
    q_off, d_off = on_device(query_offsets, device), on_device(doc_offsets, device)
    launch, tensors, ints = None, (q_off, d_off), ()
    if num_c:
        blocks = memo(
            candidate_offsets,
            ("blocks", cfg.docs_per_prog, str(device)),
            lambda: host_to_device(
                torch.from_numpy(np.stack(_candidate_blocks(c_off, cfg.docs_per_prog))), device
            ),
        )
        meta = _candidates_meta(cfg, rows, dim, docs.dtype, allow_tf32, return_argmax)
        launch = KernelLaunch(_maxsim_candidates_kernel, (blocks.shape[1] * num_chunks,), meta, device)
        tensors = (q_off, d_off, on_device(candidate_docs, device), blocks[0], blocks[1], blocks[2])
        ints = (layout.num_queries, num_c, num_chunks, layout.num_docs, dim,
                queries.stride(0), docs.stride(0), layout.max_query_len)  # fmt: skip
    return _Plan(
        num_chunks=num_chunks,
        scores_shape=(num_c,) if num_chunks == 1 else (num_chunks, num_c),
        argmax_shape=(num_c, layout.max_query_len),
        argmax_dtype=argmax_dtype,
        argmax_fill=-1,
        launch=launch,
        ints=ints,
    ), tensors
