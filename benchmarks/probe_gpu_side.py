"""What the GPU side of a `maxsim score` pass costs with the corpus already on the GPU, step by step (H200).

The `score` benchmark's pass (fp16, 10 GB, 512 queries) takes ~0.69 s against 0.43 s for the kernel alone
in the same batch sizes, and neither fewer launches per batch, nor fewer reader threads, nor larger
batches moved it (benchmarks/results/score/ab-trees-*.json, pass-breakdown-*.json). This replays the pass on
GPU-resident batches, adding one ingredient at a time, each timed back to back over all batches (best of
``--repeats``):

  kernel          `maxsim_varlen` alone (the `score` benchmark's "kernel alone");
  + merge         and the engine's per-batch work on the device: the NaN/Inf check and the top-k merge;
  + copies        and a host->device copy of the batch's bytes from pinned memory on a side stream,
                  which the scoring stream waits for (as `BatchStream` does);
  + reads         and 16 threads reading the shard files from the page cache meanwhile (and the same
                  with the readers' priority lowered, or with 14 or 8 threads).

`--precisions fp16,int8` replays the int8 corpus too: its batches with their per-token scales, the
queries quantized once as the engine does.

    python benchmarks/probe_gpu_side.py --workdir /var/tmp/mb --precisions fp16,int8 --out gpu-side.json
    python benchmarks/probe_gpu_side.py --workdir /tmp/mb-first --size 8.2GB --steps kernel,+merge,+copies \
        --out gpu-side-first-call.json      # the corpus of profile_first_call.py
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch
from common import prepare_score_corpus, read_files, write_json

from maxsim_cli.scoring.entry import score
from maxsim_cli.scoring.pipeline import batch_check
from maxsim_cli.scoring.topk import RunningTopK
from maxsim_cli.shards import open_corpus


def load_batches(paths: list[str], max_tokens: int, device: torch.device) -> list[tuple]:
    """The corpus in the engine's batches on `device`: (embeddings, host offsets, scales or None, ranks)."""
    corpus = open_corpus(paths)
    out, first = [], 0
    for shard in corpus.shards:
        for b in shard.iter_batches(max_tokens):
            n = b.num_docs
            scales = None if b.scales is None else b.scales.to(device)
            ranks = torch.arange(first, first + n, device=device)
            out.append((b.embeddings.to(device), b.offsets, scales, ranks))
            first += n
    corpus.close()
    return out


def replay(batches, q_emb, q_off, q_scales, merge: bool, copies: bool) -> float:  # noqa: ANN001
    from maxsim_kernels import maxsim_varlen

    device = q_emb.device
    compute = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    biggest = max(d.numel() * d.element_size() for d, *_ in batches)
    pinned = torch.empty(biggest, dtype=torch.uint8, pin_memory=True) if copies else None
    slots = [torch.empty(biggest, dtype=torch.uint8, device=device) for _ in range(2)] if copies else []
    released: list[torch.cuda.Event | None] = [None, None]
    topk = RunningTopK(q_off.numel() - 1, 1000)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i, (docs, offsets, scales, ranks) in enumerate(batches):
        if copies:
            nbytes = docs.numel() * docs.element_size()
            done = torch.cuda.Event()
            with torch.cuda.stream(side):
                if released[i % 2] is not None:
                    side.wait_event(released[i % 2])
                slots[i % 2][:nbytes].copy_(pinned[:nbytes], non_blocking=True)
                done.record(side)
            compute.wait_event(done)
        scores = maxsim_varlen(q_emb, q_off, docs, offsets, doc_scales=scales, query_scales=q_scales)
        if merge:
            batch_check(docs, scales)  # as the engine: the scales for int8
            topk.add(scores, ranks)
        if copies:
            released[i % 2] = torch.cuda.Event()
            released[i % 2].record(compute)
    torch.cuda.synchronize()
    return time.perf_counter() - start


STEPS = {
    "kernel": (False, False, None),
    "+ merge": (True, False, None),
    "+ copies": (True, True, None),
    "+ reads": (True, True, (16, 0)),
    "+ reads nice 10": (True, True, (16, 10)),
    "+ reads x14": (True, True, (14, 0)),
    "+ reads x8": (True, True, (8, 0)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/var/tmp/mb")
    parser.add_argument("--size", default="10GB", help="corpus size (profile_first_call.py's: 8.2GB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precisions", default="fp16", help="comma-separated: fp16, int8")
    parser.add_argument(
        "--steps",
        default=",".join(STEPS),
        help="comma-separated (spaces optional), from: " + ", ".join(STEPS),
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from maxsim_kernels.int8_host import quantize_per_token

    device = torch.device("cuda")
    precisions = args.precisions.split(",")
    corpora, qpath = prepare_score_corpus(args.workdir, device, args.size, int8="int8" in precisions)
    out = os.path.join(args.workdir, "gpu-side.trec")
    result: dict[str, dict] = {}
    stop = threading.Event()

    def reader(files: list[str], threads: int, nice: int) -> None:
        while not stop.is_set():
            read_files(files, threads, nice=nice)

    for precision in precisions:
        paths = corpora[precision]
        files = [s.info.path for s in open_corpus(paths).shards]
        st = score(qpath, paths, output=out, device="cuda", log=lambda m: None)
        pass_s = st.wall_s - st.setup_s - st.write_s
        q = open_corpus([qpath]).shards[0].read_docs(0, st.queries)
        q_emb, q_off, q_scales = q.embeddings.to(device), q.offsets, None
        if precision == "int8":  # as the engine does, once per query block
            q_emb, q_scales = quantize_per_token(q_emb)
        batches = load_batches(paths, st.max_batch_tokens, device)

        rows = {}
        wanted = set(args.steps.replace(" ", "").split(","))
        for name in [n for n in STEPS if n.replace(" ", "") in wanted]:
            merge, copies, reads = STEPS[name]
            thread = threading.Thread(target=reader, args=(files, *reads), daemon=True) if reads else None
            if thread is not None:
                stop.clear()
                thread.start()
            times = [replay(batches, q_emb, q_off, q_scales, merge, copies) for _ in range(args.repeats)]
            if thread is not None:
                stop.set()
                thread.join()
            rows[name] = {"best_s": min(times), "all_s": times}
            runs = ", ".join(f"{t:.3f}" for t in times)
            print(f"{precision} {name:16s} best {min(times):.3f} s  ({runs}); "
                  f"{len(batches)} batches, pass of `maxsim score` {pass_s:.3f} s", flush=True)  # fmt: skip
        result[precision] = {"rows": rows, "batches": len(batches), "score_stats": st.as_dict()}
        del batches
        torch.cuda.empty_cache()
    write_json(args.out, result, indent=2)


if __name__ == "__main__":
    main()
