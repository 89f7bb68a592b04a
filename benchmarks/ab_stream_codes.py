"""int4 and int2 codes (and int8 values) on the Gluon stream kernel against another version of that kernel,
or against other tiles of the same one, in one process: the scores compared bit for bit, then alternating
`do_bench` rounds. Needs an sm_90 GPU.

The other version is a module inside `maxsim_kernels` (so its relative imports resolve), e.g. the kernel of
commit BASE with its unpacking module:

    git show BASE:kernels/code_unpacking.py > kernels/_base_unpack.py
    git show BASE:kernels/maxsim_int8_hopper_stream.py \\
        | sed 's/from .code_unpacking import/from ._base_unpack import/' > kernels/_base_stream.py
    python benchmarks/ab_stream_codes.py --baseline _base_stream --out benchmarks/results/codes/ab-....json

Tiles of one kernel against others (`stream_with_tiles`' keywords, integers; 0 and 1 for booleans), e.g.
the walk of one query by the offsets against the corpus's walk table:

    python benchmarks/ab_stream_codes.py --codecs int8,int4,int2 --baseline-tiles table=0 \
        --current-tiles table=1 --out benchmarks/results/codes/ab-walk-table-h100.json

Cases: one query of 32, 13 and (int4) 64 tokens against 100K documents of 20-300 tokens (16.0M tokens,
random unit vectors), and 64 queries of 32 tokens (`--candidates-tokens`) x 1,000 candidates each (every
997th index out of range: NaN in both); int4 codes (`encode int4-per-token`), int2 codes on a grid fitted
on 262,144 tokens, and int8 values (`quantize_per_token`; one query of 32 tokens and the candidates).
A configuration that does not build or launch at a case (a register cap ptxas refuses at that query tile)
is recorded there as ``failed`` with the error's last line, and the others are timed.
"""

from __future__ import annotations

import argparse
import importlib
import statistics

import torch
import triton.testing
from common import meta, ragged, write_json


