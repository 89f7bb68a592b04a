"""`maxsim verify QUERIES COMPRESSED --exact-from CORPUS`: a compressed tier (the int8, 4-bit or 2-bit
corpus `maxsim quantize` wrote) against the exact FP32 scores of the float corpus it was quantized from.

Every query is scored against every document twice, as the library's `search` scores them (the
dispatch's plan, the kernels `maxsim score` runs): from the compressed tier (its approximate scores)
and from CORPUS (the exact FP32 scores, the reference). Reported:

- **recall@k(N)**: the share of a query's exact top k found in the compressed tier's top N, the
  documents a two-stage search (`maxsim score --exact-from --depth N`) scores exactly: where it is 1,
  the two-stage search returns exactly the exact top k. Mean and worst query, for k = 10 and 100 (at
  most the corpus's size), at the default depth of each k and at `DEPTHS` (capped at the corpus's
  size). The formula of benchmarks/two_stage_recall.py: ``|exact top-k ∩ compressed top-N| / |exact
  top-k|``.
- **score error**: ``|compressed - exact|`` over every pair, absolute and relative to the score scale
  (the query's largest exact score in absolute value), max, p99 and mean. It measures the codec and is
  not judged.

The verdict (`MIN_RECALL`, ``min_recall``): the mean recall@10 and recall@100 at the default depth are
at least 0.99.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from maxsim_cli.agreement import ErrorStats
from maxsim_cli.errors import InputError, UsageError
from maxsim_cli.verify.checks import Check

# Depths reported beside the default (each capped at the corpus's size).
DEPTHS = (100, 200, 500, 1000, 2000, 5000)
RECALL_KS = (10, 100)
MIN_RECALL = 0.99
# Both tiers' scores of every pair are held (float32): past this many pairs, ask for fewer queries.
MAX_PAIRS = 50_000_000


@dataclass(frozen=True)
class Recall:
    """recall@k at one depth: mean and worst over the queries."""

    k: int
    depth: int
    mean: float
    min: float

    def to_dict(self) -> dict[str, Any]:
        return {"k": self.k, "depth": self.depth, "mean": self.mean, "min": self.min}


@dataclass
class TierReport:
    """Everything `verify_tier` measured, and the verdict."""

    setup: dict[str, Any]
    default_depths: dict[int, int]  # k -> the default depth of `maxsim score --exact-from`
    recall: list[Recall]  # every (k, depth), k then depth ascending
    errors: ErrorStats  # compressed vs exact, relative to each query's score scale
    min_recall: float
    checks: list[Check]
    timings: dict[str, float]

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def at_default(self, k: int) -> Recall:
        return next(r for r in self.recall if r.k == k and r.depth == self.default_depths[k])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: verify's top-level keys where they apply, everything else under ``details``."""
        return {
            "passed": self.passed,
            "mode": "compressed-tier",
            "max_abs_error": self.errors.max_abs,
            "max_rel_error": self.errors.max_rel,
            "recall_at_default_depth": {str(k): self.at_default(k).mean for k in self.default_depths},
            "checks": [check.to_dict() for check in self.checks],
            "details": {
                "setup": self.setup,
                "default_depth": {str(k): depth for k, depth in self.default_depths.items()},
                "recall": [r.to_dict() for r in self.recall],
                "score_errors": self.errors.to_dict(),
                "min_recall": self.min_recall,
                "timings_s": self.timings,
            },
        }


def recall_at(exact_order: np.ndarray, compressed_rank: np.ndarray, k: int, depth: int) -> np.ndarray:
    """Each query's recall@k(depth): ``exact_order`` [Q, N] the documents (ordinals) best first by the
    exact scores; ``compressed_rank`` [Q, N] each document's rank (0: best) by the compressed scores."""
    top = exact_order[:, :k]
    found = np.take_along_axis(compressed_rank, top, axis=1) < depth
    return found.mean(axis=1)


def score_errors(compressed: np.ndarray, exact: np.ndarray) -> ErrorStats:
    """``|compressed - exact|`` over every pair ([Q, N] float32 each), absolute and relative to each
    query's score scale (its largest exact score in absolute value; 1 where that is 0)."""
    diff = np.abs(compressed.astype(np.float64) - exact.astype(np.float64))
    scale = np.abs(exact).max(axis=1, keepdims=True).astype(np.float64)
    rel = diff / np.where(scale > 0, scale, 1.0)
    finite = np.isfinite(compressed) & np.isfinite(exact)
    d, r = diff[finite], rel[finite]
    if d.size == 0:
        nan = float("nan")
        return ErrorStats(0, nan, nan, nan, nan, nan, nan, int((~finite).sum()))
    return ErrorStats(
        count=int(d.size),
        max_abs=float(d.max()),
        p99_abs=float(np.quantile(d, 0.99)),
        mean_abs=float(d.mean()),
        max_rel=float(r.max()),
        p99_rel=float(np.quantile(r, 0.99)),
        mean_rel=float(r.mean()),
        nonfinite_mismatches=int((np.isfinite(compressed) != np.isfinite(exact)).sum()),
    )


