"""Where the worker-to-scoring-process hop of `maxsim serve --workers 1` spends its time, stage by stage.

``Server-Timing``'s ``ipc`` is a request's round trip from its worker to the scoring process and back,
less the queue and the scoring. This starts a real server (`bench_serve.Server`, the rerank corpus of
`bench_serve.py`) with a ``sitecustomize`` on its path that wraps, in the worker and in the scoring
process, the functions a request passes through, and stamps each with `time.perf_counter` (the same
monotonic clock in every process of the machine), then sends one client's rerank requests (1 query x
1,000 candidates) one after the other and prints the median and p90 of each stage:

    worker:  submit -> request frame built -> (socket) ->
    scoring: frame read -> request decoding starts -> decoded -> the scoring starts -> scored ->
             answer frame starts -> built -> (socket) ->
    worker:  answer frame read -> answer decoded

and inside the scoring (`Scorer.score` on a resident corpus: `Scorer._rerank_resident`): the docnos
looked up, the queries converted and put on the device (`direct._kernel_inputs`), the launch with its
inputs and the scores back on the host (`direct.candidate_scores_on`), the answers ordered. The same
stamps are then taken in this process around the same `Scorer.score` calls on the same requests (the
corpus opened and made resident here, the server stopped), so that each part of the served step has
its in-process twin beside it.

    python benchmarks/probe_hop_trace.py --device cuda --requests 1000 [--out hop-trace.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile

import torch
from bench_serve import JSON, Server, build_rerank_corpus, make_queries, one_client, rerank_requests
from common import write_json

# Stamps around the scoring step and its parts: run by the tracer below, and in the probe's own process.
SCORING_WRAPS = r"""
def _wrap_scoring(stamp):
    import functools
    from maxsim_cli.scoring import direct
    from maxsim_cli.service import batching

    def wrap(owner, attr, first, last):
        original = getattr(owner, attr)
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            stamp(first)
            out = original(*args, **kwargs)
            stamp(last)
            return out
        setattr(owner, attr, wrapper)

    wrap(batching.Scorer, "score", "h_score", "h_scored")
    wrap(direct, "_kernel_inputs", "h_inputs", "h_inputs_done")
    wrap(direct, "candidate_scores_on", "h_launch", "h_kernel_done")
"""

# The tracer, loaded by every Python process of the server (sitecustomize); it writes its stamps to
# $MAXSIM_HOP_TRACE/trace-PID.json at exit.
SITECUSTOMIZE = (
    r"""
import atexit, json, os, time
"""
    + SCORING_WRAPS
    + r"""
_dir = os.environ.get("MAXSIM_HOP_TRACE")
if _dir:
    _stamps = []
    def _stamp(name, rid):
        _stamps.append((name, rid, time.perf_counter()))
    def _dump():
        with open(os.path.join(_dir, f"trace-{os.getpid()}.json"), "w") as f:
            json.dump(_stamps, f)
    atexit.register(_dump)
    import functools
    from maxsim_cli.service import batching, wire, workers
    _current = {"id": None}  # the scoring process's request in hand (one client: one at a time)

    def _wrap(owner, attr, before=None, after=None):
        original = getattr(owner, attr)
        if hasattr(original, "__func__"):
            original = original.__func__
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if before:
                before(*args, **kwargs)
            out = original(*args, **kwargs)
            if after:
                after(out, *args, **kwargs)
            return out
        setattr(owner, attr, wrapper)

    # worker side (front.HubClient imports these from wire inside its methods)
    _wrap(wire, "request_frame", before=lambda rid, *a, **k: _stamp("w_submit", rid),
          after=lambda out, rid, *a, **k: _stamp("w_request_built", rid))
    _orig_read = wire.read_frame
    async def _read_frame(reader):
        out = await _orig_read(reader)
        rid = out[0].get("id")
        _stamp("frame_read", rid)
        if "op" in out[0]:
            _current["id"] = rid
        return out
    wire.read_frame = _read_frame
    workers.read_frame = _read_frame
    _wrap(wire, "answers_from_frame",
          after=lambda out, header, payload: _stamp("w_submit_done", header.get("id")))
    # scoring side
    _wrap(workers, "checked_from_frame", before=lambda header, payload: _stamp("h_task", header.get("id")),
          after=lambda out, header, payload: _stamp("h_decoded", header.get("id")))
    _wrap(workers, "answer_frame", before=lambda rid, *a, **k: _stamp("h_submit_done", rid),
          after=lambda out, rid, *a, **k: _stamp("h_answer_built", rid))
    _wrap_scoring(lambda name: _stamp(name, _current["id"]))
