"""Where the Python API's small calls spend their host time: `rerank` (1 query x 1,000 candidates) and
`search` (1 query, k=10) on a resident corpus, each profiled with cProfile after a warm-up.

    python benchmarks/probe_api_calls.py --workdir /var/tmp/mb-api --size 2GB --out /tmp/probe-api.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np
import torch
from common import build_corpus


def main() -> None:
    from maxsim_cli import Queries, open_corpus, rerank, search
    from maxsim_cli.units import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/mb-api")
    parser.add_argument("--size", default="2GB")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out")
    args = parser.parse_args()
    dev = torch.device(args.device)
    corpus = open_corpus(build_corpus(args.workdir, parse_size(args.size), 1 << 30, dev))
    corpus.to(str(dev))
    ids, n = corpus.ids, len(corpus)
    gen = np.random.default_rng(0)
    lists = [[ids[i] for i in np.sort(gen.choice(n, 1000, replace=False))] for _ in range(16)]
    qgen = torch.Generator().manual_seed(1)
    unit = torch.nn.functional.normalize
    qs = [Queries.from_embeddings(["q"], [unit(torch.randn(32, 128, generator=qgen), dim=1)])
          for _ in range(16)]  # fmt: skip
    calls = {
        "rerank": lambda i: rerank(qs[i % 16], corpus, {"q": lists[i % 16]}, k=1000),
        "search": lambda i: search(qs[i % 16], corpus, k=10),
    }
    report = io.StringIO()
    for name, call in calls.items():
        for i in range(20):
            call(i)
        t0 = time.perf_counter()
        for i in range(args.calls):
            call(i)
        per_call = (time.perf_counter() - t0) / args.calls * 1e3
        profile = cProfile.Profile()
        profile.enable()
        for i in range(args.calls):
            call(i)
        profile.disable()
        print(f"== {name}: {per_call:.3f} ms a call (unprofiled)", file=report)
        for key in ("tottime", "cumulative"):
            pstats.Stats(profile, stream=report).sort_stats(key).print_stats(40)
    print(report.getvalue())
    if args.out:
        with open(args.out, "w") as f:
            f.write(report.getvalue())


if __name__ == "__main__":
    main()
