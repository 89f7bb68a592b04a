"""`maxsim serve COMPRESSED --exact-from CORPUS`: a compressed tier resident, the exact tier read per
request. Searches answer with the exact scores of the compressed tier's top depth, as `maxsim score
--exact-from` does; reranks score from the exact tier; answers say which scores they carry. Tiers of
sample_data's corpus quantized to 4-bit and 2-bit codes (small codebooks, on the CPU).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from tierlib import quantize

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

with warnings.catch_warnings():  # newer Starlette asks for httpx2 and still runs on httpx
    warnings.filterwarnings("ignore", message=".*httpx2.*")
    from fastapi.testclient import TestClient  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from maxsim_cli import Queries, open_corpus, read_queries, rerank, search  # noqa: E402
from maxsim_cli.cli import app as cli_app  # noqa: E402
from maxsim_cli.service.app import create_app  # noqa: E402
from maxsim_cli.service.schema import ARROW_TYPE, check_request  # noqa: E402
from maxsim_cli.service.wire import checked_from_frame, request_frame  # noqa: E402
from maxsim_cli.shards import write_shard  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_data"
CORPUS = str(SAMPLE / "corpus")
QUERY_FILE = str(SAMPLE / "queries.safetensors")
runner = CliRunner()
ASKED = list(range(0, 200, 7))  # the queries the tests send: 29 of the 200


@pytest.fixture(scope="module")
def queries() -> Queries:
    return read_queries(QUERY_FILE)


@pytest.fixture(scope="module", params=[4, 2])
def served(request, tiers) -> Iterator[tuple[int, TestClient]]:
    """A server of the compressed tier resident on the CPU, the exact tier read from its shards."""
    bits = request.param
    with open_corpus(tiers[bits]) as compressed, open_corpus(CORPUS) as exact:
        compressed.to("cpu")
        with TestClient(create_app(compressed, exact=exact, batch_window_ms=20)) as client:
            yield bits, client


def query_json(queries: Queries, i: int) -> dict:
    rows = queries.embeddings[int(queries.offsets[i]) : int(queries.offsets[i + 1])]
    return {"qid": queries.ids[i], "embedding": rows.float().tolist()}


def hits_of(answer: dict) -> dict[str, list[tuple[str, float]]]:
    return {r["qid"]: [(h["docno"], h["score"]) for h in r["hits"]] for r in answer["results"]}


def cli_run(compressed: str, *args: str) -> dict[str, list[tuple[str, float]]]:
    """`maxsim score QUERIES COMPRESSED --exact-from CORPUS`'s run: {qid: [(docno, float32 score)]}."""
    argv = ["score", QUERY_FILE, compressed, "--exact-from", CORPUS, "--device", "cpu", "--quiet", *args]
    result = runner.invoke(cli_app, argv)
    assert result.exit_code == 0, result.output
    out: dict[str, list[tuple[str, float]]] = {}
    for line in result.stdout.splitlines():
        qid, _, docno, _, score, _ = line.split()
        out.setdefault(qid, []).append((docno, float(np.float32(score))))
    return out


def as_float32(run: dict[str, list[tuple[str, float]]]) -> dict[str, list[tuple[str, float]]]:
    return {q: [(d, float(np.float32(s))) for d, s in rows] for q, rows in run.items()}


def assert_one_line_error(response, status: int, fragment: str) -> None:
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, str) and detail and "\n" not in detail
    assert fragment in detail, detail


def test_two_stage_searches_answer_as_maxsim_score_exact_from(served, tiers, queries) -> None:
    """Concurrent requests, some at depth 30 (below the corpus's 400 documents: the compressed tier
    decides what reaches the exact stage) and some at the default depth, batched together: each answer
    is `maxsim score --exact-from`'s run at its depth, bit for bit, and says its scores are exact."""
    bits, client = served
    at_30 = cli_run(tiers[bits], "-k", "10", "--depth", "30")
    default = cli_run(tiers[bits], "-k", "10")
    bodies = []
    for n, start in enumerate(range(0, len(ASKED), 4)):
        body = {"queries": [query_json(queries, i) for i in ASKED[start : start + 4]], "k": 10}
        if n % 2 == 0:
            body["depth"] = 30
        bodies.append(body)
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda body: client.post("/search", json=body), bodies))
    for response, body in zip(responses, bodies, strict=True):
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["scores"] == "exact"
        expected = at_30 if "depth" in body else default
        got = hits_of(answer)
        assert as_float32(got) == {qid: expected[qid] for qid in got}
        assert got == as_float32(got)  # the JSON numbers are the float32 scores themselves
    # the depth decides: at 30 some queries of the 2-bit tier miss one of the exact top 10
    if bits == 2:
        assert at_30 != default
    assert client.get("/health").json()["scores"] == "exact"


