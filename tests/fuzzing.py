"""Seeded fuzzing of what reads outside input: the real ``maxsim serve`` (JSON and Arrow IPC bodies to
``POST /search`` and ``POST /rerank``, and their query strings), the shard readers (safetensors and Arrow
IPC files mutated byte by byte and field by field, opened and scored through the library and the command
line, and Arrow query streams on ``maxsim score -``'s stdin), and the Python API's inputs
(`Queries.from_embeddings`, `search`, `rerank`).

Every case starts from a valid input and mutates it (bit flips, truncation, Arrow offsets that point
past their buffers, wrong types, extreme numbers, huge lengths, text that is not UTF-8, duplicated ids,
...). Case ``i`` of target ``t`` draws from its own generator, seeded by ``(seed, t, i)``, so one case
is reproduced alone: ``python -m tests.fuzz --seed S --target t --case=i -v``. Cases -N to -1 of each
target are built on purpose from inputs that once failed (`KNOWN_SERVER`, `KNOWN_SHARDS`, `KNOWN_API`);
every run starts with them. The report counts each kind of failure per target and groups the failures
by what tells them apart (an exception's type, place and message, a signal), with the first case of each.

What counts as a failure, by target:

- **server** (one ``maxsim serve`` process on 127.0.0.1, a free port, restarted after a crash):
  *crash* the process died; *hang* no answer within the timeout; *5xx* an answer of 500 or more;
  *traceback* a traceback in the server's log; *wrong answer* a 200 whose results differ from the
  library's own `search` / `rerank` for the same input (documents, order, float32 scores, missing
  candidates), or a 200 to a request the library refuses; *non-one-line* a 4xx whose body is not
  ``{"detail": "<one line>"}``.
- **shards** (each case a forked process, `Sandbox`): *crash* killed by a signal; *hang* over the
  timeout; *internal error* an exception other than `InputError` / `UsageError` from the library, or an
  exit code other than 0, 1 or 2 from the command line; *traceback* one on the command's stderr;
  *wrong answer* a shard the library or the command line accepts whose run differs from MaxSim computed
  here from the file's bytes (or which breaks a rule of docs/format.md that readers must enforce), or a
  command-line run that differs from the library's; *non-one-line* an error of more than one line.
- **api** (forked too): as for the shards, against the fuzzing corpus's own values.

The harness itself never reads an Arrow value before ``validate(full=True)``, so only the processes
under test can crash. Servers bind 127.0.0.1 only; every wait has a time limit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import hashlib
import io
import json
import math
import os
import queue
import random
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
TARGETS = ("server", "shards", "api")
# How a total number of cases is shared among the targets (a server case is one request, the cheapest).
SHARES = {"server": 0.6, "shards": 0.15, "api": 0.25}
KINDS = ("crash", "hang", "5xx", "internal", "traceback", "wrong", "multiline")
KIND_NAMES = {
    "crash": "crashes",
    "hang": "hangs",
    "5xx": "5xx answers",
    "internal": "internal errors",
    "traceback": "tracebacks",
    "wrong": "wrong answers",
    "multiline": "non-one-line errors",
}
DIM = 8
ARROW_TYPE = "application/vnd.apache.arrow.stream"
JSON_TYPE = "application/json"
SERVER_TIMEOUT_S = 30.0
SANDBOX_TIMEOUT_S = 60.0
# A forked case may map this much more address space than the warm process that forks it: a case that
# tries to allocate memory for a huge k or length fails (MemoryError) instead of taking the machine's.
SANDBOX_EXTRA_ADDRESS_SPACE = 4 << 30


def case_seed(seed: int, target: str, index: int) -> int:
    digest = hashlib.sha256(f"{seed}/{target}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def case_rng(seed: int, target: str, index: int) -> tuple[random.Random, np.random.Generator]:
    value = case_seed(seed, target, index)
    return random.Random(value), np.random.default_rng(value)


def one_line(text: str, limit: int = 240) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def pick(rnd: random.Random, weighted: Sequence[tuple[Any, float]] | str) -> Any:
    """One of ``weighted``'s values by its weight: ``[(value, weight), ...]`` or ``"name:weight ..."``."""
    if isinstance(weighted, str):
        weighted = [(name, float(w)) for name, w in (item.split(":") for item in weighted.split())]
    return rnd.choices([v for v, _ in weighted], [w for _, w in weighted])[0]


# --------------------------------------------------------------------------------------------------
# the tally


@dataclasses.dataclass
class Finding:
    target: str
    case: int
    kind: str
    cls: str  # the mutation class of the case
    detail: str
    sig: str  # what tells one failure from another: an exception's type and place, a signal, ...


@dataclasses.dataclass
class Tally:
    cases: int = 0
    counts: Counter = dataclasses.field(default_factory=Counter)
    outcomes: Counter = dataclasses.field(default_factory=Counter)
    classes: Counter = dataclasses.field(default_factory=Counter)
    notes: Counter = dataclasses.field(default_factory=Counter)
    skipped: int = 0
    seconds: float = 0.0


class Report:
    """Counts per target, and each failure found (with the case that reproduces it)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.tallies = {t: Tally() for t in TARGETS}
        self.findings: list[Finding] = []
        self.harness_errors: list[str] = []

    def add(self, target: str, case: int, kind: str, cls: str, detail: str, sig: str | None = None) -> None:
        self.tallies[target].counts[kind] += 1
        self.findings.append(Finding(target, case, kind, cls, one_line(detail, 400), sig or cls))

    @property
    def failures(self) -> int:
        return sum(sum(t.counts[k] for k in KINDS) for t in self.tallies.values())

    def table(self) -> str:
        head = "| target | cases | " + " | ".join(KIND_NAMES[k] for k in KINDS) + " | seconds |"
        rule = "|" + "---|" * (len(KINDS) + 3)
        rows = [head, rule]
        for name, t in self.tallies.items():
            if not t.cases:
                continue
            counts = " | ".join(str(t.counts[k]) for k in KINDS)
            rows.append(f"| {name} | {t.cases} | {counts} | {t.seconds:.0f} |")
        return "\n".join(rows)

    def groups(self) -> list[tuple[str, str, str, list[Finding]]]:
        """(target, kind, signature, findings), one row per kind of failure."""
        groups: dict[tuple[str, str, str], list[Finding]] = {}
        for f in self.findings:
            groups.setdefault((f.target, f.kind, f.sig), []).append(f)
        order = sorted(groups, key=lambda key: (TARGETS.index(key[0]), KINDS.index(key[1]), key[2]))
        return [(*key, groups[key]) for key in order]

    def text(self) -> str:
        lines = [f"maxsim fuzz (seed {self.seed})", self.table(), ""]
        for name, t in self.tallies.items():
            if not t.cases:
                continue
            outcomes = ", ".join(f"{k} {v}" for k, v in sorted(t.outcomes.items()))
            lines.append(f"{name}: outcomes: {outcomes}")
            if t.notes:
                lines.append(f"{name}: notes: " + ", ".join(f"{k} {v}" for k, v in sorted(t.notes.items())))
            if t.skipped:
                lines.append(f"{name}: {t.skipped} cases not run (the server crashed too often)")
        for target, kind, sig, found in self.groups():
            classes = Counter(f.cls for f in found)
            lines.append(
                f"{target} {kind} x{len(found)}: {sig}; classes: "
                + ", ".join(f"{c} {n}" for c, n in classes.most_common())
                + f"; cases {', '.join(str(f.case) for f in found[:6])}{' ...' if len(found) > 6 else ''}"
            )
            lines.append(
                f"    python -m tests.fuzz --seed {self.seed} --target {target} --case={found[0].case} -v  # "
                + found[0].detail
            )
        for error in self.harness_errors:
            lines.append(f"harness error: {error}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "targets": {
                name: {
                    "cases": t.cases,
                    "counts": {k: t.counts[k] for k in KINDS},
                    "outcomes": dict(t.outcomes),
                    "classes": dict(t.classes),
                    "notes": dict(t.notes),
                    "skipped": t.skipped,
                    "seconds": round(t.seconds, 1),
                }
                for name, t in self.tallies.items()
                if t.cases
            },
            "findings": [dataclasses.asdict(f) for f in self.findings],
            "harness_errors": self.harness_errors,
        }


# --------------------------------------------------------------------------------------------------
# the corpus every target scores against: 48 documents, dim 8, float16, one safetensors and one Arrow
# shard; ids with characters JSON escapes or spells in several bytes


CORPUS_IDS = [f"d{i}" for i in range(40)] + ['d"q', "d\\b", "dé", "日本", "😀x", "d/1", "d<>", "Ω"]


def corpus_values() -> list[np.ndarray]:
    rng = np.random.default_rng(20261206)
    return [rng.standard_normal((int(rng.integers(1, 9)), DIM)).astype(np.float16) for _ in CORPUS_IDS]


def make_corpus(folder: Path) -> Path:
    from maxsim_cli.shards import write_shard

    folder.mkdir(parents=True, exist_ok=True)
    values = corpus_values()
    write_shard(folder / "a.safetensors", CORPUS_IDS[:24], values[:24])
    write_shard(folder / "b.arrow", CORPUS_IDS[24:], values[24:])
    return folder


def maxsim_reference(queries: Sequence[np.ndarray], docs: Sequence[np.ndarray]) -> np.ndarray:
    """float64 MaxSim of each query against each document: ``[queries, documents]``."""
    out = np.empty((len(queries), len(docs)))
    for i, q in enumerate(queries):
        q64 = np.asarray(q, dtype=np.float64)
        for j, d in enumerate(docs):
            out[i, j] = (q64 @ np.asarray(d, dtype=np.float64).T).max(axis=1).sum()
    return out


def ranking_problem(
    got: Sequence[tuple[str, float]], ids: Sequence[str], ref: np.ndarray, bound: np.ndarray, k: int
) -> str | None:
    """Why ``got`` (a query's hits, best first) is not the top-``k`` of ``ids`` by the reference scores
    ``ref``, within ``bound`` (per document: what rounding may move a score by); None when it is."""
    index = {d: i for i, d in enumerate(ids)}
    if len(got) != min(k, len(ids)):
        return f"{len(got)} hits where top-{k} of {len(ids)} documents has {min(k, len(ids))}"
    seen = set()
    for docno, score in got:
        if docno not in index:
            return f"hit {docno!r} is not a document"
        if docno in seen:
            return f"hit {docno!r} twice"
        seen.add(docno)
        j = index[docno]
        if not math.isfinite(score) or abs(score - ref[j]) > bound[j]:
            return f"{docno!r} scored {score!r}, reference {ref[j]:.6g} (+/- {bound[j]:.2g})"
    scores = [s for _, s in got]
    if any(a < b for a, b in zip(scores, scores[1:], strict=False)):
        return "hits not in descending score order"
    if got:
        # a document left out must not be surely better than one kept
        weakest = min(ref[index[d]] + bound[index[d]] for d, _ in got)
        for d, j in index.items():
            if d not in seen and ref[j] - bound[j] > weakest:
                return f"{d!r} (reference {ref[j]:.6g}) left out of the top-{k}"
    return None


# --------------------------------------------------------------------------------------------------
# the sandbox: a warm process that forks one child per case


_SANDBOX_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); import fuzzing; fuzzing.sandbox_main()"
_PRELOAD = [
    "maxsim_cli.api",
    "maxsim_cli.cli",
    "maxsim_cli.scoring.entry",
    "maxsim_cli.scoring.engine",
    "maxsim_cli.scoring.files",
    "maxsim_cli.shards",
    "maxsim_cli.shards.readers",
    "maxsim_cli.shards.writers",
    "maxsim_cli.run_files",
    "maxsim_cli.inspect_shards",
    "pyarrow.ipc",
    "safetensors",
    "maxsim_cli.progress",
    "maxsim_cli.scoring.direct",
    "rich.progress",
    "rich.table",
    "numpy.ma",
    "pandas",
    "typer._adapters",  # what parsing a command line imports: 75 ms a command otherwise
    "pydantic",
]


def sandbox_main() -> None:
    """The sandbox process: imports torch and maxsim once (no torch work, so that forks are safe), then
    forks a child per request line on stdin and answers its exit code (``-N``: killed by signal N)."""
    import importlib

    import torch  # noqa: F401

    for name in _PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    _warm_up()
    with open(f"/proc/{os.getpid()}/status") as fh:
        vm = int(re.search(r"VmSize:\s+(\d+) kB", fh.read()).group(1)) * 1024
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    print(json.dumps({"ready": os.getpid()}), file=channel)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _sandbox_child(request, vm)
        deadline = time.monotonic() + request["timeout"]
        code, timed_out = None, False
        while code is None:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                timed_out = True
            else:
                time.sleep(0.002)
        print(json.dumps({"code": code, "timed_out": timed_out}), file=channel)


def _warm_up() -> None:
    """One search and one rerank before any fork: torch's first CPU matrix products (MKL, oneDNN) cost
    ~100 ms a process, which every child would pay again. On one thread, so that no OpenMP pool exists
    when the process forks (a forked child cannot use its parent's; maxsim's own CPU pool forgets itself
    in a forked child)."""
    import torch

    from maxsim_cli import Queries, open_corpus, rerank, search

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            corpus = make_corpus(Path(tmp) / "corpus")
            queries = Queries.from_embeddings(["w"], [np.ones((2, DIM), np.float32)])
            with open_corpus(str(corpus)) as opened:
                search(queries, opened, k=3, device="cpu")
                rerank(queries, opened, {"w": ["d1", "d2"]}, device="cpu")
                opened.to("cpu")
                search(queries, opened, k=3, device="cpu")
                rerank(queries, opened, {"w": ["d1", "d2"]}, device="cpu")


def _sandbox_child(request: dict[str, Any], vm: int) -> None:
    code = 0
    try:
        os.chdir(request["cwd"])
        stdin = request.get("stdin") or os.devnull
        os.dup2(os.open(stdin, os.O_RDONLY), 0)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.stdin = io.TextIOWrapper(os.fdopen(0, "rb", closefd=False))
        limit = vm + request.get("extra_memory", SANDBOX_EXTRA_ADDRESS_SPACE)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        faulthandler.enable()  # a crash prints the Python stack: where it died
        if request["fn"] == "cli":
            from maxsim_cli.cli import main

            try:
                main(request["args"]["argv"])
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:  # what the interpreter does with an exception main lets out
                traceback.print_exc()
                code = 1
        else:
            try:
                result = globals()[request["fn"]](request["args"])
            except BaseException:  # noqa: BLE001 - a bug of the harness's own, reported as such
                result = {"harness_error": traceback.format_exc()}
            Path(request["out"]).write_text(json.dumps(result))
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        with contextlib.suppress(BaseException):
            traceback.print_exc()
        code = 99
    os._exit(code)


class Sandbox:
    """The parent's side: ``run(fn, args)`` forks a child of the warm process to call ``fn(args)`` (a
    function of this module returning a JSON-able dict) or, for ``fn="cli"``, ``maxsim ARGV``."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self._start()

    def _start(self) -> None:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore", "MAXSIM_FUZZ": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SANDBOX_BOOT, str(TESTS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env=env,
            text=True,
        )
        first = self.proc.stdout.readline()
        if not first:
            raise RuntimeError("the fuzzing sandbox did not start")

    def run(
        self,
        fn: str,
        args: dict[str, Any],
        case_dir: Path,
        *,
        stdin: Path | None = None,
        timeout: float = SANDBOX_TIMEOUT_S,
    ) -> dict[str, Any]:
        """``{"code", "timed_out", "result" (fn's dict, or None), "stdout", "stderr"}``."""
        out = case_dir / f"{fn}.result.json"
        request = {
            "fn": fn,
            "args": args,
            "cwd": str(case_dir),
            "out": str(out),
            "stdout": str(case_dir / f"{fn}.stdout"),
            "stderr": str(case_dir / f"{fn}.stderr"),
            "stdin": str(stdin) if stdin else None,
            "timeout": timeout,
        }
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc = None
            raise RuntimeError("the fuzzing sandbox died")
        answer = json.loads(line)
        answer["result"] = json.loads(out.read_text()) if out.exists() else None
        answer["stdout"] = (case_dir / f"{fn}.stdout").read_bytes()
        answer["stderr"] = (case_dir / f"{fn}.stderr").read_text(errors="replace")
        return answer

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --------------------------------------------------------------------------------------------------
# server cases: HTTP requests


@dataclasses.dataclass
class HttpCase:
    path: str  # /search or /rerank
    content_type: str | None
    body: bytes
    query: str  # the raw query string (percent-encoded), "" for none
    cls: str
    note: str = ""


class ValidRequests:
    """Valid requests over the fuzzing corpus, as Python objects: queries of 1 to 6 tokens of float32
    values, qids of several kinds, candidates drawn from the corpus's ids and a few it does not hold."""

    def __init__(self, rnd: random.Random, rng: np.random.Generator) -> None:
        self.rnd, self.rng = rnd, rng

    def qid(self, i: int) -> str | int:
        return pick(
            self.rnd,
            [(f"q{i}", 6), (i + 7, 1), (f"é{i}", 1), (f'q"{i}', 1), (f"😀{i}", 1), (f"q\\{i}", 1)],
        )

    def vectors(self, tokens: int | None = None) -> np.ndarray:
        tokens = tokens or self.rnd.randint(1, 6)
        return self.rng.standard_normal((tokens, DIM)).astype(np.float32)

    def queries(self, n: int | None = None) -> list[tuple[str | int, np.ndarray]]:
        n = n or pick(self.rnd, [(1, 5), (2, 3), (3, 2), (5, 1)])
        qids: list[str | int] = []
        while len(qids) < n:
            qid = self.qid(len(qids))
            if str(qid) not in {str(q) for q in qids}:
                qids.append(qid)
        return [(qid, self.vectors()) for qid in qids]

    def candidates(self, qids: Sequence[str | int], strict: bool) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for qid in qids:
            if self.rnd.random() < 0.15:
                continue  # a query without candidates
            docnos = self.rnd.sample(CORPUS_IDS, self.rnd.randint(0, 10))
            if not strict and self.rnd.random() < 0.3:
                docnos.insert(self.rnd.randint(0, len(docnos)), f"absent{self.rnd.randint(0, 99)}")
            out[str(qid)] = docnos
        return out

    def request(self, kind: str) -> dict[str, Any]:
        queries = self.queries()
        body: dict[str, Any] = {
            "queries": [{"qid": qid, "embedding": vectors.tolist()} for qid, vectors in queries]
        }
        if kind == "search":
            if self.rnd.random() < 0.8:
                body["k"] = pick(self.rnd, [(self.rnd.randint(1, 12), 4), (self.rnd.randint(13, 60), 1)])
        else:
            strict = self.rnd.random() < 0.15
            body["candidates"] = self.candidates([qid for qid, _ in queries], strict)
            if self.rnd.random() < 0.5:
                body["k"] = self.rnd.randint(1, 8)
            if strict or self.rnd.random() < 0.2:
                body["strict"] = strict
        return body


