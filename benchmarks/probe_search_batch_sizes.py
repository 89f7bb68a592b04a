"""Exact search time by query batch size on the 8 GB resident corpus of `bench_serve.py` (the public
`search`, in process, one query of 32 tokens per request), and the server's scoring step
(`Scorer.score` on single-query jobs) at some of those sizes: what a served search batch of that size
costs without HTTP, the hop or the event loop beside it. The corpus is built under --workdir unless
there (bench_serve's, the same seed).

    python benchmarks/probe_search_batch_sizes.py \
        --out benchmarks/results/serve/in-flight/search-batch-sizes-h200.json
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import numpy as np
import torch
from bench_serve import DISTINCT, make_queries
from common import build_corpus, host_times, make_log, meta, write_json

log = make_log("search_batch_sizes")
SIZES = (1, 8, 16, 24, 31, 32, 48, 64)  # at most DISTINCT: the queries bench_serve's clients send
SCORER_SIZES = (16, 31, 64)


def median_ms(fn: Callable[[], object], repeats: int = 7) -> float:
    """Median host milliseconds of a call after one warm-up (each call ends with its results on the
    host, so the host clock holds its GPU work)."""
    return round(float(np.median(host_times(fn, repeats, warmup=1))) * 1e3, 3)


def main() -> None:
    from maxsim_cli import Queries, open_corpus, search
    from maxsim_cli.service.batching import Job, Scorer
    from maxsim_cli.service.schema import Parsed

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="/var/tmp/mb-serve")
    parser.add_argument("--size", default="8GB")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from maxsim_cli.units import parse_size

    root = os.path.join(args.workdir, f"corpus-{args.size}")
    paths = build_corpus(root, parse_size(args.size), 512 << 20, torch.device("cuda"))  # bench_serve's
    queries = make_queries(DISTINCT, seed=12)
    ids = [f"q{i:03d}" for i in range(DISTINCT)]
    record: dict = {"meta": meta(), "search_ms": {}, "scorer_ms": {}}
    with open_corpus(paths) as corpus:
        corpus.to("cuda")
        scorer = Scorer(corpus)
        for n in SIZES:
            batch = Queries.from_embeddings(ids[:n], queries[:n])
            record["search_ms"][n] = median_ms(lambda batch=batch: search(batch, corpus, k=10))
            if n in SCORER_SIZES:
                jobs = [
                    Job("search", Parsed(Queries.from_embeddings([ids[i]], [queries[i]]), 10))
                    for i in range(n)
                ]
                record["scorer_ms"][n] = median_ms(lambda jobs=jobs: scorer.score(jobs))
            per_query = record["search_ms"][n] / n
            log(f"{n:4d} queries: search {record['search_ms'][n]} ms ({per_query:.3f} a query), "
                f"scoring step {record['scorer_ms'].get(n, '-')} ms")  # fmt: skip
    write_json(args.out, record)


if __name__ == "__main__":
    main()
