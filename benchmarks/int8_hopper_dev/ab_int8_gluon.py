"""Prototype: the int8 all-pairs Gluon kernel (int8_allpairs.py) against the Triton int8 kernel and the fp16
forward, on the H200. Run from the repository root after copying this folder to benchmarks/int8_hopper_dev/:

    python benchmarks/int8_hopper_dev/ab_int8_gluon.py --out $OUT/int8-gluon.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from maxsim_kernels import maxsim_forward as fwd
from maxsim_kernels.maxsim_int8 import (
    _launch_varlen,
    maxsim_int8_reference,
    quantize_per_token,
)
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.testing import do_bench

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
import bench_kernels as bk  # noqa: E402
import int8_allpairs as k8  # noqa: E402
import int8_allpairs2 as k82  # noqa: E402
import int8_allpairs3 as k83  # noqa: E402
import int8_allpairs4 as k84  # noqa: E402
import int8_allpairs5 as k85  # noqa: E402


def gluon_launcher(q8, sq, q_off, d8, sd, d_off, stages=7, group=8, per_prog=None):
    q_off_dev, d_off_dev = q_off.to(d8.device), d_off.to(d8.device)
    lens = q_off[1:] - q_off[:-1]
    nq, nd = len(lens), len(d_off) - 1
    qpg = max(1, 128 // int(lens.max()))
    groups = -(-nq // qpg)
    if per_prog is None:
        slots = 2 * torch.cuda.get_device_properties(d8.device).multi_processor_count
        per_prog = fwd.persistent_docs_per_program(groups, nd, slots, 0.25)
    grid = (groups * -(-nd // per_prog),)
    dl = gl.NVMMASharedLayout.get_default_for([64, d8.shape[1]], gl.int8)
    sl = gl.NVMMASharedLayout.get_default_for([64], gl.float32)
    d_desc = TensorDescriptor.from_tensor(d8, [64, d8.shape[1]], dl)
    mode = os.environ.get("I8_SCALE_TMA", "2")
    if mode == "2":
        sl2 = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        t = sd.shape[0]
        tpad = -(-t // 4) * 4
        table = torch.zeros((4, tpad), dtype=torch.float32, device=sd.device)
        for r in range(4):
            table[r, : t - r] = sd[r:]
        s_desc = TensorDescriptor.from_tensor(table, [1, 64], sl2)
    else:
        s_desc = TensorDescriptor.from_tensor(sd, [64], sl) if mode == "1" else sd

    def run():
        out = torch.empty((nq, nd), dtype=torch.float32, device=d8.device)
        k8._int8_allpairs_kernel[grid](
            q8,
            sq,
            q_off_dev,
            d_desc,
            s_desc,
            d_off_dev,
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


def case(q_lens, d_lens, gen):
    q_off = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    d_off = torch.tensor([0, *torch.tensor(d_lens).cumsum(0).tolist()])
    q = torch.nn.functional.normalize(torch.randn(int(q_off[-1]), 128, generator=gen), dim=1).cuda()
    d = torch.nn.functional.normalize(torch.randn(int(d_off[-1]), 128, generator=gen), dim=1).cuda()
    d[: d.shape[0] // 3] *= -1
    q8, sq = quantize_per_token(q)
    d8, sd = quantize_per_token(d)
    return q8, sq, q_off, d8, sd, d_off


def checks():
    gen = torch.Generator().manual_seed(5)
    rows = []
    cases = [
        ([32] * 9, [0, 1, 63, 64, 65, 200, 7, 128, 129, 300]),
        ([int(x) for x in torch.randint(1, 33, (37,), generator=gen)], [int(x) for x in torch.randint(0, 301, (211,), generator=gen)]),
        ([5, 32, 1, 17], [int(x) for x in torch.randint(0, 70, (300,), generator=gen)]),
    ]  # fmt: skip
    if os.environ.get("ONE_CASE"):
        cases = cases[:1]
    for q_lens, d_lens in cases:
        q8, sq, q_off, d8, sd, d_off = case(q_lens, d_lens, gen)
        ref = maxsim_int8_reference(
            q8.cpu(), q_off, d8.cpu(), d_off, doc_scales=sd.cpu(), query_scales=sq.cpu()
        )
        tri, _ = _launch_varlen(q8, sq, q_off.cuda(), d8, sd, d_off.cuda(), False)
        variants = (dict(), dict(stages=5, group=4, per_prog=3), dict(per_prog=1), dict(group=8, per_prog=50))
        for variant in variants[:1] if os.environ.get("ONE_CASE") else variants:
            try:
                fn = {"2": k82.launcher, "3": k83.launcher, "4": k84.launcher, "5": k85.launcher}.get(
                    os.environ.get("V", ""), gluon_launcher
                )
                if os.environ.get("V") in ("3", "4") and variant.get("stages") == 5:
                    variant = dict(variant, stages=4)
                if os.environ.get("V") == "4" and os.environ.get("CHECK_MAXNREG"):
                    variant = dict(variant, maxnreg=int(os.environ["CHECK_MAXNREG"]))
                got = fn(q8, sq, q_off, d8, sd, d_off, **variant)().cpu()
            except Exception as e:  # noqa: BLE001
                import traceback

                traceback.print_exc()
                rows.append(
                    {
                        "case": f"{variant}",
                        "error": repr(e)[:500],
                        "same_infinities": False,
                        "max_abs_err_vs_fp64": 1e9,
                        "max_abs_diff_vs_triton": 1e9,
                    }
                )
                return rows
            fin = torch.isfinite(ref)
            rows.append({
                "case": f"q={len(q_lens)} docs={len(d_lens)} {variant}",
                "same_infinities": bool(torch.equal(torch.isinf(got), torch.isinf(ref.float()))),
                "max_abs_err_vs_fp64": float((got.double()[fin] - ref[fin]).abs().max()),
                "max_abs_diff_vs_triton": float((got[fin] - tri.cpu()[fin]).abs().max()),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def timings(rounds):
    w = bk.make_workload("exhaustive")
    q, qo, d, do = w["queries"], w["q_off"], w["docs"], w["d_off"]
    q8, sq = quantize_per_token(q)
    d8, sd = quantize_per_token(d)
    qo_d, do_d = qo.to(d.device), do.to(d.device)
    methods = {
        "fp16-forward": lambda: fwd.maxsim_varlen_forward_triton(q, qo, d, do),
        "int8-triton": lambda: _launch_varlen(q8, sq, qo_d, d8, sd, do_d, False)[0],
    }
    for spec in os.environ.get("GLUON2_SET", "").split(","):
        if spec:
            st, g = spec[1:].split("g")
            methods[f"int8-gluon2-{spec}"] = k82.launcher(
                q8, sq, qo, d8, sd, do, stages=int(st), group=int(g)
            )
    for spec in os.environ.get("GLUON3_SET", "").split(","):
        if spec:
            st, g = spec[1:].split("g")
            methods[f"int8-gluon3-{spec}"] = k83.launcher(
                q8, sq, qo, d8, sd, do, stages=int(st), group=int(g)
            )
    for spec in os.environ.get("GLUON5_SET", "").split(","):
        if spec:
            st, g = spec[1:].split("g")
            methods[f"int8-gluon5-{spec}"] = k85.launcher(
                q8, sq, qo, d8, sd, do, stages=int(st), group=int(g)
            )
    for spec in os.environ.get("GLUON4_SET", "").split(","):
        if spec:
            st, rest = spec[1:].split("g")
            g, _, r = rest.partition("r")
            methods[f"int8-gluon4-{spec}"] = k84.launcher(
                q8, sq, qo, d8, sd, do, stages=int(st), group=int(g), maxnreg=int(r) if r else None
            )
    for spec in os.environ.get("GLUON_SET", "s5g8,s7g8").split(","):
        if not spec:
            continue
        st, g = spec[1:].split("g")
        methods[f"int8-gluon-{spec}"] = gluon_launcher(q8, sq, qo, d8, sd, do, stages=int(st), group=int(g))
    base = methods["int8-triton"]()
    best = {}
    for _ in range(rounds):
        for name, fn in methods.items():
            ms = float(do_bench(fn, warmup=10, rep=200, return_mode="median"))
            best[name] = min(best.get(name, ms), ms)
    out = []
    for name, fn in methods.items():
        diff = float((fn() - base).abs().max()) if name.startswith("int8") else None
        out.append(
            {
                "method": name,
                "ms": best[name],
                "tops": w["flops"] / best[name] / 1e9,
                "max_diff_vs_int8_triton": diff,
            }
        )
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    c = [] if os.environ.get("NO_CHECKS") else checks()
    if os.environ.get("CHECKS_ONLY"):
        print("max err vs fp64", max(r["max_abs_err_vs_fp64"] for r in c))
        return
    t = timings(a.rounds)
    if a.out:
        json.dump({"command": " ".join(sys.argv), "checks": c, "exhaustive": t}, open(a.out, "w"), indent=1)
    if c:
        print(
            "max err vs fp64",
            max(r["max_abs_err_vs_fp64"] for r in c),
            "infinities ok",
            all(r["same_infinities"] for r in c),
        )
    for r in t:
        print(
            f"{r['method']:24s} {r['ms']:8.3f} ms {r['tops']:7.1f} TOPS  diff {r['max_diff_vs_int8_triton']}"
        )


if __name__ == "__main__":
    main()
