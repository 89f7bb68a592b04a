"""Seeded fault injection: signals at random instants, full disks, read-only folders and outputs that
alias inputs, against `maxsim score` (in one process and under ``--devices cpu:2``), `pack`,
`quantize`, `merge` and `verify`, each a real process (`faultlib.ForkServer`).

Each signal trial draws a signal (SIGTERM, SIGINT, SIGHUP or SIGKILL) and an instant uniformly over 1.2
times the command's measured clean run (so some land after it ended), with or without a previous output
in place; targeted trials send SIGTERM, SIGINT or SIGHUP as soon as the new output is seen at its name,
or the summary line on stderr, and must all end with exit 0. After every trial:

- the inputs are unchanged (sha256 of every file);
- nothing is left anywhere: not beside the output, not inside an output folder, not in the trial's
  working folder, not in its ``TMPDIR`` (where a ``--devices`` job keeps its folder), and no worker of a
  ``--devices`` job is still running;
- the output is absent (or the previous output is there, untouched) or complete and byte-identical to a
  clean run (`verify`, which prints its report: stdout empty or the whole report, timings aside);
- the exit code tells the truth both ways: 0 only with the complete output; 128 + N (with ``maxsim:
  stopped by SIGNAME`` as the last line) or -N (the default action: the signal came before maxsim set
  its handlers) only with the previous output as it was, or none; -9 for SIGKILL; never a traceback
  nor a temp path in a message.

**SIGKILL** cannot be caught, so the promise is narrower and checked exactly: the output's final name
is still absent, the previous output or the complete output (writes go to a temp file that is renamed
into place); hidden temp files (``.NAME.XXXX.tmp``) and staging folders (``.maxsim-...``) beside or
inside the output may remain, as may a ``--devices`` job's ``maxsim-job-...`` folder in ``TMPDIR``. Those
are counted, not failed, but a job folder left must be one that the next job removes
(`maxsim_cli.parallel.launcher.remove_stale_job_folders`, run on it once the trial's processes have
ended). The
workers of a killed launcher must still end (within seconds) and never write the run.

The totals are printed at the end of the module (``python -m pytest -q tests/test_fault_injection.py``)
and must show no leftover and no corrupt output. ``MAXSIM_FAULT_SEED`` changes the seed (default 26).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from faultlib import ForkServer, hidden_entries, snapshot, tree_hashes, wait_gone

from maxsim_cli.parallel.launcher import remove_stale_job_folders
from maxsim_cli.shards import write_manifest, write_shard

SEED = int(os.environ.get("MAXSIM_FAULT_SEED", "26"))
SIGNAL_TRIALS = 20
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL)
# Trials of a command run this many at a time (the machine's 2 cores stay busy while one waits).
PARALLEL = 3
DIM = 16

# --------------------------------------------------------------------------------------------------
# inputs and commands


def _docs(rng: np.random.Generator, n: int, lo: int, hi: int) -> list[np.ndarray]:
    return [rng.standard_normal((int(rng.integers(lo, hi)), DIM)).astype(np.float32) for _ in range(n)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("inputs")
    rng = np.random.default_rng(SEED)
    write_shard(root / "queries.safetensors", [f"q{i}" for i in range(8)], _docs(rng, 8, 3, 6))
    corpus = root / "corpus"
    corpus.mkdir()
    for name in "abcd":
        write_shard(corpus / f"{name}.safetensors", [f"{name}{i}" for i in range(200)], _docs(rng, 200, 3, 9))
    write_manifest(corpus)
    lines = [f"q{i} Q0 a{j} {j + 1} {10.0 - j / 10:.2f} bm25\n" for i in range(8) for j in range(150)]
    (root / "candidates.trec").write_text("".join(lines))
    (root / "npy").mkdir()
    for i, doc in enumerate(_docs(rng, 40, 3, 9)):
        np.save(root / "npy" / f"d{i}.npy", doc)
    (root / "links").mkdir()
    (root / "links" / "sym").symlink_to(root / "queries.safetensors")
    os.link(root / "candidates.trec", root / "links" / "hard")
    return root


@dataclasses.dataclass(frozen=True)
class Command:
    name: str
    args: Any  # (inputs, output path) -> argv
    output: str  # the output's name in the trial's out/ folder ("" for stdout)
    folder: bool = False  # the output is a folder (pack, quantize)
    workers: bool = False  # --devices cpu:2
    summary: str = ""  # how its summary line on stderr begins (without -q)


COMMANDS = {
    c.name: c
    for c in [
        Command(
            "score",
            lambda i, o: ["score", f"{i}/queries.safetensors", f"{i}/corpus", "-k", "50", "--device", "cpu",
                          "-q", "-o", o],
            "run.trec",
            summary="maxsim: scored ",
        ),
        Command(
            "score --devices cpu:2",
            lambda i, o: ["score", f"{i}/queries.safetensors", f"{i}/corpus", "-k", "50", "--devices",
                          "cpu:2", "-q", "-o", o],
            "run.trec",
            workers=True,
            summary="maxsim: scored ",
        ),
        Command("pack", lambda i, o: ["pack", f"{i}/npy", "-q", "-o", o, "--shard-tokens", "40"], "packed",
                True, summary="packed "),
        Command(
            "quantize",
            lambda i, o: ["quantize", f"{i}/corpus", "--sample-queries", "0", "--device", "cpu", "-o", o],
            "int8",
            True,
            summary="quantized ",
        ),
        Command("merge", lambda i, o: ["merge", f"{i}/candidates.trec", "-k", "100", "-q", "-o", o],
                "run.trec", summary="merged "),
        Command(
            "verify",
            lambda i, o: ["verify", f"{i}/queries.safetensors", f"{i}/corpus", "--device", "cpu", "--json"],
            "",
        ),
    ]
}  # fmt: skip


@pytest.fixture(scope="module")
def server() -> Any:
    forks = ForkServer()
    yield forks
    forks.close()


# --------------------------------------------------------------------------------------------------
# one trial


@dataclasses.dataclass
class Trial:
    command: str
    fault: str  # SIGTERM, ..., "disk full", "read-only", "alias"
    delay: float = 0.0
    code: int | None = None
    outcome: str = ""  # absent, previous, complete, corrupt
    leftovers: list[str] = dataclasses.field(default_factory=list)
    sigkill_temps: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    stderr: str = ""


TRIALS: list[Trial] = []
_counter = iter(range(1 << 30))


def _verify_report(data: bytes) -> Any:
    report = json.loads(data)
    report.get("details", {}).pop("timings_s", None)
    return report


class Reference:
    """A clean run of a command: what it writes, and how long it takes as a forked process."""

    def __init__(self, server: ForkServer, inputs: Path, base: Path, command: Command) -> None:
        trial = base / f"reference-{command.name.replace(' ', '_').replace(':', '')}"
        (trial / "out").mkdir(parents=True)
        (trial / "tmp").mkdir()
        out = trial / "out" / command.output if command.output else trial / "out"
        started = time.monotonic()
        pid = server.spawn(
            command.args(inputs, str(out)),
            trial,
            trial / "stdout",
            trial / "stderr",
            {"TMPDIR": str(trial / "tmp")},
        )
        code = server.wait(pid, 120)
        self.seconds = time.monotonic() - started
        assert code == 0, (command.name, (trial / "stderr").read_text())
        self.stdout = (trial / "stdout").read_bytes()
        self.output = snapshot(out) if command.output else _verify_report(self.stdout)
        self.size = max(
            (p.stat().st_size for p in ([out] if out.is_file() else out.rglob("*")) if p.is_file()), default=0
        )


@pytest.fixture(scope="module")
def references(
    server: ForkServer, inputs: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Reference]:
    base = tmp_path_factory.mktemp("references")
    return {name: Reference(server, inputs, base, command) for name, command in COMMANDS.items()}


def _without_hidden(snap: Any) -> Any:
    if isinstance(snap, dict):
        return {k: _without_hidden(v) for k, v in snap.items() if not k.startswith(".")}
    return snap


_SIGKILL_TEMP = re.compile(r"(^|/)\.([^/]+\.[^/]*\.tmp|maxsim-[^/]*)(/.*)?$")


def run_trial(
    server: ForkServer,
    inputs: Path,
    base: Path,
    command: Command,
    reference: Reference,
    trial: Trial,
    *,
    previous: bool,
    setup: Any = None,
    fsize: int | None = None,
    fill: int | None = None,
    argv: list[str] | None = None,
    moment: str | None = None,
    summary: bool = False,
) -> Trial:
    """Start the command, inject ``trial.fault`` (a signal after ``trial.delay``, or at ``moment``: see
    `MOMENTS`; other faults are set up by ``setup(out_folder)`` beforehand), wait for it and every
    worker to end, then check what is left. ``summary``: without ``-q``, the summary line printed."""
    before = tree_hashes(inputs)
    number = next(_counter)
    folder = base / f"trial-{number}"
    out_folder = folder / "out"
    (folder / "tmp").mkdir(parents=True)
    if setup is None:
        out_folder.mkdir()
    else:
        setup(out_folder)  # mounts, fills, links: the folder exists after this
    out = out_folder / command.output if command.output else None
    kept = None
    if previous and out is not None:
        if command.folder:
            out.mkdir()  # pack and quantize fill an empty folder
        else:
            out.write_bytes(b"previous output, to be kept\n")
        kept = snapshot(out)
    if fill is not None:
        _fill(out_folder, fill)
    if trial.fault == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", str(out_folder)], check=True)
    marker = f"MAXSIM_FAULT_TRIAL={number}"
    env = {"TMPDIR": str(folder / "tmp"), "MAXSIM_FAULT_TRIAL": str(number)}
    args = argv or command.args(inputs, str(out) if out is not None else "")
    if summary:
        args = [a for a in args if a != "-q"]
    pid = server.spawn(args, folder, folder / "stdout", folder / "stderr", env, fsize)
    signum = getattr(signal, trial.fault, None) if trial.fault.startswith("SIG") else None
    if signum is not None:
        if moment is None:
            time.sleep(trial.delay)
        else:
            trial.delay = _wait_for(MOMENTS[moment](folder, out, command), pid)
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    try:
        _finish(server, pid, folder, inputs, before, command, reference, trial, out, kept, signum, marker)
    finally:
        if trial.fault in ("disk full", "read-only"):
            subprocess.run(["umount", "-l", str(out_folder)], check=False)
    shutil.rmtree(folder, ignore_errors=True)
    TRIALS.append(trial)
    return trial


def _output_in_place(folder: Path, out: Path, command: Command) -> Any:
    """The moment the new output is at its name: a new file there, or the folder's manifest."""
    if command.folder:
        return lambda: (out / "index.json").exists()
    previous = out.stat().st_ino if out.exists() else None

    def renamed() -> bool:
        try:
            return out.stat().st_ino != previous
        except FileNotFoundError:
            return False

    return renamed


