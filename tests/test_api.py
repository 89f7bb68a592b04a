"""The Python API (`maxsim_cli.api`): the same runs as the command line, from files and from memory.

Corpora and queries are fresh random *dyadic* values (see tests/test_score.py): every score is exact in
float32, so runs are compared byte for byte and ties (many) exercise the docno-descending tie-break.
"""

from __future__ import annotations

import doctest
import os

import numpy as np
import pytest
import torch
from test_score import DIM, make_corpus, make_queries, reference_run, reference_scores
from typer.testing import CliRunner

import maxsim_cli
from maxsim_cli import Queries, Run, open_corpus, read_queries, rerank, search
from maxsim_cli.cli import app
from maxsim_cli.errors import InputError, MaxsimError, UsageError
from maxsim_cli.shards import write_shard

runner = CliRunner()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A ragged fp16 corpus over three shards (safetensors, Arrow, safetensors) and eight queries."""
    root = tmp_path_factory.mktemp("api")
    paths, docs = make_corpus(root / "corpus", seed=7)
    queries = make_queries(root / "queries.safetensors", n=8, seed=11)
    return {
        "root": root,
        "corpus": str(root / "corpus"),
        "queries_path": str(root / "queries.safetensors"),
        "queries": queries,
        "ref": reference_scores(queries, docs),
    }


def cli_run(tmp_path, *args: str) -> bytes:
    out = tmp_path / "cli.trec"
    result = runner.invoke(app, ["score", *args, "--device", "cpu", "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out.read_bytes()


def trec_bytes(run: Run, tmp_path, name: str = "api.trec") -> bytes:
    run.to_trec(tmp_path / name)
    return (tmp_path / name).read_bytes()


# --------------------------------------------------------------------------------------------------
# search


def test_search_from_files_writes_the_bytes_of_maxsim_score(data, tmp_path) -> None:
    run = search(data["queries_path"], data["corpus"], k=7, device="cpu")
    assert trec_bytes(run, tmp_path) == cli_run(tmp_path, data["queries_path"], data["corpus"], "-k", "7")
    assert run.to_dict() == reference_run(data["ref"], 7)
    assert run.qids == [f"q{i}" for i in range(8)]
    assert run.stats is not None and run.stats.mode == "exhaustive"


def test_search_from_memory_lists_padded_and_ids_gives_the_same_run(data, tmp_path) -> None:
    qids = list(data["queries"])
    embs = [data["queries"][q].to(torch.float16) for q in qids]
    expected = trec_bytes(search(data["queries_path"], data["corpus"], k=5, device="cpu"), tmp_path, "a")
    # a list of [len, dim] tensors (PyLate), as numpy arrays too, and as an (ids, embeddings) pair
    for queries in (
        Queries.from_embeddings(qids, embs),
        Queries.from_embeddings(qids, [e.numpy() for e in embs]),
        (qids, embs),
    ):
        assert trec_bytes(search(queries, data["corpus"], k=5, device="cpu"), tmp_path, "b") == expected
    # a padded [n, L, dim] tensor with a mask (colpali-engine); the padding rows hold garbage that the
    # mask must exclude exactly
    longest = max(e.shape[0] for e in embs)
    padded = torch.full((len(embs), longest, DIM), 7.0, dtype=torch.float16)
    mask = torch.zeros(len(embs), longest, dtype=torch.bool)
    for i, e in enumerate(embs):
        padded[i, : e.shape[0]] = e
        mask[i, : e.shape[0]] = True
    q = Queries.from_embeddings(qids, padded, mask)
    assert q.offsets.tolist()[-1] == sum(e.shape[0] for e in embs)
    assert trec_bytes(search(q, data["corpus"], k=5, device="cpu"), tmp_path, "c") == expected


def test_int_ids_become_strings_and_float64_is_scored_as_float32(data) -> None:
    embs = [data["queries"][q].numpy() for q in data["queries"]]  # float64
    q = Queries.from_embeddings(list(range(8)), embs)
    assert q.ids == [str(i) for i in range(8)] and q.dtype == "float32"
    run = search(q, data["corpus"], k=3, device="cpu")
    expected = reference_run(data["ref"], 3)
    assert run.to_dict() == {str(i): expected[f"q{i}"] for i in range(8)}


def test_search_takes_an_open_corpus_and_leaves_it_open(data) -> None:
    with open_corpus(data["corpus"]) as corpus:
        first = search(data["queries_path"], corpus, k=4, device="cpu")
        second = search(data["queries_path"], corpus, k=4, device="cpu")
        assert first == second
        assert len(corpus) == 75 and corpus.dim == DIM and corpus.dtype == "float16"
        assert sorted(corpus.ids) == sorted(data["ref"]["q0"])


# --------------------------------------------------------------------------------------------------
# rerank


def _candidates(data, tmp_path) -> tuple[str, dict[str, list[str]]]:
    gen = np.random.default_rng(3)
    docnos = sorted(next(iter(data["ref"].values())))
    cands = {q: list(gen.choice(docnos, size=12, replace=False)) for q in data["queries"] if q != "q3"}
    cands["q5"].append("not-in-corpus")
    path = tmp_path / "cands.trec"
    with open(path, "w") as f:
        for q, ds in cands.items():
            for rank, d in enumerate(ds):
                f.write(f"{q} Q0 {d} {rank} {-rank} bm25\n")
    return str(path), cands


def test_rerank_every_candidate_form_gives_the_bytes_of_maxsim_score(data, tmp_path) -> None:
    pd = pytest.importorskip("pandas")
    path, cands = _candidates(data, tmp_path)
    expected = cli_run(tmp_path, data["queries_path"], data["corpus"], "--candidates", path, "-k", "10")
    frame = pd.DataFrame([(q, d) for q, ds in cands.items() for d in ds], columns=["qid", "docno"])
    for candidates in (path, cands, Run.read(path), frame):
        with pytest.warns(maxsim_cli.MaxsimWarning, match="1 candidates are not in the corpus"):
            run = rerank(data["queries_path"], data["corpus"], candidates, k=10, device="cpu")
        assert trec_bytes(run, tmp_path) == expected
        assert "q3" not in run and run.stats.missing_candidates == 1


def test_rerank_scores_equal_float64_and_strict_refuses_missing(data, tmp_path) -> None:
    path, cands = _candidates(data, tmp_path)
    with pytest.warns(maxsim_cli.MaxsimWarning):
        run = rerank(data["queries_path"], data["corpus"], path, device="cpu")
    exact = {q: {d: data["ref"][q][d] for d in ds if d in data["ref"][q]} for q, ds in cands.items()}
    assert run.to_dict() == reference_run(exact, 100)
    with pytest.raises(InputError, match="not in the corpus"):
        rerank(data["queries_path"], data["corpus"], path, strict=True, device="cpu")
    with pytest.raises(InputError, match="appears twice"):
        rerank(data["queries_path"], data["corpus"], {"q1": ["a", "a"]}, device="cpu")


# --------------------------------------------------------------------------------------------------
# Run


def test_run_rows_dict_dataframe_and_read_back(data, tmp_path) -> None:
    pd = pytest.importorskip("pandas")
    run = search(data["queries_path"], data["corpus"], k=6, device="cpu")
    rows = list(run)
    assert len(rows) == len(run) == 48
    assert rows[0].rank == 1 and rows[5].rank == 6 and rows[6].qid == "q1"
    frame = run.to_dataframe()
    assert list(frame.columns) == ["qid", "docno", "rank", "score"] and len(frame) == 48
    # PyTerrier's ranks, from 0; the rows and the TREC file count from 1
    assert frame["rank"].tolist()[:7] == [0, 1, 2, 3, 4, 5, 0]
    assert [tuple(r) for r in frame.itertuples(index=False)] == [r._replace(rank=r.rank - 1) for r in rows]
    path = tmp_path / "run.trec"
    run.to_trec(path)
    again = Run.read(path)
    assert again == run and trec_bytes(again, tmp_path, "again.trec") == path.read_bytes()
    assert run["q2"] == run.to_dict()["q2"] and "nope" not in run and "q7" in run
    with pytest.raises(KeyError):
        run["nope"]
    assert isinstance(pd.DataFrame, type)


def test_the_package_exports_the_api() -> None:
    from maxsim_cli import api

    assert set(maxsim_cli._API) == set(api.__all__)
    assert all(getattr(maxsim_cli, name) is getattr(api, name) for name in api.__all__)


def test_empty_run_and_tag(tmp_path) -> None:
    assert len(Run()) == 0 and Run().to_dataframe().empty
    Run({"q": [("d", 1.0)]}).to_trec(tmp_path / "r", tag="mine")
    assert (tmp_path / "r").read_text() == "q Q0 d 1 1 mine\n"


# --------------------------------------------------------------------------------------------------
# queries: folders and bad input


def test_read_queries_from_a_folder_of_query_shards(data, tmp_path) -> None:
    qids = list(data["queries"])
    folder = tmp_path / "queries"
    folder.mkdir()
    write_shard(str(folder / "a.safetensors"), qids[:3], [data["queries"][q].half() for q in qids[:3]])
    write_shard(str(folder / "b.arrow"), qids[3:], [data["queries"][q].half() for q in qids[3:]])
    q = read_queries(folder)
    assert q.ids == qids and len(q) == 8
    expected = search(data["queries_path"], data["corpus"], k=5, device="cpu")
    assert search(q, data["corpus"], k=5, device="cpu") == expected


@pytest.mark.parametrize(
    "ids, embeddings, mask, message",
    [
        (["a", "b"], [np.ones((2, 4))], None, "2 ids but 1 embedding arrays"),
        (["a", "a"], [np.ones((2, 4)), np.ones((1, 4))], None, "duplicate query id 'a'"),
        (["a b"], [np.ones((2, 4))], None, "contains whitespace"),
        ([""], [np.ones((2, 4))], None, "empty query id"),
        ([1.5], [np.ones((2, 4))], None, "ids must be str or int"),
        (["a"], [np.ones((0, 4))], None, "has no tokens"),
        (["a", "b"], [np.ones((2, 4)), np.ones((2, 5))], None, "has vectors of 5 values"),
        (["a"], [np.array([[1.0, np.nan, 0, 0]])], None, "NaN or Inf values at token 0"),
        (["a"], np.ones((1, 3, 4)), np.ones((1, 2)), "mask has shape"),
        (["a"], np.ones((1, 3, 4)), np.zeros((1, 3)), "has no tokens"),
        (["a"], np.ones((3, 4)), None, "pass a list of"),
        (["a"], [np.ones((2, 4), dtype=np.int8)], None, "int8 query embeddings"),
    ],
)
def test_bad_in_memory_queries_raise_one_line_input_errors(ids, embeddings, mask, message) -> None:
    with pytest.raises(InputError, match=message) as info:
        Queries.from_embeddings(ids, embeddings, mask)
    assert "\n" not in str(info.value) and str(info.value).startswith("queries: ")


def test_dim_mismatch_and_bad_options(data) -> None:
    wrong = Queries.from_embeddings(["a"], [np.ones((2, DIM + 1), np.float32)])
    with pytest.raises(InputError, match=f"queries have dim {DIM + 1} but the corpus"):
        search(wrong, data["corpus"], device="cpu")
    with pytest.raises(UsageError):
        search(data["queries_path"], data["corpus"], k=0, device="cpu")
    with pytest.raises(UsageError):
        search(data["queries_path"], data["corpus"], device="tpu")
    with pytest.raises(UsageError):
        search(42, data["corpus"], device="cpu")


# --------------------------------------------------------------------------------------------------
# residency


def test_resident_corpus_on_cpu_gives_the_streamed_run(data, tmp_path) -> None:
    streamed = search(data["queries_path"], data["corpus"], k=9, device="cpu")
    path, cands = _candidates(data, tmp_path)
    with pytest.warns(maxsim_cli.MaxsimWarning):
        reranked = rerank(data["queries_path"], data["corpus"], path, device="cpu")
    with open_corpus(data["corpus"]) as corpus:
        assert corpus.to("cpu") is corpus and corpus.device == "cpu"
        for _ in range(2):
            run = search(data["queries_path"], corpus, k=9)  # device auto: the corpus's
            assert run == streamed and run.stats.extra.get("resident_corpus") is True
            with pytest.warns(maxsim_cli.MaxsimWarning):
                assert rerank(data["queries_path"], corpus, path) == reranked
            assert run.stats.bytes_read == 0
        corpus.release()
        assert corpus.device is None
        assert search(data["queries_path"], corpus, k=9, device="cpu") == streamed


def test_a_resident_corpus_is_one_buffer_and_one_batch_across_its_shards(data, tmp_path) -> None:
    """The shards of a resident corpus are views of one buffer, so a search is one document batch (one
    launch) across the three shards, its rows one view with offsets sliced from the corpus's own; a
    rerank batch names its candidates as documents of the whole corpus (scored in place); the runs are
    the streamed ones."""
    from maxsim_cli.scoring.pipeline import _ordinals, _resident_rows

    streamed = search(data["queries_path"], data["corpus"], k=9, device="cpu")
    path, _cands = _candidates(data, tmp_path)
    with pytest.warns(maxsim_cli.MaxsimWarning):
        reranked = rerank(data["queries_path"], data["corpus"], path, device="cpu")
    with open_corpus(data["corpus"]) as corpus:
        residency = corpus.to("cpu").residency
        assert len(residency.shards) == 3
        whole = residency.embeddings
        for shard in residency.shards:
            assert shard.embeddings.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
        run = search(data["queries_path"], corpus, k=9)
        assert run == streamed and run.stats.doc_batches == 1
        with pytest.warns(maxsim_cli.MaxsimWarning):
            assert rerank(data["queries_path"], corpus, path) == reranked
        n0, n1 = (len(s.host_offsets) - 1 for s in residency.shards[:2])
        # the last two documents of shard 0, all of shard 1, the first of shard 2: one view
        rows, _scales, offsets, device_offsets = _resident_rows(
            residency, [(0, n0 - 2, n0), (1, 0, n1), (2, 0, 1)]
        )
        assert rows.data_ptr() == whole[int(residency.host_offsets[n0 - 2])].data_ptr()
        first = int(residency.host_offsets[n0 - 2])
        expected = residency.host_offsets[n0 - 2 : n0 + n1 + 2] - first
        assert offsets.tolist() == expected.tolist() == device_offsets.tolist()
        assert rows.shape[0] == int(expected[-1])
        # documents 3 and 1 of shard 2, then document 0 of shard 0, as documents of the whole corpus
        assert _ordinals(residency.doc_base, [(2, np.array([3, 1])), (0, 0, 1)]).tolist() == [
            n0 + n1 + 3,
            n0 + n1 + 1,
            0,
        ]


def test_resident_int8_corpus_gives_the_streamed_run(data, tmp_path) -> None:
    from maxsim_cli.quantize import quantize_corpus

    quantize_corpus([data["corpus"]], tmp_path / "int8", sample_queries=0, device="cpu")
    streamed = search(data["queries_path"], tmp_path / "int8", k=6, device="cpu")
    with open_corpus(tmp_path / "int8") as corpus:
        assert corpus.to("cpu").residency.shards[0].scales is not None
        assert search(data["queries_path"], corpus, k=6) == streamed


@pytest.mark.gpu
@pytest.mark.parametrize("quantized", [False, True])
def test_resident_corpus_on_the_gpu_gives_the_streamed_run(data, tmp_path, quantized) -> None:
    from maxsim_cli.quantize import quantize_corpus

    corpus_path = data["corpus"]
    if quantized:
        quantize_corpus([corpus_path], tmp_path / "int8", sample_queries=0, device="cuda")
        corpus_path = str(tmp_path / "int8")
    path, _cands = _candidates(data, tmp_path)
    streamed = search(data["queries_path"], corpus_path, k=9, device="cuda")
    with pytest.warns(maxsim_cli.MaxsimWarning):
        reranked = rerank(data["queries_path"], corpus_path, path, device="cuda")
    with open_corpus(corpus_path) as corpus:
        corpus.to("cuda")
        assert corpus.device == "cuda:0"
        assert corpus.residency.shards[0].embeddings.is_cuda
        for _ in range(2):
            run = search(data["queries_path"], corpus, k=9)
            assert run == streamed and run.stats.extra["resident_corpus"] is True
            assert run.stats.bytes_read == 0
            with pytest.warns(maxsim_cli.MaxsimWarning):
                assert rerank(data["queries_path"], corpus, path) == reranked
        # a tight memory budget splits the batches, never the result
        assert search(data["queries_path"], corpus, k=9, max_memory="1MiB") == streamed
        # the CPU is another device: the corpus streams there
        on_cpu = search(data["queries_path"], corpus, k=9, device="cpu")
        assert on_cpu.stats.extra["resident_corpus"] is False
        if not quantized:  # fp16 on the CPU sums in another order than the GPU: dyadic values, exact
            assert on_cpu == streamed


@pytest.mark.parametrize("devices", [["cpu", "cpu"], ["cpu", "cpu", "cpu", "cpu", "cpu"]])
def test_corpus_resident_on_several_devices_gives_the_one_device_run(data, tmp_path, devices) -> None:
    """Shards spread over devices (two CPU "devices" here; more devices than shards leaves some idle):
    each device's share is scored in a thread of its own and the top-k merged, the same run."""
    streamed = search(data["queries_path"], data["corpus"], k=9, device="cpu")
    path, _cands = _candidates(data, tmp_path)
    with pytest.warns(maxsim_cli.MaxsimWarning):
        reranked = rerank(data["queries_path"], data["corpus"], path, device="cpu")
    with open_corpus(data["corpus"]) as corpus:
        corpus.to(devices)
        assert corpus.device == "cpu,cpu" if len(devices) == 2 else corpus.device == "cpu,cpu,cpu"
        assert sorted(s for part in corpus.placement for s in part.shards) == [0, 1, 2]
        run = search(data["queries_path"], corpus, k=9)
        assert run == streamed and run.stats.extra["resident_corpus"] is True
        assert trec_bytes(run, tmp_path, "a") == trec_bytes(streamed, tmp_path, "b")
        with pytest.warns(maxsim_cli.MaxsimWarning, match="1 candidates are not in the corpus"):
            assert rerank(data["queries_path"], corpus, path) == reranked
        with pytest.raises(InputError, match="not in the corpus"):
            rerank(data["queries_path"], corpus, path, strict=True)
        corpus.release()
        assert corpus.device is None and corpus.placement is None
        assert search(data["queries_path"], corpus, k=9, device="cpu") == streamed


