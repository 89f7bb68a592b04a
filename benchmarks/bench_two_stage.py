"""Two-stage search on an 8 GB-equivalent corpus: `maxsim quantize --bits 4/2` speed, one query's
two-stage cost against its bound (exact tier in host memory, then on disk), and its scores checked.

    python benchmarks/bench_two_stage.py --workdir /var/tmp/mb-two-stage \
        --out benchmarks/results/codes/two-stage-h100.json
    python benchmarks/bench_two_stage.py --smoke --workdir /tmp/two-stage-smoke --out /tmp/two-stage.json

Corpus: fp16 shards of 512 MiB (`common.build_corpus`: L2-normalised random vectors, d = 128, documents of
20-300 tokens, uniform), ``--size`` in all (8 GB: ~31M tokens, ~195K documents), written once into
WORKDIR/corpus and reused while its stamp (size, shard size, seed) matches and it opens with the tokens
expected; 32 queries of 32 tokens. Disk: the corpus and its 4-bit (~2.1 GB) and 2-bit (~1.1 GB) tiers.
Stages (``--stages``; the JSON is rewritten after each, so a time-out keeps what was done):

  bandwidth  pinned host-to-device copy (torch, 2 GiB in 256 MiB copies); the corpus files read with 16
             threads from disk (dropped from the page cache first: posix_fadvise DONTNEED, checked with
             mincore) and from the page cache; random reads of a mean document's size (41 KB) from disk
  quantize   `maxsim quantize CORPUS -o TIER --bits 4` and `--bits 2` (k-means included, quality check
             at its defaults) as a fresh process each, `--max-host-memory` given: wall time and the
             child's peak RSS (os.wait4). Target: <= 30 s each on the GPU, RSS within the budget
  two-stage  per tier: the tier resident on the GPU (`open_corpus(TIER).to("cuda")`), one query, top 100
             at the default depth (4-bit 1000, 2-bit 2000), p50 over --repeats of distinct queries, of
               scan      the same scan alone: the kernel (`maxsim_varlen` on the residency) and the API
                         (`search(q, tier, k=depth)`)
               host      `search(q, tier, k=100, exact_from=open_corpus(CORPUS))`, the corpus files in the
                         page cache (how a GPU search holds the exact tier in host memory: the engine reads
                         only the candidates' rows from the files)
               disk      the same with the corpus files dropped from the page cache before every call
               cpu       the exact tier made resident in host memory (`open_corpus(CORPUS).to("cpu")`)
                         with device="auto": the exact stage runs on the scan's GPU, which reads the
                         candidates' rows from the mapped host memory (`maxsim_cli.scoring.host_rows`);
                         "cpu_staged" in alternating rounds: the rows gathered by host threads into a
                         page-locked buffer and copied (MAXSIM_MAP_HOST=0), as before the mapping
             bound = scan + the candidates' exact bytes (their fp16 rows) / pinned H2D bandwidth (target:
             host within 2x of it); for disk the bound with the random-read rate is given beside it
  check      8 queries: the two-stage top 100 of each tier against `search(queries, CORPUS, k=1000)`:
             every document the two-stage run returns must carry the exact search's score, bit for bit;
             recall@100 of the exact top 100 beside it

The candidates' bytes are computed from the scan's top ``depth`` (the documents' lengths in the corpus),
and checked against the run's ``stats.extra["two_stage"]["exact_bytes_read"]``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from common import (
    DIM,
    QUERY_TOKENS,
    SMOKE,
    build_corpus,
    copy_bandwidth,
    device,
    make_log,
    median_ms,
    meta,
    read_files,
    smoke_size,
    sync,
    write_json,
)

log = make_log("two-stage", clock=True)
BITS = (4, 2)
STAGES = ("bandwidth", "quantize", "two-stage", "check")
STAMP = "bench-two-stage.json"


# --------------------------------------------------------------------------------------------------
# the page cache: drop a file's pages, and how much of it is cached


def drop_cache(paths: list[str]) -> None:
    """Ask the kernel to drop the files' clean pages from the page cache (POSIX_FADV_DONTNEED)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_LIBC = None


