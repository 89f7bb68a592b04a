"""`sort_trec`'s two ways of putting one query's hits in trec_eval's order, by list length (CPU).

Python's `sorted` with a (float32 score, docno) key, and numpy's `lexsort` on (position, docno, score),
which `sort_trec` uses from `maxsim_cli.runs._NUMPY_SORT_FROM` entries on. Docnos like `d1234567`,
scores random float32 with ties; the median of 7 rounds of 200 sorts each.

    python benchmarks/probe_sort_trec.py --out benchmarks/results/host/sort-trec-cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from common import meta, write_json

from maxsim_cli.runs import _float32_keys


def python_sort(docnos: list[str], scores: list[float]) -> list[int]:
    keys = _float32_keys(scores).tolist()
    return sorted(range(len(docnos)), key=lambda i: (keys[i], docnos[i]), reverse=True)


def numpy_sort(docnos: list[str], scores: list[float]) -> list[int]:
    position = -np.arange(len(docnos))
    return np.lexsort((position, np.asarray(docnos, dtype=str), _float32_keys(scores)))[::-1].tolist()


def per_sort_us(fn, docnos: list[str], scores: list[float], rounds: int = 7, number: int = 200) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(number):
            fn(docnos, scores)
        times.append((time.perf_counter() - t0) / number * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="8,16,32,48,64,96,128,256,1000")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        docnos = [f"d{i:07d}" for i in rng.choice(10_000_000, n, replace=False)]
        scores = np.round(rng.random(n), 2).astype(np.float32).tolist()  # two decimals: ties
        assert python_sort(docnos, scores) == numpy_sort(docnos, scores)
        row = {"n": n, "python_us": per_sort_us(python_sort, docnos, scores)}
        row["numpy_us"] = per_sort_us(numpy_sort, docnos, scores)
        rows.append(row)
        print(f"{n:5d}  python {row['python_us']:8.1f} us  numpy {row['numpy_us']:8.1f} us", flush=True)
    write_json(args.out, {**meta(), "sizes": rows})


if __name__ == "__main__":
    main()
