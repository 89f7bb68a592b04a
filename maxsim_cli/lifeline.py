"""A worker process that dies with the process that started it (the ``--devices cpu:N`` launcher).

`tie_to_launcher` runs first thing in a worker, before torch is imported, so that a worker is never left
running (and never writes the run) once its launcher is gone, whatever ended the launcher - SIGKILL
included, which the launcher cannot clean up after:

- On Linux the kernel sends the worker SIGTERM the moment its parent dies (``prctl(PR_SET_PDEATHSIG)``).
- Everywhere, a daemon thread checks ``os.getppid()`` every `POLL_S` (a dead parent makes the worker an
  orphan, with a new parent) and sends the worker SIGTERM itself.
- SIGTERM raises `Stopped` (a `SystemExit`) in the main thread, so the worker's ``finally`` blocks run: a
  run being written loses its temporary file. One raised inside a weakref callback or a ``__del__``,
  where nothing can catch it, is sent again (`stop_again`) rather than printed and ignored. A worker
  that has not ended `GRACE_S` after its launcher died (stuck in a collective) is killed.
- A SIGTERM that arrives while a module is being imported (torch, for the first seconds of a worker) is
  held back until the import is over, sent again every `DEFER_S` (`held_back`): an exception raised
  inside an import ends in a confusing traceback, as some libraries catch what their imports raise. A
  worker still importing `DEFER_MAX_S` later leaves at once (`os._exit`), removing the job's files if its
  launcher is gone.

SIGINT and SIGHUP are ignored by a worker: Ctrl-C and a closed terminal reach the whole process group,
and it is the launcher that decides, then stops its workers with SIGTERM.

**The commit point** (`commit_point`), for every process that handles stop signals (the CLI, a worker):
the step that puts a command's output in place (the final atomic rename, or the end of a stream). A stop
signal that arrives inside it is held, and once it has ended without an error the output is committed:
a stop signal from then on is noted and ignored (`holds`), the command finishes what is left (the
summary line, a stats file) and its exit code is its own. So exit 128 + N always means the previous
output is as it was, and exit 0 the new output complete. A ``--devices`` worker that commits makes the
job's commit note (`share_commit`), so that its launcher knows the run is in place.

This module imports nothing of maxsim's and nothing heavy: it must be cheap before torch is loaded.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from maxsim_cli import settings

# The launcher's pid, set by the launcher for its workers.
ENV_LAUNCHER_PID = settings.LAUNCHER_PID
# How often the watcher thread looks for its parent (a few microseconds each time).
POLL_S = 0.2
# Seconds between the launcher's death and SIGKILL for a worker that did not end on SIGTERM.
GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1
# A signal met inside an import is sent again this often, and acted on anyway after this long.
DEFER_S = 0.02
DEFER_MAX_S = 5.0
_deferred_since: dict[int, float] = {}
# The job's files and folder, removed by a worker that leaves while its launcher is gone.
_job_files: tuple[list[str], str] | None = None


def launcher_pid() -> int | None:
    """The launcher's pid from the environment, or None outside a ``--devices`` worker."""
    try:
        return int(settings.launcher_pid() or "")
    except ValueError:
        return None


def launcher_gone() -> bool:
    """Whether this process is a ``--devices`` worker whose launcher has died (it was re-parented)."""
    pid = launcher_pid()
    return pid is not None and os.getppid() != pid


