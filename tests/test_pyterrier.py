"""`maxsim_cli.pyterrier`: the reranker and the retriever give the runs of `rerank` / `search` (and so of
`maxsim score`), in PyTerrier's frames, inside `pt.Experiment` too, on the committed sample_data/."""

from __future__ import annotations

import doctest
import importlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pt = pytest.importorskip("pyterrier")
pd = pytest.importorskip("pandas")

from pyterrier.measures import R, nDCG  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from maxsim_cli import MaxsimWarning, Queries, Run, open_corpus, read_queries, rerank, search  # noqa: E402
from maxsim_cli.cli import app  # noqa: E402
from maxsim_cli.errors import InputError, UsageError  # noqa: E402
from maxsim_cli.evaluate import evaluate_run  # noqa: E402
from maxsim_cli.pyterrier import MaxSimReranker, MaxSimRetriever  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "sample_data"
QUERIES = str(SAMPLE / "queries.safetensors")
CANDIDATES = str(SAMPLE / "candidates.trec")
QRELS = str(SAMPLE / "qrels.txt")


@pytest.fixture(scope="module")
def corpus():
    with open_corpus(SAMPLE / "corpus") as c:
        yield c


@pytest.fixture(scope="module")
def queries() -> Queries:
    return read_queries(QUERIES)


@pytest.fixture(scope="module")
def query_embs(queries: Queries) -> dict[str, torch.Tensor]:
    """Each query's [tokens, dim] tensor, as a query encoder would put it in the ``query_embs`` column."""
    offsets = queries.offsets.tolist()
    return {qid: queries.embeddings[offsets[i] : offsets[i + 1]] for i, qid in enumerate(queries.ids)}


@pytest.fixture(scope="module")
def topics() -> pd.DataFrame:
    return pd.read_csv(SAMPLE / "queries.tsv", sep="\t", names=["qid", "query"], dtype=str)


@pytest.fixture(scope="module")
def bm25(topics: pd.DataFrame) -> pd.DataFrame:
    """The first stage as PyTerrier reads it: qid, docno, rank, score, name, plus the query text."""
    return pt.io.read_results(CANDIDATES).merge(topics, on="qid", how="left")


def with_embs(frame: pd.DataFrame, query_embs: dict[str, torch.Tensor]) -> pd.DataFrame:
    return frame.assign(query_embs=[query_embs[q] for q in frame["qid"]])


def as_run(frame: pd.DataFrame) -> Run:
    """A result frame as a `Run`, in the frame's row order."""
    rows: dict[str, list[tuple[str, float]]] = {}
    for qid, docno, score in zip(frame["qid"], frame["docno"], frame["score"], strict=True):
        rows.setdefault(qid, []).append((docno, score))
    return Run(rows)


def assert_same_rows(frame: pd.DataFrame, run: Run) -> None:
    """Same queries in the same order, the same rows in the same order, the same float32 scores, and
    the same ranks, from 0 (`Run.to_dataframe` numbers them as PyTerrier does)."""
    expected = run.to_dataframe()
    assert frame["qid"].tolist() == expected["qid"].tolist()
    assert frame["docno"].tolist() == expected["docno"].tolist()
    assert frame["score"].tolist() == expected["score"].tolist()
    assert (frame["rank"].to_numpy() == expected["rank"].to_numpy()).all()
    assert (frame["rank"].to_numpy() == [r.rank - 1 for r in run]).all()
    assert frame["score"].dtype == np.float64 and frame["rank"].dtype == np.int64


# --------------------------------------------------------------------------------------------------
# the reranker


