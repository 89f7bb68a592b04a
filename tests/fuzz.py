"""Fuzz ``maxsim serve``, the shard readers and the Python API with mutated inputs (`tests/fuzzing.py`).

    python -m tests.fuzz                          # CI size: the cases built on purpose, 240 drawn, seed 1
    python -m tests.fuzz --cases 20000 --seed 7   # a longer one
    python -m tests.fuzz --seed 1 --target server --case 111 -v   # one case, with its request and answer
    python -m tests.fuzz --target server --case=-1 -v             # a case built on purpose (-N..-1)

Prints a table of counts (cases, crashes, hangs, 5xx answers, internal errors, tracebacks, wrong answers,
non-one-line errors) and one line per class of failure, with the command that reproduces its first case.
Exits 1 when anything failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fuzzing  # noqa: E402

DEFAULT_CASES = 240
DEFAULT_SEED = 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases", type=int, default=DEFAULT_CASES, help="cases in all, shared among the targets"
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--target", action="append", choices=fuzzing.TARGETS, help="only these targets")
    parser.add_argument("--case", type=int, action="append", help="only these case numbers (with --target)")
    parser.add_argument("--first", type=int, default=0, help="number of the first case")
    parser.add_argument(
        "--no-known",
        dest="known",
        action="store_false",
        help="leave out the cases built on purpose (numbered -N..-1)",
    )
    parser.add_argument("--server-args", default="", help="more options for maxsim serve, e.g. '--workers 1'")
    parser.add_argument(
        "--max-restarts", type=int, default=100, help="server restarts after crashes before giving up"
    )
    parser.add_argument("--json", type=Path, help="write the counts and findings here")
    parser.add_argument(
        "--save", type=Path, help="keep each case's request body or shard file in this folder"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print each case's input and outcome")
    args = parser.parse_args(argv)
    targets = args.target or list(fuzzing.TARGETS)
    if args.case:
        cases = {t: args.case for t in targets}
    else:
        drawn = fuzzing.default_cases(args.cases, args.first)
        cases = {t: drawn[t] if args.known else drawn[t][len(fuzzing.known_cases(t)) :] for t in targets}
    report = fuzzing.run_fuzz(
        args.seed,
        cases,
        server_args=args.server_args.split(),
        max_restarts=args.max_restarts,
        verbose=args.verbose,
        save=args.save,
    )
    print(report.text())
    if args.json:
        args.json.write_text(json.dumps(report.to_json(), indent=1))
    return 1 if report.failures or report.harness_errors else 0


if __name__ == "__main__":
    sys.exit(main())
