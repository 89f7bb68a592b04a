"""A fresh process's `maxsim score` pass under other host-side settings: reader threads, the pinned
staging arena's size, Python's thread switch interval (H200 probe).

On the slower H200 hosts a fresh process's pass takes ~1.9 ms of host time a document batch against
~1.4 ms of kernel time (`profile_first_call.py`: 293 batches, 0.55-0.66 s against a 0.40-0.43 s kernel,
0.02 s waiting for data), so the scoring thread, not the GPU, sets the pace. Fewer reader threads leave
each slot of the same arena larger (fewer, larger batches) and fewer threads to take Python's lock from
the scoring thread; a larger arena makes larger batches too; a shorter switch interval hands the lock
back sooner. Each variant runs in fresh processes, alternating, through `maxsim_cli.score.score` as the
command calls it (the CUDA context started beside the imports, the warm-up thread, the bytecode folder of
`profile_first_call.py`); every run must write the same bytes.

    python benchmarks/probe_pass_tuning.py --workdir /tmp/mb-first --runs 2 --out $OUT/pass-tuning.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch
from common import build_corpus, build_queries, make_log, meta, read_files, write_json

from maxsim_cli.units import parse_size

log = make_log("pass-tuning", clock=True)
# name -> (reader threads or None for the default, staging bytes or None, switch interval or None)
VARIANTS = {
    "default": (None, None, None),
    "readers8": (8, None, None),
    "staging1g": (None, 1 << 30, None),
    "readers8-staging1g": (8, 1 << 30, None),
    "switch0.5ms": (None, None, 0.0005),
}

CHILD = """
import hashlib, json, sys, time
started = time.perf_counter()
from maxsim_cli import cuda_early
cuda_early.start("cuda")
from maxsim_cli.score import score
import maxsim_cli.scoring.plan as plan
cfg = json.loads(sys.argv[1])
if cfg["staging"]:
    plan.STAGING_BYTES = cfg["staging"]
if cfg["switch"]:
    sys.setswitchinterval(cfg["switch"])
stats = score(cfg["queries"], cfg["corpus"], output=cfg["output"], top_k=cfg["k"], device="cuda",
              reader_threads=cfg["readers"])
d = stats.as_dict()
with open(cfg["output"], "rb") as fh:
    digest = hashlib.sha256(fh.read()).hexdigest()
print(json.dumps({k: d.get(k) for k in ("wall_s", "setup_s", "write_s", "score_s", "wait_s", "doc_batches",
                                         "read_s", "copy_s", "reader_threads")} | {"sha256": digest,
                 "process_s": time.perf_counter() - started}))
"""


def one_run(args: argparse.Namespace, name: str, corpus: list[str], queries: str) -> dict:
    readers, staging, switch = VARIANTS[name]
    output = os.path.join(args.workdir, f"run-tuning-{name}.trec")
    cfg = dict(queries=queries, corpus=corpus, output=output, k=args.top_k, readers=readers, staging=staging,
               switch=switch)  # fmt: skip
    env = {**os.environ, "PYTHONPYCACHEPREFIX": os.path.join(args.workdir, "pycache")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cfg)], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed: {proc.stderr.strip()[-2000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    os.unlink(output)
    row["variant"] = name
    row["pass_s"] = row["wall_s"] - row["setup_s"] - row["write_s"]
    log(
        f"{name:20s} command {row['wall_s']:.3f} s (set-up {row['setup_s']:.3f}, pass {row['pass_s']:.3f}, "
        f"kernel {row['score_s']:.3f}, waited {row['wait_s']:.3f}), {row['doc_batches']} batches, "
        f"{row['reader_threads']} readers"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/maxsim-first-call")
    parser.add_argument("--out", required=True)
    parser.add_argument("--size", default="8.2GB")
    parser.add_argument("--queries", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    names = [v for v in args.variants.split(",") if v]
    os.makedirs(args.workdir, exist_ok=True)
    dev = torch.device("cuda")
    corpus = build_corpus(os.path.join(args.workdir, "corpus"), parse_size(args.size), 512 << 20, dev)
    queries = os.path.join(args.workdir, f"queries-{args.queries}.safetensors")
    if not os.path.exists(queries):
        build_queries(queries, args.queries, dev)
    read_files(corpus, os.cpu_count() or 1)
    one_run(args, "default", corpus, queries)  # uncounted: Triton's cache, the bytecode folder
    rows = []
    for i in range(args.runs):
        for name in names if i % 2 == 0 else names[::-1]:
            rows.append(one_run(args, name, corpus, queries))
    same = len({r["sha256"] for r in rows}) == 1
    summary = {}
    for name in names:
        mine = [r for r in rows if r["variant"] == name]
        summary[name] = {
            k: statistics.median(r[k] for r in mine)
            for k in ("wall_s", "setup_s", "pass_s", "score_s", "wait_s", "doc_batches", "process_s")
        }
        log(f"median {name:20s} {json.dumps({k: round(v, 3) for k, v in summary[name].items()})}")
    write_json(args.out, {"meta": meta(runs=args.runs), "same_run": same, "summary": summary, "runs": rows})
    log(f"same run in every process: {same}")
    if not same:
        raise SystemExit("the runs differ")


if __name__ == "__main__":
    main()
