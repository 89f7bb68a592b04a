"""Merge runs scored on disjoint parts of one corpus into one run, top-k per query.

Each part's run holds, per query, its part's best documents; the union of the parts' top-k contains the
corpus-wide top-k, so merging reproduces the run a single pass over the whole corpus would have written
(as long as every part kept at least k documents per query). Ordering is the one of `maxsim_cli.run_files`:
float32 score descending, ties by docno descending, ranks from 1.

A query's documents are the union of its documents in every input. A document that appears for the same
query in two inputs is kept once if both scores are the same float32 (overlapping parts, or a part given
twice) and is an error otherwise: the inputs then do not come from the same scoring.

**Runs without scores.** An MS MARCO run (``qid<TAB>pid<TAB>rank``) has ranks, not scores; read alone it
is ordered by ``-rank``, but ``-rank`` compared with another run's real scores is meaningless, so a merge
of scoreless and scored runs is refused. ``by_rank=True`` merges every run by rank instead: each input's
documents for a query are put in that input's order (its scores, or its ranks) and scored by their
reciprocal rank ``1 / position`` (1, 0.5, 0.333..., positions from 1), so the merged run takes the first
place of every input, then the second places, and so on (ties by docno descending). A document found in
two inputs keeps its best position.

**Query sets.** Runs that should come from one set of queries but do not (a part that failed half-way, a
run of other queries) are reported: a warning naming how many queries each input lacks (of the queries of
``queries``, when given, else of all the inputs' queries), an error with ``strict=True``.

The best ``k`` of a query's union are selected in O(n) (`select_top_k`): the k-th largest float32 score
``s_k`` is found by partition; every document scoring above ``s_k`` is in, and of those scoring exactly
``s_k`` the ones with the largest docnos fill the remaining places, which is the order "score descending,
docno descending" cut after ``k`` without sorting everything.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from maxsim_cli.errors import InputError, MaxsimWarning, UsageError
from maxsim_cli.run_files import RunWriter, format_score, read_run_and_format, sort_trec
from maxsim_cli.shards.files import check_output

# The run format that has no score column (`maxsim_cli.run_files`: its scores are -rank).
SCORELESS_FORMAT = "msmarco"


@dataclass
class MergeStats:
    """What a merge read and wrote."""

    inputs: int = 0
    queries: int = 0
    rows_read: int = 0
    rows_written: int = 0
    duplicates: int = 0  # (query, docno) pairs found in more than one input (equal scores, or by rank)
    by_rank: bool = False  # merged by reciprocal rank


def merge_runs(
    paths: Sequence[str | os.PathLike[str]],
    top_k: int,
    output: str | os.PathLike[str] = "-",
    *,
    tag: str = "maxsim",
    fmt: str = "trec",
    queries: str | os.PathLike[str] | None = None,
    by_rank: bool = False,
    strict: bool = False,
    warn: Callable[[str], None] | None = None,
) -> MergeStats:
    """Merge the runs at ``paths`` and write the best ``top_k`` documents per query to ``output``.

    Queries come in first-appearance order across the inputs (input order, then file order), or, with
    ``queries`` (a query embeddings file: safetensors, Arrow or Parquet), in that file's order, which
    is the order `maxsim score` writes; a query of the runs missing from that file is then an error.
    Inputs may be any format `maxsim_cli.run_files.read_run` reads; ``-`` (at most once) is stdin,
    ``output="-"`` stdout. The output is written atomically, after every input has been read and checked;
    an output that is one of the inputs, or cannot be written, is refused before any is read.

    A run without scores (MS MARCO's three columns) among scored runs is an `InputError` unless
    ``by_rank`` (see the module docstring). Inputs whose query sets differ give one warning, passed to
    ``warn`` (default: a `MaxsimWarning`), or with ``strict`` an `InputError` and no output.
    """
    if not paths:
        raise UsageError("no runs to merge; give at least one RUN")
    if top_k < 1:
        raise UsageError(f"--top-k must be at least 1, got {top_k}")
    if sum(1 for p in paths if str(p) == "-") > 1:
        raise UsageError("'-' (standard input) can be given only once among the runs to merge")
    check_output(output, [*paths, queries])  # not one of the inputs, and writable: before reading them
    query_order = _query_ids(queries) if queries is not None else None
    stats = MergeStats(inputs=len(paths), by_rank=by_rank)
    # qid -> docno -> (score, index of the input it came from)
    merged: dict[str, dict[str, tuple[float, int]]] = {}
    query_sets: list[set[str]] = []
    scored: str | None = None  # an input with scores, and one without, for the error that needs both
    scoreless: str | None = None
    for source, path in enumerate(paths):
        run, run_format = read_run_and_format(path)
        if run_format == SCORELESS_FORMAT:
            scoreless = scoreless or _name(path)
        else:
            scored = scored or _name(path)
        if scored is not None and scoreless is not None and not by_rank:
            raise InputError(
                f"{scoreless}: a run without scores (MS MARCO 'qid<TAB>pid<TAB>rank'), so its ranks cannot "
                f"be compared with the scores of {scored}; pass --by-rank to merge every run by rank"
            )
        query_sets.append(set(run))
        for qid, rows in run.items():
            if query_order is not None and qid not in query_order:
                raise InputError(
                    f"{_name(path)}: query {qid!r} is not in the query file {queries}; merge runs of the "
                    "queries of that file, or leave out --queries"
                )
            docs = merged.setdefault(qid, {})
            stats.rows_read += len(rows)
            if by_rank:
                rows = _reciprocal_ranks(rows)
            for docno, score in rows:
                previous = docs.get(docno)
                if previous is None:
                    docs[docno] = (score, source)
                    continue
                if by_rank:  # the best position of the document in any input
                    if score > previous[0]:
                        docs[docno] = (score, source)
                    stats.duplicates += 1
                    continue
                if np.float32(previous[0]) != np.float32(score):
                    other = _name(paths[previous[1]])
                    raise InputError(
                        f"{_name(path)}: query {qid!r} docno {docno!r} has score {format_score(score)} here "
                        f"but {format_score(previous[0])} in {other}; runs to merge must score disjoint "
                        "parts of one corpus with the same queries and model"
                    )
                stats.duplicates += 1
    _report_query_sets(
        paths, query_sets, list(query_order) if query_order is not None else None, strict, warn
    )
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


def _reciprocal_ranks(rows: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """One input's rows of a query, each scored ``1 / position`` in the input's own order (trec_eval's:
    score descending, ties by docno descending; an MS MARCO run's scores are -rank, so its ranks)."""
    order = sort_trec([docno for docno, _ in rows], [score for _, score in rows])
    return [(rows[i][0], 1.0 / position) for position, i in enumerate(order, 1)]


def _report_query_sets(
    paths: Sequence[str | os.PathLike[str]],
    query_sets: list[set[str]],
    query_order: list[str] | None,
    strict: bool,
    warn: Callable[[str], None] | None,
) -> None:
    """Warn (``strict``: raise `InputError`) when some inputs lack queries that others (or the query
    file) have: one line, how many each input lacks, with an example."""
    expected = set(query_order) if query_order is not None else set().union(*query_sets)
    whole = "of the query file" if query_order is not None else "of all the runs"
    lacking = []
    for path, found in zip(paths, query_sets, strict=True):
        missing = expected - found
        if missing:
            example = min(missing) if query_order is None else next(q for q in query_order if q in missing)
            lacking.append(f"{_name(path)} lacks {len(missing)} (e.g. {example!r})")
    if not lacking:
        return
    counts = ", ".join(lacking)
    message = f"the runs hold different queries: of the {len(expected)} queries {whole}, {counts}"
    if strict:
        raise InputError(f"{message}; merge runs of the same queries, or leave out --strict")
    message += "; each query is merged from the runs that have it (--strict makes this an error)"
    if warn is not None:
        warn(message)
    else:
        warnings.warn(message, MaxsimWarning, stacklevel=3)


def select_top_k(docnos: Sequence[str], scores: Sequence[float] | np.ndarray, k: int) -> np.ndarray:
    """Indices of the best ``k`` documents (all of them when there are fewer), in no particular order.

    "Best" is trec_eval's order, the one `maxsim_cli.run_files.sort_trec` sorts by: float32 score descending,
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
