"""The scoring process's batching under load, with the GPU's scoring time simulated: any machine.

    python benchmarks/probe_batching_sim.py [--clients 64] [--seconds 6] [--out sim.json]

`maxsim serve --workers N`'s scoring process (`workers.Hub`: its frame handling, `Batcher`,
`Batcher.score_now`) runs in this process, its `Scorer` replaced by one that sleeps as the H200 host's
scoring step takes (--base-ms + --per-query-ms a query: 2.75 ms for one query, 25.2 ms for 31, as
`probe_search_batch_sizes.py` measured) and answers empty hits; the sleep blocks the event loop for a
quick request scored on it, and the batcher's thread otherwise, as the real step does. --clients
closed-loop clients send single-query search frames to it, each waiting --way-ms (plus a uniform
jitter up to --jitter-ms) before its frame reaches the scoring process and again after its answer (the
HTTP request, the worker, the client).
Three versions of the scoring process, one after the other: as it is (`QUICK_GAP_S`), with no gap
(3d3f816 to 8fbf178: every quick frame scored as it is read while the batcher is idle), and without
`score_now` (before 3d3f816). Printed: queries/s, the mean batch, latency p50 / p99.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import socket
import statistics
import struct
import time

import numpy as np
from common import make_log, meta, write_json

log = make_log("batching-sim")
SAMPLE = os.path.join(os.path.dirname(__file__), "..", "sample_data")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--base-ms", type=float, default=2.0)
    parser.add_argument("--per-query-ms", type=float, default=0.75)
    parser.add_argument("--way-ms", type=float, default=1.0)
    parser.add_argument("--jitter-ms", type=float, default=1.0, help="each way's extra, uniform in [0, J)")
    parser.add_argument("--window-ms", type=float, default=2.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from maxsim_cli import open_corpus, read_queries
    from maxsim_cli.service import batching
    from maxsim_cli.service.schema import Hits, check_request
    from maxsim_cli.service.wire import request_frame
    from maxsim_cli.service.workers import Hub, _Worker

    class TimedScorer(batching.Scorer):
        """Sleeps as the scoring step takes on the H200 host; answers empty hits."""

        def quick(self, jobs):  # noqa: ANN001, ANN202 - a corpus resident on GPUs
            return len(jobs) == 1 and jobs[0].num_queries <= batching.QUICK_MAX_QUERIES

        def score(self, jobs):  # noqa: ANN001, ANN202
            queries = sum(job.num_queries for job in jobs)
            time.sleep((args.base_ms + args.per_query_ms * queries) / 1000)
            self.counters.note(len(jobs))
            empty = Hits([], np.zeros(0, dtype=np.float32))
            return [[(qid, empty, None) for qid in job.request.queries.ids] for job in jobs]

    queries = read_queries(os.path.join(SAMPLE, "queries.safetensors"))
    rows = {}
    versions = {
        "as_it_is": {},
        "no_gap": {"QUICK_GAP_S": 0.0},
        "no_score_now": {"score_now": None},
    }
    with open_corpus(os.path.join(SAMPLE, "corpus")) as corpus:
        embedding = queries.embeddings[: int(queries.offsets[1])].float().tolist()
        body = json.dumps({"queries": [{"qid": "q", "embedding": embedding}], "k": 10}).encode()
        frame = request_frame(0, "search", check_request("search", "application/json", body, {}, corpus.dim))
        head_len, size = struct.unpack("<II", frame[:8])
        header = json.loads(frame[8 : 8 + head_len])
        payload = frame[8 + head_len : 8 + head_len + size]
        for name, changes in versions.items():
            saved_gap, saved_now = batching.QUICK_GAP_S, batching.Batcher.score_now
            if "QUICK_GAP_S" in changes:
                batching.QUICK_GAP_S = changes["QUICK_GAP_S"]
            if "score_now" in changes:
                batching.Batcher.score_now = lambda self, kind, request, timing=None: None
            try:
                rows[name] = asyncio.run(run(args, corpus, Hub, _Worker, TimedScorer, header, payload))
            finally:
                batching.QUICK_GAP_S, batching.Batcher.score_now = saved_gap, saved_now
            log(f"{name}: {rows[name]}")
    write_json(args.out, {**meta(), "args": vars(args), "versions": rows})


async def run(args, corpus, Hub, _Worker, TimedScorer, header, payload) -> dict:  # noqa: ANN001, N803
    hub = Hub(corpus, socket.socket(), 4, token=None, max_request_bytes=1 << 20,
              batch_window_ms=args.window_ms, max_batch_queries=256, access_log=False,
              health=lambda b: {}, graceful_shutdown_s=1,
              error_status=lambda exc: (500, str(exc)))  # fmt: skip
    hub.batcher.scorer = TimedScorer(corpus)
    workers = [_Worker(i, None, 0.0) for i in range(4)]
    waiting: dict[int, asyncio.Future] = {}
    ids = itertools.count(1)
    rng = random.Random(7)

    class Sink:
        def write(self, frame: bytes) -> None:
            head_len = struct.unpack("<I", frame[:4])[0]
            answer = json.loads(frame[8 : 8 + head_len])
            future = waiting.pop(answer["id"])
            future.set_result(answer["status"])

        def is_closing(self) -> bool:
            return False

    sink = Sink()
    latencies: list[float] = []
    loop = asyncio.get_running_loop()
    await hub.batcher.start()
    end = time.perf_counter() + args.seconds
    warm = time.perf_counter() + 1.0

    async def client(i: int) -> None:
        worker = workers[i % len(workers)]
        while time.perf_counter() < end:
            started = time.perf_counter()
            await asyncio.sleep((args.way_ms + rng.uniform(0, args.jitter_ms)) / 1000)
            rid = next(ids)
            waiting[rid] = loop.create_future()
            future = waiting[rid]
            hub._request(worker, "search", {**header, "id": rid}, payload, sink)
            assert await future == 200
            await asyncio.sleep((args.way_ms + rng.uniform(0, args.jitter_ms)) / 1000)
            if started > warm:
                latencies.append(time.perf_counter() - started)

    try:
        await asyncio.gather(*(client(i) for i in range(args.clients)))
    finally:
        await hub.batcher.close()
    sizes = hub.batcher.counters.sizes
    latencies.sort()
    return {
        "queries_per_s": round(len(latencies) / (args.seconds - 1.0), 1),
        "mean_batch": round(statistics.fmean(sizes), 2) if sizes else 0.0,
        "p50_ms": round(1e3 * statistics.median(latencies), 2),
        "p99_ms": round(1e3 * latencies[int(0.99 * len(latencies))], 2),
    }


if __name__ == "__main__":
    main()
