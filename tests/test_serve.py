"""`maxsim serve`: endpoints, batching, errors and safety in process (FastAPI's TestClient), then one real
server on 127.0.0.1 in a subprocess: a concurrent load, its memory, and SIGTERM during a request.

Answers are compared with `maxsim score`'s run and with the in-process `search` / `rerank` on the sample
data (sample_data/corpus, 400 documents; sample_data/queries.safetensors, 200 queries, fp16, d = 384):
the same documents in the same order and the same float32 scores.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

with warnings.catch_warnings():  # newer Starlette asks for httpx2 and still runs on httpx
    warnings.filterwarnings("ignore", message=".*httpx2.*")
    from fastapi.testclient import TestClient  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from maxsim_cli import Queries, open_corpus, read_queries, rerank, search  # noqa: E402
from maxsim_cli.cli import app as cli_app  # noqa: E402
from maxsim_cli.service import batching  # noqa: E402
from maxsim_cli.service.app import check_bind, create_app, is_loopback  # noqa: E402
from maxsim_cli.service.batching import (  # noqa: E402
    Batcher,
    Counters,
    Job,
    Scorer,
    Timing,
    resident_on_gpus,
)
from maxsim_cli.service.schema import ARROW_TYPE, Parsed, RequestError  # noqa: E402
from maxsim_cli.shards import DocBatch, write_shard  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_data"
CORPUS = str(SAMPLE / "corpus")
QUERY_FILE = str(SAMPLE / "queries.safetensors")
CANDIDATES = str(SAMPLE / "candidates.trec")
TOKEN = "s3cret-token-0123456789"
runner = CliRunner()


# --------------------------------------------------------------------------------------------------
# fixtures and helpers


@pytest.fixture(scope="module")
def corpus() -> Iterator:
    with open_corpus(CORPUS) as c:
        c.to("cpu")
        yield c


@pytest.fixture(scope="module")
def queries() -> Queries:
    return read_queries(QUERY_FILE)


@pytest.fixture(scope="module")
def client(corpus) -> Iterator[TestClient]:
    # a long window, so that the concurrent requests of a test share batches
    app = create_app(corpus, batch_window_ms=20, max_request_bytes=4 << 20)
    with TestClient(app) as c:
        yield c


def rows_of(queries: Queries, i: int) -> torch.Tensor:
    return queries.embeddings[int(queries.offsets[i]) : int(queries.offsets[i + 1])]


def query_json(queries: Queries, i: int, qid: str | None = None) -> dict:
    """Query i as JSON: the fp16 values as floats (exact), which the server casts back exactly."""
    return {"qid": qid or queries.ids[i], "embedding": rows_of(queries, i).float().tolist()}


def as_pairs(answers: list) -> list:
    """Scorer answers with each query's hits as (docno, score) pairs."""
    return [(qid, list(hits), missing) for qid, hits, missing in answers]


def hits_of(answer: dict) -> dict[str, list[tuple[str, float]]]:
    return {r["qid"]: [(h["docno"], h["score"]) for h in r["hits"]] for r in answer["results"]}


def cli_run(*args: str) -> dict[str, list[tuple[str, float]]]:
    """`maxsim score`'s run, {qid: [(docno, float32 score)]} in the file's order."""
    result = runner.invoke(cli_app, ["score", QUERY_FILE, CORPUS, "--device", "cpu", "--quiet", *args])
    assert result.exit_code == 0, result.output
    out: dict[str, list[tuple[str, float]]] = {}
    for line in result.stdout.splitlines():
        qid, _, docno, _, score, _ = line.split()
        out.setdefault(qid, []).append((docno, float(np.float32(score))))
    return out


def as_float32(run: dict[str, list[tuple[str, float]]]) -> dict[str, list[tuple[str, float]]]:
    return {q: [(d, float(np.float32(s))) for d, s in rows] for q, rows in run.items()}


def first_stage(n: int) -> dict[str, list[str]]:
    """The candidates of the first ``n`` queries of sample_data/candidates.trec, in file order."""
    out: dict[str, list[str]] = {}
    for line in Path(CANDIDATES).read_text().splitlines():
        qid, _, docno = line.split()[:3]
        if qid not in out and len(out) == n:
            break
        out.setdefault(qid, []).append(docno)
    return out


def arrow_stream(
    queries: Queries, ids: list[int], tmp: Path, candidates: list[list[str]] | None = None
) -> bytes:
    """Queries ``ids`` as the Arrow IPC stream `maxsim score -` reads (plus a candidates column)."""
    import pyarrow as pa

    path = tmp / f"q{len(list(tmp.iterdir()))}.arrow"
    write_shard(path, [queries.ids[i] for i in ids], [rows_of(queries, i) for i in ids])
    with pa.memory_map(str(path)) as source:
        table = pa.ipc.open_file(source).read_all()
    if candidates is not None:
        table = table.append_column("candidates", pa.array(candidates, type=pa.list_(pa.string())))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def assert_one_line_error(response, status: int, fragment: str = "") -> None:
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail and detail
    assert fragment in detail, detail


# --------------------------------------------------------------------------------------------------
# endpoints


def test_health(client, corpus) -> None:
    response = client.get("/health")
    assert response.status_code == 200
    health = response.json()
    assert health == {
        "status": "ok",
        "generation": 0,
        "documents": 400,
        "deleted": 0,
        "tokens": corpus.num_tokens,
        "dim": 384,
        "dtype": "float16",
        "devices": ["cpu"],
        "requests": health["requests"],
        "batches": health["batches"],
        "workers": 0,
    }
    assert health["requests"] >= health["batches"] >= 0


def test_answers_say_where_their_time_went(client, queries) -> None:
    """Each answer's Server-Timing header: parse, queue, score (with its batch's size), encode."""
    import re

    response = client.post("/search", json={"queries": [query_json(queries, 0)], "k": 3})
    assert response.status_code == 200
    timing = response.headers["server-timing"]
    spans = dict(re.findall(r"(\w+);dur=([\d.]+)", timing))
    assert list(spans) == ["parse", "queue", "score", "encode"]
    assert all(float(v) >= 0 for v in spans.values()) and float(spans["score"]) > 0
    assert 'desc="batch of 1"' in timing


