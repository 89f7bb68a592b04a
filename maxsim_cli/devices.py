"""Devices and memory defaults: `--device`, `--backend`, and the defaults of the memory budgets (used by
scoring, residency, quantize and verify alike)."""

from __future__ import annotations

import os

import torch

from maxsim_cli.errors import BACKEND, DEVICE, UsageError

# Defaults: host staging memory, and the share of free GPU memory used without --max-memory.
DEFAULT_HOST_BYTES = 4 << 30
DEFAULT_GPU_FREE_SHARE = 0.9


def resolve_device(device: str) -> torch.device:
    """``auto`` (CUDA when there is one), ``cpu``, ``cuda`` or ``cuda:N``; `UsageError` otherwise."""
    if not isinstance(device, str):  # None or a number from the API: the usage error, not an AttributeError
        raise UsageError(f"{DEVICE.given(device)}: not a device; use auto, cpu, cuda or cuda:N")
    name = device.strip().lower()
    if name == "auto":
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise UsageError(
                f"{DEVICE.given(device)}: no CUDA device is available here; use {DEVICE.given('cpu')}"
            )
        try:
            dev = torch.device(name)
        except RuntimeError:
            raise UsageError(f"{DEVICE.given(device)}: not a device; use auto, cpu, cuda or cuda:N") from None
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise UsageError(
                f"{DEVICE.given(device)}: there are {torch.cuda.device_count()} CUDA devices (cuda:0 to "
                f"cuda:{torch.cuda.device_count() - 1})"
            )
        return torch.device("cuda", index)
    raise UsageError(f"{DEVICE.given(device)}: not a device; use auto, cpu, cuda or cuda:N")


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
