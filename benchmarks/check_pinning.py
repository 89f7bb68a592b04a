"""Does the staging arena's page-locking method change `maxsim score`'s output? (H200 check)

Scores 512 queries against a 4 GiB corpus (bench_score.py's generator) twice per fresh process, after a
warm-up on a small corpus, with PyTorch's default pinned allocator (cudaHostAlloc) and with its
threaded registration (`pinned_use_cuda_host_register:True,pinned_num_register_threads:8`: malloc, then
cudaHostRegister), three processes each, and compares every run file with the first default run.

    python benchmarks/check_pinning.py > benchmarks/results/host/check-pinning-h200.txt
"""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys

import torch
from common import build_corpus, build_queries

from maxsim_cli.score import score

WORK = "/var/tmp/mb-pinning"
THREADED = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def shards(folder: str) -> list[str]:
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))


def one_process(variant: str, process: int) -> None:
    sys.stdout.reconfigure(line_buffering=True)
    if variant == "default":  # the engine turns threaded registration on unless the user configured pinning
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "pinned_use_cuda_host_register:False"
    else:
        torch.cuda.memory._set_allocator_settings(THREADED)
    queries = os.path.join(WORK, "queries.safetensors")
    quiet = lambda _msg: None  # noqa: E731
    score(queries, shards(os.path.join(WORK, "small")), output=os.path.join(WORK, "warm.trec"),
                      log=quiet, device="cuda")  # fmt: skip
    reference = os.path.join(WORK, "default-p0-r0.trec")
    for run in range(2):
        out = os.path.join(WORK, f"{variant}-p{process}-r{run}.trec")
        name = f"{variant} process {process} run {run}"
        try:
            stats = score(queries, shards(os.path.join(WORK, "corpus")), output=out, log=quiet,
                                      device="cuda")  # fmt: skip
        except Exception as exc:  # a corrupted batch surfaces as an error somewhere downstream
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        same = filecmp.cmp(out, reference, shallow=False) if os.path.exists(reference) else "reference"
        print(
            f"{name}: wall {stats.wall_s:.3f} s, set-up {stats.setup_s:.3f} s, same run: {same}", flush=True
        )


def main() -> None:
    if len(sys.argv) == 3:
        one_process(sys.argv[1], int(sys.argv[2]))
        return
    device = torch.device("cuda")
    build_corpus(os.path.join(WORK, "corpus"), 4 << 30, 512 << 20, device)
    build_queries(os.path.join(WORK, "queries.safetensors"), 512, device)
    build_corpus(os.path.join(WORK, "small"), 32 << 20, 16 << 20, device, seed=5)
    for process in range(3):
        for variant in ("default", "threaded"):
            proc = subprocess.run(
                [sys.executable, __file__, variant, str(process)], capture_output=True, text=True
            )
            print(proc.stdout.strip() or proc.stderr[-800:], flush=True)


if __name__ == "__main__":
    main()