def _summary_printed(folder: Path, out: Path, command: Command) -> Any:
    """The moment the command's summary line is on stderr."""
    marker = command.summary.encode()

    def printed() -> bool:
        try:
            return marker in (folder / "stderr").read_bytes()
        except FileNotFoundError:  # the child has not made it yet
            return False

    return printed


# Instants to send a signal at, found by watching from outside as a user's script would: as soon as it
# is seen (within a millisecond or so).
MOMENTS = {"output in place": _output_in_place, "summary printed": _summary_printed}


def _wait_for(seen: Any, pid: int, timeout: float = 60.0) -> float:
    """Poll ``seen()`` until true (or the process is gone); returns the seconds waited."""
    started = time.monotonic()
    while not seen() and time.monotonic() - started < timeout:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.0005)
    return time.monotonic() - started


def _finish(server, pid, folder, inputs, before, command, reference, trial, out, kept, signum, marker):  # noqa: ANN001, ANN201
    """Wait for the command and its workers, then `_check` what is left."""
    trial.code = server.wait(pid, 120)
    if trial.code is None:
        trial.problems.append("still running after 120 s")
        os.kill(pid, signal.SIGKILL)
        server.wait(pid, 10)
    orphans = wait_gone(marker, 30)
    if orphans:  # a worker outlived its launcher
        trial.leftovers.append(f"running workers {orphans}")
        for orphan in orphans:
            os.kill(orphan, signal.SIGKILL)
    time.sleep(0.05 if not command.workers else 0.3)  # a late write would show now
    _check(inputs, before, folder, command, reference, trial, out, kept, signum)


