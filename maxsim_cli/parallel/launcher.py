"""``--devices cpu:N``: the launcher starts one worker process per device on this machine (the worker
program is `maxsim_cli.parallel.worker`), joined through a TCP store it holds, waits for them all and
turns rank 0's report into the job's stats or error. The job's folder in the temporary directory holds
the request, rank 0's report and a lock file that the launcher and its workers keep locked while any of
them runs, so that a job starting removes the folders of dead jobs (`remove_stale_job_folders`)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from maxsim_cli import lifeline
from maxsim_cli.errors import MaxsimError
from maxsim_cli.lifeline import ENV_LAUNCHER_PID
from maxsim_cli.parallel.environment import (
    COMMIT_NOTE,
    ENV_DEVICES,
    ENV_STATUS,
    ENV_STORE,
    ERROR_CLASSES,
    JOB_FILES,
    JOB_PREFIX,
    LOCK_NAME,
    PARTIAL_NOTE,
    timeout_seconds,
)
from maxsim_cli.parallel.work import check_no_stdin
from maxsim_cli.scoring.request import ScoreRequest
from maxsim_cli.scoring.stats import ScoreStats
from maxsim_cli.shards.files import staging_dir

try:
    import fcntl
except ImportError:  # Windows: no job locks, and no stale job folders found
    fcntl = None  # type: ignore[assignment]

# The worker program: run as a module of its own, so that nothing else loads it twice.
WORKER_MODULE = "maxsim_cli.parallel.worker"
# A job folder without a lock file is one being made (for microseconds), or a job's of a maxsim from
# before the locks, which may still run: removed only once it has not changed for a day.
STALE_UNLOCKED_S = 24 * 3600.0
# Launcher: once a worker has exited with an error, the others normally follow within a second (they
# leave the status exchange together); one still running after this long is stuck and is stopped.
FAILED_PEER_GRACE_S = 30.0
# Launcher: seconds between SIGTERM and SIGKILL when stopping workers.
TERMINATE_GRACE_S = 10.0


def worker_options(request: ScoreRequest) -> dict[str, Any]:
    """The request as the workers read it (JSON), without the launcher's own ``devices``."""
    out = dataclasses.asdict(dataclasses.replace(request, devices=None))
    out["corpus"] = list(request.corpus)
    return out


def launch(request: ScoreRequest, devices: Sequence[str]) -> ScoreStats:
    """Start one worker process per device on this machine, wait for all, return rank 0's job stats.

    Raises the job's error (rank 0's report) with its exit code; if a worker dies without reporting,
    the others are stopped and the error names it. No run is written unless every worker succeeded.
    """
    import torch.distributed as dist

    check_no_stdin(request)
    world = len(devices)
    timeout = timeout_seconds()
    cpu_workers = sum(1 for d in devices if d == "cpu")
    temp_root = tempfile.gettempdir()
    remove_stale_job_folders(temp_root)  # what launchers killed by SIGKILL left there
    # Made by one mkdir that a signal cannot separate from the cleanup below (TemporaryDirectory could
    # leave it behind when stopped right after making it).
    job_dir = staging_dir(temp_root, JOB_PREFIX)
    lock = -1
    try:
        lock = lock_job(job_dir)
        os.chmod(job_dir, 0o700)  # the job's options name the user's files
        options_path = os.path.join(job_dir, "options.json")
        status_path = os.path.join(job_dir, "status.json")
        with open(options_path, "w", encoding="utf-8") as fh:
            json.dump(worker_options(request), fh)
        # The store lives here, bound to a port the system picks: no port to guess or collide on.
        store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout))
        base = dict(os.environ)
        base.update(
            {
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port),
                ENV_STORE: f"127.0.0.1:{store.port}",
                ENV_DEVICES: ",".join(devices),
                ENV_STATUS: status_path,
                ENV_LAUNCHER_PID: str(os.getpid()),
            }
        )
        if cpu_workers:
            # CPU workers share the cores instead of each starting a thread per core
            base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cpu_workers)))
        procs: list[subprocess.Popen] = []
        started = time.perf_counter()
        lifeline.share_commit(os.path.join(job_dir, COMMIT_NOTE))  # a signal once it exists is ignored
        worker_fds = (lock,) if lock >= 0 else ()  # the workers hold the job's lock too
        try:
            for r in range(world):
                env = dict(base, RANK=str(r), LOCAL_RANK=str(r))
                argv = [sys.executable, "-m", WORKER_MODULE, options_path]
                procs.append(subprocess.Popen(argv, env=env, pass_fds=worker_fds))
            codes, ended = _wait_all(procs)
        except (SystemExit, KeyboardInterrupt):  # a stop signal: stop the workers, then see what they did
            with lifeline.signals_held():  # a second signal changes nothing: the stop is under way
                _stop(procs)
            if not lifeline.adopt_commit():
                raise
            # rank 0 had put the run in place (its commit point holds the SIGTERM): the job succeeded
            codes, ended = [int(p.returncode) for p in procs], None
        finally:
            _stop(procs)
            del store
        committed = lifeline.adopt_commit()  # before the folder, and the note, are removed
        return job_outcome(codes, devices, status_path, request.output, started, ended, committed=committed)
    finally:
        # the job's files, then its lock: a next job finds the folder gone, or locked, never half-removed
        shutil.rmtree(job_dir, ignore_errors=True)
        lifeline.share_commit(None)
        if lock >= 0:
            os.close(lock)


