"""The `maxsim` command line: parses options, calls one library function per command, formats.

Every error is one line on stderr, ``maxsim: error: ...``, and an exit code: 1 for a runtime error, 2
for a usage error (the `MaxsimError` family, and the usage errors of Typer's parser, which would
otherwise draw a box). Nothing else is caught here, so a bug still shows its traceback.

SIGTERM and SIGHUP stop a command the way Ctrl-C (SIGINT) does: they raise an exception in the main
thread (`SystemExit`, as `maxsim_cli.parallel.ranks.run_rank` does for SIGTERM; SIGINT keeps its
KeyboardInterrupt), so every ``finally`` / ``__exit__`` runs (temp files and staging folders are
removed, an output being written is left as it was), and the process exits with 128 + the signal's
number, saying so in one line. A signal that was ignored when maxsim started (``nohup``) stays ignored.

Once the command's output is in place (`maxsim_cli.lifeline.commit_point`: the final rename, the end
of a stream) a stop signal no longer stops it: the command finishes (summary line, stats file) and the
exit code is its own, so that 128 + N always means the previous output is as it was. The same holds
once the command has ended: the stop signals are then ignored (not a Python handler: the interpreter's
shutdown puts those back to the default action, which would kill the process by the signal), and as
the process's entry point `main` ends the process at once, skipping the interpreter's teardown.

A signal that arrives while a module is being imported is held back until the import is over (sent
again every 20 ms, for at most 5 s: `maxsim_cli.lifeline.defer`): libraries import others lazily
mid-command and some catch whatever the import raises (pyarrow's pandas bridge retries, then fails
with a confusing traceback over a half-imported pandas). So is one that arrives while `tempfile` first
looks for the temporary folder, which it does by making and removing a file there.
"""

from __future__ import annotations

import contextlib
import importlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from maxsim_cli import __version__, tuning
from maxsim_cli.errors import MaxsimError, command_line_terms, quiet_stdout
from maxsim_cli.lifeline import Stopped, defer, end_process, holds, new_command, stops_sent_again

# Signals that stop a command with its cleanup, like SIGINT (``parallel.ranks.run_rank``: SIGTERM too).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _deferred(signum: int, frame: Any) -> bool:
    """Whether the signal is held back, ``frame`` being inside an import (`lifeline.defer`)."""
    return bool(defer(signum, frame))


def _raise_stopped(signum: int, frame: Any) -> None:
    if holds(signum):  # the output is in place (or being put there): the command finishes
        return
    if not _deferred(signum, frame):
        raise Stopped(signum)


_interrupted: list[int] = []


def _raise_interrupt(signum: int, frame: Any) -> None:
    # Python's own SIGINT handler (KeyboardInterrupt, which Typer turns into exit code 130), remembered
    if holds(signum) or _deferred(signum, frame):
        return
    _interrupted.append(signum)
    raise KeyboardInterrupt


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[list[int]]:
    """While inside, SIGTERM and SIGHUP raise `Stopped` in the main thread, and SIGINT raises
    KeyboardInterrupt as always, noting it in the list yielded; the handlers found are put back after.
    Outside the main thread (no handler can be set there) and for a signal ignored on entry (or whose
    handler is someone else's, for SIGINT) this does nothing. Inside or after a commit point
    (`maxsim_cli.lifeline.commit_point`) a stop signal is noted and ignored. A stop raised inside a weakref
    callback or a ``__del__`` is sent again rather than printed (`lifeline.stop_again`)."""
    _interrupted.clear()
    new_command()
    if threading.current_thread() is not threading.main_thread():
        yield _interrupted
        return
    previous: dict[int, Any] = {}
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is signal.SIG_IGN:
            continue
        previous[signum] = signal.signal(signum, _raise_stopped)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, _raise_interrupt)
    restore_hook = stops_sent_again()
    try:
        yield _interrupted
    finally:
        restore_hook()
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def _error(message: str) -> None:
    print(f"maxsim: error: {message}", file=sys.stderr)


def _stopped_by(signum: int) -> None:
    print(f"maxsim: stopped by {signal.Signals(signum).name}", file=sys.stderr)


