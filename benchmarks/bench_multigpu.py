"""`maxsim score` end to end on 1 and on 2 GPUs of one machine, in one run: speedup and identical output.

Workload (the `score` benchmark's, on a larger corpus): 512 queries x 32 tokens against fp16 shards of
L2-normalised random token vectors, d = 128 (256 B a token), document lengths uniform in [20, 300]
(mean 160), 512 MiB shards (61 of them for 32 GB, so that two ranks get shares within one shard of each
other), top-k 1000, the run written to local disk. The corpus is written in this run (so it sits in the
page cache) and read alone as fast as the cores can (`bench_score.read_files`); a warm-up on a small
corpus compiles the Triton kernels into the on-disk cache that the workers load them from.

Each configuration starts fresh worker processes through the `--devices` launcher
(`maxsim_cli.distributed.launch`), so both pay the same start-up:

- ``1gpu``: one worker on cuda:0 (world size 1: the single-process engine);
- ``2gpu``: two workers on cuda:0 and cuda:1 (shards shared by tokens, results merged on rank 0).

Times: ``job_s`` is the launcher's call from start to return (interpreter start of the workers
included); ``engine_s`` is measured inside rank 0 from entering `score` to the run written (for 2 GPUs:
joining the group, the rank's share, waiting for the other rank, gathering, merging and writing). The
in-process single-GPU `score` call of a warm process (``inprocess_1gpu``, no start-up at all) is
reported beside them. Repeats alternate 1gpu / 2gpu and keep each one's best. Every run must be byte
for byte the same file. JSON lines are appended to ``--log`` as stages finish, so a run cut short still
leaves its figures.

    python benchmarks/bench_multigpu.py --workdir /tmp/maxsim-mgpu --size 32GB \\
        --out benchmarks/results/multigpu-h200x2.json

``--cpu`` runs the same script with CPU workers (``cpu`` / ``cpu, cpu``) on a small corpus: a check of
the script, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_score  # noqa: E402

from maxsim_cli import distributed  # noqa: E402
from maxsim_cli.score import score  # noqa: E402
from maxsim_cli.shards import write_shard  # noqa: E402
from maxsim_cli.units import format_size, parse_size  # noqa: E402

DIM = 128
MIN_LEN, MAX_LEN = 20, 300
QUERY_TOKENS = 32
TOP_K = 1000

_log_path: str | None = None


def log(msg: str) -> None:
    print(f"[bench_multigpu] {msg}", file=sys.stderr, flush=True)


def record(stage: str, **fields: object) -> None:
    """One JSON line per finished stage, appended to --log."""
    if _log_path is None:
        return
    with open(_log_path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"stage": stage, **fields}, sort_keys=True, default=str) + "\n")


# --------------------------------------------------------------------------------------------------
# data


def build_corpus(
    root: str, total_bytes: int, shard_bytes: int, device: torch.device, threads: int, seed: int = 0
) -> list[str]:
    """fp16 shards totalling ~total_bytes under root, generated on `device`, written by `threads`
    threads at once (`write_shard` spends its time in torch ops and the file write, outside the GIL)."""
    os.makedirs(root, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    token_bytes = DIM * 2
    jobs, doc_id, written = [], 0, 0
    with ThreadPoolExecutor(threads) as pool:
        while written < total_bytes:
            tokens_goal = min(shard_bytes, total_bytes - written) // token_bytes
            draws = tokens_goal // MIN_LEN + 1
            lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (draws,), generator=gen, device=device)
            lengths = lengths[: int((lengths.cumsum(0) <= tokens_goal).sum().item()) or 1]
            tokens = int(lengths.sum())
            emb = torch.randn(tokens, DIM, generator=gen, device=device)
            emb = torch.nn.functional.normalize(emb, dim=1).to(torch.float16).cpu()
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cpu().cumsum(0)])
            ids = [f"d{doc_id + i:09d}" for i in range(len(lengths))]
            path = os.path.join(root, f"shard{len(jobs):04d}.safetensors")
            jobs.append(
                pool.submit(write_shard, path, ids, emb, offsets=offsets, dtype="float16", normalized=True)
            )
            doc_id += len(lengths)
            written += tokens * token_bytes
            # bound the tensors waiting for a writer (each is one shard in host memory)
            while sum(1 for j in jobs if not j.done()) > 2 * threads:
                time.sleep(0.01)
        for job in jobs:
            job.result()
    return sorted(os.path.join(root, n) for n in os.listdir(root) if n.endswith(".safetensors"))


def build_queries(path: str, n: int, device: torch.device, seed: int = 1) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    emb = torch.randn(n * QUERY_TOKENS, DIM, generator=gen, device=device)
    emb = torch.nn.functional.normalize(emb, dim=1).to(torch.float16).cpu()
    offsets = torch.arange(0, n * QUERY_TOKENS + 1, QUERY_TOKENS, dtype=torch.int64)
    write_shard(path, [f"q{i:04d}" for i in range(n)], emb, offsets=offsets, dtype="float16", normalized=True)


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------
# runs


def job(qpath: str, paths: list[str], out: str, devices: list[str]) -> dict:
    """One launcher job on `devices`: wall of the call, rank 0's stats."""
    options = {
        "queries": qpath,
        "corpus": paths,
        "output": out,
        "top_k": TOP_K,
        "device": "auto",
        "show_progress": False,
    }
    start = time.perf_counter()
    stats = distributed.launch(options, devices)
    job_s = time.perf_counter() - start
    result = {"devices": devices, "job_s": job_s, "engine_s": stats.wall_s, "stats": stats.as_dict()}
    log(f"{len(devices)} worker(s) {devices}: job {job_s:.2f} s, engine {stats.wall_s:.2f} s")
    log(stats.summary())
    return result


