"""How fast the host reads page-cached shard files into pinned memory, by method and thread count.

`maxsim score` on one GPU is bound by its reader threads' `os.preadv` of page-cached shards into pinned
staging slots (13.5 GB/s with 16 threads on the H200 machine, docs/benchmarks.md), and two ranks on one
host share that rate (docs/scaling.md). This measures, on the files given (page cache warmed first),
the aggregate rate of: ``preadv`` into pinned memory in 28 MiB calls (as the pipeline does) and in 2 MiB
calls, ``preadv`` into pageable memory, and a copy from a read-only map of the file into pinned memory;
each with 1 to N threads, the files cut into 28 MiB pieces dealt round-robin (so threads stay balanced).

    python benchmarks/probe_read_rate.py /var/tmp/mb/corpus/*.safetensors --out read-rate.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

PIECE = 28 << 20  # one staging slot's worth, as `maxsim score` reads on the H200 machine


def pieces(paths: list[str]) -> list[tuple[str, int, int]]:
    out = []
    for path in paths:
        size = os.path.getsize(path)
        out += [(path, start, min(PIECE, size - start)) for start in range(0, size, PIECE)]
    return out


def run(method: str, work: list[tuple[str, int, int]], threads: int, pinned: bool) -> float:
    fds = {p: os.open(p, os.O_RDONLY) for p, _, _ in work}
    maps = {}
    if method == "map":
        maps = {p: mmap.mmap(fd, 0, prot=mmap.PROT_READ) for p, fd in fds.items()}
    pin = pinned and torch.cuda.is_available()
    buffers = [torch.empty(PIECE, dtype=torch.uint8, pin_memory=pin) for _ in range(threads)]
    views = [memoryview(b.numpy()).cast("B") for b in buffers]
    call = 2 << 20 if method == "pread-2m" else PIECE

    def worker(i: int) -> None:
        view, arr = views[i], buffers[i].numpy()
        for path, start, n in work[i::threads]:
            if method == "map":
                np.copyto(arr[:n], np.frombuffer(maps[path], np.uint8, n, start))
                continue
            done = 0
            while done < n:
                done += os.preadv(fds[path], [view[done : min(n, done + call)]], start + done)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
    seconds = time.perf_counter() - t0
    for m in maps.values():
        m.close()
    for fd in fds.values():
        os.close(fd)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--threads", default="1,2,4,8,16,32")
    parser.add_argument("--gb", type=float, default=6.0, help="read at most this many GB a measurement")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    work = pieces(sorted(args.paths))
    budget = int(args.gb * 1e9) // PIECE
    work = work[:budget]
    total = sum(n for _, _, n in work)
    run("pread", work, 16, True)  # page cache warm, pinned allocator primed
    rows = []
    cores = os.cpu_count() or 1
    for threads in [int(t) for t in args.threads.split(",") if int(t) <= 2 * cores]:
        for method, pinned in (("pread", True), ("pread-2m", True), ("pread", False), ("map", True)):
            best = min(run(method, work, threads, pinned) for _ in range(2))
            row = {"method": method, "pinned": pinned, "threads": threads, "GB": total / 1e9,
                   "seconds": best, "GBps": total / best / 1e9}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"{'method':10s} {'dest':8s} " + " ".join(f"{t:>6d}" for t in sorted({r["threads"] for r in rows})))
    for method, pinned in (("pread", True), ("pread-2m", True), ("pread", False), ("map", True)):
        rates = [r["GBps"] for r in rows if r["method"] == method and r["pinned"] == pinned]
        dest = "pinned" if pinned else "pageable"
        print(f"{method:10s} {dest:8s} " + " ".join(f"{g:6.1f}" for g in rates))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"rows": rows, "cores": cores, "piece_bytes": PIECE}, fh, indent=2)


if __name__ == "__main__":
    main()
