"""Devices and memory defaults: the one grammar of device names, `--backend`, and the defaults of the
memory budgets (used by scoring, residency, quantize and verify alike). Imports torch only when a name
is checked against the machine, so that `maxsim_cli.cuda_early` reads names before torch is loaded.

Every device name a user gives goes through `parse_device_name`: ``auto``, ``cpu``, ``cuda``, ``cuda:N``,
a bare GPU index ``N`` (in lists) and ``cpu:N`` (N CPU workers, ``score --devices`` only). What each
option accepts of it, and says when it does not:

- `resolve_device`: one device (``score --device``, the API's ``device=``, `Corpus.to`): ``auto``,
  ``cpu``, ``cuda``, ``cuda:N``, checked against the machine;
- `parse_devices`: ``score --devices``, the devices of a job: ``0,1`` or ``cuda:0,cuda:1``, ``all``,
  ``cpu:N``, ``cpu``;
- `parse_serve_devices`: ``serve --devices``, the devices a corpus is made resident on: ``0,1``,
  ``cuda:N``, ``cuda``, ``cpu``, mixed;
- `rank_device`: a torchrun rank's device from ``--device`` and ``LOCAL_RANK``;
- `maxsim_cli.cuda_early.ordinals`: the GPUs whose context is made early, from the same names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from maxsim_cli.errors import BACKEND, DEVICE, UsageError

if TYPE_CHECKING:
    import torch

# Defaults: host staging memory, and the share of free GPU memory used without --max-memory.
DEFAULT_HOST_BYTES = 4 << 30
DEFAULT_GPU_FREE_SHARE = 0.9


@dataclass(frozen=True)
class DeviceName:
    """A device as a user names it: ``kind`` ``auto``, ``cpu`` or ``cuda``; ``index`` the N of ``cuda:N``
    or of a bare ``N`` (``bare``), or the number of workers of ``cpu:N``; None when not given."""

    kind: str
    index: int | None = None
    bare: bool = False


def parse_device_name(text: str) -> DeviceName | None:
    """One device name (case and surrounding spaces ignored), or None when it is not one."""
    name = text.strip().lower()
    if name in ("auto", "cpu", "cuda"):
        return DeviceName(name)
    if _is_index(name):
        return DeviceName("cuda", int(name), bare=True)
    kind, colon, number = name.partition(":")
    if colon and kind in ("cpu", "cuda") and _is_index(number):
        return DeviceName(kind, int(number))
    return None


def _is_index(text: str) -> bool:
    return text.isascii() and text.isdigit()


def resolve_device(device: str) -> torch.device:
    """``auto`` (CUDA when there is one), ``cpu``, ``cuda`` or ``cuda:N``; `UsageError` otherwise."""
    import torch

    if not isinstance(device, str):  # None or a number from the API: the usage error, not an AttributeError
        raise UsageError(f"{DEVICE.given(device)}: not a device; use auto, cpu, cuda or cuda:N")
    name = device.strip().lower()
    parsed = parse_device_name(name)
    if parsed == DeviceName("auto"):
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    if parsed == DeviceName("cpu"):
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise UsageError(
                f"{DEVICE.given(device)}: no CUDA device is available here; use {DEVICE.given('cpu')}"
            )
        if parsed is None:
            raise UsageError(f"{DEVICE.given(device)}: not a device; use auto, cpu, cuda or cuda:N")
        index = parsed.index if parsed.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise UsageError(
                f"{DEVICE.given(device)}: there are {torch.cuda.device_count()} CUDA devices (cuda:0 to "
                f"cuda:{torch.cuda.device_count() - 1})"
            )
        return torch.device("cuda", index)
    raise UsageError(f"{DEVICE.given(device)}: not a device; use auto, cpu, cuda or cuda:N")


def parse_devices(spec: str) -> list[str]:
    """``score --devices``: ``0,1,...`` or ``cuda:0,cuda:1,...`` (CUDA device indices), ``all`` (every CUDA
    device), ``cpu:N`` (N CPU workers) or ``cpu`` -> one torch device name per worker."""
    text = spec.strip().lower()
    if text == "cpu":
        return ["cpu"]
    if text.startswith("cpu:"):
        parsed = parse_device_name(text)
        if parsed is None or parsed.index is None or parsed.index < 1:
            raise UsageError(f"--devices {spec}: cpu:N needs a whole number of workers N >= 1, e.g. cpu:2")
        return ["cpu"] * parsed.index
    available = cuda_device_count()
    if text == "all":
        if available == 0:
            raise UsageError("--devices all: no CUDA device is available here; use --devices cpu:N")
        return [f"cuda:{i}" for i in range(available)]
    indices: list[int] = []
    for item in text.split(","):
        parsed = parse_device_name(item)
        if parsed is None or parsed.kind != "cuda" or parsed.index is None:
            raise UsageError(
                f"--devices {spec}: {item.strip().removeprefix('cuda:')!r} is not a device index; use e.g. "
                "0,1 or cuda:0,cuda:1, all or cpu:N"
            )
        if parsed.index in indices:
            raise UsageError(
                f"--devices {spec}: device {parsed.index} is listed twice; name each device once"
            )
        indices.append(parsed.index)
    if available == 0:
        raise UsageError(f"--devices {spec}: no CUDA device is available here; use --devices cpu:N")
    for index in indices:
        if index >= available:
            raise UsageError(
                f"--devices {spec}: there are {available} CUDA devices (0 to {available - 1}), no {index}"
            )
    return [f"cuda:{i}" for i in indices]


def parse_serve_devices(devices: str) -> list[str]:
    """``serve --devices 0,1`` (GPU indices, ``cuda:N``, ``cuda`` or ``cpu``) as device names, each checked
    against the machine when the corpus is made resident on it (`resolve_device`)."""
    out = []
    for part in devices.split(","):
        name = part.strip().lower()
        parsed = parse_device_name(name)
        if parsed is not None and parsed.bare:
            name = f"cuda:{parsed.index}"
        elif not (parsed in (DeviceName("cpu"), DeviceName("cuda")) or name.startswith("cuda:")):
            raise UsageError(
                f"--devices {devices}: {part.strip()!r} is not a device; use GPU indices 0,1,..."
            )
        out.append(name)
    if not out:
        raise UsageError("--devices: no device given")
    return out


def rank_device(option: str, local_rank: int) -> str:
    """The torch device of a torchrun rank from ``--device`` and its ``LOCAL_RANK``: ``cpu``, or
    ``cuda:LOCAL_RANK`` for ``auto`` (the CPU where there is no GPU) and ``cuda``."""
    import torch

    parsed = parse_device_name(str(option))
    if parsed == DeviceName("cpu"):
        return "cpu"
    if parsed in (DeviceName("auto"), DeviceName("cuda")):
        assert parsed is not None
        if not torch.cuda.is_available():
            if parsed.kind == "cuda":
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


def cuda_device_count() -> int:
    """The CUDA devices torch sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_backend_option(backend: str, device: torch.device) -> str:
    """`--backend` checked against `--device` (usage errors); returned as given, "auto" included."""
    if backend not in ("auto", "triton", "torch"):
        raise UsageError(f"{BACKEND.given(backend)}: use auto, triton or torch")
    if backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise UsageError(
            f"{BACKEND.given('triton')} on the CPU needs Triton's interpreter: set TRITON_INTERPRET=1, "
            f"or use {BACKEND.given('torch')}"
        )
    return backend


def default_host_bytes() -> int:
    """The host staging budget without --max-host-memory: `DEFAULT_HOST_BYTES`, or a quarter of RAM."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return DEFAULT_HOST_BYTES
    return min(DEFAULT_HOST_BYTES, physical // 4)