def _check(
    inputs: Path,
    before: dict[str, str],
    folder: Path,
    command: Command,
    reference: Reference,
    trial: Trial,
    out: Path | None,
    kept: Any,
    signum: int | None,
) -> None:
    problems = trial.problems
    stderr = (folder / "stderr").read_text(errors="replace") if (folder / "stderr").exists() else ""
    trial.stderr = stderr
    if tree_hashes(inputs) != before:
        problems.append("an input changed")
    # what is left: beside and inside the output, in the working folder, in TMPDIR
    if trial.fault == "disk full":
        (folder / "out" / "filler").unlink(missing_ok=True)
    expected = {"out", "tmp", "stdout", "stderr"}
    trial.leftovers += [f"{folder.name}/{n}" for n in sorted(set(os.listdir(folder)) - expected)]
    names = set(os.listdir(folder / "out")) - ({command.output} if command.output else set())
    for name in sorted(names):
        (
            trial.sigkill_temps if name.startswith(".") and signum == signal.SIGKILL else trial.leftovers
        ).append(f"out/{name}")
    if out is not None and out.is_dir() and not out.is_symlink():
        for name in hidden_entries(out):
            (trial.sigkill_temps if signum == signal.SIGKILL else trial.leftovers).append(
                f"out/{out.name}/{name}"
            )
    for name in sorted(os.listdir(folder / "tmp")):
        allowed = signum == signal.SIGKILL and name.startswith("maxsim-job-")
        (trial.sigkill_temps if allowed else trial.leftovers).append(f"tmp/{name}")
    if any(name.startswith("tmp/maxsim-job-") for name in trial.sigkill_temps):
        # a killed launcher's job folder: the next job removes it (all its processes have ended)
        remove_stale_job_folders(str(folder / "tmp"))
        trial.leftovers += [
            f"tmp/{name} (not removed by the next job)" for name in os.listdir(folder / "tmp")
        ]
    trial.leftovers = [
        x for x in trial.leftovers if not (signum == signal.SIGKILL and _SIGKILL_TEMP.search(x))
    ]
    # the output
    if out is None:  # verify: the report on stdout, whole or not at all
        stdout = folder / "stdout"  # not made when the signal ended the child in its set-up
        data = stdout.read_bytes() if stdout.exists() else b""
        if not data:
            trial.outcome = "absent"
        else:
            try:
                trial.outcome = "complete" if _verify_report(data) == reference.output else "corrupt"
            except ValueError:
                trial.outcome = "corrupt"
    else:
        now = _without_hidden(snapshot(out))
        if now == _without_hidden(reference.output):
            trial.outcome = "complete"
        elif kept is not None and now == _without_hidden(kept):
            trial.outcome = "previous"
        elif kept is None and now is None:
            trial.outcome = "absent"
        else:
            trial.outcome = "corrupt"
    if trial.outcome == "corrupt":
        problems.append("corrupt output")
    # the exit code and the message
    code = trial.code
    if "Traceback" in stderr:
        problems.append(f"a traceback: {stderr[-600:]}")
    for temp in (".tmp", "maxsim-job-", ".maxsim-", str(folder / "tmp")):
        if temp in stderr:
            problems.append(f"a temp path in a message: {stderr.strip()[-300:]}")
    if signum is not None:
        allowed = {-signal.SIGKILL} if signum == signal.SIGKILL else {128 + signum, -signum}
        if code == 0:
            if trial.outcome != "complete":
                problems.append("exit 0 without the complete output")
        elif code not in allowed:
            problems.append(f"exit code {code} for {trial.fault}: {stderr.strip()[-300:]}")
        elif signum != signal.SIGKILL and trial.outcome not in ("previous", "absent"):
            # stopped (128 + N; -N: before maxsim's handlers were set) means nothing was written
            problems.append(f"exit {code} but the output is {trial.outcome}")
        elif code == 128 + signum and stderr.strip().splitlines()[-1:] != [
            f"maxsim: stopped by {trial.fault}"
        ]:
            problems.append(
                f"the last line is not 'maxsim: stopped by {trial.fault}': {stderr.strip()[-300:]}"
            )
    else:
        want = {"alias": 2}.get(trial.fault, 1)
        lines = stderr.strip().splitlines()
        if code == 0 and trial.fault == "disk full":  # there was room enough after all
            if trial.outcome != "complete":
                problems.append("exit 0 without the complete output")
        elif code != want:
            problems.append(f"exit code {code} for {trial.fault}, not {want}: {stderr.strip()[-300:]}")
        elif not lines or not lines[-1].startswith("maxsim: error: ") or str(out) not in lines[-1]:
            problems.append(f"not one line naming the output: {stderr.strip()[-300:]}")
        if code != 0 and trial.outcome == "complete":
            problems.append(f"exit {code} but the output was written")


