"""`maxsim score` as a job of several processes (`maxsim_cli.parallel`): the run is byte for byte the
single-process run, in exhaustive and rerank mode; a failing or dying rank fails the job cleanly.

The jobs run on the CPU with gloo: under torchrun (``python -m torch.distributed.run``) and with
``--devices cpu:2`` (the launcher of this package). The corpus has 4 shards of unequal sizes, documents
duplicated across shards (equal scores on different ranks, so the docno tie-break crosses ranks) and
top-k cuts inside those ties. Documents have 1 to 39 tokens: the CPU backend pads the operands of its
small products (`_MIN_GEMM_ROWS` in kernels/cpu.py; MKL's small-matrix kernels round differently), so a
score does not depend on how documents are grouped, in one process or across ranks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from failrank.sitecustomize import failing_share
from typer.testing import CliRunner

from maxsim_cli.cli import app
from maxsim_cli.devices import parse_devices
from maxsim_cli.errors import MaxsimError, UsageError
from maxsim_cli.merge import select_top_k
from maxsim_cli.parallel import launcher, shares, threads
from maxsim_cli.parallel.shares import ResultSink, split_candidates
from maxsim_cli.run_files import sort_trec
from maxsim_cli.scoring import dispatch
from maxsim_cli.scoring.entry import score
from maxsim_cli.scoring.request import ScoreRequest
from maxsim_cli.shards import write_shard
from maxsim_cli.shards.resident import assign_shards

runner = CliRunner()
DIM = 32
SHARD_DOCS = (30, 12, 22, 8)  # unequal shards: the balancing has something to do
JOB_ENV = {"MAXSIM_DIST_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}
# A folder whose sitecustomize makes a worker's rank fail (MAXSIM_TEST_FAIL_RANK): tests only.
FAIL_RANK_DIR = str(Path(__file__).resolve().parent / "failrank")


def _fail_rank_env(value: str) -> dict[str, str]:
    """The environment that makes rank ``value`` of a job's worker processes fail (``R``, ``R:kill``)."""
    path = os.pathsep.join(p for p in (FAIL_RANK_DIR, os.environ.get("PYTHONPATH")) if p)
    return {"MAXSIM_TEST_FAIL_RANK": value, "PYTHONPATH": path}


# --------------------------------------------------------------------------------------------------
# data


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("dist")
    rng = np.random.default_rng(7)
    corpus = root / "corpus"
    corpus.mkdir()
    shared = None  # one document's tokens, repeated in every shard under different docnos
    all_ids = []
    for s, n in enumerate(SHARD_DOCS):
        docs, ids = [], []
        for d in range(n):
            length = int(rng.integers(1, 40))
            emb = rng.standard_normal((length, DIM)).astype(np.float32)
            if d == 0:
                shared = emb if shared is None else shared
                emb = shared
            docs.append(emb / np.linalg.norm(emb, axis=1, keepdims=True))
            ids.append(f"s{s}-d{d:02d}" if d else f"tie-{s}")
        write_shard(str(corpus / f"shard-{s}.safetensors"), ids, docs, dtype="float32")
        all_ids.extend(ids)
    queries = []
    for _ in range(9):
        emb = rng.standard_normal((int(rng.integers(4, 9)), DIM)).astype(np.float32)
        queries.append(emb / np.linalg.norm(emb, axis=1, keepdims=True))
    qids = [f"q{i}" for i in range(len(queries))]
    write_shard(str(root / "queries.safetensors"), qids, queries, dtype="float32")
    # candidates: from every shard, in random order, with ids in no shard; q3 has only missing ones
    lines = []
    for qid in qids:
        if qid == "q3":
            picked = ["gone-1", "gone-2"]
        else:
            picked = list(rng.choice(all_ids, size=14, replace=False))
            if qid == "q1":
                picked.insert(3, "gone-3")
        for rank, docno in enumerate(picked, 1):
            lines.append(f"{qid} Q0 {docno} {rank} {20 - rank} bm25\n")
    (root / "cands.trec").write_text("".join(lines))
    return {
        "root": str(root),
        "queries": str(root / "queries.safetensors"),
        "corpus": str(corpus),
        "cands": str(root / "cands.trec"),
    }


def _single(data: dict[str, str], out: Path, **kwargs) -> list[str]:
    """The single-process run (written to ``out``) and what it logged."""
    messages: list[str] = []
    score(data["queries"], [data["corpus"]], output=str(out), device="cpu", log=messages.append, **kwargs)
    return messages