"""
)

STAGES = [
    ("w_submit", "w_request_built", "worker: request frame built"),
    ("w_request_built", "h_frame_read", "socket to the scoring process, its loop wakes, frame read"),
    ("h_frame_read", "h_task", "scoring: the request's decoding starts (a task's start when queued)"),
    ("h_task", "h_decoded", "scoring: request decoded"),
    ("h_decoded", "h_score", "scoring: the scoring starts (the batcher's hand-over when queued)"),
    ("h_score", "h_scored", "scoring: Scorer.score (GPU included)"),
    ("h_scored", "h_submit_done", "scoring: the answer frame starts (a task's resumption when queued)"),
    ("h_submit_done", "h_answer_built", "scoring: answer frame built"),
    ("h_answer_built", "w_frame_read", "socket to the worker, its loop wakes, frame read"),
    ("w_frame_read", "w_submit_done", "worker: submit resumes, answer decoded"),
]
# Inside Scorer.score, served and in process alike.
SCORING_STAGES = [
    ("h_score", "h_inputs", "docnos looked up"),
    ("h_inputs", "h_inputs_done", "queries converted and on the device"),
    ("h_inputs_done", "h_launch", "candidates' arrays"),
    ("h_launch", "h_kernel_done", "launch, kernel, scores back on the host"),
    ("h_kernel_done", "h_scored", "answers ordered"),
    ("h_score", "h_scored", "the whole step"),
]


def medians(samples: list[dict[str, float]], stages: list[tuple[str, str, str]]) -> dict:
    rows = {}
    for a, b, label in stages:
        d = sorted((s[b] - s[a]) * 1e6 for s in samples if a in s and b in s)
        if d:
            rows[label] = {"p50_us": round(statistics.median(d), 1), "p90_us": round(d[int(0.9 * len(d))], 1)}
    return rows


def analyse(trace_dir: str, hub_pid: int) -> dict:
    per_id: dict[int, dict[str, float]] = {}
    for path in glob.glob(os.path.join(trace_dir, "trace-*.json")):
        side = "h" if int(os.path.basename(path)[6:-5]) == hub_pid else "w"
        for name, rid, t in json.load(open(path)):
            if rid is not None:
                per_id.setdefault(rid, {})[f"{side}_frame_read" if name == "frame_read" else name] = t
    complete = [s for s in per_id.values() if all(a in s and b in s for a, b, _ in STAGES)]
    complete = complete[len(complete) // 10 :]  # the warm-up's first tenth out
    rows = medians(complete, STAGES)
    total = sorted((s["w_submit_done"] - s["w_submit"]) * 1e6 for s in complete)
    rows["worker's submit, whole"] = {"p50_us": round(statistics.median(total), 1)}
    return {"requests_traced": len(complete), "stages": rows, "scoring": medians(complete, SCORING_STAGES)}


def in_process(corpus_path: str, device: str, bodies: list[bytes], requests: int) -> dict:
    """The scoring step's parts for the same requests in this process: `Scorer.score` on the resident
    corpus, one request at a time, stamped as in the server."""
    import time

    from maxsim_cli import open_corpus
    from maxsim_cli.service.batching import Job, Scorer
    from maxsim_cli.service.schema import parse_request

    namespace: dict = {}
    exec(SCORING_WRAPS, namespace)
    stamps: list[dict[str, float]] = []
    namespace["_wrap_scoring"](lambda name: stamps[-1].__setitem__(name, time.perf_counter()))
    with open_corpus(corpus_path) as corpus:
        corpus.to(device)
        scorer = Scorer(corpus, device=device)
        dim = corpus.dim
        for i in range(requests):
            parsed = parse_request("rerank", JSON, bodies[i % len(bodies)], {}, dim)
            stamps.append({})
            scorer.score([Job("rerank", parsed)])
    return medians(stamps[len(stamps) // 10 :], SCORING_STAGES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--workdir", default="/tmp/mb-hop")
    parser.add_argument("--rerank-docs", type=int, default=20000)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    path = build_rerank_corpus(args.workdir, args.rerank_docs, torch.device(args.device))
    _, bodies = rerank_requests(make_queries(8, seed=11), args.rerank_docs)
    site = tempfile.mkdtemp(prefix="hop-site-")
    trace_dir = tempfile.mkdtemp(prefix="hop-trace-")
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    os.environ["PYTHONPATH"] = os.pathsep.join([site, *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ["MAXSIM_HOP_TRACE"] = trace_dir
    server = Server(path, args.device, 2.0, os.path.join(args.workdir, "serve-hop.log"), "1")
    try:
        result = one_client(server.url, "/rerank", bodies, args.requests, JSON, 120)
    finally:
        code = server.stop()
    out = {
        "command": " ".join(["python", *sys.argv]),
        "server_command": server.command,
        "server_exit_code": code,
        "errors": len(result["errors"]),
        **analyse(trace_dir, server.proc.pid),
        "scoring_in_process": in_process(path, args.device, bodies, args.requests),
    }
    print(json.dumps(out, indent=1))
    write_json(args.out, out)


if __name__ == "__main__":
    main()
