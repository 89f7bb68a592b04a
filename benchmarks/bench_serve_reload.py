"""`maxsim serve` through a reload under load: 64 clients' searches in steady state, then the same load
while `maxsim delete` commits a new generation and ``POST /reload`` swaps it in.

    python benchmarks/bench_serve_reload.py --workdir /tmp/mb-reload --docs 20000 --device cpu \
        --out benchmarks/results/serve/reload-cpu-2core.json

A corpus folder of ``--docs`` fp16 documents (4-32 tokens, d = ``--dim``); a ``maxsim serve`` of it on
127.0.0.1 (``--workers`` passed on); ``--clients`` closed-loop clients (each sends its next single-query
search, k = 10, as soon as the last is answered) for ``--seconds`` (steady state), then again for
``--seconds`` while, a quarter of the way in, 1% of the ids are deleted and the server is told to
reload. Each phase: requests, errors (any status but 200), latency p50 / p99; the reload's own time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time

import numpy as np
from common import make_log, meta, write_json

log = make_log("serve-reload")


def build(folder: str, docs: int, dim: int) -> None:
    from maxsim_cli.shards import write_manifest
    from maxsim_cli.shards.writers import ShardWriter

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(1)
    per = -(-docs // 4)
    for s in range(4):
        first, stop = s * per, min(docs, (s + 1) * per)
        lengths = rng.integers(4, 33, stop - first)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        rows = rng.standard_normal((int(offsets[-1]), dim), dtype=np.float32).astype(np.float16)
        with ShardWriter(os.path.join(folder, f"part{s}.safetensors"), dim, "float16") as writer:
            writer.add([f"d{i}" for i in range(first, stop)], rows, offsets=offsets)
    write_manifest(folder)


def percentile(values: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(values), p)) if values else float("nan")


async def phase(url: str, bodies: list[dict], clients: int, seconds: float, during=None) -> dict:  # noqa: ANN001
    import httpx

    latencies: list[float] = []
    errors = 0
    end = time.perf_counter() + seconds

    async def client(http: httpx.AsyncClient, c: int) -> None:
        nonlocal errors
        i = c
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            try:
                response = await http.post(f"{url}/search", json=bodies[i % len(bodies)])
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - t0)
            errors += not ok
            i += clients

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        tasks = [asyncio.create_task(client(http, c)) for c in range(clients)]
        extra = await during(http) if during is not None else None
        await asyncio.gather(*tasks)
    out = {
        "requests": len(latencies),
        "errors": errors,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "queries_per_s": len(latencies) / seconds,
    }
    if extra is not None:
        out["reload"] = extra
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workers", default="0")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()

    folder = os.path.join(args.workdir, "corpus")
    if os.path.exists(folder):
        import shutil

        shutil.rmtree(folder)
    build(folder, args.docs, args.dim)
    rng = np.random.default_rng(2)
    embeddings = [rng.standard_normal((32, args.dim)).round(3).tolist() for _ in range(64)]
    bodies = [{"queries": [{"qid": "q", "embedding": e}], "k": 10} for e in embeddings]
    gone = os.path.join(args.workdir, "gone.txt")
    with open(gone, "w") as f:
        picked = rng.choice(args.docs, size=args.docs // 100, replace=False)
        f.write("\n".join(f"d{i}" for i in sorted(picked.tolist())) + "\n")
    command = [sys.executable, "-m", "maxsim_cli", "serve", folder, "--device", args.device, "--port", "0"]
    server = subprocess.Popen(
        [*command, "--workers", args.workers], stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        assert server.stderr is not None
        for line in server.stderr:
            match = re.search(r"serving on (http://127\.0\.0\.1:\d+)", line)
            if match:
                url = match.group(1)
                break
        else:
            raise SystemExit("the server did not start")

        async def reload_during(http) -> dict:  # noqa: ANN001
            await asyncio.sleep(args.seconds / 4)
            t0 = time.perf_counter()
            delete = [sys.executable, "-m", "maxsim_cli", "delete", folder, "--ids", gone, "-q"]
            proc = await asyncio.create_subprocess_exec(*delete)
            await proc.wait()
            t1 = time.perf_counter()
            response = await http.post(f"{url}/reload")
            t2 = time.perf_counter()
            return {"delete_s": t1 - t0, "reload_s": t2 - t1, "status": response.status_code,
                    "answer": response.json()}  # fmt: skip

        asyncio.run(phase(url, bodies, args.clients, 3))  # warm-up
        steady = asyncio.run(phase(url, bodies, args.clients, args.seconds))
        log(f"steady: {steady}")
        reloading = asyncio.run(phase(url, bodies, args.clients, args.seconds, reload_during))
        log(f"through a reload: {reloading}")
    finally:
        server.terminate()
        server.wait(timeout=60)
    result = {
        "meta": meta(),
        "command": " ".join(["python", *sys.argv]),
        "docs": args.docs,
        "clients": args.clients,
        "steady": steady,
        "reloading": reloading,
        "p99_ratio": reloading["p99_ms"] / steady["p99_ms"],
    }
    log(f"p99 through the reload / steady: {result['p99_ratio']:.2f}x, errors {reloading['errors']}")
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
