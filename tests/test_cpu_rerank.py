"""The batched CPU rerank (`maxsim_kernels.cpu.maxsim_candidates_cpu`) on each of its paths: groups of one
query's candidates through oneDNN's product (where it gives MKL's bits), document units through MKL's
batched product, a document shared by several queries once against all of them (everywhere else), and,
where the candidates are dense, every query against every listed document by the exhaustive path's
groups. The tests taking the ``rerank_path`` fixture run on each.

Against the float64 reference (`maxsim_candidates_reference`) with test_kernels.py's tolerances (fp32
accumulation: |score - ref| <= 2e-6 * Lq * max(1, dim / 32) + 1e-6 * |ref|; the argmax equal to the
reference's wherever the max is clear by 1e-5). Against the other CPU paths bitwise: a pair's score is
the one the exhaustive path (`maxsim_varlen_cpu`) gives that pair, whatever else shares the call and
whatever the group budget, as `maxsim score` promises identical bytes under any --max-memory.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from maxsim_kernels import cpu as cpu_backend
from maxsim_kernels import maxsim_candidates_reference
from maxsim_kernels.cpu import NonFiniteDocuments, maxsim_candidates_cpu, maxsim_varlen_cpu
from test_kernels import check_argmax, check_scores, packed


def candidates(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """candidate_offsets, candidate_docs of per-query lists."""
    off = torch.zeros(len(lists) + 1, dtype=torch.int64)
    off[1:] = torch.cumsum(torch.tensor([len(x) for x in lists], dtype=torch.int64), 0)
    flat = [d for x in lists for d in x]
    return off, torch.tensor(flat, dtype=torch.int64)


def check_case(
    q_lens,
    d_lens,
    lists,
    dim,
    dtype=torch.float32,
    *,
    seed=0,
    q_sign=None,
    d_sign=None,
    int8_docs=False,
) -> torch.Tensor:
    """Scores and argmax of the batched rerank against the float64 reference and against the exhaustive
    CPU path (bitwise); returns the scores."""
    gen = torch.Generator().manual_seed(seed)
    queries, q_off = packed(q_lens, dim, dtype, sign=q_sign, gen=gen)
    docs, d_off = packed(d_lens, dim, dtype, sign=d_sign, gen=gen)
    scales = None
    if int8_docs:
        scales = docs.float().abs().amax(dim=1).clamp_min(1e-6) / 127
        docs = torch.round(docs.float() / scales[:, None]).to(torch.int8)
    c_off, c_docs = candidates(lists)
    scores, arg = maxsim_candidates_cpu(
        queries, q_off, docs, d_off, c_off, c_docs, return_argmax=True, doc_scales=scales
    )
    ref = maxsim_candidates_reference(queries, q_off, docs, d_off, c_off, c_docs, doc_scales=scales)
    pair_query = np.repeat(np.arange(len(lists)), [len(x) for x in lists])
    q_lens_t = torch.as_tensor(q_lens, dtype=torch.int64)
    max_q = int(q_lens_t.max())
    assert scores.shape == (len(c_docs),) and arg.shape == (len(c_docs), max_q) and arg.dtype == torch.int32
    if dtype == torch.float64:
        assert scores.dtype == torch.float64
        assert torch.allclose(scores, ref, rtol=1e-12, atol=1e-12) or torch.equal(scores, ref)
    else:
        check_scores(scores, ref, q_lens_t[pair_query], dim)
    plain = maxsim_candidates_cpu(queries, q_off, docs, d_off, c_off, c_docs, doc_scales=scales)
    assert torch.equal(plain, scores), "scores must not depend on return_argmax"
    # the argmax: -1 past each query's length, otherwise a token reaching the max (on the scaled tokens)
    scaled = docs.double() * scales.double()[:, None] if scales is not None else docs
    pairs = []
    for c, (qi, di) in enumerate(zip(pair_query, c_docs.tolist(), strict=True)):
        assert bool((arg[c, q_lens[qi] :] == -1).all())
        pairs.append((int(qi), di, arg[c]))
    check_argmax(arg, queries, q_off, scaled, d_off, pairs)
    # bitwise the exhaustive path's score of the same pair
    full = maxsim_varlen_cpu(queries, q_off, docs, d_off, doc_scales=scales)
    assert torch.equal(scores, full[torch.from_numpy(pair_query), c_docs])
    return scores


@pytest.fixture(params=["query groups", "document units", "all pairs"])
def rerank_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test that takes it runs on the oneDNN query groups, on the MKL document units and on the
    exhaustive path's groups over the listed documents (dense candidates: `DENSE_CANDIDATES`)."""
    dense = request.param == "all pairs"
    monkeypatch.setattr(cpu_backend, "DENSE_CANDIDATES", 0.0 if dense else float("inf"))
    monkeypatch.setattr(cpu_backend, "DENSE_SHARING", 0.0)
    if request.param == "document units":
        monkeypatch.setattr(cpu_backend, "_onednn_product", lambda dim: False)
    elif request.param == "query groups":
        if not cpu_backend._onednn_product(128):
            pytest.skip("oneDNN's product is missing here or gives other bits than MKL's")
        monkeypatch.setattr(cpu_backend, "_QUERY_GROUP_MIN_PAIRS", 0)  # the few candidates of these tests
    return request.param


