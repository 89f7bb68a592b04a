"""What a delete costs: `maxsim delete` of 1% of a corpus of many tiny documents (its whole command, in a
fresh process), and an exhaustive search before and after it, alternating; for one source tree or several
side by side (``--tree NAME=PATH``: that tree's `maxsim_cli` first on the path of each process).

    git archive BASE | tar -x -C /tmp/base-tree           # the baseline tree, beside this checkout
    python benchmarks/bench_generations.py --workdir /tmp/mb-gen --docs 10000000 --shards 16 \\
        --tree before=/tmp/base-tree --tree after=. --repeats 7 --search-repeats 11 \\
        --out benchmarks/results/generations/delete-cpu.json

A corpus of ``--docs`` documents of 1-4 tokens (dim ``--dim``, float16) in ``--shards`` shards, written
with this checkout's shard writer and `write_manifest` (a folder with `index.json`, generation 0), is
kept as it is; each delete runs on a fresh copy of it (hard links: the write commands never change a file
in place). ``--share`` of its ids, drawn at random, are deleted by `maxsim delete` in a subprocess of each
tree in turn (the order alternating each of ``--repeats`` rounds): its wall time and its CPU time (user +
system, what another process on the machine does not change as much). Then, per tree, a worker process
of that tree opens the corpus before the delete and the tree's corpus after it and times a search of
``--queries`` queries (k = ``--k``) on ``--device`` on each, alternating, ``--search-repeats`` times after
a warm-up each. Medians are reported, and the ratio of the fastest searches (the least disturbed by
other work on the machine). On a shared machine a whole search's time varies by several percent from
one call to the next, more than a delete changes it; so the one place where a deleted document costs
anything in the scan, each score block's merge into the running top-k, is also timed alone (CPU time of
its thread): its extra time after the delete is what the deleted documents cost a search.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from common import make_log, meta, write_json

log = make_log("generations")
HERE = os.path.dirname(os.path.abspath(__file__))


def build(folder: str, docs: int, shards: int, dim: int, seed: int) -> None:
    from maxsim_cli.shards import write_manifest
    from maxsim_cli.shards.writers import ShardWriter

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    per = -(-docs // shards)
    for s in range(shards):
        first, stop = s * per, min(docs, (s + 1) * per)
        lengths = rng.integers(1, 5, stop - first)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        rows = rng.standard_normal((int(offsets[-1]), dim), dtype=np.float32).astype(np.float16)
        with ShardWriter(os.path.join(folder, f"part{s:03d}.safetensors"), dim, "float16") as writer:
            writer.add([f"d{i}" for i in range(first, stop)], rows, offsets=offsets)
    write_manifest(folder)


def fresh_copy(base: str, target: str) -> None:
    """``base`` (a flat folder) as ``target``, its files hard-linked."""
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target)
    for name in os.listdir(base):
        os.link(os.path.join(base, name), os.path.join(target, name))


def tree_env(root: str, links: str) -> dict[str, str]:
    """An environment whose Python imports `maxsim_cli` (and `maxsim_kernels`) from the tree ``root``."""
    for name, sub in (("maxsim_cli", "maxsim_cli"), ("maxsim_kernels", "kernels")):
        os.symlink(os.path.join(os.path.abspath(root), sub), os.path.join(links, name))
    return dict(os.environ, PYTHONPATH=os.pathsep.join([links, os.environ.get("PYTHONPATH", "")]))


def timed_delete(env: dict[str, str], folder: str, ids_file: str) -> tuple[float, float, str]:
    """`maxsim delete` in a fresh process: (wall s, CPU s of the process, its stderr)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "maxsim_cli", "delete", folder, "--ids", ids_file],
        capture_output=True, text=True, env=env, cwd=tempfile.gettempdir(),
    )  # fmt: skip
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"maxsim delete failed: {done.stderr.strip()}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stderr.strip()