def lock_job(job_dir: str) -> int:
    """Create the lock file of the job's folder ``job_dir`` and hold an exclusive `flock` on it for the
    job's life; returns its descriptor, which the workers inherit, so that the lock is free only once
    every process of the job has ended, however it ended (SIGKILL included: the kernel lets go of the
    lock of a dead process). -1 where there is no `flock` (Windows) or it failed (no file can be made
    there, a file system without locks): the job runs all the same, its folder kept a day if left."""
    if fcntl is None:
        return -1
    path = os.path.join(job_dir, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new and ours: free
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)  # a lock file no one holds would make the folder look stale
        return -1
    return fd


def remove_stale_job_folders(folder: str) -> list[str]:
    """Remove the job folders (``maxsim-job-*``, this user's) that ``--devices`` jobs whose processes
    have all ended left in ``folder`` - a launcher killed by SIGKILL cannot remove its own. A folder is
    stale when its lock file is free (`lock_job`), or when it has none and is older than
    `STALE_UNLOCKED_S`; only the names a job writes (`JOB_FILES`) are removed, then the folder if that
    emptied it. Returns the folders removed."""
    if fcntl is None:
        return []
    try:
        names = sorted(n for n in os.listdir(folder) if n.startswith(JOB_PREFIX))
    except OSError:
        return []
    return [path for path in (os.path.join(folder, n) for n in names) if _remove_if_stale(path)]


def _remove_if_stale(path: str) -> bool:
    assert fcntl is not None
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return False
    fd = -1
    try:
        try:
            fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            if time.time() - st.st_mtime < STALE_UNLOCKED_S:
                return False  # a job's folder being made, or an older maxsim's job
        else:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # a process of that job is still running
        for name in JOB_FILES:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(path, name))
        os.rmdir(path)
        return True
    except OSError:
        return False
    finally:
        if fd >= 0:
            os.close(fd)


