"""`maxsim score` on the GPU by number of reader threads and size of the pinned staging arena (H200 sweep).

The timeline of one pass (profile_score_timeline.py) shows the GPU idle half the pass while the scoring
thread was never short of batches: the host's launch work per batch, not the reads or the copies, set
the pace, next to 16 reader threads copying from the page cache on 16 cores. Fewer readers leave the
scoring thread a core; a larger arena gives larger batches (fewer launches per pass). This alternates
every (readers, staging) pair, fp16 and int8, in one process on the `score` benchmark's corpus
(`score_corpus.prepare`), ``--rounds`` times, and prints the best wall time and pass of each.

    python benchmarks/sweep_readers.py --workdir /var/tmp/mb --out benchmarks/results/sweep-readers-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import score_corpus  # noqa: E402

import maxsim_cli.score as score_module  # noqa: E402
from maxsim_cli.units import parse_size  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    score_corpus.add_args(parser)
    parser.add_argument("--readers", default="4,8,12,16")
    parser.add_argument("--staging", default="512MiB,1GiB")
    parser.add_argument("--precisions", default="fp16,int8")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    device = torch.device(args.device)
    corpora, qpath = score_corpus.prepare(args.workdir, device, args.size)
    out = os.path.join(args.workdir, "sweep.trec")
    quiet = {"device": device.type, "log": lambda m: None}
    default_staging = score_module.STAGING_BYTES
    rows: dict[str, dict] = {}
    try:
        for r in range(args.rounds):
            for staging in args.staging.split(","):
                score_module.STAGING_BYTES = parse_size(staging)
                for readers in [int(x) for x in args.readers.split(",")]:
                    for precision in args.precisions.split(","):
                        st = score_module.score(
                            qpath, corpora[precision], output=out, reader_threads=readers, **quiet
                        )
                        key = f"{precision} readers={readers} staging={staging}"
                        pass_s = st.wall_s - st.setup_s - st.write_s
                        row = rows.setdefault(key, {"wall_s": [], "pass_s": []})
                        row["wall_s"].append(st.wall_s)
                        row["pass_s"].append(pass_s)
                        row["batches"] = st.doc_batches
                        row["read_s_summed"] = st.read_s
                        row["wait_s"] = st.wait_s
                        line = f"round {r} {key}: wall {st.wall_s:.3f} s, pass {pass_s:.3f} s, "
                        line += f"{st.doc_batches} batches, set-up {st.setup_s:.3f} s"
                        print(line, file=sys.stderr, flush=True)
    finally:
        score_module.STAGING_BYTES = default_staging
    print(f"{'configuration':40s} {'best wall':>9s} {'best pass':>9s} {'batches':>7s}")
    for key, row in rows.items():
        print(f"{key:40s} {min(row['wall_s']):9.3f} {min(row['pass_s']):9.3f} {row['batches']:7d}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"rows": rows, "device": str(device), "cores": os.cpu_count()}, fh, indent=2)


if __name__ == "__main__":
    main()