# Numbers and texts that break naive readers.
EXTREME_K = [
    0,
    -1,
    2**31 - 1,
    2**31,
    2**32,
    2**63 - 1,
    2**63,
    2**64,
    10**30,
    -(2**63),
    2.5,
    1.0,
    1e3,
    1e308,
    True,
    False,
    "10",
    "",
    None,
    [],
    {},
    [5],
]
ODD_QIDS = [
    "",
    " ",
    "q 1",
    "q\t1",
    "q\n1",
    "\u200b",
    "q\u200bx",
    "\ufeffq",
    "\x00",
    "\x7f",
    "\u0085",
    "\ud800",
    "\udfff",
    "x" * 5000,
    1.5,
    -1,
    10**30,
    -(10**30),
    True,
    None,
    [],
    {},
    "q0",
]
ODD_VALUES = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e39",
    "-1e39",
    "1e400",
    "65504",
    "65520",
    "1e5",
    "-1e5",
    "3.4e38",
    "1e-45",
    "5e-324",
    "-0.0",
    "0",
    "1" + "0" * 400,
    "1" * 5000,
    "0." + "1" * 5000,
    "true",
    "null",
    '"1.0"',
    "[]",
    "{}",
    "[1.0]",
]
ODD_DOCNOS = [
    "",
    "d 1",
    "d\n1",
    "\x00",
    "\ud800",
    "\u200b",
    "d" * 10000,
    5,
    None,
    True,
    1.5,
    [],
    {},
    'd"q',
    "d\\b",
    "日本",
    "😀x",
    "absent",
]


def _body_text(obj: Any, raw: dict[str, str] | None = None) -> bytes:
    """``obj`` as JSON, with each string placeholder in ``raw`` replaced by its raw JSON text (numbers
    and literals Python's encoder would not write)."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=True)
    for marker, replacement in (raw or {}).items():
        text = text.replace(json.dumps(marker), replacement)
    return text.encode("utf-8", "surrogatepass")


def mutate_bytes(
    rnd: random.Random, data: bytes, interesting: bytes = b'[]{},:"\\0-e.\x00\xff'
) -> tuple[bytes, str]:
    """One to four byte-level edits: bit flips, a byte set, a cut, an insertion, a span repeated or
    removed, a 1/2/4/8-byte little-endian integer overwritten with an extreme value."""
    out = bytearray(data)
    notes = []
    for _ in range(pick(rnd, [(1, 5), (2, 2), (4, 1)])):
        if not out:
            break
        op = pick(rnd, "flip:4 set:3 truncate:2 insert:2 repeat:1 delete:1 int:3")
        at = rnd.randrange(len(out))
        if op == "flip":
            out[at] ^= 1 << rnd.randrange(8)
        elif op == "set":
            out[at] = rnd.choice(interesting) if rnd.random() < 0.6 else rnd.randrange(256)
        elif op == "truncate":
            del out[at:]
        elif op == "insert":
            out[at:at] = bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 8)))
        elif op == "repeat":
            span = out[at : at + rnd.randint(1, 64)]
            out[at:at] = span * rnd.randint(1, 3)
        elif op == "delete":
            del out[at : at + rnd.randint(1, 64)]
        else:
            width = rnd.choice([1, 2, 4, 8])
            at -= at % width
            if at + width > len(out):
                continue
            value = rnd.choice(
                [0, 1, -1, 2 ** (8 * width - 1) - 1, -(2 ** (8 * width - 1)), len(data), len(data) + 1]
            )
            out[at : at + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
        notes.append(f"{op}@{at}")
    return bytes(out), " ".join(notes)


def json_case(rnd: random.Random, rng: np.random.Generator, kind: str) -> HttpCase:
    valid = ValidRequests(rnd, rng)
    body = valid.request(kind)
    path = f"/{kind}"
    cls = pick(
        rnd,
        [
            ("valid", 14),
            ("k", 7),
            ("strict", 2 if kind == "rerank" else 0),
            ("qid", 7),
            ("embedding", 10),
            ("queries", 4),
            ("candidates", 8 if kind == "rerank" else 0),
            ("fields", 3),
            ("text", 6),
            ("bytes", 12),
            ("content-type", 2),
            ("params", 2),
        ],
    )
    raw: dict[str, str] = {}
    note = ""
    content_type: str | None = JSON_TYPE
    query = ""
    queries = body["queries"]
    q = rnd.choice(queries)
    if cls == "k":
        value = rnd.choice(EXTREME_K + ["BIGINT", "LONGFLOAT"])
        if value == "BIGINT":
            raw["BIGINT"] = "1" + "0" * rnd.choice([20, 400, 5000])
        elif value == "LONGFLOAT":
            raw["LONGFLOAT"] = "1." + "0" * 5000
        body["k"] = value
        note = f"k={str(value)[:40]}"
    elif cls == "strict":
        body["strict"] = rnd.choice([1, 0, "true", None, [], "false", 2.0])
        note = f"strict={body['strict']!r}"
    elif cls == "qid":
        how = rnd.choice(["odd", "duplicate", "missing"])
        if how == "odd" or len(queries) == 1:
            q["qid"] = rnd.choice(ODD_QIDS)
            note = f"qid={str(q['qid'])[:40]!r}"
        elif how == "duplicate":
            queries[-1]["qid"] = queries[0]["qid"]
            note = "duplicate qid"
        else:
            del q["qid"]
            note = "no qid"
        if kind == "rerank":  # candidates follow the qid, or not
            if (
                rnd.random() < 0.5
                and "qid" in q
                and isinstance(q["qid"], (str, int))
                and not isinstance(q["qid"], bool)
            ):
                body["candidates"][str(q["qid"])] = rnd.sample(CORPUS_IDS, 3)
    elif cls == "embedding":
        how = rnd.choice(["value", "value", "dim", "ragged", "empty", "nested", "type", "tokens", "huge-dim"])
        rows = q["embedding"]
        if how == "value":
            value = rnd.choice(ODD_VALUES)
            raw["ODDVALUE"] = value
            rows[rnd.randrange(len(rows))][rnd.randrange(DIM)] = "ODDVALUE"
            if rnd.random() < 0.3:  # the same value everywhere
                q["embedding"] = [["ODDVALUE"] * DIM for _ in rows]
            note = f"value {value[:30]}"
        elif how == "dim":
            width = rnd.choice([0, 1, DIM - 1, DIM + 1, 384])
            q["embedding"] = [
                valid.vectors(1)[0].tolist()[:width] + [0.5] * max(0, width - DIM) for _ in rows
            ]
            note = f"dim {width}"
        elif how == "ragged":
            rows.append(rows[0][: rnd.randint(0, DIM - 1)])
            note = "ragged rows"
        elif how == "empty":
            q["embedding"] = rnd.choice([[], [[]], [[], []]])
            note = f"embedding {q['embedding']}"
        elif how == "nested":
            q["embedding"] = rnd.choice([[rows], [[[0.5] * DIM]], [[0.5] * DIM], 0.5])
            note = "nesting"
        elif how == "type":
            q["embedding"] = rnd.choice([None, "x", {"0": [0.5] * DIM}, [None] * 2, [["0.5"] * DIM], True])
            note = f"embedding {str(q['embedding'])[:30]}"
        elif how == "tokens":
            count = rnd.choice([300, 2000])
            q["embedding"] = valid.vectors(count).tolist()
            note = f"{count} tokens"
        else:
            q["embedding"] = [[0.25] * rnd.choice([10_000, 100_000])]
            note = "one token of a huge dim"
    elif cls == "queries":
        how = rnd.choice(["empty", "null", "object", "missing", "many", "item", "string"])
        if how == "empty":
            body["queries"] = []
        elif how == "null":
            body["queries"] = None
        elif how == "object":
            body["queries"] = {"q0": queries[0]}
        elif how == "missing":
            del body["queries"]
        elif how == "many":
            n = rnd.choice([100, 300])
            body["queries"] = [{"qid": f"m{i}", "embedding": valid.vectors(1).tolist()} for i in range(n)]
            if kind == "rerank":
                body["candidates"] = {f"m{i}": rnd.sample(CORPUS_IDS, 2) for i in range(0, n, 3)}
        elif how == "item":
            queries[rnd.randrange(len(queries))] = rnd.choice([None, [], "q", 5, [[0.5] * DIM]])
        else:
            body["queries"] = "queries"
        note = how
    elif cls == "candidates":
        cands = body["candidates"]
        how = rnd.choice(["unknown-qid", "duplicate", "docno", "docno", "type", "missing", "many", "empty"])
        target = str(q["qid"])
        if how == "unknown-qid":
            cands["not-a-query"] = ["d1"]
        elif how == "duplicate":
            cands[target] = ["d1", "d2", "d1"]
        elif how == "docno":
            cands.setdefault(target, []).append(rnd.choice(ODD_DOCNOS))
        elif how == "type":
            body["candidates"] = rnd.choice([None, [], ["d1"], "d1", {target: "d1"}, {target: None}, 5])
        elif how == "missing":
            del body["candidates"]
        elif how == "many":
            cands[target] = [f"absent{i}" for i in range(rnd.choice([1000, 20000]))] + CORPUS_IDS
        else:
            body["candidates"] = {}
        note = how
    elif cls == "fields":
        how = rnd.choice(["top", "query", "dup-key", "dup-query-key"])
        if how == "top":
            body[rnd.choice(["kk", "K", "", "queries ", "\ud800"])] = 1
        elif how == "query":
            q[rnd.choice(["mask", "id", "qid2"])] = [1] * len(q.get("embedding", []))
        note = how
        if how.startswith("dup"):
            data = _body_text(body, raw)
            if how == "dup-key":
                data = data[:-1] + b', "queries": []}'
            else:
                data = data.replace(b'"qid": ', b'"qid": "other", "qid": ', 1)
            return HttpCase(path, content_type, data, query, f"json/{cls}", note)
    elif cls == "text":
        data = _body_text(body, raw)
        how = rnd.choice(["bad-utf8", "escape", "bom", "comment", "trailing-comma", "deep", "spaces", "nul"])
        if how == "bad-utf8":
            data = (
                data.replace(b'"qid": "', b'"qid": "\xff\xfe', 1) if b'"qid": "' in data else b"\xff" + data
            )
        elif how == "escape":
            esc = rnd.choice([r"\u0000", r"\ud800", r"\udc00\ud800", r"\u005b", r"\"", r"\\", r"\u0020"])
            data = data.replace(b'"qid": "', b'"qid": "' + esc.encode(), 1) if b'"qid": "' in data else data
            note = esc
        elif how == "bom":
            data = "\ufeff".encode() + data
        elif how == "comment":
            data = b"/* c */" + data
        elif how == "trailing-comma":
            data = data[:-1] + b",}"
        elif how == "deep":
            depth = rnd.choice([100, 10_000, 200_000])
            data = data[:-1] + b', "k": ' + b"[" * depth + b"]" * depth + b"}"
            note = f"depth {depth}"
        elif how == "spaces":
            data = b" \n\t " + data.replace(b",", b" ,\n ") + b"\n\n"
        else:
            data = data + b"\x00"
        return HttpCase(path, content_type, data, query, f"json/{cls}", note or how)
    elif cls == "bytes":
        data, note = mutate_bytes(rnd, _body_text(body, raw))
        return HttpCase(path, content_type, data, query, f"json/{cls}", note)
    elif cls == "content-type":
        content_type = rnd.choice(
            [
                None,
                "text/plain",
                "application/json; charset=latin-1",
                "APPLICATION/JSON",
                ARROW_TYPE,
                "multipart/form-data; boundary=x",
                "",
                "application/json;;;",
                "application/x-ndjson",
            ]
        )
        note = f"content-type {content_type!r}"
    elif cls == "params":
        query = rnd.choice(["k=5", "strict=true", "x=1", "k=5&k=6"])
        note = query
    return HttpCase(path, content_type, _body_text(body, raw), query, f"json/{cls}", note)


# Arrow query streams


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16 bit patterns (round to nearest even), held as uint16."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _int8_codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scales = np.abs(values).max(axis=1) / 127
    scales[scales == 0] = 1
    codes = np.clip(np.round(values / scales[:, None]), -127, 127).astype(np.int8)
    return codes, scales.astype(np.float32)


ARROW_VALUE_TYPES = {"float16": "float16", "float32": "float32", "bfloat16": "uint16", "int8": "int8"}


def arrow_columns(
    ids: Sequence[str], vectors: Sequence[np.ndarray], dtype: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """A query shard's columns (``id``, ``embedding``, ``scales`` for int8) and its metadata."""
    import pyarrow as pa

    packed = np.concatenate(vectors) if vectors else np.zeros((0, DIM), np.float32)
    offsets = np.zeros(len(vectors) + 1, dtype=np.int32)
    np.cumsum([len(v) for v in vectors], out=offsets[1:])
    scales = None
    if dtype == "float16":
        values = packed.astype(np.float16)
    elif dtype == "bfloat16":
        values = _bf16_bits(packed)
    elif dtype == "int8":
        values, scales = _int8_codes(packed)
    else:
        values = packed.astype(np.float32)
    value_type = getattr(pa, ARROW_VALUE_TYPES[dtype])()
    flat = pa.array(values.reshape(-1), type=value_type)
    tokens = pa.FixedSizeListArray.from_arrays(flat, DIM)
    columns: dict[str, Any] = {
        "id": pa.array(list(ids), type=pa.string()),
        "embedding": pa.ListArray.from_arrays(pa.array(offsets), tokens),
    }
    if scales is not None:
        columns["scales"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(scales, type=pa.float32()))
    metadata = {
        "format": "maxsim-shard",
        "format_version": "1",
        "dim": str(DIM),
        "dtype": dtype,
        "quantization": "int8-per-token" if dtype == "int8" else "none",
        "normalized": "false",
        "num_docs": str(len(ids)),
        "num_tokens": str(int(offsets[-1])),
    }
    return columns, metadata


