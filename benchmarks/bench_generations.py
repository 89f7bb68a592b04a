"""What a delete costs: `maxsim delete` of 1% of a corpus of many tiny documents (its commit time), and
an exhaustive search before and after it, alternating.

    python benchmarks/bench_generations.py --workdir /tmp/mb-gen --docs 2000000 \
        --out benchmarks/results/generations/delete-cpu.json

A corpus of ``--docs`` documents of 1-4 tokens (dim ``--dim``, float16) in ``--shards`` shards, written
with the shard writer (a folder with `index.json`). Then ``--share`` of its ids, drawn at random, are
deleted by the `maxsim delete` command in a subprocess (the time it takes, and the commit alone as the
command reports it), and a search of ``--queries`` queries (k = ``--k``) on the CPU is timed on the old
generation (opened before the delete, kept by its reader lock) and the new one, alternating, medians of
``--repeats`` calls after a warm-up each.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np
from common import make_log, meta, write_json

log = make_log("generations")


def build(folder: str, docs: int, shards: int, dim: int, seed: int) -> None:
    from maxsim_cli.shards import write_manifest
    from maxsim_cli.shards.writers import ShardWriter

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    per = -(-docs // shards)
    for s in range(shards):
        first, stop = s * per, min(docs, (s + 1) * per)
        lengths = rng.integers(1, 5, stop - first)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        rows = rng.standard_normal((int(offsets[-1]), dim), dtype=np.float32).astype(np.float16)
        with ShardWriter(os.path.join(folder, f"part{s:03d}.safetensors"), dim, "float16") as writer:
            writer.add([f"d{i}" for i in range(first, stop)], rows, offsets=offsets)
    write_manifest(folder)


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--docs", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--share", type=float, default=0.01)
    parser.add_argument("--queries", type=int, default=4)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()

    import torch

    from maxsim_cli import Queries, open_corpus, search

    folder = os.path.join(args.workdir, "corpus")
    if not os.path.exists(os.path.join(folder, "index.json")):
        t0 = time.perf_counter()
        build(folder, args.docs, args.shards, args.dim, seed=1)
        log(f"built {args.docs:,} documents in {time.perf_counter() - t0:.1f} s")
    rng = np.random.default_rng(2)
    queries = Queries.from_embeddings(
        [f"q{i}" for i in range(args.queries)],
        [rng.standard_normal((8, args.dim)).astype(np.float32) for _ in range(args.queries)],
    )
    old = open_corpus(folder)
    gone = rng.choice(len(old), size=int(len(old) * args.share), replace=False)
    ids_file = os.path.join(args.workdir, "gone.txt")
    with open(ids_file, "w") as f:
        f.write("\n".join(f"d{i}" for i in sorted(gone.tolist())) + "\n")
    command = [sys.executable, "-m", "maxsim_cli", "delete", folder, "--ids", ids_file]
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    delete_s = time.perf_counter() - t0
    log(f"delete of {len(gone):,} ids: {delete_s:.2f} s ({done.stderr.strip()})")
    new = open_corpus(folder)
    assert new.num_deleted == len(gone) and new.generation == old.generation + 1

    def one(corpus) -> float:
        t = time.perf_counter()
        search(queries, corpus, k=args.k, device="cpu")
        return time.perf_counter() - t

    one(old), one(new)  # warm-up
    before, after = [], []
    for r in range(args.repeats):
        pair = [(old, before), (new, after)] if r % 2 == 0 else [(new, after), (old, before)]
        for corpus, times in pair:
            times.append(one(corpus))
    b, a = float(np.median(before)), float(np.median(after))
    log(f"search before {b * 1e3:.1f} ms, after {a * 1e3:.1f} ms: {a / b:.3f}x")
    result = {
        "meta": meta(),
        "command": " ".join(["python", *sys.argv]),
        "docs": len(old),
        "tokens": old.num_tokens,
        "dim": args.dim,
        "shards": args.shards,
        "deleted": len(gone),
        "delete_command_s": delete_s,
        "delete_output": done.stderr.strip(),
        "search_before_s": before,
        "search_after_s": after,
        "search_before_median_s": b,
        "search_after_median_s": a,
        "ratio": a / b,
        "torch_threads": torch.get_num_threads(),
    }
    old.close()
    new.close()
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
