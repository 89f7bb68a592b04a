"""A fresh `maxsim score` process, stage by stage: with the kernel warm-up thread and without, side by side.

Builds (or reuses under --workdir) the score benchmark's corpus (fp16 shards, d = 128, documents of
20-300 tokens; 512 queries of 32 tokens), warms the page cache and Triton's disk cache with one uncounted
run, then starts fresh ``python -m maxsim_cli score QUERIES CORPUS -k 1000 -o FILE`` processes, the modes
in turn, --runs of each:

- ``off``: ``MAXSIM_KERNEL_WARMUP=0``, the previous behaviour (the first batch pays the first launch);
- ``on``: the warm-up thread (`maxsim_cli.scoring.warmup`);
- ``on-pycache``: the same with ``PYTHONPYCACHEPREFIX`` set to a folder under --workdir (filled by one
  uncounted run), for a Python whose site-packages it may not write bytecode to: what the install advice
  of docs/benchmarks.md ("What a fresh process pays once") would give;
- ``off-pycache``: that bytecode folder without the warm-up thread;
- ``on-pycache-rehash``: ``on-pycache`` with ``MAXSIM_TRITON_KEY_CACHE=0``: the warm-up computes Triton's
  cache key as Triton does instead of reading back its saved copy (`maxsim_cli.tuning.remember_triton_key`);
- ``on-pycache-late``: ``on-pycache`` with ``MAXSIM_EARLY_CUDA=0``: the CUDA context made by torch's first
  call on the main thread instead of in a thread beside torch's import (`maxsim_cli.cuda_early`);
- ``on-pycache-gc``: ``on-pycache`` with ``MAXSIM_GC_PAUSE=0``: Python's garbage collector as Python runs
  it, not paused for the imports and the set-up and frozen as the pass begins (`maxsim_cli.tuning`);
- ``on-pycache-lateread``: ``on-pycache`` with ``MAXSIM_EARLY_READS=0``: the first batches read as the
  pass begins instead of while the warm-up finishes (`BatchStream.start`);
- ``on-pycache-gcfreeze`` / ``on-pycache-gcoff``: ``on-pycache-gc`` with the collector frozen (`gc.freeze`)
  as the pass starts, or off during it (``PASS_TRACE_GC``, traced runs only).

``--trace`` (and the two gc modes) runs each process under `pass_trace.py`, which records the pass batch
by batch on the host's clock and the GPU's, and the collections of Python's garbage collector; each
run's row then has that trace's summary (`pass_trace.summarize`).

Each process writes its timeline (``MAXSIM_TIMELINE``: seconds since the parent started it, per stage)
and its stats (``--stats-json``). Reported per run: the process's wall time, the command's own
(``wall_s``: from `score_files` to the run written), its set-up and pass, the kernel's GPU time, the wait
for the warm-up and its steps, and the stages; per mode, the medians. Every run's file must be the same
bytes. Also recorded: whether this Python writes bytecode next to triton's sources.

    python benchmarks/profile_first_call.py --workdir /tmp/mb-first --out $OUT        # H200: ~3 min
    python benchmarks/profile_first_call.py --device cpu --size 4MB --queries 4 --runs 1 --out /tmp/x
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from common import build_corpus, build_queries, make_log, meta, read_files, write_json
from pass_trace import summarize

from maxsim_cli.units import parse_size

log = make_log("first-call", clock=True)
MODES = (
    "off", "on", "on-pycache", "off-pycache", "on-pycache-rehash", "on-pycache-late",
    "on-pycache-gc", "on-pycache-lateread", "on-pycache-gcfreeze", "on-pycache-gcoff",
)  # fmt: skip
# stages of the timeline, in the order a run reaches them (those of the warm-up thread: on CUDA only)
STAGES = (
    "command", "cuda_context", "imports", "checked", "triton_imported", "cache_key", "cuda_ready",
    "checks_loaded", "corpus_open", "queries_read", "arena_locked", "kernels_ready", "kernels_joined",
    "first_batch_launched", "run_written",
)  # fmt: skip


def bytecode_report() -> dict:
    """Whether importing triton can reuse compiled bytecode: the settings that stop Python writing it,
    whether triton's folder is writable, and how many of its modules have bytecode for this Python."""
    import importlib.util

    out: dict = {
        "dont_write_bytecode": sys.dont_write_bytecode,
        "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE"),
        "pycache_prefix": sys.pycache_prefix,
    }
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return out
    root = next(iter(spec.submodule_search_locations))
    sources = cached = 0
    for folder, _dirs, names in os.walk(root):
        for name in names:
            if name.endswith(".py"):
                sources += 1
                cached += os.path.exists(importlib.util.cache_from_source(os.path.join(folder, name)))
    out.update(
        triton_dir=root, triton_dir_writable=os.access(root, os.W_OK), py_files=sources, with_pyc=cached
    )
    return out