def test_search_answers_equal_maxsim_score(client, queries) -> None:
    """All 200 queries in requests of 1 to 37 queries, sent concurrently: batched together, each answer
    is `maxsim score`'s run (same order, same float32 scores), and the in-process `search` exactly."""
    expected = cli_run("-k", "10")
    in_process = search(queries, CORPUS, k=10, device="cpu").to_dict()
    sizes = [1, 2, 3, 37, 5, 1, 20, 31, 1, 8, 40, 1, 50]
    assert sum(sizes) == len(queries)
    starts = np.cumsum([0, *sizes])
    bodies = [
        {"queries": [query_json(queries, i) for i in range(a, b)], "k": 10}
        for a, b in zip(starts[:-1], starts[1:], strict=True)
    ]
    before = client.app.state.batcher.counters.batches
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda body: client.post("/search", json=body), bodies))
    got: dict[str, list[tuple[str, float]]] = {}
    for response, body in zip(responses, bodies, strict=True):
        assert response.status_code == 200, response.text
        answer = response.json()
        assert [r["qid"] for r in answer["results"]] == [q["qid"] for q in body["queries"]]
        got.update(hits_of(answer))
    assert as_float32(got) == expected
    assert got == in_process
    assert client.app.state.batcher.counters.batches - before < len(bodies)  # some requests shared a batch


def test_each_request_gets_its_own_k_and_qids(client, queries) -> None:
    """Concurrent requests with different k and the same qid for different queries: each answer is what
    the request would get alone."""
    full = search(queries, CORPUS, k=20, device="cpu")
    bodies = [{"queries": [query_json(queries, i, qid="q")], "k": k} for i, k in enumerate([1, 20, 3, 7, 2])]
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda body: client.post("/search", json=body), bodies))
    for i, (response, body) in enumerate(zip(responses, bodies, strict=True)):
        assert response.status_code == 200, response.text
        assert hits_of(response.json()) == {"q": full[queries.ids[i]][: body["k"]]}


def test_a_small_request_to_an_idle_gpu_server_is_scored_on_the_event_loop(
    corpus, queries, monkeypatch
) -> None:
    """`Scorer.quick`: one small request on an idle server whose corpus is on GPUs is scored without the
    worker thread (here the corpus is on the CPU, so the test says it is on GPUs), with the same answers;
    a batch of several, or a large request, still goes to the worker thread."""
    threads: list[str] = []
    score = Scorer.score

    def record(self, jobs):
        threads.append(threading.current_thread().name)
        return score(self, jobs)

    monkeypatch.setattr(Scorer, "on_gpus", property(lambda self: True))
    monkeypatch.setattr(Scorer, "score", record)
    one = Queries.from_embeddings(["x"], [rows_of(queries, 0)])
    expected = search(one, corpus, k=3, device="cpu").to_dict()

    async def main() -> list:
        batcher = Batcher(Scorer(corpus), window_s=0.0)
        await batcher.start()
        try:
            alone = await batcher.submit("search", Parsed(one, 3))
            many = await asyncio.gather(*(batcher.submit("search", Parsed(one, 3)) for _ in range(3)))
            big = Queries.from_embeddings([f"q{i}" for i in range(5)], [rows_of(queries, 0)] * 5)
            await batcher.submit("search", Parsed(big, 3))
            return [alone, *many]
        finally:
            await batcher.close()

    answers = asyncio.run(main())
    assert all(
        dict((qid, list(hits)) for qid, hits, _ in answer) == {"x": expected["x"]} for answer in answers
    )
    assert threads[0] == threading.main_thread().name
    assert all(name.startswith("maxsim-serve") for name in threads[1:]), threads


def test_resident_on_gpus_needs_every_part_resident_on_a_gpu(corpus) -> None:
    """`resident_on_gpus` (the busy-poll default, one torch thread, `Scorer.quick`): false for a corpus
    resident on the CPU and for one that streams from its files (no device at all)."""
    assert not resident_on_gpus(corpus) and not Scorer(corpus).on_gpus
    with open_corpus(CORPUS) as streaming:
        assert not resident_on_gpus(streaming) and not Scorer(streaming).on_gpus


def test_score_now_answers_a_quick_request_to_an_idle_server_only(corpus, queries, monkeypatch) -> None:
    """`Batcher.score_now` (what a worker's frame tries first): the answer of `search` for one small
    request while the batcher runs idle (the corpus said to be on GPUs); None before it starts, after it
    closes, for a request that is not quick, and for one that comes right after a scoring."""
    monkeypatch.setattr(Scorer, "on_gpus", property(lambda self: True))
    # "right after" must hold on a slow or loaded machine too: a gap it cannot miss
    gap_s = 0.25
    monkeypatch.setattr(batching, "QUICK_GAP_S", gap_s)
    one = Queries.from_embeddings(["x"], [rows_of(queries, 0)])
    big = Queries.from_embeddings([f"q{i}" for i in range(5)], [rows_of(queries, 0)] * 5)
    batcher = Batcher(Scorer(corpus), window_s=0.0)
    timing = Timing()

    async def main() -> list:
        assert batcher.score_now("search", Parsed(one, 3)) is None
        await batcher.start()
        try:
            answers = batcher.score_now("search", Parsed(one, 3), timing)
            assert batcher.score_now("search", Parsed(big, 3)) is None
            # right after a scoring: a request that waited behind it (a loaded server) is queued
            assert batcher.score_now("search", Parsed(one, 3)) is None
            await asyncio.sleep(2 * gap_s)
            assert batcher.score_now("search", Parsed(one, 3)) is not None
        finally:
            await batcher.close()
        assert batcher.score_now("search", Parsed(one, 3)) is None
        return answers

    answers = asyncio.run(main())
    assert {qid: list(hits) for qid, hits, _ in answers} == search(one, corpus, k=3).to_dict()
    assert timing.batch_requests == 1 and timing.score_s > 0


