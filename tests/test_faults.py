"""Fault injection: every command that writes, against every way its output can go wrong (issue 26).

Each case drives the real CLI - `typer.testing.CliRunner` in this process, or ``python -m maxsim_cli``
in a subprocess where a signal or stdout itself is the fault - and checks what the user would see: the
exit code, one line on stderr naming the path (no traceback), no temp file or staging folder left
behind, the previous output byte for byte, and the inputs unchanged (hashed before and after).

Faults: the output is an input (same path, symlink, hard link, a file of an input folder, the input
folder or a folder inside it); a FIFO or a character device (written through, the node kept); an
existing directory where a file goes (or a file where a folder goes); a missing parent folder; a folder
without write permission (tests run as root, where permission bits do not stop writes: EACCES is
injected where files get created) or on a read-only file system (a tmpfs remounted read-only); a full
disk (a tmpfs filled up) or a quota hit half-way through a file (injected); a full disk behind stdout
(``/dev/full``); SIGTERM / SIGHUP (and SIGINT, for comparison) half-way through writing, just before
the commit point (the rename that puts the output in place) and the instant it is made; the end of the
process once the command has ended.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import io
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
from faultlib import hidden_entries, snapshot
from typer.testing import CliRunner

from maxsim_cli.cli import app
from maxsim_cli.shards import files as output_files
from maxsim_cli.shards import write_manifest, write_shard
from maxsim_cli.shards.files import OutputFile, OutputWriteError

runner = CliRunner()
DIM = 16
PREVIOUS = b"previous output, to be kept\n"


# --------------------------------------------------------------------------------------------------
# inputs


def _docs(rng: np.random.Generator, n: int, lo: int, hi: int) -> list[np.ndarray]:
    return [rng.standard_normal((int(rng.integers(lo, hi)), DIM)).astype(np.float32) for _ in range(n)]


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """Queries, a corpus folder of two shards with its manifest, a first-stage run, and a folder of .npy
    documents for `pack`: small, so that the in-process cases take milliseconds once torch is imported."""
    rng = np.random.default_rng(26)
    write_shard(tmp_path / "queries.safetensors", [f"q{i}" for i in range(6)], _docs(rng, 6, 3, 6))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_shard(corpus / "a.safetensors", [f"a{i}" for i in range(150)], _docs(rng, 150, 3, 9))
    write_shard(corpus / "b.safetensors", [f"b{i}" for i in range(150)], _docs(rng, 150, 3, 9))
    write_manifest(corpus)
    lines = [f"q{i} Q0 a{j} {j + 1} {10.0 - j / 10:.2f} bm25\n" for i in range(6) for j in range(20)]
    (tmp_path / "candidates.trec").write_text("".join(lines))
    npy = tmp_path / "npy"
    npy.mkdir()
    for i, doc in enumerate(_docs(rng, 12, 3, 9)):
        np.save(npy / f"d{i}.npy", doc)
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "sym").symlink_to(tmp_path / "queries.safetensors")
    os.link(tmp_path / "candidates.trec", tmp_path / "links" / "hard")
    return tmp_path


def _hashes(root: Path) -> dict[str, str]:
    """sha256 of every input file (the links folder and outputs aside)."""
    out = {}
    for name in ("queries.safetensors", "candidates.trec", "corpus", "npy"):
        for path in sorted([root / name] if (root / name).is_file() else (root / name).rglob("*")):
            if path.is_file():
                out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture
def inputs_kept(work: Path):
    """Fails the test if any input file changed (or appeared, or went away)."""
    before = _hashes(work)
    yield
    assert _hashes(work) == before, "an input changed"


def _score(work: Path, *extra: str) -> list[str]:
    return [
        "score",
        str(work / "queries.safetensors"),
        str(work / "corpus"),
        "-k",
        "50",
        "--device",
        "cpu",
        "-q",
        *extra,
    ]


def _rerank(work: Path, *extra: str) -> list[str]:
    return _score(work, "--candidates", str(work / "candidates.trec"), *extra)


def _merge(work: Path, *extra: str) -> list[str]:
    return ["merge", str(work / "candidates.trec"), "-q", *extra]


def _pack(work: Path, *extra: str) -> list[str]:
    return ["pack", str(work / "npy"), "-q", *extra]


def _quantize(work: Path, *extra: str) -> list[str]:
    return ["quantize", str(work / "corpus"), "--sample-queries", "0", "--device", "cpu", *extra]


# --------------------------------------------------------------------------------------------------
# what every failure must look like


def _one_line_error(result, code: int, *names: object) -> str:
    """The exit code, and stderr one line `maxsim: error: ...` naming every one of ``names``."""
    output = result.stdout + result.stderr
    if result.exc_info is not None and not issubclass(result.exc_info[0], SystemExit):
        output += "".join(traceback.format_exception(*result.exc_info))  # escaped the CLI: show where
    assert "Traceback" not in output, output
    assert result.exit_code == code, output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("maxsim: error: "), result.stderr
    for name in names:
        assert str(name) in lines[0], (name, lines[0])
    return lines[0]


def _no_debris(*folders: Path) -> None:
    """No temp file (``.NAME.XXXX.tmp``), probe or staging folder (``.maxsim-pack-...``) left over."""
    for folder in folders:
        left = [p for p in glob.glob(os.path.join(folder, ".*"))]
        assert not left, f"left behind in {folder}: {left}"


def _run(args: list[str]):
    return runner.invoke(app, args)


# --------------------------------------------------------------------------------------------------
# the output is an input: a usage error before any work, naming both paths


_ALIAS_CASES = {
    # case: work folder -> (args, the output as given, the input it names)
    "score -o QUERIES": lambda w: (_score(w, "-o", str(w / "queries.safetensors")), "queries.safetensors",
                                   "queries.safetensors"),
    "score -o symlink to QUERIES": lambda w: (_score(w, "-o", str(w / "links/sym")), "links/sym",
                                              "queries.safetensors"),
    "score -o a corpus shard": lambda w: (_score(w, "-o", str(w / "corpus/a.safetensors")),
                                          "corpus/a.safetensors", "corpus"),
    "score -o the corpus manifest": lambda w: (_score(w, "-o", str(w / "corpus/index.json")),
                                               "corpus/index.json", "corpus"),
    "score -o --candidates": lambda w: (_rerank(w, "-o", str(w / "candidates.trec")), "candidates.trec",
                                        "candidates.trec"),
    "score -o hard link to --candidates": lambda w: (_rerank(w, "-o", str(w / "links/hard")), "links/hard",
                                                     "candidates.trec"),
    "score --stats-json QUERIES": lambda w: (
        _score(w, "-o", str(w / "r"), "--stats-json", str(w / "queries.safetensors")),
        "queries.safetensors", "queries.safetensors"),
    "merge -o its input": lambda w: (_merge(w, "-o", str(w / "candidates.trec")), "candidates.trec",
                                     "candidates.trec"),
    "merge -o hard link to its input": lambda w: (_merge(w, "-o", str(w / "links/hard")), "links/hard",
                                                  "candidates.trec"),
    "merge -o symlink to --queries": lambda w: (
        _merge(w, "--queries", str(w / "queries.safetensors"), "-o", str(w / "links/sym")), "links/sym",
        "queries.safetensors"),
    "pack -o the source folder": lambda w: (_pack(w, "-o", str(w / "npy")), "npy", "npy"),
    "pack -o inside the source": lambda w: (_pack(w, "-o", str(w / "npy/out")), "npy/out", "npy"),
    "quantize -o the corpus": lambda w: (_quantize(w, "-o", str(w / "corpus")), "corpus", "corpus"),
    "quantize -o inside the corpus": lambda w: (_quantize(w, "-o", str(w / "corpus/q")), "corpus/q",
                                                "corpus"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_ALIAS_CASES))
def test_an_output_that_is_an_input_is_a_usage_error(work: Path, inputs_kept, case: str) -> None:
    args, output, source = _ALIAS_CASES[case](work)
    line = _one_line_error(_run(args), 2, work / output, work / source)
    assert "input" in line, line
    _no_debris(work, work / "corpus", work / "npy", work / "links")
    assert not (work / "r").exists()  # nothing written: refused before the scoring
    assert not (work / "npy" / "out").exists() and not (work / "corpus" / "q").exists()
    assert (work / "links" / "sym").is_symlink()


def test_stats_json_and_the_run_in_one_file_is_refused(work: Path, inputs_kept) -> None:
    run = work / "run.trec"
    _one_line_error(_run(_score(work, "-o", str(run), "--stats-json", str(run))), 2, run)
    _one_line_error(_run(_score(work, "--stats-json", "-")), 2, "--stats-json")
    assert not run.exists()


# --------------------------------------------------------------------------------------------------
# special files: written through as streams, the node kept


def _read_fifo(path: Path, into: list[bytes]) -> threading.Thread:
    def read() -> None:
        with open(path, "rb") as fh:
            into.append(fh.read())

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("command", ["score", "rerank", "merge", "stats-json"])
def test_a_fifo_is_written_through_and_kept(work: Path, inputs_kept, command: str) -> None:
    fifo = work / "fifo"
    os.mkfifo(fifo)
    reference = work / "reference"
    args = {
        "score": lambda out: _score(work, "-o", out),
        "rerank": lambda out: _rerank(work, "-o", out),
        "merge": lambda out: _merge(work, "-o", out),
        "stats-json": lambda out: _score(work, "-o", str(work / "run.trec"), "--stats-json", out),
    }[command]
    assert _run(args(str(reference))).exit_code == 0
    got: list[bytes] = []
    reader = _read_fifo(fifo, got)
    result = _run(args(str(fifo)))
    reader.join(30)
    assert result.exit_code == 0, result.output
    assert stat.S_ISFIFO(os.stat(fifo).st_mode), "the FIFO was replaced"
    if command == "stats-json":
        assert set(json.loads(got[0])) == set(json.loads(reference.read_text()))  # timings differ
    else:
        assert got == [reference.read_bytes()]
    os.unlink(fifo)
    _no_debris(work)


@pytest.fixture
def char_device(tmp_path: Path) -> Path:
    """A null device node of our own (mknod, as root), so that a regression replaces it, not /dev/null."""
    node = tmp_path / "null-device"
    try:
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (OSError, AttributeError) as exc:
        pytest.skip(f"cannot make a device node here: {exc}")
    return node


@pytest.mark.parametrize("command", ["score", "merge", "stats-json"])
def test_a_character_device_is_written_through_and_kept(work: Path, inputs_kept, char_device, command):
    args = {
        "score": _score(work, "-o", str(char_device)),
        "merge": _merge(work, "-o", str(char_device)),
        "stats-json": _score(work, "-o", str(work / "run.trec"), "--stats-json", str(char_device)),
    }[command]
    result = _run(args)
    assert result.exit_code == 0, result.output
    st = os.stat(char_device)
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3), "the device node was replaced"
    _no_debris(work)


@pytest.fixture
def dev_null_guard():
    """Puts /dev/null back should a regression replace it with a regular file (as root it could)."""
    yield
    if not stat.S_ISCHR(os.stat("/dev/null").st_mode):
        os.unlink("/dev/null")
        os.mknod("/dev/null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        os.chmod("/dev/null", 0o666)
        pytest.fail("-o /dev/null replaced /dev/null with a regular file")


def test_dev_null(work: Path, inputs_kept, char_device, dev_null_guard) -> None:
    """The same, on /dev/null itself, once a device node of our own showed it is safe to try."""
    assert _run(_score(work, "-o", str(char_device))).exit_code == 0
    assert stat.S_ISCHR(os.stat(char_device).st_mode), "a device node gets replaced: /dev/null not tried"
    result = _run(_score(work, "-o", "/dev/null", "--stats-json", "/dev/null"))
    assert result.exit_code == 0, result.output
    assert not glob.glob("/dev/.null.*.tmp")


# --------------------------------------------------------------------------------------------------
# the wrong kind of path: a usage error before any work


_SHAPE_CASES = {
    # case: work folder -> (args, the path the error names)
    "score -o a folder": lambda w: (_score(w, "-o", str(w / "folder")), w / "folder"),
    "score --stats-json a folder": lambda w: (
        _score(w, "-o", str(w / "r"), "--stats-json", str(w / "folder")), w / "folder"),
    "merge -o a folder": lambda w: (_merge(w, "-o", str(w / "folder")), w / "folder"),
    "pack -o a file": lambda w: (_pack(w, "-o", str(w / "a-file")), w / "a-file"),
    "quantize -o a file": lambda w: (_quantize(w, "-o", str(w / "a-file")), w / "a-file"),
    "score -o in a missing folder": lambda w: (_score(w, "-o", str(w / "no/such/run.trec")), w / "no/such"),
    "score --stats-json in a missing folder": lambda w: (
        _score(w, "-o", str(w / "r"), "--stats-json", str(w / "no/such/stats.json")), w / "no/such"),
    "merge -o in a missing folder": lambda w: (_merge(w, "-o", str(w / "no/such/run.trec")), w / "no/such"),
    "pack -o in a missing folder": lambda w: (_pack(w, "-o", str(w / "no/such/out")), w / "no/such"),
    "quantize -o in a missing folder": lambda w: (_quantize(w, "-o", str(w / "no/such/out")), w / "no/such"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_SHAPE_CASES))
def test_a_directory_a_file_or_a_missing_parent_is_a_usage_error(work: Path, inputs_kept, case: str) -> None:
    (work / "folder").mkdir()
    (work / "a-file").write_bytes(PREVIOUS)
    args, named = _SHAPE_CASES[case](work)
    _one_line_error(_run(args), 2, named)
    assert not (work / "r").exists()  # the run is not written when --stats-json cannot be
    assert os.listdir(work / "folder") == [] and (work / "a-file").read_bytes() == PREVIOUS
    assert not (work / "no").exists()
    _no_debris(work)


# --------------------------------------------------------------------------------------------------
# no permission, read-only file system, full disk, quota: exit 1, one line, nothing left, previous kept


_WRITE_CASES = {
    # case: (work folder, output folder) -> (args, the path the error names)
    "score": lambda w, d: (_score(w, "-o", str(d / "run.trec")), d / "run.trec"),
    "score .gz": lambda w, d: (_score(w, "-o", str(d / "run.trec.gz")), d / "run.trec.gz"),
    "rerank jsonl": lambda w, d: (_rerank(w, "-o", str(d / "run.trec"), "--format", "jsonl"), d / "run.trec"),
    "score --stats-json": lambda w, d: (_score(w, "-o", str(w / "side.trec"), "--stats-json",
                                               str(d / "stats.json")), d / "stats.json"),
    "merge": lambda w, d: (_merge(w, "-o", str(d / "run.trec")), d / "run.trec"),
    "pack": lambda w, d: (_pack(w, "-o", str(d / "packed")), d / "packed"),
    "quantize": lambda w, d: (_quantize(w, "-o", str(d / "int8")), d / "int8"),
}  # fmt: skip


def _previous_outputs(where: Path) -> None:
    for name in ("run.trec", "run.trec.gz", "stats.json"):
        (where / name).write_bytes(PREVIOUS)


def _check_previous_outputs(where: Path) -> None:
    for name in ("run.trec", "run.trec.gz", "stats.json"):
        assert (where / name).read_bytes() == PREVIOUS, f"{name} changed"
    assert sorted(os.listdir(where)) == ["run.trec", "run.trec.gz", "stats.json"]


@pytest.fixture
def locked(work: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder without write permission (mode 0500). Root writes there anyway, so creating a file or a
    folder in it is also made to fail with EACCES, as it would for anyone else."""
    folder = work / "locked"
    folder.mkdir()
    _previous_outputs(folder)
    folder.chmod(0o500)

    def refuse(original):
        def call(*args, **kwargs):
            target = kwargs.get("dir") or (args[2] if len(args) > 2 else None)
            if target is not None and os.path.realpath(target) == os.path.realpath(folder):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(target))
            return original(*args, **kwargs)

        return call

    def refuse_mkdir(original):
        def call(path, *args, **kwargs):
            if os.path.realpath(os.path.dirname(os.path.abspath(path))) == os.path.realpath(folder):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return original(path, *args, **kwargs)

        return call

    monkeypatch.setattr(tempfile, "mkstemp", refuse(tempfile.mkstemp))
    monkeypatch.setattr(tempfile, "mkdtemp", refuse(tempfile.mkdtemp))
    monkeypatch.setattr(output_files.os, "mkdir", refuse_mkdir(os.mkdir))
    monkeypatch.setattr(output_files.os, "open", refuse_mkdir(os.open))  # new files: temp, probe
    yield folder
    folder.chmod(0o700)


