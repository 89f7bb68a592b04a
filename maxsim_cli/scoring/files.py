"""A scoring run whose inputs are files and whose output is a run file: what `maxsim score` does on one
device (`maxsim_cli.score.score` without ``--devices``, and a job with a single device)."""

from __future__ import annotations

import time

from maxsim_cli.memory import HostMeter
from maxsim_cli.queries import read_queries
from maxsim_cli.runs import RunWriter, read_run
from maxsim_cli.scoring import engine
from maxsim_cli.scoring.engine import Logger, RankContext
from maxsim_cli.scoring.request import ScoreRequest
from maxsim_cli.scoring.stats import ScoreStats
from maxsim_cli.shards import check_same_dim, input_notes, open_corpus, report_notes
from maxsim_cli.shards.files import check_output


def score_files(request: ScoreRequest, *, log: Logger = engine._stderr) -> ScoreStats:
    """Open the request's corpus, read its queries (and candidates), score them with `engine.run` and
    write the run to ``request.output``; the corpus is closed on every exit path. ``setup_s`` and
    ``wall_s`` count from this call."""
    started = time.perf_counter()
    device = request.check()
    # the run may not overwrite an input and must be writable: refused now, not after the scoring
    check_output(request.output, [request.queries, *request.corpus, request.candidates])
    writer = RunWriter(request.output, tag=request.run_tag, fmt=request.fmt)  # opens only in the pass
    # what --max-host-memory bounds: the growth from here on, the inputs' ids and offsets included
    meter = HostMeter(device if device.type == "cuda" else None)
    # on CUDA the staging memory locks while the corpus opens (`engine.open_arena`)
    arena = engine.open_arena(request, device) if device.type == "cuda" else None
    try:
        corpus = open_corpus(list(request.corpus))
    except BaseException:
        meter.close()
        raise
    try:
        queries = read_queries(request.queries).batch  # a query shard, a folder of them, or stdin
        check_same_dim(queries, request.query_name, corpus)  # before the run is read, as always
        # empty shards skipped, no queries, another encoder: warnings (--strict: errors), before any work
        report_notes(input_notes(corpus, queries, request.query_name), strict=request.strict, log=log)
        candidates = read_run(request.candidates) if request.candidates is not None else None
        entered = time.perf_counter()
        stats = engine.run(
            request,
            corpus,
            queries,
            writer,
            candidates=candidates,
            context=RankContext(arena=arena, host_meter=meter),
            log=log,
        )
    finally:
        corpus.close()
        meter.close()
    stats.setup_s += entered - started
    stats.wall_s = time.perf_counter() - started
    return stats