def arrow_bytes(
    columns: dict[str, Any], metadata: dict[str, str] | None, batches: int = 1, *, empty_batch: bool = False
) -> bytes:
    """The columns as an Arrow IPC stream (split in ``batches`` record batches)."""
    import pyarrow as pa

    names = list(columns)
    arrays = list(columns.values())
    schema = pa.schema([pa.field(n, a.type) for n, a in zip(names, arrays, strict=True)], metadata=metadata)
    batch = pa.RecordBatch.from_arrays(arrays, schema=schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        if empty_batch:
            writer.write_batch(batch.slice(0, 0))
        step = max(1, math.ceil(batch.num_rows / max(1, batches)))
        for start in range(0, batch.num_rows, step):
            writer.write_batch(batch.slice(start, step))
    return sink.getvalue().to_pybytes()


def _patch_buffer(rnd: random.Random, data: bytes, buffer: bytes, width: int) -> tuple[bytes, str] | None:
    """Overwrite one integer of ``buffer`` (found once in the serialized ``data``) with an extreme
    value: the offsets of a string or list column made to point past their data, backwards, negative."""
    if len(buffer) < 8 or data.count(buffer) != 1:
        return None
    at = data.index(buffer)
    count = len(buffer) // width
    i = rnd.randrange(count)
    fmt = {4: "<i", 8: "<q"}[width]
    old = struct.unpack_from(fmt, buffer, i * width)[0]
    last = struct.unpack_from(fmt, buffer, (count - 1) * width)[0]
    value = rnd.choice(
        [
            old + 1,
            old - 1,
            last + 1,
            last + 1000,
            -1,
            -(2 ** (8 * width - 1)),
            2 ** (8 * width - 1) - 1,
            0,
            2**31 - 1,
        ]
    )
    out = bytearray(data)
    struct.pack_into(fmt, out, at + i * width, value)
    return bytes(out), f"element {i} of {count}: {old} -> {value}"


def _strings_from_buffers(values: Sequence[bytes], offsets: Sequence[int] | None = None) -> Any:
    """A utf8 array over raw bytes (not checked as UTF-8) and, when given, raw offsets."""
    import pyarrow as pa

    data = b"".join(values)
    if offsets is None:
        offsets = [0]
        for v in values:
            offsets.append(offsets[-1] + len(v))
    buf = pa.py_buffer(np.array(offsets, dtype=np.int32).tobytes())
    return pa.Array.from_buffers(pa.string(), len(offsets) - 1, [None, buf, pa.py_buffer(data)])


def arrow_case(rnd: random.Random, rng: np.random.Generator, kind: str) -> HttpCase:
    import pyarrow as pa

    valid = ValidRequests(rnd, rng)
    path = f"/{kind}"
    dtype = pick(rnd, "float32:3 float16:3 bfloat16:1 int8:1")
    queries = valid.queries(pick(rnd, [(1, 3), (2, 3), (4, 2), (8, 1)]))
    ids = [str(qid) for qid, _ in queries]
    vectors = [v for _, v in queries]
    strict = kind == "rerank" and rnd.random() < 0.15
    cands = valid.candidates(ids, strict)
    params: list[tuple[str, str]] = []
    if kind == "search" and rnd.random() < 0.7:
        params.append(("k", str(rnd.randint(1, 60))))
    if kind == "rerank":
        if rnd.random() < 0.5:
            params.append(("k", str(rnd.randint(1, 8))))
        if strict or rnd.random() < 0.2:
            params.append(("strict", rnd.choice(["true", "1"]) if strict else rnd.choice(["false", "0"])))
    cls = pick(
        rnd, "valid:10 buffers:12 offsets-mid:6 utf8:5 schema:8 metadata:5 values:5 rows:6 bytes:12 params:8"
    )
    columns, metadata = arrow_columns(ids, vectors, dtype)
    if kind == "rerank":
        columns["candidates"] = pa.array([cands.get(i, []) for i in ids], type=pa.list_(pa.string()))
    note = ""
    batches = 1
    empty_batch = False
    data: bytes | None = None
    if cls == "valid":
        batches = pick(rnd, [(1, 4), (2, 1)])
        empty_batch = rnd.random() < 0.1
    elif cls == "buffers":
        data = arrow_bytes(columns, metadata)
        # every buffer of every column (and of its children) is a target
        targets = []
        for name, array in columns.items():
            stack = [(name, array)]
            while stack:
                label, arr = stack.pop()
                for b_index, buf in enumerate(arr.buffers()):
                    if buf is not None and b_index > 0:
                        targets.append((label, b_index, buf))
                if isinstance(arr.type, (pa.ListType, pa.FixedSizeListType)):
                    stack.append((label + ".item", arr.values))
        rnd.shuffle(targets)
        for label, b_index, buf in targets:
            is_offsets = b_index == 1 and (
                pa.types.is_string(_type_at(columns, label)) or pa.types.is_list(_type_at(columns, label))
            )
            patched = _patch_buffer(rnd, data, buf.to_pybytes(), 4) if is_offsets else None
            if patched is None and rnd.random() < 0.5:
                continue
            if patched is None:
                raw = buf.to_pybytes()
                if len(raw) < 8 or data.count(raw) != 1:
                    continue
                at = data.index(raw) + rnd.randrange(len(raw))
                out = bytearray(data)
                out[at] ^= 1 << rnd.randrange(8)
                patched = (bytes(out), f"bit flip in buffer {b_index}")
            data, detail = patched
            note = f"{label} buffer {b_index}: {detail}"
            break
        else:
            data, note = mutate_bytes(rnd, data)
    elif cls == "offsets-mid":
        # a string offset in the middle past the data, the last one in range: passes Arrow's cheap checks
        column = rnd.choice(["candidates", "id"] if kind == "rerank" else ["id"])
        if column == "id":
            strings = [s.encode() for s in ids]
        else:
            strings = [d.encode() for c in columns["candidates"].to_pylist() for d in c]
        if len(strings) >= 2:
            offsets = [0]
            for s in strings:
                offsets.append(offsets[-1] + len(s))
            i = rnd.randint(1, len(strings) - 1)
            offsets[i] = rnd.choice([offsets[-1] + 1, offsets[-1] + 4096, 2**31 - 1, 2**30])
            array = _strings_from_buffers(strings, offsets)
            if column == "id":
                columns["id"] = array
            else:
                columns["candidates"] = pa.ListArray.from_arrays(columns["candidates"].offsets, array)
            note = f"{column} string offset {i} -> {offsets[i]} of {offsets[-1]} bytes"
        else:
            note = "too few strings: unchanged"
    elif cls == "utf8":
        how = rnd.choice(
            ["id", "candidate", "field-name", "metadata"]
            if kind == "rerank"
            else ["id", "field-name", "metadata"]
        )
        bad = rnd.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xc0\xaf"])
        if how == "id":
            columns["id"] = _strings_from_buffers(
                [s.encode() + (bad if j == 0 else b"") for j, s in enumerate(ids)]
            )
        elif how == "candidate":
            flat = [d.encode() for c in columns["candidates"].to_pylist() for d in c] or [b"d1"]
            flat[0] += bad
            lists = (
                columns["candidates"].offsets
                if len(columns["candidates"].values)
                else pa.array([0] + [1] * len(ids), pa.int32())
            )
            columns["candidates"] = pa.ListArray.from_arrays(lists, _strings_from_buffers(flat))
        else:
            placeholder = "zq" * 4
            if how == "field-name":
                name = rnd.choice([n for n in columns])
                columns = {(placeholder if n == name else n): a for n, a in columns.items()}
            else:
                metadata[rnd.choice(["dtype", placeholder])] = placeholder
            data = arrow_bytes(columns, metadata)
            data = data.replace(placeholder.encode(), (bad * 8)[: len(placeholder)])
        note = f"{how} {bad!r}"
    elif cls == "schema":
        how = rnd.choice(
            (
                "embedding-flat fixed-dim id-int id-large drop-id drop-embedding extra duplicate-name "
                "candidates-int candidates-string candidates-large dictionary value-type scales-float"
            ).split()
        )
        emb = columns["embedding"]
        if how == "embedding-flat":
            columns["embedding"] = pa.ListArray.from_arrays(emb.offsets, emb.values.flatten())
        elif how == "fixed-dim":  # the same values as vectors of another width
            width = rnd.choice([1, DIM // 2, DIM * 2])
            flat = emb.values.flatten()
            tokens = len(flat) // width
            ends = np.minimum(emb.offsets.to_numpy() * DIM // width, tokens).astype(np.int32)
            vectors_of_width = pa.FixedSizeListArray.from_arrays(flat.slice(0, tokens * width), width)
            columns["embedding"] = pa.ListArray.from_arrays(pa.array(ends), vectors_of_width)
        elif how == "id-int":
            columns["id"] = pa.array(list(range(len(ids))), pa.int64())
        elif how == "id-large":
            columns["id"] = pa.array(ids, pa.large_string())
        elif how == "drop-id":
            del columns["id"]
        elif how == "drop-embedding":
            del columns["embedding"]
        elif how == "extra":
            columns[rnd.choice(["extra", "length", "mask"])] = pa.array(list(range(len(ids))), pa.int64())
        elif how == "duplicate-name":
            columns = dict(columns)
            data = arrow_bytes({**columns, "idx": columns["id"]}, metadata)
            data = data.replace(b"idx\x00", b"id\x00\x00", 1)
        elif how == "value-type":
            columns["embedding"] = (
                pa.ListArray.from_arrays(
                    emb.offsets,
                    pa.FixedSizeListArray.from_arrays(emb.values.flatten().cast(pa.float64()), DIM),
                )
                if dtype != "bfloat16"
                else emb
            )
        elif how == "scales-float":
            columns["scales"] = pa.ListArray.from_arrays(
                emb.offsets, pa.array(np.ones(int(emb.offsets[-1].as_py()), np.float32))
            )
        elif kind == "rerank":
            c = columns["candidates"]
            if how == "candidates-int":
                columns["candidates"] = pa.ListArray.from_arrays(
                    c.offsets, pa.array(range(len(c.values)), pa.int64())
                )
            elif how == "candidates-string":
                columns["candidates"] = pa.array([",".join(x) for x in c.to_pylist()], pa.string())
            elif how == "candidates-large":
                columns["candidates"] = c.cast(pa.large_list(pa.large_string()))
            else:
                columns["candidates"] = pa.ListArray.from_arrays(c.offsets, c.values.dictionary_encode())
        else:
            columns["id"] = columns["id"].dictionary_encode()
        note = how
    elif cls == "metadata":
        how = rnd.choice("dim dtype num_docs num_tokens format format_version drop none quantization".split())
        if how == "none":
            metadata = None
        elif how == "drop":
            del metadata[rnd.choice(list(metadata))]
        else:
            metadata[how] = rnd.choice(
                ["", "0", "-1", "2", "7", "99999999999999999999", "float16", "int8", "x", "1.0", "١", "²"]
            )
        note = f"{how}={None if metadata is None else metadata.get(how)!r}"
    elif cls == "values":
        how = rnd.choice(["nan", "inf", "fp16-overflow", "huge", "zeros", "scales"])
        where = rnd.randrange(len(vectors))
        if how == "nan":
            vectors[where][0, rnd.randrange(DIM)] = np.nan
        elif how == "inf":
            vectors[where][-1, 0] = -np.inf
        elif how == "fp16-overflow":
            vectors[where][:] = 70000.0
        elif how == "huge":
            vectors[where][:] = 3.0e38
        elif how == "zeros":
            vectors[where][:] = 0.0
        if how == "scales" and dtype == "int8":
            cols, metadata = arrow_columns(ids, vectors, dtype)
            s = cols["scales"]
            flat = s.values.to_numpy().copy()
            flat[rnd.randrange(len(flat))] = rnd.choice([-1.0, np.nan, np.inf, 0.0, 1e38])
            cols["scales"] = pa.ListArray.from_arrays(s.offsets, pa.array(flat, pa.float32()))
        else:
            cols, metadata = arrow_columns(ids, vectors, dtype)
        columns.update(cols)
        note = how
    elif cls == "rows":
        how = rnd.choice(
            (
                "duplicate empty-id space-id null-id null-embedding "
                "null-candidates null-docno empty-tokens no-rows batches many"
            ).split()
        )
        if how == "duplicate" and len(ids) > 1:
            ids[-1] = ids[0]
        elif how == "empty-id":
            ids[0] = ""
        elif how == "space-id":
            ids[0] = rnd.choice(["a b", "a\tb", "a\u200bb", "\x00"])
        elif how == "empty-tokens":
            vectors[0] = vectors[0][:0]
        elif how == "many":
            n = rnd.choice([100, 300])
            ids = [f"m{i}" for i in range(n)]
            vectors = [valid.vectors(1) for _ in range(n)]
        if how in ("duplicate", "empty-id", "space-id", "empty-tokens", "many"):
            cols, metadata = arrow_columns(ids, vectors, dtype)
            columns.update(cols)
            if kind == "rerank":
                columns["candidates"] = pa.array(
                    [cands.get(i, ["d1"]) for i in ids], type=pa.list_(pa.string())
                )
        elif how == "null-id":
            columns["id"] = pa.array([None] + ids[1:], pa.string())
        elif how == "null-embedding":
            emb = columns["embedding"]
            mask = pa.array([True] + [False] * (len(ids) - 1))
            columns["embedding"] = pa.ListArray.from_arrays(emb.offsets, emb.values, mask=mask)
        elif how == "null-candidates" and kind == "rerank":
            c = columns["candidates"]
            columns["candidates"] = pa.array([None] + c.to_pylist()[1:], pa.list_(pa.string()))
        elif how == "null-docno" and kind == "rerank":
            columns["candidates"] = pa.array(
                [[None, "d1"]] + columns["candidates"].to_pylist()[1:], pa.list_(pa.string())
            )
        elif how == "no-rows":
            columns = {n: a.slice(0, 0) for n, a in columns.items()}
            metadata["num_docs"] = metadata["num_tokens"] = "0"
        elif how == "batches":
            batches = rnd.choice([2, 3, len(ids)])
            empty_batch = rnd.random() < 0.5
        note = how
    elif cls == "bytes":
        data, note = mutate_bytes(rnd, arrow_bytes(columns, metadata), interesting=b"\x00\xff\x7f\x80\x01")
    elif cls == "params":
        name = rnd.choice(["k", "k", "strict", "other", "repeat", "raw"])
        value = rnd.choice(
            [
                "0",
                "-1",
                "",
                "²",
                "٣",
                "1" * 5000,
                "1e3",
                "+5",
                " 5",
                "05",
                "0x10",
                str(2**63),
                str(2**64),
                "true",
                "yes",
                "TRUE",
                "5.0",
            ]
        )
        if name == "repeat":
            params = [("k", "1"), ("k", "2")]
        elif name == "raw":
            params = []
            note = "raw"
        else:
            params = [p for p in params if p[0] != name] + [(name, value)]
        note = note or f"{name}={value[:20]!r}"
        query = urllib.parse.urlencode(params)
        if name == "raw":
            query = rnd.choice("k=%FF k=% k=%C2 strict=%00 k=1%00 %FF=1 k && k=5;strict=1".split())
            note = query
        body = arrow_bytes(columns, metadata)
        return HttpCase(path, ARROW_TYPE, body, query, f"arrow/{cls}", note)
    if data is None:
        try:
            data = arrow_bytes(columns, metadata, batches, empty_batch=empty_batch)
        except (pa.ArrowException, ValueError, TypeError) as exc:  # pyarrow refused to write it
            data = arrow_bytes(*arrow_columns(ids[:1], vectors[:1], dtype))
            note += f" (not writable: {one_line(exc, 60)})"
    return HttpCase(path, ARROW_TYPE, data, urllib.parse.urlencode(params), f"arrow/{cls}", note)


def _type_at(columns: dict[str, Any], label: str) -> Any:
    name, *items = label.split(".")
    t = columns[name].type
    for _ in items:
        t = t.value_type
    return t


def server_case(seed: int, index: int) -> HttpCase:
    """Case ``index`` of the server: drawn from its seed, or (``index`` < 0) one of `KNOWN_SERVER`."""
    rnd, rng = case_rng(seed, "server", index)
    if index < 0:
        return KNOWN_SERVER[-index - 1](rnd, rng)
    kind = rnd.choice(["search", "rerank"])
    return json_case(rnd, rng, kind) if rnd.random() < 0.55 else arrow_case(rnd, rng, kind)


# Inputs that once failed, built on purpose rather than drawn (every run starts with them): case -1 is
# the first. Each is named by what it does to a valid request.


def _known_arrow(
    rnd: random.Random, rng: np.random.Generator, kind: str, dtype: str = "float32"
) -> tuple[dict, dict, list[str]]:
    import pyarrow as pa

    valid = ValidRequests(rnd, rng)
    ids = ["q0", "q1", "q2"]
    columns, metadata = arrow_columns(ids, [valid.vectors(2) for _ in ids], dtype)
    if kind == "rerank":
        columns["candidates"] = pa.array([["d1", "d2"], ["d3", "d4", "d5"], ["d6"]], pa.list_(pa.string()))
    return columns, metadata, ids


def _known_offsets_past_the_data(rnd: random.Random, rng: np.random.Generator) -> HttpCase:
    import pyarrow as pa

    columns, metadata, _ = _known_arrow(rnd, rng, "rerank")
    strings = [b"d1", b"d2", b"d3", b"d4", b"d5", b"d6"]
    offsets = [0, 2, 4, 2**31 - 1, 8, 10, 12]  # the middle one far past the data, the last in range
    columns["candidates"] = pa.ListArray.from_arrays(
        columns["candidates"].offsets, _strings_from_buffers(strings, offsets)
    )
    body = arrow_bytes(columns, metadata)
    return HttpCase(
        "/rerank", ARROW_TYPE, body, "", "known/arrow-offsets", "a candidates string offset past its data"
    )


def _known_field_name(rnd: random.Random, rng: np.random.Generator) -> HttpCase:
    columns, metadata, _ = _known_arrow(rnd, rng, "search")
    columns["zqzq"] = columns.pop("id")
    body = arrow_bytes(columns, metadata).replace(b"zqzq", b"\xff\xfe\xfd\xfc")
    return HttpCase(
        "/search", ARROW_TYPE, body, "", "known/arrow-field-name", "a field name that is not UTF-8"
    )


def _known_docno_not_utf8(rnd: random.Random, rng: np.random.Generator) -> HttpCase:
    import pyarrow as pa

    columns, metadata, _ = _known_arrow(rnd, rng, "rerank")
    strings = [b"d1", b"d\xff", b"d3", b"d4", b"d5", b"d6"]
    columns["candidates"] = pa.ListArray.from_arrays(
        columns["candidates"].offsets, _strings_from_buffers(strings)
    )
    return HttpCase(
        "/rerank",
        ARROW_TYPE,
        arrow_bytes(columns, metadata),
        "",
        "known/arrow-docno",
        "a docno that is not UTF-8",
    )


def _known_k(query: str, note: str) -> Callable[[random.Random, np.random.Generator], HttpCase]:
    def build(rnd: random.Random, rng: np.random.Generator) -> HttpCase:
        columns, metadata, _ = _known_arrow(rnd, rng, "search")
        return HttpCase("/search", ARROW_TYPE, arrow_bytes(columns, metadata), query, "known/arrow-k", note)

    return build


def _known_json(
    kind: str, raw_k: str | None, value: str | None, cls: str, note: str
) -> Callable[..., HttpCase]:
    def build(rnd: random.Random, rng: np.random.Generator) -> HttpCase:
        body = ValidRequests(rnd, rng).request(kind)
        raw = {}
        if raw_k is not None:
            body["k"] = "RAWK"
            raw["RAWK"] = raw_k
        if value is not None:
            body["queries"][0]["embedding"] = [["RAWV"] * DIM]
            raw["RAWV"] = value
        return HttpCase(f"/{kind}", JSON_TYPE, _body_text(body, raw), "", cls, note)

    return build


def _known_values(kind: str) -> Callable[..., HttpCase]:
    def build(rnd: random.Random, rng: np.random.Generator) -> HttpCase:
        columns, metadata, ids = _known_arrow(rnd, rng, kind, "float32")
        columns.update(arrow_columns(ids, [np.full((2, DIM), 3.0e38, np.float32) for _ in ids], "float32")[0])
        return HttpCase(
            f"/{kind}",
            ARROW_TYPE,
            arrow_bytes(columns, metadata),
            "",
            "known/arrow-values",
            "float32 values past float16's range",
        )

    return build


def _known_metadata(rnd: random.Random, rng: np.random.Generator) -> HttpCase:
    columns, metadata, _ = _known_arrow(rnd, rng, "search")
    metadata["num_docs"] = "\u00b2"
    return HttpCase(
        "/search", ARROW_TYPE, arrow_bytes(columns, metadata), "", "known/arrow-metadata", "num_docs='\u00b2'"
    )


KNOWN_SERVER: list[Callable[[random.Random, np.random.Generator], HttpCase]] = [
    _known_offsets_past_the_data,
    _known_field_name,
    _known_docno_not_utf8,
    _known_k("k=%C2%B2", "k=\u00b2"),
    _known_k("k=" + "1" * 5000, "k of 5,000 digits"),
    _known_json("search", "1" * 5000, None, "known/json-k", "k of 5,000 digits"),
    _known_json("rerank", None, "65520", "known/json-values", "values past float16's range"),
    _known_json("search", None, "65520", "known/json-values", "values past float16's range"),
    _known_values("rerank"),
    _known_metadata,
]


# --------------------------------------------------------------------------------------------------
# what the server should answer: the library's answer for the same input


@dataclasses.dataclass
class Expected:
    """``answer``: the results the server must give (``[(qid, [(docno, float32 score)], missing)]``);
    ``refuse``: a reason the library (or a rule docs/serve.md states) refuses the input; neither: the
    harness cannot tell (only crashes, 5xx, tracebacks and the error's form are checked)."""

    answer: list[tuple[str, list[tuple[str, float]], list[str] | None]] | None = None
    refuse: str | None = None
    note: str = ""


class _Unsure(Exception):
    pass


class _Refuse(Exception):
    pass


def _strict_json(body: bytes) -> Any:
    """The body as JSON the way a strict reader takes it (duplicate keys and out-of-range integers:
    the harness does not guess the server's choice)."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in items]
        if len(set(keys)) != len(keys):
            raise _Unsure("duplicate keys")
        return dict(items)

    def constant(name: str) -> float:
        raise _Unsure(f"JSON extension {name}")

    def integer(text: str) -> int:
        if len(text.lstrip("-")) > 300:
            raise _Unsure("an integer of more than 300 digits")
        return int(text)

    def number(text: str) -> float:
        if len(text) > 300:
            raise _Unsure("a number of more than 300 characters")
        return float(text)

    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Refuse(f"not UTF-8: {exc}") from None
    if text.startswith("\ufeff"):
        raise _Unsure("a byte-order mark")
    try:
        return json.loads(
            text, object_pairs_hook=pairs, parse_constant=constant, parse_int=integer, parse_float=number
        )
    except RecursionError:
        raise _Unsure("nesting deeper than Python's JSON reader goes") from None
    except json.JSONDecodeError as exc:
        raise _Refuse(f"malformed JSON: {exc}") from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _has_surrogate(text: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in text)


def decode_json_request(
    kind: str, body: bytes
) -> tuple[list[str | int], list[np.ndarray], int | None, dict, bool]:
    """The request the JSON body spells, by docs/serve.md's schema; `_Refuse` when it breaks it."""
    doc = _strict_json(body)
    if not isinstance(doc, dict):
        raise _Refuse("not an object")
    allowed = {"queries", "k"} | ({"candidates", "strict"} if kind == "rerank" else set())
    unknown = set(doc) - allowed
    if unknown:
        raise _Refuse(f"unknown field {sorted(unknown)[0]!r}")
    if "queries" not in doc or (kind == "rerank" and "candidates" not in doc):
        raise _Refuse("a required field is missing")
    queries = doc["queries"]
    if not isinstance(queries, list) or not queries:
        raise _Refuse("queries must be a non-empty list")
    qids, arrays = [], []
    for item in queries:
        if not isinstance(item, dict) or set(item) != {"qid", "embedding"}:
            raise _Refuse("a query is not {qid, embedding}")
        qid, rows = item["qid"], item["embedding"]
        if not (isinstance(qid, str) or _is_int(qid)):
            raise _Refuse("qid is not a string or an integer")
        if isinstance(qid, str) and _has_surrogate(qid):
            raise _Unsure("a qid with a lone surrogate")
        if not isinstance(rows, list) or not all(
            isinstance(r, list) and all(_is_number(v) for v in r) for r in rows
        ):
            raise _Refuse("embedding is not a list of lists of numbers")
        if rows and len({len(r) for r in rows}) > 1:
            raise _Refuse("rows of different lengths")
        with warnings.catch_warnings(), np.errstate(over="ignore"):
            warnings.simplefilter("ignore")
            values = [
                [float(v) if not (_is_int(v) and abs(v) > 1e308) else math.copysign(math.inf, v) for v in r]
                for r in rows
            ]
            arrays.append(
                np.asarray(values, dtype=np.float64)
                .astype(np.float32)
                .reshape(len(rows), -1 if rows else DIM)
            )
        qids.append(qid)
    k = doc.get("k", 10 if kind == "search" else None)
    if not ((_is_int(k) and k >= 1) or (k is None and kind == "rerank")):
        raise _Refuse(f"k={k!r} is not a whole number >= 1")
    strict = doc.get("strict", False)
    if not isinstance(strict, bool):
        raise _Refuse("strict is not a boolean")
    candidates = doc.get("candidates", {})
    if not isinstance(candidates, dict) or not all(
        isinstance(v, list) and all(isinstance(d, str) for d in v) for v in candidates.values()
    ):
        raise _Refuse("candidates is not {qid: [docno, ...]}")
    if any(_has_surrogate(d) for v in candidates.values() for d in v) or any(
        _has_surrogate(q) for q in candidates
    ):
        raise _Unsure("a docno with a lone surrogate")
    return qids, arrays, k, candidates, strict


def decode_arrow_request(kind: str, body: bytes, query: str) -> tuple[Any, list[str], int | None, dict, bool]:
    """(the library's `Queries` read from the stream, the qids, k, candidates, strict); `_Refuse` when
    the stream or the query string breaks docs/serve.md's rules. Nothing is read before the stream is
    fully validated."""
    import pyarrow as pa

    from maxsim_cli import read_queries
    from maxsim_cli.errors import MaxsimError

    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=False, errors="strict")
    except UnicodeDecodeError:
        raise _Unsure("a query string that is not UTF-8") from None
    if query and not pairs:
        raise _Unsure(f"query string {query!r}")
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise _Unsure("a parameter given twice")
    params = dict(pairs)
    allowed = {"k"} | ({"strict"} if kind == "rerank" else set())
    if set(params) - allowed:
        raise _Refuse("unknown query-string parameter")
    k: int | None = 10 if kind == "search" else None
    if "k" in params:
        text = params["k"]
        if text.isdigit() and not text.isascii():
            raise _Unsure("k in digits other than ASCII")
        if not (text.isascii() and text.isdigit()) or not text.strip("0"):
            raise _Refuse(f"k={text[:20]!r}")
        k = int(text) if len(text) <= 18 else 10**18  # past the corpus either way
    strict_text = params.get("strict", "false").lower()
    if strict_text not in ("true", "false", "1", "0"):
        raise _Refuse(f"strict={strict_text!r}")
    strict = strict_text in ("true", "1")
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(body))
        schema = reader.schema
        batches = list(reader)
        for b in batches:
            b.validate(full=True)
        names = schema.names
    except (pa.ArrowException, OSError, ValueError, UnicodeDecodeError) as exc:
        raise _Refuse(f"not a valid Arrow stream: {one_line(exc, 80)}") from None
    if sum(b.num_rows for b in batches) == 0:
        raise _Refuse("no queries")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "request.arrow")
        try:
            with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
                for b in batches:
                    writer.write_batch(b)
        except (pa.ArrowException, ValueError) as exc:
            raise _Unsure(f"the stream cannot be written as a file: {exc}") from None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                q = read_queries(path)
        except MaxsimError as exc:
            raise _Refuse(one_line(exc, 120)) from None
    candidates: dict[str, list[str]] = {}
    if kind == "rerank":
        if "candidates" not in names:
            raise _Refuse("no candidates column")
        column = pa.concat_arrays([b.column(names.index("candidates")) for b in batches])
        t = column.type
        if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not (
            pa.types.is_string(t.value_type) or pa.types.is_large_string(t.value_type)
        ):
            raise _Refuse(f"candidates column of type {t}")
        lists = column.to_pylist()
        if any(d is None for docnos in lists if docnos for d in docnos):
            raise _Refuse("a null docno")
        candidates = {qid: docnos for qid, docnos in zip(q.ids, lists, strict=True) if docnos}
    return q, q.ids, k, candidates, strict


class Oracle:
    """The library's answer, on the fuzzing corpus resident on the CPU in this process."""

    def __init__(self, corpus_dir: Path) -> None:
        from maxsim_cli import open_corpus

        self.corpus = open_corpus(str(corpus_dir))
        self.corpus.to("cpu")
        self.ids = set(CORPUS_IDS)

    def close(self) -> None:
        self.corpus.close()

    def expect(self, case: HttpCase) -> Expected:
        from maxsim_cli import Queries
        from maxsim_cli.errors import MaxsimError

        kind = case.path.strip("/")
        media = (case.content_type or JSON_TYPE).split(";", 1)[0].strip().lower()
        try:
            if media == JSON_TYPE:
                if case.query:
                    raise _Refuse("query-string parameters with a JSON body")
                qids, arrays, k, candidates, strict = decode_json_request(kind, case.body)
                try:
                    queries = Queries.from_embeddings(qids, arrays)
                except MaxsimError as exc:
                    raise _Refuse(one_line(exc, 120)) from None
                if queries.dim != DIM:
                    raise _Refuse(f"dim {queries.dim}")
                shown = [str(q) for q in qids]
            elif media == ARROW_TYPE:
                queries, shown, k, candidates, strict = decode_arrow_request(kind, case.body, case.query)
            else:
                raise _Refuse(f"Content-Type {media!r}")
            return self._library(kind, queries, shown, k, candidates, strict)
        except _Refuse as exc:
            return Expected(refuse=str(exc))
        except _Unsure as exc:
            return Expected(note=str(exc))

    def _library(
        self, kind: str, queries: Any, shown: list[str], k: int | None, candidates: dict, strict: bool
    ) -> Expected:
        from maxsim_cli import rerank, search
        from maxsim_cli.errors import MaxsimError

        n = len(CORPUS_IDS)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                if kind == "search":
                    # top-k in trec_eval's order is prefix-closed: k past the corpus is the whole corpus
                    run = search(queries, self.corpus, k=min(k, n), device="cpu")
                else:
                    unknown = set(candidates) - set(queries.ids)
                    if unknown:
                        raise _Refuse("candidates for a qid with no query")
                    run = rerank(
                        queries,
                        self.corpus,
                        candidates,
                        k=None if k is None else min(k, 10**6),
                        strict=strict,
                        device="cpu",
                    )
            except MaxsimError as exc:
                return Expected(refuse=one_line(exc, 120))
            except _Refuse as exc:
                return Expected(refuse=str(exc))
            except Exception as exc:  # noqa: BLE001 - the library failed: the server must not answer 200
                return Expected(
                    refuse=f"library raised {type(exc).__name__}: {one_line(exc, 80)}",
                    note="library-exception",
                )
        answer = []
        results = run.to_dict()
        for qid, shown_qid in zip(queries.ids, shown, strict=True):
            hits = [(d, float(np.float32(s))) for d, s in results.get(qid, [])]
            if k is not None:
                hits = hits[:k]
            missing = None
            if kind == "rerank":
                missing = [d for d in candidates.get(qid, []) if d not in self.ids]
            answer.append((shown_qid, hits, missing))
        return Expected(answer=answer)


def answer_problem(expected: Expected, answer: Any) -> str | None:
    """How a 200's JSON differs from the expected answer; None when it is the same."""
    if not isinstance(answer, dict) or set(answer) != {"results"} or not isinstance(answer["results"], list):
        return f"not {{'results': [...]}}: {str(answer)[:80]}"
    got = answer["results"]
    if len(got) != len(expected.answer):
        return f"{len(got)} results for {len(expected.answer)} queries"
    for result, (qid, hits, missing) in zip(got, expected.answer, strict=True):
        if str(result.get("qid")) != qid:
            return f"result for qid {result.get('qid')!r} where {qid!r} was expected"
        pairs = [(h.get("docno"), float(np.float32(h.get("score")))) for h in result.get("hits", [])]
        if pairs != hits:
            for i, (a, b) in enumerate(zip(pairs, hits, strict=False)):
                if a != b:
                    return f"query {qid!r} hit {i}: {a} where the library gives {b}"
            return f"query {qid!r}: {len(pairs)} hits where the library gives {len(hits)}"
        if missing is not None and result.get("missing") != missing:
            return f"query {qid!r}: missing {result.get('missing')} where the library gives {missing}"
    return None


# --------------------------------------------------------------------------------------------------
# the server under test


class ServerProcess:
    """``maxsim serve CORPUS --device cpu --port 0`` on 127.0.0.1, its stderr read by a thread."""

    def __init__(self, corpus_dir: Path, extra: Sequence[str] = ()) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "maxsim_cli",
                "serve",
                str(corpus_dir),
                "--device",
                "cpu",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                *extra,
            ],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + 120
        while True:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is None and time.monotonic() < deadline:
                    continue
                self.stop()
                raise RuntimeError("maxsim serve did not start:\n" + "".join(self.log[-20:])) from None
            match = re.search(r"serving on http://127\.0\.0\.1:(\d+)", line)
            if match:
                self.url = f"http://127.0.0.1:{int(match.group(1))}"
                return

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            self.lines.put(line)

    def new_lines(self, wait: float = 0.0) -> list[str]:
        out = []
        deadline = time.monotonic() + wait
        while True:
            try:
                out.append(self.lines.get(timeout=max(0.0, deadline - time.monotonic()) if not out else 0.02))
            except queue.Empty:
                return out

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit {code}"


