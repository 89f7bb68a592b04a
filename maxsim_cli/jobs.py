"""`maxsim score` on several devices: rank threads on the GPUs of one machine, or processes joined by
torch.distributed on one machine or many.

A job is ``W`` ranks that share one corpus. Every rank opens the whole corpus (headers and ids: this
checks that ids are unique across all shards; rank threads share one opened corpus), takes its share of
the shards, scores its share against *all* queries with the single-process engine
(`maxsim_cli.scoring.engine.run`, given a copy of the job's `ScoreRequest` with the rank's device), and
sends its results to rank 0, which merges them and alone writes the run. Exhaustive results travel as
two arrays per rank (float32 scores and corpus ordinals, ``[queries, k]``, 12 B a result), merged on rank
0 with the engine's order keys and written by the run writer's columnar path, as one process writes
them; rerank results per query. This module is the layer above the engine: it never calls
`maxsim_cli.score.score`, which calls it.

**Shares.** Shards are dealt largest first (by token count; ties by shard order) to the rank with the
fewest tokens so far (ties to the lowest rank). With shard token counts ``t_s`` and total ``T``, this
greedy rule (LPT) gives a largest share of at most ``T / W + max_s t_s``, so shards well below ``T / W``
tokens balance the ranks; a rank left without shards (``W`` > number of shards) scores nothing.

**Exactness.** Exhaustive mode: rank ``r`` keeps the best ``k`` documents of its shards per query in the
total order "float32 score descending, docno descending" (trec_eval's). The corpus-wide best ``k`` are
among the union of the ranks' best ``k``, and a document's score does not depend on the batch or rank it
was scored in, so rank 0 selecting the best ``k`` of the union in the same order writes exactly the bytes
of a single-process run. Rerank mode: rank ``r`` scores the candidates that live in its shards; a
candidate in no shard at all is reported by rank 0 alone (the warning, and the ``--strict`` error on every
rank), with the counts and examples a single process would give. Queries are written in the query file's
order, queries without results left out, as in one process.

**Failure.** Each rank catches its own error and all ranks exchange a status (``all_gather_object``)
before anything is written: if any rank failed, rank 0 raises that rank's one-line error (prefixed with
the rank and device unless it is rank 0's own), ranks other than 0 exit with the same code without a
message, and no run is written. A rank that dies (killed) never reaches the exchange: the launcher
(``--devices``) or torchrun's agent stops the other ranks; ranks on other machines give up after the
process group's timeout. The run is written atomically by rank 0 after every rank has finished, and
SIGTERM raises `SystemExit` in a rank so that a rank stopped while writing removes its temporary file.

**Launching.** Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) the rank's device is
``cuda:LOCAL_RANK`` (``--device auto`` or ``cuda``) or the CPU (``--device cpu``). ``--devices 0,1`` or
``all`` runs a rank per GPU as a thread of this process (`run_threads`): no interpreter, import or
corpus opening is repeated, and results are merged in memory. ``--devices cpu:N`` starts N worker
processes itself on this machine, joined through a TCP store that the launcher holds (the same
environment contract as torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), and the launcher's exit code
is the job's. **Failure** of rank threads: the failing rank sets a stop that the others check after
every batch (`maxsim_cli.errors.RankStopped`), and the job raises the failing rank's error.

Environment variables read here:

- ``MAXSIM_DIST_TIMEOUT``: seconds a rank waits in a collective, e.g. for the slowest rank to finish
  before the status exchange (default 3600).
- ``MAXSIM_TEST_FAIL_RANK``: *test hook*. ``R`` makes rank ``R`` raise an error after opening the corpus,
  ``R:kill`` makes it kill itself with SIGKILL there. Only for tests of the failure paths.
- ``MAXSIM_DEVICES``, ``MAXSIM_STORE``, ``MAXSIM_STATUS_FILE``, ``MAXSIM_LAUNCHER_PID``: set by the
  ``--devices cpu:N`` launcher for its workers (device of each local rank; ``host:port`` of the
  launcher's store; where rank 0 reports; the launcher's pid, see `maxsim_cli.lifeline`).

**Lifetime of ``--devices cpu:N`` workers.** The workers die with their launcher, however it ends
(`maxsim_cli.lifeline`: a death signal from the kernel and a thread watching the parent); rank 0 checks
that the launcher is still there before it writes the run, so no run appears after the job failed.
SIGINT and SIGHUP go to the launcher alone (workers ignore them); it stops the workers with SIGTERM,
then SIGKILL after `TERMINATE_GRACE_S`. Rank 0 notes the temporary file of the run it writes in the
job's folder, so that a launcher whose rank 0 was killed removes exactly that file, and notes there
that the run is in place (`COMMIT_NOTE`, at its commit point: `maxsim_cli.lifeline`): a stop signal to
the launcher from then on, or one that came during that rename, leaves the job's result its own. A
worker that finds its launcher gone removes the job's folder (its few files) on its way out; one that
had already finished cannot, and a launcher killed by SIGKILL removes nothing, so the job's folder holds
a lock file that the launcher and its workers keep locked while any of them runs (`_lock_job`), and a
job starting removes the folders whose lock is free (`remove_stale_job_folders`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from maxsim_cli import lifeline
from maxsim_cli.arrays import values_array
from maxsim_cli.errors import MaxsimError, RankStopped, UsageError, quiet_stdout
from maxsim_cli.lifeline import ENV_LAUNCHER_PID, holds, launcher_gone
from maxsim_cli.scoring.request import ScoreRequest
from maxsim_cli.scoring.stats import ScoreStats
from maxsim_cli.shards.files import staging_dir
from maxsim_cli.shards.resident import assign_shards

try:
    import fcntl
except ImportError:  # Windows: no job locks, and no stale job folders found
    fcntl = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from maxsim_cli.progress import ScoreProgress
    from maxsim_cli.shards import Corpus, DocBatch

ENV_TIMEOUT = "MAXSIM_DIST_TIMEOUT"
ENV_FAIL_RANK = "MAXSIM_TEST_FAIL_RANK"
ENV_DEVICES = "MAXSIM_DEVICES"
ENV_STORE = "MAXSIM_STORE"
ENV_STATUS = "MAXSIM_STATUS_FILE"
# Beside the status file: the temporary file rank 0 is writing the run to (one line), while it does.
PARTIAL_NOTE = "partial-output"
# Beside it too: made by rank 0 once the run is in place (`lifeline.share_commit`).
COMMIT_NOTE = "committed"
# The job's folder in the temporary directory, and its lock file (see `_lock_job`).
JOB_PREFIX = "maxsim-job-"
LOCK_NAME = "lock"
# Every name a job's folder can hold: the next job removes a dead job's folder by these names only.
JOB_FILES = ("options.json", "status.json", "status.json.tmp", PARTIAL_NOTE, COMMIT_NOTE, LOCK_NAME)
# A job folder without a lock file is one being made (for microseconds), or a job's of a maxsim from
# before the locks, which may still run: removed only once it has not changed for a day.
STALE_UNLOCKED_S = 24 * 3600.0
# A collective waits this long by default: it must cover the slowest rank's lag behind the fastest at
# the status exchange (shares are balanced by tokens, so the lag is a small part of a job's time).
DEFAULT_TIMEOUT_S = 3600.0
# Launcher: once a worker has exited with an error, the others normally follow within a second (they
# leave the status exchange together); one still running after this long is stuck and is stopped.
FAILED_PEER_GRACE_S = 30.0
# Launcher: seconds between SIGTERM and SIGKILL when stopping workers.
TERMINATE_GRACE_S = 10.0
# The launcher's workers run this (not `-m maxsim_cli.jobs`, which would load this module twice).
# The lifeline is tied before torch is imported (seconds), so that a launcher killed meanwhile takes
# its workers along; a worker whose launcher died removes the job's folder on its way out.
# Rank 0 makes the job's commit note once the run is in place; a worker whose outcome is decided ends at
# once (`lifeline.end_process`), a traceback aside.
_WORKER_CODE = f"""
import os, sys
from maxsim_cli import lifeline
status = os.environ.get({ENV_STATUS!r}, "")
folder = os.path.dirname(status)
files = [sys.argv[1], status, status + ".tmp", *(os.path.join(folder, n) for n in {JOB_FILES[3:]!r})]
lifeline.share_commit(os.path.join(folder, {COMMIT_NOTE!r}))
try:
    lifeline.tie_to_launcher(files, folder, armed=False)  # SIGTERM ends the worker silently until armed
    import pyarrow
    pyarrow.array([""])  # its pandas bridge, imported at the first array: before any handler can raise
    from maxsim_cli.jobs import worker_main
    lifeline.arm()
    code = worker_main(sys.argv[1:])
