"""Same-run A/B of the fused forward kernel against other versions of its module (H200).

Each `--variant NAME=FILE` is a copy of `kernels/maxsim_forward.py` (another commit's, say, from
`git show REF:kernels/maxsim_forward.py > FILE`); it is imported beside the installed module under a
private name, with its own tuning table, and timed on the same tensors as the installed one ("as_is"),
alternating round by round so that the machine's drift hits both alike. Scores are compared with the
installed module's (max |difference|). Workloads are those of bench_kernels.py.

    git show main:kernels/maxsim_forward.py > /tmp/main_forward.py
    python benchmarks/ab_forward.py --variant main=/tmp/main_forward.py --out ab.json
    TRITON_INTERPRET=1 python benchmarks/ab_forward.py --smoke --variant ...   # checks the script
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import shutil
from typing import Any

import maxsim_kernels
import maxsim_kernels.maxsim_forward as as_is
import torch
from common import SMOKE, WORKLOADS, device, make_log, make_workload, meta, time_ms, write_json

PACKAGE = pathlib.Path(maxsim_kernels.__file__).parent
log = make_log("ab_forward", clock=True)


def load_variant(name: str, path: str) -> Any:
    """The module at `path`, imported as maxsim_kernels._ab_<name> (its relative imports resolve)."""
    target = PACKAGE / f"_ab_{name}.py"
    shutil.copyfile(path, target)
    return importlib.import_module(f"maxsim_kernels._ab_{name}")


def launcher(module: Any, w: dict[str, Any]) -> Any:
    q, qo, d, do = w["queries"], w["q_off"], w["docs"], w["d_off"]
    if w["name"] == "rerank":
        co, cd = w["cand_offsets"], w["cand_docs"].to(device())
        return lambda: module.maxsim_candidates_forward_triton(q, qo, d, do, co, cd)
    return lambda: module.maxsim_varlen_forward_triton(q, qo, d, do)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", default=[], help="NAME=FILE (repeatable)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (Triton interpreter)")
    args = parser.parse_args()
    SMOKE["on"] = args.smoke
    modules = {"as_is": as_is}
    try:
        for spec in args.variant:
            name, path = spec.split("=", 1)
            modules[name] = load_variant(name, path)
        rows: list[dict[str, Any]] = []
        for wname in args.workloads.split(","):
            w = make_workload(wname)
            fns = {name: launcher(mod, w) for name, mod in modules.items()}
            base = fns["as_is"]()
            diffs = {name: (fn() - base).abs().max().item() for name, fn in fns.items()}
            del base
            times: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    times[name].append(time_ms(fn, slow=False))
            for name in fns:
                row = {"workload": wname, "variant": name, "ms": times[name], "best_ms": min(times[name])}
                row["max_abs_diff_vs_as_is"] = diffs[name]
                rows.append(row)
                log(f"{wname:10s} {name:12s} " + " ".join(f"{t:8.3f}" for t in times[name]))
            del w, fns
            torch.cuda.empty_cache()
        write_json(args.out, {"ab": rows, "meta": meta(dtype="float16", dim=128)})
        print(f"\n{'workload':10s} " + " ".join(f"{n:>12s}" for n in modules) + "   (best ms of rounds)")
        for wname in args.workloads.split(","):
            best = {r["variant"]: r["best_ms"] for r in rows if r["workload"] == wname}
            print(f"{wname:10s} " + " ".join(f"{best[n]:12.3f}" for n in modules))
    finally:
        for path in PACKAGE.glob("_ab_*.py"):
            path.unlink()


if __name__ == "__main__":
    main()
