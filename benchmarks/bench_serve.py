"""`maxsim serve` under load: an asyncio + httpx load generator on loopback, bounded in requests and time.

    python benchmarks/bench_serve.py --client-processes 4 --out benchmarks/results/serve/serve-h200.json
    python benchmarks/bench_serve.py --device cpu --size 16MB --rerank-docs 1200 --clients 8 \\
        --search-requests 400 --rerank-requests 100 --workdir /tmp/mb-serve \\
        --out benchmarks/results/serve/serve-cpu-2core.json

Builds (once, under --workdir) two corpora of fp16, L2-normalised random vectors, d = 128: the search
corpus of `bench_resident.py` (documents of 20-300 tokens, ``--size``) and a rerank corpus of
``--rerank-docs`` documents of exactly 180 tokens; queries are 32 random tokens. Then:

1. **rerank, one client**: the in-process ``rerank`` call (1 query x 1000 candidates, the corpus
   resident on ``--device``, called from one worker thread as the server calls it) and the server's own
   scoring step for the same request (`Scorer.score`), then the same requests to a ``maxsim serve`` of
   that corpus from one client, one at a time (``k`` unset: all 1000 re-sorted): JSON bodies over a bare
   socket (request bytes built beforehand, as a C load generator sends them) and through the standard
   library's ``http.client`` (one keep-alive connection each), the same query as an Arrow IPC stream,
   and JSON through httpx's asyncio client; latency p50 / p99 of each.
2. **search, N clients**: the in-process ``search`` of one query and of N queries at once, then
   ``--clients`` concurrent clients (closed loop: each sends its next single-query request, k = 10, as
   soon as the last is answered) against a ``maxsim serve`` of the search corpus: queries/s over the
   run, latency p50 / p99, and the server's RSS before and after. ``--client-processes P`` shares the
   clients among P processes, so that the Python load generator is not what limits the rate.

Every answer of a distinct request is compared with the in-process call (same docnos, same float32
scores). Servers run as ``python -m maxsim_cli serve ... --port 0`` on 127.0.0.1 and are stopped with
SIGTERM (their exit code is recorded). Nothing listens beyond loopback. ``--metrics off`` starts them
with ``--no-metrics`` (two runs compare what ``GET /metrics`` costs). ``--workers N`` is passed to
the servers (left out: the server's own default, ``auto``); the search run records the number the server
reports and the CPU time per request of the server's main thread (event loop: HTTP, or with workers the
frames to and from them), of its whole process, and of its worker processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from common import DIM, QUERY_TOKENS, build_corpus, make_log, meta, write_json

log = make_log("serve", clock=True)
RERANK_TOKENS = 180
CANDIDATES = 1000
DISTINCT = 64  # distinct requests of each kind, cycled through


def percentile(values: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(values), p)) if values else float("nan")


def summary_ms(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "mean_ms": round(statistics.fmean(ms), 3) if ms else float("nan"),
        "min_ms": round(min(ms), 3) if ms else float("nan"),
    }


# --------------------------------------------------------------------------------------------------
# inputs


def build_rerank_corpus(root: str, docs: int, device: torch.device) -> str:
    """``docs`` documents of exactly 180 tokens in one shard (reused when there)."""
    from maxsim_cli.shards import write_shard

    path = os.path.join(root, f"rerank-{docs}x{RERANK_TOKENS}.safetensors")
    if os.path.exists(path):
        return path
    os.makedirs(root, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(3)
    emb = torch.randn(docs * RERANK_TOKENS, DIM, generator=gen, device=device)
    emb = torch.nn.functional.normalize(emb, dim=1).to(torch.float16).cpu()
    offsets = torch.arange(0, docs * RERANK_TOKENS + 1, RERANK_TOKENS, dtype=torch.int64)
    write_shard(
        path, [f"r{i:07d}" for i in range(docs)], emb, offsets=offsets, dtype="float16", normalized=True
    )
    return path


def make_queries(n: int, seed: int) -> list[np.ndarray]:
    """n queries of 32 fp16 tokens (as float32 arrays holding fp16 values: exact in JSON)."""
    gen = torch.Generator().manual_seed(seed)
    emb = torch.nn.functional.normalize(torch.randn(n * QUERY_TOKENS, DIM, generator=gen), dim=1)
    emb = emb.to(torch.float16).float().numpy()
    return [emb[i * QUERY_TOKENS : (i + 1) * QUERY_TOKENS] for i in range(n)]


def on_worker_thread(fn: Callable[[], None]) -> None:
    """Run ``fn`` on a thread of its own, as the server scores its batches (on the 2-core CPU machine the
    same CPU calls ran up to 2x slower from the main thread)."""
    with ThreadPoolExecutor(1) as pool:
        pool.submit(fn).result()


def free_device_memory() -> None:
    """Hand the in-process corpus's GPU memory back before a server needs it."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def hits(answer: dict) -> dict[str, list[tuple[str, float]]]:
    return {r["qid"]: [(h["docno"], h["score"]) for h in r["hits"]] for r in answer["results"]}


