"""Tile sweep of the forward *with argmax* (the training forward) at the training shapes of bench_train.py.

The main tuning table in `kernels/maxsim_forward.py` was measured for scores only; with `return_argmax` the
all-pairs kernels keep a running max and argmax per query row instead of per tile element, and the
ColBERT training step at 256 documents is now bound by that forward on the GPU (docs/benchmarks.md,
Training). This times the table's choice against other tiles on the same tensors, in one run, and
checks that every tile gives bitwise the same scores and argmax as the table's.

    python benchmarks/sweep_argmax_forward.py --out benchmarks/results/train/argmax-sweep-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from common import TRAIN_SHAPES, training_inputs, write_json
from maxsim_kernels import maxsim_forward as fwd
from triton.testing import do_bench

# (block_q, block_t, docs_per_prog, num_warps, num_stages); None = the tuning table's choice
COLBERT_TILES = [
    None,
    (128, 64, 64, 4, 3),
    (128, 64, 16, 4, 3),
    (256, 64, 64, 8, 2),
    (128, 32, 64, 4, 3),
    (64, 64, 64, 4, 3),
    (128, 128, 16, 8, 2),
    (256, 32, 16, 4, 2),
    (256, 32, 64, 8, 2),
    (256, 32, 64, 4, 2),  # the scores-only entry of the "many" class
]
COLPALI_TILES = [None, (128, 64, 1, 8, 2), (64, 64, 1, 4, 3), (128, 128, 1, 8, 2), (256, 64, 1, 8, 2)]


def run_tile(x: dict, config: fwd.KernelConfig | None) -> tuple[torch.Tensor, torch.Tensor]:
    return fwd.maxsim_varlen_forward_triton(
        x["q"], x["qo"], x["d"], x["do"], return_argmax=True, argmax_dtype=None, config=config
    )


def time_tile(x: dict, config: fwd.KernelConfig | None, base: tuple[torch.Tensor, torch.Tensor]) -> dict:
    out = run_tile(x, config)
    same = bool(torch.equal(out[0], base[0]) and torch.equal(out[1], base[1]))
    ms = do_bench(lambda: run_tile(x, config), warmup=25, rep=200, return_mode="median")
    return {"ms": ms, "same_as_table": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for shape, tiles in (("colbert-128", COLBERT_TILES), ("colbert-256", COLBERT_TILES),
                         ("colpali-32", COLPALI_TILES)):  # fmt: skip
        x = training_inputs(*TRAIN_SHAPES[shape], torch.float16, seed=0)
        base = run_tile(x, None)
        for tile in tiles:
            row: dict = {"shape": shape, "tile": tile or "table"}
            try:
                row |= time_tile(x, None if tile is None else fwd.KernelConfig(*tile), base)
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile is a result too
                row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_json(args.out, {"command": " ".join(sys.argv), "rows": rows})
    print("\nshape         tile                        ms    same")
    for r in rows:
        same = r.get("same_as_table", r.get("error", ""))
        print(f"{r['shape']:13s} {str(r['tile']):26s} {r.get('ms', float('nan')):7.3f}  {same}")


if __name__ == "__main__":
    main()
