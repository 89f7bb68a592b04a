"""What a connection's offer to the scoring process costs (`maxsim serve --workers N --direct-connections`).

    python benchmarks/probe_connection_offer.py [--device cpu] [--out offer.json]

A worker offers each connection it accepts to the scoring process before reading it
(`maxsim_cli/service/takeover.py`): one round trip between the two processes per connection. This
starts a server with `--workers 2` twice, `--direct-connections 1` and `0`, on the small corpus of
`sample_data/` (the request is `GET /health`, which both the scoring process and a worker answer by
asking the scoring process's batcher: no scoring), and times --requests requests one after the other
from one client, on one kept connection and on a new connection each (connect, request, close):
medians and p90 in microseconds, the two servers one after the other in one run.
"""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import tempfile
import time

from bench_serve import Server
from common import make_log, meta, write_json

log = make_log("offer")
CORPUS = os.path.join(os.path.dirname(__file__), "..", "sample_data", "corpus")


def timed(port: int, requests: int, kept: bool) -> dict[str, float]:
    times = []
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30) if kept else None
    for _ in range(requests):
        started = time.perf_counter()
        conn = connection or http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/health")
        response = conn.getresponse()
        response.read()
        assert response.status == 200
        if connection is None:
            conn.close()
        times.append(time.perf_counter() - started)
    if connection is not None:
        connection.close()
    times = sorted(t * 1e6 for t in times[requests // 10 :])  # the first tenth: warm-up
    return {"p50_us": round(statistics.median(times), 1), "p90_us": round(times[int(0.9 * len(times))], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as workdir:
        for direct in ("1", "0"):
            log_path = os.path.join(workdir, f"serve-{direct}.log")
            server = Server(CORPUS, args.device, 2.0, log_path, workers="2", direct_connections=direct)
            try:
                port = int(server.url.rsplit(":", 1)[1])
                row = {
                    "kept_connection": timed(port, args.requests, kept=True),
                    "new_connection_each": timed(port, args.requests, kept=False),
                }
            finally:
                row["server_exit_code"] = server.stop()
            rows[f"direct_connections_{direct}"] = row
            log(f"--direct-connections {direct}: {row}")
    write_json(args.out, {**meta(), "requests": args.requests, "servers": rows})


if __name__ == "__main__":
    main()