@pytest.mark.parametrize("case", list(_WRITE_CASES))
def test_a_folder_without_write_permission(work: Path, inputs_kept, locked: Path, case: str) -> None:
    args, named = _WRITE_CASES[case](work, locked)
    line = _one_line_error(_run(args), 1, named)
    assert "permission denied" in line, line
    _check_previous_outputs(locked)
    assert not (work / "side.trec").exists()  # refused before the scoring
    _no_debris(work)


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir()
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True,
            text=True,
        )
    except OSError as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")


@pytest.fixture
def small_fs(work: Path):
    """A 64 KiB tmpfs holding the previous outputs."""
    where = work / "mnt"
    _mount_tmpfs(where, "64k")
    _previous_outputs(where)
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.parametrize("case", list(_WRITE_CASES))
def test_a_read_only_file_system(work: Path, inputs_kept, small_fs: Path, case: str) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    args, named = _WRITE_CASES[case](work, small_fs)
    line = _one_line_error(_run(args), 1, named)
    assert "read-only file system" in line, line
    _check_previous_outputs(small_fs)
    assert not (work / "side.trec").exists()


def _fill(folder: Path) -> None:
    with open(folder / "filler", "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


@pytest.mark.parametrize("case", list(_WRITE_CASES))
def test_a_full_disk(work: Path, inputs_kept, small_fs: Path, case: str) -> None:
    """The checks pass (a file can still be created), the writes then fail with ENOSPC."""
    _fill(small_fs)
    args, named = _WRITE_CASES[case](work, small_fs)
    line = _one_line_error(_run(args), 1, named)
    assert "no space left on device" in line and "nothing was written" in line, line
    os.unlink(small_fs / "filler")
    _check_previous_outputs(small_fs)
    _no_debris(small_fs)


class _QuotaFile(io.FileIO):
    """A file whose writes fail with EDQUOT once ``budget`` bytes went through: a quota met half-way."""

    budget = 4096

    def write(self, data) -> int:  # noqa: ANN001
        if len(data) > _QuotaFile.budget:  # what fits goes in, then the quota is hit
            super().write(bytes(data[: _QuotaFile.budget]))
            _QuotaFile.budget = 0
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        _QuotaFile.budget -= len(data)
        return super().write(data)


class _OsWithQuota:
    """`os` for `maxsim_cli.shards.files`, whose `fdopen` gives a `_QuotaFile`."""

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(os, name)

    @staticmethod
    def fdopen(fd: int, mode: str = "r", *args, **kwargs):  # noqa: ANN002, ANN003, ANN205
        assert mode == "wb"
        return io.BufferedWriter(_QuotaFile(fd, "wb"), buffer_size=1024)


@pytest.mark.parametrize("command", ["score", "score-gz", "merge", "stats-json"])
def test_a_quota_met_half_way_through_a_file(work: Path, inputs_kept, monkeypatch, command: str) -> None:
    out = work / "out"
    out.mkdir()
    _previous_outputs(out)
    args, named = {
        "score": (_score(work, "-o", str(out / "run.trec")), out / "run.trec"),
        "score-gz": (_score(work, "-o", str(out / "run.trec.gz"), "-k", "300"), out / "run.trec.gz"),
        "merge": (_merge(work, "-o", str(out / "run.trec")), out / "run.trec"),
        "stats-json": (
            _score(work, "-o", "-", "--stats-json", str(out / "stats.json")),  # the run on stdout
            out / "stats.json",
        ),
    }[command]
    monkeypatch.setattr(
        _QuotaFile, "budget", {"score": 4096, "score-gz": 2048, "merge": 1000}.get(command, 100)
    )
    monkeypatch.setattr(output_files, "os", _OsWithQuota())
    line = _one_line_error(_run(args), 1, named)
    assert "disk quota exceeded" in line, line
    _check_previous_outputs(out)


def test_output_file_reports_a_directory_that_appeared_and_keeps_nothing(tmp_path: Path) -> None:
    """EISDIR at the final rename (a directory took the name while writing): one error, no temp file."""
    target = tmp_path / "run.trec"
    with pytest.raises(OutputWriteError, match=r"run.trec: cannot write: is a directory"):
        with OutputFile(target) as fh:
            fh.write(b"x\n")
            target.mkdir()
    assert os.listdir(tmp_path) == ["run.trec"] and target.is_dir()


# --------------------------------------------------------------------------------------------------
# subprocesses: a full disk behind stdout, and signals


def _maxsim(args: list[str], cwd: Path, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "maxsim_cli", *args], cwd=cwd, stderr=subprocess.PIPE, text=True, **kwargs
    )


