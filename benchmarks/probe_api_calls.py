"""Where the Python API's small calls spend their host time: `rerank` (1 query x 1,000 candidates) and
`search` (1 query, k=10) on a resident corpus.

    python benchmarks/probe_api_calls.py --workdir /var/tmp/mb-api --size 2GB --out /tmp/probe-api.txt

profiles each call with cProfile after a warm-up (the corpus of `common.build_corpus`: fp16, d = 128,
documents of 20-300 tokens). With ``--split`` each call is timed instead, and its time is split into

  kernel  the kernels' calls (`maxsim_kernels.maxsim_candidates` / `maxsim_varlen`, or the resident
          launcher `ResidentCandidates` on CUDA, with their device copies; on CUDA the device is waited
          for inside them, so that its work is counted here and not in what follows);
  merge   a search's top-k merge of the score block (`RunningTopK.add`: the order keys and `torch.topk`
          over every document, device work that on CUDA is two launches);
  host    the rest: everything the API does around them.

``--stub-kernels`` replaces the kernels and the merge by stand-ins (`stub_kernels`), leaving the host's
work as a GPU leaves it (on the CPU the kernels' and the merge's pass over 200K documents sweeps the
caches the host's steps then miss).

On a machine without a GPU, ``--device cpu --dim 8 --docs 200000`` makes a corpus of as many documents as
the H100 figures' (documents of 2-8 tokens of dim 8, ids ``d000000000``...), so that the CPU kernel
costs little beside the host's work. ``--baseline DIR`` times another version of the code side by side:
DIR holds its ``maxsim_cli`` and ``maxsim_kernels`` packages (e.g. ``git archive`` of a commit, with
``kernels`` linked as ``maxsim_kernels``); the two run as alternating processes (``--rounds``, the order
swapped each round) and the figures are the medians of every call of every round:

    python benchmarks/probe_api_calls.py --split --device cpu --dim 8 --docs 200000 --search-calls 60 \
        --workdir /tmp/mb-api-cpu --baseline /tmp/base --rounds 6 \
        --json benchmarks/results/api/host-cost-cpu.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from common import build_corpus, meta, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = ("kernel", "merge")


def build_small_corpus(root: str, docs: int, dim: int, shards: int = 8, seed: int = 0) -> list[str]:
    """``docs`` documents of 2-8 tokens of dim ``dim`` (float32, L2-normalised random vectors, ids
    d000000000...) in ``shards`` shards under ``root`` (reused when already there)."""
    from maxsim_cli.shards import write_shard

    os.makedirs(root, exist_ok=True)
    done, made = os.path.join(root, ".complete"), f"{docs} {dim} {shards} {seed} float32"
    if not os.path.exists(done) or open(done).read() != made:
        gen = torch.Generator().manual_seed(seed)
        cuts = np.linspace(0, docs, shards + 1).astype(np.int64)
        for s in range(shards):
            n = int(cuts[s + 1] - cuts[s])
            lengths = torch.randint(2, 9, (n,), generator=gen)
            emb = torch.nn.functional.normalize(torch.randn(int(lengths.sum()), dim, generator=gen), dim=1)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
            ids = [f"d{int(cuts[s]) + i:09d}" for i in range(n)]
            path = os.path.join(root, f"shard{s:04d}.safetensors")
            write_shard(path, ids, emb, offsets=offsets, dtype="float32", normalized=True)
        with open(done, "w") as f:
            f.write(made)
    return sorted(os.path.join(root, n) for n in os.listdir(root) if n.endswith(".safetensors"))


class Meter:
    """Time spent inside the wrapped callables, by kind (`KINDS`), since the last `take`."""

    def __init__(self, dev: torch.device) -> None:
        self.spent = dict.fromkeys(KINDS, 0.0)
        self.sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def wrap(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.sync()
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
                self.sync()
                return out
            finally:
                self.spent[kind] += time.perf_counter() - t0

        return timed

    def take(self) -> dict[str, float]:
        spent, self.spent = self.spent, dict.fromkeys(KINDS, 0.0)
        return spent


def instrument(meter: Meter) -> None:
    """The kernels' entry points and the search's top-k merge, wrapped by ``meter``."""
    import maxsim_kernels
    from maxsim_kernels import maxsim_forward

    from maxsim_cli.scoring import topk

    for name in ("maxsim_candidates", "maxsim_varlen"):
        setattr(maxsim_kernels, name, meter.wrap("kernel", getattr(maxsim_kernels, name)))
    launcher = maxsim_forward.ResidentCandidates
    launcher.__call__ = meter.wrap("kernel", launcher.__call__)
    topk.RunningTopK.add = meter.wrap("merge", topk.RunningTopK.add)


def prepare(args: argparse.Namespace) -> tuple[dict[str, Callable[[int], Any]], torch.device]:
    """The resident corpus and the two calls, ``call(i)`` for the i-th call."""
    from maxsim_cli import Queries, open_corpus, rerank, search
    from maxsim_cli.units import parse_size

    dev = torch.device(args.device)
    if args.docs:
        paths = build_small_corpus(args.workdir, args.docs, args.dim)
    else:
        paths = build_corpus(args.workdir, parse_size(args.size), 1 << 30, dev)
    corpus = open_corpus(paths)
    corpus.to(str(dev))
    ids, n, dim = corpus.ids, len(corpus), corpus.dim
    gen = np.random.default_rng(0)
    lists = [[ids[i] for i in np.sort(gen.choice(n, min(n, 1000), replace=False))] for _ in range(16)]
    qgen = torch.Generator().manual_seed(1)
    unit = torch.nn.functional.normalize
    qs = [Queries.from_embeddings(["q"], [unit(torch.randn(32, dim, generator=qgen), dim=1)])
          for _ in range(16)]  # fmt: skip
    calls = {
        "rerank": lambda i: rerank(qs[i % 16], corpus, {"q": lists[i % 16]}, k=1000),
        "search": lambda i: search(qs[i % 16], corpus, k=10),
    }
    return calls, dev


def split_times(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Per call of each kind: total, kernel, merge and host milliseconds."""
    if args.stub_kernels:
        stub_kernels()
    calls, dev = prepare(args)
    meter = Meter(dev)
    instrument(meter)
    out: dict[str, dict[str, list[float]]] = {}
    for name, call in calls.items():
        for i in range(20):
            call(i)
        meter.take()
        rows: dict[str, list[float]] = {"total": [], "kernel": [], "merge": [], "host": []}
        # a search scores every document: fewer of them where the kernels run (``--search-calls``)
        few = name == "search" and args.search_calls and not args.stub_kernels
        count = args.search_calls if few else args.calls
        for i in range(count):
            t0 = time.perf_counter()
            call(i)
            total = time.perf_counter() - t0
            spent = meter.take()
            rows["total"].append(total * 1e3)
            for kind in KINDS:
                rows[kind].append(spent[kind] * 1e3)
            rows["host"].append((total - sum(spent.values())) * 1e3)
        out[name] = rows
    return out


