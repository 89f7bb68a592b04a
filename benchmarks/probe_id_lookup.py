"""Docnos to corpus ordinals: a dict of every id against `IdLookup` (numpy over a hash table).

    python benchmarks/probe_id_lookup.py [--out benchmarks/results/serve/id-lookup-cpu.json]

For corpora of 20,000 ids (the served rerank benchmark's) and 195,215 ids (the 8 GB corpus's), times
the lookup of a served request's 1,000 candidate docnos (fresh strings, as parsed from a request), 2% of
them not in the corpus: once back to back ("hot": the structures stay in the caches), and once with
32 MiB of other memory read between two lookups ("cold": what the rest of a served request does to
the caches, where a served 1,000-docno lookup took 0.49 ms on the H200 host against 0.08 ms back to
back). Each answer is checked against the dict's. Medians of --repeats.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import numpy as np
import pyarrow as pa
from common import make_log, meta, write_json

log = make_log("id-lookup")
NOT_FOUND = itertools.repeat(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20000,195215")
    parser.add_argument("--candidates", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from maxsim_cli.shards.id_lookup import IdLookup

    rng = np.random.default_rng(7)
    sweep = np.zeros(32 << 20, dtype=np.uint8)
    rows = []
    for size in map(int, args.sizes.split(",")):
        ids = [f"msmarco_passage_{i:08d}" for i in rng.permutation(size * 4)[:size]]
        arrow = pa.array(ids, type=pa.large_string())
        started = time.perf_counter()
        as_dict = dict(zip(ids, range(size), strict=True))
        dict_build_s = time.perf_counter() - started
        started = time.perf_counter()
        table = IdLookup(arrow)
        table_build_s = time.perf_counter() - started
        requests = []
        for _ in range(16):
            picks = [ids[i] for i in rng.choice(size, args.candidates, replace=False)]
            picks[::50] = [f"absent_{i}" for i in range(len(picks[::50]))]
            requests.append(picks)

        def by_dict(docnos: list[str], as_dict: dict[str, int] = as_dict) -> np.ndarray:
            return np.fromiter(map(as_dict.get, docnos, NOT_FOUND), dtype=np.int64, count=len(docnos))

        row = {"ids": size, "dict_build_s": round(dict_build_s, 3), "table_build_s": round(table_build_s, 3)}
        for name, fn in (("dict", by_dict), ("table", table.lookup)):
            for mode in ("hot", "cold"):
                times = []
                for r in range(args.repeats):
                    fresh = [d.encode().decode() for d in requests[r % len(requests)]]  # unhashed strings
                    if mode == "cold":
                        int(sweep[::64].sum())  # one read a cache line
                    t0 = time.perf_counter()
                    got = fn(fresh)
                    times.append(time.perf_counter() - t0)
                    if r < len(requests):
                        assert np.array_equal(got, by_dict(fresh)), "lookups disagree"
                row[f"{name}_{mode}_us"] = round(statistics.median(times) * 1e6, 1)
        log(str(row))
        rows.append(row)
    write_json(args.out, {**meta(), "candidates": args.candidates, "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
