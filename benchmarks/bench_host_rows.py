"""The exact stage of a two-stage search on a GPU, host side: one query's candidates' rows from the exact
tier in host memory (`Corpus.to("cpu")`) or from its files in the page cache, as the stage stages them.

    python benchmarks/bench_host_rows.py --workdir /var/tmp/mb-host-rows --size 2GB \
        --out benchmarks/results/host/host-rows-cpu.json

Corpus: `common.build_corpus` (fp16 L2-normalised random vectors, d = 128, documents of 20-300 tokens), --size
in shards of 256 MiB, written once into WORKDIR/corpus. Candidates: the exact top --depth (default 2000, the
2-bit tier's default depth) of one 32-token query, found once by an exact search on the device and kept in
WORKDIR (the scan's top documents are long ones, as a compressed scan's are). Timed, p50 and min over
--repeats, the host's work only (any machine):

  locate        the candidates' docnos to corpus ordinals (`results.locate_candidates`)
  files_before  the engine's reads of the rerank's batches (its plan on CUDA) as they were: `read_parts`
                (`read_doc_indices`: a read and a NaN/Inf check a document, `torch.cat`), then the copy into
                the batch's slot; a reader thread a batch, --threads of them
  files         the same batches read straight into their slots (`SafetensorsShard.read_docs_into`)
  host_gather   the rows gathered from the corpus resident in host memory into a reused buffer, in pieces
                (`host_rows.stage_rows`: `torch.index_select` on torch's threads), as the direct path stages
                them for the GPU; beside it one contiguous copy of as many bytes (the machine's copy rate)

On CUDA also the exact stage through the library, one query's `rerank(..., device="cuda")` of those
candidates (exact tier resident on the host; and from the page cache), against its bound: the candidates'
bytes over the pinned host-to-device rate (`common.copy_bandwidth`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from common import DIM, QUERY_TOKENS, build_corpus, copy_bandwidth, make_log, meta, write_json

log = make_log("host-rows", clock=True)


def p50(fn, repeats: int, warmup: int = 1) -> dict:
    """Milliseconds of fn() over `repeats` calls after `warmup`: p50, min, all."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"p50_ms": statistics.median(times), "min_ms": min(times), "ms": times}