def main() -> None:
    global _log_path
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workdir", default="/tmp/maxsim-mgpu", help="where the corpus is written (local disk)"
    )
    parser.add_argument("--size", default=None, help="corpus size (default 32GB; --cpu: 64MB)")
    parser.add_argument("--shard-size", default=None, help="shard size (default 512MiB; --cpu: 8MiB)")
    parser.add_argument("--queries", type=int, default=None, help="number of queries (default 512; --cpu: 8)")
    parser.add_argument("--repeats", type=int, default=2, help="alternating repetitions, best kept")
    parser.add_argument("--cpu", action="store_true", help="check the script with CPU workers")
    parser.add_argument("--log", default=None, help="append one JSON line per finished stage here")
    parser.add_argument("--out", default=None, help="JSON file for the summary")
    args = parser.parse_args()
    _log_path = args.log
    if args.cpu:
        device = torch.device("cpu")
        one, two, inproc_device = ["cpu"], ["cpu", "cpu"], "cpu"
        size, shard, nq = args.size or "64MB", args.shard_size or "8MiB", args.queries or 8
    else:
        if torch.cuda.device_count() < 2:
            raise SystemExit("bench_multigpu: needs 2 CUDA devices (or --cpu to check the script)")
        device = torch.device("cuda", 0)
        one, two, inproc_device = ["cuda:0"], ["cuda:0", "cuda:1"], "cuda:0"
        size, shard, nq = args.size or "32GB", args.shard_size or "512MiB", args.queries or 512
    threads = min(16, os.cpu_count() or 1)
    work = args.workdir
    os.makedirs(work, exist_ok=True)

    t0 = time.perf_counter()
    paths = build_corpus(os.path.join(work, "corpus"), parse_size(size), parse_size(shard), device, threads)
    qpath = os.path.join(work, "queries.safetensors")
    build_queries(qpath, nq, device)
    small = build_corpus(os.path.join(work, "small"), 16 << 20, 8 << 20, device, threads, seed=5)
    corpus_bytes = sum(os.path.getsize(p) for p in paths)
    data_s = time.perf_counter() - t0
    log(f"data: {len(paths)} shards, {format_size(corpus_bytes)} in {data_s:.1f} s")
    record("data", shards=len(paths), corpus_bytes=corpus_bytes, seconds=data_s)
    bench_score.read_files(paths, threads)  # page cache warm
    read_s = min(bench_score.read_files(paths, threads)[0] for _ in range(2))
    log(f"page cache read alone: {read_s:.2f} s ({corpus_bytes / read_s / 1e9:.1f} GB/s, {threads} threads)")
    record("read", seconds=read_s, GBps=corpus_bytes / read_s / 1e9)

    # Triton compile into the on-disk cache (workers load from it), CUDA and torch warm in this process
    score(qpath, small, output=os.path.join(work, "warm.trec"), top_k=TOP_K, device=inproc_device, log=log)
    inproc_out = os.path.join(work, "run-inprocess.trec")
    start = time.perf_counter()
    inproc = score(qpath, paths, output=inproc_out, top_k=TOP_K, device=inproc_device, log=log)
    inproc_s = time.perf_counter() - start
    log(f"in-process 1 device: {inproc_s:.2f} s; {inproc.summary()}")
    record("inprocess_1gpu", seconds=inproc_s, stats=inproc.as_dict())
    reference = sha256(inproc_out)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the worker on cuda:0 should find the memory this process used free

    best: dict[str, dict] = {}
    same = True
    for rep in range(args.repeats):
        for name, devices in (("1gpu", one), ("2gpu", two)):
            out = os.path.join(work, f"run-{name}.trec")
            result = job(qpath, paths, out, devices)
            result["same_as_inprocess"] = sha256(out) == reference
            same = same and result["same_as_inprocess"]
            record(name, rep=rep, **result)
            if name not in best or result["engine_s"] < best[name]["engine_s"]:
                best[name] = result
            os.unlink(out)

    summary = {
        "corpus_bytes": corpus_bytes,
        "shards": len(paths),
        "documents": inproc.documents,
        "tokens": inproc.tokens,
        "queries": nq,
        "query_tokens": QUERY_TOKENS,
        "top_k": TOP_K,
        "page_cache_read_GBps": corpus_bytes / read_s / 1e9,
        "inprocess_1gpu_s": inproc_s,
        "job_1gpu_s": best["1gpu"]["job_s"],
        "job_2gpu_s": best["2gpu"]["job_s"],
        "engine_1gpu_s": best["1gpu"]["engine_s"],
        "engine_2gpu_s": best["2gpu"]["engine_s"],
        "speedup_engine": best["1gpu"]["engine_s"] / best["2gpu"]["engine_s"],
        "speedup_job": best["1gpu"]["job_s"] / best["2gpu"]["job_s"],
        "speedup_vs_inprocess": inproc_s / best["2gpu"]["engine_s"],
        "identical_output": same,
        "run_sha256": reference,
        "best_1gpu": best["1gpu"],
        "best_2gpu": best["2gpu"],
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "date": datetime.date.today().isoformat(),
        },
    }
    log(
        f"speedup 2 vs 1: engine {summary['speedup_engine']:.2f}x, job {summary['speedup_job']:.2f}x, "
        f"vs in-process {summary['speedup_vs_inprocess']:.2f}x; identical output: {same}"
    )
    record("summary", **summary)
    text = json.dumps(summary, indent=2, sort_keys=True)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
