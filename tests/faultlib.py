"""Helpers of the fault-injection tests: a fork server that starts `maxsim` commands in milliseconds, the
inputs' hashes, and a look at what a command left behind.

`ForkServer` is one ``python`` process that has imported torch and maxsim (2-3 s, once) and forks a child
per command: the child sets up its working folder, stdout, stderr, environment, ``TMPDIR``, resource
limits and default signal dispositions, then runs `maxsim_cli.cli.main` as the ``maxsim`` script and
``python -m maxsim_cli`` do (no arguments: ``sys.argv``), and ends as such a process ends - by `main`
itself, or through the interpreter's shutdown (with torch loaded, as in a ``score`` process). So a
signal drawn at a random instant of a command's run falls in the command's own work or in its process's
end, not in the interpreter's start-up, and a trial costs what the work costs. The server is a child subreaper
(Linux), so the workers of a ``--devices cpu:N`` launcher that was killed are re-parented to it (not
to init) and reaped: a worker still running shows in ``/proc``. Exit codes are those of
`subprocess.Popen.returncode`: ``-N`` for a death by signal N.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# The child runs the command as `python -m maxsim_cli` would, with the dispositions of an interactive
# shell's job (whatever the test runner set), stdout and stderr in files, then exits with main's code.
_SERVER = r"""
import ctypes, importlib, io, json, os, resource, select, signal, sys, tempfile, traceback

import torch  # noqa: F401 - the seconds every trial would otherwise spend
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
from maxsim_cli.cli import main

try:  # PR_SET_CHILD_SUBREAPER: orphaned grandchildren (a dead launcher's workers) come back here
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)
except Exception:
    pass
channel = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)


def at_entry(exc):
    # whether exc came at main's first instruction (its check for signals on entry), before any
    # statement of maxsim's ran: a process as stopped while starting as by a signal before the call
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code is main.__code__ and tb.tb_lineno == main.__code__.co_firstlineno


def child(request):
    started = False
    try:
        os.chdir(request["cwd"])
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        channel.close()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # read TMPDIR again
        if request.get("fsize") is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (request["fsize"], request["fsize"]))
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = ["maxsim", *request["argv"]]
        started = True
        main()  # as the `maxsim` script runs it: it ends the process itself, or raises SystemExit
    except SystemExit:
        raise  # through the interpreter's shutdown, as the `maxsim` script's process would end
    except KeyboardInterrupt as exc:
        if started and not at_entry(exc):  # out of maxsim: a fault of the command's
            traceback.print_exc()
        else:  # a SIGINT in this set-up, before maxsim runs: the end of a process stopped while starting
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
    os._exit(1)


print(json.dumps({"ready": os.getpid()}), file=channel)
pending = b""
while True:
    readable, _, _ = select.select([0], [], [], 0.01)
    if readable:
        data = os.read(0, 1 << 16)
        if not data:
            break
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                child(request)
            print(json.dumps({"id": request["id"], "pid": pid}), file=channel)
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        print(json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status)}), file=channel)
"""

# Modules the commands import lazily: imported once in the server rather than in every child.
PRELOAD = [
    "maxsim_cli.scoring.entry",
    "maxsim_cli.scoring.dispatch",
    "maxsim_cli.scoring.engine",
    "maxsim_cli.scoring.files",
    "maxsim_cli.pack",
    "maxsim_cli.quantize",
    "maxsim_cli.merge",
    "maxsim_cli.run_files",
    "maxsim_cli.verify",
    "maxsim_cli.verify.run",
    "maxsim_cli.shards",
]


class ForkServer:
    """Starts commands as forks of one warm process: `spawn` returns the pid, `wait` the exit code."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, json.dumps(PRELOAD)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        assert self._proc.stdout is not None
        first = self._proc.stdout.readline()
        if not first:
            raise RuntimeError("the fork server did not start")
        self.pid = json.loads(first)["ready"]
        self._lock = threading.Condition()
        self._pids: dict[int, int] = {}
        self._codes: dict[int, int] = {}
        self._next = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            message = json.loads(line)
            with self._lock:
                if "id" in message:
                    self._pids[message["id"]] = message["pid"]
                else:
                    self._codes[message["pid"]] = message["code"]
                self._lock.notify_all()

    def spawn(
        self,
        argv: list[str],
        cwd: Path,
        stdout: Path,
        stderr: Path,
        env: dict[str, str] | None = None,
        fsize: int | None = None,
    ) -> int:
        """Start ``maxsim ARGV`` in ``cwd``; returns its pid."""
        with self._lock:
            self._next += 1
            ident = self._next
        request = {"id": ident, "argv": argv, "cwd": str(cwd), "stdout": str(stdout), "stderr": str(stderr)}
        request.update({"env": env or {}, "fsize": fsize})
        assert self._proc.stdin is not None
        with self._lock:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            self._lock.wait_for(lambda: ident in self._pids or self._proc.poll() is not None, 30)
            return self._pids.pop(ident)

    def wait(self, pid: int, timeout: float) -> int | None:
        """The exit code of ``pid`` (``-N``: killed by signal N), or None if it is still running."""
        with self._lock:
            self._lock.wait_for(lambda: pid in self._codes, timeout)
            return self._codes.pop(pid, None)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def processes_with(marker: str) -> list[int]:
    """Live processes (not zombies) whose environment holds ``marker`` (``NAME=value``)."""
    found = []
    needle = marker.encode() + b"\0"
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                state = fh.read().rpartition(b")")[2].split()[0]
            if state in (b"Z", b"X"):
                continue
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle in fh.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def wait_gone(marker: str, timeout: float) -> list[int]:
    """Wait until no process holds ``marker``; returns those still there after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = processes_with(marker)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def tree_hashes(*paths: Path) -> dict[str, str]:
    """sha256 of every file under ``paths`` (files or folders), by path."""
    out = {}
    for root in paths:
        for path in sorted([root] if root.is_file() else root.rglob("*")):
            if path.is_file() and not path.is_symlink():
                out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def snapshot(path: Path) -> Any:
    """What is at ``path``: None, the bytes of a file, or {name: snapshot} of a folder (hidden names too)."""
    if path.is_symlink() or not path.exists():
        return None if not path.is_symlink() else ("link", os.readlink(path))
    if path.is_file():
        return path.read_bytes()
    return {child.name: snapshot(child) for child in sorted(path.iterdir())}


def hidden_entries(folder: Path) -> list[str]:
    """Names starting with a dot anywhere under ``folder`` (temp files, staging folders)."""
    if not folder.is_dir():
        return []
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".*"))