def _shape_of(message: str) -> str:
    """A message with its numbers and quoted parts blanked: what tells two errors of one place apart."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'...'", one_line(message, 400))
    return re.sub(r"\d+", "N", text)[:90]


def _error_name(text: str) -> str:
    """A 500's ``internal error: Name: message``, its numbers and quoted parts blanked and cut to its
    first words (else the start of the text)."""
    match = re.search(r"internal error: (\w+: .*?)\"?}?$", text)
    if not match:
        return one_line(text, 60)
    shape = _shape_of(re.sub(r"0x[0-9a-fA-F]+", "0x..", match.group(1)))
    return shape if len(shape) <= 64 else shape[:64].rsplit(" ", 1)[0] + " ..."


def _traceback_place(stderr: str) -> str:
    """The last maxsim frame of a traceback: ``maxsim_cli/x.py:N (function)``."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', stderr)
    ours = [f for f in frames if "/maxsim_cli/" in f[0] or "/kernels/" in f[0]] or frames[-1:]
    if not ours:
        return "?"
    name, line, function = ours[-1]
    return f"{os.path.relpath(name, ROOT)}:{line} ({function})"


def _crash_place(stderr: str) -> str:
    """Where a child died, from Python's fault handler (enabled in every child), else "?"."""
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', stderr)
    ours = [f for f in frames if "/maxsim_cli/" in f[0] or "/kernels/" in f[0] or "pyarrow" in f[0]]
    if not ours:
        return "?"
    name, line, function = ours[0]
    shown = os.path.relpath(name, ROOT) if name.startswith(str(ROOT)) else os.path.basename(name)
    return f"{shown}:{line} ({function})"


def run_server_case(
    report: Report,
    index: int,
    case: HttpCase,
    server: ServerProcess,
    oracle: Oracle,
    http: Any,
    verbose: bool = False,
) -> None:
    import httpx

    tally = report.tallies["server"]
    tally.cases += 1
    tally.classes[case.cls] += 1
    try:
        expected = oracle.expect(case)
    except Exception:  # noqa: BLE001 - a bug of the harness's own: reported, and the case still runs
        report.harness_errors.append(f"server case {index}: {traceback.format_exc()[-800:]}")
        expected = Expected(note="harness error")
    if expected.note:
        tally.notes[expected.note.split(":")[0]] += 1
    url = server.url + case.path + (f"?{case.query}" if case.query else "")
    headers = {"content-type": case.content_type} if case.content_type is not None else {}
    what = f"{case.path} {case.cls} ({case.note})"
    try:
        response = http.post(url, content=case.body, headers=headers, timeout=SERVER_TIMEOUT_S)
    except httpx.TimeoutException:
        tally.outcomes["timeout"] += 1
        report.add(
            "server",
            index,
            "hang",
            case.cls,
            f"{what}: no answer in {SERVER_TIMEOUT_S:.0f} s",
            f"{case.path}: no answer",
        )
        return
    except httpx.HTTPError as exc:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(2)
        tally.outcomes["no answer"] += 1
        if not server.alive():
            died = _exit_text(server.proc.returncode)
            report.add(
                "server", index, "crash", case.cls, f"{what}: server {died}", f"{case.path}: server {died}"
            )
        else:
            report.add(
                "server",
                index,
                "crash",
                case.cls,
                f"{what}: connection failed ({type(exc).__name__}), server still up",
                f"{case.path}: connection failed",
            )
        _log_tracebacks(report, index, case, server.new_lines(0.5))
        return
    status = response.status_code
    tally.outcomes[f"{status}"] += 1
    lines = server.new_lines(0.3 if status >= 500 else 0.0)
    _log_tracebacks(report, index, case, lines)
    if verbose:
        print(f"answer {status}: {response.text[:2000]}")
        print("".join(lines), end="")
    if status >= 500:
        report.add(
            "server",
            index,
            "5xx",
            case.cls,
            f"{what}: {status} {response.text[:200]}",
            f"{case.path}: {status} {_error_name(response.text)}",
        )
        return
    if status != 200:
        try:
            detail = response.json()["detail"]
            ok = isinstance(detail, str) and detail and "\n" not in detail and "\r" not in detail
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            report.add(
                "server", index, "multiline", case.cls, f"{what}: {status} body {response.text[:200]!r}"
            )
        if expected.answer is not None:
            tally.notes[f"{status} to what the library answers ({case.cls})"] += 1
            if verbose:
                print(f"note: the library answers this request; the server refused it ({status})")
        return
    if expected.refuse is not None:
        report.add(
            "server",
            index,
            "wrong",
            case.cls,
            f"{what}: 200 where the library refuses: {expected.refuse}",
            f"{case.path}: 200 to what the library refuses",
        )
        return
    if expected.answer is not None:
        try:
            problem = answer_problem(expected, response.json())
        except ValueError:
            problem = f"not JSON: {response.text[:100]!r}"
        if problem:
            report.add(
                "server",
                index,
                "wrong",
                case.cls,
                f"{what}: {problem}",
                f"{case.path}: an answer unlike the library's",
            )


def _log_tracebacks(report: Report, index: int, case: HttpCase, lines: list[str]) -> None:
    count = sum("Traceback (most recent call last)" in line for line in lines)
    for _ in range(count):
        last = next((ln for ln in reversed(lines) if ln.strip() and not ln.startswith(" ")), "")
        report.add(
            "server",
            index,
            "traceback",
            case.cls,
            f"{case.path} {case.cls} ({case.note}): {last.strip()}",
            f"{case.path or 'after the last case'}: {last.strip().split(':')[0]}",
        )