@pytest.mark.gpu
def test_corpus_resident_on_several_gpus_gives_the_one_device_run(data) -> None:
    """Every GPU of the machine (the one GPU twice when there is one): the same run as streaming."""
    streamed = search(data["queries_path"], data["corpus"], k=9, device="cuda")
    devices = [f"cuda:{i}" for i in range(max(2, torch.cuda.device_count()))]
    devices = [d if int(d[5:]) < torch.cuda.device_count() else "cuda:0" for d in devices]
    with open_corpus(data["corpus"]) as corpus:
        corpus.to(devices)
        assert all(part.corpus.residency.shards[0].embeddings.is_cuda for part in corpus.placement)
        assert search(data["queries_path"], corpus, k=9) == streamed


def test_resident_corpus_that_does_not_fit_says_how_much(data, monkeypatch) -> None:
    from maxsim_cli.shards import resident

    monkeypatch.setattr(resident, "available_bytes", lambda device: 1000)
    with open_corpus(data["corpus"]) as corpus, pytest.raises(MaxsimError) as info:
        corpus.to("cpu")
    message = str(info.value)
    assert "needs" in message and "only 1000 B is free" in message and "\n" not in message
    assert corpus.residency is None
    with open_corpus(data["corpus"]) as corpus:
        with pytest.raises(UsageError, match="no device given"):
            corpus.to([])
        with pytest.raises(UsageError, match="not a device"):
            corpus.to(["cpu", "tpu"])
        assert corpus.residency is None and corpus.placement is None


