"""`maxsim serve`'s ``GET /metrics`` (Prometheus) and its OpenAPI schema (``/openapi.json``, ``/docs``).

Metrics: in process (FastAPI's TestClient, the one-process server's app), then real servers on
127.0.0.1 with ``--workers 0`` and ``--workers 1``, whose counts must be the whole server's whichever
process answers the scrape. The schema: every route described, every JSON example of docs/serve.md and
every real answer and error body valid against it.
"""

from __future__ import annotations

import json
import os
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
prometheus_client = pytest.importorskip("prometheus_client")

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*httpx2.*")
    from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_serve import (  # noqa: E402
    CORPUS,
    QUERY_FILE,
    TOKEN,
    Server,
    arrow_stream,
    assert_one_line_error,
    first_stage,
    post,
    query_json,
)

from maxsim_cli import open_corpus, read_queries  # noqa: E402
from maxsim_cli.service import metrics as metrics_module  # noqa: E402
from maxsim_cli.service import openapi  # noqa: E402
from maxsim_cli.service.app import create_app  # noqa: E402
from maxsim_cli.service.schema import ARROW_TYPE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "serve.md"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def corpus() -> Iterator:
    with open_corpus(CORPUS) as c:
        c.to("cpu")
        yield c


@pytest.fixture(scope="module")
def queries():
    return read_queries(QUERY_FILE)


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A scrape's samples: (sample name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def requests_of(samples: dict, endpoint: str, status: int) -> float:
    return value(samples, "maxsim_http_requests_total", endpoint=endpoint, status=str(status))


# --------------------------------------------------------------------------------------------------
# metrics, in process


def test_requests_errors_latency_batches_and_the_corpus(corpus, queries) -> None:
    with TestClient(create_app(corpus, batch_window_ms=0)) as client:
        body = {"queries": [query_json(queries, 0)], "k": 3}
        for _ in range(3):
            assert client.post("/search", json=body).status_code == 200
        rerank = {"queries": [query_json(queries, 1)], "candidates": {queries.ids[1]: corpus.ids[:5]}}
        assert client.post("/rerank", json=rerank).status_code == 200
        assert_one_line_error(post(client, "/search", b"{"), 400)
        assert_one_line_error(post(client, "/search", b"hi", "text/plain"), 415)
        assert_one_line_error(post(client, "/rerank", {"queries": [query_json(queries, 0)]}), 422)
        assert client.get("/no/such/path").status_code == 404
        assert client.get("/another-one").status_code == 404
        assert client.get("/search").status_code == 405
        assert client.get("/health").status_code == 200

        response = client.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        samples = scrape(response.text)
        counters = client.app.state.batcher.counters

    assert requests_of(samples, "/search", 200) == 3
    assert requests_of(samples, "/rerank", 200) == 1
    assert requests_of(samples, "/search", 400) == requests_of(samples, "/search", 415) == 1
    assert requests_of(samples, "/rerank", 422) == 1
    assert requests_of(samples, "other", 404) == 2  # any path that is no route: one label value
    assert requests_of(samples, "/search", 405) == 1
    assert requests_of(samples, "/health", 200) == 1
    assert requests_of(samples, "/metrics", 200) == 0  # counted once answered: in the next scrape
    errors = {labels: v for (name, labels), v in samples.items() if name == "maxsim_http_errors_total"}
    assert errors == {
        (("endpoint", "/search"), ("status", "400")): 1,
        (("endpoint", "/search"), ("status", "415")): 1,
        (("endpoint", "/rerank"), ("status", "422")): 1,
        (("endpoint", "other"), ("status", "404")): 2,
        (("endpoint", "/search"), ("status", "405")): 1,
    }
    count = value(samples, "maxsim_http_request_duration_seconds_count", endpoint="/search")
    assert count == 6 and value(samples, "maxsim_http_request_duration_seconds_sum", endpoint="/search") > 0
    inf = value(samples, "maxsim_http_request_duration_seconds_bucket", endpoint="/search", le="+Inf")
    assert inf == 6
    assert value(samples, "maxsim_batch_requests_count") == counters.batches == 4
    assert value(samples, "maxsim_batch_requests_sum") == counters.requests == 4
    assert value(samples, "maxsim_batch_requests_bucket", le="1.0") == 4
    assert value(samples, "maxsim_queue_depth") == 0
    assert value(samples, "maxsim_corpus_documents") == len(corpus) == 400
    assert value(samples, "maxsim_corpus_tokens") == corpus.num_tokens
    # resident on the CPU: the fp16 vectors (2 bytes a value) and each shard's document offsets
    offsets = 8 * (len(corpus) + len(corpus.shards))
    assert value(samples, "maxsim_corpus_bytes") == corpus.num_tokens * corpus.dim * 2 + offsets
    assert not any(name.startswith("maxsim_device_memory") for name, _ in samples)  # no GPU


