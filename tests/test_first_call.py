"""A fresh process's first call: the timeline (`MAXSIM_TIMELINE`) and the kernel warm-up thread.

The warm-up runs on CUDA only; here it is forced on for the Triton backend under the interpreter, where
it makes the same calls on CPU tensors (`KernelWarmup.wanted` patched).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_pack import hf_table, make_docs
from test_score import make_corpus, make_queries, parse_run, reference_run, reference_scores
from typer.testing import CliRunner

from maxsim_cli import timeline
from maxsim_cli.cli import app
from maxsim_cli.scoring.entry import score
from maxsim_cli.scoring.warmup import KernelWarmup
from maxsim_cli.tuning import THREAD_SWITCH_S as SWITCH_S

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()
MAIN_STAGES = ["command", "imports", "checked", "corpus_open", "queries_read", "first_batch_launched"]


def _warmup_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "maxsim-warmup"]


@pytest.fixture
def small(tmp_path: Path) -> tuple[list[str], str, dict, dict]:
    paths, docs = make_corpus(tmp_path / "c", "float16", layout=(("safetensors", 6), ("arrow", 5)))
    queries = make_queries(tmp_path / "q.safetensors", n=3)
    return paths, str(tmp_path / "q.safetensors"), queries, docs


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up on for the Triton backend on the CPU (the interpreter)."""
    pytest.importorskip("maxsim_kernels.maxsim_forward")
    monkeypatch.setattr(KernelWarmup, "wanted", staticmethod(lambda device, backend: backend == "triton"))


