"""Planning (`maxsim_cli.scoring.plan`): budgets to query batches and document batches, from numpy arrays
alone (no shard file, no device)."""

from __future__ import annotations

import numpy as np
import pytest

from maxsim_cli.errors import MaxsimError
from maxsim_cli.scoring.plan import (
    BUDGET_FILL,
    Budget,
    index_parts,
    plan_exhaustive,
    plan_rerank,
    shard_parts,
)

TB = 16 * 2  # bytes a document token: dim 16, fp16
QTB = 16 * 4  # bytes a query token: float32


def _corpus(seed: int = 0, shards: tuple[int, ...] = (40, 25, 35)) -> tuple[np.ndarray, np.ndarray]:
    """Document lengths (1-30 tokens) and shard bounds."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 31, size=sum(shards)).astype(np.int64)
    bounds = np.concatenate([[0], np.cumsum(shards)]).astype(np.int64)
    return lengths, bounds


def _queries(n: int, tokens: int = 8) -> np.ndarray:
    return np.arange(0, (n + 1) * tokens, tokens, dtype=np.int64)


def _cpu(device_bytes: int) -> Budget:
    return Budget(device_bytes=device_bytes, host_bytes=4 << 30, reader_threads=1, cuda=False)


def _cuda(device_bytes: int) -> Budget:
    return Budget(device_bytes, 4 << 30, 4, True, staging_bytes=64 << 20, device="cuda:0")


def _check_covers(plan, lengths: np.ndarray, bounds: np.ndarray) -> None:  # noqa: ANN001
    """The batches are consecutive, cover every document once, and their parts say the same."""
    assert plan.spans[0][0] == 0 and plan.spans[-1][1] == len(lengths)
    assert all(b0 == a1 for (_, b0), (a1, _) in zip(plan.spans, plan.spans[1:], strict=False))
    for (a, b), parts in zip(plan.spans, plan.parts, strict=True):
        ordinals = [int(bounds[s]) + d for s, start, stop in parts for d in range(start, stop)]
        assert ordinals == list(range(a, b))
    assert plan.num_tokens == int(lengths.sum())


def test_a_large_budget_is_one_query_batch_and_batches_within_shards_on_the_cpu() -> None:
    lengths, bounds = _corpus()
    plan = plan_exhaustive(lengths, bounds, _queries(5), QTB, TB, 10, None, _cpu(1 << 30))
    assert plan is not None
    assert plan.query_batches == [(0, 5)] and not plan.resident
    _check_covers(plan, lengths, bounds)
    assert all(len(parts) == 1 for parts in plan.parts)  # `_cut_at`: one shard a batch on the CPU
    assert len(plan.spans) == len(bounds) - 1  # the corpus is small: a batch a shard
    assert 0 < plan.planned_bytes <= (1 << 30) * BUDGET_FILL


@pytest.mark.parametrize("budget", [9_000, 20_000, 60_000])
def test_smaller_budgets_make_more_batches_that_fit(budget: int) -> None:
    lengths, bounds = _corpus()
    plan = plan_exhaustive(lengths, bounds, _queries(5), QTB, TB, 10, None, _cpu(budget))
    assert plan is not None
    _check_covers(plan, lengths, bounds)
    assert 0 < plan.planned_bytes <= budget * BUDGET_FILL
    assert len(plan.spans) > len(bounds) - 1
    assert plan.max_batch_tokens == max(plan.batch_tokens(i) for i in range(len(plan.spans)))


def test_a_budget_too_small_for_the_longest_document_is_a_clear_error() -> None:
    lengths, bounds = _corpus()
    with pytest.raises(MaxsimError, match=r"memory budget \(200 B on cpu\) is too small for 1 query "):
        plan_exhaustive(lengths, bounds, _queries(5), QTB, TB, 10, None, _cpu(200))


def test_batch_queries_fixes_the_query_batches() -> None:
    lengths, bounds = _corpus()
    plan = plan_exhaustive(lengths, bounds, _queries(5), QTB, TB, 10, 2, _cpu(1 << 30))
    assert plan is not None and plan.query_batches == [(0, 2), (2, 4), (4, 5)]


def test_cuda_keeps_the_batches_resident_across_query_batches_when_they_fit() -> None:
    lengths, bounds = _corpus()
    roomy = plan_exhaustive(lengths, bounds, _queries(6), QTB, TB, 10, 2, _cuda(1 << 30))
    assert roomy is not None and roomy.resident and len(roomy.query_batches) == 3
    assert roomy.planned_bytes <= (1 << 30) * BUDGET_FILL
    single = plan_exhaustive(lengths, bounds, _queries(6), QTB, TB, 10, None, _cuda(1 << 30))
    assert single is not None and not single.resident  # one pass: nothing to keep
    tight = plan_exhaustive(lengths, bounds, _queries(6), QTB, TB, 10, 2, _cuda(60_000))
    assert tight is not None and not tight.resident and len(tight.spans) > 1
    _check_covers(tight, lengths, bounds)


def test_nothing_to_plan() -> None:
    lengths, bounds = _corpus()
    assert plan_exhaustive(lengths, bounds, _queries(0), QTB, TB, 10, None, _cpu(1 << 30)) is None
    none = np.zeros(0, dtype=np.int64)
    assert plan_exhaustive(none, np.zeros(1, np.int64), _queries(3), QTB, TB, 10, None, _cpu(1 << 30)) is None
    assert plan_rerank(none, none, lengths, bounds, _queries(3), QTB, TB, _cpu(1 << 30)) is None


@pytest.mark.parametrize("budget", [12_000, 1 << 30])
def test_rerank_side_data_lists_each_pair_once_with_its_output_position(budget: int) -> None:
    lengths, bounds = _corpus(3)
    rng = np.random.default_rng(5)
    nq = 4
    # pairs in (query, run order): each query's candidates in a random order, some shared across queries
    pair_q = np.repeat(np.arange(nq), 12)
    pair_doc = np.concatenate([rng.choice(len(lengths), 12, replace=False) for _ in range(nq)])
    plan = plan_rerank(pair_q, pair_doc, lengths, bounds, _queries(nq), QTB, TB, _cpu(budget))
    assert plan is not None and plan.docs is not None and plan.sides is not None
    assert plan.query_batches == [(0, nq)] and plan.num_pairs == len(pair_q)
    assert plan.planned_bytes <= budget * BUDGET_FILL
    assert list(plan.docs) == sorted(set(pair_doc.tolist()))
    assert plan.num_tokens == int(lengths[plan.docs].sum())
    if budget < 1 << 20:
        assert len(plan.spans) > 1
    seen = {}
    for (a, b), side, parts in zip(plan.spans, plan.sides, plan.parts, strict=True):
        ordinals = [int(bounds[s]) + int(d) for s, idx in parts for d in idx]
        assert ordinals == plan.docs[a:b].tolist()
        offsets = side[: nq + 1]
        n = int(offsets[-1])
        docs, positions = side[nq + 1 : nq + 1 + n], side[nq + 1 + n :]
        assert len(side) == nq + 1 + 2 * n
        for q in range(nq):
            for j in range(int(offsets[q]), int(offsets[q + 1])):
                seen[int(positions[j])] = (q, int(plan.docs[a + int(docs[j])]))
    # output position i is the i-th pair in (query, run order)
    assert [seen[i] for i in range(len(pair_q))] == list(zip(pair_q.tolist(), pair_doc.tolist(), strict=True))
    assert plan.pair_query is not None and plan.pair_query.tolist() == pair_q.tolist()


@pytest.mark.parametrize("cuda", [False, True])
def test_rerank_of_a_resident_corpus_is_one_batch_when_it_fits(cuda: bool) -> None:
    """No staging slot limits a resident corpus's batches: 1000 candidates of one query are one batch,
    not one batch a document (the staging arena of a resident corpus is empty)."""
    lengths, bounds = _corpus(3)
    pair_doc = np.random.default_rng(2).choice(len(lengths), min(1000, len(lengths)), replace=False)
    pair_q = np.zeros(len(pair_doc), np.int64)
    budget = Budget(1 << 30, 4 << 30, 2, cuda, staging_bytes=0, device="cuda:0" if cuda else "cpu",
                    resident_corpus=True)  # fmt: skip
    plan = plan_rerank(pair_q, pair_doc, lengths, bounds, _queries(1), QTB, TB, budget)
    assert plan is not None and len(plan.spans) == 1 and plan.num_pairs == len(pair_doc)


def test_rerank_budget_too_small_is_a_clear_error() -> None:
    lengths, bounds = _corpus()
    pair_q, pair_doc = np.zeros(3, np.int64), np.array([0, 50, 90])
    with pytest.raises(MaxsimError, match=r"too small to rerank 2 queries: .* raise --max-memory"):
        plan_rerank(pair_q, pair_doc, lengths, bounds, _queries(2), QTB, TB, _cpu(300))


def test_parts_split_ordinals_by_shard() -> None:
    bounds = np.array([0, 4, 4, 10])  # the middle shard is empty
    assert shard_parts(bounds, 2, 9) == [(0, 2, 4), (2, 0, 5)]
    assert shard_parts(bounds, 4, 6) == [(2, 0, 2)]
    got = index_parts(bounds, np.array([1, 3, 5, 9]))
    assert [(s, idx.tolist()) for s, idx in got] == [(0, [1, 3]), (2, [1, 5])]