def test_resident_corpus_refuses_nan_like_every_read(tmp_path) -> None:
    from test_validation import raw_shard

    values = np.ones((6, 4), np.float32)
    values[4, 2] = np.inf  # document d2 holds tokens 3..5: this is its token 1
    path = raw_shard(tmp_path / "s.safetensors", values=values)
    with open_corpus(path) as corpus, pytest.raises(InputError, match="'d2' .index 2. has NaN or Inf"):
        corpus.to("cpu")


# --------------------------------------------------------------------------------------------------
# the examples in the docstrings run


@pytest.mark.parametrize("module", ["maxsim_cli.api", "maxsim_cli.run", "maxsim_cli.queries"])
def test_docstring_examples(module, monkeypatch) -> None:
    import importlib

    monkeypatch.chdir(REPO)
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_readme_python_example_runs(tmp_path, monkeypatch) -> None:
    """The README's "From Python" block, run as written in a fresh folder next to sample_data/, on
    whatever devices this machine has (its `corpus.to` picks one)."""
    import re

    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    section = readme[readme.index("## From Python") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "sample_data").symlink_to(os.path.join(REPO, "sample_data"))
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    assert (tmp_path / "run.trec").stat().st_size > 0
    assert list(namespace["frame"].columns) == ["qid", "docno", "rank", "score"]
    assert namespace["frame"].groupby("qid").size().max() == 10
    assert namespace["frame"]["rank"].min() == 0  # PyTerrier's ranks
    assert namespace["corpus"].device is not None  # resident, wherever this machine could hold it
    assert namespace["run"].qids == ["q1", "q2"]


