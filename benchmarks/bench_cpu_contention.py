"""The CPU backend on a quiet machine and beside busy processes, against padded torch and maxsim-cpu.

Workloads (fp32, dim 128, unit vectors, queries of 32 tokens, documents of 20-300 tokens, uniform):
50 queries x 1000 documents (a search: the blocked path) and 1 query x 4000 documents (the stream).
Methods: this backend (`maxsim_varlen(..., backend="torch")`); a padded torch version as a user would
write it (pad the queries and the documents, one einsum, a masked amax with -inf, a sum); maxsim-cpu
0.1.0 (Rust + libxsmm, one query per call) when installed (`pip install maxsim-cpu==0.1.0`).

Conditions, alternating in every round (the order flips from round to round): *idle*, nothing added to
what else runs on the machine, and *loaded*, with ``--busy`` processes started by this script (default:
one per CPU this process may use), each a Python busy loop, stopped when the condition ends. Within a
condition the methods run in an order that rotates from round to round; each method is called until
``--min-block-s`` has passed (at least once, at most ``--max-calls`` times). The machine's load (the
1-minute load average and the runnable tasks of /proc/loadavg) is recorded at the start and the end of
every condition, and each call's CPU time beside its wall time (CPU / wall: the cores the call got).
Rounds stop after ``--rounds`` or once ``--max-seconds`` have passed (at least two rounds).
The report: per workload, condition and method, the median and range of the calls, and per round the
ratio of this backend's median to the padded version's in the same condition of the same round.

    python benchmarks/bench_cpu_contention.py --out benchmarks/results/cpu/contention-2core.json
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from common import make_log, meta, write_json

DIM = 128
QUERY_TOKENS = 32
WORKLOADS = {"50 x 1000": (50, 1000), "1 x 4000": (1, 4000)}
# a busy loop that ends when its parent does (checked every ~1M iterations), so none outlives a killed run
BUSY_LOOP = """
import os
parent = os.getppid()
while os.getppid() == parent:
    for _ in range(1 << 20):
        pass
"""
IN_ORDER = "maxsim, groups in order (before)"

log = make_log("bench_cpu_contention", clock=True)


def padded_torch(q: torch.Tensor, q_off: torch.Tensor, d: torch.Tensor, d_off: torch.Tensor) -> torch.Tensor:
    """MaxSim of every query against every document from padded tensors: scores [nq, nd]."""
    q_lens, d_lens = q_off.diff(), d_off.diff()
    queries = torch.nn.utils.rnn.pad_sequence(q.split(q_lens.tolist()), batch_first=True)  # [nq, Lq, dim]
    docs = torch.nn.utils.rnn.pad_sequence(d.split(d_lens.tolist()), batch_first=True)  # [nd, Ld, dim]
    sim = torch.einsum("qid,njd->qnij", queries, docs)  # [nq, nd, Lq, Ld]
    sim.masked_fill_(~(torch.arange(docs.shape[1]) < d_lens[:, None])[None, :, None, :], -torch.inf)
    query_mask = torch.arange(queries.shape[1]) < q_lens[:, None]
    return (sim.amax(-1) * query_mask[:, None, :]).sum(-1)


def make_inputs(nq: int, nd: int, rng: np.random.Generator) -> dict[str, Any]:
    lens = rng.integers(20, 301, nd)
    d_off = np.zeros(nd + 1, dtype=np.int64)
    np.cumsum(lens, out=d_off[1:])
    docs = rng.standard_normal((int(d_off[-1]), DIM), dtype=np.float32)
    docs /= np.linalg.norm(docs, axis=1, keepdims=True)
    queries = rng.standard_normal((nq * QUERY_TOKENS, DIM), dtype=np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    return {
        "q": torch.from_numpy(queries),
        "q_off": torch.arange(nq + 1, dtype=torch.int64) * QUERY_TOKENS,
        "d": torch.from_numpy(docs),
        "d_off": torch.from_numpy(d_off),
        "doc_list": [docs[d_off[i] : d_off[i + 1]] for i in range(nd)],
        "tokens": int(d_off[-1]),
    }


def in_order(fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn` with the backend's units of work run in order on the caller's thread, each op over torch's
    threads: how the blocked path ran its groups before they went to the worker threads."""
    from maxsim_kernels import cpu as cpu_backend

    def run() -> Any:
        saved = cpu_backend._run_units
        cpu_backend._run_units = lambda work, units, workers: [work(unit) for unit in units]
        try:
            return fn()
        finally:
            cpu_backend._run_units = saved

    return run