def _report(trials: list[Trial]) -> str:
    bad = [t for t in trials if t.problems or t.leftovers]
    return "\n".join(
        f"{t.command} / {t.fault} at {t.delay:.3f}s: exit {t.code}, {t.outcome}, leftovers {t.leftovers}, "
        f"{t.problems}"
        for t in bad[:10]
    ) + (f"\nfirst one's stderr:\n{bad[0].stderr[-4000:]}" if bad else "")


def _run_all(jobs: list[Any]) -> list[Trial]:
    with ThreadPoolExecutor(PARALLEL) as pool:
        return list(pool.map(lambda job: job(), jobs))


# --------------------------------------------------------------------------------------------------
# the totals, printed at the end of the module


@pytest.fixture(scope="module", autouse=True)
def totals(request: pytest.FixtureRequest) -> Any:
    yield
    if not TRIALS:
        return
    by_fault = Counter(t.fault for t in TRIALS)
    outcomes = Counter(t.outcome for t in TRIALS)
    leftovers = sum(len(t.leftovers) for t in TRIALS)
    corrupt = outcomes.get("corrupt", 0)
    killed_temps = sum(len(t.sigkill_temps) for t in TRIALS)
    problems = sum(len(t.problems) for t in TRIALS)
    lines = [
        "",
        f"fault injection (seed {SEED}): {len(TRIALS)} trials, {leftovers} leftovers, {corrupt} corrupt "
        f"outputs, {problems} other problems",
        "  by command: "
        + ", ".join(f"{k} {v}" for k, v in sorted(Counter(t.command for t in TRIALS).items())),
        "  by fault: " + ", ".join(f"{k} {v}" for k, v in sorted(by_fault.items())),
        "  outputs: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())),
        f"  hidden temp files left by SIGKILL (allowed): {killed_temps} in "
        f"{sum(1 for t in TRIALS if t.sigkill_temps)} of {by_fault.get('SIGKILL', 0)} SIGKILL trials",
    ]
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        for line in lines:
            if reporter is not None:
                reporter.write_line(line)
            else:
                print(line)
    assert leftovers == 0 and corrupt == 0


