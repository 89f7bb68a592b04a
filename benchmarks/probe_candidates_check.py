"""Rerank with candidates in corpus order against shuffled ones, through the public `maxsim_candidates`,
with the candidates tensor reused, made afresh on the GPU, or made afresh on the host at each call.

    python benchmarks/probe_candidates_check.py --out benchmarks/results/kernels/candidates-check-h200.json

The kernels alone show no slowdown for candidates in order (docs/kernel-notes.md, "Rerank: candidates
in order"); this probe tests the explanation given there for the slowdown the issue measured: a
candidates tensor the call has not seen before is checked on the host, and a CUDA one is first copied
there, a copy that waits for the GPU. 64 queries of 32 tokens, each against 1000 candidates of 180
tokens from a pool of 64,000 documents, fp16, d = 128; do_bench medians.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from common import DIM, QUERY_TOKENS, device, make_log, median_ms, meta, normal_tokens, write_json

log = make_log("cands")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rep-ms", type=int, default=200)
    parser.add_argument("--out")
    args = parser.parse_args()
    from maxsim_kernels import maxsim_candidates

    dev = device()
    gen = torch.Generator(device=dev).manual_seed(0)
    n_q, per_q, length = 64, 1000, 180
    pool = n_q * per_q
    docs = normal_tokens(pool * length, gen, dev)
    d_off = torch.arange(pool + 1, dtype=torch.int64) * length
    queries = normal_tokens(n_q * QUERY_TOKENS, gen, dev)
    q_off = torch.arange(n_q + 1, dtype=torch.int64) * QUERY_TOKENS
    c_off = torch.arange(n_q + 1, dtype=torch.int64) * per_q
    orders = {
        "in order": torch.arange(pool),
        "shuffled": torch.randperm(pool, generator=torch.Generator().manual_seed(0)),
    }
    rows = []
    for order, cand in orders.items():
        cand_dev = cand.to(dev)
        base = maxsim_candidates(queries, q_off, docs, d_off, c_off, cand_dev)
        ways: dict[str, Callable[[], torch.Tensor]] = {
            "one CUDA tensor, reused": lambda c=cand_dev: maxsim_candidates(
                queries, q_off, docs, d_off, c_off, c
            ),
            "a new CUDA tensor a call": lambda c=cand_dev: maxsim_candidates(
                queries, q_off, docs, d_off, c_off, c.clone()
            ),
            "a new host tensor a call": lambda c=cand: maxsim_candidates(
                queries, q_off, docs, d_off, c_off, c.clone()
            ),
        }
        for way, fn in ways.items():
            equal = bool(torch.equal(fn(), base))
            ms = median_ms(fn, args.rep_ms)
            rows.append({"candidates": order, "tensor": way, "ms": ms, "equal": equal})
            log(f"{order:9s} {way:26s} {ms:7.3f} ms equal={equal}")
    write_json(args.out, {**meta(), "dim": DIM, "rows": rows})


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
