"""What the benchmark scripts share: logging and result files, timing, the inputs they measure on.

A script run as ``python benchmarks/NAME.py`` has this folder first on its path, so ``import common``
(or ``from common import ...``) needs no path edit; `maxsim_cli` and `maxsim_kernels` come from the
installed package (``pip install -e .``), imported inside the functions that need them, so that a
script about the kernels does not import the CLI and one about the host does not import Triton.

- environment and results: `make_log`, `device`, `sync`, `meta`, `write_json`, `sha256`;
- timing: `median_ms` (do_bench median), `time_ms` (bench_kernels.py's rules), `host_time` (enqueue
  time of a step), `kernel_time` (the kernel over a corpus in batches), and the per-batch host / GPU
  times of a `maxsim score` pass (`instrument_batches`, `batch_report`);
- inputs in memory: the four forward workloads of `bench_kernels.py` (`make_workload`, BRIEF section 4),
  ragged random corpora (`ragged`), the training shapes of `bench_train.py` (`training_inputs`), and
  the padded layout and entry points of the peers (`padded_inputs`, `flash`, `lik`);
- corpora on disk: the `score` benchmark's fp16 shards and queries (`build_corpus`, `build_queries`),
  reading them as the engine's readers do (`read_files`, `drain_pieces`), the pinned copy rate
  (`copy_bandwidth`), the corpus in the engine's batches (`load_batches`), and the whole prepared corpus
  of the end-to-end A/B and probe scripts (`add_score_args`, `prepare_score_corpus`).

`SMOKE["on"]` (set by a script's ``--smoke``) shrinks the workloads a thousandfold and times one call,
to check a script on the CPU under the Triton interpreter before spending GPU time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

DIM = 128
QUERY_TOKENS = 32
MIN_LEN, MAX_LEN = 20, 300  # document lengths, uniform
WORKLOADS = ("exhaustive", "one_query", "colpali", "rerank")
# training shapes, all pairs: (queries, query tokens, documents, document tokens)
TRAIN_SHAPES = {
    "colbert-128": (128, 32, 128, 180),
    "colbert-256": (128, 32, 256, 180),
    "colpali-32": (32, 1024, 32, 1024),
}
SMOKE = {"on": False}
START = time.perf_counter()


def smoke_size(n: int, minimum: int = 2) -> int:
    """`n`, or a thousandth of it (at least `minimum`) in a smoke run."""
    return max(minimum, n // 1000) if SMOKE["on"] else n


# --------------------------------------------------------------------------------------------------
# environment and result files


def make_log(tag: str, clock: bool = False) -> Callable[[str], None]:
    """A `log(msg)` that prints ``[tag] msg`` (with ``clock``: seconds since start) to stderr."""

    def log(msg: str) -> None:
        head = f"{tag} {time.perf_counter() - START:6.1f}s" if clock else tag
        print(f"[{head}] {msg}", file=sys.stderr, flush=True)

    return log


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def meta(**extra: Any) -> dict[str, Any]:
    """Where and how a result was measured: date, device, versions, the command line."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    script = os.path.relpath(os.path.abspath(sys.argv[0])) if sys.argv and sys.argv[0] else "?"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "command": " ".join(["python", script, *sys.argv[1:]]),
        **extra,
    }


def write_json(path: str | None, data: Any, indent: int = 1, sort_keys: bool = False) -> None:
    """Write `data` as JSON to `path` (nothing when None) through a temporary file: a run cut short
    leaves the previous complete file, never half of one."""
    if path is None:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(data, indent=indent, sort_keys=sort_keys, default=str) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------
# timing


