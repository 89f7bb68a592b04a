"""`maxsim serve` against slow clients: request headers and bodies that never finish, an answer never read,
more stalled connections than the server may open descriptors for; real servers on 127.0.0.1 (port 0),
with a lowered descriptor limit, one process and `--workers 1`.

Stalled clients: some send half a request line and headers, some the headers and half a body. Each is
answered 408 and closed after its time limit, a client that does not read its answer is cut off, and a
normal client is answered meanwhile; with more stalled connections than the descriptor limit, the
connections that waited longest are closed (503) to make room and the normal client is still answered.
"""

from __future__ import annotations

import asyncio
import json
import re
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from test_serve import CORPUS, QUERY_FILE, Server, query_json  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from maxsim_cli import read_queries  # noqa: E402
from maxsim_cli.cli import app as cli_app  # noqa: E402
from maxsim_cli.errors import MaxsimError, UsageError  # noqa: E402
from maxsim_cli.service.limits import (  # noqa: E402
    LISTEN_BACKLOG,
    MIN_BACKLOG,
    RESERVED_DESCRIPTORS,
    Budget,
    budget_note,
    descriptor_budget,
)

HEADERS_PART = b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl"
BODY_HEAD = (
    b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: 5000\r\n\r\n"
)
BODY_PART = b'{"queries": [{"qid": "q", "embedding": [[0.1, '
# How late past its limit a connection may be closed: the server's accept queue and a loaded 2-core
# machine.
SLACK_S = 4.0


def descriptor_limit(n: int) -> Callable[[], None]:
    """A preexec_fn: the child may open ``n`` descriptors (soft and hard: it cannot raise them)."""
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


@dataclass
class Stalled:
    """One stalled client: when the server's clock for it may have started at the earliest (its connect
    for headers, its headers sent for a body), when it stopped sending, what the server answered, when
    it closed (None: still open when the client gave up)."""

    kind: str
    started: float = 0.0
    stalled_at: float = 0.0
    answer: bytes = b""
    closed_at: float | None = None

    @property
    def status(self) -> int | None:
        match = re.match(rb"HTTP/1\.1 (\d+) ", self.answer)
        return int(match.group(1)) if match else None

    @property
    def detail(self) -> str:
        return json.loads(self.answer.partition(b"\r\n\r\n")[2])["detail"] if self.answer else ""


async def stall(port: int, kind: str, out: Stalled, give_up: asyncio.Event) -> None:
    """Connect, send part of a request (its headers, or its headers and part of its body), then only
    listen: until the server closes the connection or ``give_up`` is set."""
    out.started = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if kind == "body":
            out.started = time.monotonic()
        writer.write(HEADERS_PART if kind == "headers" else BODY_HEAD + BODY_PART)
        await writer.drain()
        out.stalled_at = time.monotonic()
        read = asyncio.ensure_future(reader.read())
        waiting = asyncio.ensure_future(give_up.wait())
        await asyncio.wait([read, waiting], return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if read.done():
            out.answer, out.closed_at = read.result(), time.monotonic()
        else:
            read.cancel()
    except ConnectionError:
        out.closed_at = time.monotonic()
    finally:
        writer.close()


async def stalled_crowd(
    port: int, count: int, while_stalled: Callable[[], asyncio.Future], give_up_after: float
) -> tuple[list[Stalled], object]:
    """``count`` stalled clients, half in their headers, half in their bodies, all connected before
    ``while_stalled()`` runs (a normal client); each listened to until closed or ``give_up_after``
    seconds. The stalled clients and what ``while_stalled`` gave."""
    give_up = asyncio.Event()
    crowd = [Stalled("headers" if i % 2 else "body") for i in range(count)]
    tasks = [asyncio.ensure_future(stall(port, s.kind, s, give_up)) for s in crowd]
    deadline = time.monotonic() + 30
    while any(s.stalled_at == 0.0 and not t.done() for s, t in zip(crowd, tasks, strict=True)):
        assert time.monotonic() < deadline, "the stalled clients could not connect"
        await asyncio.sleep(0.02)
    result = await while_stalled()
    asyncio.get_running_loop().call_later(give_up_after, give_up.set)
    await asyncio.gather(*tasks)
    return crowd, result


def search_body(queries, n: int = 1, k: int = 5) -> dict:
    return {"queries": [{**query_json(queries, i % len(queries)), "qid": f"q{i}"} for i in range(n)], "k": k}


async def normal_client(url: str, queries) -> list[tuple[int, float]]:
    """A health check and a search from a new client: (status, seconds) of each."""
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=20) as http:
        for method, path, body in (("GET", "/health", None), ("POST", "/search", search_body(queries))):
            started = time.monotonic()
            response = await http.request(method, path, json=body)
            out.append((response.status_code, time.monotonic() - started))
            if path == "/search":
                assert response.json()["results"][0]["qid"] == "q0"
    return out


