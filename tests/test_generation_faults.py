"""Faults while a corpus changes: SIGKILL and SIGTERM at seeded random instants of `maxsim add`,
`delete` and `compact` (real processes, `faultlib.ForkServer`), two writers at once, a full disk.

After every trial the corpus opens as exactly the old generation or exactly the new one (its live ids
and their vectors), the inputs are unchanged, and the exit code tells which (0: the new one; 128 + N or
-N: the old one). After SIGTERM nothing is left beside the committed generation's files; after SIGKILL
what is left (a hidden staging folder, a generation folder the pointer never named, a temp file of the
pointer) is removed by the next writer, and then nothing is left either.

``MAXSIM_GENERATION_TRIALS`` sets the trials per command and signal (default 2; 20 for the full run).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from faultlib import ForkServer, tree_hashes

from maxsim_cli import open_corpus
from maxsim_cli.shards import write_manifest, write_shard
from maxsim_cli.shards.generations import read_generation, read_pointer

SEED = int(os.environ.get("MAXSIM_FAULT_SEED", "26"))
TRIALS = int(os.environ.get("MAXSIM_GENERATION_TRIALS", "2"))
DIM = 16


def _docs(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    return [rng.standard_normal((int(rng.integers(3, 9)), DIM)).astype(np.float32) for _ in range(n)]


@pytest.fixture(scope="module")
def server() -> Any:
    forks = ForkServer()
    yield forks
    forks.close()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("inputs")
    rng = np.random.default_rng(SEED)
    base = root / "base"
    base.mkdir()
    for name in "abc":
        write_shard(base / f"{name}.safetensors", [f"{name}{i}" for i in range(300)], _docs(rng, 300))
    write_manifest(base)
    (root / "new").mkdir()
    write_shard(root / "new" / "n.safetensors", [f"n{i}" for i in range(300)] + ["a1"], _docs(rng, 301))
    (root / "ids.txt").write_text("".join(f"{x}{i}\n" for x in "ab" for i in range(0, 300, 2)))
    return root


def _content(folder: Path) -> dict[str, str]:
    """The corpus as a reader opens it: its generation, and each live id with a hash of its vectors."""
    with open_corpus(folder) as corpus:
        mask = corpus.deleted_mask()
        out = {
            "": f"generation {corpus.generation}, shards {[os.path.basename(s.path) for s in corpus.shards]}"
        }
        start = 0
        for shard in corpus.shards:
            for a in range(0, shard.num_docs, 256):
                batch = shard.read_docs(a, min(a + 256, shard.num_docs))
                for i, doc_id in enumerate(batch.ids):
                    if mask is None or not mask[start + a + i]:
                        rows = batch.embeddings[batch.offsets[i] : batch.offsets[i + 1]].numpy()
                        out[doc_id] = hashlib.sha256(rows.tobytes()).hexdigest()
            start += shard.num_docs
        return out


def _expected_files(folder: Path) -> set[str]:
    """What a corpus folder at rest holds: the pointer, the committed generation's manifest and the
    files it names (or, at generation 0, whatever it held), and the generations/ folder."""
    number = read_pointer(str(folder))
    if number is None:
        return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    files = {"index.json", f"generations/{number}/manifest.json"}
    for entry in read_generation(str(folder), number):
        files.update(entry.files())
    return files


def _present(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def _prepared(inputs: Path, base: Path, command: str) -> Path:
    folder = base / "corpus"
    shutil.copytree(inputs / "base", folder)
    if command == "compact":  # something to compact: a third of a and b deleted
        ids = "".join(f"{x}{i}\n" for x in "ab" for i in range(0, 300, 3))
        subprocess.run(
            [sys.executable, "-m", "maxsim_cli", "delete", str(folder), "--ids", "-", "-q"],
            input=ids.encode(), check=True, cwd=Path(__file__).resolve().parents[1],
        )  # fmt: skip
    return folder


COMMANDS = {
    "add": lambda i, c: ["add", str(c), str(i / "new"), "--replace", "-q"],
    "delete": lambda i, c: ["delete", str(c), "--ids", str(i / "ids.txt"), "-q"],
    "compact": lambda i, c: ["compact", str(c), "--threshold", "0.2", "-q"],
}


def _clean_run(server: ForkServer, inputs: Path, base: Path, name: str) -> tuple[dict, dict, float]:
    folder = _prepared(inputs, base, name)
    before = _content(folder)
    start = time.monotonic()
    pid = server.spawn(COMMANDS[name](inputs, folder), base, base / "out", base / "err")
    assert server.wait(pid, 120) == 0, (base / "err").read_text()
    took = time.monotonic() - start
    after = _content(folder)
    assert after != before
    shutil.rmtree(folder)
    return before, after, took


@pytest.mark.parametrize("name", list(COMMANDS))
def test_signals_at_random_instants(server, inputs: Path, tmp_path: Path, name: str) -> None:
    (tmp_path / "clean").mkdir()
    old, new, took = _clean_run(server, inputs, tmp_path / "clean", name)
    rng = np.random.default_rng([SEED, list(COMMANDS).index(name)])
    hashes = tree_hashes(inputs / "new", inputs / "ids.txt")
    outcomes = []
    for trial in range(2 * TRIALS):
        signum = signal.SIGKILL if trial % 2 else signal.SIGTERM
        base = tmp_path / f"trial-{trial}"
        base.mkdir()
        folder = _prepared(inputs, base, name)
        pid = server.spawn(COMMANDS[name](inputs, folder), base, base / "out", base / "err")
        time.sleep(float(rng.uniform(0, took * 1.2)))
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
        code = server.wait(pid, 120)
        # a signal at the fork's first instant comes before the child opened its stderr
        err = (base / "err").read_text() if (base / "err").exists() else ""
        assert "Traceback" not in err, err
        got = _content(folder)
        assert got in (old, new), f"{name} {signum!r}: the corpus is neither the old nor the new one"
        if code == 0:
            assert got == new
        else:
            assert code in (-signum, 128 + signum), (code, err)
            if signum != signal.SIGKILL:  # SIGKILL may come after the commit: old or new, checked above
                assert got == old, f"{name}: exit {code} but the corpus changed"
        assert tree_hashes(inputs / "new", inputs / "ids.txt") == hashes  # no input lost or changed
        left = _present(folder) - _expected_files(folder) - {"index.json"}
        if signum == signal.SIGTERM or code == 0:
            assert not left, f"{name} {signum!r} exit {code}: left {sorted(left)}"
        else:  # SIGKILL: what it left, the next writer removes
            pid = server.spawn(
                ["compact", str(folder), "--threshold", "1", "-q"], base, base / "o2", base / "e2"
            )
            assert server.wait(pid, 120) == 0, (base / "e2").read_text()
            assert _content(folder) == got
            left = _present(folder) - _expected_files(folder)
            assert not left, f"{name} SIGKILL: left {sorted(left)} after the next writer"
        outcomes.append("new" if got == new else "old")
        shutil.rmtree(base)
    print(f"{name}: {len(outcomes)} trials, {outcomes.count('old')} old, {outcomes.count('new')} new")


def test_two_writers_one_wins(server, inputs: Path, tmp_path: Path) -> None:
    folder = _prepared(inputs, tmp_path, "compact")
    before = _content(folder)
    first = server.spawn(COMMANDS["compact"](inputs, folder), tmp_path, tmp_path / "o1", tmp_path / "e1")
    time.sleep(0.05)
    second = server.spawn(COMMANDS["delete"](inputs, folder), tmp_path, tmp_path / "o2", tmp_path / "e2")
    codes = (server.wait(first, 120), server.wait(second, 120))
    said = [(tmp_path / "e1").read_text(), (tmp_path / "e2").read_text()]
    errors = "".join(said)
    after = _content(folder)
    if 1 in codes:  # one was refused while the other held the lock
        assert sorted(codes) == [0, 1], errors
        # the refused one says so in one line (the winner may warn: the delete's ids already deleted)
        refused = said[codes.index(1)]
        assert "another maxsim add/delete/compact is changing this corpus" in refused
        assert len(refused.strip().splitlines()) == 1, errors
    else:  # the first ended before the second began: both committed, one after the other
        assert codes == (0, 0), errors
    assert after != before


def test_a_full_disk(server, inputs: Path, tmp_path: Path) -> None:
    """A file size limit stops every file written at a random size: exit 1 and one line, the corpus as
    it was and nothing left; or exit 0 and the new generation."""
    rng = np.random.default_rng([SEED, 99])
    for trial in range(TRIALS):
        base = tmp_path / f"disk-{trial}"
        base.mkdir()
        folder = _prepared(inputs, base, "compact")
        before = _content(folder)
        limit = int(rng.integers(1, 40_000))
        pid = server.spawn(COMMANDS["compact"](inputs, folder), base, base / "o", base / "e", fsize=limit)
        code = server.wait(pid, 120)
        err = (base / "e").read_text()
        assert "Traceback" not in err
        if code != 0:
            assert code == 1 and len(err.strip().splitlines()) == 1, err
            assert _content(folder) == before
        assert not _present(folder) - _expected_files(folder) - {"index.json"}