def test_a_full_disk_behind_stdout(work: Path, inputs_kept) -> None:
    """``> /dev/full``: ENOSPC on stdout, for a run and for what a command prints; the flush at exit
    must then stay quiet too. The three run side by side."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    cases = {
        "score": _score(work),
        "merge": _merge(work),
        "inspect": ["inspect", "corpus", "--json", "--no-check-values"],
    }
    with open("/dev/full", "wb") as full:
        procs = {name: _maxsim(args, work, stdout=full) for name, args in cases.items()}
        results = {name: (proc.communicate(timeout=120)[1], proc.returncode) for name, proc in procs.items()}
    for name, (stderr, code) in results.items():
        assert code == 1, (name, stderr)
        assert stderr.strip().splitlines() == [
            "maxsim: error: <stdout>: cannot write: no space left on device; free some space or write "
            "elsewhere"
        ], (name, stderr)


# Runs `maxsim` with one function made to stop half-way: after its first call (a run's first lines, a
# shard's first documents are in a temp file by then) it touches the READY file and sleeps.
_HOOK = r"""
import importlib, os, signal, sys, time
# as an interactive shell would start it, whatever this test runs under (nohup, a background job)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
module, _, name = os.environ["HOOK"].partition(":")
owner_name, _, attr = name.rpartition(".")
owner = importlib.import_module(module)
if owner_name:
    owner = getattr(owner, owner_name)
