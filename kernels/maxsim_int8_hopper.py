"""INT8 x INT8 MaxSim, all pairs, on Hopper (sm_90), in Gluon: the int8 product of one document tile runs
on the tensor cores while the previous tile's products are scaled and folded into the row maxima.

    acc[i, j]   = sum_k q8[i, k] * d8[j, k]                 (int32, exact)
    score(q, d) = sum_{i in q} s_q[i] * max_{j in d} (s_d[j] * acc[i, j])

the math of `maxsim_int8` (its docstring): each `s_d[j] * acc[i, j]` is one fp32 product of the exact
integer and the fp32 scale, so the row maxima are bit for bit those of the Triton kernel and of the float64
reference with `round_products`; the query-scale products and the sum over a query's rows are fp32 and
differ from the Triton kernel's only by the order of the additions.

Scope: `maxsim_varlen_int8` on an sm_90 GPU with the Triton release the kernel was built with, scores
only, dim 128, offsets given on the host (the plan reads the query lengths and the documents' tile counts
without synchronising with the device), queries of at most 128 tokens, and enough query groups to keep
the tensor cores busy (`MIN_GROUPS`). Everything else keeps the Triton kernels of `maxsim_int8`.

Per program (one warp group):

- a group of QPG consecutive queries, at most 128 rows (QPG = 128 // the longest query, at most
  MAX_QPG), is loaded once into registers as wgmma's int8 A operand;
- the program walks a run of consecutive documents tile by tile, BLOCK_T tokens a tile, each document's
  first tile at its first token. The walk is a table made on the host (each tile's first token and
  whether it ends its document) and the tiles' scales a table on the device, one row of BLOCK_T fp32 per
  tile with NaN past the document's end (`tile_scales`): the kernel needs no mask, since a NaN product is
  ignored by max;
- tiles and their scale rows arrive by TMA in a ring of STAGES buffers. Tile t's product
  Q8 . D8_t^T (int32) is issued asynchronously; while it runs, tile t - 1's products are converted,
  scaled and folded into the running row maxima;
- the int32 -> fp32 conversion is the conversion instruction (I2FP.F32.S32 in the sm_90 build; exact,
  |acc| < 2^24): per product element three instructions, the conversion, the scale product and the
  max. The accumulator-bias conversion of `maxsim_int8` (add the bits of 1.5 * 2^23, subtract 1.5 *
  2^23 as a float) takes two instructions for the first and was 5% slower here (`I2F_TILES`);
- at a document's last tile the 128 row maxima go to shared memory. At the end of each group of GROUP
  tiles, every finished document gets one sum per query of the group (the query scales applied).

Why a TMA row of scales per tile rather than one per token: TMA needs the innermost coordinate of a copy
16-byte aligned, so a 64-scale copy can start only at a token that is a multiple of 4 (an unaligned one
stops the kernel with an illegal instruction).

Cost (the exhaustive workload of `benchmarks/bench_int8.py`: 512 queries of 32 tokens x 50K documents of
20-300 tokens): 2 * 128 * 128 * 64 int8 operations a tile, 19.2M tiles; the tensor cores need 256 cycles
a tile an SM at 4096 int8 MAC/clock, 17 ms for the workload at the datasheet's 1979 TOPS. The loop is
issue-bound instead: in the exploration's profiles a warp issued 445 instructions a tile (275 of them the
then four per element) at 2.34 of 4 instructions a clock an SM (two programs an SM, 232 registers a
thread here). Measured 54.2-54.4 ms against 57.0-57.4 with the bias conversion and the fp16 kernel's
80.9-84.3 ms in the same processes (docs/benchmarks.md, INT8; docs/kernel-notes.md, the int8 Gluon
kernel).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .launch import hopper_device
from .maxsim_forward_hopper import issue_product
from .validation import cdiv, host_to_device, memo

# Tuning (the exhaustive workload above; the alternatives: docs/kernel-notes.md, "The int8 Gluon kernel:
# all pairs on Hopper"): a ring of 4 tiles 57.1 ms against 63.4 for 5 and 60.0 for 6; groups of 16 as 8.
BLOCK_Q = 128  # query rows a program (one warp group: two m64 wgmma rows)
BLOCK_T = 64  # document tokens a tile
STAGES = 4
GROUP = 8
NUM_WARPS = 4
MAX_QPG = 16  # queries a group at most (the per-query sums are unrolled over the group)
PROGRAMS_PER_SM = 2  # 232 registers x 128 threads, 46 KB of shared memory (sm_90 build)
PROGRAM_START_DOCS = 0.25  # as the fp16 Hopper kernel: a program's start in documents' worth of time
# One group of 128 rows leaves the shape bound by HBM, where the Triton kernel's tiles are faster; from
# two groups on this kernel is: 4 queries (one group) 1.21 ms against the Triton kernel's 0.80.
MIN_GROUPS = 2
# Which tiles convert their products by the conversion instruction (one instruction) instead of the
# accumulator-bias bits (two): 0 none, 1 every other tile, 2 all. 512 queries x 50K documents: 54.2-54.4
# ms (2) against 56.2-56.6 (1) and 57.0-57.4 (0), the same bits (docs/kernel-notes.md, "INT8: what
# limits it").
I2F_TILES = 2

_MAGIC_BITS = gl.constexpr(0x4B400000)  # bits of 1.5 * 2^23
_MAGIC_FLOAT = gl.constexpr(12582912.0)  # 1.5 * 2^23
_ENDS_DOC = 1  # tile_ends value of a document's last tile


@gluon.jit
def _request(d_desc, d_smem, s_desc, s_smem, ready, x, tok, row, STAGES: gl.constexpr):
    """TMA of tile x (its first token `tok`, its scales row `row` of the tile scales) into ring slot
    x % STAGES."""
    slot = x % STAGES
    mbarrier.expect(ready.index(slot), d_desc.block_type.nbytes + s_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(d_desc, [tok, 0], ready.index(slot), d_smem.index(slot))
    tma.async_copy_global_to_shared(s_desc, [row, 0], ready.index(slot), s_smem.index(slot))


@gluon.jit
def _scales(s_smem, x, col_layout: gl.constexpr, STAGES: gl.constexpr, BLOCK_T: gl.constexpr):
    flat = s_smem._reinterpret(gl.float32, [STAGES, BLOCK_T], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    return flat.index(x % STAGES).load(col_layout)


@gluon.jit
def _retire(acc, scale, t, total, tiles, m, tok_a, tok_b, ends, finished, num_finished, tile_tok_ptr,
            tile_ends_ptr, t0, d_desc, d_smem, s_desc, s_smem, ready, STAGES: gl.constexpr,
            I2F: gl.constexpr):  # fmt: skip
    """Tile t's product is done: refill the ring slot of tile t - 2 with tile t - 2 + STAGES (its first
    token `tok_a`, loaded two tiles ago), fold tile t into the row maxima `m` (parking them in `finished`
    at its document's end), and load the table entries of later tiles. I2F: the products converted by
    the conversion instruction instead of the accumulator-bias bits (both exact here)."""
    r = t - 2 + STAGES
    # every warp has read tile t - 2's scales: tile t's product being done means every warp has issued it,
    # which each does after retiring tile t - 2
    if t >= 2:
        if r < tiles:
            _request(d_desc, d_smem, s_desc, s_smem, ready, r, tok_a, gl.where(r < total, t0 + r, 0), STAGES)
    tok_a = tok_b
    tok_b = gl.load(tile_tok_ptr + t0 + r + 2, mask=r + 2 < total, other=0)
    if t < total:
        # columns past the document have NaN scales: NaN products, which max ignores
        if I2F:
            exact = acc.to(gl.float32)
        else:
            exact = (acc + _MAGIC_BITS).to(gl.float32, bitcast=True) - _MAGIC_FLOAT
        v = exact * scale[None, :]
        m = gl.maximum(m, gl.max(v, axis=1))
        if ends != 0:
            finished.index(num_finished).store(m)
            num_finished += 1
            m = gl.full(m.shape, float("-inf"), gl.float32, m.type.layout)
    ends = gl.load(tile_ends_ptr + t0 + t + 1, mask=t + 1 < total, other=0)
    return m, tok_a, tok_b, ends, num_finished


@gluon.jit(do_not_specialize=["num_queries", "num_docs", "num_groups", "docs_per_prog"])
def _int8_allpairs_kernel(
    q_ptr, qs_ptr, q_off_ptr, d_desc, s_desc, tile_tok_ptr, tile_ends_ptr, doc_tile_ptr, out_ptr,
    num_queries, num_docs, num_groups, docs_per_prog, stride_q,
    DIM: gl.constexpr, BLOCK_T: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr,
    QPG: gl.constexpr, I2F_TILES: gl.constexpr,
):  # fmt: skip
    """Program pid: query group pid % num_groups (queries QPG * g ...), documents
    [(pid // num_groups) * docs_per_prog, + docs_per_prog). q_off int32 [nq + 1]; the tile table
    (tile_tok, tile_ends int32 [n_tiles], doc_tile int32 [nd + 1]) as `tile_table` makes it; d_desc the
    int8 documents [Td, DIM] in [BLOCK_T, DIM] tiles; s_desc the tile scales [n_tiles, BLOCK_T]."""
    BLOCK_Q: gl.constexpr = 128
    I2F_A: gl.constexpr = I2F_TILES == 2  # the conversion of the tiles folded from acc_a, acc_b
    I2F_B: gl.constexpr = I2F_TILES >= 1
    pid = gl.program_id(0)
    grp = pid % num_groups
    d0 = (pid // num_groups) * docs_per_prog
    d1 = gl.minimum(d0 + docs_per_prog, num_docs)
    q_first = grp * QPG
    q_last = gl.minimum(q_first + QPG, num_queries)
    row_first = gl.load(q_off_ptr + q_first)
    row_last = gl.load(q_off_ptr + q_last)

    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_T, 32]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=4)
    # [GROUP documents, 128 rows] with whole rows in one warp: the per-query sums are warp shuffles
    sums_layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    q_tok = row_first + gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, q_layout))
    k = gl.arange(0, DIM, layout=gl.SliceLayout(0, q_layout))
    q_rows = gl.load(q_ptr + q_tok.to(gl.int64)[:, None] * stride_q + k[None, :],
                     mask=(q_tok < row_last)[:, None], other=0)  # fmt: skip

    # per query row: its scale and its query within the group (-1 past the group's rows), for the sums
    row_sq = gl.allocate_shared_memory(gl.float32, [BLOCK_Q], plain)
    row_query = gl.allocate_shared_memory(gl.int32, [BLOCK_Q], plain)
    rows = row_first + gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(0, sums_layout))
    row_ok = rows < row_last
    local = gl.zeros([BLOCK_Q], gl.int32, gl.SliceLayout(0, sums_layout))
    for kq in gl.static_range(QPG - 1):
        local += (rows >= gl.load(q_off_ptr + gl.minimum(q_first + 1 + kq, q_last))).to(gl.int32)
    row_sq.store(gl.load(qs_ptr + rows, mask=row_ok, other=0.0))
    row_query.store(gl.where(row_ok, local, -1))

    d_smem = gl.allocate_shared_memory(d_desc.dtype, [STAGES, BLOCK_T, DIM], d_desc.layout)
    s_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_T], s_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    finished = gl.allocate_shared_memory(gl.float32, [GROUP, BLOCK_Q], plain)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()

    t0 = gl.load(doc_tile_ptr + d0)
    total = gl.load(doc_tile_ptr + d1) - t0
    tiles = gl.cdiv(total, GROUP) * GROUP  # padding tiles (past `total`) are loaded and not folded
    for i in gl.static_range(STAGES):
        if i < tiles:
            tok = gl.load(tile_tok_ptr + t0 + i, mask=i < total, other=0)
            _request(d_desc, d_smem, s_desc, s_smem, ready, i, tok, gl.where(i < total, t0 + i, 0), STAGES)
    tok_a = 0
    tok_b = gl.load(tile_tok_ptr + t0 + STAGES, mask=STAGES < total, other=0)
    ends = gl.load(tile_ends_ptr + t0)

    m = gl.full([BLOCK_Q], float("-inf"), gl.float32, row_layout)
    zero = gl.zeros([BLOCK_Q, BLOCK_T], gl.int32, acc_layout)
    num_finished = 0
    first_doc = d0
    for base in range(0, tiles, GROUP):
        # two products in flight: tile x + 1's is issued before tile x's is folded
        acc_a = issue_product(q_rows, d_smem, ready, base, zero, STAGES)
        acc_b = issue_product(q_rows, d_smem, ready, base + 1, zero, STAGES)
        scale = _scales(s_smem, base, col_layout, STAGES, BLOCK_T)
        acc_b, acc_a = warpgroup_mma_wait(num_outstanding=1, deps=[acc_b, acc_a])
        m, tok_a, tok_b, ends, num_finished = _retire(
            acc_a, scale, base, total, tiles, m, tok_a, tok_b, ends, finished, num_finished, tile_tok_ptr,
            tile_ends_ptr, t0, d_desc, d_smem, s_desc, s_smem, ready, STAGES, I2F_A,
        )  # fmt: skip
        for j in gl.static_range(2, GROUP, 2):
            acc_a = issue_product(q_rows, d_smem, ready, base + j, zero, STAGES)
            scale = _scales(s_smem, base + j - 1, col_layout, STAGES, BLOCK_T)
            acc_a, acc_b = warpgroup_mma_wait(num_outstanding=1, deps=[acc_a, acc_b])
            m, tok_a, tok_b, ends, num_finished = _retire(
                acc_b, scale, base + j - 1, total, tiles, m, tok_a, tok_b, ends, finished, num_finished,
                tile_tok_ptr, tile_ends_ptr, t0, d_desc, d_smem, s_desc, s_smem, ready, STAGES, I2F_B,
            )  # fmt: skip
            acc_b = issue_product(q_rows, d_smem, ready, base + j + 1, zero, STAGES)
            scale = _scales(s_smem, base + j, col_layout, STAGES, BLOCK_T)
            acc_b, acc_a = warpgroup_mma_wait(num_outstanding=1, deps=[acc_b, acc_a])
            m, tok_a, tok_b, ends, num_finished = _retire(
                acc_a, scale, base + j, total, tiles, m, tok_a, tok_b, ends, finished, num_finished,
                tile_tok_ptr, tile_ends_ptr, t0, d_desc, d_smem, s_desc, s_smem, ready, STAGES, I2F_A,
            )  # fmt: skip
        scale = _scales(s_smem, base + GROUP - 1, col_layout, STAGES, BLOCK_T)
        acc_b = warpgroup_mma_wait(num_outstanding=0, deps=[acc_b])
        m, tok_a, tok_b, ends, num_finished = _retire(
            acc_b, scale, base + GROUP - 1, total, tiles, m, tok_a, tok_b, ends, finished, num_finished,
            tile_tok_ptr, tile_ends_ptr, t0, d_desc, d_smem, s_desc, s_smem, ready, STAGES, I2F_B,
        )  # fmt: skip
        if num_finished > 0:
            gl.thread_barrier()
            sq = row_sq.load(gl.SliceLayout(0, sums_layout))
            local = row_query.load(gl.SliceLayout(0, sums_layout))
            by_row: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
            flat = finished._reinterpret(gl.float32, [GROUP, BLOCK_Q], by_row)
            # rows past the group give NaN (0 * -inf) or 0 here and are never selected below
            contrib = sq[None, :] * flat.load(sums_layout)
            xs = gl.arange(0, GROUP, layout=gl.SliceLayout(1, sums_layout))
            for kq in gl.static_range(QPG):
                part = gl.sum(gl.where((local == kq)[None, :], contrib, 0.0), axis=1)
                dst = (q_first + kq).to(gl.int64) * num_docs + first_doc + xs
                gl.store(out_ptr + dst, part, mask=(xs < num_finished) & (q_first + kq < q_last))
            first_doc += num_finished
            num_finished = 0
            gl.thread_barrier()  # the next group overwrites `finished`

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------


def tile_table(doc_offsets: np.ndarray, block_t: int = BLOCK_T) -> tuple[np.ndarray, ...]:
    """The documents' tiles in order, from host offsets (int64 [nd + 1]): (first token [n_tiles], 1 where
    the tile is its document's last else 0 [n_tiles], each document's first tile [nd + 1], tokens of the
    tile inside its document [n_tiles]), int32 numpy arrays; an empty document has one tile."""
    lens = np.diff(doc_offsets)
    per_doc = np.maximum((lens + block_t - 1) // block_t, 1)
    doc_tile = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(per_doc, out=doc_tile[1:])
    doc_of = np.repeat(np.arange(len(lens)), per_doc)
    k = np.arange(int(doc_tile[-1])) - doc_tile[doc_of]
    first = doc_offsets[doc_of] + k * block_t
    inside = np.clip(lens[doc_of] - k * block_t, 0, block_t)
    ends = k == per_doc[doc_of] - 1
    return tuple(a.astype(np.int32) for a in (first, ends, doc_tile, inside))


_TABLE_DOCS = 1024  # documents a step of `_tile_table_kernel`


@triton.jit
def _tile_table_kernel(offsets_ptr, first_ptr, ends_ptr, doc_tile_ptr, inside_ptr, n_docs,
                       DOCS: tl.constexpr, BLOCK_T: tl.constexpr):  # fmt: skip
    """`tile_table` in one program: DOCS documents a step, each step's tile counts prefix-summed onto
    the running total, then each document's k-th tile written for k up to the step's largest count."""
    carry = tl.full([], 0, tl.int32)
    tl.store(doc_tile_ptr, carry)
    for start in range(0, n_docs, DOCS):
        d = start + tl.arange(0, DOCS)
        ok = d < n_docs
        lo = tl.load(offsets_ptr + d, mask=ok, other=0)
        lens = tl.load(offsets_ptr + d + 1, mask=ok, other=0) - lo
        per_doc = tl.where(ok, tl.maximum((lens + BLOCK_T - 1) // BLOCK_T, 1), 0).to(tl.int32)
        before = tl.cumsum(per_doc, 0) - per_doc + carry  # each document's first tile
        tl.store(doc_tile_ptr + d + 1, before + per_doc, mask=ok)
        for k in range(0, tl.max(per_doc, 0)):
            has = k < per_doc
            t = before + k
            tl.store(first_ptr + t, (lo + k * BLOCK_T).to(tl.int32), mask=has)
            inside = tl.minimum(tl.maximum(lens - k * BLOCK_T, 0), BLOCK_T)
            tl.store(inside_ptr + t, inside.to(tl.int32), mask=has)
            tl.store(ends_ptr + t, (k == per_doc - 1).to(tl.int32), mask=has)
        carry += tl.sum(per_doc, 0)


def tile_table_triton(
    doc_offsets: torch.Tensor, n_tiles: int, block_t: int = BLOCK_T
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tile_table` by one launch of `_tile_table_kernel` on the offsets' device (CUDA, or the CPU under
    TRITON_INTERPRET=1): the offsets int64 [nd + 1] there, `n_tiles` from the host offsets (so that
    nothing is read back from the device); int32 tensors."""
    nd = doc_offsets.numel() - 1
    device = doc_offsets.device
    first, ends, inside = (torch.empty(n_tiles, dtype=torch.int32, device=device) for _ in range(3))
    doc_tile = torch.empty(nd + 1, dtype=torch.int32, device=device)
    _tile_table_kernel[(1,)](
        doc_offsets, first, ends, doc_tile, inside, nd, DOCS=_TABLE_DOCS, BLOCK_T=block_t
    )
    return first, ends, doc_tile, inside


def device_tables(
    doc_offsets: np.ndarray, device_doc_offsets: torch.Tensor, doc_scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's tables on the scales' device, from the doc offsets on the host (numpy int64) and
    their device copy: (first token, ends, doc_tile) of `tile_table` and the tile scales (`tile_scales`).

    On CUDA the index tables are made on the device from the offsets' device copy (`tile_table_triton`,
    one launch). Elsewhere, and for an empty batch, they are made on the host (numpy) and travel in one
    copy that the host does not wait for (`host_to_device`), each part on a 16-byte boundary (the
    kernel's pointers stay aligned). On CUDA such a copy would run on the kernel's stream and hold the
    kernel behind the batch copies: int8 pass 0.383 s with device tables against 0.443 s with host ones
    (docs/kernel-notes.md, "The int8 Gluon kernel: all pairs on Hopper")."""
    if device_doc_offsets.is_cuda and len(doc_offsets) > 1:
        n_tiles = int(np.maximum((np.diff(doc_offsets) + BLOCK_T - 1) // BLOCK_T, 1).sum())
        first, ends, doc_tile, inside = tile_table_triton(device_doc_offsets, n_tiles)
        return first, ends, doc_tile, tile_scales(doc_scales, first, inside)
    parts = tile_table(doc_offsets)
    starts = np.cumsum([0] + [cdiv(len(a), 4) * 4 for a in parts])
    packed = np.zeros(int(starts[-1]), dtype=np.int32)
    for a, at in zip(parts, starts[:-1], strict=True):
        packed[at : at + len(a)] = a
    on_gpu = host_to_device(torch.from_numpy(packed), doc_scales.device)
    first, ends, doc_tile, inside = (on_gpu[a : a + len(p)] for a, p in zip(starts[:-1], parts, strict=True))
    return first, ends, doc_tile, tile_scales(doc_scales, first, inside)


def tile_scales(
    doc_scales: torch.Tensor, first: torch.Tensor, inside: torch.Tensor, block_t: int = BLOCK_T
) -> torch.Tensor:
    """[n_tiles, block_t] fp32 on the scales' device: each tile's token scales, NaN past its document.

    On CUDA one launch of `_tile_scales_kernel` instead of the seven torch operations below, which serve
    other devices: 0.67 ms of `launch_hopper` host time a call against 1.04 (docs/kernel-notes.md, "The
    int8 Gluon kernel: all pairs on Hopper")."""
    if doc_scales.is_cuda:
        return tile_scales_triton(doc_scales, first, inside, block_t)
    padded = torch.cat([doc_scales, doc_scales.new_zeros(block_t)])
    rows = padded.unfold(0, block_t, 1)[first.long()]  # row t: the block_t scales from token first[t] on
    cols = torch.arange(block_t, device=doc_scales.device)
    return rows.masked_fill_(cols[None, :] >= inside[:, None], float("nan"))


_SCALE_TILES = 16  # tiles a program of _tile_scales_kernel


@triton.jit
def _tile_scales_kernel(scales_ptr, first_ptr, inside_ptr, out_ptr, n_tiles, TILES: tl.constexpr,
                        BLOCK_T: tl.constexpr):  # fmt: skip
    """Rows t of the tile-scale table: scales[first[t] + c] for c < inside[t], NaN from there on."""
    t = tl.program_id(0) * TILES + tl.arange(0, TILES)
    t_ok = t < n_tiles
    first = tl.load(first_ptr + t, mask=t_ok, other=0).to(tl.int64)
    inside = tl.load(inside_ptr + t, mask=t_ok, other=0)
    cols = tl.arange(0, BLOCK_T)
    keep = cols[None, :] < inside[:, None]
    vals = tl.load(scales_ptr + first[:, None] + cols[None, :], mask=keep, other=float("nan"))
    tl.store(out_ptr + t.to(tl.int64)[:, None] * BLOCK_T + cols[None, :], vals, mask=t_ok[:, None])


def tile_scales_triton(
    doc_scales: torch.Tensor, first: torch.Tensor, inside: torch.Tensor, block_t: int = BLOCK_T
) -> torch.Tensor:
    """`tile_scales` by `_tile_scales_kernel` (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    n_tiles = first.numel()
    out = torch.empty((n_tiles, block_t), dtype=torch.float32, device=doc_scales.device)
    if n_tiles:
        grid = (cdiv(n_tiles, _SCALE_TILES),)
        _tile_scales_kernel[grid](
            doc_scales, first, inside, out, n_tiles, TILES=_SCALE_TILES, BLOCK_T=block_t
        )
    return out


def queries_per_group(max_query_len: int) -> int:
    return min(MAX_QPG, BLOCK_Q // max_query_len)


def supports(q_lens: np.ndarray, d8: torch.Tensor, return_argmax: bool) -> bool:
    """Whether this kernel takes an all-pairs problem (see the module docstring): `q_lens` the query
    lengths (host), `d8` the int8 documents."""
    if return_argmax or not len(q_lens) or d8.dim() != 2 or d8.shape[1] != 128:
        return False
    longest = int(q_lens.max())
    return (
        1 <= longest <= BLOCK_Q
        and cdiv(len(q_lens), queries_per_group(longest)) >= MIN_GROUPS
        and 0 < d8.shape[0] < 2**31 - BLOCK_T  # TMA coordinates and the tile table are int32
        and d8.stride(1) == 1
        and d8.stride(0) % 16 == 0
        and d8.data_ptr() % 16 == 0
        and hopper_device(d8.device)
    )


@functools.cache
def _smem_layouts(dim: int) -> tuple[gl.NVMMASharedLayout, gl.NVMMASharedLayout]:
    """Shared-memory layouts of the document tiles and of the scale rows (made once per dim)."""
    return (
        gl.NVMMASharedLayout.get_default_for([BLOCK_T, dim], gl.int8),
        gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2),
    )


def maxsim_int8_allpairs(
    q8: torch.Tensor,
    sq: torch.Tensor,
    q_off: torch.Tensor,
    d8: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    queries_a_group: int,
    docs_per_prog: int,
) -> torch.Tensor:
    """fp32 scores [nq, nd]: q8 int8 [Tq, 128] with scales sq fp32 [Tq], query offsets int64 [nq + 1] on
    the device (a copy from the host here would wait for the stream); d8 int8 [Td, 128]; `tables` =
    (tile_tok, tile_ends, doc_tile) on the device and the tile scales (`tile_scales`); `queries_a_group`
    from `queries_per_group`; `docs_per_prog` documents a program
    (`maxsim_forward.persistent_docs_per_program`)."""
    tile_tok, tile_ends, doc_tile, scales = tables
    nq, nd = q_off.numel() - 1, doc_tile.numel() - 1
    groups = cdiv(nq, queries_a_group)
    out = torch.empty((nq, nd), dtype=torch.float32, device=d8.device)
    d_layout, s_layout = _smem_layouts(d8.shape[1])
    d_desc = TensorDescriptor.from_tensor(d8, [BLOCK_T, d8.shape[1]], d_layout)
    s_desc = TensorDescriptor.from_tensor(scales, [1, BLOCK_T], s_layout)
    grid = (groups * cdiv(nd, docs_per_prog),)
    q_off32 = memo(q_off, "int32", lambda: q_off.to(torch.int32))  # the same for every document batch
    _int8_allpairs_kernel[grid](
        q8, sq, q_off32, d_desc, s_desc, tile_tok, tile_ends, doc_tile, out, nq, nd, groups,
        docs_per_prog, q8.stride(0), DIM=d8.shape[1], BLOCK_T=BLOCK_T, STAGES=STAGES, GROUP=GROUP,
        QPG=queries_a_group, I2F_TILES=I2F_TILES, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
