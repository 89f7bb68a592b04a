"""Failures and races injected into a job's ranks, for tests of those paths only.

A process started with this folder on ``PYTHONPATH`` loads this module at start-up (Python imports
``sitecustomize`` by itself). With ``MAXSIM_TEST_FAIL_RANK=R`` set, rank ``R`` raises an error right
after the job's corpus is opened; ``R:kill`` makes it kill itself with SIGKILL there. With
``MAXSIM_TEST_DELETE_AFTER_LOOK=ID,ID,...`` rank 0 deletes those documents from the corpus folders
(`maxsim delete`'s commit) right after it has found their committed generations, before the other ranks
open them: a write command that commits while the job starts. Used for torchrun ranks and ``--devices
cpu:N`` workers; tests of rank threads install `failing_share` with monkeypatch instead.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

ENV_FAIL_RANK = "MAXSIM_TEST_FAIL_RANK"
ENV_DELETE_AFTER_LOOK = "MAXSIM_TEST_DELETE_AFTER_LOOK"


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


def _delete_after_look(ids: list[str]) -> None:
    from maxsim_cli.parallel import ranks
    from maxsim_cli.shards.edit import delete_ids

    look = ranks.committed_generations

    def look_then_delete(paths: list[str]) -> Any:
        found = look(paths)
        for path, number in zip(paths, found[0], strict=True):
            if number is not None:
                delete_ids(path, ids)
        return found

    ranks.committed_generations = look_then_delete


if os.environ.get(ENV_FAIL_RANK):
    _install(os.environ[ENV_FAIL_RANK])
if os.environ.get(ENV_DELETE_AFTER_LOOK):
    _delete_after_look(os.environ[ENV_DELETE_AFTER_LOOK].split(","))