def _torchrun(args: list[str], extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "maxsim_cli", "score", *args, "--device", "cpu"]
    env = dict(os.environ, **JOB_ENV, **(extra_env or {}))
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def _leftovers(directory: Path, name: str) -> list[str]:
    return [n for n in os.listdir(directory) if n == name or n.startswith(f".{name}.")]


# --------------------------------------------------------------------------------------------------
# pure pieces


def test_assign_shards_largest_first_onto_least_loaded():
    assert assign_shards([5, 9, 1, 7], 2) == [[1, 2], [0, 3]]  # 9+1 vs 7+5
    assert assign_shards([4, 4, 4, 4], 2) == [[0, 2], [1, 3]]  # ties: shard order, then lower rank
    assert assign_shards([3, 1], 4) == [[0], [1], [], []]  # more ranks than shards
    assert assign_shards([], 3) == [[], [], []]
    rng = np.random.default_rng(0)
    for world in (2, 3, 8):
        tokens = rng.integers(1, 1000, size=40).tolist()
        shares = assign_shards(tokens, world)
        assert sorted(s for share in shares for s in share) == list(range(40))
        loads = [sum(tokens[s] for s in share) for share in shares]
        assert max(loads) <= sum(tokens) / world + max(tokens)
        assert shares == assign_shards(tokens, world)  # deterministic: every rank computes the same


def test_parse_devices():
    assert parse_devices("cpu:3") == ["cpu", "cpu", "cpu"]
    assert parse_devices("cpu") == ["cpu"]
    for bad in ("cpu:0", "cpu:x", "0,x", "-1"):
        with pytest.raises(UsageError, match="--devices"):
            parse_devices(bad)
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="no CUDA device"):
            parse_devices("all")
        with pytest.raises(UsageError, match="no CUDA device"):
            parse_devices("0,1")
    with pytest.raises(UsageError, match="listed twice"):
        parse_devices("0,0")


def test_select_top_k_is_trec_order_cut_after_k():
    rng = np.random.default_rng(3)
    for trial in range(200):
        n = int(rng.integers(1, 60))
        docnos = [f"d{i:03d}" for i in rng.permutation(n)]
        scores = (rng.integers(-6, 6, size=n) / 4).astype(np.float32)  # many ties, +0 and -0
        scores[rng.random(n) < 0.1] = -0.0
        k = int(rng.integers(1, n + 3))
        got = sorted(select_top_k(docnos, scores, k).tolist())
        assert got == sorted(sort_trec(docnos, scores.tolist())[:k]), trial


def _best(ranks, qid: str, k: int) -> list[str]:
    docnos = [d for res in ranks for x, ds, _ in res if x == qid for d in ds]
    scores = [float(v) for res in ranks for x, _, sc in res if x == qid for v in sc]
    return sorted(docnos[i] for i in sort_trec(docnos, scores)[:k])


def test_results_below_the_ranks_bound_never_make_the_top_k():
    # Ranks' top-k lists filtered by the best k-th score over ranks merge to the same top-k, and far
    # fewer results travel: about k per query instead of k per rank.
    rng = np.random.default_rng(5)
    k, world = 10, 6
    for trial in range(50):
        per_rank = []
        for r in range(world):
            results = []
            for q in range(4):
                n = int(rng.integers(0, 25))
                docnos = [f"r{r}-{i:02d}" for i in range(n)]
                scores = (rng.integers(-8, 8, size=n) / 4).astype(np.float32)  # many ties across ranks
                keep = select_top_k(docnos, scores, k)
                if len(keep):
                    results.append((f"q{q}", [docnos[i] for i in keep], scores[keep]))
            per_rank.append(results)
        bounds = [shares.kth_scores(results, k) for results in per_rank]
        filtered = [shares.drop_below(results, bounds) for results in per_rank]
        for q in range(4):
            assert _best(filtered, f"q{q}", k) == _best(per_rank, f"q{q}", k), trial
        sent = sum(len(ds) for res in filtered for _, ds, _ in res)
        assert sent <= sum(len(ds) for res in per_rank for _, ds, _ in res)


