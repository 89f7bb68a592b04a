"""Training benchmark: MaxSim forward + backward, ours against plain autograd and the peers.

Shapes (all pairs, in-batch negatives; d = 128, L2-normalised random token vectors, fixed lengths so
every method sees the same work):
  colbert-128   128 queries x 32 tokens   vs 128 documents x 180 tokens
  colbert-256   128 queries x 32 tokens   vs 256 documents x 180 tokens
  colpali-32     32 queries x 1024 tokens vs  32 documents x 1024 tokens
  colpali-q32    32 queries x 32 tokens   vs  32 documents x 1024 tokens (text queries, page images)
  colpali-q64    64 queries x 32 tokens   vs  64 documents x 1024 tokens
  colpali-q128  128 queries x 32 tokens   vs 128 documents x 1024 tokens

Methods: ours (`maxsim_kernels.maxsim_varlen` with inputs that require grad, packed layout); plain
autograd (padded einsum, -inf masked amax, sum); flash-maxsim 0.3.0 `flash_maxsim_batched_train` (its
default backward, fp32 atomics, and its opt-in inverse-grid CSR path, FLASH_BWD_PATH=invgrid);
late-interaction-kernels 0.4.5 `maxsim` (its default backward and `backward="lowmem"`, its
deterministic one). The peers run on fp16 inputs only (flash-maxsim computes in fp16 whatever it is
given); ours and plain autograd also on fp32 inputs.

For each row: fwd+bwd time (triton.testing.do_bench median, upstream gradient fixed), the same step
captured in a CUDA graph and replayed (`gpu_ms`: the GPU's work without the host's; missing where a method
cannot be captured), the host time to enqueue a step (`host_ms`), peak memory beyond the inputs
(torch.cuda.max_memory_allocated during one fwd+bwd, the returned gradients included), the relative
gradient error ||g - g_ref|| / ||g_ref|| of dQ and dD against float64 (similarities and argmax in float64,
gradients reduced in float64), and whether two runs give bitwise-equal gradients. `ours-csr` and
`ours-onehot` force our document gradient's two paths (`ours` picks one by shape).
Our backward is also broken down (forward, CSR build, dQ kernel, CSR + dD, the one-hot dD; with
`--segment-sweep` the inverse map's segment, with `--argmax-tiles` forward tiles).

    python benchmarks/bench_train.py --out benchmarks/results/train/train-h200.json
    python benchmarks/bench_train.py --out benchmarks/results/train/train-colpali-queries-h200.json \
        --shapes colpali-q32,colpali-q64,colpali-q128,colbert-128 \
        --methods ours,ours-csr,flash-maxsim,lik --fp32-shapes none --argmax-tiles
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable

import maxsim_kernels
import torch
import triton
from common import DIM, TRAIN_SHAPES, host_time, training_inputs, write_json
from maxsim_kernels import maxsim_backward as mb
from triton.testing import do_bench

SHAPES = {
    **TRAIN_SHAPES,
    "colpali-q32": (32, 32, 32, 1024),
    "colpali-q64": (64, 32, 64, 1024),
    "colpali-q128": (128, 32, 128, 1024),
}
DEVICE = "cuda"
Grads = tuple[torch.Tensor, torch.Tensor]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------------
# inputs and the float64 reference
# ------------------------------------------------------------------------------------------------------


def reference_grads(x: dict) -> Grads:
    """float64 dQ, dD: similarities and argmax in float64, then the gather / scatter formulas."""
    nq, lq, nd, ld = x["shape"]
    q = x["q"].double().view(nq, lq, DIM)
    d = x["d"].double().view(nd, ld, DIM)
    g = x["g"].double()
    grad_q = torch.zeros_like(q)
    grad_d = torch.zeros(nd * ld, DIM, dtype=torch.float64, device=DEVICE)
    step = max(1, (1 << 28) // (nd * lq * ld))  # <= 2 GiB of float64 similarities at a time
    for s in range(0, nq, step):
        sims = torch.einsum("qid,bjd->qbij", q[s : s + step], d)
        arg = sims.argmax(dim=-1)  # [qs, nd, lq], first maximum
        del sims
        rows = arg + (torch.arange(nd, device=DEVICE) * ld)[None, :, None]
        w = g[s : s + step][:, :, None]  # [qs, nd, 1]
        gathered = d.reshape(nd * ld, DIM)[rows]  # [qs, nd, lq, DIM]
        grad_q[s : s + step] = (gathered * w[..., None]).sum(dim=1)
        del gathered
        contrib = q[s : s + step][:, None, :, :] * w[..., None]  # [qs, nd, lq, DIM]
        grad_d.index_add_(0, rows.reshape(-1), contrib.expand(-1, nd, -1, -1).reshape(-1, DIM))
        del contrib
    return grad_q.reshape(nq * lq, DIM), grad_d


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(x.double() - ref) / torch.linalg.vector_norm(ref)).item()


# ------------------------------------------------------------------------------------------------------
# methods: each returns a step() computing (dQ, dD) in packed [tokens, DIM] layout
# ------------------------------------------------------------------------------------------------------


def ours(x: dict, dd_path: str = "auto") -> Callable[[], Grads]:
    """Our step; `dd_path` forces the document gradient's path ("csr", "onehot") for this step's plans,
    which are made at the first call on offsets of their own (the plans are kept per offsets tensor)."""
    q = x["q"].detach().requires_grad_(True)
    d = x["d"].detach().requires_grad_(True)
    qo, do = x["qo"].clone(), x["do"].clone()

    def step() -> Grads:
        scores = maxsim_kernels.maxsim_varlen(q, qo, d, do)  # routes to the autograd path
        return torch.autograd.grad(scores, (q, d), x["g"])

    saved, mb._DD_PATH = mb._DD_PATH, dd_path
    try:
        step()
    finally:
        mb._DD_PATH = saved
    return step


def plain_autograd(x: dict) -> Callable[[], Grads]:
    nq, lq, nd, ld = x["shape"]
    q = x["q"].detach().view(nq, lq, DIM).requires_grad_(True)
    d = x["d"].detach().view(nd, ld, DIM).requires_grad_(True)
    q_mask = torch.ones(nq, lq, dtype=torch.bool, device=DEVICE)
    d_mask = torch.ones(nd, ld, dtype=torch.bool, device=DEVICE)

    def step() -> Grads:
        sims = torch.einsum("qid,bjd->qbij", q, d)
        sims = sims.masked_fill(~d_mask[None, :, None, :], float("-inf"))
        scores = (sims.amax(dim=-1) * q_mask[:, None, :]).sum(dim=-1).float()
        gq, gd = torch.autograd.grad(scores, (q, d), x["g"])
        return gq.reshape(nq * lq, DIM), gd.reshape(nd * ld, DIM)

    return step


def flash(x: dict, path: str) -> Callable[[], Grads]:
    from flash_maxsim.flash_maxsim_batched_train import flash_maxsim_batched_train

    nq, lq, nd, ld = x["shape"]
    q = x["q"].detach().view(nq, lq, DIM).requires_grad_(True)
    d = x["d"].detach().view(nd, ld, DIM).requires_grad_(True)

    def step() -> Grads:
        os.environ["FLASH_BWD_PATH"] = path  # read by its backward at call time
        scores = flash_maxsim_batched_train(q, d, shared_docs=True)
        gq, gd = torch.autograd.grad(scores, (q, d), x["g"])
        return gq.reshape(nq * lq, DIM), gd.reshape(nd * ld, DIM)

    return step


def lik(x: dict, backward: str | None) -> Callable[[], Grads]:
    from late_interaction_kernels import maxsim

    nq, lq, nd, ld = x["shape"]
    q = x["q"].detach().view(nq, lq, DIM).requires_grad_(True)
    d = x["d"].detach().view(nd, ld, DIM).requires_grad_(True)

    def step() -> Grads:
        scores = maxsim(q, d, backward=backward)
        gq, gd = torch.autograd.grad(scores, (q, d), x["g"])
        return gq.reshape(nq * lq, DIM), gd.reshape(nd * ld, DIM)

    return step


METHODS: dict[str, Callable[[dict], Callable[[], Grads]]] = {
    "ours": ours,
    "ours-csr": lambda x: ours(x, "csr"),
    "ours-onehot": lambda x: ours(x, "onehot"),
    "plain-autograd": plain_autograd,
    "flash-maxsim": lambda x: flash(x, "auto"),
    "flash-maxsim-invgrid": lambda x: flash(x, "invgrid"),
    "lik": lambda x: lik(x, None),
    "lik-lowmem": lambda x: lik(x, "lowmem"),
}
FP32_METHODS = ("ours", "plain-autograd")


def graph_time(step: Callable[[], Grads]) -> float | None:
    """Milliseconds of one step captured in a CUDA graph and replayed: the GPU's work and its launch gaps
    inside the graph, without the host's time to enqueue it. None where the step cannot be captured."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        ms = do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
        del graph
        return ms
    except Exception as exc:  # a method that syncs or allocates on the host inside the step
        log(f"graph capture failed: {type(exc).__name__}: {exc}"[:200])
        torch.cuda.synchronize()
        return None


