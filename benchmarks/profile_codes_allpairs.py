"""Where all pairs of codes spend their time: 512 queries of 32 tokens x 50K ragged documents (20-300
tokens, d = 128) as int8, int4 and int2, each through `maxsim_varlen` with the query offsets on the device
and on the host. For each: which int8 kernel scored it (`maxsim_int8.hopper_allpairs`' answer, or the
Triton tiles), the median time (`triton.testing.do_bench`) and one call's host time; then a CUDA profile
(`torch.profiler`, three calls) of each codec in ``--profile``, kernel by kernel.

    python benchmarks/profile_codes_allpairs.py --out benchmarks/results/codes/allpairs-profile-h100.json

``--device cpu --docs 300 --queries 8`` checks the script on a machine without a GPU (the torch paths; it
times and profiles nothing).
"""

from __future__ import annotations

import argparse

import torch
from common import host_times, median_ms, meta, sync, write_json


def main() -> None:
    from maxsim_kernels import maxsim_codes, maxsim_int8, maxsim_varlen
    from maxsim_kernels.maxsim_int8 import quantize_per_token
    from torch.profiler import ProfilerActivity, profile

    from maxsim_cli.codecs import Int2Grid, encode, fit_int2_levels

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=50_000)
    parser.add_argument("--queries", type=int, default=512)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rep-ms", type=int, default=300)
    parser.add_argument("--profile", default="int2,int4", help="codecs to profile kernel by kernel")
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

    # the path each call takes: the Gluon all-pairs kernel's answer, or the int8 Triton tiles
    taken: list[str] = []
    allpairs, tiles = maxsim_int8.hopper_allpairs, maxsim_int8._launch_varlen

    def logged_allpairs(*a, **k):  # noqa: ANN002, ANN003, ANN202
        module = allpairs(*a, **k)
        taken.append("gluon all pairs" if module is not None else "no gluon")
        return module

    def logged_tiles(*a, **k):  # noqa: ANN002, ANN003, ANN202
        taken.append("int8 triton tiles")
        return tiles(*a, **k)

    maxsim_int8.hopper_allpairs = maxsim_codes.hopper_allpairs = logged_allpairs
    maxsim_int8._launch_varlen = logged_tiles

    record: dict = {"meta": meta(dtype="float16", dim=128, queries=args.queries, documents=args.docs),
                    "calls": {}, "profiles": {}}  # fmt: skip
    timed = dev.type == "cuda"
    for where, offs in q_off.items():
        for name, (codes, kw) in stored.items():

            def call(codes=codes, kw=kw, offs=offs):  # noqa: ANN001, ANN202
                return maxsim_varlen(queries, offs, codes, offsets, **kw)

            taken.clear()
            call()
            sync()
            row = {"path": list(taken)}
            if timed:
                row["ms"] = median_ms(call, args.rep_ms)
                row["host_ms"] = 1e3 * min(host_times(call, 3, 1))
            record["calls"][f"{name}/{where} offsets"] = row
            print(name, where, row, flush=True)
    for name in filter(None, args.profile.split(",")):
        codes, kw = stored[name]
        if not timed:
            continue
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                maxsim_varlen(queries, q_off["device"], codes, offsets, **kw)
            sync()
        kernels = {e.key: {"calls": e.count, "cuda_ms": e.device_time_total / 1e3}
                   for e in prof.key_averages() if e.device_time_total > 0}  # fmt: skip
        record["profiles"][name] = dict(sorted(kernels.items(), key=lambda kv: -kv[1]["cuda_ms"])[:12])
        print(f"== {name} (3 calls)", flush=True)
        for key, v in record["profiles"][name].items():
            print(f"  {v['cuda_ms']:10.3f} ms  {v['calls']:4d}  {key[:70]}", flush=True)
    write_json(args.out, record)


if __name__ == "__main__":
    main()
