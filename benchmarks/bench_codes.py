"""The scan kernels of codes below 8 bits (`maxsim_kernels.maxsim_codes`: int4, int2, residual2) beside our
fp16 and int8 kernels on the same documents, alternating rounds in one process.

    python benchmarks/bench_codes.py --out benchmarks/results/codes/codes-h100.json

Documents: random unit vectors (d = 128), 20-300 tokens each (uniform), fp16; int8 per token
(`quantize_per_token`), int4 (`encode_int4`), residual2 with a codebook trained by fastkmeans on a
sample of 262,144 tokens (`maxsim_cli.codecs.train_codebook`, 4,096 centroids; its buckets separable, as
`maxsim quantize` fits them: two bit planes a part), int2 with its grid fitted on the same sample
(`maxsim_cli.codecs.fit_int2_levels`, `maxsim quantize --bits 2 --codec int2`).
``residual2_three_planes`` is the same codes with the codebook's top bucket value moved by one ulp, which
makes the third bit plane nonzero: the three-plane scan on the same bytes. On an sm_90 GPU one query's
int4, int2 and residual2 scans run on the Gluon stream kernel; ``int4_triton`` and ``residual2_triton`` are
the same codes on the Triton scan. Workloads:

  one_query  1 query of 32 tokens x 100K documents (~16M tokens): HBM-bound, reported as TB/s of the
             bytes each format reads a token (fp16 256, int8 132, int4 68, int2 and residual2 36 at d = 128)
  all_pairs  512 queries of 32 tokens x 50K documents: reported as pairs/s and against int8

Each time is `triton.testing.do_bench`'s median (L2 flushed between calls) over ``--rep-ms``, in
``--rounds`` rounds that alternate the formats' order. Before timing, each codec's Triton scores are
compared with the torch path on the same codes (1,000 documents): the largest difference is recorded.
Also the quantize speed: encode of the whole corpus on the GPU, the k-means training and int2's grid fit.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import SMOKE, device, make_log, median_ms, meta, smoke_size, sync, write_json

log = make_log("codes", clock=True)
BYTES = {"fp16": 256, "int8": 132, "int4": 68, "int4_triton": 68, "int2": 36, "residual2": 36,
         "residual2_triton": 36, "residual2_three_planes": 36}  # a token at d = 128  # fmt: skip
TRITON_SCANS = ("int4_triton", "residual2_triton")  # the codes of int4 / residual2 on the Triton scan


def ragged(n: int, lo: int, hi: int, dim: int, gen: torch.Generator, dev: torch.device):
    lengths = torch.randint(lo, hi + 1, (n,), generator=gen)
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    x = torch.randn(int(offsets[-1]), dim, generator=gen).to(dev, torch.float16)
    return torch.nn.functional.normalize(x.float(), dim=1).half(), offsets.to(dev)


def main() -> None:
    from maxsim_kernels import codes_host, maxsim_varlen
    from maxsim_kernels.int8_host import quantize_per_token

    from maxsim_cli.codecs import Int2Grid, encode, fit_int2_levels, train_codebook

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--rep-ms", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-one-query", action="store_true", help="time all pairs only")
    parser.add_argument("--one-query-docs", type=int, default=100_000)
    parser.add_argument("--all-pairs-docs", type=int, default=50_000)
    parser.add_argument("--centroids", type=int, default=4096)
    parser.add_argument("--sweep", action="store_true", help="also time the tile plans of SWEEP_* per codec")
    parser.add_argument(
        "--stream-sweep",
        nargs="?",
        const="int4,int2,residual2",
        help="also time these codecs (default all three) on the Gluon stream kernel under the tiles of "
        "SWEEP_STREAM (int4), SWEEP_STREAM_INT2 and SWEEP_STREAM_RESIDUAL2",
    )
    parser.add_argument("--smoke", action="store_true", help="a check of the script: tiny sizes, one call")
    args = parser.parse_args()
    SMOKE["on"] = args.smoke
    args.one_query_docs = smoke_size(args.one_query_docs)
    args.all_pairs_docs = smoke_size(args.all_pairs_docs)
    args.centroids = smoke_size(args.centroids, 16)
    dev = device()
    gen = torch.Generator().manual_seed(0)
    record: dict = {"meta": meta(dtype="float16", dim=128), "workloads": {}, "check": {}, "quantize": {}}

    docs, offsets = ragged(args.one_query_docs, 20, 300, 128, gen, dev)
    tokens = docs.shape[0]
    log(f"{args.one_query_docs} documents, {tokens} tokens")
    sync()
    t0 = time.perf_counter()
    sample = docs[torch.randperm(tokens, generator=gen)[: smoke_size(1 << 18, 256)].to(dev)]
    book = train_codebook(sample, args.centroids, device=dev)
    sync()
    record["quantize"]["kmeans_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    grid = Int2Grid(*fit_int2_levels(sample))
    sync()
    record["quantize"]["int2_fit_s"] = time.perf_counter() - t0
    stored: dict[str, dict] = {"fp16": {"docs": docs, "kw": {}}}
    for name, make in (
        ("int8", lambda: quantize_per_token(docs)),
        ("int4", lambda: encode("int4-per-token", docs, None)),
        ("int2", lambda: encode("int2-grid", docs, grid)),
        ("residual2", lambda: encode("residual2-kmeans", docs, book)),
    ):
        sync()
        t0 = time.perf_counter()
        codes, scales = make()
        sync()
        record["quantize"][f"{name}_encode_s"] = time.perf_counter() - t0
        if name == "int2":
            kw = {"doc_scales": scales, "codebook": grid.for_kernels(dev)}
        else:
            kw = {"doc_scales": scales} if scales is not None else {"codebook": book.for_kernels(dev)}
        stored[name] = {"docs": codes, "kw": kw}
    log(f"quantize: {record['quantize']}")

    stored["int4_triton"] = stored["int4"]  # the same codes on the Triton scan kernel (no Gluon stream)
    stored["residual2_triton"] = stored["residual2"]
    # the same residual2 codes, the third bit plane made nonzero: the scan of three planes a part
    nudged = book.bucket_weights.clone()
    nudged[:, 3] = torch.nextafter(nudged[:, 3], torch.full_like(nudged[:, 3], float("inf")))
    three = type(book)(book.centroids, nudged, book.bucket_cutoffs)
    stored["residual2_three_planes"] = {
        "docs": stored["residual2"]["docs"],
        "kw": {"codebook": three.for_kernels(dev)},
    }
    q = torch.nn.functional.normalize(torch.randn(32, 128, generator=gen), dim=1).to(dev, torch.float16)
    q_off = torch.tensor([0, 32], device=dev)
    # correctness: each codec's Triton scores against the torch path on the first 1,000 documents
    head = offsets[: min(1000, len(offsets) - 1) + 1]
    for name in ("int4", "int2", "residual2", "residual2_three_planes"):
        part = stored[name]["docs"][: int(head[-1])]
        kw = dict(stored[name]["kw"])
        if "doc_scales" in kw:
            kw["doc_scales"] = kw["doc_scales"][: int(head[-1])]
        fast = maxsim_varlen(q, q_off, part, head, **kw)
        slow = codes_host.maxsim_varlen_codes(q, q_off, part, head, backend="torch", **kw)
        record["check"][name] = float((fast.float() - slow.float()).abs().max())
    log(f"check (max |triton - torch|): {record['check']}")

    if args.sweep:
        record["sweep"] = {"one_query": sweep(q, q_off, stored, offsets, SWEEP_ONE_QUERY, args.rep_ms)}
        write_json(args.out, record)
    if args.stream_sweep:
        configs = {"int4": SWEEP_STREAM, "int2": SWEEP_STREAM_INT2, "residual2": SWEEP_STREAM_RESIDUAL2}
        record["stream_sweep"] = {
            codec: stream_sweep(q, stored[codec], offsets, configs[codec], args.rep_ms)
            for codec in args.stream_sweep.split(",")
        }
        write_json(args.out, record)

    def one_query(name: str):
        s = stored[name]
        if name in TRITON_SCANS:
            scan = codes_host.launch_varlen_with_tiles  # tiles None: the Triton scan's own plan
            return lambda: scan(q, q_off, s["docs"], offsets, None, **s["kw"])
        return lambda: maxsim_varlen(q, q_off, s["docs"], offsets, **s["kw"])

    if not args.skip_one_query:
        times: dict[str, list[float]] = {n: [] for n in stored}
        for r in range(args.rounds):
            order = list(stored) if r % 2 == 0 else list(stored)[::-1]
            for name in order:
                times[name].append(median_ms(one_query(name), args.rep_ms))
        row = {}
        for name, ts in times.items():
            ms = statistics.median(ts)
            row[name] = {"ms": ms, "rounds_ms": ts, "bytes_per_token": BYTES[name],
                         "tb_per_s": tokens * BYTES[name] / ms / 1e9}  # fmt: skip
        for name in row:
            row[name]["speedup_over_fp16"] = row["fp16"]["ms"] / row[name]["ms"]
        record["workloads"]["one_query"] = {
            "documents": args.one_query_docs, "tokens": tokens, "formats": row
        }  # fmt: skip
        shown = {n: (round(v["ms"], 4), round(v["speedup_over_fp16"], 2)) for n, v in row.items()}
        log(f"one_query: {shown}")
        write_json(args.out, record)

    # all pairs: 512 queries x the first all-pairs-docs documents
    n = args.all_pairs_docs
    end = int(offsets[n])
    qs = torch.randn(512 * 32, 128, generator=gen)
    qs = torch.nn.functional.normalize(qs, dim=1).to(dev, torch.float16)
    qs_off = torch.arange(0, 512 * 32 + 1, 32, device=dev)
    sub_off = offsets[: n + 1]

    def all_pairs(name: str):
        s = stored[name]
        kw = dict(s["kw"])
        if "doc_scales" in kw:
            kw["doc_scales"] = kw["doc_scales"][:end]
        if name == "int4_triton":  # the Triton scan, where sm_90 decodes chunks for the int8 kernel
            scan = codes_host.launch_varlen_with_tiles
            return lambda: scan(qs, qs_off, s["docs"][:end], sub_off, None, **kw)
        return lambda: maxsim_varlen(qs, qs_off, s["docs"][:end], sub_off, **kw)

    # (all pairs decode the residual2 values on the Triton scan: the planes, and so the three-plane
    # codebook, play no part)
    times = {n_: [] for n_ in stored if n_ not in ("residual2_three_planes", "residual2_triton")}
    for r in range(args.rounds):
        order = list(times) if r % 2 == 0 else list(times)[::-1]
        for name in order:
            times[name].append(median_ms(all_pairs(name), args.rep_ms))
    row = {name: {"ms": statistics.median(ts), "rounds_ms": ts} for name, ts in times.items()}
    for name in row:
        row[name]["pairs_per_s"] = 512 * n / (row[name]["ms"] / 1e3)
        row[name]["over_int8_rate"] = row["int8"]["ms"] / row[name]["ms"]
    record["workloads"]["all_pairs"] = {"queries": 512, "documents": n, "formats": row}
    log(f"all_pairs: { {k: (round(v['ms'], 3), round(v['over_int8_rate'], 2)) for k, v in row.items()} }")
    write_json(args.out, record)
    if args.sweep:
        cut = {name: {"docs": s["docs"][:end], "kw": cut_scales(s["kw"], end)} for name, s in stored.items()
               if name not in TRITON_SCANS}  # fmt: skip
        record["sweep"]["all_pairs"] = sweep(qs, qs_off, cut, sub_off, SWEEP_ALL_PAIRS, args.rep_ms)
        write_json(args.out, record)


def cut_scales(kw: dict, end: int) -> dict:
    kw = dict(kw)
    if "doc_scales" in kw:
        kw["doc_scales"] = kw["doc_scales"][:end]
    return kw


# Tile plans swept (`maxsim_codes.Tiles`: block_q, block_d, docs a program, warps, stages); the first is
# the shipped plan of that workload.
SWEEP_ONE_QUERY = [
    (64, 64, 64, 4, 2), (64, 64, 64, 4, 2, True), (64, 128, 8, 4, 2, True), (64, 128, 16, 4, 3, True),
    (64, 128, 32, 4, 2, True), (64, 128, 32, 8, 2, True), (64, 64, 32, 4, 3, True), (64, 128, 64, 4, 3, True),
    (64, 64, 128, 4, 2, True), (64, 128, 16, 4, 2, True), (64, 64, 64, 4, 3, True), (64, 64, 64, 8, 2, True),
    (64, 128, 64, 8, 3, True), (64, 256, 32, 8, 2, True),
]  # fmt: skip
SWEEP_ALL_PAIRS = [
    (256, 32, 64, 4, 2), (256, 64, 64, 4, 2, True), (128, 64, 64, 4, 2, True), (256, 128, 32, 8, 2, True),
    (128, 128, 32, 4, 2, True), (256, 64, 64, 8, 2, True), (128, 128, 64, 8, 2, True),
]  # fmt: skip


# The Gluon stream kernel's tiles (`maxsim_int8_hopper_stream.stream_with_tiles`: items a program, ring
# stages, tiles a turn, register cap; 0 = no cap); the first is the shipped `INT4_TILES` / `RESIDUAL2_TILES`.
SWEEP_STREAM = [
    (32, 4, 2, 128), (32, 4, 2, 96), (32, 4, 2, 80), (32, 4, 2, 72), (32, 6, 2, 80), (64, 4, 2, 80),
    (16, 4, 2, 80), (32, 8, 2, 128), (32, 8, 2, 0), (64, 12, 2, 128),
]  # fmt: skip


SWEEP_STREAM_RESIDUAL2 = [
    (32, 6, 2, 128), (32, 6, 2, 168), (32, 6, 2, 0), (32, 4, 2, 128), (32, 8, 2, 128), (32, 6, 4, 168),
    (16, 6, 2, 128), (64, 6, 2, 128), (32, 4, 2, 168), (32, 6, 2, 152), (32, 3, 2, 128), (64, 6, 2, 168),
]  # fmt: skip


SWEEP_STREAM_INT2 = [
    (32, 4, 2, 128), (32, 4, 2, 96), (32, 4, 2, 80), (32, 4, 2, 72), (32, 4, 2, 64), (32, 6, 2, 80),
    (64, 4, 2, 80), (16, 4, 2, 80), (32, 8, 2, 80),
]  # fmt: skip


def stream_sweep(q, codes: dict, offsets, configs: list, rep_ms: int) -> list:
    """int4, int2 or residual2 codes, one query, on the stream kernel under each of `configs`: median time,
    same bits as the first."""
    from maxsim_kernels import code_packing, codes_host, maxsim_codes
    from maxsim_kernels import maxsim_int8_hopper_stream as stream
    from maxsim_kernels.int8_host import quantize_per_token

    q8, sq = quantize_per_token(q)
    q_off = torch.tensor([0, q.shape[0]], device=q.device)
    book = codes["kw"].get("codebook")
    int2 = isinstance(book, code_packing.Int2Levels)
    if int2:  # the query side of int2 (`int2_queries`): its int8 scan without the rows' offsets
        side = codes_host.int2_queries(q, book)
        q8, sq, book = side.q8, side.scales, None
    tables = None if book is None else maxsim_codes.residual2_query_tables(q8, book)
    scales = codes["kw"].get("doc_scales")
    rows, first = [], None
    for items, stages, group, cap in configs[:2] if SMOKE["on"] else configs:
        cfg = dict(items_per_prog=items, stages=stages, group=group, maxnreg=cap)

        def call(cfg=cfg):
            return stream.stream_with_tiles(
                q8, sq, q_off, None, None, codes["docs"], scales, offsets, q.shape[0], residual=tables,
                int2=int2, **cfg,
            )

        try:
            scores = call()
            first = scores if first is None else first
            same = bool(torch.equal(scores, first))
            rows.append({**cfg, "ms": median_ms(call, rep_ms), "equal_to_first": same})
        except Exception as exc:  # a configuration the compiler refuses (shared memory, registers)
            rows.append({**cfg, "error": str(exc).splitlines()[0][:200]})
        log(f"stream sweep {cfg}: {rows[-1]}")
    return rows


def sweep(q, q_off, stored: dict, offsets, plans: list, rep_ms: int) -> dict:
    """Each codec under each tile plan: the median time and whether its scores equal the first plan's."""
    from maxsim_kernels.codes_host import launch_varlen_with_tiles
    from maxsim_kernels.maxsim_codes import Tiles

    out: dict = {}
    plans = plans[:2] if SMOKE["on"] else plans
    for name in ("int4", "residual2"):
        s = stored[name]
        rows, first = [], None
        for plan in plans:
            tiles = Tiles(*plan)
            try:
                scores = launch_varlen_with_tiles(q, q_off, s["docs"], offsets, tiles, **s["kw"])
                first = scores if first is None else first
                ms = median_ms(
                    lambda s=s, tiles=tiles: launch_varlen_with_tiles(
                        q, q_off, s["docs"], offsets, tiles, **s["kw"]
                    ),
                    rep_ms,
                )
                same = bool(torch.equal(scores, first))
                rows.append({"tiles": list(plan), "ms": ms, "equal_to_first": same})
            except Exception as exc:  # a plan the compiler refuses (shared memory, registers)
                rows.append({"tiles": list(plan), "error": str(exc).splitlines()[0][:200]})
            log(f"sweep {name} {plan}: {rows[-1]}")
        out[name] = rows
    return out


if __name__ == "__main__":
    main()