# --------------------------------------------------------------------------------------------------
# the API guards what the command line guards


def _one_line(info: pytest.ExceptionInfo) -> str:
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_to_trec_refuses_to_overwrite_the_runs_inputs(data, tmp_path) -> None:
    """`maxsim score -o` refuses to write over its inputs (exit 2); `Run.to_trec` refuses the same."""
    import shutil

    from maxsim_cli.shards import write_manifest

    corpus = tmp_path / "corpus"
    shutil.copytree(data["corpus"], corpus)
    write_manifest(corpus)
    queries = tmp_path / "queries.safetensors"
    shutil.copy(data["queries_path"], queries)
    cands, _ = _candidates(data, tmp_path)
    inputs = [queries, corpus / "index.json", corpus / "shard1.arrow", cands]
    before = {str(p): open(p, "rb").read() for p in inputs}
    with pytest.warns(maxsim_cli.MaxsimWarning):
        runs = [
            search(str(queries), str(corpus), k=3, device="cpu"),
            rerank(str(queries), str(corpus), cands, device="cpu"),
        ]
    for run in runs:
        for target in inputs:
            if target == cands and run is runs[0]:
                continue  # a search has no candidates file
            with pytest.raises(UsageError, match="is (the input|.*a file of the input folder)") as info:
                run.to_trec(target)
            assert _one_line(info).startswith(f"path={str(target)!r}: ")
    assert {str(p): open(p, "rb").read() for p in inputs} == before
    runs[1].to_trec(tmp_path / "fine.trec")  # anywhere else is fine
    assert (tmp_path / "fine.trec").stat().st_size > 0
    # the command line names its option, as before
    result = runner.invoke(app, ["score", str(queries), str(corpus), "--device", "cpu", "-o", str(queries)])
    assert result.exit_code == 2 and f"-o {queries}: is the input" in result.stderr


