"""One rank's work: the job's corpus opened, the rank's share of its shards scored for all queries by the
single-process engine, its results handed over as a `Share` (used by torchrun ranks and rank threads)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from maxsim_cli.errors import UsageError
from maxsim_cli.parallel.environment import Logger
from maxsim_cli.parallel.shares import (
    MergeOrder,
    ResultSink,
    Share,
    make_share,
    run_candidate_index,
    split_candidates,
)
from maxsim_cli.scoring.request import ScoreRequest
from maxsim_cli.scoring.stats import ScoreStats
from maxsim_cli.shards.resident import assign_shards

if TYPE_CHECKING:
    from maxsim_cli.progress import ScoreProgress
    from maxsim_cli.shards import Corpus


def check_no_stdin(request: ScoreRequest) -> None:
    if request.queries == "-":
        raise UsageError(
            "QUERIES '-': standard input cannot be shared by the workers of a distributed job; save the "
            "Arrow stream to a file and pass its path"
        )
    if request.candidates == "-":
        raise UsageError(
            "--candidates '-': standard input cannot be shared by the workers of a distributed job; "
            "save the run to a file and pass its path"
        )
    for option, path in (("--include-ids", request.include_ids), ("--exclude-ids", request.exclude_ids)):
        if path == "-":
            raise UsageError(
                f"{option} '-': standard input cannot be shared by the workers of a distributed job; "
                "save the ids to a file and pass its path"
            )


class CudaInit(threading.Thread):
    """Creates the rank's CUDA context (a few hundred ms) while the rank joins the group and opens the
    corpus; `wait` re-raises what it raised."""

    def __init__(self, device: str) -> None:
        super().__init__(name="maxsim-cuda-init", daemon=True)
        self.device = device
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            torch.empty(1, device=self.device)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            self.error = exc

    def wait(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error


def open_job_corpus(request: ScoreRequest, generations: Sequence[int | None] | None = None) -> Corpus:
    """The job's corpus; ``generations``: the generation to open of each corpus folder (the one that
    rank 0 holds open: `maxsim_cli.parallel.ranks`), else the committed ones."""
    from maxsim_cli.shards import open_corpus

    check_no_stdin(request)
    corpus_paths = list(request.corpus)
    if not corpus_paths:
        raise UsageError("no corpus given: pass one or more shard files or directories after QUERIES")
    return open_corpus(corpus_paths, generations=generations)


def job_filter(request: ScoreRequest, corpus: Corpus, rank: int, log: Logger) -> np.ndarray | None:
    """The job's filter mask over the whole corpus (`maxsim_cli.scoring.filters`), made alike on every
    rank (the ids files and metadata columns read by each), so that a ``--strict`` error stops every
    rank at once; its warnings are rank 0's alone, as one process gives them."""
    from maxsim_cli.scoring.files import request_filter

    return request_filter(request, corpus, log if rank == 0 else (lambda message: None))


def score_share(
    request: ScoreRequest,
    rank: int,
    world: int,
    device: str,
    cuda_ready: CudaInit | None,
    log: Logger,
    corpus: Corpus | None = None,
    stop: threading.Event | None = None,
    staging_bytes: int | None = None,
    run: dict[str, list[tuple[str, float]]] | None = None,
    run_index: dict[str, tuple[int, int]] | None = None,
    progress: ScoreProgress | None = None,
    disallowed: np.ndarray | None = None,
    generations: Sequence[int | None] | None = None,
) -> tuple[Share, MergeOrder | None]:
    """Score this rank's shards of the corpus (opened here, or the job's open `corpus`, whose shards
    of this rank are closed afterwards) for all queries, return the results (and, on rank 0 in
    exhaustive mode, the docno order that the merge needs). `stop`: set when another rank failed;
    `staging_bytes`: the rank's pinned staging arena (`RankContext`); `run` and `run_index`: the
    candidates' run and its `run_candidate_index`, when the job has made them already (else made
    here); `progress`: the job's bar, shared by rank threads (else rank 0 draws its own share);
    `disallowed`: the job's filter mask over the whole corpus, when the job has made it already (else
    made here, from the request's filter: `job_filter`). The rank scores its shards with its part of
    the mask: each rank's top-k is of its allowed documents, so the merge's is of the job's.
    ``generations``: the corpus folders' generations to open (`open_job_corpus`)."""
    from maxsim_cli.queries import read_queries, read_query_ids
    from maxsim_cli.run_files import read_run
    from maxsim_cli.scoring import engine
    from maxsim_cli.scoring.filters import share_mask
    from maxsim_cli.shards import Corpus, input_notes, report_notes

    own_corpus = corpus is None
    if corpus is None:
        corpus = open_job_corpus(request, generations)
    try:
        shares = assign_shards([s.num_tokens for s in corpus.shards], world)
        mine = shares[rank]
        owner = [0] * len(corpus.shards)
        for r, indices in enumerate(shares):
            for s in indices:
                owner[s] = r
        if rank != 0:
            base_log = log
            log = lambda message: base_log(f"rank {rank}: {message}")  # noqa: E731
        elif world > len(corpus.shards):
            n = len(corpus.shards)
            idle = f"rank {n} has" if world - n == 1 else f"ranks {n} to {world - 1} have"
            log(
                f"note: {world} ranks but {n} shards: {idle} nothing to score; split the corpus into "
                "more shards to use them"
            )
        query_ids = None
        if rank == 0:
            query_ids = read_query_ids(request.queries)  # a query shard or a folder of them
        if disallowed is None and request.filtered:
            disallowed = job_filter(request, corpus, rank, log)
        candidates = None
        if request.candidates is not None:
            run = run if run is not None else read_run(request.candidates)
            if run_index is None:
                run_index = run_candidate_index(corpus, run)
            candidates, _ = split_candidates(run, run_index, owner, rank, request.strict)
        sink = ResultSink()
        if cuda_ready is not None:
            cuda_ready.wait()
        if mine:
            sub = corpus if len(mine) == len(corpus.shards) else Corpus([corpus.shards[s] for s in mine])
            share_request = dataclasses.replace(
                request,
                device=device,
                devices=None,
                show_progress=request.show_progress and rank == 0 and progress is None,
            )
            context = engine.RankContext(stop=stop, staging_bytes=staging_bytes, progress=progress)
            started = time.perf_counter()
            try:
                share_request.check()  # bad options are reported before the query file is read
                queries = read_queries(share_request.queries).batch
                # the job's corpus (skipped shards, encoder): reported once, as one process reports it
                if rank == 0:
                    report_notes(
                        input_notes(corpus, queries, share_request.query_name), strict=request.strict, log=log
                    )
                entered = time.perf_counter()
                stats = engine.run(
                    share_request,
                    sub,
                    queries,
                    sink,
                    candidates=candidates,
                    context=context,
                    log=log,
                    disallowed=share_mask(disallowed, corpus, mine),
                )
            finally:
                sub.close()  # this rank's shards
            stats.setup_s += entered - started
            stats.wall_s = time.perf_counter() - started
        else:
            stats = ScoreStats(
                mode=request.mode, device=device, backend=request.backend, output=request.output
            )
        share = make_share(rank, device, mine, sink, stats, query_ids, corpus)
        merge_order = None
        if rank == 0 and request.candidates is None:
            merge_order = MergeOrder(corpus.rank_of_ordinal(), corpus.id_order()[2])
        return share, merge_order
    finally:
        if own_corpus:
            corpus.close()