def make_methods(w: dict[str, Any], maxsim_cpu: Any, with_in_order: bool) -> dict[str, Callable[[], Any]]:
    from maxsim_kernels import maxsim_varlen

    q, q_off, d, d_off = w["q"], w["q_off"], w["d"], w["d_off"]
    queries = q.numpy()
    methods: dict[str, Callable[[], Any]] = {
        "maxsim (torch backend)": lambda: maxsim_varlen(q, q_off, d, d_off, backend="torch"),
        "padded torch": lambda: padded_torch(q, q_off, d, d_off),
    }
    if with_in_order and len(q_off) - 1 > 4:  # the blocked path (the stream already used the workers)
        methods[IN_ORDER] = in_order(methods["maxsim (torch backend)"])
    if maxsim_cpu is not None:
        methods["maxsim-cpu 0.1.0"] = lambda: np.stack(
            [
                maxsim_cpu.maxsim_scores_variable(queries[q_off[i] : q_off[i + 1]], w["doc_list"])
                for i in range(len(q_off) - 1)
            ]
        )
    return methods


def machine_load() -> dict[str, Any]:
    """The 1-minute load average and the runnable / all tasks now (/proc/loadavg)."""
    try:
        with open("/proc/loadavg", encoding="ascii") as fh:
            fields = fh.read().split()
        running, tasks = fields[3].split("/")
        return {"load_1m": float(fields[0]), "runnable": int(running), "tasks": int(tasks)}
    except (OSError, IndexError, ValueError):
        return {"load_1m": os.getloadavg()[0]}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def start_busy(n: int) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(n)]
    time.sleep(0.5)  # let them reach their cores
    return procs


def stop_busy(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=10)


def time_calls(fn: Callable[[], Any], min_s: float, max_calls: int) -> list[dict[str, float]]:
    calls: list[dict[str, float]] = []
    start = time.perf_counter()
    while not calls or (len(calls) < max_calls and time.perf_counter() - start < min_s):
        cpu0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
        calls.append({"wall_s": wall, "cpu_s": time.process_time() - cpu0})
    return calls


