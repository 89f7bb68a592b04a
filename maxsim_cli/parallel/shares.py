"""What a rank hands over and the arithmetic of merging it: a rank's results (`ResultSink`, `Share`),
the candidates each rank scores (`split_candidates`), the bounds below which a result cannot reach the
job's top-k (`kth_scores`, `kth_column`), the merge of the ranks' columns by the engine's order keys
(`merge_columns`), and the job's stats (`combine_stats`). Pure functions, tested alone."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from maxsim_cli.scoring.request import ScoreRequest
from maxsim_cli.scoring.stats import ScoreStats

if TYPE_CHECKING:
    from maxsim_cli.shards import Corpus


class ResultSink:
    """The sink of a rank's `engine.run` in place of `maxsim_cli.run_files.RunWriter`: keeps the results
    in memory.

    Rerank mode hands it each query's results (`write_query`: docnos and scores); exhaustive mode hands
    it whole query batches as columns (`write_ordinals`: scores and corpus ordinals, ``[nq, m]`` arrays,
    best first), which travel to rank 0 as two arrays instead of a Python string per result. Scores are
    kept as float32, the precision the run prints (`maxsim_cli.run_files.format_score`).
    """

    def __init__(self) -> None:
        self.results: list[tuple[str, list[str], np.ndarray]] = []
        self.blocks: list[tuple[np.ndarray, np.ndarray]] = []

    def write_ordinals(self, scores: np.ndarray, ordinals: np.ndarray) -> None:
        """Keep one query batch: float32 scores and int64 ordinals of the engine's corpus, ``[nq, m]``,
        each row best first."""
        self.blocks.append((np.asarray(scores, dtype=np.float32), np.asarray(ordinals, dtype=np.int64)))

    def columns(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Every batch kept by `write_ordinals`, stacked in query order (None when there is none)."""
        if not self.blocks:
            return None
        return np.concatenate([b[0] for b in self.blocks]), np.concatenate([b[1] for b in self.blocks])

    def __enter__(self) -> ResultSink:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def write_query(self, qid: str, docnos: Sequence[str], scores: Sequence[float]) -> None:
        """Keep one query's results (any order)."""
        self.results.append((qid, list(docnos), np.asarray(scores, dtype=np.float32)))


@dataclass
class Share:
    """What a rank sends to rank 0."""

    rank: int
    device: str
    shards: list[int]
    results: list[tuple[str, list[str], np.ndarray]]  # rerank mode: per query
    stats: dict[str, Any]
    query_ids: list[str] | None = None  # rank 0 only: the query file's order
    # exhaustive mode: scores and corpus-wide ordinals [nq, m] (every query, rows best first)
    columns: tuple[np.ndarray, np.ndarray] | None = None


@dataclass
class MergeOrder:
    """Rank 0's key from corpus ordinals to docnos, for merging columns (stays on rank 0)."""

    rank_of_ordinal: np.ndarray  # int64 [docs]: position of each document's id in byte order
    ids_by_rank: Any  # pyarrow array: the ids in that order


def run_candidate_index(
    corpus: Corpus, run: dict[str, list[tuple[str, float]]]
) -> dict[str, tuple[int, int]]:
    """(shard, document) of each of the run's candidates in the corpus (`Corpus.candidate_index`)."""
    return corpus.candidate_index(docno for cands in run.values() for docno, _ in cands)


def split_candidates(
    run: dict[str, list[tuple[str, float]]],
    id_index: dict[str, tuple[int, int]],
    owner_of_shard: Sequence[int],
    rank: int,
    strict: bool,
) -> tuple[dict[str, list[tuple[str, float]]], int]:
    """The candidates rank ``rank`` scores: those in its shards, in run order, every qid of the run kept
    (so that the engine still checks each qid against the query file). Candidates in no shard go to
    rank 0, which reports them as a single process would; with ``strict`` to every rank, so that all of
    them stop with the same error at once. Returns the rank's run and the number of missing candidates.
    """
    part: dict[str, list[tuple[str, float]]] = {}
    missing = 0
    keep_missing = rank == 0 or strict
    for qid, cands in run.items():
        kept = []
        for docno, score in cands:
            where = id_index.get(docno)
            if where is None:
                missing += 1
                if keep_missing:
                    kept.append((docno, score))
            elif owner_of_shard[where[0]] == rank:
                kept.append((docno, score))
        part[qid] = kept
    return part, missing


def kth_scores(results: Sequence[tuple[str, list[str], np.ndarray]], k: int) -> dict[str, float]:
    """Per query, the k-th best score of a rank's results (only queries with ``k`` results).

    A rank with ``k`` results at or above ``s`` for a query proves that the job's ``k``-th best score is
    at least ``s``: every result of any rank scoring below the largest such ``s`` over the ranks is
    beaten by ``k`` others and cannot be in the top-k (a result equal to it can, by the docno
    tie-break, and is kept). So ranks send only results at or above that bound: about ``k`` per query
    in all instead of ``k`` per rank, which keeps rank 0's gather and merge flat in the number of ranks.
    """
    out = {}
    for qid, _, scores in results:
        if len(scores) >= k:
            out[qid] = float(np.partition(scores, len(scores) - k)[len(scores) - k])
    return out


def kth_column(scores: np.ndarray, k: int) -> np.ndarray:
    """`kth_scores` for columns: the k-th best score of each row of ``scores [nq, m]`` (rows best first),
    -inf where a row has fewer than ``k``."""
    if scores.shape[1] >= k and k > 0:
        return scores[:, k - 1].astype(np.float32)
    return np.full(scores.shape[0], -np.inf, dtype=np.float32)