def fuzz_server(
    report: Report,
    seed: int,
    cases: Sequence[int],
    workdir: Path,
    *,
    server_args: Sequence[str] = (),
    max_restarts: int = 4,
    verbose: bool = False,
    save: Path | None = None,
) -> None:
    import httpx

    tally = report.tallies["server"]
    started = time.perf_counter()
    corpus_dir = make_corpus(workdir / "corpus")
    oracle = Oracle(corpus_dir)
    server = ServerProcess(corpus_dir, server_args)
    restarts = 0
    try:
        with httpx.Client(trust_env=False) as http:
            for n, index in enumerate(cases):
                if not server.alive():
                    if restarts >= max_restarts:
                        tally.skipped = len(cases) - n
                        break
                    restarts += 1
                    server = ServerProcess(corpus_dir, server_args)
                case = server_case(seed, index)
                if verbose:
                    print(
                        f"case {index}: POST {case.path}?{case.query} {case.cls} ({case.note}) "
                        f"content-type {case.content_type!r}, {len(case.body)} bytes: {case.body[:300]!r}"
                    )
                if save is not None:
                    save.mkdir(parents=True, exist_ok=True)
                    (save / f"server-{index}.body").write_bytes(case.body)
                run_server_case(report, index, case, server, oracle, http, verbose)
            _log_tracebacks(report, -1, HttpCase("", None, b"", "", "late", ""), server.new_lines(0.2))
    finally:
        server.stop()
        oracle.close()
        tally.seconds += time.perf_counter() - started


# --------------------------------------------------------------------------------------------------
# shard cases: files written here, mutated, then opened and scored in forked children


ST_DTYPES = {
    "float16": ("F16", np.float16),
    "bfloat16": ("BF16", np.uint16),
    "float32": ("F32", np.float32),
    "int8": ("I8", np.int8),
}
ST_ITEMSIZE = {"F16": 2, "BF16": 2, "F32": 4, "I8": 1, "I64": 8, "U8": 1, "F64": 8, "I32": 4, "U16": 2}


def shard_values(dtype: str, vectors: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
    """The packed values as stored for ``dtype`` (bfloat16 as uint16 bits) and the int8 scales."""
    packed = np.concatenate(vectors).astype(np.float32)
    if dtype == "float16":
        return packed.astype(np.float16), None
    if dtype == "bfloat16":
        return _bf16_bits(packed), None
    if dtype == "int8":
        return _int8_codes(packed)
    return packed, None


def safetensors_parts(
    ids: Sequence[str], vectors: Sequence[np.ndarray], dtype: str
) -> tuple[dict, dict[str, bytes], dict[str, str]]:
    """A shard's safetensors header tensors (name -> [dtype, shape]), their bytes and the metadata."""
    values, scales = shard_values(dtype, vectors)
    offsets = np.zeros(len(ids) + 1, np.int64)
    np.cumsum([len(v) for v in vectors], out=offsets[1:])
    raw_ids = [s.encode("utf-8", "surrogatepass") for s in ids]
    id_offsets = np.zeros(len(ids) + 1, np.int64)
    np.cumsum([len(b) for b in raw_ids], out=id_offsets[1:])
    tensors = {"embeddings": [ST_DTYPES[dtype][0], list(values.shape)]}
    data = {"embeddings": values.tobytes()}
    if scales is not None:
        tensors["scales"] = ["F32", [len(scales)]]
        data["scales"] = scales.astype(np.float32).tobytes()
    tensors["offsets"] = ["I64", [len(offsets)]]
    data["offsets"] = offsets.tobytes()
    tensors["id_offsets"] = ["I64", [len(id_offsets)]]
    data["id_offsets"] = id_offsets.tobytes()
    ids_bytes = b"".join(raw_ids)
    tensors["ids"] = ["U8", [len(ids_bytes)]]
    data["ids"] = ids_bytes
    metadata = {
        "format": "maxsim-shard",
        "format_version": "1",
        "dim": str(DIM),
        "dtype": dtype,
        "quantization": "int8-per-token" if dtype == "int8" else "none",
        "normalized": "false",
        "num_docs": str(len(ids)),
        "num_tokens": str(int(offsets[-1])),
    }
    return tensors, data, metadata


def safetensors_bytes(
    tensors: dict,
    data: dict[str, bytes],
    metadata: Any,
    header_extra: dict | None = None,
    offsets_override: dict[str, Any] | None = None,
) -> bytes:
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    position = 0
    for name, (dt, shape) in tensors.items():
        size = len(data[name])
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [position, position + size]}
        position += size
    for name, value in (offsets_override or {}).items():
        header[name]["data_offsets"] = value
    header.update(header_extra or {})
    text = json.dumps(header, ensure_ascii=False).encode("utf-8", "surrogatepass")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(data[n] for n in tensors)


def arrow_file_bytes(columns: dict[str, Any], metadata: dict[str, str] | None) -> bytes:
    import pyarrow as pa

    names = list(columns)
    arrays = list(columns.values())
    schema = pa.schema([pa.field(n, a.type) for n, a in zip(names, arrays, strict=True)], metadata=metadata)
    batch = pa.RecordBatch.from_arrays(arrays, schema=schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


@dataclasses.dataclass
class ShardCase:
    name: str  # file name of the mutated shard (or of the stream fed to stdin)
    data: bytes
    cls: str
    note: str
    queries: list[np.ndarray]
    stdin: bool = False


SHARD_IDS = ["s0", "s1", "s2", "é3", "😀4", "s5", 's"6', "s\\7", "s8", "s9"]


def _patch_ints(rnd: random.Random, raw: bytes, width: int, values: Sequence[int]) -> tuple[bytes, str]:
    count = len(raw) // width
    i = rnd.randrange(count)
    fmt = {4: "<i", 8: "<q"}[width]
    old = struct.unpack_from(fmt, raw, i * width)[0]
    value = rnd.choice(list(values) + [old + 1, old - 1])
    out = bytearray(raw)
    struct.pack_into(fmt, out, i * width, value)
    return bytes(out), f"element {i} of {count}: {old} -> {value}"


def shard_case(seed: int, index: int) -> ShardCase:
    import pyarrow as pa

    rnd, rng = case_rng(seed, "shards", index)
    queries = [rng.standard_normal((rnd.randint(1, 4), DIM)).astype(np.float32) for _ in range(2)]
    if index < 0:
        return _known_shard(-index - 1, rnd, rng, queries)
    container = pick(rnd, "safetensors:5 arrow:4 stdin:2")
    if container == "stdin":
        case = arrow_case(rnd, rng, "search")
        return ShardCase(
            "queries.arrows", case.body, f"stdin/{case.cls.split('/')[1]}", case.note, queries, stdin=True
        )
    dtype = pick(rnd, "float16:3 float32:2 bfloat16:1 int8:2")
    n = rnd.randint(2, 8)
    ids = rnd.sample(SHARD_IDS, n)
    vectors = [rng.standard_normal((rnd.randint(1, 6), DIM)).astype(np.float32) for _ in range(n)]
    if container == "safetensors":
        return _safetensors_case(rnd, ids, vectors, dtype, queries)
    cls = pick(
        rnd, "valid:2 bytes:5 buffers:5 offsets-mid:3 utf8:2 schema:3 metadata:2 values:2 rows:2 truncate:2"
    )
    columns, metadata = arrow_columns(ids, vectors, dtype)
    note = ""
    data = None
    if cls == "bytes":
        data, note = mutate_bytes(
            rnd, arrow_file_bytes(columns, metadata), interesting=b"\x00\xff\x7f\x80\x01"
        )
    elif cls == "truncate":
        full = arrow_file_bytes(columns, metadata)
        cut = rnd.randrange(len(full))
        data, note = full[:cut], f"cut at {cut} of {len(full)}"
    elif cls == "buffers":
        full = arrow_file_bytes(columns, metadata)
        data, note = full, "no buffer found: unchanged"
        choices = [("id", columns["id"].buffers()[1], 4), ("embedding", columns["embedding"].buffers()[1], 4)]
        if "scales" in columns:
            choices.append(("scales", columns["scales"].buffers()[1], 4))
        rnd.shuffle(choices)
        for label, buf, width in choices:
            patched = _patch_buffer(rnd, full, buf.to_pybytes(), width)
            if patched is not None:
                data, note = patched[0], f"{label} offsets {patched[1]}"
                break
    elif cls == "offsets-mid":
        strings = [s.encode() for s in ids]
        offsets = [0]
        for s in strings:
            offsets.append(offsets[-1] + len(s))
        i = rnd.randint(1, len(strings) - 1)
        offsets[i] = rnd.choice([offsets[-1] + 1, offsets[-1] + 4096, 2**31 - 1])
        columns["id"] = _strings_from_buffers(strings, offsets)
        note = f"id string offset {i} -> {offsets[i]} of {offsets[-1]} bytes"
    elif cls == "utf8":
        bad = rnd.choice([b"\xff", b"\xed\xa0\x80", b"\xc0\xaf"])
        how = rnd.choice(["id", "field-name", "metadata"])
        if how == "id":
            columns["id"] = _strings_from_buffers(
                [s.encode() + (bad if j == 1 else b"") for j, s in enumerate(ids)]
            )
        else:
            placeholder = "zq" * 4
            if how == "field-name":
                name = rnd.choice(list(columns))
                columns = {(placeholder if c == name else c): a for c, a in columns.items()}
            else:
                metadata[rnd.choice(["dtype", placeholder])] = placeholder
            data = arrow_file_bytes(columns, metadata).replace(
                placeholder.encode(), (bad * 8)[: len(placeholder)]
            )
        note = f"{how} {bad!r}"
    elif cls == "schema":
        emb = columns["embedding"]
        how = rnd.choice(
            "embedding-flat id-int id-large drop-id value-type large-list scales-extra length".split()
        )
        if how == "embedding-flat":
            columns["embedding"] = pa.ListArray.from_arrays(emb.offsets, emb.values.flatten())
        elif how == "id-int":
            columns["id"] = pa.array(list(range(n)), pa.int64())
        elif how == "id-large":
            columns["id"] = pa.array(ids, pa.large_string())
        elif how == "drop-id":
            del columns["id"]
        elif how == "value-type":
            flat = emb.values.flatten()
            columns["embedding"] = pa.ListArray.from_arrays(
                emb.offsets,
                pa.FixedSizeListArray.from_arrays(
                    flat.cast(pa.float64()) if dtype != "bfloat16" else flat.view(pa.int16()), DIM
                ),
            )
        elif how == "large-list":
            columns["embedding"] = emb.cast(pa.large_list(emb.type.value_type))
        elif how == "scales-extra":
            lengths = np.diff(emb.offsets.to_numpy())
            columns["scales"] = pa.ListArray.from_arrays(
                emb.offsets, pa.array(np.ones(int(lengths.sum()), np.float32))
            )
        else:
            lengths = np.diff(emb.offsets.to_numpy())
            if rnd.random() < 0.5:
                lengths = lengths + 1
            columns["length"] = pa.array(lengths.astype(np.int32))
        note = how
    elif cls == "metadata":
        how = rnd.choice("dim dtype num_docs num_tokens format format_version drop none".split())
        if how == "none":
            metadata = None
        elif how == "drop":
            del metadata[rnd.choice(list(metadata))]
        else:
            metadata[how] = rnd.choice(
                ["", "0", "-1", "2", "7", "99999999999999999999", "float16", "int8", "x", "١", "²"]
            )
        note = f"{how}"
    elif cls == "values":
        how = rnd.choice(["nan", "inf", "huge", "scales"])
        if how == "nan":
            vectors[0][0, 0] = np.nan
        elif how == "inf":
            vectors[-1][-1, -1] = np.inf
        elif how == "huge":
            vectors[0][:] = 3.0e38 if dtype in ("float32", "bfloat16") else 60000.0
        columns, metadata = arrow_columns(ids, vectors, dtype)
        if how == "scales" and dtype == "int8":
            s = columns["scales"]
            flat = s.values.to_numpy().copy()
            flat[rnd.randrange(len(flat))] = rnd.choice([-1.0, np.nan, np.inf])
            columns["scales"] = pa.ListArray.from_arrays(s.offsets, pa.array(flat, pa.float32()))
        note = how
    elif cls == "rows":
        how = rnd.choice(["duplicate", "empty-id", "space-id", "null-id", "null-embedding", "empty-tokens"])
        if how == "duplicate":
            ids[-1] = ids[0]
        elif how == "empty-id":
            ids[0] = ""
        elif how == "space-id":
            ids[0] = rnd.choice(["a b", "a\u200bb", "\x00"])
        elif how == "empty-tokens":
            vectors[0] = vectors[0][:0]
        if how in ("duplicate", "empty-id", "space-id", "empty-tokens"):
            columns, metadata = arrow_columns(ids, vectors, dtype)
        elif how == "null-id":
            columns["id"] = pa.array([None] + ids[1:], pa.string())
        else:
            emb = columns["embedding"]
            columns["embedding"] = pa.ListArray.from_arrays(
                emb.offsets, emb.values, mask=pa.array([False, True] + [False] * (n - 2))
            )
        note = how
    if data is None:
        try:
            data = arrow_file_bytes(columns, metadata)
        except (pa.ArrowException, ValueError, TypeError) as exc:
            data = arrow_file_bytes(*arrow_columns(ids, vectors, dtype))
            note += f" (not writable: {one_line(exc, 60)})"
    return ShardCase("shard.arrow", data, f"arrow/{cls}", f"{dtype} {note}", queries)


KNOWN_SHARDS = [
    "safetensors num_docs='\u00b2'",
    "Arrow id string offset past its data",
    "Arrow query stream with a field name that is not UTF-8",
    "safetensors id_offsets past the ids",
    "float32 values whose products overflow float32 (a NaN score left out of the top-k)",
]


def _known_shard(
    which: int, rnd: random.Random, rng: np.random.Generator, queries: list[np.ndarray]
) -> ShardCase:
    """The shard cases built on purpose (`KNOWN_SHARDS`), as `KNOWN_SERVER` for the server."""
    ids = ["s0", "s1", "s2", "s3"]
    vectors = [rng.standard_normal((2, DIM)).astype(np.float32) for _ in ids]
    note = KNOWN_SHARDS[which]
    if which == 0:
        tensors, data, metadata = safetensors_parts(ids, vectors, "float16")
        metadata["num_docs"] = "\u00b2"
        return ShardCase(
            "shard.safetensors", safetensors_bytes(tensors, data, metadata), "known/metadata", note, queries
        )
    if which == 1:
        columns, metadata = arrow_columns(ids, vectors, "float16")
        columns["id"] = _strings_from_buffers([i.encode() for i in ids], [0, 2, 2**31 - 1, 6, 8])
        return ShardCase(
            "shard.arrow", arrow_file_bytes(columns, metadata), "known/arrow-offsets", note, queries
        )
    if which == 2:
        columns, metadata = arrow_columns(["q0", "q1"], vectors[:2], "float32")
        columns["zqzq"] = columns.pop("embedding")
        body = arrow_bytes(columns, metadata).replace(b"zqzq", b"\xff\xfe\xfd\xfc")
        return ShardCase("queries.arrows", body, "known/stdin-field-name", note, queries, stdin=True)
    if which == 4:
        # finite values whose dot products overflow float32: query qa's first token meets +inf and its
        # second -inf, so its score of s2 is NaN in float32 where MaxSim is 1.2e39, the best of the shard
        ids = [f"s{i}" for i in range(8)]  # more documents than the top-4 keeps
        vectors = [rng.standard_normal((2, DIM)).astype(np.float32) for _ in ids]
        vectors[2] = np.full((2, DIM), 3.0e38, np.float32)
        qa = np.stack([np.ones(DIM), np.full(DIM, -0.5)]).astype(np.float32)
        queries = [qa, -qa]  # qb: NaN too, where MaxSim is -1.2e39, the worst
        tensors, data, metadata = safetensors_parts(ids, vectors, "float32")
        data_bytes = safetensors_bytes(tensors, data, metadata)
        return ShardCase("shard.safetensors", data_bytes, "known/overflow", note, queries)
    tensors, data, metadata = safetensors_parts(ids, vectors, "float16")
    data["id_offsets"] = np.array([0, 2, 4000, 6, 8], np.int64).tobytes()
    return ShardCase(
        "shard.safetensors", safetensors_bytes(tensors, data, metadata), "known/id-offsets", note, queries
    )


def _safetensors_case(
    rnd: random.Random, ids: list[str], vectors: list[np.ndarray], dtype: str, queries: list[np.ndarray]
) -> ShardCase:
    tensors, data, metadata = safetensors_parts(ids, vectors, dtype)
    cls = pick(
        rnd, "valid:2 bytes:5 header-bytes:3 header:5 offsets:3 id-offsets:3 ids:2 values:2 truncate:2"
    )
    note = ""
    extra: dict[str, Any] = {}
    overrides: dict[str, Any] = {}
    raw: bytes | None = None
    if cls == "bytes":
        raw, note = mutate_bytes(rnd, safetensors_bytes(tensors, data, metadata))
    elif cls == "truncate":
        full = safetensors_bytes(tensors, data, metadata)
        cut = rnd.randrange(len(full))
        raw, note = full[:cut], f"cut at {cut} of {len(full)}"
    elif cls == "header-bytes":
        full = safetensors_bytes(tensors, data, metadata)
        (h,) = struct.unpack("<Q", full[:8])
        header, note = mutate_bytes(rnd, full[8 : 8 + h], interesting=b'[]{},:"\\0-e.\x00\xff 9')
        keep_length = rnd.random() < 0.5
        raw = struct.pack("<Q", h if keep_length else len(header)) + header + full[8 + h :]
        note += " (length kept)" if keep_length else ""
    elif cls == "header":
        how = rnd.choice(
            (
                "dtype shape data_offsets drop-tensor extra-tensor "
                "metadata metadata-type length-field not-object huge-shape"
            ).split()
        )
        name = rnd.choice(list(tensors))
        if how == "dtype":
            tensors[name] = [
                rnd.choice(["F16", "BF16", "F32", "I8", "I64", "U8", "F64", "I32", "bool", "", 5]),
                tensors[name][1],
            ]
        elif how == "shape":
            shape = list(tensors[name][1])
            j = rnd.randrange(len(shape))
            shape[j] = rnd.choice([0, shape[j] + 1, shape[j] - 1, -1, 2**62, 1.5])
            if rnd.random() < 0.3:
                shape = rnd.choice([[], shape + [1], [shape[0]]])
            tensors[name] = [tensors[name][0], shape]
        elif how == "huge-shape":
            tensors[name] = [tensors[name][0], [2**31, 2**31] if name == "embeddings" else [2**40]]
        elif how == "data_offsets":
            total = sum(len(v) for v in data.values())
            overrides[name] = rnd.choice(
                [
                    [0, 0],
                    [-1, 8],
                    [0, total + 8],
                    [total, total + 8],
                    [8, 0],
                    [0.5, 8],
                    ["0", "8"],
                    [0],
                    None,
                    [2**63, 2**63 + 8],
                ]
            )
        elif how == "drop-tensor":
            del tensors[name]
        elif how == "extra-tensor":
            tensors["extra"] = ["U8", [4]]
            data["extra"] = b"abcd"
        elif how == "metadata":
            key = rnd.choice("dim dtype num_docs num_tokens format format_version quantization".split())
            if rnd.random() < 0.2:
                del metadata[key]
            else:
                metadata[key] = rnd.choice(
                    ["", "0", "-1", "2", "7", "99999999999999999999", "float16", "int8", "x", "١", "²", " 8"]
                )
            note = f"{key}={metadata.get(key)!r}"
        elif how == "metadata-type":
            metadata = rnd.choice([None, [], "x", {"dim": 8}, {**metadata, "dim": None}])
        elif how == "length-field":
            full = safetensors_bytes(tensors, data, metadata)
            (h,) = struct.unpack("<Q", full[:8])
            value = rnd.choice([0, 1, 7, h - 1, h + 1, len(full), 2**63, 2**64 - 1, 100_000_001])
            raw = struct.pack("<Q", value) + full[8:]
            note = f"header length {h} -> {value}"
        elif how == "not-object":
            text = rnd.choice([b"[]", b'"x"', b"null", b"{", b"{}"])
            raw = struct.pack("<Q", len(text)) + text
        note = note or f"{how} {name}"
    elif cls in ("offsets", "id-offsets"):
        key = "offsets" if cls == "offsets" else "id_offsets"
        total = len(data["ids"]) if key == "id_offsets" else int(np.frombuffer(data["offsets"], np.int64)[-1])
        data[key], note = _patch_ints(
            rnd, data[key], 8, [total + 1, total + 4096, -1, 2**62, 2**63 - 1, 0, -(2**63)]
        )
    elif cls == "ids":
        how = rnd.choice(["bad-utf8", "space", "duplicate", "empty", "control"])
        raw_ids = [s.encode() for s in ids]
        if how == "bad-utf8":
            raw_ids[0] += rnd.choice([b"\xff", b"\xed\xa0\x80", b"\xc0"])
        elif how == "space":
            raw_ids[0] = b"a b"
        elif how == "duplicate":
            raw_ids[-1] = raw_ids[0]
        elif how == "empty":
            raw_ids[0] = b""
        else:
            raw_ids[0] = b"a\x00b"
        id_offsets = np.zeros(len(ids) + 1, np.int64)
        np.cumsum([len(b) for b in raw_ids], out=id_offsets[1:])
        data["ids"] = b"".join(raw_ids)
        data["id_offsets"] = id_offsets.tobytes()
        tensors["ids"] = ["U8", [len(data["ids"])]]
        note = how
    elif cls == "values":
        item = ST_ITEMSIZE[tensors["embeddings"][0]]
        values = bytearray(data["embeddings"])
        at = rnd.randrange(len(values) // item) * item
        patterns = {
            2: [b"\x00\x7c", b"\x00\xfc", b"\x01\x7e", b"\xff\x7b", b"\x01\x00"],
            4: [b"\x00\x00\x80\x7f", b"\x00\x00\xc0\x7f", b"\xff\xff\x7f\x7f"],
            1: [b"\x80"],
        }[item]
        if dtype == "bfloat16":
            patterns = [b"\x80\x7f", b"\xc0\x7f", b"\x7f\x7f"]
        values[at : at + item] = rnd.choice(patterns)
        data["embeddings"] = bytes(values)
        note = f"value at byte {at}"
        if dtype == "int8" and rnd.random() < 0.7:
            scales = np.frombuffer(data["scales"], np.float32).copy()
            scales[rnd.randrange(len(scales))] = rnd.choice([-1.0, np.nan, np.inf, 0.0])
            data["scales"] = scales.tobytes()
            note = "a scale"
    if raw is None:
        raw = safetensors_bytes(tensors, data, metadata, extra, overrides)
    return ShardCase("shard.safetensors", raw, f"safetensors/{cls}", f"{dtype} {note}", queries)


# what a shard holds, read here by docs/format.md (never through maxsim's readers)

ZERO_WIDTH = {"\u200b", "\u200c", "\u200d", "\u2060", "\ufeff"}


def id_breaks_rules(text: str) -> bool:
    return not text or any(
        c.isspace() or ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c in ZERO_WIDTH for c in text
    )


@dataclasses.dataclass
class ShardContent:
    ids: list[str]
    docs: list[np.ndarray]  # float64 values, dequantized
    dtype: str
    dim: int


def _check_meta(meta: dict[str, str], num_docs: int, num_tokens: int, dim: int, dtype: str) -> None:
    """The metadata rules readers enforce (docs/format.md: unknown format or version, a dtype outside the
    list, counts that disagree with the data)."""
    if meta.get("format") != "maxsim-shard" or meta.get("format_version") != "1":
        raise _Refuse("format or format_version")
    if meta.get("dtype") != dtype:
        raise _Refuse(f"metadata dtype {meta.get('dtype')!r} for {dtype} values")
    for key, value in (("dim", dim), ("num_docs", num_docs), ("num_tokens", num_tokens)):
        text = meta.get(key)
        if text is None or not (text.isascii() and text.isdigit()) or int(text) != value:
            raise _Refuse(f"metadata {key}={text!r} where the data has {value}")
    if meta.get("quantization", "none") != ("int8-per-token" if dtype == "int8" else "none"):
        raise _Refuse("quantization")
    if meta.get("normalized", "false") not in ("true", "false"):
        raise _Refuse("normalized")


def _check_content(
    ids: list[str], offsets: np.ndarray, values: np.ndarray, scales: np.ndarray | None
) -> list[np.ndarray]:
    if (
        len(offsets) != len(ids) + 1
        or offsets[0] != 0
        or offsets[-1] != len(values)
        or np.any(np.diff(offsets) <= 0)
    ):
        raise _Refuse("offsets")
    if any(id_breaks_rules(i) for i in ids) or len(set(ids)) != len(ids):
        raise _Refuse("ids")
    if not np.isfinite(values).all():
        raise _Refuse("values not finite")
    if scales is not None:
        if not np.isfinite(scales).all() or (scales < 0).any():
            raise _Refuse("scales")
        values = values * scales[:, None]
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(ids))]


