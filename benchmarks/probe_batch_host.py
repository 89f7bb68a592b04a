"""Host and GPU time of one `maxsim score` document batch, fp16 against int8 (H200 probe).

A batch as the engine scores it: 512 queries x 32 tokens against the documents of one staging slot
(110K fp16 tokens, 201K int8 tokens: ~720 / ~1,300 documents of 20-300 tokens), offsets on the host
and a new tensor at every call, as the engine's are (so every per-offsets memo misses), then the
running top-1000 merge. For each: host microseconds per call (enqueued; nothing synchronised inside
the timed calls) and GPU milliseconds per call (the calls queued behind a GPU sleep, so that the GPU
never waits for the host), then a cProfile of the int8 calls by own time.

    python benchmarks/probe_batch_host.py [--out probe-batch-host-h200.txt]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable

import torch
from maxsim_kernels import maxsim_varlen
from maxsim_kernels.maxsim_int8 import quantize_per_token

from maxsim_cli.topk import RunningTopK

QUERIES, QUERY_TOKENS, DIM, TOP_K = 512, 32, 128, 1000


def batch(tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.randint(20, 301, (tokens // 20,), generator=gen)
    lens = lens[: int((lens.cumsum(0) <= tokens).sum())]
    off = torch.zeros(len(lens) + 1, dtype=torch.int64)
    off[1:] = lens.cumsum(0)
    x = torch.nn.functional.normalize(torch.randn(int(off[-1]), DIM, device="cuda"), dim=1)
    return x, off


def host_and_gpu(fn: Callable[[], object], calls: int = 20, rounds: int = 10) -> tuple[float, float]:
    """(host us per call, GPU ms per call), the median over rounds of `calls` calls each."""
    host, gpu = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(400_000_000)  # ~0.2 s: the calls below are queued before the GPU reaches them
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - t0) / calls * 1e6)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) / calls)
    return sorted(host)[rounds // 2], sorted(gpu)[rounds // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(QUERIES * QUERY_TOKENS, DIM, device="cuda"), dim=1)
    q_off = torch.arange(QUERIES + 1, dtype=torch.int64) * QUERY_TOKENS
    q16 = q.half()
    d16, off16 = batch(110_000, gen)
    d16 = d16.half()
    x8, off8 = batch(201_000, gen)
    d8, s8 = quantize_per_token(x8)
    q8, sq = quantize_per_token(q)
    ranks16 = torch.arange(len(off16) - 1, device="cuda")
    ranks8 = torch.arange(len(off8) - 1, device="cuda")
    topk = RunningTopK(QUERIES, TOP_K)
    zeros8 = torch.zeros(QUERIES, len(off8) - 1, device="cuda")

    cases: dict[str, Callable[[], object]] = {
        "fp16 kernel": lambda: maxsim_varlen(q16, q_off, d16, off16.clone()),
        "fp16 kernel + merge": lambda: topk.add(maxsim_varlen(q16, q_off, d16, off16.clone()), ranks16),
        "int8 kernel (float queries)": lambda: maxsim_varlen(q, q_off, d8, off8.clone(), doc_scales=s8),
        "int8 kernel + merge": lambda: topk.add(
            maxsim_varlen(q, q_off, d8, off8.clone(), doc_scales=s8), ranks8
        ),
        "int8 kernel, same offsets tensor": lambda: maxsim_varlen(q, q_off, d8, off8, doc_scales=s8),
        "quantize queries": lambda: quantize_per_token(q),
        "merge alone (int8 batch)": lambda: topk.add(zeros8, ranks8),
    }
    lines = [f"fp16 batch: {len(off16) - 1} docs, {d16.shape[0]} tokens; int8: {len(off8) - 1} docs, "
             f"{d8.shape[0]} tokens; {QUERIES} queries x {QUERY_TOKENS}"]  # fmt: skip
    for name, fn in cases.items():
        for _ in range(3):
            fn()
        h, g = host_and_gpu(fn)
        lines.append(f"{name:36s} host {h:8.1f} us/call   GPU {g:7.3f} ms/call")
        print(lines[-1], flush=True)
    del q8, sq
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(100):
        topk.add(maxsim_varlen(q, q_off, d8, off8.clone(), doc_scales=s8), ranks8)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(35)
    lines.append("cProfile, 100 int8 calls + merge, by own time:\n" + text.getvalue())
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(report + "\n")


if __name__ == "__main__":
    main()
