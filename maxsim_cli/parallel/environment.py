"""What a job's environment says: the variables its ranks read, the names of the job's folder, the
collectives' timeout, and the error classes an exit code stands for. Imports nothing heavy: the worker
program reads it before torch is loaded.

Environment variables the modules of `maxsim_cli.parallel` read (through `maxsim_cli.settings`):

- ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``: torchrun's (or the ``--devices cpu:N`` launcher's).
- ``MAXSIM_DIST_TIMEOUT``: seconds a rank waits in a collective, e.g. for the slowest rank to finish
  before the status exchange (default 3600).
- ``MAXSIM_DEVICES``, ``MAXSIM_STORE``, ``MAXSIM_STATUS_FILE``, ``MAXSIM_LAUNCHER_PID``: set by the
  ``--devices cpu:N`` launcher for its workers (device of each local rank; ``host:port`` of the
  launcher's store; where rank 0 reports; the launcher's pid, see `maxsim_cli.lifeline`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from maxsim_cli import settings
from maxsim_cli.errors import MaxsimError, UsageError, log_to_stderr  # noqa: F401 - its modules' logger

ENV_TIMEOUT = settings.DIST_TIMEOUT
ENV_DEVICES = settings.DEVICES
ENV_STORE = settings.STORE
ENV_STATUS = settings.STATUS_FILE
# Beside the status file: the temporary file rank 0 is writing the run to (one line), while it does.
PARTIAL_NOTE = "partial-output"
# Beside it too: made by rank 0 once the run is in place (`lifeline.share_commit`).
COMMIT_NOTE = "committed"
# The job's folder in the temporary directory, and its lock file (see `lock_job`).
JOB_PREFIX = "maxsim-job-"
LOCK_NAME = "lock"
# Every name a job's folder can hold: the next job removes a dead job's folder by these names only.
JOB_FILES = ("options.json", "status.json", "status.json.tmp", PARTIAL_NOTE, COMMIT_NOTE, LOCK_NAME)
# A collective waits this long by default: it must cover the slowest rank's lag behind the fastest at
# the status exchange (shares are balanced by tokens, so the lag is a small part of a job's time).
DEFAULT_TIMEOUT_S = 3600.0

ERROR_CLASSES: dict[int, type[MaxsimError]] = {1: MaxsimError, 2: UsageError}

Logger = Callable[[str], None]


def world_size() -> int:
    """``WORLD_SIZE`` of the environment (1 when unset): > 1 inside a torchrun or ``--devices`` job."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        value = os.environ["WORLD_SIZE"]
        raise UsageError(f"WORLD_SIZE={value!r} is not an integer; check the launcher") from None


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{name}={value!r} is not an integer; check the launcher") from None


def timeout_seconds() -> float:
    """The collectives' timeout: ``MAXSIM_DIST_TIMEOUT`` seconds, default `DEFAULT_TIMEOUT_S`."""
    value = settings.dist_timeout()
    if value is None:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise UsageError(f"{ENV_TIMEOUT}={value!r}: give a positive number of seconds")
    return seconds


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "")
