"""Arrow from outside (request bodies, `maxsim score -`, shard files) and the server's client errors.

Arrow's reads trust a stream's offsets, null counts and UTF-8: a string offset that points past its
buffer is read as it stands, which kills the process. Each stream and shard is fully validated before a
value is read, so a crafted one is a one-line error: HTTP 400 (the server answers and goes on), exit 1
naming the file. The server's other client errors (a field name that is not UTF-8, a ``k`` that is not
a number, scores that overflow float32) are 4xx with one line and no traceback in the log, and name the
request's own qids whatever the request was batched with.
"""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from typer.testing import CliRunner

from maxsim_cli.cli import app as cli_app
from maxsim_cli.errors import InputError
from maxsim_cli.shards import open_shard, write_shard

ROOT = Path(__file__).resolve().parents[1]
CORPUS = str(ROOT / "sample_data" / "corpus")
DIM = 384  # the sample corpus's
ARROW_TYPE = "application/vnd.apache.arrow.stream"
runner = CliRunner()


# --------------------------------------------------------------------------------------------------
# crafted Arrow


def query_table(tmp: Path, ids: list[str], dim: int = DIM, name: str = "q.arrow") -> pa.Table:
    """Queries ``ids`` (two tokens each) as the table of a query shard, read back from an Arrow file."""
    rows = [torch.full((2, dim), 0.25 * (i + 1), dtype=torch.float16) for i in range(len(ids))]
    path = tmp / name
    write_shard(path, ids, rows)
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all().combine_chunks()


def with_offset(array: pa.Array, slot: int, value: int) -> pa.Array:
    """``array`` (a string or list array) with its int32 offset ``slot`` set to ``value``: the buffers
    as a foreign writer could send them, which pyarrow takes without a full validation."""
    buffers = array.buffers()
    offsets = np.frombuffer(buffers[1], dtype=np.int32, count=len(array) + 1).copy()
    offsets[slot] = value
    rest = buffers[2:] if pa.types.is_string(array.type) else []
    children = None if pa.types.is_string(array.type) else [array.values]
    return pa.Array.from_buffers(
        array.type, len(array), [buffers[0], pa.py_buffer(offsets.tobytes()), *rest], children=children
    )


def with_false_null_count(array: pa.Array) -> pa.Array:
    """``array`` with a validity bitmap of no nulls that says it holds one (read as it stands, a count of
    nulls that are not there)."""
    bitmap = pa.py_buffer(np.packbits(np.ones(len(array), bool), bitorder="little").tobytes())
    buffers = array.buffers()
    if pa.types.is_string(array.type):
        return pa.Array.from_buffers(array.type, len(array), [bitmap, *buffers[1:3]], null_count=1)
    return pa.Array.from_buffers(
        array.type, len(array), [bitmap, buffers[1]], null_count=1, children=[array.values]
    )


def replaced(table: pa.Table, name: str, column: pa.Array) -> pa.Table:
    i = table.schema.get_field_index(name)
    return table.set_column(i, table.schema.field(i), column)


