"""Looking up a first-stage run's candidates in a corpus: `Corpus.candidate_index` (through the id lookup,
`Corpus.id_lookup`, built at its first call) against the dict of every id (`Corpus.id_index`), on 2M ids
in 10 shards (documents of one token, dim 16; CPU).

    python benchmarks/probe_candidate_index.py --workdir /var/tmp/bigids
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from maxsim_cli.shards import open_corpus, write_shard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/var/tmp/bigids")
    parser.add_argument("--docs-per-shard", type=int, default=200_000)
    parser.add_argument("--shards", type=int, default=10)
    parser.add_argument("--candidates", default="100000,1000000")
    args = parser.parse_args()
    n, shards = args.docs_per_shard, args.shards
    done = os.path.join(args.workdir, ".complete")
    if not os.path.exists(done):
        os.makedirs(args.workdir, exist_ok=True)
        perm = np.random.default_rng(0).permutation(n * shards)
        emb = torch.zeros(n, 16, dtype=torch.float16)
        emb[:, 0] = 1
        offsets = torch.arange(n + 1, dtype=torch.int64)
        for s in range(shards):
            ids = [str(int(i)) for i in perm[s * n : (s + 1) * n]]
            path = os.path.join(args.workdir, f"s{s:03d}.safetensors")
            write_shard(path, ids, emb, offsets=offsets, dtype="float16", normalized=True)
        open(done, "w").close()
    for count in (int(c) for c in args.candidates.split(",")):
        corpus = open_corpus([args.workdir])
        all_ids = corpus.id_order()[0]
        picks = np.random.default_rng(1).integers(0, corpus.num_docs, count)
        docnos = all_ids.take(picks).to_pylist()
        t0 = time.perf_counter()
        small = corpus.candidate_index(docnos)
        found = [small.get(d) for d in docnos]
        t1 = time.perf_counter()
        full = corpus.id_index()
        expected = [full.get(d) for d in docnos]
        t2 = time.perf_counter()
        assert found == expected
        print(f"{corpus.num_docs} ids, {count} candidates: candidate_index and lookups {t1 - t0:.2f} s, "
              f"id_index and lookups {t2 - t1:.2f} s", flush=True)  # fmt: skip
        corpus.close()


if __name__ == "__main__":
    main()
