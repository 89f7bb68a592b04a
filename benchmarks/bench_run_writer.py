"""Time `RunWriter` on a run of 512 queries x 1000 documents (the `maxsim score` default top-k), on this
machine: ids like MS MARCO's, scores already in descending order as the engine hands them over.

    python benchmarks/bench_run_writer.py --out benchmarks/results/host/run-writer-cpu.json

`--compare-with FILE` times the RunWriter of another version of maxsim_cli/runs.py on the same rows in
the same run, e.g. the one before the one-format-per-query change:

    git show dabbd6c~1:maxsim_cli/runs.py > /tmp/runs_before.py
    python benchmarks/bench_run_writer.py --compare-with /tmp/runs_before.py --out ...
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
import time

import numpy as np

from maxsim_cli.run_files import RunWriter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compare-with", default=None, help="another runs.py to time on the same rows")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    ids = [f"msmarco_doc_{i:08d}" for i in range(200_000)]
    data = []
    for q in range(args.queries):
        chosen = rng.choice(len(ids), args.top_k, replace=False)
        scores = np.sort(rng.random(args.top_k).astype(np.float32))[::-1]
        data.append((f"q{q}", [ids[i] for i in chosen], scores.tolist()))
    writers = {"this": RunWriter}
    if args.compare_with:
        spec = importlib.util.spec_from_file_location("maxsim_cli._runs_compared", args.compare_with)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        writers["compared"] = module.RunWriter
    times: dict[str, list[float]] = {name: [] for name in writers}
    outputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):  # interleaved, so that load from other processes hits both alike
            for name, writer_class in writers.items():
                path = os.path.join(tmp, f"{name}.trec")
                start = time.perf_counter()
                with writer_class(path) as writer:
                    for qid, docnos, scores in data:
                        writer.write_query(qid, docnos, scores)
                times[name].append(time.perf_counter() - start)
        for name in writers:
            with open(os.path.join(tmp, f"{name}.trec"), "rb") as f:
                outputs[name] = f.read()
    rows = args.queries * args.top_k
    command = "python benchmarks/bench_run_writer.py"
    if args.compare_with:
        command += f" --compare-with {args.compare_with}"
    result = {
        "rows": rows,
        "bytes": len(outputs["this"]),
        "cores": os.cpu_count(),
        "command": command + (f" --out {args.out}" if args.out else ""),
    }
    for name, ts in times.items():
        result[name] = {"best_s": min(ts), "median_s": float(np.median(ts)), "rows_per_s": rows / min(ts)}
    if "compared" in outputs:
        result["same_bytes"] = outputs["compared"] == outputs["this"]
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
