"""Which int8 all-pairs kernel and tiles for how many queries (H200): the crossover points.

`maxsim_varlen_int8` picks, from the host offsets, the Gluon kernel when there are at least
`maxsim_int8_hopper.MIN_GROUPS` groups of 128 query rows, else the Triton kernel, whose tiles are the
memory-bound ("few queries") ones when the queries fill at most two query tiles. At 16 queries of 32
tokens that gave the Triton few-queries tiles and 5.2 ms against fp16's 2.9 ms
(benchmarks/results/archive/int8/int8-h200-a286c9c.log). This times, for 1-64 queries of 32 tokens against the
50K ragged documents of `bench_int8.py`'s workload 1 (20-300 tokens, 8.0M tokens):

  fp16            `maxsim_varlen`, host offsets;
  default         `maxsim_varlen_int8`, host offsets (whatever it picks);
  triton few      the Triton kernel with the few-queries tiles;
  triton many     the Triton kernel with the all-pairs tiles;
  gluon           the Gluon kernel, `MIN_GROUPS` lifted (where it takes the shape).

    python benchmarks/sweep_int8_queries.py --out benchmarks/results/int8/int8-queries-h200.json
"""

from __future__ import annotations

import argparse

import torch
from common import QUERY_TOKENS, SMOKE, int8_kernel, median_ms, ragged, write_json
from maxsim_kernels import maxsim_int8, maxsim_varlen
from maxsim_kernels.maxsim_int8 import (
    _launch_varlen,
    maxsim_varlen_int8,
    quantize_per_token,
)

FEW = dict(block_d=64, docs_per_prog=32, num_warps=4, num_stages=3, element_max=True)
MANY = dict(block_d=32, docs_per_prog=64, num_warps=4, num_stages=2, element_max=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", default="1,2,4,8,12,16,24,32,48,64")
    parser.add_argument("--rep-ms", type=int, default=200)
    parser.add_argument("--docs", type=int, default=50_000)
    parser.add_argument("--device", default="cuda", help="cpu: a check under TRITON_INTERPRET=1")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    SMOKE["on"] = device.type == "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    d16, d_off = ragged(args.docs, 20, 300, gen, device)
    counts = [int(n) for n in args.queries.split(",")]
    queries16, q_off = ragged(max(counts), QUERY_TOKENS, QUERY_TOKENS, gen, device)
    d8, sd = quantize_per_token(d16)
    d_off_host = d_off.cpu()
    hopper = maxsim_int8.gluon_module("maxsim_int8_hopper", device)

    def measure(nq: int) -> dict:
        q16, qo = queries16[: nq * QUERY_TOKENS], q_off[: nq + 1]
        qo_host = qo.cpu()
        q8, sq = quantize_per_token(q16)
        row = {
            "kernel_picked": int8_kernel(q16, qo_host, d8, d_off_host),
            "fp16_ms": median_ms(lambda: maxsim_varlen(q16, qo_host, d16, d_off_host), args.rep_ms),
            "default_ms": median_ms(
                lambda: maxsim_varlen_int8(q16, qo_host, d8, d_off_host, doc_scales=sd), args.rep_ms
            ),
            "triton_few_ms": median_ms(
                lambda: _launch_varlen(q8, sq, qo, d8, sd, d_off, False, **FEW), args.rep_ms
            ),
            "triton_many_ms": median_ms(
                lambda: _launch_varlen(q8, sq, qo, d8, sd, d_off, False, **MANY), args.rep_ms
            ),
        }
        if hopper is not None:
            saved = hopper.MIN_GROUPS
            hopper.MIN_GROUPS = 1
            try:
                if maxsim_int8._hopper_allpairs(qo_host, d_off_host, q8, d8, False) is not None:
                    row["gluon_ms"] = median_ms(
                        lambda: maxsim_varlen_int8(q16, qo_host, d8, d_off_host, doc_scales=sd), args.rep_ms
                    )
            finally:
                hopper.MIN_GROUPS = saved
        return row

    rows = {}
    for nq in counts:
        row = measure(nq)
        rows[nq] = row
        cells = ", ".join(f"{k[:-3]} {v:.3f}" for k, v in row.items() if k.endswith("_ms"))
        print(f"{nq:3d} queries ({row['kernel_picked']}): {cells} ms", flush=True)
    write_json(args.out, {"rows": rows, "doc_tokens": int(d16.shape[0])}, indent=2)


if __name__ == "__main__":
    main()
