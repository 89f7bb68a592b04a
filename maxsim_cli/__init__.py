"""maxsim: exact late-interaction MaxSim scoring over on-disk embedding shards.

The public API (`maxsim_cli.api`) is importable from here: `open_corpus`, `read_queries`, `Queries`,
`search`, `rerank`, `Run`. It is loaded on first use, so that ``import maxsim_cli`` (and the command
line's start-up) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_API = (
    "Corpus",
    "MaxsimWarning",
    "Queries",
    "Result",
    "Run",
    "open_corpus",
    "read_queries",
    "rerank",
    "search",
)

__all__ = ["__version__", *_API]

if TYPE_CHECKING:
    from maxsim_cli.api import (  # noqa: F401
        Corpus,
        MaxsimWarning,
        Queries,
        Result,
        Run,
        open_corpus,
        read_queries,
        rerank,
        search,
    )


def __getattr__(name: str) -> Any:
    if name in _API:
        from maxsim_cli import api

        return getattr(api, name)
    raise AttributeError(f"module 'maxsim_cli' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
