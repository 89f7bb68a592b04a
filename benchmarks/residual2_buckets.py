"""2-bit residual codes: ColBERTv2's bucket cutoffs and values against those `maxsim quantize` fits.

`maxsim quantize --bits 2` stores, per token, its k-means centroid and a 2-bit bucket per dimension; the
codebook's cutoffs (which bucket a residual falls in) and values (what a bucket decodes to) are per
dimension. ColBERTv2 takes the quartiles of the residuals as cutoffs and their 1/8, 3/8, 5/8 and 7/8
quantiles as values; `maxsim_cli.codecs.fit_buckets` runs Lloyd-Max steps from there (each value the
mean of its bucket, each cutoff half-way between two values), by default under the constraint w3 - w2
= w1 - w0 that zeroes the scan kernels' third bit plane ("separable"; "fitted" is the same without it;
"uniform" constrains further to evenly spaced values, one integer a bucket for the products). All four are
measured here on the same centroids (k-means runs once per seed), with the same bytes a token:

- the squared error of the 2-bit residuals on the k-means sample (``sample_mse``: mean over tokens of
  ``|r - decoded r|^2``, for unit vectors);
- the compressed-only run against the qrels (``maxsim eval``'s nDCG@10, RR@10, R@100);
- the recall of the exact top-k in the compressed top N (as benchmarks/two_stage_recall.py).

    python benchmarks/residual2_buckets.py --corpus sample_data/corpus \
        --queries sample_data/queries.safetensors --qrels sample_data/qrels.txt --seeds 10 --device cpu \
        --out benchmarks/results/codes/residual2-buckets-sample-data-cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import sys
import tempfile

import numpy as np
import torch

from maxsim_cli import codecs, open_corpus, read_queries, search
from maxsim_cli.evaluate import evaluate_run
from maxsim_cli.quantize import quantize_corpus

RECALL_AT = ((10, 10), (10, 20), (10, 100), (100, 100), (100, 200), (100, 1000))


def colbertv2_buckets(residuals: torch.Tensor, iterations: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """ColBERTv2's per-dimension buckets: quartiles as cutoffs, the 1/8 .. 7/8 quantiles as values."""
    cutoffs = torch.quantile(residuals, torch.tensor([0.25, 0.5, 0.75]), dim=0).T.contiguous()
    weights = torch.quantile(residuals, torch.tensor([0.125, 0.375, 0.625, 0.875]), dim=0).T.contiguous()
    return cutoffs, weights


def bucket_error(residuals: torch.Tensor, cutoffs: torch.Tensor, weights: torch.Tensor) -> float:
    """Mean over tokens of the squared error of the decoded residuals (a block of rows at a time)."""
    total = 0.0
    for a in range(0, residuals.shape[0], 4096):
        r = residuals[a : a + 4096]
        buckets = (r[:, :, None] >= cutoffs[None]).sum(dim=2)
        total += float(((weights.gather(1, buckets.T).T - r) ** 2).sum())
    return total / max(1, residuals.shape[0])


class _Cached:
    """`fastkmeans.FastKMeans` trained once per (k, seed, sample): both bucket rules get the same
    centroids."""

    results: dict[tuple, np.ndarray] = {}

    def __init__(self, original, **kwargs) -> None:  # noqa: ANN001
        self.original, self.kwargs, self.centroids = original, kwargs, None

    def train(self, data: np.ndarray) -> None:
        key = (self.kwargs["k"], self.kwargs["seed"], hashlib.sha256(data.tobytes()).hexdigest())
        if key not in self.results:
            model = self.original(**self.kwargs)
            model.train(data)
            self.results[key] = np.asarray(model.centroids, dtype=np.float32)
        self.centroids = self.results[key]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True, help="float corpus folder")
    parser.add_argument("--queries", required=True, help="query shard")
    parser.add_argument("--qrels", required=True, help="TREC qrels of the queries")
    parser.add_argument("--seeds", type=int, default=10, help="quantize seeds 0 .. N-1")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", help="write the rows and the setup to this JSON file")
    args = parser.parse_args()
    import fastkmeans

    original = fastkmeans.FastKMeans
    fastkmeans.FastKMeans = lambda **kwargs: _Cached(original, **kwargs)  # type: ignore[misc]
    fitted = codecs.fit_buckets
    rules = {
        "colbertv2": colbertv2_buckets,
        "fitted": lambda residuals: fitted(residuals, grid="free"),
        "separable": lambda residuals: fitted(residuals, grid="separable"),
        "uniform": lambda residuals: fitted(residuals, grid="uniform"),
    }
    measured: dict[str, float] = {}

    def measuring(rule):  # noqa: ANN001, ANN202
        def fit(residuals: torch.Tensor, iterations: int = codecs.BUCKET_ITERATIONS):
            cutoffs, weights = rule(residuals)
            measured["sample_mse"] = bucket_error(residuals, cutoffs, weights)
            measured["sample_residual_energy"] = float((residuals.double() ** 2).sum(dim=1).mean())
            return cutoffs, weights

        return fit

    rows = []
    queries = read_queries(args.queries)
    with tempfile.TemporaryDirectory() as tmp:
        with open_corpus(args.corpus) as corpus:
            num_docs, num_tokens, dim = len(corpus), corpus.num_tokens, corpus.dim
            exact_run = search(queries, corpus, k=100, device=args.device)
        exact = exact_run.to_dict()
        exact_run.to_trec(os.path.join(tmp, "exact.trec"))
        exact_quality = evaluate_run(os.path.join(tmp, "exact.trec"), args.qrels).values
        print(f"exact  {json.dumps(exact_quality)}", flush=True)
        depth = min(num_docs, max(n for _, n in RECALL_AT))
        for seed in range(args.seeds):
            for name, rule in rules.items():
                codecs.fit_buckets = measuring(rule)
                out = os.path.join(tmp, f"{name}-{seed}")
                report = quantize_corpus(
                    [args.corpus], out, bits=2, codec="residual2", device=args.device, sample_queries=0,
                    seed=seed,
                )
                with open_corpus(out) as compressed:
                    run = search(queries, compressed, k=depth, device=args.device)
                run.to_trec(f"{out}.trec")
                row = {"seed": seed, "buckets": name, "num_centroids": report.num_centroids, **measured}
                row.update(evaluate_run(f"{out}.trec", args.qrels).values)
                approx = run.to_dict()
                for k, n in RECALL_AT:
                    if n <= num_docs:
                        row[f"recall@{k}({n})"] = float(
                            np.mean(
                                [
                                    len({d for d, _ in exact[q][:k]} & {d for d, _ in approx[q][:n]}) / k
                                    for q in exact
                                ]
                            )
                        )
                rows.append(row)
                print(json.dumps(row), flush=True)
                codecs.fit_buckets = fitted
    summary = {}
    for name in rules:
        mine = [r for r in rows if r["buckets"] == name]
        keys = [key for key in mine[0] if key not in ("seed", "buckets", "num_centroids")]
        values = {key: [r[key] for r in mine] for key in keys}
        summary[name] = {
            key: {"mean": float(np.mean(v)), "min": float(np.min(v)), "max": float(np.max(v))}
            for key, v in values.items()
        }
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "command": "python " + " ".join(sys.argv),
                    "date": datetime.date.today().isoformat(),
                    "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
                    "corpus": args.corpus,
                    "documents": num_docs,
                    "tokens": num_tokens,
                    "dim": dim,
                    "queries": len(exact),
                    "exact": exact_quality,
                    "summary": summary,
                    "rows": rows,
                },
                f,
                indent=1,
            )
            f.write("\n")


if __name__ == "__main__":
    main()
