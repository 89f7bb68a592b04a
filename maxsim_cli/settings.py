"""Every ``MAXSIM_*`` environment variable the product reads, with its meaning.

Each is read when it is needed, not at import (a process, or a test, may set it later). Three kinds:

- **Switches that turn one step off**, for a comparison (the run is the same bytes either way): the
  start-up steps of a fresh ``maxsim score`` (docs/benchmarks.md, "What a fresh process pays once") and
  the mapping of a host-resident corpus for the GPU (`map_host`); on unless set to ``0``.
- **What a user asks for**: `timeline_path`, `dist_timeout_s`.
- **What the ``--devices cpu:N`` launcher hands its workers** (`launcher_devices` ... `launcher_pid`).

This module imports nothing but the standard library: the command line reads it before torch is loaded.
"""

from __future__ import annotations

import os

# switches: "0" turns the step off
EARLY_READS = "MAXSIM_EARLY_READS"  # the pass's first batches read while the kernels' warm-up finishes
GC_PAUSE = "MAXSIM_GC_PAUSE"  # Python's collector paused while a one-shot `maxsim score` sets up
KERNEL_WARMUP = "MAXSIM_KERNEL_WARMUP"  # the first Triton launches made in a thread during the set-up
TRITON_KEY_CACHE = "MAXSIM_TRITON_KEY_CACHE"  # Triton's cache key read back from a saved copy
EARLY_CUDA = "MAXSIM_EARLY_CUDA"  # the CUDA context made in a thread while torch is imported
MAP_HOST = "MAXSIM_MAP_HOST"  # a host-resident corpus mapped for the GPU: reranks read its rows in place

# what a user asks for
TIMELINE = "MAXSIM_TIMELINE"  # a file: each stage's seconds since the process started, written at exit
TIMELINE_T0 = "MAXSIM_TIMELINE_T0"  # a parent's time.time() just before it started the process
DIST_TIMEOUT = "MAXSIM_DIST_TIMEOUT"  # seconds a rank waits in a collective (default 3600)

# set by the `--devices cpu:N` launcher for its workers
DEVICES = "MAXSIM_DEVICES"  # the device of each local rank, comma-separated
STORE = "MAXSIM_STORE"  # host:port of the launcher's TCP store
STATUS_FILE = "MAXSIM_STATUS_FILE"  # where rank 0 reports the job's stats or error
LAUNCHER_PID = "MAXSIM_LAUNCHER_PID"  # the launcher's pid (`maxsim_cli.lifeline`)

SWITCHES = (EARLY_READS, GC_PAUSE, KERNEL_WARMUP, TRITON_KEY_CACHE, EARLY_CUDA, MAP_HOST)


def switched_on(name: str) -> bool:
    """Whether the step of switch ``name`` (one of `SWITCHES`) is on: anything but ``0``."""
    return os.environ.get(name, "1") != "0"


def early_reads() -> bool:
    """``MAXSIM_EARLY_READS``: read the pass's first batches while the kernels' warm-up finishes."""
    return switched_on(EARLY_READS)


def gc_pause() -> bool:
    """``MAXSIM_GC_PAUSE``: pause Python's collector while a one-shot ``maxsim score`` sets up."""
    return switched_on(GC_PAUSE)


def kernel_warmup() -> bool:
    """``MAXSIM_KERNEL_WARMUP``: make a CUDA run's first Triton launches in a thread during its set-up."""
    return switched_on(KERNEL_WARMUP)


def triton_key_cache() -> bool:
    """``MAXSIM_TRITON_KEY_CACHE``: read Triton's cache key back from a copy saved beside its cache."""
    return switched_on(TRITON_KEY_CACHE)


def early_cuda() -> bool:
    """``MAXSIM_EARLY_CUDA``: make the CUDA context in a thread while torch is imported."""
    return switched_on(EARLY_CUDA)


def map_host() -> bool:
    """``MAXSIM_MAP_HOST``: page-lock and map a host-resident corpus for the GPU at its first rerank there,
    so that the GPU reads the candidates' rows in place (`maxsim_cli.scoring.host_rows`); ``0``: host
    threads stage them in a page-locked buffer instead."""
    return switched_on(MAP_HOST)


def timeline_path() -> str | None:
    """``MAXSIM_TIMELINE``: the file a process's timeline is written to; None (unset or empty): none."""
    return os.environ.get(TIMELINE) or None


def timeline_t0() -> str | None:
    """``MAXSIM_TIMELINE_T0``: the parent's ``time.time()`` just before it started this process, as text
    (the timeline checks it); None when not given."""
    return os.environ.get(TIMELINE_T0)


def dist_timeout() -> str | None:
    """``MAXSIM_DIST_TIMEOUT``: seconds a rank waits in a collective, as text (the job checks it)."""
    return os.environ.get(DIST_TIMEOUT)


def launcher_devices() -> str | None:
    """``MAXSIM_DEVICES``: the ``--devices cpu:N`` launcher's device of each local rank."""
    return os.environ.get(DEVICES)


def launcher_store() -> str | None:
    """``MAXSIM_STORE``: ``host:port`` of the launcher's TCP store."""
    return os.environ.get(STORE)


def launcher_status_file() -> str | None:
    """``MAXSIM_STATUS_FILE``: where rank 0 reports the job's stats or error to the launcher."""
    return os.environ.get(STATUS_FILE)


def launcher_pid() -> str | None:
    """``MAXSIM_LAUNCHER_PID``: the pid of the launcher this worker dies with, as text."""
    return os.environ.get(LAUNCHER_PID)