def search_worker(args: argparse.Namespace) -> None:
    """In a tree's process: searches on the corpus before the delete and after it, alternating."""
    import torch

    import maxsim_cli
    from maxsim_cli import Queries, open_corpus, search

    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(2)
    queries = Queries.from_embeddings(
        [f"q{i}" for i in range(args.queries)],
        [rng.standard_normal((8, args.dim)).astype(np.float32) for _ in range(args.queries)],
    )
    old, new = open_corpus(args.before), open_corpus(args.after)
    assert new.num_deleted > 0 and old.num_deleted == 0
    # where a deleted document costs anything in the scan: each score block's merge into the top-k
    # (its order keys leave the deleted out), timed as CPU time of the thread that runs it, which other
    # work on the machine disturbs far less than a whole search's wall time
    from maxsim_cli.scoring.topk import RunningTopK

    merge = RunningTopK.add
    merged = [0.0]

    def timed_merge(self, *a, **kw):  # noqa: ANN001, ANN202
        t = time.thread_time()
        try:
            return merge(self, *a, **kw)
        finally:
            merged[0] += time.thread_time() - t

    RunningTopK.add = timed_merge

    def one(corpus) -> tuple[float, float, float]:
        t, c, merged[0] = time.perf_counter(), time.process_time(), 0.0
        search(queries, corpus, k=args.k, device=args.device)
        return time.perf_counter() - t, time.process_time() - c, merged[0]

    one(old), one(new)  # warm-up: each corpus's id order, the kernels
    before, after = [], []
    for r in range(args.search_repeats):
        pair = [(old, before), (new, after)] if r % 2 == 0 else [(new, after), (old, before)]
        for corpus, times in pair:
            times.append(one(corpus))
    out = {
        "maxsim_cli": os.path.dirname(maxsim_cli.__file__),
        "torch_threads": torch.get_num_threads(),
        "search_before_s": [w for w, _, _ in before],
        "search_after_s": [w for w, _, _ in after],
        "search_before_cpu_s": [c for _, c, _ in before],
        "search_after_cpu_s": [c for _, c, _ in after],
        "topk_merge_before_cpu_s": [m for _, _, m in before],
        "topk_merge_after_cpu_s": [m for _, _, m in after],
    }
    print("RESULT " + json.dumps(out), flush=True)


