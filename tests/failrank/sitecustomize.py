"""Failures injected into a job's ranks, for tests of the failure paths only.

A process started with this folder on ``PYTHONPATH`` loads this module at start-up (Python imports
``sitecustomize`` by itself). With ``MAXSIM_TEST_FAIL_RANK=R`` set, rank ``R`` raises an error right
after the job's corpus is opened; ``R:kill`` makes it kill itself with SIGKILL there. Used for
torchrun ranks and ``--devices cpu:N`` workers; tests of rank threads install `failing_share` with
monkeypatch instead.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

ENV_FAIL_RANK = "MAXSIM_TEST_FAIL_RANK"


def failing_share(score_share: Callable[..., Any], value: str) -> Callable[..., Any]:
    """``score_share`` (`maxsim_cli.parallel.work`) failing on the rank that ``value`` names."""
    target, _, how = value.partition(":")

    def share(request: Any, rank: int, *args: Any, **kwargs: Any) -> Any:
        if str(rank) == target.strip():
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            from maxsim_cli.errors import MaxsimError

            raise MaxsimError(f"failure injected on rank {rank} by {ENV_FAIL_RANK}={value} (a test hook)")
        return score_share(request, rank, *args, **kwargs)

    return share


def _install(value: str) -> None:
    from maxsim_cli.parallel import ranks

    ranks.score_share = failing_share(ranks.score_share, value)


if os.environ.get(ENV_FAIL_RANK):
    _install(os.environ[ENV_FAIL_RANK])
