"""``--devices`` with GPUs: a rank per device, each a thread of this process driving its GPU with the
single-process engine; the ranks share the open corpus and hand their results over in memory."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Sequence

from maxsim_cli import tuning
from maxsim_cli.errors import MaxsimError, RankStopped
from maxsim_cli.parallel.environment import Logger, log_to_stderr
from maxsim_cli.parallel.shares import MergeOrder, Share, combine_stats, run_candidate_index
from maxsim_cli.parallel.work import job_filter, open_job_corpus, score_share
from maxsim_cli.parallel.write import write_merged
from maxsim_cli.scoring.request import ScoreRequest
from maxsim_cli.scoring.stats import ScoreStats

_POLL_S = 0.05
# Rank threads share Python's lock, which each holds for part of every batch, so they take larger batches
# than one process does (a pinned staging arena of this size each) and hand the lock over every
# `tuning.THREAD_SWITCH_S`: two H200s, 10 GB, 1.34x one GPU against 0.90x with neither (docs/kernel-notes.md,
# "Two GPUs from one host").
THREAD_STAGING_BYTES = 1 << 30
# The machine's page cache is read fastest by ~16 threads in all (plan.DEFAULT_READER_THREADS), so the
# rank threads share them instead of starting 16 each: 8 a rank 1.50x one GPU on 10 GB, 16 a rank 1.42x
# (benchmarks/results/scaling/multigpu-10gb-h200x2-readers.json).


def run_threads(request: ScoreRequest, devices: Sequence[str], *, log: Logger = log_to_stderr) -> ScoreStats:
    """Score on several devices of this machine from this one process: a rank per device, each a thread
    that drives its GPU with the single-process engine, results merged here and the run written once.

    The ranks share the open corpus (headers and ids read once) and need no process group: they hand
    their results over in memory. The file reads and copies release Python's lock; the engine's
    per-batch work holds it (~1 ms a batch on the H200 machine), which is why rank threads take larger
    batches (`THREAD_STAGING_BYTES`) and a shorter switch interval. Threads spare the job a worker's
    start-up (an interpreter, torch and Triton imported again, the corpus opened again), which on a
    10 GB corpus took longer than scoring it (docs/scaling.md). A rank that fails stops the others at
    their next batch; the job raises that rank's error and writes nothing.
    """
    from maxsim_cli.progress import ScoreProgress
    from maxsim_cli.scoring.plan import DEFAULT_READER_THREADS

    start = time.perf_counter()
    world = len(devices)
    if not request.reader_threads:
        machine = min(DEFAULT_READER_THREADS, os.cpu_count() or 1)
        request = dataclasses.replace(request, reader_threads=max(1, machine // world))
    stop = threading.Event()
    corpus = open_job_corpus(request)
    switches = contextlib.ExitStack()
    try:
        run = run_index = None
        if request.candidates is not None:  # read and indexed once for all ranks
            from maxsim_cli.run_files import read_run

            run = read_run(request.candidates)
            run_index = run_candidate_index(corpus, run)
        disallowed = job_filter(request, corpus, 0, log) if request.filtered else None  # made once
        outcomes: list[tuple[Share, MergeOrder | None] | BaseException | None] = [None] * world
        bar = ScoreProgress(request.show_progress, 0, shared=True)  # one for all ranks' work

        def rank_main(rank: int) -> None:
            try:
                outcomes[rank] = score_share(
                    request, rank, world, devices[rank], None, log,
                    corpus=corpus, stop=stop, staging_bytes=THREAD_STAGING_BYTES, run=run,
                    run_index=run_index, progress=bar, disallowed=disallowed,
                )  # fmt: skip
            except BaseException as exc:  # noqa: BLE001 - reported by the launcher's thread
                outcomes[rank] = exc
                stop.set()

        switches.enter_context(tuning.quick_thread_switches())

        threads = [
            threading.Thread(target=rank_main, args=(r,), name=f"maxsim-rank-{r}", daemon=True)
            for r in range(world)
        ]
        with bar:
            for thread in threads:
                thread.start()
            try:
                for thread in threads:
                    while thread.is_alive():
                        thread.join(_POLL_S)
            except BaseException:  # Ctrl-C: the ranks stop at their next batch, then the error goes on
                stop.set()
                for thread in threads:
                    thread.join()
                raise
        share_s = time.perf_counter() - start
    finally:
        switches.close()
        corpus.close()
    failures = [(r, o) for r, o in enumerate(outcomes) if isinstance(o, BaseException)]
    if failures:
        first = [(r, o) for r, o in failures if not isinstance(o, RankStopped)] or failures
        r, exc = first[0]
        if r == 0 or not isinstance(exc, MaxsimError):
            raise exc
        raise type(exc)(f"rank {r} of {world} ({devices[r]}): {exc}") from None
    done = [o for o in outcomes if isinstance(o, tuple)]
    shares = [share for share, _order in done]
    mark = time.perf_counter()
    write_merged(request, shares, done[0][1])
    merge_write_s = time.perf_counter() - mark
    stats = combine_stats(request, shares)
    stats.write_s = merge_write_s
    stats.extra["phases"] = {"share_s": share_s, "merge_write_s": merge_write_s}
    stats.extra["workers"] = "threads"
    stats.wall_s = time.perf_counter() - start
    return stats