def test_columns_trimmed_by_the_ranks_floor_merge_to_the_union_top_k():
    # Exhaustive mode's columns: each rank's best k per query (rows best first, many ties across ranks),
    # cut by the best k-th score over the ranks, merge to the top-k of the union in trec order.
    rng = np.random.default_rng(7)
    num_docs, nq = 40, 5
    docnos = [f"d{i:03d}" for i in rng.permutation(num_docs)]  # ordinal -> docno, not in byte order
    order = np.argsort(np.array(docnos))  # ordinals by docno
    rank_of_ordinal = np.empty(num_docs, dtype=np.int64)
    rank_of_ordinal[order] = np.arange(num_docs)
    for trial in range(40):
        k = int(rng.integers(1, 12))
        scores_all = (rng.integers(-6, 6, size=(nq, num_docs)) / 4).astype(np.float32)
        owner = rng.integers(0, 3, size=num_docs)
        parts = []
        for r in range(3):
            mine = np.flatnonzero(owner == r)
            rows_s, rows_o = [], []
            for q in range(nq):
                keep = mine[select_top_k([docnos[i] for i in mine], scores_all[q, mine], k)]
                best = sort_trec([docnos[i] for i in keep], scores_all[q, keep].tolist())
                rows_o.append(keep[best])
                rows_s.append(scores_all[q, keep[best]])
            parts.append((np.array(rows_s, np.float32).reshape(nq, -1), np.array(rows_o).reshape(nq, -1)))
        floors = np.maximum.reduce([shares.kth_column(p[0], k) for p in parts])
        trimmed = [shares.trim_columns(p, floors) for p in parts]
        assert sum(p[0].size for p in trimmed) <= sum(p[0].size for p in parts)
        for rows in (2, nq):  # the merge's query blocks do not change the result
            merged = list(shares.merge_columns(trimmed, rank_of_ordinal, k, rows))
            got_scores = np.concatenate([m[1].numpy() for m in merged])
            got_docnos = [[docnos[order[r]] for r in m_ranks] for m in merged for m_ranks in m[2].tolist()]
            for q in range(nq):
                expected = sort_trec(docnos, scores_all[q].tolist())[:k]
                assert got_docnos[q] == [docnos[i] for i in expected], trial
                assert got_scores[q].tolist() == scores_all[q, expected].tolist()


def test_split_candidates_keeps_run_order_and_every_qid():
    run = {"a": [("x", 3.0), ("gone", 2.0), ("y", 1.0)], "b": [("gone2", 1.0)]}
    index = {"x": (1, 0), "y": (0, 4)}
    owner = [0, 1]
    part0, missing = split_candidates(run, index, owner, 0, strict=False)
    assert part0 == {"a": [("gone", 2.0), ("y", 1.0)], "b": [("gone2", 1.0)]} and missing == 2
    part1, _ = split_candidates(run, index, owner, 1, strict=False)
    assert part1 == {"a": [("x", 3.0)], "b": []}  # missing ones are rank 0's to report
    part1, _ = split_candidates(run, index, owner, 1, strict=True)
    assert part1 == {"a": [("x", 3.0), ("gone", 2.0)], "b": [("gone2", 1.0)]}  # all ranks fail alike


def test_result_sink_stands_in_for_the_writer():
    with ResultSink() as sink:
        sink.write_query("q", ["a", "b"], [0.1, 0.2])
    qid, docnos, scores = sink.results[0]
    assert (qid, docnos, scores.dtype) == ("q", ["a", "b"], np.float32)
    assert scores.tolist() == np.float32([0.1, 0.2]).tolist()  # the precision the run prints


def test_the_request_travels_to_workers_as_json_and_ranks_get_copies():
    request = ScoreRequest(Path("q.arrow"), [Path("a"), "b"], top_k=7, candidates="c.trec", devices="cpu:2")
    assert request.corpus == ("a", "b") and request.queries == "q.arrow"
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.top_k = 3  # type: ignore[misc]
    sent = json.loads(json.dumps(launcher.worker_options(request)))
    assert ScoreRequest(**sent) == dataclasses.replace(request, devices=None)
    share = dataclasses.replace(request, device="cuda:1", devices=None)
    assert (share.device, share.corpus, request.device) == ("cuda:1", ("a", "b"), "auto")