original = getattr(owner, attr)

def stop_here(*args, **kwargs):
    result = original(*args, **kwargs)
    open(os.environ["READY"], "w").close()
    time.sleep(60)
    return result

setattr(owner, attr, stop_here)
from maxsim_cli.cli import main
main(sys.argv[1:])
"""

_SIGNAL_CASES = {
    # command: (arguments, in the work folder; the function to stop in)
    "score": (
        ["score", "queries.safetensors", "corpus", "-k", "50", "--device", "cpu", "-q", "-o", "out/run.trec"],
        "maxsim_cli.run_files:RunWriter._emit",
    ),
    "rerank": (
        [
            "score",
            "queries.safetensors",
            "corpus",
            "--candidates",
            "candidates.trec",
            "--device",
            "cpu",
            "-q",
            "-o",
            "out/run.trec.gz",
        ],
        "maxsim_cli.run_files:RunWriter._emit",
    ),
    "merge": (
        ["merge", "candidates.trec", "-q", "-o", "out/run.trec"],
        "maxsim_cli.run_files:RunWriter._emit",
    ),
    "pack": (
        ["pack", "npy", "-q", "-o", "out/packed", "--shard-tokens", "20"],
        "maxsim_cli.shards:ShardWriter.add",
    ),
    "quantize": (
        ["quantize", "corpus", "--sample-queries", "0", "--device", "cpu", "-o", "out/int8"],
        "maxsim_cli.shards:ShardWriter.add",
    ),
}


@pytest.mark.parametrize(
    ("command", "signum"),
    [
        ("score", signal.SIGTERM),
        ("score", signal.SIGHUP),
        ("score", signal.SIGINT),
        ("rerank", signal.SIGHUP),
        ("merge", signal.SIGTERM),
        ("pack", signal.SIGTERM),
        ("quantize", signal.SIGHUP),
    ],
    ids=lambda v: v.name if isinstance(v, signal.Signals) else v,
)
def test_a_signal_half_way_leaves_the_previous_output(work: Path, inputs_kept, command: str, signum) -> None:
    args, hook = _SIGNAL_CASES[command]
    out = work / "out"
    out.mkdir()
    _previous_outputs(out)
    (out / "packed").mkdir()  # pack fills an existing folder: it must stay as it was (empty)
    before = sorted(os.listdir(out))
    ready = work / "ready"
    env = dict(os.environ, HOOK=hook, READY=str(ready))
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOOK, *args],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ready.exists(), proc.communicate(timeout=10)
    in_flight = glob.glob(str(out / ".*")) + glob.glob(str(out / "packed" / ".*"))
    assert in_flight, "the hook should stop with a temp file or staging folder in place"
    proc.send_signal(signum)
    try:
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines() == [f"maxsim: stopped by {signal.Signals(signum).name}"], stderr
    assert sorted(os.listdir(out)) == before and os.listdir(out / "packed") == []
    _check_previous_outputs_and(out, "packed")
    _no_debris(out, out / "packed", work)


def _check_previous_outputs_and(where: Path, *folders: str) -> None:
    for name in ("run.trec", "run.trec.gz", "stats.json"):
        assert (where / name).read_bytes() == PREVIOUS, f"{name} changed"
    assert sorted(os.listdir(where)) == sorted(["run.trec", "run.trec.gz", "stats.json", *folders])


# --------------------------------------------------------------------------------------------------
# usage errors: one line, like every other error; help unchanged


@pytest.mark.parametrize(
    "args",
    [
        ["score"],
        ["score", "q", "c", "-k", "0"],
        ["score", "q", "c", "--no-such-option"],
        ["merge", "r", "--top-k", "many"],
        ["frobnicate"],
    ],
)
def test_usage_errors_are_one_line(args: list[str]) -> None:
    result = _run(args)
    line = _one_line_error(result, 2)
    assert "--help" in line and "╭" not in result.stderr and "Usage:" not in result.stderr


def test_help_is_unchanged() -> None:
    result = _run(["score", "--help"])
    assert result.exit_code == 0 and "Usage:" in result.stdout and "--stats-json" in result.stdout
    result = _run([])
    assert result.exit_code == 2 and "Usage:" in result.stdout + result.stderr
    assert "maxsim: error" not in result.stderr


# --------------------------------------------------------------------------------------------------
# a signal in the instants around a temp file's creation (found by tests/test_fault_injection.py: a
# SIGINT at 0.079 s left out/.run.trec.*.tmp)


class _Signal(BaseException):
    """What a stop signal raises in the main thread (KeyboardInterrupt, `cli.Stopped`)."""


def _interrupt_after_creation(monkeypatch: pytest.MonkeyPatch) -> None:
    """`new_file` made (and claimed) its file; the signal lands before it returns."""
    made = output_files.new_file

    def new_file(*args, **kwargs):
        made(*args, **kwargs)
        raise _Signal

    monkeypatch.setattr(output_files, "new_file", new_file)


def _left(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_new_file_removes_what_it_made_when_interrupted_before_returning(tmp_path: Path) -> None:
    def interrupted(path: str) -> None:
        assert os.path.exists(path)
        raise _Signal

    with pytest.raises(_Signal):
        output_files.new_file(str(tmp_path), ".x.", ".tmp", interrupted)
    assert _left(tmp_path) == []


@pytest.mark.parametrize("where", ["after the claim", "in fdopen"])
def test_output_file_open_interrupted_leaves_no_temp(tmp_path: Path, monkeypatch, where: str) -> None:
    """A signal after the temp exists but before ``open`` returns (the ``with`` block never begins, so
    no ``__exit__`` runs): the temp is removed, the previous output kept."""
    target = tmp_path / "run.trec"
    target.write_bytes(b"previous\n")
    if where == "after the claim":
        _interrupt_after_creation(monkeypatch)
    else:

        def fdopen(*args, **kwargs):
            raise _Signal

        monkeypatch.setattr(output_files.os, "fdopen", fdopen)
    with pytest.raises(_Signal), output_files.OutputFile(target) as fh:
        fh.write(b"never\n")
    assert _left(tmp_path) == ["run.trec"] and target.read_bytes() == b"previous\n"


@pytest.mark.parametrize("fmt", ["safetensors", "arrow"])
def test_shard_sinks_interrupted_in_their_constructor_leave_nothing(tmp_path: Path, monkeypatch, fmt) -> None:
    from maxsim_cli.shards import sinks

    _interrupt_after_creation(monkeypatch)
    with pytest.raises(_Signal):
        if fmt == "safetensors":
            sinks.SafetensorsSink(str(tmp_path / "s.safetensors"), 8, "float16", {})
        else:
            sinks.RecordSink(str(tmp_path / "s.arrow"), 8, "float16", "arrow")
    assert _left(tmp_path) == []


@pytest.mark.parametrize("name", ["run.trec", "run.trec.gz"])
def test_a_run_writer_interrupted_while_it_opens_leaves_no_temp(tmp_path: Path, monkeypatch, name) -> None:
    """A signal after `OutputFile.open` has returned but before `RunWriter.__enter__` has (the text
    wrapper being made: the fault-injection suite's SIGTERM at 0.05 s found this): the temp is removed."""
    from maxsim_cli import run_files as runs

    target = tmp_path / name
    target.write_bytes(b"previous\n")

    def wrapper(*args, **kwargs):
        raise _Signal

    monkeypatch.setattr(runs.io, "TextIOWrapper", wrapper)
    with pytest.raises(_Signal), runs.RunWriter(target):
        pass
    assert _left(tmp_path) == [name] and target.read_bytes() == b"previous\n"


def test_the_write_probe_interrupted_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    _interrupt_after_creation(monkeypatch)
    with pytest.raises(_Signal):
        output_files._probe(str(tmp_path), "-o")
    assert _left(tmp_path) == []


def test_a_signal_in_the_temporary_folders_first_look_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    """`tempfile`'s first look for the temporary folder makes a randomly named file there and removes it;
    a stop signal just after the make left the file in TMPDIR (the fault-injection suite's SIGINT at
    0.023 s into ``score --devices cpu:2`` found it). The signal is held back until the look is over,
    then stops the command as usual."""
    from maxsim_cli import cli

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    real_open = os.open

    def open_then_signal(path, *args, **kwargs):
        fd = real_open(path, *args, **kwargs)
        if os.path.dirname(path) == str(tmp_path):
            os.kill(os.getpid(), signal.SIGTERM)
        return fd

    monkeypatch.setattr(os, "open", open_then_signal)
    with pytest.raises(cli.Stopped), cli.stop_signals_raise():
        found = tempfile.gettempdir()
        monkeypatch.setattr(os, "open", real_open)
        for _ in range(200):  # the held-back signal is sent again within 20 ms and stops here
            time.sleep(0.01)
    assert found == str(tmp_path) and _left(tmp_path) == []


def test_a_stop_signal_inside_a_finalizer_stops_the_command_after_it_unprinted(capsys) -> None:
    """The collector runs weakref callbacks and ``__del__`` wherever the main thread is; a stop signal's
    handler that runs inside one raises where nothing can catch it, and Python printed "Exception ignored
    in ..." with a traceback and went on (the fault-injection suite's SIGTERM at a random instant into
    ``add``, inside a WeakKeyDictionary's callback). The stop is sent again, stops the command outside the
    callback, and nothing is printed."""
    from maxsim_cli import cli

    class Finalized:
        def __del__(self) -> None:  # as the handler would run here
            cli._raise_stopped(signal.SIGTERM, None)

    with pytest.raises(cli.Stopped) as stopped, cli.stop_signals_raise():
        Finalized()  # dropped at once: its __del__ raises where nothing can catch it
        for _ in range(200):  # the stop is sent again within 20 ms and raises here
            time.sleep(0.01)
    assert stopped.value.signum == signal.SIGTERM
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err, err


def test_a_worker_stopped_inside_a_finalizer_stops_after_it_unprinted(monkeypatch, capsys) -> None:
    """The same in a ``--devices`` worker, whose SIGTERM handler is `lifeline`'s (armed once its imports
    are done): the stop raised inside a ``__del__`` is sent again and stops the worker outside it, and
    nothing is printed; disarming puts the unraisable hook found back."""
    from maxsim_cli import lifeline, settings

    monkeypatch.setenv(settings.LAUNCHER_PID, str(os.getppid()))
    handler, hook = signal.getsignal(signal.SIGTERM), sys.unraisablehook

    class Finalized:
        def __del__(self) -> None:  # as the handler would run here
            lifeline._raise_exit(signal.SIGTERM, None)

    try:
        lifeline.arm()
        with pytest.raises(lifeline.Stopped) as stopped:
            Finalized()  # dropped at once: its __del__ raises where nothing can catch it
            for _ in range(200):  # the stop is sent again within 20 ms and raises here
                time.sleep(0.01)
        assert stopped.value.code == 128 + signal.SIGTERM
        lifeline.disarm()
        assert sys.unraisablehook is hook
    finally:
        signal.signal(signal.SIGTERM, handler)
        sys.unraisablehook = hook
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err, err


_TERM_INSIDE_THE_TEMP_LOOK = """
import os, signal, sys, tempfile
real_open = os.open

def open_then_term(path, *args, **kwargs):  # tempfile's probe file is made: SIGTERM before its removal
    fd = real_open(path, *args, **kwargs)
    if os.path.dirname(str(path)) == os.environ["TMPDIR"]:
        os.kill(os.getpid(), signal.SIGTERM)
    return fd

os.open = open_then_term
from maxsim_cli import lifeline
lifeline.tie_to_launcher(armed=False)  # SIGTERM's default action, as in a worker's first imports
print(tempfile.gettempdir())
"""


def test_a_worker_stopped_inside_the_first_look_for_the_temp_folder_leaves_nothing_there(tmp_path) -> None:
    """tempfile's first look for the temporary folder makes a file there and removes it; torch's import
    takes that look while a ``--devices`` worker still ends at once on SIGTERM (its launcher stopping it
    on Ctrl-C). The worker takes the look itself, first thing, with SIGTERM blocked: the signal ends it
    after the look, and ``TMPDIR`` holds nothing (the fault-injection suite once found the file there)."""
    from maxsim_cli import settings

    env = dict(os.environ, TMPDIR=str(tmp_path), **{settings.LAUNCHER_PID: str(os.getpid())})
    argv = [sys.executable, "-c", _TERM_INSIDE_THE_TEMP_LOOK]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert done.stdout == "" and os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "args",
    [
        ["pack", "npy", "-q", "-o", "out/corpus", "--shard-tokens", "20"],
        ["quantize", "corpus", "--sample-queries", "0", "--device", "cpu", "-o", "out/corpus"],
    ],
    ids=["pack", "quantize"],
)
def test_stopped_between_the_renames_of_a_swap_the_old_corpus_stays(work: Path, monkeypatch, args) -> None:
    """``--overwrite`` into a corpus folder swaps the new corpus in by renames (the old files set aside,
    the new ones moved in, the manifest last: `swap_corpus_files`). A stop signal just after any one of
    them: the previous corpus, file for file, and nothing hidden left (the fault-injection suite's SIGINT
    at 0.086 s into `pack` found a set-aside shard lost with the trash; `quantize` put nothing back)."""
    monkeypatch.chdir(work)
    (work / "out").mkdir()
    assert CliRunner().invoke(app, args).exit_code == 0
    previous = snapshot(work / "out" / "corpus")
    assert len(previous) > 2  # shards and the manifest
    real_move = output_files.move_into
    for stop_after in range(1, 100):
        calls: list[str] = []

        def move_then_stop(source: str, target: str, outdir: str, calls=calls, stop_after=stop_after) -> None:
            real_move(source, target, outdir)
            calls.append(target)
            if len(calls) == stop_after:
                raise KeyboardInterrupt

        monkeypatch.setattr(output_files, "move_into", move_then_stop)
        result = CliRunner().invoke(app, [*args, "--overwrite"])
        if len(calls) < stop_after:  # every rename made: the swap is over
            assert result.exit_code == 0 and stop_after > 2, result.output
            break
        assert result.exit_code != 0, (stop_after, result.output)
        assert snapshot(work / "out" / "corpus") == previous, f"after rename {stop_after}"
        assert hidden_entries(work / "out") == []


