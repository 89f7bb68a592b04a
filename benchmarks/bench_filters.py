"""Filtered against unfiltered search time (`maxsim_cli.scoring.filters`), in process.

    python benchmarks/bench_filters.py --workdir /tmp/mb-filters --size 64MB --queries 16 \
        --out benchmarks/results/filters/filters-cpu.json
    python benchmarks/bench_filters.py --workdir /var/tmp/mb-filters --size 4GB --queries 64 \
        --out benchmarks/results/filters/filters-h100.json            # on a GPU

A ``--size`` corpus of ragged fp16 documents (`common.build_corpus`: d = 128, 20-300 tokens) and
``--queries`` queries of 32 tokens. Each case is a `search` (k = ``--k``) with a filter: the whole
corpus allowed through a mask (the masked scan's cost on top of the unfiltered one), an exclude list of
1% of the documents, include lists of a share of the documents scattered at random (``--shares``: from
50% down to 1%, across `filters.SUBSET_SHARE`, where the search scores the allowed documents as
candidates instead), and include lists of the first shards' documents (the scan skips the batches that
hold no allowed one). Both ways a search runs: streamed from the files (``streamed``: the engine) and
resident on the device (``resident``: the direct path when the score block fits it). Each case is timed
call by call alternating with the unfiltered search, which goes first every other call (medians of
``--rounds`` x ``--repeats`` calls after a warm-up), and its run checked first against an unfiltered
search's top-k of the allowed documents (k = the corpus size).

``--batch-filters N`` also times what a served batch of N search requests with N different filters
costs (`maxsim_cli.service.batching.Scorer`: one search a filter) against the same batch with one filter.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from common import build_corpus, build_queries, device, make_log, meta, write_json

log = make_log("filters")


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def cases(corpus, shares: list[float], seed: int = 0) -> list[tuple[str, dict]]:
    """(name, search keyword arguments) of each filter."""
    n = len(corpus)
    ids = np.asarray(corpus.ids, dtype=object)
    rng = np.random.default_rng(seed)
    out: list[tuple[str, dict]] = [("mask: all allowed", {"include": np.ones(n, dtype=bool)})]
    out.append(("exclude 1%", {"exclude": ids[rng.choice(n, max(1, n // 100), replace=False)].tolist()}))
    for share in shares:
        picked = rng.choice(n, max(1, int(n * share)), replace=False)
        out.append((f"include {share:.1%} scattered", {"include": ids[np.sort(picked)].tolist()}))
    starts = corpus.doc_starts
    for shards in (1, max(1, len(corpus.shards) // 4)):
        end = int(starts[min(shards, len(corpus.shards))])
        out.append((f"include the first {shards} shard(s) ({end / n:.1%})", {"include": ids[:end].tolist()}))
    return out


def check(queries, corpus, k: int, kwargs: dict, dev: str) -> None:
    """The filtered run is the unfiltered ranking's top-k of the allowed documents."""
    from maxsim_cli import search
    from maxsim_cli.scoring import filters

    disallowed = filters.disallowed_mask(corpus, **kwargs, log=lambda m: None)
    allowed = {d for d, bad in zip(corpus.ids, disallowed.tolist(), strict=True) if not bad}
    full = search(queries, corpus, k=len(corpus), device=dev).to_dict()
    got = search(queries, corpus, k=k, device=dev, **kwargs).to_dict()
    want = {q: [r for r in rows if r[0] in allowed][:k] for q, rows in full.items()}
    assert got == {q: rows for q, rows in want.items() if rows}, "a filtered run differs"


