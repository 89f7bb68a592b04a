"""What the hop between a `maxsim serve --workers` HTTP worker and the scoring process costs, in parts.

A request served by a worker crosses a Unix socket to the scoring process and back (`ipc` in its
``Server-Timing`` header). This times, on the machine it runs on (no GPU needed), for one query of 32
tokens against 1,000 candidates (the rerank figure's request):

- the frames: `wire.request_frame`, `wire.checked_from_frame` + `schema.to_parsed` (the scoring side's
  read), `wire.answer_frame` of 1,000 hits, `wire.answers_from_frame`;
- the round trip of a frame's bytes to another process and back over a Unix socket pair: both ends
  blocking, then both ends on asyncio event loops (the worker's and the scoring process's), with a
  small message and with the rerank frames' sizes; the echo process answers as soon as it has read.

The difference between an event loop's round trip and a blocking one is what the loops' wake-ups
cost; a round trip much above the same on another machine points at the machine's wake-up latency
(idle cores, virtualised interrupts).

    python benchmarks/probe_worker_hop.py [--rounds 2000] [--out hop.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import time

import numpy as np
from common import host_times, write_json

from maxsim_cli.service.schema import Checked, Hits, to_parsed
from maxsim_cli.service.wire import (
    _recv_exactly,
    answer_frame,
    answers_from_frame,
    checked_from_frame,
    request_frame,
)

_LEN = struct.Struct("<I")


def _us(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    return {
        "p50_us": round(statistics.median(samples) * 1e6, 1),
        "p99_us": round(samples[min(len(samples) - 1, int(0.99 * len(samples)))] * 1e6, 1),
    }


def _time(fn, rounds: int) -> dict[str, float]:
    return _us(host_times(fn, rounds, warmup=min(50, rounds)))


def frames(rounds: int) -> tuple[dict, int, int]:
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((32, 128)).astype(np.float16)
    docnos = [f"r{i:07d}" for i in rng.choice(20000, 1000, replace=False)]
    checked = Checked(["q1"], emb, np.array([0, 32]), "float16", None, None, {"q1": docnos}, False, "body")
    req = request_frame(1, "rerank", checked)
    head_len = struct.unpack("<II", req[:8])[0]
    req_header, req_payload = json.loads(req[8 : 8 + head_len]), req[8 + head_len :]
    hits = Hits(docnos, rng.standard_normal(1000).astype(np.float32))
    ans = answer_frame(1, [("q1", hits, [])], 0.0, 0.0, 1)
    ans_len = struct.unpack("<II", ans[:8])[0]
    ans_header, ans_payload = json.loads(ans[8 : 8 + ans_len]), ans[8 + ans_len :]
    out = {
        "request_frame": _time(lambda: request_frame(1, "rerank", checked), rounds),
        "checked_from_frame+to_parsed": _time(
            lambda: to_parsed(checked_from_frame(req_header, req_payload)), rounds
        ),
        "answer_frame": _time(lambda: answer_frame(1, [("q1", hits, [])], 0.0, 0.0, 1), rounds),
        "answers_from_frame": _time(lambda: answers_from_frame(ans_header, ans_payload), rounds),
    }
    return out, len(req), len(ans)


# ------------------------------------------------------------------------------------------ echo


def _echo_blocking(sock: socket.socket, answer_bytes: int) -> None:
    answer = b"a" * answer_bytes
    try:
        while True:
            (size,) = _LEN.unpack(_recv_exactly(sock, 4))
            _recv_exactly(sock, size)
            sock.sendall(_LEN.pack(len(answer)) + answer)
    except ConnectionError:
        pass


async def _echo_async_main(fd: int, answer_bytes: int) -> None:
    answer = b"a" * answer_bytes
    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=fd))
    try:
        while True:
            (size,) = _LEN.unpack(await reader.readexactly(4))
            await reader.readexactly(size)
            writer.write(_LEN.pack(len(answer)) + answer)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass


def _echo(fd: int, mode: str, answer_bytes: int) -> None:
    if mode == "blocking":
        _echo_blocking(socket.socket(fileno=fd), answer_bytes)
    else:
        asyncio.run(_echo_async_main(fd, answer_bytes))


def round_trip(mode: str, request_bytes: int, answer_bytes: int, rounds: int) -> dict[str, float]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen(
        [sys.executable, __file__, "--echo", mode, str(theirs.fileno()), str(answer_bytes)],
        pass_fds=(theirs.fileno(),),
    )
    theirs.close()
    request = _LEN.pack(request_bytes) + b"r" * request_bytes
    try:
        if mode == "blocking":

            def once() -> None:
                ours.sendall(request)
                (size,) = _LEN.unpack(_recv_exactly(ours, 4))
                _recv_exactly(ours, size)

            # spaced like requests one client sends after the other (an idle gap between them)
            samples = []
            for i in range(rounds + 50):
                time.sleep(0.0005)
                t0 = time.perf_counter()
                once()
                if i >= 50:
                    samples.append(time.perf_counter() - t0)
            return _us(samples)

        async def main() -> list[float]:
            reader, writer = await asyncio.open_unix_connection(sock=ours)
            samples = []
            for i in range(rounds + 50):
                await asyncio.sleep(0.0005)
                t0 = time.perf_counter()
                writer.write(request)
                (size,) = _LEN.unpack(await reader.readexactly(4))
                await reader.readexactly(size)
                if i >= 50:
                    samples.append(time.perf_counter() - t0)
            writer.close()
            return samples

        return _us(asyncio.run(main()))
    finally:
        ours.close()
        proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--out", default=None)
    parser.add_argument("--echo", nargs=3, help=argparse.SUPPRESS)  # the other end: mode, fd, bytes
    args = parser.parse_args()
    if args.echo:
        _echo(int(args.echo[1]), args.echo[0], int(args.echo[2]))
        return
    frame_times, req_bytes, ans_bytes = frames(args.rounds)
    trips = {
        f"{mode}, {label}": round_trip(mode, rq, an, args.rounds)
        for mode in ("blocking", "asyncio")
        for label, rq, an in (
            ("64 B each way", 64, 64),
            (f"{req_bytes} B / {ans_bytes} B", req_bytes, ans_bytes),
        )
    }
    result = {
        "command": "python benchmarks/probe_worker_hop.py " + f"--rounds {args.rounds}",
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
        "frames_1q_1000_candidates": frame_times,
        "round_trip_idle_gap_0.5ms": trips,
    }
    print(json.dumps(result, indent=1))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
