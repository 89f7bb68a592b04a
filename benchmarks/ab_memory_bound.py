"""The HBM-bound shapes, old and new tiles side by side in one process: int8 one query and rerank (pointer
loads against TMA tiles, a sweep of the TMA tiles), the fp16 kernel on the same data, the int8 all-pairs
case, and the rerank with each query's candidates one after another in memory against shuffled ones.

Inputs: L2-normalised random fp16 vectors, d = 128, int8 = the same vectors through `quantize_per_token`;
offsets on the GPU for the int8 launchers (kernel time), the public fp16 functions as `bench_kernels.py`
calls them; `triton.testing.do_bench` medians. Every variant's scores are compared bit for bit with the
baseline of its row group (the old int8 tiles, or the unrotated fp16 walk on the same candidates).

Rerank candidate layouts (64 queries x 1000 candidates of 180 tokens, a pool of 64K documents):
  shuffled    each query's candidates scattered over the pool (`randperm`, the benchmark's layout)
  contiguous  query q owns documents 1000 q .. 1000 q + 999, in order
  sorted      random candidates, each query's list in increasing document order
  gapped      contiguous, but a 1-token document between any two pool documents (shifts the alignment)
  round-robin contiguous, the programs' launch order interleaved over the queries
  per4/per16  contiguous, 4 or 16 candidates a program instead of 8

    python benchmarks/ab_memory_bound.py --out benchmarks/results/int8/memory-bound-h200.json
    python benchmarks/ab_memory_bound.py --parts maxnreg --out ...       # register caps against none
    python benchmarks/ab_memory_bound.py --parts tiles --out ...         # 32-token tiles against 64
    python benchmarks/ab_memory_bound.py --parts convert --out ...       # Gluon all pairs: I2F against bias
    python benchmarks/ab_memory_bound.py --parts stream --out ...        # Gluon stream kernel against Triton
    python benchmarks/ab_memory_bound.py --parts stream --defaults-only --rounds 8 --out ...
    TRITON_INTERPRET=1 python benchmarks/ab_memory_bound.py --smoke     # the script itself, on the CPU
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from common import (
    DIM,
    QUERY_TOKENS,
    SMOKE,
    device,
    make_log,
    median_ms,
    meta,
    normal_tokens,
    ragged,
    smoke_size,
    sync,
    write_json,
)

log = make_log("ab_memory_bound", clock=True)
RECORD: dict[str, Any] = {"rows": []}
OUT: dict[str, str | None] = {"path": None}


def row(
    part: str,
    variant: str,
    fn: Callable[[], torch.Tensor],
    nbytes: float,
    base: torch.Tensor | None,
    rep_ms: int,
    **extra: Any,
) -> torch.Tensor | None:
    """Time `fn`, compare its scores with `base` bit for bit, record and log one row."""
    try:
        out = fn()
        sync()
        ms = median_ms(fn, rep_ms)
    except Exception as exc:  # a tile the compiler refuses is recorded, not fatal
        log(f"{part} {variant}: failed ({type(exc).__name__}: {str(exc)[:200]})")
        RECORD["rows"].append({"part": part, "variant": variant, "error": str(exc)[:400], **extra})
        return None
    equal = None if base is None else bool(torch.equal(out, base))
    diff = None if base is None else float((out.double() - base.double()).abs().max())
    r = {"part": part, "variant": variant, "ms": ms, "tb_s": nbytes / ms / 1e9, "bitwise_equal": equal,
         "max_abs_diff": diff, **extra}  # fmt: skip
    RECORD["rows"].append(r)
    log(f"{part:10s} {variant:44s} {ms:8.3f} ms {r['tb_s']:5.2f} TB/s  equal={equal}")
    write_json(OUT["path"], RECORD)
    return out


def rerank(rep_ms: int) -> None:
    from maxsim_kernels import int8_host
    from maxsim_kernels import maxsim_forward as fwd
    from maxsim_kernels import maxsim_int8 as i8

    dev = device()
    gen = torch.Generator(device=dev).manual_seed(0)
    n_rq, per_q, length = 64, smoke_size(1000), 180
    pool_n = n_rq * per_q
    tokens = normal_tokens(pool_n * (length + 1), gen, dev)  # room for the gapped layout
    pool8, pool_sc = int8_host.quantize_per_token(tokens)
    plain_off = torch.arange(pool_n + 1, dtype=torch.int64) * length  # host offsets, as the API takes
    gap_lens = torch.tensor([length, 1] * pool_n, dtype=torch.int64)
    gap_off = torch.cat([torch.zeros(1, dtype=torch.int64), gap_lens.cumsum(0)])
    queries = normal_tokens(n_rq * QUERY_TOKENS, gen, dev)
    q_off = torch.arange(n_rq + 1, dtype=torch.int64) * QUERY_TOKENS
    q8, sq = int8_host.quantize_per_token(queries)
    q_off_dev = q_off.to(dev)
    perm = torch.randperm(pool_n, generator=torch.Generator().manual_seed(0))
    layouts = {
        "shuffled": (perm, plain_off),
        "contiguous": (torch.arange(pool_n), plain_off),
        "sorted": (perm.view(n_rq, per_q).sort(1).values.flatten(), plain_off),
        "gapped": (torch.arange(pool_n) * 2, gap_off),
    }
    c_off = torch.arange(n_rq + 1, dtype=torch.int64) * per_q
    fp16_bytes = n_rq * per_q * length * DIM * 2.0
    int8_bytes = n_rq * per_q * length * (DIM + 4.0)
    docs16 = {"plain": tokens[: pool_n * length], "gapped": tokens[: int(gap_off[-1])]}
    docs8 = {"plain": (pool8[: pool_n * length], pool_sc[: pool_n * length]),
             "gapped": (pool8[: int(gap_off[-1])], pool_sc[: int(gap_off[-1])])}  # fmt: skip
    cands = fwd._TUNING["cands"]
    original_blocks = fwd._candidate_blocks

    def round_robin(c: np.ndarray, per: int):  # the same blocks, launched one query after another
        query, first, last = original_blocks(c, per)
        order = np.lexsort((query, np.arange(len(query)) - np.searchsorted(query, query)))
        return query[order], first[order], last[order]

    for name, (cand, d_off) in layouts.items():
        kind = "gapped" if name == "gapped" else "plain"
        cand_dev = cand.to(dev)
        setups = [("", None, original_blocks)]
        if name == "contiguous":
            setups += [("round-robin", None, round_robin)]
            setups += [(f"per{n}", fwd.replace(cands, docs_per_prog=n), original_blocks) for n in (4, 16)]
        for label, cfg, blocks in setups:
            base = None
            for rotate in (False, True):
                fwd._ROTATE_CANDIDATES, fwd._candidate_blocks = rotate, blocks
                co = c_off.clone()  # a fresh tensor: the launch blocks are memoised per offsets tensor

                def fn(co=co, cfg=cfg, d=docs16[kind], d_off=d_off, cand_dev=cand_dev) -> torch.Tensor:
                    return fwd.maxsim_candidates_forward_triton(
                        queries, q_off, d, d_off, co, cand_dev, config=cfg
                    )

                tag = f"{name}{'+' + label if label else ''} rotate={rotate}"
                out = row(
                    "rerank16", tag, fn, fp16_bytes, base, rep_ms, layout=name, setup=label, rotate=rotate
                )
                base = out if base is None else base
        fwd._ROTATE_CANDIDATES, fwd._candidate_blocks = True, original_blocks
        d8, sd = docs8[kind]
        d_off_dev = d_off.to(dev)
        co_dev = c_off.to(dev)
        base = None
        variants = [(False, False), (True, False), (True, True), (False, True)]
        if name in ("sorted", "gapped"):
            variants = [(False, False), (True, True)]
        for tma, rotate in variants:

            def fn8(
                tma=tma, rotate=rotate, d8=d8, sd=sd, d_off=d_off_dev, co=co_dev, cd=cand_dev
            ) -> torch.Tensor:
                return i8.launch_candidates_with_tiles(
                    q8, sq, q_off_dev, d8, sd, d_off, co, cd, False, tma=tma, rotate=rotate
                )[0]

            out = row("rerank8", f"{name} tma={tma} rotate={rotate}", fn8, int8_bytes, base, rep_ms,
                      layout=name, tma=tma, rotate=rotate)  # fmt: skip
            base = out if base is None else base
        if name == "shuffled":  # the TMA tile sweep on the benchmark's layout
            for bd, per, warps, stages in [(64, 8, 4, 4), (64, 16, 4, 3), (64, 16, 4, 4), (64, 16, 4, 6),
                                           (64, 32, 4, 4), (64, 16, 8, 4), (128, 16, 4, 3)]:  # fmt: skip
                cfg8 = dict(block_d=bd, cands_per_prog=per, num_warps=warps, num_stages=stages)

                def fn8(cfg8=cfg8, d8=d8, sd=sd, d_off=d_off_dev, co=co_dev, cd=cand_dev) -> torch.Tensor:
                    return i8.launch_candidates_with_tiles(
                        q8, sq, q_off_dev, d8, sd, d_off, co, cd, False, tma=True, **cfg8
                    )[0]

                row("rerank8", f"shuffled tma sweep {cfg8}", fn8, int8_bytes, base, rep_ms, layout=name,
                    tma=True, sweep=cfg8)  # fmt: skip
        fp16_check = None
        if name == "shuffled":
            fp16_check = fwd.maxsim_candidates_forward_triton(queries, q_off, docs16[kind], d_off, c_off,
                                                              cand_dev)  # fmt: skip
            RECORD["rerank_int8_vs_fp16_max_abs"] = float((base - fp16_check).abs().max())


def one_query_and_exhaustive(rep_ms: int, parts: set[str]) -> None:
    from maxsim_kernels import int8_host, maxsim_varlen
    from maxsim_kernels import maxsim_int8 as i8

    dev = device()
    gen = torch.Generator(device=dev).manual_seed(1)
    docs16, d_off = ragged(smoke_size(100_000), 20, 300, gen, dev)
    docs8, sd = int8_host.quantize_per_token(docs16)
    queries = normal_tokens(smoke_size(512) * QUERY_TOKENS, gen, dev)
    n_tok = int(d_off[-1])
    if "one_query" in parts:
        q, qo = queries[:QUERY_TOKENS], torch.tensor([0, QUERY_TOKENS], dtype=torch.int64, device=dev)
        q8, sq = int8_host.quantize_per_token(q)
        fp16 = lambda: maxsim_varlen(q, qo, docs16, d_off)  # noqa: E731
        row("one_query", "fp16 (maxsim_varlen)", fp16, n_tok * DIM * 2.0, None, rep_ms)
        base = None
        configs = [dict(tma=False)]  # the old default tile: (64, 32, 4, 3), pointer loads
        configs += [
            dict(tma=True, block_d=64, docs_per_prog=32, num_warps=4, num_stages=s) for s in (3, 4, 5, 6, 8)
        ]
        configs += [dict(tma=True, block_d=64, docs_per_prog=p, num_warps=4, num_stages=5) for p in (16, 64)]
        configs += [dict(tma=True, block_d=128, docs_per_prog=32, num_warps=4, num_stages=s) for s in (3, 4)]
        configs += [dict(tma=True, block_d=64, docs_per_prog=32, num_warps=8, num_stages=5), dict(tma=True)]
        for cfg in configs:

            def fn(cfg=cfg) -> torch.Tensor:
                return i8.launch_varlen_with_tiles(q8, sq, qo, docs8, sd, d_off, False, **cfg)[0]

            out = row("one_query", f"int8 {cfg}", fn, n_tok * (DIM + 4.0), base, rep_ms, config=cfg)
            base = out if base is None else base
    if "exhaustive" in parts:
        n_ex = smoke_size(50_000)
        t_ex = int(d_off[n_ex])
        d16, do, d8, s8 = docs16[:t_ex], d_off[: n_ex + 1].contiguous(), docs8[:t_ex], sd[:t_ex]
        nq = smoke_size(512)
        qo = torch.arange(nq + 1, dtype=torch.int64, device=dev) * QUERY_TOKENS
        q8, sq = int8_host.quantize_per_token(queries)
        flops = 2.0 * queries.shape[0] * t_ex * DIM
        fp16 = lambda: maxsim_varlen(queries, qo, d16, do)  # noqa: E731
        row("exhaustive", "fp16 (maxsim_varlen, gpu offsets)", fp16, flops, None, rep_ms)
        base = row(
            "exhaustive",
            "int8 triton (gpu offsets)",
            lambda: i8.launch_varlen_with_tiles(q8, sq, qo, d8, s8, do, False, tma=False)[0],
            flops,
            None,
            rep_ms,
        )
        tma = lambda: i8.launch_varlen_with_tiles(q8, sq, qo, d8, s8, do, False, tma=True)[0]  # noqa: E731
        row("exhaustive", "int8 triton tma", tma, flops, base, rep_ms)
        qo_h, do_h = qo.cpu(), do.cpu()
        row(
            "exhaustive",
            "int8 maxsim_varlen_int8 (host offsets: gluon)",
            lambda: int8_host.maxsim_varlen_int8(q8, qo_h, d8, do_h, doc_scales=s8, query_scales=sq),
            flops,
            base,
            rep_ms,
        )
    RECORD["note"] = "exhaustive rows: tb_s holds TFLOP/s x 1e-3 (flops / ms / 1e9)"


def compiled_registers(kernel: Any) -> list[dict]:
    """(registers, spills, num_stages) of each compiled variant of a Triton kernel, as Triton keeps them."""
    found = []
    for caches in getattr(kernel, "device_caches", {}).values():
        for compiled in caches[0].values():
            meta = getattr(compiled, "metadata", None)
            found.append({
                "n_regs": getattr(compiled, "n_regs", None),
                "n_spills": getattr(compiled, "n_spills", None),
                "num_stages": getattr(meta, "num_stages", None),
                "maxnreg": getattr(meta, "maxnreg", None),
            })  # fmt: skip
    return found


def hbm_inputs(query_tokens: int = QUERY_TOKENS) -> SimpleNamespace:
    """The two HBM-bound int8 workloads of the register-cap and tile parts: one query (32 tokens) x 100K
    ragged documents (``one``: `launch_varlen`'s inputs, ``docs16`` the fp16 documents), and rerank 64
    queries x 1000 shuffled candidates of 180 tokens (``rerank``: `launch_candidates`'s inputs), with
    the bytes each reads; `query_tokens` a query instead of 32."""
    from maxsim_kernels import int8_host

    dev = device()
    gen = torch.Generator(device=dev).manual_seed(1)
    docs16, d_off = ragged(smoke_size(100_000), 20, 300, gen, dev)
    docs8, sd = int8_host.quantize_per_token(docs16)
    q = normal_tokens(query_tokens, gen, dev)
    qo = torch.tensor([0, query_tokens], dtype=torch.int64, device=dev)
    q8, sq = int8_host.quantize_per_token(q)
    n_rq, per_q, length = 64, smoke_size(1000), 180
    pool16 = normal_tokens(n_rq * per_q * length, gen, dev)
    pool8, pool_sc = int8_host.quantize_per_token(pool16)
    pool_off = (torch.arange(n_rq * per_q + 1, dtype=torch.int64) * length).to(dev)
    rq16 = normal_tokens(n_rq * query_tokens, gen, dev)
    rq8, rsq = int8_host.quantize_per_token(rq16)
    rqo = (torch.arange(n_rq + 1, dtype=torch.int64) * query_tokens).to(dev)
    c_off = (torch.arange(n_rq + 1, dtype=torch.int64) * per_q).to(dev)
    perm = torch.randperm(n_rq * per_q, generator=torch.Generator().manual_seed(0)).to(dev)
    n_tok = int(d_off[-1])
    return SimpleNamespace(
        q=q, qo=qo, docs16=docs16, d_off=d_off, n_tok=n_tok,
        one=(q8, sq, qo, docs8, sd, d_off), one_bytes=n_tok * (DIM + 4.0),
        rerank=(rq8, rsq, rqo, pool8, pool_sc, pool_off, c_off, perm),
        rerank16=(rq16, rqo, pool16, pool_off, c_off, perm),
        rerank_bytes=n_rq * per_q * length * (DIM + 4.0),
    )  # fmt: skip


def register_caps(rep_ms: int, rounds: int = 3, caps: tuple = (None, 120, 112, 104, 96, 88)) -> None:
    """The HBM-bound int8 tiles with ptxas's register cap (``maxnreg``) at several values against none,
    in rounds of rotating order: one query x 100K ragged documents, rerank 64 q x 1000 x 180 tokens
    shuffled; the default tiles, and 4 stages beside them; the fp16 kernel once a round."""
    from maxsim_kernels import maxsim_int8 as i8
    from maxsim_kernels import maxsim_varlen

    w = hbm_inputs()
    for r in range(rounds):
        row("maxnreg", f"round {r} fp16 one query", lambda: maxsim_varlen(w.q, w.qo, w.docs16, w.d_off),
            w.n_tok * DIM * 2.0, None, rep_ms, round=r)  # fmt: skip
        order = caps[r % len(caps) :] + caps[: r % len(caps)]
        for stages in (None, 4):
            base = None
            for cap in order:

                def one(cap=cap, stages=stages) -> torch.Tensor:
                    return i8.launch_varlen_with_tiles(*w.one, False, maxnreg=cap, num_stages=stages)[0]

                out = row("maxnreg", f"round {r} one query stages={stages} maxnreg={cap}", one,
                          w.one_bytes, base, rep_ms, round=r, workload="one_query", maxnreg=cap,
                          stages=stages)  # fmt: skip
                base = out if base is None else base
            base = None
            for cap in order:

                def rr(cap=cap, stages=stages) -> torch.Tensor:
                    tiles = dict(maxnreg=cap, num_stages=stages)
                    return i8.launch_candidates_with_tiles(*w.rerank, False, **tiles)[0]

                out = row("maxnreg", f"round {r} rerank stages={stages} maxnreg={cap}", rr, w.rerank_bytes,
                          base, rep_ms, round=r, workload="rerank", maxnreg=cap, stages=stages)  # fmt: skip
                base = out if base is None else base
    RECORD["compiled"] = {
        "varlen": compiled_registers(i8._maxsim_int8_varlen_kernel),
        "candidates": compiled_registers(i8._maxsim_int8_candidates_kernel),
    }
    for name, found in RECORD["compiled"].items():
        for c in found:
            log(f"compiled {name}: {c}")


def tile_sweep(rep_ms: int, rounds: int = 3) -> None:
    """Document tiles of 32 tokens against the default 64, TMA, in rounds of rotating order: one query x
    100K ragged documents, rerank 64 q x 1000 x 180 tokens shuffled (180 = 64 + 64 + 52: a 64-token
    tile reads 6.7% past each candidate; 32-token tiles 3.5%); candidates or documents a program and
    stages around the defaults. Same bits asked."""
    from maxsim_kernels import maxsim_int8 as i8

    w = hbm_inputs()
    one_cfgs = [{}] + [dict(block_d=32, docs_per_prog=p, num_stages=st) for p in (32, 64) for st in (3, 5)]
    cand_cfgs = [{}, dict(cands_per_prog=8, num_stages=4)]
    cand_cfgs += [dict(block_d=32, cands_per_prog=p, num_stages=st) for p in (8, 16, 32) for st in (4, 6)]
    for r in range(rounds):
        for name, cfgs in (("one query", one_cfgs), ("rerank", cand_cfgs)):
            base = None
            for cfg in cfgs[r % len(cfgs) :] + cfgs[: r % len(cfgs)]:
                if name == "one query":
                    fn = lambda cfg=cfg: i8.launch_varlen_with_tiles(*w.one, False, **cfg)[0]  # noqa: E731
                    nbytes = w.one_bytes
                else:
                    fn = lambda cfg=cfg: i8.launch_candidates_with_tiles(*w.rerank, False, **cfg)[0]  # noqa: E731
                    nbytes = w.rerank_bytes
                out = row("tiles", f"round {r} {name} {cfg or 'default'}", fn, nbytes, base, rep_ms,
                          round=r, workload=name, config=cfg)  # fmt: skip
                base = out if base is None else base


def conversions(rep_ms: int, rounds: int = 3) -> None:
    """The Gluon all-pairs kernel's int32 -> fp32 conversion (`maxsim_int8_hopper.I2F_TILES`: 0 the
    accumulator-bias bits, 1 the conversion instruction on every other tile, 2 on all), in rounds of
    rotating order, 512 and 64 queries of 32 tokens x 50K ragged documents (host offsets, as `maxsim
    score` calls it), the fp16 kernel once a round. Same bits asked."""
    from maxsim_kernels import int8_host, maxsim_varlen
    from maxsim_kernels import maxsim_int8 as i8
    from maxsim_kernels import maxsim_int8_hopper as hopper

    dev = device()
    gen = torch.Generator(device=dev).manual_seed(1)
    docs16, d_off = ragged(smoke_size(50_000), 20, 300, gen, dev)
    docs8, sd = int8_host.quantize_per_token(docs16)
    d_host = d_off.cpu()
    variants, default = (0, 1, 2), hopper.I2F_TILES
    for nq in (smoke_size(512), smoke_size(64)):
        queries = normal_tokens(nq * QUERY_TOKENS, gen, dev)
        qo = torch.arange(nq + 1, dtype=torch.int64, device=dev) * QUERY_TOKENS
        q8, sq = int8_host.quantize_per_token(queries)
        qo_h = qo.cpu()
        flops = 2.0 * queries.shape[0] * docs16.shape[0] * DIM
        for r in range(rounds):
            fp16 = lambda q=queries, o=qo: maxsim_varlen(q, o, docs16, d_off)  # noqa: E731
            row("convert", f"{nq} q round {r} fp16", fp16, flops, None, rep_ms, round=r, queries=nq)
            base = None
            for v in variants[r % 3 :] + variants[: r % 3]:

                def fn(v=v, q8=q8, qo_h=qo_h, sq=sq) -> torch.Tensor:
                    hopper.I2F_TILES = v
                    return int8_host.maxsim_varlen_int8(
                        q8, qo_h, docs8, d_host, doc_scales=sd, query_scales=sq
                    )

                out = row("convert", f"{nq} q round {r} int8 I2F_TILES={v}", fn, flops, base, rep_ms,
                          round=r, queries=nq, i2f_tiles=v)  # fmt: skip
                base = out if base is None else base
    hopper.I2F_TILES = default
    # the Triton tiles of the HBM-bound shapes: the accumulator-bias bits (dim <= _MAGIC_MAX_DIM) against
    # the conversion instruction (what wider vectors use)
    w = hbm_inputs()
    magic = i8._MAGIC_MAX_DIM
    for r in range(rounds):
        workloads = [("one query", i8.launch_varlen, w.one, w.one_bytes)]
        workloads.append(("rerank", i8.launch_candidates, w.rerank, w.rerank_bytes))
        for name, launch, args, nbytes in workloads:
            base = None
            for bias in (True, False)[r % 2 :] + (True, False)[: r % 2]:

                def fn(bias=bias, launch=launch, args=args) -> torch.Tensor:
                    i8._MAGIC_MAX_DIM = magic if bias else 0
                    return launch(*args, False)[0]

                out = row("convert", f"round {r} {name} triton {'bias bits' if bias else 'I2F'}", fn, nbytes,
                          base, rep_ms, round=r, workload=name, bias_bits=bias)  # fmt: skip
                base = out if base is None else base
    i8._MAGIC_MAX_DIM = magic
    RECORD["note"] = "convert all-pairs rows: tb_s holds TFLOP/s x 1e-3 (flops / ms / 1e9)"


STREAM_ONE = [dict(), dict(maxnreg=0), dict(maxnreg=80), dict(items_per_prog=64)]  # fmt: skip
STREAM_RERANK = [dict(), dict(stages=6), dict(items_per_prog=32)]  # fmt: skip


def stream(
    rep_ms: int, rounds: int = 4, defaults_only: bool = False, query_tokens: int = QUERY_TOKENS
) -> None:
    """The Gluon stream kernel (`maxsim_int8_hopper_stream`: document-major wgmma tiles by TMA through a
    deep ring) against the Triton int8 TMA tiles (the default before it) and the fp16 kernel, in rounds of
    rotating order: one query x 100K ragged documents, rerank 64 q x 1000 x 180 tokens shuffled; its
    configurations around the defaults. The default's scores against the Triton tiles' (`max_abs_diff`: the
    query sums run in another order), every other configuration's bitwise against the default's."""
    from maxsim_kernels import maxsim_candidates, maxsim_varlen
    from maxsim_kernels import maxsim_int8 as i8
    from maxsim_kernels import maxsim_int8_hopper_stream as st

    w = hbm_inputs(query_tokens)
    one_cfgs, rerank_cfgs = ([{}], [{}]) if defaults_only else (STREAM_ONE, STREAM_RERANK)
    q8, sq, qo, d8, sd, d_off = w.one
    rq8, rsq, rqo, pool8, pool_sc, pool_off, c_off, perm = w.rerank
    rerank_args = (rq8, rsq, rqo, c_off, perm, pool8, pool_sc, pool_off, query_tokens)
    # (name, fp16 kernel, its bytes, Triton int8 tiles, int8 bytes, stream configurations, stream kernel)
    workloads = [
        ("one query", lambda: maxsim_varlen(w.q, w.qo, w.docs16, w.d_off), w.n_tok * DIM * 2.0,
         lambda: i8.launch_varlen(*w.one, False)[0], w.one_bytes, one_cfgs,
         lambda cfg: st.stream_with_tiles(q8, sq, qo, None, None, d8, sd, d_off, query_tokens, **cfg)[None]),
        ("rerank", lambda: maxsim_candidates(*w.rerank16), w.rerank_bytes * 2,
         lambda: i8.launch_candidates(*w.rerank, False)[0], w.rerank_bytes, rerank_cfgs,
         lambda cfg: st.stream_with_tiles(*rerank_args, **cfg)),
    ]  # fmt: skip
    for r in range(rounds):
        for name, fp16, fp16_bytes, triton_int8, nbytes, cfgs, stream_kernel in workloads:
            kind = name.replace(" ", "_")
            row("stream", f"round {r} {name} fp16", fp16, fp16_bytes, None, rep_ms, round=r, workload=kind)
            triton_out = row("stream", f"round {r} {name} triton int8", triton_int8, nbytes, None, rep_ms,
                             round=r, workload=kind)  # fmt: skip
            default = stream_kernel({})
            for cfg in cfgs[r % len(cfgs) :] + cfgs[: r % len(cfgs)]:
                # the default against the Triton tiles (max_abs_diff), the others bitwise against it
                run = lambda cfg=cfg, kernel=stream_kernel: kernel(cfg)  # noqa: E731
                base = triton_out if cfg == {} else default
                label = f"round {r} {name} stream {cfg or 'default'}"
                row("stream", label, run, nbytes, base, rep_ms, round=r, workload=kind, config=cfg)
    RECORD["compiled"] = {"stream": compiled_registers(st._int8_stream_kernel)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rep-ms", type=int, default=150)
    parser.add_argument("--parts", default="rerank,one_query,exhaustive")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one call each (CPU, interpreter)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of the stream part")
    parser.add_argument("--defaults-only", action="store_true", help="stream part: the defaults, no sweep")
    parser.add_argument(
        "--query-tokens", type=int, default=QUERY_TOKENS, help="stream part: a query's tokens"
    )
    parser.add_argument(
        "--stream-configs",
        default=None,
        help="stream part: JSON list of configurations instead of the sweep's",
    )
    args = parser.parse_args()
    SMOKE["on"] = args.smoke
    OUT["path"] = args.out
    RECORD["meta"] = meta()
    parts = set(args.parts.split(","))
    if "rerank" in parts:
        rerank(args.rep_ms)
    if parts & {"one_query", "exhaustive"}:
        one_query_and_exhaustive(args.rep_ms, parts)
    if "maxnreg" in parts:
        register_caps(args.rep_ms)
    if "tiles" in parts:
        tile_sweep(args.rep_ms)
    if "convert" in parts:
        conversions(args.rep_ms)
    if "stream" in parts:
        if args.stream_configs:
            STREAM_ONE[:] = STREAM_RERANK[:] = json.loads(args.stream_configs)
        stream(args.rep_ms, args.rounds, args.defaults_only, args.query_tokens)
    write_json(args.out, RECORD)
    for r in RECORD["rows"]:
        if "ms" in r:
            name = r["variant"][:70]
            print(f"{r['part']:10s} {name:70s} {r['ms']:8.3f} {r['tb_s']:6.2f} {r['bitwise_equal']}")
    return None


if __name__ == "__main__":
    sys.exit(main())