except SystemExit as exc:  # stopped (SIGTERM), or a rank's exit code
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
finally:
    lifeline.disarm()  # the exit code is now the worker's
    lifeline.remove_if_orphaned(files, folder)
lifeline.end_process(code)
"""
_ERROR_CLASSES: dict[int, type[MaxsimError]] = {1: MaxsimError, 2: UsageError}

Logger = Callable[[str], None]


def _stderr(message: str) -> None:
    print(f"maxsim: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# what a rank hands to the engine, and what it sends back


class ResultSink:
    """The sink of a rank's `engine.run` in place of `maxsim_cli.runs.RunWriter`: keeps the results in memory.

    Rerank mode hands it each query's results (`write_query`: docnos and scores); exhaustive mode hands
    it whole query batches as columns (`write_ordinals`: scores and corpus ordinals, ``[nq, m]`` arrays,
    best first), which travel to rank 0 as two arrays instead of a Python string per result. Scores are
    kept as float32, the precision the run prints (`maxsim_cli.runs.format_score`).
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
class _Share:
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
class _MergeOrder:
    """Rank 0's key from corpus ordinals to docnos, for merging columns (stays on rank 0)."""

    rank_of_ordinal: np.ndarray  # int64 [docs]: position of each document's id in byte order
    ids_by_rank: Any  # pyarrow array: the ids in that order


# --------------------------------------------------------------------------------------------------
# small pieces (pure functions, tested alone)


def world_size() -> int:
    """``WORLD_SIZE`` of the environment (1 when unset): > 1 inside a torchrun or ``--devices`` job."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        value = os.environ["WORLD_SIZE"]
        raise UsageError(f"WORLD_SIZE={value!r} is not an integer; check the launcher") from None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{name}={value!r} is not an integer; check the launcher") from None


def timeout_seconds() -> float:
    """The collectives' timeout: ``MAXSIM_DIST_TIMEOUT`` seconds, default `DEFAULT_TIMEOUT_S`."""
    value = os.environ.get(ENV_TIMEOUT)
    if value is None:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise UsageError(f"{ENV_TIMEOUT}={value!r}: give a positive number of seconds")
    return seconds


