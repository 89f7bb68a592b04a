"""What the residual2 scan's centroid table costs on its own: a floor for the 2-bit scan that no product or
unpacking can lower.

    python benchmarks/probe_table_gather.py --out benchmarks/results/codes/table-gather-h100.json

For one query of Lq tokens the scan adds, to every document token's products, the token's row of the
centroid table (fp32 [K, Lq]: ``q8 . (C[c] + W[:, 0])`` for each centroid c, `maxsim_codes`), gathered by
the token's centroid id: 4 Lq bytes a token from L2 (128 at Lq = 32), 3.6x the 36 bytes of codes the scan
reads from HBM. This script times a Triton kernel that does only that: for each token it loads the id
(and, with ``codes``, its 36-byte row, as the scan reads it) and takes the max of the gathered rows over
a program's tokens, so nothing is written but one row a program. Two table sizes: K = 4,096 (512 KB at
Lq = 32, `bench_codes.py`'s corpus) and K = 2^18 (32 MB, `bench_scale.py`'s 1B-token codebook), random
ids; 16.0M tokens (one query x 100K documents) and, with ``--scale``, 1B tokens. Reported: the time, the
table bytes gathered a second, and the scan's figures it bounds.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from common import SMOKE, device, make_log, median_ms, meta, smoke_size, write_json

log = make_log("table_gather", clock=True)
ROW_BYTES = 36  # a residual2 row at d = 128: the centroid id and 32 bytes of buckets


@triton.jit
def _gather_max_kernel(codes_ptr, tab_ptr, out_ptr, n_tokens, stride_tab, N: tl.constexpr,
                       BLOCK: tl.constexpr, TILES: tl.constexpr, WITH_CODES: tl.constexpr):  # fmt: skip
    """Program p: tokens [p * TILES * BLOCK, (p + 1) * TILES * BLOCK); the max over them of the table rows
    of their ids (int32 word 0 of each 9-word row); WITH_CODES also reads words 1-8 of each row and adds
    their XOR times 0.0 (a product the compiler keeps: it would be NaN for an infinite factor)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, N)
    best = tl.full([BLOCK, N], float("-inf"), tl.float32)
    for t in range(TILES):
        rows = (pid * TILES + t) * BLOCK + tl.arange(0, BLOCK)
        ok = rows < n_tokens
        at = rows.to(tl.int64) * 9
        ids = tl.load(codes_ptr + at, mask=ok, other=0)
        row = tl.load(tab_ptr + ids.to(tl.int64)[:, None] * stride_tab + cols[None, :], mask=ok[:, None],
                      other=float("-inf"))  # fmt: skip
        if WITH_CODES:
            words = tl.load(codes_ptr + at[:, None] + 1 + tl.arange(0, 8)[None, :], mask=ok[:, None], other=0)
            row = row + tl.xor_sum(words, axis=1).to(tl.float32)[:, None] * 0.0
        best = tl.maximum(best, row)
    tl.store(out_ptr + pid * N + cols, tl.max(best, axis=0))


def gather_max(codes: torch.Tensor, table: torch.Tensor, with_codes: bool, block: int = 64, tiles: int = 32):
    n_tokens, n = codes.shape[0], table.shape[1]
    progs = triton.cdiv(n_tokens, block * tiles)
    out = torch.empty(progs, n, dtype=torch.float32, device=codes.device)
    _gather_max_kernel[(progs,)](codes, table, out, n_tokens, table.stride(0), N=n, BLOCK=block, TILES=tiles,
                                WITH_CODES=with_codes, num_warps=4)  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--rep-ms", type=int, default=200)
    parser.add_argument("--query-tokens", type=int, nargs="+", default=[32, 16])
    parser.add_argument("--scale", action="store_true", help="also 1B tokens (36 GB of codes)")
    parser.add_argument("--smoke", action="store_true", help="a check of the script: tiny sizes, one call")
    args = parser.parse_args()
    SMOKE["on"] = args.smoke
    dev = device()
    gen = torch.Generator(device=dev).manual_seed(0)
    record: dict = {"meta": meta(dim=128), "rows": []}
    sizes = [smoke_size(16_000_000)] + ([smoke_size(1_000_000_000)] if args.scale else [])
    for n_tokens in sizes:
        codes = torch.randint(
            -(2**31), 2**31 - 1, (n_tokens, 9), dtype=torch.int32, device=dev, generator=gen
        )
        for k in (4096, 1 << 18):
            codes[:, 0] = torch.randint(0, k, (n_tokens,), dtype=torch.int32, device=dev, generator=gen)
            for lq in args.query_tokens:
                table = torch.randn(k, lq, device=dev, generator=gen)
                for with_codes in (False, True):
                    call = lambda c=codes, t=table, w=with_codes: gather_max(c, t, w)  # noqa: E731
                    ms = median_ms(call, args.rep_ms)
                    gathered = n_tokens * lq * 4
                    row = {"tokens": n_tokens, "centroids": k, "query_tokens": lq, "with_codes": with_codes,
                           "table_bytes": k * lq * 4, "ms": ms, "gathered_TBps": gathered / ms / 1e9,
                           "codes_TBps": n_tokens * ROW_BYTES / ms / 1e9 if with_codes else None}  # fmt: skip
                    record["rows"].append(row)
                    log(f"{n_tokens} tokens, K={k}, Lq={lq}, codes={with_codes}: {ms:.3f} ms, "
                        f"{row['gathered_TBps']:.2f} TB/s gathered")  # fmt: skip
                    write_json(args.out, record)


if __name__ == "__main__":
    main()
