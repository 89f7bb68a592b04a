"""Rerank cost against corpus size: the Python API's `rerank`, `maxsim serve`'s scoring step and a
one-shot `maxsim score --candidates`, on the CPU, 50K to 5M documents, 10 / 100 / 1,000 candidates,
this source tree against another (``--old-tree``, or ``--old-commit`` of this repository), call for call.

    python benchmarks/bench_rerank_corpus_size.py --old-tree /work/main \\
        --out benchmarks/results/rerank-corpus-size/rerank-corpus-size-cpu.json

The corpora are made with the library's writers (`write_shard`) in a temporary folder: documents of
one token (dim 8, float16, so that 5M fit in memory on a small machine) in shards of 500K, ids the
numbers 0..N-1 in a shuffled order; one query of 32 tokens; its candidates drawn from the corpus
(seeded, the same for both trees).

Two worker processes, one importing ``maxsim_cli`` from each tree (``PYTHONPATH``; the kernels are this
tree's in both), open every corpus and make it resident on the CPU. The driver then asks them in turn,
a batch of ``--reps`` calls each, round after round (which tree goes first alternates), for:

- ``api``: ``maxsim_cli.rerank(queries, corpus, {qid: candidates}, device="cpu")`` on the resident
  corpus: the call a library user makes;
- ``serve``: `maxsim_cli.service.batching.Scorer.score` of one rerank job: `maxsim serve`'s scoring step
  (after `maxsim_cli.service.app.index_ids`, which the server runs at start-up);
- ``cli``: `maxsim_cli.scoring.entry.score` of the query file against the corpus folder with a run file of
  1,000 candidates, the corpus opened by the call (what ``maxsim score --candidates`` runs), once a round.

Each worker also reports its set-up: opening the corpora, making them resident, the first API call
(which builds the id lookup where there is one), `index_ids` (the dict of every id, on the old tree)
and what each added to the process's resident memory. The answers are compared across the trees: the
API's run written as TREC (sha256 of the bytes), the served hits (docnos and float32 score bits) and
the one-shot run file must be equal byte for byte.

Each call is timed on the wall clock and by the calling thread's CPU time. The summary gives, for each
path, corpus size and request size, the median and the 10th percentile of the wall times and the median
of the CPU times (on a machine shared with other work a call's wall time also counts its waits for a
core), and the ratio of each between the largest corpus and the smallest.

``--smoke`` runs small sizes (20K / 60K) and few calls: a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

DOCS_PER_SHARD = 500_000
DIM = 8
QUERY_TOKENS = 32
QID = "q0"


def log(message: str) -> None:
    print(f"[rerank-size] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# the inputs, written with this tree's library


def build_inputs(workdir: str, sizes: list[int], requests: list[int], seed: int) -> dict[str, Any]:
    import numpy as np
    import torch

    from maxsim_cli.shards import write_shard

    config: dict[str, Any] = {"corpora": {}, "candidates": {}, "runs": {}}
    for size in sizes:
        folder = os.path.join(workdir, f"corpus-{size}")
        config["corpora"][str(size)] = folder
        if not os.path.exists(os.path.join(folder, ".complete")):
            rng = np.random.default_rng([seed, size])  # the same corpus whatever was made before
            started = time.perf_counter()
            os.makedirs(folder, exist_ok=True)
            ids = rng.permutation(size)
            for s, a in enumerate(range(0, size, DOCS_PER_SHARD)):
                b = min(a + DOCS_PER_SHARD, size)
                emb = torch.from_numpy(rng.standard_normal((b - a, DIM)).astype(np.float16))
                write_shard(
                    os.path.join(folder, f"shard-{s:03d}.safetensors"),
                    [str(i) for i in ids[a:b].tolist()],
                    emb,
                    offsets=torch.arange(b - a + 1),
                    dtype="float16",
                )
            open(os.path.join(folder, ".complete"), "w").close()
            log(f"corpus of {size:,} documents written in {time.perf_counter() - started:.1f} s")
        for count in requests:
            picks = np.random.default_rng([seed, size, count]).choice(size, min(count, size), replace=False)
            docnos = [str(i) for i in picks.tolist()]
            config["candidates"][f"{size}/{count}"] = docnos
            run_path = os.path.join(workdir, f"candidates-{size}-{count}.trec")
            with open(run_path, "w", encoding="utf-8") as fh:
                fh.writelines(f"{QID} Q0 {d} {r + 1} {-r} first\n" for r, d in enumerate(docnos))
            config["runs"][f"{size}/{count}"] = run_path
    query_path = os.path.join(workdir, "query.safetensors")
    query = torch.from_numpy(
        np.random.default_rng(seed).standard_normal((QUERY_TOKENS, DIM)).astype(np.float16)
    )
    write_shard(query_path, [QID], query, offsets=torch.tensor([0, QUERY_TOKENS]), dtype="float16")
    config["queries"] = query_path
    with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh)
    return config


# --------------------------------------------------------------------------------------------------
# a worker: one tree's maxsim_cli, every corpus resident, commands from stdin, answers on stdout


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Worker:
    def __init__(self, workdir: str) -> None:
        import warnings

        import maxsim_cli
        from maxsim_cli import open_corpus, read_queries

        warnings.simplefilter("ignore")
        with open(os.path.join(workdir, "config.json"), encoding="utf-8") as fh:
            self.config = json.load(fh)
        self.workdir = workdir
        self.queries = read_queries(self.config["queries"])
        self.corpora: dict[str, Any] = {}
        self.scorers: dict[str, Any] = {}
        self.setup: dict[str, Any] = {"maxsim_cli": os.path.dirname(maxsim_cli.__file__)}
        for size, folder in self.config["corpora"].items():
            before = rss_bytes()
            t0 = time.perf_counter()
            corpus = open_corpus(folder)
            t1 = time.perf_counter()
            corpus.to("cpu")
            t2 = time.perf_counter()
            self.corpora[size] = corpus
            self.setup[size] = {
                "open_s": t1 - t0,
                "resident_s": t2 - t1,
                "rss_mb": (rss_bytes() - before) / 2**20,
            }

    def first_calls(self) -> dict[str, Any]:
        """The first API rerank of each corpus (1,000 candidates; it builds the id lookup where there is
        one), then the server's start-up index (`index_ids`), each timed with the memory it added."""
        from maxsim_cli import rerank
        from maxsim_cli.service.app import index_ids
        from maxsim_cli.service.batching import Scorer

        for size, corpus in self.corpora.items():
            docnos = self.config["candidates"][f"{size}/{max_request(self.config, size)}"]
            before = rss_bytes()
            t0 = time.perf_counter()
            rerank(self.queries, corpus, {QID: docnos}, device="cpu")
            t1 = time.perf_counter()
            mid = rss_bytes()
            index_ids(corpus)
            t2 = time.perf_counter()
            self.setup[size].update(
                first_api_call_s=t1 - t0,
                first_api_call_rss_mb=(mid - before) / 2**20,
                serve_index_s=t2 - t1,
                serve_index_rss_mb=(rss_bytes() - mid) / 2**20,
            )
            self.scorers[size] = Scorer(corpus, device="cpu")
        return self.setup

    def call(self, path: str, size: str, count: int) -> Any:
        from maxsim_cli import rerank
        from maxsim_cli.service.batching import Job
        from maxsim_cli.service.schema import Parsed

        docnos = self.config["candidates"][f"{size}/{count}"]
        if path == "api":
            return rerank(self.queries, self.corpora[size], {QID: docnos}, device="cpu")
        answers = self.scorers[size].score([Job("rerank", Parsed(self.queries, None, {QID: list(docnos)}))])[
            0
        ]
        if isinstance(answers, BaseException):
            raise answers
        return answers

    def time_calls(self, path: str, size: str, count: int, reps: int, budget_s: float) -> list[list[float]]:
        """[wall seconds, the calling thread's CPU seconds] of each call: on a loaded machine the wall time
        also counts the waits for a core, the thread's CPU time does not."""
        times: list[list[float]] = []
        started = time.perf_counter()
        while len(times) < reps and (len(times) < 2 or time.perf_counter() - started < budget_s):
            t0, c0 = time.perf_counter(), time.thread_time()
            self.call(path, size, count)
            times.append([time.perf_counter() - t0, time.thread_time() - c0])
        return times

    def digest(self, path: str, size: str, count: int) -> str:
        got = self.call(path, size, count)
        sha = hashlib.sha256()
        if path == "api":
            out = os.path.join(self.workdir, f"api-{os.getpid()}.trec")
            got.to_trec(out)
            with open(out, "rb") as fh:
                sha.update(fh.read())
            os.remove(out)
        else:
            for qid, hits, missing in got:
                sha.update(json.dumps([qid, list(hits.docnos), missing]).encode())
                sha.update(hits.scores.astype("float32").tobytes())
        return sha.hexdigest()

    def one_shot(self, size: str, count: int) -> dict[str, Any]:
        from maxsim_cli.scoring.entry import score

        out = os.path.join(self.workdir, f"cli-{os.getpid()}.trec")
        t0 = time.perf_counter()
        score(
            self.config["queries"],
            [self.config["corpora"][size]],
            output=out,
            candidates=self.config["runs"][f"{size}/{count}"],
            device="cpu",
            log=lambda _message: None,
        )
        seconds = time.perf_counter() - t0
        with open(out, "rb") as fh:
            sha = hashlib.sha256(fh.read()).hexdigest()
        os.remove(out)
        return {"s": seconds, "sha256": sha}