@pytest.mark.parametrize(
    "embedding, dtype",
    [
        (np.array([[1.0, 2.0]], dtype=object), "object"),
        (np.array([["a", "b"]]), "<U1"),
        (np.ones((1, 2), np.complex64), "complex64"),
        (torch.ones((1, 2), dtype=torch.complex64), "torch.complex64"),
        ([[1.0, 2.0], [3.0]], None),  # ragged: not an array
    ],
)
def test_in_memory_queries_that_are_not_numbers_are_input_errors(embedding, dtype) -> None:
    with pytest.raises(InputError) as info:
        Queries.from_embeddings(["q1", "q2"], [np.ones((1, 2), np.float32), embedding])
    message = _one_line(info)
    assert message.startswith("queries: query 'q2' (index 1): ") and "numbers" in message
    if dtype is not None:
        assert f"dtype {dtype} is not a real-number type" in message


@pytest.mark.parametrize("k", [2.5, True, "5", 0, -3])
def test_counts_must_be_whole_numbers_of_at_least_one(data, k) -> None:
    for call in (
        lambda: search(data["queries_path"], data["corpus"], k=k, device="cpu"),
        lambda: rerank(data["queries_path"], data["corpus"], {"q1": ["doc001"]}, k=k, device="cpu"),
        lambda: search(data["queries_path"], data["corpus"], batch_queries=k, device="cpu"),
    ):
        with pytest.raises(UsageError) as info:
            call()
        message = _one_line(info)
        assert message.startswith((f"k={k!r}: ", f"batch_queries={k!r}: ")) and "at least 1" in message


