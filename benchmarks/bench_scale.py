"""One query's scan over a synthetic 1B-token corpus of 2-bit residual codes resident on one GPU, 4-bit codes
at the largest token count that fits, and a two-stage search composed from its parts with the exact tier
in host memory.

    python benchmarks/bench_scale.py --out benchmarks/results/codes/scale-h100.json
    python benchmarks/bench_scale.py --tokens 5e8 --out benchmarks/results/codes/scale-h100.json
    python benchmarks/bench_scale.py --smoke --out /tmp/scale.json

The corpus is synthesized on the GPU, never written: document lengths uniform in 20-300 tokens (~6.25M
documents for 1e9 tokens), int64 offsets, d = 128. The codes are what `maxsim_kernels.maxsim_codes`
scans (uint8 rows, one a token), drawn at random in chunks of 2^25 tokens so that GPU memory holds the
codes and one chunk: random bytes, and for residual2 a random centroid id below K in bytes 0-3 (uint32,
little-endian). Scores of random codes mean nothing; the bytes read and the work per token are a real
corpus's. Stages (``--stages``; the JSON is rewritten after each, so a time-out keeps what was done; a
CUDA out-of-memory error is recorded and the next stage runs):

  residual2  one query of 32 tokens against every document: `maxsim_varlen(q, q_off, codes, offsets,
             codebook=...)`, the median of ``--rounds`` `triton.testing.do_bench` medians (L2 flushed),
             TB/s on the 36 B/token the codes hold; and with the top ``--depth`` taken (`torch.topk`).
             Once for each codebook of ``--codebooks``: ``default`` is the K `maxsim quantize` picks for
             this many tokens (2^18 at 1e9: a 64 MiB codebook, larger than L2, whose rows every token
             gathers), a number is a K of its own (4096: 1 MiB, L2-resident). Target: <= 15 ms at 1e9
  two-stage  composed from its parts, on the codes of ``--two-stage-codec`` (int2, as `maxsim quantize
             --bits 2` writes by default, run after the int2 stage's scan; residual2 with its default
             codebook, after the residual2 stage): an exact tier of the first documents (fp16, or int8
             with scales: ``--exact-dtype``) in pageable host memory, as many
             as ``--exact-host-bytes`` holds (default 60% of MemAvailable); per query, p50 over
             ``--repeats`` distinct queries, of: the scan of those documents' codes and their top
             ``--depth`` (to the host), the candidates' rows gathered on the host (`index_select` into
             pinned memory), copied to the GPU, scored exactly (`maxsim_varlen`) and cut to the top 100.
             Bound: scan + candidate bytes / pinned host-to-device bandwidth (measured here). Beside it,
             the 1e9-token figure composed: the full scan's time (with its top ``--depth``, from the
             codec's own stage) + the measured exact-stage parts
  int4       one query against 4-bit codes (uint8 [T, 64] + fp32 scales) of the first documents, as many
             as fit 92% of the free GPU memory once the 2-bit codes are freed (at most ``--tokens``)
  int2       one query against int2 codes (uint8 [T, 32] + fp32 scales, `maxsim quantize --codec int2`)
             of every document, TB/s on its 36 B/token, and with the top ``--depth`` taken. Target: <= 15
             ms at 1e9
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from common import (
    DIM,
    MAX_LEN,
    MIN_LEN,
    QUERY_TOKENS,
    SMOKE,
    copy_bandwidth,
    device,
    make_log,
    median_ms,
    meta,
    sync,
    write_json,
)

log = make_log("scale", clock=True)
STAGES = ("residual2", "two-stage", "int4", "int2")
CHUNK_TOKENS = 1 << 25
BYTES = {"residual2": 4 + DIM // 4, "int4": DIM // 2 + 4, "int2": DIM // 4 + 4}  # what a token's scan reads
EXACT_BYTES = {"float16": DIM * 2, "int8": DIM + 4}


def mem_available() -> int:
    """Host memory this process may still fill (bytes): MemAvailable, or less where a cgroup (v2) limit
    leaves less."""
    available = None
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    if available is None:
        raise RuntimeError("no MemAvailable in /proc/meminfo")
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as fh:
            limit = fh.read().strip()
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as fh:
            current = int(fh.read().strip())
        if limit != "max":
            available = min(available, int(limit) - current)
    except (OSError, ValueError):
        pass
    return available


def gpu_memory(dev: torch.device) -> dict:
    if dev.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(dev)
    return {
        "free_bytes": free,
        "total_bytes": total,
        "allocated_bytes": torch.cuda.memory_allocated(dev),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(dev),
    }


def ragged_offsets(tokens: int, gen: torch.Generator, dev: torch.device) -> torch.Tensor:
    """int64 offsets [n + 1] on `dev` of documents of MIN_LEN..MAX_LEN tokens (uniform), ~`tokens` in all
    (the last document that fits)."""
    mean = (MIN_LEN + MAX_LEN) / 2
    draws = int(tokens / mean * 1.02) + 1000
    lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (draws,), generator=gen, device=dev)
    ends = torch.cumsum(lengths, 0)
    n = max(1, int(torch.searchsorted(ends, torch.tensor([tokens], device=dev), right=True)))
    offsets = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    offsets[1:] = ends[:n]
    return offsets


def fill_random_bytes(codes: torch.Tensor, first_col: int, gen: torch.Generator) -> None:
    """Random bytes into columns first_col.. of `codes`, a chunk of rows at a time."""
    width = codes.shape[1] - first_col
    for a in range(0, codes.shape[0], CHUNK_TOKENS):
        b = min(codes.shape[0], a + CHUNK_TOKENS)
        chunk = torch.randint(0, 256, (b - a, width), dtype=torch.uint8, generator=gen, device=codes.device)
        codes[a:b, first_col:].copy_(chunk)
        del chunk


def draw_ids(codes: torch.Tensor, num_centroids: int, gen: torch.Generator) -> None:
    """Random centroid ids below num_centroids into bytes 0-3 of every row (uint32, little-endian)."""
    for a in range(0, codes.shape[0], CHUNK_TOKENS):
        b = min(codes.shape[0], a + CHUNK_TOKENS)
        ids = torch.randint(0, num_centroids, (b - a,), dtype=torch.int32, generator=gen, device=codes.device)
        codes[a:b, :4].copy_(ids.view(torch.uint8).view(b - a, 4))
        del ids


def make_codebook(num_centroids: int, gen: torch.Generator, dev: torch.device):
    from maxsim_kernels.code_packing import ResidualCodebook

    cent = torch.randn(num_centroids, DIM, generator=gen, device=dev)
    cent = torch.nn.functional.normalize(cent, dim=1).half()
    weights = torch.tensor([-0.06, -0.02, 0.02, 0.06], device=dev).expand(DIM, 4).contiguous()
    return ResidualCodebook(cent, weights)


def unit_queries(n: int, gen: torch.Generator, dev: torch.device) -> list[torch.Tensor]:
    q = torch.randn(n * QUERY_TOKENS, DIM, generator=gen, device=dev)
    q = torch.nn.functional.normalize(q, dim=1).half()
    return list(q.split(QUERY_TOKENS))


def timed_rounds(fn, rounds: int, rep_ms: int) -> dict:
    ms = [median_ms(fn, rep_ms) for _ in range(rounds)]
    return {"ms": statistics.median(ms), "rounds_ms": ms}


def scan_record(name: str, tokens: int, docs: int, timing: dict) -> dict:
    return {
        **timing,
        "tokens": tokens,
        "documents": docs,
        "bytes_per_token": BYTES[name],
        "bytes_read": tokens * BYTES[name],
        "TBps": tokens * BYTES[name] / timing["ms"] / 1e9,
    }


def resident_scan(name: str, scan, tokens: int, docs: int, args, dev: torch.device) -> dict:
    """One query's scan of codes resident on the GPU (int4, int2): its timing, bytes and TB/s, and the
    GPU's memory, logged."""
    row = scan_record(name, tokens, docs, timed_rounds(scan, args.rounds, args.rep_ms))
    row.update(gpu_memory(dev))
    log(f"{name} at {tokens} tokens: {row['ms']:.3f} ms ({row['TBps']:.2f} TB/s on {BYTES[name]} B/token)")
    return row


