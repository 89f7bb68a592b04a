"""Devices of a job: the ``--devices`` list, whether its ranks are threads or processes, and the device
of a torchrun rank."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from maxsim_cli.errors import UsageError
from maxsim_cli.parallel.environment import ENV_DEVICES


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


def in_threads(devices: Sequence[str]) -> bool:
    """Whether ``--devices`` runs its ranks as threads of this process (GPUs: `run_threads`) rather than
    as worker processes (CPU workers, whose torch thread pools would otherwise share one process)."""
    return all(d.startswith("cuda") for d in devices)


def rank_device(option: str, local_rank: int) -> str:
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
