"""The CUDA context of a GPU run made in a background thread while the process imports torch.

A fresh CUDA process pays ~0.5 s on the H200 machine to initialise the driver and create the device's
context (docs/benchmarks.md, "What a fresh process pays once"). torch does it on its first CUDA call, on
the main thread, after its own import (~2 s) and with Python's lock held around parts of it. The driver
needs neither torch nor the lock: `start` calls it through ``ctypes`` (which drops the lock around each
foreign call) in a thread of its own as soon as the command knows its device, so the context is made
while the main thread imports torch, and torch's first CUDA call finds it in place: a fresh `maxsim score`
over 8.2 GB took 1.13 s against 1.44 without it, the whole process 3.2 s against 4.0 (H200, fresh
processes alternating; benchmarks/results/score/first-call-h200-early.json).

What it makes is what torch would make: the driver initialised (``cuInit``) and the device's primary
context retained (``cuDevicePrimaryCtxRetain``), the one context torch and Triton then use. The ordinal is
the one torch will pick, within ``CUDA_VISIBLE_DEVICES`` as both see it: ``cuda:N`` -> N, ``auto`` and
``cuda`` -> 0 (torch's current device in a fresh process), ``--devices 0,1`` -> each. It does nothing
for ``cpu``, inside a torchrun job (the launcher's environment picks the rank's device), without a
driver library, or with ``MAXSIM_EARLY_CUDA=0``; every failure is silent: torch's own call then meets
it and reports it as before. The thread never blocks the process's exit (a daemon) and changes no
result: only when the context is made moves.

This module imports nothing heavy: it runs before torch is loaded.
"""

from __future__ import annotations

import ctypes
import os
import threading

from maxsim_cli import settings, timeline
from maxsim_cli.devices import DeviceName, parse_device_name

ENV_SWITCH = settings.EARLY_CUDA
_LIBRARY = "libcuda.so.1"


def ordinals(device: str, devices: str | None = None) -> list[int]:
    """The CUDA ordinals a run with ``--device`` / ``--devices`` will use, as far as the option text
    tells without torch; [] where it names none or is not understood (torch then reports it)."""
    world = os.environ.get("WORLD_SIZE", "1").strip() or "1"
    # inside a torchrun job (or a WORLD_SIZE that is not a number, which the job's own check reports)
    if not settings.early_cuda() or not world.isdigit() or int(world) > 1:
        return []
    if devices:
        listed = [parse_device_name(p) for p in devices.split(",")]
        if not all(d is not None and d.bare for d in listed):
            return []
        return sorted({d.index for d in listed if d is not None and d.index is not None})
    parsed = parse_device_name(device)
    if parsed in (DeviceName("auto"), DeviceName("cuda")):
        return [0]
    if parsed is not None and parsed.kind == "cuda" and parsed.index is not None and not parsed.bare:
        return [parsed.index]
    return []


def start(device: str, devices: str | None = None) -> threading.Thread | None:
    """Start the thread of the module docstring for the ordinals `ordinals` finds; None when there are
    none."""
    wanted = ordinals(device, devices)
    if not wanted:
        return None
    thread = threading.Thread(target=_make_contexts, args=(wanted,), name="maxsim-cuda-early", daemon=True)
    thread.start()
    return thread


def _make_contexts(wanted: list[int]) -> None:
    """``cuInit`` then each device's primary context retained; returns at the first failure."""
    try:
        driver = ctypes.CDLL(_LIBRARY)
    except OSError:
        return
    if driver.cuInit(0) != 0:
        return
    count = ctypes.c_int(0)
    if driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return
    for ordinal in wanted:
        if ordinal >= count.value:
            return
        handle = ctypes.c_int(0)
        context = ctypes.c_void_p()
        if driver.cuDeviceGet(ctypes.byref(handle), ordinal) != 0:
            return
        # retained for the process's life, as torch retains it: released, it could be destroyed before
        # torch takes it
        if driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle) != 0:
            return
    timeline.mark("cuda_context")