def host_times(fn: Callable[[], Any], repeats: int, warmup: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` on the host clock, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def alternating_host_rounds(
    paths: dict[str, Callable[[], Any]], rounds: int, repeats: int, log: Callable[[str], None]
) -> dict[str, list[float]]:
    """Each path's median milliseconds of ``repeats`` calls (host clock), in ``rounds`` rounds whose order
    alternates: {name: [ms of each round]}."""
    ms: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            ms[name].append(statistics.median(host_times(paths[name], repeats, warmup=0)) * 1e3)
        log(f"round {r}: { {k: round(v[-1], 1) for k, v in ms.items()} }")
    return ms


def cpu_int8_products(integers: bool, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run with the CPU's int8 products in integers or in fp32 (`maxsim_kernels.cpu._INT8_PRODUCT`),
    the CPU's own choice restored after it."""
    from maxsim_kernels import cpu

    def call() -> Any:
        cpu._INT8_PRODUCT = integers
        try:
            return fn()
        finally:
            cpu._INT8_PRODUCT = None

    return call


def add_cpu_rounds_args(parser: argparse.ArgumentParser, docs: int) -> None:
    """The CPU benchmarks' common options: --docs, --repeats, --rounds, --out, --smoke."""
    parser.add_argument("--docs", type=int, default=docs)
    add_rounds_args(parser)


def add_rounds_args(parser: argparse.ArgumentParser, repeats: int = 3, rounds: int = 3) -> None:
    """--repeats (calls a round), --rounds (alternating rounds), --out, --smoke."""
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--out")
    parser.add_argument("--smoke", action="store_true", help="a check of the script: tiny sizes, one call")


def median_us(fn: Callable[[], Any], repeats: int) -> float:
    """Median microseconds of a call (host clock), after a warm-up of a tenth as many calls (20 at least)."""
    import numpy as np

    return round(float(np.median(host_times(fn, repeats, max(20, repeats // 10)))) * 1e6, 1)


def median_ms(fn: Callable[[], Any], rep_ms: int = 300) -> float:
    """`triton.testing.do_bench` median (L2 flushed between calls) over ~rep_ms of calls; one call in a
    smoke run."""
    if SMOKE["on"]:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton

    return float(triton.testing.do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, return_mode="median"))


def time_ms(fn: Callable[[], Any], slow: bool, quick: bool = False) -> float:
    """Milliseconds of one call: do_bench median (``quick``: a shorter one); ``slow``: one warm-up call,
    then one call timed by CUDA events (the naive baselines take seconds). Without a GPU, one call."""
    if SMOKE["on"] or not torch.cuda.is_available():
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton

    if slow:  # one warm-up call, one timed call
        fn()
        sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        sync()
        return start.elapsed_time(end)
    if quick:
        return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def host_time(step: Callable[[], Any], steps: int = 50) -> float:
    """Milliseconds of host time a step takes to enqueue (no synchronisation inside the loop): when it
    exceeds the GPU time, the step is bound by Python and launch overheads."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / steps * 1e3


def kernel_time(batches, queries: torch.Tensor, q_offsets: torch.Tensor, backend: str) -> float:
    """Seconds of `maxsim_varlen` over `batches` (from `load_batches`), after one warm-up call."""
    from maxsim_kernels import maxsim_varlen

    maxsim_varlen(queries, q_offsets, *batches[0], backend=backend)  # compile / warm caches
    wait = torch.cuda.synchronize if queries.is_cuda else (lambda: None)
    wait()
    start = time.perf_counter()
    for docs, offsets in batches:
        maxsim_varlen(queries, q_offsets, docs, offsets, backend=backend)
    wait()
    return time.perf_counter() - start


BATCHES: list[tuple[float, object, object]] = []  # (host seconds, start event, end event) per batch


def instrument_batches() -> None:
    """Record each batch that `maxsim score` scores: its host launch time next to its GPU events (the
    engine's own timers); `batch_report` summarises them."""
    from maxsim_cli.scoring.engine import _Engine as engine

    timer, timer_end = engine._timer, engine._timer_end

    def _timer(self):  # noqa: ANN001, ANN202
        return (time.perf_counter(), timer(self))

    def _timer_end(self, pair) -> None:  # noqa: ANN001
        host_start, inner = pair
        timer_end(self, inner)
        if self.cuda:
            start, end = self.score_events[-1]
            BATCHES.append((time.perf_counter() - host_start, start, end))

    engine._timer, engine._timer_end = _timer, _timer_end


def batch_report() -> str:
    """Per-batch GPU and host milliseconds of the batches recorded since the last report."""
    import numpy as np

    if not BATCHES:
        return "no batches recorded"
    host = np.array([b[0] for b in BATCHES]) * 1e3
    gpu = np.array([b[1].elapsed_time(b[2]) for b in BATCHES])  # ms
    n = len(gpu)
    tenth = max(n // 10, 1)
    worst = np.argsort(gpu)[::-1][:5]
    tenths = [round(float(gpu[i : i + tenth].sum()) / 1e3, 3) for i in range(0, n, tenth)]
    slowest = [(int(i), round(float(gpu[i]), 2), round(float(host[i]), 2)) for i in worst]
    lines = [
        f"batches {n}: GPU ms per batch p10 {np.percentile(gpu, 10):.3f} / median {np.median(gpu):.3f} / "
        f"p90 {np.percentile(gpu, 90):.3f} / max {gpu.max():.3f}; sum {gpu.sum() / 1e3:.3f} s",
        f"  host ms per batch median {np.median(host):.3f} / p90 {np.percentile(host, 90):.3f} / max "
        f"{host.max():.3f}; sum {host.sum() / 1e3:.3f} s",
        f"  GPU s by tenth of the pass: {tenths}",
        f"  slowest batches (index, GPU ms, host ms): {slowest}",
    ]
    BATCHES.clear()
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# inputs in memory


def offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    """int64 offsets [n + 1] of `lengths`, on their device."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    out[1:] = lengths.cumsum(0)
    return out


def unit(n: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """n L2-normalised random fp16 vectors on `device()`, made in one fp32 block."""
    x = torch.randn(n, dim, generator=gen, device=device(), dtype=torch.float32)
    return torch.nn.functional.normalize(x, dim=-1).half()


def normal_tokens(n: int, gen: torch.Generator, dev: torch.device) -> torch.Tensor:
    """n L2-normalised random fp16 vectors, made in chunks (bounded fp32 temporaries)."""
    out = torch.empty(n, DIM, dtype=torch.float16, device=dev)
    for a in range(0, n, 1 << 22):
        b = min(n, a + (1 << 22))
        out[a:b] = torch.nn.functional.normalize(torch.randn(b - a, DIM, generator=gen, device=dev), dim=1)
    return out


def ragged(n: int, low: int, high: int, gen: torch.Generator, dev: torch.device):
    """(tokens, offsets) of n documents of low..high tokens, fp16, on `dev`."""
    lengths = torch.randint(low, high + 1, (n,), generator=gen, device=dev)
    offsets = offsets_of(lengths)
    return normal_tokens(int(offsets[-1]), gen, dev), offsets


def make_workload(name: str, seed: int = 0) -> dict[str, Any]:
    """One of the four forward workloads (`WORKLOADS`; BRIEF section 4) on `device()`: packed queries and
    documents, host offsets, and its FLOP and byte counts. Smoke runs take a thousandth of the sizes."""
    gen = torch.Generator(device=device()).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    w: dict[str, Any] = {"name": name}
    if name == "exhaustive":
        nq, lq, nd = smoke_size(512), 32, smoke_size(50_000)
        d_lens = torch.randint(MIN_LEN, MAX_LEN + 1, (nd,), generator=cpu_gen)
    elif name == "one_query":
        nq, lq, nd = 1, 32, smoke_size(100_000)
        d_lens = torch.randint(MIN_LEN, MAX_LEN + 1, (nd,), generator=cpu_gen)
    elif name == "colpali":
        nq, lq, nd = 1, smoke_size(1024, 16), smoke_size(1000)
        d_lens = torch.full((nd,), smoke_size(1024, 16))
    elif name == "rerank":
        nq, lq, per_q = smoke_size(64), 32, smoke_size(1000)
        nd = nq * per_q
        d_lens = torch.full((nd,), 180)
        # each query owns 1000 documents scattered over the pool, read in place through their indices
        w["cand_docs"] = torch.randperm(nd, generator=cpu_gen)
        w["cand_offsets"] = torch.arange(nq + 1, dtype=torch.int64) * per_q
        w["per_q"] = per_q
    else:
        raise ValueError(name)
    q_lens = torch.full((nq,), lq)
    w.update(nq=nq, lq=lq, nd=nd, d_lens=d_lens)
    w["q_off"], w["d_off"] = offsets_of(q_lens), offsets_of(d_lens)
    w["queries"] = unit(int(w["q_off"][-1]), DIM, gen)
    w["docs"] = unit(int(w["d_off"][-1]), DIM, gen)
    w["tq"], w["td"] = int(w["q_off"][-1]), int(w["d_off"][-1])
    if name == "rerank":
        scored = int(w["d_lens"][w["cand_docs"]].sum())
        w["flops"] = 2.0 * lq * scored * DIM
        w["bytes"] = scored * DIM * 2.0
    else:
        w["flops"] = 2.0 * w["tq"] * w["td"] * DIM
        w["bytes"] = w["td"] * DIM * 2.0
    return w


def training_inputs(
    nq: int, lq: int, nd: int, ld: int, dtype: torch.dtype, seed: int, dev: str = "cuda"
) -> dict:
    """A training batch of fixed lengths (`TRAIN_SHAPES`): packed q, d, their offsets, and an upstream
    gradient g [nq, nd] for all pairs."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(nq * lq, DIM, device=dev, generator=gen), dim=-1)
    d = torch.nn.functional.normalize(torch.randn(nd * ld, DIM, device=dev, generator=gen), dim=-1)
    return {
        "q": q.to(dtype),
        "d": d.to(dtype),
        "qo": torch.arange(0, nq * lq + 1, lq, device=dev, dtype=torch.int64),
        "do": torch.arange(0, nd * ld + 1, ld, device=dev, dtype=torch.int64),
        "g": torch.randn(nq, nd, device=dev, generator=gen),
        "shape": (nq, lq, nd, ld),
    }


def int8_kernel(queries, q_off, d8, d_off) -> str:
    """Which int8 all-pairs kernel `maxsim_varlen_int8` runs for these inputs (scores only)."""
    from maxsim_kernels import int8_host, maxsim_int8

    q8 = int8_host.quantize_per_token(queries)[0]
    return "gluon" if maxsim_int8.hopper_allpairs(q_off, d_off, q8, d8, False) is not None else "triton"


# the peers' layouts and entry points (flash-maxsim 0.3.0, late-interaction-kernels 0.4.5)


def padded(values: torch.Tensor, offsets: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed [T, d] -> zero-padded [n, width, d] and a bool mask [n, width]."""
    lens = offsets.diff().to(values.device)
    n = lens.numel()
    pos = torch.arange(width, device=values.device)
    mask = pos[None, :] < lens[:, None]
    out = torch.zeros(n, width, values.shape[1], dtype=values.dtype, device=values.device)
    out[mask] = values
    return out, mask


def padded_inputs(w: dict[str, Any]) -> dict[str, Any]:
    """Adds the padded layout to a workload (once): qp [nq, lq, d], dp and its mask dmask."""
    if "qp" not in w:
        w["qp"] = w["queries"].view(w["nq"], w["lq"], DIM)
        if w["name"] == "rerank":
            docs = w["docs"].view(w["nd"], 180, DIM)[w["cand_docs"].to(device())]
            w["dp"] = docs.view(w["nq"], w["per_q"], 180, DIM)  # the gathered copy the peers need
            w["dmask"] = torch.ones(w["nq"], w["per_q"], 180, dtype=torch.bool, device=device())
        else:
            width = int(w["d_lens"].max())
            w["dp"], w["dmask"] = padded(w["docs"], w["d_off"], width)
    return w


def flash(w: dict[str, Any]) -> Callable[[], torch.Tensor]:
    """flash-maxsim's fastest public entry point for the workload's layout."""
    import flash_maxsim as fm

    if w["name"] == "one_query":
        cu = w["d_off"].to(device(), torch.int32)
        return lambda: fm.flash_maxsim(w["queries"], w["docs"], cu)[None]
    w = padded_inputs(w)
    if w["name"] == "colpali":
        return lambda: fm.flash_maxsim(w["queries"], w["dp"])[None]
    if w["name"] == "rerank":
        return lambda: fm.flash_maxsim_batched(w["qp"], w["dp"], shared_docs=False)
    lens = w["d_lens"].to(device(), torch.int32)
    return lambda: fm.flash_maxsim_batched(w["qp"], w["dp"], doc_lengths=lens)


def lik(w: dict[str, Any]) -> Callable[[], torch.Tensor]:
    """late-interaction-kernels' entry point for the workload's layout (varlen where it has one)."""
    import late_interaction_kernels as lk

    if w["name"] in ("rerank", "colpali"):
        w = padded_inputs(w)
        return lambda: lk.maxsim(w["qp"], w["dp"]).view(w["nq"], -1)
    cq, cd = w["q_off"].to(device(), torch.int32), w["d_off"].to(device(), torch.int32)
    max_q, max_d = int(w["lq"]), int(w["d_lens"].max())
    return lambda: lk.maxsim_varlen(w["queries"], w["docs"], cq, cd, max_q, max_d)


# --------------------------------------------------------------------------------------------------
# corpora on disk: the `score` benchmark's


def build_corpus(
    root: str, total_bytes: int, shard_bytes: int, dev: torch.device, seed: int = 0
) -> list[str]:
    """fp16 shards totalling ~total_bytes under root (reused when already there): L2-normalised random
    vectors, d = 128, documents of 20-300 tokens, ids d000000000..."""
    from maxsim_cli.shards import write_shard
    from maxsim_cli.units import format_size

    os.makedirs(root, exist_ok=True)
    done = os.path.join(root, ".complete")
    if os.path.exists(done):
        return sorted(os.path.join(root, n) for n in os.listdir(root) if n.endswith(".safetensors"))
    gen = torch.Generator(device=dev).manual_seed(seed)
    token_bytes = DIM * 2
    paths, doc_id, written = [], 0, 0
    num_shards = max(1, -(-total_bytes // shard_bytes))
    for _ in range(num_shards):
        tokens_goal = max(total_bytes // num_shards // token_bytes, MAX_LEN)
        draws = tokens_goal // MIN_LEN + 1  # more lengths than needed, cut where the tokens run out
        lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (draws,), generator=gen, device=dev)
        lengths = lengths[: int((lengths.cumsum(0) <= tokens_goal).sum().item()) or 1]
        tokens = int(lengths.sum())
        emb = torch.randn(tokens, DIM, generator=gen, device=dev)
        emb = torch.nn.functional.normalize(emb, dim=1).to(torch.float16).cpu()
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cpu().cumsum(0)])
        ids = [f"d{doc_id + i:09d}" for i in range(len(lengths))]
        path = os.path.join(root, f"shard{len(paths):04d}.safetensors")
        write_shard(path, ids, emb, offsets=offsets, dtype="float16", normalized=True)
        paths.append(path)
        doc_id += len(lengths)
        written += tokens * token_bytes
        print(f"[common] wrote {path}: {len(lengths)} docs, {format_size(tokens * token_bytes)}",
              file=sys.stderr, flush=True)  # fmt: skip
    # The pages just written are dirty: their writeback to disk would run during the first timed run
    # (on the H200 machine a first run right after writing 10 GB took 1.31 s, 0.76 s once written back)
    os.sync()
    open(done, "w").close()
    return paths


def build_queries(path: str, n: int, dev: torch.device, seed: int = 1) -> None:
    """n queries of 32 tokens (fp16, L2-normalised random), ids q0000..."""
    from maxsim_cli.shards import write_shard

    gen = torch.Generator(device=dev).manual_seed(seed)
    emb = torch.randn(n * QUERY_TOKENS, DIM, generator=gen, device=dev)
    emb = torch.nn.functional.normalize(emb, dim=1).to(torch.float16).cpu()
    offsets = torch.arange(0, n * QUERY_TOKENS + 1, QUERY_TOKENS, dtype=torch.int64)
    write_shard(path, [f"q{i:04d}" for i in range(n)], emb, offsets=offsets, dtype="float16", normalized=True)


def drain_pieces(pieces: list[tuple[str, int]], lock: threading.Lock, view: memoryview) -> int:
    """Take (path, offset) pieces from the shared list until it is empty, each read with `os.preadv`
    into `view` (a piece is `len(view)` bytes, or less at a file's end); returns the bytes read."""
    fds: dict[str, int] = {}
    n = 0
    try:
        while True:
            with lock:
                if not pieces:
                    return n
                path, start = pieces.pop()
            if path not in fds:
                fds[path] = os.open(path, os.O_RDONLY)
            done = 0
            while done < len(view):
                got = os.preadv(fds[path], [view[done:]], start + done)
                if not got:
                    break
                done += got
            n += done
    finally:
        for fd in fds.values():
            os.close(fd)


def read_files(paths: list[str], threads: int, chunk: int = 32 << 20, nice: int = 0) -> tuple[float, int]:
    """Read every file's bytes with `threads` threads into reused buffers (pinned where CUDA is up, as
    the engine's staging slots are): the files cut into `chunk`-byte pieces that the threads take from
    one queue, so all threads stay busy to the end. (Dealing whole files to threads left most threads
    idle while a few read a second 512 MiB file: 20 files on 16 threads measured 13.5 GB/s on the H200
    machine, pieces 44 GB/s: results/host/read-rate-h200.json.) `nice` lowers the threads' priority (Linux).
    Returns (seconds, bytes)."""
    pieces = [(p, start) for p in paths for start in range(0, os.path.getsize(p), chunk)]
    pieces.reverse()
    lock = threading.Lock()
    total = [0]
    pinned = torch.cuda.is_available()
    buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=pinned) for _ in range(threads)]

    def worker(i: int) -> None:
        if nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        n = drain_pieces(pieces, lock, memoryview(buffers[i].numpy()).cast("B"))
        with lock:
            total[0] += n

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(worker, i) for i in range(threads)]:
            f.result()
    return time.perf_counter() - start, total[0]


def copy_bandwidth(total_bytes: int, dev: torch.device, chunk: int = 256 << 20) -> float:
    """Seconds to copy total_bytes host->device from a pinned buffer, chunk by chunk on one stream."""
    host = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(chunk, dtype=torch.uint8, device=dev)
    dst.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(max(1, total_bytes // chunk)):
        dst.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return elapsed * total_bytes / (max(1, total_bytes // chunk) * chunk)


def load_batches(
    paths: list[str], max_tokens: int, dev: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The corpus in batches of at most max_tokens tokens, on `dev`, offsets on the host."""
    from maxsim_cli.shards import open_corpus

    corpus = open_corpus(paths)
    out = []
    for shard in corpus.shards:
        for batch in shard.iter_batches(max_tokens):
            out.append((batch.embeddings.to(dev), batch.offsets))
    corpus.close()
    return out


def add_score_args(parser: argparse.ArgumentParser) -> None:
    """The options of every script that runs on `prepare_score_corpus`'s corpus."""
    parser.add_argument("--workdir", default="/var/tmp/mb")
    parser.add_argument("--size", default="10GB")
    parser.add_argument("--device", default="cuda", help="cuda (cpu: a check of the script)")
    parser.add_argument("--out", default=None)


def prepare_score_corpus(
    work: str, dev: torch.device, size: str, int8: bool = True
) -> tuple[dict[str, list[str]], str]:
    """The `score` benchmark's corpus, ready for the end-to-end A/B and probe scripts of `maxsim score`:
    built once under `work` (the 10 GB of fp16 shards that `bench_score.py` measures, their int8
    quantization in corpus-int8, 512 queries of 32 tokens, two small corpora, fp16 and int8), the page
    cache warmed, and `maxsim score` run once on each small corpus so that the kernels are compiled and
    loaded before anything is timed. Returns (the shards by precision, "fp16" and "int8"; the query file).
    ``int8=False``: no int8 corpora (none made, none warmed, none returned)."""
    from maxsim_cli.quantize import quantize_corpus
    from maxsim_cli.scoring.entry import score
    from maxsim_cli.units import parse_size

    shard_bytes = 512 << 20 if dev.type == "cuda" else 4 << 20
    paths = build_corpus(os.path.join(work, "corpus"), parse_size(size), shard_bytes, dev)
    small = build_corpus(os.path.join(work, "small"), 32 << 20, 16 << 20, dev, seed=5)
    qpath = os.path.join(work, "queries.safetensors")
    if not os.path.exists(qpath):
        build_queries(qpath, 512, dev)
    corpora, warm = {"fp16": paths}, [small]
    if int8:
        int8_dir = os.path.join(work, "corpus-int8")
        if not os.path.isdir(int8_dir):
            quantize_corpus(paths, int8_dir, device=dev.type, sample_queries=0)
        small8 = os.path.join(work, "small-int8")
        if not os.path.isdir(small8):
            quantize_corpus(small, small8, device=dev.type, sample_queries=0)
        corpora["int8"], warm = [int8_dir], [small, [small8]]
    read_files(paths, os.cpu_count() or 1)  # warm the page cache
    for corpus in warm:
        score(qpath, corpus, output=os.path.join(work, "warm-up.trec"), device=dev.type, log=lambda m: None)
    return corpora, qpath
