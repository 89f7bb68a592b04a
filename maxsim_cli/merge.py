"""Merge runs scored on disjoint parts of one corpus into one run, top-k per query.

Each part's run holds, per query, its part's best documents; the union of the parts' top-k contains the
corpus-wide top-k, so merging reproduces the run a single pass over the whole corpus would have written
(as long as every part kept at least k documents per query). Ordering is the one of `maxsim_cli.runs`:
float32 score descending, ties by docno descending, ranks from 1.

A query's documents are the union of its documents in every input. A document that appears for the same
query in two inputs is kept once if both scores are the same float32 (overlapping parts, or a part given
twice) and is an error otherwise: the inputs then do not come from the same scoring.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from maxsim_cli.errors import InputError, UsageError
from maxsim_cli.runs import RunWriter, format_score, read_run, sort_trec


@dataclass
class MergeStats:
    """What a merge read and wrote."""

    inputs: int = 0
    queries: int = 0
    rows_read: int = 0
    rows_written: int = 0
    duplicates: int = 0  # (query, docno) pairs found in more than one input, with equal scores


def merge_runs(
    paths: Sequence[str | os.PathLike[str]],
    top_k: int,
    output: str | os.PathLike[str] = "-",
    *,
    tag: str = "maxsim",
    fmt: str = "trec",
) -> MergeStats:
    """Merge the runs at ``paths`` and write the best ``top_k`` documents per query to ``output``.

    Queries come in first-appearance order across the inputs (input order, then file order). Inputs
    may be any format `maxsim_cli.runs.read_run` reads; ``-`` (at most once) is stdin, ``output="-"``
    stdout. The output is written atomically, after every input has been read and checked.
    """
    if not paths:
        raise UsageError("no runs to merge; give at least one RUN")
    if top_k < 1:
        raise UsageError(f"--top-k must be at least 1, got {top_k}")
    if sum(1 for p in paths if str(p) == "-") > 1:
        raise UsageError("'-' (standard input) can be given only once among the runs to merge")
    stats = MergeStats(inputs=len(paths))
    # qid -> docno -> (score, index of the input it came from)
    merged: dict[str, dict[str, tuple[float, int]]] = {}
    for source, path in enumerate(paths):
        for qid, rows in read_run(path).items():
            docs = merged.setdefault(qid, {})
            stats.rows_read += len(rows)
            for docno, score in rows:
                previous = docs.get(docno)
                if previous is None:
                    docs[docno] = (score, source)
                    continue
                if np.float32(previous[0]) != np.float32(score):
                    other = _name(paths[previous[1]])
                    raise InputError(
                        f"{_name(path)}: query {qid!r} docno {docno!r} has score {format_score(score)} here "
                        f"but {format_score(previous[0])} in {other}; runs to merge must score disjoint "
                        "parts of one corpus with the same queries and model"
                    )
                stats.duplicates += 1
    with RunWriter(output, tag=tag, fmt=fmt) as writer:
        for qid, docs in merged.items():
            docnos = list(docs)
            scores = [score for score, _ in docs.values()]
            best = sort_trec(docnos, scores)[:top_k]
            writer.write_query(qid, [docnos[i] for i in best], [scores[i] for i in best])
            stats.rows_written += len(best)
    stats.queries = len(merged)
    return stats


def _name(path: str | os.PathLike[str]) -> str:
    return "<stdin>" if str(path) == "-" else str(path)
