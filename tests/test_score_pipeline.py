"""The streaming engine's parts: order keys and the running top-k, batch planning, the reader pipeline,
and the out-of-memory fallback. CPU only, tiny shapes.

Scores here are exact by construction (small dyadic values), so comparisons are exact.
"""

from __future__ import annotations

import os
import random
import re
import sys
import threading

import numpy as np
import pytest
import torch

from maxsim_cli.errors import InputError, MaxsimError
from maxsim_cli.scoring.engine import _interleave
from maxsim_cli.scoring.pipeline import BatchPlan, BatchStream
from maxsim_cli.scoring.plan import _cut_at, _split
from maxsim_cli.scoring.staging import SlotBuffers
from maxsim_cli.scoring.topk import RunningTopK, decode_keys, order_keys
from maxsim_cli.shards import open_corpus, write_shard

# --------------------------------------------------------------------------------------------------
# order keys


def test_order_keys_order_scores_then_ranks() -> None:
    values = [3.0, -2.0, 0.0, -0.0, 1.5, -1e-30, 1e-30, float("inf"), float("-inf"), 1.5, -2.0]
    scores = torch.tensor([values], dtype=torch.float32)
    ranks = torch.arange(len(values), dtype=torch.int64)
    keys = order_keys(scores.clone(), ranks)[0].tolist()
    expected = sorted(range(len(values)), key=lambda i: (values[i] + 0.0, i), reverse=True)
    assert sorted(range(len(values)), key=lambda i: keys[i], reverse=True) == expected