def test_an_arrow_shard_deleted_after_opening_is_an_input_error(tmp_path) -> None:
    """As for safetensors: one line naming the shard, not a bare FileNotFoundError."""
    ids = [f"d{i}" for i in range(4)]
    docs = [np.full((2, DIM), 0.5, np.float32) for _ in ids]
    for name in ("c.arrow", "c.safetensors"):
        path = tmp_path / name
        write_shard(str(path), ids, docs)
        with open_corpus(path) as corpus:
            path.unlink()
            with pytest.raises(InputError) as info:
                search((["q"], [np.ones((1, DIM), np.float32)]), corpus, k=2, device="cpu")
            message = _one_line(info)
            assert message.startswith(f"{path}: cannot ") and "read values: " in message
            assert "No such file" in message


# --------------------------------------------------------------------------------------------------
# bugs a new user met


def test_a_numpy_boolean_mask_is_a_mask(data) -> None:
    qids = list(data["queries"])[:3]
    embs = [data["queries"][q].to(torch.float32) for q in qids]
    longest = max(e.shape[0] for e in embs)
    padded = np.full((3, longest, DIM), 7.0, np.float32)
    mask = np.zeros((3, longest), dtype=bool)
    for i, e in enumerate(embs):
        padded[i, : e.shape[0]] = e.numpy()
        mask[i, : e.shape[0]] = True
    expected = Queries.from_embeddings(qids, embs)
    for queries in (
        Queries.from_embeddings(qids, padded, mask),  # padded, with its [n, L] mask
        Queries.from_embeddings(qids, list(padded), list(mask)),  # one [L] mask per query
    ):
        assert torch.equal(queries.embeddings, expected.embeddings) and queries.offsets.tolist() == (
            expected.offsets.tolist()
        )
    with pytest.raises(InputError, match=r"^queries: mask holds 2; a mask holds True/1"):
        Queries.from_embeddings(qids, padded, mask.astype(np.int64) * 2)