def _as_float64(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return raw.astype(np.float64)


def read_safetensors_reference(data: bytes) -> ShardContent:
    if len(data) < 8:
        raise _Refuse("shorter than 8 bytes")
    (h,) = struct.unpack("<Q", data[:8])
    if h > 100_000_000 or 8 + h > len(data):
        raise _Refuse("header length")
    try:
        header = json.loads(
            data[8 : 8 + h].decode("utf-8"), parse_constant=lambda c: (_ for _ in ()).throw(_Unsure(c))
        )
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise _Refuse("header is not JSON") from None
    if not isinstance(header, dict):
        raise _Refuse("header is not an object")
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise _Refuse("__metadata__")
    size = len(data) - 8 - h
    spans = []
    arrays: dict[str, tuple[str, list[int], bytes]] = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(t, dict) or set(t) != {"dtype", "shape", "data_offsets"}:
            raise _Refuse(f"tensor {name}")
        dt, shape, span = t["dtype"], t["shape"], t["data_offsets"]
        if dt not in ST_ITEMSIZE:
            raise (_Refuse if name in ("embeddings", "scales", "offsets", "ids", "id_offsets") else _Unsure)(
                f"dtype {dt!r}"
            )
        if not (isinstance(shape, list) and all(_is_int(s) and s >= 0 for s in shape)):
            raise _Refuse(f"shape of {name}")
        if not (
            isinstance(span, list)
            and len(span) == 2
            and all(_is_int(s) for s in span)
            and 0 <= span[0] <= span[1] <= size
        ):
            raise _Refuse(f"data_offsets of {name}")
        if span[1] - span[0] != math.prod(shape) * ST_ITEMSIZE[dt]:
            raise _Refuse(f"size of {name}")
        spans.append(tuple(span))
        arrays[name] = (dt, shape, data[8 + h + span[0] : 8 + h + span[1]])
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            raise _Refuse("tensors do not cover the data section exactly")
        position = end
    if position != size:
        raise _Refuse("tensors do not cover the data section exactly")
    for name in ("embeddings", "offsets", "ids", "id_offsets"):
        if name not in arrays:
            raise _Refuse(f"no {name}")
    if set(arrays) - {"embeddings", "offsets", "ids", "id_offsets", "scales"}:
        raise _Unsure("an extra tensor")
    dt, shape, raw = arrays["embeddings"]
    names = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "I8": "int8"}
    if dt not in names or len(shape) != 2:
        raise _Refuse("embeddings dtype or shape")
    dtype = names[dt]
    np_type = ST_DTYPES[dtype][1]
    values = _as_float64(np.frombuffer(raw, np_type).reshape(shape), dtype)
    scales = None
    if dtype == "int8":
        if "scales" not in arrays or arrays["scales"][0] != "F32" or arrays["scales"][1] != [shape[0]]:
            raise _Refuse("scales")
        scales = np.frombuffer(arrays["scales"][2], np.float32).astype(np.float64)
    elif "scales" in arrays:
        raise _Unsure("scales for float values")
    for name, want in (("offsets", "I64"), ("id_offsets", "I64"), ("ids", "U8")):
        if arrays[name][0] != want or len(arrays[name][1]) != 1:
            raise _Refuse(f"{name} dtype or shape")
    offsets = np.frombuffer(arrays["offsets"][2], np.int64)
    id_offsets = np.frombuffer(arrays["id_offsets"][2], np.int64)
    id_bytes = arrays["ids"][2]
    if (
        len(id_offsets) != len(offsets)
        or id_offsets[0] != 0
        or id_offsets[-1] != len(id_bytes)
        or np.any(np.diff(id_offsets) < 0)
    ):
        raise _Refuse("id_offsets")
    try:
        ids = [id_bytes[a:b].decode("utf-8") for a, b in zip(id_offsets[:-1], id_offsets[1:], strict=True)]
    except UnicodeDecodeError:
        raise _Refuse("an id is not UTF-8") from None
    _check_meta(meta, len(ids), shape[0], shape[1], dtype)
    return ShardContent(ids, _check_content(ids, offsets, values, scales), dtype, shape[1])


METADATA_KEYS = (
    "format",
    "format_version",
    "dim",
    "dtype",
    "quantization",
    "normalized",
    "encoder",
    "num_docs",
    "num_tokens",
)


def _arrow_metadata(raw: dict[bytes, bytes]) -> dict[str, str]:
    """The schema metadata as text; a key of docs/format.md whose value is not UTF-8 breaks the format,
    other keys are ignored."""
    meta = {}
    for key, value in raw.items():
        try:
            name = key.decode("utf-8")
        except UnicodeDecodeError:
            continue
        try:
            meta[name] = value.decode("utf-8")
        except UnicodeDecodeError:
            if name in METADATA_KEYS:
                raise _Refuse(f"metadata {name} is not UTF-8") from None
    return meta


def read_arrow_reference(data: bytes) -> ShardContent:
    import pyarrow as pa

    try:
        reader = pa.ipc.open_file(pa.py_buffer(data))
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        for b in batches:
            b.validate(full=True)
        schema = reader.schema
        names = schema.names
        meta = _arrow_metadata(schema.metadata or {})
    except (pa.ArrowException, OSError, ValueError, UnicodeDecodeError) as exc:
        raise _Refuse(f"not a valid Arrow file: {one_line(exc, 60)}") from None
    if len(set(names)) != len(names):
        raise _Unsure("duplicate column names")
    if "id" not in names or "embedding" not in names:
        raise _Refuse("no id or embedding column")
    table = pa.Table.from_batches(batches, schema)
    id_col = (
        table.column("id").combine_chunks() if table.num_rows else pa.array([], table.schema.field("id").type)
    )
    emb = table.column("embedding").combine_chunks() if table.num_rows else None
    if not (pa.types.is_string(id_col.type) or pa.types.is_large_string(id_col.type)):
        raise _Refuse(f"id column of type {id_col.type}")
    t = table.schema.field("embedding").type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_fixed_size_list(
        t.value_type
    ):
        raise _Refuse(f"embedding column of type {t}")
    value_type = t.value_type.value_type
    dtype = meta.get("dtype")
    want = {"float16": pa.float16(), "float32": pa.float32(), "bfloat16": pa.uint16(), "int8": pa.int8()}.get(
        dtype
    )
    if want is None or value_type != want:
        raise _Refuse(f"values of type {value_type} for dtype {dtype!r}")
    dim = t.value_type.list_size
    if id_col.null_count or (emb is not None and emb.null_count):
        raise _Refuse("null ids or embeddings")
    ids = id_col.to_pylist()
    if emb is None:
        offsets = np.zeros(1, np.int64)
        values = np.zeros((0, dim))
    else:
        tokens = emb.flatten()
        if tokens.null_count or tokens.flatten().null_count:
            raise _Unsure("null values")
        offsets = emb.offsets.to_numpy().astype(np.int64)
        offsets = offsets - offsets[0]
        values = _as_float64(tokens.flatten().to_numpy(zero_copy_only=False), dtype).reshape(-1, dim)
    scales = None
    if dtype == "int8":
        if "scales" not in names:
            raise _Refuse("int8 without scales")
        s = table.column("scales").combine_chunks() if table.num_rows else None
        st = table.schema.field("scales").type
        if not (pa.types.is_list(st) or pa.types.is_large_list(st)) or st.value_type != pa.float32():
            raise _Refuse(f"scales of type {st}")
        if s is not None:
            if s.null_count or s.flatten().null_count:
                raise _Refuse("null scales")
            if not np.array_equal(np.diff(s.offsets.to_numpy()), np.diff(offsets)):
                raise _Refuse("scales and embedding lengths differ")
            scales = s.flatten().to_numpy().astype(np.float64)
        else:
            scales = np.zeros(0)
    elif "scales" in names:
        raise _Unsure("scales for float values")
    if "length" in names:
        raise _Unsure("a length column")
    _check_meta(meta, len(ids), len(values), dim, dtype)
    return ShardContent(ids, _check_content(ids, offsets, values, scales), dtype, dim)


def shard_reference(case: ShardCase) -> ShardContent | str | None:
    """What the shard holds; a string: the rule it breaks; None: the harness does not judge it."""
    try:
        # as maxsim sniffs: the leading magic, else the suffix
        if case.data[:6] == b"ARROW1" or (case.data[:4] != b"PAR1" and case.name.endswith(".arrow")):
            return read_arrow_reference(case.data)
        return read_safetensors_reference(case.data)
    except _Refuse as exc:
        return str(exc) or "refused"
    except _Unsure:
        return None


def _cast_queries(queries: Sequence[np.ndarray], dtype: str) -> list[np.ndarray]:
    if dtype == "float16":
        return [q.astype(np.float16).astype(np.float64) for q in queries]
    if dtype == "bfloat16":
        return [_as_float64(_bf16_bits(q), "bfloat16") for q in queries]
    return [q.astype(np.float64) for q in queries]


def rounding_bound(
    queries: Sequence[np.ndarray], docs: Sequence[np.ndarray], rel: float = 0.02
) -> np.ndarray:
    """Per (query, document): how far rounding the inputs (to 16 bits, or int8 codes) may move a
    score: ``rel`` times the sum over query tokens of the largest ``|q|_1 |d|_inf + |q|_inf |d|_1``."""
    out = np.empty((len(queries), len(docs)))
    for i, q in enumerate(queries):
        qa = np.abs(np.asarray(q, np.float64))
        for j, d in enumerate(docs):
            da = np.abs(np.asarray(d, np.float64))
            term = qa.sum(1)[:, None] * da.max(1)[None, :] + qa.max(1)[:, None] * da.sum(1)[None, :]
            out[i, j] = rel * term.max(axis=1).sum() + 1e-4
    return out


def run_problem(
    run: dict[str, list],
    qids: Sequence[str],
    queries: Sequence[np.ndarray],
    content: ShardContent,
    k: int,
    candidates: dict[str, list[str]] | None = None,
) -> str | None:
    """How a run (``{qid: [(docno, score)]}``) differs from MaxSim over ``content``."""
    cast = _cast_queries(queries, content.dtype)
    ref = maxsim_reference(cast, content.docs) if content.docs else np.zeros((len(queries), 0))
    bound = rounding_bound(cast, content.docs) if content.docs else ref
    for i, qid in enumerate(qids):
        got = [tuple(x) for x in run.get(qid, [])]
        if candidates is None:
            problem = ranking_problem(got, content.ids, ref[i], bound[i], k)
        else:
            present = [d for d in candidates.get(qid, []) if d in content.ids]
            keep = [content.ids.index(d) for d in present]
            problem = ranking_problem(got, present, ref[i][keep], bound[i][keep], min(k, len(present)))
        if problem:
            return f"{qid}: {problem}"
    return None


# in the forked child


def _outcome_of(exc: BaseException) -> dict[str, Any]:
    from maxsim_cli.errors import MaxsimError

    if isinstance(exc, MaxsimError):
        return {"status": "refused", "type": type(exc).__name__, "message": str(exc)}
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/maxsim_cli/" in f.filename or "/kernels/" in f.filename] or frames[-1:]
    place = f"{os.path.relpath(ours[-1].filename, ROOT)}:{ours[-1].lineno} ({ours[-1].name})" if ours else "?"
    return {
        "status": "exception",
        "type": type(exc).__name__,
        "message": str(exc)[:2000],
        "where": one_line(" | ".join(traceback.format_exception(exc)[-3:]), 600),
        "place": place,
    }