def test_usage_errors_before_any_worker_starts(data, tmp_path, monkeypatch):
    out = tmp_path / "run.trec"
    args = ["score", data["queries"], data["corpus"], "--devices", "cpu:2"]
    result = runner.invoke(app, [*args, "--device", "cpu"])
    assert result.exit_code == 2
    assert "give one of them" in result.stderr
    result = runner.invoke(app, ["score", "-", data["corpus"], "--devices", "cpu:2", "-o", str(out)])
    assert result.exit_code == 2
    assert "standard input cannot be shared" in result.stderr
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match="under torchrun leave it out"):
        dispatch.run_files(ScoreRequest(data["queries"], (data["corpus"],), devices="cpu:2"))
    assert not out.exists()


# --------------------------------------------------------------------------------------------------
# jobs: byte for byte the single-process run


def test_torchrun_exhaustive_equals_single_process(data, tmp_path):
    single = tmp_path / "single.trec"
    _single(data, single, top_k=5)
    out = tmp_path / "dist.trec"
    proc = _torchrun([data["queries"], data["corpus"], "-k", "5", "-o", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == single.read_bytes()
    # the tie across shards (and so across ranks) is cut by docno, descending
    assert "tie-3" in single.read_text()
    # one summary, by rank 0, for the whole job
    summaries = [x for x in proc.stderr.splitlines() if x.startswith("maxsim: scored")]
    assert len(summaries) == 1 and "on 2 ranks (cpu, cpu)" in summaries[0], proc.stderr
    assert "72 documents" in summaries[0]


def test_torchrun_rerank_equals_single_process_with_the_same_warning(data, tmp_path):
    single = tmp_path / "single.trec"
    messages = _single(data, single, top_k=6, candidates=data["cands"])
    out = tmp_path / "dist.trec"
    args = [data["queries"], data["corpus"], "-k", "6", "--candidates", data["cands"]]
    proc = _torchrun([*args, "-o", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == single.read_bytes()
    assert "q3 " not in single.read_text()  # a query whose candidates are all missing is left out
    warnings = [x for x in proc.stderr.splitlines() if "warning" in x]
    assert warnings == [f"maxsim: {m}" for m in messages if m.startswith("warning")], proc.stderr
    assert "3 candidates are not in the corpus" in warnings[0]


def test_devices_cpu2_jsonl_equals_single_process(data, tmp_path):
    single = tmp_path / "single.jsonl"
    _single(data, single, top_k=3, fmt="jsonl")
    out = tmp_path / "dist.jsonl"
    stats_json = tmp_path / "stats.json"
    args = ["score", data["queries"], data["corpus"], "-k", "3", "--format", "jsonl", "-o", str(out)]
    result = runner.invoke(app, [*args, "--devices", "cpu:2", "--stats-json", str(stats_json)], env=JOB_ENV)
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == single.read_bytes()
    assert "on 2 ranks (cpu, cpu)" in result.stderr
    import json

    stats = json.loads(stats_json.read_text())
    assert stats["world_size"] == 2 and stats["documents"] == sum(SHARD_DOCS)
    assert sorted(s for r in stats["ranks"] for s in r["shards"]) == [0, 1, 2, 3]


def test_a_rank_without_shards_sends_nothing_and_the_run_is_the_same(data, tmp_path):
    """One shard, two ranks: rank 1 scores nothing (no columns to send), and top-k larger than the
    shard's documents leaves every row short; the run is still the single process's, byte for byte."""
    shard = str(Path(data["corpus"]) / "shard-3.safetensors")
    single = tmp_path / "single.trec"
    score(data["queries"], [shard], output=str(single), device="cpu", top_k=50)
    out = tmp_path / "dist.trec"
    args = ["score", data["queries"], shard, "-k", "50", "-o", str(out), "--devices", "cpu:2"]
    result = runner.invoke(app, args, env=JOB_ENV)
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == single.read_bytes()


@pytest.mark.parametrize("launch", ["devices", "torchrun"])
def test_a_commit_while_the_ranks_start_changes_no_rank_s_documents(data, tmp_path, launch):
    """A write command that commits while a job's ranks start (here rank 0 deletes two documents right
    after it has looked, before the other rank opens the corpus): every rank opens the generation rank 0
    found, so the run is the single process's on the corpus as it was; a later run sees the deletion."""
    corpus = tmp_path / "corpus"
    shutil.copytree(data["corpus"], corpus)
    before, out, after = tmp_path / "before.trec", tmp_path / "dist.trec", tmp_path / "after.trec"
    score(data["queries"], [str(corpus)], output=str(before), device="cpu", top_k=80)
    deleted = ["s0-d01", "s2-d03"]
    assert all(d in before.read_text() for d in deleted)
    path = os.pathsep.join(p for p in (FAIL_RANK_DIR, os.environ.get("PYTHONPATH")) if p)
    env = {"MAXSIM_TEST_DELETE_AFTER_LOOK": ",".join(deleted), "PYTHONPATH": path}
    args = [data["queries"], str(corpus), "-k", "80", "-o", str(out)]
    if launch == "devices":
        result = runner.invoke(app, ["score", *args, "--devices", "cpu:2"], env={**JOB_ENV, **env})
        assert result.exit_code == 0, result.output
    else:
        proc = _torchrun(args, env)
        assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == before.read_bytes()
    score(data["queries"], [str(corpus)], output=str(after), device="cpu", top_k=80)
    assert not any(d in after.read_text() for d in deleted)


# --------------------------------------------------------------------------------------------------
# failures: exit code, one line, no run


def test_a_rank_that_raises_fails_the_job_cleanly(data, tmp_path):
    out = tmp_path / "run.trec"
    args = ["score", data["queries"], data["corpus"], "-o", str(out), "--devices", "cpu:2"]
    result = runner.invoke(app, args, env={**JOB_ENV, **_fail_rank_env("1")})
    assert result.exit_code == 1
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert lines == [
        "maxsim: error: rank 1 of 2 (cpu): failure injected on rank 1 by MAXSIM_TEST_FAIL_RANK=1 "
        "(a test hook)"
    ]
    assert _leftovers(tmp_path, "run.trec") == []


def test_strict_rerank_fails_every_rank_with_the_single_process_error(data, tmp_path):
    out = tmp_path / "run.trec"
    with pytest.raises(Exception) as single_error:
        _single(data, out, candidates=data["cands"], strict=True)
    args = ["score", data["queries"], data["corpus"], "--candidates", data["cands"], "--strict"]
    result = runner.invoke(app, [*args, "-o", str(out), "--devices", "cpu:2"], env=JOB_ENV)
    assert result.exit_code == 1
    assert result.stderr.strip() == f"maxsim: error: {single_error.value}"
    assert _leftovers(tmp_path, "run.trec") == []


@pytest.mark.parametrize("mode", ["exhaustive", "rerank"])
def test_ranks_as_threads_equal_single_process(data, tmp_path, monkeypatch, mode):
    """`--devices` with GPUs runs its ranks as threads of one process (`run_threads`); here on two CPU
    "devices", the same code: byte for byte the single process's run, one summary for the job."""
    kwargs = {"top_k": 6, "candidates": data["cands"]} if mode == "rerank" else {"top_k": 5}
    single = tmp_path / "single.trec"
    expected = [m for m in _single(data, single, **kwargs) if m.startswith("warning")]
    monkeypatch.setattr(dispatch, "in_threads", lambda devices: True)
    out = tmp_path / "threads.trec"
    messages: list[str] = []
    interval = sys.getswitchinterval()
    stats = score(
        data["queries"], [data["corpus"]], output=str(out), devices="cpu:2", log=messages.append, **kwargs
    )
    assert out.read_bytes() == single.read_bytes()
    assert sys.getswitchinterval() == interval  # the job's shorter interval is given back
    assert [m for m in messages if m.startswith("warning")] == expected
    assert stats.extra["workers"] == "threads" and stats.extra["world_size"] == 2
    assert stats.documents == (sum(SHARD_DOCS) if mode == "exhaustive" else stats.documents)
    assert sorted(s for r in stats.extra["ranks"] for s in r["shards"]) == [0, 1, 2, 3]


@pytest.mark.parametrize("mode", ["exhaustive", "rerank"])
def test_rank_threads_share_one_progress_bar(data, tmp_path, monkeypatch, mode):
    """Rank threads draw one bar for the job: every rank adds its work to it and advances it, so it
    counts the single process's tokens, not rank 0's share."""
    from maxsim_cli import progress

    kwargs = {"top_k": 6, "candidates": data["cands"]} if mode == "rerank" else {"top_k": 5}
    bars: list[progress.ScoreProgress] = []

    class Recorded(progress.ScoreProgress):
        def __init__(self, enabled: bool, total_tokens: int, *, shared: bool = False) -> None:
            super().__init__(enabled, total_tokens, shared=shared)
            bars.append(self)

    monkeypatch.setattr(progress, "ScoreProgress", Recorded)
    _single(data, tmp_path / "single.trec", show_progress=True, **kwargs)
    (single,) = bars
    bars.clear()
    monkeypatch.setattr(dispatch, "in_threads", lambda devices: True)
    out = tmp_path / "threads.trec"
    score(data["queries"], [data["corpus"]], output=str(out), devices="cpu:2", show_progress=True, **kwargs)
    (job,) = bars
    assert job.total_tokens == single.total_tokens > 0
    assert (job.tokens, job.docs) == (single.tokens, single.docs) and job.tokens == job.total_tokens


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exhaustive", "rerank"])
def test_gpu_ranks_as_threads_equal_single_process(data, tmp_path, monkeypatch, mode):
    """`--devices` on GPUs: two rank threads (on cuda:0 and cuda:1, or both on cuda:0 where there is
    one GPU) write the single-process GPU run byte for byte; each rank drives its own device."""
    kwargs = {"top_k": 6, "candidates": data["cands"]} if mode == "rerank" else {"top_k": 5}
    single = tmp_path / "single.trec"
    score(data["queries"], [data["corpus"]], output=str(single), device="cuda:0", **kwargs)
    devices = ["cuda:0", "cuda:1"] if torch.cuda.device_count() > 1 else ["cuda:0", "cuda:0"]
    monkeypatch.setattr(dispatch, "parse_devices", lambda spec: devices)
    out = tmp_path / "threads.trec"
    stats = score(data["queries"], [data["corpus"]], output=str(out), devices="0,1", **kwargs)
    assert out.read_bytes() == single.read_bytes()
    assert stats.extra["workers"] == "threads"
    assert [r["device"] for r in stats.extra["ranks"]] == devices


def test_a_rank_thread_that_fails_stops_the_others_and_writes_nothing(data, tmp_path, monkeypatch):
    """A failing rank's error is the job's (named by rank and device, one line, exit code 1 from the
    CLI); the other rank stops at its next batch instead of scoring on; no run is written."""
    import threading

    from maxsim_cli.scoring.engine import _Engine

    monkeypatch.setattr(dispatch, "in_threads", lambda devices: True)
    out = tmp_path / "run.trec"
    args = ["score", data["queries"], data["corpus"], "-o", str(out), "--devices", "cpu:2"]
    with monkeypatch.context() as patch:
        patch.setattr(threads, "score_share", failing_share(threads.score_share, "1"))
        result = runner.invoke(app, args, env=JOB_ENV)
    assert result.exit_code == 1, result.output
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert lines == [
        "maxsim: error: rank 1 of 2 (cpu): failure injected on rank 1 by MAXSIM_TEST_FAIL_RANK=1 "
        "(a test hook)"
    ]
    assert _leftovers(tmp_path, "run.trec") == []
    # rank 0 fails after its first batch while rank 1 is held in its first batch until then: rank 1
    # must stop there (RankStopped), and the job reports rank 0's own error
    batches = {0: 0, 1: 0}
    done = _Engine._batch_done

    def batch_done(self, batch):  # noqa: ANN001, ANN202
        rank = int(threading.current_thread().name.rpartition("-")[2])
        batches[rank] += 1
        if rank == 0:
            raise MaxsimError("rank 0 broke")
        assert self.stop.wait(10)  # the job's stop, set once rank 0's error has left its thread
        return done(self, batch)

    monkeypatch.setattr(_Engine, "_batch_done", batch_done)
    monkeypatch.setattr("maxsim_cli.scoring.plan.STAGING_BYTES", 1 << 12)
    interval = sys.getswitchinterval()
    with pytest.raises(MaxsimError, match="^rank 0 broke$"):
        score(data["queries"], [data["corpus"]], output=str(out), devices="cpu:2", max_memory=1 << 16)
    assert batches[1] == 1
    assert sys.getswitchinterval() == interval
    assert _leftovers(tmp_path, "run.trec") == []


def test_a_killed_rank_fails_the_job_under_the_launcher(data, tmp_path):
    out = tmp_path / "run.trec"
    args = ["score", data["queries"], data["corpus"], "-o", str(out), "--devices", "cpu:2"]
    result = runner.invoke(app, args, env={**JOB_ENV, **_fail_rank_env("1:kill")})
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        "maxsim: error: worker rank 1 of 2 (cpu) was killed by SIGKILL; the job stopped and no run was "
        "written (out of host memory? see the system log)"
    ]
    assert _leftovers(tmp_path, "run.trec") == []


def test_the_first_worker_to_die_is_the_one_named(tmp_path):
    """A worker killed from outside takes its peer down a moment later (gloo aborts on the closed
    connection): the job's error names the worker that ended first, not the lowest rank."""
    codes = [-signal.SIGABRT, -signal.SIGKILL]
    output = str(tmp_path / "run.trec")
    with pytest.raises(MaxsimError, match=r"^worker rank 1 of 2 \(cpu\) was killed by SIGKILL;"):
        launcher.job_outcome(codes, ["cpu", "cpu"], str(tmp_path / "none.json"), output, 0.0, [1, 0])
    with pytest.raises(MaxsimError, match=r"^worker rank 0 of 2 \(cpu\) was killed by SIGABRT;"):
        launcher.job_outcome(codes, ["cpu", "cpu"], str(tmp_path / "none.json"), output, 0.0, [0, 1])


def test_a_killed_rank_fails_the_job_under_torchrun(data, tmp_path):
    out = tmp_path / "run.trec"
    proc = _torchrun([data["queries"], data["corpus"], "-o", str(out)], _fail_rank_env("1:kill"))
    assert proc.returncode != 0
    assert "Signal 9" in proc.stderr or "SIGKILL" in proc.stderr, proc.stderr
    assert _leftovers(tmp_path, "run.trec") == []


# --------------------------------------------------------------------------------------------------
# the job's folder in the temporary directory: removed by the next job when its launcher was killed


def _dead_job_folder(folder: Path, *extra: str) -> Path:
    """A job folder whose processes have all ended (its lock file held by no one)."""
    folder.mkdir()
    for name in ("options.json", "status.json", "partial-output", "lock", *extra):
        (folder / name).write_text("{}")
    return folder


def test_a_job_folder_is_stale_once_every_process_of_its_job_has_ended(tmp_path):
    """The launcher's lock on its job folder is inherited by its workers: the folder is not stale while
    the launcher or any worker lives (a launcher killed by SIGKILL leaves workers behind for a moment),
    and is removed, file by file, once they have all ended."""
    folder = tmp_path / "maxsim-job-x"
    folder.mkdir()
    lock = launcher.lock_job(str(folder))
    (folder / "options.json").write_text("{}")
    worker = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                              pass_fds=(lock,))  # fmt: skip
    try:
        assert launcher.remove_stale_job_folders(str(tmp_path)) == []  # the launcher holds it
        os.close(lock)  # the launcher is gone; its worker is not
        assert launcher.remove_stale_job_folders(str(tmp_path)) == []
    finally:
        worker.communicate(b"", timeout=30)
    assert launcher.remove_stale_job_folders(str(tmp_path)) == [str(folder)]
    assert os.listdir(tmp_path) == []


def test_the_next_job_removes_the_folders_of_dead_jobs_only(data, tmp_path, monkeypatch):
    """A ``--devices`` launcher killed by SIGKILL after its run was written left its ``maxsim-job-*``
    folder in the temporary directory (2 of 3 tries): the next job removes every job folder whose lock
    is free, and one without a lock that has not changed for days; it keeps a live job's, one without a
    lock that is new (being made, or an older maxsim's), and anything it did not write."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    _dead_job_folder(temp / "maxsim-job-dead")
    old = temp / "maxsim-job-old"
    old.mkdir()
    (old / "options.json").write_text("{}")
    os.utime(old, (time.time() - 2 * 86400, time.time() - 2 * 86400))
    _dead_job_folder(temp / "maxsim-job-mixed", "notes.txt")
    (temp / "maxsim-job-new").mkdir()
    alive = temp / "maxsim-job-alive"
    alive.mkdir()
    lock = launcher.lock_job(str(alive))
    try:
        out = tmp_path / "run.trec"
        args = ["score", data["queries"], data["corpus"], "-o", str(out), "--devices", "cpu:2", "-q"]
        result = runner.invoke(app, args, env=JOB_ENV)
    finally:
        os.close(lock)
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(temp)) == ["maxsim-job-alive", "maxsim-job-mixed", "maxsim-job-new"]
    assert os.listdir(temp / "maxsim-job-mixed") == ["notes.txt"]
    assert os.listdir(alive) == ["lock"]
