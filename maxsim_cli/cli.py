"""The `maxsim` command line: parses options, calls one library function per command, formats.

Errors of the `MaxsimError` family become a one-line message on stderr and their exit code
(1 runtime, 2 usage); nothing else is caught here, so a bug still shows its traceback.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer

from maxsim_cli import __version__
from maxsim_cli.errors import MaxsimError

app = typer.Typer(
    name="maxsim",
    help="Exact late-interaction (ColBERT, ColPali) MaxSim scoring over on-disk embedding shards.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Each module under maxsim_cli/commands defines `register(app)`; the order is the order of `--help`.
COMMAND_MODULES = ("pack", "inspect", "score", "eval", "verify", "quantize", "merge")


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"maxsim {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Exact late-interaction (ColBERT, ColPali) MaxSim scoring over on-disk embedding shards."""


for _name in COMMAND_MODULES:
    importlib.import_module(f"maxsim_cli.commands.{_name}").register(app)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    try:
        app(args=argv, prog_name="maxsim", standalone_mode=True)
    except MaxsimError as exc:
        print(f"maxsim: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except BrokenPipeError:
        # `maxsim score ... | head`: the reader went away; leave quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(0)
