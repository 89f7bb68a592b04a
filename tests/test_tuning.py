"""Process-wide settings (`maxsim_cli.tuning`) are the entry points' alone: a library caller gets none."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# a fresh interpreter: nothing imported or set before the library is
LIBRARY_CALLER = """
import gc, json, sys
import numpy as np
import torch

def state():
    return {
        "switch_interval": sys.getswitchinterval(),
        "gc_enabled": gc.isenabled(),
        "gc_frozen": gc.get_freeze_count(),
        "gc_threshold": list(gc.get_threshold()),
        "torch_threads": torch.get_num_threads(),
    }

before = state()
import maxsim_cli
from maxsim_cli import Corpus, Queries, rerank, search
rng = np.random.default_rng(0)
docs = [rng.standard_normal((n, 8)).astype(np.float32) for n in (3, 5, 2, 4)]
corpus = Corpus.from_embeddings(["a", "b", "c", "d"], docs)
queries = Queries.from_embeddings(["q1", "q2"], [rng.standard_normal((2, 8)).astype(np.float32)] * 2)
found = search(queries, corpus, k=2, device="cpu")
rerank(queries, corpus, {"q1": ["a", "b"], "q2": ["c"]}, device="cpu")
from maxsim_cli import tuning
print(json.dumps({"before": before, "after": state(), "rows": sum(len(v) for v in found.to_dict().values()),
                  "marked": tuning.in_one_shot_process(), "paused": tuning._paused}))
"""


def test_a_library_caller_gets_no_process_wide_setting() -> None:
    """Importing maxsim_cli and running a small CPU search and rerank leave Python's switch interval,
    its garbage collector and torch's host threads as they were, and the process unmarked."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-c", LIBRARY_CALLER], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["after"] == seen["before"]
    assert seen["rows"] == 4 and not seen["marked"] and not seen["paused"]


def test_the_pause_needs_the_entry_points_mark() -> None:
    """`pause_until_pass` outside a process that `cli.main` marked does nothing."""
    from maxsim_cli import tuning

    assert not tuning.in_one_shot_process()
    tuning.pause_until_pass()
    assert gc.isenabled() and not tuning._paused


def test_quick_thread_switches_hands_the_interval_back() -> None:
    from maxsim_cli import tuning

    interval = sys.getswitchinterval()
    with tuning.quick_thread_switches():
        assert sys.getswitchinterval() == min(interval, tuning.THREAD_SWITCH_S)
    assert sys.getswitchinterval() == interval


def test_settings_read_the_environment_when_asked(monkeypatch) -> None:
    from maxsim_cli import settings

    for name in settings.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert settings.early_reads() and settings.gc_pause() and settings.kernel_warmup()
    assert settings.triton_key_cache() and settings.early_cuda() and settings.map_host()
    monkeypatch.setenv(settings.EARLY_READS, "0")
    assert not settings.early_reads()
    monkeypatch.setenv(settings.TIMELINE, "")
    assert settings.timeline_path() is None
    monkeypatch.setenv(settings.LAUNCHER_PID, "123")
    assert settings.launcher_pid() == "123"
