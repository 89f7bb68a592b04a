"""`maxsim serve --workers N`: real servers on 127.0.0.1 (port 0) whose HTTP runs in worker processes.

Each answer and each refusal is compared byte for byte with the one-process server (`create_app` under
FastAPI's TestClient, what ``--workers 0`` runs) and with `maxsim score`'s run; then the processes: no
torch in a worker, a worker killed or sent SIGTERM is replaced, SIGTERM to the server finishes the
requests in flight and removes the server's folder, a worker that cannot start stops the server.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import struct
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*httpx2.*")
    from fastapi.testclient import TestClient  # noqa: E402
from test_score import _arrow_stream_bytes  # noqa: E402
from test_serve import (  # noqa: E402
    CORPUS,
    JSON_ERRORS,
    QUERY_FILE,
    TOKEN,
    Server,
    _load,
    arrow_stream,
    as_float32,
    cli_run,
    first_stage,
    hits_of,
    query_json,
    rows_of,
)
from typer.testing import CliRunner  # noqa: E402

from maxsim_cli import open_corpus, read_queries, search  # noqa: E402
from maxsim_cli.cli import app as cli_app  # noqa: E402
from maxsim_cli.service.app import create_app  # noqa: E402
from maxsim_cli.service.schema import ARROW_TYPE, parse_request  # noqa: E402
from maxsim_cli.shards import write_shard  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JSON = "application/json"


def wait_for(condition, what: str, timeout: float = 30) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def queries():
    return read_queries(QUERY_FILE)


@pytest.fixture(scope="module")
def local() -> Iterator[TestClient]:
    """The one-process server (`--workers 0`) on the same settings."""
    with open_corpus(CORPUS) as corpus:
        corpus.to("cpu")
        app = create_app(corpus, batch_window_ms=5, max_request_bytes=4 << 20, busy_poll_ms=2)
        with TestClient(app) as client:
            yield client


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # busy polling on (a CPU server has it off unless asked): each request announced to the scoring
    # process, the loops turning while answers are due; the answers must not change. No connection
    # taken over by the scoring process: every request here crosses from a worker (the connections the
    # scoring process serves itself have tests of their own, below)
    options = ["--workers", "2", "--batch-window-ms", "5", "--max-request-bytes", "4MiB"]
    options += ["--direct-connections", "0"]
    s = Server(CORPUS, *options, "--busy-poll-ms", "2")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def both(http: httpx.Client, local: TestClient, path: str, body: bytes, content_type: str = JSON):
    """The worker server's and the one-process server's answers to one request."""
    headers = {"content-type": content_type}
    return http.post(path, content=body, headers=headers), local.post(path, content=body, headers=headers)


def json_body(value: dict) -> bytes:
    import json

    return json.dumps(value).encode()


# --------------------------------------------------------------------------------------------------
# answers


def test_health_names_the_workers(http) -> None:
    health = http.get("/health").json()
    assert health["workers"] == 2 and health["documents"] == 400 and health["dtype"] == "float16"
    assert health["requests"] >= health["batches"] >= 0


def test_search_from_several_clients_equals_one_process_and_maxsim_score(server, local, queries) -> None:
    expected = cli_run("-k", "10")
    sizes = [1, 2, 3, 37, 5, 1, 20, 31, 1, 8, 40, 1, 50]
    starts = np.cumsum([0, *sizes])
    bodies = [
        json_body({"queries": [query_json(queries, i) for i in range(a, b)], "k": 10})
        for a, b in zip(starts[:-1], starts[1:], strict=True)
    ]

    def send(body: bytes) -> httpx.Response:
        with httpx.Client(base_url=server.url, timeout=30) as client:  # a connection each
            return client.post("/search", content=body, headers={"content-type": JSON})

    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(send, bodies))
    got: dict = {}
    for response, body in zip(responses, bodies, strict=True):
        assert response.status_code == 200, response.text
        alone = local.post("/search", content=body, headers={"content-type": JSON})
        assert response.content == alone.content
        got.update(hits_of(response.json()))
    assert as_float32(got) == expected


def test_a_corpus_on_several_devices_behind_workers_answers_as_one_process(local, queries) -> None:
    """`--devices cpu,cpu --workers 2`: the shards spread over two devices, every request scored on both
    and merged, HTTP in two workers: the bytes of the one-process, one-device server."""
    server = Server(CORPUS, "--workers", "2", where=("--devices", "cpu,cpu"))
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            health = client.get("/health").json()
            assert health["devices"] == ["cpu", "cpu"] and health["workers"] == 2
            stage = first_stage(4)
            for path, body in (
                ("/search", {"queries": [query_json(queries, i) for i in range(6)], "k": 7}),
                (
                    "/rerank",
                    {
                        "queries": [query_json(queries, queries.ids.index(q)) for q in stage],
                        "candidates": stage,
                    },
                ),
            ):
                content = json_body(body)
                response = client.post(path, content=content, headers={"content-type": JSON})
                assert response.status_code == 200, response.text
                alone = local.post(path, content=content, headers={"content-type": JSON})
                assert response.content == alone.content
    finally:
        server.stop()
    assert server.proc.returncode == 0, "".join(server.log)


def test_rerank_equals_one_process_and_maxsim_score(http, local, queries) -> None:
    stage = first_stage(20)
    wanted = [queries.ids.index(q) for q in stage]
    expected = cli_run("--candidates", "sample_data/candidates.trec", "-k", "5")
    body = {"queries": [query_json(queries, i) for i in wanted], "candidates": stage, "k": 5}
    ours, theirs = both(http, local, "/rerank", json_body(body))
    assert ours.status_code == 200 and ours.content == theirs.content
    assert as_float32(hits_of(ours.json())) == {q: expected[q] for q in stage}
    cands = {q: ["no-such-doc", *docnos] for q, docnos in stage.items()}
    ours, theirs = both(http, local, "/rerank", json_body({**body, "candidates": cands, "k": None}))
    assert ours.status_code == 200 and ours.content == theirs.content
    assert all(r["missing"] == ["no-such-doc"] for r in ours.json()["results"])


def test_arrow_requests_equal_one_process(http, local, queries, tmp_path) -> None:
    stream = arrow_stream(queries, list(range(10, 25)), tmp_path)
    ours, theirs = both(http, local, "/search?k=7", stream, ARROW_TYPE)
    assert ours.status_code == 200 and ours.content == theirs.content
    stage = first_stage(3)
    lists = [stage[q] + (["no-such-doc"] if n == 0 else []) for n, q in enumerate(stage)]
    body = arrow_stream(queries, [queries.ids.index(q) for q in stage], tmp_path, candidates=lists)
    for path in ("/rerank?k=4", "/rerank?strict=true"):
        ours, theirs = both(http, local, path, body, ARROW_TYPE)
        assert (ours.status_code, ours.content) == (theirs.status_code, theirs.content)


def test_answers_say_where_their_time_went(http, queries) -> None:
    response = http.post("/search", json={"queries": [query_json(queries, 0)], "k": 3})
    spans = dict(re.findall(r"(\w+);dur=([\d.]+)", response.headers["server-timing"]))
    assert list(spans) == ["parse", "ipc", "queue", "score", "encode"]
    assert all(float(v) >= 0 for v in spans.values()) and float(spans["score"]) > 0


BAD_TRANSPORT = [
    ("/search", b"hello", "text/plain"),
    ("/search", b"", JSON),
    ("/search", b"\x00" * 64, ARROW_TYPE),
    ("/search", json_body({"queries": [{"qid": "q1", "embedding": [[0.5] * 384]}] * 3000}), JSON),
    ("/search?k=3", json_body({"queries": [{"qid": "q1", "embedding": [[0.5] * 384]}]}), JSON),
]


def test_refusals_equal_one_process(http, local, queries, tmp_path) -> None:
    cases = [
        (path, body if isinstance(body, bytes) else json_body(body), JSON)
        for _, path, body, *_ in JSON_ERRORS
    ]
    stream = arrow_stream(queries, [0], tmp_path)
    cases += BAD_TRANSPORT + [
        ("/search?kk=1", stream, ARROW_TYPE),
        ("/search?k=zero", stream, ARROW_TYPE),
        ("/rerank", stream, ARROW_TYPE),
    ]
    for path, body, content_type in cases:
        ours, theirs = both(http, local, path, body, content_type)
        assert 400 <= ours.status_code < 500, (path, body[:80], ours.text)
        assert (ours.status_code, ours.content) == (theirs.status_code, theirs.content), (path, body[:80])
    assert http.get("/search").status_code == 405 and http.get("/nothing").status_code == 404


def test_workers_do_not_import_torch(server) -> None:
    workers = server.workers()
    assert len(workers) == 2
    assert "torch" in Path(f"/proc/{server.proc.pid}/maps").read_text()  # the check sees torch where it is
    for pid in workers:
        assert "torch" not in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "sigterm"])
def test_a_worker_that_exits_is_replaced(server, http, queries, how) -> None:
    before = server.workers()
    os.kill(before[0], how)
    wait_for(lambda: before[0] not in server.workers() and len(server.workers()) == 2, "a new worker")
    body = {"queries": [query_json(queries, 3)], "k": 2}
    with ThreadPoolExecutor(4) as pool:  # fresh connections, spread over both workers
        statuses = list(
            pool.map(lambda _: httpx.post(f"{server.url}/search", json=body).status_code, range(8))
        )
    assert statuses == [200] * 8
    assert any(f"pid {before[0]}) exited" in line for line in server.log)
    assert server.proc.poll() is None


# --------------------------------------------------------------------------------------------------
# an int8 corpus, int8 queries, a token


def quantized(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = rows.float()
    scales = values.abs().amax(dim=1).clamp_min(1e-12) / 127
    return torch.round(values / scales[:, None]).to(torch.int8), scales


def int8_query_stream(queries, ids: list[int], path: Path) -> bytes:
    rows = [queries.embeddings[int(queries.offsets[i]) : int(queries.offsets[i + 1])] for i in ids]
    pairs = [quantized(r) for r in rows]
    write_shard(path, [queries.ids[i] for i in ids], [q for q, _ in pairs], scales=[s for _, s in pairs])
    return _arrow_stream_bytes(path)


def test_int8_corpus_and_queries_with_a_token(tmp_path, queries) -> None:
    from maxsim_cli.quantize import quantize_corpus

    quantize_corpus([CORPUS], tmp_path / "int8", device="cpu", sample_queries=0)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    server = Server(str(tmp_path / "int8"), "--workers", "1", "--token-file", str(token_file))
    try:
        with open_corpus(tmp_path / "int8") as corpus:
            corpus.to("cpu")
            app = create_app(corpus, token=TOKEN, batch_window_ms=0)
            with TestClient(app) as local, httpx.Client(base_url=server.url, timeout=30) as http:
                for headers in ({}, {"authorization": "Bearer wrong-token-0123456789"}):
                    ours, theirs = http.get("/health", headers=headers), local.get("/health", headers=headers)
                    assert ours.status_code == 401 and ours.content == theirs.content
                    assert ours.headers["www-authenticate"] == "Bearer"
                auth = {"authorization": f"Bearer {TOKEN}"}
                assert http.get("/health", headers=auth).json()["dtype"] == "int8"
                body = json_body({"queries": [query_json(queries, i) for i in range(0, 200, 9)], "k": 5})
                stream = int8_query_stream(queries, list(range(0, 200, 13)), tmp_path / "q8.arrow")
                for path, content, kind in (("/search", body, JSON), ("/search?k=5", stream, ARROW_TYPE)):
                    headers = {**auth, "content-type": kind}
                    ours, theirs = (c.post(path, content=content, headers=headers) for c in (http, local))
                    assert ours.status_code == 200, ours.text
                    assert ours.content == theirs.content
                parsed = parse_request("search", ARROW_TYPE, stream, {"k": "5"}, corpus.dim)
                assert parsed.queries.dtype == "int8"
                expected = search(parsed.queries, corpus, k=5).to_dict()
                assert hits_of(ours.json()) == expected
    finally:
        server.stop()


# --------------------------------------------------------------------------------------------------
# connections the scoring process takes over (`maxsim_cli.service.takeover`)


def spans(response: httpx.Response) -> list[str]:
    return [name for name, _ in re.findall(r"(\w+);dur=([\d.]+)", response.headers["server-timing"])]


def post_json(client: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return client.post(path, content=body, headers={"content-type": JSON})


def raw_post(
    port: int, path: str, body: bytes, *, pieces: int = 1, sock: socket.socket | None = None
) -> bytes:
    """One request on a (new) connection, written at once or in ``pieces``; the response's bytes."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    data = head + body
    own = sock is None
    sock = sock or socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        step = -(-len(data) // pieces)
        for at in range(0, len(data), step):
            sock.sendall(data[at : at + step])
            if pieces > 1:
                time.sleep(0.02)
        response = b""
        while b"\r\n\r\n" not in response:
            response += sock.recv(65536)
        head_part, _, rest = response.partition(b"\r\n\r\n")
        size = int(re.search(rb"content-length: (\d+)", head_part, re.I).group(1))
        while len(rest) < size:
            rest += sock.recv(65536)
        return head_part + b"\r\n\r\n" + rest
    finally:
        if own:
            sock.close()


def test_a_lone_client_is_served_by_the_scoring_process_and_others_by_workers(local, queries) -> None:
    """The default: the first connection is taken over (no ``ipc``: no hop), a second one while the first
    is open is a worker's; both answer the one-process server's bytes; once the first closes, the next
    one is taken over again."""
    server = Server(CORPUS, "--workers", "2", "--batch-window-ms", "0")
    try:
        stage = first_stage(5)
        requests = [
            ("/search", json_body({"queries": [query_json(queries, i) for i in range(3)], "k": 7})),
            ("/rerank", json_body({"queries": [query_json(queries, queries.ids.index(q)) for q in stage],
                                   "candidates": stage})),
            ("/search", json_body({"queries": [{"qid": "q", "embedding": [[0.5] * 3]}]})),  # 422
        ]  # fmt: skip
        with httpx.Client(base_url=server.url, timeout=30) as first:
            for path, body in requests * 2:
                ours, theirs = both(first, local, path, body)
                assert (ours.status_code, ours.content) == (theirs.status_code, theirs.content)
            assert "ipc" not in spans(post_json(first, *requests[0]))
            with httpx.Client(base_url=server.url, timeout=30) as second:
                for path, body in requests:
                    ours, theirs = both(second, local, path, body)
                    assert (ours.status_code, ours.content) == (theirs.status_code, theirs.content)
                assert "ipc" in spans(post_json(second, *requests[0]))

        # the first is closed: its slot is free again for the next connection
        def next_is_taken() -> bool:
            with httpx.Client(base_url=server.url, timeout=30) as client:
                return "ipc" not in spans(post_json(client, *requests[0]))

        wait_for(next_is_taken, "a new connection to be taken over")
    finally:
        server.stop()
    assert server.proc.returncode == 0, "".join(server.log)


def test_a_request_written_with_the_connection_reaches_the_scoring_process_whole(local, queries) -> None:
    """A client that writes its request as it connects: the bytes the worker's loop had read before it
    paused the connection travel with it, whole or in pieces, on a new connection each time."""
    server = Server(CORPUS, "--workers", "1")
    try:
        body = json_body({"queries": [query_json(queries, 4)], "k": 5})
        want = local.post("/search", content=body, headers={"content-type": JSON})
        for pieces in (1, 1, 1, 3, 1, 7):
            # taken over: the lone connection is the scoring process's, once it has let the previous one
            # go (on a loaded machine that can come after the next connect: the worker then answers it,
            # correctly, and the request is sent again on a new connection)
            for _attempt in range(20):
                response = raw_post(server.port, "/search", body, pieces=pieces)
                head, _, content = response.partition(b"\r\n\r\n")
                assert b" 200 " in head.split(b"\r\n")[0] and content == want.content
                if b"ipc;" not in head:
                    break
                time.sleep(0.05)
            assert b"ipc;" not in head, pieces
        # two requests one after the other on one kept connection
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            for _ in range(2):
                assert raw_post(server.port, "/search", body, sock=sock).endswith(want.content)
    finally:
        server.stop()


def test_a_large_request_written_with_the_connection_reaches_the_scoring_process_whole(local) -> None:
    """A client that writes a large request (~0.8 MB) as it connects: the worker stops reading the
    connection while it offers it (uvloop starts reading only after the pause made as the connection is
    made), so no byte is read there after the ones it hands over with it. (They were lost: the request
    then waited for bytes that never came.)"""
    server = Server(CORPUS, "--workers", "1", "--body-timeout", "5")
    try:
        rng = np.random.default_rng(5)
        for attempt in range(12):
            vectors = rng.standard_normal((200, 384)).round(6)
            request = {
                "queries": [{"qid": f"q{i}", "embedding": [row.tolist()]} for i, row in enumerate(vectors)]
            }
            body = json_body({**request, "k": 2})
            want = local.post("/search", content=body, headers={"content-type": JSON})
            for _retry in range(20):  # until taken over (see the test above)
                response = raw_post(server.port, "/search", body)
                head, _, content = response.partition(b"\r\n\r\n")
                assert b" 200 " in head.split(b"\r\n")[0], (attempt, response[:300])
                assert content == want.content
                if b"ipc;" not in head:
                    break
                time.sleep(0.05)
            assert b"ipc;" not in head, attempt
    finally:
        server.stop()


def test_a_taken_connection_checks_the_token_and_the_body_limit(tmp_path, queries) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    server = Server(CORPUS, "--workers", "1", "--token-file", str(token_file), "--max-request-bytes", "1KiB")
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.get("/health").status_code == 401
            auth = {"authorization": f"Bearer {TOKEN}"}
            big = http.post("/search", json={"queries": [query_json(queries, 0)]}, headers=auth)
            assert big.status_code == 413 and "over the limit of 1024 bytes" in big.json()["detail"]
            health = http.get("/health", headers=auth)
            assert health.status_code == 200 and health.json()["workers"] == 1
    finally:
        server.stop()


def test_a_taken_connection_outlives_the_workers_and_an_idle_one_closes_at_sigterm(local, queries) -> None:
    """A connection the scoring process has taken over is its own: the workers killed (and replaced),
    it goes on answering; at SIGTERM, idle, it is closed at once and the server exits 0."""
    server = Server(CORPUS, "--workers", "2")
    try:
        body = json_body({"queries": [query_json(queries, 7)], "k": 6})
        want = local.post("/search", content=body, headers={"content-type": JSON}).content
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            assert raw_post(server.port, "/search", body, sock=sock).endswith(want)
            old = server.workers()
            for pid in old:
                os.kill(pid, signal.SIGKILL)
            wait_for(lambda: len(set(server.workers()) - set(old)) == 2, "two new workers")
            for _ in range(3):
                response = raw_post(server.port, "/search", body, sock=sock)
                assert response.endswith(want) and b"ipc;" not in response.partition(b"\r\n\r\n")[0]
            started = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            assert sock.recv(1) == b""  # closed by the server, not left to the keep-alive timeout
            assert server.proc.wait(timeout=30) == 0, "".join(server.log)
            assert time.monotonic() - started < 15
    finally:
        server.stop()


@pytest.mark.parametrize("value", ["-1", "one"])
def test_bad_direct_connections_option(value) -> None:
    result = CliRunner().invoke(cli_app, ["serve", CORPUS, "--device", "cpu", "--direct-connections", value])
    assert result.exit_code == 2, result.output
    assert "--direct-connections" in result.output and "Traceback" not in result.output


# --------------------------------------------------------------------------------------------------
# stopping, and a worker that cannot start


def test_sigterm_answers_the_requests_in_flight_then_exits_0(queries) -> None:
    server = Server(CORPUS, "--workers", "2", "--batch-window-ms", "2")
    try:
        folder = server.hub_folder()
        assert os.path.isdir(folder) and os.stat(folder).st_mode & 0o777 == 0o700
        bodies = [json_body({"queries": [query_json(queries, i)], "k": 4}) for i in range(6)]
        heads = [
            (
                f"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            for body in bodies
        ]
        socks = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in bodies]
        for sock, head, body in zip(socks, heads, bodies, strict=True):
            sock.sendall(head + body[: len(body) // 2])
        time.sleep(0.3)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert server.proc.poll() is None  # waiting for the requests in flight
        expected = search(queries, CORPUS, k=4, device="cpu").to_dict()
        for i, (sock, body) in enumerate(zip(socks, bodies, strict=True)):
            sock.sendall(body[len(body) // 2 :])
            response = b""
            while chunk := sock.recv(65536):
                response += chunk
            sock.close()
            status_line, _, rest = response.partition(b"\r\n")
            assert b" 200 " in status_line, response[:300]
            answer = httpx.Response(200, content=rest.partition(b"\r\n\r\n")[2]).json()
            assert hits_of(answer) == {queries.ids[i]: expected[queries.ids[i]]}
        assert server.proc.wait(timeout=60) == 0, "".join(server.log)
        assert not os.path.exists(folder)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
    finally:
        server.stop()


def test_a_worker_that_cannot_start_stops_the_server(tmp_path) -> None:
    # every worker process exits at once, before it has imported anything
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if 'maxsim_cli.service.front' in getattr(sys, 'orig_argv', ()):\n"
        "    print('maxsim: serve worker: cannot start', file=sys.stderr, flush=True)\n"
        "    os._exit(1)\n"
    )
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    server = Server(CORPUS, "--workers", "2", env={"PYTHONPATH": path}, wait=False)
    try:
        assert server.proc.wait(timeout=90) == 1, "".join(server.log)
        time.sleep(0.2)  # the rest of stderr
        errors = [line for line in server.log if line.startswith("maxsim: error:")]
        assert len(errors) == 1 and "before it was ready" in errors[0], "".join(server.log)
        assert not any("serving on" in line for line in server.log)
        assert not any(line.startswith("Traceback") for line in server.log)
    finally:
        server.stop()


def test_workers_die_with_a_killed_server_and_remove_its_folder() -> None:
    server = Server(CORPUS, "--workers", "2")
    try:
        folder, workers = server.hub_folder(), server.workers()
        server.proc.kill()
        server.proc.wait()
        wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in workers), "the workers to exit")
        wait_for(lambda: not os.path.exists(folder), "the folder to go")
    finally:
        server.stop()


@pytest.mark.parametrize("value", ["many", "-1", "65"])
def test_bad_workers_option(value) -> None:
    result = CliRunner().invoke(cli_app, ["serve", CORPUS, "--device", "cpu", "--workers", value])
    assert result.exit_code == 2, result.output
    assert "--workers" in result.output


@pytest.mark.parametrize("value", ["-1", "soon"])
def test_bad_busy_poll_option(value) -> None:
    result = CliRunner().invoke(cli_app, ["serve", CORPUS, "--device", "cpu", "--busy-poll-ms", value])
    assert result.exit_code == 2, result.output
    assert "--busy-poll-ms" in result.output and "Traceback" not in result.output


def test_a_negative_busy_poll_or_direct_connections_is_refused_by_the_library() -> None:
    from maxsim_cli.errors import UsageError
    from maxsim_cli.service.app import serve

    with pytest.raises(UsageError, match="--busy-poll-ms -1.0: must be 0 or more"):
        serve([CORPUS], busy_poll_ms=-1.0)
    with pytest.raises(UsageError, match="--direct-connections -1: must be 0 or more"):
        serve([CORPUS], direct_connections=-1)


def test_answer_frames_carry_the_hits_exactly() -> None:
    """An answer frame gives back each query's docnos, float32 score bits (-0.0, the smallest subnormal,
    the largest float32) and missing docnos; a frame whose scores do not match its hits is refused."""
    from maxsim_cli.service.schema import Hits
    from maxsim_cli.service.wire import FrameError, answer_frame, answers_from_frame

    scores = np.array([3.4028235e38, -0.0, 1e-45], dtype=np.float32)
    answers = [("q1", Hits(["d[1]", "é", "d3"], scores), ["gone"]), ("q2", Hits([], scores[:0]), None)]
    frame = answer_frame(7, answers, 0.001, 0.002, 3)
    head_len, size = struct.unpack("<II", frame[:8])
    header = json.loads(frame[8 : 8 + head_len])
    payload = frame[8 + head_len :]
    assert len(payload) == size and header["id"] == 7 and header["batch"] == 3
    back = answers_from_frame(header, payload)
    assert [(q, list(h.docnos), m) for q, h, m in back] == [
        ("q1", ["d[1]", "é", "d3"], ["gone"]),
        ("q2", [], None),
    ]
    assert back[0][1].scores.tobytes() == scores.tobytes()
    with pytest.raises(FrameError, match="2 scores for 3 hits"):
        answers_from_frame(header, payload[:8])


def unframe(frame: bytes) -> tuple[dict, bytes]:
    head_len, size = struct.unpack("<II", frame[:8])
    return json.loads(frame[8 : 8 + head_len]), frame[8 + head_len : 8 + head_len + size]


class FrameSink:
    """What the scoring process writes back to a worker: its frames, in order."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def write(self, frame: bytes) -> None:
        self.frames.append(frame)

    def is_closing(self) -> bool:
        return False


@pytest.mark.parametrize("on_gpus", [True, False], ids=["idle-quick", "queued"])
def test_a_request_frame_is_answered_now_or_queued_with_the_same_answer(
    queries, monkeypatch, on_gpus
) -> None:
    """The scoring process answers a quick request to an idle server straight from the worker's
    connection (`Batcher.score_now`; here the CPU corpus is said to be on GPUs) and any other through the
    batcher's queue: the same answer frame either way, that of `search`; a request that fails is an error
    frame either way."""
    import asyncio

    from maxsim_cli import Queries
    from maxsim_cli.service import batching
    from maxsim_cli.service.batching import Batcher, Scorer
    from maxsim_cli.service.schema import check_request
    from maxsim_cli.service.wire import answers_from_frame, request_frame
    from maxsim_cli.service.workers import Hub, _Worker

    monkeypatch.setattr(Scorer, "on_gpus", property(lambda self: on_gpus))
    # the second frame is parsed right after the first is scored; on a slow or loaded machine that can
    # take longer than the real gap, so the gap here is one no machine misses
    monkeypatch.setattr(batching, "QUICK_GAP_S", 30.0)
    queued: list[int] = []
    submit = Batcher.submit

    async def counted(self, kind, request, timing=None):  # noqa: ANN001, ANN202
        queued.append(1)
        return await submit(self, kind, request, timing)

    monkeypatch.setattr(Batcher, "submit", counted)
    body = json_body({"queries": [query_json(queries, 3)], "k": 4})
    checked = check_request("search", JSON, body, {}, queries.embeddings.shape[1])
    frame, bad = request_frame(11, "search", checked), request_frame(12, "search", checked)
    bad_header, bad_payload = unframe(bad)
    bad_header["k"] = "four"  # passes the frame's checks, fails in the scorer

    with open_corpus(CORPUS) as corpus:
        hub = Hub(corpus, socket.socket(), 1, token=None, max_request_bytes=1 << 20, batch_window_ms=0,
                  max_batch_queries=64, access_log=False, health=lambda b: {}, graceful_shutdown_s=1,
                  error_status=lambda exc: (500, type(exc).__name__))  # fmt: skip
        worker = _Worker(0, None, 0.0)  # type: ignore[arg-type]
        sink = FrameSink()

        async def main() -> None:
            await hub.batcher.start()
            try:
                hub._request(worker, "search", *unframe(frame), sink)  # type: ignore[arg-type]
                hub._request(worker, "search", bad_header, bad_payload, sink)  # type: ignore[arg-type]
                await asyncio.gather(*worker.tasks)
            finally:
                await hub.batcher.close()

        asyncio.run(main())
        one = Queries.from_embeddings([queries.ids[3]], [rows_of(queries, 3)])
        expected = search(one, corpus, k=4).to_dict()
    assert len(sink.frames) == 2
    header, payload = unframe(sink.frames[0])
    assert header["id"] == 11 and header["status"] == 200 and header["queue_s"] >= 0.0
    assert {q: list(h) for q, h, _ in answers_from_frame(header, payload)} == as_float32(expected)
    error, _ = unframe(sink.frames[1])
    assert error["id"] == 12 and error["status"] == 500
    # the second frame came right after the first was scored: queued either way (`QUICK_GAP_S`)
    assert len(queued) == (1 if on_gpus else 2)


def test_frames_that_waited_behind_a_scoring_are_batched(queries, monkeypatch) -> None:
    """A loaded server on GPUs: frames from several workers read one after another, as the event loop
    reads them once a scoring lets it. Only the first is scored at once (`score_now`); the others came
    right after it and go to the batcher's queue, where they are scored together, each answer that of
    the request alone."""
    import asyncio

    from maxsim_cli import Queries
    from maxsim_cli.service import batching
    from maxsim_cli.service.batching import Scorer
    from maxsim_cli.service.schema import check_request
    from maxsim_cli.service.wire import answers_from_frame, request_frame
    from maxsim_cli.service.workers import Hub, _Worker

    monkeypatch.setattr(Scorer, "on_gpus", property(lambda self: True))
    monkeypatch.setattr(batching, "QUICK_GAP_S", 30.0)  # each frame comes "right after" on any machine
    frames = []
    for i in range(8):
        body = json_body({"queries": [query_json(queries, i)], "k": 3})
        checked = check_request("search", JSON, body, {}, queries.embeddings.shape[1])
        frames.append(unframe(request_frame(100 + i, "search", checked)))
    with open_corpus(CORPUS) as corpus:
        hub = Hub(corpus, socket.socket(), 2, token=None, max_request_bytes=1 << 20, batch_window_ms=2,
                  max_batch_queries=64, access_log=False, health=lambda b: {}, graceful_shutdown_s=1,
                  error_status=lambda exc: (500, type(exc).__name__))  # fmt: skip
        workers = [_Worker(0, None, 0.0), _Worker(1, None, 0.0)]  # type: ignore[arg-type]
        sink = FrameSink()

        async def main() -> None:
            await hub.batcher.start()
            try:
                for i, (header, payload) in enumerate(frames):
                    hub._request(workers[i % 2], "search", header, payload, sink)  # type: ignore[arg-type]
                await asyncio.gather(*(task for w in workers for task in w.tasks))
            finally:
                await hub.batcher.close()

        asyncio.run(main())
        expected = search(
            Queries.from_embeddings(queries.ids[:8], [rows_of(queries, i) for i in range(8)]), corpus, k=3
        ).to_dict()
        counters = hub.batcher.counters
    assert len(sink.frames) == 8
    for frame in sink.frames:
        header, payload = unframe(frame)
        assert header["status"] == 200
        got = {q: list(h) for q, h, _ in answers_from_frame(header, payload)}
        assert got == as_float32({q: expected[q] for q in got})
    assert counters.requests == 8 and counters.largest > 1 and counters.batches < 8


def test_a_loaded_server_whose_requests_are_quick_batches_them(tmp_path, queries) -> None:
    """A real server whose scorer says its corpus is on GPUs (a ``sitecustomize`` in the scoring
    process), so that a lone quick request is scored as its frame is read: under 16 clients the frames
    that waited behind a scoring go to the queue and are scored in batches (one batch a request was the
    regression `QUICK_GAP_S` fixes), each answer that of `search`."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "argv = ' '.join(getattr(sys, 'orig_argv', ()))\n"
        "if 'maxsim_cli' in argv and 'service.front' not in argv:\n"
        "    from maxsim_cli.service import batching\n"
        "    batching.Scorer.on_gpus = property(lambda self: True)\n"
    )
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    server = Server(CORPUS, "--workers", "2", "--direct-connections", "0", env={"PYTHONPATH": path})
    try:
        expected = search(queries, CORPUS, k=3, device="cpu").to_dict()
        bodies = [{"queries": [query_json(queries, i % 200)], "k": 3} for i in range(240)]
        results = asyncio.run(_load(server.url, bodies, clients=16))
        for (status, answer), body in zip(results, bodies, strict=True):
            qid = body["queries"][0]["qid"]
            assert status == 200 and hits_of(answer) == {qid: expected[qid]}
        health = httpx.get(f"{server.url}/health").json()
        assert health["requests"] == 240 and health["batches"] < 0.8 * 240, health
    finally:
        server.stop()