def parse_devices(spec: str) -> list[str]:
    """``--devices``: ``0,1,...`` or ``cuda:0,cuda:1,...`` (CUDA device indices), ``all`` (every CUDA
    device), ``cpu:N`` (N CPU workers) or ``cpu`` -> one torch device name per worker."""
    text = spec.strip().lower()
    if text == "cpu":
        return ["cpu"]
    if text.startswith("cpu:"):
        try:
            n = int(text[4:])
        except ValueError:
            n = 0
        if n < 1:
            raise UsageError(f"--devices {spec}: cpu:N needs a whole number of workers N >= 1, e.g. cpu:2")
        return ["cpu"] * n
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if text == "all":
        if available == 0:
            raise UsageError("--devices all: no CUDA device is available here; use --devices cpu:N")
        return [f"cuda:{i}" for i in range(available)]
    indices: list[int] = []
    for item in text.split(","):
        item = item.strip().removeprefix("cuda:")
        if not item.isdigit():
            raise UsageError(
                f"--devices {spec}: {item!r} is not a device index; use e.g. 0,1 or cuda:0,cuda:1, all "
                "or cpu:N"
            )
        index = int(item)
        if index in indices:
            raise UsageError(f"--devices {spec}: device {index} is listed twice; name each device once")
        indices.append(index)
    if available == 0:
        raise UsageError(f"--devices {spec}: no CUDA device is available here; use --devices cpu:N")
    for index in indices:
        if index >= available:
            raise UsageError(
                f"--devices {spec}: there are {available} CUDA devices (0 to {available - 1}), no {index}"
            )
    return [f"cuda:{i}" for i in indices]


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
    (`maxsim_cli.topk`): float32 score descending, docno descending."""
    from maxsim_cli.topk import decode_keys, order_keys

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


# --------------------------------------------------------------------------------------------------
# entry from maxsim_cli.score.score (and the workers)


def dispatch(request: ScoreRequest, *, log: Logger = _stderr) -> ScoreStats:
    """Run ``request`` as a distributed job: start workers for ``request.devices``, or, inside a job
    (``WORLD_SIZE`` > 1), be one rank."""
    devices = request.devices
    if world_size() > 1:
        if devices is not None:
            raise UsageError(
                "--devices starts its own workers; under torchrun leave it out (each rank uses "
                "cuda:LOCAL_RANK, or the CPU with --device cpu)"
            )
        return run_rank(request, log=log)
    if devices is None:
        raise ValueError("dispatch: neither --devices nor a distributed environment")
    names = parse_devices(str(devices))
    if request.device.strip().lower() != "auto":
        raise UsageError(
            f"--device {request.device} and --devices {devices}: give one of them (--devices picks the "
            "device of each worker)"
        )
    if len(names) == 1:  # one device: no workers, score here
        from maxsim_cli.scoring.files import score_files

        return score_files(dataclasses.replace(request, devices=None, device=names[0]), log=log)
    if in_threads(names):
        return run_threads(request, names, log=log)
    return launch(request, names)


def in_threads(devices: Sequence[str]) -> bool:
    """Whether ``--devices`` runs its ranks as threads of this process (GPUs: `run_threads`) rather than
    as worker processes (CPU workers, whose torch thread pools would otherwise share one process)."""
    return all(d.startswith("cuda") for d in devices)


def _check_no_stdin(request: ScoreRequest) -> None:
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


# --------------------------------------------------------------------------------------------------
# one rank


def _rank_device(option: str, local_rank: int) -> str:
    """The torch device of this rank: from the launcher's list, else from ``--device`` and LOCAL_RANK."""
    listed = os.environ.get(ENV_DEVICES)
    if listed:
        names = listed.split(",")
        if local_rank >= len(names):
            raise UsageError(f"{ENV_DEVICES}={listed!r} has no device for local rank {local_rank}")
        return names[local_rank]
    name = str(option).strip().lower()
    if name == "cpu":
        return "cpu"
    if name in ("auto", "cuda"):
        if not torch.cuda.is_available():
            if name == "cuda":
                raise UsageError("--device cuda: no CUDA device is available here; use --device cpu")
            return "cpu"
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise UsageError(
                f"local rank {local_rank} has no GPU: this machine has {count}; start at most {count} "
                "processes per node (torchrun --nproc-per-node)"
            )
        return f"cuda:{local_rank}"
    raise UsageError(
        f"--device {option}: under torchrun each rank uses cuda:LOCAL_RANK; pass --device auto, cuda or "
        "cpu (or restrict the GPUs with CUDA_VISIBLE_DEVICES)"
    )


def _init_group(rank: int, world: int, timeout: datetime.timedelta) -> None:
    import torch.distributed as dist

    # gloo for every rank, also on GPUs: the only traffic is the ranks' results (host strings and floats)
    # and statuses, which NCCL would have to copy to a GPU and back.
    store_address = os.environ.get(ENV_STORE)
    try:
        if store_address:
            host, _, port = store_address.rpartition(":")
            store = dist.TCPStore(host, int(port), world, False, timeout=timeout)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(
                "gloo", init_method="env://", rank=rank, world_size=world, timeout=timeout
            )
    except (RuntimeError, ValueError, OSError) as exc:
        raise MaxsimError(
            f"rank {rank} of {world} could not join the job's process group: {_one_line(exc)}; check "
            "MASTER_ADDR/MASTER_PORT and that every rank was started"
        ) from None