def _wait_all(procs: Sequence[subprocess.Popen]) -> tuple[list[int], list[int]]:
    """Exit codes of all workers, and their ranks in the order they ended. A worker killed by a signal
    means the others can never finish: they are stopped at once; one that exits with an error gives the
    others `FAILED_PEER_GRACE_S` to follow.

    A thread per worker waits for it, so that the order is the order of the deaths: a worker killed
    from outside brings its peers down within milliseconds (gloo aborts on a closed connection), and
    polling all of them now and then can find both dead and name the wrong one."""
    ended: list[int] = []
    changed = threading.Event()
    lock = threading.Lock()

    def watch(rank: int, proc: subprocess.Popen) -> None:
        proc.wait()
        with lock:
            ended.append(rank)
        changed.set()

    for rank, proc in enumerate(procs):
        threading.Thread(target=watch, args=(rank, proc), name=f"maxsim-watch-{rank}", daemon=True).start()
    failed_at: float | None = None
    while True:
        changed.wait(0.05)
        changed.clear()
        with lock:
            done = list(ended)
        codes = [procs[r].returncode for r in done]
        if len(done) == len(procs):
            by_rank = {r: int(c) for r, c in zip(done, codes, strict=True)}
            return [by_rank[r] for r in range(len(procs))], done
        if any(c < 0 for c in codes):
            _stop(procs)
            continue
        if any(c != 0 for c in codes):
            failed_at = failed_at or time.monotonic()
            if time.monotonic() - failed_at > FAILED_PEER_GRACE_S:
                _stop(procs)
                continue


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM to every worker still running, SIGKILL to those still there after `TERMINATE_GRACE_S`."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for p in running:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def job_outcome(
    codes: Sequence[int],
    devices: Sequence[str],
    status_path: str,
    output: str,
    started: float,
    ended: Sequence[int] | None = None,
    *,
    committed: bool = False,
) -> ScoreStats:
    """The job's stats from rank 0's report, or its error: a worker killed by a signal (the first to
    end, in `ended` order, when several were), rank 0's report of an error, or a worker that exited
    without one. ``committed``: rank 0 put the run in place, and its report is the job's outcome
    whatever happened to the workers after."""
    status = None
    if os.path.exists(status_path):
        with open(status_path, encoding="utf-8") as fh:
            status = json.load(fh)
    if committed and status is not None and "stats" in status:
        return ScoreStats(**status["stats"])
    world = len(devices)
    order = list(ended) if ended is not None else list(range(len(codes)))
    killed = [(r, -codes[r]) for r in order if codes[r] < 0 and codes[r] != -signal.SIGTERM]
    if killed:
        r, signum = killed[0]
        _remove_partial_output(status_path, output, started)
        raise MaxsimError(
            f"worker rank {r} of {world} ({devices[r]}) was killed by {_signal_name(signum)}; the job "
            "stopped and no run was written (out of host memory? see the system log)"
        )
    if status is not None and status.get("broken_pipe"):
        raise BrokenPipeError("the run's reader closed standard output")
    if status is not None and "error" in status:
        raise ERROR_CLASSES.get(int(status["exit_code"]), MaxsimError)(str(status["error"]))
    bad = [(r, c) for r, c in enumerate(codes) if c != 0]
    if bad or status is None:
        r, c = bad[0] if bad else (0, codes[0])
        _remove_partial_output(status_path, output, started)
        raise MaxsimError(
            f"worker rank {r} of {world} ({devices[r]}) exited with code {c} without a report; its "
            "messages are above; no run was written"
        )
    fields = status["stats"]
    return ScoreStats(**fields)


def _remove_partial_output(status_path: str, output: str, started: float) -> None:
    """Remove the temporary file that a rank 0 killed while writing left behind, and nothing else: the
    file named by its note (`PARTIAL_NOTE`), if it is a regular file (not a link) in the folder the run
    goes to, named as `OutputFile` names its temp files for that run, and made during this job."""
    note = os.path.join(os.path.dirname(status_path), PARTIAL_NOTE)
    try:
        with open(note, encoding="utf-8") as fh:
            tmp = fh.read().strip()
    except OSError:
        return
    if output == "-" or not tmp:
        return
    target = os.path.realpath(output)  # `OutputFile` writes beside the file a symlink names
    name = os.path.basename(tmp)
    if os.path.realpath(os.path.dirname(tmp)) != os.path.dirname(target):
        return
    if not (name.startswith(f".{os.path.basename(target)}.") and name.endswith(".tmp")):
        return
    try:
        st = os.lstat(tmp)
        if stat.S_ISREG(st.st_mode) and st.st_mtime >= started - 1:
            os.unlink(tmp)
    except OSError:
        pass


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