@pytest.mark.gpu
def test_a_gpu_resident_corpus_answers_as_the_in_process_calls(queries) -> None:
    """On a GPU: a lone small request (scored on the event loop) and concurrent ones (a batch on the
    worker thread) answer as `search` and `rerank` on the same resident corpus."""
    stage = first_stage(6)
    with open_corpus(CORPUS) as corpus:
        corpus.to("cuda")
        assert resident_on_gpus(corpus) and Scorer(corpus).on_gpus
        expected = search(queries, corpus, k=5).to_dict()
        reranked = rerank(queries, corpus, stage).to_dict()
        with TestClient(create_app(corpus, batch_window_ms=20)) as client:
            lone = client.post("/search", json={"queries": [query_json(queries, 0)], "k": 5})
            assert lone.status_code == 200, lone.text
            assert hits_of(lone.json()) == {queries.ids[0]: expected[queries.ids[0]]}
            qid = next(iter(stage))
            i = queries.ids.index(qid)
            one = client.post(
                "/rerank", json={"queries": [query_json(queries, i)], "candidates": {qid: stage[qid]}}
            )
            assert hits_of(one.json()) == {qid: reranked[qid]}

            def ask(i: int) -> dict:
                return client.post("/search", json={"queries": [query_json(queries, i)], "k": 5}).json()

            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(ask, range(len(queries))))
            for i, answer in enumerate(answers):
                assert hits_of(answer) == {queries.ids[i]: expected[queries.ids[i]]}


def test_rerank_answers_equal_maxsim_score(client, queries, tmp_path) -> None:
    stage = first_stage(20)
    wanted = [queries.ids.index(q) for q in stage]
    expected = cli_run("--candidates", CANDIDATES, "-k", "5")
    body = {"queries": [query_json(queries, i) for i in wanted], "candidates": stage, "k": 5}
    response = client.post("/rerank", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert as_float32(hits_of(answer)) == {q: expected[q] for q in stage}
    assert all(r["missing"] == [] for r in answer["results"])
    # without k: every candidate, as the in-process rerank orders them
    body.pop("k")
    response = client.post("/rerank", json=body)
    alone = rerank(queries, CORPUS, {q: stage[q] for q in stage}, device="cpu").to_dict()
    assert hits_of(response.json()) == alone


def test_rerank_missing_docnos_and_strict(client, queries) -> None:
    stage = first_stage(2)
    (q1, docs1), (q2, docs2) = stage.items()
    cands = {q1: ["no-such-doc", *docs1[:4]], q2: docs2[:3]}
    body = {"queries": [query_json(queries, queries.ids.index(q)) for q in (q1, q2)], "candidates": cands}
    response = client.post("/rerank", json=body)
    assert response.status_code == 200, response.text
    results = {r["qid"]: r for r in response.json()["results"]}
    assert results[q1]["missing"] == ["no-such-doc"] and results[q2]["missing"] == []
    assert sorted(d for d, _ in hits_of(response.json())[q1]) == sorted(docs1[:4])
    assert_one_line_error(client.post("/rerank", json={**body, "strict": True}), 422, "'no-such-doc'")
    # a query without candidates has no hits
    response = client.post("/rerank", json={**body, "candidates": {q1: docs1[:2]}})
    assert {r["qid"]: len(r["hits"]) for r in response.json()["results"]} == {q1: 2, q2: 0}


def test_arrow_stream_requests(client, queries, tmp_path) -> None:
    ids = list(range(10, 25))
    response = client.post(
        "/search?k=7", content=arrow_stream(queries, ids, tmp_path), headers={"content-type": ARROW_TYPE}
    )
    assert response.status_code == 200, response.text
    full = search(queries, CORPUS, k=7, device="cpu").to_dict()
    assert hits_of(response.json()) == {queries.ids[i]: full[queries.ids[i]] for i in ids}

    stage = first_stage(3)
    wanted = [queries.ids.index(q) for q in stage]
    lists = [stage[q] + (["no-such-doc"] if n == 0 else []) for n, q in enumerate(stage)]
    body = arrow_stream(queries, wanted, tmp_path, candidates=lists)
    response = client.post("/rerank?k=4", content=body, headers={"content-type": ARROW_TYPE})
    assert response.status_code == 200, response.text
    alone = rerank(queries, CORPUS, stage, k=4, device="cpu").to_dict()
    assert hits_of(response.json()) == alone
    assert response.json()["results"][0]["missing"] == ["no-such-doc"]
    strict = client.post("/rerank?strict=true", content=body, headers={"content-type": ARROW_TYPE})
    assert_one_line_error(strict, 422, "not in the corpus")
    lists[1] = [lists[1][0], None]
    nulls = arrow_stream(queries, wanted, tmp_path, candidates=lists)
    response = client.post("/rerank", content=nulls, headers={"content-type": ARROW_TYPE})
    assert_one_line_error(response, 422, f"query {queries.ids[wanted[1]]!r} has a null docno")


def test_int8_corpus(tmp_path, queries) -> None:
    from maxsim_cli.quantize import quantize_corpus

    quantize_corpus([CORPUS], tmp_path / "int8", device="cpu", sample_queries=0)
    with open_corpus(tmp_path / "int8") as corpus:
        corpus.to("cpu")
        expected = search(queries, corpus, k=5).to_dict()
        with TestClient(create_app(corpus, batch_window_ms=5)) as client:
            assert client.get("/health").json()["dtype"] == "int8"
            body = {"queries": [query_json(queries, i) for i in range(0, 200, 9)], "k": 5}
            response = client.post("/search", json=body)
    assert response.status_code == 200, response.text
    assert hits_of(response.json()) == {q["qid"]: expected[q["qid"]] for q in body["queries"]}


def test_corpus_on_several_devices(queries) -> None:
    """`--devices`: the corpus spread over two (CPU) devices answers as on one."""
    answers_on_several_devices(queries, ["cpu", "cpu"])


@pytest.mark.gpu
def test_corpus_on_several_gpus(queries) -> None:
    """`--devices` on GPUs (cuda:0 and cuda:1, or cuda:0 twice where there is one): as on cuda:0."""
    two = ["cuda:0", "cuda:1"] if torch.cuda.device_count() > 1 else ["cuda:0", "cuda:0"]
    answers_on_several_devices(queries, two)


def answers_on_several_devices(queries: Queries, devices: list[str]) -> None:
    """A server over the corpus spread on ``devices`` answers as the library on the first of them."""
    stage = first_stage(4)
    body = {"queries": [query_json(queries, queries.ids.index(q)) for q in stage], "candidates": stage}
    search_body = {"queries": [query_json(queries, i) for i in range(0, 200, 11)], "k": 6}
    expected_search = search(queries, CORPUS, k=6, device=devices[0]).to_dict()
    expected_rerank = rerank(queries, CORPUS, stage, device=devices[0]).to_dict()
    with open_corpus(CORPUS) as corpus:
        corpus.to(devices)
        assert resident_on_gpus(corpus) == all(d.startswith("cuda") for d in devices)
        with TestClient(create_app(corpus, batch_window_ms=0)) as client:
            assert client.get("/health").json()["devices"] == devices
            searched = client.post("/search", json=search_body)
            reranked = client.post("/rerank", json=body)
    assert hits_of(searched.json()) == {q["qid"]: expected_search[q["qid"]] for q in search_body["queries"]}
    assert hits_of(reranked.json()) == expected_rerank


# --------------------------------------------------------------------------------------------------
# batching


def test_a_batch_answers_each_request_as_alone(corpus, queries) -> None:
    """Requests of fp16, float32, bfloat16 and int8 (with scales) queries, k from 1 to 30, the same qids,
    gathered into one batch: each answer is the request's own `search`, and one engine call ran."""

    def part(indices: list[int], kind: str) -> Queries:
        rows = [rows_of(queries, i) for i in indices]
        ids = ["a", "b", "c"][: len(indices)]
        if kind == "int8":
            packed = torch.cat(rows).float()
            scales = packed.abs().amax(dim=1).clamp_min(1e-12) / 127
            codes = torch.round(packed / scales[:, None]).clamp(-127, 127).to(torch.int8)
            offsets = torch.tensor(np.cumsum([0, *[len(r) for r in rows]]), dtype=torch.int64)
            return Queries(DocBatch(ids, codes, offsets, scales))
        dtype = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}[kind]
        return Queries.from_embeddings(ids, [r.to(dtype) for r in rows])

    parts = [
        (part([0, 1], "fp16"), 10),
        (part([2], "fp32"), 1),
        (part([3, 4, 5], "bf16"), 30),
        (part([6, 7], "int8"), 4),
        (part([8], "fp16"), 7),
    ]
    counters = Counters()
    scorer = Scorer(corpus, counters=counters)

    async def main() -> list:
        batcher = Batcher(scorer, window_s=0.5, max_queries=64)
        await batcher.start()
        try:
            return await asyncio.gather(*(batcher.submit("search", Parsed(q, k)) for q, k in parts))
        finally:
            await batcher.close()

    answers = asyncio.run(main())
    assert counters.batches == 1 and counters.largest == len(parts)
    for (q, k), answer in zip(parts, answers, strict=True):
        alone = search(q, corpus, k=k).to_dict()
        assert {qid: list(hits) for qid, hits, _ in answer} == alone


