"""Rerank with the same candidates tensor every call against a new one every call (as a service passes
them), fp16 and int8, through the public `maxsim_candidates`, the peers beside them.

    python benchmarks/bench_rerank_new_candidates.py --out rerank-new-candidates-h100.json
    python benchmarks/bench_rerank_new_candidates.py --smoke   # the script itself, on the CPU (interpreter)

The workload is `bench_kernels.py`'s rerank: 64 queries of 32 tokens, each against its own 1000 documents
of 180 tokens scattered over a pool of 64,000 (`make_workload("rerank")`), d = 128, fp16 (int8: the same
documents through `quantize_per_token`, fp16 queries quantized by the call). Candidate offsets come from
the host; the candidates live on the GPU, either one tensor reused by every call ("same") or a fresh
copy of it at every call ("new": the copy is timed with the call; "copy only" times it alone). A new
candidates tensor used to be copied to the host and checked there, a copy that waits for the GPU; the
kernels now guard each index themselves (docs: `maxsim_candidates`). `--orders` adds the candidates in
corpus order (query q owns documents 1000 q .. 1000 q + 999).

flash-maxsim and late-interaction-kernels, where importable, score the same pairs from the padded copy
of the gathered candidates they need (made once, outside the timing; they take no candidates tensor).
Every variant is timed once a round by `triton.testing.do_bench` (median, L2 flushed between calls), in
an order that rotates from round to round; the JSON keeps every round's figure and each variant's median
over the rounds and its spread ((max - min) / median). The "new" scores are compared bit for bit with the
"same" scores.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from common import SMOKE, device, flash, lik, make_log, make_workload, median_ms, meta, sync, write_json

log = make_log("rerank-new-candidates", clock=True)


def our_variants(w: dict[str, Any], order: str) -> tuple[dict[str, Callable[[], torch.Tensor]], dict]:
    """The timed calls of this project's kernels for one candidate order, and what they ran on."""
    from maxsim_kernels import maxsim_candidates
    from maxsim_kernels.int8_host import quantize_per_token
    from maxsim_kernels.maxsim_int8 import hopper_stream

    dev = device()
    cand = w["cand_docs"] if order == "shuffled" else torch.arange(w["nd"])
    cand = cand.to(dev)
    c_off = w["cand_offsets"]  # host offsets, as a service passes them
    args = (w["queries"], w["q_off"], w["docs"], w["d_off"], c_off)
    d8, sd = quantize_per_token(w["docs"])
    args8 = (w["queries"], w["q_off"], d8, w["d_off"], c_off)
    q8 = quantize_per_token(w["queries"])[0]
    info = {
        "int8_kernel": "gluon-stream" if hopper_stream(w["q_off"], q8, d8, False) is not None else "triton"
    }

    def fp16(c: torch.Tensor) -> torch.Tensor:
        return maxsim_candidates(*args, c, backend="triton")

    def int8(c: torch.Tensor) -> torch.Tensor:
        return maxsim_candidates(*args8, c, doc_scales=sd, backend="triton")

    calls = {
        "fp16 same": lambda: fp16(cand),
        "fp16 new": lambda: fp16(cand.clone()),
        "int8 same": lambda: int8(cand),
        "int8 new": lambda: int8(cand.clone()),
        "copy only": lambda: cand.clone(),
    }
    for kind, run in (("fp16", fp16), ("int8", int8)):
        same, new = run(cand), run(cand.clone())
        info[f"{kind}_new_equals_same"] = bool(torch.equal(same, new))
        info[f"{kind}_nan"] = int(torch.isnan(new).sum())
    return calls, info


def peer_variants(w: dict[str, Any]) -> tuple[dict[str, Callable[[], torch.Tensor]], dict[str, str]]:
    """flash-maxsim and late-interaction-kernels where importable (on a GPU), else why not."""
    calls: dict[str, Callable[[], torch.Tensor]] = {}
    missing: dict[str, str] = {}
    for name, make in (("flash-maxsim", flash), ("late-interaction-kernels", lik)):
        if not torch.cuda.is_available():
            missing[name] = "no GPU"
            continue
        try:
            calls[name] = make(w)
            calls[name]()
        except ImportError as exc:
            missing[name] = f"not importable: {exc}"
            calls.pop(name, None)
    return calls, missing


def summary(times: list[float]) -> dict[str, float]:
    med = float(np.median(times))
    return {"median_ms": med, "spread": (max(times) - min(times)) / med if med else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (every variant once each)")
    parser.add_argument("--rep-ms", type=int, default=300, help="do_bench's time per figure")
    parser.add_argument("--orders", default="shuffled,in-order", help="candidate orders, comma-separated")
    parser.add_argument("--no-peers", action="store_true", help="this project's kernels only")
    parser.add_argument("--out", help="write the JSON results here")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (Triton interpreter)")
    args = parser.parse_args()
    SMOKE["on"] = args.smoke
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.rounds = min(args.rounds, 2)
    elif not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --smoke)")
    w = make_workload("rerank")
    log(f"rerank: {w['nq']} queries x {w['per_q']} candidates of 180 tokens, pool {w['nd']}")
    calls: dict[str, Callable[[], torch.Tensor]] = {}
    info: dict[str, Any] = {}
    for order in args.orders.split(","):
        mine, what = our_variants(w, order)
        calls.update({f"{order} {name}": fn for name, fn in mine.items()})
        info[order] = what
        log(f"{order}: {what}")
    missing: dict[str, str] = {}
    if not args.no_peers:
        peers, missing = peer_variants(w)
        calls.update(peers)
        for name, why in missing.items():
            log(f"{name}: skipped ({why})")
    names = list(calls)
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        shift = r % len(names)
        figures = {}
        for name in names[shift:] + names[:shift]:
            sync()
            figures[name] = median_ms(calls[name], args.rep_ms)
        rounds.append(figures)
        log(f"round {r + 1}: " + ", ".join(f"{name} {figures[name]:.3f}" for name in names))
    results = {name: summary([fig[name] for fig in rounds]) for name in names}
    for name, res in results.items():
        log(f"{name:40s} {res['median_ms']:8.3f} ms  spread {100 * res['spread']:.1f}%")
    write_json(
        args.out,
        {
            "meta": meta(smoke=args.smoke, rounds=args.rounds, rep_ms=args.rep_ms),
            "workload": {
                "queries": w["nq"],
                "query_tokens": w["lq"],
                "candidates_per_query": w["per_q"],
                "doc_tokens": 180,
                "pool": w["nd"],
                "dim": 128,
            },  # fmt: skip
            "checks": info,
            "peers_skipped": missing,
            "results": results,
            "rounds": rounds,
        },
    )


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