def max_request(config: dict[str, Any], size: str) -> int:
    return max(int(key.split("/")[1]) for key in config["candidates"] if key.split("/")[0] == size)


def worker_main(workdir: str) -> None:
    worker = Worker(workdir)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        kind = cmd["cmd"]
        if kind == "first_calls":
            answer: Any = worker.first_calls()
        elif kind == "time":
            answer = worker.time_calls(cmd["path"], cmd["size"], cmd["count"], cmd["reps"], cmd["budget_s"])
        elif kind == "digest":
            answer = worker.digest(cmd["path"], cmd["size"], cmd["count"])
        elif kind == "one_shot":
            answer = worker.one_shot(cmd["size"], cmd["count"])
        elif kind == "exit":
            return
        else:
            raise ValueError(f"unknown command {kind!r}")
        print(json.dumps(answer), flush=True)


# --------------------------------------------------------------------------------------------------
# the driver


class Client:
    def __init__(self, name: str, tree: str, workdir: str) -> None:
        env = dict(os.environ, PYTHONPATH=tree)
        self.name, self.tree = name, tree
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", workdir],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.read()  # ready: every corpus open and resident

    def read(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker ({self.tree}) stopped; see its error above")
        return json.loads(line)

    def ask(self, **cmd: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.ask_exit()
        self.proc.wait(timeout=60)

    def ask_exit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
        self.proc.stdin.close()


def tree_commit(tree: str) -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", tree, *args], capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "maxsim_cli")
    return {
        "path": os.path.abspath(tree),
        "commit": git("rev-parse", "HEAD"),
        "maxsim_cli_modified": bool(dirty),
    }


def median(values: list[float]) -> float:
    return quantile(values, 0.5)


def quantile(values: list[float], share: float) -> float:
    """The ``share`` quantile of ``values``, interpolated between the nearest two."""
    ordered = sorted(values)
    at = share * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="WORKDIR", help=argparse.SUPPRESS)
    parser.add_argument("--old-tree", default="/work/main", help="the tree to compare with (its maxsim_cli)")
    parser.add_argument(
        "--old-commit",
        help="compare with this commit of the new tree's repository instead (its maxsim_cli, checked out "
        "into the work folder with git archive): a fixed old tree while others commit to --old-tree",
    )
    parser.add_argument(
        "--new-tree",
        default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        help="this tree by default",
    )
    parser.add_argument("--sizes", default="50000,500000,1000000,2000000,5000000")
    parser.add_argument("--requests", default="10,100,1000", help="candidates of a request")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5, help="calls a batch (one tree, one size, one request)")
    parser.add_argument("--budget-s", type=float, default=4.0, help="a batch stops after 2 calls past this")
    parser.add_argument("--workdir", help="where the corpora go (default: a temporary folder, removed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="small sizes, few calls: a check of the script")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker)
        return
    if args.smoke:
        args.sizes, args.requests, args.rounds, args.reps = "20000,60000", "10,1000", 2, 2
    sizes = [int(s) for s in args.sizes.split(",")]
    requests = [int(c) for c in args.requests.split(",")]
    workdir = args.workdir or tempfile.mkdtemp(prefix="maxsim-rerank-size-")
    own_workdir = args.workdir is None
    trees = {"old": args.old_tree, "new": args.new_tree}
    try:
        if args.old_commit:
            trees["old"] = os.path.join(workdir, f"old-{args.old_commit}")
            os.makedirs(trees["old"], exist_ok=True)
            archive = subprocess.run(
                ["git", "-C", args.new_tree, "archive", args.old_commit, "maxsim_cli"],
                capture_output=True,
                check=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", trees["old"]], input=archive, check=True)
        commits = {name: tree_commit(tree) for name, tree in trees.items()}
        if args.old_commit:
            commit = subprocess.run(
                ["git", "-C", args.new_tree, "rev-parse", args.old_commit], capture_output=True, text=True
            )
            commits["old"].update(commit=commit.stdout.strip(), maxsim_cli_modified=False)
        build_inputs(workdir, sizes, requests, args.seed)
        clients = {}
        for name, tree in trees.items():
            started = time.perf_counter()
            clients[name] = Client(name, tree, workdir)
            log(f"{name} worker ({tree}) ready in {time.perf_counter() - started:.1f} s")
        try:
            result = measure(clients, sizes, requests, args)
        finally:
            for client in clients.values():
                client.close()
    finally:
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    import numpy
    import pyarrow
    import torch

    result["meta"] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python", os.path.relpath(os.path.abspath(__file__)), *sys.argv[1:]]),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "pyarrow": pyarrow.__version__,
        "trees": commits,
        "corpus": f"documents of 1 token, dim {DIM}, float16, shards of {DOCS_PER_SHARD:,}; ids shuffled",
        "query": f"1 query of {QUERY_TOKENS} tokens",
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
            fh.write("\n")
    print(json.dumps(result["summary"], indent=1))


def measure(
    clients: dict[str, Client], sizes: list[int], requests: list[int], args: argparse.Namespace
) -> dict:
    names = list(clients)
    setup = {name: client.ask(cmd="first_calls") for name, client in clients.items()}
    log("first calls done")
    times: dict[str, dict[str, list[list[float]]]] = {name: {} for name in names}
    one_shot: dict[str, dict[str, list[dict]]] = {name: {} for name in names}
    loads = []
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        loads.append(os.getloadavg()[0])
        for size in sizes:
            for count in requests:
                for path in ("api", "serve"):
                    for name in order:
                        got = clients[name].ask(
                            cmd="time",
                            path=path,
                            size=str(size),
                            count=count,
                            reps=args.reps,
                            budget_s=args.budget_s,
                        )
                        times[name].setdefault(f"{path}/{size}/{count}", []).extend(got)
            for name in order:
                got = clients[name].ask(cmd="one_shot", size=str(size), count=max(requests))
                one_shot[name].setdefault(str(size), []).append(got)
        log(f"round {r + 1} of {args.rounds} done (load average {os.getloadavg()[0]:.2f})")
    same: dict[str, bool] = {}
    for size in sizes:
        for count in requests:
            for path in ("api", "serve"):
                digests = {
                    clients[n].ask(cmd="digest", path=path, size=str(size), count=count) for n in names
                }
                same[f"{path}/{size}/{count}"] = len(digests) == 1
        same[f"cli/{size}/{max(requests)}"] = (
            len({o["sha256"] for n in names for o in one_shot[n][str(size)]}) == 1
        )
    summary: dict[str, Any] = {
        "equal_answers": all(same.values()),
        "wall_p50_ms": {},
        "wall_p10_ms": {},
        "cpu_p50_ms": {},
        "ratio_largest_to_smallest": {},
    }
    for key in times[names[0]]:
        for stat, column, share in (("wall_p50_ms", 0, 0.5), ("wall_p10_ms", 0, 0.1), ("cpu_p50_ms", 1, 0.5)):
            summary[stat][key] = {
                n: round(quantile([t[column] for t in times[n][key]], share) * 1e3, 3) for n in names
            }
    for size in sizes:
        summary["wall_p50_ms"][f"cli/{size}/{max(requests)}"] = {
            n: round(median([o["s"] for o in one_shot[n][str(size)]]) * 1e3, 1) for n in names
        }
    for stat in ("wall_p50_ms", "wall_p10_ms", "cpu_p50_ms"):
        for path in ("api", "serve"):
            for count in requests:
                small = summary[stat][f"{path}/{sizes[0]}/{count}"]
                large = summary[stat][f"{path}/{sizes[-1]}/{count}"]
                summary["ratio_largest_to_smallest"][f"{stat}/{path}/{count}"] = {
                    n: round(large[n] / small[n], 3) for n in names
                }
    summary["setup"] = {
        n: {size: {k: round(v, 3) for k, v in setup[n][str(size)].items()} for size in map(str, sizes)}
        for n in names
    }
    return {
        "summary": summary,
        "equal": same,
        "times_s": times,
        "one_shot": one_shot,
        "setup": setup,
        "load_average_at_round_start": loads,
        "config": {
            "sizes": sizes,
            "requests": requests,
            "rounds": args.rounds,
            "reps": args.reps,
            "budget_s": args.budget_s,
            "seed": args.seed,
        },
    }


if __name__ == "__main__":
    main()
