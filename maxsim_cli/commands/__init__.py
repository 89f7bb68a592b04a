"""Typer commands. Each module defines `register(app)`; all share `cli_errors` for exit codes.

A command module declares its options at import but imports the library function it calls inside the
command's body: `maxsim --help`, `--version` and the commands that score nothing then never import the
scoring stack (torch, triton), which alone takes seconds to import (tests/test_imports.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from maxsim_cli.errors import MaxsimError, quiet_stdout

F = TypeVar("F", bound=Callable[..., Any])


def cli_errors(fn: F) -> F:
    """Turn `MaxsimError` into a one-line message on stderr and its exit code; quiet on a broken pipe."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MaxsimError as exc:
            typer.echo(f"maxsim: error: {exc}", err=True)
            raise typer.Exit(exc.exit_code) from None
        except BrokenPipeError:
            quiet_stdout()  # `maxsim ... | head`: the reader went away; stop quietly
            raise typer.Exit(0) from None

    return wrapper  # type: ignore[return-value]


def echo_data(text: str) -> None:
    """Print ``text`` and a newline on stdout (data only goes there). A write error (a full disk behind
    a redirection, ...) becomes a one-line error naming <stdout>; a closed pipe stays a `BrokenPipeError`.
    """
    try:
        typer.echo(text)
    except BrokenPipeError:
        raise
    except OSError as exc:
        from maxsim_cli.shards.files import write_error

        raise write_error("<stdout>", exc, nothing_written=False) from None
