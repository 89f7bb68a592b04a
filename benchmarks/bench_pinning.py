"""Page-locking host memory for the staging arena, several ways, each in a fresh process.

What `maxsim score` pays before its first batch can be copied at full speed: page-locking the pinned
staging arena (492 MiB, in 56 MiB pieces as `pipeline.PinnedArena` does). Variants:
  torch_pieces             torch.empty(pin_memory=True) a piece (PyTorch's cudaHostAlloc)
  torch_one                torch.empty(pin_memory=True), one block
  register                 anonymous mmap a piece, cudaHostRegister (which faults the pages in)
  register_touch           the same, pages touched first (memset)
  register_huge_touch      the same, advised MADV_HUGEPAGE first (2 MiB pages): `pipeline.lock_huge_pages`
  torch_pageable_register  torch.empty a piece, cudaHostRegister
  torch_register_threads   torch.empty(pin_memory=True) a piece, PyTorch's allocator set to register
                           malloc'ed memory with 8 threads (pinned_use_cuda_host_register)
Each line also gives the host-to-GPU copy rate from the locked memory.

    python benchmarks/bench_pinning.py > benchmarks/results/host/pin-h200.txt
"""

from __future__ import annotations

import ctypes
import json
import mmap
import subprocess
import sys
import time

TOTAL = 512 << 20
PIECE = 56 << 20
VARIANTS = ["torch_pieces", "torch_one", "register", "register_touch", "register_huge_touch",
            "torch_pageable_register", "torch_register_threads"]  # fmt: skip


def lock(variant: str) -> list:
    import torch

    pieces = TOTAL // PIECE
    if variant == "torch_register_threads":
        torch.cuda.memory._set_allocator_settings(
            "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
        )
    if variant in ("torch_pieces", "torch_register_threads"):
        return [torch.empty(PIECE, dtype=torch.uint8, pin_memory=True) for _ in range(pieces)]
    if variant == "torch_one":
        return [torch.empty(pieces * PIECE, dtype=torch.uint8, pin_memory=True)]
    cudart = torch.cuda.cudart()
    keep = []
    for _ in range(pieces):
        if variant == "torch_pageable_register":
            buf = torch.empty(PIECE, dtype=torch.uint8)
            address = buf.data_ptr()
        else:
            mapping = mmap.mmap(-1, PIECE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if "huge" in variant:
                mapping.madvise(mmap.MADV_HUGEPAGE)
            view = (ctypes.c_char * PIECE).from_buffer(mapping)
            address = ctypes.addressof(view)
            if "touch" in variant:
                ctypes.memset(address, 0, PIECE)
            buf = torch.frombuffer(view, dtype=torch.uint8)
        assert int(cudart.cudaHostRegister(address, PIECE, 0)) == 0
        keep.append(buf)
    return keep


def measure(variant: str) -> dict:
    import torch

    torch.empty(1, device="cuda")  # CUDA context first: it is not part of the locking
    start = time.perf_counter()
    pieces = lock(variant)
    lock_s = time.perf_counter() - start
    src = pieces[0][:PIECE]
    dst = torch.empty(PIECE, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    rate = 10 * PIECE / (time.perf_counter() - start) / 1e9
    return {"variant": variant, "lock_s": lock_s, "GiB": TOTAL // PIECE * PIECE / 2**30, "h2d_GBps": rate}


def main() -> None:
    if len(sys.argv) > 1:
        print(json.dumps(measure(sys.argv[1])))
        return
    for _ in range(2):  # two rounds, variants interleaved: the machine is shared and noisy
        for variant in VARIANTS:
            out = subprocess.run([sys.executable, __file__, variant], capture_output=True, text=True)
            print(out.stdout.strip() or out.stderr[-500:], flush=True)


if __name__ == "__main__":
    main()