def _on_sigterm(signum: int, frame: object) -> None:
    # finally blocks run (the run writer removes its temporary file), then the process exits; once the
    # run is in place (`lifeline.commit_point`) the rank finishes instead
    if holds(signum):
        return
    raise SystemExit(128 + signum)


def run_rank(request: ScoreRequest, *, log: Logger = _stderr) -> ScoreStats:
    """This process's part of a job whose ranks are described by the environment (torchrun's variables)."""
    import torch.distributed as dist

    start = time.perf_counter()
    rank = _env_int("RANK", 0)
    world = world_size()
    local_rank = _env_int("LOCAL_RANK", rank)
    if not 0 <= rank < world:
        raise UsageError(f"RANK={rank} is outside 0..{world - 1} (WORLD_SIZE={world}); check the launcher")
    timeout = datetime.timedelta(seconds=timeout_seconds())
    # The device is settled before joining the group, but a bad one is reported through the status
    # exchange like any other error, so that every rank stops.
    device, device_error = "?", None
    try:
        device = _rank_device(request.device, local_rank)
    except MaxsimError as exc:
        device_error = exc
    cuda_ready = _CudaInit(device) if device.startswith("cuda") else None
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        _init_group(rank, world, timeout)
        phases = {"join_s": time.perf_counter() - start}
        try:
            return _run_in_group(request, rank, world, device, device_error, cuda_ready, start, phases, log)
        finally:
            dist.destroy_process_group()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class _CudaInit(threading.Thread):
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


def _run_in_group(
    request: ScoreRequest,
    rank: int,
    world: int,
    device: str,
    device_error: MaxsimError | None,
    cuda_ready: _CudaInit | None,
    start: float,
    phases: dict[str, float],
    log: Logger,
) -> ScoreStats:
    import torch.distributed as dist

    share: _Share | None = None
    merge_order: _MergeOrder | None = None
    status: tuple[int, str, str] | None = None
    crash: BaseException | None = None
    try:
        if device_error is not None:
            raise device_error
        share, merge_order = _score_share(request, rank, world, device, cuda_ready, log)
    except MaxsimError as exc:
        status = (exc.exit_code, str(exc), device)
    except Exception as exc:  # a bug: the others must still learn of it, then its traceback shows here
        crash = exc
        message = f"{type(exc).__name__}: {_one_line(exc)} (its traceback is in that rank's output)"
        status = (1, message, device)
    phases["share_s"] = time.perf_counter() - start - phases["join_s"]
    mark = time.perf_counter()
    statuses: list[Any] = [None] * world
    _collective(rank, world, dist.all_gather_object, statuses, status)
    phases["wait_for_ranks_s"] = time.perf_counter() - mark
    failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if failed:
        if crash is not None:
            raise crash
        if rank != 0:
            raise SystemExit(failed[0][1][0])  # rank 0 reports the job's error
        r, (code, message, where) = failed[0]
        if r != 0:
            message = f"rank {r} of {world} ({where}): {message}"
        raise _ERROR_CLASSES.get(code, MaxsimError)(message)
    assert share is not None
    mark = time.perf_counter()
    if world > 1:
        # Only results that can still make the job's top-k travel (see `kth_scores`).
        top_k = request.top_k
        if request.candidates is None:
            kth = None if share.columns is None else kth_column(share.columns[0], top_k)
            floors: list[Any] = [None] * world
            _collective(rank, world, dist.all_gather_object, floors, kth)
            known = [f for f in floors if f is not None]
            if share.columns is not None and known:
                share.columns = trim_columns(share.columns, np.maximum.reduce(known))
        else:
            bounds: list[Any] = [None] * world
            _collective(rank, world, dist.all_gather_object, bounds, kth_scores(share.results, top_k))
            share.results = drop_below(share.results, bounds)
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    _collective(rank, world, dist.gather_object, share, gathered, dst=0)
    phases["gather_s"] = time.perf_counter() - mark
    if rank != 0:
        stats = ScoreStats(**share.stats)
        stats.extra = {"rank": rank, "world_size": world}
        return stats
    assert gathered is not None
    shares: list[_Share] = gathered
    mark = time.perf_counter()
    _write_merged(request, shares, merge_order)
    phases["merge_write_s"] = time.perf_counter() - mark
    stats = _combine_stats(request, shares)
    stats.write_s = phases["merge_write_s"]
    stats.extra["phases"] = phases
    stats.wall_s = time.perf_counter() - start
    return stats