def run_command(call: Callable[[], Any]) -> int:
    """Run ``call`` (the parser and the command, Typer not in standalone mode) and return the exit code,
    every error printed as one line, naming options as flags (`command_line_terms`)."""
    code = 0
    try:
        with command_line_terms(), stop_signals_raise() as interrupted:
            result = call()
            # not standalone, Typer returns the code of a `typer.Exit` (or of Ctrl-C: 130), else the
            # command's return value (None)
            code = result if isinstance(result, int) else 0
        if code == 128 + signal.SIGINT and interrupted:
            _stopped_by(signal.SIGINT)
    except KeyboardInterrupt:  # outside what Typer catches
        _stopped_by(signal.SIGINT)
        code = 128 + signal.SIGINT
    except Stopped as exc:
        _stopped_by(exc.signum)
        code = int(exc.code)  # type: ignore[arg-type]
    except MaxsimError as exc:
        _error(str(exc))
        code = exc.exit_code
    except BrokenPipeError:
        quiet_stdout()
        return 0
    except typer.Abort:
        _error("aborted")
        code = 1
    except typer.TyperException as exc:  # the parser's usage errors (Click's, vendored by Typer)
        if type(exc).__name__ == "NoArgsIsHelpError":  # `maxsim` alone: the help is already printed
            return exc.exit_code
        message = " ".join(exc.format_message().split()).rstrip(".")
        ctx = getattr(exc, "ctx", None)
        hint = f"; see '{ctx.command_path} --help'" if ctx is not None else ""
        _error(f"{message}{hint}")
        code = exc.exit_code
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        quiet_stdout()
    except OSError as exc:  # data left in stdout's buffer met a full disk, ...
        if code == 0:
            from maxsim_cli.shards.files import write_error

            _error(str(write_error("<stdout>", exc, nothing_written=False)))
            code = 1
        quiet_stdout()
    return code


def _flags_as_flags(params: list[Any]) -> list[Any]:
    """Typer's help shows every option's type, a flag's as ``<bool>`` (``--quiet <bool>``), which reads
    as if it took a value: an empty metavar leaves the type column blank for flags."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class MaxsimCommand(TyperCommand):
    """Typer's command, with flags shown as flags in its help."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _flags_as_flags(super().get_params(ctx))


class MaxsimGroup(TyperGroup):
    """Typer's group, run through `run_command`: one-line errors and the stop signals, also under
    `typer.testing.CliRunner` (which calls `main`); flags shown as flags in its help."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _flags_as_flags(super().get_params(ctx))

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        code = run_command(lambda: super(MaxsimGroup, self).main(*args, standalone_mode=False, **kwargs))
        if standalone_mode:
            sys.exit(code)
        return code


# The top-level help's example: score the sample data and evaluate the run (every line runs as is).
_EXAMPLE = (
    "Example: maxsim score sample_data/queries.safetensors sample_data/corpus -k 100 -o run.trec "
    "&& maxsim eval run.trec sample_data/qrels.txt"
)

app = typer.Typer(
    name="maxsim",
    cls=MaxsimGroup,
    help="Exact late-interaction (ColBERT, ColPali) MaxSim scoring over on-disk embedding shards.\n\n"
    "Pack token embeddings into shards, score queries against them (every document, or the candidates "
    "of a first-stage run) and evaluate the TREC run. Each command's --help ends with an example.",
    epilog=_EXAMPLE,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Each module under maxsim_cli/commands defines `register(app)`; the order is the order of `--help`.
COMMAND_MODULES = (
    "pack", "inspect", "score", "explain", "eval", "verify", "quantize", "merge", "add", "delete", "compact",
    "serve",
)


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
for _info in app.registered_commands:
    if _info.cls in (None, TyperCommand):
        _info.cls = MaxsimCommand


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (`MaxsimGroup.main` prints the errors and exits with their code).

    The stop signals raise from the start, not only while the command runs (Ctrl-C while Typer builds
    the command line is no traceback either), and are ignored once the command has ended: the exit code
    is then the command's. It is the process's entry point: it leaves the stop signals ignored, and
    marks the process as the product's own, whose settings (`maxsim_cli.tuning`) a command applies. Called
    without ``argv`` (the ``maxsim`` script, ``python -m maxsim_cli``) it ends the process itself
    (`maxsim_cli.lifeline.end_process`); with ``argv`` it raises `SystemExit` with the code."""
    code: int = 1
    try:
        tuning.one_shot_process()  # inside: a signal while it runs is a stop like any other
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, _raise_stopped)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _raise_interrupt)
        stops_sent_again()
        command = typer.main.get_command(app)
        command.main(args=argv, prog_name="maxsim")  # exits: MaxsimGroup.main is standalone here
    except Stopped as exc:  # before the command started
        _stopped_by(exc.signum)
        code = int(exc.code)  # type: ignore[arg-type]
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        _stopped_by(signal.SIGINT)
        code = 128 + signal.SIGINT
    finally:
        tuning.command_ended()
    while True:  # from here on a stop signal is ignored: the exit code is the command's
        try:
            for signum in (signal.SIGINT, *STOP_SIGNALS):
                if signal.getsignal(signum) in (_raise_stopped, _raise_interrupt):
                    signal.signal(signum, signal.SIG_IGN)
            break
        except (Stopped, KeyboardInterrupt):  # one already on its way when the command ended
            continue
    if argv is None:
        end_process(code)
    sys.exit(code)