def test_a_nan_in_a_query_is_called_a_query() -> None:
    bad = np.ones((2, 4), np.float32)
    bad[1, 3] = np.nan
    with pytest.raises(InputError) as info:
        Queries.from_embeddings(["qa", "qx"], [np.ones((1, 4), np.float32), bad])
    assert _one_line(info) == (
        "queries: query 'qx' (index 1) has NaN or Inf values at token 1; re-encode or drop that query"
    )


def test_an_empty_query_set_warns_and_gives_an_empty_run(data) -> None:
    for empty in (Queries.from_embeddings([], []), ([], [])):
        with pytest.warns(maxsim_cli.MaxsimWarning, match=r"^queries: holds no queries; the run is empty"):
            run = search(empty, data["corpus"], k=3, device="cpu")
        assert len(run) == 0 and run.qids == []
    with pytest.raises(InputError, match=r"^queries: holds no queries; .* leave out strict=True$"):
        search(([], []), data["corpus"], strict=True, device="cpu")


def test_a_string_where_a_list_of_docnos_belongs_is_an_error(data) -> None:
    for rows in ("doc001", b"doc001", 7):
        with pytest.raises(InputError) as info:
            rerank(data["queries_path"], data["corpus"], {"q1": rows}, device="cpu")
        assert _one_line(info).startswith(
            f"candidates: query 'q1' has {rows!r} where a list of docnos belongs"
        )


# --------------------------------------------------------------------------------------------------
# the API speaks Python