# --------------------------------------------------------------------------------------------------
# a stop signal around the commit point (the rename that puts the output in place): before it, exit
# 128 + N and the previous output as it was; from it on, the command finishes, exit 0, output complete

_SCORE_ARGS = ["score", "queries.safetensors", "corpus", "-k", "50", "--device", "cpu"]
_QUANTIZE_ARGS = ["quantize", "corpus", "--sample-queries", "0", "--device", "cpu"]
_COMMIT_CASES = {
    # command: (arguments, in the work folder; what is at out/X before: a run, nothing, an empty folder
    # or a corpus of other shards; the path whose rename puts the output in place)
    "merge": (["merge", "candidates.trec", "-o", "out/run.trec"], "run", "out/run.trec"),
    "score": ([*_SCORE_ARGS, "-o", "out/run.trec"], "run", "out/run.trec"),
    "score --stats-json": ([*_SCORE_ARGS, "-o", "-", "--stats-json", "out/run.trec"], "run", "out/run.trec"),
    "pack": (["pack", "npy", "-o", "out/corpus", "--shard-tokens", "20"], "nothing", "out/corpus"),
    "pack into an empty folder": (
        ["pack", "npy", "-o", "out/corpus", "--shard-tokens", "20"],
        "empty",
        "out/corpus/index.json",
    ),
    "pack --overwrite": (
        ["pack", "npy", "-o", "out/corpus", "--shard-tokens", "20", "--overwrite"],
        "corpus",
        "out/corpus/index.json",
    ),
    "quantize": ([*_QUANTIZE_ARGS, "-o", "out/corpus"], "empty", "out/corpus"),
    "quantize --overwrite": (
        [*_QUANTIZE_ARGS, "-o", "out/corpus", "--overwrite"],
        "corpus",
        "out/corpus/index.json",
    ),
}