def test_metrics_need_the_token_like_every_endpoint(corpus) -> None:
    with TestClient(create_app(corpus, token=TOKEN, batch_window_ms=0)) as client:
        refused = client.get("/metrics")
        assert_one_line_error(refused, 401, "bearer token")
        validator(client.get("/openapi.json", headers=AUTH).json(), "ErrorOut")(refused.json())
        assert_one_line_error(client.get("/metrics", headers={"authorization": "Bearer wrong"}), 401)
        assert_one_line_error(client.get("/openapi.json"), 401)
        assert_one_line_error(client.get("/docs"), 401)
        response = client.get("/metrics", headers=AUTH)
        assert response.status_code == 200
        assert requests_of(scrape(response.text), "/metrics", 401) == 2  # the refusals are counted
        assert client.get("/docs", headers=AUTH).status_code == 200


def test_device_memory_is_read_at_each_scrape(corpus, monkeypatch) -> None:
    """A corpus on GPUs: each one's memory as torch counts it, read when scraped."""
    reads = []

    def fake(devices):
        reads.append(list(devices))
        return {"cuda:0": (1000 + len(reads), 4096, 80 << 30), "cuda:1": (7, 8, 9)}

    monkeypatch.setattr(metrics_module, "device_memory", fake)
    with TestClient(create_app(corpus, batch_window_ms=0)) as client:
        first = scrape(client.get("/metrics").text)
        second = scrape(client.get("/metrics").text)
    assert value(first, "maxsim_device_memory_allocated_bytes", device="cuda:0") + 1 == value(
        second, "maxsim_device_memory_allocated_bytes", device="cuda:0"
    )
    assert value(second, "maxsim_device_memory_reserved_bytes", device="cuda:0") == 4096
    assert value(second, "maxsim_device_memory_total_bytes", device="cuda:0") == 80 << 30
    assert value(second, "maxsim_device_memory_total_bytes", device="cuda:1") == 9
    assert reads[0] == []  # the CPU corpus names no CUDA device: `device_memory` reads none


@pytest.mark.gpu
def test_device_memory_of_a_corpus_on_a_gpu() -> None:
    import torch

    with open_corpus(CORPUS) as corpus:
        corpus.to("cuda:0")
        with TestClient(create_app(corpus, batch_window_ms=0)) as client:
            samples = scrape(client.get("/metrics").text)
        allocated = value(samples, "maxsim_device_memory_allocated_bytes", device="cuda:0")
        assert allocated >= corpus.residency.nbytes
        assert value(samples, "maxsim_corpus_bytes") == corpus.residency.nbytes
        total = torch.cuda.get_device_properties(0).total_memory
        assert value(samples, "maxsim_device_memory_total_bytes", device="cuda:0") == total