# --------------------------------------------------------------------------------------------------
# signals at random instants


@pytest.mark.parametrize("name", list(COMMANDS))
def test_signals_at_random_instants(server, inputs, references, tmp_path: Path, name: str) -> None:
    command, reference = COMMANDS[name], references[name]
    rng = np.random.default_rng([SEED, list(COMMANDS).index(name)])
    signals = [SIGNALS[i % len(SIGNALS)] for i in range(SIGNAL_TRIALS)]
    rng.shuffle(signals)
    jobs = []
    for i, signum in enumerate(signals):
        trial = Trial(name, signum.name, delay=float(rng.uniform(0, 1.2 * reference.seconds)))
        jobs.append(
            lambda trial=trial, i=i: run_trial(
                server, inputs, tmp_path, command, reference, trial, previous=i % 2 == 0
            )
        )
    trials = _run_all(jobs)
    assert not any(t.problems or t.leftovers for t in trials), _report(trials)
    assert len(trials) >= 20


# --------------------------------------------------------------------------------------------------
# signals just after the output is in place: the command's result is its own


TARGETED = ["merge", "score", "pack", "quantize", "score --devices cpu:2"]


@pytest.mark.parametrize("name", TARGETED)
def test_a_signal_just_after_the_output_is_in_place(server, inputs, references, tmp_path: Path, name) -> None:
    """SIGTERM, SIGINT and SIGHUP sent as soon as the new output is seen at its name, and as soon as the
    summary line is seen on stderr (the process is ending): the output is complete, so the exit code is
    the command's own, 0, with no ``stopped by`` line - not 128 + N, nor a death by the signal."""
    command, reference = COMMANDS[name], references[name]
    signals = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]
    cases = [(moment, signals[(i + j) % 3]) for i, moment in enumerate(MOMENTS) for j in range(3)]
    if command.workers:  # each trial starts two workers: two cases
        cases = [("output in place", signal.SIGTERM), ("summary printed", signal.SIGINT)]
    jobs = [
        lambda i=i, moment=moment, signum=signum: run_trial(
            server, inputs, tmp_path, command, reference, Trial(name, signum.name), previous=i % 2 == 0,
            moment=moment, summary=True,
        )
        for i, (moment, signum) in enumerate(cases)
    ]  # fmt: skip
    trials = _run_all(jobs)
    assert not any(t.problems or t.leftovers for t in trials), _report(trials)
    wrong = [
        f"{t.fault} after {t.delay:.3f} s: exit {t.code}, {t.outcome}: {t.stderr.strip()[-300:]}"
        for t in trials
        if t.code != 0 or t.outcome != "complete" or "stopped by" in t.stderr
    ]
    assert not wrong, "\n".join(wrong)