def _make_previous(work: Path, out: Path, what: str) -> None:
    if what == "run":
        out.write_bytes(PREVIOUS)
    elif what == "empty":
        out.mkdir()
    elif what == "corpus":
        assert runner.invoke(app, _pack(work, "-o", str(out), "--shard-tokens", "40")).exit_code == 0


def _commit_case(work: Path, case: str) -> tuple[list[str], str, Path, object]:
    """The case's arguments, its final rename's target, the output, and what is there before the run."""
    args, previous, target = _COMMIT_CASES[case]
    out = work / args[args.index("-o") + 1] if "--stats-json" not in args else work / args[-1]
    (work / "out").mkdir()
    _make_previous(work, out, previous)
    return args, str(work / target), out, snapshot(out)


def _clean_run(work: Path, case: str) -> object:
    """What the command writes when nothing stops it (in a folder of its own)."""
    args, previous, _ = _COMMIT_CASES[case]
    (work / "clean").mkdir()
    args = [a.replace("out/", "clean/") for a in args]
    path = work / next(a for a in reversed(args) if a.startswith("clean/"))
    _make_previous(work, path, previous)
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    snap = snapshot(path)
    if "--stats-json" in args:  # its timings differ from run to run: its keys are what is compared
        snap = sorted(json.loads(snap))
    return snap


