"""Where a training step's host time goes, piece by piece (H200 probe for the ColBERT shapes).

At ColBERT 128 queries x 32 tokens against 128 documents x 180 tokens our forward + backward is bound by
host time (0.54 ms enqueued for 0.29 ms of GPU work, docs/benchmarks.md). This script times, in host
microseconds per call with nothing synchronised inside the loop:

- our step (forward with autograd, `torch.autograd.grad`), our forward alone, our backward alone;
- the dQ launcher (`_grad_queries_triton`: an allocation, argument handling, one launch);
- the same kernel through Triton's JIT dispatch (`kernel[grid](...)`) and through the compiled kernel's
  own launcher (`kernel.warmup(...)[grid](...)`: no argument binding, specialisation or cache lookup);
  the difference bounds what a leaner launch path could save a launch (four a step);
- `torch.empty` on the GPU, and the autograd floor: an identity `torch.autograd.Function` with one
  output, and one with a second, non-differentiable output as ours has (the argmax).

    python benchmarks/probe_host_overhead.py [--out probe-host-h200.json]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import maxsim_kernels
import torch
from common import host_time, write_json
from maxsim_kernels import maxsim_backward as mb
from maxsim_kernels._validate import cdiv


def host_us(fn: Callable[[], object], calls: int = 2000) -> float:
    """Microseconds of host time per call (`common.host_time`: enqueued, no synchronisation)."""
    return host_time(fn, calls) * 1e3


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return g


class _IdentityWithIndex(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index):  # noqa: ANN001, ANN205
        ctx.mark_non_differentiable(index)
        ctx.set_materialize_grads(False)
        return x.view_as(x), index

    @staticmethod
    def backward(ctx, g, _g_index):  # noqa: ANN001, ANN205
        return g, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    nq, lq, nd, ld, dim = 128, 32, 128, 180, 128
    q = torch.nn.functional.normalize(torch.randn(nq * lq, dim, device=dev, generator=gen), dim=1).half()
    d = torch.nn.functional.normalize(torch.randn(nd * ld, dim, device=dev, generator=gen), dim=1).half()
    qo = torch.arange(0, nq * lq + 1, lq, device=dev)
    do = torch.arange(0, nd * ld + 1, ld, device=dev)
    g = torch.randn(nq, nd, device=dev, generator=gen)
    qg, dg = q.clone().requires_grad_(True), d.clone().requires_grad_(True)
    with torch.no_grad():
        _, argmax = maxsim_kernels.maxsim_varlen(q, qo, d, do, return_argmax=True)
    argmax16 = argmax.to(torch.int16)
    token_query = mb._owner_of(qo, q.shape[0])
    results: dict[str, object] = {}

    def step() -> object:
        scores = maxsim_kernels.maxsim_varlen(qg, qo, dg, do)
        return torch.autograd.grad(scores, (qg, dg), g)

    results["step_us"] = host_us(step, 500)
    results["forward_autograd_us"] = host_us(lambda: maxsim_kernels.maxsim_varlen(qg, qo, dg, do), 1000)
    results["forward_no_grad_us"] = host_us(
        lambda: maxsim_kernels.maxsim_varlen(q, qo, d, do, return_argmax=True)
    )
    results["backward_us"] = host_us(lambda: mb.maxsim_backward(g, argmax16, q, qo, d, do))
    dq_args = (d, None, do, argmax16, g, qo, token_query, None, None, q.shape[0], q.dtype)
    results["dq_launcher_us"] = host_us(lambda: mb._grad_queries_triton(*dq_args))

    # the dQ kernel alone, through the JIT and through its compiled launcher
    out = torch.empty_like(q)
    grid = (cdiv(q.shape[0], mb._DQ_BLOCK_T), 1, 1)
    kernel_args = (
        d,
        do,
        do,
        argmax16,
        g,
        qo,
        token_query,
        do,
        do,
        out,
        q.shape[0],
        nd,
        0,
        dim,
        d.stride(0),
        out.stride(0),
    )
    meta = dict(
        CANDIDATES=False, HAS_SCALES=False, BLOCK_T=mb._DQ_BLOCK_T, BLOCK_C=mb._DQ_BLOCK_C, BLOCK_DIM=128
    )
    kernel = mb._maxsim_grad_queries_kernel
    results["jit_launch_us"] = host_us(lambda: kernel[grid](*kernel_args, **meta, num_warps=mb._DQ_NUM_WARPS))
    try:
        compiled = kernel.warmup(*kernel_args, **meta, num_warps=mb._DQ_NUM_WARPS, grid=grid)
        ordered = list(kernel_args) + [meta[name] for name in kernel.arg_names[len(kernel_args) :]]
        runner = compiled[grid]
        stream = torch.cuda.current_stream().cuda_stream
        runner(*ordered, stream=stream)
        torch.cuda.synchronize()
        reference = out.clone()
        out.zero_()
        runner(*ordered, stream=stream)
        torch.cuda.synchronize()
        results["compiled_launch_same_result"] = bool(torch.equal(out, reference))
        results["compiled_launch_us"] = host_us(lambda: runner(*ordered, stream=stream))
    except Exception as exc:  # noqa: BLE001 - an API this Triton release does not have
        results["compiled_launch_error"] = f"{type(exc).__name__}: {exc}"

    results["torch_empty_us"] = host_us(lambda: torch.empty((nq * lq, dim), device=dev, dtype=torch.float16))
    x = torch.randn(nq, nd, device=dev, requires_grad=True)
    index = torch.zeros(nq, nd, device=dev, dtype=torch.int16)
    results["autograd_identity_us"] = host_us(lambda: torch.autograd.grad(_Identity.apply(x), (x,), g), 1000)
    results["autograd_identity_two_outputs_us"] = host_us(
        lambda: torch.autograd.grad(_IdentityWithIndex.apply(x, index)[0], (x,), g), 1000
    )
    for key, value in results.items():
        print(f"{key:36s} {value:.1f}" if isinstance(value, float) else f"{key:36s} {value}")
    write_json(args.out, results)


if __name__ == "__main__":
    main()