def _collective(rank: int, world: int, call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """A collective of the job's process group; a peer that went away (stopped, killed: gloo's
    "Connection closed by peer") is one error line rather than a traceback. The launcher, or torchrun's
    agent, names the rank that died."""
    try:
        call(*args, **kwargs)
    except RuntimeError as exc:
        raise MaxsimError(
            f"rank {rank} of {world} lost the other ranks ({_one_line(exc)[:120]}); one of them stopped or "
            "died, see its messages; no run was written"
        ) from None


def _inject_test_failure(rank: int) -> None:
    """The `ENV_FAIL_RANK` test hook (see the module docstring)."""
    value = os.environ.get(ENV_FAIL_RANK)
    if not value:
        return
    target, _, how = value.partition(":")
    if target.strip() != str(rank):
        return
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise MaxsimError(f"failure injected on rank {rank} by {ENV_FAIL_RANK}={value} (a test hook)")


def _open_job_corpus(request: ScoreRequest) -> Corpus:
    from maxsim_cli.shards import open_corpus

    _check_no_stdin(request)
    corpus_paths = list(request.corpus)
    if not corpus_paths:
        raise UsageError("no corpus given: pass one or more shard files or directories after QUERIES")
    return open_corpus(corpus_paths)


def _score_share(
    request: ScoreRequest,
    rank: int,
    world: int,
    device: str,
    cuda_ready: _CudaInit | None,
    log: Logger,
    corpus: Corpus | None = None,
    stop: threading.Event | None = None,
    staging_bytes: int | None = None,
    run: dict[str, list[tuple[str, float]]] | None = None,
    run_index: dict[str, tuple[int, int]] | None = None,
    progress: ScoreProgress | None = None,
) -> tuple[_Share, _MergeOrder | None]:
    """Score this rank's shards of the corpus (opened here, or the job's open `corpus`, whose shards
    of this rank are closed afterwards) for all queries, return the results (and, on rank 0 in
    exhaustive mode, the docno order that the merge needs). `stop`: set when another rank failed;
    `staging_bytes`: the rank's pinned staging arena (`RankContext`); `run` and `run_index`: the
    candidates' run and its `run_candidate_index`, when the job has made them already (else made
    here); `progress`: the job's bar, shared by rank threads (else rank 0 draws its own share)."""
    from maxsim_cli.queries import read_queries, read_query_ids
    from maxsim_cli.runs import read_run
    from maxsim_cli.scoring import engine
    from maxsim_cli.shards import Corpus, input_notes, report_notes

    own_corpus = corpus is None
    if corpus is None:
        corpus = _open_job_corpus(request)
    try:
        _inject_test_failure(rank)
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
                    share_request, sub, queries, sink, candidates=candidates, context=context, log=log
                )
            finally:
                sub.close()  # this rank's shards
            stats.setup_s += entered - started
            stats.wall_s = time.perf_counter() - started
        else:
            stats = ScoreStats(
                mode=request.mode, device=device, backend=request.backend, output=request.output
            )
        share = _make_share(rank, device, mine, sink, stats, query_ids, corpus)
        merge_order = None
        if rank == 0 and request.candidates is None:
            merge_order = _MergeOrder(corpus.rank_of_ordinal(), corpus.id_order()[2])
        return share, merge_order
    finally:
        if own_corpus:
            corpus.close()


def _make_share(
    rank: int,
    device: str,
    mine: list[int],
    sink: ResultSink,
    stats: ScoreStats,
    query_ids: list[str] | None,
    corpus: Corpus,
) -> _Share:
    """What a rank hands over: its results, and in exhaustive mode its columns with the engine's
    ordinals (of the rank's shards ``mine``) turned into ordinals of the whole ``corpus``."""
    stats_fields = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
    stats_fields["extra"] = dict(stats.extra)
    share = _Share(rank, device, mine, sink.results, stats_fields, query_ids)
    columns = sink.columns()
    if columns is not None:
        scores, ordinals = columns
        sub_starts = np.concatenate([[0], np.cumsum([corpus.shards[s].num_docs for s in mine])])
        shard = np.searchsorted(sub_starts, ordinals, side="right") - 1
        base = corpus.doc_starts[np.asarray(mine, dtype=np.int64)] - sub_starts[:-1]
        share.columns = (scores, ordinals + base[shard])
    return share


# Rank 0 merges the ranks' columns this many queries at a time (temporaries ~ 24 B x ranks x k a query).
MERGE_QUERY_BLOCK = 4096


def _write_merged(request: ScoreRequest, shares: Sequence[_Share], order: _MergeOrder | None) -> None:
    """Rank 0: the best ``top_k`` of every query over all ranks, in the query file's order, written once."""
    from maxsim_cli.runs import RunWriter

    if launcher_gone():  # the job has failed: its launcher is dead and reports nothing; write nothing
        raise SystemExit(128 + signal.SIGTERM)
    with RunWriter(request.output, tag=request.run_tag, fmt=request.fmt) as writer:
        note = _note_partial_output(writer)
        try:
            _merge_into(writer, request.top_k, shares, order)
        finally:
            _remove_quietly(note)


def _note_partial_output(writer: Any) -> str | None:
    """Under the ``--devices`` launcher, write the path of the run's temporary file to the job folder's
    `PARTIAL_NOTE`: should this rank be killed while writing, the launcher removes that file, and only
    it. Returns the note's path (None when there is nothing to note)."""
    status_path = os.environ.get(ENV_STATUS)
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


def _merge_into(sink: Any, top_k: int, shares: Sequence[_Share], order: _MergeOrder | None) -> None:
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


def _combine_stats(request: ScoreRequest, shares: Sequence[_Share]) -> ScoreStats:
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
    return out


# --------------------------------------------------------------------------------------------------
# --devices with GPUs: one thread per device in this process