def _matrix(run: Any, qids: Sequence[str], corpus: Any) -> np.ndarray:
    """A run of every document for every query as float32 scores [Q, N] in corpus order."""
    lookup = corpus.id_lookup()
    row_of = {qid: i for i, qid in enumerate(qids)}
    out = np.full((len(qids), len(corpus)), np.nan, dtype=np.float32)
    for qid, docnos, scores in run._queries():
        out[row_of[qid], lookup.ordinals_of(docnos)] = scores
    return out


def _search_all(queries: Any, corpus: Any, device: str, backend: str) -> Any:
    """Every document's score for every query (a `Run`), planned by the dispatch as `search` plans it."""
    from maxsim_cli.run import RunCollector
    from maxsim_cli.scoring import dispatch
    from maxsim_cli.scoring.request import ScoreRequest

    request = ScoreRequest(
        queries=queries.name, corpus=tuple(corpus.paths), top_k=len(corpus), device=device, backend=backend
    )
    sink = RunCollector()
    stats = dispatch.run_call(request, corpus, queries.batch, sink)
    return sink.run(stats)


def _order(scores: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Each query's documents best first, as a search ranks them: score, then docno, descending."""
    keys = np.where(np.isnan(scores), -np.inf, scores.astype(np.float64) + 0.0)
    return np.stack([np.lexsort((ranks, row))[::-1] for row in keys])


def verify_tier(
    queries: str,
    compressed: Sequence[str],
    exact_from: Sequence[str],
    *,
    device: str = "auto",
    backend: str = "auto",
    min_recall: float = MIN_RECALL,
) -> TierReport:
    """Recall and score error of the compressed tier ``compressed`` against ``exact_from``, the float
    corpus it was quantized from (module docstring); `InputError` (one line naming both) when they do
    not hold the same documents."""
    from maxsim_cli.queries import read_queries
    from maxsim_cli.scoring.request import default_depth
    from maxsim_cli.scoring.resources import corpus_name
    from maxsim_cli.scoring.two_stage import check_pair
    from maxsim_cli.shards import check_same_dim, open_corpus

    started = time.perf_counter()
    if not 0.0 <= min_recall <= 1.0:
        raise UsageError(f"--min-recall {min_recall}: must be between 0 and 1")
    q = read_queries(queries)
    if len(q) == 0:
        raise InputError(f"{queries}: holds no queries; verify needs at least one")
    with open_corpus(list(compressed)) as tier, open_corpus(list(exact_from)) as exact:
        check_pair(tier, exact, corpus_name(list(compressed)), corpus_name(list(exact_from)))
        check_same_dim(q.batch, q.name, tier)
        num_docs = len(exact)
        if len(q) * num_docs > MAX_PAIRS:
            raise UsageError(
                f"{len(q):,} queries x {num_docs:,} documents is {len(q) * num_docs:,} pairs, over the "
                f"{MAX_PAIRS:,} verify holds for a compressed tier (it ranks the whole corpus): verify fewer "
                "queries"
            )
        t0 = time.perf_counter()
        exact_run = _search_all(q, exact, device, backend)
        t1 = time.perf_counter()
        tier_run = _search_all(q, tier, device, backend)
        t2 = time.perf_counter()
        exact_scores = _matrix(exact_run, q.ids, exact)
        tier_scores = _matrix(tier_run, q.ids, exact)  # the same documents in the same order: checked
        ranks = exact.rank_of_ordinal()
        quantization = tier.quantization
        setup = {
            "num_queries": len(q),
            "num_docs": num_docs,
            "pairs": len(q) * num_docs,
            "dim": exact.dim,
            "compressed": corpus_name(list(compressed)),
            "quantization": quantization,
            "exact_from": corpus_name(list(exact_from)),
            "exact_dtype": exact.dtype,
            "device": str(getattr(exact_run.stats, "device", device)),
        }
    exact_order = _order(exact_scores, ranks)
    tier_order = _order(tier_scores, ranks)
    tier_rank = np.empty_like(tier_order)
    np.put_along_axis(tier_rank, tier_order, np.arange(num_docs)[None, :].repeat(len(q), 0), axis=1)
    ks = sorted({min(k, num_docs) for k in RECALL_KS})
    defaults = {k: min(default_depth(quantization, k), num_docs) for k in ks}
    recall: list[Recall] = []
    for k in ks:
        depths = sorted({min(d, num_docs) for d in DEPTHS if d >= k} | {defaults[k]})
        for depth in depths:
            per_query = recall_at(exact_order, tier_rank, k, depth)
            recall.append(Recall(k, depth, float(per_query.mean()), float(per_query.min())))
    report = TierReport(setup, defaults, recall, score_errors(tier_scores, exact_scores), min_recall, [], {})
    for k in ks:
        at = report.at_default(k)
        report.checks.append(
            Check(
                f"recall@{k}",
                at.mean >= min_recall,
                f"mean recall of the exact top {k} in the compressed top {at.depth} (the default depth) "
                f"{at.mean:.4f} (worst query {at.min:.2f}); needs >= {min_recall}",
            )
        )
    report.timings = {"exact": t1 - t0, "compressed": t2 - t1, "total": time.perf_counter() - started}
    return report
