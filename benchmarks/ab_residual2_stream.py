"""The residual2 scan on the Gluon stream kernel under several tiles, for comparing two versions of it: run
it from each version's tree (its `maxsim_kernels` and `maxsim_cli` first on the path), as alternating
processes, and compare the lines. Needs an sm_90 GPU.

    for round in 1 2; do for tree in A B; do
        (cd $tree && python benchmarks/ab_residual2_stream.py $tree)
    done; done

One query of 32 tokens against 100K documents of 20-300 tokens (16.0M tokens; random unit vectors), as
residual2 codes of a 4,096-centroid codebook trained by `train_codebook` (`bench_codes.py`'s corpus); the
query side from whichever the tree has (`residual2_stream_tables`, else `residual2_query_tables`). One
JSON line: fp16 through `maxsim_varlen` beside it, the codes through `maxsim_varlen` (the tree's tuned
tiles), and `stream_with_tiles` under each configuration "items/ring/tiles a turn/register cap" (0: no
cap); `triton.testing.do_bench` medians of 100 ms.
"""

from __future__ import annotations

import json
import sys

import torch
from common import median_ms

CONFIGS = [(32, 6, 2, 128), (32, 6, 2, 168), (32, 6, 2, 0), (32, 4, 2, 0), (32, 4, 2, 168), (32, 8, 2, 0),
           (64, 4, 2, 0)]  # fmt: skip


def main() -> None:
    from maxsim_kernels import maxsim_codes, maxsim_varlen
    from maxsim_kernels import maxsim_int8_hopper_stream as stream
    from maxsim_kernels.int8_host import quantize_per_token

    from maxsim_cli.codecs import encode, train_codebook

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    n = 100_000
    lengths = torch.randint(20, 301, (n,), generator=gen)
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    x = torch.randn(int(offsets[-1]), 128, generator=gen).to(dev)
    docs = torch.nn.functional.normalize(x, dim=1).half()
    offsets = offsets.to(dev)
    sample = docs[torch.randperm(docs.shape[0], generator=gen)[: 1 << 18].to(dev)]
    book = train_codebook(sample, 4096, device=dev)
    codes, _ = encode("residual2-kmeans", docs, book)
    kb = book.for_kernels(dev)
    q = torch.nn.functional.normalize(torch.randn(32, 128, generator=gen), dim=1).to(dev, torch.float16)
    q_off = torch.tensor([0, 32], device=dev)
    q8, sq = quantize_per_token(q)
    make = getattr(maxsim_codes, "residual2_stream_tables", None) or maxsim_codes.residual2_query_tables
    tables = make(q8, kb)
    out = {
        "tag": sys.argv[1] if len(sys.argv) > 1 else "",
        "fp16_ms": median_ms(lambda: maxsim_varlen(q, q_off, docs, offsets), 100),
        "varlen_ms": median_ms(lambda: maxsim_varlen(q, q_off, codes, offsets, codebook=kb), 100),
    }
    for items, stages, group, cap in CONFIGS:
        cfg = dict(items_per_prog=items, stages=stages, group=group, maxnreg=cap)

        def call(cfg=cfg):
            return stream.stream_with_tiles(
                q8, sq, q_off, None, None, codes, None, offsets, 32, residual=tables, **cfg
            )

        out[f"{items}/{stages}/{group}/{cap}"] = median_ms(call, 100)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
