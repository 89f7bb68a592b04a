"""The `score` benchmark's corpus, ready for the end-to-end A/B and probe scripts of `maxsim score`.

`prepare` builds (once, under --workdir) the 10 GB of fp16 shards that `bench_score.py` measures, their
int8 quantization (corpus-int8), 512 queries of 32 tokens and two small corpora (fp16 and int8), warms
the page cache, and runs `maxsim score` once on each small corpus so that the kernels are compiled and
loaded before anything is timed. `add_args` adds the options every such script takes.
"""

from __future__ import annotations

import argparse
import os

import bench_score
import torch

from maxsim_cli.quantize import quantize_corpus
from maxsim_cli.score import score


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", default="/var/tmp/mb")
    parser.add_argument("--size", default="10GB")
    parser.add_argument("--device", default="cuda", help="cuda (cpu: a check of the script)")
    parser.add_argument("--out", default=None)


def prepare(work: str, device: torch.device, size: str) -> tuple[dict[str, list[str]], str]:
    """(the corpus's shards by precision, "fp16" and "int8"; the query file), built and warmed up."""
    shard_bytes = 512 << 20 if device.type == "cuda" else 4 << 20
    total = bench_score.parse_size(size)
    paths = bench_score.build_corpus(os.path.join(work, "corpus"), total, shard_bytes, device)
    small = bench_score.build_corpus(os.path.join(work, "small"), 32 << 20, 16 << 20, device, seed=5)
    qpath = os.path.join(work, "queries.safetensors")
    if not os.path.exists(qpath):
        bench_score.build_queries(qpath, 512, device)
    int8_dir = os.path.join(work, "corpus-int8")
    if not os.path.isdir(int8_dir):
        quantize_corpus(paths, int8_dir, device=device.type, sample_queries=0)
    small8 = os.path.join(work, "small-int8")
    if not os.path.isdir(small8):
        quantize_corpus(small, small8, device=device.type, sample_queries=0)
    bench_score.read_files(paths, os.cpu_count() or 1)  # warm the page cache
    for corpus in (small, [small8]):
        score(
            qpath, corpus, output=os.path.join(work, "warm-up.trec"), device=device.type, log=lambda m: None
        )
    return {"fp16": paths, "int8": [int8_dir]}, qpath