# The launcher's main thread checks this often for a finished rank (and for Ctrl-C).
_POLL_S = 0.05
# Rank threads share Python's lock, which each holds for part of every batch (~1 ms a batch on the H200
# machine), so they take larger batches than one process does (a pinned staging arena of this size each)
# and hand the lock over every `THREAD_SWITCH_S` instead of Python's 5 ms, which left a GPU idle while the
# other rank's thread ran. Two H200s, 10 GB: 1.34x one GPU (median) against 0.90x with neither
# (benchmarks/results/scaling/multigpu-10gb-h200x2-variants.json; docs/kernel-notes.md, "Two GPUs from one
# host").
THREAD_STAGING_BYTES = 1 << 30
THREAD_SWITCH_S = 0.0005
# The machine's page cache is read fastest by ~16 threads in all (plan.DEFAULT_READER_THREADS), so the
# rank threads share them instead of starting 16 each: 8 a rank 1.50x one GPU on 10 GB, 16 a rank 1.42x
# (benchmarks/results/scaling/multigpu-10gb-h200x2-readers.json).


def run_threads(request: ScoreRequest, devices: Sequence[str], *, log: Logger = _stderr) -> ScoreStats:
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
    corpus = _open_job_corpus(request)
    interval = sys.getswitchinterval()
    try:
        run = run_index = None
        if request.candidates is not None:  # read and indexed once for all ranks
            from maxsim_cli.runs import read_run

            run = read_run(request.candidates)
            run_index = run_candidate_index(corpus, run)
        outcomes: list[tuple[_Share, _MergeOrder | None] | BaseException | None] = [None] * world
        bar = ScoreProgress(request.show_progress, 0, shared=True)  # one for all ranks' work

        def rank_main(rank: int) -> None:
            try:
                outcomes[rank] = _score_share(
                    request, rank, world, devices[rank], None, log,
                    corpus=corpus, stop=stop, staging_bytes=THREAD_STAGING_BYTES, run=run,
                    run_index=run_index, progress=bar,
                )  # fmt: skip
            except BaseException as exc:  # noqa: BLE001 - reported by the launcher's thread
                outcomes[rank] = exc
                stop.set()

        sys.setswitchinterval(min(interval, THREAD_SWITCH_S))

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
        sys.setswitchinterval(interval)
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
    _write_merged(request, shares, done[0][1])
    merge_write_s = time.perf_counter() - mark
    stats = _combine_stats(request, shares)
    stats.write_s = merge_write_s
    stats.extra["phases"] = {"share_s": share_s, "merge_write_s": merge_write_s}
    stats.extra["workers"] = "threads"
    stats.wall_s = time.perf_counter() - start
    return stats


# --------------------------------------------------------------------------------------------------
# a corpus resident on several devices (`Corpus.to` with a list): one thread per device


def score_resident(
    request: ScoreRequest,
    corpus: Corpus,
    queries: DocBatch,
    sink: Any,
    *,
    candidates: dict[str, list[tuple[str, float]]] | None = None,
    log: Logger = _stderr,
) -> ScoreStats:
    """Score ``queries`` against a corpus whose shards are resident on several devices
    (``corpus.placement``): each device's share by the single-process engine in a thread of its own,
    the shares' top-k merged as `run_threads` merges its ranks', the results handed to ``sink``. The
    same run as one device gives; a device that fails stops the others, and its error is raised."""
    from maxsim_cli.scoring import engine

    placement = corpus.placement
    assert placement, "score_resident needs a corpus resident on several devices"
    world = len(placement)
    owner = [0] * len(corpus.shards)
    for r, part in enumerate(placement):
        for s in part.shards:
            owner[s] = r
    run_index = run_candidate_index(corpus, candidates) if candidates is not None else None
    stop = threading.Event()
    outcomes: list[_Share | BaseException | None] = [None] * world
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
            )  # fmt: skip
            qids = list(queries.ids) if rank == 0 else None
            outcomes[rank] = _make_share(rank, str(part.device), part.shards, rank_sink, stats, qids, corpus)
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
    shares = [o for o in outcomes if isinstance(o, _Share)]
    order = _MergeOrder(corpus.rank_of_ordinal(), corpus.id_order()[2]) if candidates is None else None
    mark = time.perf_counter()
    with sink if hasattr(sink, "__enter__") else contextlib.nullcontext(sink):
        _merge_into(sink, request.top_k, shares, order)
    stats = _combine_stats(request, shares)
    stats.write_s = time.perf_counter() - mark
    stats.extra["workers"] = "resident devices"
    stats.extra["resident_corpus"] = True
    stats.wall_s = time.perf_counter() - start
    return stats


# --------------------------------------------------------------------------------------------------
# --devices: the launcher and its workers


def _worker_options(request: ScoreRequest) -> dict[str, Any]:
    """The request as the workers read it (JSON), without the launcher's own ``devices``."""
    out = dataclasses.asdict(dataclasses.replace(request, devices=None))
    out["corpus"] = list(request.corpus)
    return out