def _renames_then(target: str, act, monkeypatch: pytest.MonkeyPatch) -> None:
    """``act()`` just after the rename onto ``target`` (os.replace or os.rename)."""
    for name in ("replace", "rename"):
        real = getattr(os, name)

        def wrapped(source, destination, *args, real=real, **kwargs):
            real(source, destination, *args, **kwargs)
            if os.path.abspath(destination) == target:
                act()

        monkeypatch.setattr(os, name, wrapped)


@pytest.fixture
def shell_signals():
    """The stop signals' dispositions as an interactive shell's job has them (whatever this test runs
    under: nohup ignores SIGHUP), put back after."""
    wanted = {
        signal.SIGTERM: signal.SIG_DFL,
        signal.SIGHUP: signal.SIG_DFL,
        signal.SIGINT: signal.default_int_handler,
    }
    previous = {signum: signal.signal(signum, handler) for signum, handler in wanted.items()}
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("case", list(_COMMIT_CASES))
def test_a_signal_just_after_the_final_rename_lets_the_command_finish(
    work: Path, monkeypatch, shell_signals, case
) -> None:
    """SIGTERM, then SIGINT and SIGHUP, the instant the rename that puts the output in place returns (the
    fault-injection suite sent them 0.4-1.4 s later and got 143): the command finishes, prints its
    summary, exit 0, and the output is the complete one."""
    from maxsim_cli import lifeline

    monkeypatch.chdir(work)
    clean = _clean_run(work, case)
    args, target, out, _ = _commit_case(work, case)
    sent: list[int] = []

    def signals() -> None:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            sent.append(signum)
            os.kill(os.getpid(), signum)

    _renames_then(target, signals, monkeypatch)
    result = runner.invoke(app, args)
    assert sent, "the rename should have been made"
    assert result.exit_code == 0, result.output
    assert "stopped by" not in result.stderr, result.stderr
    now = snapshot(out)
    assert (sorted(json.loads(now)) if "--stats-json" in args else now) == clean
    assert lifeline.noted() == sent
    assert hidden_entries(work / "out") == []