# --------------------------------------------------------------------------------------------------
# the server


class Server:
    """``maxsim serve`` on 127.0.0.1, a free port, its stderr in a log file."""

    def __init__(
        self,
        corpus: str,
        device: str,
        window_ms: float,
        log_path: str,
        workers: str | None = None,
        busy_poll_ms: str | None = None,
        direct_connections: str | None = None,
        metrics: bool = True,
    ) -> None:
        self.log_path = log_path
        self.log_file = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "maxsim_cli", "serve", corpus, "--device", device, "--port", "0",
               "--batch-window-ms", str(window_ms)]  # fmt: skip
        if workers is not None:
            cmd += ["--workers", workers]
        if busy_poll_ms is not None:
            cmd += ["--busy-poll-ms", busy_poll_ms]
        if direct_connections is not None:
            cmd += ["--direct-connections", direct_connections]
        if not metrics:
            cmd.append("--no-metrics")
        self.command = " ".join(["maxsim", *cmd[3:]])
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log_file
        )
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            text = open(log_path).read()
            match = re.search(r"serving on (http://127\.0\.0\.1:\d+)", text)
            if match:
                self.url = match.group(1)
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise SystemExit(f"the server did not start:\n{open(log_path).read()}")

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) / 1024

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds so far: the main thread, the whole server process, its worker processes."""
        pid = self.proc.pid
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
        return {
            "main_thread": _cpu_s(f"/proc/{pid}/task/{pid}/stat"),
            "process": _cpu_s(f"/proc/{pid}/stat"),
            "workers": sum(_cpu_s(f"/proc/{c}/stat") for c in children),
        }

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()
        return self.proc.returncode


def _cpu_s(stat_path: str) -> float:
    """User + system CPU seconds of a process or thread (``/proc/.../stat``; 0 once it is gone)."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load(
    url: str, path: str, bodies: list[bytes], total: int, clients: int, max_seconds: float
) -> dict:
    """``clients`` closed-loop clients sending ``total`` requests (bodies cycled) or until
    ``max_seconds``; latencies, errors, wall time, and the first answer to each distinct body."""
    import httpx

    latencies: list[float] = []
    timings: list[dict[str, float]] = []
    errors: list[str] = []
    answers: dict[int, dict] = {}
    sent = 0
    started = time.perf_counter()

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal sent
        while sent < total and time.perf_counter() - started < max_seconds:
            i = sent % len(bodies)
            sent += 1
            t0 = time.perf_counter()
            response = await http.post(
                f"{url}{path}", content=bodies[i], headers={"content-type": "application/json"}
            )
            latencies.append(time.perf_counter() - t0)
            if response.status_code != 200:
                errors.append(f"{response.status_code} {response.text[:200]}")
            else:
                timings.append(server_timing(response.headers.get("server-timing", "")))
                if i not in answers:
                    answers[i] = response.json()

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    wall = time.perf_counter() - started
    return {"latencies": latencies, "timings": timings, "errors": errors, "answers": answers, "wall_s": wall}


def server_timing(header: str) -> dict[str, float]:
    """``parse;dur=0.4, queue;dur=1.2, score;dur=5.0;desc="batch of 3", ...`` as {phase: ms, "batch": 3}."""
    out = {name: float(ms) for name, ms in re.findall(r"(\w+);dur=([\d.]+)", header)}
    batch = re.search(r"batch of (\d+)", header)
    if batch:
        out["batch"] = float(batch.group(1))
    return out