def measure(method: str, x: dict, ref: Grads) -> dict:
    step = METHODS[method](x)
    first = step()  # compiles, autotunes
    second = step()
    repeatable = all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    errors = [rel_error(a, r) for a, r in zip(first, ref, strict=True)]
    del first, second
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del grads
    ms = do_bench(step, warmup=25, rep=100, return_mode="median")
    return {
        "fwd_bwd_ms": ms,
        "gpu_ms": graph_time(step),
        "host_ms": host_time(step),
        "fwd_bwd_ms_again": do_bench(step, warmup=25, rep=100, return_mode="median"),  # the spread
        "peak_mib": peak / 2**20,
        "rel_err_dq": errors[0],
        "rel_err_dd": errors[1],
        "bitwise_repeatable": repeatable,
    }


# ------------------------------------------------------------------------------------------------------
# our forward and backward, part by part
# ------------------------------------------------------------------------------------------------------


def profile_host(step: Callable[[], Grads], title: str, path: str, steps: int = 200) -> None:
    """Append the cProfile of `steps` enqueued steps (host time by function, no synchronisation) to path."""
    import cProfile
    import io
    import pstats

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(f"===== {title}: {steps} steps\n{text.getvalue()}\n")


# forward-with-argmax tiles timed by --argmax-tiles: (block_q, block_t, docs_per_prog, num_warps,
# num_stages); the table's own choice is timed as "table"
ARGMAX_TILES = [(128, 64, 64, 4, 3), (64, 64, 64, 4, 3)]


