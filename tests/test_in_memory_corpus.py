"""`Corpus.from_embeddings`: a corpus held in memory, scored as the shards written from the same embeddings
are (runs compared byte for byte), checked by the writer's rules with the writer's messages, through
`search`, `rerank`, `Corpus.to` and `maxsim serve` (its app, and `serve` from Python).

Values are random *dyadic* numbers (as in tests/test_score.py): every score is exact in float32, and
the many ties exercise the docno-descending tie-break.
"""

from __future__ import annotations

import os
import threading
import time
import warnings

import numpy as np
import pytest
import torch
from test_score import DIM

import maxsim_cli
from maxsim_cli import Corpus, MaxsimWarning, Queries, Run, open_corpus, rerank, search
from maxsim_cli.errors import InputError, MaxsimError, UsageError
from maxsim_cli.shards import write_shard

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def dyadic(gen: torch.Generator, rows: int, dim: int = DIM) -> torch.Tensor:
    """Values k/8 for k in -8..8: exact in every float dtype, products and sums exact in float32."""
    return torch.randint(-8, 9, (rows, dim), generator=gen).to(torch.float32) / 8


def documents(n: int = 40, seed: int = 0) -> tuple[list[str], list[torch.Tensor]]:
    """Ragged documents (1 to 8 tokens) with shuffled ids, so that id order and corpus order differ."""
    gen = torch.Generator().manual_seed(seed)
    ids = [f"doc{int(i):03d}" for i in torch.randperm(n, generator=gen)]
    return ids, [dyadic(gen, int(torch.randint(1, 9, (1,), generator=gen))) for _ in ids]


def queries(n: int = 5, seed: int = 1) -> Queries:
    gen = torch.Generator().manual_seed(seed)
    return Queries.from_embeddings(
        [f"q{i}" for i in range(n)],
        [dyadic(gen, int(torch.randint(1, 6, (1,), generator=gen))) for _ in range(n)],
    )


def candidates(ids: list[str]) -> dict[str, list[str]]:
    gen = np.random.default_rng(3)
    out = {f"q{i}": [str(d) for d in gen.choice(ids, size=9, replace=False)] for i in range(5) if i != 2}
    out["q4"].append("not-in-corpus")
    return out


