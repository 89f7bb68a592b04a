"""A ``--devices cpu:N`` worker: ``python -m maxsim_cli.parallel.worker OPTIONS.json``, started by
`maxsim_cli.parallel.launcher`. It runs the job's request as one rank (`maxsim_cli.parallel.ranks`).

The lifeline is tied before torch is imported (seconds), so that a launcher killed meanwhile takes its
workers along; a worker whose launcher died removes the job's folder on its way out. Rank 0 makes the
job's commit note once the run is in place; a worker whose outcome is decided ends at once
(`lifeline.end_process`), a traceback aside. Only light modules are imported at the top of this one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from maxsim_cli import lifeline, settings
from maxsim_cli.errors import MaxsimError, quiet_stdout
from maxsim_cli.lifeline import launcher_gone
from maxsim_cli.parallel.environment import COMMIT_NOTE, JOB_FILES, env_int, one_line


def worker_main(argv: Sequence[str]) -> int:
    """A ``--devices`` worker: run the job's request (a JSON file) as one rank; rank 0 reports to the
    launcher through ``MAXSIM_STATUS_FILE`` (stats, or the job's error) and prints nothing itself."""
    from maxsim_cli.parallel.ranks import run_rank
    from maxsim_cli.scoring.request import ScoreRequest

    try:
        with open(argv[0], encoding="utf-8") as fh:
            options = json.load(fh)
    except OSError:
        if launcher_gone():  # the job is over, and its folder went with it: leave quietly
            raise SystemExit(128 + signal.SIGTERM) from None
        raise
    status_path = settings.launcher_status_file()
    rank = env_int("RANK", 0)
    try:
        stats = run_rank(ScoreRequest(**options))
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
            message = f"rank 0 failed: {type(exc).__name__}: {one_line(exc)} (traceback above)"
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


def main(argv: Sequence[str]) -> int:
    """The worker's life: tied to its launcher, then one rank of the job; returns the exit code."""
    status = (settings.launcher_status_file() or "")
    folder = os.path.dirname(status)
    files = [argv[0], status, status + ".tmp", *(os.path.join(folder, n) for n in JOB_FILES[3:])]
    lifeline.share_commit(os.path.join(folder, COMMIT_NOTE))
    try:
        lifeline.tie_to_launcher(files, folder, armed=False)  # SIGTERM ends the worker silently until armed
        import pyarrow

        pyarrow.array([""])  # its pandas bridge, imported at the first array: before any handler can raise
        import maxsim_cli.parallel.ranks  # noqa: F401 - torch and the engine, imported before SIGTERM is armed
        lifeline.arm()
        code = worker_main(argv)
    except SystemExit as exc:  # stopped (SIGTERM), or a rank's exit code
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        lifeline.disarm()  # the exit code is now the worker's
        lifeline.remove_if_orphaned(files, folder)
    return code


if __name__ == "__main__":
    lifeline.end_process(main(sys.argv[1:]))