def argmax_tiles(x: dict) -> dict:
    """The forward with argmax on other tiles than the table's, each checked bitwise against it."""
    from maxsim_kernels import maxsim_forward as fwd

    def run(config: object) -> tuple[torch.Tensor, torch.Tensor]:
        return fwd.maxsim_varlen_forward_triton(
            x["q"], x["qo"], x["d"], x["do"], return_argmax=True, argmax_dtype=None, config=config
        )

    base = run(None)
    out = {"table": do_bench(lambda: run(None), return_mode="median")}
    for tile in ARGMAX_TILES:
        config = fwd.KernelConfig(*tile)
        try:
            scores, argmax = run(config)
            same = bool(torch.equal(scores, base[0]) and torch.equal(argmax, base[1]))
            out[str(tile)] = {"ms": do_bench(lambda c=config: run(c), return_mode="median"), "same": same}
        except Exception as exc:
            out[str(tile)] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    return out


def breakdown(x: dict, segment_sweep: bool, tiles: bool) -> dict:
    """Our forward and the parts of our backward, each timed alone."""
    q, d, qo, do, g = x["q"], x["d"], x["qo"], x["do"], x["g"]
    from maxsim_kernels.maxsim_forward import maxsim_varlen_forward_triton

    def fwd(*args: torch.Tensor, return_argmax: bool) -> Grads:  # the training step's forward (int16 argmax)
        return maxsim_varlen_forward_triton(*args, return_argmax=return_argmax, argmax_dtype=None)

    with torch.no_grad():
        _, argmax = fwd(q, qo, d, do, return_argmax=True)
    td, max_doc_len, max_query_len = d.shape[0], x["shape"][3], x["shape"][1]
    tq = mb._owner_of(qo, q.shape[0])

    def forward_only() -> Grads:
        return fwd(q, qo, d, do, return_argmax=True)

    def grad_docs(path: str = "csr") -> Callable[[], torch.Tensor]:
        """The backward's document gradient as the training step runs it, on one path ("csr": inverse
        map + dD, planned at the inverse map's current segment; "onehot")."""
        saved = mb._DD_PATH
        mb._DD_PATH = path
        try:
            plan = mb._AllPairsBackward(q, d, argmax, qo, do, max_doc_len, max_query_len)
        finally:
            mb._DD_PATH = saved
        return lambda: plan.grad_docs(q, d, g, argmax, qo, do)

    segments = {}
    saved = mb._CSR_MAX_SEGMENT, mb._CSR_MANY_DOCS_SEGMENT
    for segment in (512, 1024, 2048, 4096) if segment_sweep else ():  # the inverse map's segment
        mb._CSR_MAX_SEGMENT = mb._CSR_MANY_DOCS_SEGMENT = segment
        try:
            segments[str(segment)] = {
                "csr_build_ms": do_bench(
                    lambda: mb.build_inverse_csr_all_pairs(argmax, do, td, max_doc_len), return_mode="median"
                ),
                "csr_and_dd_ms": do_bench(grad_docs(), return_mode="median"),
            }
        finally:
            mb._CSR_MAX_SEGMENT, mb._CSR_MANY_DOCS_SEGMENT = saved
    onehot = grad_docs("onehot")
    return {
        "onehot_dd_ms": do_bench(onehot, return_mode="median"),
        "onehot_dd_rel_diff_to_csr": rel_error(onehot(), grad_docs("csr")().double()),
        "argmax_tiles": argmax_tiles(x) if tiles else None,
        "host_ms_per_step": host_time(ours(x)),
        "host_forward_ms": host_time(forward_only),
        "host_backward_ms": host_time(lambda: mb.maxsim_backward(g, argmax, q, qo, d, do)),
        "host_dq_launch_ms": host_time(
            lambda: mb._grad_queries_triton(d, None, do, argmax, g, qo, tq, None, None, q.shape[0], q.dtype)
        ),
        "csr_segment_sweep": segments,
        "forward_argmax_ms": do_bench(lambda: fwd(q, qo, d, do, return_argmax=True), return_mode="median"),
        "csr_build_ms": do_bench(
            lambda: mb.build_inverse_csr_all_pairs(argmax, do, td, max_doc_len), return_mode="median"
        ),
        "dq_kernel_ms": do_bench(
            lambda: mb._grad_queries_triton(d, None, do, argmax, g, qo, tq, None, None, q.shape[0], q.dtype),
            return_mode="median",
        ),
        "csr_and_dd_ms": do_bench(grad_docs(), return_mode="median"),
        "backward_ms": do_bench(lambda: mb.maxsim_backward(g, argmax, q, qo, d, do), return_mode="median"),
    }


