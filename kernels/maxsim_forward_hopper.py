"""MaxSim forward for long queries on Hopper (sm_90), in Gluon: the product of one document tile runs on the
tensor cores while the running max of the previous tile is taken.

    S[i, j]     = <q_i, d_j>                     (fp16/bf16 inputs, fp32 accumulation)
    score(q, d) = sum_{i in q} max_{j in d} S[i, j]

Scope: the "long" shape class of `maxsim_forward` (queries longer than 128 tokens: ColPali's 1024-token
page queries), scores only, fp16/bf16, dim 128, on an sm_90 GPU. Everything else
(the argmax, fp32, other GPUs, the interpreter) keeps the Triton kernel of `maxsim_forward`; the scores
are bitwise the same as that kernel's (same products per element, same max, same pairwise sum).

Why a second kernel. In Triton's `tl.dot` loop each tile's wgmma is waited for right after it is issued,
before its max: the max (and the loads' address arithmetic) and the tensor cores take turns within a
program, and at ColPali's shape that loop reaches 64% of the measured matmul rate (docs/kernel-notes.md,
version 5). Here, per program (one warp group; a 128-row query chunk held in registers as wgmma's A
operand, a run of consecutive documents):

- document tiles [BLOCK_T, dim] arrive by TMA into a ring of STAGES shared-memory buffers, each with its
  mbarrier; tile t - 1 + STAGES is requested as soon as tile t - 1's product is done with its buffer;
- tile t's product S_t = Q . D_t^T is issued asynchronously (`warpgroup_mma(is_async=True)`), then the
  program waits for the product of tile t - 1 only (`warpgroup_mma_wait(1)`) and folds S_{t-1} into the
  running max per query row while S_t is being computed: two fp32 accumulators live at once (in groups
  of GROUP tiles, see `_maxsim_long_kernel`);
- at a document's last tile its 128 row maxima go to shared memory; at the group's end they are added
  (rows past the query's end count 0) in the same pairwise tree as `maxsim_forward._query_sums` and one
  partial score per (chunk, document) is written; the chunks of a query are added afterwards as in
  `maxsim_forward`.

Programs are persistent where the problem allows: `maxsim_forward.persistent_docs_per_program` picks
the run of documents a program walks so that the grid fills the GPU's PROGRAMS_PER_SM x SMs slots in as
few waves as it can (ColPali's shape: 31 documents a program, 8 chunks x 33 runs = 264 programs, one
wave), so a program's start (the query's load, the ring's fill) is paid once per run.

Bandwidth per tile and SM (the reason for the A operand in registers): the tile's wgmma read B (the
document tile, 16 KB) once per 64-row half and, from shared memory, A (the query chunk) as well: 64 KB
a tile plus TMA's 16 KB write against 512 cycles of tensor-core work at 2048 FMA/clock, 160 B/clock
where shared memory gives 128; with A in registers 94 B/clock.

Cost, as for the Triton kernel: FLOPs 2 * 128 * dim * BLOCK_T per tile (ColPali: 2.7e11, 0.39 ms at the
694 TFLOP/s measured on the H200); documents are read from HBM once and from L2 by the other chunks of
the same query (adjacent programs, which walk the same run in step): 16 KB of L2 reads per 1M FMA. Tile
padding: a document of n tokens takes ceil(n / BLOCK_T) tiles; the rows past its end (the next
document's, or TMA's zeros past the tensor) are masked to -inf on its last tile only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .launch import hopper_device

BLOCK_Q = gl.constexpr(128)  # query rows a program (one warp group: two m64 wgmma rows)


@gluon.jit
def _pairwise_row_sum(row_vals, ROWS: gl.constexpr, pair_layout: gl.constexpr):
    """[ROWS] -> scalar, added in the pairwise tree of maxsim_forward._query_sums (rows 2i and 2i + 1,
    then pairs of pairs, ...): the same bits as the Triton kernel's sum. A sum of two is one addition, so
    each level is a reshape to [n / 2, 2] (pairs in one thread) and a sum over the pair."""
    x = row_vals
    for _ in gl.static_range(ROWS.bit_length() - 1):
        x = gl.convert_layout(gl.reshape(x, [x.shape[0] // 2, 2]), pair_layout)
        x = gl.sum(x, axis=1)
    return gl.sum(x, axis=0)


@gluon.jit
def _advance(tok, doc_end, doc, d_off_ptr, num_docs, BLOCK_T: gl.constexpr):
    """The next tile of a program's flat walk: the next BLOCK_T tokens, or the next document's first."""
    last = tok + BLOCK_T >= doc_end
    next_end = gl.load(d_off_ptr + gl.minimum(doc + 2, num_docs))
    tok = gl.where(last, doc_end, tok + BLOCK_T)
    doc_end = gl.where(last, next_end, doc_end)
    doc = doc + last.to(gl.int64)
    return tok, doc_end, doc


@gluon.jit
def _request_tile(d_desc, d_smem, ready, x, tok, STAGES: gl.constexpr):
    """TMA of the document tile starting at token `tok` (the program's tile x) into buffer x % STAGES."""
    slot = x % STAGES
    mbarrier.expect(ready.index(slot), d_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(d_desc, [tok.to(gl.int32), 0], ready.index(slot), d_smem.index(slot))


@gluon.jit
def _refill(
    d_desc,
    d_smem,
    ready,
    done,
    tiles,
    tok,
    doc_end,
    doc,
    d_off_ptr,
    num_docs,
    BLOCK_T: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Tile `done`'s product has finished with its buffer: request tile done + STAGES into it (if any)."""
    if done + STAGES < tiles:
        _request_tile(d_desc, d_smem, ready, done + STAGES, tok, STAGES)
        tok, doc_end, doc = _advance(tok, doc_end, doc, d_off_ptr, num_docs, BLOCK_T)
    return tok, doc_end, doc


@gluon.jit
def issue_product(q_rows, d_smem, ready, x, dead_acc, STAGES: gl.constexpr):
    """Tile x's S = Q . D^T, asynchronous, written over the registers of `dead_acc` (a folded tile)."""
    slot = x % STAGES
    mbarrier.wait(ready.index(slot), (x // STAGES) & 1)
    return warpgroup_mma(q_rows, d_smem.index(slot).permute((1, 0)), dead_acc, use_acc=False, is_async=True)


@gluon.jit
def _fold(
    s,
    valid,
    m,
    tok,
    doc_end,
    doc,
    d_off_ptr,
    num_docs,
    finished,
    num_finished,
    col_layout: gl.constexpr,
    BLOCK_T: gl.constexpr,
):
    """Fold tile s (starting at token `tok` of document `doc`) into the running max per row; at the
    document's last tile park the row maxima in `finished` (summed at the group's end: the sum's code
    stays out of the unrolled group) and start again. Returns the state and the next tile. A padding tile
    (not `valid`) changes nothing."""
    if valid:
        if tok + BLOCK_T > doc_end:  # only a document's last tile can reach past its end
            cols = gl.arange(0, BLOCK_T, layout=col_layout)
            s = gl.where((cols < (doc_end - tok).to(gl.int32))[None, :], s, float("-inf"))
        m = gl.maximum(m, gl.max(s, axis=1))
        if tok + BLOCK_T >= doc_end:
            finished.index(num_finished).store(m)
            num_finished += 1
            m = gl.full(m.shape, float("-inf"), gl.float32, m.type.layout)
        tok, doc_end, doc = _advance(tok, doc_end, doc, d_off_ptr, num_docs, BLOCK_T)
    return m, tok, doc_end, doc, num_finished


@gluon.jit
def _retire(s, done, tiles, total, m, l_tok, l_end, l_doc, f_tok, f_end, f_doc, d_desc, d_smem, ready,
            d_off_ptr, num_docs, finished, num_finished, col_layout: gl.constexpr, BLOCK_T: gl.constexpr,
            STAGES: gl.constexpr):  # fmt: skip
    """Tile `done`'s product `s` has finished: refill its buffer (`_refill`) and fold it (`_fold`, unless
    it is a padding tile). Returns the running max, both cursors and the count of finished documents."""
    l_tok, l_end, l_doc = _refill(d_desc, d_smem, ready, done, tiles, l_tok, l_end, l_doc, d_off_ptr,
                                  num_docs, BLOCK_T, STAGES)  # fmt: skip
    m, f_tok, f_end, f_doc, num_finished = _fold(s, done < total, m, f_tok, f_end, f_doc, d_off_ptr, num_docs,
                                                 finished, num_finished, col_layout, BLOCK_T)  # fmt: skip
    return m, l_tok, l_end, l_doc, f_tok, f_end, f_doc, num_finished


@gluon.jit(do_not_specialize=["num_queries", "num_docs", "num_chunks", "docs_per_prog"])
def _maxsim_long_kernel(
    q_ptr,
    q_off_ptr,
    d_desc,
    d_off_ptr,
    out_ptr,
    num_queries,
    num_docs,
    num_chunks,
    docs_per_prog,
    stride_q,
    DIM: gl.constexpr,
    BLOCK_T: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP: gl.constexpr,
):
    """One program: query `qi`'s 128-row chunk `chunk` x documents [d0, d0 + docs_per_prog).

    The tiles are taken in groups of GROUP, alternately into two accumulators (A: even tiles, B: odd
    tiles); each group ends with its last product waited for. ptxas serializes every wgmma of a kernel in
    which an accumulator is copied between registers or stays in flight across a loop's back edge (checked
    on sm_90 builds), so the overlap runs within a group and pauses at its end. The tile count is rounded
    up to whole groups with padding tiles (whatever TMA reads there), whose products are never folded.
    """
    pid = gl.program_id(0).to(gl.int64)
    blk = pid % (num_queries * num_chunks)  # the chunks of a document run are adjacent: they share L2
    qi = blk // num_chunks
    chunk = blk % num_chunks
    d0 = (pid // (num_queries * num_chunks)) * docs_per_prog
    d1 = gl.minimum(d0 + docs_per_prog, num_docs)

    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_T, 16]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    pair_layout: gl.constexpr = gl.BlockedLayout([1, 2], [32, 1], [4, 1], [1, 0])

    # the query chunk, loaded once into the registers wgmma reads its A operand from (from shared memory,
    # A and B together would ask more than its bandwidth at 64-token tiles); rows past the query's end
    # load as zeros and are left out of the sum
    q_start = gl.load(q_off_ptr + qi)
    q_end = gl.load(q_off_ptr + qi + 1)
    q_tok = q_start + chunk * BLOCK_Q + gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, q_layout))
    k = gl.arange(0, DIM, layout=gl.SliceLayout(0, q_layout))
    q_rows = gl.load(q_ptr + q_tok[:, None] * stride_q + k[None, :], mask=(q_tok < q_end)[:, None], other=0.0)
    row_ok = (q_start + chunk * BLOCK_Q + gl.arange(0, BLOCK_Q, layout=row_layout)) < q_end

    d_smem = gl.allocate_shared_memory(d_desc.dtype, [STAGES, BLOCK_T, DIM], d_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # row maxima of the documents finished within a group (at most one a tile)
    finished = gl.allocate_shared_memory(gl.float32, [GROUP, BLOCK_Q], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()  # the barriers' init, before TMA
    gl.thread_barrier()

    # the program's tiles (an empty document still takes one tile, fully masked), rounded up to groups
    total = 0
    for dd in range(d0, d1):
        n = gl.load(d_off_ptr + dd + 1) - gl.load(d_off_ptr + dd)
        total += gl.maximum(gl.cdiv(n, BLOCK_T), 1).to(gl.int32)
    tiles = gl.cdiv(total, GROUP) * GROUP

    # loader cursor: the next tile to request; the ring starts full
    l_tok = gl.load(d_off_ptr + d0)
    l_end = gl.load(d_off_ptr + d0 + 1)
    l_doc = d0
    for i in gl.static_range(STAGES):
        if i < tiles:
            _request_tile(d_desc, d_smem, ready, i, l_tok, STAGES)
            l_tok, l_end, l_doc = _advance(l_tok, l_end, l_doc, d_off_ptr, num_docs, BLOCK_T)

    # fold cursor: the next tile to fold into the running max
    f_tok = gl.load(d_off_ptr + d0)
    f_end = gl.load(d_off_ptr + d0 + 1)
    f_doc = d0
    m = gl.full([BLOCK_Q], float("-inf"), gl.float32, row_layout)
    out_row = (chunk * num_queries + qi) * num_docs
    zero = gl.zeros([BLOCK_Q, BLOCK_T], gl.float32, acc_layout)
    num_finished = 0
    for base in range(0, tiles, GROUP):
        first_doc = f_doc  # documents finish in order: the group's are first_doc, first_doc + 1, ...
        # a group's first two products start from a zero constant, the others over the registers of a
        # folded tile: a register copy of an accumulator, or one in flight across the loop's back edge,
        # makes ptxas serialize every wgmma
        acc_a = issue_product(q_rows, d_smem, ready, base, zero, STAGES)
        acc_a = warpgroup_mma_wait(num_outstanding=1, deps=[acc_a])  # no wait: a tensor from here on
        acc_b = issue_product(q_rows, d_smem, ready, base + 1, zero, STAGES)
        acc_b, acc_a = warpgroup_mma_wait(num_outstanding=1, deps=[acc_b, acc_a])  # tile base is done
        m, l_tok, l_end, l_doc, f_tok, f_end, f_doc, num_finished = _retire(
            acc_a, base, tiles, total, m, l_tok, l_end, l_doc, f_tok, f_end, f_doc, d_desc, d_smem, ready,
            d_off_ptr, num_docs, finished, num_finished, col_layout, BLOCK_T, STAGES,
        )  # fmt: skip
        for j in gl.static_range(2, GROUP, 2):  # B holds tile base + j - 1, in flight
            acc_a = issue_product(q_rows, d_smem, ready, base + j, acc_a, STAGES)
            acc_a, acc_b = warpgroup_mma_wait(num_outstanding=1, deps=[acc_a, acc_b])  # base + j - 1 is done
            m, l_tok, l_end, l_doc, f_tok, f_end, f_doc, num_finished = _retire(
                acc_b, base + j - 1, tiles, total, m, l_tok, l_end, l_doc, f_tok, f_end, f_doc, d_desc,
                d_smem, ready, d_off_ptr, num_docs, finished, num_finished, col_layout, BLOCK_T, STAGES,
            )  # fmt: skip
            acc_b = issue_product(q_rows, d_smem, ready, base + j + 1, acc_b, STAGES)
            acc_b, acc_a = warpgroup_mma_wait(num_outstanding=1, deps=[acc_b, acc_a])  # base + j is done
            m, l_tok, l_end, l_doc, f_tok, f_end, f_doc, num_finished = _retire(
                acc_a, base + j, tiles, total, m, l_tok, l_end, l_doc, f_tok, f_end, f_doc, d_desc, d_smem,
                ready, d_off_ptr, num_docs, finished, num_finished, col_layout, BLOCK_T, STAGES,
            )  # fmt: skip
        acc_b = warpgroup_mma_wait(num_outstanding=0, deps=[acc_b])  # the group's last tile
        m, l_tok, l_end, l_doc, f_tok, f_end, f_doc, num_finished = _retire(
            acc_b, base + GROUP - 1, tiles, total, m, l_tok, l_end, l_doc, f_tok, f_end, f_doc, d_desc,
            d_smem, ready, d_off_ptr, num_docs, finished, num_finished, col_layout, BLOCK_T, STAGES,
        )  # fmt: skip
        # the group's finished documents: partial score = pairwise sum of the row maxima (the barrier: a
        # row's copies across a quad may have been written by one of its threads)
        if num_finished > 0:
            gl.thread_barrier()
        for x in range(num_finished):
            row_max = finished.index(x).load(row_layout)
            part = _pairwise_row_sum(gl.where(row_ok, row_max, 0.0), BLOCK_Q, pair_layout)
            gl.store(out_ptr + out_row + first_doc + x, part)
        num_finished = 0

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


def supports(queries: torch.Tensor, docs: torch.Tensor, return_argmax: bool) -> bool:
    """Whether this kernel takes a long-query all-pairs problem (see the module docstring)."""
    return (
        not return_argmax
        and docs.dtype in (torch.float16, torch.bfloat16)
        and queries.dtype == docs.dtype
        and docs.shape[1] == 128  # the dim tested (64 builds for sm_90; 256 spills there)
        and docs.shape[0] < 2**31  # TMA coordinates are int32
        and docs.stride(1) == 1
        and docs.data_ptr() % 16 == 0
        and (docs.stride(0) * docs.element_size()) % 16 == 0
        and hopper_device(docs.device)
    )


# Tuning (ColPali: 1 query x 1024 tokens x 1000 documents of 1024, fp16, dim 128; the alternatives, run by
# run: docs/kernel-notes.md, "Version 7 (this code): the query in registers, persistent runs of
# documents"). A ring of 5: 0.438-0.449 ms against 0.462 for 4; groups of 8: 0.434 against 0.439 for 16,
# whose first call took 5.9 s.
BLOCK_T, STAGES, GROUP, NUM_WARPS = 64, 5, 8, 4
# A program takes 239 registers x 128 threads and 90.6 KB of shared memory (sm_90 build): two fit an SM.
PROGRAMS_PER_SM = 2
# A program's start (query load, ring fill) in documents' worth of time: 2 documents a program lost
# 7-9% against 31, part of it waves (16 against 1; the same runs).
PROGRAM_START_DOCS = 0.25

_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


@functools.cache
def _tile_layout(block_t: int, dim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout (swizzle) of a document tile, as TMA writes it and wgmma reads it."""
    return gl.NVMMASharedLayout.get_default_for([block_t, dim], _GL_DTYPES[dtype])


@dataclass(frozen=True)
class LongLaunch:
    """A launch of `_maxsim_long_kernel` with the call signature of `launch.KernelLaunch` as the forward
    plans use it: (queries, query offsets, docs, doc offsets, scores, unused argmax, *ints), where ints are
    (num_queries, num_docs, num_chunks, docs_per_prog, stride_q). The TMA descriptor of the documents is
    made at each call (it holds their address)."""

    grid: tuple[int]

    def __call__(self, queries, q_off, docs, d_off, scores, _argmax, *ints) -> None:
        dim = docs.shape[1]
        desc = TensorDescriptor.from_tensor(docs, [BLOCK_T, dim], _tile_layout(BLOCK_T, dim, docs.dtype))
        _maxsim_long_kernel[self.grid](
            queries, q_off, desc, d_off, scores, *ints,
            DIM=dim, BLOCK_T=BLOCK_T, STAGES=STAGES, GROUP=GROUP, num_warps=NUM_WARPS,
        )  # fmt: skip