@pytest.mark.parametrize("case", list(_COMMIT_CASES))
def test_a_signal_just_before_the_commit_point_keeps_the_previous_output(
    work: Path, monkeypatch, shell_signals, case
) -> None:
    """SIGTERM as the commit point is reached, before the rename: exit 143, the previous output as it
    was (the previous run, the empty folder, the old corpus), nothing hidden left."""
    from maxsim_cli import lifeline, pack, quantize
    from maxsim_cli import run_files as runs

    monkeypatch.chdir(work)
    args, _, out, previous = _commit_case(work, case)
    real = lifeline.commit_point

    def signal_first():
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before this returns
        return real()

    for module in (output_files, runs, pack, quantize):
        monkeypatch.setattr(module, "commit_point", signal_first)
    result = runner.invoke(app, args)
    assert result.exit_code == 128 + signal.SIGTERM, result.output
    assert result.stderr.strip().splitlines()[-1] == "maxsim: stopped by SIGTERM"
    assert snapshot(out) == previous
    assert hidden_entries(work / "out") == []


_END = r"""
import atexit, os, signal, sys
atexit.register(lambda: print("exit handlers ran", flush=True))
from maxsim_cli.cli import main
sys.argv = ["maxsim", *sys.argv[1:]]
if os.environ.get("ARGV") == "given":
    try:
        main(sys.argv[1:])
    except SystemExit as exc:
        print("SystemExit", exc.code, signal.getsignal(signal.SIGTERM) is signal.SIG_IGN,
              signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)
        os._exit(0)
main()
print("not reached")
"""


@pytest.mark.parametrize("argv", ["given", "none"])
def test_once_the_command_has_ended_the_stop_signals_are_ignored(work: Path, argv: str) -> None:
    """After the command the stop signals are ignored (SIG_IGN: a Python handler would be put back to the
    default action by the interpreter's shutdown, and a signal then killed the process by the signal);
    as the process's entry point (no arguments) `main` ends the process itself, its exit handlers run."""
    args = ["merge", str(work / "candidates.trec"), "-q", "-o", str(work / "run.trec")]
    env = dict(os.environ, ARGV=argv)
    proc = subprocess.run(
        [sys.executable, "-c", _END, *args], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.stderr == ""
    if argv == "given":
        assert proc.returncode == 0 and proc.stdout == "SystemExit 0 True True\n"
    else:
        assert proc.returncode == 0 and proc.stdout == "exit handlers ran\n"
    assert (work / "run.trec").stat().st_size > 0


_LEFT_WAITING = r"""
import sys, threading
from maxsim_cli.cli import main
# what a stop signal can leave behind: a pool's worker that the pool never noted (the signal raised in
# `Thread.start` as it waited for the thread), so that nothing tells it to stop waiting for work
threading.Thread(target=threading.Event().wait, name="left-waiting").start()
sys.argv = ["maxsim", *sys.argv[1:]]
main()
"""


def test_a_thread_left_waiting_does_not_keep_the_process_from_ending(work: Path) -> None:
    """The fault-injection suite's SIGHUP 0.5 s into ``score`` left a reader pool's worker waiting, and
    the process, having said ``stopped by SIGHUP``, never ended: the interpreter's shutdown waits for
    every thread that is not a daemon. The command's outcome decided, the process ends."""
    args = ["merge", str(work / "candidates.trec"), "-q", "-o", str(work / "run.trec")]
    proc = subprocess.run(
        [sys.executable, "-c", _LEFT_WAITING, *args], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stderr == ""
    assert (work / "run.trec").stat().st_size > 0