def ipc_bytes(table: pa.Table, *, stream: bool = True) -> bytes:
    sink = pa.BufferOutputStream()
    new = pa.ipc.new_stream if stream else pa.ipc.new_file
    with new(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def crafted_rerank_body(tmp: Path) -> bytes:
    """A `/rerank` stream whose `candidates` strings have an offset in the middle that points past their
    buffer (the last offset is in range, so only a full validation sees it)."""
    table = query_table(tmp, ["q1", "q2"])
    docnos = pa.array(["d1", "d2", "d3", "d4"], type=pa.string())
    lists = pa.ListArray.from_arrays(pa.array([0, 2, 4], pa.int32()), with_offset(docnos, 2, 1 << 30))
    return ipc_bytes(table.append_column("candidates", lists))


def non_utf8_name(data: bytes, name: bytes) -> bytes:
    """``data`` with the field name ``name`` made invalid UTF-8 (its last byte 0xFF, same length)."""
    assert data.count(name) >= 1
    return data.replace(name, name[:-1] + b"\xff")


# --------------------------------------------------------------------------------------------------
# the server


def test_the_crafted_rerank_body_was_a_crash_and_is_a_400_in_the_check_itself(tmp_path) -> None:
    """The check a request goes through (`check_request`, in the scoring process or a worker), run in a
    process of its own: a crash would be a signal, not a failed assertion of pytest's process."""
    body = tmp_path / "body.arrows"
    body.write_bytes(crafted_rerank_body(tmp_path))
    code = (
        "import sys\n"
        "from maxsim_cli.service.schema import ARROW_TYPE, RequestError, check_request\n"
        "try:\n"
        "    check_request('rerank', ARROW_TYPE, open(sys.argv[1], 'rb').read(), {}, 384)\n"
        "except RequestError as exc:\n"
        "    print(exc.status, exc.message)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(body)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (done.returncode, done.stderr)
    status, _, message = done.stdout.strip().partition(" ")
    assert status == "400" and "\n" not in message
    assert "<request>: record batch 0 is corrupt" in message and "out of bounds" in message


@pytest.mark.slow
def test_a_real_server_answers_the_crafted_body_400_and_stays_up(tmp_path) -> None:
    """`maxsim serve --workers 1`: the crafted body on the connection the scoring process takes over and
    on a second one, served by the worker; both 400 with one line, and no process died or was replaced."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from test_serve import Server

    body = crafted_rerank_body(tmp_path)
    server = Server(CORPUS, "--workers", "1")
    try:
        workers = server.workers()
        with (
            httpx.Client(base_url=server.url, timeout=30) as first,
            httpx.Client(base_url=server.url, timeout=30) as second,
        ):
            for client in (first, second, first):
                response = client.post("/rerank", content=body, headers={"content-type": ARROW_TYPE})
                assert response.status_code == 400, response.text
                detail = response.json()["detail"]
                assert "\n" not in detail and "corrupt" in detail
            assert first.get("/health").status_code == 200
        assert server.proc.poll() is None and server.workers() == workers
    finally:
        server.stop()
    assert server.proc.returncode == 0
    assert not any("Traceback" in line for line in server.log), "".join(server.log)


@pytest.fixture(scope="module")
def corpus() -> Iterator:
    from maxsim_cli import open_corpus

    with open_corpus(CORPUS) as c:
        c.to("cpu")
        yield c


@pytest.fixture(scope="module")
def client(corpus) -> Iterator:
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from maxsim_cli.service.app import create_app

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*httpx2.*")
        from fastapi.testclient import TestClient
    with TestClient(create_app(corpus)) as c:
        yield c


def assert_client_error(response, status: int, *fragments: str) -> str:
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, str) and detail and "\n" not in detail
    for fragment in fragments:
        assert fragment in detail, detail
    return detail


def arrow_post(client, path: str, body: bytes):
    return client.post(path, content=body, headers={"content-type": ARROW_TYPE})


def test_corrupt_arrow_bodies_are_400s(client, tmp_path) -> None:
    """Corrupt bodies that do not crash an unchecked reader (the crafted one is tried in processes of
    its own, above), refused the same way."""
    table = query_table(tmp_path, ["q1", "q2"])
    docnos = pa.array(["d1", "d2"], type=pa.string())
    bodies = {
        "candidates null count": ipc_bytes(
            table.append_column(
                "candidates",
                pa.ListArray.from_arrays(pa.array([0, 1, 2], pa.int32()), with_false_null_count(docnos)),
            )
        ),
        "id offset": ipc_bytes(replaced(table, "id", with_offset(table.column("id").chunk(0), 1, 1 << 20))),
        "id null count": ipc_bytes(replaced(table, "id", with_false_null_count(table.column("id").chunk(0)))),
        "embedding null count": ipc_bytes(
            replaced(table, "embedding", with_false_null_count(table.column("embedding").chunk(0)))
        ),
    }
    for what, body in bodies.items():
        path = "/rerank" if what.startswith("candidates") else "/search"
        assert_client_error(arrow_post(client, path, body), 400, "<request>: record batch 0 is corrupt")
    assert client.get("/health").status_code == 200


def test_client_errors_are_4xx_with_one_line_and_no_traceback(client, tmp_path, caplog) -> None:
    table = query_table(tmp_path, ["q1", "q2"])
    lists = pa.array([["d1"], ["d2"]], type=pa.list_(pa.string()))
    good = ipc_bytes(table.append_column("candidates", lists))
    assert arrow_post(client, "/rerank", good).status_code == 200
    caplog.set_level(logging.INFO, logger="maxsim")
    assert_client_error(
        arrow_post(client, "/rerank", non_utf8_name(good, b"candidates")), 422, "column 2", "not valid UTF-8"
    )
    assert_client_error(arrow_post(client, "/search", non_utf8_name(good, b"embedding")), 422, "UTF-8")
    assert_client_error(arrow_post(client, "/search?k=\u00b2", good), 422, "k='\u00b2'", "whole number")
    detail = assert_client_error(arrow_post(client, "/search?k=" + "9" * 5000, good), 422, "5000 characters")
    assert len(detail) < 200
    assert_client_error(arrow_post(client, "/rerank?k=5&strict=" + "x" * 5000, good), 422, "strict=")
    twice = ipc_bytes(table.append_column("candidates", lists).append_column("candidates", lists))
    assert_client_error(arrow_post(client, "/rerank", twice), 422, "more than one 'candidates'")
    # scores past float32's range from finite values: /search and /rerank alike
    big = {"qid": "big-q", "embedding": [[3e38] * DIM, [-3e38] * DIM]}
    assert_client_error(client.post("/search", json={"queries": [big]}), 422, "'big-q'", "overflow float32")
    rerank = {"queries": [big], "candidates": {"big-q": ["zstd", "heaptrack"]}}
    assert_client_error(client.post("/rerank", json=rerank), 422, "'big-q'", "overflow float32")
    assert client.get("/health").status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info], caplog.text


def overflow_jobs(queries_kind: str, corpus) -> list:
    """Three one-query requests, the middle one's scores overflow float32; every qid is "q"."""
    from maxsim_cli import Queries
    from maxsim_cli.service.batching import Job
    from maxsim_cli.service.schema import Parsed

    rows = [np.full((2, DIM), v, np.float32) for v in (0.01, 3e38, -0.02)]
    docnos = [corpus.shards[0].ids[i] for i in range(4)]
    jobs = []
    for r in rows:
        queries = Queries.from_embeddings(["q"], [r])
        candidates = {"q": docnos} if queries_kind == "rerank" else None
        jobs.append(Job(queries_kind, Parsed(queries, 3, candidates)))
    return jobs


@pytest.mark.parametrize("path", ["search", "rerank-resident", "rerank-library"])
def test_a_batch_error_names_the_requests_own_qid(corpus, path, monkeypatch) -> None:
    """A request that fails in a batch fails alone, with a message naming its qid (not the batch's
    internal id of it, such as '1.0'); its batch mates are answered."""
    from maxsim_cli.service.batching import Scorer

    kind = path.split("-")[0]
    if path == "rerank-library":
        monkeypatch.setattr(Scorer, "_rerank_resident", lambda self, jobs, residency: None)
    scorer = Scorer(corpus)
    results = scorer.score(overflow_jobs(kind, corpus))
    assert isinstance(results[1], InputError), results[1]
    message = str(results[1])
    assert "for query 'q' is not finite" in message and "'1.0'" not in message
    for i in (0, 2):
        qid, hits, _ = results[i][0]
        assert qid == "q" and len(hits) == 3


def test_a_batcher_answers_each_request_under_its_own_qids(corpus) -> None:
    """Two requests that use the same qids, batched: each answer carries the request's own qids."""
    from maxsim_cli import Queries
    from maxsim_cli.service.batching import Batcher, Counters, Scorer
    from maxsim_cli.service.schema import Parsed

    def request(value: float) -> Parsed:
        rows = [np.full((1, DIM), value, np.float32), np.full((1, DIM), -value, np.float32)]
        return Parsed(Queries.from_embeddings(["a", "b"], rows), 2)

    counters = Counters()

    async def main() -> list:
        batcher = Batcher(Scorer(corpus, counters=counters), window_s=0.5)
        await batcher.start()
        try:
            return await asyncio.gather(*(batcher.submit("search", request(v)) for v in (0.01, 0.02)))
        finally:
            await batcher.close()

    answers = asyncio.run(main())
    assert counters.largest == 2
    assert [[qid for qid, _, _ in answer] for answer in answers] == [["a", "b"], ["a", "b"]]


# --------------------------------------------------------------------------------------------------
# shard files and `maxsim score -`


def error_of(function: Callable[..., object], *args: object) -> str:
    """``function(*args)``'s exception as ``"Type: message"`` ("" when it returns), the exception itself
    dropped: pytest's report of an exception from a reader shows the frames' arguments, and the repr of
    a corrupt record batch reads it unchecked."""
    try:
        function(*args)
    except Exception as exc:  # noqa: BLE001 - any exception is the answer
        return f"{type(exc).__name__}: {exc}"
    return ""


def corrupt_tables(tmp: Path) -> dict[str, pa.Table]:
    """Query tables that pass Arrow's basic validation but not its full one."""
    table = query_table(tmp, ["q1", "q2", "q3"], dim=8)
    ids, emb = table.column("id").chunk(0), table.column("embedding").chunk(0)
    other = pa.array(["x", "y", "z"], type=pa.string())
    return {
        "id offset": replaced(table, "id", with_offset(ids, 1, 1 << 20)),
        "id null count": replaced(table, "id", with_false_null_count(ids)),
        "embedding null count": replaced(table, "embedding", with_false_null_count(emb)),
        "an unread column's offset": table.append_column("note", with_offset(other, 2, 1 << 20)),
    }


@pytest.mark.parametrize("stream", [False, True], ids=["file", "stream"])
def test_a_corrupt_arrow_shard_is_one_line_naming_the_file(tmp_path, stream) -> None:
    for what, table in corrupt_tables(tmp_path).items():
        path = tmp_path / "bad.arrow"
        path.write_bytes(ipc_bytes(table, stream=stream))
        if what.startswith("an unread"):  # a shard file's other columns are never read: not checked
            with open_shard(path) as shard:
                assert shard.read_docs(0, 3).num_docs == 3
            continue
        message = error_of(open_shard, path)
        pattern = r"^InputError: .*bad\.arrow: column '\w+' of record batch 0 .* is corrupt"
        assert re.search(pattern, message), (what, message)


@pytest.mark.parametrize("suffix", [".arrow", ".parquet"])
def test_a_field_name_that_is_not_utf8_is_one_line_naming_the_file(tmp_path, suffix) -> None:
    good = tmp_path / f"good{suffix}"
    write_shard(good, ["d1", "d2"], [np.ones((1, 8), np.float32)] * 2)
    bad = tmp_path / f"bad{suffix}"
    bad.write_bytes(non_utf8_name(good.read_bytes(), b"embedding"))
    assert re.search(rf"^InputError: .*bad\{suffix}: .*not valid UTF-8", error_of(open_shard, bad))
    result = runner.invoke(cli_app, ["inspect", str(bad)])
    assert result.exit_code == 1 and "bad" in result.stderr and "UTF-8" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_score_from_stdin_refuses_a_corrupt_stream_with_one_line(tmp_path) -> None:
    """`maxsim score -`: a stream that is corrupt anywhere, an unread column too, or has a field name that
    is not UTF-8, is one line naming <stdin>, exit 1, no run."""
    corpus = tmp_path / "c.safetensors"
    write_shard(corpus, ["c1", "c2"], [np.ones((1, 8), np.float32)] * 2)
    good = ipc_bytes(query_table(tmp_path, ["q1", "q2", "q3"], dim=8))

    def score(data: bytes):
        return runner.invoke(cli_app, ["score", "-", str(corpus), "--device", "cpu", "--quiet"], input=data)

    result = score(good)
    assert result.exit_code == 0 and len(result.stdout.splitlines()) == 6, result.output
    cases = {
        what: (ipc_bytes(table), "record batch 0 is corrupt")
        for what, table in corrupt_tables(tmp_path).items()
    }
    cases["field name"] = (non_utf8_name(good, b"embedding"), "not valid UTF-8")
    for what, (data, fragment) in cases.items():
        result = score(data)
        assert result.exit_code == 1, (what, result.output)
        assert "error: <stdin>: " in result.stderr and fragment in result.stderr, (what, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and result.stdout == "", what


def test_pack_refuses_a_corrupt_source_table_with_one_line(tmp_path) -> None:
    """`maxsim pack` reads foreign tables: a source whose id offsets point past their buffer was a crash
    (run in a process of its own); a column name that is not UTF-8 was a traceback."""
    ids = pa.array(["a", "b", "c"], type=pa.string())
    vectors = pa.array([[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]]], type=pa.list_(pa.list_(pa.float32(), 2)))
    source = tmp_path / "src.arrow"
    source.write_bytes(
        ipc_bytes(pa.table({"id": with_offset(ids, 1, 1 << 30), "embedding": vectors}), stream=False)
    )
    done = subprocess.run(
        [sys.executable, "-m", "maxsim_cli", "pack", str(source), "-o", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "src.arrow: rows 0..2: column 'id' is corrupt" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    source.write_bytes(non_utf8_name(ipc_bytes(pa.table({"id": ids, "embedding": vectors})), b"embedding"))
    result = runner.invoke(cli_app, ["pack", str(source), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1 and "src.arrow: a column name is not valid UTF-8" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