def test_without_prometheus_client_or_with_no_metrics_the_endpoint_says_why(
    corpus, queries, monkeypatch
) -> None:
    with TestClient(create_app(corpus, batch_window_ms=0, metrics=False)) as client:
        assert_one_line_error(client.get("/metrics"), 404, "--no-metrics")
        assert client.post("/search", json={"queries": [query_json(queries, 0)]}).status_code == 200
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # `import prometheus_client` fails
    with TestClient(create_app(corpus, batch_window_ms=0)) as client:
        assert_one_line_error(client.get("/metrics"), 404, "pip install 'maxsim[serve]'")
        assert client.post("/search", json={"queries": [query_json(queries, 0)]}).status_code == 200


def test_a_scrape_that_fails_is_one_line(corpus, monkeypatch) -> None:
    """A worker whose scoring process is gone cannot have the gauges set: 503, one line, not a 500."""
    from maxsim_cli.service.schema import RequestError

    async def gone(self) -> bytes:
        raise RequestError(503, "the server is shutting down")

    monkeypatch.setattr(metrics_module.Metrics, "scrape", gone)
    with TestClient(create_app(corpus, batch_window_ms=0)) as client:
        assert_one_line_error(client.get("/metrics"), 503, "shutting down")


def test_the_documented_metrics_are_the_ones_exposed(corpus, monkeypatch) -> None:
    """The table of docs/serve.md, "GET /metrics", names every metric a scrape holds, and only those."""
    section = DOC.read_text().split("### `GET /metrics`", 1)[1].split("\n### ", 1)[0]
    table = re.findall(r"^\| `(maxsim_\w+)` \| (\w+) \|", section, flags=re.M)
    monkeypatch.setattr(metrics_module, "device_memory", lambda devices: {"cuda:0": (1, 2, 3)})
    with TestClient(create_app(corpus, batch_window_ms=0)) as client:
        client.get("/health")
        client.get("/nope")
        text = client.get("/metrics").text
    families = text_string_to_metric_families(text)
    exposed = {f.name: f.type for f in families if not f.name.endswith("_created")}  # prometheus-client's
    documented = {name.removesuffix("_total"): kind for name, kind in table}
    assert documented == exposed


# --------------------------------------------------------------------------------------------------
# metrics, real servers: one process, and a worker beside the scoring process


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["0", "1"])
def test_a_real_servers_metrics_count_every_process(workers, queries) -> None:
    """Requests answered by the scoring process (the connection it takes over, or the one process) and by
    a worker (a second connection, while the first is held): every scrape, in either process, counts
    them all; with workers the values live in a private folder, removed at exit."""
    server = Server(CORPUS, "--workers", workers, "--batch-window-ms", "0")
    folder = None
    try:
        body = {"queries": [query_json(queries, 0)], "k": 2}
        with (
            httpx.Client(base_url=server.url, timeout=30) as a,
            httpx.Client(base_url=server.url, timeout=30) as b,
        ):
            timings = [a.post("/search", json=body).headers["server-timing"] for _ in range(3)]
            timings += [b.post("/search", json=body).headers["server-timing"] for _ in range(2)]
            assert_one_line_error(
                b.post("/search", content=b"{", headers={"content-type": "application/json"}), 400
            )
            assert_one_line_error(
                a.post("/rerank", content=b"x", headers={"content-type": "text/plain"}), 415
            )
            through_worker = ["ipc;" in t for t in timings]
            # with a worker: the first connection is the scoring process's, the second the worker's
            assert through_worker == ([False] * 3 + [True] * 2 if workers == "1" else [False] * 5)
            if workers == "1":
                environ = Path(f"/proc/{server.workers()[0]}/environ").read_bytes().split(b"\0")
                folder = next(e for e in environ if e.startswith(b"PROMETHEUS_MULTIPROC_DIR=")).split(
                    b"=", 1
                )[1]
                assert os.path.isdir(folder) and oct(os.stat(folder).st_mode & 0o777) == "0o700"
            scrapes = [scrape(a.get("/metrics").text), scrape(b.get("/metrics").text)]
        for i, samples in enumerate(scrapes):
            assert requests_of(samples, "/search", 200) == 5
            assert requests_of(samples, "/search", 400) == requests_of(samples, "/rerank", 415) == 1
            assert requests_of(samples, "/metrics", 200) == i  # the first scrape, counted in the second
            assert value(samples, "maxsim_http_request_duration_seconds_count", endpoint="/search") == 6
            assert (
                value(samples, "maxsim_batch_requests_count")
                == value(samples, "maxsim_batch_requests_sum")
                == 5
            )
            assert value(samples, "maxsim_corpus_documents") == 400
            assert value(samples, "maxsim_queue_depth") == 0
        server.proc.terminate()
        assert server.proc.wait(timeout=30) == 0, "".join(server.log)
        if folder is not None:
            assert not os.path.exists(folder)
    finally:
        server.stop()


