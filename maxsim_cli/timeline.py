"""A process's timeline: when each stage of a command was reached, written as JSON when the process exits.

Off unless ``MAXSIM_TIMELINE=PATH`` is set; then `mark` notes the first time each stage is reached and the
file is written (atomically) at exit. `benchmarks/profile_first_call.py` reads it to show where a fresh
``maxsim score`` process spends its time before and around its first batch. Times are seconds since the
process started: since ``MAXSIM_TIMELINE_T0`` (a ``time.time()`` that the parent took just before it
started the process) when given, else since the start time the kernel keeps for the process
(``/proc/self/stat``, 10 ms steps on Linux).

    {"t0": 1764500000.12, "t0_source": "parent", "pid": 123,
     "stages": {"command": 2.91, "imports": 4.80, ...}, "threads": {"cuda_ready": "maxsim-warmup", ...}}

This module imports nothing heavy: the command marks its stages before torch is loaded.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time

from maxsim_cli import settings

ENV_PATH = settings.TIMELINE
ENV_T0 = settings.TIMELINE_T0

_lock = threading.Lock()
_stages: dict[str, float] = {}  # stage -> time.time() when first reached
_threads: dict[str, str] = {}  # stage -> the thread that reached it
_registered = False


def enabled() -> bool:
    """Whether ``MAXSIM_TIMELINE`` names a file to write."""
    return settings.timeline_path() is not None


def mark(stage: str) -> None:
    """Note that ``stage`` is reached now (the first time only); nothing when the timeline is off."""
    global _registered
    if settings.timeline_path() is None:
        return
    now = time.time()
    with _lock:
        if stage in _stages:
            return
        _stages[stage] = now
        _threads[stage] = threading.current_thread().name
        if not _registered:
            atexit.register(write)
            _registered = True


def process_start() -> tuple[float, str]:
    """(when the process started as a ``time.time()``, and where that came from: "parent" or "proc")."""
    given = settings.timeline_t0()
    if given:
        try:
            return float(given), "parent"
        except ValueError:
            pass
    try:
        with open("/proc/self/stat", encoding="ascii") as fh:
            fields = fh.read().rpartition(")")[2].split()
        ticks = int(fields[19])  # field 22, starttime: clock ticks after boot (fields[0] is field 3)
        with open("/proc/uptime", encoding="ascii") as fh:
            uptime = float(fh.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK"), "proc"
    except (OSError, ValueError, IndexError):
        return min(_stages.values(), default=time.time()), "first-mark"


def snapshot() -> dict:
    """The timeline so far, as it is written."""
    t0, source = process_start()
    with _lock:
        stages = sorted(_stages.items(), key=lambda item: item[1])
        threads = dict(_threads)
    return {
        "t0": t0,
        "t0_source": source,
        "pid": os.getpid(),
        "stages": {name: round(at - t0, 4) for name, at in stages},
        "threads": {name: threads[name] for name, _ in stages},
    }


def write() -> None:
    """Write the timeline to ``MAXSIM_TIMELINE`` (temp file + rename); a failure is one line on stderr."""
    path = settings.timeline_path()
    if not path:
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(snapshot(), fh, indent=2)
        os.replace(tmp, path)
    except OSError as exc:
        print(f"maxsim: warning: {ENV_PATH}={path}: could not write the timeline: {exc}", file=sys.stderr)
        try:
            os.unlink(tmp)
        except OSError:
            pass
