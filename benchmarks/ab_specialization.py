"""A/B of Triton's argument specialization on the one-query workload (1 query x 100K documents of 20-300
tokens, dim 128), int8 and fp16, in one process on one GPU.

Triton compiles a kernel variant per argument that is 1 or a multiple of 16 unless told not to. The
kernels turn that off for sizes (no recompiles within a bucket); this script measures what it costs by
loading copies of the kernel modules with the specialization put back, or with the int8 one-query
bucket (the ONE_QUERY constexpr) taken out:

    python benchmarks/ab_specialization.py            # on the H200; prints ms per variant, two rounds

Results: benchmarks/results/kernels/ab-specialization-h200.txt.
"""

from __future__ import annotations

import importlib
import pathlib
import re

import maxsim_kernels
import torch
import triton

PACKAGE = pathlib.Path(maxsim_kernels.__file__).parent
VARIANTS = ("as_is", "all_specialized", "no_one_query_bucket")


def load_variant(module: str, variant: str):  # noqa: ANN201
    """A copy of maxsim_kernels.<module> with the variant's edit, imported under a private name."""
    src = (PACKAGE / f"{module}.py").read_text()
    if variant == "all_specialized":
        src = re.sub(r"@triton\.jit\([^@]*?\)\n(def )", r"@triton.jit\n\1", src)
    elif variant == "no_one_query_bucket":
        src = src.replace("ONE_QUERY=nq == 1", "ONE_QUERY=False")
    name = f"_ab_{module}_{variant}"
    (PACKAGE / f"{name}.py").write_text(src)
    return importlib.import_module(f"maxsim_kernels.{name}")


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(20, 301, (100_000,), generator=gen)
    offsets = torch.zeros(len(lens) + 1, dtype=torch.int64)
    offsets[1:] = lens.cumsum(0)
    docs = torch.nn.functional.normalize(torch.randn(int(offsets[-1]), 128, device="cuda"), dim=-1).half()
    query = torch.nn.functional.normalize(torch.randn(32, 128, device="cuda"), dim=-1).half()
    q_off, d_off = torch.tensor([0, 32], device="cuda"), offsets.cuda()
    modules = {v: (load_variant("maxsim_int8", v), load_variant("maxsim_forward", v)) for v in VARIANTS}
    try:
        for round_ in (1, 2):
            for variant, (int8, fp16) in modules.items():
                codes, scales = int8.quantize_per_token(docs)

                def run_int8(int8=int8, codes=codes, scales=scales):  # noqa: ANN001, ANN202
                    return int8.maxsim_varlen_int8(query, q_off, codes, d_off, doc_scales=scales)

                def run_fp16(fp16=fp16):  # noqa: ANN001, ANN202
                    return fp16.maxsim_varlen_forward_triton(query, q_off, docs, d_off)

                ms = [
                    triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median")
                    for f in (run_int8, run_fp16)
                ]
                print(f"round {round_} {variant:22s} int8 {ms[0]:.3f} ms  fp16 {ms[1]:.3f} ms", flush=True)
    finally:
        for path in PACKAGE.glob("_ab_*.py"):
            path.unlink()


if __name__ == "__main__":
    main()