def timing_summary(timings: list[dict[str, float]]) -> dict[str, float]:
    """Median of each Server-Timing phase over the answers (ms; ``batch``: requests a batch)."""
    names = sorted({name for t in timings for name in t})
    return {name: round(float(np.median([t[name] for t in timings if name in t])), 3) for name in names}


def _client_process(args: tuple, barrier: object, results: object) -> None:
    barrier.wait()  # type: ignore[attr-defined]
    results.put(asyncio.run(load(*args)))  # type: ignore[attr-defined]


def run_load(
    url: str, path: str, bodies: list[bytes], total: int, clients: int, max_seconds: float, processes: int
) -> dict:
    """`load` in ``processes`` client processes (started together; the clients and requests shared out),
    so that the load generator is not the limit; the results merged."""
    if processes <= 1:
        return asyncio.run(load(url, path, bodies, total, clients, max_seconds))
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    procs = []
    for i in range(processes):
        share = (url, path, bodies, total // processes + (i < total % processes),
                 clients // processes + (i < clients % processes), max_seconds)  # fmt: skip
        procs.append(ctx.Process(target=_client_process, args=(share, barrier, results)))
    for proc in procs:
        proc.start()
    parts = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
    answers: dict[int, dict] = {}
    for part in parts:
        answers.update(part["answers"])
    return {
        "latencies": [x for part in parts for x in part["latencies"]],
        "timings": [x for part in parts for x in part["timings"]],
        "errors": [e for part in parts for e in part["errors"]],
        "answers": answers,
        "wall_s": max(part["wall_s"] for part in parts),
    }


# --------------------------------------------------------------------------------------------------
# the two measurements


def rerank_requests(queries: list[np.ndarray], docs: int) -> tuple[list[list[str]], list[bytes]]:
    """Each query's ``CANDIDATES`` docnos of the rerank corpus (drawn with seed 5) and its JSON
    rerank body."""
    rng = np.random.default_rng(5)
    cands = [[f"r{i:07d}" for i in rng.choice(docs, CANDIDATES, replace=False)] for _ in queries]
    bodies = [
        json.dumps({"queries": [{"qid": "q", "embedding": q.tolist()}], "candidates": {"q": c}}).encode()
        for q, c in zip(queries, cands, strict=True)
    ]
    return cands, bodies


def rerank_one_client(args: argparse.Namespace, device: torch.device) -> dict:
    from maxsim_cli import Queries, open_corpus, rerank
    from maxsim_cli.service.batching import Job, Scorer
    from maxsim_cli.service.schema import parse_request

    path = build_rerank_corpus(args.workdir, args.rerank_docs, device)
    queries = make_queries(DISTINCT, seed=11)
    cands, bodies = rerank_requests(queries, args.rerank_docs)
    arrow_bodies = [arrow_rerank_body(q, c) for q, c in zip(queries, cands, strict=True)]

    # in process, on the same device and, as in the server, on a worker thread: the public `rerank`,
    # then the server's own scoring step (`Scorer.score` of a parsed request)
    with open_corpus(path) as corpus:
        corpus.to(str(device))
        corpus.id_index()  # as a long-lived corpus does: candidates looked up in a dict built once
        expected, times, served_times = {}, [], []
        one = [Queries.from_embeddings(["q"], [q]) for q in queries]
        scorer = Scorer(corpus)
        parsed = [parse_request("rerank", "application/json", b, {}, corpus.dim) for b in bodies]

        def measure() -> None:
            for i in range(args.warmup):
                rerank(one[i % DISTINCT], corpus, {"q": cands[i % DISTINCT]})
                scorer.score([Job("rerank", parsed[i % DISTINCT])])
            for i in range(args.rerank_requests):
                j = i % DISTINCT
                t0 = time.perf_counter()
                run = rerank(one[j], corpus, {"q": cands[j]})
                times.append(time.perf_counter() - t0)
                expected.setdefault(j, run.to_dict())
            for i in range(args.rerank_requests):
                t0 = time.perf_counter()
                scorer.score([Job("rerank", parsed[i % DISTINCT])])
                served_times.append(time.perf_counter() - t0)

        on_worker_thread(measure)
    free_device_memory()
    in_process = summary_ms(times)
    scorer_step = summary_ms(served_times)
    log(f"rerank in process: p50 {in_process['p50_ms']} ms, p99 {in_process['p99_ms']} ms")
    log(f"  the server's scoring step: p50 {scorer_step['p50_ms']} ms, p99 {scorer_step['p99_ms']} ms")

    server = Server(
        path,
        str(device),
        args.window_ms,
        os.path.join(args.workdir, "serve-rerank.log"),
        args.workers,
        args.busy_poll_ms,
        args.direct_connections,
        args.metrics == "on",
    )
    runs = {}
    try:
        clients = {
            "http_one_client_socket": (socket_one_client, bodies, JSON),
            "http_one_client": (one_client, bodies, JSON),
            "http_one_client_arrow": (one_client, arrow_bodies, ARROW),
            "http_one_client_httpx": (httpx_one_client, bodies, JSON),
        }
        for name, (client, these, content_type) in clients.items():
            client(server.url, "/rerank", these, args.warmup, content_type, args.max_seconds)
            runs[name] = client(
                server.url, "/rerank", these, args.rerank_requests, content_type, args.max_seconds
            )
    finally:
        code = server.stop()
    out = {
        "server_command": server.command,
        "documents": args.rerank_docs,
        "document_tokens": RERANK_TOKENS,
        "candidates": CANDIDATES,
        "query_tokens": QUERY_TOKENS,
        "request_bytes_json": len(bodies[0]),
        "request_bytes_arrow": len(arrow_bodies[0]),
        "in_process": in_process,
        "in_process_server_scoring_step": scorer_step,
    }
    for name, result in runs.items():
        same = all(hits(answer) == expected[i] for i, answer in result["answers"].items() if i in expected)
        http = summary_ms(result["latencies"])
        log(f"rerank {name}: p50 {http['p50_ms']} ms, p99 {http['p99_ms']} ms; same: {same}")
        log(f"  server timing (median ms): {timing_summary(result['timings'])}")
        out[name] = {
            **http,
            "server_timing_median_ms": timing_summary(result["timings"]),
            "errors": len(result["errors"]),
            "error_examples": result["errors"][:3],
            "answers_equal_in_process": same,
        }
    out["server_exit_code"] = code
    return out


JSON = "application/json"
ARROW = "application/vnd.apache.arrow.stream"


def arrow_rerank_body(query: np.ndarray, candidates: list[str]) -> bytes:
    """One query (fp16, as `maxsim pack` writes queries) and its candidates as the Arrow IPC stream
    ``/rerank`` takes: the query shard stream of docs/format.md plus a ``candidates`` column."""
    import tempfile

    import pyarrow as pa

    from maxsim_cli.shards import write_shard

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "q.arrow")
        write_shard(path, ["q"], [torch.from_numpy(query).to(torch.float16)])
        with pa.memory_map(path) as source:
            table = pa.ipc.open_file(source).read_all()
    table = table.append_column("candidates", pa.array([candidates], type=pa.list_(pa.string())))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def one_client(
    url: str, path: str, bodies: list[bytes], total: int, content_type: str, max_seconds: float
) -> dict:
    """One client sending ``total`` requests one at a time over one keep-alive connection, through the
    standard library's `http.client`: the least Python a client spends on a request (on the 2-core
    machine a request to ``/health`` took 0.27 ms through it and 0.83 ms through httpx's asyncio
    client), so that the latency is the server's. The result as `load`'s."""
    import http.client
    from urllib.parse import urlsplit

    where = urlsplit(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=120)
    latencies: list[float] = []
    timings: list[dict[str, float]] = []
    errors: list[str] = []
    answers: dict[int, dict] = {}
    started = time.perf_counter()
    try:
        for n in range(total):
            if time.perf_counter() - started > max_seconds:
                break
            i = n % len(bodies)
            t0 = time.perf_counter()
            connection.request("POST", path, body=bodies[i], headers={"content-type": content_type})
            response = connection.getresponse()
            text = response.read()
            latencies.append(time.perf_counter() - t0)
            if response.status != 200:
                errors.append(f"{response.status} {text[:200]!r}")
            else:
                timings.append(server_timing(response.getheader("server-timing") or ""))
                if i not in answers:
                    answers[i] = json.loads(text)
    finally:
        connection.close()
    wall = time.perf_counter() - started
    return {"latencies": latencies, "timings": timings, "errors": errors, "answers": answers, "wall_s": wall}