# --------------------------------------------------------------------------------------------------
# a full disk, a read-only folder, an output that is an input


def _mount(folder: Path, size: str) -> bool:
    folder.mkdir()
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True
        )
    except OSError:
        return False
    return proc.returncode == 0


@pytest.fixture(scope="module")
def can_mount(tmp_path_factory: pytest.TempPathFactory) -> bool:
    probe = tmp_path_factory.mktemp("mount") / "probe"
    if not _mount(probe, "64k"):
        return False
    subprocess.run(["umount", "-l", str(probe)], check=False)
    return True


def _fill(folder: Path, free: int) -> None:
    """Fill a tmpfs until ``free`` bytes (in whole pages) are left."""
    stats = os.statvfs(folder)
    room = stats.f_bavail * stats.f_frsize - free
    with open(folder / "filler", "wb", buffering=0) as fh:
        try:
            fh.write(b"\0" * max(0, room))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


FAULT_COMMANDS = ["score", "pack", "quantize", "merge"]


@pytest.mark.parametrize("name", FAULT_COMMANDS)
def test_a_full_disk_at_a_random_byte(
    server, inputs, references, tmp_path: Path, can_mount: bool, name: str
) -> None:
    """The output folder is a tmpfs with a random number of bytes free (or, where no tmpfs can be mounted,
    RLIMIT_FSIZE stops files at a random size): exit 1 and one line naming the output, or exit 0 and the
    complete output when it fitted; the previous output kept, nothing left."""
    command, reference = COMMANDS[name], references[name]
    rng = np.random.default_rng([SEED, 100 + FAULT_COMMANDS.index(name)])
    jobs = []
    for i in range(3 if command.workers else 5):
        free = int(rng.integers(0, int(reference.size * 1.3) + 1))
        limit = max(1, free)
        trial = Trial(name, "disk full")
        if can_mount:
            jobs.append(
                lambda t=trial, f=free, i=i: run_trial(
                    server, inputs, tmp_path, command, reference, t, previous=i % 2 == 0,
                    setup=lambda folder: _mount(folder, "512k"), fill=f,
                )
            )  # fmt: skip
        else:
            jobs.append(
                lambda t=trial, f=limit, i=i: run_trial(
                    server, inputs, tmp_path, command, reference, t, previous=i % 2 == 0, fsize=f
                )
            )
    trials = _run_all(jobs)
    assert not any(t.problems or t.leftovers for t in trials), _report(trials)