def cached_fraction(path: str) -> float | None:
    """Share of the file's pages in the page cache (mincore over a map that touches nothing); None where
    that cannot be asked."""
    global _LIBC
    try:
        if _LIBC is None:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_long,
            ]
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            _LIBC = libc
        size = os.path.getsize(path)
        if size == 0:
            return 1.0
        page = os.sysconf("SC_PAGE_SIZE")
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = _LIBC.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if _LIBC.mincore(addr, size, vec) != 0:
                    return None
                return float((np.frombuffer(vec, dtype=np.uint8) & 1).mean())
            finally:
                _LIBC.munmap(addr, size)
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        return None


def filesystem_of(path: str) -> str | None:
    """The type of the file system `path` is on (/proc/mounts, longest mount point), or None."""
    path = os.path.realpath(path)
    best, kind = "", None
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                parts = line.split()
                if len(parts) >= 3 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")):
                    if len(parts[1]) > len(best):
                        best, kind = parts[1], parts[2]
    except OSError:
        return None
    return kind


def random_read_rate(paths: list[str], reads: int, size: int, threads: int, seed: int = 0) -> dict:
    """`reads` preads of `size` bytes at random 4 KiB-aligned offsets of the files, `threads` at a time
    (the files dropped from the page cache first): GB/s and reads/s."""
    rng = random.Random(seed)
    sizes = {p: os.path.getsize(p) for p in paths}
    jobs = []
    for _ in range(reads):
        path = rng.choice(paths)
        jobs.append((path, rng.randrange(0, max(1, sizes[path] - size)) // 4096 * 4096))
    drop_cache(paths)
    lock = threading.Lock()
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}

    def worker() -> int:
        buf = bytearray(size)
        n = 0
        while True:
            with lock:
                if not jobs:
                    return n
                path, offset = jobs.pop()
            n += os.preadv(fds[path], [buf], offset)

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            total = sum(f.result() for f in [pool.submit(worker) for _ in range(threads)])
        elapsed = time.perf_counter() - start
    finally:
        for fd in fds.values():
            os.close(fd)
    return {
        "reads": reads,
        "read_bytes": size,
        "threads": threads,
        "s": elapsed,
        "GBps": total / elapsed / 1e9,
        "reads_per_s": reads / elapsed,
    }


# --------------------------------------------------------------------------------------------------
# inputs


def corpus_paths(root: str) -> list[str]:
    return sorted(os.path.join(root, n) for n in os.listdir(root) if n.endswith(".safetensors"))


def prepare_corpus(root: str, total_bytes: int, shard_bytes: int, dev: torch.device, seed: int) -> dict:
    """The fp16 corpus under root: reused when its stamp matches and it opens with the tokens expected,
    else (re)built. Returns what it is and how it came."""
    from maxsim_cli import open_corpus

    want = {"size_bytes": total_bytes, "shard_bytes": shard_bytes, "seed": seed, "dim": DIM}
    stamp = os.path.join(root, STAMP)

    def valid() -> dict | None:
        try:
            with open(stamp, encoding="utf-8") as fh:
                if json.load(fh) != want:
                    return None
            if not os.path.exists(os.path.join(root, ".complete")):
                return None
            with open_corpus(root) as corpus:
                info = {
                    "documents": len(corpus),
                    "tokens": int(corpus.num_tokens),
                    "dim": corpus.dim,
                    "dtype": corpus.dtype,
                    "shards": len(corpus.shards),
                }
        except Exception as exc:  # noqa: BLE001 - anything wrong with an old corpus: build it again
            log(
                f"corpus in {root} not reused: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            )
            return None
        ok = info["dtype"] == "float16" and info["dim"] == DIM
        ok = ok and 0.9 * total_bytes <= info["tokens"] * DIM * 2 <= 1.01 * total_bytes
        return info if ok else None

    if os.path.isdir(root):
        info = valid()
        if info is not None:
            log(f"corpus reused: {root} ({info['documents']} documents, {info['tokens']} tokens)")
            return {**info, "path": root, "reused": True}
        shutil.rmtree(root)
    t0 = time.perf_counter()
    build_corpus(root, total_bytes, shard_bytes, dev, seed=seed)
    with open(stamp, "w", encoding="utf-8") as fh:
        json.dump(want, fh)
    built_s = time.perf_counter() - t0
    info = valid()
    if info is None:
        raise SystemExit(f"the corpus just built in {root} does not open as expected")
    log(f"corpus built in {built_s:.1f} s: {info['documents']} documents, {info['tokens']} tokens")
    return {**info, "path": root, "reused": False, "built_s": built_s}


def make_queries(n: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n * QUERY_TOKENS, DIM, generator=gen)
    return torch.nn.functional.normalize(q, dim=1).half()


def queries_of(values: torch.Tensor, first: int, count: int):
    from maxsim_cli import Queries

    rows = [values[(first + i) * QUERY_TOKENS : (first + i + 1) * QUERY_TOKENS] for i in range(count)]
    return Queries.from_embeddings([f"q{first + i:04d}" for i in range(count)], rows)


# --------------------------------------------------------------------------------------------------
# quantize: a fresh `maxsim quantize` process


def _die_with_parent() -> None:  # the child must not outlive a benchmark stopped by its time limit
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_quantize(
    corpus: str,
    out: str,
    bits: int,
    dev: str,
    host_memory: str,
    timeout_s: float,
    extra: list[str],
    log_path: str,
) -> dict:
    """`maxsim quantize` as a child process: wall time, exit code, peak RSS (os.wait4), its JSON report."""
    if os.path.exists(out):
        shutil.rmtree(out)
    cmd = [
        sys.executable,
        "-m",
        "maxsim_cli",
        "quantize",
        corpus,
        "-o",
        out,
        "--bits",
        str(bits),
        "--device",
        dev,
        "--max-host-memory",
        host_memory,
        "--json",
        "-q",
        *extra,
    ]
    log(f"$ {' '.join(cmd)}")
    with (
        open(log_path, "w", encoding="utf-8") as err,
        open(log_path + ".json", "w+", encoding="utf-8") as out_fh,
    ):
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out_fh, stderr=err, preexec_fn=_die_with_parent)
        status, usage, timed_out = None, None, False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t0 > timeout_s:
                proc.kill()
                _pid, status, usage = os.wait4(proc.pid, 0)
                timed_out = True
                break
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        out_fh.seek(0)
        stdout = out_fh.read()
    row: dict = {
        "command": " ".join(cmd),
        "wall_s": wall,
        "rc": proc.returncode,
        "timed_out": timed_out,
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "user_s": usage.ru_utime,
        "sys_s": usage.ru_stime,
    }
    try:
        row["report"] = json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        row["report"] = None
    if proc.returncode != 0:
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            row["stderr_tail"] = fh.read()[-2000:]
        log(f"quantize --bits {bits} failed (rc {proc.returncode}): {row['stderr_tail'][-400:]}")
    return row


# --------------------------------------------------------------------------------------------------
# timing


def p50_ms(fn, repeats: int, warmup: int, before=None) -> dict:
    """Host-clock milliseconds of fn(i) over `repeats` calls (after `warmup`), `before(i)` untimed."""
    for i in range(warmup):
        if before is not None:
            before(i)
        fn(i)
    times = []
    for i in range(repeats):
        if before is not None:
            before(warmup + i)
        sync()
        t0 = time.perf_counter()
        fn(warmup + i)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"p50_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "ms": times}


def candidate_bytes(run, lengths: dict[str, int]) -> int:
    """fp16 bytes of the documents of a run (the exact stage reads each candidate's rows)."""
    return sum(lengths[r.docno] for r in run) * DIM * 2


def two_stage_tier(
    args,
    record: dict,
    bits: int,
    tier: str,
    corpus_root: str,
    qvals: torch.Tensor,
    lengths: dict[str, int],
    dev: torch.device,
) -> dict:
    from maxsim_kernels import maxsim_varlen

    from maxsim_cli import open_corpus, search

    out: dict = {"tier": tier}
    exact_paths = corpus_paths(corpus_root)
    nq = qvals.shape[0] // QUERY_TOKENS
    singles = [queries_of(qvals, i, 1) for i in range(nq)]
    with open_corpus(tier) as compressed, open_corpus(corpus_root) as exact:
        t0 = time.perf_counter()
        compressed.to(str(dev))
        out["resident_s"] = time.perf_counter() - t0
        out["quantization"] = compressed.quantization
        out["tier_tokens"] = int(compressed.num_tokens)
        res = compressed.residency
        out["tier_device_bytes"] = int(res.nbytes)
        # the default depth for k = 100, as the search picks it
        warm = search(singles[0], compressed, k=100, exact_from=exact)
        depth = int(warm.stats.extra["two_stage"]["depth"])
        out["depth"] = depth
        out["k"] = 100
        log(f"--bits {bits}: resident in {out['resident_s']:.2f} s, depth {depth}")

        # the scan alone: the kernel on the residency, and the API's search of the tier for the top depth
        qdev = [q.batch.embeddings.to(dev) for q in singles]
        q_off = torch.tensor([0, QUERY_TOKENS], device=dev)
        # int4: scales; residual2: its codebook; int2: scales and its grid (the codebook)
        kw = {} if res.scales is None else {"doc_scales": res.scales}
        if compressed.codebook is not None:
            kw["codebook"] = compressed.codebook.for_kernels(dev)
        out["scan_kernel_ms"] = median_ms(
            lambda: maxsim_varlen(qdev[0], q_off, res.embeddings, res.offsets, **kw), args.rep_ms
        )
        out["scan_kernel_TBps"] = out["tier_tokens"] * res.embeddings.shape[1] / out["scan_kernel_ms"] / 1e9
        scans = {}

        def api_scan(i: int) -> None:
            scans[i % nq] = search(singles[i % nq], compressed, k=depth)

        out["scan_api"] = p50_ms(api_scan, args.repeats, 3)
        cand = [candidate_bytes(run, lengths) for run in scans.values()]
        out["candidate_bytes_p50"] = int(statistics.median(cand))
        out["candidate_documents"] = depth
        h2d = record["bandwidth"].get("h2d_pinned_GBps")
        copy_ms = out["candidate_bytes_p50"] / (h2d * 1e9) * 1e3 if h2d else None
        out["bound"] = {
            "copy_ms": copy_ms,
            "kernel_scan_plus_copy_ms": out["scan_kernel_ms"] + copy_ms if copy_ms is not None else None,
            "api_scan_plus_copy_ms": out["scan_api"]["p50_ms"] + copy_ms if copy_ms is not None else None,
        }
        scan_note = f"scan kernel {out['scan_kernel_ms']:.3f} ms ({out['scan_kernel_TBps']:.2f} TB/s)"
        scan_note += f", API {out['scan_api']['p50_ms']:.2f} ms"
        log(f"--bits {bits}: {scan_note}; candidates {out['candidate_bytes_p50'] / 1e6:.1f} MB")
        write_json(args.out, record)

        runs = {}
        split: list[tuple[float, float]] = []  # (scan, exact) wall seconds of each call, as its stats say

        def two_stage(i: int) -> None:
            runs[i % nq] = run = search(singles[i % nq], compressed, k=100, exact_from=exact)
            parts = run.stats.extra["two_stage"]
            split.append((parts["scan_wall_s"], parts["exact_wall_s"]))

        def stage_split(row: dict, calls: int) -> None:
            """The p50 of the two stages' own times over the last `calls` calls (the run's stats)."""
            last = split[-calls:]
            row["scan_stage_p50_ms"] = statistics.median(s for s, _ in last) * 1e3
            row["exact_stage_p50_ms"] = statistics.median(e for _, e in last) * 1e3

        # host: the corpus files in the page cache
        read_files(exact_paths, os.cpu_count() or 1)
        out["host"] = p50_ms(two_stage, args.repeats, 3)
        stage_split(out["host"], args.repeats)
        out["host"]["cached_fraction_after"] = cached_fraction(exact_paths[0])
        last = runs[max(runs)]
        out["stats_exact_bytes_read"] = last.stats.extra["two_stage"].get("exact_bytes_read")
        out["stats_two_stage"] = last.stats.extra["two_stage"]
        for name in ("kernel_scan_plus_copy_ms", "api_scan_plus_copy_ms"):
            bound = out["bound"][name]
            out["host"][f"over_{name.replace('_plus_copy_ms', '')}_bound"] = (
                out["host"]["p50_ms"] / bound if bound else None
            )
        log(
            f"--bits {bits}: two-stage, exact tier in the page cache: p50 {out['host']['p50_ms']:.2f} ms "
            f"(bound {out['bound']['kernel_scan_plus_copy_ms']}) "
        )
        write_json(args.out, record)

        # disk: the corpus files dropped from the page cache before every call
        fractions = []

        def drop(_i: int) -> None:
            drop_cache(exact_paths)
            fractions.append(cached_fraction(exact_paths[0]))

        out["disk"] = p50_ms(two_stage, args.disk_repeats, 1, before=drop)
        stage_split(out["disk"], args.disk_repeats)
        known = [f for f in fractions if f is not None]
        out["disk"]["cached_fraction_before_call_max"] = max(known) if known else None
        rand = record["bandwidth"].get("disk_random") or {}
        if rand.get("GBps"):
            out["disk"]["bound_random_reads_ms"] = (
                out["scan_kernel_ms"] + out["candidate_bytes_p50"] / (rand["GBps"] * 1e9) * 1e3
            )
        log(f"--bits {bits}: two-stage, exact tier on disk: p50 {out['disk']['p50_ms']:.2f} ms")
        write_json(args.out, record)
        read_files(exact_paths, os.cpu_count() or 1)  # back in the page cache

        # the exact tier resident in host memory: device="auto" scores the exact stage on the scan's GPU,
        # the candidates' rows read by the GPU from the mapped residency ("cpu") and, in alternating
        # rounds, gathered by host threads into a staging buffer ("cpu_staged", MAXSIM_MAP_HOST=0)
        if not args.skip_cpu_exact:
            t0 = time.perf_counter()
            try:
                exact.to("cpu")
            except Exception as exc:  # noqa: BLE001 - a host without room: say so and go on
                out["cpu"] = {"error": str(exc).splitlines()[0]}
            else:
                resident_s = time.perf_counter() - t0
                out.update(host_resident_rounds(args, exact, two_stage, stage_split, runs))
                out["cpu"]["resident_s"] = resident_s
                map_s = out["cpu"].get("map_s")  # None where no GPU maps the rows
                log(
                    f"--bits {bits}: two-stage, exact tier resident on the host (exact stage on "
                    f"{out['cpu']['exact_device']}): p50 {out['cpu']['p50_ms']:.2f} ms mapped, "
                    f"{out['cpu_staged']['p50_ms']:.2f} ms staged; mapped in "
                    + ("-" if map_s is None else f"{map_s:.2f} s")
                )
                exact.release()
        if dev.type == "cuda":
            out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(dev)
    return out


def host_resident_rounds(args, exact, two_stage, stage_split, runs: dict) -> dict:
    """The two-stage calls with the exact tier resident on the host, its rows mapped for the GPU ("cpu")
    and staged by host threads ("cpu_staged"), in alternating rounds: each row's p50 over every round's
    calls, and the stages' split; the mapping's own time (`HostMapping.seconds`)."""
    from maxsim_cli.scoring.host_rows import staging_of

    calls = max(3, args.repeats // 2)
    staging = staging_of(exact.residency)
    os.environ["MAXSIM_MAP_HOST"] = "1"
    two_stage(0)  # the first call maps the rows
    mapping = staging.mapping
    rows: dict[str, dict] = {"cpu": {"ms": []}, "cpu_staged": {"ms": []}}
    splits: dict[str, list[dict]] = {"cpu": [], "cpu_staged": []}
    try:
        for _round in range(2):
            for name in ("cpu_staged", "cpu"):
                staging.mapping = mapping if name == "cpu" else None
                timed = p50_ms(two_stage, calls, 1)
                rows[name]["ms"] += timed["ms"]
                split_row: dict = {}
                stage_split(split_row, calls)
                splits[name].append(split_row)
    finally:
        staging.mapping = mapping
    for name, row in rows.items():
        row["p50_ms"] = statistics.median(row["ms"])
        row["min_ms"], row["max_ms"] = min(row["ms"]), max(row["ms"])
        for key in ("scan_stage_p50_ms", "exact_stage_p50_ms"):
            row[key] = statistics.median(split[key] for split in splits[name])
        row["exact_device"] = runs[max(runs)].stats.device
    if args.profile:  # where a mapped call's host time goes: cProfile's top functions by cumulative time
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for i in range(calls):
            two_stage(i)
        sync()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
        rows["cpu"]["profile"] = text.getvalue().splitlines()
    rows["cpu"]["mapped"] = mapping is not None
    rows["cpu"]["map_s"] = mapping.seconds if mapping is not None else None
    rows["cpu"]["mapped_bytes"] = mapping.nbytes if mapping is not None else 0
    return rows


def check_tier(tier: str, corpus_root: str, qvals: torch.Tensor, count: int) -> dict:
    """The two-stage scores of `count` queries against the exact search of the corpus: bit for bit."""
    from maxsim_cli import open_corpus, search

    queries = queries_of(qvals, 0, count)
    with open_corpus(tier) as compressed, open_corpus(corpus_root) as exact:
        compressed.to(str(device()))
        two = search(queries, compressed, k=100, exact_from=exact).to_dict()
        full = search(queries, exact, k=1000).to_dict()
    compared = equal = found = 0
    mismatches = []
    for qid, rows in two.items():
        exact_scores = dict(full.get(qid, []))
        top100 = {d for d, _ in full.get(qid, [])[:100]}
        found += len(top100 & {d for d, _ in rows})
        for docno, score in rows:
            if docno not in exact_scores:
                continue
            compared += 1
            same = np.float32(score).view(np.uint32) == np.float32(exact_scores[docno]).view(np.uint32)
            equal += bool(same)
            if not same and len(mismatches) < 5:
                mismatches.append(
                    {"qid": qid, "docno": docno, "two_stage": score, "exact": exact_scores[docno]}
                )
    returned = sum(len(r) for r in two.values())
    return {
        "queries": count,
        "returned": returned,
        "compared": compared,
        "bitwise_equal": equal,
        "not_in_exact_top_1000": returned - compared,
        "mismatches": mismatches,
        "recall_at_100": found / max(1, sum(min(100, len(r)) for r in full.values())),
        "ok": compared == equal and compared == returned,
    }


# --------------------------------------------------------------------------------------------------


def main() -> None:
    from maxsim_cli.units import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/var/tmp/mb-two-stage")
    parser.add_argument("--size", default="8GB", help="the fp16 corpus's size (8GB: ~31M tokens)")
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--bits", default="4,2")
    parser.add_argument("--queries", type=int, default=32, help="distinct one-query calls, cycled")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls, exact tier in host memory")
    parser.add_argument("--disk-repeats", type=int, default=10, help="timed calls, exact tier on disk")
    parser.add_argument("--check-queries", type=int, default=8)
    parser.add_argument("--rep-ms", type=int, default=300, help="do_bench time of the kernel scan")
    parser.add_argument("--quantize-host-memory", default="8GiB", help="maxsim quantize --max-host-memory")
    parser.add_argument("--quantize-timeout", type=float, default=240.0)
    parser.add_argument("--quantize-args", default="", help="more options for maxsim quantize")
    parser.add_argument("--skip-cpu-exact", action="store_true", help="no exact tier resident on the host")
    parser.add_argument("--profile", action="store_true", help="cProfile the mapped calls (host time)")
    parser.add_argument("--out")
    parser.add_argument("--smoke", action="store_true", help="a check of the script: tiny sizes, few calls")
    args = parser.parse_args()
    SMOKE["on"] = args.smoke
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(stages) - set(STAGES)
    if unknown:
        parser.error(f"--stages: unknown {sorted(unknown)}; choose from {','.join(STAGES)}")
    bits_list = [int(b) for b in args.bits.split(",")]
    total_bytes = smoke_size(parse_size(args.size), 4 << 20)
    shard_bytes = smoke_size(512 << 20, 1 << 20)
    extra = args.quantize_args.split()
    if args.smoke:
        args.queries, args.repeats, args.disk_repeats = 4, 2, 2
        args.check_queries = 2
        extra = extra or ["--sample-queries", "4", "--sample-docs", "20"]
    dev = device()
    os.makedirs(args.workdir, exist_ok=True)
    record: dict = {
        "meta": meta(dtype="float16", dim=DIM, size=args.size, stages=stages, cpus=os.cpu_count()),
        "corpus": {},
        "bandwidth": {},
        "quantize": {},
        "two_stage": {},
        "check": {},
    }
    record["meta"]["workdir_filesystem"] = filesystem_of(args.workdir)
    corpus_root = os.path.join(args.workdir, "corpus")
    record["corpus"] = prepare_corpus(corpus_root, total_bytes, shard_bytes, dev, seed=0)
    paths = corpus_paths(corpus_root)
    tiers = {b: os.path.join(args.workdir, f"corpus-{b}bit") for b in bits_list}
    if not record["corpus"]["reused"]:  # tiers of an older corpus
        for t in tiers.values():
            shutil.rmtree(t, ignore_errors=True)
    write_json(args.out, record)

    threads = min(16, os.cpu_count() or 1)
    if "bandwidth" in stages:
        bw = record["bandwidth"]
        if dev.type == "cuda":
            nbytes = 2 << 30
            bw["h2d_pinned_GBps"] = nbytes / copy_bandwidth(nbytes, dev) / 1e9
        some = paths[: max(1, min(len(paths), 4))]
        drop_cache(some)
        bw["cached_fraction_after_drop"] = cached_fraction(some[0])
        secs, n = read_files(some, threads)
        bw["disk_sequential"] = {"bytes": n, "s": secs, "GBps": n / secs / 1e9, "threads": threads}
        secs, n = read_files(paths, threads)
        secs, n = read_files(paths, threads)  # second pass: from the page cache
        bw["page_cache"] = {"bytes": n, "s": secs, "GBps": n / secs / 1e9, "threads": threads}
        mean_doc = int(160 * DIM * 2)
        bw["disk_random"] = random_read_rate(paths, smoke_size(4000, 50), mean_doc, threads)
        disk_note = f"disk {bw['disk_sequential']['GBps']:.2f} GB/s sequential, "
        disk_note += f"{bw['disk_random']['GBps']:.2f} GB/s in random 41 KB reads"
        log(
            f"bandwidth: H2D pinned {bw.get('h2d_pinned_GBps')}, {disk_note}, page cache "
            f"{bw['page_cache']['GBps']:.1f} GB/s (cached after a drop: {bw['cached_fraction_after_drop']})"
        )
        write_json(args.out, record)
    elif dev.type == "cuda":
        record["bandwidth"]["h2d_pinned_GBps"] = (2 << 30) / copy_bandwidth(2 << 30, dev) / 1e9

    if "quantize" in stages:
        read_files(paths, threads)  # the source in the page cache, as right after writing it
        budget = parse_size(args.quantize_host_memory)
        for bits in bits_list:
            row = run_quantize(
                corpus_root,
                tiers[bits],
                bits,
                dev.type,
                args.quantize_host_memory,
                args.quantize_timeout,
                extra,
                os.path.join(args.workdir, f"quantize-{bits}.log"),
            )
            row["max_host_memory_bytes"] = budget
            row["rss_within_budget"] = row["peak_rss_bytes"] <= budget
            row["within_30s"] = row["rc"] == 0 and row["wall_s"] <= 30
            rep = row.get("report") or {}
            if rep.get("num_tokens"):
                row["output_bytes_per_token"] = rep["output_bytes"] / rep["num_tokens"]
            record["quantize"][str(bits)] = row
            log(
                f"quantize --bits {bits}: rc {row['rc']}, {row['wall_s']:.1f} s, peak RSS "
                f"{row['peak_rss_bytes'] / 2**30:.2f} GiB"
            )
            write_json(args.out, record)

    qvals = make_queries(max(args.queries, args.check_queries))
    if "two-stage" in stages:
        from maxsim_cli import open_corpus

        with open_corpus(corpus_root) as corpus:
            lengths = {}
            for shard in corpus.shards:
                lengths.update(zip(shard.ids, np.diff(shard.offsets).tolist(), strict=True))
        for bits in bits_list:
            try:
                record["two_stage"][str(bits)] = two_stage_tier(
                    args,
                    record,
                    bits,
                    tiers[bits],
                    corpus_root,
                    qvals[: args.queries * QUERY_TOKENS],
                    lengths,
                    dev,
                )
            except Exception as exc:  # noqa: BLE001 - one tier's failure is recorded; the next still runs
                record["two_stage"][str(bits)] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                log(f"two-stage --bits {bits} failed: {type(exc).__name__}: {exc}")
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            write_json(args.out, record)

    if "check" in stages:
        for bits in bits_list:
            try:
                record["check"][str(bits)] = check_tier(tiers[bits], corpus_root, qvals, args.check_queries)
            except Exception as exc:  # noqa: BLE001
                record["check"][str(bits)] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            log(f"check --bits {bits}: {record['check'][str(bits)]}")
            write_json(args.out, record)
    log("done")


if __name__ == "__main__":
    main()