def test_queries_of_few_candidates_go_to_the_document_units(monkeypatch) -> None:
    """The query groups take a call whose queries list `_QUERY_GROUP_MIN_PAIRS` candidates each on average
    (queries without candidates not counted); fewer go to the document units, with the same bits."""
    if not cpu_backend._onednn_product(32):
        pytest.skip("oneDNN's product is missing here or gives other bits than MKL's")
    monkeypatch.setattr(cpu_backend, "_QUERY_GROUP_MIN_PAIRS", 4)
    taken = []
    for name in ("_rerank_by_query", "_rerank_by_document"):
        real = getattr(cpu_backend, name)
        monkeypatch.setattr(
            cpu_backend, name, lambda *a, _n=name, _f=real, **k: (taken.append(_n), _f(*a, **k))
        )
    gen = torch.Generator().manual_seed(3)
    q, qo = packed([5, 3, 4], 32, gen=gen)
    d, do = packed([7, 1, 12, 30, 2, 9, 4, 5], 32, gen=gen)
    outs = []
    for lists in ([[0, 1, 2, 3], [], [4, 5, 6, 7]], [[0, 1, 2], [], [4, 5, 6, 7]]):  # 4 a query; 3.5
        off, docs = candidates(lists)
        outs.append(maxsim_candidates_cpu(q, qo, d, do, off, docs))
    assert taken == ["_rerank_by_query", "_rerank_by_document"]
    assert torch.equal(outs[1][:3], outs[0][:3]) and torch.equal(outs[1][3:], outs[0][4:])


