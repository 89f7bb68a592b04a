"""Merge runs scored on disjoint parts of one corpus into one run, top-k per query.

Each part's run holds, per query, its part's best documents; the union of the parts' top-k contains the
corpus-wide top-k, so merging reproduces the run a single pass over the whole corpus would have written
(as long as every part kept at least k documents per query). Ordering is the one of `maxsim_cli.runs`:
float32 score descending, ties by docno descending, ranks from 1.

A query's documents are the union of its documents in every input. A document that appears for the same
query in two inputs is kept once if both scores are the same float32 (overlapping parts, or a part given
twice) and is an error otherwise: the inputs then do not come from the same scoring.

The best ``k`` of a query's union are selected in O(n) (`select_top_k`): the k-th largest float32 score
``s_k`` is found by partition; every document scoring above ``s_k`` is in, and of those scoring exactly
``s_k`` the ones with the largest docnos fill the remaining places, which is the order "score descending,
docno descending" cut after ``k`` without sorting everything.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from maxsim_cli.errors import InputError, UsageError
from maxsim_cli.runs import RunWriter, format_score, read_run
from maxsim_cli.shards.files import check_output


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
    queries: str | os.PathLike[str] | None = None,
) -> MergeStats:
    """Merge the runs at ``paths`` and write the best ``top_k`` documents per query to ``output``.

    Queries come in first-appearance order across the inputs (input order, then file order), or, with
    ``queries`` (a query embeddings file: safetensors, Arrow or Parquet), in that file's order, which
    is the order `maxsim score` writes; a query of the runs missing from that file is then an error.
    Inputs may be any format `maxsim_cli.runs.read_run` reads; ``-`` (at most once) is stdin,
    ``output="-"`` stdout. The output is written atomically, after every input has been read and checked;
    an output that is one of the inputs, or cannot be written, is refused before any is read.
    """
    if not paths:
        raise UsageError("no runs to merge; give at least one RUN")
    if top_k < 1:
        raise UsageError(f"--top-k must be at least 1, got {top_k}")
    if sum(1 for p in paths if str(p) == "-") > 1:
        raise UsageError("'-' (standard input) can be given only once among the runs to merge")
    check_output(output, [*paths, queries])  # not one of the inputs, and writable: before reading them
    query_order = _query_ids(queries) if queries is not None else None
    stats = MergeStats(inputs=len(paths))
    # qid -> docno -> (score, index of the input it came from)
    merged: dict[str, dict[str, tuple[float, int]]] = {}
    for source, path in enumerate(paths):
        for qid, rows in read_run(path).items():
            if query_order is not None and qid not in query_order:
                raise InputError(
                    f"{_name(path)}: query {qid!r} is not in the query file {queries}; merge runs of the "
                    "queries of that file, or leave out --queries"
                )
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
    order = list(merged) if query_order is None else [q for q in query_order if q in merged]
    with RunWriter(output, tag=tag, fmt=fmt) as writer:
        for qid in order:
            docs = merged[qid]
            docnos = list(docs)
            scores = np.fromiter((score for score, _ in docs.values()), dtype=np.float64, count=len(docs))
            best = select_top_k(docnos, scores, top_k).tolist()
            writer.write_query(qid, [docnos[i] for i in best], scores[best].tolist())
            stats.rows_written += len(best)
    stats.queries = len(merged)
    return stats


def select_top_k(docnos: Sequence[str], scores: Sequence[float] | np.ndarray, k: int) -> np.ndarray:
    """Indices of the best ``k`` documents (all of them when there are fewer), in no particular order.

    "Best" is trec_eval's order, the one `maxsim_cli.runs.sort_trec` sorts by: float32 score descending,
    ties by docno descending. O(n) plus a sort of the documents tied at the k-th score.
    """
    values = np.asarray(scores, dtype=np.float32)
    n = len(values)
    if len(docnos) != n:
        raise ValueError(f"select_top_k: {len(docnos)} docnos but {n} scores")
    if n <= k:
        return np.arange(n, dtype=np.int64)
    kth = np.partition(values, n - k)[n - k]  # the k-th largest score
    above = np.flatnonzero(values > kth)
    tied = np.flatnonzero(values == kth)  # -0.0 == 0.0: the two zeros tie, as they print
    need = k - len(above)
    if need < len(tied):
        tied = np.asarray(sorted(tied.tolist(), key=lambda i: docnos[i], reverse=True)[:need], dtype=np.int64)
    return np.concatenate([above, tied]).astype(np.int64, copy=False)


def _query_ids(path: str | os.PathLike[str]) -> dict[str, int]:
    from maxsim_cli.shards import open_shard

    with open_shard(path) as shard:
        return {qid: i for i, qid in enumerate(shard.ids)}


def _name(path: str | os.PathLike[str]) -> str:
    return "<stdin>" if str(path) == "-" else str(path)