def held_back(frame: Any) -> bool:
    """Whether ``frame`` (where a signal interrupted the main thread) runs inside an import, or inside
    the standard library's first look for the temporary folder (`tempfile.gettempdir` makes a randomly
    named file in each candidate folder and removes it: a signal between the two left the file in
    ``TMPDIR``)."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        if code.co_name == "_get_default_tempdir" and os.path.basename(code.co_filename) == "tempfile.py":
            return True
        frame = frame.f_back
    return False


def defer(signum: int, frame: Any) -> bool | None:
    """For a signal handler: True when ``frame`` is inside an import or the temporary folder's first look
    (`held_back`), and then the signal is sent again in `DEFER_S`; False when it is not; None when it
    has been held back for `DEFER_MAX_S` already."""
    now = time.monotonic()
    if not held_back(frame):
        _deferred_since.pop(signum, None)
        return False
    if now - _deferred_since.setdefault(signum, now) > DEFER_MAX_S:
        _deferred_since.pop(signum, None)
        return None
    send_again(signum)
    return True


def send_again(signum: int) -> None:
    """Send ``signum`` to this process again in `DEFER_S`, from a timer thread: its handler then runs
    where the main thread is by then."""
    timer = threading.Timer(DEFER_S, os.kill, (os.getpid(), signum))
    timer.daemon = True
    timer.start()


class Stopped(SystemExit):
    """Raised in the main thread by a stop signal (the CLI's SIGTERM and SIGHUP, a worker's SIGTERM):
    cleanup runs, then the exit code is 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


def stop_again(previous: Callable[[Any], None], unraisable: Any) -> None:
    """`sys.unraisablehook` while the stop signals raise (bound to the hook found, ``previous``). The
    collector runs weakref callbacks and ``__del__`` wherever the main thread is, and a stop raised by the
    handler inside one cannot leave it: Python prints it ("Exception ignored in ...", a traceback) and goes
    on. Such a stop (`Stopped`, KeyboardInterrupt) is sent again (`send_again`) to stop the process outside
    the callback, and not printed; anything else goes to ``previous``."""
    if isinstance(unraisable.exc_value, Stopped):
        send_again(unraisable.exc_value.signum)
    elif isinstance(unraisable.exc_value, KeyboardInterrupt):
        send_again(signal.SIGINT)
    else:
        previous(unraisable)


def stops_sent_again() -> Callable[[], None]:
    """Install `stop_again` as `sys.unraisablehook` over the hook found; returns what puts that back."""
    found = sys.unraisablehook
    sys.unraisablehook = functools.partial(stop_again, found)

    def restore() -> None:
        sys.unraisablehook = found

    return restore


def _raise_exit(signum: int, frame: Any) -> None:
    if holds(signum):
        return
    held = defer(signum, frame)
    if held is None:  # stuck in an import: nothing of the job's is open yet, leave now
        if _job_files is not None:
            remove_if_orphaned(*_job_files)
        os._exit(128 + signum)
    if not held:
        raise Stopped(signum)


def _death_signal() -> None:
    """Ask the kernel for SIGTERM when the parent dies (Linux only; elsewhere the watcher does it)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)


def tie_to_launcher(
    job_files: list[str] | None = None, job_folder: str | None = None, *, armed: bool = True
) -> None:
    """Make this worker die with its launcher (see the module docstring). Call from the main thread,
    first thing. ``job_files`` and ``job_folder``: what `remove_if_orphaned` removes should the worker
    have to leave at once. Without ``MAXSIM_LAUNCHER_PID`` (not a ``--devices`` worker) it does nothing.

    ``armed=False`` leaves SIGTERM's default action (the process ends at once, silently) until `arm`:
    for the worker's first imports, which an exception raised inside can break for good (pyarrow retries
    a failed import of pandas, whose second attempt then fails on the first one's remains)."""
    global _job_files
    parent = launcher_pid()
    if parent is None:
        return
    find_temp_folder()
    if job_files is not None and job_folder is not None:
        _job_files = (job_files, job_folder)
    if armed:
        arm()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _death_signal()
    threading.Thread(target=_watch, args=(parent,), name="maxsim-lifeline", daemon=True).start()
    if os.getppid() != parent:  # the launcher died before the death signal was asked for
        raise SystemExit(128 + signal.SIGTERM)


def find_temp_folder() -> None:
    """Take the standard library's first look for the temporary folder now, with SIGTERM blocked.

    That look (`tempfile.gettempdir`) makes a randomly named file in the folder and removes it. Before
    `arm`, SIGTERM ends a worker at once (no handler runs to hold it back, as `held_back` does once
    armed), and torch's import takes that look: a worker stopped between the two left the file in
    ``TMPDIR``. Once taken, the answer is kept (``tempfile.tempdir``) and no
    later call makes a file. A SIGTERM that came meanwhile ends the worker as soon as it is unblocked.
    Call it before any other thread starts, so that no thread takes the signal in the main one's place.
    """
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no signal masks, nor SIGTERM from a launcher
        tempfile.gettempdir()
        return
    found = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        tempfile.gettempdir()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, found)


