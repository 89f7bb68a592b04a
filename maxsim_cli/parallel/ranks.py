"""A rank of a job joined by torch.distributed (under torchrun, or a ``--devices cpu:N`` worker): it
scores its share, all ranks exchange a status before anything is written, only the results that can
still make the top-k travel to rank 0, and rank 0 merges and writes the run."""

from __future__ import annotations

import datetime
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from maxsim_cli import settings
from maxsim_cli.devices import rank_device
from maxsim_cli.errors import MaxsimError, UsageError
from maxsim_cli.lifeline import holds
from maxsim_cli.parallel.environment import (
    ENV_DEVICES,
    ERROR_CLASSES,
    Logger,
    env_int,
    log_to_stderr,
    one_line,
    timeout_seconds,
    world_size,
)
from maxsim_cli.parallel.shares import (
    MergeOrder,
    Share,
    combine_stats,
    drop_below,
    kth_column,
    kth_scores,
    trim_columns,
)
from maxsim_cli.parallel.work import CudaInit, score_share
from maxsim_cli.parallel.write import write_merged
from maxsim_cli.scoring.request import ScoreRequest
from maxsim_cli.scoring.stats import ScoreStats
from maxsim_cli.shards.generations import ReaderLock, committed_generations


def _this_rank_device(option: str, local_rank: int) -> str:
    """The torch device of this rank: from the launcher's list, else from ``--device`` and LOCAL_RANK."""
    listed = settings.launcher_devices()
    if listed:
        names = listed.split(",")
        if local_rank >= len(names):
            raise UsageError(f"{ENV_DEVICES}={listed!r} has no device for local rank {local_rank}")
        return names[local_rank]
    return rank_device(option, local_rank)


def _init_group(rank: int, world: int, timeout: datetime.timedelta) -> None:
    import torch.distributed as dist

    # gloo for every rank, also on GPUs: the only traffic is the ranks' results (host strings and floats)
    # and statuses, which NCCL would have to copy to a GPU and back.
    store_address = settings.launcher_store()
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
            f"rank {rank} of {world} could not join the job's process group: {one_line(exc)}; check "
            "MASTER_ADDR/MASTER_PORT and that every rank was started"
        ) from None


def _on_sigterm(signum: int, frame: object) -> None:
    # finally blocks run (the run writer removes its temporary file), then the process exits; once the
    # run is in place (`lifeline.commit_point`) the rank finishes instead
    if holds(signum):
        return
    raise SystemExit(128 + signum)


def run_rank(request: ScoreRequest, *, log: Logger = log_to_stderr) -> ScoreStats:
    """This process's part of a job whose ranks are described by the environment (torchrun's variables)."""
    import torch.distributed as dist

    start = time.perf_counter()
    rank = env_int("RANK", 0)
    world = world_size()
    local_rank = env_int("LOCAL_RANK", rank)
    if not 0 <= rank < world:
        raise UsageError(f"RANK={rank} is outside 0..{world - 1} (WORLD_SIZE={world}); check the launcher")
    timeout = datetime.timedelta(seconds=timeout_seconds())
    # The device is settled before joining the group, but a bad one is reported through the status
    # exchange like any other error, so that every rank stops.
    device, device_error = "?", None
    try:
        device = _this_rank_device(request.device, local_rank)
    except MaxsimError as exc:
        device_error = exc
    cuda_ready = CudaInit(device) if device.startswith("cuda") else None
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        _init_group(rank, world, timeout)
        held: list[ReaderLock] = []
        try:
            generations = _rank0_generations(request, rank, world, held)
            phases = {"join_s": time.perf_counter() - start}
            return _run_in_group(
                request, rank, world, device, device_error, cuda_ready, start, phases, log, generations
            )
        finally:
            for lock in held:
                lock.release()
            dist.destroy_process_group()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _rank0_generations(
    request: ScoreRequest, rank: int, world: int, held: list[ReaderLock]
) -> list[int | None] | None:
    """The generation of each corpus folder that every rank opens: the one committed when rank 0 looks,
    sent to the others, so that a write command (`maxsim add`, `delete`, `compact`) committing while the
    ranks start does not give them different documents. Rank 0 holds those generations open (``held``,
    until the job ends), so that no writer's clean-up removes their files meanwhile. None (each rank
    opens the committed ones) with one rank, or when rank 0 could not look: opening the corpus then
    reports why, on every rank."""
    import torch.distributed as dist

    if world == 1:
        return None
    found: list[Any] = [None]
    if rank == 0:
        try:
            numbers, locks = committed_generations([str(p) for p in request.corpus])
        except (MaxsimError, OSError):
            pass
        else:
            held.extend(locks)
            found[0] = numbers
    _collective(rank, world, dist.broadcast_object_list, found, src=0)
    return found[0]


def _run_in_group(
    request: ScoreRequest,
    rank: int,
    world: int,
    device: str,
    device_error: MaxsimError | None,
    cuda_ready: CudaInit | None,
    start: float,
    phases: dict[str, float],
    log: Logger,
    generations: list[int | None] | None,
) -> ScoreStats:
    import torch.distributed as dist

    share: Share | None = None
    merge_order: MergeOrder | None = None
    status: tuple[int, str, str] | None = None
    crash: BaseException | None = None
    try:
        if device_error is not None:
            raise device_error
        share, merge_order = score_share(
            request, rank, world, device, cuda_ready, log, generations=generations
        )
    except MaxsimError as exc:
        status = (exc.exit_code, str(exc), device)
    except Exception as exc:  # a bug: the others must still learn of it, then its traceback shows here
        crash = exc
        message = f"{type(exc).__name__}: {one_line(exc)} (its traceback is in that rank's output)"
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
        raise ERROR_CLASSES.get(code, MaxsimError)(message)
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
    shares: list[Share] = gathered
    mark = time.perf_counter()
    write_merged(request, shares, merge_order)
    phases["merge_write_s"] = time.perf_counter() - mark
    stats = combine_stats(request, shares)
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
            f"rank {rank} of {world} lost the other ranks ({one_line(exc)[:120]}); one of them stopped or "
            "died, see its messages; no run was written"
        ) from None
