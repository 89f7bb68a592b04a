"""`maxsim score` on the GPU with the offsets copied three ways, alternating in one process (H200 A/B).

Since df1a339 the kernels copy offsets from the host without the host waiting for the stream
(`maxsim_kernels._validate.host_to_device`), so the scoring thread queues batches as far ahead of the
GPU as the readers' batches allow. fp16 end-to-end runs after df1a339 were slower than before on other
machines (docs/benchmarks.md, `maxsim score` end to end); this settles it in one process:

- ``current``: the code as it is (non-blocking copies, no bound on the queue);
- ``bounded``: the candidate fix: the same, with the scoring thread waiting for the end of the batch two
  back before it queues the next (`RUN_AHEAD_BATCHES`), so at most two batches wait on the GPU;
- ``blocking``: offsets copied with a copy that waits for the stream (as before df1a339).

The `score` benchmark's corpus (10 GB of fp16 shards under --workdir, built as `bench_score.py` builds
it) and its int8 quantization (`bench_score.py --int8` keeps it in corpus-int8), 512 queries, top-1000,
after a warm-up run on the small corpus; every way and precision ``--rounds`` times, interleaved. Prints
the best and median wall time of each and their per-batch GPU and host times (first round). Result
(benchmarks/results/score/ab-offsets-h200.json): the non-blocking copy stays (int8 17-20% faster, fp16 within
the spread); the bound did not pay enough to enter the engine.

    python benchmarks/ab_offsets_copy.py --workdir /var/tmp/mb \\
        --out benchmarks/results/score/ab-offsets-h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from typing import Any

import maxsim_kernels._validate as validate
import maxsim_kernels.maxsim_forward as forward
import torch
from common import add_score_args, prepare_score_corpus, write_json

from maxsim_cli.score import score
from maxsim_cli.scoring.engine import _Engine

WAYS = ("current", "bounded", "blocking")
RUN_AHEAD_BATCHES = 2  # the bound that ``bounded`` tries


def _blocking_copy(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return x.to(device)  # waits for the stream when the target is a GPU


def _bounded_timer(timer: Callable[[Any], object]) -> Callable[[Any], object]:
    """The engine's batch timer, first waiting for the end of the batch RUN_AHEAD_BATCHES back."""

    def start(engine: Any) -> object:
        if engine.cuda and len(engine.score_events) >= RUN_AHEAD_BATCHES:
            engine.score_events[-RUN_AHEAD_BATCHES][1].synchronize()
        return timer(engine)

    return start


@contextlib.contextmanager
def way(name: str) -> Iterator[None]:
    """The code patched to copy offsets and bound the queue as `name` says, restored afterwards."""
    modules = [validate, forward]
    with contextlib.suppress(ImportError):  # the Gluon module needs triton's gluon
        import maxsim_kernels.maxsim_int8_hopper as hopper

        modules.append(hopper)
    copies = [(m, m.host_to_device) for m in modules]
    timer = _Engine._timer
    try:
        if name == "bounded":
            _Engine._timer = _bounded_timer(timer)
        if name == "blocking":
            for m in modules:
                m.host_to_device = _blocking_copy
        yield
    finally:
        for m, fn in copies:
            m.host_to_device = fn
        _Engine._timer = timer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_score_args(parser)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    work = args.workdir
    corpora, qpath = prepare_score_corpus(work, device, args.size)
    times: dict[str, list[float]] = {}
    batches: dict[str, str] = {}
    for r in range(args.rounds):
        for name in WAYS:
            for precision, corpus in corpora.items():
                key = f"{precision} {name}"
                with way(name):
                    stats = score(qpath, corpus, output=os.path.join(work, "ab.trec"), device=device.type,
                                  log=lambda m: None)  # fmt: skip
                times.setdefault(key, []).append(stats.wall_s)
                if r == 0:
                    batches[key] = f"{stats.doc_batches} batches, scoring {stats.score_s:.3f} s"
                print(f"round {r} {key}: {stats.wall_s:.3f} s", file=sys.stderr, flush=True)
    rows = {
        key: {"best_s": min(t), "median_s": statistics.median(t), "all_s": t, "first_round": batches[key]}
        for key, t in times.items()
    }
    for key, row in rows.items():
        print(f"{key:16s} best {row['best_s']:.3f} s  median {row['median_s']:.3f} s  ({row['first_round']})")
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    write_json(args.out, {"rows": rows, "device": gpu, "torch": torch.__version__}, indent=2)


if __name__ == "__main__":
    main()
