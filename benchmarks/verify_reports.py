"""Produce the `maxsim verify` reports that docs/verify.md and the README show.

Runs, on the chosen device, the verify commands on `sample_data/` in fp16 (as shipped), bf16 (packed from
the Arrow copy) and int8 (quantized from the fp16 shards, judged against its float source), the rerank
layout with `--grad`, and the timing of 100 queries x 10,000 ColBERT-shaped documents. Each command's
output goes to `OUTDIR/<name>.txt`, a summary table to stdout.

    python benchmarks/verify_reports.py --device cuda --out "$OUT"     # on the H200
    python benchmarks/verify_reports.py --device cpu --out /tmp/vr     # on a CPU machine
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time

import torch


def make_timing_data(root: str) -> None:
    """100 queries x 32 tokens and 10,000 documents of 20-300 tokens, dim 128, fp16, unit vectors."""
    from maxsim_cli.shards import write_shard

    g = torch.Generator().manual_seed(0)
    os.makedirs(f"{root}/corpus", exist_ok=True)
    for s in range(4):
        lens = torch.randint(20, 301, (2500,), generator=g)
        emb = torch.nn.functional.normalize(torch.randn(int(lens.sum()), 128, generator=g), dim=-1)
        off = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
        write_shard(
            f"{root}/corpus/shard-{s}.safetensors",
            [f"d{s}-{i}" for i in range(2500)],
            emb,
            offsets=off,
            dtype="float16",
        )
    q = torch.nn.functional.normalize(torch.randn(3200, 128, generator=g), dim=-1)
    write_shard(
        f"{root}/queries.safetensors",
        [f"q{i}" for i in range(100)],
        q,
        offsets=torch.arange(0, 3201, 32),
        dtype="float16",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True, help="directory for the reports")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="maxsim-verify-reports-")
    dev = ["--device", args.device]
    q = "sample_data/queries.safetensors"
    steps = [
        ("fp16", ["maxsim", "verify", q, "sample_data/corpus", *dev]),
        (
            "pack-bf16",
            [
                "maxsim",
                "pack",
                "sample_data/corpus.arrow",
                "-o",
                f"{work}/corpus-bf16",
                "--dtype",
                "bfloat16",
            ],
        ),
        ("bf16", ["maxsim", "verify", q, f"{work}/corpus-bf16", *dev]),
        ("quantize-int8", ["maxsim", "quantize", "sample_data/corpus", "-o", f"{work}/corpus-int8", *dev]),
        (
            "int8",
            ["maxsim", "verify", q, f"{work}/corpus-int8", "--reference-corpus", "sample_data/corpus", *dev],
        ),
        (
            "rerank-grad",
            [
                "maxsim",
                "verify",
                q,
                "sample_data/corpus",
                *dev,
                "--candidates",
                "sample_data/candidates.trec",
                "--grad",
            ],
        ),
        (
            "timing-100x10k",
            ["maxsim", "verify", f"{work}/timing/queries.safetensors", f"{work}/timing/corpus", *dev],
        ),
    ]
    make_timing_data(f"{work}/timing")
    rows = []
    for name, cmd in steps:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        shown = " ".join(shlex.quote(c) for c in cmd).replace(work, "/tmp")
        with open(os.path.join(args.out, f"verify-{name}.txt"), "w") as f:
            f.write(f"$ {shown}\n{proc.stdout}{proc.stderr}exit code {proc.returncode}, {wall:.2f} s wall\n")
        rows.append((name, proc.returncode, wall))
        print(f"--- {name} (exit {proc.returncode}, {wall:.2f} s)\n{proc.stdout}{proc.stderr}", flush=True)
    print(f"{'step':<16}{'exit':>6}{'wall s':>10}")
    for name, code, wall in rows:
        print(f"{name:<16}{code:>6}{wall:>10.2f}")
    sys.exit(0)


if __name__ == "__main__":
    main()
