"""Recall of the exact top-k in the compressed tier's top N (`maxsim score --exact-from`'s depth).

For each codec (`maxsim quantize --bits 8/4/2`) the compressed corpus is searched for every query's top
N, and the exact (float) top-k is looked for in it: recall@k(N) = |exact top-k within compressed top-N| / k,
averaged over the queries. The two-stage search returns exactly the exact top-k whenever that recall is 1.

    python benchmarks/two_stage_recall.py --corpus sample_data/corpus \
        --queries sample_data/queries.safetensors --device cpu
    python benchmarks/two_stage_recall.py --random 10000 --device cpu

Prints one table row per (codec, k, depth); with --json, one JSON object per row on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np
import torch

from maxsim_cli import open_corpus, read_queries, search
from maxsim_cli.quantize import quantize_corpus
from maxsim_cli.shards import write_shard

DEPTHS = (10, 20, 50, 100, 200, 300, 500, 1000, 2000)


def random_ragged(folder: str, num_docs: int, num_queries: int, dim: int, seed: int) -> tuple[str, str]:
    """A float16 corpus of random unit vectors, 20-300 tokens a document, and queries of 32 tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 301, size=num_docs)
    values = torch.from_numpy(rng.standard_normal((int(lengths.sum()), dim), dtype=np.float32))
    values = torch.nn.functional.normalize(values, dim=1).half()
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    docs = [values[offsets[i] : offsets[i + 1]] for i in range(num_docs)]
    corpus = os.path.join(folder, "corpus")
    os.makedirs(corpus)
    write_shard(os.path.join(corpus, "shard-0.safetensors"), [f"d{i}" for i in range(num_docs)], docs)
    q = torch.from_numpy(rng.standard_normal((num_queries * 32, dim), dtype=np.float32))
    q = torch.nn.functional.normalize(q, dim=1).half()
    queries = os.path.join(folder, "queries.safetensors")
    write_shard(queries, [f"q{i}" for i in range(num_queries)], list(q.split(32)))
    return corpus, queries


def recall_rows(
    exact: dict, compressed: dict, ks: list[int], depths: list[int]
) -> list[tuple[int, int, float, float]]:
    """(k, depth, mean recall, worst query's recall) for every k and depth."""
    rows = []
    for k in ks:
        for depth in depths:
            if depth < k:
                continue
            per_query = []
            for qid, ranked in exact.items():
                want = {d for d, _ in ranked[:k]}
                got = {d for d, _ in compressed.get(qid, [])[:depth]}
                per_query.append(len(want & got) / len(want))
            rows.append((k, depth, float(np.mean(per_query)), float(np.min(per_query))))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", help="float corpus folder (default: random ragged data)")
    parser.add_argument("--queries", help="query shard (with --corpus)")
    parser.add_argument("--random", type=int, default=20000, help="documents of the random corpus")
    parser.add_argument("--random-queries", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--bits", default="8,4,2")
    parser.add_argument("--ks", default="10,100")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        if args.corpus:
            corpus_path, queries_path = args.corpus, args.queries
        else:
            corpus_path, queries_path = random_ragged(
                tmp, args.random, args.random_queries, args.dim, args.seed
            )
        queries = read_queries(queries_path)
        with open_corpus(corpus_path) as corpus:
            num_docs = len(corpus)
            depths = [d for d in DEPTHS if d <= num_docs] or [num_docs]
            exact = search(queries, corpus, k=max(ks), device=args.device).to_dict()
        label = args.corpus or f"random ragged {args.random} docs x 20-300 tokens, dim {args.dim}"
        for bits in [int(b) for b in args.bits.split(",")]:
            out = os.path.join(tmp, f"bits{bits}")
            quantize_corpus(
                [corpus_path], out, bits=bits, device=args.device, sample_queries=0, seed=args.seed
            )
            with open_corpus(out) as compressed:
                approx = search(queries, compressed, k=max(depths), device=args.device).to_dict()
            for k, depth, mean, worst in recall_rows(exact, approx, ks, depths):
                row = dict(corpus=label, bits=bits, k=k, depth=depth, recall=mean, worst=worst)
                if args.json:
                    print(json.dumps(row))
                else:
                    print(
                        f"bits {bits}  k {k:4d}  depth {depth:5d}  recall {mean:.4f}  worst query {worst:.2f}"
                    )


if __name__ == "__main__":
    main()
