from __future__ import annotations

import os

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

SCALE_TMA = gl.constexpr(os.environ.get("I8_SCALE_TMA", "2") != "0")  # debug switches
SCALE_2D = gl.constexpr(os.environ.get("I8_SCALE_TMA", "2") == "2")  # scales as a [1, T] tensor
MAGIC = gl.constexpr(int(os.environ.get("I8_MAGIC", "1")))  # 0: int->float convert, 1: acc filled, 2: iadd
FLUSH = gl.constexpr(
    int(os.environ.get("I8_FLUSH", "1"))
)  # 0: per doc cross-warp sums, 1: warp-local, 2: none
EPI = gl.constexpr(os.environ.get("I8_EPI", "1") == "1")  # 0: no scale/max (timing the pipeline alone)
BLOCK_Q = gl.constexpr(128)  # query rows a program (one warp group: two m64 wgmma rows)


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
def _request_tile(d_desc, d_smem, s_desc, s_smem, ready, x, tok, STAGES: gl.constexpr):
    """TMA of the document tile starting at token `tok` (the program's tile x) and of its scales into
    buffer x % STAGES."""
    slot = x % STAGES
    if SCALE_TMA:
        mbarrier.expect(ready.index(slot), d_desc.block_type.nbytes + s_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(d_desc, [tok.to(gl.int32), 0], ready.index(slot), d_smem.index(slot))
        if SCALE_2D:
            # TMA needs the innermost coordinate 16-byte aligned: row r of the scale table holds the scales
            # shifted by r, so the tile at `tok` reads row tok % 4 from the aligned column tok - tok % 4
            shift = (tok % 4).to(gl.int32)
            tma.async_copy_global_to_shared(
                s_desc, [shift, tok.to(gl.int32) - shift], ready.index(slot), s_smem.index(slot)
            )
        else:
            tma.async_copy_global_to_shared(s_desc, [tok.to(gl.int32)], ready.index(slot), s_smem.index(slot))
    else:
        mbarrier.expect(ready.index(slot), d_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(d_desc, [tok.to(gl.int32), 0], ready.index(slot), d_smem.index(slot))


@gluon.jit
def _refill(
    d_desc,
    d_smem,
    s_desc,
    s_smem,
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
        _request_tile(d_desc, d_smem, s_desc, s_smem, ready, done + STAGES, tok, STAGES)
        tok, doc_end, doc = _advance(tok, doc_end, doc, d_off_ptr, num_docs, BLOCK_T)
    return tok, doc_end, doc


@gluon.jit
def _issue_product(q_rows, d_smem, ready, x, magic, STAGES: gl.constexpr):
    """Tile x's acc = MAGIC + Q8 . D8^T (int32), asynchronous."""
    slot = x % STAGES
    mbarrier.wait(ready.index(slot), (x // STAGES) & 1)
    return warpgroup_mma(q_rows, d_smem.index(slot).permute((1, 0)), magic, use_acc=MAGIC == 1, is_async=True)


MAGIC_BITS = gl.constexpr(0x4B400000)  # bits of 1.5 * 2^23
MAGIC_FLOAT = gl.constexpr(12582912.0)


@gluon.jit
def _fold(acc, scale, valid, m, tok, doc_end, doc, d_off_ptr, num_docs, finished, num_finished,
          col_layout: gl.constexpr, BLOCK_T: gl.constexpr):  # fmt: skip
    if valid:
        if EPI:
            if MAGIC == 1:
                v = (acc.to(gl.float32, bitcast=True) - MAGIC_FLOAT) * scale[None, :]
            elif MAGIC == 2:
                v = ((acc + MAGIC_BITS).to(gl.float32, bitcast=True) - MAGIC_FLOAT) * scale[None, :]
            else:
                v = acc.to(gl.float32) * scale[None, :]
            if tok + BLOCK_T > doc_end:
                cols = gl.arange(0, BLOCK_T, layout=col_layout)
                v = gl.where((cols < (doc_end - tok).to(gl.int32))[None, :], v, float("-inf"))
            m = gl.maximum(m, gl.max(v, axis=1))
        if tok + BLOCK_T >= doc_end:
            finished.index(num_finished).store(m)
            num_finished += 1
            m = gl.full(m.shape, float("-inf"), gl.float32, m.type.layout)
        tok, doc_end, doc = _advance(tok, doc_end, doc, d_off_ptr, num_docs, BLOCK_T)
    return m, tok, doc_end, doc, num_finished


@gluon.jit
def _retire(acc, done, tiles, total, m, l_tok, l_end, l_doc, f_tok, f_end, f_doc, d_desc, d_smem, s_desc,
            s_smem, ready, d_off_ptr, num_docs, finished, num_finished, col_layout: gl.constexpr,
            BLOCK_T: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    if SCALE_2D:
        flat = s_smem._reinterpret(gl.float32, [STAGES, BLOCK_T], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        scale = flat.index(done % STAGES).load(col_layout)
    elif SCALE_TMA:
        scale = s_smem.index(done % STAGES).load(col_layout)
    else:
        cols = gl.arange(0, BLOCK_T, layout=col_layout)
        scale = gl.load(s_desc + f_tok + cols, mask=cols < (f_end - f_tok).to(gl.int32), other=0.0)
    # refill the buffer of tile done - 2: every warp has read its scales (tile done's product being done
    # means every warp has issued it, which each does after retiring tile done - 2)
    if done >= 2:
        l_tok, l_end, l_doc = _refill(d_desc, d_smem, s_desc, s_smem, ready, done - 2, tiles, l_tok, l_end,
                                      l_doc, d_off_ptr, num_docs, BLOCK_T, STAGES)  # fmt: skip
    m, f_tok, f_end, f_doc, num_finished = _fold(acc, scale, done < total, m, f_tok, f_end, f_doc, d_off_ptr,
                                                 num_docs, finished, num_finished, col_layout, BLOCK_T)  # fmt: skip
    return m, l_tok, l_end, l_doc, f_tok, f_end, f_doc, num_finished


@gluon.jit(do_not_specialize=["num_queries", "num_docs", "num_groups", "docs_per_prog"])
def _int8_allpairs_kernel(
    q_ptr, qs_ptr, q_off_ptr, d_desc, s_desc, d_off_ptr, out_ptr,
    num_queries, num_docs, num_groups, docs_per_prog, stride_q,
    DIM: gl.constexpr, BLOCK_T: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr,
    QPG: gl.constexpr,
):  # fmt: skip
    BLOCK_Q: gl.constexpr = 128
    pid = gl.program_id(0).to(gl.int64)
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
    q_rows = gl.load(
        q_ptr + q_tok[:, None] * stride_q + k[None, :], mask=(q_tok < row_last)[:, None], other=0
    )

    d_smem = gl.allocate_shared_memory(d_desc.dtype, [STAGES, BLOCK_T, DIM], d_desc.layout)
    if SCALE_2D:
        s_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_T], s_desc.layout)
    elif SCALE_TMA:
        s_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_T], s_desc.layout)
    else:
        s_smem = gl.allocate_shared_memory(
            gl.float32, [STAGES, BLOCK_T], gl.SwizzledSharedLayout(1, 1, 1, [0])
        )
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    finished = gl.allocate_shared_memory(gl.float32, [GROUP, BLOCK_Q], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()

    total = 0
    for dd in range(d0, d1):
        n = gl.load(d_off_ptr + dd + 1) - gl.load(d_off_ptr + dd)
        total += gl.maximum(gl.cdiv(n, BLOCK_T), 1).to(gl.int32)
    tiles = gl.cdiv(total, GROUP) * GROUP

    l_tok = gl.load(d_off_ptr + d0)
    l_end = gl.load(d_off_ptr + d0 + 1)
    l_doc = d0
    for i in gl.static_range(STAGES):
        if i < tiles:
            _request_tile(d_desc, d_smem, s_desc, s_smem, ready, i, l_tok, STAGES)
            l_tok, l_end, l_doc = _advance(l_tok, l_end, l_doc, d_off_ptr, num_docs, BLOCK_T)

    f_tok = gl.load(d_off_ptr + d0)
    f_end = gl.load(d_off_ptr + d0 + 1)
    f_doc = d0
    m = gl.full([BLOCK_Q], float("-inf"), gl.float32, row_layout)
    magic = gl.full([BLOCK_Q, BLOCK_T], MAGIC_BITS, gl.int32, acc_layout)
    num_finished = 0
    for base in range(0, tiles, GROUP):
        first_doc = f_doc
        acc_a = _issue_product(q_rows, d_smem, ready, base, magic, STAGES)
        acc_a = warpgroup_mma_wait(num_outstanding=1, deps=[acc_a])
        acc_b = _issue_product(q_rows, d_smem, ready, base + 1, magic, STAGES)
        acc_b, acc_a = warpgroup_mma_wait(num_outstanding=1, deps=[acc_b, acc_a])
        m, l_tok, l_end, l_doc, f_tok, f_end, f_doc, num_finished = _retire(
            acc_a, base, tiles, total, m, l_tok, l_end, l_doc, f_tok, f_end, f_doc, d_desc, d_smem, s_desc,
            s_smem, ready, d_off_ptr, num_docs, finished, num_finished, col_layout, BLOCK_T, STAGES,
        )  # fmt: skip
        for j in gl.static_range(2, GROUP, 2):
            acc_a = _issue_product(q_rows, d_smem, ready, base + j, magic, STAGES)
            acc_a, acc_b = warpgroup_mma_wait(num_outstanding=1, deps=[acc_a, acc_b])
            m, l_tok, l_end, l_doc, f_tok, f_end, f_doc, num_finished = _retire(
                acc_b, base + j - 1, tiles, total, m, l_tok, l_end, l_doc, f_tok, f_end, f_doc, d_desc,
                d_smem, s_desc, s_smem, ready, d_off_ptr, num_docs, finished, num_finished, col_layout,
                BLOCK_T, STAGES,
            )  # fmt: skip
            acc_b = _issue_product(q_rows, d_smem, ready, base + j + 1, magic, STAGES)
            acc_b, acc_a = warpgroup_mma_wait(num_outstanding=1, deps=[acc_b, acc_a])
            m, l_tok, l_end, l_doc, f_tok, f_end, f_doc, num_finished = _retire(
                acc_a, base + j, tiles, total, m, l_tok, l_end, l_doc, f_tok, f_end, f_doc, d_desc,
                d_smem, s_desc, s_smem, ready, d_off_ptr, num_docs, finished, num_finished, col_layout,
                BLOCK_T, STAGES,
            )  # fmt: skip
        acc_b = warpgroup_mma_wait(num_outstanding=0, deps=[acc_b])
        m, l_tok, l_end, l_doc, f_tok, f_end, f_doc, num_finished = _retire(
            acc_b, base + GROUP - 1, tiles, total, m, l_tok, l_end, l_doc, f_tok, f_end, f_doc, d_desc,
            d_smem, s_desc, s_smem, ready, d_off_ptr, num_docs, finished, num_finished, col_layout,
            BLOCK_T, STAGES,
        )  # fmt: skip
        if FLUSH == 0:
            if num_finished > 0:
                gl.thread_barrier()
                # per row: its query scale and its query within the group (kept out of the loop's registers)
                rows = row_first + gl.arange(0, BLOCK_Q, layout=row_layout)
                row_ok = rows < row_last
                sq = gl.load(qs_ptr + rows, mask=row_ok, other=0.0)
                local = gl.zeros([BLOCK_Q], gl.int32, row_layout)
                for kq in gl.static_range(QPG - 1):
                    end_k = gl.load(q_off_ptr + gl.minimum(q_first + 1 + kq, q_last))
                    local += (rows >= end_k).to(gl.int32)
                for x in range(num_finished):
                    contrib = gl.where(row_ok, sq * finished.index(x).load(row_layout), 0.0)
                    for kq in gl.static_range(QPG):
                        part = gl.sum(gl.where(local == kq, contrib, 0.0), axis=0)
                        gl.store(
                            out_ptr + (q_first + kq) * num_docs + first_doc + x,
                            part,
                            mask=q_first + kq < q_last,
                        )
        elif FLUSH == 1:
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
                contrib = gl.where(
                    row_ok[None, :],
                    sq[None, :]
                    * finished._reinterpret(
                        gl.float32, [GROUP, BLOCK_Q], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
                    ).load(fl),
                    0.0,
                )
                xs = gl.arange(0, GROUP, layout=gl.SliceLayout(1, fl))
                for kq in gl.static_range(QPG):
                    part = gl.sum(gl.where((local == kq)[None, :], contrib, 0.0), axis=1)
                    gl.store(
                        out_ptr + (q_first + kq) * num_docs + first_doc + xs,
                        part,
                        mask=(xs < num_finished) & (q_first + kq < q_last),
                    )
                gl.thread_barrier()  # the next group overwrites `finished`
        num_finished = 0

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
