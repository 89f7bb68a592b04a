"""Could the GPUs copy shard bytes straight out of the page cache? Page-locking mapped shard files (H200).

Every corpus byte now crosses host memory three times (page cache -> page-locked slot -> GPU), and on the
two-H200 machine that traffic bounds a two-GPU pass (docs/scaling.md, probe_host_memory.py). If the
shard files' pages, mapped read-only, could be page-locked (`cudaHostRegister` with the read-only flag)
fast enough, the copy engines would read them in place: one crossing instead of three. This times, on
the `score` benchmark's 10 GB corpus (warm page cache):

  register    `cudaHostRegister(READ_ONLY)` of every mapped file, by 1 and by 16 threads;
  copy        host -> GPU from the registered pages, to one GPU and to two at once;
  unregister  `cudaHostUnregister` of every file.

    python benchmarks/probe_register_pages.py --workdir /var/tmp/mgpu --out register-pages.json
"""

from __future__ import annotations

import argparse
import mmap
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from common import build_corpus, read_files, write_json

from maxsim_cli.units import parse_size

READ_ONLY = 0x08  # cudaHostRegisterReadOnly


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/var/tmp/mgpu")
    parser.add_argument("--size", default="10GB")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    total = parse_size(args.size)
    files = build_corpus(os.path.join(args.workdir, "corpus"), total, 512 << 20, torch.device("cuda"))
    read_files(files, 16)
    cudart = torch.cuda.cudart()
    maps = []
    for path in files:
        with open(path, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
        arr = np.frombuffer(mm, dtype=np.uint8)
        maps.append((mm, arr, arr.ctypes.data, arr.nbytes))
    size = sum(m[3] for m in maps)
    rows: dict[str, list[float]] = {}
    ngpu = torch.cuda.device_count()

    def register(m) -> None:  # noqa: ANN001
        err = cudart.cudaHostRegister(m[2], m[3], READ_ONLY)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister: error {int(err)}")

    def unregister(m) -> None:  # noqa: ANN001
        cudart.cudaHostUnregister(m[2])

    def copy_all(gpus: list[int]) -> float:
        hosts = [torch.from_numpy(m[1]) for m in maps]
        chunk = max(h.numel() for h in hosts)
        dests = {g: torch.empty(chunk, dtype=torch.uint8, device=f"cuda:{g}") for g in gpus}
        streams = {g: torch.cuda.Stream(device=f"cuda:{g}") for g in gpus}
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i, h in enumerate(hosts):
            g = gpus[i % len(gpus)]
            with torch.cuda.stream(streams[g]):
                dests[g][: h.numel()].copy_(h, non_blocking=True)
        for g in gpus:
            torch.cuda.synchronize(g)
        return time.perf_counter() - start

    warnings.simplefilter("ignore")  # torch.from_numpy of a read-only array

    def every_file(fn, threads: int) -> float:  # noqa: ANN001
        """GB/s of `fn` over every mapped file, on `threads` threads."""
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fn, maps))
        return size / (time.perf_counter() - start) / 1e9

    for _ in range(args.repeats):
        for threads in (1, 16):
            rows.setdefault(f"register x{threads} (GB/s)", []).append(every_file(register, threads))
            rows.setdefault("copy registered -> GPU 0 (GB/s)", []).append(size / copy_all([0]) / 1e9)
            if ngpu >= 2:
                rows.setdefault("copy registered -> GPUs 0,1 (GB/s)", []).append(
                    size / copy_all([0, 1]) / 1e9
                )
            rows.setdefault(f"unregister x{threads} (GB/s)", []).append(every_file(unregister, threads))
        rows.setdefault("copy unregistered (pageable) -> GPU 0 (GB/s)", []).append(size / copy_all([0]) / 1e9)
    print(f"{size / 1e9:.2f} GB in {len(files)} mapped files")
    for name, values in rows.items():
        print(f"{name:45s} best {max(values):7.1f}  ({', '.join(f'{v:.1f}' for v in values)})")
    write_json(args.out, {"rows": rows, "bytes": size}, indent=2)


if __name__ == "__main__":
    main()