class UnreadAnswer:
    """A search (400 one-token queries, a small body) whose answer (~8 MB) is bigger than the socket
    buffers (4 MB at most on Linux by default), sent by a client that reads the answer's first bytes and
    then nothing; a thread waits for those bytes (the answer being written) meanwhile."""

    def __init__(self, port: int, queries) -> None:
        one_token = [[0.5] * queries.dim]
        request = {"queries": [{"qid": f"q{i}", "embedding": one_token} for i in range(400)], "k": 400}
        body = json.dumps(request).encode()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", port))
        head = b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        self.sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        self.first = b""
        self.stopped_reading = 0.0
        self.thread = threading.Thread(target=self._first_bytes, daemon=True)
        self.thread.start()

    def _first_bytes(self) -> None:
        self.sock.settimeout(60)
        self.first = self.sock.recv(4096)
        self.stopped_reading = time.monotonic()

    def read_after(self, seconds: float) -> tuple[int, int]:
        """Read the rest once the client has read nothing for ``seconds``: the answer's Content-Length
        and the body bytes that came."""
        self.thread.join(60)
        time.sleep(max(0.0, self.stopped_reading + seconds - time.monotonic()))
        return read_all(self.sock, self.first)


def read_all(sock: socket.socket, data: bytes = b"") -> tuple[int, int]:
    """Read the socket to its end: the answer's Content-Length and the body bytes that came."""
    sock.settimeout(20)
    while True:
        try:
            part = sock.recv(1 << 20)
        except ConnectionError:
            break
        if not part:
            break
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    return int(re.search(rb"content-length: (\d+)", head, re.I).group(1)), len(body)


def wait_for_line(server: Server, fragment: str) -> str:
    """The server's first log line with ``fragment`` (a worker's may come after the serving line)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for line in list(server.log):
            if fragment in line:
                return line
        time.sleep(0.05)
    pytest.fail(f"no line with {fragment!r} in the log:\n" + "".join(server.log))


# --------------------------------------------------------------------------------------------------
# real servers


@pytest.fixture(scope="module")
def queries():
    return read_queries(QUERY_FILE)


@pytest.mark.parametrize("workers", ["0", "1"])
def test_stalled_clients_get_408_and_are_closed_while_a_normal_client_is_answered(queries, workers) -> None:
    """120 clients stalled in their headers or bodies, under a descriptor limit of 300: each gets 408
    and is closed after its own limit (1 s for headers, 2 s for a body), a normal client is answered
    meanwhile, and a client that reads none of its answer is cut off; nothing is logged as a failure.
    With `--workers 1` the first stalled connection is the scoring process's (taken over)."""
    server = Server(
        CORPUS,
        *("--workers", workers, "--header-timeout", "1", "--body-timeout", "2"),
        preexec_fn=descriptor_limit(300),
    )
    try:
        note = wait_for_line(server, "lowered to")
        assert re.search(r"--max-connections 1024 lowered to \d+: this process may open 300 desc", note)
        unread = UnreadAnswer(server.port, queries)
        started = time.monotonic()
        crowd, answered = asyncio.run(
            stalled_crowd(server.port, 120, lambda: normal_client(server.url, queries), give_up_after=20)
        )
        assert [status for status, _ in answered] == [200, 200]
        # the normal client was answered before the first stalled connection's limit
        assert time.monotonic() - started < 20 and max(seconds for _, seconds in answered) < 5
        for client in crowd:
            limit = 1.0 if client.kind == "headers" else 2.0
            option = "--header-timeout" if client.kind == "headers" else "--body-timeout"
            assert client.status == 408 and option in client.detail, (client, "".join(server.log))
            assert client.closed_at is not None
            assert client.closed_at - client.started >= limit - 0.01, client
            assert client.closed_at - client.stalled_at <= limit + SLACK_S, client
        size, came = unread.read_after(2.0 + 2.0)
        assert came < size, ("an answer the client did not read was written whole", unread.first)
        unread.sock.close()
        with httpx.Client(base_url=server.url, timeout=20) as http:
            assert http.get("/health").status_code == 200
    finally:
        server.stop()
    assert server.proc.returncode == 0, "".join(server.log)
    assert "Traceback" not in "".join(server.log) and "ERROR" not in "".join(server.log)