_unarmed: list[Callable[[], None]] = []  # what puts the unraisable hook found by `arm` back


def arm() -> None:
    """From now on SIGTERM raises `Stopped` in the main thread (held back inside imports, ignored once
    the run is committed: `holds`; sent again when raised inside a finalizer: `stop_again`), so that the
    worker's ``finally`` blocks run."""
    if launcher_pid() is not None:
        signal.signal(signal.SIGTERM, _raise_exit)
        if not _unarmed:
            _unarmed.append(stops_sent_again())


def disarm() -> None:
    """The worker's work is over: a SIGTERM from now on is ignored, not raised inside the interpreter's
    shutdown (a signal is handled by the main thread whichever thread receives it)."""
    if launcher_pid() is not None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while _unarmed:
            _unarmed.pop()()


def remove_if_orphaned(paths: list[str], folder: str) -> None:
    """When the launcher is gone (it cannot clean up any more): remove the job's files ``paths`` by
    name, then ``folder`` if that left it empty - never anything else."""
    if not launcher_gone():
        return
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass
    try:
        os.rmdir(folder)
    except OSError:
        pass


# --------------------------------------------------------------------------------------------------
# The commit point (see the module docstring)

_holding = 0  # commit points under way (in any thread: a signal's handler runs in the main thread)
_holding_lock = threading.Lock()
_committed = False  # this command's output is in place
_noted: list[int] = []  # stop signals that came inside a commit point or after one
_commit_note: str | None = None  # the job's commit note: made by the worker that commits, read by all


def new_command() -> None:
    """A command begins: nothing is committed yet, no signal noted."""
    global _committed
    _committed = False
    _noted.clear()


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """While inside, a stop signal is noted and does not stop the command (`holds`)."""
    global _holding
    with _holding_lock:
        _holding += 1
    try:
        yield
    finally:
        with _holding_lock:
            _holding -= 1


@contextlib.contextmanager
def commit_point() -> Iterator[None]:
    """Around the step that puts a command's output in place. A stop signal inside is held (`holds`);
    when the block ends without an exception the output is committed (`committed`), and the job's commit
    note made if there is one. Outside a process whose handlers ask `holds` it changes nothing."""
    with signals_held():
        yield
        _mark_committed()


def _mark_committed() -> None:
    global _committed
    if _commit_note is not None and not _committed:
        try:  # made by one open: the launcher only asks whether it exists
            os.close(os.open(_commit_note, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        except OSError:
            pass
    _committed = True


def committed() -> bool:
    """Whether this command's output is in place: committed here, or by a worker of this job."""
    return _committed or (_commit_note is not None and os.path.exists(_commit_note))


def adopt_commit() -> bool:
    """The launcher, its workers ended: whether one of them committed the run (the job's note exists),
    and if so this command is committed too (before the job's folder, and its note, are removed)."""
    if committed():
        _mark_committed()
    return _committed


def share_commit(note: str | None) -> None:
    """The job's commit note (a path in the job's folder; None: none): `commit_point` makes it, and
    `committed` is also true once it exists."""
    global _commit_note
    _commit_note = note


def holds(signum: int) -> bool:
    """For a stop signal's handler: True, and the signal noted, when it must not stop the command - it
    came inside a commit point or after the output was committed."""
    if _holding or committed():
        _noted.append(signum)
        return True
    return False


def noted() -> list[int]:
    """The stop signals `holds` kept from stopping this command, in order."""
    return list(_noted)


def end_process(code: int) -> NoReturn:
    """End this process with ``code``, its outcome decided: the exit handlers run (`atexit`) and the
    standard streams are flushed, but the interpreter's teardown is skipped - tenths of a second once
    torch is loaded, during which a signal with a Python handler gets the default action again, and
    which waits for every thread that is not a daemon: a pool's worker that a stop signal left waiting
    for work (the signal came while the pool started it) kept a stopped ``score`` from ever exiting."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
