"""`maxsim score` end to end from two source trees, alternating fresh processes in one run (H200 A/B).

For changes that cannot be switched inside one process (the engine's own code): each tree's
`maxsim_cli/` and `kernels/` (as `maxsim_kernels`) are put first on the path of a worker process, which
warms up on the small corpora and then times ``--runs`` fp16 and int8 runs of the `score` benchmark's
corpus (`common.prepare_score_corpus`: 10 GB, 512 queries, top-1000). Workers of the two trees alternate
``--rounds`` times; the best and median of each tree and precision are printed, and every run file must
be byte for byte the same across trees.

    git archive BASE | tar -x -C /tmp/base          # the baseline tree, beside this checkout
    python benchmarks/ab_trees.py --tree base=/tmp/base --tree new=. --workdir /var/tmp/mb \\
        --out benchmarks/results/score/ab-trees-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from common import add_score_args, prepare_score_corpus, sha256, write_json


def worker(args: argparse.Namespace) -> None:
    import torch

    from maxsim_cli.scoring.entry import score

    device = torch.device(args.device)
    corpora, qpath = prepare_score_corpus(args.workdir, device, args.size)
    quiet = {"device": device.type, "log": lambda m: None}
    result: dict[str, list] = {}
    for _ in range(args.runs):
        for precision, corpus in corpora.items():
            out = os.path.join(args.workdir, f"ab-trees-{precision}.trec")
            st = score(qpath, corpus, output=out, **quiet)
            digest = sha256(out)
            result.setdefault(precision, []).append(
                {"wall_s": st.wall_s, "pass_s": st.wall_s - st.setup_s - st.write_s, "sha256": digest}
            )
    import maxsim_kernels

    import maxsim_cli

    paths = [os.path.dirname(m.__file__) for m in (maxsim_cli, maxsim_kernels)]
    print("RESULT " + json.dumps({"paths": paths, "runs": result}), flush=True)


def run_tree(root: str, args: argparse.Namespace) -> dict:
    """One worker process with `root`'s packages first on its path."""
    with tempfile.TemporaryDirectory() as links:
        os.symlink(os.path.join(os.path.abspath(root), "maxsim_cli"), os.path.join(links, "maxsim_cli"))
        os.symlink(os.path.join(os.path.abspath(root), "kernels"), os.path.join(links, "maxsim_kernels"))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([links, os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--workdir", args.workdir,
               "--size", args.size, "--runs", str(args.runs), "--device", args.device]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"worker for {root} failed:\n{proc.stderr[-3000:]}")
    got = json.loads(lines[-1][len("RESULT ") :])
    expected = [os.path.join(links, "maxsim_cli"), os.path.join(links, "maxsim_kernels")]
    if got["paths"] != expected:  # the packages must come from the tree, not from the installed ones
        raise SystemExit(f"worker for {root} imported {got['paths']}, not {expected}")
    return got["runs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH of a source tree")
    add_score_args(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=2, help="timed runs a worker, each precision")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    trees = dict(t.split("=", 1) for t in args.tree)
    runs: dict[str, dict[str, list]] = {name: {} for name in trees}
    for r in range(args.rounds):
        for name, root in trees.items():
            got = run_tree(root, args)
            for precision, rows in got.items():
                runs[name].setdefault(precision, []).extend(rows)
                walls = ", ".join(f"{row['wall_s']:.3f}" for row in rows)
                print(f"round {r} {name} {precision}: {walls} s", file=sys.stderr, flush=True)
    digests = {row["sha256"] for tree in runs.values() for rows in tree.values() for row in rows}
    summary = {}
    for name, tree in runs.items():
        for precision, rows in tree.items():
            walls = [row["wall_s"] for row in rows]
            passes = [row["pass_s"] for row in rows]
            summary[f"{name} {precision}"] = {
                "best_wall_s": min(walls), "median_wall_s": statistics.median(walls),
                "best_pass_s": min(passes), "median_pass_s": statistics.median(passes), "runs": rows,
            }  # fmt: skip
            med_wall, med_pass = statistics.median(walls), statistics.median(passes)
            line = f"{name:8s} {precision}: wall best {min(walls):.3f} median {med_wall:.3f} s; "
            print(line + f"pass best {min(passes):.3f} median {med_pass:.3f} s")
    same = all(
        len({row["sha256"] for tree in runs.values() for row in tree.get(p, [])}) == 1
        for p in ("fp16", "int8")
    )
    print(f"run files identical across trees: {same} ({len(digests)} distinct over both precisions)")
    write_json(args.out, {"trees": trees, "summary": summary, "identical_runs": same}, indent=2)


if __name__ == "__main__":
    main()