def run_mode(mode: str, paths: list[str], queries, args, dev: str) -> list[dict]:
    from maxsim_cli import open_corpus, search

    rows = []
    with open_corpus(paths) as corpus:
        if mode == "resident":
            corpus.to(dev)
        for name, kwargs in cases(corpus, args.shares):
            if args.check:
                check(queries, corpus, args.k, kwargs, dev)
            base: list[float] = []
            filt: list[float] = []
            path = search(queries, corpus, k=args.k, device=dev, **kwargs).stats.extra.get("filter", {})
            calls = {
                "base": lambda: search(queries, corpus, k=args.k, device=dev),
                "filt": lambda kw=kwargs: search(queries, corpus, k=args.k, device=dev, **kw),
            }
            for fn in calls.values():
                fn()  # warm-up
            times: dict[str, list[float]] = {"base": [], "filt": []}
            for r in range(args.rounds * args.repeats):  # call by call, alternating which goes first
                for way in ("base", "filt") if r % 2 else ("filt", "base"):
                    t0 = time.perf_counter()
                    calls[way]()
                    times[way].append(time.perf_counter() - t0)
            base, filt = times["base"], times["filt"]
            row = {
                "mode": mode,
                "case": name,
                "path": path.get("path"),
                "allowed": path.get("allowed"),
                "unfiltered_ms": round(float(np.median(base)) * 1e3, 2),
                "filtered_ms": round(float(np.median(filt)) * 1e3, 2),
            }
            row["ratio"] = round(row["filtered_ms"] / row["unfiltered_ms"], 3)
            log(str(row))
            rows.append(row)
    return rows


def batch_filters(paths: list[str], queries, args, dev: str) -> dict:
    """A served batch of N requests with N filters against the same batch with one filter."""
    from maxsim_cli import Queries, open_corpus
    from maxsim_cli.service.batching import Job, Scorer
    from maxsim_cli.service.schema import Parsed

    n = args.batch_filters
    with open_corpus(paths) as corpus:
        corpus.to(dev)
        ids = np.asarray(corpus.ids, dtype=object)
        rng = np.random.default_rng(1)
        filters_ = [ids[rng.choice(len(ids), len(ids) // 2, replace=False)].tolist() for _ in range(n)]
        one = Queries.from_embeddings(
            [queries.ids[0]], [queries.embeddings[int(queries.offsets[0]) : int(queries.offsets[1])]]
        )
        scorer = Scorer(corpus, device=dev)

        def batch(distinct: bool):
            jobs = [
                Job("search", Parsed(one, args.k, include=filters_[i if distinct else 0]), None)
                for i in range(n)
            ]
            return lambda: scorer.score(jobs)

        same, different = [], []
        for _ in range(args.rounds):
            same += timed(batch(False), args.repeats)
            different += timed(batch(True), args.repeats)
    row = {
        "requests": n,
        "one_filter_ms": round(float(np.median(same)) * 1e3, 2),
        "distinct_filters_ms": round(float(np.median(different)) * 1e3, 2),
    }
    log(str(row))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", default="/tmp/mb-filters")
    parser.add_argument("--size", default="64MB", help="corpus size (e.g. 64MB, 4GB)")
    parser.add_argument("--shard-size", default=None, help="shard size (default: an eighth of --size)")
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("-k", "--k", type=int, default=10)
    parser.add_argument(
        "--shares", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 0.1, 0.05, 0.04, 0.01]
    )
    parser.add_argument("--modes", default="streamed,resident")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-filters", type=int, default=8)
    parser.add_argument("--no-check", dest="check", action="store_false")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from maxsim_cli import read_queries
    from maxsim_cli.units import parse_size

    dev = device()
    size = parse_size(args.size)
    shard = parse_size(args.shard_size) if args.shard_size else max(size // 8, 1 << 20)
    paths = build_corpus(os.path.join(args.workdir, f"corpus-{args.size}"), size, shard, dev)
    qpath = os.path.join(args.workdir, f"queries-{args.queries}.safetensors")
    if not os.path.exists(qpath):
        build_queries(qpath, args.queries, dev)
    queries = read_queries(qpath)
    results = {"meta": meta(size=args.size, queries=args.queries, k=args.k), "cases": []}
    for mode in args.modes.split(","):
        results["cases"] += run_mode(mode, paths, queries, args, str(dev))
        write_json(args.out, results)
    if args.batch_filters > 1:
        results["batch_filters"] = batch_filters(paths, queries, args, str(dev))
    write_json(args.out, results)


if __name__ == "__main__":
    main()