def one_run(args: argparse.Namespace, mode: str, corpus: list[str], queries: str, tag: str) -> dict:
    """One fresh process of `maxsim score` in ``mode``: its timeline, stats and run's digest."""
    work = args.workdir
    timeline_path, stats_path = (
        os.path.join(work, f"timeline-{tag}.json"),
        os.path.join(work, f"stats-{tag}.json"),
    )
    output = os.path.join(work, f"run-{tag}.trec")
    for path in (timeline_path, stats_path):
        if os.path.exists(path):
            os.unlink(path)
    env = {
        **os.environ,
        "MAXSIM_TIMELINE": timeline_path,
        "MAXSIM_KERNEL_WARMUP": "0" if mode.startswith("off") else "1",
        "MAXSIM_TRITON_KEY_CACHE": "0" if mode.endswith("rehash") else "1",
        "MAXSIM_EARLY_CUDA": "0" if mode.endswith("late") else "1",
        "MAXSIM_GC_PAUSE": "0" if mode.endswith(("-gc", "gcfreeze", "gcoff")) else "1",
        "MAXSIM_EARLY_READS": "0" if mode.endswith("lateread") else "1",
    }
    env.pop("PYTHONPYCACHEPREFIX", None)
    env.pop("PASS_TRACE_GC", None)
    trace_path = None
    if args.trace or mode.endswith(("gcfreeze", "gcoff")):
        trace_path = os.path.join(work, f"trace-{tag}.json")
        env["PASS_TRACE"] = trace_path
        if mode.endswith(("gcfreeze", "gcoff")):
            env["PASS_TRACE_GC"] = mode.rsplit("-gc", 1)[1]
    if "pycache" in mode:  # bytecode written to, and read from, a folder of its own
        env["PYTHONPYCACHEPREFIX"] = os.path.join(work, "pycache")
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    launcher = (
        [os.path.join(os.path.dirname(os.path.abspath(__file__)), "pass_trace.py")]
        if trace_path
        else ["-m", "maxsim_cli"]
    )
    cmd = [sys.executable, *launcher, "score", queries, *corpus, "-k", str(args.top_k), "-o", output]
    cmd += ["--device", args.device, "--quiet", "--stats-json", stats_path]
    started = time.time()
    env["MAXSIM_TIMELINE_T0"] = repr(started)
    # run from the work folder: `-m` puts the current folder first on the path, so that a checkout there
    # would be imported instead of the one PYTHONPATH names (a copy of another version, for an A/B)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=work)
    process_s = time.time() - started
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    with open(stats_path, encoding="utf-8") as fh:
        stats = json.load(fh)
    with open(timeline_path, encoding="utf-8") as fh:
        stages = json.load(fh)["stages"]
    with open(output, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    os.unlink(output)
    row = {
        "mode": mode,
        "process_s": round(process_s, 4),
        "wall_s": stats["wall_s"],
        "setup_s": stats["setup_s"],
        "pass_s": stats["wall_s"] - stats["setup_s"] - stats["write_s"],
        "write_s": stats["write_s"],
        "kernel_s": stats["score_s"],
        "read_s": stats["read_s"],
        "copy_s": stats["copy_s"],
        "wait_s": stats.get("wait_s"),
        "doc_batches": stats.get("doc_batches"),
        "arena_ready_s": stats.get("arena_ready_s"),
        "kernels_wait_s": stats.get("kernels_wait_s"),
        "warmup": stats.get("warmup"),
        "stages": {name: stages[name] for name in STAGES if name in stages},
        "run_sha256": digest,
    }
    row["pass_over_kernel"] = row["pass_s"] / row["kernel_s"] if row["kernel_s"] else None
    if trace_path is not None:
        with open(trace_path, encoding="utf-8") as fh:
            row["trace"] = summarize(json.load(fh))
        log(f"{mode:10s} trace {json.dumps(row['trace'])}")
    log(
        f"{mode:10s} process {process_s:.2f} s, command {row['wall_s']:.3f} s (set-up {row['setup_s']:.3f}, "
        f"pass {row['pass_s']:.3f}, kernel {row['kernel_s']:.3f}, waited for the warm-up "
        f"{row['kernels_wait_s']}); first batch at {stages.get('first_batch_launched')} s"
    )
    return row


def summary(rows: list[dict]) -> dict:
    """Per mode: the medians of the times and of each stage."""
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        keys = ("process_s", "wall_s", "setup_s", "pass_s", "write_s", "kernel_s", "pass_over_kernel")
        med = {
            k: statistics.median(r[k] for r in mine if r[k] is not None)
            for k in keys
            if mine[0][k] is not None
        }
        med["stages"] = {
            name: statistics.median(r["stages"][name] for r in mine if name in r["stages"])
            for name in STAGES
            if any(name in r["stages"] for r in mine)
        }
        med["runs"] = len(mine)
        out[mode] = med
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/maxsim-first-call", help="corpus and scratch files")
    parser.add_argument("--out", required=True, help="folder (first-call-<device>.json) or .json file")
    parser.add_argument("--size", default="8.2GB", help="corpus size")
    parser.add_argument("--queries", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=4, help="fresh processes of each mode")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--trace", action="store_true", help="run each process under pass_trace.py: its pass, batch by batch"
    )
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if any(m not in MODES for m in modes):
        parser.error(f"--modes: each of {', '.join(MODES)}")
    args.workdir = os.path.abspath(args.workdir)
    os.makedirs(args.workdir, exist_ok=True)
    dev = torch.device(args.device)
    started = time.perf_counter()
    shard_bytes = 512 << 20 if dev.type == "cuda" else 4 << 20
    corpus = build_corpus(os.path.join(args.workdir, "corpus"), parse_size(args.size), shard_bytes, dev)
    queries = os.path.join(args.workdir, f"queries-{args.queries}.safetensors")
    if not os.path.exists(queries):
        build_queries(queries, args.queries, dev)
    read_s, nbytes = read_files(corpus, os.cpu_count() or 1)  # the page cache warm for every run
    log(
        f"corpus {nbytes / 1e9:.2f} GB in {len(corpus)} shards ready in {time.perf_counter() - started:.1f} s"
    )
    # uncounted: the kernels into Triton's disk cache, and the bytecode folder of on-pycache filled
    primes = ["off"] + (["on-pycache"] if any("pycache" in m for m in modes) else [])
    for mode in primes:
        one_run(args, mode, corpus, queries, f"prime-{mode}")
    rows = []
    for i in range(args.runs):
        for mode in modes if i % 2 == 0 else modes[::-1]:  # alternating, so that no mode always goes first
            rows.append(one_run(args, mode, corpus, queries, f"{mode}-{i}"))
    same = len({r["run_sha256"] for r in rows}) == 1
    result = {
        "meta": meta(
            corpus_bytes=nbytes, shards=len(corpus), queries=args.queries, top_k=args.top_k, runs=args.runs
        ),
        "bytecode": bytecode_report(),
        "same_run": same,
        "summary": summary(rows),
        "runs": rows,
    }
    out = args.out if args.out.endswith(".json") else os.path.join(args.out, f"first-call-{dev.type}.json")
    if os.path.dirname(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
    write_json(out, result)
    for mode, med in result["summary"].items():
        log(
            f"median {mode:10s}: command {med['wall_s']:.3f} s (set-up {med['setup_s']:.3f}, pass "
            f"{med['pass_s']:.3f}, kernel {med['kernel_s']:.3f}), process {med['process_s']:.2f} s"
        )
    log(f"same run in every process: {same}; {out}; {time.perf_counter() - started:.0f} s in all")
    if not same:
        raise SystemExit("the runs differ between processes")


if __name__ == "__main__":
    main()