def test_arrow_search_takes_depth_in_the_query_string(served, tiers, queries, tmp_path) -> None:
    import pyarrow as pa

    bits, client = served
    path = tmp_path / "q.arrow"
    rows = [queries.embeddings[int(queries.offsets[i]) : int(queries.offsets[i + 1])] for i in ASKED]
    write_shard(path, [queries.ids[i] for i in ASKED], rows)
    with pa.memory_map(str(path)) as source:
        table = pa.ipc.open_file(source).read_all()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    body = sink.getvalue().to_pybytes()
    response = client.post("/search?k=5&depth=20", content=body, headers={"content-type": ARROW_TYPE})
    assert response.status_code == 200, response.text
    expected = search(queries, tiers[bits], k=5, exact_from=CORPUS, depth=20, device="cpu").to_dict()
    assert hits_of(response.json()) == {queries.ids[i]: expected[queries.ids[i]] for i in ASKED}
    assert response.json()["scores"] == "exact"
    refused = client.post("/search?k=10&depth=5", content=body, headers={"content-type": ARROW_TYPE})
    assert_one_line_error(refused, 422, "depth: 5 is below k (10)")


@pytest.mark.filterwarnings("ignore:.*not in the corpus")
def test_rerank_on_a_compressed_server(tiers, queries) -> None:
    """With the exact tier, a rerank scores from it (the library's rerank of CORPUS); without one, from
    the codes, and the answer says the scores are approximate (a search's too)."""
    stage = {queries.ids[i]: [f"{d}" for d in _some_docnos(i)] + ["no-such-doc"] for i in ASKED[:6]}
    body = {"queries": [query_json(queries, i) for i in ASKED[:6]], "candidates": stage, "k": 5}
    with open_corpus(tiers[4]) as compressed, open_corpus(CORPUS) as exact:
        compressed.to("cpu")
        with TestClient(create_app(compressed, exact=exact)) as client:
            answer = client.post("/rerank", json=body).json()
        assert answer["scores"] == "exact"
        assert hits_of(answer) == rerank(queries, CORPUS, stage, k=5, device="cpu").to_dict()
        assert all(r["missing"] == ["no-such-doc"] for r in answer["results"])
        with TestClient(create_app(compressed)) as client:
            answer = client.post("/rerank", json=body).json()
            assert answer["scores"] == "approximate"
            assert hits_of(answer) == rerank(queries, compressed, stage, k=5, device="cpu").to_dict()
            found = client.post("/search", json={"queries": [query_json(queries, 3)], "k": 4}).json()
            assert found["scores"] == "approximate"
            assert hits_of(found) == {
                queries.ids[3]: search(queries, compressed, k=4, device="cpu").to_dict()[queries.ids[3]]
            }
            assert client.get("/health").json()["scores"] == "approximate"
            # a depth needs an exact tier; the other requests of its batch are answered
            with_depth = {"queries": [query_json(queries, 3)], "k": 4, "depth": 50}
            plain = {"queries": [query_json(queries, 5)], "k": 4}
            with ThreadPoolExecutor(2) as pool:
                refused, fine = pool.map(lambda b: client.post("/search", json=b), [with_depth, plain])
            assert_one_line_error(refused, 422, "no exact tier")
            assert fine.status_code == 200


