"""How a request runs: the one place that picks the path of a scoring call, as a `Plan`.

Every entry point asks here: `maxsim score` (`maxsim_cli.scoring.entry.score`: `run_files`), the library's
`search` and `rerank` (`maxsim_cli.api`, and through them PyTerrier and a served search: `run_call`)
and a served rerank batch (`maxsim_cli.service.batching.Scorer`: `plan_served_rerank`). The paths:

| path | what runs it | when |
|---|---|---|
| ``rank`` | `parallel.ranks.run_rank`: this process is a rank of a torchrun job | ``WORLD_SIZE`` > 1 |
| ``threads`` | `parallel.threads.run_threads`: a rank thread a GPU | ``--devices`` names several GPUs |
| ``processes`` | `parallel.launcher.launch`: a worker process a device | ``--devices cpu:N``, N > 1 |
| ``files`` | `scoring.files.score_files`: this process, one device, inputs from files | otherwise |
| ``direct`` | `scoring.direct`: one launch on a corpus resident on one device (a rerank on a GPU of \
one resident on the host: its candidates' rows staged, `scoring.host_rows`) | small (`direct.eligible`) |
| ``resident`` | `parallel.resident.score_resident`: a thread a device | resident on several devices |
| ``engine`` | `scoring.engine.run`: an open corpus on one device, streamed or resident | otherwise |
| ``library`` | the library's `search` / `rerank`, which plans its call here | a served batch, not direct |
| (a filter) | any path, with a mask over the corpus (`scoring.filters`): the scan masked, or few \
allowed documents scored as candidates; a rank or a device its share of the mask; two stages the \
compressed scan's | ``--include-ids``, ``--where``, ``include=``, ``exclude=``, ``where=`` |
| ``two-stage`` | `run_two_stage`: the compressed tier's top ``depth`` (a call plan), then those candidates \
exactly from ``exact_from`` (a call plan) | ``--exact-from`` / ``exact_from`` |

This module sits above `maxsim_cli.parallel` (it starts jobs) and below the entry points; the engine
and the parallel package never import it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from maxsim_cli.devices import parse_devices, resolve_device
from maxsim_cli.errors import UsageError
from maxsim_cli.parallel.environment import Logger, log_to_stderr, world_size
from maxsim_cli.scoring.request import ScoreRequest
from maxsim_cli.scoring.stats import ScoreStats

if TYPE_CHECKING:
    import numpy as np

    from maxsim_cli.shards import Corpus, DocBatch
    from maxsim_cli.shards.resident import Residency

RANK = "rank"
THREADS = "threads"
PROCESSES = "processes"
FILES = "files"
DIRECT = "direct"
RESIDENT = "resident"
ENGINE = "engine"
LIBRARY = "library"
TWO_STAGE = "two-stage"


@dataclass(frozen=True)
class Plan:
    """How one request runs: its ``path`` (the table of the module docstring) and the devices it runs on
    (a name a rank for a job; the device of a one-device path as the request names it; empty where the
    path learns it from its environment, a torchrun rank). ``residency``: the resident corpus the
    ``direct`` path scores from."""

    path: str
    devices: tuple[str, ...] = ()
    residency: Residency | None = field(default=None, compare=False, repr=False)


# --------------------------------------------------------------------------------------------------
# maxsim score: inputs on disk, the run written to a file


def in_threads(devices: Sequence[str]) -> bool:
    """Whether ``--devices`` runs its ranks as threads of this process (GPUs: `run_threads`) rather than
    as worker processes (CPU workers, whose torch thread pools would otherwise share one process)."""
    return all(d.startswith("cuda") for d in devices)


def plan_files(request: ScoreRequest) -> Plan:
    """The plan of a run from files (`maxsim score`): a torchrun rank, a job of several devices
    (``request.devices``), or this process on one device. Usage errors for options that contradict."""
    devices = request.devices
    if request.filtered:
        request.check_filters()  # a filter that cannot be read: refused before a job starts
    if request.two_stage:
        if world_size() > 1:
            raise UsageError("--exact-from runs on one device; run it without torchrun")
        return Plan(TWO_STAGE, (request.device,))
    if world_size() > 1:
        if devices is not None:
            raise UsageError(
                "--devices starts its own workers; under torchrun leave it out (each rank uses "
                "cuda:LOCAL_RANK, or the CPU with --device cpu)"
            )
        return Plan(RANK)
    if devices is None:
        return Plan(FILES, (request.device,))
    names = parse_devices(str(devices))
    if request.device.strip().lower() != "auto":
        raise UsageError(
            f"--device {request.device} and --devices {devices}: give one of them (--devices picks the "
            "device of each worker)"
        )
    if len(names) == 1:  # one device: no workers, score here
        return Plan(FILES, tuple(names))
    return Plan(THREADS if in_threads(names) else PROCESSES, tuple(names))


def run_files(request: ScoreRequest, *, log: Logger = log_to_stderr) -> ScoreStats:
    """Run ``request`` (inputs on disk, a run file out) as `plan_files` plans it; its stats."""
    plan = plan_files(request)
    if plan.path == TWO_STAGE:
        from maxsim_cli.scoring import two_stage

        return two_stage.score_files(request, run_two_stage, log=log)
    if plan.path == RANK:
        from maxsim_cli.parallel.ranks import run_rank

        return run_rank(request, log=log)
    if plan.path == THREADS:
        from maxsim_cli.parallel.threads import run_threads

        return run_threads(request, plan.devices, log=log)
    if plan.path == PROCESSES:
        from maxsim_cli.parallel.launcher import launch

        return launch(request, plan.devices)
    from maxsim_cli.scoring.files import score_files

    if request.devices is not None:
        request = dataclasses.replace(request, devices=None, device=plan.devices[0])
    return score_files(request, log=log)


# --------------------------------------------------------------------------------------------------
# the library: an open corpus, queries in memory, rows into a sink


def call_request(request: ScoreRequest, corpus: Corpus) -> ScoreRequest:
    """``request`` on the device a call on ``corpus`` scores on: ``auto`` on a corpus resident on one
    device is that device."""
    if request.device == "auto" and corpus.residency is not None:
        # a copy with the device alone changed: `dataclasses.replace` would convert every field again
        # (`ScoreRequest.__post_init__`), at every library call
        resolved = copy.copy(request)
        object.__setattr__(resolved, "device", str(corpus.residency.device))
        return resolved
    return request


def plan_call(request: ScoreRequest, corpus: Corpus, num_queries: int, pairs: int) -> Plan:
    """The plan of a library call (`call_request`'s request, ``pairs`` (query, document) pairs): the
    two stages with ``exact_from`` (each stage a call planned here), one launch on a resident corpus
    when it is small (`direct.eligible`), a thread a device for a corpus resident on several (with
    ``device="auto"``), else the engine."""
    if request.two_stage:
        return Plan(TWO_STAGE, (request.device,))
    if corpus.residency is not None:
        from maxsim_cli.scoring import direct

        residency = direct.eligible(request, corpus, num_queries, pairs)
        if residency is not None:
            return Plan(DIRECT, (str(direct.scoring_device(request, residency)),), residency)
    if corpus.placement is not None and request.device == "auto":
        return Plan(RESIDENT, tuple(str(part.device) for part in corpus.placement))
    return Plan(ENGINE, (request.device,))


def run_call(
    request: ScoreRequest,
    corpus: Corpus,
    queries: DocBatch,
    sink: Any,
    *,
    candidates: dict[str, list[tuple[str, float]]] | None = None,
    exact: Corpus | None = None,
    log: Logger = log_to_stderr,
    disallowed: np.ndarray | None = None,
) -> ScoreStats:
    """Score ``queries`` against the open ``corpus`` into ``sink`` as `plan_call` plans it; its stats. The
    direct path hands a call that runs out of device memory to the engine. ``exact``: the open corpus
    ``request.exact_from`` names, for a two-stage search. ``disallowed``: a filter's mask over the corpus
    (`maxsim_cli.scoring.filters`), on every path (two stages: the compressed scan's; a corpus resident on
    several devices: each device its share)."""
    from maxsim_cli.scoring import engine, filters

    if request.two_stage:
        if exact is None:
            raise ValueError("run_call: a two-stage request needs the open exact corpus (exact=)")
        return run_two_stage(request, corpus, exact, queries, sink, log=log, disallowed=disallowed)
    request = call_request(request, corpus)
    nq = len(queries.ids)
    pairs = nq * len(corpus) if candidates is None else sum(len(rows) for rows in candidates.values())
    if candidates is None and disallowed is not None and filters.use_subset(disallowed):
        pairs = nq * filters.allowed_count(disallowed, len(corpus))  # the allowed documents' pairs
    plan = plan_call(request, corpus, nq, pairs)
    if plan.path == DIRECT:
        from maxsim_cli.scoring import direct

        assert plan.residency is not None
        stats = direct.run(
            request,
            corpus,
            plan.residency,
            queries,
            sink,
            candidates=candidates,
            log=log,
            disallowed=disallowed,
            # the device `plan_call` found (`direct.scoring_device`), not resolved from its name again
            device=direct.scoring_device(request, plan.residency),
        )
        if stats is not None:
            return stats
    elif plan.path == RESIDENT:
        from maxsim_cli.parallel.resident import score_resident

        request.check()
        return score_resident(
            request, corpus, queries, sink, candidates=candidates, log=log, disallowed=disallowed
        )
    return engine.run(request, corpus, queries, sink, candidates=candidates, log=log, disallowed=disallowed)


def run_two_stage(
    request: ScoreRequest,
    compressed: Corpus,
    exact: Corpus,
    queries: DocBatch,
    sink: Any,
    *,
    log: Logger = log_to_stderr,
    disallowed: np.ndarray | None = None,
) -> ScoreStats:
    """The ``two-stage`` path: each query's top ``request.search_depth`` from the compressed tier, then
    those candidates scored exactly from ``exact`` (only their rows read) into ``sink``, cut to
    ``top_k``. Each stage runs as `plan_call` plans it (a resident tier: one launch). The tiers are
    checked to hold the same documents first (`two_stage.check_tiers`). ``disallowed``: a filter's mask
    over the documents (both tiers hold them in one order), applied to the compressed scan: every
    candidate is an allowed document, so the run is the exact top-k among the allowed documents
    wherever it is among their compressed top ``depth``."""
    from maxsim_cli.scoring import two_stage

    request.check()
    two_stage.check_tiers(request, compressed, exact)
    scan_name, _ = two_stage.tier_names(request, compressed, exact)
    scan_request, exact_request = two_stage.stage_requests(request, compressed, scan_name)
    found = two_stage.ScanCandidates(queries.ids)
    scan_stats = run_call(scan_request, compressed, queries, found, log=log, disallowed=disallowed)
    candidates = found.candidates(compressed)
    exact_request = two_stage.exact_on_scan_device(exact_request, exact, scan_stats.device)
    exact_stats = run_call(exact_request, exact, queries, sink, candidates=candidates, log=log)
    return two_stage.merge_stats(request, compressed, scan_stats, exact_stats)


# --------------------------------------------------------------------------------------------------
# maxsim serve: a batch of rerank requests


def one_residency(corpus: Corpus, device: str) -> Residency | None:
    """The corpus's residency when every shard is on the one device a call on ``device`` scores on."""
    residency = corpus.residency
    if residency is None or corpus.placement is not None or len(corpus) == 0:
        return None
    if device != "auto" and resolve_device(device) != residency.device:
        return None
    return residency


def plan_served_rerank(corpus: Corpus, device: str, pairs: int) -> Plan:
    """The plan of a served rerank batch of ``pairs`` candidates in all: one launch on corpus ordinals
    (``direct``, the server orders the answers itself) when the corpus is resident on the scoring device
    and the batch fits the direct path, else the library's `rerank` (``library``)."""
    residency = one_residency(corpus, device)
    if residency is not None:
        from maxsim_cli.scoring import direct

        if direct.fits(residency.device, pairs):
            return Plan(DIRECT, (str(residency.device),), residency)
    return Plan(LIBRARY, (device,))