def tie_corpus(root: Path, dtype: str = "float16") -> str:
    """Two shards whose scores tie on purpose: copies of one document under ids whose byte order is not
    their look (upper case, digits, non-ASCII), a zero document (-0.0 against a negative query) beside
    one that scores +0.0, negative scores, and lengths from 1 to 9 tokens; dim 24."""
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(3, 24, generator=gen)
    zero_plus = torch.zeros(1, 24)
    zero_plus[0, 0], zero_plus[0, 1] = 1.0, -1.0  # against the all -1 query: -1 + 1 = +0.0
    docs = {"d10": base, "d9": base.clone(), "D1": base.clone(), "\u00e9": base.clone()}
    docs |= {"zero": torch.zeros(1, 24), "plus0": zero_plus, "neg": -base.abs()}
    docs["long"] = torch.randn(9, 24, generator=gen)
    for n in range(12):
        docs[f"r{n}"] = torch.randn(1 + n % 5, 24, generator=gen)
    names = list(docs)
    os.makedirs(root, exist_ok=True)
    half = len(names) // 2
    for s, part in enumerate((names[:half], names[half:])):
        rows = [docs[n] for n in part]
        if dtype == "int8":
            packed = torch.cat(rows)
            scales = packed.abs().amax(dim=1).clamp_min(1e-12) / 127
            codes = torch.round(packed / scales[:, None]).clamp(-127, 127).to(torch.int8)
            offsets = torch.tensor(np.cumsum([0, *[len(r) for r in rows]]), dtype=torch.int64)
            write_shard(root / f"s{s}.safetensors", part, codes, offsets=offsets, scales=scales, dtype="int8")
        else:
            write_shard(root / f"s{s}.safetensors", part, [r.to(getattr(torch, dtype)) for r in rows])
    return str(root)