@pytest.mark.parametrize("workers", ["0", "1"])
def test_more_stalled_connections_than_descriptors_do_not_keep_a_normal_client_out(queries, workers) -> None:
    """The issue's case, scaled down: a server that may open 200 descriptors, 250 connections stalled
    in their headers or bodies with limits far away (60 s): the connections that waited longest are
    closed (503, or reset) to make room, at most the cap stay open, and a normal client is answered at
    once."""
    server = Server(
        CORPUS,
        *("--workers", workers, "--header-timeout", "60", "--body-timeout", "60"),
        preexec_fn=descriptor_limit(200),
    )
    try:
        cap = int(re.search(r"lowered to (\d+):", wait_for_line(server, "lowered to")).group(1))
        crowd, answered = asyncio.run(
            stalled_crowd(server.port, 250, lambda: normal_client(server.url, queries), give_up_after=3)
        )
        assert [status for status, _ in answered] == [200, 200]
        assert max(seconds for _, seconds in answered) < 5
        closed = [c for c in crowd if c.closed_at is not None]
        # each closed with a 503, or reset (one closed with its request unread: with workers, while it
        # waited to be offered to the scoring process)
        refused = [c for c in closed if c.answer]
        assert all(c.status == 503 and "--max-connections" in c.detail for c in refused), refused[:3]
        assert len(refused) > len(closed) // 2
        # the rest still open: at most the cap (the scoring process holds one more with --workers 1)
        assert len(crowd) - len(closed) <= cap + (workers == "1")
        assert len(closed) >= 250 - cap - 1
        with httpx.Client(base_url=server.url, timeout=20) as http:
            assert http.get("/health").status_code == 200
    finally:
        server.stop()
    assert server.proc.returncode == 0, "".join(server.log)
    log = "".join(server.log)
    assert "Traceback" not in log and "at the limit of" in log and log.count("at the limit of") <= 2


# --------------------------------------------------------------------------------------------------
# the options and the budget


@pytest.mark.parametrize(
    "option, value",
    [
        ("--header-timeout", "0"),
        ("--header-timeout", "-1"),
        ("--header-timeout", "soon"),
        ("--header-timeout", "nan"),
        ("--body-timeout", "0"),
        ("--body-timeout", "inf"),
        ("--max-connections", "0"),
        ("--max-connections", "many"),
    ],
)
def test_bad_limit_options(option, value) -> None:
    result = CliRunner().invoke(cli_app, ["serve", CORPUS, "--device", "cpu", option, value])
    assert result.exit_code == 2, result.output
    assert option in result.output and "Traceback" not in result.output


def test_bad_limits_are_refused_by_the_library() -> None:
    from maxsim_cli.service.app import serve

    with pytest.raises(UsageError, match="--header-timeout 0: must be a number of seconds above 0"):
        serve([CORPUS], header_timeout=0)
    with pytest.raises(UsageError, match="--body-timeout -2.0: must be"):
        serve([CORPUS], body_timeout=-2.0)
    with pytest.raises(UsageError, match="--max-connections 0: must be at least 1"):
        serve([CORPUS], max_connections=0)


def test_the_limit_options_have_help() -> None:
    result = CliRunner().invoke(cli_app, ["serve", "--help"], env={"COLUMNS": "200"})
    for option in ("--header-timeout", "--body-timeout", "--max-connections"):
        assert option in result.output


def test_the_descriptor_budget() -> None:
    # room to spare: the cap asked for and the whole listen queue
    def sizes(budget: Budget) -> tuple[int, int]:
        return budget.cap, budget.backlog

    assert sizes(descriptor_budget(1024, 1 << 20, 50)) == (1024, LISTEN_BACKLOG)
    # a small limit: the queue shrinks to a quarter of the room, then the cap
    room = 400 - 30 - RESERVED_DESCRIPTORS
    budget = descriptor_budget(1024, 400, 30)
    assert budget.backlog == room // 4 and budget.cap == room - room // 4
    assert budget.cap + budget.backlog + 30 + RESERVED_DESCRIPTORS <= 400
    assert "lowered to" in budget_note(budget, 1024) and budget_note(budget, budget.cap) is None
    # a cap that fits as asked, with a shorter queue
    assert sizes(descriptor_budget(200, 400, 30)) == (200, room - 200)
    assert descriptor_budget(1024, 120, 30).backlog == MIN_BACKLOG
    with pytest.raises(MaxsimError, match="too few to serve connections; raise the limit"):
        descriptor_budget(1024, 90, 30)
    assert sizes(descriptor_budget(5, -1, 30)) == (5, LISTEN_BACKLOG)  # no limit


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one() -> None:
    code = "from maxsim_cli.service.limits import raise_descriptor_limit as r; print(*r())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (100, 300)),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.split() == ["300", "300"]
