"""Small calls on a resident corpus are scored directly (`maxsim_cli.scoring.direct`): the same run as
the engine's, bit for bit, on every layout; the engine takes over where the direct path must not run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_score import DIM, make_corpus, make_queries

import maxsim_cli
from maxsim_cli import Queries, open_corpus, rerank, search
from maxsim_cli.errors import InputError
from maxsim_cli.scoring import direct
from maxsim_cli.shards import write_shard


def _random_values(gen: torch.Generator, n: int) -> torch.Tensor:
    """Unrounded values of both signs: fp16 products that round, negative similarities."""
    return torch.randn(n, DIM, generator=gen, dtype=torch.float64)


@pytest.fixture(scope="module", params=["float16", "float32", "bfloat16"])
def corpus_path(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"direct-{request.param}")
    make_corpus(root / "corpus", dtype=request.param, seed=3, values=_random_values)
    return str(root / "corpus")


@pytest.fixture(scope="module")
def queries(tmp_path_factory):
    path = tmp_path_factory.mktemp("direct-q") / "queries.safetensors"
    make_queries(path, n=7, dtype="float32", seed=5, values=_random_values)
    return maxsim_cli.read_queries(path)


def _engine_only(monkeypatch) -> None:
    monkeypatch.setattr(direct, "eligible", lambda *args: None)


def _candidates(corpus, qids, seed: int) -> dict[str, list[str]]:
    """Candidates in an order other than the queries' (the last query first), some queries without any,
    one docno not in the corpus."""
    rng = np.random.default_rng(seed)
    ids = corpus.ids
    out = {}
    for qid in reversed(qids[1:]):
        picked = rng.choice(len(ids), size=int(rng.integers(1, 12)), replace=False)
        out[qid] = [ids[i] for i in picked]
    out[qids[-1]].append("not-a-document")
    return out


def test_search_is_the_engines_run_bit_for_bit(corpus_path, queries, monkeypatch) -> None:
    with open_corpus(corpus_path) as corpus:
        corpus.to("cpu")
        for k in (1, 5, 1000):
            run = search(queries, corpus, k=k)
            assert run.stats.extra.get("direct") is True
            with monkeypatch.context() as patch:
                _engine_only(patch)
                engine_run = search(queries, corpus, k=k)
            assert engine_run.stats.extra.get("direct") is None
            assert run.to_dict() == engine_run.to_dict()
            assert run.stats.pairs == engine_run.stats.pairs == len(queries) * len(corpus)


def test_rerank_is_the_engines_run_bit_for_bit(corpus_path, queries, monkeypatch) -> None:
    with open_corpus(corpus_path) as corpus:
        corpus.to("cpu")
        cands = _candidates(corpus, queries.ids, seed=1)
        for k in (None, 3):
            with pytest.warns(maxsim_cli.MaxsimWarning, match="1 candidates are not in the corpus"):
                run = rerank(queries, corpus, cands, k=k)
            assert run.stats.extra.get("direct") is True
            with monkeypatch.context() as patch, pytest.warns(maxsim_cli.MaxsimWarning):
                _engine_only(patch)
                engine_run = rerank(queries, corpus, cands, k=k)
            assert run.to_dict() == engine_run.to_dict()
            assert run.qids == engine_run.qids  # the queries' order, not the candidates'
            for field in ("pairs", "queries_with_candidates", "missing_candidates", "documents", "tokens"):
                assert getattr(run.stats, field) == getattr(engine_run.stats, field), field


def test_int8_corpus_is_the_engines_run(corpus_path, queries, tmp_path, monkeypatch) -> None:
    from maxsim_cli.quantize import quantize_corpus

    quantize_corpus([corpus_path], tmp_path / "int8", sample_queries=0, device="cpu")
    with open_corpus(tmp_path / "int8") as corpus:
        corpus.to("cpu")
        cands = {qid: corpus.ids[:9] for qid in queries.ids}
        run, reranked = search(queries, corpus, k=6), rerank(queries, corpus, cands)
        assert run.stats.extra.get("direct") is True
        _engine_only(monkeypatch)
        assert run.to_dict() == search(queries, corpus, k=6).to_dict()
        assert reranked.to_dict() == rerank(queries, corpus, cands).to_dict()


def test_exact_ties_are_broken_by_docno_descending(tmp_path) -> None:
    """Five copies of one document under different docnos, in two shards: equal scores, ranked by docno
    descending, in search and rerank alike."""
    emb = torch.zeros(2, 8)
    emb[:, :3] = torch.tensor([[0.5, -0.25, 1.0], [1.0, 0.5, -0.5]])
    write_shard(tmp_path / "a.safetensors", ["d3", "d1", "x"], [emb, emb, -emb[:1]], dtype="float32")
    write_shard(tmp_path / "b.safetensors", ["d2", "d5", "d4"], [emb, emb, emb], dtype="float32")
    q = Queries.from_embeddings(["q"], [emb[:1]])
    with open_corpus(tmp_path) as corpus:
        corpus.to("cpu")
        run = search(q, corpus, k=6)
        assert run.stats.extra.get("direct") is True
        assert [r.docno for r in run] == ["d5", "d4", "d3", "d2", "d1", "x"]
        assert len({r.score for r in list(run)[:5]}) == 1 and list(run)[5].score < 0
        reranked = rerank(q, corpus, {"q": ["x", "d1", "d4", "d2"]})
        assert [r.docno for r in reranked] == ["d4", "d2", "d1", "x"]


def test_a_rerank_writes_the_engines_trec_bytes_with_ties_misses_and_filters(tmp_path, monkeypatch) -> None:
    """The direct rerank hands a query's rows over as the lookup's Arrow docnos, sorted by score, equal
    scores by docno descending; none goes through write_query (which the engine's rows take). Both
    give the engine's file byte for byte: queries given in another order, with and without ties, a
    missing candidate, a cut to k and a filter."""
    gen = torch.Generator().manual_seed(4)
    docs = [torch.randn(int(n), 8, generator=gen) for n in torch.randint(1, 6, (40,), generator=gen)]
    docs[7] = docs[3].clone()  # copies: equal scores for every query
    docs[21] = docs[3].clone()
    ids = [f"doc{i:02d}" for i in range(40)]
    write_shard(tmp_path / "a.safetensors", ids[:25], docs[:25], dtype="float32")
    write_shard(tmp_path / "b.safetensors", ids[25:], docs[25:], dtype="float32")
    q = Queries.from_embeddings(["q1", "q2", "q3"], [torch.randn(3, 8, generator=gen) for _ in range(3)])
    cands = {
        "q3": [ids[i] for i in (30, 3, 12, 21, 5, 7, 39)],  # three copies: tied
        "q1": [ids[i] for i in (9, 0, 33, 17)] + ["missing"],  # no ties
        "q2": [ids[i] for i in (2, 26, 14, 38, 11)],
    }
    from maxsim_cli.run_files import RankedSink

    outputs, sorted_by_docno = {}, []
    write_query = RankedSink.write_query
    for way in ("direct", "engine"):
        with open_corpus(tmp_path) as corpus, monkeypatch.context() as patch:
            corpus.to("cpu")
            if way == "engine":
                _engine_only(patch)
            else:  # the queries that go through write_query: none, equal scores or not
                patch.setattr(RankedSink, "write_query", lambda self, qid, *a: [
                    sorted_by_docno.append(qid), write_query(self, qid, *a)][1])  # fmt: skip
            for k in (None, 2):
                for exclude in (None, [ids[12], ids[38]]):
                    with pytest.warns(maxsim_cli.MaxsimWarning, match="1 candidates are not in the corpus"):
                        run = rerank(q, corpus, cands, k=k, exclude=exclude)
                    assert run.stats.extra.get("direct") is (True if way == "direct" else None)
                    path = tmp_path / f"{way}-{k}-{exclude is None}.trec"
                    run.to_trec(path)
                    outputs.setdefault(way, []).append(path.read_bytes())
    assert outputs["direct"] == outputs["engine"]
    assert sorted_by_docno == []
    assert b"q3 Q0 doc21" in outputs["direct"][0] and outputs["direct"][0].startswith(b"q1 Q0 ")


def test_docnos_alone_under_two_keys_of_one_qid_are_one_query(corpus_path, queries) -> None:
    """Docnos given alone are kept as their list (`DocnoRows`); two keys that name one qid (1 and "1")
    still join their rows in order, and a docno under both is a docno twice."""
    from maxsim_cli.scoring.results import DocnoRows

    ids = Queries.from_embeddings(["1"], [torch.ones(2, DIM)])
    with open_corpus(corpus_path) as corpus:
        corpus.to("cpu")
        docnos = corpus.ids[:6]
        joined = rerank(ids, corpus, {1: docnos[:3], "1": docnos[3:]})
        pairs = rerank(ids, corpus, {"1": [(d, 0.0) for d in docnos]})
        assert joined.to_dict() == pairs.to_dict() and len(joined) == 6
        with pytest.raises(InputError, match=f"docno {docnos[2]!r} appears twice for query '1'"):
            rerank(ids, corpus, {1: docnos[:3], "1": docnos[2:]})
    rows = DocnoRows(["a", "b"])
    assert list(rows) == [("a", 0.0), ("b", 0.0)] and rows[1] == ("b", 0.0) and rows[:1] == [("a", 0.0)]
    assert rows == [("a", 0.0), ("b", 0.0)] and len(rows) == 2


def test_bad_candidates_fail_as_in_the_engine(corpus_path, queries) -> None:
    with open_corpus(corpus_path) as corpus:
        corpus.to("cpu")
        with pytest.raises(InputError, match="query 'nope' has candidates but no embedding"):
            rerank(queries, corpus, {"nope": corpus.ids[:2]})
        with pytest.raises(InputError, match="1 candidates are not in the corpus"):
            rerank(queries, corpus, {queries.ids[0]: ["missing"]}, strict=True)
        with pytest.warns(maxsim_cli.MaxsimWarning):
            empty = rerank(queries, corpus, {queries.ids[0]: ["missing"]})
        assert len(empty) == 0 and empty.stats.pairs == 0


def test_the_engine_runs_what_the_direct_path_must_not(corpus_path, queries, monkeypatch) -> None:
    with open_corpus(corpus_path) as corpus:
        streamed = search(queries, corpus, k=4, device="cpu")  # not resident
        assert streamed.stats.extra.get("direct") is None
        corpus.to("cpu")
        for options in ({"max_memory": "64MiB"}, {"max_host_memory": "4GiB"}, {"batch_queries": 2}):
            run = search(queries, corpus, k=4, **options)
            assert run.stats.extra.get("direct") is None and run == streamed, options
        # a score block over the direct path's limit
        monkeypatch.setitem(direct.MAX_BLOCK_BYTES, "cpu", 1)
        assert search(queries, corpus, k=4).stats.extra.get("direct") is None


def test_out_of_memory_hands_the_call_to_the_engine(corpus_path, queries, monkeypatch) -> None:
    import maxsim_kernels

    with open_corpus(corpus_path) as corpus:
        corpus.to("cpu")
        expected = search(queries, corpus, k=5)

        def out_of_memory(kernel):
            def call(*args, check_finite=False, **kwargs):
                if not check_finite:
                    raise torch.OutOfMemoryError("out of memory")
                return kernel(*args, check_finite=check_finite, **kwargs)

            return call

        for name in ("maxsim_varlen", "maxsim_candidates"):
            monkeypatch.setattr(maxsim_kernels, name, out_of_memory(getattr(maxsim_kernels, name)))
        # the engine on the CPU asks the kernels to check values (the direct path does not), which works
        run = search(queries, corpus, k=5)
        assert run.stats.extra.get("direct") is None and run == expected
        # the direct path's notes are dropped with it: the missing candidate is warned about once
        with pytest.warns(maxsim_cli.MaxsimWarning) as caught:
            reranked = rerank(queries, corpus, {queries.ids[0]: [corpus.ids[0], "missing"]})
        assert len(caught) == 1 and reranked.stats.extra.get("direct") is None and len(reranked) == 1


@pytest.mark.gpu
def test_on_the_gpu_the_direct_path_is_the_engines_run(corpus_path, queries, tmp_path, monkeypatch) -> None:
    from maxsim_cli.quantize import quantize_corpus

    quantize_corpus([corpus_path], tmp_path / "int8", sample_queries=0, device="cuda")
    for path in (corpus_path, str(tmp_path / "int8")):
        with open_corpus(path) as corpus:
            corpus.to("cuda")
            cands = _candidates(corpus, queries.ids, seed=2)
            with pytest.warns(maxsim_cli.MaxsimWarning):
                got = (search(queries, corpus, k=7), rerank(queries, corpus, cands))
            assert all(r.stats.extra.get("direct") is True for r in got)
            with monkeypatch.context() as patch, pytest.warns(maxsim_cli.MaxsimWarning):
                _engine_only(patch)
                want = (search(queries, corpus, k=7), rerank(queries, corpus, cands))
            assert [r.to_dict() for r in got] == [r.to_dict() for r in want]


def test_a_querys_order_with_runs_of_equal_scores_is_sort_trecs() -> None:
    """`_trec_order` sorts the scores in numpy and each run of equal scores by docno: `sort_trec`'s
    order, whatever the ties (one run, many, at the ends, -0 against 0); None for a non-finite score."""
    from maxsim_cli.run_files import sort_trec
    from maxsim_cli.scoring.results import _trec_order

    gen = np.random.default_rng(3)
    for n in (1, 2, 5, 60, 1000):
        for levels in (1, 3, 50, 10_000):
            scores = (gen.integers(0, levels, n) / 7 - 1).astype(np.float32)
            scores[scores == 0] = np.float32(-0.0) if n % 2 else scores[scores == 0]
            docnos = [f"{gen.choice(['d', 'é', '中'])}{i}" for i in gen.permutation(n)]
            assert _trec_order(scores, docnos).tolist() == sort_trec(docnos, scores.tolist()), (n, levels)
    assert _trec_order(np.array([1, np.nan], np.float32), ["a", "b"]) is None
    assert _trec_order(np.array([1, 1], np.float32), None) is None
