"""One query against int8 shards and 4-bit and 2-bit codes on the CPU: the streamed int8 path
(`maxsim_kernels.cpu.maxsim_int8_varlen_cpu`) beside the blocked torch paths it replaced and the float path,
alternating rounds in one process, each result checked bitwise against the blocked path's.

    python benchmarks/bench_cpu_codes.py --out benchmarks/results/cpu/cpu-codes-2core.json
    python benchmarks/bench_cpu_codes.py --skip-blocked --out benchmarks/results/cpu/cpu-codes-products.json
    python benchmarks/bench_cpu_codes.py --smoke --out /tmp/cpu-codes.json

Documents: ``--docs`` L2-normalised random vectors (d = 128), 20-300 tokens each (uniform), fp32; int8 per
token (`quantize_per_token`), int4 (`encode_int4`), int2 (`encode_int2` on a grid fitted to 65,536 of the
tokens, `maxsim_cli.codecs.fit_int2_levels`). One query of 32 tokens. Each time is the median of
``--repeats`` calls, in ``--rounds`` rounds that alternate the order of the paths.

  fp32          `maxsim_varlen` on the float tokens (the float stream path)
  int8 / int4 / int2            `maxsim_varlen` on the codes: the streamed int8 path, the codes decoded a
                                32K-token chunk at a time on each worker
                                with the chunk's products in integers (`torch._int_mm`)
  *_fp32        the same streamed path with each chunk upcast to fp32 and an fp32 product (the choice
                where the CPU has no int8 dot-product instructions: `maxsim_kernels.cpu.int8_products`)
  *_blocked     the blocked torch path of the same codes (`int8_host._varlen_torch`; int4:
                `codes_host._varlen_torch`; int2: its odd values decoded whole, then the int8 path);
                with ``--skip-blocked`` run once for the bit check, not timed
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import (
    SMOKE,
    add_cpu_rounds_args,
    alternating_host_rounds,
    cpu_int8_products,
    make_log,
    meta,
    offsets_of,
    smoke_size,
    write_json,
)

log = make_log("cpu-codes", clock=True)


def main() -> None:
    from maxsim_kernels import code_packing, codes_host, cpu, int8_host, maxsim_varlen
    from maxsim_kernels.int8_host import quantize_per_token

    from maxsim_cli.codecs import fit_int2_levels

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cpu_rounds_args(parser, docs=20_000)
    parser.add_argument("--skip-blocked", action="store_true", help="time the streamed paths only")
    args = parser.parse_args()
    SMOKE["on"] = args.smoke
    n = smoke_size(args.docs, 20)
    if args.smoke:
        args.repeats, args.rounds = 1, 1
    gen = torch.Generator().manual_seed(0)
    offsets = offsets_of(torch.randint(20, 301, (n,), generator=gen))
    x = torch.nn.functional.normalize(torch.randn(int(offsets[-1]), 128, generator=gen), dim=1)
    q = torch.nn.functional.normalize(torch.randn(32, 128, generator=gen), dim=1)
    q_off = torch.tensor([0, 32])
    q8, sq = quantize_per_token(q)
    d8, s8 = quantize_per_token(x)
    c4, s4 = code_packing.encode_int4(x)
    levels = code_packing.Int2Levels(*(t.float() for t in fit_int2_levels(x[:65536])))
    c2, s2 = code_packing.encode_int2(x, levels)
    side = codes_host.int2_queries(q, levels, query_offsets=q_off)

    def int2_blocked() -> torch.Tensor:
        values = code_packing.int2_values(c2)
        out = int8_host._varlen_torch(side.q8, side.scales, q_off, values, s2, offsets, False)[0]
        return out.add_(side.query_sums[:, None])

    streamed = {
        "int8": lambda: maxsim_varlen(q, q_off, d8, offsets, doc_scales=s8),
        "int4": lambda: maxsim_varlen(q, q_off, c4, offsets, doc_scales=s4),
        "int2": lambda: maxsim_varlen(q, q_off, c2, offsets, doc_scales=s2, codebook=levels),
    }
    paths = {"fp32": lambda: maxsim_varlen(q, q_off, x, offsets)}
    for codec, fn in streamed.items():
        paths[codec] = cpu_int8_products(True, fn)
        paths[f"{codec}_fp32"] = cpu_int8_products(False, fn)
    blocked = {
        "int8_blocked": lambda: int8_host._varlen_torch(q8, sq, q_off, d8, s8, offsets, False)[0],
        "int4_blocked": lambda: codes_host._varlen_torch(q8, sq, q_off, c4, s4, offsets, None),
        "int2_blocked": int2_blocked,
    }
    if not args.skip_blocked:
        paths.update(blocked)
    record: dict = {"meta": meta(docs=n, tokens=int(offsets[-1]), dim=128, query_tokens=32)}
    record["bitwise_equal"] = {}
    results = {name: fn() for name, fn in {**paths, **blocked}.items()}
    for codec in ("int8", "int4", "int2"):
        for way in (codec, f"{codec}_fp32"):
            record["bitwise_equal"][way] = bool(torch.equal(results[way], results[f"{codec}_blocked"]))
    log(f"bitwise equal to the blocked paths: {record['bitwise_equal']}")
    record["ms"] = alternating_host_rounds(paths, args.rounds, args.repeats, log)
    record["median_ms"] = {k: statistics.median(v) for k, v in record["ms"].items()}
    med = record["median_ms"]
    if not args.skip_blocked:
        record["speedup_over_blocked"] = {c: med[f"{c}_blocked"] / med[c] for c in ("int8", "int4", "int2")}
    record["integer_over_fp32_products"] = {c: med[f"{c}_fp32"] / med[c] for c in ("int8", "int4", "int2")}
    record["over_fp32"] = {c: med[c] / med["fp32"] for c in ("int8", "int4", "int2")}
    record["int8_products_chosen"] = cpu.int8_products(128)
    log(f"medians: { {k: round(v, 1) for k, v in record['median_ms'].items()} }")
    write_json(args.out, record)


if __name__ == "__main__":
    main()