def test_timeline_of_a_fresh_process(small, tmp_path: Path) -> None:
    paths, qpath, _, _ = small
    out = tmp_path / "timeline.json"
    started = time.time()
    env = {**os.environ, timeline.ENV_PATH: str(out), timeline.ENV_T0: repr(started)}
    cmd = [sys.executable, "-m", "maxsim_cli", "score", qpath, *paths, "-k", "3", "--device", "cpu", "-q"]
    proc = subprocess.run([*cmd, "-o", str(tmp_path / "run.trec")], env=env, cwd=ROOT, capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()
    record = json.loads(out.read_text())
    assert record["t0"] == started and record["t0_source"] == "parent" and record["pid"] > 0
    stages = record["stages"]
    assert [s for s in stages if s in MAIN_STAGES] == MAIN_STAGES  # in the order reached
    assert list(stages)[-1] == "run_written"
    assert 0 < stages["command"] <= stages["run_written"] < time.time() - started
    # on the CPU there is no warm-up thread and no arena
    assert set(record["threads"].values()) == {"MainThread"}
    assert "kernels_ready" not in stages and "arena_locked" not in stages


def test_timeline_start_from_proc(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the parent's time, the process's start time from /proc: before now, after boot."""
    monkeypatch.delenv(timeline.ENV_T0, raising=False)
    t0, source = timeline.process_start()
    assert source in ("proc", "first-mark") and t0 <= time.time()


def test_timeline_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(timeline.ENV_PATH, raising=False)
    before = dict(timeline._stages)
    timeline.mark("never-written")
    assert timeline._stages == before and not timeline.enabled()


def test_timeline_unwritable_is_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv(timeline.ENV_PATH, str(tmp_path / "missing" / "t.json"))
    timeline.write()
    err = capsys.readouterr().err
    assert err.startswith("maxsim: warning: MAXSIM_TIMELINE=") and err.count("\n") == 1
    assert not list(tmp_path.iterdir())


def test_no_warmup_on_the_cpu(small, tmp_path: Path) -> None:
    paths, qpath, _, _ = small
    assert KernelWarmup.start(torch.device("cpu"), "auto") is None
    assert not KernelWarmup.wanted(torch.device("cpu"), "triton")
    stats = score(qpath, paths, output=str(tmp_path / "run.trec"), top_k=3, device="cpu")
    assert "warmup" not in stats.extra and "kernels_wait_s" not in stats.extra
    assert not _warmup_threads()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_warmup_loads_the_value_check_on_cuda(tmp_path: Path, dtype: str) -> None:
    """On CUDA the thread loads the batches' value check (each dtype) before the queries come."""
    paths, _ = make_corpus(tmp_path / "c", dtype, layout=(("safetensors", 6), ("arrow", 5)))
    make_queries(tmp_path / "q.safetensors", n=3)
    stats = score(str(tmp_path / "q.safetensors"), paths, output=str(tmp_path / "run.trec"), top_k=3,
                  device="cuda")  # fmt: skip
    warmup = stats.extra["warmup"]
    assert "error" not in warmup and "checks_loaded_s" in warmup and "kernels_ready_s" in warmup, warmup
    assert len(parse_run((tmp_path / "run.trec").read_text())) == 3


def test_warmup_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAXSIM_KERNEL_WARMUP", "0")
    assert not KernelWarmup.wanted(torch.device("cuda"), "auto")


@pytest.mark.parametrize("rerank", [False, True], ids=["exhaustive", "rerank"])
def test_warmup_gives_the_same_run(forced, small, tmp_path: Path, rerank: bool) -> None:
    paths, qpath, queries, docs = small
    extra = {}
    if rerank:
        cands = tmp_path / "cands.trec"
        cands.write_text("".join(f"q{i} Q0 {d} 1 1.0 bm25\n" for i in range(3) for d in sorted(docs)[:4]))
        extra["candidates"] = str(cands)
    interval = sys.getswitchinterval()
    stats = score(qpath, paths, output=str(tmp_path / "run.trec"), top_k=3, device="cpu", backend="triton",
                  **extra)  # fmt: skip
    assert sys.getswitchinterval() == interval  # handed back
    assert not _warmup_threads()
    assert "error" not in stats.extra["warmup"], stats.extra["warmup"]
    assert "kernels_ready_s" in stats.extra["warmup"] and stats.extra["kernels_wait_s"] >= 0
    got = parse_run((tmp_path / "run.trec").read_text())
    if rerank:
        docs = {d: docs[d] for d in sorted(docs)[:4]}
    assert got == reference_run(reference_scores(queries, docs), 3)


def test_bad_shard_with_the_warmup_is_one_line(forced, small, tmp_path: Path) -> None:
    paths, qpath, _, _ = small
    bad = tmp_path / "c" / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    out = tmp_path / "run.trec"
    result = runner.invoke(
        app, ["score", qpath, *paths, str(bad), "--device", "cpu", "--backend", "triton", "-o", str(out)]
    )
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("maxsim: error: ") and "bad.safetensors" in lines[0]
    assert not out.exists() and not _warmup_threads()


def test_error_after_the_launches_were_given(forced, small, tmp_path: Path) -> None:
    """A bad --candidates line fails after the queries are read (the warm-up has its launches)."""
    paths, qpath, _, _ = small
    cands = tmp_path / "cands.trec"
    cands.write_text("q0 Q0 doc000\n")
    result = runner.invoke(
        app,
        ["score", qpath, *paths, "--device", "cpu", "--backend", "triton", "--candidates", str(cands)],
    )
    assert result.exit_code == 1, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("maxsim: error: ")
    assert not _warmup_threads()


def _reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(("maxsim-read", "maxsim-dispatch"))]


@pytest.mark.parametrize("early", ["1", "0"], ids=["early-reads", "MAXSIM_EARLY_READS=0"])
def test_interrupt_while_the_first_batches_are_read(
    forced, small, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, early: str
) -> None:
    """Ctrl-C while the run waits for the warm-up, its first batches being read meanwhile: exit 130, no
    reader, dispatcher or warm-up thread left, nothing written. ``MAXSIM_EARLY_READS=0``: no reads yet."""
    from maxsim_cli.scoring.pipeline import BatchStream

    started: list[int] = []
    start = BatchStream.start

    def spy(self: BatchStream) -> None:
        started.append(1)
        start(self)

    def interrupted(self: KernelWarmup) -> float:
        raise KeyboardInterrupt

    monkeypatch.setattr(BatchStream, "start", spy)
    monkeypatch.setattr(KernelWarmup, "wait", interrupted)
    monkeypatch.setenv("MAXSIM_EARLY_READS", early)
    paths, qpath, _, _ = small
    out = tmp_path / "run.trec"
    result = runner.invoke(
        app, ["score", qpath, *paths, "--device", "cpu", "--backend", "triton", "-o", str(out)]
    )
    assert result.exit_code == 130, result.output
    assert started == ([1] if early == "1" else [])
    assert not out.exists() and not _warmup_threads() and not _reader_threads()


def test_interrupt_joins_the_thread(forced, small, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the corpus opens: exit 130, the thread is joined, nothing written."""
    import maxsim_cli.scoring.files as files

    def interrupted(paths: list[str]) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(files, "open_corpus", interrupted)
    paths, qpath, _, _ = small
    out = tmp_path / "run.trec"
    result = runner.invoke(
        app, ["score", qpath, *paths, "--device", "cpu", "--backend", "triton", "-o", str(out)]
    )
    assert result.exit_code == 130
    assert not out.exists() and not _warmup_threads()


# --------------------------------------------------------------------------------------------------
# Python's garbage collector in a one-shot process (`maxsim_cli.collector`)

SPY = """
import gc, json, sys
from maxsim_cli import tuning as collector
seen = {"collections_while_paused": 0, "passes": []}
begins = collector.pass_begins

def spy():
    before = gc.isenabled()
    begins()
    seen["passes"].append([before, gc.isenabled(), gc.get_freeze_count() > 0])

def on_gc(phase, info):
    if phase == "start" and collector._paused:
        seen["collections_while_paused"] += 1

collector.pass_begins = spy
gc.callbacks.append(on_gc)
from maxsim_cli.cli import main
try:
    main(sys.argv[1:])
finally:
    seen["enabled_at_exit"] = gc.isenabled()
    print(json.dumps(seen), file=sys.stderr)
"""


@pytest.mark.parametrize("pause", ["1", "0"], ids=["paused", "MAXSIM_GC_PAUSE=0"])
def test_a_one_shot_score_pauses_the_collector_until_its_pass(small, tmp_path: Path, pause: str) -> None:
    """`maxsim score` as a process: no collection while it imports and sets up; the pass begins with the
    collector on and what existed frozen; the run is the one scored in-process. ``MAXSIM_GC_PAUSE=0``:
    the collector as Python runs it."""
    paths, qpath, queries, docs = small
    out = tmp_path / "run.trec"
    cmd = [sys.executable, "-c", SPY, "score", qpath, *paths, "-k", "3", "--device", "cpu", "-q"]
    cmd += ["-o", str(out)]
    env = {**os.environ, "MAXSIM_GC_PAUSE": pause}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stderr.strip().splitlines()[-1])
    passes = [[False, True, True]] if pause == "1" else [[True, True, False]]
    assert seen == {"collections_while_paused": 0, "passes": passes, "enabled_at_exit": True}
    assert parse_run(out.read_text()) == reference_run(reference_scores(queries, docs), 3)


def test_the_collector_is_left_alone_in_a_callers_process(small, tmp_path: Path) -> None:
    """In-process (the API, `CliRunner`): never paused, nothing frozen; a one-shot command that ends
    without a pass (an error) turns it on again."""
    import gc

    from maxsim_cli import tuning as collector

    paths, qpath, _, _ = small
    frozen = gc.get_freeze_count()
    result = runner.invoke(app, ["score", qpath, *paths, "--device", "cpu", "-q", "-o", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    collector.one_shot_process()
    try:
        collector.pause_until_pass()
        assert not gc.isenabled()
        collector.command_ended()  # the set-up failed: no pass began
        assert gc.isenabled() and gc.get_freeze_count() == frozen
    finally:
        collector._one_shot = False
        collector.command_ended()


def test_a_one_shot_score_that_fails_before_its_pass_turns_the_collector_on_again(small, tmp_path) -> None:
    """`maxsim score` as a process, failing in its set-up (a missing corpus file): one line, exit 1, the
    collector on again when the command has ended, nothing frozen, no run written."""
    _, qpath, _, _ = small
    out = tmp_path / "run.trec"
    missing = str(tmp_path / "missing.safetensors")
    cmd = [sys.executable, "-c", SPY, "score", qpath, missing, "--device", "cpu", "-q", "-o", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    error, spy = proc.stderr.strip().splitlines()
    assert error.startswith("maxsim: error: ") and "missing.safetensors" in error
    assert json.loads(spy) == {"collections_while_paused": 0, "passes": [], "enabled_at_exit": True}
    assert not out.exists()


def test_close_before_load_launches_nothing() -> None:
    pytest.importorskip("maxsim_kernels.maxsim_forward")
    called: list[int] = []
    interval = sys.getswitchinterval()
    warm = KernelWarmup(torch.device("cpu"))
    assert sys.getswitchinterval() == min(interval, SWITCH_S)
    warm.close()
    warm.load(lambda: called.append(1))  # too late: the thread has ended
    assert not called and not _warmup_threads() and sys.getswitchinterval() == interval


def test_a_failing_launch_is_kept_not_raised() -> None:
    pytest.importorskip("maxsim_kernels.maxsim_forward")

    def fails() -> None:
        raise RuntimeError("no such kernel")

    warm = KernelWarmup(torch.device("cpu"))
    warm.load(fails)
    assert warm.wait() >= 0
    assert warm.stats()["error"] == "RuntimeError: no such kernel"
    warm.close()  # a second end is harmless
    assert not _warmup_threads()


def test_profile_script_one_fresh_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/profile_first_call.py on the CPU: one fresh process's row, the medians, the bytecode."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import profile_first_call as profile
    from common import build_corpus, build_queries

    work = tmp_path / "w"
    corpus = build_corpus(str(work / "corpus"), 1 << 20, 1 << 20, torch.device("cpu"))
    queries = str(work / "queries.safetensors")
    build_queries(queries, 2, torch.device("cpu"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    args = profile.argparse.Namespace(workdir=str(work), top_k=5, device="cpu", trace=False)
    row = profile.one_run(args, "on", corpus, queries, "t")
    assert "trace" not in row
    assert row["mode"] == "on" and row["warmup"] is None  # no warm-up on the CPU
    assert list(row["stages"]) == [s for s in profile.STAGES if s in row["stages"]]
    assert {"command", "imports", "first_batch_launched", "run_written"} <= row["stages"].keys()
    assert 0 < row["wall_s"] < row["process_s"] and len(row["run_sha256"]) == 64
    med = profile.summary([row, {**row, "mode": "off"}])
    assert med["on"]["runs"] == 1 and med["off"]["wall_s"] == row["wall_s"]
    report = profile.bytecode_report()
    assert report["py_files"] >= report["with_pyc"] >= 0
    # under pass_trace.py, with the collector off during the pass: the same run, and the pass's trace
    traced = profile.one_run(args, "on-pycache-gcoff", corpus, queries, "g")
    assert traced["run_sha256"] == row["run_sha256"]
    trace = traced["trace"]
    assert trace["batches"] >= 1 and 0 < trace["first_batch_host_ms"] <= trace["loop_end"]
    assert trace["loop_end"] <= trace["result_end"] <= trace["write_start"] <= trace["write_end"]
    assert trace["gc_in_pass"] == {"gen0": [0, 0.0], "gen1": [0, 0.0], "gen2": [0, 0.0]}
    assert trace["calls_ms"]["BatchStream.close"][0] >= 1


# --------------------------------------------------------------------------------------------------
# Triton's cache key, saved and read back (`remember_triton_key`)

KEY = "9.9.9" + "-".join(["ab12" * 16, "cd34" * 16, "ef56" * 16])  # version, then sha256 digests


def _fake_triton(root: Path, key: str = KEY) -> tuple[types.SimpleNamespace, list[int]]:
    """A `triton.runtime.cache` stand-in over a small Triton-like tree under ``root``, whose
    ``triton_key`` counts its calls."""
    for rel in ("runtime/cache.py", "compiler/compiler.py", "backends/nvidia/driver.py", "language/core.py",
                "_C/libtriton.so"):  # fmt: skip
        if not (root / rel).exists():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(rel)
    calls: list[int] = []

    def triton_key() -> str:
        calls.append(1)
        return key

    return types.SimpleNamespace(__file__=str(root / "runtime" / "cache.py"), triton_key=triton_key), calls


@pytest.fixture
def fake_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="9.9.9"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def test_triton_key_is_saved_then_read_back(fake_version: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first process computes the key and saves it beside Triton's cache; the next reads it back and
    hands it out wherever a Triton module holds ``triton_key``."""
    from maxsim_cli.tuning import remember_triton_key

    first, calls = _fake_triton(fake_version / "triton")
    assert remember_triton_key(first) and calls == [1]
    saved = list((fake_version / "cache").iterdir())
    assert [p.read_text() for p in saved] == [KEY] and saved[0].name.startswith("maxsim-triton-key-")
    second, calls = _fake_triton(fake_version / "triton")
    user = types.SimpleNamespace(triton_key=second.triton_key)  # a module that imported it by name
    monkeypatch.setitem(sys.modules, "triton.compiler.fake_user", user)
    assert remember_triton_key(second) and calls == []  # read back, not computed
    assert user.triton_key() == KEY and user.triton_key is not second.triton_key


def test_a_changed_triton_file_or_a_bad_copy_computes_the_key_again(fake_version: Path) -> None:
    from maxsim_cli.tuning import remember_triton_key

    root = fake_version / "triton"
    module, _ = _fake_triton(root)
    remember_triton_key(module)
    (root / "compiler" / "compiler.py").write_text("edited: another size")
    counted: list[int] = []
    module.triton_key = lambda: counted.append(1) or KEY
    assert remember_triton_key(module) and counted == [1]  # a new fingerprint: computed
    assert len(list((fake_version / "cache").iterdir())) == 2
    for saved in (fake_version / "cache").iterdir():
        saved.write_text("9.9.9 not a key")
    assert remember_triton_key(module) and counted == [1, 1]  # not a key of this Triton: computed
    for saved in (fake_version / "cache").iterdir():
        saved.write_text(KEY[:-5])  # a copy cut short
    assert remember_triton_key(module) and counted == [1, 1, 1]


def test_an_unwritable_cache_folder_still_gives_the_key(
    fake_version: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from maxsim_cli.tuning import remember_triton_key

    blocker = fake_version / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(blocker / "cache"))  # under a file: cannot be made
    module, calls = _fake_triton(fake_version / "triton")
    assert remember_triton_key(module) and calls == [1]
    assert remember_triton_key(module) and calls == [1, 1]  # nothing saved: computed each time
    assert list(fake_version.glob("**/.maxsim-triton-key-*")) == []


def test_a_signal_while_the_key_is_saved_leaves_no_temporary_file(
    fake_version: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C (or a stop signal, which raises as it does) while the key is written: the key is not
    saved and no temporary file is left in Triton's cache folder."""
    from maxsim_cli import tuning as warmup

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(warmup.os, "fdopen", interrupted)
    with pytest.raises(KeyboardInterrupt):
        warmup._save(str(fake_version / "cache" / "maxsim-triton-key-x"), KEY)
    assert list((fake_version / "cache").iterdir()) == []


def test_the_saved_key_is_off_by_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``MAXSIM_TRITON_KEY_CACHE=0``: the warm-up calls Triton's own function and saves nothing."""
    triton_cache = pytest.importorskip("triton.runtime.cache")
    from maxsim_cli.scoring import warmup

    counted: list[int] = []
    monkeypatch.setattr(triton_cache, "triton_key", lambda: counted.append(1) or "k")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MAXSIM_TRITON_KEY_CACHE", "0")
    warmup._cache_key()
    assert counted == [1] and list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------------
# The CUDA context made beside torch's import (`maxsim_cli.cuda_early`)


@pytest.mark.parametrize(
    ("device", "devices", "expected"),
    [
        ("auto", None, [0]),
        ("cuda", None, [0]),
        (" CUDA:3 ", None, [3]),
        ("cpu", None, []),
        ("cuda:x", None, []),
        ("mps", None, []),
        ("auto", "1,0,1", [0, 1]),
        ("auto", "0,a", []),
    ],
)
def test_early_cuda_ordinals(monkeypatch: pytest.MonkeyPatch, device, devices, expected) -> None:
    """The ordinals torch will pick, read from the option text alone; none where it is not plain."""
    from maxsim_cli import cuda_early

    monkeypatch.delenv(cuda_early.ENV_SWITCH, raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cuda_early.ordinals(device, devices) == expected


@pytest.mark.parametrize("env", [{"MAXSIM_EARLY_CUDA": "0"}, {"WORLD_SIZE": "2"}, {"WORLD_SIZE": "x"}])
def test_early_cuda_off(monkeypatch: pytest.MonkeyPatch, env: dict) -> None:
    """Turned off by its switch, and inside a torchrun job (whose launcher picks the rank's device)."""
    from maxsim_cli import cuda_early

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cuda_early.start("cuda:0") is None


def test_early_cuda_without_a_driver_is_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    """No driver library (this machine, or a CPU-only container): the thread ends at once, raising
    nothing; a driver that fails any call stops it the same way."""
    from maxsim_cli import cuda_early

    monkeypatch.delenv(cuda_early.ENV_SWITCH, raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(cuda_early, "_LIBRARY", "libmaxsim-no-such-driver.so.1")
    thread = cuda_early.start("auto")
    assert thread is not None and thread.daemon
    thread.join(5)
    assert not thread.is_alive()

    calls: list[str] = []

    class FailingDriver:
        def __getattr__(self, name: str):
            def call(*args) -> int:
                calls.append(name)
                return 100  # CUDA_ERROR_NO_DEVICE

            return call

    monkeypatch.setattr(cuda_early.ctypes, "CDLL", lambda name: FailingDriver())
    cuda_early._make_contexts([0])
    assert calls == ["cuInit"]


def test_early_cuda_retains_each_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a driver: cuInit once, then each wanted device's primary context retained; an ordinal past
    the device count stops there (torch's own check reports it)."""
    from maxsim_cli import cuda_early

    calls: list[tuple] = []

    class Driver:
        def cuInit(self, flags):
            calls.append(("init", flags))
            return 0

        def cuDeviceGetCount(self, count):
            count._obj.value = 2
            return 0

        def cuDeviceGet(self, handle, ordinal):
            handle._obj.value = 10 + ordinal
            return 0

        def cuDevicePrimaryCtxRetain(self, context, handle):
            calls.append(("retain", handle.value))
            return 0

    monkeypatch.setattr(cuda_early.ctypes, "CDLL", lambda name: Driver())
    cuda_early._make_contexts([0, 1])
    assert calls == [("init", 0), ("retain", 10), ("retain", 11)]
    calls.clear()
    cuda_early._make_contexts([1, 5])
    assert calls == [("init", 0), ("retain", 11)]


@pytest.mark.gpu
def test_early_cuda_context_is_the_one_torch_uses(tmp_path: Path) -> None:
    """In a fresh process: the context made by the thread is torch's (current once torch sets the
    device), and a run made after it is a run as before."""
    code = (
        "import ctypes, sys\n"
        "from maxsim_cli import cuda_early\n"
        "t = cuda_early.start('cuda:0'); t.join()\n"
        "import torch\n"
        "torch.cuda.set_device(0); x = torch.ones(4, device='cuda').sum().item()\n"
        "drv = ctypes.CDLL('libcuda.so.1'); cur = ctypes.c_void_p(); dev = ctypes.c_int()\n"
        "drv.cuCtxGetCurrent(ctypes.byref(cur)); drv.cuDeviceGet(ctypes.byref(dev), 0)\n"
        "prim = ctypes.c_void_p(); drv.cuDevicePrimaryCtxRetain(ctypes.byref(prim), dev)\n"
        "print(x, cur.value == prim.value and cur.value is not None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["4.0", "True"]


# --------------------------------------------------------------------------------------------------
# A scoring run without pyarrow's pandas bridge (`maxsim_cli.arrays`)


# Each runs in one fresh process, in this order (a later one may read what an earlier one wrote): a
# `maxsim score` run of each kind, then the shard readers and writers (Arrow and safetensors, float and
# int8) that build their arrays without pyarrow's pandas bridge too.
PANDAS_FREE = {
    "score-exhaustive": ["score", "{q}", "sample_data/corpus", "-k", "10", "-o", "{tmp}/a.trec", "--device",
                         "cpu"],
    "score-rerank": [
        "score", "{q}", "sample_data/corpus", "-k", "10", "-o", "{tmp}/b.trec", "--device", "cpu",
        "--candidates", "sample_data/candidates.trec",
    ],
    "score-jsonl": [
        "score", "{q}", "sample_data/corpus", "-k", "10", "-o", "{tmp}/c.jsonl", "--device", "cpu",
        "--format", "jsonl",
    ],
    "score-arrow-shard": [
        "score", "{q}", "sample_data/corpus.arrow", "-k", "10", "-o", "{tmp}/d.trec", "--device", "cpu",
    ],
    "pack-arrow-to-arrow": ["pack", "sample_data/corpus.arrow", "-o", "{tmp}/arrow", "--format", "arrow"],
    "quantize-arrow": ["quantize", "{tmp}/arrow", "-o", "{tmp}/int8-arrow"],
    "quantize-safetensors": ["quantize", "sample_data/corpus", "-o", "{tmp}/int8"],
    "inspect-arrow": ["inspect", "sample_data/corpus.arrow"],
    "pack-bool-mask": ["pack", "{tmp}/padded.parquet", "-o", "{tmp}/masked", "--mask-column",
                       "attention_mask"],
}  # fmt: skip


def test_commands_do_not_import_pandas(tmp_path: Path) -> None:
    """pyarrow imports pandas (0.2-0.3 s of a fresh process) at its first ``pa.array`` or ``to_numpy``;
    `maxsim score` and the shard commands build their arrays without them. One fresh process runs every
    command of `PANDAS_FREE` in turn and says after each whether pandas is imported: the first that
    imports it is named."""
    ids, docs = make_docs(n=8, seed=14)
    table = hf_table(ids, docs, mask_pad=3)
    table = table.set_column(2, "attention_mask", table.column("attention_mask").cast(pa.list_(pa.bool_())))
    pq.write_table(table, tmp_path / "padded.parquet")
    runs = {
        name: [
            arg.replace("{tmp}", str(tmp_path)).replace("{q}", "sample_data/queries.safetensors")
            for arg in args
        ]
        for name, args in PANDAS_FREE.items()
    }
    code = (
        "import json, sys\n"
        "from maxsim_cli.cli import main\n"
        "for name, args in json.loads(sys.argv[1]).items():\n"
        "    try:\n        main(args)\n"
        "    except SystemExit as e:\n        assert not e.code, (name, e.code)\n"
        "    print(name, 'pandas' in sys.modules, flush=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(runs)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    said = dict(
        line.split() for line in proc.stdout.splitlines() if line.split()[:1] and line.split()[0] in runs
    )
    assert list(said) == list(runs), proc.stdout
    assert "True" not in said.values(), (
        f"pandas imported by: {next(n for n, v in said.items() if v == 'True')}"
    )
    assert (tmp_path / "a.trec").stat().st_size > 0