def stub_kernels() -> None:
    """The kernels and the search's merge replaced by stand-ins (``--stub-kernels``): what is left is the
    host's work as a GPU leaves it to the host, with the caches not swept by the CPU's scoring of every
    document. A rerank's scores are random; a search's score block is made once per shape and kept, and
    its merge keeps the order keys of its first ``k`` documents (`RunningTopK.add` on those alone)."""
    import maxsim_kernels

    from maxsim_cli.scoring import topk

    gen = torch.Generator().manual_seed(7)
    blocks: dict[tuple[int, int], torch.Tensor] = {}

    def candidates(queries, query_offsets, docs, doc_offsets, candidate_offsets, candidate_docs, **_):  # noqa: ANN001, ANN202
        return torch.rand(len(candidate_docs), generator=gen)

    def varlen(queries, query_offsets, docs, doc_offsets, **_):  # noqa: ANN001, ANN202
        shape = (len(query_offsets) - 1, len(doc_offsets) - 1)
        if shape not in blocks:
            blocks[shape] = torch.rand(shape, generator=gen)
        return blocks[shape]

    merge = topk.RunningTopK.add

    def first_k(self, scores, ranks, hidden=None):  # noqa: ANN001, ANN202
        k = min(self.k, scores.shape[1])
        return merge(self, scores[:, :k].clone(), ranks[:k], None if hidden is None else hidden[:k])

    maxsim_kernels.maxsim_candidates, maxsim_kernels.maxsim_varlen = candidates, varlen
    topk.RunningTopK.add = first_k


