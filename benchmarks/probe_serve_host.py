"""The host side of one served rerank request, without a GPU: every step but the kernel, timed apart.

    python benchmarks/probe_serve_host.py --workdir /tmp/mb-serve-host \
        --out benchmarks/results/serve/serve-host-cpu.json

A rerank request of `bench_serve.py` (1 query of 32 tokens, 1000 candidates of 180 tokens, JSON, every
candidate returned) goes through the steps of `maxsim serve --workers 0` in process, on a corpus resident
on the CPU, with `maxsim_candidates` replaced by a function that returns one score a candidate at once,
so that what is timed is the request's Python: parsing and checking the JSON, the batcher's scorer (for
a corpus resident on one device its own step, `Scorer._rerank_resident`: docnos to corpus positions, the
launch's inputs, the trec_eval order of the hits), and encoding the answer. On the H200 host the same
Python ran 2-3.6x slower than on the 2-core development machine (docs/serve.md), and it is most of a
request's time there: this probe measures it anywhere.
Medians of --repeats after a warm-up; the scorer's step under cProfile with --profile.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats

import numpy as np
import torch
from bench_serve import build_rerank_corpus, make_queries
from common import make_log, median_us, meta, write_json

log = make_log("serve-host")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/mb-serve-host")
    parser.add_argument("--repeats", type=int, default=500)
    parser.add_argument("--profile", action="store_true", help="print the scorer's step under cProfile")
    parser.add_argument("--out")
    args = parser.parse_args()

    import maxsim_kernels

    from maxsim_cli import open_corpus
    from maxsim_cli.service.batching import Job, Scorer
    from maxsim_cli.service.schema import answer_json, parse_request

    # the kernel's place taken by one score a candidate, made at once
    maxsim_kernels.maxsim_candidates = lambda *a, **k: torch.linspace(0.0, 1.0, len(a[5]))
    query = make_queries(1, seed=3)[0]
    candidates = [f"r{i:07d}" for i in np.random.default_rng(5).choice(20000, 1000, replace=False)]
    body = json.dumps(
        {"queries": [{"qid": "q", "embedding": query.tolist()}], "candidates": {"q": candidates}}
    )
    body_bytes = body.encode()
    path = build_rerank_corpus(args.workdir, 20000, torch.device("cpu"))
    with open_corpus(path) as corpus:
        corpus.to("cpu")
        corpus.id_index()  # as the server keeps it
        scorer = Scorer(corpus)
        parsed = parse_request("rerank", "application/json", body_bytes, {}, corpus.dim)
        answers = scorer.score([Job("rerank", parsed)])[0]
        assert not isinstance(answers, BaseException) and len(answers[0][1]) == len(candidates)
        steps = {
            "parse and check the JSON": lambda: parse_request(
                "rerank", "application/json", body_bytes, {}, corpus.dim
            ),
            "score (the batcher's scorer, no kernel)": lambda: scorer.score([Job("rerank", parsed)]),
            "encode the answer": lambda: answer_json(answers),
        }
        results = {name: median_us(fn, args.repeats) for name, fn in steps.items()}
        results["all three"] = round(sum(results.values()), 1)
        for name, us in results.items():
            log(f"{name}: {us} us")
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(200):
                scorer.score([Job("rerank", parsed)])
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
            print(text.getvalue())
    write_json(
        args.out, {**meta(), "request_bytes": len(body_bytes), "candidates": 1000, "median_us": results}
    )


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