def socket_one_client(
    url: str, path: str, bodies: list[bytes], total: int, content_type: str, max_seconds: float
) -> dict:
    """`one_client` through a bare socket, as a C load generator (wrk, h2load) measures: each request's
    HTTP/1.1 bytes built before the clock starts, one keep-alive connection (TCP_NODELAY), the answer
    read by its Content-Length. What is left is the server's time and the loopback; `http.client`'s
    own Python (building the request, parsing the headers) came to ~0.05 ms a request on 2 cores."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(url)
    host = f"{where.hostname}:{where.port}"
    requests = [
        (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body
        for body in bodies
    ]
    latencies: list[float] = []
    timings: list[dict[str, float]] = []
    errors: list[str] = []
    answers: dict[int, dict] = {}
    started = time.perf_counter()
    with socket.create_connection((where.hostname, where.port), timeout=120) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = sock.makefile("rb")
        for n in range(total):
            if time.perf_counter() - started > max_seconds:
                break
            i = n % len(bodies)
            t0 = time.perf_counter()
            sock.sendall(requests[i])
            status = reader.readline()
            headers = {}
            while (line := reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
            text = reader.read(int(headers.get(b"content-length", b"0")))
            latencies.append(time.perf_counter() - t0)
            if status.split()[1:2] != [b"200"]:
                errors.append(f"{status.strip()!r} {text[:200]!r}")
            else:
                timings.append(server_timing(headers.get(b"server-timing", b"").decode()))
                if i not in answers:
                    answers[i] = json.loads(text)
    wall = time.perf_counter() - started
    return {"latencies": latencies, "timings": timings, "errors": errors, "answers": answers, "wall_s": wall}


def httpx_one_client(
    url: str, path: str, bodies: list[bytes], total: int, content_type: str, max_seconds: float
) -> dict:
    """`load` with one asyncio + httpx client (JSON bodies): the client of the concurrent runs."""
    assert content_type == JSON
    return asyncio.run(load(url, path, bodies, total, 1, max_seconds))


def search_clients(args: argparse.Namespace, device: torch.device) -> dict:
    from maxsim_cli import Queries, open_corpus, search
    from maxsim_cli.units import parse_size

    shard_bytes = 512 << 20 if device.type == "cuda" else 4 << 20
    root = os.path.join(args.workdir, f"corpus-{args.size}")
    paths = build_corpus(root, parse_size(args.size), shard_bytes, device)
    queries = make_queries(DISTINCT, seed=12)
    ids = [f"q{i:03d}" for i in range(DISTINCT)]
    bodies = [
        json.dumps({"queries": [{"qid": qid, "embedding": q.tolist()}], "k": args.k}).encode()
        for qid, q in zip(ids, queries, strict=True)
    ]

    with open_corpus(paths) as corpus:
        corpus.to(str(device))
        documents, tokens = len(corpus), corpus.num_tokens
        all_queries = Queries.from_embeddings(ids, queries)
        expected = search(all_queries, corpus, k=args.k).to_dict()
        one = [Queries.from_embeddings([qid], [q]) for qid, q in zip(ids, queries, strict=True)]
        n = min(args.clients, DISTINCT)
        batch = Queries.from_embeddings(ids[:n], queries[:n])
        single, batched = [], []

        def measure() -> None:
            for i in range(args.warmup):
                search(one[i % DISTINCT], corpus, k=args.k)
            for i in range(min(args.search_requests, 200)):
                t0 = time.perf_counter()
                search(one[i % DISTINCT], corpus, k=args.k)
                single.append(time.perf_counter() - t0)
            search(batch, corpus, k=args.k)
            for _ in range(5):
                t0 = time.perf_counter()
                search(batch, corpus, k=args.k)
                batched.append(time.perf_counter() - t0)

        on_worker_thread(measure)
    free_device_memory()
    in_single, in_batch = summary_ms(single), summary_ms(batched)
    log(f"search in process: one query p50 {in_single['p50_ms']} ms; {n} queries p50 {in_batch['p50_ms']} ms")

    server = Server(
        root,
        str(device),
        args.window_ms,
        os.path.join(args.workdir, "serve-search.log"),
        args.workers,
        args.busy_poll_ms,
        args.direct_connections,
        args.metrics == "on",
    )
    try:
        import httpx

        workers = httpx.get(f"{server.url}/health", timeout=30).json().get("workers")
        warm = args.warmup * args.clients
        run_load(server.url, "/search", bodies, warm, args.clients, args.max_seconds, args.client_processes)
        rss_before = server.rss_mib()
        cpu_before = server.cpu_s()
        result = run_load(
            server.url, "/search", bodies, args.search_requests, args.clients, args.max_seconds,
            args.client_processes,
        )  # fmt: skip
        cpu_after = server.cpu_s()
        rss_after = server.rss_mib()
    finally:
        code = server.stop()
    done = max(1, len(result["latencies"]))
    cpu_ms = {part: round((cpu_after[part] - cpu_before[part]) / done * 1e3, 3) for part in cpu_after}
    same = all(hits(answer) == {ids[i]: expected[ids[i]]} for i, answer in result["answers"].items())
    http = summary_ms(result["latencies"])
    qps = len(result["latencies"]) / result["wall_s"]
    log(
        f"search over HTTP, {args.clients} clients: {qps:.0f} queries/s, p50 {http['p50_ms']} ms, "
        f"p99 {http['p99_ms']} ms; errors {len(result['errors'])}; same: {same}"
    )
    log(f"  server timing (median ms): {timing_summary(result['timings'])}")
    log(f"  server CPU per request (ms), {workers} workers: {cpu_ms}")
    return {
        "server_command": server.command,
        "workers": workers,
        "server_cpu_ms_per_request": cpu_ms,
        "corpus_bytes": sum(os.path.getsize(p) for p in paths),
        "documents": documents,
        "tokens": tokens,
        "query_tokens": QUERY_TOKENS,
        "k": args.k,
        "clients": args.clients,
        "requests": len(result["latencies"]),
        "wall_s": round(result["wall_s"], 3),
        "queries_per_s": round(qps, 1),
        "http": http,
        "server_timing_median_ms": timing_summary(result["timings"]),
        "in_process_one_query": in_single,
        f"in_process_{n}_queries": in_batch,
        "errors": len(result["errors"]),
        "error_examples": result["errors"][:3],
        "answers_equal_in_process": same,
        "server_rss_mib_before_after": [round(rss_before, 1), round(rss_after, 1)],
        "server_exit_code": code,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", default="/var/tmp/mb-serve")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (small sizes: a check)")
    parser.add_argument("--size", default="8GB", help="search corpus size (bench_resident.py's: 8GB)")
    parser.add_argument(
        "--rerank-docs", type=int, default=20000, help="documents of 180 tokens to rerank from"
    )
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--client-processes", type=int, default=1, help="processes the clients are shared by")
    parser.add_argument("--search-requests", type=int, default=20000)
    parser.add_argument("--rerank-requests", type=int, default=2000)
    parser.add_argument("-k", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=20, help="requests before timing (per client)")
    parser.add_argument("--window-ms", type=float, default=2.0, help="the servers' --batch-window-ms")
    parser.add_argument("--max-seconds", type=float, default=120, help="time bound of each timed run")
    parser.add_argument(
        "--workers", default=None, help="the servers' --workers (N or auto; default: the server's own)"
    )
    parser.add_argument(
        "--busy-poll-ms", default=None, help="the servers' --busy-poll-ms (default: the server's own)"
    )
    parser.add_argument(
        "--direct-connections",
        default=None,
        help="the servers' --direct-connections (default: the server's own)",
    )
    parser.add_argument(
        "--metrics",
        choices=("on", "off"),
        default="on",
        help="the servers' GET /metrics (off: --no-metrics); run both to compare the cost",
    )
    parser.add_argument("--only", choices=("rerank", "search"), default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
    os.makedirs(args.workdir, exist_ok=True)
    result: dict = {
        **meta(),
        "window_ms": args.window_ms,
        "client_processes": args.client_processes,
        "workers_option": args.workers or "default (auto)",
        "busy_poll_ms_option": args.busy_poll_ms or "default",
        "direct_connections_option": args.direct_connections or "default",
        "metrics": args.metrics,
    }
    result["load_average_start"] = os.getloadavg()
    if args.only in (None, "rerank"):
        result["rerank_one_client"] = rerank_one_client(args, device)
    if args.only in (None, "search"):
        result["search_clients"] = search_clients(args, device)
    result["load_average_end"] = os.getloadavg()
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json(args.out, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