def test_reranker_gives_the_run_of_rerank_and_of_maxsim_score(corpus, queries, query_embs, bm25, tmp_path):
    expected = rerank(queries, corpus, CANDIDATES, device="cpu")
    from_column = MaxSimReranker(corpus, device="cpu")(with_embs(bm25, query_embs))
    from_shard = MaxSimReranker(corpus, queries=QUERIES, device="cpu")(bm25)
    assert_same_rows(from_column, expected)
    assert_same_rows(from_shard, expected)
    # byte for byte what `maxsim score --candidates` writes
    out = tmp_path / "cli.trec"
    result = CliRunner().invoke(
        app,
        [
            "score",
            QUERIES,
            str(SAMPLE / "corpus"),
            "--candidates",
            CANDIDATES,
            "--device",
            "cpu",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    as_run(from_column).to_trec(tmp_path / "pt.trec")
    assert (tmp_path / "pt.trec").read_bytes() == out.read_bytes()


def test_reranker_carries_the_other_columns_and_orders_queries_as_they_come(corpus, query_embs, bm25):
    picked = bm25[bm25["qid"].isin(["q003", "q001", "q002"])]
    shuffled = picked.sample(frac=1.0, random_state=3)  # rows and queries out of order, index kept
    shuffled = shuffled.assign(feature=np.arange(len(shuffled)) * 0.5)
    out = MaxSimReranker(corpus, device="cpu")(with_embs(shuffled, query_embs))
    order = list(dict.fromkeys(shuffled["qid"]))
    assert list(dict.fromkeys(out["qid"])) == order
    assert list(out.columns) == [*shuffled.columns, "query_embs"]
    assert len(out) == len(shuffled) and list(out.index) == list(range(len(out)))
    # each row kept its own columns (the first stage's score is replaced, its rank too)
    by_key = shuffled.set_index(["qid", "docno"])
    for row in out.itertuples(index=False):
        source = by_key.loc[(row.qid, row.docno)]
        assert (row.query, row.name, row.feature) == (source["query"], source["name"], source["feature"])
        assert row.query_embs is query_embs[row.qid]
    for qid, group in out.groupby("qid", sort=False):
        assert group["rank"].tolist() == list(range(len(group)))
        assert group["score"].is_monotonic_decreasing
        expected = rerank(
            (["x"], [query_embs[qid]]), corpus, {"x": group["docno"].tolist()}, device="cpu"
        ).to_dict()["x"]
        assert list(zip(group["docno"], group["score"], strict=True)) == expected


def test_reranker_breaks_score_ties_by_docno_descending(tmp_path):
    """Documents with the same vectors under different docnos tie; `maxsim score` (and trec_eval) put
    them in docno descending order, whatever order the frame gives them in."""
    from maxsim_cli.shards import write_shard

    rng = np.random.default_rng(5)
    same = rng.standard_normal((3, 8)).astype(np.float32)
    other = rng.standard_normal((2, 8)).astype(np.float32)
    write_shard(tmp_path / "ties.safetensors", ["a", "b", "c", "d"], [same, same, same, other])
    query = rng.standard_normal((2, 8)).astype(np.float32)
    frame = pd.DataFrame({"qid": ["x"] * 4, "docno": ["a", "d", "b", "c"]})
    frame["query_embs"] = [query] * 4
    with open_corpus(tmp_path / "ties.safetensors") as corpus:
        out = MaxSimReranker(corpus, device="cpu")(frame)
        expected = rerank((["x"], [query]), corpus, {"x": ["a", "d", "b", "c"]}, device="cpu")
    assert_same_rows(out, expected)
    tied = out[out["docno"] != "d"]
    assert tied["docno"].tolist() == ["c", "b", "a"] and tied["score"].nunique() == 1


def test_reranker_k_and_rank_cutoff(corpus, query_embs, bm25):
    frame = with_embs(bm25[bm25["qid"].isin(["q001", "q002"])], query_embs)
    full = MaxSimReranker(corpus, device="cpu")(frame)
    top5 = full.groupby("qid", sort=False).head(5).reset_index(drop=True)
    cut = MaxSimReranker(corpus, k=5, device="cpu")(frame)
    pd.testing.assert_frame_equal(cut, top5)
    pipeline = MaxSimReranker(corpus, device="cpu") % 5
    fused = pipeline.compile()
    assert isinstance(fused, MaxSimReranker) and fused.k == 5
    pd.testing.assert_frame_equal(fused(frame), top5)
    assert MaxSimReranker(corpus, k=3).fuse_rank_cutoff(10).k == 3
    for bad in (0, -1, 2.5, True):
        with pytest.raises(UsageError, match="k="):
            MaxSimReranker(corpus, k=bad)


def test_reranker_refuses_unknown_docnos_or_drops_them_when_asked(corpus, query_embs):
    frame = pd.DataFrame({"qid": ["q001", "q001", "q002"], "docno": ["libgprofng0", "no-such-doc", "gcc"]})
    frame = with_embs(frame, query_embs)
    with pytest.raises(InputError) as err:
        MaxSimReranker(corpus, device="cpu")(frame)
    message = str(err.value)
    assert "\n" not in message
    assert "'no-such-doc' of query 'q001'" in message and "strict=False" in message
    with pytest.warns(MaxsimWarning, match="1 of the frame's 3 rows .*'no-such-doc'.*left out"):
        out = MaxSimReranker(corpus, strict=False, device="cpu")(frame)
    assert sorted(out["docno"]) == ["gcc", "libgprofng0"]
    # every row dropped: an empty frame, not an error
    with pytest.warns(MaxsimWarning):
        empty = MaxSimReranker(corpus, strict=False, device="cpu")(frame[frame["docno"] == "no-such-doc"])
    assert len(empty) == 0 and list(empty.columns) == [*frame.columns, "score", "rank"]


def test_reranker_refuses_a_docno_twice_for_a_query(corpus, query_embs):
    frame = with_embs(pd.DataFrame({"qid": ["q001", "q001"], "docno": ["gcc", "gcc"]}), query_embs)
    with pytest.raises(InputError, match="'gcc' appears twice for query 'q001'"):
        MaxSimReranker(corpus, device="cpu")(frame)


# --------------------------------------------------------------------------------------------------
# query embeddings: the column or a query shard


def test_query_embs_as_arrays_tensors_and_copies_give_the_same_scores(corpus, query_embs, bm25):
    frame = bm25[bm25["qid"].isin(["q004", "q005"])].reset_index(drop=True)
    expected = MaxSimReranker(corpus, queries=QUERIES, device="cpu")(frame)
    variants = {
        "tensors": [query_embs[q] for q in frame["qid"]],
        "numpy": [query_embs[q].numpy() for q in frame["qid"]],
        "a copy per row": [query_embs[q].clone() for q in frame["qid"]],
    }
    for name, column in variants.items():
        out = MaxSimReranker(corpus, device="cpu")(frame.assign(query_embs=column))
        assert out["score"].tolist() == expected["score"].tolist(), name
        assert out["docno"].tolist() == expected["docno"].tolist(), name


def test_queries_from_a_queries_object_and_the_column_ignored(corpus, queries, query_embs, bm25):
    frame = bm25[bm25["qid"] == "q006"]
    expected = MaxSimReranker(corpus, device="cpu")(with_embs(frame, query_embs))
    # queries= wins over a query_embs column, which is carried untouched
    wrong = frame.assign(query_embs=[query_embs["q001"]] * len(frame))
    out = MaxSimReranker(corpus, queries=queries, device="cpu")(wrong)
    assert out["score"].tolist() == expected["score"].tolist()
    assert all(e is query_embs["q001"] for e in out["query_embs"])


def test_bad_query_embs_are_one_line_errors(corpus, query_embs):
    base = pd.DataFrame({"qid": ["q001", "q001"], "docno": ["gcc", "bash"]})
    cases = {
        "different embeddings in different rows": [query_embs["q001"], query_embs["q002"]],
        "row 1 .query 'q001'. holds NoneType": [query_embs["q001"], None],
        r"query 'q001' \(index 0\) has shape \(384,\)": [query_embs["q001"][0], query_embs["q001"][0]],
        "queries have dim 100 but the corpus": [query_embs["q001"][:, :100]] * 2,
    }
    for pattern, column in cases.items():
        with pytest.raises(InputError, match=pattern) as err:
            MaxSimReranker(corpus, device="cpu")(base.assign(query_embs=column))
        assert "\n" not in str(err.value)


def test_missing_columns_and_queries_are_refused(corpus):
    frame = pd.DataFrame({"qid": ["q001"], "docno": ["gcc"]})
    with pytest.raises(pt.validate.InputValidationError, match="query_embs"):
        MaxSimReranker(corpus, device="cpu")(frame)
    with pytest.raises(pt.validate.InputValidationError, match="docno"):
        MaxSimReranker(corpus, queries=QUERIES, device="cpu")(frame[["qid"]])
    with pytest.raises(InputError, match="has no query 'nope'.*query_embs column"):
        MaxSimReranker(corpus, queries=QUERIES, device="cpu")(frame.assign(qid="nope"))
    with pytest.raises(UsageError, match="queries: got int"):
        MaxSimReranker(corpus, queries=3)
    with pytest.raises(UsageError, match="corpus: got dict"):
        MaxSimRetriever({})


def test_a_corpus_path_is_opened_once(query_embs):
    reranker = MaxSimReranker(str(SAMPLE / "corpus"), device="cpu")
    frame = with_embs(pd.DataFrame({"qid": ["q003"], "docno": ["gcc"]}), query_embs)
    assert reranker(frame)["docno"].tolist() == ["gcc"]
    assert reranker(frame)["docno"].tolist() == ["gcc"]
    reranker.close()


def test_int8_query_shard_keeps_its_scales(tmp_path, corpus, bm25):
    """Queries looked up in a quantized query folder are cut with their per-token scales."""
    from maxsim_cli.quantize import quantize_corpus

    quantize_corpus([QUERIES], tmp_path / "queries-int8", sample_queries=0, device="cpu")
    int8 = read_queries(tmp_path / "queries-int8")
    assert int8.scales is not None
    frame = bm25[bm25["qid"].isin(["q010", "q002"])]
    out = MaxSimReranker(corpus, queries=int8, device="cpu")(frame)
    expected = rerank(int8, corpus, frame[["qid", "docno"]], device="cpu")
    assert_same_rows(out, expected)


def test_an_in_memory_corpus_gives_the_frames_of_its_shards(corpus, query_embs, bm25, topics):
    """The sample corpus's documents as an encoder would hand them over (a list of [len, dim] tensors),
    held in memory: both transformers give the frames they give over the shards."""
    from maxsim_cli import Corpus

    ids, docs = [], []
    for shard in corpus.shards:
        batch = shard.read_docs(0, shard.num_docs)
        ids += batch.ids
        docs += list(torch.split(batch.embeddings, batch.lengths().tolist()))
    frame = with_embs(bm25[bm25["qid"].isin(["q001", "q002", "q077"])], query_embs)
    asked = with_embs(topics[topics["qid"].isin(["q150", "q002"])], query_embs)
    with Corpus.from_embeddings(ids, docs) as in_memory:
        for transformer, inp in (
            (lambda c: MaxSimReranker(c, device="cpu"), frame),
            (lambda c: MaxSimRetriever(c, k=10, device="cpu"), asked),
        ):
            got, expected = transformer(in_memory)(inp), transformer(corpus)(inp)
            assert got[["qid", "docno", "rank", "score"]].equals(expected[["qid", "docno", "rank", "score"]])
        unknown = with_embs(pd.DataFrame({"qid": ["q001"], "docno": ["no-such-doc"]}), query_embs)
        with pytest.raises(InputError, match="not in the corpus .corpus., e.g. 'no-such-doc'"):
            MaxSimReranker(in_memory, device="cpu")(unknown)


# --------------------------------------------------------------------------------------------------
# the retriever


def test_retriever_gives_the_run_of_search(corpus, queries, query_embs, topics):
    expected = search(queries, corpus, k=20, device="cpu")
    from_shard = MaxSimRetriever(corpus, queries=QUERIES, k=20, device="cpu")(topics)
    from_column = MaxSimRetriever(corpus, k=20, device="cpu")(with_embs(topics, query_embs))
    assert_same_rows(from_shard, expected)
    assert_same_rows(from_column, expected)
    assert list(from_shard.columns) == ["qid", "docno", "rank", "score", "query"]
    assert list(from_column.columns) == ["qid", "docno", "rank", "score", "query", "query_embs"]
    text = dict(zip(topics["qid"], topics["query"], strict=True))
    assert (from_shard["query"] == from_shard["qid"].map(text)).all()


def test_retriever_keeps_the_frames_query_order_and_k(corpus):
    frame = pd.DataFrame({"qid": ["q150", "q002", "q077"], "query": ["x", "y", "z"]})
    out = MaxSimRetriever(corpus, queries=QUERIES, k=3, device="cpu")(frame)
    assert out["qid"].tolist() == ["q150"] * 3 + ["q002"] * 3 + ["q077"] * 3
    assert out["rank"].tolist() == [0, 1, 2] * 3
    fused = (MaxSimRetriever(corpus, queries=QUERIES, k=50, device="cpu") % 3).compile()
    assert isinstance(fused, MaxSimRetriever) and fused.k == 3
    pd.testing.assert_frame_equal(fused(frame), out)
    whole = MaxSimRetriever(corpus, queries=QUERIES, k=10_000, device="cpu")(frame.head(1))
    assert len(whole) == len(corpus)


def test_retriever_refuses_bad_input(corpus):
    with pytest.raises(InputError, match="query 'q001' appears in rows 0 and 1"):
        MaxSimRetriever(corpus, queries=QUERIES, device="cpu")(pd.DataFrame({"qid": ["q001", "q001"]}))
    with pytest.raises(pt.validate.InputValidationError):
        MaxSimRetriever(corpus, queries=QUERIES, device="cpu")(
            pd.DataFrame({"qid": ["q001"], "docno": ["x"]})
        )
    with pytest.raises(pt.validate.InputValidationError, match="query_embs"):
        MaxSimRetriever(corpus, device="cpu")(pd.DataFrame({"qid": ["q001"]}))
    for bad in (0, None, 1.0):
        with pytest.raises(UsageError, match="k="):
            MaxSimRetriever(corpus, queries=QUERIES, k=bad)


# --------------------------------------------------------------------------------------------------
# empty frames, inspection


def test_empty_frames_in_give_empty_frames_out(corpus):
    result_columns = ["qid", "query", "docno", "score", "rank", "query_embs"]
    out = MaxSimReranker(corpus, device="cpu")(pd.DataFrame(columns=result_columns))
    assert len(out) == 0 and list(out.columns) == result_columns
    assert out["score"].dtype == np.float64 and out["rank"].dtype == np.int64
    out = MaxSimReranker(corpus, queries=QUERIES, device="cpu")(pd.DataFrame(columns=["qid", "docno"]))
    assert list(out.columns) == ["qid", "docno", "score", "rank"]
    out = MaxSimRetriever(corpus, queries=QUERIES, device="cpu")(pd.DataFrame(columns=["qid", "query"]))
    assert len(out) == 0 and list(out.columns) == ["qid", "docno", "rank", "score", "query"]
    assert out["rank"].dtype == np.int64 and out["score"].dtype == np.float64


def test_pyterrier_can_inspect_them(corpus):
    retriever = MaxSimRetriever(corpus, queries=QUERIES, device="cpu")
    reranker = MaxSimReranker(corpus, device="cpu")
    assert pt.inspect.transformer_outputs(retriever, ["qid", "query"]) == [
        "qid",
        "docno",
        "rank",
        "score",
        "query",
    ]
    assert pt.inspect.transformer_inputs(reranker) == [["qid", "docno", "query_embs"]]
    assert pt.inspect.transformer_outputs(reranker, ["qid", "docno", "query_embs"]) == [
        "qid",
        "docno",
        "query_embs",
        "score",
        "rank",
    ]


# --------------------------------------------------------------------------------------------------
# pt.Experiment


def test_experiment_gives_the_ndcg_of_maxsim_eval(corpus, queries, bm25, topics, tmp_path):
    qrels = pt.io.read_qrels(QRELS)
    source = pt.Transformer.from_df(bm25)
    systems = [
        bm25,
        source >> MaxSimReranker(corpus, queries=QUERIES, device="cpu"),
        MaxSimRetriever(corpus, queries=QUERIES, k=100, device="cpu"),
    ]
    measures = ["nDCG@10", "R@100"]
    # PyTerrier's measure strings are trec_eval's names (ndcg_cut_10); ir_measures objects name themselves
    table = pt.Experiment(
        systems, topics, qrels, eval_metrics=[nDCG @ 10, R @ 100], names=["bm25", "rerank", "search"]
    )
    rerank(queries, corpus, CANDIDATES, device="cpu").to_trec(tmp_path / "rerank.trec")
    search(queries, corpus, k=100, device="cpu").to_trec(tmp_path / "search.trec")
    runs = {"bm25": CANDIDATES, "rerank": tmp_path / "rerank.trec", "search": tmp_path / "search.trec"}
    for name, path in runs.items():
        expected = evaluate_run(path, QRELS, measures).values
        row = table.set_index("name").loc[name]
        for measure in measures:
            assert row[measure] == pytest.approx(expected[measure], abs=1e-12), (name, measure)
    # the figures sample_data/README.md states
    assert round(table.set_index("name").loc["rerank", "nDCG@10"], 3) == 0.555
    assert not pt.java.started()  # nothing here needs Java


def test_experiment_validates_through_empty_frames_and_runs_a_pipeline(corpus, bm25, topics):
    """``validate="error"``: PyTerrier sends empty frames through each system to learn its columns. A query
    without candidates is simply absent from the run (it scores 0)."""
    qrels = pt.io.read_qrels(QRELS)
    few = topics[topics["qid"].isin(["q001", "q002", "q003"])]
    first_stage = bm25[bm25["qid"].isin(["q001", "q003"])]  # q002 has no candidates
    systems = [
        pt.Transformer.from_df(first_stage) >> MaxSimReranker(corpus, queries=QUERIES, device="cpu"),
        MaxSimRetriever(corpus, queries=QUERIES, k=20, device="cpu")
        >> MaxSimReranker(corpus, queries=QUERIES, k=10, device="cpu"),
    ]
    table = pt.Experiment(
        systems,
        few,
        qrels,
        eval_metrics=[nDCG @ 10],
        perquery=True,
        names=["rerank", "pipeline"],
        validate="error",
    )
    assert set(table["qid"]) == {"q001", "q002", "q003"}
    assert set(table[(table["name"] == "rerank") & (table["value"] == 0)]["qid"]) >= {"q002"}
    # the exact top 20 re-scored and cut to 10 is the exact top 10
    top10 = search(QUERIES, corpus, k=10, device="cpu").to_dict()
    assert_same_rows(systems[1](few), Run({qid: top10[qid] for qid in few["qid"]}))


# --------------------------------------------------------------------------------------------------
# the module itself


def test_docstring_examples(monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    result = doctest.testmod(importlib.import_module("maxsim_cli.pyterrier"), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_without_pyterrier_the_import_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pyterrier", None)  # an import of it fails, as when not installed
    monkeypatch.delitem(sys.modules, "maxsim_cli.pyterrier")
    with pytest.raises(ImportError) as err:
        importlib.import_module("maxsim_cli.pyterrier")
    assert str(err.value) == (
        "maxsim_cli.pyterrier needs PyTerrier and pandas; install them with: pip install 'maxsim[pyterrier]'"
    )


def test_the_command_line_does_not_import_pyterrier() -> None:
    """``maxsim --help`` (and the CLI module) stay free of PyTerrier and pandas."""
    import subprocess

    code = (
        "import sys\n"
        "from maxsim_cli.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print([m for m in ('pyterrier', 'pandas', 'maxsim_cli.pyterrier') if m in sys.modules])"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
