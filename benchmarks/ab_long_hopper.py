"""The Hopper long-query kernel (`maxsim_kernels.maxsim_forward_hopper`, Gluon) against the Triton forward's
"long" class and flash-maxsim, on the same tensors in one process (H200).

First the checks: on ragged long queries x ragged documents (empty, 1-token, tile-straddling), fp16 and
bf16, the Gluon scores must equal the Triton kernel's bit for bit and stay within the float64 reference's
tolerance. Then the ColPali workload of bench_kernels.py (1 query x 1024 tokens against 1000 documents of
1024 tokens), methods interleaved over rounds, best median per method; and the variants of the Gluon
kernel (tile group, ring depth, documents a program; "auto" is the forward's choice).

    python benchmarks/ab_long_hopper.py --out benchmarks/results/kernels/long-hopper-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from common import flash, make_workload, meta, write_json
from maxsim_kernels import maxsim_forward as fwd
from maxsim_kernels import maxsim_forward_hopper as hopper
from maxsim_kernels import maxsim_reference
from triton.testing import do_bench

# (group, ring depth, documents a program: None for the forward's choice)
VARIANTS = [
    (16, 5, None), (8, 5, None), (16, 4, None), (16, 6, None), (16, 5, 2), (16, 5, 16), (16, 5, 62),
]  # fmt: skip


def gluon(q, qo, d, do, group: int, stages: int, per_prog: int | None):
    """The Gluon kernel as the forward launches it: partial scores per 128-row chunk, then their sum."""
    max_len = int((qo[1:] - qo[:-1]).max())
    chunks = -(-max_len // 128)
    qo_dev, do_dev = qo.to(d.device), do.to(d.device)
    nq, nd = qo.shape[0] - 1, do.shape[0] - 1
    if per_prog is None:
        per_prog = fwd.hopper_docs_per_program(hopper, nq * chunks, nd, d.device)
    launch = hopper.LongLaunch((nq * chunks * -(-nd // per_prog),), hopper.BLOCK_T, stages, group)

    def run() -> torch.Tensor:
        scores = torch.empty((chunks, nq, nd), dtype=torch.float32, device=d.device)
        launch(q, qo_dev, d, do_dev, scores, None, nq, nd, chunks, per_prog, q.stride(0))
        return scores.sum(0) if chunks > 1 else scores[0]

    return run


def checks() -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(3)
    cases = [
        ([150, 1024, 129, 300], [0, 1, 63, 64, 65, 200, 1024, 7, 128, 129]),
        ([1024], [1024] * 9),
        ([200, 256], [int(x) for x in torch.randint(0, 400, (37,), generator=gen)]),
        ([300, 5, 140], [int(x) for x in torch.randint(0, 70, (90,), generator=gen)]),  # full groups of ends
    ]
    for dtype in (torch.float16, torch.bfloat16):
        for q_lens, d_lens in cases:
            q_off = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
            d_off = torch.tensor([0, *torch.tensor(d_lens).cumsum(0).tolist()])
            q = torch.nn.functional.normalize(torch.randn(int(q_off[-1]), 128, generator=gen), dim=1)
            d = torch.nn.functional.normalize(torch.randn(int(d_off[-1]), 128, generator=gen), dim=1)
            d[: d.shape[0] // 3] *= -1  # negative similarities
            q, d = q.to(dtype).cuda(), d.to(dtype).cuda()
            ref = maxsim_reference(q, q_off, d, d_off)
            triton_scores = fwd.maxsim_varlen_forward_triton(q, q_off, d, d_off)
            for variant in ((16, 5, None), (8, 4, 1), (16, 5, 3), (16, 6, 5)):
                got = gluon(q, q_off, d, d_off, *variant)()
                finite = torch.isfinite(ref)
                rows.append({
                    "check": f"{dtype} q={q_lens[:4]} docs={len(d_lens)} variant={variant}",
                    "bitwise_equal_to_triton": bool(torch.equal(got, triton_scores)),
                    "same_infinities": bool(torch.equal(torch.isinf(got), torch.isinf(ref.float()))),
                    "max_abs_err_vs_fp64": float((got.double()[finite] - ref[finite]).abs().max()),
                })  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    return rows


def timings(rounds: int) -> list[dict]:
    w = make_workload("colpali")
    q, qo, d, do = w["queries"], w["q_off"], w["docs"], w["d_off"]
    long_cfg = fwd._TUNING["long"]  # a config forces the Triton kernel; none: the default (Gluon on Hopper)
    methods = {
        "triton-long": lambda: fwd.maxsim_varlen_forward_triton(q, qo, d, do, config=long_cfg),
        "default": lambda: fwd.maxsim_varlen_forward_triton(q, qo, d, do),
    }
    for v in VARIANTS:
        methods["gluon-g{}-s{}-d{}".format(*(x or "auto" for x in v))] = gluon(q, qo, d, do, *v)
    try:
        methods["flash-maxsim"] = flash(w)
    except ImportError as exc:
        print("flash-maxsim:", exc)
    base = methods["triton-long"]()
    best: dict[str, float] = {}
    same: dict[str, bool] = {}
    for _ in range(rounds):
        for name, fn in methods.items():
            ms = float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
            best[name] = min(best.get(name, ms), ms)
    for name, fn in methods.items():
        out = fn()
        same[name] = bool(torch.equal(out.reshape(base.shape), base)) if name != "flash-maxsim" else False
    rows = [
        {"method": n, "ms": best[n], "tflops": w["flops"] / best[n] / 1e9, "bitwise_equal_to_triton": same[n]}
        for n in methods
    ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    check_rows = checks()
    rows = timings(args.rounds)
    data = {"command": " ".join(sys.argv), "meta": meta(), "checks": check_rows, "colpali": rows}
    write_json(args.out, data)
    ok = all(r["bitwise_equal_to_triton"] for r in check_rows)
    print(f"\nchecks: {len(check_rows)}, all bitwise equal to the Triton kernel: {ok}, "
          f"max error vs fp64 {max(r['max_abs_err_vs_fp64'] for r in check_rows):.2e}")  # fmt: skip
    print("method                      ms     TFLOP/s  same")
    for r in rows:
        print(f"{r['method']:26s} {r['ms']:7.4f}  {r['tflops']:7.1f}  {r['bitwise_equal_to_triton']}")


if __name__ == "__main__":
    main()