def trim_columns(columns: tuple[np.ndarray, np.ndarray], floors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Columns cut to the widest row prefix at or above its query's floor (`kth_column`, best over the
    ranks): what is cut scores below ``k`` others and cannot reach the top-k; what is kept beyond a
    row's own prefix loses in the merge."""
    scores, ordinals = columns
    if scores.shape[1] == 0:
        return columns
    width = int((scores >= floors[:, None]).sum(axis=1).max(initial=0))
    return scores[:, :width], ordinals[:, :width]


def merge_columns(
    parts: Sequence[tuple[np.ndarray, np.ndarray]], rank_of_ordinal: np.ndarray, top_k: int, rows: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """The best ``top_k`` of the ranks' columns per query, in blocks of up to ``rows`` queries:
    ``(first query, float32 scores [n, m], docno ranks [n, m])``, best first, with the engine's order keys
    (`maxsim_cli.scoring.topk`): float32 score descending, docno descending."""
    from maxsim_cli.scoring.topk import decode_keys, order_keys

    parts = [p for p in parts if p[0].shape[1]]
    if not parts:
        return
    nq = parts[0][0].shape[0]
    for q0 in range(0, nq, rows):
        q1 = min(q0 + rows, nq)
        scores = torch.from_numpy(np.concatenate([p[0][q0:q1] for p in parts], axis=1))
        ranks = torch.from_numpy(rank_of_ordinal[np.concatenate([p[1][q0:q1] for p in parts], axis=1)])
        keys = order_keys(scores, ranks)
        keys = torch.topk(keys, min(top_k, keys.shape[1]), dim=1, largest=True, sorted=True).values
        best_scores, best_ranks = decode_keys(keys)
        yield q0, best_scores, best_ranks


def drop_below(
    results: Sequence[tuple[str, list[str], np.ndarray]], bounds: Sequence[dict[str, float]]
) -> list[tuple[str, list[str], np.ndarray]]:
    """A rank's results without those scoring below the best of the ranks' `kth_scores` bounds."""
    out = []
    for qid, docnos, scores in results:
        floor = max((b[qid] for b in bounds if qid in b), default=None)
        if floor is not None:
            keep = np.flatnonzero(scores >= np.float32(floor))
            if len(keep) < len(scores):
                docnos = [docnos[i] for i in keep.tolist()]
                scores = scores[keep]
        out.append((qid, docnos, scores))
    return out


def make_share(
    rank: int,
    device: str,
    mine: list[int],
    sink: ResultSink,
    stats: ScoreStats,
    query_ids: list[str] | None,
    corpus: Corpus,
) -> Share:
    """What a rank hands over: its results, and in exhaustive mode its columns with the engine's
    ordinals (of the rank's shards ``mine``) turned into ordinals of the whole ``corpus``."""
    stats_fields = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
    stats_fields["extra"] = dict(stats.extra)
    share = Share(rank, device, mine, sink.results, stats_fields, query_ids)
    columns = sink.columns()
    if columns is not None:
        scores, ordinals = columns
        sub_starts = np.concatenate([[0], np.cumsum([corpus.shards[s].num_docs for s in mine])])
        shard = np.searchsorted(sub_starts, ordinals, side="right") - 1
        base = corpus.doc_starts[np.asarray(mine, dtype=np.int64)] - sub_starts[:-1]
        share.columns = (scores, ordinals + base[shard])
    return share


def combine_stats(request: ScoreRequest, shares: Sequence[Share]) -> ScoreStats:
    """Job stats: counts and stage times summed over ranks; peaks, setup and batch sizes the largest
    rank's; anything else rank 0's. Each rank's own stats are kept under ``ranks``."""
    per_rank = [ScoreStats(**share.stats) for share in shares]
    out = ScoreStats(**{**shares[0].stats, "extra": {}})
    out.device = f"{len(shares)} ranks ({', '.join(share.device for share in shares)})"
    out.output = request.output
    summed = ("documents", "tokens", "pairs", "missing_candidates", "oom_retries", "doc_batches")
    for name in (*summed, "bytes_read", "read_s", "copy_s", "score_s", "wait_s"):
        setattr(out, name, sum(getattr(s, name) for s in per_rank))
    largest = ("queries", "query_batches", "peak_host_bytes", "query_batch_size", "max_batch_docs")
    for name in (*largest, "max_batch_tokens", "planned_device_bytes", "setup_s"):
        if hasattr(out, name):
            setattr(out, name, max(getattr(s, name) for s in per_rank))
    if request.candidates is not None:  # a query's candidates may lie on several ranks: count it once
        out.queries_with_candidates = len(
            {qid for share in shares for qid, docnos, _ in share.results if len(docnos)}
        )
    filtered = [s.extra["filter"] for s in per_rank if "filter" in s.extra]
    peaks = [s.peak_gpu_bytes for s in per_rank if s.peak_gpu_bytes is not None]
    out.peak_gpu_bytes = max(peaks) if peaks else None
    out.resident = all(s.resident for s in per_rank if s.documents)
    out.extra = {
        "rank": 0,
        "world_size": len(shares),
        "ranks": [
            {"rank": share.rank, "device": share.device, "shards": share.shards, **s.as_dict()}
            for share, s in zip(shares, per_rank, strict=True)
        ],
    }
    if filtered:  # each rank's filter counts its own shards: the job's are their sums
        out.extra["filter"] = {
            "allowed": sum(f["allowed"] for f in filtered),
            "path": "/".join(sorted({f["path"] for f in filtered})),
        }
    if any("filtered_candidates" in s.extra for s in per_rank):
        out.extra["filtered_candidates"] = sum(s.extra.get("filtered_candidates", 0) for s in per_rank)
    return out