def _some_docnos(i: int) -> list[str]:
    with open_corpus(CORPUS) as corpus:
        ids = corpus.ids
    return [ids[(i * 13 + j * 17) % len(ids)] for j in range(12)]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"k": 10, "depth": 5}, "depth: 5 is below k (10)"),
        ({"k": 3, "depth": 0}, "depth: Input should be greater than or equal to 1"),
        ({"k": 3, "depth": "50"}, "depth: Input should be a valid integer"),
        ({"k": 3, "depth": 2.5}, "depth: Input should be a valid integer"),
    ],
)
def test_bad_depth_values_are_a_422_of_one_line(served, queries, body, fragment) -> None:
    _, client = served
    response = client.post("/search", json={"queries": [query_json(queries, 0)], **body})
    assert_one_line_error(response, 422, fragment)


def test_depth_is_no_field_of_a_rerank(served, queries) -> None:
    _, client = served
    body = {"queries": [query_json(queries, 0)], "candidates": {}, "depth": 50}
    assert_one_line_error(client.post("/rerank", json=body), 422, "depth: unknown field")


def test_the_fast_json_reader_reads_depth_as_the_models_do(queries) -> None:
    import json

    from maxsim_cli.service import schema

    body = json.dumps({"queries": [query_json(queries, 0)], "k": 3, "depth": 40}).encode()
    fast = schema._read_json_fast("search", body)
    assert fast is not None and fast[-1] == 40
    assert fast[-1] == schema._read_json_models("search", body, queries.dim)[-1]
    assert check_request("search", None, body, {}, queries.dim).depth == 40


def test_depth_crosses_to_the_scoring_process(queries) -> None:
    """`--workers`: a request's depth travels in its frame."""
    import json

    body = json.dumps({"queries": [query_json(queries, 0)], "k": 3, "depth": 40}).encode()
    checked = check_request("search", None, body, {}, queries.dim)
    frame = request_frame(7, "search", checked)
    import struct

    head_len, _ = struct.unpack("<II", frame[:8])
    header = json.loads(frame[8 : 8 + head_len])
    assert checked_from_frame(header, frame[8 + head_len :]).depth == 40
    header["depth"] = 0
    with pytest.raises(Exception, match="depth"):
        checked_from_frame(header, frame[8 + head_len :])


def _serve(*args: str):
    return runner.invoke(cli_app, ["serve", *args, "--device", "cpu", "--port", "0", "--no-metrics"])


def test_a_mismatched_pair_is_refused_at_start_up_in_one_line(tiers, tmp_path) -> None:
    half = tmp_path / "half"
    quantize(os.path.join(CORPUS, "shard-00000.safetensors"), str(half), 4)
    result = _serve(str(half), "--exact-from", CORPUS)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(half) in lines[0] and CORPUS in lines[0] and "quantized from" in lines[0]
    result = _serve(tiers[4], "--exact-from", tiers[2])  # an exact tier of codes
    assert result.exit_code == 1 and "codes" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = _serve(CORPUS, "--exact-from", CORPUS)  # a float corpus is no compressed tier
    assert result.exit_code == 1 and "records no single source corpus" in result.stderr
    result = runner.invoke(cli_app, ["serve", tiers[4], "--exact-from", CORPUS, "--devices", "0,1"])
    assert result.exit_code == 2 and "one device" in result.stderr


def test_the_answers_of_a_compressed_server_fit_the_openapi_schema(served, queries) -> None:
    from maxsim_cli.service import openapi

    _, client = served
    spec = client.get("/openapi.json").json()
    search_answer = client.post("/search", json={"queries": [query_json(queries, 0)], "k": 3, "depth": 9})
    body = {"queries": [query_json(queries, 0)], "candidates": {queries.ids[0]: _some_docnos(0)}}
    rerank_answer = client.post("/rerank", json=body)
    for model, response in ((openapi.SearchOut, search_answer), (openapi.RerankOut, rerank_answer)):
        assert response.status_code == 200, response.text
        model.model_validate_json(response.content)
        jsonschema = pytest.importorskip("jsonschema")
        schema = {"$ref": f"#/components/schemas/{model.__name__}", "components": spec["components"]}
        jsonschema.Draft202012Validator(schema).validate(response.json())
    depth = next(p for p in spec["paths"]["/search"]["post"]["parameters"] if p["name"] == "depth")
    assert depth["schema"]["minimum"] == 1
    assert "depth" in spec["components"]["schemas"]["SearchIn"]["properties"]
