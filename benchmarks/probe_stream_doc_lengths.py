"""Where the Gluon stream kernel's time goes by document length: one query of 32 tokens against 16.0M tokens
of int4 codes and of int8 values (the same random unit vectors, d = 128), cut into documents of one length
each, and into ragged documents of 20-300 tokens (the benchmark's corpus). Per length the number of tiles
(64 tokens) and of document ends differ, so the differences between rows price a tile and a document's end.

    python benchmarks/probe_stream_doc_lengths.py

Prints one line a corpus: tokens, documents and the `triton.testing.do_bench` median (ms) of each format on
`maxsim_int8_hopper_stream.stream_with_tiles` with the shipped tiles. Needs an sm_90 GPU.
"""

from __future__ import annotations

import torch
import triton


def main() -> None:
    from maxsim_kernels import maxsim_int8_hopper_stream as stream
    from maxsim_kernels.code_packing import encode_int4
    from maxsim_kernels.int8_host import quantize_per_token

    torch.manual_seed(0)
    tokens = 16_000_000
    x = torch.randn(tokens, 128, device="cuda", dtype=torch.float16).float()
    x = torch.nn.functional.normalize(x, dim=1).half()
    formats = {"int4": encode_int4(x), "int8": quantize_per_token(x)}
    del x
    query = torch.nn.functional.normalize(torch.randn(32, 128, device="cuda"), dim=1).half()
    q8, sq = quantize_per_token(query)
    q_off = torch.tensor([0, 32], device="cuda")
    corpora = {
        "ragged20-300": torch.randint(20, 301, (100_000,)),
        **{f"len{n}": torch.full((tokens // n,), n) for n in (64, 128, 160, 2560)},
    }
    for name, lengths in corpora.items():
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        offsets[1:] = lengths.cumsum(0)
        offsets = offsets[offsets <= tokens].cuda()
        row = {}
        for codec, (docs, scales) in formats.items():

            def call(docs=docs, scales=scales, offsets=offsets):
                return stream.stream_with_tiles(q8, sq, q_off, None, None, docs, scales, offsets, 32)

            row[codec] = round(triton.testing.do_bench(call, rep=100), 4)
        print(name, int(offsets[-1]), offsets.numel() - 1, row, flush=True)


if __name__ == "__main__":
    main()
