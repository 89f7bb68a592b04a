"""How long opening a corpus spends ordering its ids, and whether sorting shard by shard is faster (CPU).

`Corpus.id_order` sorts all document ids once per run (duplicate ids across shards, the docno order that
breaks score ties, the docnos of the run). With Arrow's `sort_indices` on the whole array that is
~0.5 us an id on a 2-core machine: seconds for MS MARCO's 8.8M passages, at every `maxsim score`. This
times, on ids spread over 20 shards (MS MARCO-like numbers in random order, and long ids like
`msmarco_passage_07_123456`):

  whole      `pc.sort_indices` of all ids, then `take` (the current `id_order`);
  by shard   `maxsim_cli.shards.format.sorted_id_order`: each shard's ids sorted in its own thread, then the
             concatenated sorted runs sorted once more (Arrow's sort is faster on runs), then `take`.

    python benchmarks/probe_id_sort.py --out id-sort.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from maxsim_cli.shards import format as shard_format


def whole(arrays: list[pa.Array]) -> tuple[np.ndarray, pa.Array]:
    ids = pa.concat_arrays(arrays)
    order = pc.sort_indices(ids)
    return order.to_numpy().astype(np.int64), ids.take(order)


def by_shard(arrays: list[pa.Array]) -> tuple[np.ndarray, pa.Array]:
    """`maxsim_cli.shards.format.sorted_id_order`, made to sort shard by shard whatever the sizes (its
    thresholds are read from `maxsim_cli.shards.format`, so they are set there)."""
    saved = shard_format.BY_SHARD_SORT_MIN_THREADS, shard_format.BY_SHARD_SORT_MIN_IDS
    shard_format.BY_SHARD_SORT_MIN_THREADS, shard_format.BY_SHARD_SORT_MIN_IDS = 2, 0
    try:
        _, ordinals, sorted_ids = shard_format.sorted_id_order(arrays)
    finally:
        shard_format.BY_SHARD_SORT_MIN_THREADS, shard_format.BY_SHARD_SORT_MIN_IDS = saved
    return ordinals, sorted_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="244208,8800000")
    parser.add_argument("--shards", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cpus = os.cpu_count() or 1
    rows = {}
    for n in (int(x) for x in args.sizes.split(",")):
        perm = np.random.default_rng(0).permutation(n)
        for kind, make in (
            ("numbers", lambda i: str(i)),
            ("long", lambda i: f"msmarco_passage_{i % 70:02d}_{i:09d}"),
        ):
            ids = pa.array([make(int(i)) for i in perm], type=pa.large_string())
            cuts = [n * s // args.shards for s in range(args.shards + 1)]
            arrays = [ids.slice(a, b - a) for a, b in zip(cuts, cuts[1:], strict=False)]
            times: dict[str, list[float]] = {"whole": [], "by_shard": []}
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                a = whole(arrays)
                t1 = time.perf_counter()
                b = by_shard(arrays)
                t2 = time.perf_counter()
                times["whole"].append(t1 - t0)
                times["by_shard"].append(t2 - t1)
                assert np.array_equal(a[0], b[0]) and a[1].equals(b[1])
            key = f"{n} {kind}"
            rows[key] = {k: min(v) for k, v in times.items()}
            print(f"{key:20s} whole {min(times['whole']):.3f} s, by shard {min(times['by_shard']):.3f} s "
                  f"({cpus} cpus)", flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"rows": rows, "cpus": cpus, "shards": args.shards}, fh, indent=2)


if __name__ == "__main__":
    main()
