"""Inputs of `maxsim verify`: the queries as the kernel sees them, which documents are scored (all, a
seeded sample, or a run's candidates), and reading those documents by location into packed batches."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from maxsim_cli.errors import InputError
from maxsim_cli.run_files import read_run
from maxsim_cli.shards import Corpus, DocBatch


def query_values(batch: DocBatch, corpus_dtype: str, path: str) -> torch.Tensor:
    """Query vectors as the kernel gets them: the corpus's float dtype, or float32 for an int8 corpus."""
    emb = batch.embeddings
    if emb.dtype == torch.int8:
        if batch.scales is None:
            raise InputError(
                f"{path}: int8 queries without per-token scales; re-create them with maxsim pack"
            )
        emb = emb.to(torch.float32) * batch.scales.to(torch.float32)[:, None]
    if corpus_dtype == "int8":
        return emb.to(torch.float32).contiguous()
    return emb.to(getattr(torch, corpus_dtype)).contiguous()


def read_locations(corpus: Corpus, locations: np.ndarray) -> DocBatch:
    """Documents at (shard, index) `locations` [n, 2], in that order, packed into one batch."""
    n = locations.shape[0]
    order = np.lexsort((locations[:, 1], locations[:, 0]))
    parts: list[DocBatch] = []
    for s in np.unique(locations[:, 0]):
        picked = order[locations[order, 0] == s]
        parts.append(corpus.shards[int(s)].read_doc_indices(locations[picked, 1]))
    if not parts:
        return corpus.shards[0].read_docs(0, 0)
    emb = torch.cat([p.embeddings for p in parts]) if len(parts) > 1 else parts[0].embeddings
    scales = None
    if parts[0].scales is not None:
        scales = torch.cat([p.scales for p in parts]) if len(parts) > 1 else parts[0].scales  # type: ignore[misc]
    ids = [i for p in parts for i in p.ids]
    lengths = np.concatenate([p.lengths().numpy() for p in parts])
    sorted_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    if np.array_equal(order, np.arange(n)):
        return DocBatch(ids, emb, torch.from_numpy(sorted_offsets), scales)
    # back to the requested order: document order[k] of the request sits at sorted position k
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)
    out_lengths = lengths[position]
    out_offsets = np.concatenate([[0], np.cumsum(out_lengths)]).astype(np.int64)
    rows = np.repeat(sorted_offsets[position] - out_offsets[:-1], out_lengths) + np.arange(out_offsets[-1])
    rows_t = torch.from_numpy(rows)
    return DocBatch(
        [ids[p] for p in position],
        emb.index_select(0, rows_t),
        torch.from_numpy(out_offsets),
        None if scales is None else scales.index_select(0, rows_t),
    )


def locations_of(corpus: Corpus, global_docs: np.ndarray) -> np.ndarray:
    """(shard, index in shard) of corpus-wide document numbers."""
    shard = np.searchsorted(corpus.doc_starts, global_docs, side="right") - 1
    return np.stack([shard, global_docs - corpus.doc_starts[shard]], axis=1).astype(np.int64)


def batches_of(corpus: Corpus, global_docs: np.ndarray, max_tokens: int) -> Iterator[np.ndarray]:
    """Split sorted corpus-wide document numbers into runs of at most `max_tokens` tokens within one
    shard (a longer document alone)."""
    lengths = np.concatenate([np.diff(s.offsets) for s in corpus.shards])[global_docs]
    shard_of = locations_of(corpus, global_docs)[:, 0]
    cumulative = np.concatenate([[0], np.cumsum(lengths)])
    start = 0
    while start < global_docs.size:
        shard_end = start + int(np.searchsorted(shard_of[start:], shard_of[start], side="right"))
        stop = int(np.searchsorted(cumulative, cumulative[start] + max_tokens, side="right")) - 1
        stop = min(max(stop, start + 1), shard_end)
        yield global_docs[start:stop]
        start = stop


def rows_of(query_offsets: np.ndarray, chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token rows of the chosen queries and their packed offsets."""
    lengths = np.diff(query_offsets)[chosen]
    rows = (
        np.concatenate([np.arange(query_offsets[q], query_offsets[q + 1]) for q in chosen])
        if len(chosen)
        else np.zeros(0, dtype=np.int64)
    )
    return rows.astype(np.int64), np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def batch_subset(batch: DocBatch, picked: np.ndarray) -> DocBatch:
    """Documents `picked` of a batch, packed, in that order."""
    offsets = batch.offsets.numpy()
    lengths = offsets[picked + 1] - offsets[picked]
    out_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    rows = torch.from_numpy(
        np.repeat(offsets[picked] - out_offsets[:-1], lengths) + np.arange(out_offsets[-1])
    )
    return DocBatch(
        [batch.ids[i] for i in picked],
        batch.embeddings.index_select(0, rows),
        torch.from_numpy(out_offsets),
        None if batch.scales is None else batch.scales.index_select(0, rows),
    )


def sample_documents(num_docs: int, count: int, seed: int) -> np.ndarray:
    """`count` distinct corpus-wide document numbers drawn uniformly with `seed`, sorted (all if fewer)."""
    if count >= num_docs:
        return np.arange(num_docs, dtype=np.int64)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(num_docs, size=count, replace=False)).astype(np.int64)


def select_candidates(
    path: str, corpus: Corpus, query_ids: list[str], queries_path: str
) -> tuple[list[np.ndarray], int, int]:
    """Per query, the corpus-wide numbers of its candidates (in run order); how many queries have none;
    how many candidates are not in the corpus (left out, as `maxsim score` leaves them out)."""
    run = read_run(path)
    position = {qid: q for q, qid in enumerate(query_ids)}
    unknown = next((qid for qid in run if qid not in position), None)
    if unknown is not None:
        raise InputError(
            f"{path}: query {unknown} is not in {queries_path}; the run must use the query file's ids"
        )
    index = corpus.candidate_index(docno for rows in run.values() for docno, _ in rows)
    per_query = [np.zeros(0, dtype=np.int64)] * len(query_ids)
    missing = 0
    for qid, rows in run.items():
        found = [index.get(docno) for docno, _ in rows]
        missing += sum(1 for w in found if w is None)
        numbers = [corpus.doc_starts[w[0]] + w[1] for w in found if w is not None]
        per_query[position[qid]] = np.array(numbers, dtype=np.int64)
    skipped = sum(1 for p in per_query if p.size == 0)
    return per_query, skipped, missing
