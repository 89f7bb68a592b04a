"""A corpus resident on several devices (`Corpus.to` with a list): each device's share scored in a
thread of its own, the shares merged as rank threads' are."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from maxsim_cli.errors import RankStopped
from maxsim_cli.parallel.environment import Logger, log_to_stderr
from maxsim_cli.parallel.shares import (
    MergeOrder,
    ResultSink,
    Share,
    combine_stats,
    make_share,
    run_candidate_index,
    split_candidates,
)
from maxsim_cli.parallel.write import merge_into
from maxsim_cli.scoring.request import ScoreRequest
from maxsim_cli.scoring.stats import ScoreStats

if TYPE_CHECKING:
    from maxsim_cli.shards import Corpus, DocBatch


def score_resident(
    request: ScoreRequest,
    corpus: Corpus,
    queries: DocBatch,
    sink: Any,
    *,
    candidates: dict[str, list[tuple[str, float]]] | None = None,
    log: Logger = log_to_stderr,
    disallowed: np.ndarray | None = None,
) -> ScoreStats:
    """Score ``queries`` against a corpus whose shards are resident on several devices
    (``corpus.placement``): each device's share by the single-process engine in a thread of its own,
    the shares' top-k merged as `run_threads` merges its ranks', the results handed to ``sink``. The
    same run as one device gives; a device that fails stops the others, and its error is raised.
    ``disallowed``: a filter's mask over the whole corpus; each device scores with its share's part."""
    from maxsim_cli.scoring import engine
    from maxsim_cli.scoring.filters import share_mask

    placement = corpus.placement
    assert placement, "score_resident needs a corpus resident on several devices"
    world = len(placement)
    owner = [0] * len(corpus.shards)
    for r, part in enumerate(placement):
        for s in part.shards:
            owner[s] = r
    run_index = run_candidate_index(corpus, candidates) if candidates is not None else None
    stop = threading.Event()
    outcomes: list[Share | BaseException | None] = [None] * world
    start = time.perf_counter()

    def rank_main(rank: int) -> None:
        part = placement[rank]
        try:
            mine = None
            if candidates is not None:
                assert run_index is not None
                mine, _missing = split_candidates(candidates, run_index, owner, rank, request.strict)
            rank_sink = ResultSink()
            rank_request = dataclasses.replace(request, device=str(part.device), devices=None)
            rank_log = log if rank == 0 else (lambda message: log(f"{part.device}: {message}"))
            stats = engine.run(
                rank_request, part.corpus, queries, rank_sink, candidates=mine,
                context=engine.RankContext(stop=stop), log=rank_log,
                disallowed=share_mask(disallowed, corpus, part.shards),
            )  # fmt: skip
            qids = list(queries.ids) if rank == 0 else None
            outcomes[rank] = make_share(rank, str(part.device), part.shards, rank_sink, stats, qids, corpus)
        except BaseException as exc:  # noqa: BLE001 - raised below, on the caller's thread
            outcomes[rank] = exc
            stop.set()

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"maxsim-device-{r}") for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    if failures:
        raise next((f for f in failures if not isinstance(f, RankStopped)), failures[0])
    shares = [o for o in outcomes if isinstance(o, Share)]
    order = MergeOrder(corpus.rank_of_ordinal(), corpus.id_order()[2]) if candidates is None else None
    mark = time.perf_counter()
    with sink if hasattr(sink, "__enter__") else contextlib.nullcontext(sink):
        merge_into(sink, request.top_k, shares, order)
    stats = combine_stats(request, shares)
    stats.write_s = time.perf_counter() - mark
    stats.extra["workers"] = "resident devices"
    stats.extra["resident_corpus"] = True
    stats.wall_s = time.perf_counter() - start
    return stats
