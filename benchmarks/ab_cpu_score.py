"""`maxsim score --device cpu` against earlier versions of its CPU path, interleaved (CPU machine).

Ways (one per process; run them alternately, several rounds):

- ``current``: the code as it is;
- ``uncut``: document batches not cut at shard boundaries (a batch spanning two shards is copied into a
  staging slot instead of scored from a map of each file), as before `maxsim_cli.scoring.plan._cut_at`;
- ``fresh``: also the CPU backend's chunk buffers allocated per chunk instead of kept per worker
  thread, as before `maxsim_kernels.cpu._scratch`.

Each process scores the 1 GB corpus of ``bench_score.py cpu`` three times end to end (4 queries) and
three times from memory (the backend alone, in the run's batch sizes):

    for i in 1 2 3; do for way in fresh uncut current; do
        python benchmarks/ab_cpu_score.py $way; done; done
"""

from __future__ import annotations

import glob
import os
import sys

import maxsim_kernels.cpu as cpu_backend
import torch
from common import kernel_time, load_batches

import maxsim_cli.scoring.plan as plan_module
from maxsim_cli.score import score
from maxsim_cli.shards import open_corpus


def main() -> None:
    way = sys.argv[1] if len(sys.argv) > 1 else "current"
    work = sys.argv[2] if len(sys.argv) > 2 else "/tmp/mbcpu"
    if way in ("fresh", "uncut"):
        plan_module._cut_at = lambda spans, _bounds: spans  # planning calls it from its own module
    if way == "fresh":
        cpu_backend._scratch = lambda _name, shape, dtype: torch.empty(shape, dtype=dtype)
    paths = sorted(glob.glob(os.path.join(work, "corpus-cpu-*", "*.safetensors")))
    queries = os.path.join(work, "queries-cpu-4.safetensors")
    if not paths or not os.path.exists(queries):
        sys.exit(f"no corpus under {work}: run `python benchmarks/bench_score.py cpu --workdir {work}` first")
    q = open_corpus([queries]).shards[0].read_docs(0, 4)
    e2e = score(queries, paths, output=os.path.join(work, "ab.trec"), device="cpu", log=lambda _m: None)
    batches = load_batches(paths, e2e.max_batch_tokens, torch.device("cpu"))
    e2e_s, kernel_s = [], []
    for _ in range(3):
        e2e_s.append(
            score(
                queries, paths, output=os.path.join(work, "ab.trec"), device="cpu", log=lambda _m: None
            ).wall_s
        )
        kernel_s.append(kernel_time(batches, q.embeddings, q.offsets, "torch"))
    print(f"{way:6s} end to end {' '.join(f'{x:.3f}' for x in e2e_s)} s; backend from memory "
          f"{' '.join(f'{x:.3f}' for x in kernel_s)} s")  # fmt: skip


if __name__ == "__main__":
    main()
