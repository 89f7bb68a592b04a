"""Explanations (`Run.explain`, `maxsim_cli.explain`, `maxsim explain`, `maxsim serve`'s "explain"): each
query token's winning document token, similarity and share, whose similarities added in the kernel's
order give the run's score bit for bit: float16, bfloat16, float32 and int8 corpora, ragged lengths (1 to
100 tokens), ties, negative similarities, search and rerank, the CPU path and the Triton kernel under its
interpreter; ColPali heatmaps over the patch grid of a shard's metadata.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from maxsim_cli import Queries, Run, open_corpus, rerank, search
from maxsim_cli.cli import app
from maxsim_cli.errors import InputError, UsageError
from maxsim_cli.explain import PAIRWISE, SEQUENTIAL, add_in_order, explain
from maxsim_cli.quantize import quantize_corpus
from maxsim_cli.shards import write_shard

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_data"
DIM = 32
runner = CliRunner()


def bits(value: float) -> int:
    return int(np.float32(value).view(np.uint32))


def make_data() -> tuple[list[str], list[torch.Tensor], list[str], list[torch.Tensor]]:
    """Documents of 1 to 100 tokens (both signs), one of repeated tokens (ties), one whose every
    similarity with query "neg" is negative; queries of 1 to 40 tokens."""
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 2, 3, 7, 16, 17, 31, 64, 100, 5]
    docs = [torch.randn(n, DIM, generator=gen) for n in lengths]
    ids = [f"d{i}" for i in range(len(docs))]
    tie = torch.randn(2, DIM, generator=gen)
    docs.append(torch.cat([tie, tie, tie]))  # every max is reached three times: the lowest index wins
    ids.append("tie")
    direction = torch.randn(DIM, generator=gen)
    docs.append(-(direction + 0.1 * torch.randn(6, DIM, generator=gen)))
    ids.append("far")
    q_lengths = [1, 3, 8, 32, 40]
    queries = [torch.randn(n, DIM, generator=gen) for n in q_lengths]
    qids = [f"q{n}" for n in q_lengths]
    queries.append(direction + 0.1 * torch.randn(5, DIM, generator=gen))
    qids.append("neg")
    return ids, docs, qids, queries


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    ids, docs, qids, queries = make_data()
    root = tmp_path_factory.mktemp("explain")
    corpora = {}
    for dtype in ("float16", "bfloat16", "float32"):
        folder = root / dtype
        folder.mkdir()
        write_shard(folder / "a.safetensors", ids[:6], docs[:6], dtype=dtype)
        write_shard(folder / "b.arrow", ids[6:], docs[6:], dtype=dtype)
        corpora[dtype] = folder
    quantize_corpus([corpora["float32"]], root / "int8", sample_queries=0)
    corpora["int8"] = root / "int8"
    return {
        "corpora": corpora,
        "ids": ids,
        "docs": dict(zip(ids, docs, strict=True)),
        "queries": Queries.from_embeddings(qids, queries),
        "query_rows": dict(zip(qids, queries, strict=True)),
    }


def check_against_vectors(e, query: torch.Tensor, doc: torch.Tensor) -> None:
    """Each token's match is a best document token (float64, within float16/int8 rounding) and its
    similarity is that token's."""
    sims = query.double() @ doc.double().T
    scale = float(query.abs().sum(1).max() * doc.abs().max()) * 2e-2  # int8 and float16 rounding
    assert len(e.tokens) == query.shape[0] and e.doc_tokens == doc.shape[0]
    for t in e.tokens:
        assert 0 <= t.doc_token < doc.shape[0]
        assert abs(t.similarity - float(sims[t.query_token].max())) <= scale
        assert abs(float(sims[t.query_token, t.doc_token]) - t.similarity) <= scale


# --------------------------------------------------------------------------------------------------
# the API: exact totals


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int8"])
def test_every_row_of_a_search_and_a_rerank_is_explained_bit_for_bit(data: dict, dtype: str) -> None:
    with open_corpus(data["corpora"][dtype]) as corpus:
        _explain_every_row(data, corpus)