def shard_library(args: dict[str, Any]) -> dict[str, Any]:
    """Open the shard as a corpus and score: streamed `search`, resident `search`, `rerank`."""
    from maxsim_cli import Queries, open_corpus, rerank, search

    queries = Queries.from_embeddings(args["qids"], [np.asarray(q, np.float32) for q in args["queries"]])
    out: dict[str, Any] = {"status": "ok"}
    stage = "open_corpus"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with open_corpus(args["path"]) as corpus:
                stage = "search"
                out["search"] = search(queries, corpus, k=args["k"], device="cpu").to_dict()
                stage = "corpus.to"
                corpus.to("cpu")
                stage = "resident search"
                out["resident"] = search(queries, corpus, k=args["k"], device="cpu").to_dict()
                stage = "rerank"
                out["rerank"] = rerank(queries, corpus, args["candidates"], device="cpu").to_dict()
    except Exception as exc:  # noqa: BLE001 - the outcome is the verdict
        out = _outcome_of(exc)
    out["stage"] = stage
    return out


def _check_error(
    report: Report, target: str, index: int, cls: str, what: str, outcome: dict[str, Any]
) -> None:
    if outcome["status"] == "exception":
        report.add(
            target,
            index,
            "internal",
            cls,
            f"{what}: {outcome['type']}: {outcome['message'][:200]} at {outcome.get('where', '')}",
            f"{outcome['type']} at {outcome.get('place', '?')}: {_shape_of(outcome['message'])}",
        )
    elif outcome["status"] == "refused" and ("\n" in outcome["message"] or not outcome["message"].strip()):
        report.add(target, index, "multiline", cls, f"{what}: {outcome['message'][:300]!r}")


def _check_child(
    report: Report, target: str, index: int, cls: str, what: str, answer: dict[str, Any]
) -> dict | None:
    """The child's result, or None after counting how it failed to give one."""
    tool = what.split(":")[0]
    if answer["timed_out"]:
        report.add(
            target,
            index,
            "hang",
            cls,
            f"{what}: still running after {SANDBOX_TIMEOUT_S:.0f} s",
            f"{tool}: hang",
        )
        return None
    if answer["code"] < 0:
        died = _exit_text(answer["code"])
        report.add(
            target,
            index,
            "crash",
            cls,
            f"{what}: {died}",
            f"{tool}: {died} in {_crash_place(answer['stderr'])}",
        )
        return None
    result = answer["result"]
    if result is None or answer["code"] != 0:
        report.add(
            target,
            index,
            "crash",
            cls,
            f"{what}: the child exited {answer['code']} without a result: {answer['stderr'][-300:]}",
        )
        return None
    if "harness_error" in result:
        report.harness_errors.append(f"{target} case {index}: {result['harness_error'][-800:]}")
        return None
    return result


def read_trec(data: bytes) -> dict[str, list[tuple[str, float]]]:
    out: dict[str, list[tuple[str, float]]] = {}
    for line in data.decode("utf-8").splitlines():
        qid, _, docno, _, score, _ = line.split()
        out.setdefault(qid, []).append((docno, float(np.float32(score))))
    return out


def check_cli(
    report: Report,
    target: str,
    index: int,
    cls: str,
    what: str,
    answer: dict[str, Any],
    run_file: Path | None,
    expected: dict | None,
    refused: str | None,
) -> str:
    """Count how a command failed; returns its outcome (``exit N`` or how it died)."""
    code = answer["code"]
    stderr = answer["stderr"]
    tool = what.split(":")[0]
    if answer["timed_out"]:
        report.add(
            target,
            index,
            "hang",
            cls,
            f"{what}: still running after {SANDBOX_TIMEOUT_S:.0f} s",
            f"{tool}: hang",
        )
        return "timeout"
    if code < 0:
        report.add(target, index, "crash", cls, f"{what}: {_exit_text(code)}", f"{tool}: {_exit_text(code)}")
        return _exit_text(code)
    traced = "Traceback (most recent call last)" in stderr
    if traced:
        last = [ln for ln in stderr.splitlines() if ln.strip()][-1]
        report.add(
            target,
            index,
            "traceback",
            cls,
            f"{what}: {last}",
            f"{tool}: {last.split(':')[0]} at {_traceback_place(stderr)}",
        )
    if code not in (0, 1, 2):
        report.add(target, index, "internal", cls, f"{what}: exit {code}: {stderr[-200:]}")
    elif code in (1, 2) and not traced:
        lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("maxsim: warning:")]
        if len(lines) != 1 or not lines[0].startswith("maxsim: error:"):
            report.add(
                target,
                index,
                "multiline",
                cls,
                f"{what}: exit {code} with {len(lines)} lines: {stderr[:300]!r}",
            )
    elif code == 0 and refused is not None:
        report.add(
            target,
            index,
            "wrong",
            cls,
            f"{what}: exit 0 where {refused}",
            f"{tool}: exit 0 where it should refuse",
        )
    elif code == 0 and expected is not None and run_file is not None:
        try:
            got = read_trec(run_file.read_bytes())
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            report.add(target, index, "wrong", cls, f"{what}: exit 0 but no readable run ({exc})")
        else:
            want = {q: [(d, float(np.float32(s))) for d, s in rows] for q, rows in expected.items() if rows}
            if got != want:
                report.add(
                    target,
                    index,
                    "wrong",
                    cls,
                    f"{what}: the run differs from the library's: {str(got)[:150]} vs {str(want)[:150]}",
                    f"{tool}: a run unlike the library's",
                )
    return f"exit {code}"


def fuzz_shards(
    report: Report,
    seed: int,
    cases: Sequence[int],
    workdir: Path,
    sandbox: Sandbox,
    *,
    verbose: bool = False,
    save: Path | None = None,
) -> None:
    from maxsim_cli.shards import write_shard

    tally = report.tallies["shards"]
    started = time.perf_counter()
    corpus_dir = make_corpus(workdir / "corpus")
    oracle: Oracle | None = None
    try:
        for index in cases:
            case = shard_case(seed, index)
            tally.cases += 1
            tally.classes[case.cls] += 1
            case_dir = workdir / f"shard-{index}"
            shutil.rmtree(case_dir, ignore_errors=True)
            case_dir.mkdir(parents=True)
            (case_dir / case.name).write_bytes(case.data)
            if save is not None:
                save.mkdir(parents=True, exist_ok=True)
                (save / f"shards-{index}-{case.name}").write_bytes(case.data)
            qids = ["qa", "qb"]
            write_shard(case_dir / "queries.safetensors", qids, case.queries)
            what = f"{case.cls} ({case.note})"
            if verbose:
                print(f"case {index}: {what}, {len(case.data)} bytes: {case.data[:200]!r}")
            if case.stdin:
                if oracle is None:
                    oracle = Oracle(corpus_dir)
                expected = oracle.expect(HttpCase("/search", ARROW_TYPE, case.data, "", case.cls))
                # the server's own rules aside, `maxsim score -` reads what the library reads
                refused = expected.refuse if expected.refuse and "no queries" not in expected.refuse else None
                run = None
                if expected.answer is not None:
                    run = {qid: hits for qid, hits, _ in expected.answer}
                elif expected.refuse == "no queries":
                    run = {}
                argv = ["score", "-", str(corpus_dir), "-k", "10", "--device", "cpu", "-q", "-o", "run.trec"]
                answer = sandbox.run("cli", {"argv": argv}, case_dir, stdin=case_dir / case.name)
                outcome = check_cli(
                    report,
                    "shards",
                    index,
                    case.cls,
                    f"maxsim score -: {what}",
                    answer,
                    case_dir / "run.trec",
                    run,
                    refused and f"the library refuses: {refused}",
                )
                tally.outcomes[f"score - {outcome}"] += 1
                if verbose:
                    print(f"maxsim score -: {outcome}: {answer['stderr'][-600:]}")
            else:
                fuzz_one_shard(report, index, case, case_dir, qids, sandbox, verbose)
            if save is None:
                shutil.rmtree(case_dir, ignore_errors=True)
    finally:
        if oracle is not None:
            oracle.close()
        tally.seconds += time.perf_counter() - started


def fuzz_one_shard(
    report: Report,
    index: int,
    case: ShardCase,
    case_dir: Path,
    qids: list[str],
    sandbox: Sandbox,
    verbose: bool,
) -> None:
    tally = report.tallies["shards"]
    content = shard_reference(case)
    rnd = random.Random(case_seed(0, "candidates", index))
    candidates = {"qa": rnd.sample(SHARD_IDS, 3) + ["absent"], "qb": rnd.sample(SHARD_IDS, 2)}
    k = 4
    what = f"{case.cls} ({case.note})"
    args = {
        "path": case.name,
        "qids": qids,
        "queries": [q.tolist() for q in case.queries],
        "k": k,
        "candidates": candidates,
    }
    answer = sandbox.run("shard_library", args, case_dir)
    result = _check_child(report, "shards", index, case.cls, f"library: {what}", answer)
    library_run = None
    library_refused = None
    if result is not None:
        tally.outcomes[f"library {result['status']}"] += 1
        _check_error(report, "shards", index, case.cls, f"library {result['stage']}: {what}", result)
        if verbose:
            print(f"library: {result['status']} at {result['stage']}: {result.get('message', '')[:500]}")
        if result["status"] == "ok":
            library_run = result["search"]
            if isinstance(content, str):
                report.add(
                    "shards",
                    index,
                    "wrong",
                    case.cls,
                    f"library: {what}: scored a shard that breaks a rule ({content})",
                    f"library: scored a shard that breaks: {content}",
                )
            elif content is not None:
                problem = (
                    run_problem(result["search"], qids, case.queries, content, k)
                    or run_problem(result["rerank"], qids, case.queries, content, 10**9, candidates)
                    or (
                        None
                        if result["resident"] == result["search"]
                        else "the resident corpus ranks differently"
                    )
                )
                if problem:
                    report.add(
                        "shards",
                        index,
                        "wrong",
                        case.cls,
                        f"library: {what}: {problem}",
                        "library: a run unlike MaxSim over the file",
                    )
        elif result["status"] == "refused":
            library_refused = result["message"]
    argv = [
        "score",
        "queries.safetensors",
        case.name,
        "-k",
        str(k),
        "--device",
        "cpu",
        "-q",
        "-o",
        "run.trec",
    ]
    answer = sandbox.run("cli", {"argv": argv}, case_dir)
    refused = (
        f"the library refuses: {one_line(library_refused, 100)}"
        if library_refused
        else (f"the shard breaks a rule: {content}" if isinstance(content, str) else None)
    )
    outcome = check_cli(
        report,
        "shards",
        index,
        case.cls,
        f"maxsim score: {what}",
        answer,
        case_dir / "run.trec",
        library_run,
        refused,
    )
    tally.outcomes[f"score {outcome}"] += 1
    if verbose:
        print(f"maxsim score: {outcome}: {answer['stderr'][-600:]}")
    if outcome == "exit 1" and library_run is not None:
        tally.notes["maxsim score refused what the library scores"] += 1
    if index % 3:
        return
    answer = sandbox.run("cli", {"argv": ["inspect", case.name, "--check-values"]}, case_dir)
    outcome = check_cli(
        report, "shards", index, case.cls, f"maxsim inspect: {what}", answer, None, None, None
    )
    tally.outcomes[f"inspect {outcome}"] += 1
    if verbose:
        print(f"maxsim inspect: {outcome}: {answer['stderr'][-600:]}")


# --------------------------------------------------------------------------------------------------
# api cases: odd arguments to Queries.from_embeddings, search and rerank, in forked children


@dataclasses.dataclass
class ApiCase:
    """A call drawn from the case's generator: ``cls`` and ``note`` say what it tries; ``spec`` is what
    the child builds the arguments from (plain data, so the parent can show it)."""

    cls: str
    note: str
    spec: dict[str, Any]


API_DTYPES = [
    "float32",
    "float16",
    "float64",
    "bfloat16",
    "int8",
    "int32",
    "int64",
    "uint8",
    "bool",
    "complex64",
    "object",
    "str",
    "datetime64[s]",
    "float128",
]
API_K = [
    0,
    -1,
    1,
    48,
    49,
    2**31 - 1,
    2**31,
    2**63 - 1,
    2**63,
    2**64,
    10**30,
    -(2**63),
    2.5,
    1.0,
    True,
    False,
    "5",
    None,
    "nan",
    "np.int64",
    "np.float64",
    "np.uint64-max",
    "tensor",
]


# API calls that once failed, made on purpose (case -1 is the first): the spec's changes and a name.
KNOWN_API: list[tuple[str, dict[str, Any]]] = [
    (
        "padded embeddings with a numpy bool mask",
        {"layout": "padded", "mask_kind": "numpy-bool", "how": "valid"},
    ),
    ("search(k=2.5)", {"call": "search", "k": 2.5, "how": "k"}),
    ("search(k=True)", {"call": "search", "k": True, "how": "k"}),
    ("complex64 embeddings", {"dtype": "complex64"}),
    ("object embeddings", {"dtype": "object"}),
    ("rerank(k='5')", {"call": "rerank", "k": "5", "how": "k"}),
    ("device=None", {"option": ("device", None)}),
]


def api_case(seed: int, index: int) -> ApiCase:
    """Case ``index`` of the API: drawn from its seed, or (``index`` < 0) one of `KNOWN_API`."""
    rnd, _ = case_rng(seed, "api", index)
    n = pick(rnd, [(1, 3), (2, 3), (3, 1)])
    spec: dict[str, Any] = {
        "seed": case_seed(seed, "api-values", index),
        "n": n,
        "tokens": [rnd.randint(1, 5) for _ in range(n)],
        "qids": [f"q{i}" for i in range(n)],
        "dtype": "float32",
        "layout": pick(rnd, "list:4 padded:2 tensors:2"),
        "call": rnd.choice(["search", "rerank"]),
        "k": rnd.randint(1, 12),
        "corpus": pick(rnd, "path:2 open:2 resident:3 list:1"),
        "how": "valid",
        "mask_kind": rnd.choice(["numpy-bool", "numpy-int", "torch-bool", "torch-int"]),
    }
    if index < 0:
        note, changes = KNOWN_API[-index - 1]
        spec.update(changes)
        spec["layout"] = "padded" if spec["layout"] == "padded" else "list"
        return ApiCase("api/known", note, spec)
    cls = pick(rnd, "valid:10 ids:6 dtype:8 shape:8 mask:5 values:6 k:10 candidates:6 options:6 args:4")
    note = ""
    if cls == "ids":
        spec["qids"][0] = rnd.choice(ODD_QIDS[:-1] + ["q1", b"q0", ("q",), 7.0, "np.int64", "np.str_"])
        if spec["qids"][0] == "q1" and n == 1:
            spec["qids"].append("q1")
            spec["tokens"].append(2)
            spec["n"] = 2
        if rnd.random() < 0.3:
            spec["qids"] = (
                spec["qids"][: rnd.choice([0, max(0, n - 1)])]
                if rnd.random() < 0.5
                else spec["qids"] + ["extra"]
            )
        note = f"qids {str(spec['qids'])[:60]}"
    elif cls == "dtype":
        spec["dtype"] = rnd.choice(API_DTYPES)
        note = spec["dtype"]
    elif cls == "shape":
        spec["how"] = rnd.choice(
            (
                "1d 3d-item no-tokens no-dim ragged-dim wrong-dim packed-2d 4d scalar "
                "empty-list nested-lists generator dict huge-tokens non-contiguous requires-grad meta string"
            ).split()
        )
        note = spec["how"]
    elif cls == "mask":
        spec["layout"] = rnd.choice(["padded", "list"])
        spec["how"] = rnd.choice(
            (
                "mask-shape mask-float mask-all-false mask-two "
                "mask-negative mask-list mask-none-row mask-count mask-nan"
            ).split()
        )
        note = f"{spec['layout']} {spec['how']}"
    elif cls == "values":
        spec["how"] = rnd.choice("nan inf fp16-overflow huge subnormal negative-zero zeros".split())
        note = spec["how"]
    elif cls == "k":
        spec["how"] = "k"
        spec["k"] = rnd.choice(API_K)
        note = f"k={str(spec['k'])[:30]}"
    elif cls == "candidates":
        spec["call"] = "rerank"
        spec["how"] = rnd.choice(
            (
                "int-qid int-docno none-docno tuple-score nan-score str-score unknown-qid duplicate "
                "empty list none generator absent strict-absent frame frame-columns run bytes-docno "
                "file-missing huge"
            ).split()
        )
        note = spec["how"]
    elif cls == "options":
        option = rnd.choice(
            "device backend max_memory max_host_memory batch_queries strict show_progress".split()
        )
        values = {
            "device": [
                "cpu",
                "cuda",
                "cuda:0",
                "cuda:99",
                "meta",
                "",
                "CPU",
                "cpu:0",
                "tpu",
                None,
                5,
                "auto",
            ],
            "backend": ["torch", "triton", "", "numpy", None, 1],
            "max_memory": [0, -1, 1, "1KiB", "abc", "1e3", 2**70, 1.5, "", "-5MiB", "16MiB"],
            "max_host_memory": [0, -1, 1, "1KiB", "abc", 2**70, 1.5, "", "16MiB", "1TiB"],
            "batch_queries": [0, -1, 1, 2**40, 2.5, "2", True, None],
            "strict": [True, "yes", 1, None],
            "show_progress": [True, "no", 2],
        }[option]
        spec["option"] = (option, rnd.choice(values))
        if option in ("batch_queries",):
            spec["call"] = "search"
        if option == "strict":
            spec["call"] = "rerank"
        note = f"{option}={spec['option'][1]!r}"
    elif cls == "args":
        spec["how"] = rnd.choice(
            (
                "queries-triple queries-list queries-none queries-missing-path queries-folder "
                "corpus-none corpus-int corpus-empty-list corpus-missing corpus-not-shard queries-dict"
            ).split()
        )
        note = spec["how"]
    return ApiCase(f"api/{cls}", note, spec)


