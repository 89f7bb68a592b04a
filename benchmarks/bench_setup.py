"""`maxsim score`'s set-up alone (opening the shards, checking and ordering the ids, planning), on the
document count of the H200 end-to-end benchmark: 19 safetensors shards, 244,150 documents of 20-300
tokens, with dim 8 so the files stay small (the set-up does not read embeddings). The scoring pass is
skipped. Host-only work, so any machine measures it; best of --repeats runs in one process.

    python benchmarks/bench_setup.py --workdir /tmp/mb-setup --out benchmarks/results/host/setup-cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform

import torch

from maxsim_cli.scoring import entry as score_mod
from maxsim_cli.scoring.engine import _Engine
from maxsim_cli.shards import write_shard

SHARDS, DOCS_PER_SHARD, DIM, QUERIES = 19, 12850, 8, 4


def build(workdir: str) -> tuple[str, list[str]]:
    os.makedirs(workdir, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    paths = [os.path.join(workdir, f"shard{s:04d}.safetensors") for s in range(SHARDS)]
    done = os.path.join(workdir, ".complete")
    if not os.path.exists(done):
        for s, path in enumerate(paths):
            lens = torch.randint(20, 301, (DOCS_PER_SHARD,), generator=gen)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
            emb = torch.nn.functional.normalize(torch.randn(int(offsets[-1]), DIM, generator=gen), dim=1)
            ids = [f"d{s * DOCS_PER_SHARD + i:09d}" for i in range(DOCS_PER_SHARD)]
            write_shard(path, ids, emb.half(), offsets=offsets, dtype="float16", normalized=True)
        open(done, "w").close()
    queries = os.path.join(workdir, "queries.safetensors")
    q = torch.nn.functional.normalize(torch.randn(QUERIES * 32, DIM, generator=gen), dim=1).half()
    write_shard(queries, [f"q{i}" for i in range(QUERIES)], q, offsets=torch.arange(0, QUERIES * 32 + 1, 32),
                dtype="float16", normalized=True)  # fmt: skip
    return queries, paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    queries, paths = build(args.workdir)
    _Engine.run_exhaustive = lambda self, *a, **k: None  # the set-up only
    times = []
    for _ in range(args.repeats):
        out = os.path.join(args.workdir, "run.trec")
        stats = score_mod.score(queries, paths, output=out, log=lambda m: None, device="cpu")
        times.append(stats.setup_s)
    result = {
        "benchmark": "score set-up",
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "command": "python benchmarks/bench_setup.py --workdir WORKDIR --out OUT",
        "shards": SHARDS,
        "documents": SHARDS * DOCS_PER_SHARD,
        "setup_s_best": min(times),
        "setup_s_all": times,
    }
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