def oom_record(exc: BaseException, dev: torch.device, **what) -> dict:
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
        **what,
        **gpu_memory(dev),
    }


def fill_exact_tier(tokens: int, dtype: str, gen: torch.Generator, dev: torch.device):
    """An exact tier of `tokens` random unit vectors in pageable host memory: fp16 [T, d], or int8 codes
    [T, d] and fp32 scales [T]; made on `dev` a chunk at a time and copied down."""
    from maxsim_kernels.int8_host import quantize_per_token

    values = torch.empty((tokens, DIM), dtype=torch.float16 if dtype == "float16" else torch.int8)
    scales = torch.empty(tokens, dtype=torch.float32) if dtype == "int8" else None
    step = CHUNK_TOKENS // 8
    for a in range(0, tokens, step):
        b = min(tokens, a + step)
        x = torch.nn.functional.normalize(torch.randn(b - a, DIM, generator=gen, device=dev), dim=1).half()
        if scales is None:
            values[a:b].copy_(x)
        else:
            codes, s = quantize_per_token(x)
            values[a:b].copy_(codes)
            scales[a:b].copy_(s)
        del x
    return values, scales


def rows_of(host_offsets: np.ndarray, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The token rows of `docs` (in that order) and their packed offsets."""
    starts = host_offsets[docs]
    lengths = host_offsets[docs + 1] - starts
    packed = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=packed[1:])
    rows = np.arange(int(packed[-1]), dtype=np.int64) + np.repeat(starts - packed[:-1], lengths)
    return rows, packed


def main() -> None:
    from maxsim_kernels import codes_host, maxsim_varlen
    from maxsim_kernels.code_packing import Int2Levels

    from maxsim_cli.codecs import default_centroids

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokens", type=float, default=1e9, help="corpus tokens (step down if memory is short)"
    )
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument(
        "--codebooks", default="default,4096", help="K of each residual2 scan: default or a number"
    )
    parser.add_argument(
        "--depth", type=int, default=2000, help="candidates of the two-stage search (2-bit: 2000)"
    )
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument(
        "--two-stage-codec", choices=("int2", "residual2"), default="int2", help="the two-stage's tier"
    )
    parser.add_argument("--exact-dtype", choices=("float16", "int8"), default="float16")
    parser.add_argument(
        "--exact-host-bytes", help="host memory for the exact tier (default 60%% of MemAvailable)"
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep-ms", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    parser.add_argument("--smoke", action="store_true", help="a check of the script: tiny sizes, one call")
    args = parser.parse_args()
    SMOKE["on"] = args.smoke
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    if set(stages) - set(STAGES):
        parser.error(f"--stages: unknown {sorted(set(stages) - set(STAGES))}; choose from {','.join(STAGES)}")
    tokens = 20_000 if args.smoke else int(args.tokens)
    if args.smoke:
        args.repeats, args.rounds = 2, 1
    dev = device()
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    record: dict = {
        "meta": meta(dim=DIM, tokens=tokens, stages=stages, depth=args.depth, k=args.k),
        "gpu": gpu_memory(dev),
        "residual2": {},
        "two_stage": {},
        "int4": {},
    }
    try:
        record["meta"]["host_mem_available_bytes"] = mem_available()
    except (OSError, RuntimeError):
        pass
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        record["h2d_pinned_GBps"] = (2 << 30) / copy_bandwidth(2 << 30, dev) / 1e9
    queries = unit_queries(max(4, args.repeats + 2), gen, dev)
    q_off = torch.tensor([0, QUERY_TOKENS], device=dev)

    offsets = ragged_offsets(tokens, gen, dev)
    host_offsets = offsets.cpu().numpy()
    num_docs, total = len(host_offsets) - 1, int(host_offsets[-1])
    record["meta"].update(documents=num_docs, corpus_tokens=total)
    default_k = default_centroids(total)
    log(f"{num_docs} documents, {total} tokens; default codebook K = {default_k}")
    write_json(args.out, record)

    codes = book = None
    current_k = None
    residual2_two_stage = "two-stage" in stages and args.two_stage_codec == "residual2"
    if "residual2" in stages or residual2_two_stage:
        try:
            t0 = time.perf_counter()
            codes = torch.empty((total, BYTES["residual2"]), dtype=torch.uint8, device=dev)
            fill_random_bytes(codes, 4, gen)
            sync()
            record["residual2"]["synthesized_s"] = time.perf_counter() - t0
            record["residual2"]["codes_bytes"] = codes.numel()
            log(
                f"residual2 codes: {codes.numel() / 1e9:.1f} GB in "
                f"{record['residual2']['synthesized_s']:.1f} s"
            )
        except torch.OutOfMemoryError as exc:
            codes = None
            record["residual2"] = oom_record(exc, dev, tokens=total, codes_bytes=total * BYTES["residual2"])
            log(f"residual2: {record['residual2']['error']}")
        write_json(args.out, record)

    def use_codebook(k: int) -> None:
        nonlocal book, current_k
        if current_k != k:
            draw_ids(codes, k, gen)
            book = make_codebook(k, gen, dev)
            current_k = k

    if codes is not None and "residual2" in stages:
        scans = record["residual2"].setdefault("scans", {})
        for name in [c.strip() for c in args.codebooks.split(",") if c.strip()]:
            k = default_k if name == "default" else int(name)
            try:
                use_codebook(k)
                scan = lambda: maxsim_varlen(queries[0], q_off, codes, offsets, codebook=book)  # noqa: E731
                row = scan_record("residual2", total, num_docs, timed_rounds(scan, args.rounds, args.rep_ms))
                row["num_centroids"] = k
                row["codebook_bytes"] = k * DIM * 2
                topk = timed_rounds(
                    lambda scan=scan: torch.topk(scan()[0], min(args.depth, num_docs)),
                    args.rounds,
                    args.rep_ms,
                )
                row["scan_topk_ms"] = topk["ms"]
                # the same codes on the Triton scan (on sm_90 the scan above runs on the Gluon stream kernel)
                triton_scan = lambda: codes_host.launch_varlen_with_tiles(  # noqa: E731
                    queries[0], q_off, codes, offsets, None, codebook=book
                )
                row["triton_scan_ms"] = timed_rounds(triton_scan, args.rounds, args.rep_ms)["ms"]
                row["within_15ms"] = row["ms"] <= 15.0
                row.update(gpu_memory(dev))
                scans[name] = row
                log(
                    f"residual2 K={k}: {row['ms']:.3f} ms ({row['TBps']:.2f} TB/s on 36 B/token), "
                    f"with top {args.depth}: {row['scan_topk_ms']:.3f} ms; "
                    f"Triton scan {row['triton_scan_ms']:.3f} ms"
                )
            except torch.OutOfMemoryError as exc:
                scans[name] = oom_record(exc, dev, num_centroids=k)
            write_json(args.out, record)

    if codes is not None and residual2_two_stage:

        def residual2_scan(n_exact: int):
            use_codebook(default_k)
            record["two_stage"]["num_centroids"] = default_k
            codes_e, off_e = codes[: int(host_offsets[n_exact])], offsets[: n_exact + 1]
            return lambda q: maxsim_varlen(q, q_off, codes_e, off_e, codebook=book)

        full = (record["residual2"].get("scans") or {}).get("default") or {}
        run_two_stage(args, record, residual2_scan, full, host_offsets, queries, q_off, gen, dev)

    codes = book = None  # the 2-bit codes freed: room for the 4-bit ones
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    if "int4" in stages:
        try:
            free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else total * BYTES["int4"] * 2
            # room for one chunk of random bytes beside the codes
            fit = int(free * 0.92) - (min(CHUNK_TOKENS, total) * (DIM // 2) if dev.type == "cuda" else 0)
            n4 = int(np.searchsorted(host_offsets, min(total, fit // BYTES["int4"]), side="right")) - 1
            if n4 < 1:
                raise torch.OutOfMemoryError(f"no room for 4-bit codes: {free} bytes free")
            t4 = int(host_offsets[n4])
            codes4 = torch.empty((t4, DIM // 2), dtype=torch.uint8, device=dev)
            fill_random_bytes(codes4, 0, gen)
            scales = torch.empty(t4, device=dev).uniform_(0.01, 0.02, generator=gen)  # in place
            off4 = offsets[: n4 + 1]
            scan = lambda: maxsim_varlen(queries[0], q_off, codes4, off4, doc_scales=scales)  # noqa: E731
            row = resident_scan("int4", scan, t4, n4, args, dev)
            record["int4"] = {**row, "of_corpus_tokens": t4 / total}
            del codes4, scales
        except torch.OutOfMemoryError as exc:
            record["int4"] = oom_record(exc, dev)
            log(f"int4: {record['int4']['error']}")
        write_json(args.out, record)

    int2_two_stage = "two-stage" in stages and args.two_stage_codec == "int2"
    if "int2" in stages or int2_two_stage:  # the two-stage's composed figure takes the whole scan's time
        try:
            codes2 = torch.empty((total, DIM // 4), dtype=torch.uint8, device=dev)
            fill_random_bytes(codes2, 0, gen)
            scales = torch.empty(total, device=dev).uniform_(0.01, 0.02, generator=gen)  # in place, >= 0
            levels = Int2Levels(torch.zeros(DIM, device=dev), torch.full((DIM,), 0.05, device=dev))
            scan = lambda: maxsim_varlen(  # noqa: E731
                queries[0], q_off, codes2, offsets, doc_scales=scales, codebook=levels
            )
            record["int2"] = resident_scan("int2", scan, total, num_docs, args, dev)
            record["int2"]["scan_topk_ms"] = timed_rounds(
                lambda: torch.topk(scan()[0], min(args.depth, num_docs)), args.rounds, args.rep_ms
            )["ms"]
            if int2_two_stage:

                def int2_scan(n_exact: int):
                    t_exact = int(host_offsets[n_exact])
                    codes_e, off_e, scales_e = codes2[:t_exact], offsets[: n_exact + 1], scales[:t_exact]
                    kw = {"doc_scales": scales_e, "codebook": levels}
                    return lambda q: maxsim_varlen(q, q_off, codes_e, off_e, **kw)

                full = record["int2"]
                run_two_stage(args, record, int2_scan, full, host_offsets, queries, q_off, gen, dev)
            del codes2, scales
        except torch.OutOfMemoryError as exc:
            record["int2"] = oom_record(exc, dev)
            log(f"int2: {record['int2']['error']}")
        write_json(args.out, record)
    log("done")


def run_two_stage(args, record, scan_of, full, host_offsets, queries, q_off, gen, dev) -> None:
    """`two_stage`, a failure (out of memory) recorded in place of its figures."""
    try:
        two_stage(args, record, scan_of, full, host_offsets, queries, q_off, gen, dev)
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
        record["two_stage"].update(oom_record(exc, dev))
        log(f"two-stage: {record['two_stage']['error']}")
    write_json(args.out, record)


def two_stage(args, record, scan_of, full, host_offsets, queries, q_off, gen, dev) -> None:
    """The two-stage search composed from its parts, the exact tier in host memory (module docstring):
    `scan_of(n)` the scan of the tier's first n documents (one query -> its scores [1, n]), `full` the
    codec's stage record of the whole corpus's scan (its top ``--depth``: ``scan_topk_ms``)."""
    from maxsim_kernels import maxsim_varlen

    from maxsim_cli.units import parse_size

    out: dict = record["two_stage"]  # filled as it goes: a failure part-way keeps what was measured
    out.update(exact_dtype=args.exact_dtype, depth=args.depth, k=args.k, codec=args.two_stage_codec)
    per_token = EXACT_BYTES[args.exact_dtype]
    if args.exact_host_bytes:
        budget = parse_size(args.exact_host_bytes)
    else:
        budget = int(mem_available() * 0.6)
    n_exact = int(np.searchsorted(host_offsets, budget // per_token, side="right")) - 1
    n_exact = max(1, min(n_exact, len(host_offsets) - 1))
    t_exact = int(host_offsets[n_exact])
    depth = min(args.depth, n_exact)
    out["depth"] = depth
    out.update(host_budget_bytes=budget, documents=n_exact, tokens=t_exact, host_bytes=t_exact * per_token)
    scan_only = scan_of(n_exact)
    t0 = time.perf_counter()
    values, scales = fill_exact_tier(t_exact, args.exact_dtype, gen, dev)
    out["filled_s"] = time.perf_counter() - t0
    log(
        f"two-stage: exact tier of {n_exact} documents "
        f"({t_exact * per_token / 1e9:.1f} GB {args.exact_dtype}) in host memory, "
        f"filled in {out['filled_s']:.1f} s"
    )
    write_json(args.out, record)

    cuda = dev.type == "cuda"
    max_rows = depth * MAX_LEN
    pinned = torch.empty((max_rows, DIM), dtype=values.dtype, pin_memory=cuda)
    pinned_scales = (
        torch.empty(max_rows, dtype=torch.float32, pin_memory=cuda) if scales is not None else None
    )
    dev_rows = torch.empty((max_rows, DIM), dtype=values.dtype, device=dev)
    dev_scales = torch.empty(max_rows, dtype=torch.float32, device=dev) if scales is not None else None
    out["scan_ms"] = timed_rounds(lambda: scan_only(queries[0]), args.rounds, args.rep_ms)["ms"]

    parts: dict[str, list[float]] = {n: [] for n in ("scan_select", "gather", "copy", "exact_topk", "total")}
    cand_bytes: list[int] = []

    def one(q, keep: bool) -> None:
        t0 = time.perf_counter()
        top = torch.topk(scan_only(q)[0], depth, sorted=False).indices.cpu().numpy()
        t1 = time.perf_counter()
        rows, packed = rows_of(host_offsets, top)
        n = len(rows)
        index = torch.from_numpy(rows)
        torch.index_select(values, 0, index, out=pinned[:n])
        if scales is not None:
            torch.index_select(scales, 0, index, out=pinned_scales[:n])
        t2 = time.perf_counter()
        dev_rows[:n].copy_(pinned[:n], non_blocking=True)
        if scales is not None:
            dev_scales[:n].copy_(pinned_scales[:n], non_blocking=True)
        cand_off = torch.from_numpy(packed).to(dev)
        sync()
        t3 = time.perf_counter()
        kw = {"doc_scales": dev_scales[:n]} if scales is not None else {}
        exact = maxsim_varlen(q, q_off, dev_rows[:n], cand_off, **kw)[0]
        best = torch.topk(exact, min(args.k, depth))
        best.values.cpu(), best.indices.cpu()
        t4 = time.perf_counter()
        if keep:
            for name, (a, b) in {
                "scan_select": (t0, t1),
                "gather": (t1, t2),
                "copy": (t2, t3),
                "exact_topk": (t3, t4),
                "total": (t0, t4),
            }.items():
                parts[name].append((b - a) * 1e3)
            cand_bytes.append(n * per_token)

    for i in range(2):  # warm-up: compiles, first touches of the pinned buffers
        one(queries[-1 - i], keep=False)
    for i in range(args.repeats):
        one(queries[i % (len(queries) - 2)], keep=True)
    out["p50_ms"] = {name: statistics.median(ms) for name, ms in parts.items()}
    out["ms"] = parts
    out["candidate_bytes_p50"] = int(statistics.median(cand_bytes))
    h2d = record.get("h2d_pinned_GBps")
    if h2d:
        copy_ms = out["candidate_bytes_p50"] / (h2d * 1e9) * 1e3
        out["bound_ms"] = out["scan_ms"] + copy_ms
        out["over_bound"] = out["p50_ms"]["total"] / out["bound_ms"]
        if full.get("scan_topk_ms") is not None:
            rest = out["p50_ms"]["total"] - out["p50_ms"]["scan_select"]
            out["composed_full_corpus"] = {
                "tokens": int(host_offsets[-1]),
                "scan_topk_ms": full["scan_topk_ms"],
                "ms": full["scan_topk_ms"] + rest,
                "bound_ms": full["ms"] + copy_ms,
                "what": f"the whole corpus's scan and top depth ({args.two_stage_codec} stage, do_bench) "
                "+ this stage's gather, copy and exact parts (p50), as if every candidate were in the "
                "host tier; the bound: the whole scan + the candidates' bytes over pinned H2D",
            }
    log(
        f"two-stage (composed): p50 {out['p50_ms']['total']:.2f} ms, parts "
        f"{ {n: round(v, 3) for n, v in out['p50_ms'].items()} }, bound {out.get('bound_ms')}"
    )


if __name__ == "__main__":
    main()
