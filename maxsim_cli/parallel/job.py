"""Which ranks run a ``--devices`` or torchrun job: this process as a torchrun rank, one device here,
rank threads, or worker processes."""

from __future__ import annotations

import dataclasses

from maxsim_cli.errors import UsageError
from maxsim_cli.parallel.devices import in_threads, parse_devices
from maxsim_cli.parallel.environment import Logger, log_to_stderr, world_size
from maxsim_cli.parallel.launcher import launch
from maxsim_cli.parallel.ranks import run_rank
from maxsim_cli.parallel.threads import run_threads
from maxsim_cli.scoring.request import ScoreRequest
from maxsim_cli.scoring.stats import ScoreStats


def dispatch(request: ScoreRequest, *, log: Logger = log_to_stderr) -> ScoreStats:
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