def launch(request: ScoreRequest, devices: Sequence[str]) -> ScoreStats:
    """Start one worker process per device on this machine, wait for all, return rank 0's job stats.

    Raises the job's error (rank 0's report) with its exit code; if a worker dies without reporting,
    the others are stopped and the error names it. No run is written unless every worker succeeded.
    """
    import torch.distributed as dist

    _check_no_stdin(request)
    world = len(devices)
    timeout = timeout_seconds()
    cpu_workers = sum(1 for d in devices if d == "cpu")
    temp_root = tempfile.gettempdir()
    remove_stale_job_folders(temp_root)  # what launchers killed by SIGKILL left there
    # Made by one mkdir that a signal cannot separate from the cleanup below (TemporaryDirectory could
    # leave it behind when stopped right after making it).
    job_dir = staging_dir(temp_root, JOB_PREFIX)
    lock = -1
    try:
        lock = _lock_job(job_dir)
        os.chmod(job_dir, 0o700)  # the job's options name the user's files
        options_path = os.path.join(job_dir, "options.json")
        status_path = os.path.join(job_dir, "status.json")
        with open(options_path, "w", encoding="utf-8") as fh:
            json.dump(_worker_options(request), fh)
        # The store lives here, bound to a port the system picks: no port to guess or collide on.
        store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout))
        base = dict(os.environ)
        base.update(
            {
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port),
                ENV_STORE: f"127.0.0.1:{store.port}",
                ENV_DEVICES: ",".join(devices),
                ENV_STATUS: status_path,
                ENV_LAUNCHER_PID: str(os.getpid()),
            }
        )
        if cpu_workers:
            # CPU workers share the cores instead of each starting a thread per core
            base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cpu_workers)))
        procs: list[subprocess.Popen] = []
        started = time.perf_counter()
        lifeline.share_commit(os.path.join(job_dir, COMMIT_NOTE))  # a signal once it exists is ignored
        worker_fds = (lock,) if lock >= 0 else ()  # the workers hold the job's lock too
        try:
            for r in range(world):
                env = dict(base, RANK=str(r), LOCAL_RANK=str(r))
                argv = [sys.executable, "-c", _WORKER_CODE, options_path]
                procs.append(subprocess.Popen(argv, env=env, pass_fds=worker_fds))
            codes, ended = _wait_all(procs)
        except (SystemExit, KeyboardInterrupt):  # a stop signal: stop the workers, then see what they did
            with lifeline.signals_held():  # a second signal changes nothing: the stop is under way
                _stop(procs)
            if not lifeline.adopt_commit():
                raise
            # rank 0 had put the run in place (its commit point holds the SIGTERM): the job succeeded
            codes, ended = [int(p.returncode) for p in procs], None
        finally:
            _stop(procs)
            del store
        committed = lifeline.adopt_commit()  # before the folder, and the note, are removed
        return _job_outcome(codes, devices, status_path, request.output, started, ended, committed=committed)
    finally:
        # the job's files, then its lock: a next job finds the folder gone, or locked, never half-removed
        shutil.rmtree(job_dir, ignore_errors=True)
        lifeline.share_commit(None)
        if lock >= 0:
            os.close(lock)


def _lock_job(job_dir: str) -> int:
    """Create the lock file of the job's folder ``job_dir`` and hold an exclusive `flock` on it for the
    job's life; returns its descriptor, which the workers inherit, so that the lock is free only once
    every process of the job has ended, however it ended (SIGKILL included: the kernel lets go of the
    lock of a dead process). -1 where there is no `flock` (Windows) or it failed (no file can be made
    there, a file system without locks): the job runs all the same, its folder kept a day if left."""
    if fcntl is None:
        return -1
    path = os.path.join(job_dir, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new and ours: free
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)  # a lock file no one holds would make the folder look stale
        return -1
    return fd


def remove_stale_job_folders(folder: str) -> list[str]:
    """Remove the job folders (``maxsim-job-*``, this user's) that ``--devices`` jobs whose processes
    have all ended left in ``folder`` - a launcher killed by SIGKILL cannot remove its own. A folder is
    stale when its lock file is free (`_lock_job`), or when it has none and is older than
    `STALE_UNLOCKED_S`; only the names a job writes (`JOB_FILES`) are removed, then the folder if that
    emptied it. Returns the folders removed."""
    if fcntl is None:
        return []
    try:
        names = sorted(n for n in os.listdir(folder) if n.startswith(JOB_PREFIX))
    except OSError:
        return []
    return [path for path in (os.path.join(folder, n) for n in names) if _remove_if_stale(path)]


def _remove_if_stale(path: str) -> bool:
    assert fcntl is not None
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return False
    fd = -1
    try:
        try:
            fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            if time.time() - st.st_mtime < STALE_UNLOCKED_S:
                return False  # a job's folder being made, or an older maxsim's job
        else:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # a process of that job is still running
        for name in JOB_FILES:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(path, name))
        os.rmdir(path)
        return True
    except OSError:
        return False
    finally:
        if fd >= 0:
            os.close(fd)