# ------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results JSON (rewritten after every row)")
    parser.add_argument(
        "--shapes",
        default=",".join(TRAIN_SHAPES),
        help=f"comma-separated shape names, of: {', '.join(SHAPES)}",
    )
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated method names")
    parser.add_argument("--fp32-shapes", default=",".join(SHAPES), help="shapes also run with fp32 inputs")
    parser.add_argument(
        "--profile-host", default=None, help="write a cProfile of our step's host time (per shape) here"
    )
    parser.add_argument("--segment-sweep", action="store_true", help="time the inverse map's segments")
    parser.add_argument("--argmax-tiles", action="store_true", help="time forward-with-argmax tiles")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the breakdown of our step")
    args = parser.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 rows compute in fp32
    result = {
        "benchmark": "train",
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dim": DIM,
        "command": "python benchmarks/bench_train.py " + " ".join(sys.argv[1:]),
        "rows": [],
        "breakdown": [],
    }

    def save() -> None:
        write_json(args.out, result)

    started = time.perf_counter()
    for shape_name in args.shapes.split(","):
        for dtype in (torch.float16, torch.float32):
            if dtype == torch.float32 and shape_name not in args.fp32_shapes.split(","):
                continue
            x = training_inputs(*SHAPES[shape_name], dtype, seed=0, dev=DEVICE)
            ref = reference_grads(x)
            for method in args.methods.split(","):
                if dtype == torch.float32 and method not in FP32_METHODS:
                    continue
                row = {"shape": shape_name, "dtype": str(dtype).removeprefix("torch."), "method": method}
                try:
                    row.update(measure(method, x, ref))
                except Exception as exc:  # a peer failing on a shape is a result, not a crash
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                result["rows"].append(row)
                log(f"[{time.perf_counter() - started:6.1f}s] {json.dumps(row)}")
                save()
            if "ours" in args.methods.split(",") and args.profile_host and dtype == torch.float16:
                profile_host(ours(x), f"{shape_name} {dtype}", args.profile_host)
            if "ours" in args.methods and not args.no_breakdown and dtype == torch.float16:
                bd = {
                    "shape": shape_name,
                    "dtype": str(dtype).removeprefix("torch."),
                    **breakdown(x, args.segment_sweep, args.argmax_tiles),
                }
                result["breakdown"].append(bd)
                log(f"[{time.perf_counter() - started:6.1f}s] {json.dumps(bd)}")
                save()
            del x, ref
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