@pytest.mark.filterwarnings("ignore::maxsim_cli.errors.MaxsimWarning")
@pytest.mark.parametrize("dtype", ["float16", "float32", "int8"])
def test_the_resident_rerank_answers_as_the_library(tmp_path, dtype) -> None:
    """A rerank batch on a resident corpus goes straight from docnos to corpus ordinals and sorts in
    numpy (`Scorer._rerank_resident`); its answers are the library `rerank`'s, on exact ties (ordered by
    docno bytes), -0.0 against +0.0, negative scores, candidates over two shards, missing docnos, k
    cuts, strict requests and mixed query dtypes in one batch."""
    gen = torch.Generator().manual_seed(11)
    every = ["d10", "d9", "D1", "\u00e9", "zero", "plus0", "neg", "long", *[f"r{n}" for n in range(12)]]
    requests = [
        (torch.full((2, 24), -1.0), every, None, False),
        (torch.randn(3, 24, generator=gen), ["r3", "nope", "d9", "D1", "d10", "\u00e9"], 3, False),
        (torch.randn(1, 24, generator=gen).to(torch.bfloat16), every[::-1], 5, False),
        (torch.randn(4, 24, generator=gen), ["zero", "nope"], None, True),
        (torch.randn(2, 24, generator=gen).half(), ["long"], 1, False),
    ]
    with open_corpus(tie_corpus(tmp_path / "c", dtype)) as corpus:
        corpus.to("cpu")
        scorer = Scorer(corpus)
        residency = corpus.residency
        jobs = [
            Job("rerank", Parsed(Queries.from_embeddings(["q"], [emb]), k, {"q": cands}, strict))
            for emb, cands, k, strict in requests
        ]
        for batch in (jobs, *[[job] for job in jobs]):
            fast = scorer._rerank_resident(batch, residency)
            slow = scorer._rerank_library(batch)
            assert fast is not None and len(fast) == len(slow)
            for a, b in zip(fast, slow, strict=True):
                if isinstance(b, Exception):
                    assert type(a) is type(b) and str(a) == str(b)
                else:
                    assert as_pairs(a) == as_pairs(b)
        hits = list(scorer.score([jobs[0]])[0][0][1])
        copies = [(d, score) for d, score in hits if d in ("d10", "d9", "D1", "\u00e9")]
        assert [d for d, _ in copies] == ["\u00e9", "d9", "d10", "D1"]  # docno bytes, descending
        assert len({score for _, score in copies}) == 1
        zeros = [d for d, score in hits if score == 0.0]
        assert zeros == ["zero", "plus0"]  # -0.0 and +0.0 tie


def test_a_rerank_the_resident_path_cannot_take_goes_to_the_library(corpus, queries, monkeypatch) -> None:
    """A batch too large for one launch, or one that ran the device out of memory, is scored by the
    library's `rerank` instead, with the same answers."""
    from maxsim_cli.scoring import direct

    stage = first_stage(3)
    jobs = [
        Job(
            "rerank",
            Parsed(Queries.from_embeddings([q], [rows_of(queries, queries.ids.index(q))]), 4, {q: c}),
        )
        for q, c in stage.items()
    ]
    scorer = Scorer(corpus)
    expected = scorer._rerank_library(jobs)
    calls = []
    real = scorer._rerank_library
    monkeypatch.setattr(scorer, "_rerank_library", lambda batch: calls.append(len(batch)) or real(batch))
    assert scorer.score(jobs) == expected and calls == []
    monkeypatch.setattr(direct, "candidate_scores", lambda *a, **k: None)  # out of memory
    assert scorer.score(jobs) == expected and calls == [3]
    monkeypatch.setattr(direct, "MAX_BLOCK_BYTES", {})  # beyond one launch
    assert scorer.score(jobs) == expected and calls == [3, 3]


def test_an_idle_server_does_not_wait_the_window(corpus, queries) -> None:
    """A request alone is scored at once; concurrent ones share a batch."""
    counters = Counters()

    async def main() -> float:
        batcher = Batcher(Scorer(corpus, counters=counters), window_s=30.0)
        await batcher.start()
        try:
            started = time.perf_counter()
            one = Queries.from_embeddings(["x"], [rows_of(queries, 0)])
            await batcher.submit("search", Parsed(one, 3))
            elapsed = time.perf_counter() - started
            await asyncio.gather(*(batcher.submit("search", Parsed(one, 3)) for _ in range(3)))
            return elapsed
        finally:
            await batcher.close()

    assert asyncio.run(main()) < 10
    assert counters.sizes == [1, 3]


def test_a_failing_batch_is_split_and_only_the_bad_request_fails(corpus, queries, monkeypatch) -> None:
    """A batch that fails is scored again in halves: here every call holding the poisoned request fails,
    as an out-of-memory that the request would also meet alone."""
    import maxsim_cli.api as api

    real = api.search

    def flaky(q, *args, **kwargs):
        if bool((q.embeddings == 64).any()):  # the poisoned request's mark
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(q, *args, **kwargs)

    monkeypatch.setattr(api, "search", flaky)
    scorer = Scorer(corpus)
    rows = [rows_of(queries, i).clone() for i in range(4)]
    rows[2][0, 0] = 64
    jobs = [Job("search", Parsed(Queries.from_embeddings(["x"], [r]), 3)) for r in rows]
    results = scorer.score(jobs)
    assert isinstance(results[2], torch.OutOfMemoryError)
    for i in (0, 1, 3):
        assert list(results[i][0][1]) == real(jobs[i].request.queries, corpus, k=3).to_dict()["x"]
    assert scorer.counters.splits >= 1


# --------------------------------------------------------------------------------------------------
# errors: a 4xx with one line, and the server keeps answering

DIM_ROW = [0.5] * 384
GOOD = {"qid": "q1", "embedding": [DIM_ROW]}
ONE_ROW = b'{"queries": [{"qid": "q1", "embedding": [[%s' + b", 1.0" * 383 + b"]]}]}"
JSON_ERRORS = [
    ("malformed", "/search", b'{"queries": [', 400, "malformed JSON"),
    ("not-an-object", "/search", b"[1, 2]", 422, "object"),
    ("unknown-field", "/search", {"queries": [GOOD], "kk": 3}, 422, "kk: unknown field"),
    ("unknown-query-field", "/search", {"queries": [{**GOOD, "mask": [1]}]}, 422, "queries[0].mask"),
    ("wrong-dim", "/search", {"queries": [{"qid": "q1", "embedding": [[1.0, 2.0]]}]}, 422, "dim 384"),
    ("ragged", "/search", {"queries": [{"qid": "q1", "embedding": [DIM_ROW, [1.0]]}]}, 422, "384 and 1"),
    ("nan", "/search", ONE_ROW % b"NaN", 422, "query 'q1' (index 0) has NaN or Inf values"),
    ("inf", "/search", ONE_ROW % b"1e999", 422, "drop that query"),
    ("no-queries", "/search", {"queries": []}, 422, "queries"),
    ("empty-query", "/search", {"queries": [{"qid": "q1", "embedding": []}]}, 422, "no tokens"),
    ("duplicate-qid", "/search", {"queries": [GOOD, GOOD]}, 422, "'q1'"),
    ("qid-whitespace", "/search", {"queries": [{**GOOD, "qid": "q 1"}]}, 422, "whitespace"),
    ("string-number", "/search", {"queries": [{"qid": "q1", "embedding": [["1.0"] * 384]}]}, 422, "number"),
    ("k-zero", "/search", {"queries": [GOOD], "k": 0}, 422, "k:"),
    ("k-string", "/search", {"queries": [GOOD], "k": "5"}, 422, "k:"),
    ("no-such-query", "/rerank", {"queries": [GOOD], "candidates": {"q9": ["d"]}}, 422, "'q9'"),
    ("candidate-twice", "/rerank", {"queries": [GOOD], "candidates": {"q1": ["d", "d"]}}, 422, "twice"),
    ("no-candidates", "/rerank", {"queries": [GOOD]}, 422, "candidates"),
    ("strict-not-bool", "/rerank", {"queries": [GOOD], "candidates": {}, "strict": "y"}, 422, "strict"),
]


