"""What limits reading a corpus onto two GPUs: the host's NUMA layout, or its memory traffic? (two H200s)

`maxsim score --devices 0,1` feeds both GPUs from one host's page cache; its ranks wait for reads
(docs/scaling.md). Every corpus byte crosses host memory three times: read from the page cache, written
to a pinned slot, read again by the GPU's copy engine. This prints the machine's NUMA nodes and each
GPU's local node, then times, on the `score` benchmark's 10 GB corpus (warm page cache):

  read            the whole corpus read by N threads (pieces of 32 MiB into pinned buffers, as the
                  engine's readers do), threads free or bound to one node's cores;
  read halves     two groups of N/2 threads at once, each reading half of the files (as two rank
                  threads do), free or each bound to its GPU's node;
  copy            host->device copies from a pinned buffer allocated by a thread bound to node n, to
                  GPU g, alone and both GPUs at once (each from its own node's buffer, or both from
                  node 0's);
  memcpy          a 2 GiB host tensor copied by torch's threads (read + write bytes counted);
  + copying       the halves read while both GPUs copy from pinned buffers without pause: the read
                  rate and the copies' rate side by side.

    python benchmarks/probe_host_memory.py --workdir /var/tmp/mgpu --out host-memory.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import threading
import time

import torch
from common import build_corpus, drain_pieces, read_files, write_json

from maxsim_cli.units import parse_size

CHUNK = 32 << 20


def parse_cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            a, _, b = part.partition("-")
            cpus.extend(range(int(a), int(b or a) + 1))
    return cpus


def smi(*args: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True).stdout
    except OSError:
        return ""


def topology() -> dict:
    nodes = {}
    base = "/sys/devices/system/node"
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        if name.startswith("node") and name[4:].isdigit():
            with open(os.path.join(base, name, "cpulist")) as fh:
                nodes[int(name[4:])] = parse_cpulist(fh.read())
    gpus = []
    out = smi("--query-gpu=index,pci.bus_id", "--format=csv,noheader")
    for line in out.strip().splitlines():
        index, bus = (x.strip() for x in line.split(","))
        dom, rest = bus.split(":", 1)
        sysfs = f"/sys/bus/pci/devices/{int(dom, 16):04x}:{rest.lower()}"
        node = cpus = None
        try:
            with open(os.path.join(sysfs, "numa_node")) as fh:
                node = int(fh.read())
            with open(os.path.join(sysfs, "local_cpulist")) as fh:
                cpus = parse_cpulist(fh.read())
        except OSError:
            pass
        gpus.append({"index": int(index), "bus": bus, "numa_node": node, "local_cpus": cpus})
    topo = smi("topo", "-m")
    return {"nodes": nodes, "gpus": gpus, "nvidia_smi_topo": topo}


def read_pieces(files: list[str], threads: int, cpus: list[int] | None) -> tuple[float, int]:
    """`threads` threads (bound to `cpus` when given) read the files in CHUNK pieces into pinned buffers
    that each thread allocates itself after binding (so the pages lie on its node)."""
    pieces = [(p, s) for p in files for s in range(0, os.path.getsize(p), CHUNK)]
    pieces.reverse()
    lock = threading.Lock()
    total = [0]
    ready = threading.Barrier(threads + 1)
    go = threading.Event()

    def worker() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        buf = torch.empty(CHUNK, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        view = memoryview(buf.numpy()).cast("B")
        ready.wait()
        go.wait()
        n = drain_pieces(pieces, lock, view)
        with lock:
            total[0] += n

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    ready.wait()
    start = time.perf_counter()
    go.set()
    for t in pool:
        t.join()
    return time.perf_counter() - start, total[0]


def read_halves(halves: list[list[str]], threads: int, binds: list[list[int] | None]) -> float:
    """Both halves at once, each by `threads` threads; seconds until both are read."""
    times = [0.0, 0.0]
    start = time.perf_counter()

    def run(i: int) -> None:
        times[i] = read_pieces(halves[i], threads, binds[i])[0]

    pool = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return time.perf_counter() - start


def pinned_on(cpus: list[int] | None, nbytes: int) -> torch.Tensor:
    box: list[torch.Tensor] = []

    def alloc() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        box.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))

    t = threading.Thread(target=alloc)
    t.start()
    t.join()
    return box[0]


def copy_rate(pairs: list[tuple[torch.Tensor, int]], repeats: int = 8) -> float:
    """GB/s summed over the (pinned buffer, GPU) pairs copying at once, each on its own stream."""
    dests = [torch.empty(h.numel(), dtype=torch.uint8, device=f"cuda:{g}") for h, g in pairs]
    streams = [torch.cuda.Stream(device=f"cuda:{g}") for _, g in pairs]
    for (h, _), d, s in zip(pairs, dests, streams, strict=True):
        with torch.cuda.stream(s):
            d.copy_(h, non_blocking=True)
    for g in {g for _, g in pairs}:
        torch.cuda.synchronize(g)
    start = time.perf_counter()
    for _ in range(repeats):
        for (h, _), d, s in zip(pairs, dests, streams, strict=True):
            with torch.cuda.stream(s):
                d.copy_(h, non_blocking=True)
    for g in {g for _, g in pairs}:
        torch.cuda.synchronize(g)
    elapsed = time.perf_counter() - start
    return repeats * sum(h.numel() for h, _ in pairs) / elapsed / 1e9


def copying_meanwhile(buffers: list[tuple[torch.Tensor, int]], work) -> tuple[float, float]:  # noqa: ANN001
    """(`work()`'s result, GB/s of host->device copies that ran without pause on every pair meanwhile)."""
    stop = threading.Event()
    moved = [0, 0.0]

    def copier() -> None:
        dests = [torch.empty(h.numel(), dtype=torch.uint8, device=f"cuda:{g}") for h, g in buffers]
        streams = [torch.cuda.Stream(device=f"cuda:{g}") for _, g in buffers]
        start = time.perf_counter()
        while not stop.is_set():
            for (h, _), d, s in zip(buffers, dests, streams, strict=True):
                with torch.cuda.stream(s):
                    d.copy_(h, non_blocking=True)
            for s in streams:
                s.synchronize()
            moved[0] += sum(h.numel() for h, _ in buffers)
        moved[1] = time.perf_counter() - start

    thread = threading.Thread(target=copier)
    thread.start()
    time.sleep(0.05)
    result = work()
    stop.set()
    thread.join()
    return result, moved[0] / moved[1] / 1e9


def memcpy_rate(nbytes: int = 2 << 30) -> float:
    a = torch.ones(nbytes // 4, dtype=torch.float32)
    b = torch.empty_like(a)
    b.copy_(a)
    start = time.perf_counter()
    for _ in range(3):
        b.copy_(a)
    return 3 * 2 * nbytes / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/var/tmp/mgpu")
    parser.add_argument("--size", default="10GB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    topo = topology()
    print(topo["nvidia_smi_topo"])
    print("nodes:", {n: f"{len(c)} cpus {c[0]}-{c[-1]}" for n, c in topo["nodes"].items()})
    for g in topo["gpus"]:
        print(f"GPU {g['index']} {g['bus']}: node {g['numa_node']}, {len(g['local_cpus'] or [])} local cpus")
    files = build_corpus(
        os.path.join(args.workdir, "corpus"),
        parse_size(args.size),
        512 << 20,
        torch.device("cuda"),
    )
    size = sum(os.path.getsize(p) for p in files)
    read_files(files, 16)  # warm the page cache
    nodes = topo["nodes"]
    gpu_cpus = [g["local_cpus"] for g in topo["gpus"]][:2]
    rows: dict[str, list[float]] = {}

    def record(name: str, seconds: float, nbytes: int = size) -> None:
        rows.setdefault(name, []).append(nbytes / seconds / 1e9)

    halves = [files[0::2], files[1::2]]
    for _ in range(args.repeats):
        for threads in (8, 16, 32):
            record(f"read x{threads} free", read_pieces(files, threads, None)[0])
        for n, cpus in nodes.items():
            record(f"read x16 node {n}", read_pieces(files, 16, cpus)[0])
        for per in (8, 16):
            record(f"halves 2 x{per} free", read_halves(halves, per, [None, None]))
            if len(gpu_cpus) == 2 and all(gpu_cpus):
                record(f"halves 2 x{per} GPU-local", read_halves(halves, per, gpu_cpus))
                record(f"halves 2 x{per} GPU-remote", read_halves(halves, per, gpu_cpus[::-1]))
    buffers = {n: pinned_on(cpus, 256 << 20) for n, cpus in nodes.items()}
    ngpu = torch.cuda.device_count()
    for _ in range(args.repeats):
        for n, buf in buffers.items():
            for g in range(ngpu):
                rows.setdefault(f"copy node {n} -> GPU {g}", []).append(copy_rate([(buf, g)]))
        if ngpu >= 2 and len(buffers) >= 2:
            local = [buffers[topo["gpus"][g]["numa_node"]] for g in range(2)]
            rows.setdefault("copy both GPUs, each from its node", []).append(
                copy_rate([(local[0], 0), (local[1], 1)])
            )
            rows.setdefault("copy both GPUs, both from node 0", []).append(
                copy_rate([(buffers[0], 0), (pinned_on(nodes[0], 256 << 20), 1)])
            )
    torch.set_num_threads(os.cpu_count() or 1)
    if ngpu >= 2:
        pairs = [(pinned_on(None, 256 << 20), g) for g in range(2)]
    for _ in range(args.repeats):
        rows.setdefault("memcpy (read + write)", []).append(memcpy_rate())
        if ngpu >= 2:
            for per in (8, 16):
                seconds, dma = copying_meanwhile(
                    pairs, lambda per=per: read_halves(halves, per, [None, None])
                )
                record(f"halves 2 x{per} + copying", seconds)
                rows.setdefault(f"copies during halves 2 x{per}", []).append(dma)
            rows.setdefault("copies alone, both GPUs", []).append(copy_rate(pairs))
    print(f"\n{size / 1e9:.2f} GB corpus, {len(files)} files; GB/s, best (all runs)")
    for name, rates in rows.items():
        print(f"{name:40s} {max(rates):6.1f}  ({', '.join(f'{r:.1f}' for r in rates)})")
    write_json(args.out, {"topology": topo, "gb_per_s": rows, "bytes": size}, indent=2)


if __name__ == "__main__":
    main()