def set_budget(monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    """The group budget of both paths."""
    monkeypatch.setattr(cpu_backend, "_RERANK_GROUP_BYTES", budget)
    monkeypatch.setattr(cpu_backend, "_QUERY_GROUP_BYTES", budget)


def on_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small groups, spread over two worker threads (whatever the CPUs this test may use)."""
    set_budget(monkeypatch, 200_000)
    monkeypatch.setattr(cpu_backend, "_worker_count", lambda: 2)


@pytest.mark.parametrize("workers", [False, True])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_random_ragged_candidates_match_the_reference(seed, dtype, workers, rerank_path, monkeypatch):
    if workers:
        on_workers(monkeypatch)
    rng = np.random.default_rng(1000 + seed)
    nq, nd = int(rng.integers(1, 40)), int(rng.integers(1, 80))
    q_lens = rng.integers(1, 40, nq).tolist()
    d_lens = rng.integers(0, 300, nd).tolist()
    lists = [rng.integers(0, nd, int(rng.integers(0, 25))).tolist() for _ in range(nq)]
    dim = [24, 40, 96, 128, 136, 8][seed]
    check_case(q_lens, d_lens, lists, dim, dtype, seed=seed)


def test_length_one_queries_and_documents_and_empty_documents(rerank_path):
    # documents of 0, 1, 2 and 15-17 tokens (around the 16-row padding of the products)
    d_lens = [1, 0, 2, 1, 15, 16, 17, 1, 0]
    lists = [[0, 1, 2], [3], [], [4, 5, 6, 7, 8, 0], [1, 8], [7, 7, 0]]
    scores = check_case([1, 1, 3, 1, 2, 1], d_lens, lists, 24)
    off = np.cumsum([0] + [len(x) for x in lists])
    empty = [off[q] + j for q, x in enumerate(lists) for j, d in enumerate(x) if d_lens[d] == 0]
    assert bool(torch.isinf(scores[empty]).all()) and bool((scores[empty] < 0).all())


def test_duplicates_and_a_document_listed_by_many_queries(rerank_path):
    # document 3 is listed by all 75 queries, twice by some: with queries of <= 5 tokens a product takes
    # 512 // 16 = 32 of its pairs, so its pairs are split over several products
    rng = np.random.default_rng(3)
    nq = 75
    lists = [[3, int(rng.integers(0, 12))] + ([3] if q % 4 == 0 else []) for q in range(nq)]
    q_lens = rng.integers(1, 6, nq).tolist()
    check_case(q_lens, rng.integers(1, 60, 12).tolist(), lists, 40, seed=4)


def test_queries_without_candidates_first_last_and_between(rerank_path):
    lists = [[], [0, 1], [], [], [2, 0, 2], []]
    check_case([3, 4, 5, 6, 7, 8], [4, 9, 1], lists, 16)


def test_one_candidate_a_query(rerank_path):
    # every query one candidate (a group of one pair each), 1-token queries and documents among them
    lists = [[4], [0], [2], [4], [1], [3]]
    check_case([1, 33, 16, 17, 1, 5], [1, 300, 7, 1, 40], lists, 40, seed=11)
    check_case([9], [3, 60], [[1]], 24, seed=12)  # one query, one candidate


@pytest.mark.parametrize("workers", [1, 2])
def test_calls_inside_and_outside_inference_mode_in_turn(rerank_path, workers, monkeypatch):
    """The worker threads' reused buffers (`cpu.thread_buffer`) are normal tensors even when a call under
    ``torch.inference_mode`` (`maxsim score`, the API) makes them: a later call outside it writes into them
    in place (an inference tensor raised there), and back inside. The same bits each time; the few-rows
    stream of `maxsim_varlen_cpu` alike."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: workers)
    gen = torch.Generator().manual_seed(21)
    q, qo = packed([5, 3, 9], 32, gen=gen)
    d, do = packed([7, 1, 12, 40, 3], 32, gen=gen)
    off, docs = candidates([[0, 1, 3], [2], [4, 3, 0, 1]])
    outs = []
    for inference in (True, False, True, False):
        with torch.inference_mode(inference):
            outs.append(maxsim_candidates_cpu(q, qo, d, do, off, docs))
            outs.append(maxsim_varlen_cpu(q[:5], qo[:2], d, do))
    for i, out in enumerate(outs[2:]):
        assert torch.equal(out, outs[i % 2]), i


def test_the_same_documents_in_every_query_in_other_orders(rerank_path):
    """Every query lists the same documents (some twice) in its own order: each pair is scored in its
    query's group, a document gathered once a pair, and lands at its own position."""
    rng = np.random.default_rng(13)
    base = [0, 1, 2, 3, 4, 5, 2, 5]
    lists = [rng.permutation(base).tolist() for _ in range(9)]
    scores = check_case(rng.integers(1, 40, 9).tolist(), [1, 2, 16, 17, 150, 40], lists, 24, seed=13)
    off = np.cumsum([0] + [len(x) for x in lists])
    for q, listed in enumerate(lists):  # a document listed twice by a query scores the same twice
        row = scores[int(off[q]) : int(off[q + 1])]
        for d in (2, 5):
            at = [j for j, x in enumerate(listed) if x == d]
            assert torch.equal(row[at[0]], row[at[1]])


def test_query_lengths_around_the_column_padding(rerank_path):
    """oneDNN's columns are a query's tokens padded with copies of its last to a multiple of 16; the
    copies never reach a score or an argmax."""
    q_lens = [1, 15, 16, 17, 31, 32, 33, 47, 48]
    rng = np.random.default_rng(14)
    lists = [rng.integers(0, 10, 5).tolist() for _ in q_lens]
    check_case(q_lens, rng.integers(1, 90, 10).tolist(), lists, 32, q_sign=1.0, d_sign=-1.0, seed=14)


def test_a_document_over_the_group_budget(rerank_path, monkeypatch):
    """A document whose block alone exceeds the budget is a group of its own, between smaller groups."""
    set_budget(monkeypatch, 64 * 1024)
    lists = [[0, 1, 2, 3], [3, 2], [1]]
    check_case([20, 3, 40], [2, 1500, 30, 700], lists, 16, seed=15)


def test_a_dim_where_onednn_may_sum_otherwise():
    """dim 256: oneDNN's product cuts the sum over dim otherwise than MKL's on some CPUs (the 2-core AMD
    machine); whichever path the check picks, a pair's score is the exhaustive path's."""
    rng = np.random.default_rng(16)
    lists = [rng.integers(0, 8, 4).tolist() for _ in range(3)]
    check_case([5, 32, 17], rng.integers(1, 60, 8).tolist(), lists, 256, seed=16)


def test_onednn_is_used_only_where_it_gives_mkls_bits(monkeypatch):
    """The check compares oneDNN's product with MKL's once per dim: one that differs by a single ulp, or
    is missing, sends the rerank to the document units, and its scores stay the exhaustive path's."""
    real = cpu_backend._onednn_linear
    calls = []

    def off_by_an_ulp(block: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        calls.append(block.shape)
        sim = real(block, weight)
        return torch.nextafter(sim, torch.full_like(sim, torch.inf))

    monkeypatch.setattr(cpu_backend, "_ONEDNN_SAME_BITS", {})
    monkeypatch.setattr(cpu_backend, "_onednn_linear", off_by_an_ulp)
    assert cpu_backend._onednn_product(24) is False
    probed = len(calls)
    check_case([3, 20], [5, 30, 1], [[0, 1, 2], [2, 2]], 24, seed=17)
    assert len(calls) == probed, "no oneDNN product after a check that failed"
    assert cpu_backend._onednn_product(24) is False and len(calls) == probed, "checked once per dim"

    def missing(block: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no such op")

    monkeypatch.setattr(cpu_backend, "_onednn_linear", missing)
    assert cpu_backend._onednn_product(40) is False
    check_case([3, 20], [5, 30, 1], [[0, 1, 2], [2, 2]], 40, seed=17)
    monkeypatch.setattr(cpu_backend.torch.backends.mkldnn, "is_available", lambda: False)
    assert cpu_backend._onednn_product(48) is False


def test_no_candidates_at_all():
    queries, q_off = packed([3, 5], 16)
    docs, d_off = packed([4, 2], 16)
    c_off, c_docs = torch.zeros(3, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    scores, arg = maxsim_candidates_cpu(queries, q_off, docs, d_off, c_off, c_docs, return_argmax=True)
    assert scores.shape == (0,) and scores.dtype == torch.float32
    assert arg.shape == (0, 5) and arg.dtype == torch.int32


def test_only_empty_documents():
    scores, arg = maxsim_candidates_cpu(
        *packed([2], 16),
        torch.zeros(0, 16),
        torch.zeros(4, dtype=torch.int64),
        *candidates([[0, 2, 1]]),
        return_argmax=True,
    )
    assert bool(torch.isinf(scores).all()) and bool((scores < 0).all())
    assert bool((arg == -1).all())


def test_negative_similarities(rerank_path):
    """Every similarity negative: a padding that added a zero (or a dropped column counted as 0) shows."""
    rng = np.random.default_rng(5)
    lists = [rng.integers(0, 20, 9).tolist() for _ in range(7)]
    scores = check_case(
        rng.integers(1, 30, 7).tolist(), rng.integers(1, 50, 20).tolist(), lists, 48, q_sign=1.0, d_sign=-1.0
    )
    assert bool((scores < 0).all())


@pytest.mark.parametrize("shared", [False, True])
def test_long_queries_are_split_over_several_products(shared, rerank_path):
    """Queries over 512 tokens (the products' column limit), ragged, alone or sharing documents."""
    lists = [[0, 1, 2], [1, 3] if shared else [3], [2, 1, 0] if shared else [4]]
    check_case([600, 17, 1030], [5, 40, 1, 300, 70], lists, 32, seed=6)


def test_int8_documents_with_scales(rerank_path):
    rng = np.random.default_rng(7)
    lists = [rng.integers(0, 30, 12).tolist() for _ in range(9)]
    check_case(rng.integers(1, 33, 9).tolist(), rng.integers(0, 120, 30).tolist(), lists, 96, int8_docs=True)


def test_float64_queries_and_documents():
    rng = np.random.default_rng(8)
    lists = [rng.integers(0, 15, 6).tolist() for _ in range(5)]
    gen = torch.Generator().manual_seed(8)
    queries, q_off = packed(rng.integers(1, 20, 5).tolist(), 24, torch.float64, gen=gen)
    docs, d_off = packed(rng.integers(0, 40, 15).tolist(), 24, torch.float64, gen=gen)
    c_off, c_docs = candidates(lists)
    scores = maxsim_candidates_cpu(queries, q_off, docs, d_off, c_off, c_docs)
    ref = maxsim_candidates_reference(queries, q_off, docs, d_off, c_off, c_docs)
    assert scores.dtype == torch.float64
    torch.testing.assert_close(scores, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("workers", [1, 2])
def test_scores_do_not_depend_on_the_batch_or_the_budget(monkeypatch, workers, rerank_path):
    """A pair's score is bitwise the same in a call with other queries or alone, whatever the group
    budget (one document a product, or many) and the rows a oneDNN product is padded to, on one worker
    thread or two."""
    monkeypatch.setattr(cpu_backend, "_worker_count", lambda: workers)
    rng = np.random.default_rng(9)
    nq, nd = 12, 40
    gen = torch.Generator().manual_seed(9)
    q_lens = rng.integers(1, 40, nq).tolist()
    queries, q_off = packed(q_lens, 96, torch.float16, gen=gen)
    docs, d_off = packed(rng.integers(1, 200, nd).tolist(), 96, torch.float16, gen=gen)
    lists = [rng.integers(0, nd, int(rng.integers(0, 30))).tolist() for _ in range(nq)]
    c_off, c_docs = candidates(lists)
    full = maxsim_candidates_cpu(queries, q_off, docs, d_off, c_off, c_docs)
    for budget in (1, 100_000, 1 << 26):  # one document a product, a few, all
        set_budget(monkeypatch, budget)
        assert torch.equal(maxsim_candidates_cpu(queries, q_off, docs, d_off, c_off, c_docs), full), budget
    for rows in (16, 1024):
        monkeypatch.setattr(cpu_backend, "_ONEDNN_ROWS", rows)
        assert torch.equal(maxsim_candidates_cpu(queries, q_off, docs, d_off, c_off, c_docs), full), rows
    for qa, qb in [(0, 1), (3, 4), (2, 9), (11, 12)]:
        sub_c_off, sub_c_docs = candidates(lists[qa:qb])
        sub = maxsim_candidates_cpu(
            queries[q_off[qa] : q_off[qb]], q_off[qa : qb + 1] - q_off[qa], docs, d_off, sub_c_off, sub_c_docs
        )
        assert torch.equal(sub, full[int(c_off[qa]) : int(c_off[qb])]), (qa, qb)


@pytest.mark.parametrize("workers", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_non_finite_candidate_tokens_raise(bad, dtype, workers, rerank_path, monkeypatch):
    """check_finite finds a NaN/Inf in any candidate's token, also one shared by many queries (several
    pairs in one product), and ignores it in a document no query lists."""
    if workers:
        on_workers(monkeypatch)
    rng = np.random.default_rng(10)
    gen = torch.Generator().manual_seed(10)
    queries, q_off = packed(rng.integers(1, 9, 40).tolist(), 24, dtype, gen=gen)
    docs, d_off = packed([5, 1, 9, 3, 7, 30], 24, dtype, gen=gen)
    docs[int(d_off[2]) + 6, 17] = bad  # document 2, token 6
    shared = candidates([[2, 0] for _ in range(40)])
    once = candidates([[0]] * 39 + [[4, 2]])
    elsewhere = candidates([[0, 1, 3, 4, 5]] * 40)
    for c_off, c_docs in (shared, once):
        with pytest.raises(NonFiniteDocuments, match="NaN or Inf"):
            maxsim_candidates_cpu(queries, q_off, docs, d_off, c_off, c_docs, check_finite=True)
    clean = maxsim_candidates_cpu(queries, q_off, docs, d_off, *elsewhere, check_finite=True)
    assert torch.equal(clean, maxsim_candidates_cpu(queries, q_off, docs, d_off, *elsewhere))


def test_argument_errors_are_unchanged():
    queries, q_off = packed([3, 5], 16)
    docs, d_off = packed([4, 2], 16)
    with pytest.raises(ValueError, match=r"candidate_docs\[1\] = 2 is not a document index in \[0, 2\)"):
        maxsim_candidates_cpu(queries, q_off, docs, d_off, *candidates([[0, 2], []]))
    with pytest.raises(ValueError, match="candidate_offsets has 2 entries but there are 2 queries"):
        maxsim_candidates_cpu(queries, q_off, docs, d_off, torch.tensor([0, 1]), torch.tensor([0]))
    with pytest.raises(ValueError, match="candidate_docs must be int64"):
        maxsim_candidates_cpu(queries, q_off, docs, d_off, torch.tensor([0, 1, 1]), torch.tensor([0.0]))
    with pytest.raises(ValueError, match="queries have dim 16 but docs have dim 8"):
        maxsim_candidates_cpu(queries, q_off, docs[:, :8], d_off, *candidates([[0], [1]]))
    with pytest.raises(ValueError, match="query 1 has no tokens"):
        maxsim_candidates_cpu(queries, torch.tensor([0, 8, 8]), docs, d_off, *candidates([[0], [1]]))