def post(client: TestClient, path: str, body: bytes | dict, content_type: str = "application/json"):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=content, headers={"content-type": content_type})


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"), [c[1:] for c in JSON_ERRORS], ids=[c[0] for c in JSON_ERRORS]
)
def test_bad_json_requests(client, path, body, status, fragment) -> None:
    assert_one_line_error(post(client, path, body), status, fragment)
    assert client.get("/health").status_code == 200


def test_bad_transport(client, queries, tmp_path) -> None:
    assert_one_line_error(post(client, "/search", b"hello", "text/plain"), 415)
    assert_one_line_error(post(client, "/search", b""), 400)
    assert_one_line_error(post(client, "/search", b"\x00" * 64, ARROW_TYPE), 400, "Arrow")
    big = {"queries": [GOOD] * 3000}  # ~5.8 MB, over the 4 MiB of the fixture
    assert_one_line_error(post(client, "/search", big), 413)
    stream = arrow_stream(queries, [0], tmp_path)
    assert_one_line_error(post(client, "/search?kk=1", stream, ARROW_TYPE), 422, "'kk'")
    assert_one_line_error(post(client, "/search?k=zero", stream, ARROW_TYPE), 422, "k=")
    assert_one_line_error(post(client, "/rerank", stream, ARROW_TYPE), 422, "candidates")
    assert_one_line_error(post(client, "/search?k=3", {"queries": [GOOD]}), 422, "'k'")
    assert client.get("/search").status_code == 405
    assert client.get("/nothing").status_code == 404
    assert post(client, "/search", {"queries": [GOOD]}).status_code == 200


def test_a_bug_in_one_request_is_a_500_and_the_server_goes_on(client, queries, monkeypatch) -> None:
    from maxsim_cli.service import app as service_app

    def broken(*args, **kwargs):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(service_app, "answer_json", broken)
    assert_one_line_error(client.post("/search", json={"queries": [query_json(queries, 0)]}), 500, "boom")
    monkeypatch.undo()
    assert client.post("/search", json={"queries": [query_json(queries, 0)]}).status_code == 200


# --------------------------------------------------------------------------------------------------
# safety


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_an_answer_with_a_score_json_cannot_carry_is_refused(bad) -> None:
    from maxsim_cli.service.schema import Hits, answer_json

    good = [("d1", 3.5), ("d2", -1.25)]
    answer = answer_json([("q", Hits.from_pairs(good), None)])
    assert json.loads(answer)["results"][0]["hits"][1]["score"] == -1.25
    with pytest.raises(ValueError, match="'q': a score is not finite"):
        answer_json([("q", Hits.from_pairs([*good, ("d3", bad)]), [])])


@pytest.mark.parametrize(
    "docnos",
    [
        ["d1"],
        ["d1", "doc-2", "\u00e9t\u00e9", "\U0001f600", "", "a,b", "x]y", "}{"],  # no escape needed
        ["d1", 'say "hi"', "d3"],  # a quote
        ["back\\slash", "d2"],
        ["tab\tin", "bell\x07"],
        ['","', "d2"],  # the separator itself, escaped
    ],
)
def test_the_answer_is_the_json_of_the_hits_whatever_the_docnos(docnos) -> None:
    """The hits are written by splicing two arrays when no docno needs an escape, else as a list of
    objects: either way the JSON reads back as the hits, scores as the same float32 values, and the
    text is the one `json.dumps` of the same objects would parse to."""
    from maxsim_cli.service.schema import Hits, answer_json

    rng = np.random.default_rng(len(docnos))
    scores = rng.standard_normal(len(docnos)).astype(np.float32)
    scores[0] = -0.0
    hits = Hits(docnos, scores)
    answer = json.loads(
        answer_json([('q"1', hits, ["gone"]), ("q2", Hits([], np.zeros(0, np.float32)), None)])
    )
    assert answer == {
        "results": [
            {"qid": 'q"1', "hits": [{"docno": d, "score": s} for d, s in hits], "missing": ["gone"]},
            {"qid": "q2", "hits": []},
        ]
    }
    got = answer["results"][0]["hits"]
    assert np.array_equal(
        np.array([h["score"] for h in got], dtype=np.float32).view(np.int32), scores.view(np.int32)
    )


def test_bearer_token(corpus, queries) -> None:
    with TestClient(create_app(corpus, token=TOKEN, batch_window_ms=0)) as client:
        body = {"queries": [query_json(queries, 0)], "k": 2}
        assert_one_line_error(client.get("/health"), 401, "bearer token")
        assert_one_line_error(client.post("/search", json=body), 401)
        wrong = {"authorization": "Bearer " + TOKEN[:-1] + "x"}
        assert_one_line_error(client.post("/search", json=body, headers=wrong), 401)
        assert client.get("/health", headers={"authorization": "Basic " + TOKEN}).status_code == 401
        right = {"authorization": f"Bearer {TOKEN}"}
        assert client.get("/health", headers=right).status_code == 200
        assert client.post("/search", json=body, headers=right).status_code == 200


def test_loopback_only_without_a_token() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("127.3.4.5")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.0.2.1") and not is_loopback("")
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", TOKEN)
    with pytest.raises(Exception, match="--token-file"):
        check_bind("0.0.0.0", None)