def test_errors_and_warnings_name_the_apis_arguments(data, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    q, c = data["queries_path"], data["corpus"]
    cases = [
        (lambda: search(q, c, k=0, device="cpu"), "k=0: must be at least 1"),
        (lambda: rerank(q, c, {"q1": ["doc001"]}, k=0, device="cpu"), "k=0: must be at least 1"),
        (
            lambda: search(q, c, device="cuda"),
            "device='cuda': no CUDA device is available here; use device='cpu'",
        ),
        (lambda: search(q, c, device="tpu"), "device='tpu': not a device; use auto, cpu, cuda or cuda:N"),
        (lambda: search(q, c, device=None), "device=None: not a device; use auto, cpu, cuda or cuda:N"),
        (lambda: search(q, c, backend="jax", device="cpu"), "backend='jax': use auto, triton or torch"),
        (lambda: search(q, c, max_memory="lots", device="cpu"), "max_memory: invalid size 'lots'"),
        (
            lambda: opened.to("cuda"),
            "device='cuda': no CUDA device is available here; use device='cpu'",
        ),
    ]
    with open_corpus(c) as opened:
        for call, message in cases:
            with pytest.raises(UsageError) as info:
                call()
            assert _one_line(info).startswith(message) and "--" not in str(info.value)
    path, _ = _candidates(data, tmp_path)
    with pytest.warns(maxsim_cli.MaxsimWarning) as warned:
        rerank(q, c, path, device="cpu")
    assert "(strict=True makes this an error)" in str(warned[0].message)
    with pytest.raises(InputError, match=r"or drop strict=True to skip them$"):
        rerank(q, c, path, strict=True, device="cpu")
    # the same vocabulary, rendered as flags by the command line
    result = runner.invoke(app, ["score", q, c, "--device", "cuda", "-o", str(tmp_path / "r.trec")])
    assert result.exit_code == 2
    assert "--device cuda: no CUDA device is available here; use --device cpu" in result.stderr
    result = runner.invoke(app, ["score", q, c, "--device", "cpu", "--candidates", path, "-q"])
    assert "(--strict makes this an error)" in result.stderr


def test_search_and_rerank_take_the_same_keywords() -> None:
    import inspect

    def keywords(func) -> dict[str, object]:
        params = inspect.signature(func).parameters.values()
        return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}

    searching, reranking = keywords(search), keywords(rerank)
    # search alone: its query batches and the two-stage search (a compressed corpus, exact scores)
    assert set(searching) - {"batch_queries", "exact_from", "depth"} == set(reranking)
    assert {name: searching[name] for name in reranking if name != "k"} == {
        name: default for name, default in reranking.items() if name != "k"
    }


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda: Queries.from_embeddings(["q0", "q1"], 0.5), id="scalar-embeddings"),
        pytest.param(
            lambda: Queries.from_embeddings(["q0"], [torch.ones(2, 8, device="meta")]), id="meta-tensor"
        ),
        pytest.param(
            lambda: Queries.from_embeddings(
                ["q0", "q1"], [np.ones((2, 8)), np.ones((3, 8))], mask=[None, None]
            ),
            id="mask-of-none",
        ),
        pytest.param(
            lambda: Queries.from_embeddings(
                ["q0", "q1"], np.ones((2, 3, 8), np.float32), mask=[[1, 1, 0], [1, 0]]
            ),
            id="ragged-padded-mask",
        ),
        pytest.param(
            lambda: Queries.from_embeddings(["q0"], [np.ones((2, 8))], mask=7), id="scalar-mask-for-a-list"
        ),
    ],
)
def test_odd_query_inputs_are_one_line_input_errors(call) -> None:
    with pytest.raises(InputError) as info:
        call()
    assert "\n" not in str(info.value)


def test_a_candidate_score_that_is_not_a_number_is_an_input_error(tmp_path) -> None:
    path = tmp_path / "c.safetensors"
    write_shard(path, ["d1", "d2"], [np.ones((2, 8), np.float32), np.ones((1, 8), np.float32)])
    queries = Queries.from_embeddings(["q"], [np.ones((2, 8), np.float32)])
    with pytest.raises(InputError, match="'high', not a number") as info:
        rerank(queries, str(path), {"q": [("d1", "high"), ("d2", 1.0)]}, device="cpu")
    assert "\n" not in str(info.value)

