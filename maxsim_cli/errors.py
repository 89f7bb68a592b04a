"""One exception family, converted to exit codes at the CLI boundary.

Every message is a single line that names the file, the document or line, and what to do.

One vocabulary, two renderings: a message that names an option of a scoring run builds it from an
`Option`, which knows both the command line's flag and the Python API's keyword argument. The Python
API's entry points (`search`, `rerank`, `Corpus.to`, `Run.to_trec`) run inside `python_terms`, where
``str(TOP_K)`` is ``k`` and ``TOP_K.given(0)`` is ``k=0``; everywhere else, and always while a `maxsim`
command runs (`command_line_terms`, entered by the CLI boundary), they are ``--top-k`` and ``--top-k 0``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar


def log_to_stderr(message: str) -> None:
    """A progress or warning line on stderr, as every command prints them (``maxsim: ...``)."""
    print(f"maxsim: {message}", file=sys.stderr, flush=True)


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


# --------------------------------------------------------------------------------------------------
# options named in messages: the command line's flag or the Python API's keyword

# Counted, not a flag per thread: the engine's reader and warm-up threads build messages for the call
# that started them. The command line wins: a `maxsim` command that calls the API (`maxsim serve`'s
# warm-up, `Corpus.to`) still speaks in flags.
_python_calls = 0
_command_line_calls = 0
_calls_lock = threading.Lock()


def speaks_python() -> bool:
    """Whether messages built now name options as the Python API's keywords (inside `python_terms`
    and outside any `maxsim` command)."""
    return _python_calls > 0 and _command_line_calls == 0


@contextlib.contextmanager
def python_terms() -> Iterator[None]:
    """While inside, messages name options as the Python API's keyword arguments (``k=0``)."""
    global _python_calls
    with _calls_lock:
        _python_calls += 1
    try:
        yield
    finally:
        with _calls_lock:
            _python_calls -= 1


@contextlib.contextmanager
def command_line_terms() -> Iterator[None]:
    """While inside (a `maxsim` command), messages name options as flags (``--top-k 0``), also where
    the command calls the Python API."""
    global _command_line_calls
    with _calls_lock:
        _command_line_calls += 1
    try:
        yield
    finally:
        with _calls_lock:
            _command_line_calls -= 1


F = TypeVar("F", bound=Callable[..., Any])


def in_python_terms(func: F) -> F:
    """`python_terms` around every call of ``func`` (an entry point of the Python API)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with python_terms():
            return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


class Option(NamedTuple):
    """An option as each front end names it: the command line's ``flag`` and the Python API's
    ``keyword``. ``f"{TOP_K}"`` is the name alone, ``TOP_K.given(0)`` the option as the user gave it."""

    flag: str
    keyword: str

    def __str__(self) -> str:
        return self.keyword if speaks_python() else self.flag

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def given(self, value: object = True) -> str:
        """``--top-k 0`` / ``k=0``; a flag given (True) is ``--strict`` / ``strict=True``."""
        if speaks_python():
            return f"{self.keyword}={value!r}"
        return self.flag if value is True else f"{self.flag} {value}"


# The options of a scoring run (`maxsim score` and the API's `search` / `rerank`) that messages name.
TOP_K = Option("--top-k", "k")
BATCH_QUERIES = Option("--batch-queries", "batch_queries")
STRICT = Option("--strict", "strict")
DEVICE = Option("--device", "device")
BACKEND = Option("--backend", "backend")
INCLUDE = Option("--include-ids", "include")
EXCLUDE = Option("--exclude-ids", "exclude")
WHERE = Option("--where", "where")
MAX_MEMORY = Option("--max-memory", "max_memory")
MAX_HOST_MEMORY = Option("--max-host-memory", "max_host_memory")
OUTPUT = Option("-o", "path")
EXACT_FROM = Option("--exact-from", "exact_from")
DEPTH = Option("--depth", "depth")