def median(values: list[float]) -> float:
    return float(np.median(values))


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--workdir", help="where the corpus and its copies go (required)")
    parser.add_argument("--docs", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--share", type=float, default=0.01)
    parser.add_argument("--queries", type=int, default=4)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--device", default="cpu", help="where the searches run (cpu, cuda)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads of the searches (0: torch's)")
    parser.add_argument("--repeats", type=int, default=5, help="deletes per tree")
    parser.add_argument("--search-repeats", type=int, default=5, help="searches per corpus and tree")
    parser.add_argument(
        "--tree", action="append", default=[], metavar="NAME=PATH",
        help="a source tree to time (repeat for several); default: this checkout",
    )  # fmt: skip
    parser.add_argument("--out")
    parser.add_argument("--search-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--before", help=argparse.SUPPRESS)
    parser.add_argument("--after", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.search_worker:
        return search_worker(args)
    if not args.workdir:
        parser.error("--workdir is required")

    trees = dict(t.split("=", 1) for t in args.tree) or {"this": os.path.dirname(HERE)}
    base = os.path.join(args.workdir, "corpus")
    if not os.path.exists(os.path.join(base, "index.json")):
        t0 = time.perf_counter()
        build(base, args.docs, args.shards, args.dim, seed=1)
        log(f"built {args.docs:,} documents in {time.perf_counter() - t0:.1f} s")
    elif not any(n.endswith(".idindex") for n in os.listdir(base)):
        from maxsim_cli.shards import write_manifest

        write_manifest(base)  # a corpus written before id indexes: as this checkout writes it
        log("wrote the id indexes of the corpus")
    from maxsim_cli import open_corpus

    with open_corpus(base) as corpus:
        num_docs, num_tokens = len(corpus), corpus.num_tokens
    rng = np.random.default_rng(2)
    gone = rng.choice(num_docs, size=int(num_docs * args.share), replace=False)
    ids_file = os.path.join(args.workdir, "gone.txt")
    with open(ids_file, "w") as f:
        f.write("\n".join(f"d{i}" for i in sorted(gone.tolist())) + "\n")

    results: dict[str, dict] = {name: {"path": os.path.abspath(path)} for name, path in trees.items()}
    with tempfile.TemporaryDirectory() as scratch:
        envs = {}
        for name, path in trees.items():
            os.makedirs(os.path.join(scratch, name))
            envs[name] = tree_env(path, os.path.join(scratch, name))
        names = list(trees)
        for r in range(args.repeats):
            for name in names if r % 2 == 0 else names[::-1]:
                folder = os.path.join(args.workdir, f"after-{name}")
                fresh_copy(base, folder)
                wall, cpu, said = timed_delete(envs[name], folder, ids_file)
                got = results[name]
                got.setdefault("delete_command_s", []).append(wall)
                got.setdefault("delete_cpu_s", []).append(cpu)
                got["delete_output"] = said
                log(f"{name}: delete of {len(gone):,} ids: {wall:.2f} s ({cpu:.2f} s CPU)")
        for name in names:
            command = [sys.executable, os.path.abspath(__file__), "--search-worker", "--before", base,
                       "--after", os.path.join(args.workdir, f"after-{name}"), "--dim", str(args.dim),
                       "--queries", str(args.queries), "--k", str(args.k), "--device", args.device,
                       "--search-repeats", str(args.search_repeats),
                       "--threads", str(args.threads)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, env=envs[name])
            if done.returncode != 0:
                raise SystemExit(f"{name}: the search worker failed: {done.stderr.strip()[-2000:]}")
            line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
            got = results[name]
            got.update(json.loads(line[len("RESULT ") :]))
            for key in ("delete_command_s", "delete_cpu_s", "search_before_s", "search_after_s",
                        "search_before_cpu_s", "search_after_cpu_s", "topk_merge_before_cpu_s",
                        "topk_merge_after_cpu_s"):  # fmt: skip
                got[key + "_median"] = median(got[key])
            got["ratio"] = got["search_after_s_median"] / got["search_before_s_median"]
            got["ratio_cpu"] = got["search_after_cpu_s_median"] / got["search_before_cpu_s_median"]
            # the fastest of each: the search least disturbed by the machine's other work
            got["ratio_min"] = min(got["search_after_s"]) / min(got["search_before_s"])
            # what the deleted documents add to a search: the merges' extra CPU time, as a share of it
            extra = got["topk_merge_after_cpu_s_median"] - got["topk_merge_before_cpu_s_median"]
            got["deleted_cost_s"] = extra
            got["deleted_cost_share"] = extra / got["search_before_s_median"]
            log(
                f"{name}: delete {got['delete_command_s_median']:.2f} s ({got['delete_cpu_s_median']:.2f} s "
                f"CPU); search before {got['search_before_s_median']:.3f} s, after "
                f"{got['search_after_s_median']:.3f} s: {got['ratio']:.3f}x ({got['ratio_cpu']:.3f}x CPU, "
                f"{got['ratio_min']:.3f}x fastest to fastest); the deleted documents' merges: "
                f"{extra * 1e3:+.1f} ms a search ({100 * got['deleted_cost_share']:+.2f}%)"
            )
    result = {
        "meta": meta(),
        "command": " ".join(["python", *sys.argv]),
        "docs": num_docs,
        "tokens": num_tokens,
        "dim": args.dim,
        "shards": args.shards,
        "deleted": len(gone),
        "device": args.device,
        "load_average": os.getloadavg(),
        "trees": results,
    }
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
