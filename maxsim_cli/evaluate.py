"""Evaluate a run against TREC qrels with ir_measures (the optional ``eval`` extra).

The run is read by `maxsim_cli.run_files` (TREC, MS MARCO or ColBERT format, .gz, ``-`` for stdin), so a
malformed line is reported as ``file:line`` before ir_measures sees anything; ``irds:<dataset-id>``, for
the run or the qrels, reads an ir_datasets dataset's scoreddocs or qrels (`maxsim_cli.irds`). The
measures themselves are ir_measures' (pytrec_eval inside). Each value is a mean over the *judged*
queries: a query of the qrels that the run lacks scores 0 (as ``trec_eval -c``), a query of the run that
has no judgement is ignored.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from maxsim_cli.errors import MaxsimError, UsageError

# `maxsim_cli.run_files` (numpy, pyarrow) is imported where a run is read, not here: `maxsim eval --help`
# imports this module for DEFAULT_MEASURES and should not pay for the readers.

DEFAULT_MEASURES = ("nDCG@10", "RR@10", "R@100")


@dataclass
class EvalResult:
    """Mean value of each measure (in the order asked for) and the query counts behind them."""

    values: dict[str, float] = field(default_factory=dict)
    run_queries: int = 0  # queries in the run
    judged_queries: int = 0  # queries in the qrels: the denominator of every mean
    missing_queries: int = 0  # judged queries absent from the run (they count as 0)
    unjudged_queries: int = 0  # run queries absent from the qrels (ignored)


def _ir_measures() -> Any:
    try:
        import ir_measures
    except ImportError:
        raise MaxsimError(
            "maxsim eval needs the optional package ir-measures; install it with: pip install 'maxsim[eval]'"
        ) from None
    return ir_measures


def parse_measures(names: Sequence[str]) -> list[tuple[str, Any]]:
    """``(name, measure)`` pairs for ir_measures names (``nDCG@10``) or trec_eval names (``ndcg_cut_10``).

    Raises `UsageError` for a name neither understands. Duplicates are kept once.
    """
    ir_measures = _ir_measures()
    parsed: dict[str, Any] = {}
    for name in names:
        try:
            measures = [ir_measures.parse_measure(name)]
        except (NameError, ValueError, SyntaxError, TypeError, AttributeError):
            try:
                measures = list(ir_measures.parse_trec_measure(name))
            except (NameError, ValueError, SyntaxError, TypeError, AttributeError, KeyError):
                raise UsageError(
                    f"unknown measure {name!r}; use ir_measures names such as nDCG@10, RR@10, R@100, P@5, AP"
                ) from None
        for measure in measures:
            parsed.setdefault(str(measure), measure)
    return list(parsed.items())


def _trec_eval_order(rows: list[tuple[str, float]]) -> dict[str, float]:
    """Scores replaced by ``n - rank``: the ranking trec_eval would make, with no ties left.

    ir_measures hands different measures to different providers, and not all of them break score ties
    as trec_eval does (its RR@k provider does not); distinct scores make every provider see one ranking.
    """
    from maxsim_cli.run_files import sort_trec

    docnos = [docno for docno, _ in rows]
    order = sort_trec(docnos, [score for _, score in rows])
    return {docnos[i]: float(len(order) - rank) for rank, i in enumerate(order)}


def evaluate_run(
    run_path: str | os.PathLike[str],
    qrels_path: str | os.PathLike[str],
    measures: Sequence[str] | None = None,
) -> EvalResult:
    """Mean of each measure over the judged queries (default measures: nDCG@10, RR@10, R@100).

    e.g. ``nDCG@10 = mean_q DCG@10(q) / IDCG@10(q)`` with ``DCG@k = sum_{r<=k} (2^rel_r - 1) / log2(r + 1)``
    as trec_eval defines it; ``RR@10`` the reciprocal rank of the first relevant document in the top 10.
    The run is ordered as trec_eval orders it: score descending, ties by docno descending. Either path
    may be ``irds:<dataset-id>`` (the dataset's scoreddocs as the run, its qrels as the qrels).
    """
    if str(run_path) == "-" and str(qrels_path) == "-":
        raise UsageError("RUN and QRELS cannot both be '-' (standard input); give one of them as a file")
    from maxsim_cli.run_files import read_qrels, read_run

    ir_measures = _ir_measures()
    parsed = parse_measures(list(measures) if measures else list(DEFAULT_MEASURES))
    qrels = read_qrels(qrels_path)
    run = {qid: _trec_eval_order(rows) for qid, rows in read_run(run_path).items()}
    # ir_measures/pytrec_eval want non-negative relevance for gain; negatives mean "judged non-relevant".
    qrels_for_eval = {qid: {d: max(rel, 0) for d, rel in docs.items()} for qid, docs in qrels.items()}
    judged_in_run = sum(1 for qid in qrels if qid in run)
    if judged_in_run == 0:
        raise MaxsimError(
            f"{run_path}: none of its {len(run)} query ids appears in {qrels_path} "
            f"(e.g. run {next(iter(run))!r}, qrels {next(iter(qrels))!r}); check that the files match"
        )
    aggregate = ir_measures.calc_aggregate([m for _, m in parsed], qrels_for_eval, run)
    values = {name: float(aggregate[measure]) for name, measure in parsed}
    return EvalResult(
        values=values,
        run_queries=len(run),
        judged_queries=len(qrels),
        missing_queries=len(qrels) - judged_in_run,
        unjudged_queries=len(run) - judged_in_run,
    )
