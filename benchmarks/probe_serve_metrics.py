"""What ``GET /metrics`` costs a request of `maxsim serve`: the same requests with metrics and without.

    python benchmarks/probe_serve_metrics.py [--workers 0] [--device cpu] [--out metrics-cost.json]

Starts two servers of ``sample_data/corpus`` on 127.0.0.1 with the same options, one with metrics (the
default) and one with ``--no-metrics``, and times requests one after the other from one client
(`http.client`, one kept connection to each server): ``GET /health`` (no scoring: the HTTP path, where the
metrics' share is largest) and ``POST /rerank`` of one query x 10 candidates (a small scoring request).
Rounds alternate the servers (and which goes first), so that a machine's drift falls on both. Then, in
this process, the bare cost of the metrics' work per request: `Metrics.observe` with the values in
memory (``--workers 0``) and in a multiprocess folder (``--workers N``), and the middleware around an
ASGI app that answers at once. Latencies in microseconds: median, p90, p99, mean.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import statistics
import tempfile
import time

from bench_serve import Server
from common import make_log, meta, write_json

log = make_log("metrics")
ROOT = os.path.join(os.path.dirname(__file__), "..")
CORPUS = os.path.join(ROOT, "sample_data", "corpus")
QUERIES = os.path.join(ROOT, "sample_data", "queries.safetensors")


def summary_us(seconds: list[float]) -> dict[str, float]:
    us = sorted(s * 1e6 for s in seconds)
    pick = lambda p: round(us[min(len(us) - 1, int(p * len(us)))], 1)
    return {
        "n": len(us),
        "p50_us": pick(0.5),
        "p90_us": pick(0.9),
        "p99_us": pick(0.99),
        "mean_us": round(statistics.fmean(us), 1),
    }


def rerank_body() -> bytes:
    from maxsim_cli import open_corpus, read_queries

    queries = read_queries(QUERIES)
    with open_corpus(CORPUS) as corpus:
        docnos = corpus.ids[:10]
    rows = queries.embeddings[int(queries.offsets[0]) : int(queries.offsets[1])].float().tolist()
    return json.dumps({"queries": [{"qid": "q", "embedding": rows}], "candidates": {"q": docnos}}).encode()


def timed(
    connection: http.client.HTTPConnection, method: str, path: str, body: bytes | None, n: int
) -> list[float]:
    headers = {"content-type": "application/json"} if body is not None else {}
    times = []
    for _ in range(n):
        started = time.perf_counter()
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        response.read()
        times.append(time.perf_counter() - started)
        assert response.status == 200, response.status
    return times


def over_http(args: argparse.Namespace, workdir: str) -> dict:
    body = rerank_body()
    servers = {}
    for name, on in (("metrics", True), ("no_metrics", False)):
        log_path = os.path.join(workdir, f"serve-{name}.log")
        servers[name] = Server(CORPUS, args.device, 0.0, log_path, workers=args.workers, metrics=on)
    try:
        connections = {}
        for name, server in servers.items():
            host, port = server.url.removeprefix("http://").split(":")
            connections[name] = http.client.HTTPConnection(host, int(port), timeout=30)
            timed(connections[name], "GET", "/health", None, args.warmup)  # warm-up
            timed(connections[name], "POST", "/rerank", body, args.warmup)
        times: dict[str, dict[str, list[float]]] = {n: {"health": [], "rerank": []} for n in servers}
        for round_ in range(args.rounds):
            order = list(servers) if round_ % 2 == 0 else list(servers)[::-1]
            for name in order:
                times[name]["health"] += timed(connections[name], "GET", "/health", None, args.requests)
                times[name]["rerank"] += timed(connections[name], "POST", "/rerank", body, args.requests)
        out = {name: {kind: summary_us(t) for kind, t in kinds.items()} for name, kinds in times.items()}
        scrape = connections["metrics"]
        scrape.request("GET", "/metrics")
        response = scrape.getresponse()
        text = response.read().decode()
        counted = [line for line in text.splitlines() if line.startswith("maxsim_http_requests_total")]
        out["metrics_scrape_requests_total"] = counted
    finally:
        codes = {name: server.stop() for name, server in servers.items()}
    out["server_exit_codes"] = codes
    return out


def in_process(calls: int) -> dict:
    """The metrics' own work per request, without HTTP: `observe`, and the middleware around an ASGI app
    that answers at once (against the same app bare)."""
    from maxsim_cli.service.metrics import Metrics, MetricsMiddleware, shared_metrics

    def per_call_ns(fn) -> float:
        rounds = []
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(calls):
                fn()
            rounds.append((time.perf_counter() - started) / calls * 1e9)
        return round(statistics.median(rounds), 1)

    memory = Metrics()
    out = {"observe_in_memory_ns": per_call_ns(lambda: memory.observe("/search", 200, 0.002))}
    with shared_metrics() as shared:
        assert shared is not None
        out["observe_multiprocess_ns"] = per_call_ns(lambda: shared.observe("/search", 200, 0.002))

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    class Route:
        path = "/search"

    async def nothing(message) -> None:
        return None

    scope = {"type": "http", "path": "/search"}

    def asgi_ns(handler) -> float:
        async def run() -> float:
            rounds = []
            for _ in range(5):
                started = time.perf_counter()
                for _ in range(calls):
                    await handler(scope, nothing, nothing)
                rounds.append((time.perf_counter() - started) / calls * 1e9)
            return statistics.median(rounds)

        return round(asyncio.run(run()), 1)

    bare = asgi_ns(app)
    wrapped = asgi_ns(MetricsMiddleware(app, Metrics(), [Route()]))
    out.update(
        {"asgi_bare_ns": bare, "asgi_with_middleware_ns": wrapped, "middleware_ns": round(wrapped - bare, 1)}
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workers", default="0", help="the servers' --workers")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=300, help="requests of each kind per server a round")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--calls", type=int, default=100_000, help="calls of the in-process timings")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = {**meta(), "workers": args.workers, "device": args.device, "load_average_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as workdir:
        result["http"] = over_http(args, workdir)
    result["in_process"] = in_process(args.calls)
    result["load_average_end"] = os.getloadavg()
    for name in ("metrics", "no_metrics"):
        for kind in ("health", "rerank"):
            row = result["http"][name][kind]
            log(f"{name:>10} {kind:>6}: p50 {row['p50_us']} us, p90 {row['p90_us']}, p99 {row['p99_us']}")
    log(f"in process: {result['in_process']}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
