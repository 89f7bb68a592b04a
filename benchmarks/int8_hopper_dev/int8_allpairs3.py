"""int8 all-pairs Gluon kernel, version 2: a precomputed tile table, masking by an additive bias, int32
bookkeeping. Prototype."""

from __future__ import annotations

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

MAGIC_BITS = gl.constexpr(0x4B400000)  # bits of 1.5 * 2^23
MAGIC_FLOAT = gl.constexpr(12582912.0)
ENDS_DOC = gl.constexpr(256)  # tile_info bit: the tile is its document's last


@gluon.jit
def _request(d_desc, d_smem, s_desc, s_smem, ready, slot: gl.constexpr, tok):
    """TMA of a tile (starting at token `tok`) and its scales into ring slot `slot`."""
    mbarrier.expect(ready.index(slot), d_desc.block_type.nbytes + s_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(d_desc, [tok, 0], ready.index(slot), d_smem.index(slot))
    # TMA needs the innermost coordinate 16-byte aligned: row r of the scale table holds the scales shifted
    # by r, so the tile at `tok` reads row tok % 4 from the aligned column tok - tok % 4
    shift = tok % 4
    tma.async_copy_global_to_shared(s_desc, [shift, tok - shift], ready.index(slot), s_smem.index(slot))


@gluon.jit
def _product(q_rows, d_smem, ready, x, zero, STAGES: gl.constexpr, slot: gl.constexpr):
    mbarrier.wait(ready.index(slot), (x // STAGES) & 1)
    return warpgroup_mma(q_rows, d_smem.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _retire(acc, scale, t, total, tiles, m, req_tok, info, finished, num_finished, tile_tok_ptr, tile_info_ptr,
            t0, d_desc, d_smem, s_desc, s_smem, ready, col_layout: gl.constexpr, BLOCK_T: gl.constexpr,
            STAGES: gl.constexpr, J: gl.constexpr):  # fmt: skip
    """Fold tile t (its product `acc`, its scales `scale`, its table entry `info`), refill the ring slot of
    tile t - 2 with tile t - 2 + STAGES (whose start token `req_tok` was loaded one tile ago), and load the
    next entries."""
    if t >= 2:
        if t - 2 + STAGES < tiles:
            _request(d_desc, d_smem, s_desc, s_smem, ready, (J + STAGES - 2) % STAGES, req_tok)
    nxt = t - 1 + STAGES
    req_tok = gl.load(tile_tok_ptr + t0 + nxt, mask=nxt < total, other=0)
    if t < total:
        cols = gl.arange(0, BLOCK_T, layout=col_layout)
        bias = gl.where(cols < (info & 255), 0.0, float("-inf"))
        v = gl.fma(
            (acc + MAGIC_BITS).to(gl.float32, bitcast=True) - MAGIC_FLOAT, scale[None, :], bias[None, :]
        )
        m = gl.maximum(m, gl.max(v, axis=1))
        if info >= ENDS_DOC:
            finished.index(num_finished).store(m)
            num_finished += 1
            m = gl.full(m.shape, float("-inf"), gl.float32, m.type.layout)
    info = gl.load(tile_info_ptr + t0 + t + 1, mask=t + 1 < total, other=0)
    return m, req_tok, info, num_finished


@gluon.jit
def _scales(
    s_smem, slot: gl.constexpr, col_layout: gl.constexpr, STAGES: gl.constexpr, BLOCK_T: gl.constexpr
):
    flat = s_smem._reinterpret(gl.float32, [STAGES, BLOCK_T], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    return flat.index(slot).load(col_layout)


@gluon.jit(do_not_specialize=["num_queries", "num_docs", "num_groups", "docs_per_prog"])
def _int8_allpairs_kernel(
    q_ptr, qs_ptr, q_off_ptr, d_desc, s_desc, tile_tok_ptr, tile_info_ptr, doc_tile_ptr, out_ptr,
    num_queries, num_docs, num_groups, docs_per_prog, stride_q,
    DIM: gl.constexpr, BLOCK_T: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr,
    QPG: gl.constexpr,
):  # fmt: skip
    BLOCK_Q: gl.constexpr = 128
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

    q_tok = row_first + gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, q_layout))
    k = gl.arange(0, DIM, layout=gl.SliceLayout(0, q_layout))
    q_rows = gl.load(q_ptr + q_tok.to(gl.int64)[:, None] * stride_q + k[None, :],
                     mask=(q_tok < row_last)[:, None], other=0)  # fmt: skip

    d_smem = gl.allocate_shared_memory(d_desc.dtype, [STAGES, BLOCK_T, DIM], d_desc.layout)
    s_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_T], s_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    finished = gl.allocate_shared_memory(gl.float32, [GROUP, BLOCK_Q], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()

    t0 = gl.load(doc_tile_ptr + d0)
    total = gl.load(doc_tile_ptr + d1) - t0
    gl.static_assert(GROUP % STAGES == 0, "ring slots are static: GROUP must be a multiple of STAGES")
    tiles = gl.cdiv(total, GROUP) * GROUP
    for i in gl.static_range(STAGES):
        if i < tiles:
            tok = gl.load(tile_tok_ptr + t0 + i, mask=i < total, other=0)
            _request(d_desc, d_smem, s_desc, s_smem, ready, i, tok)
    req_tok = gl.load(tile_tok_ptr + t0 + STAGES, mask=STAGES < total, other=0)
    info = gl.load(tile_info_ptr + t0)

    m = gl.full([BLOCK_Q], float("-inf"), gl.float32, row_layout)
    zero = gl.zeros([BLOCK_Q, BLOCK_T], gl.int32, acc_layout)
    num_finished = 0
    f_doc = d0
    for base in range(0, tiles, GROUP):
        acc_a = _product(q_rows, d_smem, ready, base, zero, STAGES, 0)
        acc_b = _product(q_rows, d_smem, ready, base + 1, zero, STAGES, 1)
        scale = _scales(s_smem, 0, col_layout, STAGES, BLOCK_T)
        acc_b, acc_a = warpgroup_mma_wait(num_outstanding=1, deps=[acc_b, acc_a])
        m, req_tok, info, num_finished = _retire(
            acc_a, scale, base, total, tiles, m, req_tok, info, finished, num_finished, tile_tok_ptr,
            tile_info_ptr, t0, d_desc, d_smem, s_desc, s_smem, ready, col_layout, BLOCK_T, STAGES, 0,
        )  # fmt: skip
        for j in gl.static_range(2, GROUP, 2):
            acc_a = _product(q_rows, d_smem, ready, base + j, zero, STAGES, j % STAGES)
            scale = _scales(s_smem, (j - 1) % STAGES, col_layout, STAGES, BLOCK_T)
            acc_a, acc_b = warpgroup_mma_wait(num_outstanding=1, deps=[acc_a, acc_b])
            m, req_tok, info, num_finished = _retire(
                acc_b, scale, base + j - 1, total, tiles, m, req_tok, info, finished, num_finished,
                tile_tok_ptr, tile_info_ptr, t0, d_desc, d_smem, s_desc, s_smem, ready, col_layout, BLOCK_T,
                STAGES, j - 1,
            )  # fmt: skip
            acc_b = _product(q_rows, d_smem, ready, base + j + 1, zero, STAGES, (j + 1) % STAGES)
            scale = _scales(s_smem, j % STAGES, col_layout, STAGES, BLOCK_T)
            acc_b, acc_a = warpgroup_mma_wait(num_outstanding=1, deps=[acc_b, acc_a])
            m, req_tok, info, num_finished = _retire(
                acc_a, scale, base + j, total, tiles, m, req_tok, info, finished, num_finished,
                tile_tok_ptr, tile_info_ptr, t0, d_desc, d_smem, s_desc, s_smem, ready, col_layout, BLOCK_T,
                STAGES, j,
            )  # fmt: skip
        scale = _scales(s_smem, (GROUP - 1) % STAGES, col_layout, STAGES, BLOCK_T)
        acc_b = warpgroup_mma_wait(num_outstanding=0, deps=[acc_b])
        m, req_tok, info, num_finished = _retire(
            acc_b, scale, base + GROUP - 1, total, tiles, m, req_tok, info, finished, num_finished,
            tile_tok_ptr, tile_info_ptr, t0, d_desc, d_smem, s_desc, s_smem, ready, col_layout, BLOCK_T,
            STAGES, GROUP - 1,
        )  # fmt: skip
        if num_finished > 0:
            gl.thread_barrier()
            # [GROUP docs, 128 rows] with whole rows in one warp: the per-query sums are warp shuffles
            fl: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
            rows = row_first + gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(0, fl))
            row_ok = rows < row_last
            sq = gl.load(qs_ptr + rows, mask=row_ok, other=0.0)
            local = gl.zeros([BLOCK_Q], gl.int32, gl.SliceLayout(0, fl))
            for kq in gl.static_range(QPG - 1):
                end_k = gl.load(q_off_ptr + gl.minimum(q_first + 1 + kq, q_last))
                local += (rows >= end_k).to(gl.int32)
            flat = finished._reinterpret(
                gl.float32, [GROUP, BLOCK_Q], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
            )
            contrib = gl.where(row_ok[None, :], sq[None, :] * flat.load(fl), 0.0)
            xs = gl.arange(0, GROUP, layout=gl.SliceLayout(1, fl))
            for kq in gl.static_range(QPG):
                part = gl.sum(gl.where((local == kq)[None, :], contrib, 0.0), axis=1)
                dst = (q_first + kq).to(gl.int64) * num_docs + f_doc + xs
                gl.store(out_ptr + dst, part, mask=(xs < num_finished) & (q_first + kq < q_last))
            f_doc += num_finished
            num_finished = 0
            gl.thread_barrier()  # the next group overwrites `finished`

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


def tile_table(d_off: torch.Tensor, block_t: int = 64):
    """(tile_tok int32 [n_tiles], tile_info int32 [n_tiles], doc_tile int32 [nd + 1]) on d_off's device:
    every document's tiles of block_t tokens (one empty tile for an empty document) in order."""
    lens = d_off[1:] - d_off[:-1]
    per_doc = torch.clamp((lens + block_t - 1) // block_t, min=1)
    doc_tile = torch.zeros(len(lens) + 1, dtype=torch.int64, device=d_off.device)
    doc_tile[1:] = per_doc.cumsum(0)
    n = int(doc_tile[-1])
    doc_of = torch.repeat_interleave(torch.arange(len(lens), device=d_off.device), per_doc, output_size=n)
    k = torch.arange(n, device=d_off.device) - doc_tile[doc_of]
    tok = d_off[doc_of] + k * block_t
    valid = torch.clamp(lens[doc_of] - k * block_t, 0, block_t)
    ends = (k == per_doc[doc_of] - 1).to(torch.int64) * 256
    return tok.to(torch.int32), (valid + ends).to(torch.int32), doc_tile.to(torch.int32)


def scale_table(sd: torch.Tensor) -> torch.Tensor:
    """[4, T'] fp32: row r holds the scales from token r on (TMA reads 16-byte aligned columns only)."""
    t = sd.shape[0]
    table = torch.zeros((4, -(-(t + 4) // 4) * 4), dtype=torch.float32, device=sd.device)
    for r in range(4):
        table[r, : max(t - r, 0)] = sd[r:]
    return table


def launcher(q8, sq, q_off, d8, sd, d_off, stages=4, group=8, per_prog=None, slots=None):
    from maxsim_kernels import maxsim_forward as fwd

    dev = d8.device
    lens = q_off[1:] - q_off[:-1]
    nq, nd = len(lens), len(d_off) - 1
    qpg = max(1, 128 // int(lens.max()))
    groups = -(-nq // qpg)
    if per_prog is None:
        slots = slots or 2 * torch.cuda.get_device_properties(dev).multi_processor_count
        per_prog = fwd.persistent_docs_per_program(groups, nd, slots, 0.25)
    grid = (groups * -(-nd // per_prog),)
    q_off32 = q_off.to(dev, torch.int32)
    tile_tok, tile_info, doc_tile = tile_table(d_off.to(dev))
    table = scale_table(sd)
    dl = gl.NVMMASharedLayout.get_default_for([64, d8.shape[1]], gl.int8)
    sl = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    d_desc = TensorDescriptor.from_tensor(d8, [64, d8.shape[1]], dl)
    s_desc = TensorDescriptor.from_tensor(table, [1, 64], sl)

    def run():
        out = torch.empty((nq, nd), dtype=torch.float32, device=dev)
        _int8_allpairs_kernel[grid](
            q8,
            sq,
            q_off32,
            d_desc,
            s_desc,
            tile_tok,
            tile_info,
            doc_tile,
            out,
            nq,
            nd,
            groups,
            per_prog,
            q8.stride(0),
            DIM=d8.shape[1],
            BLOCK_T=64,
            STAGES=stages,
            GROUP=group,
            QPG=qpg,
            num_warps=4,
        )
        return out

    return run
