"""One exception family, converted to exit codes at the CLI boundary.

Every message is a single line that names the file, the document or line, and what to do.
"""

from __future__ import annotations

import os
import sys


class MaxsimError(Exception):
    """A runtime error the user can act on: exit code 1."""

    exit_code = 1


class InputError(MaxsimError):
    """Invalid input data (corrupt shard, bad run file, ...): exit code 1."""


class UsageError(MaxsimError):
    """Bad command-line usage (conflicting options, two stdin inputs, ...): exit code 2."""

    exit_code = 2


class MaxsimWarning(UserWarning):
    """Something was left out or adjusted, and the result is still valid (e.g. candidates missing from
    the corpus, documents written with all-zero token rows). Defined here, the lowest layer, so that
    every layer can warn with it; `maxsim_cli.MaxsimWarning` is this class."""


class RankStopped(MaxsimError):
    """A rank of a job stopped early because another rank failed (that rank's error is the job's)."""


def quiet_stdout() -> None:
    """Point stdout at /dev/null after its reader went away (a closed pipe, `maxsim ... | head`) or its
    disk filled, so that Python's flush at exit cannot fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