def candidates_of(root: str, workdir: str, depth: int, dev: torch.device) -> dict:
    """The exact top `depth` of one query, found once and kept in WORKDIR."""
    from maxsim_cli import open_corpus, search

    path = os.path.join(workdir, f"candidates-{depth}.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    gen = torch.Generator().manual_seed(5)
    query = torch.nn.functional.normalize(torch.randn(QUERY_TOKENS, DIM, generator=gen), dim=1).half()
    with open_corpus(root) as exact:
        run = search((["q0"], [query]), exact, k=depth, device=str(dev)).to_dict()
    data = {"query": query.float().tolist(), "candidates": run}
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
    return data


def main() -> None:
    from maxsim_cli import open_corpus, rerank
    from maxsim_cli.scoring import host_rows
    from maxsim_cli.scoring import plan as planning
    from maxsim_cli.scoring.pipeline import read_parts
    from maxsim_cli.scoring.results import locate_candidates
    from maxsim_cli.scoring.staging import gathered_offsets
    from maxsim_cli.units import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/var/tmp/mb-host-rows")
    parser.add_argument("--size", default="2GB")
    parser.add_argument("--depth", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1), help="reader threads")
    parser.add_argument("--out")
    args = parser.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    root = os.path.join(args.workdir, "corpus")
    os.makedirs(args.workdir, exist_ok=True)
    build_corpus(root, parse_size(args.size), 256 << 20, dev)
    data = candidates_of(root, args.workdir, args.depth, dev)
    cands = data["candidates"]
    record: dict = {
        "meta": meta(
            size=args.size, depth=args.depth, threads=args.threads, torch_threads=torch.get_num_threads()
        ),
        "cpus": os.cpu_count(),
    }
    with open_corpus(root) as exact:
        located = locate_candidates(exact, cands, ["q0"], "queries", "candidates", False, exact.paths, log)
        lengths = np.concatenate([np.diff(s.offsets) for s in exact.shards])
        bounds = np.concatenate([[0], np.cumsum([s.num_docs for s in exact.shards])]).astype(np.int64)
        tokens = int(lengths[located.pair_doc].sum())
        record["candidates"] = {
            "documents": len(located.pair_doc),
            "tokens": tokens,
            "bytes": tokens * DIM * 2,
        }
        log(f"{len(exact)} documents, {exact.num_tokens} tokens; candidates {tokens * DIM * 2 / 1e6:.1f} MB")
        record["locate"] = p50(
            lambda: locate_candidates(exact, cands, ["q0"], "queries", "candidates", False, exact.paths, log),
            args.repeats,
        )

        # the engine's rerank plan on CUDA: its batches, as its readers take them
        budget = planning.Budget(
            device_bytes=60 << 30,
            host_bytes=16 << 30,
            reader_threads=16,
            cuda=True,
            staging_bytes=planning.STAGING_BYTES,
        )
        plan = planning.plan_rerank(
            located.pair_query,
            located.pair_doc,
            lengths,
            bounds,
            np.array([0, QUERY_TOKENS]),
            256,
            256,
            budget,
        )
        assert plan is not None
        slots = [torch.zeros(plan.batch_tokens(i), DIM, dtype=torch.float16) for i in range(len(plan.parts))]
        record["batches"] = len(plan.parts)

        def files_before(i: int) -> None:
            t = 0
            for part in read_parts(exact.shards, plan.parts[i]):
                n = part.embeddings.shape[0]
                slots[i][t : t + n].copy_(part.embeddings)
                t += n

        def files(i: int) -> None:
            t = 0
            for shard, indices in plan.parts[i]:
                t += int(exact.shards[shard].read_docs_into(indices, slots[i][t:], None).sum())

        with ThreadPoolExecutor(args.threads, initializer=lambda: torch.set_num_threads(1)) as pool:
            for name, fn in (("files_before", files_before), ("files", files)):
                record[name] = p50(lambda fn=fn: list(pool.map(fn, range(len(plan.parts)))), args.repeats)
                log(f"{name}: p50 {record[name]['p50_ms']:.1f} ms")
        read_back = torch.cat(slots)

        t0 = time.perf_counter()
        exact.to("cpu")
        record["resident_s"] = time.perf_counter() - t0
        residency = exact.residency
        docs = np.unique(located.pair_doc)
        starts, offsets = gathered_offsets(residency.host_offsets, docs)
        out = torch.zeros(int(offsets[-1]), DIM, dtype=torch.float16)
        record["host_gather"] = p50(
            lambda: host_rows.stage_rows(residency, starts, offsets, out, None), args.repeats
        )
        assert torch.equal(out, read_back)  # the batches hold the unique documents in ordinal order too
        flat = torch.zeros_like(out)
        source = residency.embeddings[: out.shape[0]]
        record["contiguous_copy"] = p50(lambda: flat.copy_(source), args.repeats)
        record["pieces"] = len(host_rows._pieces(offsets, DIM * 2)) - 1
        log(
            f"host_gather: p50 {record['host_gather']['p50_ms']:.1f} ms "
            f"(one contiguous copy of the bytes {record['contiguous_copy']['p50_ms']:.1f} ms)"
        )

        if dev.type == "cuda":
            query = torch.tensor(data["query"], dtype=torch.float16)
            queries = (["q0"], [query])
            h2d = (2 << 30) / copy_bandwidth(2 << 30, dev) / 1e9
            record["h2d_pinned_GBps"] = h2d
            record["bound_ms"] = record["candidates"]["bytes"] / (h2d * 1e9) * 1e3
            runs = {}

            def call(name: str, corpus) -> None:
                runs[name] = rerank(queries, corpus, cands, device="cuda")

            record["gpu_host_resident"] = p50(lambda: call("host", exact), args.repeats, 3)
            record["gpu_host_resident"]["stats_extra"] = runs["host"].stats.extra
            exact.release()
            record["gpu_page_cache"] = p50(lambda: call("files", exact), args.repeats, 3)
            record["same_run"] = runs["host"].to_dict() == runs["files"].to_dict()
            host_ms, files_ms = record["gpu_host_resident"]["p50_ms"], record["gpu_page_cache"]["p50_ms"]
            log(
                f"rerank on CUDA: host-resident p50 {host_ms:.2f} ms, page cache p50 {files_ms:.2f} ms; "
                f"bound {record['bound_ms']:.2f} ms"
            )
    write_json(args.out, record)
    log("done")


if __name__ == "__main__":
    main()
