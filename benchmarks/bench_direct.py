"""Calls on a resident corpus: the direct path (`maxsim_cli.scoring.direct`) against the engine, in process.

    python benchmarks/bench_direct.py --workdir /tmp/mb-direct --out benchmarks/results/serve/direct-h200.json

The calls `maxsim serve` makes: a rerank of one query (32 tokens) against 1,000 candidates of 180 tokens
(the rerank corpus of `bench_serve.py`, 20,000 documents), and a search (k = 10) of one and of 64 queries
over a ``--size`` corpus of ragged documents (`common.build_corpus`), all resident on the device. Each
is timed through the public `search` / `rerank` call (wall time, median and p99 of ``--repeats``, after
a warm-up), once on the direct path and once with it switched off (the engine), alternating so that both
see the same machine; the two runs are checked equal first.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import torch
from bench_serve import build_rerank_corpus, make_queries
from common import build_corpus, device, host_times, make_log, meta, write_json

log = make_log("direct")


def compare(name: str, fn: Callable[[], object], repeats: int, rounds: int = 3) -> dict[str, object]:
    """Direct against engine, ``rounds`` alternating rounds of ``repeats`` calls each."""
    from maxsim_cli.scoring import direct

    eligible = direct.eligible
    times: dict[str, list[float]] = {"direct": [], "engine": []}
    for _ in range(rounds):
        for way in ("direct", "engine"):
            direct.eligible = eligible if way == "direct" else (lambda *args: None)
            try:
                times[way] += host_times(fn, repeats, warmup=5)
            finally:
                direct.eligible = eligible
    row: dict[str, object] = {}
    for way, ts in times.items():
        ms = np.asarray(ts) * 1e3
        row[way] = {
            "n": len(ms),
            "p50_ms": round(float(np.median(ms)), 3),
            "p99_ms": round(float(np.percentile(ms, 99)), 3),
        }
    log(f"{name}: direct {row['direct']} engine {row['engine']}")
    return row


def same_run(fn: Callable[[], object]) -> bool:
    from maxsim_cli.scoring import direct

    first = fn()
    eligible = direct.eligible
    direct.eligible = lambda *args: None
    try:
        return first == fn()
    finally:
        direct.eligible = eligible


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/mb-direct")
    parser.add_argument("--size", default="2GiB", help="the search corpus (default 2GiB)")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--out")
    args = parser.parse_args()

    from maxsim_cli import Queries, open_corpus, rerank, search
    from maxsim_cli.units import parse_size

    dev = device()
    where = f"cuda:{dev.index or 0}" if dev.type == "cuda" else "cpu"
    queries = make_queries(64, seed=11)
    one = Queries.from_embeddings(["q"], [queries[0]])
    many = Queries.from_embeddings([f"q{i}" for i in range(64)], queries)
    results: dict[str, object] = {}
    path = build_rerank_corpus(args.workdir, 20000, dev)
    candidates = {"q": [f"r{i:07d}" for i in np.random.default_rng(5).choice(20000, 1000, replace=False)]}
    with open_corpus(path) as corpus:
        corpus.to(where)
        corpus.id_index()  # as `maxsim serve` keeps it

        def call() -> object:
            return rerank(one, corpus, candidates)

        results["rerank_1x1000x180"] = {"runs_equal": same_run(call), **compare("rerank", call, args.repeats)}
    paths = build_corpus(f"{args.workdir}/search", parse_size(args.size), 512 << 20, dev)
    with open_corpus(paths) as corpus:
        corpus.to(where)
        for name, q, repeats in (
            ("search_1q", one, args.repeats),
            ("search_64q", many, max(5, args.repeats // 5)),
        ):

            def call(q=q) -> object:  # noqa: ANN001
                return search(q, corpus, k=10)

            results[name] = {"runs_equal": same_run(call), **compare(name, call, repeats)}
        results["search_corpus"] = {"documents": len(corpus), "tokens": corpus.num_tokens}
    write_json(
        args.out,
        {
            **meta(),
            **results,
        },
    )


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
