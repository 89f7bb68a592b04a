"""Where the GPU's time goes in one `maxsim score` pass: a torch.profiler (CUPTI) timeline, summarised.

The `score` benchmark's 10 GB corpus (fp16, and its int8 quantization, as `common.prepare_score_corpus` keeps
them under --workdir), 512 queries, top-1000, after a warm-up on the small corpus. For each precision:
one run unprofiled (wall time), one under the profiler. From the trace: GPU time by kernel name, the
host->device copies, and on the stream that runs the scoring kernel its busy time against its span
(first to last kernel), with the idle gaps between kernels binned by length. A pass bound by the
kernel shows a busy fraction near 1 and a kernel total near the `score` benchmark's "kernel alone".

    python benchmarks/profile_score_timeline.py --workdir /var/tmp/mb --out timeline.json
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
from typing import Any

import torch
from common import add_score_args, prepare_score_corpus, write_json
from torch.profiler import ProfilerActivity, profile

from maxsim_cli.score import score

GAP_BINS_US = (5, 20, 50, 200, 1000)


def _union(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            busy, end = busy + (b - a), b
        elif b > end:
            busy, end = busy + (b - end), b
    return busy


def summarise(trace: dict[str, Any]) -> dict[str, Any]:
    """GPU kernels and copies of a chrome trace, per name and on the scoring kernel's stream (µs)."""
    wanted = ("kernel", "gpu_memcpy")
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in wanted]
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    streams: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)
    copies: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        if e["cat"] == "gpu_memcpy":
            copies[e["name"]].append(e["dur"])
            continue
        by_name[e["name"]].append(e["dur"])
        streams[e["args"].get("stream", -1)].append((e["ts"], e["ts"] + e["dur"]))
    kernels = sorted(
        ({"name": n[:90], "count": len(d), "total_ms": sum(d) / 1e3} for n, d in by_name.items()),
        key=lambda r: -r["total_ms"],
    )
    main = max(
        streams,
        key=lambda s: sum(b - a for a, b in streams[s]),
        default=None,
    )
    stream: dict[str, Any] = {}
    if main is not None:
        spans = sorted(streams[main])
        first, last = spans[0][0], max(b for _, b in spans)
        busy = _union(spans)
        gaps, end = [], spans[0][1]
        for a, b in spans[1:]:
            if a > end:
                gaps.append(a - end)
            end = max(end, b)
        bins = {}
        lo = 0
        for hi in (*GAP_BINS_US, float("inf")):
            sel = [g for g in gaps if lo <= g < hi]
            bins[f"{lo}-{hi}us"] = {"count": len(sel), "total_ms": sum(sel) / 1e3}
            lo = hi
        stream = {"stream": main, "span_ms": (last - first) / 1e3, "busy_ms": busy / 1e3,
                  "busy_fraction": busy / max(last - first, 1e-9), "gaps": bins}  # fmt: skip
    return {
        "kernels": kernels[:15],
        "copies": {n: {"count": len(d), "total_ms": sum(d) / 1e3} for n, d in copies.items()},
        "scoring_stream": stream,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_score_args(parser)
    parser.add_argument("--traces", default=None, help="folder for the gzipped chrome traces")
    args = parser.parse_args()
    device = torch.device(args.device)
    corpora, qpath = prepare_score_corpus(args.workdir, device, args.size)
    quiet = {"device": device.type, "log": lambda m: None}
    result: dict[str, Any] = {}
    for precision, corpus in corpora.items():
        out = os.path.join(args.workdir, "tl.trec")
        plain = score(qpath, corpus, output=out, **quiet)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            profiled = score(qpath, corpus, output=out, **quiet)
        path = os.path.join(args.traces or args.workdir, f"timeline-{precision}.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as fh:
            trace = json.load(fh)
        if args.traces:
            with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
                dst.write(src.read())
        os.unlink(path)
        summary = summarise(trace)
        result[precision] = {
            "wall_s": plain.wall_s,
            "profiled_wall_s": profiled.wall_s,
            "stats": plain.as_dict(),
            **summary,
        }
        s = summary["scoring_stream"] or {"span_ms": 0.0, "busy_ms": 0.0, "busy_fraction": 0.0, "gaps": {}}
        print(
            f"{precision}: wall {plain.wall_s:.3f} s (profiled {profiled.wall_s:.3f} s), set-up "
            f"{plain.setup_s:.3f} s, write {plain.write_s:.3f} s; scoring stream span {s['span_ms']:.1f} ms, "
            f"busy {s['busy_ms']:.1f} ms ({s['busy_fraction']:.0%}); wait for batches {plain.wait_s:.3f} s",
            flush=True,
        )
        for k in summary["kernels"][:8]:
            print(f"  {k['total_ms']:8.1f} ms {k['count']:6d}x  {k['name']}")
        for name, c in summary["copies"].items():
            print(f"  {c['total_ms']:8.1f} ms {c['count']:6d}x  {name}")
        for name, g in s["gaps"].items():
            print(f"  gaps {name:>12s}: {g['count']:5d}, {g['total_ms']:.1f} ms")
    write_json(args.out, result, indent=2)


if __name__ == "__main__":
    main()
