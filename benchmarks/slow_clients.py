"""`maxsim serve` against a crowd of stalled clients, under a low descriptor limit: are they closed, and is
a normal client answered meanwhile?

    python benchmarks/slow_clients.py --out benchmarks/results/serve/slow-clients-cpu.json
    python benchmarks/slow_clients.py --workers 2 --in-headers 250

Starts ``python -m maxsim_cli serve CORPUS --device cpu --port 0`` on 127.0.0.1 with its descriptor limit
(soft and hard, so it cannot raise it) at ``--fd-limit`` (400), opens ``--stalled`` (500) connections that
each send a request's headers and the first bytes of its body (``--in-headers N`` of them: half a
request line and headers instead) and then nothing, and once all are connected, has a normal client
send ``--probes`` (5) requests, ``GET /health`` and a one-query ``POST /search`` on a new connection
each (10 s limit each). Then it watches the stalled connections for ``--wait`` (40) seconds from the
last one's stall: when each is closed and with what (408: a time limit; 503: closed to make room for a
new connection; reset: closed with nothing said). One line on stdout says it all; ``--out`` writes the
details as JSON. ``--source DIR`` runs the server from another source tree (e.g. an older commit's,
``git archive``), for a before and after; ``--server-args`` passes options to it.

Everything is on loopback and bounded: the server is stopped with SIGTERM (then killed) at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADERS_PART = b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl"
BODY_HEAD = (
    b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: 5000\r\n\r\n"
)
BODY_PART = b'{"queries": [{"qid": "q", "embedding": [[0.1, '
PROBE_LIMIT_S = 10.0


@dataclass
class Stalled:
    kind: str
    stalled_at: float = 0.0
    closed_after_s: float | None = None
    outcome: str = "open"  # open, 408, 503, ..., reset, refused (could not connect)


@dataclass
class Probe:
    path: str
    status: int | None = None  # None: failed (closed, reset, or no answer in time)
    seconds: float = 0.0
    error: str = ""


@dataclass
class Run:
    stalled: list[Stalled] = field(default_factory=list)
    probes: list[Probe] = field(default_factory=list)
    server_log: list[str] = field(default_factory=list)


class Server:
    """The server in a subprocess with its descriptor limit lowered; stderr kept by a thread."""

    def __init__(self, corpus: str, fd_limit: int, source: str | None, args: list[str]) -> None:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        if source:
            env["PYTHONPATH"] = os.path.abspath(source) + os.pathsep + env.get("PYTHONPATH", "")
        command = [
            sys.executable,
            "-m",
            "maxsim_cli",
            "serve",
            corpus,
            "--device",
            "cpu",
            "--port",
            "0",
            *args,
        ]
        self.proc = subprocess.Popen(
            command,
            cwd=os.path.abspath(source) if source else ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit)),
        )
        self.log: list[str] = []
        self.port = 0
        started = threading.Event()

        def drain() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.log.append(line.rstrip("\n"))
                match = re.search(r"serving on http://127\.0\.0\.1:(\d+)", line)
                if match:
                    self.port = int(match.group(1))
                    started.set()

        threading.Thread(target=drain, daemon=True).start()
        deadline = time.monotonic() + 120
        while not started.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                sys.exit("the server did not start:\n" + "\n".join(self.log))
        time.sleep(1.0)  # workers' own lines, if any

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def stall(port: int, client: Stalled, give_up: asyncio.Event) -> None:
    """Connect, send part of a request, then listen until the server closes or ``give_up``."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 30)
    except (OSError, asyncio.TimeoutError):
        client.outcome = "refused"
        return
    try:
        writer.write(HEADERS_PART if client.kind == "headers" else BODY_HEAD + BODY_PART)
        await writer.drain()
        client.stalled_at = time.monotonic()
        read = asyncio.ensure_future(reader.read())
        waiting = asyncio.ensure_future(give_up.wait())
        await asyncio.wait([read, waiting], return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if read.done():
            client.closed_after_s = time.monotonic() - client.stalled_at
            answer = read.result()
            match = re.match(rb"HTTP/1\.[01] (\d+) ", answer)
            client.outcome = match.group(1).decode() if match else ("reset" if not answer else "other")
        else:
            read.cancel()
    except ConnectionError:
        client.closed_after_s = time.monotonic() - client.stalled_at if client.stalled_at else 0.0
        client.outcome = "reset"
    finally:
        writer.close()


async def probe(port: int, path: str, body: bytes | None) -> Probe:
    """One request on a new connection (``Connection: close``), read to its end."""
    out = Probe(path)
    method = "POST" if body is not None else "GET"
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    started = time.monotonic()
    try:

        async def exchange() -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(head.encode() + b"\r\n" + (body or b""))
                await writer.drain()
                return await reader.read()
            finally:
                writer.close()

        answer = await asyncio.wait_for(exchange(), PROBE_LIMIT_S)
        match = re.match(rb"HTTP/1\.[01] (\d+) ", answer)
        out.status = int(match.group(1)) if match else None
        if out.status is None:
            out.error = "closed without an answer"
    except (OSError, asyncio.TimeoutError) as exc:
        out.error = type(exc).__name__
    out.seconds = time.monotonic() - started
    return out


async def scenario(port: int, args: argparse.Namespace, dim: int) -> Run:
    run = Run(stalled=[Stalled("headers" if i < args.in_headers else "body") for i in range(args.stalled)])
    give_up = asyncio.Event()
    tasks = [asyncio.ensure_future(stall(port, client, give_up)) for client in run.stalled]
    deadline = time.monotonic() + 60
    while any(c.stalled_at == 0.0 and not t.done() for c, t in zip(run.stalled, tasks, strict=True)):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    search = json.dumps({"queries": [{"qid": "q", "embedding": [[0.1] * dim]}], "k": 5}).encode()
    for i in range(args.probes):
        run.probes.append(
            await probe(port, "/health", None) if i % 2 == 0 else await probe(port, "/search", search)
        )
    last_stall = max((c.stalled_at for c in run.stalled if c.stalled_at), default=time.monotonic())
    asyncio.get_running_loop().call_at(
        asyncio.get_running_loop().time() + max(0.0, last_stall + args.wait - time.monotonic()), give_up.set
    )
    await asyncio.gather(*tasks)
    return run


def corpus_dim(port: int) -> int:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as answer:
        return int(json.loads(answer.read())["dim"])


def summary(run: Run, args: argparse.Namespace) -> str:
    """The one line: the crowd, the normal client's answers, what was left open and how the rest closed."""
    where = "mid-body" if args.in_headers == 0 else f"{args.in_headers} in their headers, the rest mid-body"
    answered = [p for p in run.probes if p.status == 200]
    median_ms = statistics.median(p.seconds for p in answered) * 1000 if answered else float("nan")
    cap = next(
        (m.group(1) for line in run.server_log for m in [re.search(r"lowered to (\d+)", line)] if m), None
    )
    limit = f"descriptor limit {args.fd_limit}" + (f" (connection cap {cap})" if cap else "")
    closed: dict[str, list[float]] = {}
    for client in run.stalled:
        if client.outcome not in ("open", "refused"):
            closed.setdefault(client.outcome, []).append(client.closed_after_s or 0.0)
    still_open = sum(c.outcome == "open" for c in run.stalled)
    refused = sum(c.outcome == "refused" for c in run.stalled)
    parts = [
        f"{len(closed[k])} closed {k} after {min(closed[k]):.1f}-{max(closed[k]):.1f} s"
        for k in sorted(closed)
    ]
    failures = sorted({p.error or str(p.status) for p in run.probes if p.status != 200})
    return (
        f"{args.stalled} connections stalled {where}, {limit}: a new client answered "
        f"{len(answered)}/{len(run.probes)}"
        + (f" (median {median_ms:.0f} ms)" if answered else "")
        + (f", failed: {', '.join(failures)}" if failures else "")
        + f"; after {args.wait:g} s: {still_open} of {args.stalled} still open"
        + (f" ({'; '.join(parts)})" if parts else "")
        + (f"; {refused} could not connect" if refused else "")
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--corpus", default=os.path.join(ROOT, "sample_data", "corpus"))
    parser.add_argument("--stalled", type=int, default=500, help="stalled connections (default 500)")
    parser.add_argument(
        "--in-headers", type=int, default=0, help="of them, stalled in their headers (default 0)"
    )
    parser.add_argument(
        "--fd-limit", type=int, default=400, help="the server's descriptor limit (default 400)"
    )
    parser.add_argument("--workers", default="0", help="the server's --workers (default 0)")
    parser.add_argument("--probes", type=int, default=5, help="the normal client's requests (default 5)")
    parser.add_argument(
        "--wait", type=float, default=40.0, help="seconds to watch the stalled ones (default 40)"
    )
    parser.add_argument("--source", help="run the server from this source tree (PYTHONPATH)")
    parser.add_argument("--server-args", default="", help="more options for maxsim serve, one string")
    parser.add_argument("--out", help="write the details as JSON here")
    args = parser.parse_args()
    if not 0 <= args.in_headers <= args.stalled:
        parser.error("--in-headers: 0 to --stalled")
    server = Server(
        args.corpus, args.fd_limit, args.source, ["--workers", args.workers, *args.server_args.split()]
    )
    try:
        run = asyncio.run(scenario(server.port, args, corpus_dim(server.port)))
    finally:
        server.stop()
    run.server_log = server.log
    line = summary(run, args)
    print(line)
    if args.out:
        from common import meta, write_json

        write_json(
            args.out,
            {
                "meta": meta(),
                "summary": line,
                "args": vars(args),
                "exit_code": server.proc.returncode,
                **asdict(run),
            },
        )


if __name__ == "__main__":
    main()
