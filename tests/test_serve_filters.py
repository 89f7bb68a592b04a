"""`maxsim serve` with filters: ``"include"`` / ``"exclude"`` per request, for /search and /rerank, JSON
and Arrow; requests of one batch with different filters each get their own; bad filters are a 422."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from test_serve import (
    ARROW_TYPE,
    CORPUS,
    QUERY_FILE,
    Batcher,
    Counters,
    Parsed,
    TestClient,
    arrow_stream,
    assert_one_line_error,
    first_stage,
    hits_of,
    query_json,
)

from maxsim_cli import open_corpus, read_queries, rerank, search
from maxsim_cli.service.app import create_app
from maxsim_cli.service.batching import Scorer


@pytest.fixture(scope="module")
def corpus():
    with open_corpus(CORPUS) as c:
        c.to("cpu")
        yield c


@pytest.fixture(scope="module")
def queries():
    return read_queries(QUERY_FILE)


@pytest.fixture(scope="module")
def client(corpus):
    with TestClient(create_app(corpus, batch_window_ms=20, max_request_bytes=4 << 20)) as c:
        yield c


def _filters(corpus):
    ids = sorted(corpus.ids)
    rng = np.random.default_rng(3)
    return rng.choice(ids, size=120, replace=False).tolist(), rng.choice(ids, size=60, replace=False).tolist()


def test_search_and_rerank_with_filters_answer_as_the_library(client, corpus, queries) -> None:
    include, exclude = _filters(corpus)
    body = {
        "queries": [query_json(queries, 0), query_json(queries, 1)],
        "k": 8,
        "include": include,
        "exclude": exclude,
    }
    answer = client.post("/search", json=body)
    assert answer.status_code == 200, answer.text
    want = search(_two(queries), corpus, k=8, include=include, exclude=exclude).to_dict()
    got = hits_of(answer.json())
    assert {q: [d for d, _ in rows] for q, rows in got.items()} == {
        q: [d for d, _ in rows] for q, rows in want.items()
    }
    allowed = set(include) - set(exclude)
    assert all(d in allowed for rows in got.values() for d, _ in rows)
    cands = first_stage(1)
    qid = next(iter(cands))
    i = queries.ids.index(qid)
    body = {"queries": [query_json(queries, i)], "candidates": cands, "exclude": cands[qid][:5]}
    answer = client.post("/rerank", json=body)
    assert answer.status_code == 200, answer.text
    result = answer.json()["results"][0]
    assert [h["docno"] for h in result["hits"]] == [
        d for d, _ in rerank(_one(queries, i), corpus, {qid: cands[qid][5:]}).to_dict()[qid]
    ]
    assert result["missing"] == []


def _two(queries):
    from maxsim_cli import Queries

    return Queries.from_embeddings(
        queries.ids[:2],
        [queries.embeddings[int(queries.offsets[i]) : int(queries.offsets[i + 1])] for i in range(2)],
    )


def _one(queries, i):
    from maxsim_cli import Queries

    return Queries.from_embeddings(
        [queries.ids[i]], [queries.embeddings[int(queries.offsets[i]) : int(queries.offsets[i + 1])]]
    )


def test_a_batch_of_different_filters_gives_each_request_its_own(corpus, queries) -> None:
    include, exclude = _filters(corpus)
    q = _two(queries)
    requests = [
        Parsed(q, 5),
        Parsed(q, 5, include=include),
        Parsed(q, 5, exclude=exclude),
        Parsed(q, 5, include=include, exclude=exclude),
        Parsed(q, 5, include=include),
    ]
    counters = Counters()

    async def main() -> list:
        batcher = Batcher(Scorer(corpus, counters=counters), window_s=0.5, max_queries=64)
        await batcher.start()
        try:
            return await asyncio.gather(*(batcher.submit("search", r) for r in requests))
        finally:
            await batcher.close()

    answers = asyncio.run(main())
    assert counters.batches == 1 and counters.largest == len(requests)
    for request, answer in zip(requests, answers, strict=True):
        alone = search(q, corpus, k=5, include=request.include, exclude=request.exclude).to_dict()
        assert {qid: list(hits) for qid, hits, _ in answer} == alone


def test_arrow_filters_are_list_columns(client, corpus, queries, tmp_path) -> None:
    import pyarrow as pa

    include, _ = _filters(corpus)
    body = arrow_stream(queries, [0, 1], tmp_path)
    table = pa.ipc.open_stream(body).read_all()
    table = table.append_column("include", pa.array([include, []], type=pa.list_(pa.string())))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    answer = client.post(
        "/search?k=6", content=sink.getvalue().to_pybytes(), headers={"Content-Type": ARROW_TYPE}
    )
    assert answer.status_code == 200, answer.text
    want = search(_two(queries), corpus, k=6, include=include).to_dict()
    assert {q: [d for d, _ in rows] for q, rows in hits_of(answer.json()).items()} == {
        q: [d for d, _ in rows] for q, rows in want.items()
    }
    bad = table.append_column("exclude", pa.array([1, 2], type=pa.int64()))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, bad.schema) as writer:
        writer.write_table(bad)
    answer = client.post(
        "/search", content=sink.getvalue().to_pybytes(), headers={"Content-Type": ARROW_TYPE}
    )
    assert_one_line_error(answer, 422, "'exclude' column is int64")


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"include": "d1"}, "include"),
        ({"include": ["d 1"]}, "whitespace"),
        ({"exclude": [1, 2]}, "exclude"),
        ({"exclude": [""]}, "empty"),
    ],
)
def test_bad_filters_are_a_422(client, queries, extra, fragment) -> None:
    answer = client.post("/search", json={"queries": [query_json(queries, 0)], **extra})
    assert_one_line_error(answer, 422, fragment)


def test_the_openapi_schema_names_the_filters(client) -> None:
    schema = client.get("/openapi.json").json()
    for model in ("SearchIn", "RerankIn"):
        properties = schema["components"]["schemas"][model]["properties"]
        assert "include" in properties and "exclude" in properties
