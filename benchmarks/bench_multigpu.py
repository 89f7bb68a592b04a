"""`maxsim score` end to end on 1 and on 2 GPUs of one machine, in one run: speedup and identical output.

Workload (the `score` benchmark's, bench_score.py): 512 queries x 32 tokens against fp16 shards of
L2-normalised random token vectors, d = 128 (256 B a token), document lengths uniform in [20, 300]
(mean 160), 512 MiB shards, 10 GB by default, top-k 1000, the run written to local disk. The corpus is
written in this run (so it sits in the page cache) and read alone as fast as the cores can
(`common.read_files`); a warm-up on a small corpus on each GPU, alone and together, compiles the
Triton kernels and starts CUDA on both devices, as `bench_score` warms up before its first run.

Configurations (``--configs``), alternated in the order given, each run's wall time from the call to the
run written:

- ``1gpu``: `score` on cuda:0 in this process (the single-process engine: `bench_score`'s first run);
- ``2gpu``: `score --devices 0,1` in this process: a rank per GPU as threads (`run_threads`), shards
  shared by tokens, results merged and written once;
- ``1gpu-process`` / ``2gpu-processes``: the same with ranks as fresh worker processes joined through
  torch.distributed (`maxsim_cli.parallel.launcher.launch`, what torchrun does): interpreter, imports
  and CUDA start included;
- ``cli-1gpu`` / ``cli-2gpu``: `python -m maxsim_cli score` as a user types it, all start-up included.

Every run must be byte for byte the same file. JSON lines are appended to ``--log`` as stages finish,
so a run cut short still leaves its figures.

    python benchmarks/bench_multigpu.py --workdir /var/tmp/mgpu --size 10GB \\
        --configs 1gpu,2gpu,cli-1gpu,cli-2gpu --out benchmarks/results/scaling/multigpu-h200x2.json

``--cpu`` runs the same script with CPU "devices" on a small corpus: a check of the script, not a
measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
from common import DIM, MAX_LEN, MIN_LEN, QUERY_TOKENS, build_queries, read_files, write_json

import maxsim_cli.scoring.plan as plan_module
from maxsim_cli.parallel import launcher as job_launcher
from maxsim_cli.parallel import threads as rank_threads
from maxsim_cli.scoring.entry import score
from maxsim_cli.scoring.request import ScoreRequest
from maxsim_cli.shards import write_shard
from maxsim_cli.shards.files import file_sha256
from maxsim_cli.units import format_size, parse_size

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


# --------------------------------------------------------------------------------------------------
# runs


def request_for(qpath: str, paths: list[str], out: str, **settings: object) -> ScoreRequest:
    """The job's request, as `maxsim score --devices` builds it (plus a configuration's settings)."""
    return ScoreRequest(
        queries=qpath, corpus=paths, output=out, top_k=TOP_K, device="auto", show_progress=False, **settings
    )


@contextlib.contextmanager
def settings(config: str) -> Iterator[dict]:
    """A configuration's settings after '@', joined by '+': staging=SIZE (each rank's pinned arena, hence
    the batch size, for 1gpu and for rank threads alike), readers=N (reader threads per rank), switch=MS
    (Python's GIL switch interval). In-process configurations only."""
    # the engine reads the arena's cap from `maxsim_cli.scoring.plan` and rank threads theirs from
    # `maxsim_cli.parallel.threads`, both at each run: patch them there
    staging, interval = plan_module.STAGING_BYTES, sys.getswitchinterval()
    thread_staging = rank_threads.THREAD_STAGING_BYTES
    kwargs: dict = {}
    try:
        for setting in filter(None, config.partition("@")[2].split("+")):
            key, _, value = setting.partition("=")
            if key == "staging":
                plan_module.STAGING_BYTES = rank_threads.THREAD_STAGING_BYTES = parse_size(value)
            elif key == "readers":
                kwargs["reader_threads"] = int(value)
            elif key == "switch":  # Python's GIL switch interval, in ms
                sys.setswitchinterval(float(value) / 1000)
            else:
                raise SystemExit(f"bench_multigpu: unknown setting {setting!r} in {config!r}")
        yield kwargs
    finally:
        plan_module.STAGING_BYTES, rank_threads.THREAD_STAGING_BYTES = staging, thread_staging
        sys.setswitchinterval(interval)


def run_config(config: str, qpath: str, paths: list[str], out: str, devices: list[str]) -> dict:
    """One run of configuration `config` (a name, then optional settings: `settings`): wall of the call
    and the engine's stats (rank 0's for a job)."""
    name = config.partition("@")[0]
    start = time.perf_counter()
    if name == "1gpu":  # the single-process engine, in this (warm) process
        with settings(config) as kwargs:
            stats = score(qpath, paths, output=out, top_k=TOP_K, device=devices[0], log=log, **kwargs)
    elif name == "2gpu":  # `--devices`: ranks as threads of this process
        with settings(config) as kwargs:
            stats = rank_threads.run_threads(request_for(qpath, paths, out, **kwargs), devices)
    elif name in ("1gpu-process", "2gpu-processes"):  # ranks as fresh worker processes
        stats = job_launcher.launch(request_for(qpath, paths, out), devices)
    else:  # cli-1gpu / cli-2gpu: `maxsim score` as a user types it, interpreter start included
        cmd = [sys.executable, "-m", "maxsim_cli", "score", qpath, *paths, "-k", str(TOP_K), "-o", out]
        spec = ",".join(devices) if devices[0].startswith("cuda") else f"cpu:{len(devices)}"
        cmd += ["--device", devices[0]] if len(devices) == 1 else ["--devices", spec]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        stats = None
    wall = time.perf_counter() - start
    result = {"devices": devices, "wall_s": wall}
    if stats is not None:
        result.update(engine_s=stats.wall_s, stats=stats.as_dict())
    log(f"{config} {devices}: {wall:.3f} s" + (f"; {stats.summary()}" if stats is not None else ""))
    return result


def main() -> None:
    global _log_path
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workdir", default="/tmp/maxsim-mgpu", help="where the corpus is written (local disk)"
    )
    parser.add_argument("--size", default=None, help="corpus size (default 10GB; --cpu: 64MB)")
    parser.add_argument("--shard-size", default=None, help="shard size (default 512MiB; --cpu: 8MiB)")
    parser.add_argument("--queries", type=int, default=None, help="number of queries (default 512; --cpu: 8)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repetitions")
    parser.add_argument(
        "--configs",
        default="1gpu,2gpu",
        help="comma-separated, alternated in this order: 1gpu, 2gpu (threads, in this process), "
        "1gpu-process, 2gpu-processes (fresh workers), cli-1gpu, cli-2gpu (fresh `maxsim score`); "
        "an in-process one may take settings, e.g. 2gpu@staging=1GiB+readers=8",
    )
    parser.add_argument("--cpu", action="store_true", help="check the script with CPU workers")
    parser.add_argument("--log", default=None, help="append one JSON line per finished stage here")
    parser.add_argument("--out", default=None, help="JSON file for the summary")
    args = parser.parse_args()
    from maxsim_cli import tuning

    tuning.one_shot_process()  # the command line's process-wide settings, as `maxsim score` has them
    _log_path = args.log
    if args.cpu:
        device = torch.device("cpu")
        one, two = ["cpu"], ["cpu", "cpu"]
        size, shard, nq = args.size or "64MB", args.shard_size or "8MiB", args.queries or 8
    else:
        if torch.cuda.device_count() < 2:
            raise SystemExit("bench_multigpu: needs 2 CUDA devices (or --cpu to check the script)")
        device = torch.device("cuda", 0)
        one, two = ["cuda:0"], ["cuda:0", "cuda:1"]
        size, shard, nq = args.size or "10GB", args.shard_size or "512MiB", args.queries or 512
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
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
    read_files(paths, threads)  # page cache warm
    read_s = min(read_files(paths, threads)[0] for _ in range(2))
    log(f"page cache read alone: {read_s:.2f} s ({corpus_bytes / read_s / 1e9:.1f} GB/s, {threads} threads)")
    record("read", seconds=read_s, GBps=corpus_bytes / read_s / 1e9)

    # Triton compile (into the on-disk cache that fresh workers load from), CUDA and torch warm on both
    # devices in this process, as `bench_score` warms up before its first run
    for warm_devices in ([d] for d in two):
        run_config("1gpu", qpath, small, os.path.join(work, "warm.trec"), warm_devices)
    run_config("2gpu", qpath, small, os.path.join(work, "warm.trec"), two)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # a worker on cuda:0 should find the memory this process used free

    runs: dict[str, list[dict]] = {c: [] for c in configs}
    reference = None
    same = True
    for rep in range(args.repeats):
        for name in configs:
            out = os.path.join(work, f"run-{name}.trec")
            result = run_config(name, qpath, paths, out, one if "1gpu" in name else two)
            digest = file_sha256(out)
            reference = reference or digest
            result["same_output"] = digest == reference
            same = same and result["same_output"]
            record(name, rep=rep, **result)
            runs[name].append(result)
            os.unlink(out)

    def summary_of(name: str) -> dict:
        walls = [r["wall_s"] for r in runs[name]]
        # first: the first run of the configuration after the warm-up (it page-locks the staging arena
        # that later runs of this process reuse), as `bench_score`'s first run
        return {
            "first_s": walls[0],
            "best_s": min(walls),
            "median_s": statistics.median(walls),
            "walls_s": walls,
        }

    summary = {
        "corpus_bytes": corpus_bytes,
        "shards": len(paths),
        "queries": nq,
        "query_tokens": QUERY_TOKENS,
        "top_k": TOP_K,
        "repeats": args.repeats,
        "page_cache_read_GBps": corpus_bytes / read_s / 1e9,
        "configs": {name: summary_of(name) for name in configs},
        "identical_output": same,
        "run_sha256": reference,
        "runs": runs,
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "date": datetime.date.today().isoformat(),
        },
    }
    pairs = [("1gpu", "2gpu"), ("1gpu-process", "2gpu-processes"), ("cli-1gpu", "cli-2gpu")]
    pairs += [("1gpu", c) for c in configs if c.startswith("2gpu@")]
    pairs += [("1gpu", c) for c in configs if c.startswith("1gpu@")]
    for base, multi in pairs:
        if base in runs and multi in runs:
            a, b = summary["configs"][base], summary["configs"][multi]
            speedup = {key: a[f"{key}_s"] / b[f"{key}_s"] for key in ("first", "best", "median")}
            summary[f"speedup_{multi}"] = speedup
            log(
                f"speedup {multi} vs {base}: first {speedup['first']:.2f}x, best {speedup['best']:.2f}x, "
                f"median {speedup['median']:.2f}x ({a['median_s']:.3f} / {b['median_s']:.3f} s)"
            )
    log(f"identical output: {same}")
    record("summary", **{k: v for k, v in summary.items() if k != "runs"})
    print(json.dumps(summary, indent=2, sort_keys=True))
    write_json(args.out, summary, indent=2, sort_keys=True)


if __name__ == "__main__":
    main()
