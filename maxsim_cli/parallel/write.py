"""Rank 0's last step: the shares' results merged in the query file's order and the run written once,
by the run writer, atomically (under the ``--devices`` launcher, with a note naming its temporary file)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Sequence
from typing import Any

import numpy as np

from maxsim_cli import settings
from maxsim_cli.arrays import values_array
from maxsim_cli.lifeline import launcher_gone
from maxsim_cli.parallel.environment import PARTIAL_NOTE
from maxsim_cli.parallel.shares import MergeOrder, Share, merge_columns
from maxsim_cli.scoring.request import ScoreRequest

# Rank 0 merges the ranks' columns this many queries at a time (temporaries ~ 24 B x ranks x k a query).
MERGE_QUERY_BLOCK = 4096


def write_merged(request: ScoreRequest, shares: Sequence[Share], order: MergeOrder | None) -> None:
    """Rank 0: the best ``top_k`` of every query over all ranks, in the query file's order, written once."""
    from maxsim_cli.run_files import RunWriter

    if launcher_gone():  # the job has failed: its launcher is dead and reports nothing; write nothing
        raise SystemExit(128 + signal.SIGTERM)
    with RunWriter(request.output, tag=request.run_tag, fmt=request.fmt) as writer:
        note = _note_partial_output(writer)
        try:
            merge_into(writer, request.top_k, shares, order)
        finally:
            _remove_quietly(note)


def _note_partial_output(writer: Any) -> str | None:
    """Under the ``--devices`` launcher, write the path of the run's temporary file to the job folder's
    `PARTIAL_NOTE`: should this rank be killed while writing, the launcher removes that file, and only
    it. Returns the note's path (None when there is nothing to note)."""
    status_path = settings.launcher_status_file()
    output = getattr(writer, "_output", None)  # the run's `OutputFile`; None on stdout
    tmp = getattr(output, "_tmp", None)  # None for a FIFO or a device, written through
    if not status_path or not tmp:
        return None
    note = os.path.join(os.path.dirname(status_path), PARTIAL_NOTE)
    with open(note, "w", encoding="utf-8") as fh:
        fh.write(os.path.abspath(tmp))
    return note


def _remove_quietly(path: str | None) -> None:
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)


def merge_into(sink: Any, top_k: int, shares: Sequence[Share], order: MergeOrder | None) -> None:
    """The best ``top_k`` of every query over all ranks, handed to ``sink`` in the query file's order."""
    from maxsim_cli.merge import select_top_k

    query_ids = shares[0].query_ids
    assert query_ids is not None
    if order is not None:  # exhaustive mode: columns, every query on every rank that scored
        columns = [share.columns for share in shares if share.columns is not None]
        for q0, scores, ranks in merge_columns(columns, order.rank_of_ordinal, top_k, MERGE_QUERY_BLOCK):
            docnos = order.ids_by_rank.take(values_array(ranks.numpy()))
            sink.write_ranked(query_ids[q0 : q0 + scores.shape[0]], docnos, scores.numpy())
        return
    by_query: dict[str, list[tuple[list[str], np.ndarray]]] = {}
    for share in shares:
        for qid, docnos, scores in share.results:
            by_query.setdefault(qid, []).append((docnos, scores))
    for qid in query_ids:
        parts = by_query.get(qid)
        if not parts:
            continue
        if len(parts) == 1:
            docnos, scores = parts[0]
        else:
            docnos = [d for part_docnos, _ in parts for d in part_docnos]
            scores = np.concatenate([part_scores for _, part_scores in parts])
        keep = select_top_k(docnos, scores, top_k)
        sink.write_query(qid, [docnos[i] for i in keep.tolist()], scores[keep].tolist())