def main() -> None:
    from maxsim_kernels import codes_host
    from maxsim_kernels import maxsim_int8_hopper_stream as current
    from maxsim_kernels.int8_host import quantize_per_token

    from maxsim_cli.codecs import Int2Grid, encode, fit_int2_levels

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a maxsim_kernels module: the other kernel (default: this one)")
    parser.add_argument("--baseline-tiles", default="", help="k=v,...: the baseline's stream_with_tiles")
    parser.add_argument(
        "--current-tiles",
        action="append",
        default=None,
        help="k=v,...: the current kernel's keywords; repeated: several configurations, each "
        "timed in the same rounds against the baseline",
    )
    parser.add_argument("--codecs", default="int2,int4", help="of int2, int4, int8")
    parser.add_argument("--candidates-tokens", type=int, default=32,
                        help="the candidates case's query tokens (int2: at most 32)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rep-ms", type=int, default=300)
    parser.add_argument("--out")
    args = parser.parse_args()
    base = importlib.import_module(f"maxsim_kernels.{args.baseline}") if args.baseline else current
    currents = args.current_tiles or [""]
    labels = ["current"] if len(currents) == 1 else [f"current:{text}" for text in currents]
    tiles = {"baseline": keywords(args.baseline_tiles)}
    tiles.update({key: keywords(text) for key, text in zip(labels, currents, strict=True)})
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    n_docs = 100_000
    docs, offsets = ragged(n_docs, 20, 300, torch.Generator(device=dev).manual_seed(0), dev)
    sample = docs[torch.randperm(docs.shape[0], generator=gen)[: 1 << 18].to(dev)]
    grid = Int2Grid(*fit_int2_levels(sample))
    levels = grid.for_kernels(dev)
    codes = {"int4": encode("int4-per-token", docs, None), "int2": encode("int2-grid", docs, grid)}
    if "int8" in codecs:
        codes["int8"] = quantize_per_token(docs)

    def query_side(codec: str, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if codec == "int2":  # the int8 scan of q * steps, without the rows' offsets (the same in both)
            side = codes_host.int2_queries(q, levels)
            return side.q8, side.scales
        return quantize_per_token(q)

    def unit(rows: int) -> torch.Tensor:
        q = torch.nn.functional.normalize(torch.randn(rows, 128, generator=gen), dim=1)
        return q.to(dev, torch.float16)

    cases = []
    for codec in codecs:
        for q_len in {"int2": (32, 13), "int4": (32, 13, 64), "int8": (32,)}[codec]:
            q8, sq = query_side(codec, unit(q_len))
            q_off = torch.tensor([0, q_len], device=dev)
            cases.append((f"{codec}/one_query/q{q_len}", codec, q8, sq, q_off, None, None, q_len))
        tokens = min(args.candidates_tokens, 32) if codec == "int2" else args.candidates_tokens
        q8, sq = query_side(codec, unit(64 * tokens))
        q_off = torch.arange(0, 64 * tokens + 1, tokens, device=dev)
        item_off = torch.arange(0, 64 * 1000 + 1, 1000, device=dev)
        items = torch.randint(0, n_docs, (64 * 1000,), generator=gen)
        items[::997] = n_docs + 5
        name = "candidates/64x1000" + ("" if tokens == 32 else f"/q{tokens}")
        cases.append((f"{codec}/{name}", codec, q8, sq, q_off, item_off, items.to(dev), tokens))

    record = {"meta": meta(baseline=args.baseline, tiles=tiles, tokens=int(offsets[-1])), "cases": {}}
    for name, codec, q8, sq, q_off, item_off, items, q_len in cases:
        c, s = codes[codec]

        def call(module, cfg, q8=q8, sq=sq, q_off=q_off, item_off=item_off, items=items, c=c, s=s,
                 q_len=q_len, codec=codec):  # fmt: skip
            return lambda: module.stream_with_tiles(q8, sq, q_off, item_off, items, c, s, offsets, q_len,
                                                    int2=codec == "int2", **cfg)  # fmt: skip

        fns = {key: call(base if key == "baseline" else current, cfg) for key, cfg in tiles.items()}
        first = fns["baseline"]().view(torch.int32)
        same: dict[str, bool] = {}
        failed: dict[str, str] = {}  # configurations that do not build or launch at this case
        for key, fn in list(fns.items()):
            if key == "baseline":
                continue
            try:
                same[key] = bool(torch.equal(first, fn().view(torch.int32)))
            except Exception as exc:  # e.g. ptxas refusing a cap at this N: recorded, the others timed
                lines = str(exc).strip().splitlines()
                failed[key] = f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:300]
                del fns[key]
        times: dict[str, list[float]] = {key: [] for key in fns}
        order = list(fns.items())
        for r in range(args.rounds):
            for key, fn in order[r % len(order) :] + order[: r % len(order)]:  # a rotating order
                times[key].append(triton.testing.do_bench(fn, rep=args.rep_ms, return_mode="median"))
        ms = {key: statistics.median(ts) for key, ts in times.items()}
        entry = {"nan": int(first.view(torch.float32).isnan().sum()), "baseline_ms": ms["baseline"],
                 "rounds_ms": times}  # fmt: skip
        for key in labels:
            suffix = key[len("current") :]
            if key in failed:
                entry[f"failed{suffix}"] = failed[key]
                print(f"{name}: {key} failed: {failed[key]}", flush=True)
                continue
            entry[f"bitwise_equal{suffix}"] = same[key]
            entry[f"current_ms{suffix}"] = ms[key]
            entry[f"speedup{suffix}"] = ms["baseline"] / ms[key]
            print(f"{name}: baseline {ms['baseline']:.4f} ms  {key} {ms[key]:.4f} ms  "
                  f"x{ms['baseline'] / ms[key]:.3f}  equal {same[key]}", flush=True)  # fmt: skip
        record["cases"][name] = entry
        write_json(args.out, record)


def keywords(text: str) -> dict[str, int]:
    """``k=v,...`` as stream_with_tiles keywords (integer values)."""
    pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
    return {k.strip(): int(v) for k, v in pairs}


if __name__ == "__main__":
    main()
