"""The server's scoring step of one rerank request, in pieces, on a GPU.

    python benchmarks/probe_rerank_step.py --workdir /tmp/mb \
        --out benchmarks/results/serve/rerank-step-h200.json

The rerank request of `bench_serve.py` (1 query of 32 tokens, 1000 candidates of 180 tokens, JSON),
against its 20,000-document corpus resident on the GPU: the medians of the whole step
(`Scorer.score`), of the launch with its inputs (`direct.candidate_scores`), of `maxsim_candidates`
with candidates new to it (no launch plan remembered, as for each request) and of its parts that
precede the kernel, beside the body's parsing and the answer's encoding. With --profile, the step
under cProfile.
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

log = make_log("rerank-step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/mb")
    parser.add_argument("--repeats", type=int, default=400)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()

    import maxsim_kernels

    from maxsim_cli import open_corpus
    from maxsim_cli.scoring import direct
    from maxsim_cli.service.batching import Job, Scorer, _concat
    from maxsim_cli.service.schema import answer_json, parse_request

    device = torch.device("cuda", 0)
    path = build_rerank_corpus(args.workdir, 20000, device)
    rows = make_queries(1, seed=3)[0].tolist()
    candidates = [f"r{i:07d}" for i in np.random.default_rng(5).choice(20000, 1000, replace=False)]
    body = json.dumps({"queries": [{"qid": "q", "embedding": rows}], "candidates": {"q": candidates}})
    with open_corpus(path) as corpus:
        corpus.to(str(device))
        ordinal_of = corpus.ordinal_index()
        scorer = Scorer(corpus)
        residency = corpus.residency
        parsed = parse_request("rerank", "application/json", body.encode(), {}, corpus.dim)
        job = Job("rerank", parsed)
        answers = scorer.score([job])[0]
        cand_docs = np.array([ordinal_of[c] for c in candidates], dtype=np.int64)
        cand_offsets = np.array([0, len(cand_docs)], dtype=np.int64)
        batch = _concat([parsed.queries]).batch
        kernel_args, kernel_kwargs = direct._kernel_inputs(corpus, residency, batch, "auto")

        def launch() -> torch.Tensor:  # new candidate tensors, as each request brings
            return maxsim_kernels.maxsim_candidates(
                *kernel_args, torch.from_numpy(cand_offsets), torch.from_numpy(cand_docs), **kernel_kwargs
            )

        steps = {
            "the scoring step (Scorer.score)": lambda: scorer.score([job]),
            "direct.candidate_scores (inputs, launch, scores back)": lambda: direct.candidate_scores(
                corpus, residency, batch, cand_offsets, cand_docs
            ),
            "the queries' inputs (direct._kernel_inputs)": lambda: direct._kernel_inputs(
                corpus, residency, batch, "auto"
            ),
            "maxsim_candidates, not waited for": launch,
            "maxsim_candidates and its scores back": lambda: launch().cpu(),
            "an empty synchronize": torch.cuda.synchronize,
            "parse and check the JSON": lambda: parse_request(
                "rerank", "application/json", body.encode(), {}, corpus.dim
            ),
            "encode the answer": lambda: answer_json(answers),
        }
        results = {name: median_us(fn, args.repeats) for name, fn in steps.items()}
        for name, us in results.items():
            log(f"{name}: {us} us")
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.repeats):
                scorer.score([job])
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
            print(text.getvalue())
    write_json(args.out, {**meta(), "candidates": len(candidates), "median_us": results})


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