def _wait_all(procs: Sequence[subprocess.Popen]) -> tuple[list[int], list[int]]:
    """Exit codes of all workers, and their ranks in the order they ended. A worker killed by a signal
    means the others can never finish: they are stopped at once; one that exits with an error gives the
    others `FAILED_PEER_GRACE_S` to follow.

    A thread per worker waits for it, so that the order is the order of the deaths: a worker killed
    from outside brings its peers down within milliseconds (gloo aborts on a closed connection), and
    polling all of them now and then can find both dead and name the wrong one."""
    ended: list[int] = []
    changed = threading.Event()
    lock = threading.Lock()

    def watch(rank: int, proc: subprocess.Popen) -> None:
        proc.wait()
        with lock:
            ended.append(rank)
        changed.set()

    for rank, proc in enumerate(procs):
        threading.Thread(target=watch, args=(rank, proc), name=f"maxsim-watch-{rank}", daemon=True).start()
    failed_at: float | None = None
    while True:
        changed.wait(0.05)
        changed.clear()
        with lock:
            done = list(ended)
        codes = [procs[r].returncode for r in done]
        if len(done) == len(procs):
            by_rank = {r: int(c) for r, c in zip(done, codes, strict=True)}
            return [by_rank[r] for r in range(len(procs))], done
        if any(c < 0 for c in codes):
            _stop(procs)
            continue
        if any(c != 0 for c in codes):
            failed_at = failed_at or time.monotonic()
            if time.monotonic() - failed_at > FAILED_PEER_GRACE_S:
                _stop(procs)
                continue


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM to every worker still running, SIGKILL to those still there after `TERMINATE_GRACE_S`."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for p in running:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _job_outcome(
    codes: Sequence[int],
    devices: Sequence[str],
    status_path: str,
    output: str,
    started: float,
    ended: Sequence[int] | None = None,
    *,
    committed: bool = False,
) -> ScoreStats:
    """The job's stats from rank 0's report, or its error: a worker killed by a signal (the first to
    end, in `ended` order, when several were), rank 0's report of an error, or a worker that exited
    without one. ``committed``: rank 0 put the run in place, and its report is the job's outcome
    whatever happened to the workers after."""
    status = None
    if os.path.exists(status_path):
        with open(status_path, encoding="utf-8") as fh:
            status = json.load(fh)
    if committed and status is not None and "stats" in status:
        return ScoreStats(**status["stats"])
    world = len(devices)
    order = list(ended) if ended is not None else list(range(len(codes)))
    killed = [(r, -codes[r]) for r in order if codes[r] < 0 and codes[r] != -signal.SIGTERM]
    if killed:
        r, signum = killed[0]
        _remove_partial_output(status_path, output, started)
        raise MaxsimError(
            f"worker rank {r} of {world} ({devices[r]}) was killed by {_signal_name(signum)}; the job "
            "stopped and no run was written (out of host memory? see the system log)"
        )
    if status is not None and status.get("broken_pipe"):
        raise BrokenPipeError("the run's reader closed standard output")
    if status is not None and "error" in status:
        raise _ERROR_CLASSES.get(int(status["exit_code"]), MaxsimError)(str(status["error"]))
    bad = [(r, c) for r, c in enumerate(codes) if c != 0]
    if bad or status is None:
        r, c = bad[0] if bad else (0, codes[0])
        _remove_partial_output(status_path, output, started)
        raise MaxsimError(
            f"worker rank {r} of {world} ({devices[r]}) exited with code {c} without a report; its "
            "messages are above; no run was written"
        )
    fields = status["stats"]
    return ScoreStats(**fields)


def _remove_partial_output(status_path: str, output: str, started: float) -> None:
    """Remove the temporary file that a rank 0 killed while writing left behind, and nothing else: the
    file named by its note (`PARTIAL_NOTE`), if it is a regular file (not a link) in the folder the run
    goes to, named as `OutputFile` names its temp files for that run, and made during this job."""
    note = os.path.join(os.path.dirname(status_path), PARTIAL_NOTE)
    try:
        with open(note, encoding="utf-8") as fh:
            tmp = fh.read().strip()
    except OSError:
        return
    if output == "-" or not tmp:
        return
    target = os.path.realpath(output)  # `OutputFile` writes beside the file a symlink names
    name = os.path.basename(tmp)
    if os.path.realpath(os.path.dirname(tmp)) != os.path.dirname(target):
        return
    if not (name.startswith(f".{os.path.basename(target)}.") and name.endswith(".tmp")):
        return
    try:
        st = os.lstat(tmp)
        if stat.S_ISREG(st.st_mode) and st.st_mtime >= started - 1:
            os.unlink(tmp)
    except OSError:
        pass


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def worker_main(argv: Sequence[str]) -> int:
    """A ``--devices`` worker: run the job's request (a JSON file) as one rank; rank 0 reports to the
    launcher through ``MAXSIM_STATUS_FILE`` (stats, or the job's error) and prints nothing itself."""
    try:
        with open(argv[0], encoding="utf-8") as fh:
            options = json.load(fh)
    except OSError:
        if launcher_gone():  # the job is over, and its folder went with it: leave quietly
            raise SystemExit(128 + signal.SIGTERM) from None
        raise
    status_path = os.environ.get(ENV_STATUS)
    rank = _env_int("RANK", 0)
    try:
        stats = dispatch(ScoreRequest(**options))
    except MaxsimError as exc:
        if rank == 0 and status_path:
            _write_status(status_path, {"exit_code": exc.exit_code, "error": str(exc)})
        return exc.exit_code
    except SystemExit:
        raise
    except BrokenPipeError:
        # `maxsim score --devices ... | head`: the reader went away; the launcher leaves quietly too
        quiet_stdout()
        if rank == 0 and status_path:
            _write_status(status_path, {"broken_pipe": True})
        return 0
    except BaseException as exc:
        if rank == 0 and status_path and not isinstance(exc, KeyboardInterrupt):
            message = f"rank 0 failed: {type(exc).__name__}: {_one_line(exc)} (traceback above)"
            _write_status(status_path, {"exit_code": 1, "error": message})
        raise
    if rank == 0 and status_path:
        fields = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
        _write_status(status_path, {"stats": fields})
    return 0


def _write_status(path: str, payload: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(payload, fh)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "")


__all__ = [
    "ResultSink",
    "assign_shards",
    "dispatch",
    "drop_below",
    "kth_column",
    "kth_scores",
    "merge_columns",
    "trim_columns",
    "in_threads",
    "launch",
    "parse_devices",
    "run_rank",
    "run_threads",
    "split_candidates",
    "timeout_seconds",
    "world_size",
    "worker_main",
]
