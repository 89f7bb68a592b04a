"""Where the first `maxsim_varlen` call of a process spends its time (H200 diagnosis).

`profile_first_pass.py` showed the first `maxsim score` pass of a fresh process losing 0.66-0.82 s on its
first document batch, host and GPU alike, with Triton's disk cache already filled: the first kernel
launch of the process. This script makes that call in a fresh process, on the shapes of the score
benchmark (512 queries x 32 tokens, fp16, d = 128), under cProfile, and prints the functions with the
most cumulative time, then times a second call.

    python benchmarks/profile_first_launch.py [--rows 45]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

t_start = time.perf_counter()
import torch  # noqa: E402

t_torch = time.perf_counter()
import maxsim_kernels  # noqa: E402

t_kernels = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=45)
    args = parser.parse_args()
    print(f"import torch {t_torch - t_start:.3f} s, import maxsim_kernels {t_kernels - t_torch:.3f} s")
    t0 = time.perf_counter()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    print(f"CUDA context {time.perf_counter() - t0:.3f} s")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(512 * 32, 128, device="cuda", generator=gen).half()
    q_off = torch.arange(0, 512 * 32 + 1, 32, dtype=torch.int64)
    lengths = torch.randint(20, 301, (700,), generator=gen, device="cuda").cpu()
    d_off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    d = torch.randn(int(d_off[-1]), 128, device="cuda", generator=gen).half()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    maxsim_kernels.maxsim_varlen(q, q_off, d, d_off)
    torch.cuda.synchronize()
    prof.disable()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    maxsim_kernels.maxsim_varlen(q, q_off, d, d_off)
    torch.cuda.synchronize()
    second = time.perf_counter() - t0
    t0 = time.perf_counter()
    keys = torch.randint(0, 1 << 60, (512, 1719), device="cuda")
    torch.topk(keys, 1000, dim=1, sorted=False)
    torch.cuda.synchronize()
    print(f"first call {first:.3f} s (under cProfile), second {second * 1e3:.2f} ms; "
          f"first topk {time.perf_counter() - t0:.3f} s")  # fmt: skip
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.rows)
        print(buf.getvalue())


if __name__ == "__main__":
    main()