def main() -> None:
    from maxsim_kernels import cpu as cpu_backend
    from maxsim_kernels import maxsim_reference

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON results here")
    parser.add_argument(
        "--busy", type=int, help="busy processes in the loaded condition (default: usable CPUs)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both conditions (default 3)")
    parser.add_argument(
        "--max-seconds", type=float, default=300.0, help="start no round past this (default 300)"
    )
    parser.add_argument("--min-block-s", type=float, default=0.5, help="call a method for at least this long")
    parser.add_argument("--max-calls", type=int, default=7, help="calls of a method in one condition at most")
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated, of: " + ", ".join(WORKLOADS)
    )
    parser.add_argument(
        "--with-in-order",
        action="store_true",
        help=f"also '{IN_ORDER}' on the many-query workload: the previous path, for an A/B",
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(1))  # stop the busy processes on the way out
    names = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; choose from {list(WORKLOADS)}")

    cpus = cpu_backend._usable_cpus()
    busy = cpus if args.busy is None else args.busy
    try:
        import maxsim_cpu
    except ImportError:
        maxsim_cpu = None
        log("maxsim-cpu is not installed (pip install maxsim-cpu==0.1.0): measuring without it")
    rng = np.random.default_rng(0)
    workloads = {name: make_inputs(*WORKLOADS[name], rng) for name in names}
    methods = {name: make_methods(w, maxsim_cpu, args.with_in_order) for name, w in workloads.items()}
    errors: dict[str, dict[str, float]] = {}
    for name, w in workloads.items():  # also the warm-up
        ref = maxsim_reference(w["q"].double(), w["q_off"], w["d"].double(), w["d_off"]).numpy()
        errors[name] = {
            m: float(np.abs(np.asarray(fn(), dtype=np.float64) - ref).max())
            for m, fn in methods[name].items()
        }
        log(f"{name}: max abs error against float64 {errors[name]}")
    log(
        f"{cpus} usable CPUs (affinity {len(os.sched_getaffinity(0))}, cgroup limit "
        f"{cpu_backend._cgroup_cpu_limit()}), torch threads {torch.get_num_threads()}, workers "
        f"{cpu_backend._worker_count()}; loaded = {busy} busy processes; load now {machine_load()}"
    )

    calls: list[dict[str, Any]] = []
    blocks: list[dict[str, Any]] = []
    start = time.perf_counter()
    rounds = 0
    while rounds < args.rounds and (rounds < 2 or time.perf_counter() - start < args.max_seconds):
        conditions = ["idle", "loaded"] if rounds % 2 == 0 else ["loaded", "idle"]
        for condition in conditions:
            procs = start_busy(busy) if condition == "loaded" else []
            try:
                before = machine_load()
                for name in names:
                    order = list(methods[name])
                    order = order[rounds % len(order) :] + order[: rounds % len(order)]
                    for method in order:
                        for call in time_calls(methods[name][method], args.min_block_s, args.max_calls):
                            calls.append(
                                {
                                    "round": rounds,
                                    "condition": condition,
                                    "workload": name,
                                    "method": method,
                                    **call,
                                }
                            )
                after = machine_load()
            finally:
                stop_busy(procs)
            blocks.append(
                {"round": rounds, "condition": condition, "load_before": before, "load_after": after}
            )
            block = [c for c in calls if c["round"] == rounds and c["condition"] == condition]
            medians = {
                (w, m): statistics.median(
                    c["wall_s"] for c in block if (c["workload"], c["method"]) == (w, m)
                )
                for w in names
                for m in methods[w]
            }
            log(
                f"round {rounds} {condition:>6}: "
                + ", ".join(f"{w} {m} {t:.3f}s" for (w, m), t in medians.items())
                + f"; load {before['load_1m']:.1f} -> {after['load_1m']:.1f}"
            )
        rounds += 1

    def select(**match: Any) -> list[dict[str, Any]]:
        return [c for c in calls if all(c[key] == value for key, value in match.items())]

    summary = []
    for name in names:
        for condition in ("idle", "loaded"):
            per_method = {}
            for method in methods[name]:
                mine = select(workload=name, condition=condition, method=method)
                walls = [c["wall_s"] for c in mine]
                per_method[method] = {
                    "median_s": statistics.median(walls),
                    "min_s": min(walls),
                    "max_s": max(walls),
                    "round_medians_s": [
                        statistics.median(c["wall_s"] for c in mine if c["round"] == r) for r in range(rounds)
                    ],
                    "calls": len(walls),
                    "cores_used_median": statistics.median(c["cpu_s"] / c["wall_s"] for c in mine),
                }
            ours = per_method["maxsim (torch backend)"]["round_medians_s"]
            padded = per_method["padded torch"]["round_medians_s"]
            ratios = [a / b for a, b in zip(ours, padded, strict=True)]
            summary.append(
                {
                    "workload": name,
                    "condition": condition,
                    "methods": per_method,
                    "ours_over_padded_by_round": ratios,
                    "ours_over_padded_worst": max(ratios),
                    **(
                        {
                            "before_over_ours_by_round": [
                                a / b
                                for a, b in zip(per_method[IN_ORDER]["round_medians_s"], ours, strict=True)
                            ]
                        }
                        if IN_ORDER in per_method
                        else {}
                    ),
                }
            )
            log(
                f"{name:>9} {condition:>6}: "
                + ", ".join(
                    f"{m} {v['median_s']:.3f}s ({v['min_s']:.3f}-{v['max_s']:.3f})"
                    for m, v in per_method.items()
                )
                + f"; ours / padded by round {', '.join(f'{r:.2f}' for r in ratios)}"
            )
    loads = [b[key]["load_1m"] for b in blocks for key in ("load_before", "load_after")]
    result = {
        "meta": meta(
            cpu=cpu_model(),
            usable_cpus=cpus,
            affinity_cpus=len(os.sched_getaffinity(0)),
            cgroup_cpu_limit=cpu_backend._cgroup_cpu_limit(),
            torch_threads=torch.get_num_threads(),
            workers=cpu_backend._worker_count(),
            busy_processes=busy,
            maxsim_cpu="0.1.0" if maxsim_cpu is not None else "not installed",
            rounds=rounds,
            load_1m_range=[min(loads), max(loads)],
        ),
        "max_abs_err_vs_fp64": errors,
        "summary": summary,
        "blocks": blocks,
        "calls": calls,
    }
    write_json(args.out, result)


if __name__ == "__main__":
    main()
