"""Where all pairs of codes spend their time: 512 queries of 32 tokens x 50K ragged documents (20-300
tokens, d = 128) as int8, int4 and int2, each through `maxsim_varlen` with the query offsets on the device
and on the host. For each: the kernels one call launches and their GPU time (`torch.profiler`: the int8
kernel that scored it, `_int8_allpairs_kernel` for the Gluon all-pairs kernel, and the decode of the
codes), the median time of a call (`triton.testing.do_bench`) and one call's host time.

    python benchmarks/profile_codes_allpairs.py --out benchmarks/results/codes/allpairs-profile-h100.json

``--device cpu --docs 300 --queries 8`` checks the script on a machine without a GPU (each call once, on the
torch paths; nothing timed or profiled).
"""

from __future__ import annotations

import argparse

import torch
from common import host_times, median_ms, meta, sync, write_json


def main() -> None:
    from maxsim_kernels import maxsim_varlen
    from maxsim_kernels.int8_host import quantize_per_token
    from torch.profiler import ProfilerActivity, profile

    from maxsim_cli.codecs import Int2Grid, encode, fit_int2_levels

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=50_000)
    parser.add_argument("--queries", type=int, default=512)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rep-ms", type=int, default=300)
    parser.add_argument("--out")
    args = parser.parse_args()
    dev = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 301, (args.docs,), generator=gen)
    offsets = torch.zeros(args.docs + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    docs = torch.nn.functional.normalize(torch.randn(int(offsets[-1]), 128, generator=gen), dim=1)
    docs, offsets = docs.to(dev, torch.float16), offsets.to(dev)
    grid = Int2Grid(*fit_int2_levels(docs[: 1 << 18]))
    stored = {}
    codes, scales = quantize_per_token(docs)
    stored["int8"] = (codes, {"doc_scales": scales})
    codes, scales = encode("int4-per-token", docs, None)
    stored["int4"] = (codes, {"doc_scales": scales})
    codes, scales = encode("int2-grid", docs, grid)
    stored["int2"] = (codes, {"doc_scales": scales, "codebook": grid.for_kernels(dev)})
    queries = torch.nn.functional.normalize(torch.randn(args.queries * 32, 128, generator=gen), dim=1)
    queries = queries.to(dev, torch.float16)
    q_off = {"device": torch.arange(0, args.queries * 32 + 1, 32, device=dev)}
    q_off["host"] = q_off["device"].cpu()

    record: dict = {"meta": meta(dtype="float16", dim=128, queries=args.queries, documents=args.docs),
                    "calls": {}}  # fmt: skip
    if dev.type != "cuda":  # a check of the script: each call once, nothing timed or profiled
        for codes, kw in stored.values():
            maxsim_varlen(queries, q_off["host"], codes, offsets, **kw)
        write_json(args.out, record)
        return
    for where, offs in q_off.items():
        for name, (codes, kw) in stored.items():

            def call(codes=codes, kw=kw, offs=offs):  # noqa: ANN001, ANN202
                return maxsim_varlen(queries, offs, codes, offsets, **kw)

            call()
            sync()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:  # the kernels one call launches
                call()
                sync()
            kernels = {e.key: {"calls": e.count, "cuda_ms": e.device_time_total / 1e3}
                       for e in prof.key_averages() if e.device_time_total > 0}  # fmt: skip
            row = {
                "ms": median_ms(call, args.rep_ms),
                "host_ms": 1e3 * min(host_times(call, 3, 1)),
                "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]["cuda_ms"])),
            }
            record["calls"][f"{name}/{where} offsets"] = row
            top = list(row["kernels"].items())[:4]
            top = ", ".join(f"{k[:40]} {v['cuda_ms']:.3f} ms x{v['calls']}" for k, v in top)
            print(f"{name} {where}: {row['ms']:.3f} ms (host {row['host_ms']:.2f}); {top}", flush=True)
    write_json(args.out, record)


if __name__ == "__main__":
    main()
