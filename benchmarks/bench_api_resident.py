"""The Python API's small calls on a corpus resident in GPU memory, beside the kernel alone on the same data.

    python benchmarks/bench_api_resident.py --workdir /tmp/mb-api --size 8.2GB \
        --out benchmarks/results/api/api-resident-h100.json

The corpus: ``--size`` of fp16 shards (`common.build_corpus`: L2-normalised random vectors, d = 128,
documents of 20-300 tokens; 8.2 GB is ~200K documents), opened with `open_corpus` and moved to the GPU
with `Corpus.to("cuda")`. Queries: 32 tokens, random unit vectors, a new `Queries` object every call.

  rerank  `rerank(queries, corpus, {qid: docnos}, k=1000)`, one query against 1,000 docnos drawn from the
          corpus (a new list every call, from 16 prepared ones); beside it the kernel alone on the same
          resident rows (`maxsim_candidates` with host offsets, the indices known);
  search  `search(queries, corpus, k=10)`, one query; beside it the kernel alone (`maxsim_varlen` over the
          resident rows, then `torch.topk`).

Wall time of each call on the host clock (the call returns host results, so it includes the device's work),
``--repeats`` calls after a warm-up, in ``--rounds`` rounds alternating API and kernel; p50 and p99.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from common import build_corpus, make_log, meta, write_json

log = make_log("api_resident", clock=True)


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    for _ in range(5):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    from maxsim_kernels import maxsim_candidates, maxsim_varlen

    from maxsim_cli import Queries, open_corpus, rerank, search
    from maxsim_cli.units import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/mb-api")
    parser.add_argument("--size", default="8.2GB")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    parser.add_argument("--device", default="cuda", help="cpu: a check of the script (tiny --size)")
    args = parser.parse_args()
    dev = torch.device(args.device)
    paths = build_corpus(args.workdir, parse_size(args.size), 1 << 30, dev)
    corpus = open_corpus(paths)
    t0 = time.perf_counter()
    corpus.to(str(dev))
    log(f"resident: {len(corpus)} documents in {time.perf_counter() - t0:.1f} s")
    residency = corpus.residency
    ids, n = corpus.ids, len(corpus)
    gen = np.random.default_rng(0)
    picks = [np.sort(gen.choice(n, min(n, 1000), replace=False)) for _ in range(16)]
    lists = [[ids[i] for i in p] for p in picks]
    qgen = torch.Generator().manual_seed(1)

    def new_queries() -> Queries:
        q = torch.nn.functional.normalize(torch.randn(32, 128, generator=qgen), dim=1)
        return Queries.from_embeddings(["q"], [q])

    q_pool = [new_queries() for _ in range(16)]
    step = {"i": 0}

    def api_rerank() -> object:
        i = step["i"] = step["i"] + 1
        return rerank(q_pool[i % 16], corpus, {"q": lists[i % 16]}, k=1000)

    def api_search() -> object:
        i = step["i"] = step["i"] + 1
        return search(q_pool[i % 16], corpus, k=10)

    emb, offsets_host = residency.embeddings, residency.offsets_host
    q_dev = [qq.embeddings.to(dev, emb.dtype) for qq in q_pool]
    q_off = torch.tensor([0, 32])
    c_off = torch.tensor([0, len(picks[0])])
    cands = [torch.from_numpy(p.astype(np.int64)) for p in picks]

    def kernel_rerank() -> object:
        i = step["i"] = step["i"] + 1
        return maxsim_candidates(q_dev[i % 16], q_off, emb, offsets_host, c_off, cands[i % 16]).cpu()

    def kernel_search() -> object:
        i = step["i"] = step["i"] + 1
        scores = maxsim_varlen(q_dev[i % 16], q_off, emb, offsets_host)
        return torch.topk(scores, 10, dim=1).indices.cpu()

    runs = {"rerank": (api_rerank, kernel_rerank), "search": (api_search, kernel_search)}
    record: dict = {"meta": meta(dtype="float16", dim=128), "documents": n, "size": args.size, "calls": {}}
    for name, (api, kernel) in runs.items():
        times: dict[str, list[float]] = {"api": [], "kernel": []}
        for r in range(args.rounds):
            order = (("api", api), ("kernel", kernel))
            for way, fn in order if r % 2 == 0 else order[::-1]:
                times[way] += timed(fn, args.repeats)
        row = {way: {"p50_ms": statistics.median(ts), "p99_ms": float(np.percentile(ts, 99))}
               for way, ts in times.items()}  # fmt: skip
        row["api_over_kernel_p50"] = row["api"]["p50_ms"] / row["kernel"]["p50_ms"]
        record["calls"][name] = row
        log(f"{name}: {row}")
        write_json(args.out, record)
    for name, row in record["calls"].items():
        print(f"{name}: API p50 {row['api']['p50_ms']:.3f} ms (p99 {row['api']['p99_ms']:.3f}), kernel alone "
              f"p50 {row['kernel']['p50_ms']:.3f} ms, ratio {row['api_over_kernel_p50']:.2f}")


if __name__ == "__main__":
    main()