def _serve(*args: str):
    return runner.invoke(cli_app, ["serve", CORPUS, *args])


def test_serve_refuses_before_loading(tmp_path) -> None:
    result = _serve("--host", "0.0.0.0")
    assert result.exit_code == 2 and "--token-file" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    (tmp_path / "empty").write_text("\n")
    result = _serve("--host", "0.0.0.0", "--token-file", str(tmp_path / "empty"))
    assert result.exit_code == 2 and "empty" in result.stderr
    (tmp_path / "short").write_text("abc\n")
    assert _serve("--token-file", str(tmp_path / "short")).exit_code == 2
    assert _serve("--device", "cpu", "--devices", "0,1").exit_code == 2
    assert _serve("--max-request-bytes", "lots").exit_code == 2
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = _serve("--device", "cpu", "--port", str(taken.getsockname()[1]))
    assert result.exit_code == 1 and "cannot listen" in result.stderr


def test_serve_without_fastapi_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "fastapi", None)  # `import fastapi` raises ImportError
    result = _serve("--device", "cpu")
    assert result.exit_code == 1
    assert "pip install 'maxsim[serve]'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------------
# a real server: concurrent load, memory, SIGTERM


class Server:
    """`maxsim serve CORPUS` in a subprocess on 127.0.0.1, a free port (on the CPU unless ``where`` says
    otherwise); stderr collected by a thread; ``wait``: until it says it is serving; ``preexec_fn``: run
    in the child before it starts (e.g. to lower its limits)."""

    def __init__(
        self,
        corpus: str,
        *args: str,
        env: dict[str, str] | None = None,
        wait: bool = True,
        where: tuple[str, ...] = ("--device", "cpu"),
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "maxsim_cli", "serve", corpus, *where, "--port", "0", *args],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})},
            preexec_fn=preexec_fn,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        if not wait:
            return
        deadline = time.monotonic() + 90
        while True:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is None and time.monotonic() < deadline:
                    continue
                self.stop()
                pytest.fail("the server did not start:\n" + "".join(self.log))
            match = re.search(r"serving on http://127\.0\.0\.1:(\d+)", line)
            if match:
                self.port = int(match.group(1))
                self.url = f"http://127.0.0.1:{self.port}"
                return

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            self.lines.put(line)

    def workers(self) -> list[int]:
        """The pids of the worker processes."""
        text = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        return [int(pid) for pid in text.split()]

    def hub_folder(self) -> str:
        """The server's private folder (its Unix socket's), from a worker's command line."""
        args = Path(f"/proc/{self.workers()[0]}/cmdline").read_bytes().split(b"\0")
        return os.path.dirname(args[args.index(b"--hub") + 1].decode())

    def rss_kib(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _load(url: str, bodies: list[dict], clients: int) -> list[tuple[int, dict]]:
    """``clients`` concurrent clients, each sending the next body until none is left."""
    todo = list(enumerate(bodies))
    out: list = [None] * len(bodies)

    async def client(http: httpx.AsyncClient) -> None:
        while todo:
            i, body = todo.pop()
            response = await http.post(f"{url}/search", json=body)
            out[i] = (response.status_code, response.json())

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=30, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return out


@pytest.mark.slow
def test_real_server_under_load_then_sigterm(queries) -> None:
    expected = search(queries, CORPUS, k=10, device="cpu").to_dict()
    server = Server(CORPUS, "--batch-window-ms", "2")
    try:
        ks = [1, 3, 10]

        def bodies(n: int, offset: int) -> list[dict]:
            picks = [(offset + 7 * j) % len(queries) for j in range(n)]
            return [{"queries": [query_json(queries, i)], "k": ks[j % 3]} for j, i in enumerate(picks)]

        def check(results: list, sent: list[dict]) -> None:
            for (status, answer), body in zip(results, sent, strict=True):
                assert status == 200, answer
                qid = body["queries"][0]["qid"]
                assert hits_of(answer) == {qid: expected[qid][: body["k"]]}

        warm = bodies(120, 0)
        check(asyncio.run(_load(server.url, warm, clients=8)), warm)
        before = server.rss_kib()
        sent = bodies(400, 3)
        started = time.perf_counter()
        check(asyncio.run(_load(server.url, sent, clients=8)), sent)
        elapsed = time.perf_counter() - started
        after = server.rss_kib()
        # flat: a leak of one answer (~1 KB) a request would show; allocator noise stays well under this
        assert after - before < 24 * 1024, f"RSS {before} -> {after} KiB over {len(sent)} requests"
        print(f"400 requests from 8 clients in {elapsed:.2f} s; RSS {before} -> {after} KiB")

        # SIGTERM while a request is in flight (its headers and half its body sent): it completes, then
        # the server exits 0
        body = json.dumps({"queries": [query_json(queries, 5)], "k": 4}).encode()
        head = (
            f"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(head + body[: len(body) // 2])
            time.sleep(0.3)
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            assert server.proc.poll() is None  # still waiting for the request to finish
            sock.sendall(body[len(body) // 2 :])
            response = b""
            while chunk := sock.recv(65536):
                response += chunk
        status_line, _, rest = response.partition(b"\r\n")
        assert b" 200 " in status_line, response[:300]
        answer = json.loads(rest.partition(b"\r\n\r\n")[2])
        assert hits_of(answer) == {queries.ids[5]: expected[queries.ids[5]][:4]}
        assert server.proc.wait(timeout=30) == 0, "".join(server.log)
        with pytest.raises(OSError):  # and it no longer listens
            socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
    finally:
        server.stop()


# --------------------------------------------------------------------------------------------------
# the JSON reader of well-formed requests (simdjson) against the pydantic models

ROW4 = "[0.5, -0.25, 1e-45, 3]"
ONE = '{"queries": [{"qid": "a", "embedding": [ROW]}]'  # one query; the rest of the body follows


def embedding_body(embedding: str, rest: str = "}") -> str:
    """A body of one query "a" with this embedding's JSON text, then ``rest``."""
    return '{"queries": [{"qid": "a", "embedding": ' + embedding + "}]" + rest


FAST_BODIES = {  # ROW: a token vector of 4 numbers
    # read by simdjson (fast: True), or left to the models (False), with the same outcome either way
    "search": (True, "search", '{"queries": [{"qid": "q1", "embedding": [ROW, ROW]}], "k": 3}'),
    "search-default-k": (True, "search", '{"queries": [{"embedding": [ROW], "qid": 7}]}'),
    "rerank": (
        True,
        "rerank",
        '{"queries": [{"qid": "a[1", "embedding": [ROW]}, {"qid": "b", "embedding": [ROW, ROW]}],'
        ' "candidates": {"a[1": ["d[0]", "d2", "\u00e9t\u00e9"], "b": []}, "k": null, "strict": true}',
    ),
    "rerank-missing-query": (True, "rerank", ONE + ', "candidates": {"z": ["d"]}}'),
    "overflow-to-inf": (True, "search", embedding_body("[[1e39, 0, 0, 0]]")),
    "nested-singleton": (False, "search", embedding_body("[[0.5, [1.0], 2, 3]]")),
    "row-not-array": (False, "search", embedding_body("[1, [[2]]]")),
    "escaped-bracket": (
        False,
        "rerank",
        embedding_body("[[0.5, [1.0], 2, 3]]", ', "candidates": {"a": ["\\u005b"]}}'),
    ),
    "ragged": (False, "search", embedding_body("[[1, 2], [3], [4, 5, 6]]")),
    "duplicate-key": (False, "search", ONE + ', "queries": []}'),
    "duplicate-query-key": (
        False,
        "search",
        '{"queries": [{"qid": "a", "qid": "b", "embedding": [ROW]}]}',
    ),
    "duplicate-candidates": (False, "rerank", ONE + ', "candidates": {"a": ["x"], "a": ["y"]}}'),
    "qid-bool": (False, "search", '{"queries": [{"qid": true, "embedding": [ROW]}]}'),
    "qid-float": (False, "search", '{"queries": [{"qid": 1.5, "embedding": [ROW]}]}'),
    "k-bool": (False, "search", ONE + ', "k": true}'),
    "k-float": (False, "search", ONE + ', "k": 2.0}'),
    "k-null-search": (False, "search", ONE + ', "k": null}'),
    "strict-int": (False, "rerank", ONE + ', "candidates": {}, "strict": 1}'),
    "strict-in-search": (False, "search", ONE + ', "strict": true}'),
    "bool-number": (False, "search", embedding_body("[[true, 1, 2, 3]]")),
    "huge-number": (False, "search", embedding_body("[[1e400, 1, 2, 3]]")),
    "docno-number": (False, "rerank", ONE + ', "candidates": {"a": [1]}}'),
    "candidates-list": (False, "rerank", ONE + ', "candidates": ["a"]}'),
    "trailing": (False, "search", ONE + "} x"),
    "empty-rows": (False, "search", embedding_body("[[]]")),
    "array-body": (False, "search", "[1, 2]"),
}


@pytest.mark.parametrize("name", list(FAST_BODIES))
def test_the_fast_json_reader_agrees_with_the_models(name, monkeypatch) -> None:
    """Every body gives the same checked request (bit for bit) or the same error with simdjson's reader
    as with the pydantic models alone; the well-formed ones are read by simdjson, the rest fall back."""
    from maxsim_cli.service import schema

    fast, kind, text = FAST_BODIES[name]
    body = text.replace("ROW", ROW4).encode()
    assert (schema._read_json_fast(kind, body) is not None) == fast

    def outcome():
        try:
            c = schema.check_request(kind, "application/json", body, {}, 4)
        except RequestError as exc:
            return ("error", exc.status, exc.message)
        return (
            c.ids,
            c.embeddings.dtype,
            c.embeddings.tobytes(),
            c.offsets.tolist(),
            c.k,
            c.candidates,
            c.strict,
        )

    with_simdjson = outcome()
    monkeypatch.setattr(schema, "simdjson", None)
    assert outcome() == with_simdjson


def test_a_request_of_realistic_size_is_read_by_simdjson_as_the_models_read_it(queries) -> None:
    from maxsim_cli.service import schema

    body = json.dumps(
        {
            "queries": [query_json(queries, 0), query_json(queries, 1)],
            "candidates": {queries.ids[0]: ["a", "b"]},
        }
    ).encode()
    fast = schema._read_json_fast("rerank", body)
    slow = schema._read_json_models("rerank", body, queries.dim)
    assert fast is not None
    assert fast[0] == slow[0] and fast[2:] == slow[2:]  # qids, k, candidates, strict
    assert [(a.shape, a.tobytes()) for a in fast[1]] == [(a.shape, a.tobytes()) for a in slow[1]]


def test_a_large_body_gets_a_parser_of_its_own(monkeypatch) -> None:
    """A thread keeps one parser for small bodies (its buffers grow to the largest it read); a body over
    KEPT_PARSER_BYTES is read by a parser freed with it, so the kept one stays small."""
    from maxsim_cli.service import schema

    small = ONE.replace("ROW", ROW4).encode() + b"}"
    assert schema._read_json_fast("search", small) is not None
    kept = schema._PARSERS.parser
    monkeypatch.setattr(schema, "KEPT_PARSER_BYTES", len(small))
    large = embedding_body("[" + ", ".join([ROW4] * 50) + "]").encode()
    read = schema._read_json_fast("search", large)
    assert read is not None and read[1][0].shape == (50, 4)
    assert schema._PARSERS.parser is kept
    assert schema._read_json_fast("search", small) is not None


def test_the_command_lines_defaults_are_the_librarys() -> None:
    """`maxsim serve` repeats the library's defaults (to keep FastAPI out of ``--help``): the same values."""
    from maxsim_cli.commands import serve as command
    from maxsim_cli.service import app as library
    from maxsim_cli.units import parse_size

    assert parse_size(command.DEFAULT_MAX_REQUEST_BYTES) == library.DEFAULT_MAX_REQUEST_BYTES
    for name in ("DEFAULT_WINDOW_MS", "DEFAULT_MAX_BATCH_QUERIES", "DEFAULT_DIRECT_CONNECTIONS"):
        assert getattr(command, name) == getattr(library, name), name