def _api_array(values: np.ndarray, dtype: str) -> Any:
    import torch

    if dtype == "bfloat16":
        return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16)
    if dtype == "str":
        return values.astype(str)
    if dtype == "object":
        return values.astype(object)
    if dtype == "float128":
        return values.astype(np.longdouble)
    return values.astype(dtype)


def _api_value(value: Any) -> Any:
    import torch

    return (
        {
            "nan": float("nan"),
            "np.int64": np.int64(5),
            "np.float64": np.float64(5.0),
            "np.uint64-max": np.uint64(2**64 - 1),
            "tensor": torch.tensor(5),
            "np.str_": np.str_("q0"),
        }.get(value, value)
        if isinstance(value, str) or not isinstance(value, (list, tuple, dict))
        else value
    )


def api_child(args: dict[str, Any]) -> dict[str, Any]:
    """Build the case's call, make it, and judge what came back (in the forked child)."""
    import torch

    from maxsim_cli import Queries, Run, open_corpus, rerank, search

    case = api_case(args["seed"], args["index"])
    spec = case.spec
    rng = np.random.default_rng(spec["seed"])
    corpus_dir = args["corpus"]
    values = [rng.standard_normal((t, DIM)).astype(np.float32) for t in spec["tokens"]]
    how = spec["how"]
    must_refuse = None  # a documented rule the input breaks
    judge = True  # whether the expected answer is known (the values and k as given)
    if how in ("nan", "inf", "fp16-overflow", "huge", "subnormal", "negative-zero", "zeros"):
        fill = {
            "nan": np.nan,
            "inf": -np.inf,
            "fp16-overflow": 1e5,
            "huge": 3e38,
            "subnormal": 1e-42,
            "negative-zero": -0.0,
            "zeros": 0.0,
        }[how]
        values[0][0, rng.integers(DIM)] = fill
        if how in ("nan", "inf"):
            must_refuse = "NaN/Inf values"
        if how in ("fp16-overflow", "huge"):
            judge = False  # past the corpus's float16: refused, or finite scores
    qids = [_api_value(q) for q in spec["qids"]]
    dtype = spec["dtype"]
    if dtype != "float32":
        if dtype in ("int8",):
            must_refuse = "int8 queries carry no scales"
        judge = dtype in ("float16", "float64", "bfloat16") and judge
    mask = None
    embeddings: Any
    arrays = [_api_array(v, dtype) if dtype != "float32" else v for v in values]
    if spec["layout"] == "tensors":
        embeddings = [
            torch.as_tensor(a)
            if isinstance(a, np.ndarray) and a.dtype.kind in "fiub" and a.dtype.itemsize <= 8
            else a
            for a in arrays
        ]
    else:
        embeddings = arrays
    expected_values = [v.astype(np.float64) for v in values]
    if spec["layout"] == "padded" and dtype in ("float32", "float16", "float64", "bfloat16"):
        longest = max(spec["tokens"])
        padded = np.zeros((len(values), longest, DIM), np.float32)
        mask_np = np.zeros((len(values), longest), bool)
        for i, v in enumerate(values):
            padded[i, : len(v)] = v
            mask_np[i, : len(v)] = True
        embeddings = _api_array(padded, dtype) if dtype != "float32" else padded
        mask = {
            "numpy-bool": mask_np,
            "numpy-int": mask_np.astype(np.int64),
            "torch-bool": torch.from_numpy(mask_np),
            "torch-int": torch.from_numpy(mask_np.astype(np.int32)),
        }[spec["mask_kind"]]
    if how.startswith("mask"):
        judge = False
        lengths = spec["tokens"]
        if spec["layout"] == "padded":
            mask = mask_np
        if spec["layout"] == "list":
            mask = [np.ones(t, bool) for t in lengths]
        if how == "mask-shape":
            mask = (
                np.ones((len(values), max(lengths) + 1), bool)
                if spec["layout"] == "padded"
                else [np.ones(t + 1, bool) for t in lengths]
            )
        elif how == "mask-float":
            mask = (
                (mask.astype(np.float32) * 0.5)
                if isinstance(mask, np.ndarray)
                else [m.astype(np.float32) * 0.5 for m in mask]
            )
        elif how == "mask-all-false":
            if isinstance(mask, np.ndarray):
                mask[0] = False
            else:
                mask[0][:] = False
            must_refuse = "a query without tokens"
        elif how == "mask-two":
            mask = (
                (mask.astype(np.int64) * 2)
                if isinstance(mask, np.ndarray)
                else [m.astype(np.int64) * 2 for m in mask]
            )
        elif how == "mask-negative":
            mask = (
                -np.ones_like(mask, dtype=np.int64)
                if isinstance(mask, np.ndarray)
                else [-np.ones(len(m), np.int64) for m in mask]
            )
        elif how == "mask-list":
            mask = mask.tolist() if isinstance(mask, np.ndarray) else [m.tolist() for m in mask]
        elif how == "mask-none-row":
            mask = [None] * len(values)
        elif how == "mask-count":
            mask = mask[:-1] if len(mask) > 1 else list(mask) + [np.ones(1, bool)]
        elif how == "mask-nan":
            mask = np.full(
                np.shape(mask) if isinstance(mask, np.ndarray) else (len(values), max(lengths)), np.nan
            )
        if spec["mask_kind"].startswith("torch"):  # the same masks as tensors

            def as_tensor(m: Any) -> Any:
                return torch.from_numpy(m) if isinstance(m, np.ndarray) and m.dtype != object else m

            mask = as_tensor(mask) if not isinstance(mask, list) else [as_tensor(m) for m in mask]
    elif how != "valid" and how in (
        "1d",
        "3d-item",
        "no-tokens",
        "no-dim",
        "ragged-dim",
        "wrong-dim",
        "packed-2d",
        "4d",
        "scalar",
        "empty-list",
        "nested-lists",
        "generator",
        "dict",
        "huge-tokens",
        "non-contiguous",
        "requires-grad",
        "meta",
        "string",
    ):
        judge = how in ("nested-lists", "generator", "non-contiguous", "requires-grad", "huge-tokens")
        if how == "1d":
            embeddings = [v.reshape(-1) for v in values]
        elif how == "3d-item":
            embeddings = [v[None] for v in values]
        elif how == "no-tokens":
            embeddings = [values[0][:0]] + values[1:]
            must_refuse = "a query without tokens"
        elif how == "no-dim":
            embeddings = [v[:, :0] for v in values]
            must_refuse = "dim 0"
        elif how == "ragged-dim":
            embeddings = [values[0][:, :-1]] + values[1:]
            must_refuse = "queries of two dims" if len(values) > 1 else "a dim the corpus does not have"
        elif how == "wrong-dim":
            embeddings = [np.concatenate([v, v], axis=1) for v in values]
            must_refuse = "a dim the corpus does not have"
        elif how == "packed-2d":
            embeddings = np.concatenate(values)
        elif how == "4d":
            embeddings = np.zeros((len(values), 2, 2, DIM), np.float32)
        elif how == "scalar":
            embeddings = 0.5
        elif how == "empty-list":
            embeddings = []
        elif how == "nested-lists":
            embeddings = [v.tolist() for v in values]
        elif how == "generator":
            embeddings = (v for v in values)
        elif how == "dict":
            embeddings = {str(q): v for q, v in zip(qids, values, strict=False)}
        elif how == "huge-tokens":
            values[0] = rng.standard_normal((4096, DIM)).astype(np.float32)
            expected_values[0] = values[0].astype(np.float64)
            embeddings = values
        elif how == "non-contiguous":
            embeddings = [
                np.asfortranarray(v)[:, ::1] if i % 2 else np.repeat(v, 2, axis=0)[::2]
                for i, v in enumerate(values)
            ]
        elif how == "requires-grad":
            embeddings = [torch.from_numpy(v).requires_grad_(True) for v in values]
        elif how == "meta":
            embeddings = [torch.empty(v.shape, device="meta") for v in values]
            judge = False
        elif how == "string":
            embeddings = "embeddings"
    if any(not isinstance(q, (str, int)) or isinstance(q, bool) for q in qids) or len(qids) != len(values):
        judge = False
    elif len({str(q) for q in qids}) != len(qids):
        must_refuse = "duplicate ids"
    elif any(isinstance(q, str) and id_breaks_rules(q) for q in qids):
        must_refuse = "an id that breaks the id rules"
    shown = [str(q) for q in qids] if judge else []
    k_raw = _api_value(spec["k"])
    k_int = k_raw if _is_int(k_raw) else None
    if k_int is None:
        judge = False
    elif k_int < 1:
        must_refuse = f"k={k_int}"
    kwargs: dict[str, Any] = {"k": k_raw, "device": "cpu"}
    candidates: Any = None
    if spec["call"] == "rerank":
        crng = random.Random(spec["seed"])
        candidates = {
            str(q): crng.sample(CORPUS_IDS, crng.randint(1, 8)) for q in qids if isinstance(q, (str, int))
        }
        if crng.random() < 0.3 and how == "valid":
            kwargs.pop("k")
            k_int = 10**9
        how_c = how
        if how_c == "int-qid":
            candidates = {
                int(q[1:]) if isinstance(q, str) and q[1:].isdigit() else q: d for q, d in candidates.items()
            }
            judge = False
        elif how_c == "int-docno":
            candidates = {q: [5, 7] for q in candidates}
            judge = False
        elif how_c == "none-docno":
            candidates = {q: [None] + d for q, d in candidates.items()}
            judge = False
        elif how_c == "tuple-score":
            candidates = {q: [(x, 1.0) for x in d] for q, d in candidates.items()}
        elif how_c == "nan-score":
            candidates = {q: [(x, float("nan")) for x in d] for q, d in candidates.items()}
        elif how_c == "str-score":
            candidates = {q: [(x, "high") for x in d] for q, d in candidates.items()}
            judge = False
        elif how_c == "unknown-qid":
            candidates["nobody"] = ["d1"]
            must_refuse = "candidates for a qid with no query"
        elif how_c == "duplicate":
            first = next(iter(candidates))
            candidates[first] = candidates[first] + candidates[first][:1]
            must_refuse = "a docno twice"
        elif how_c == "empty":
            candidates = {q: [] for q in candidates}
        elif how_c == "list":
            candidates = [("q0", "d1")]
            judge = False
        elif how_c == "none":
            candidates = None
            judge = False
        elif how_c == "generator":
            candidates = (c for c in ["q0 Q0 d1 1 1.0 x"])
            judge = False
        elif how_c in ("absent", "strict-absent"):
            candidates = {q: d + ["absent-doc"] for q, d in candidates.items()}
            if how_c == "strict-absent":
                kwargs["strict"] = True
                must_refuse = "strict with candidates not in the corpus"
        elif how_c == "frame":
            import pandas as pd

            candidates = pd.DataFrame(
                [(q, d) for q, ds in candidates.items() for d in ds], columns=["qid", "docno"]
            )
        elif how_c == "frame-columns":
            import pandas as pd

            candidates = pd.DataFrame({"query": ["q0"], "doc": ["d1"]})
            judge = False
        elif how_c == "run":
            candidates = Run({q: [(d, 0.0) for d in ds] for q, ds in candidates.items()})
        elif how_c == "bytes-docno":
            candidates = {q: [x.encode() for x in d] for q, d in candidates.items()}
            judge = False
        elif how_c == "file-missing":
            candidates = os.path.join(corpus_dir, "no-such-run.trec")
            judge = False
        elif how_c == "huge":
            candidates = {q: [f"absent{i}" for i in range(50_000)] + d for q, d in candidates.items()}
    if "option" in spec:
        name, value = spec["option"]
        kwargs[name] = value
        judge = (
            judge
            and name in ("show_progress",)
            and value is True
            or (judge and name == "device" and value == "cpu")
        )
        if name == "device" and value == "cuda:99":
            must_refuse = None
    queries_arg: Any = None
    corpus_arg: Any = None
    built = "build"
    out: dict[str, Any] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if how.startswith(("queries-", "corpus-")):
                judge = False
            if how == "queries-triple":
                queries_arg = (qids, embeddings, None)
            elif how == "queries-list":
                queries_arg = [qids, embeddings]
            elif how == "queries-none":
                queries_arg = None
            elif how == "queries-missing-path":
                queries_arg = os.path.join(corpus_dir, "nothing.safetensors")
            elif how == "queries-folder":
                queries_arg = corpus_dir
            elif how == "queries-dict":
                queries_arg = dict(zip(qids, embeddings, strict=False))
            else:
                built = "Queries.from_embeddings"
                queries_arg = Queries.from_embeddings(qids, embeddings, mask)
            built = "corpus"
            if how == "corpus-none":
                corpus_arg = None
            elif how == "corpus-int":
                corpus_arg = 5
            elif how == "corpus-empty-list":
                corpus_arg = []
            elif how == "corpus-missing":
                corpus_arg = os.path.join(corpus_dir, "missing")
            elif how == "corpus-not-shard":
                corpus_arg = __file__
            elif spec["corpus"] == "path":
                corpus_arg = corpus_dir
            elif spec["corpus"] == "list":
                corpus_arg = [os.path.join(corpus_dir, "a.safetensors"), Path(corpus_dir) / "b.arrow"]
            else:
                corpus_arg = open_corpus(corpus_dir)
                if spec["corpus"] == "resident":
                    corpus_arg.to("cpu")
            built = spec["call"]
            if spec["call"] == "search":
                run = search(queries_arg, corpus_arg, **kwargs)
            else:
                run = rerank(queries_arg, corpus_arg, candidates, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the outcome is the verdict
        out = _outcome_of(exc)
        out["stage"] = built
        return out
    out = {"status": "ok", "stage": built}
    if not isinstance(run, Run):
        out["problem"] = f"{spec['call']} returned {type(run).__name__}, not a Run"
        return out
    rows = run.to_dict()
    if any(not math.isfinite(s) for hits in rows.values() for _, s in hits):
        out["problem"] = "a score that is not finite"
        return out
    if must_refuse is not None:
        out["problem"] = f"scored an input that breaks a rule ({must_refuse})"
        return out
    if judge and k_int is not None:
        docs = [v.astype(np.float64) for v in corpus_values()]
        content = ShardContent(list(CORPUS_IDS), docs, "float16", DIM)
        cands = None
        if spec["call"] == "rerank":
            cands = candidates.to_dict() if isinstance(candidates, Run) else candidates
            if hasattr(cands, "itertuples"):
                frame = cands
                cands = {}
                for q, d in zip(frame["qid"], frame["docno"], strict=True):
                    cands.setdefault(str(q), []).append(d)
            cands = {str(q): [d if isinstance(d, str) else d[0] for d in ds] for q, ds in cands.items()}
            k_eff = k_int if "k" in kwargs else 10**9
        else:
            k_eff = k_int
        problem = run_problem(rows, shown, expected_values, content, k_eff, cands)
        if problem:
            out["problem"] = problem
    return out


def fuzz_api(
    report: Report, seed: int, cases: Sequence[int], workdir: Path, sandbox: Sandbox, *, verbose: bool = False
) -> None:
    tally = report.tallies["api"]
    started = time.perf_counter()
    corpus_dir = make_corpus(workdir / "corpus")
    case_dir = workdir / "cases"
    case_dir.mkdir(parents=True, exist_ok=True)
    try:
        for index in cases:
            case = api_case(seed, index)
            tally.cases += 1
            tally.classes[case.cls] += 1
            what = f"{case.cls} ({case.note})"
            answer = sandbox.run(
                "api_child", {"seed": seed, "index": index, "corpus": str(corpus_dir)}, case_dir
            )
            result = _check_child(report, "api", index, case.cls, what, answer)
            if verbose:
                print(f"case {index}: {what}: {case.spec}\n  -> {answer['code']} {result}")
            if result is None:
                continue
            tally.outcomes[result["status"]] += 1
            _check_error(report, "api", index, case.cls, f"{what} in {result['stage']}", result)
            if result.get("problem"):
                report.add(
                    "api",
                    index,
                    "wrong",
                    case.cls,
                    f"{what}: {result['problem']}",
                    f"{result['stage']}: {re.sub(r'[(].*', '', result['problem'])}",
                )
    finally:
        tally.seconds += time.perf_counter() - started


# --------------------------------------------------------------------------------------------------
# the whole run


def split_cases(total: int) -> dict[str, int]:
    """``total`` cases shared among the targets by `SHARES` (at least one each)."""
    return {t: max(1, round(total * share)) for t, share in SHARES.items()}


def known_cases(target: str) -> list[int]:
    """The numbers of the target's cases built on purpose: -N .. -1."""
    count = {"server": len(KNOWN_SERVER), "shards": len(KNOWN_SHARDS), "api": len(KNOWN_API)}[target]
    return list(range(-count, 0))


def default_cases(total: int, first: int = 0) -> dict[str, list[int]]:
    """Each target's cases for a run of ``total`` drawn cases: the known ones, then its share."""
    counts = split_cases(total)
    return {t: known_cases(t) + list(range(first, first + counts[t])) for t in TARGETS}


def run_fuzz(
    seed: int,
    cases: dict[str, Sequence[int]],
    *,
    workdir: Path | None = None,
    server_args: Sequence[str] = (),
    max_restarts: int = 4,
    verbose: bool = False,
    save: Path | None = None,
) -> Report:
    """Run the cases of each target (``{"server": range(200), ...}``) and return the report."""
    report = Report(seed)
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="maxsim-fuzz-")))
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            if cases.get("server"):
                fuzz_server(
                    report,
                    seed,
                    cases["server"],
                    workdir / "server",
                    server_args=server_args,
                    max_restarts=max_restarts,
                    verbose=verbose,
                    save=save,
                )
            if cases.get("shards") or cases.get("api"):
                sandbox = Sandbox(workdir)
                try:
                    if cases.get("shards"):
                        fuzz_shards(
                            report,
                            seed,
                            cases["shards"],
                            workdir / "shards",
                            sandbox,
                            verbose=verbose,
                            save=save,
                        )
                    if cases.get("api"):
                        fuzz_api(report, seed, cases["api"], workdir / "api", sandbox, verbose=verbose)
                finally:
                    sandbox.close()
    return report