def compare(args: argparse.Namespace) -> None:
    """This checkout and ``--baseline`` in alternating worker processes, with the kernels and with them
    stubbed (``--modes``); medians side by side."""
    versions = {"before": os.path.abspath(args.baseline), "after": None}
    pooled: dict[str, dict[str, dict[str, dict[str, list[float]]]]] = {}
    rounds: list[dict[str, Any]] = []
    worker = [sys.executable, os.path.abspath(__file__), "--worker", "--split", "--calls", str(args.calls),
              "--search-calls", str(args.search_calls), "--device", args.device, "--workdir", args.workdir,
              "--size", args.size, "--docs", str(args.docs), "--dim", str(args.dim)]  # fmt: skip
    for r in range(args.rounds):
        row: dict[str, Any] = {}
        for mode in args.modes:
            for version in list(versions) if r % 2 == 0 else list(versions)[::-1]:
                env = dict(os.environ)
                path = versions[version]
                if path is not None:  # the baseline's packages first on the path
                    env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, env.get("PYTHONPATH")]))
                command = worker + (["--stub-kernels"] if mode == "stubs" else [])
                load = os.getloadavg()[0]
                done = subprocess.run(command, env=env, cwd="/", capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    sys.exit(f"probe_api_calls: the {version} worker failed:\n{done.stderr[-3000:]}")
                times = json.loads(done.stdout.strip().splitlines()[-1])
                for name, rows in times["calls"].items():
                    for key, values in rows.items():
                        pooled.setdefault(mode, {}).setdefault(version, {}).setdefault(name, {}).setdefault(
                            key, []).extend(values)  # fmt: skip
                medians = {name: {key: statistics.median(v) for key, v in rows.items()}
                           for name, rows in times["calls"].items()}  # fmt: skip
                row.setdefault(mode, {})[version] = {"load_average": load, **medians}
                print(f"round {r} {mode} {version} (load {load:.1f}): " + "; ".join(
                    f"{name} host {medians[name]['host']:.3f} ms" for name in medians
                ), file=sys.stderr, flush=True)  # fmt: skip
        rounds.append(row)
    summary = {
        mode: {
            version: {
                name: {key: {"p50": statistics.median(v), "p25": float(np.percentile(v, 25)),
                             "p75": float(np.percentile(v, 75))} for key, v in rows.items()}
                for name, rows in calls.items()
            }
            for version, calls in by_version.items()
        }
        for mode, by_version in pooled.items()
    }  # fmt: skip
    record = {
        "meta": meta(device_kind=args.device, docs=args.docs, dim=args.dim),
        "what": "ms a call over every call of every round (p50, p25, p75); host = total - kernel - merge; "
        "modes: kernels (the CPU kernels), stubs (kernels and merge replaced by stand-ins: stub_kernels)",
        "versions": {"before": args.baseline_label or versions["before"], "after": args.label or "checkout"},
        "calls_per_round": {"rerank": args.calls, "search (kernels)": args.search_calls or args.calls,
                            "search (stubs)": args.calls},
        "rounds": args.rounds,
        "summary": summary,
        "per_round_median_ms": rounds,
    }
    write_json(args.json, record)
    for mode, by_version in summary.items():
        for name in ("rerank", "search"):
            b, a = by_version["before"][name], by_version["after"][name]
            print(f"{mode} {name}: host p50 {b['host']['p50']:.3f} -> {a['host']['p50']:.3f} ms; total "
                  f"{b['total']['p50']:.3f} -> {a['total']['p50']:.3f} ms (kernel {a['kernel']['p50']:.3f}, "
                  f"merge {a['merge']['p50']:.3f})")  # fmt: skip


def profile(args: argparse.Namespace) -> None:
    if args.stub_kernels:
        stub_kernels()
    calls, _ = prepare(args)
    report = io.StringIO()
    for name, call in calls.items():
        for i in range(20):
            call(i)
        t0 = time.perf_counter()
        for i in range(args.calls):
            call(i)
        per_call = (time.perf_counter() - t0) / args.calls * 1e3
        prof = cProfile.Profile()
        prof.enable()
        for i in range(args.calls):
            call(i)
        prof.disable()
        print(f"== {name}: {per_call:.3f} ms a call (unprofiled)", file=report)
        for key in ("tottime", "cumulative"):
            pstats.Stats(prof, stream=report).sort_stats(key).print_stats(40)
    print(report.getvalue())
    if args.out:
        with open(args.out, "w") as f:
            f.write(report.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/mb-api")
    parser.add_argument("--size", default="2GB", help="the corpus of common.build_corpus (without --docs)")
    parser.add_argument("--docs", type=int, default=0, help="a corpus of this many short documents instead")
    parser.add_argument("--dim", type=int, default=8, help="their dimension (with --docs)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--search-calls", type=int, default=0, help="searches with the kernels (0: --calls)")
    parser.add_argument("--out", help="the cProfile report")
    parser.add_argument("--split", action="store_true", help="time kernel, merge and host per call")
    parser.add_argument("--stub-kernels", action="store_true", help="random scores, no kernel")
    parser.add_argument("--baseline", help="with --split: a folder of another version's packages to compare")
    parser.add_argument("--baseline-label", help="what the baseline is, for the result file (a commit)")
    parser.add_argument("--label", help="what this checkout is, for the result file")
    parser.add_argument("--modes", nargs="+", choices=("kernels", "stubs"), default=["kernels", "stubs"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", help="with --split: the result file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.split:
        profile(args)
    elif args.baseline:
        compare(args)
    else:
        times = split_times(args)
        import maxsim_cli

        code = os.path.dirname(os.path.dirname(os.path.abspath(maxsim_cli.__file__)))
        record = {"code": code, "calls": times}
        if args.worker:
            print(json.dumps(record))
            return
        write_json(args.json, {"meta": meta(device_kind=args.device), **record})
        for name, rows in times.items():
            print(f"{name}: " + ", ".join(f"{k} {statistics.median(v):.3f} ms" for k, v in rows.items()))


if __name__ == "__main__":
    main()
