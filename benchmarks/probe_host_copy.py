"""Host time of one small host -> GPU copy as the kernels' launchers make it, against a slot ring (H200).

`maxsim_kernels._validate.host_to_device` copies offsets, candidate lists and tile tables (a few KB to
~100 KB a batch) without the host waiting for the stream, through a fresh page-locked tensor from
PyTorch's caching host allocator per copy. The candidate measured here, `StagingRing`, reuses 32
page-locked slots round-robin, each taken again once a CUDA event says its copy has run. This times
the host side of N copies of each size both ways, each queued behind a short kernel with the host at
most two steps ahead (as in `maxsim score`'s pass), alternating the ways over `--rounds`.

Result (`benchmarks/results/host/host-copy-h200.json`, 2026-11-30): the launchers' way 21-25 us a
copy, the ring 39-52 us (its event queries and locking cost more than the allocator's cached blocks),
and `maxsim score` end to end no faster with the ring
(`benchmarks/results/score/ab-trees-h200-staging-ring.json`); the ring was not adopted.

    python benchmarks/probe_host_copy.py --out benchmarks/results/host/host-copy-h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch
from maxsim_kernels import _validate


class StagingRing:
    """Page-locked slots reused round-robin for small host -> device copies, each slot taken again only
    once the copy out of it has run (a CUDA event per slot); None when every slot is in flight."""

    SLOTS = 32
    SLOT_BYTES = 256 << 10

    def __init__(self) -> None:
        self.buffer = torch.empty(self.SLOTS * self.SLOT_BYTES, dtype=torch.uint8, pin_memory=True)
        self.events: list[torch.cuda.Event | None] = [None] * self.SLOTS
        self.next = 0
        self.lock = threading.Lock()

    def __call__(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        nbytes = x.numel() * x.element_size()
        with self.lock:
            for _ in range(self.SLOTS):
                slot = self.next
                self.next = (slot + 1) % self.SLOTS
                event = self.events[slot]
                if event is None or event.query():
                    break
            else:
                return _validate.host_to_device(x, device)
            start = slot * self.SLOT_BYTES
            staged = self.buffer[start : start + nbytes].view(x.dtype).view(x.shape)
            staged.copy_(x)
            out = torch.empty(x.shape, dtype=x.dtype, device=device)
            out.copy_(staged, non_blocking=True)
            if event is None:
                event = self.events[slot] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            return out


def time_copies(way, sizes: list[int], n: int, device: torch.device) -> dict[int, float]:  # noqa: ANN001
    """Mean host time of one copy, in us. As in `maxsim score`'s pass, each copy queues behind ~0.5 ms of
    GPU work and the host runs at most two steps ahead of the GPU (it waits for the step before last)."""
    out = {}
    for size in sizes:
        x = torch.arange(size, dtype=torch.int64)
        torch.cuda.synchronize()
        steps: list[torch.cuda.Event] = []
        spent = 0.0
        for _ in range(n):
            torch.cuda._sleep(1_000_000)  # ~0.5 ms of GPU time
            start = time.perf_counter()
            way(x, device)
            spent += time.perf_counter() - start
            steps.append(torch.cuda.Event())
            steps[-1].record()
            if len(steps) > 2:
                steps.pop(0).synchronize()
        torch.cuda.synchronize()
        out[size] = spent / n * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    sizes = [1_300, 4_000, 12_000]  # int64 values: one batch's offsets, ~32 KB, ~96 KB
    ways = {"ring": StagingRing(), "fresh": _validate.host_to_device}
    for way in ways.values():  # warm: the ring's slots, the allocator's blocks
        time_copies(way, sizes, 50, device)
    runs: dict[str, list[dict[int, float]]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            runs[name].append(time_copies(way, sizes, args.copies, device))
    summary = {
        name: {size: statistics.median(r[size] for r in rs) for size in sizes} for name, rs in runs.items()
    }
    for name, per_size in summary.items():
        print(name, " ".join(f"{size * 8 // 1024} KB: {us:.1f} us" for size, us in per_size.items()))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"us_per_copy_median": summary, "runs": runs, "copies": args.copies}, fh, indent=2)


if __name__ == "__main__":
    main()