# --------------------------------------------------------------------------------------------------
# the OpenAPI schema


@pytest.fixture(scope="module")
def served(corpus) -> Iterator[tuple[TestClient, dict]]:
    with TestClient(create_app(corpus, batch_window_ms=0)) as client:
        response = client.get("/openapi.json")
        assert response.status_code == 200
        yield client, response.json()


def validator(spec: dict, model: str):
    """A function that raises when a value does not fit the schema's ``model`` (jsonschema, when
    installed), and when the pydantic model refuses it."""
    by_name = {m.__name__: m for m in openapi.MODELS}

    def check(value: object) -> None:
        by_name[model].model_validate_json(json.dumps(value))
        if jsonschema is not None:
            schema = {"$ref": f"#/components/schemas/{model}", "components": spec["components"]}
            jsonschema.Draft202012Validator(schema).validate(value)

    return check


try:
    import jsonschema
except ImportError:  # pragma: no cover - the pydantic models still check every example
    jsonschema = None


def test_the_schema_describes_every_route_and_its_errors(served) -> None:
    client, spec = served
    assert spec["openapi"].startswith("3.1") and spec["info"]["title"] == "maxsim"
    hidden = {"/openapi.json", "/docs"}
    routes = {(route.path, method.lower()) for route in client.app.routes for method in route.methods or ()}
    described = {(path, method) for path, item in spec["paths"].items() for method in item}
    assert {r for r in routes if r[0] not in hidden and r[1] != "head"} == described
    documented = set(re.findall(r"^\| (\d{3}) \|", DOC.read_text(), flags=re.M))  # the "Errors" table
    for path, answer in (("/search", "SearchOut"), ("/rerank", "RerankOut")):
        post_item = spec["paths"][path]["post"]
        content = post_item["requestBody"]["content"]
        assert set(content) == {"application/json", ARROW_TYPE}
        assert post_item["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(answer)
        errors = {status for status in post_item["responses"] if status != "200"}
        assert errors == documented
        for status in errors:
            schema = post_item["responses"][status]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorOut"}
        # the schema's own examples are valid requests
        example = content["application/json"]["example"]
        validator(spec, content["application/json"]["schema"]["$ref"].rsplit("/", 1)[1])(example)
    search_parameters = {p["name"] for p in spec["paths"]["/search"]["post"]["parameters"]}
    assert search_parameters == {"k", "explain", "depth", "where"}
    rerank_parameters = {p["name"] for p in spec["paths"]["/rerank"]["post"]["parameters"]}
    assert rerank_parameters == {"k", "strict", "explain", "where"}
    for path in ("/health", "/metrics"):
        assert "401" in spec["paths"][path]["get"]["responses"]
    assert "security" not in spec


def test_a_server_with_a_token_says_so_in_its_schema(corpus) -> None:
    with TestClient(create_app(corpus, token=TOKEN, batch_window_ms=0)) as client:
        spec = client.get("/openapi.json", headers=AUTH).json()
    assert spec["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "The token of --token-file",
    }
    assert spec["security"] == [{"bearer": []}]


def test_the_schema_is_a_valid_openapi_document(served) -> None:
    validate = pytest.importorskip("openapi_spec_validator").validate
    validate(served[1])


def doc_examples() -> list[tuple[str, object]]:
    """Every JSON example of docs/serve.md (the ```json blocks and the bodies of its curl commands), each
    with the model it shows. An ellipsis stands for more of the same: ", ..." is dropped, "[...]" is
    an empty list."""
    text = DOC.read_text()
    blocks = re.findall(r"```json\n(.*?)```", text, flags=re.S)
    blocks += re.findall(r"-d '(\{.*?\})'", text, flags=re.S)
    out = []
    for block in blocks:
        plain = re.sub(r"\[\s*\.\.\.\s*\]", "[]", re.sub(r",\s*\.\.\.", "", block))
        example = json.loads(plain)
        if "queries" in example:
            model = "RerankIn" if "candidates" in example else "SearchIn"
        elif "results" in example:
            model = "RerankOut" if any("missing" in r for r in example["results"]) else "SearchOut"
        elif "detail" in example:
            model = "ErrorOut"
        elif "changed" in example:
            model = "ReloadOut"
        else:
            model = "HealthOut"
        out.append((model, example))
    return out


def test_the_schema_validates_the_examples_of_the_docs(served) -> None:
    _, spec = served
    examples = doc_examples()
    shown = {model for model, _ in examples}
    assert shown == {"SearchIn", "SearchOut", "RerankIn", "RerankOut", "ErrorOut", "HealthOut", "ReloadOut"}
    for model, example in examples:
        validator(spec, model)(example)
    # and the schema is strict enough to tell them apart
    search_in = next(example for model, example in examples if model == "SearchIn")
    rerank_out = next(example for model, example in examples if model == "RerankOut")
    for model, wrong in (
        ("SearchIn", {**search_in, "kk": 3}),
        ("SearchIn", {**search_in, "k": "10"}),
        ("SearchOut", rerank_out),
        ("ErrorOut", {"detail": ["a", "list"]}),
    ):
        with pytest.raises(Exception):  # noqa: B017 - pydantic's ValidationError or jsonschema's
            validator(spec, model)(wrong)


def test_real_answers_and_error_bodies_fit_the_schema(served, queries, tmp_path) -> None:
    client, spec = served
    search = client.post("/search", json={"queries": [query_json(queries, 0)], "k": 3})
    validator(spec, "SearchOut")(search.json())
    explained = client.post("/search", json={"queries": [query_json(queries, 0)], "k": 2, "explain": True})
    assert "explanation" in explained.json()["results"][0]["hits"][0]
    validator(spec, "SearchOut")(explained.json())
    candidates = first_stage(1)
    (qid,) = candidates
    i = queries.ids.index(qid)
    rerank = client.post(
        "/rerank", json={"queries": [query_json(queries, i)], "candidates": {qid: [*candidates[qid], "x"]}}
    )
    validator(spec, "RerankOut")(rerank.json())
    assert rerank.json()["results"][0]["missing"] == ["x"]
    arrow = client.post(
        "/search?k=2", content=arrow_stream(queries, [0], tmp_path), headers={"content-type": ARROW_TYPE}
    )
    validator(spec, "SearchOut")(arrow.json())
    validator(spec, "HealthOut")(client.get("/health").json())
    refusals = [
        post(client, "/search", b"{"),
        post(client, "/search", b"hi", "text/plain"),
        post(client, "/search", {"queries": [{"qid": "q", "embedding": [[1.0, 2.0]]}]}),
        post(client, "/rerank", b"x", ARROW_TYPE),
        client.get("/nope"),
        client.get("/search"),
    ]
    statuses = [response.status_code for response in refusals]
    assert statuses == [400, 415, 422, 400, 404, 405]
    for response in refusals:
        validator(spec, "ErrorOut")(response.json())