@pytest.mark.parametrize("name", ["score", "pack", "quantize", "merge"])
def test_a_read_only_file_system(
    server, inputs, references, tmp_path: Path, can_mount: bool, name: str
) -> None:
    if not can_mount:
        pytest.skip("cannot mount a tmpfs here")
    command, reference = COMMANDS[name], references[name]
    trials = _run_all(
        [
            lambda i=i: run_trial(
                server, inputs, tmp_path, command, reference, Trial(name, "read-only"), previous=i == 0,
                setup=lambda folder: _mount(folder, "512k"),
            )
            for i in range(2)
        ]
    )  # fmt: skip
    assert not any(t.problems or t.leftovers for t in trials), _report(trials)


def _aliases(inputs: Path) -> list[tuple[str, list[str]]]:
    i = inputs
    score = COMMANDS["score"].args
    return [
        ("score", score(i, f"{i}/queries.safetensors")),
        ("score", score(i, f"{i}/links/sym")),
        ("score", score(i, f"{i}/corpus/b.safetensors")),
        ("score", score(i, f"{i}/corpus/index.json")),
        ("score", [*score(i, f"{i}/links/hard"), "--candidates", f"{i}/candidates.trec"]),
        ("score --devices cpu:2", COMMANDS["score --devices cpu:2"].args(i, f"{i}/links/sym")),
        ("merge", COMMANDS["merge"].args(i, f"{i}/candidates.trec")),
        ("merge", COMMANDS["merge"].args(i, f"{i}/links/hard")),
        ("pack", COMMANDS["pack"].args(i, f"{i}/npy")),
        ("pack", COMMANDS["pack"].args(i, f"{i}/npy/packed")),
        ("quantize", COMMANDS["quantize"].args(i, f"{i}/corpus")),
        ("quantize", COMMANDS["quantize"].args(i, f"{i}/corpus/int8")),
    ]


def test_outputs_that_alias_inputs(server, inputs, references, tmp_path: Path) -> None:
    """Every way an output can name an input: exit 2 before any work, one line, the inputs unchanged."""
    jobs = []
    for name, argv in _aliases(inputs):
        trial = Trial(name, "alias")
        jobs.append(
            lambda t=trial, n=name, a=argv: run_trial(
                server, inputs, tmp_path, COMMANDS[n], references[n], t, previous=False, argv=a
            )
        )
    trials = _run_all(jobs)
    for trial in trials:  # the line names the input, not the trial's own output folder
        trial.problems = [p for p in trial.problems if not p.startswith("not one line naming the output")]
    assert not any(t.problems or t.leftovers for t in trials), _report(trials)
    assert all(t.code == 2 for t in trials)
