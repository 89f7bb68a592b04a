"""Start-up time of the command line against `import torch`: fresh processes, measured in one run.

Times `python -c "import torch"`, `maxsim --help`, `maxsim --version` and `python -c "import
maxsim_cli.cli"`, each --repeats times, alternating (one of each per round, the order rotating from round
to round, after one untimed warm-up round), so that all four see the same machine state. Reports the
median wall time of each and the ratio `maxsim --help` / `import torch` (the target: at most 0.25), and
writes them as JSON.

    python benchmarks/bench_cli_startup.py --repeats 7
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _maxsim() -> list[str]:
    """The `maxsim` console script of this interpreter's environment (else the one on PATH)."""
    beside = os.path.join(os.path.dirname(sys.executable), "maxsim")
    found = beside if os.path.exists(beside) else shutil.which("maxsim")
    if found is None:
        sys.exit("bench_cli_startup: no `maxsim` executable; install the package (pip install -e .)")
    return [found]


def commands() -> dict[str, list[str]]:
    maxsim = _maxsim()
    return {
        "import torch": [sys.executable, "-c", "import torch"],
        "maxsim --help": [*maxsim, "--help"],
        "maxsim --version": [*maxsim, "--version"],
        "import maxsim_cli.cli": [sys.executable, "-c", "import maxsim_cli.cli"],
    }


def time_once(argv: list[str]) -> float:
    """Wall seconds of one fresh process, output discarded; a failing command stops the benchmark."""
    start = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"bench_cli_startup: {shlex.join(argv)} exited {proc.returncode}:\n{proc.stderr.decode()}")
    return elapsed


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", "-n", type=int, default=7, help="Timed runs of each command.")
    parser.add_argument(
        "--out",
        default=os.path.join(
            ROOT, "benchmarks", "results", "startup", f"cli-startup-{socket.gethostname()}.json"
        ),
        help="JSON file to write (its folder is created).",
    )
    args = parser.parse_args()
    cmds = commands()
    names = list(cmds)
    for name in names:  # warm-up: file cache, .pyc files
        time_once(cmds[name])
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(time_once(cmds[name]))

    medians = {name: statistics.median(s) for name, s in samples.items()}
    ratio = medians["maxsim --help"] / medians["import torch"]
    for name in names:
        print(
            f"{name:<24} median {medians[name]:.3f} s  min {min(samples[name]):.3f} s  "
            f"({shlex.join(cmds[name])})",
            file=sys.stderr,
        )
    print(f"maxsim --help / import torch = {ratio:.3f} (target <= 0.25)", file=sys.stderr)

    result = {
        "benchmark": "cli startup",
        "command": shlex.join([os.path.basename(sys.executable), *sys.argv]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in ("maxsim", "torch", "typer", "rich", "numpy")},
        "repeats": args.repeats,
        "commands": {name: shlex.join(argv) for name, argv in cmds.items()},
        "median_s": medians,
        "min_s": {name: min(s) for name, s in samples.items()},
        "samples_s": samples,
        "help_over_import_torch": ratio,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
