"""`maxsim score`: exact MaxSim of queries against a sharded corpus, exhaustive top-k or reranking.

`score` is the front of the scoring layers: it gathers its options in a `ScoreRequest` and hands it to
`maxsim_cli.scoring.dispatch.run_files`, which runs it as a job of several ranks (`maxsim_cli.parallel`:
``devices``, or a torchrun environment) or in this process on one device
(`maxsim_cli.scoring.files.score_files`, which opens the inputs and calls `maxsim_cli.scoring.engine.run`).
The modes, the memory plans and where the time goes are described in `maxsim_cli.scoring.engine` and
`maxsim_cli.scoring.plan`.

The other public names here are kept for code that imported them from this module before the layers
existed.
"""

from __future__ import annotations

from collections.abc import Sequence

from maxsim_cli.devices import check_backend_option, resolve_device
from maxsim_cli.parallel.environment import Logger, log_to_stderr
from maxsim_cli.scoring.dispatch import run_files
from maxsim_cli.scoring.plan import BUDGET_FILL, DEFAULT_READER_THREADS, STAGING_BYTES
from maxsim_cli.scoring.request import ScoreRequest
from maxsim_cli.scoring.stats import ScoreStats


def score(
    queries: str,
    corpus: Sequence[str],
    *,
    output: str = "-",
    top_k: int = 1000,
    candidates: str | None = None,
    strict: bool = False,
    device: str = "auto",
    backend: str = "auto",
    max_memory: int | None = None,
    max_host_memory: int | None = None,
    run_tag: str = "maxsim",
    fmt: str = "trec",
    batch_queries: int | None = None,
    reader_threads: int | None = None,
    show_progress: bool = False,
    log: Logger = log_to_stderr,
    devices: str | None = None,
    exact_from: Sequence[str] | None = None,
    depth: int | None = None,
    include_ids: str | None = None,
    exclude_ids: str | None = None,
    where: str | None = None,
) -> ScoreStats:
    """Score the queries of ``queries`` against the shards ``corpus`` and write a run to ``output``.

    Exhaustive top-``top_k`` per query, or, with ``candidates`` (a run file, ``-`` = stdin), the
    candidates of that run re-scored. ``queries`` may be ``-`` (an Arrow IPC stream on stdin); at most
    one input may be stdin. ``max_memory`` bounds the scoring device's memory (GPU memory, or the CPU
    working set with device ``cpu``), ``max_host_memory`` the process's host memory growth during the run
    (`maxsim_cli.memory`). Returns the stats;
    raises `UsageError` / `InputError` / `MaxsimError` with one-line messages, leaving no output file.
    ``devices`` (``"0,1"``, ``"all"``, ``"cpu:N"``) or a torchrun environment makes it a job of several
    processes with the same output (`maxsim_cli.parallel`). ``exact_from`` (shard files or folders)
    makes ``corpus`` a compressed tier (`maxsim quantize`) scanned for each query's top ``depth``
    (default: `maxsim_cli.scoring.request.default_depth`, by the tier's codec), whose candidates are
    then scored exactly from ``exact_from``, the corpus it was quantized from. ``include_ids`` /
    ``exclude_ids`` (files of ids, one a line; ``-`` is stdin) and ``where`` (a condition on the shards'
    metadata columns, as text: `maxsim_cli.scoring.where`) filter the documents a search returns and
    the candidates a rerank keeps (`maxsim_cli.scoring.filters`).
    """
    request = ScoreRequest(
        queries=queries,
        corpus=corpus,
        output=output,
        top_k=top_k,
        candidates=candidates,
        strict=strict,
        device=device,
        backend=backend,
        max_memory=max_memory,
        max_host_memory=max_host_memory,
        run_tag=run_tag,
        fmt=fmt,
        batch_queries=batch_queries,
        reader_threads=reader_threads,
        show_progress=show_progress,
        devices=devices,
        exact_from=None if exact_from is None else tuple(exact_from),
        depth=depth,
        include_ids=include_ids,
        exclude_ids=exclude_ids,
        where=where,
    )
    return run_files(request, log=log)


__all__ = [
    "BUDGET_FILL",
    "DEFAULT_READER_THREADS",
    "STAGING_BYTES",
    "ScoreRequest",
    "ScoreStats",
    "check_backend_option",
    "resolve_device",
    "score",
]