def _explain_every_row(data: dict, corpus) -> None:  # noqa: ANN001 - a Corpus
    run = search(data["queries"], corpus, k=len(data["ids"]), device="cpu")
    candidates = {qid: data["ids"][i % 3 :: 2] for i, qid in enumerate(data["queries"].ids)}
    reranked = rerank(data["queries"], corpus, candidates, device="cpu")
    for one, rows in ((run, list(run)), (reranked, [r for r in reranked if r.rank <= 2])):
        assert rows
        for row in rows:
            e = one.explain(row.qid, row.docno)
            assert (e.qid, e.docno, e.order) == (row.qid, row.docno, SEQUENTIAL)
            assert e.exact and bits(e.total) == bits(row.score) == bits(e.score), row
            assert bits(add_in_order([t.similarity for t in e.tokens], SEQUENTIAL)) == bits(row.score)
        # a pair scores the same bits searched or reranked (the explanation's own score agrees too)
        for row in rows[:3]:
            assert bits(explain(data["queries"], corpus, row.qid, row.docno, device="cpu").score) == bits(
                row.score
            )
    for qid in ("q8", "q40"):
        e = run.explain(qid, "d8")
        check_against_vectors(e, data["query_rows"][qid], data["docs"]["d8"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("resident", [False, True])
def test_on_the_gpu_every_explanation_adds_up_to_the_run_bit_for_bit(
    data: dict, dtype: str, resident
) -> None:
    """The fused kernel's scores (streamed, or a corpus resident in GPU memory) against the explanations'
    pairwise totals: bit for bit, every row of a search and the top rows of a rerank."""
    with open_corpus(data["corpora"][dtype]) as corpus:
        if resident:
            corpus.to("cuda")
        run = search(data["queries"], corpus, k=len(data["ids"]), device="cuda")
        candidates = {qid: data["ids"][i % 3 :: 2] for i, qid in enumerate(data["queries"].ids)}
        reranked = rerank(data["queries"], corpus, candidates, device="cuda")
        for one, rows in ((run, list(run)), (reranked, [r for r in reranked if r.rank <= 2])):
            for row in rows:
                e = one.explain(row.qid, row.docno)
                assert e.order == PAIRWISE and e.exact and bits(e.total) == bits(row.score), row


def test_ties_go_to_the_lowest_document_token(data: dict) -> None:
    for dtype in ("float32", "int8"):
        e = explain(data["queries"], data["corpora"][dtype], "q32", "tie", device="cpu")
        assert {t.doc_token for t in e.tokens} <= {0, 1}  # the first of the three copies
        assert e.exact
        similarities = e.similarities()  # from the vectors as the kernel took them (int8: its codes)
        assert similarities.shape == (32, 6)
        for t in e.tokens:
            assert int(similarities[t.query_token].argmax()) == t.doc_token
            assert similarities[t.query_token, t.doc_token] == pytest.approx(t.similarity, rel=1e-5, abs=1e-6)


def test_negative_similarities_give_negative_terms_and_shares_that_add_up(data: dict) -> None:
    run = search(data["queries"], data["corpora"]["float32"], k=len(data["ids"]), device="cpu")
    e = run.explain("neg", "far")
    assert all(t.similarity < 0 for t in e.tokens) and e.score < 0 and e.exact
    assert bits(e.score) == bits(dict(run["neg"])["far"])
    assert sum(t.share for t in e.tokens) == pytest.approx(1.0, rel=1e-5)
    assert all(t.share > 0 for t in e.tokens)  # negative over negative


def test_a_docno_the_run_does_not_list_is_scored_anew(data: dict) -> None:
    corpus = data["corpora"]["float16"]
    run = search(data["queries"], corpus, k=1, device="cpu")
    listed = {docno for docno, _ in run["q8"]}
    other = next(d for d in data["ids"] if d not in listed)
    e = run.explain("q8", other)
    full = search(data["queries"], corpus, k=len(data["ids"]), device="cpu")
    assert e.exact and bits(e.score) == bits(dict(full["q8"])[other])


def test_the_sample_data_explains_bit_for_bit() -> None:
    """fp16, dim 384, through an open corpus the run keeps."""
    with open_corpus(SAMPLE / "corpus") as corpus:
        run = search(SAMPLE / "queries.safetensors", corpus, k=3, device="cpu")
        for row in list(run)[:12]:
            e = run.explain(row.qid, row.docno)
            assert e.exact and bits(e.total) == bits(row.score)
            assert sum(t.share for t in e.tokens) == pytest.approx(1.0, rel=1e-5)


def test_the_triton_kernel_adds_pairwise(data: dict) -> None:
    """Under Triton's interpreter (CPU tensors): the kernel's pairwise tree, not a sequential sum."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    queries = Queries.from_embeddings(["q"], [data["query_rows"]["q40"]])
    run = search(queries, data["corpora"]["float16"], k=3, device="cpu", backend="triton")
    for row in run:
        e = run.explain(row.qid, row.docno)
        assert e.order == PAIRWISE and e.exact and bits(e.total) == bits(row.score)


def test_docstring_examples(monkeypatch: pytest.MonkeyPatch) -> None:
    import doctest

    import maxsim_cli.explain

    monkeypatch.chdir(ROOT)
    result = doctest.testmod(maxsim_cli.explain, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_add_in_order() -> None:
    terms = np.array([1e8, 1.0, -1e8, 1.0, 3.0], dtype=np.float32)
    assert add_in_order(terms, SEQUENTIAL) == np.float32(4.0)  # ((1e8 + 1) - 1e8) + 1 + 3 = 0 + 1 + 3
    assert add_in_order(terms, PAIRWISE) == np.float32(3.0)  # float32: (1e8 + 1) + (-1e8 + 1) = 0, + 3
    many = np.arange(300, dtype=np.float32) / 7
    pair = add_in_order(many, PAIRWISE)
    chunks = [many[:128], many[128:256], many[256:]]
    assert pair == np.float32(
        np.float32(add_in_order(chunks[0], PAIRWISE) + add_in_order(chunks[1], PAIRWISE))
        + add_in_order(chunks[2], PAIRWISE)
    )


def test_unknown_ids_and_runs_without_inputs_are_one_line_errors(data: dict) -> None:
    corpus = data["corpora"]["float32"]
    with pytest.raises(InputError, match=r"no query 'nope' \(it has 6, e.g. 'q1'\); check the qid"):
        explain(data["queries"], corpus, "nope", "d1", device="cpu")
    with pytest.raises(InputError, match=r"corpus \(.*a.safetensors and 1 more\): no document 'nope'"):
        explain(data["queries"], corpus, "q1", "nope", device="cpu")
    with pytest.raises(UsageError, match="not made by search or rerank"):
        Run({"q1": [("d1", 1.0)]}).explain("q1", "d1")
    e = explain(data["queries"], corpus, "q3", "d1", device="cpu")
    with pytest.raises(UsageError, match="query 'q3' has 3 tokens"):
        e.patch_map(token=3)


# --------------------------------------------------------------------------------------------------
# the command line


def test_cli_prints_a_table_and_json(data: dict, tmp_path: Path) -> None:
    corpus = str(data["corpora"]["float16"])
    query_file = tmp_path / "queries.safetensors"
    write_shard(query_file, data["queries"].ids, list(data["query_rows"].values()))
    args = ["explain", str(query_file), corpus, "--qid", "q8", "--docno", "d7", "--device", "cpu"]
    table = runner.invoke(app, args)
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert lines[0].startswith("query q8, document d7 (64 tokens): score ")
    assert lines[1] == "the 8 similarities, added one after another, give the score bit for bit"
    assert lines[3].split() == ["query_token", "doc_token", "similarity", "share"]
    assert len(lines) == 4 + 8
    as_json = runner.invoke(app, [*args, "--format", "json"])
    assert as_json.exit_code == 0, as_json.output
    got = json.loads(as_json.stdout)
    want = explain(str(query_file), corpus, "q8", "d7", device="cpu").to_dict()
    assert got == want and got["exact"] is True
    assert bits(got["score"]) == bits(sum(np.float32(t["similarity"]) for t in got["tokens"]))
    score = search(str(query_file), corpus, k=20, device="cpu")
    assert bits(dict(score["q8"])["d7"]) == bits(got["score"])


@pytest.mark.parametrize(
    ("extra", "code", "message"),
    [
        (["--qid", "qq", "--docno", "d1"], 1, "no query 'qq'"),
        (["--qid", "q1", "--docno", "dd"], 1, "no document 'dd'"),
        (["--qid", "q1", "--docno", "d1", "--format", "xml"], 2, "--format xml: use table or json"),
        (["--qid", "q1", "--docno", "d1", "--token", "0"], 2, "--token draws a heatmap"),
        (
            ["--qid", "q1", "--docno", "d1", "--heatmap", "out.png"],
            1,
            "no patch_grid in the shard's metadata",
        ),
        (["--docno", "d1"], 2, "Missing option '--qid'"),
    ],
)
def test_cli_errors_are_one_line(
    data: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list, code: int, message: str
) -> None:
    query_file = tmp_path / "queries.safetensors"
    write_shard(query_file, data["queries"].ids, list(data["query_rows"].values()))
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["explain", str(query_file), str(data["corpora"]["float32"]), *extra])
    assert result.exit_code == code, result.output
    assert message in result.stderr and result.stderr.count("\n") == 1 and result.stdout == ""
    assert not (tmp_path / "out.png").exists()


# --------------------------------------------------------------------------------------------------
# ColPali: heatmaps over the patch grid


@pytest.fixture
def pages(tmp_path: Path) -> tuple[Path, Path]:
    """Two "pages" of 1 special token + a 2 x 3 patch grid + 2 prompt tokens, and one query whose token
    0 matches patch (1, 2) and token 1 the prompt."""
    gen = torch.Generator().manual_seed(1)
    page = torch.randn(9, DIM, generator=gen)
    query = torch.stack([page[1 + 5] * 3, page[8] * 3, page[2] * 3])
    write_shard(tmp_path / "pages.safetensors", ["p1", "p2"], [page, torch.randn(9, DIM, generator=gen)],
                patch_grid=(2, 3), patch_start=1)  # fmt: skip
    write_shard(tmp_path / "query.safetensors", ["q"], [query])
    return tmp_path / "query.safetensors", tmp_path / "pages.safetensors"


def test_patch_maps_place_the_matches_on_the_grid(pages: tuple[Path, Path]) -> None:
    query, corpus = pages
    e = explain(query, corpus, "q", "p1", device="cpu")
    assert e.patch_grid == (2, 3) and e.patch_start == 1
    assert [t.doc_token for t in e.tokens] == [6, 8, 2]
    assert [t.patch for t in e.tokens] == [(1, 2), None, (0, 1)]
    shares = e.patch_map()
    assert shares.shape == (2, 3)
    assert shares[1, 2] == pytest.approx(e.tokens[0].share, rel=1e-6)
    assert shares[0, 1] == pytest.approx(e.tokens[2].share, rel=1e-6)
    assert shares.sum() == pytest.approx(1 - e.tokens[1].share, rel=1e-5)  # the prompt token is no patch
    similarity = e.patch_map(token=0)
    assert np.unravel_index(similarity.argmax(), similarity.shape) == (1, 2)
    assert similarity[1, 2] == pytest.approx(e.tokens[0].similarity, rel=1e-3)
    assert e.to_dict()["tokens"][1]["patch"] is None and e.to_dict()["patch_grid"] == [2, 3]


def test_cli_writes_heatmaps(pages: tuple[Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    query, corpus = pages
    for extra, name in (([], "all.png"), (["--token", "2"], "token.png")):
        out = tmp_path / name
        result = runner.invoke(
            app,
            [
                "explain",
                str(query),
                str(corpus),
                "--qid",
                "q",
                "--docno",
                "p1",
                "--heatmap",
                str(out),
                *extra,
            ],
        )
        assert result.exit_code == 0, result.output
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "patch (row, col)" in result.stdout
    bad = runner.invoke(
        app, ["explain", str(query), str(corpus), "--qid", "q", "--docno", "p1", "--heatmap",
              str(tmp_path / "x.png"), "--token", "3"],
    )  # fmt: skip
    assert bad.exit_code == 2 and "token 3: query 'q' has 3 tokens (0 to 2)" in bad.stderr
    assert not (tmp_path / "x.png").exists()


def test_a_document_shorter_than_its_grid_is_refused(tmp_path: Path) -> None:
    write_shard(
        tmp_path / "short.safetensors", ["p"], [torch.randn(4, DIM)], patch_grid=(2, 2), patch_start=1
    )
    query = Queries.from_embeddings(["q"], [torch.randn(2, DIM)])
    e = explain(query, tmp_path / "short.safetensors", "q", "p", device="cpu")
    with pytest.raises(
        InputError, match=r"document 'p' has 4 tokens but its patch_grid 2x2 from token 1 needs 5"
    ):
        e.patch_map()


# --------------------------------------------------------------------------------------------------
# maxsim serve: "explain": true


@pytest.fixture(scope="module")
def served(data: dict):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    import warnings

    with warnings.catch_warnings():  # newer Starlette asks for httpx2 and still runs on httpx
        warnings.filterwarnings("ignore", message=".*httpx2.*")
        from fastapi.testclient import TestClient

    from maxsim_cli.service.app import create_app

    with open_corpus(data["corpora"]["float16"]) as corpus:
        corpus.to("cpu")
        with TestClient(create_app(corpus, batch_window_ms=0)) as client:
            yield client, corpus


def query_json(data: dict, qid: str) -> dict:
    return {"qid": qid, "embedding": data["query_rows"][qid].tolist()}


def check_explained_hits(answer: dict, data: dict, corpus) -> None:  # noqa: ANN001 - a Corpus
    for result in answer["results"]:
        assert result["hits"]
        for hit in result["hits"]:
            e = hit["explanation"]
            assert (e["qid"], e["docno"]) == (result["qid"], hit["docno"])
            assert e["exact"] is True and bits(e["total"]) == bits(e["score"]) == bits(hit["score"])
            assert len(e["tokens"]) == data["query_rows"][result["qid"]].shape[0]
            want = explain(data["queries"], corpus, result["qid"], hit["docno"], device="cpu").to_dict()
            assert e == want


def test_served_search_and_rerank_explain_every_hit(served, data: dict) -> None:
    client, corpus = served
    queries = [query_json(data, "q8"), query_json(data, "q40")]
    plain = client.post("/search", json={"queries": queries, "k": 3})
    assert plain.status_code == 200 and b"explanation" not in plain.content
    # the answer's bytes without explanations do not depend on the field
    assert (
        client.post("/search", json={"queries": queries, "k": 3, "explain": False}).content == plain.content
    )
    explained = client.post("/search", json={"queries": queries, "k": 3, "explain": True})
    assert explained.status_code == 200, explained.text
    answer = explained.json()
    assert [[(h["docno"], h["score"]) for h in r["hits"]] for r in answer["results"]] == [
        [(h["docno"], h["score"]) for h in r["hits"]] for r in plain.json()["results"]
    ]
    check_explained_hits(answer, data, corpus)
    reranked = client.post(
        "/rerank",
        json={
            "queries": queries,
            "candidates": {"q8": ["d8", "tie", "nope"], "q40": ["d2"]},
            "explain": True,
        },
    )
    assert reranked.status_code == 200, reranked.text
    check_explained_hits(reranked.json(), data, corpus)
    assert reranked.json()["results"][0]["missing"] == ["nope"]


def test_served_arrow_requests_take_explain_in_the_query_string(served, data: dict, tmp_path: Path) -> None:
    import pyarrow as pa

    client, corpus = served
    path = tmp_path / "q.arrow"
    write_shard(path, ["q3", "neg"], [data["query_rows"]["q3"], data["query_rows"]["neg"]])
    with pa.memory_map(str(path)) as source:
        table = pa.ipc.open_file(source).read_all()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    body = sink.getvalue().to_pybytes()
    arrow = {"content-type": "application/vnd.apache.arrow.stream"}
    response = client.post("/search?k=2&explain=true", content=body, headers=arrow)
    assert response.status_code == 200, response.text
    check_explained_hits(response.json(), data, corpus)
    plain = client.post("/search?k=2", content=body, headers=arrow)
    assert b"explanation" not in plain.content
    bad = client.post("/search?explain=maybe", content=body, headers=arrow)
    assert bad.status_code == 422 and bad.json() == {"detail": "explain='maybe': must be true or false"}


def test_served_explain_must_be_a_bool(served, data: dict) -> None:
    client, _ = served
    response = client.post("/search", json={"queries": [query_json(data, "q1")], "explain": "yes"})
    assert response.status_code == 422 and "explain" in response.json()["detail"]
    assert "\n" not in response.json()["detail"]
    response = client.post("/search?explain=true", json={"queries": [query_json(data, "q1")]})
    assert response.status_code == 422
    assert response.json()["detail"].endswith("with JSON, k, strict and explain go in the body")


def split_frame(frame: bytes) -> tuple[dict, bytes]:
    head_len = int.from_bytes(frame[:4], "little")
    return json.loads(frame[8 : 8 + head_len]), frame[8 + head_len :]


def test_worker_frames_carry_explain_and_explanations(data: dict) -> None:
    """`maxsim serve --workers`: the request's flag reaches the scoring process, the explanations the
    worker that answers."""
    from maxsim_cli.service.schema import Hits, check_request
    from maxsim_cli.service.wire import answer_frame, answers_from_frame, checked_from_frame, request_frame

    body = json.dumps({"queries": [query_json(data, "q3")], "explain": True}).encode()
    checked = check_request("search", "application/json", body, {}, DIM)
    assert checked_from_frame(*split_frame(request_frame(7, "search", checked))).explain is True
    explanation = {"qid": "q3", "docno": "d1", "exact": True}
    answers = [("q3", Hits(["d1"], np.array([1.5], dtype=np.float32), [explanation]), None)]
    back = answers_from_frame(*split_frame(answer_frame(7, answers, 0.0, 0.0, 1)))
    assert back[0][1].explanations == [explanation] and list(back[0][1]) == [("d1", 1.5)]
    plain = [("q3", Hits(["d1"], np.array([1.5], dtype=np.float32)), None)]
    assert answers_from_frame(*split_frame(answer_frame(7, plain, 0.0, 0.0, 1)))[0][1].explanations is None