def test_decode_keys_round_trips_scores_and_ranks() -> None:
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 50, generator=gen) * 1e3
    scores[0, :5] = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 65504.0])  # subnormals, zeros
    ranks = torch.randint(0, 2**32 - 1, (50,), generator=gen, dtype=torch.int64)
    got_scores, got_ranks = decode_keys(order_keys(scores.clone(), ranks))
    expected = scores + 0.0
    assert torch.equal(got_scores.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(got_ranks, ranks.expand(3, -1))


# --------------------------------------------------------------------------------------------------
# running top-k


def _reference_topk(scores: torch.Tensor, ranks: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    out = []
    for row in scores.tolist():
        pairs = sorted(zip(row, ranks.tolist(), strict=True), reverse=True)
        out.append([(s, r) for s, r in pairs[:k]])
    return out


@pytest.mark.parametrize("k", [1, 3, 7, 40, 100])
def test_running_topk_is_independent_of_batching_and_order(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    nq, nd = 4, 60
    # few distinct values: many exact ties, decided by rank
    scores = torch.randint(-3, 4, (nq, nd), generator=gen).to(torch.float32) / 4
    ranks = torch.randperm(nd, generator=gen)
    expected = _reference_topk(scores, ranks, k)
    rng = random.Random(k)
    for _trial in range(5):
        perm = list(range(nd))
        rng.shuffle(perm)
        cuts = sorted(rng.sample(range(1, nd), rng.randint(0, 8)))
        topk = RunningTopK(nq, k)
        for a, b in zip([0, *cuts], [*cuts, nd], strict=True):
            cols = torch.tensor(perm[a:b], dtype=torch.int64)
            topk.add(scores[:, cols].contiguous(), ranks[cols])
        got_scores, got_ranks = topk.result()
        got = [
            list(zip(s, r, strict=True)) for s, r in zip(got_scores.tolist(), got_ranks.tolist(), strict=True)
        ]
        assert got == expected


def test_running_topk_empty_and_short() -> None:
    topk = RunningTopK(2, 5)
    scores, ranks = topk.result()
    assert scores.shape == (2, 0) and ranks.shape == (2, 0)
    topk.add(torch.tensor([[1.0, 2.0], [0.5, 0.5]]), torch.tensor([7, 3]))
    scores, ranks = topk.result()
    assert scores.tolist() == [[2.0, 1.0], [0.5, 0.5]]
    assert ranks.tolist() == [[3, 7], [7, 3]]


# --------------------------------------------------------------------------------------------------
# planning


def test_split_respects_both_limits_and_keeps_long_documents_alone() -> None:
    lengths = np.array([3, 3, 10, 1, 1, 1, 1, 4, 2], dtype=np.int64)
    tok_cum = np.concatenate([[0], np.cumsum(lengths)])
    doc_cum = np.arange(len(lengths) + 1, dtype=np.float64)
    spans = _split(doc_cum, tok_cum, 3, 6)
    assert spans[0][0] == 0 and spans[-1][1] == len(lengths)
    assert all(b0 == a1 for (_, b0), (a1, _) in zip(spans, spans[1:], strict=False))
    for a, b in spans:
        assert b - a <= 3
        assert tok_cum[b] - tok_cum[a] <= 6 or b - a == 1
    assert (2, 3) in spans  # the 10-token document alone


def test_interleave_alternates_shards() -> None:
    plans = [BatchPlan(i, [(s, 0, 1)], 1, 1) for i, s in enumerate([0, 0, 0, 1, 1, 2])]
    out = _interleave(plans)
    assert [p.parts[0][0] for p in out] == [0, 1, 2, 0, 1, 0]
    assert [p.index for p in out] == list(range(6))


# --------------------------------------------------------------------------------------------------
# the reader pipeline (CPU)


@pytest.fixture
def two_shards(tmp_path):
    gen = torch.Generator().manual_seed(3)
    paths = []
    for s, fmt in enumerate(["safetensors", "arrow"]):
        lengths = torch.randint(1, 6, (20,), generator=gen).tolist()
        embs = [torch.randint(-4, 5, (n, 8), generator=gen).to(torch.float32) / 4 for n in lengths]
        path = tmp_path / f"s{s}.{fmt}"
        write_shard(path, [f"s{s}d{i:02d}" for i in range(20)], embs)
        paths.append(str(path))
    return paths


def test_batch_stream_yields_plans_in_order_with_packed_parts(two_shards) -> None:
    corpus = open_corpus(two_shards)
    plans = [
        BatchPlan(0, [(0, 0, 7)], 7, 0, side=np.arange(7), side_len=7),
        BatchPlan(1, [(0, 7, 20), (1, 0, 5)], 18, 0, side=np.arange(18), side_len=18),
        BatchPlan(2, [(1, np.array([9, 5, 6]))], 3, 0, side=np.arange(3), side_len=3),
        BatchPlan(3, [(1, 10, 20)], 10, 0, side=lambda: np.arange(10), side_len=10),
    ]
    for plan in plans:
        plan.num_tokens = sum(_part_tokens(corpus, p) for p in plan.parts)
    with BatchStream(
        corpus.shards,
        plans,
        dim=8,
        dtype=torch.float32,
        scaled=False,
        device=torch.device("cpu"),
        reader_threads=2,
    ) as stream:
        for _ in range(2):  # a stream can be iterated once per query batch
            got = list(stream)
            assert [b.plan.index for b in got] == [0, 1, 2, 3]
            for batch in got:
                expected = torch.cat([_read_part(corpus, p) for p in batch.plan.parts])
                assert torch.equal(batch.embeddings, expected)
                assert batch.offsets[-1] == expected.shape[0] == batch.plan.num_tokens
                assert np.array_equal(batch.host_offsets, batch.offsets.numpy())
                assert batch.side is not None and batch.side.tolist() == list(range(batch.plan.num_docs))
    assert stream.times.batches == 8
    corpus.close()


def _part_tokens(corpus, part) -> int:
    shard = corpus.shards[part[0]]
    if len(part) == 3:
        return int(shard.offsets[part[2]] - shard.offsets[part[1]])
    return int(sum(shard.offsets[i + 1] - shard.offsets[i] for i in part[1]))


def _read_part(corpus, part) -> torch.Tensor:
    shard = corpus.shards[part[0]]
    if len(part) == 3:
        return shard.read_docs(part[1], part[2]).embeddings
    return shard.read_doc_indices(part[1]).embeddings


def test_batch_stream_reader_error_reaches_the_consumer_and_threads_stop(two_shards) -> None:
    corpus = open_corpus(two_shards)

    class Broken:
        def __init__(self, shard):
            self.shard = shard

        def read_docs(self, start, stop):
            if start >= 10:
                raise InputError(f"{self.shard.path}: document {start} is damaged; re-create the shard")
            return self.shard.read_docs(start, stop)

    shards = [Broken(s) for s in corpus.shards]
    plans = [BatchPlan(i, [(0, a, a + 5)], 5, 0) for i, a in enumerate(range(0, 20, 5))]
    stream = BatchStream(
        shards, plans, dim=8, dtype=torch.float32, scaled=False, device=torch.device("cpu"), reader_threads=3
    )
    seen = []
    with pytest.raises(InputError, match="document 10 is damaged"):
        for batch in stream:
            seen.append(batch.plan.index)
    assert seen == [0, 1]
    assert stream._pool is None and stream._dispatcher is None
    corpus.close()


def test_batch_stream_stops_cleanly_when_abandoned(two_shards) -> None:
    corpus = open_corpus(two_shards)
    plans = [BatchPlan(i, [(0, i, i + 1)], 1, 0) for i in range(20)]
    stream = BatchStream(
        corpus.shards,
        plans,
        dim=8,
        dtype=torch.float32,
        scaled=False,
        device=torch.device("cpu"),
        reader_threads=2,
    )
    it = iter(stream)
    next(it)
    it.close()  # the consumer stops early (an exception, a closed pipe)
    assert stream._pool is None and stream._dispatcher is None
    corpus.close()


def test_batch_stream_started_early_reads_ahead_and_stops_on_close(two_shards) -> None:
    """`start` begins the reads before the first batch is asked for: the iteration then yields the same
    batches in order; started and closed without being iterated, no reader is left running."""
    corpus = open_corpus(two_shards)
    plans = [BatchPlan(i, [(0, 2 * i, 2 * i + 2)], 2, 0) for i in range(10)]
    for plan in plans:
        plan.num_tokens = _part_tokens(corpus, plan.parts[0])

    def stream() -> BatchStream:
        return BatchStream(
            corpus.shards, plans, dim=8, dtype=torch.float32, scaled=False, device=torch.device("cpu"),
            reader_threads=2,
        )  # fmt: skip

    early = stream()
    early.start()
    early.start()  # once only
    ready = early._ready
    assert ready is not None and early._pool is not None
    deadline = 50
    while ready.qsize() < early.host_slots(2) and deadline:  # the readers fill every slot meanwhile
        deadline -= 1
        threading.Event().wait(0.01)
    assert ready.qsize() == early.host_slots(2)
    got = [(b.plan.index, b.embeddings.clone()) for b in early]
    assert [i for i, _ in got] == list(range(10)) and early._ready is None
    for (_, emb), plan in zip(got, plans, strict=True):
        assert torch.equal(emb, _read_part(corpus, plan.parts[0]))
    assert [b.plan.index for b in early] == list(range(10))  # the next iteration starts its own reads

    unused = stream()
    unused.start()
    unused.close()
    assert unused._pool is None and unused._dispatcher is None and unused._ready is None
    assert not [t for t in threading.enumerate() if t.name.startswith(("maxsim-read", "maxsim-dispatch"))]
    corpus.close()


# --------------------------------------------------------------------------------------------------
# the engine with a stand-in kernel: memory plans and the out-of-memory fallback


def _patch_varlen(monkeypatch, fn) -> None:
    """Route the engine's all-pairs scoring (the public entry point, also when it asks the CPU backend
    to check the documents' values with ``check_finite``) to ``fn``."""
    import maxsim_kernels

    monkeypatch.setattr(maxsim_kernels, "maxsim_varlen", fn, raising=False)


def _plain_varlen(q, q_off, d, d_off, *, backend="auto", doc_scales=None, **_kwargs) -> torch.Tensor:
    """MaxSim of every (query, document) pair in float64, returned as float32."""
    qf, df = q.double(), d.double()
    if doc_scales is not None:
        df = df * doc_scales.double()[:, None]
    out = torch.empty(q_off.numel() - 1, d_off.numel() - 1, dtype=torch.float64)
    qo, do = q_off.tolist(), d_off.tolist()
    for j in range(len(do) - 1):
        best = (qf @ df[do[j] : do[j + 1]].T).max(dim=1).values
        for i in range(len(qo) - 1):
            out[i, j] = best[qo[i] : qo[i + 1]].sum()
    return out.float()


def test_cut_at_shard_boundaries() -> None:
    bounds = np.array([0, 7, 20, 30])
    assert _cut_at([(0, 10), (10, 25), (25, 30)], bounds) == [(0, 7), (7, 10), (10, 20), (20, 25), (25, 30)]
    assert _cut_at([(0, 7), (7, 20)], bounds) == [(0, 7), (7, 20)]  # already within shards


def test_cpu_batches_stay_within_one_shard(engine_data, tmp_path, monkeypatch) -> None:
    """On the CPU no document batch spans two shards (each is scored from a map of its file, uncopied),
    whatever the budget; the run is the same as with one batch a shard."""
    from maxsim_cli.scoring import engine
    from maxsim_cli.scoring import entry as score_mod

    queries, shards = engine_data
    seen: list[list] = []
    original = engine._Engine._stream

    def recording(self, plans, *, resident=False):  # noqa: ANN001, ANN202
        seen.append([p.parts for p in plans])
        return original(self, plans, resident=resident)

    monkeypatch.setattr(engine._Engine, "_stream", recording)
    big = score_mod.score(queries, shards, output=str(tmp_path / "big.trec"), top_k=5, device="cpu")
    small = score_mod.score(
        queries, shards, output=str(tmp_path / "small.trec"), top_k=5, device="cpu", max_memory=8000
    )
    assert big.doc_batches == 2 and small.doc_batches > 2
    assert all(len(parts) == 1 for plans in seen for parts in plans)
    assert (tmp_path / "big.trec").read_bytes() == (tmp_path / "small.trec").read_bytes()


@pytest.fixture
def engine_data(tmp_path, two_shards):
    gen = torch.Generator().manual_seed(9)
    qembs = [torch.randint(-4, 5, (n, 8), generator=gen).to(torch.float32) / 4 for n in (2, 3, 1, 4, 2)]
    queries = tmp_path / "q.safetensors"
    write_shard(queries, [f"q{i}" for i in range(5)], qembs)
    return str(queries), two_shards


def test_out_of_memory_halves_the_batch_and_gives_the_same_run(engine_data, tmp_path, monkeypatch) -> None:

    from maxsim_cli.scoring.entry import score

    _patch_varlen(monkeypatch, _plain_varlen)
    queries, shards = engine_data
    score(queries, shards, output=str(tmp_path / "plain.trec"), top_k=7, device="cpu")
    calls = []

    def tight(q, q_off, d, d_off, **kwargs):
        calls.append(d_off.numel() - 1)
        if d_off.numel() - 1 > 6:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return _plain_varlen(q, q_off, d, d_off, **kwargs)

    _patch_varlen(monkeypatch, tight)
    notes: list[str] = []
    stats = score(queries, shards, output=str(tmp_path / "oom.trec"), top_k=7, device="cpu", log=notes.append)
    assert (tmp_path / "oom.trec").read_bytes() == (tmp_path / "plain.trec").read_bytes()
    assert stats.oom_retries >= 1 and len(notes) == stats.oom_retries
    assert "out of memory" in notes[0] and "documents per kernel call" in notes[0]
    assert max(c for c in calls[-3:]) <= 6  # later batches are split up front, without another failure

    def hopeless(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    _patch_varlen(monkeypatch, hopeless)
    with pytest.raises(MaxsimError, match="out of memory on cpu scoring one document"):
        score(queries, shards, output=str(tmp_path / "never.trec"), top_k=7, device="cpu", log=notes.append)
    assert not (tmp_path / "never.trec").exists()


@pytest.mark.parametrize("budget", [3000, 8000, 50_000, 10**9])
def test_memory_plan_stays_within_the_budget(engine_data, tmp_path, monkeypatch, budget) -> None:

    from maxsim_cli.scoring.entry import score
    from maxsim_cli.scoring.plan import BUDGET_FILL

    _patch_varlen(monkeypatch, _plain_varlen)
    queries, shards = engine_data
    out = tmp_path / f"run{budget}.trec"
    stats = score(queries, shards, output=str(out), top_k=5, device="cpu", max_memory=budget)
    assert 0 < stats.planned_device_bytes <= budget * BUDGET_FILL
    assert stats.doc_batches >= stats.query_batches >= 1
    if budget < 10_000:
        assert stats.doc_batches > stats.query_batches  # several batches per pass
    reference = tmp_path / "reference.trec"
    if not reference.exists():
        score(queries, shards, output=str(reference), top_k=5, device="cpu")
    assert out.read_bytes() == reference.read_bytes()


def test_budget_too_small_for_one_document_is_a_clear_error(engine_data, tmp_path, monkeypatch) -> None:

    from maxsim_cli.scoring.entry import score

    _patch_varlen(monkeypatch, _plain_varlen)
    queries, shards = engine_data
    with pytest.raises(MaxsimError, match=r"memory budget .* too small .* raise --max-memory"):
        score(queries, shards, output=str(tmp_path / "x.trec"), device="cpu", max_memory=200)
    assert not (tmp_path / "x.trec").exists()


# --------------------------------------------------------------------------------------------------
# direct reads of safetensors rows (the CUDA staging path) and the deferred value check


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int8"])
def test_direct_rows_equal_what_safetensors_loads(tmp_path, dtype) -> None:
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(4)
    lengths = torch.randint(1, 9, (30,), generator=gen).tolist()
    embs = [torch.randn(n, 16, generator=gen) for n in lengths]
    path = tmp_path / f"s.{dtype}.safetensors"
    if dtype == "int8":
        scales = [e.abs().amax(dim=1) / 127 for e in embs]
        codes = [torch.round(e / s[:, None]).to(torch.int8) for e, s in zip(embs, scales, strict=True)]
        write_shard(path, [f"d{i}" for i in range(30)], codes, scales=scales, dtype="int8")
    else:
        write_shard(path, [f"d{i}" for i in range(30)], embs, dtype=dtype)
    reference = load_file(str(path))
    corpus = open_corpus([path])
    shard = corpus.shards[0]
    for start, stop in [(0, 30), (3, 4), (10, 22)]:
        t0, t1 = int(shard.offsets[start]), int(shard.offsets[stop])
        out = torch.empty(t1 - t0 + 5, 16, dtype=reference["embeddings"].dtype)
        out_scales = torch.empty(t1 - t0 + 5) if dtype == "int8" else None
        shard.read_rows_into(t0, t1, out, out_scales)
        assert torch.equal(out[: t1 - t0], reference["embeddings"][t0:t1])
        batch = shard.read_docs(start, stop)
        assert torch.equal(batch.embeddings, reference["embeddings"][t0:t1])
        if dtype == "int8":
            assert torch.equal(out_scales[: t1 - t0], reference["scales"][t0:t1])
            assert torch.equal(batch.scales, reference["scales"][t0:t1])
    corpus.close()
    arrow = tmp_path / "s.arrow"
    write_shard(arrow, ["a"], [torch.ones(2, 16)])
    assert not hasattr(open_corpus([arrow]).shards[0], "read_rows_into")


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_index_lists_read_directly_equal_the_checked_reader(tmp_path, dtype) -> None:
    """A rerank's index list read straight into a buffer (`read_docs_into`: neighbouring documents in
    one read, any order, repeats) holds the rows `read_doc_indices` gives, and a batch stream of index
    lists reads them so (CPU: the reader checks the values it read)."""
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 7, (40,), generator=gen).tolist()
    embs = [torch.randn(n, 16, generator=gen) for n in lengths]
    path = tmp_path / f"s.{dtype}.safetensors"
    if dtype == "int8":
        scales = [e.abs().amax(dim=1) / 127 for e in embs]
        codes = [torch.round(e / s[:, None]).to(torch.int8) for e, s in zip(embs, scales, strict=True)]
        write_shard(path, [f"d{i}" for i in range(40)], codes, scales=scales, dtype="int8")
    else:
        write_shard(path, [f"d{i}" for i in range(40)], embs, dtype=dtype)
    corpus = open_corpus([path])
    shard = corpus.shards[0]
    for indices in ([3], [0, 1, 2, 3], [5, 6, 9, 10, 11, 39], [12, 4, 5, 4, 30], list(range(40))):
        wanted = np.array(indices, dtype=np.int64)
        checked = shard.read_doc_indices(wanted)
        rows = int(checked.offsets[-1])
        out = torch.full((rows + 3, 16), 7, dtype=checked.embeddings.dtype)
        out_scales = torch.full((rows + 3,), 7.0) if dtype == "int8" else None
        got = shard.read_docs_into(wanted, out, out_scales)
        assert got.tolist() == np.diff(checked.offsets.numpy()).tolist()
        assert torch.equal(out[:rows], checked.embeddings) and bool((out[rows:] == 7).all())
        if dtype == "int8":
            assert torch.equal(out_scales[:rows], checked.scales)
    with pytest.raises(ValueError, match="do not fit"):
        shard.read_docs_into(np.array([0, 1]), torch.empty(1, 16, dtype=checked.embeddings.dtype), None)
    parts = [(0, np.array([2, 7, 8, 20], dtype=np.int64))]
    plan = BatchPlan(0, parts, 4, int(sum(lengths[i] for i in (2, 7, 8, 20))))
    stream = BatchStream(
        corpus.shards,
        [plan],
        dim=16,
        dtype=checked.embeddings.dtype,
        scaled=dtype == "int8",
        device=torch.device("cpu"),
        reader_threads=1,
    )
    (batch,) = list(stream)
    expected = shard.read_doc_indices(parts[0][1])
    assert torch.equal(batch.embeddings, expected.embeddings)
    assert batch.host_offsets.tolist() == expected.offsets.tolist()
    if dtype == "int8":
        assert torch.equal(batch.scales, expected.scales)
    corpus.close()


def test_index_lists_read_directly_name_a_truncated_shard(tmp_path) -> None:
    path = tmp_path / "s.safetensors"
    write_shard(path, ["a", "b", "c"], [torch.ones(2, 8), torch.ones(3, 8), torch.ones(1, 8)])
    corpus = open_corpus([path])
    shard = corpus.shards[0]
    os.truncate(path, shard.emb_start + 3 * shard.row_bytes)
    with pytest.raises(InputError, match="changed size from"):
        shard.read_docs_into(np.array([0, 2]), torch.empty(3, 8), None)
    corpus.close()


def test_deferred_value_check_names_the_document(tmp_path) -> None:
    path = tmp_path / "s.safetensors"
    write_shard(
        path, ["a", "b", "c"], [torch.ones(2, 8), torch.ones(3, 8), torch.ones(1, 8)], dtype="float16"
    )
    shard = open_corpus([path]).shards[0]
    # plant a NaN in token 1 of document "b" (row 3), as a damaged disk or a buggy writer would
    with open(path, "r+b") as fh:
        fh.seek(shard.emb_start + 3 * shard.row_bytes + 2 * 5)
        fh.write(np.array([np.nan], dtype=np.float16).tobytes())
    shard.close()
    corpus = open_corpus([path])
    plan = BatchPlan(0, [(0, 0, 3)], 3, 6)
    stream = BatchStream(
        corpus.shards,
        [plan],
        dim=8,
        dtype=torch.float16,
        scaled=False,
        device=torch.device("cpu"),
        reader_threads=1,
    )
    # the batches' sums as the device check leaves them: the second one flagged
    stream._checks = [plan, plan]
    stream._check_sums = torch.tensor([1.0, float("inf")])
    with pytest.raises(InputError, match=r"'?b'? .*NaN or Inf values at token 1"):
        stream._check_values()
    stream._checks = [plan]
    stream._check_sums = torch.tensor([1.0])
    stream._check_values()  # nothing flagged: nothing re-read
    corpus.close()


def test_batch_check_is_finite_only_for_clean_batches() -> None:
    from maxsim_cli.scoring.pipeline import batch_check

    def clean(emb: torch.Tensor, scales: torch.Tensor | None = None) -> bool:
        into = torch.empty(3)  # the pass's vector of sums, one slot a batch
        summed = batch_check(emb, scales, out=into[1])
        assert bool(torch.isfinite(summed)) == bool(torch.isfinite(into[1]))
        return bool(torch.isfinite(batch_check(emb, scales)))

    emb = torch.randn(50, 8).to(torch.float16)
    assert clean(emb)
    for bad in (float("nan"), float("inf"), -float("inf")):
        dirty = emb.clone()
        dirty[17, 3] = bad
        assert not clean(dirty)
    codes = torch.randint(-127, 128, (50, 8), dtype=torch.int8)
    scales = torch.rand(50)
    assert clean(codes, scales)
    for edge in (0.0, -0.0):  # zero tokens have zero scales
        ok = scales.clone()
        ok[4] = edge
        assert clean(codes, ok)
    for bad in (-1e-3, float("nan"), float("inf"), -float("inf")):
        dirty = scales.clone()
        dirty[4] = bad
        assert not clean(codes, dirty)


def test_pinned_arena_carves_aligned_disjoint_slots(monkeypatch) -> None:
    from maxsim_cli.scoring import pipeline

    # the carving, without page-locking (this machine has no CUDA): 5 shares of 12 KiB, 2 a piece
    locked = []

    def lock_piece(self, nbytes: int) -> torch.Tensor:
        locked.append(torch.zeros(nbytes, dtype=torch.uint8))
        return locked[-1]

    monkeypatch.setattr(pipeline.PinnedArena, "_lock_piece", lock_piece)
    monkeypatch.setattr(pipeline.PinnedArena, "PIECE_BYTES", 24 << 10)
    arena = pipeline.PinnedArena((60 << 10) + 100, slots=5)
    assert (arena.share, arena.nbytes) == (12 << 10, 60 << 10)  # never more than asked for
    slots = [SlotBuffers(100 + i, 10, 5, 16, torch.bfloat16, True, "cpu", False, arena) for i in range(5)]
    for i, slot in enumerate(slots):
        slot.allocate()  # host slots are allocated by the reader that first fills them
        assert slot.embeddings.shape == (100 + i, 16) and slot.embeddings.dtype == torch.bfloat16
        assert slot.scales is not None and slot.scales.shape == (100 + i,)
        assert slot.ints.shape == (16,) and slot.ints.dtype == torch.int64
        for t in (slot.embeddings, slot.scales, slot.ints):
            piece = [p for p in locked if 0 <= t.data_ptr() - p.data_ptr() < p.numel()]
            assert len(piece) == 1  # inside one locked piece, aligned, not past its end
            assert (t.data_ptr() - piece[0].data_ptr()) % pipeline.PinnedArena.ALIGN == 0
            assert t.data_ptr() - piece[0].data_ptr() + t.numel() * t.element_size() <= piece[0].numel()
            t.fill_(i + 1)
    for i, slot in enumerate(slots):  # no slot overwrote another
        assert bool((slot.embeddings == i + 1).all()) and bool((slot.ints == i + 1).all())
    assert arena.wait() >= 0 and arena.ready_s is not None  # every piece locked
    assert [p.numel() for p in locked] == [24 << 10, 24 << 10, 12 << 10]  # whole shares a piece
    rest = SlotBuffers(100, 10, 5, 16, torch.bfloat16, True, "cpu", False, arena)
    rest.allocate()  # every share is taken: a slot of its own
    assert all(not (0 <= rest.embeddings.data_ptr() - p.data_ptr() < p.numel()) for p in locked)
    huge = SlotBuffers(1 << 20, 10, 0, 16, torch.float16, False, "cpu", False, arena)
    huge.allocate()
    assert huge.embeddings.shape == (1 << 20, 16)  # larger than a share: a slot of its own


def test_batches_fit_the_pinned_shares() -> None:
    """The planner's token limit keeps a slot (embeddings, scales, offsets and side data, aligned)
    within its share of the arena, so no slot falls outside the pinned budget."""
    from maxsim_cli.scoring import pipeline
    from maxsim_cli.scoring.plan import Budget, _batch_token_limit

    for staging, dim, itemsize, scaled in [(512 << 20, 128, 2, False), (3 << 20, 96, 1, True)]:
        budget = Budget(device_bytes=1 << 40, host_bytes=1 << 40, reader_threads=16, cuda=True,
                         staging_bytes=staging)  # fmt: skip
        slots = pipeline.BatchStream.host_slots(16)
        tb = dim * itemsize + (4 if scaled else 0)
        tokens = int(_batch_token_limit(100 << 30, tb, budget))
        need = (
            SlotBuffers.nbytes(tokens, tokens, tokens, dim, itemsize, scaled) + 2 * pipeline.PinnedArena.ALIGN
        )
        assert need <= pipeline.PinnedArena.slot_share(staging, slots)


def test_pinned_arena_error_reaches_the_reader(monkeypatch) -> None:
    from maxsim_cli.scoring import pipeline

    def lock_piece(self, nbytes: int) -> torch.Tensor:
        raise RuntimeError("cannot page-lock")

    monkeypatch.setattr(pipeline.PinnedArena, "_lock_piece", lock_piece)
    with pytest.raises(RuntimeError, match="cannot page-lock"):
        pipeline.PinnedArena(1 << 20, slots=4).take(100)
    with pytest.raises(RuntimeError, match="cannot page-lock"):
        pipeline.PinnedArena(1 << 20, slots=4).wait()


def test_threaded_host_register_is_set_once_and_never_over_a_users_setting(monkeypatch) -> None:
    from maxsim_cli import tuning as pipeline

    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    for name in pipeline._ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setattr(pipeline, "_threaded_register_done", False)
    assert not pipeline.use_threaded_host_register() and calls == []  # the user's configuration stands
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert pipeline.use_threaded_host_register() and pipeline.use_threaded_host_register()
    assert calls == [pipeline.THREADED_HOST_REGISTER]  # once per process

    # an older torch without the binding: its deprecated wrapper, whose FutureWarning stays off stderr
    def deprecated(settings: str) -> None:
        import warnings

        warnings.warn("deprecated", FutureWarning, stacklevel=2)
        calls.append(settings)

    monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings", raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", deprecated)
    monkeypatch.setattr(pipeline, "_threaded_register_done", False)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pipeline.use_threaded_host_register()
    assert calls == [pipeline.THREADED_HOST_REGISTER] * 2


def test_progress_bar_is_drawn_only_on_a_terminal(monkeypatch) -> None:
    import io
    import sys

    from maxsim_cli import progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    assert progress.progress_enabled(quiet=False) and not progress.progress_enabled(quiet=True)
    with progress.ScoreProgress(True, 1000) as bar:
        bar.advance(10, 600)
        bar.advance(10, 400)
    assert "scoring" in screen.getvalue() and "docs/s" in screen.getvalue()
    pipe = io.StringIO()  # a pipe or a file: nothing at all
    monkeypatch.setattr(sys, "stderr", pipe)
    assert not progress.progress_enabled(quiet=False)
    with progress.ScoreProgress(True, 1000) as bar:
        bar.advance(1, 1)
    assert pipe.getvalue() == ""


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_finite_check_finds_every_non_finite_value_and_passes_extremes(dtype, monkeypatch) -> None:
    """The reader's NaN/Inf check (bit patterns for half precision, in steps): every kind of non-finite
    value is found wherever it sits, including on either side of a step boundary; the largest finite
    values, subnormals and -0.0 pass."""
    from maxsim_cli.scoring import pipeline

    monkeypatch.setattr(pipeline, "_FINITE_STEP", 64)
    info = torch.finfo(dtype)
    values = torch.randn(50, 8).to(dtype)
    values[0, 0], values[0, 1], values[0, 2] = info.max, -info.max, -0.0
    values[0, 3], values[0, 4] = info.smallest_normal / 4, -info.smallest_normal / 4  # subnormals
    assert pipeline._finite(values, None)
    negative_nan = -torch.tensor(float("nan"))
    for bad in (float("nan"), negative_nan, float("inf"), float("-inf")):
        for at in (0, 63, 64, 65, 399):
            poisoned = values.clone()
            poisoned.view(-1)[at] = bad
            assert not pipeline._finite(poisoned, None), (bad, at)


def test_pinned_arena_hands_each_share_to_one_taker_while_pieces_are_still_locking(monkeypatch) -> None:
    """Readers take shares while later pieces are still being locked: a taker that waits for its piece
    must already own its share, or a second taker computes the same one and two batches are staged in
    the same bytes."""
    import threading
    import time

    from maxsim_cli.scoring import pipeline

    def slow_lock_piece(self, nbytes: int) -> torch.Tensor:
        time.sleep(0.02)  # pieces arrive while the takers wait
        return torch.zeros(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(pipeline.PinnedArena, "_lock_piece", slow_lock_piece)
    monkeypatch.setattr(pipeline.PinnedArena, "PIECE_BYTES", 8 << 10)
    arena = pipeline.PinnedArena(16 * (4 << 10), slots=16)  # 16 shares of 4 KiB, 2 a piece
    taken: list[torch.Tensor] = []
    lock = threading.Lock()
    start = threading.Barrier(16)

    def taker() -> None:
        start.wait()
        region = arena.take(4 << 10)
        assert region is not None
        with lock:
            taken.append(region)

    threads = [threading.Thread(target=taker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    addresses = sorted(r.data_ptr() for r in taken)
    assert len(set(addresses)) == 16, "two takers were given the same share"
    assert arena.take(1) is None  # every share handed out exactly once


# --------------------------------------------------------------------------------------------------
# both backends on the GPU


DEVICES_BACKENDS = (("cpu", "torch"), ("cuda", "torch"), ("cuda", "triton"))


@pytest.mark.gpu
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("rerank", [False, True])
def test_both_backends_on_the_gpu_give_the_same_run(engine_data, tmp_path, int8, rerank) -> None:
    """Dyadic values (exact in every summation order): the Triton and torch backends on CUDA, and the
    torch backend on the CPU, write the same bytes in both modes, for float and int8 shards. The int8
    case's queries quantize exactly (each token's largest |value| is 127/4: scale 1/4, integer codes),
    so that the scale products are exact too (otherwise the backends may differ in the last bit)."""
    queries, shards = engine_data
    if int8:
        gen = torch.Generator().manual_seed(6)
        qembs = [
            torch.randint(-127, 128, (n, 8), generator=gen).to(torch.float32) / 4 for n in (2, 3, 1, 4, 2)
        ]
        for q in qembs:
            q[:, 0] = 127 / 4
        queries = str(tmp_path / "q8.safetensors")
        write_shard(queries, [f"q{i}" for i in range(5)], qembs)
        shards = []
        for s in range(2):
            codes = [torch.randint(-127, 128, (n, 8), generator=gen).to(torch.int8) for n in (3, 1, 4, 2)]
            scales = [torch.full((c.shape[0],), 2.0**-7) for c in codes]
            path = tmp_path / f"i{s}.safetensors"
            write_shard(path, [f"s{s}d{i:02d}" for i in range(4)], codes, scales=scales, dtype="int8")
            shards.append(str(path))
    candidates = None
    if rerank:
        candidates = tmp_path / "cands.tsv"
        candidates.write_text(
            "".join(f"q{q}\ts{q % 2}d{d:02d}\t{d + 1}\n" for q in range(5) for d in range(3))
        )
    runs = {}
    for device, backend in DEVICES_BACKENDS:
        out = tmp_path / f"{device}-{backend}.trec"
        score_run(queries, shards, out, device, backend, candidates)
        runs[(device, backend)] = out.read_text()
    assert all(run == runs[("cpu", "torch")] for run in runs.values())


def score_run(queries: str, shards: list[str], out, device: str, backend: str, candidates) -> None:  # noqa: ANN001
    from maxsim_cli.scoring.entry import score

    score(
        queries, shards, output=str(out), top_k=5, device=device, backend=backend,
        candidates=None if candidates is None else str(candidates),
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("rerank", [False, True])
def test_batch_ints_reach_the_kernels_through_the_streams_device_copy(
    engine_data, tmp_path, monkeypatch, rerank
) -> None:
    """The offsets and candidate lists that `BatchStream` copies to the GPU with each batch are not
    copied a second time by the kernels' launchers (`share_device_copy`), and the run is unchanged."""
    from maxsim_kernels import validation as _validate

    from maxsim_cli.scoring.engine import _Engine

    queries, shards = engine_data
    candidates = None
    if rerank:
        candidates = tmp_path / "cands.tsv"
        candidates.write_text(
            "".join(f"q{q}\ts{q % 2}d{d:02d}\t{d + 1}\n" for q in range(5) for d in range(3))
        )
    score_run(queries, shards, tmp_path / "cpu.trec", "cpu", "torch", candidates)
    shared: list[torch.Tensor] = []  # kept alive: their ids stay theirs
    batch_ints, to_device = _Engine._batch_ints, _validate.host_to_device

    def recording(self, values, device_copy):  # noqa: ANN001, ANN202
        host = batch_ints(self, values, device_copy)
        shared.append(host)
        return host

    def copying(x, device):  # noqa: ANN001, ANN202
        assert all(x is not h for h in shared), "a batch's ints were copied to the device again"
        return to_device(x, device)

    monkeypatch.setattr(_Engine, "_batch_ints", recording)
    monkeypatch.setattr(_validate, "host_to_device", copying)
    score_run(queries, shards, tmp_path / "cuda.trec", "cuda", "triton", candidates)
    assert shared
    assert (tmp_path / "cuda.trec").read_text() == (tmp_path / "cpu.trec").read_text()


@pytest.mark.gpu
def test_a_small_corpus_is_scored_with_all_queries_in_one_pass(tmp_path) -> None:
    """The staging slots of a small corpus are small (the arena is sized to the files); that must not
    split the queries into many passes, which only device memory calls for."""
    from maxsim_cli.scoring.entry import score

    gen = torch.Generator().manual_seed(2)
    for s in range(2):
        embs = [
            torch.randn(int(n), 128, generator=gen) for n in torch.randint(20, 300, (400,), generator=gen)
        ]
        write_shard(
            tmp_path / f"s{s}.safetensors", [f"s{s}d{i:03d}" for i in range(400)], embs, dtype="float16"
        )
    qembs = [torch.randn(32, 128, generator=gen) for _ in range(512)]
    write_shard(tmp_path / "q.safetensors", [f"q{i:03d}" for i in range(512)], qembs, dtype="float16")
    shards = [str(tmp_path / f"s{s}.safetensors") for s in range(2)]
    stats = score(
        str(tmp_path / "q.safetensors"), shards, output=str(tmp_path / "run.trec"), top_k=10, device="cuda"
    )
    assert stats.query_batches == 1 and stats.query_batch_size == 512, stats.as_dict()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("per_score", [False, True])
def test_order_keys_kernel_equals_the_torch_arithmetic(per_score: bool) -> None:
    """The one-launch order keys (CUDA; here under Triton's interpreter) equal the torch form bit for bit,
    on both zeros, negatives, exact ties, extreme floats and ranks up to 2^32 - 1."""
    from maxsim_kernels.order_keys import order_keys_triton

    gen = torch.Generator().manual_seed(11)
    nq, nd = 5, 1300  # 6500 scores: several programs, the last one partial
    scores = torch.randn(nq, nd, generator=gen)
    scores[0, :6] = torch.tensor([0.0, -0.0, 1.0, 1.0, -1.0, -1.0])
    scores[1, :4] = torch.tensor([3.4e38, -3.4e38, 1e-45, -1e-45])
    shape = (nq, nd) if per_score else (nd,)
    ranks = torch.randint(0, 1 << 32, shape, generator=gen, dtype=torch.int64)
    ranks.view(-1)[:3] = torch.tensor([0, (1 << 32) - 1, 1])
    expected = order_keys(scores.clone(), ranks)
    got = order_keys_triton(scores, ranks)
    assert torch.equal(got, expected)
    decoded, back = decode_keys(got)
    assert torch.equal(decoded, torch.where(scores == 0, 0.0, scores))
    assert torch.equal(back, ranks.expand(nq, nd))
    assert torch.equal(order_keys_triton(scores[:, :0], ranks[..., :0]), expected[:, :0])


@pytest.mark.gpu
def test_order_keys_on_cuda_equal_the_cpu_keys() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator().manual_seed(12)
    scores = torch.randn(512, 1301, generator=gen)
    scores[0, :3] = torch.tensor([0.0, -0.0, -0.0])
    ranks = torch.randint(0, 1 << 32, (1301,), generator=gen, dtype=torch.int64)
    expected = order_keys(scores.clone(), ranks)
    assert torch.equal(order_keys(scores.cuda(), ranks.cuda()).cpu(), expected)
    assert torch.equal(order_keys(scores.cuda(), ranks).cpu(), expected)  # ranks from the host


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")
def test_reader_threads_run_below_the_scoring_thread() -> None:
    """Reader threads add READER_NICE to their niceness (the scoring thread keeps its own), capped at 19."""
    import threading

    from maxsim_cli.scoring.pipeline import READER_NICE, _reader_thread_init

    got: dict[str, int] = {}

    def reader() -> None:
        tid = threading.get_native_id()
        got["before"] = os.getpriority(os.PRIO_PROCESS, tid)
        _reader_thread_init()
        got["after"] = os.getpriority(os.PRIO_PROCESS, tid)

    thread = threading.Thread(target=reader)
    thread.start()
    thread.join()
    assert got["after"] == min(19, got["before"] + READER_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == got["before"]


# --------------------------------------------------------------------------------------------------
# inputs that change during a run


def _changing_corpus(tmp_path) -> tuple[str, list[str]]:
    gen = torch.Generator().manual_seed(8)
    queries = str(tmp_path / "q.safetensors")
    write_shard(queries, ["q0", "q1"], [torch.randn(3, 16, generator=gen) for _ in range(2)])
    shards = []
    for s in range(2):
        path = str(tmp_path / f"c{s}.safetensors")
        write_shard(
            path, [f"d{s}-{i}" for i in range(40)], [torch.randn(6, 16, generator=gen) for _ in range(40)]
        )
        shards.append(path)
    return queries, shards


@pytest.mark.parametrize(
    "change",
    [
        ("truncated", lambda path: os.truncate(path, os.path.getsize(path) // 2), "changed size from"),
        ("rewritten", lambda path: open(path, "r+b").close() or os.utime(path, ns=(1, 1)), "was rewritten"),
        ("replaced", lambda path: os.replace(path + ".new", path), "was replaced by another file"),
    ],
    ids=lambda c: c[0],
)
@pytest.mark.parametrize("candidates", [False, True])
def test_a_shard_changed_during_a_run_is_a_one_line_error_and_no_run(
    tmp_path, monkeypatch, change, candidates
):
    """The corpus is opened, then a shard changes before its values are read (the `engine.run` hook):
    one `InputError` naming the shard, no run file; never a crash on a truncated map (SIGBUS)."""
    from maxsim_cli.scoring import engine
    from maxsim_cli.scoring.entry import score

    _name, mutate, message = change
    queries, shards = _changing_corpus(tmp_path)
    with open(shards[1], "rb") as src, open(shards[1] + ".new", "wb") as dst:
        dst.write(src.read())
    original = engine.run

    def run_after_the_change(*args, **kwargs):
        mutate(shards[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(engine, "run", run_after_the_change)
    run_file = tmp_path / "cands.trec"
    run_file.write_text("".join(f"q0 Q0 d{s}-{i} {i + 1} 1.0 x\n" for s in range(2) for i in range(3)))
    out = tmp_path / "out.trec"
    with pytest.raises(InputError, match=rf"^{shards[1]}: {message}.* while maxsim was reading it"):
        score(
            queries,
            shards,
            output=str(out),
            top_k=5,
            device="cpu",
            candidates=str(run_file) if candidates else None,
        )
    assert not out.exists()
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["q.safetensors", "c0.safetensors", "c1.safetensors", "cands.trec"]
        + (["c1.safetensors.new"] if _name != "replaced" else [])
    )


def test_a_shard_truncated_while_maxsim_reads_it_exits_1_with_one_line(tmp_path) -> None:
    """The whole CLI in a process of its own: the shard is cut short once the first batch is read
    (`--max-memory` makes many small batches); exit 1, one line naming the shard, no output."""
    import subprocess

    queries, shards = _changing_corpus(tmp_path)
    hook = (
        "import os, sys\n"
        "from maxsim_cli.shards.readers import SafetensorsShard\n"
        "original = SafetensorsShard.read_rows_into\n"
        "def read_then_truncate(self, *args):\n"
        "    original(self, *args)\n"
        "    if self.path.endswith('c1.safetensors') and os.path.getsize(self.path) > 100:\n"
        "        os.truncate(self.path, 100)\n"
        "SafetensorsShard.read_rows_into = read_then_truncate\n"
        "from maxsim_cli.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    out = tmp_path / "out.trec"
    proc = subprocess.run(
        [sys.executable, "-c", hook, "score", queries, *shards, "--device", "cpu", "--max-memory", "24KiB",
         "-o", str(out), "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"maxsim: error: {shards[1]}: changed size from"), lines
    assert not out.exists()


# --------------------------------------------------------------------------------------------------
# --max-host-memory: the process's growth over the run


def _fp16_corpus(root, total_tokens: int, shards: int = 4, dim: int = 128) -> list[str]:
    gen = torch.Generator().manual_seed(9)
    paths = []
    per = total_tokens // shards
    for s in range(shards):
        values = torch.randn(per, dim, generator=gen).to(torch.float16)
        path = str(root / f"c{s}.safetensors")
        write_shard(
            path, [f"d{s}-{i}" for i in range(per // 128)], values, offsets=torch.arange(0, per + 1, 128)
        )
        paths.append(path)
    return paths


def test_host_memory_growth_stays_within_max_host_memory(tmp_path) -> None:
    """A fresh `maxsim score --device cpu` over 128 MiB of shards with --max-host-memory 80MiB: the
    process grows (peak RSS, mapped pages included, minus RSS at the start) by at most the budget, and
    says so in its stats. (Reading the shards through a map grew it by the corpus: ~580 MiB for 32 MiB.)"""
    import json
    import subprocess

    shards = _fp16_corpus(tmp_path, 1 << 19)  # 128 MiB of values
    queries = str(tmp_path / "q.safetensors")
    write_shard(queries, ["q0", "q1"], [torch.randn(8, 128) for _ in range(2)], dtype="float16")
    stats_path = tmp_path / "stats.json"
    budget = 80 << 20
    proc = subprocess.run(
        [sys.executable, "-m", "maxsim_cli", "score", queries, *shards, "--device", "cpu", "-k", "5",
         "--max-host-memory", "80MiB", "-o", str(tmp_path / "run.trec"), "--stats-json", str(stats_path),
         "-q"],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    stats = json.loads(stats_path.read_text())
    assert stats["host_budget_bytes"] == budget
    assert stats["peak_host_bytes"] == stats["peak_rss_bytes"] - stats["host_base_bytes"]
    assert 0 < stats["peak_host_bytes"] <= budget, stats["peak_host_bytes"] / 2**20
    assert stats["doc_batches"] > 4  # the corpus did not fit one batch


def test_a_run_that_grows_past_max_host_memory_warns(tmp_path, monkeypatch, capsys) -> None:
    from maxsim_cli.memory import HostMeter
    from maxsim_cli.scoring.entry import score

    queries, shards = _changing_corpus(tmp_path)
    monkeypatch.setattr(HostMeter, "peak", lambda self: self.base + (300 << 20))
    stats = score(queries, shards, output=str(tmp_path / "run.trec"), device="cpu", max_host_memory=256 << 20)
    assert stats.peak_host_bytes == 300 << 20 and stats.host_budget_bytes == 256 << 20
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "maxsim: warning: the process's memory grew by 300 MiB during the run, over --max-host-memory "
        '256 MiB; a larger budget avoids this, or see docs/reliability.md, "Memory bounds"'
    ]
    assert (tmp_path / "run.trec").exists()  # a warning: the run is complete


def test_a_host_budget_below_what_the_run_holds_is_refused_naming_the_minimum(tmp_path) -> None:
    from maxsim_cli.scoring.entry import score

    queries, shards = _changing_corpus(tmp_path)
    out = tmp_path / "run.trec"
    with pytest.raises(
        MaxsimError,
        match=r"\(8 MiB\) is too small .* needs at least (\d+) MiB; give --max-host-memory \1MiB or more$",
    ):
        score(queries, shards, output=str(out), device="cpu", max_host_memory=8 << 20)
    assert not out.exists()


def test_a_cpu_run_holds_its_worker_threads_buffers_within_the_host_budget(tmp_path, monkeypatch) -> None:
    """A CPU run reserves each worker thread's buffers (`memory.worker_host_bytes`) before it plans its
    batches: with many workers a budget that holds one worker's is refused, naming a minimum that counts
    them all, before any work; `cpu_workers` in the stats says how many the run used."""
    from maxsim_kernels.cpu import worker_keep_bytes

    from maxsim_cli.scoring import engine
    from maxsim_cli.scoring.entry import score

    queries, shards = _changing_corpus(tmp_path)
    out = tmp_path / "run.trec"
    budget = 2 * worker_keep_bytes() + (64 << 20)
    monkeypatch.setattr(engine, "worker_count", lambda: 1)
    stats = score(queries, shards, output=str(out), device="cpu", max_host_memory=budget)
    assert stats.extra["cpu_workers"] == 1 and stats.extra["host_reserved_bytes"] > worker_keep_bytes()
    out.unlink()
    monkeypatch.setattr(engine, "worker_count", lambda: 16)
    with pytest.raises(MaxsimError, match=r"is too small .* needs at least (\d+) MiB") as refused:
        score(queries, shards, output=str(out), device="cpu", max_host_memory=budget)
    minimum = int(re.search(r"needs at least (\d+) MiB", str(refused.value)).group(1)) << 20
    assert minimum > 16 * worker_keep_bytes()
    assert not out.exists()


# --------------------------------------------------------------------------------------------------
# the blocks' best keys (`maxsim_kernels.order_keys.block_best_keys`), the running top-k's first step on
# CUDA for a small k: under the interpreter here, on the GPU below


@pytest.mark.parametrize(("nq", "nd", "k"), [(1, 5000, 10), (3, 4097, 1), (2, 2049, 32), (1, 6000, 7)])
def test_block_best_keys_hold_every_rows_best_keys(nq: int, nd: int, k: int) -> None:
    from maxsim_kernels.order_keys import block_best_keys, order_keys_triton

    gen = torch.Generator().manual_seed(nd + k)
    # few distinct values (ties decided by rank), both zeros, negative scores, a deleted document
    scores = torch.randint(-3, 4, (nq, nd), generator=gen).to(torch.float32) / 4
    scores[0, 7], scores[0, 8] = -0.0, 0.0
    ranks = torch.randperm(nd, generator=gen)
    ranks[10] = -1
    hidden = torch.rand(nd, generator=gen) < 0.3
    for hide in (None, hidden):
        best = block_best_keys(scores, ranks, k, hide)
        keys = order_keys_triton(scores, ranks)
        if hide is not None:
            keys[:, hide] = -(1 << 63)
        expected = torch.topk(keys, k, dim=1).values
        assert torch.equal(torch.sort(best, dim=1, descending=True).values[:, :k], expected)


@pytest.mark.parametrize("k", [1, 10, 32])
def test_running_topk_through_the_blocks_best_gives_the_same_result(k: int, monkeypatch) -> None:
    # the CUDA path's choice taken on the CPU (the kernel under the interpreter): one block, then several
    gen = torch.Generator().manual_seed(k)
    nq, nd = 2, 4500
    scores = torch.randint(-40, 40, (nq, nd), generator=gen).to(torch.float32) / 8
    ranks = torch.randperm(nd, generator=gen)
    expected = _reference_topk(scores, ranks, k)
    monkeypatch.setattr(RunningTopK, "_block_best", lambda self, s, r: s.shape[1] > 2048)
    for cuts in ([], [2100], [1000, 3000]):
        topk = RunningTopK(nq, k)
        for a, b in zip([0, *cuts], [*cuts, nd], strict=True):
            topk.add(scores[:, a:b].contiguous(), ranks[a:b])
        got_scores, got_ranks = topk.result()
        rows = zip(got_scores.tolist(), got_ranks.tolist(), strict=True)
        assert [list(zip(s, r, strict=True)) for s, r in rows] == expected


def test_block_best_kernel_builds_for_sm90(sm90_build) -> None:
    """Every variant `block_best_keys` launches compiles for Hopper: the interpreter takes code (a global
    that is not a constexpr, say) that the compiler refuses."""
    built = sm90_build(
        """
from maxsim_kernels import order_keys as m
out = {}
for K in (1, 2, 4, 8, 16, 32):
    for hidden in (False, True):
        sig = {"scores_ptr": "*fp32", "ranks_ptr": "*i64", "hidden_ptr": "*u8" if hidden else "*i64",
               "best_ptr": "*i64", "nd": "i32", "num_blocks": "i32", "HAS_HIDDEN": "constexpr",
               "K": "constexpr", "BLOCK": "constexpr"}
        const = dict(HAS_HIDDEN=hidden, K=K, BLOCK=m.BEST_BLOCK)
        k = triton.compile(ASTSource(m._block_best_kernel, sig, const), target=SM90,
                           options={"num_warps": m.BEST_WARPS, "num_stages": 1})
        out[f"{K} {hidden}"] = resource_usage(k)
print(json.dumps(out))
"""
    )
    assert len(built) == 12
    assert all(not usage or "LOCAL:0" in usage for usage in built.values()), built