def padded(docs: list[torch.Tensor], fill: float = 7.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The documents as a padded [n, L, dim] tensor (padding rows hold ``fill``) and its mask."""
    longest = max(d.shape[0] for d in docs)
    out = torch.full((len(docs), longest, docs[0].shape[1]), fill, dtype=docs[0].dtype)
    mask = torch.zeros(len(docs), longest, dtype=torch.bool)
    for i, d in enumerate(docs):
        out[i, : d.shape[0]] = d
        mask[i, : d.shape[0]] = True
    return out, mask


def trec(run: Run, path) -> bytes:
    run.to_trec(path)
    return open(path, "rb").read()


def runs(corpus, device: str, tmp_path, name: str) -> tuple[bytes, bytes, bytes]:
    """A search's run, a rerank's and a search's under a memory budget (the engine), as TREC bytes."""
    q = queries()
    ids = corpus.ids
    with pytest.warns(MaxsimWarning, match="1 candidates are not in the corpus"):
        reranked = rerank(q, corpus, candidates(sorted(ids)), device=device)
    return (
        trec(search(q, corpus, k=7, device=device), tmp_path / f"{name}-search.trec"),
        trec(reranked, tmp_path / f"{name}-rerank.trec"),
        trec(search(q, corpus, k=7, device=device, max_memory="1MiB"), tmp_path / f"{name}-engine.trec"),
    )


def file_runs(ids, docs, tmp_path, device: str = "cpu", **write) -> tuple[bytes, bytes, bytes]:
    """`runs` of the shard that `write_shard` writes from the same embeddings."""
    path = tmp_path / "written.safetensors"
    write_shard(path, ids, docs, **write)
    with open_corpus(path) as corpus:
        return runs(corpus, device, tmp_path, "file")


# --------------------------------------------------------------------------------------------------
# the same runs as the shards written from the same embeddings


@pytest.mark.parametrize(
    "dtype, layout",
    [(dtype, layout) for dtype in DTYPES for layout in ("tensors", "padded")]
    + [("float16", "numpy"), ("float32", "numpy")],  # numpy holds no bfloat16
)
def test_an_in_memory_corpus_gives_the_run_of_its_written_shard(tmp_path, dtype, layout) -> None:
    ids, docs = documents()
    docs = [d.to(DTYPES[dtype]) for d in docs]
    expected = file_runs(ids, docs, tmp_path)
    if layout == "tensors":  # PyLate: a list of [len, dim] tensors
        corpus = Corpus.from_embeddings(ids, docs)
    elif layout == "numpy":
        corpus = Corpus.from_embeddings(np.array(ids), [d.numpy() for d in docs])
    else:  # colpali-engine: padded with its (numpy) mask; the padding rows hold values the mask must drop
        values, mask = padded(docs)
        corpus = Corpus.from_embeddings(ids, values, mask.numpy())
    with corpus:
        assert corpus.dtype == dtype and corpus.device == "cpu" and corpus.paths == []
        assert corpus.ids == ids and len(corpus) == len(ids) and corpus.dim == DIM
        assert runs(corpus, "auto", tmp_path, "memory") == expected


def test_int8_embeddings_with_their_scales(tmp_path) -> None:
    ids, docs = documents()
    scales = [d.abs().amax(dim=1) / 127 + 1 / 64 for d in docs]
    codes = [torch.round(d / s[:, None]).to(torch.int8) for d, s in zip(docs, scales, strict=True)]
    expected = file_runs(ids, codes, tmp_path, scales=scales, dtype="int8")
    with Corpus.from_embeddings(ids, codes, scales=scales) as corpus:
        assert corpus.dtype == "int8" and corpus.quantization == "int8-per-token"
        assert runs(corpus, "auto", tmp_path, "memory") == expected
    values, mask = padded(codes, fill=5)
    padded_scales, _ = padded([s[:, None] for s in scales], fill=-1)  # padding's scales are masked out too
    with Corpus.from_embeddings(ids, values.to(torch.int8), mask, scales=padded_scales[..., 0]) as corpus:
        assert runs(corpus, "auto", tmp_path, "padded") == expected


def test_an_ids_and_embeddings_pair_is_a_corpus(tmp_path) -> None:
    ids, docs = documents()
    expected = search(queries(), Corpus.from_embeddings(ids, docs), k=4)
    assert search(queries(), (ids, docs), k=4) == expected
    pair = rerank(queries(), (ids, docs), {"q1": ids[:5]})
    assert pair == rerank(queries(), Corpus.from_embeddings(ids, docs), {"q1": ids[:5]})
    with pytest.raises(UsageError, match=r"corpus: got int; pass a Corpus, shard file/folder path\(s\), or"):
        search(queries(), 42)


def test_the_tensors_stay_where_they_are_and_are_the_residency() -> None:
    """Packed once, on their device; scoring reads them in place: no copy, no file, no read."""
    ids, docs = documents()
    corpus = Corpus.from_embeddings(ids, docs)
    shard = corpus.shards[0]
    assert corpus.in_memory and corpus.residency.embeddings is shard.values
    assert corpus.to("cpu") is corpus and corpus.residency.embeddings is shard.values
    run = search(queries(), corpus, k=3)
    assert run.stats.extra["resident_corpus"] is True and run.stats.bytes_read == 0
    assert repr(corpus).endswith("tokens, dim 16, float32, in memory on cpu)")
    corpus.release()  # the tensors are the corpus: kept
    assert corpus.device == "cpu"
    with pytest.raises(UsageError, match="in memory, one block of tensors on one device; pass one device"):
        corpus.to(["cpu", "cpu"])
    corpus.close()
    with pytest.raises(MaxsimError, match="corpus: this in-memory corpus was closed"):
        search(queries(), corpus, k=3)


def test_the_engine_streams_an_in_memory_corpus_from_memory(tmp_path) -> None:
    """A call on another device than the tensors' (here: the residency set aside) streams the documents
    through the shard's reader, which slices the tensors: the same run, and no file opened."""
    ids, docs = documents()
    expected = file_runs(ids, docs, tmp_path)
    corpus = Corpus.from_embeddings(ids, docs)
    corpus.residency = None
    got = runs(corpus, "cpu", tmp_path, "streamed")
    assert got == expected


def test_to_trec_takes_any_path_the_corpus_name_included(tmp_path, monkeypatch) -> None:
    """An in-memory corpus has no files, so `Run.to_trec` refuses nothing on its account."""
    monkeypatch.chdir(tmp_path)
    ids, docs = documents()
    run = search(queries(), Corpus.from_embeddings(ids, docs), k=2)
    run.to_trec("corpus")
    os.mkdir("folder")
    run.to_trec("folder/run.trec")
    assert Run.read("corpus") == Run.read("folder/run.trec")


def test_metadata_is_what_the_writer_records(tmp_path) -> None:
    """``normalized`` measured (None), asserted (True) or given; ``encoder`` kept; they take part in the
    checks against queries as a shard's metadata does."""
    ids, docs = documents()
    unit = [torch.nn.functional.normalize(torch.ones_like(d) + d.abs(), dim=1) for d in docs]
    path = tmp_path / "unit.safetensors"
    write_shard(path, ids, unit)
    with open_corpus(path) as written:
        assert written.normalized is True
    assert Corpus.from_embeddings(ids, unit).normalized is True
    assert Corpus.from_embeddings(ids, docs).normalized is False
    assert Corpus.from_embeddings(ids, docs, normalized=False, encoder="colbert").encoder == "colbert"
    with pytest.raises(InputError, match="corpus: normalized=True but token 0 of document"):
        Corpus.from_embeddings(ids, [d + 2 for d in docs], normalized=True)


def test_padding_kept_without_its_mask_is_warned_about() -> None:
    ids, docs = documents()
    values, _mask = padded(docs, fill=0.0)
    with pytest.warns(MaxsimWarning, match=r"^corpus: \d+ documents carry all-zero token rows .*pass mask="):
        Corpus.from_embeddings(ids, values)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Corpus.from_embeddings(ids, values, _mask)


def test_explanations_are_those_of_the_written_shard(tmp_path) -> None:
    """`Run.explain` reads the one document from memory: the explanation of the written shard's row."""
    ids, docs = documents()
    path = tmp_path / "written.safetensors"
    write_shard(path, ids, docs)
    q = queries()
    with open_corpus(path) as written, Corpus.from_embeddings(ids, docs) as corpus:
        run, expected = search(q, corpus, k=3), search(q, written, k=3, device="cpu")
        for qid in ("q0", "q3"):
            for docno, _score in run[qid]:
                got, want = run.explain(qid, docno), expected.explain(qid, docno)
                assert got.exact and got.to_dict() == want.to_dict()
        with pytest.raises(InputError, match=r"corpus \(corpus\): no document 'no-such-doc'"):
            run.explain("q0", "no-such-doc")


# --------------------------------------------------------------------------------------------------
# the writer's rules and messages


def writer_message(tmp_path, ids, embeddings, **kwargs) -> str:
    path = str(tmp_path / "w.safetensors")
    with pytest.raises(InputError) as info:
        write_shard(path, ids, embeddings, **kwargs)
    return str(info.value).removeprefix(f"{path}: ")


def memory_message(ids, embeddings, *args, **kwargs) -> str:
    with pytest.raises(InputError) as info:
        Corpus.from_embeddings(ids, embeddings, *args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and message.startswith("corpus: ")
    return message.removeprefix("corpus: ")


ONE = np.ones((2, 8), np.float32)


@pytest.mark.parametrize(
    "ids, embeddings",
    [
        (["a", "a"], [ONE, ONE]),  # duplicate ids
        (["a b"], [ONE]),  # whitespace
        (["a\u200bb"], [ONE]),  # invisible
        ([""], [ONE]),  # empty id
        ([1.5], [ONE]),  # not str or int
        (["a\ud800"], [ONE]),  # not UTF-8
        (["a", "b"], [ONE, np.array([[1.0, np.nan] * 4])]),  # NaN
        (["a", "b"], [ONE, np.array([[1.0, np.inf] * 4, [1.0] * 8])]),  # Inf
    ],
)
def test_bad_documents_get_the_writers_message(tmp_path, ids, embeddings) -> None:
    assert memory_message(ids, embeddings) == writer_message(tmp_path, ids, embeddings)


@pytest.mark.parametrize(
    "ids, embeddings, mask, message",
    [
        (["a", "b"], [ONE], None, "2 ids but 1 embedding arrays"),
        (["a"], [np.ones((0, 8))], None, "document 'a' (index 0) has no tokens"),
        (["a", "b"], [ONE, np.ones((2, 16))], None, "document 'b' (index 1) has vectors of 16 values but"),
        (["a"], np.ones((1, 3, 8)), np.ones((1, 2)), "mask has shape (1, 2); expected (1, 3)"),
        (["a", "b"], np.ones((2, 3, 8)), np.array([[1, 1, 0], [0] * 3]), "document 'b' (index 1) has no"),
        (["a"], np.ones((3, 8)), None, "pass a list of [tokens, dim] arrays, one per document"),
        (["a"], [np.ones((2, 8), np.int8)], None, "int8 document embeddings carry no scales; pass scales="),
        (["a"], [ONE], [np.array([1, 2])], "the mask of document 'a' (index 0) holds 2"),
        (["a"], [np.array([["x"] * 8])], None, "document 'a' (index 0): dtype <U1 is not a real-number type"),
        ([], [], None, "no documents; a corpus needs at least one document to score"),
        (
            ["a", "b"],
            [ONE, torch.ones(2, 8, device="meta")],
            None,
            "document 'b' (index 1): a tensor on the meta",
        ),
        (["a"], [np.ones((2, 0))], None, "dim 0"),
    ],
)
def test_bad_in_memory_documents_are_one_line_input_errors(ids, embeddings, mask, message) -> None:
    assert message in memory_message(ids, embeddings, mask)


def test_scales_go_with_int8_values_only() -> None:
    assert "scales go with int8 embeddings only" in memory_message(["a"], [ONE], scales=[np.ones(2)])
    codes = [np.ones((2, 8), np.int8)]
    assert "the scales of document 'a' (index 0) hold 3 values for 2 tokens" in memory_message(
        ["a"], codes, scales=[np.ones(3)]
    )
    assert "a negative int8 scale at token 1" in memory_message(["a"], codes, scales=[np.array([1.0, -1.0])])


# --------------------------------------------------------------------------------------------------
# maxsim serve


def test_the_server_answers_from_an_in_memory_corpus_as_from_its_shard(tmp_path) -> None:
    pytest.importorskip("fastapi")
    from test_serve import TestClient, hits_of

    from maxsim_cli.service.app import create_app

    ids, docs = documents()
    q = queries()
    path = tmp_path / "written.safetensors"
    write_shard(path, ids, docs)
    listed = [{"qid": qid, "embedding": e.tolist()} for qid, e in zip(q.ids, q_rows(q), strict=True)]
    stage = {qid: rows for qid, rows in candidates(ids).items() if qid != "q4"}
    asked = [query for query in listed if query["qid"] in stage]
    answers = []
    for corpus in (open_corpus(path).to("cpu"), Corpus.from_embeddings(ids, docs)):
        with corpus, TestClient(create_app(corpus, batch_window_ms=0)) as client:
            searched = client.post("/search", json={"queries": listed, "k": 5})
            reranked = client.post("/rerank", json={"queries": asked, "candidates": stage})
            health = client.get("/health").json()
            assert searched.status_code == reranked.status_code == 200
            answers.append((hits_of(searched.json()), hits_of(reranked.json()), health["documents"]))
    assert answers[0] == answers[1]
    assert answers[1][0] == search(q, path, k=5).to_dict()


def q_rows(q: Queries) -> list[torch.Tensor]:
    return [q.embeddings[int(q.offsets[i]) : int(q.offsets[i + 1])] for i in range(len(q))]


def test_serve_from_python_takes_an_in_memory_corpus(monkeypatch) -> None:
    """`serve(corpus)` serves an open `Corpus` where it is, on a free port of 127.0.0.1, and leaves it
    open; stopped here as SIGTERM stops it (uvicorn's should_exit)."""
    pytest.importorskip("fastapi")
    import httpx
    import uvicorn

    from maxsim_cli.service import app as app_module

    servers: list = []

    class Recorded(uvicorn.Server):
        def __init__(self, config) -> None:
            super().__init__(config)
            servers.append(self)

    monkeypatch.setattr(uvicorn, "Server", Recorded)
    monkeypatch.setattr(app_module, "_settle_for_serving", lambda corpus: None)  # no gc.freeze in tests
    ids, docs = documents()
    corpus = Corpus.from_embeddings(ids, docs)
    lines: list[str] = []
    thread = threading.Thread(
        target=app_module.serve, args=(corpus,), kwargs={"port": 0, "workers": 0, "log": lines.append}
    )
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not any("serving on" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        url = next(line for line in lines if "serving on" in line).split()[2]
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["documents"] == 40 and health["devices"] == ["cpu"]
        q = queries()
        body = {"queries": [{"qid": "q0", "embedding": q_rows(q)[0].tolist()}], "k": 3}
        answer = httpx.post(f"{url}/search", json=body, timeout=10).json()
        assert hits_of_answer(answer) == search(q, corpus, k=3).to_dict()["q0"]
    finally:
        for server in servers:
            server.should_exit = True
        thread.join(30)
    assert not thread.is_alive() and lines[-1] == "stopped"
    assert lines[0].startswith("Corpus(40 documents") and corpus.device == "cpu"  # left open


def hits_of_answer(answer: dict) -> list[tuple[str, float]]:
    return [(h["docno"], h["score"]) for h in answer["results"][0]["hits"]]


# --------------------------------------------------------------------------------------------------
# on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8"])
def test_cuda_tensors_stay_on_the_gpu_and_give_the_run_of_their_shard(tmp_path, dtype) -> None:
    ids, docs = documents()
    kwargs: dict = {}
    if dtype == "int8":
        scales = [d.abs().amax(dim=1) / 127 + 1 / 64 for d in docs]
        docs = [torch.round(d / s[:, None]).to(torch.int8) for d, s in zip(docs, scales, strict=True)]
        kwargs = {"scales": scales}
    else:
        docs = [d.to(DTYPES[dtype]) for d in docs]
    expected = file_runs(ids, docs, tmp_path, device="cuda", **kwargs)
    on_gpu = [d.cuda() for d in docs]
    gpu_kwargs = {"scales": [s.cuda() for s in kwargs["scales"]]} if kwargs else {}
    with Corpus.from_embeddings(ids, on_gpu, **gpu_kwargs) as corpus:
        assert corpus.device == "cuda:0" and corpus.residency.embeddings.is_cuda
        assert runs(corpus, "auto", tmp_path, "memory") == expected
        # scored on the CPU, the documents stream from the GPU's memory; moved, they are scored there
        (tmp_path / "cpu").mkdir()
        on_cpu = file_runs(ids, docs, tmp_path / "cpu", device="cpu", **kwargs)
        assert runs(corpus, "cpu", tmp_path, "streamed") == on_cpu
        corpus.to("cpu")
        assert corpus.device == "cpu" and not corpus.shards[0].values.is_cuda
        assert runs(corpus, "auto", tmp_path, "moved") == on_cpu
        corpus.to("cuda")
        assert corpus.device == "cuda:0" and corpus.shards[0].values.is_cuda
        assert runs(corpus, "auto", tmp_path, "back") == expected


@pytest.mark.gpu
def test_padded_cuda_tensors_with_a_cuda_mask() -> None:
    ids, docs = documents()
    values, mask = padded([d.half() for d in docs])
    expected = search(queries(), Corpus.from_embeddings(ids, values, mask), k=5, device="cuda")
    with Corpus.from_embeddings(ids, values.cuda(), mask.cuda()) as corpus:
        assert corpus.device == "cuda:0"
        assert search(queries(), corpus, k=5) == expected


def test_the_package_exports_corpus() -> None:
    assert maxsim_cli.Corpus is Corpus and hasattr(Corpus, "from_embeddings")


def test_the_docstring_example_runs(monkeypatch) -> None:
    import doctest

    from maxsim_cli.shards import corpus as corpus_module

    finder = doctest.DocTestFinder()
    tests = [t for t in finder.find(corpus_module.Corpus.from_embeddings, "from_embeddings") if t.examples]
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        test.globs.update(vars(corpus_module))
        runner.run(test)
    assert runner.failures == 0 and runner.tries > 0
