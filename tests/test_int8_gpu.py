"""INT8 x INT8 MaxSim on the GPU at realistic sizes, against the float64 integer-math reference.

Tolerances as in tests/test_int8.py: the argmax must be identical (every path and the reference round
``s_d[j] * acc[i, j]`` once to fp32 from the exact integer), and a score may differ from the float64
reference by the fp32 rounding of the query-scale products and of the sum over the L query tokens:
``|err| <= 2 (L + 1) 2^-24 B`` with ``B = sum_i s_q[i] max_j s_d[j] (|q8_i| . |d8_j|)``, an upper bound on
``sum_i |s_q[i] max_j s_d[j] acc[i, j]|`` computed by the same reference on the codes' magnitudes.
"""

from __future__ import annotations

import pytest
import torch
from maxsim_kernels.maxsim_int8 import (
    maxsim_candidates_int8,
    maxsim_int8_reference,
    maxsim_varlen_int8,
    quantize_per_token,
)

pytestmark = pytest.mark.gpu
EPS32 = 2.0**-24


def ragged(n: int, low: int, high: int, dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n L2-normalised ragged items of low..high tokens on the GPU: (values fp16 [T, dim], offsets)."""
    lengths = torch.randint(low, high + 1, (n,), generator=gen)
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    values = torch.nn.functional.normalize(torch.randn(int(offsets[-1]), dim, generator=gen), dim=1)
    return values.half().cuda(), offsets.cuda()


def score_tolerance(queries, qo, d8, do, sd) -> torch.Tensor:
    """2 (L + 1) 2^-24 B per (query, document); see the module docstring."""
    q8, sq = quantize_per_token(queries) if queries.is_floating_point() else (queries, None)
    bound = maxsim_int8_reference(q8.abs(), qo, d8.abs(), do, doc_scales=sd, query_scales=sq)
    return 2 * (qo.diff().double()[:, None] + 1) * EPS32 * bound


def assert_scores(scores, reference, atol) -> None:
    err = (scores.double() - reference).abs()
    assert torch.isfinite(scores).all()
    assert (err <= atol).all(), (
        f"max error {err.max().item():.3g}, worst ratio {(err / atol).max().item():.3g}"
    )


def check(scores, arg, queries, qo, d8, do, sd) -> None:
    ref, ref_arg = maxsim_int8_reference(queries, qo, d8, do, doc_scales=sd, return_argmax=True)
    assert_scores(scores, ref, score_tolerance(queries, qo, d8, do, sd))
    mismatch = (arg != ref_arg).sum().item()
    assert mismatch == 0, f"{mismatch} argmax mismatches of {arg.numel()}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_quantize_kernel_matches_torch_bitwise(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, 128, generator=gen) * torch.rand(100_000, 1, generator=gen)
    x[0] = 0
    x[1, :4] = torch.tensor([127.0, 2.5, -2.5, 3.5])
    x[1, 4:] = 0
    x = x.to(dtype)
    codes, scales = quantize_per_token(x.cuda())
    want_codes, want_scales = quantize_per_token(x, backend="torch")
    assert torch.equal(codes.cpu(), want_codes)
    assert torch.equal(scales.cpu(), want_scales)


@pytest.mark.parametrize(
    "nq,q_len,nd,dim",
    [
        (64, 32, 5000, 128),  # many queries: the tensor-core path, 4 queries per tile
        (1, 32, 20000, 128),  # one query: the memory-bound path
        (7, 13, 3000, 96),  # ragged group boundaries, dim not a power of two
        (5, 20, 1000, 384),  # wider than the exact-bias conversion
        (3, 300, 500, 128),  # queries longer than one tile (ColPali-like)
    ],
)
def test_varlen_exact_at_size(nq: int, q_len: int, nd: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(nq * 7 + dim)
    queries, qo = ragged(nq, q_len // 2 + 1, q_len, dim, gen)
    docs, do = ragged(nd, 20, 300, dim, gen)
    d8, sd = quantize_per_token(docs)
    scores, arg = maxsim_varlen_int8(queries, qo, d8, do, doc_scales=sd, return_argmax=True)
    check(scores, arg, queries, qo, d8, do, sd)
    assert torch.equal(maxsim_varlen_int8(queries, qo, d8, do, doc_scales=sd), scores)
    # Offsets from the host (as `maxsim score` passes them): checked there, same scores.
    assert torch.equal(maxsim_varlen_int8(queries, qo.cpu(), d8, do.cpu(), doc_scales=sd), scores)
    # The torch path on the same CUDA tensors: identical argmax, scores within the same bound.
    scores_t, arg_t = maxsim_varlen_int8(
        queries, qo, d8, do, doc_scales=sd, return_argmax=True, backend="torch"
    )
    assert torch.equal(arg_t, arg)
    torch.testing.assert_close(scores_t, scores, rtol=1e-5, atol=1e-5)


def test_candidates_exact_at_size() -> None:
    gen = torch.Generator().manual_seed(1)
    queries, qo = ragged(16, 20, 32, 128, gen)
    docs, do = ragged(8000, 20, 300, 128, gen)
    d8, sd = quantize_per_token(docs)
    counts = torch.randint(0, 600, (16,), generator=gen)
    cand_off = torch.zeros(17, dtype=torch.int64)
    cand_off[1:] = counts.cumsum(0)
    cand_docs = torch.randint(0, 8000, (int(cand_off[-1]),), generator=gen).cuda()
    cand_off = cand_off.cuda()
    scores, arg = maxsim_candidates_int8(
        queries, qo, d8, do, cand_off, cand_docs, doc_scales=sd, return_argmax=True
    )
    ref, ref_arg = maxsim_int8_reference(queries, qo, d8, do, doc_scales=sd, return_argmax=True)
    owner = torch.repeat_interleave(torch.arange(16, device="cuda"), counts.cuda())
    atol = score_tolerance(queries, qo, d8, do, sd)[owner, cand_docs]
    assert_scores(scores, ref[owner, cand_docs], atol)
    q_len = qo.diff()
    for q in range(16):
        rows = slice(int(qo[q]), int(qo[q + 1]))
        mine = arg[cand_off[q] : cand_off[q + 1]]
        assert torch.equal(
            mine[:, : int(q_len[q])], ref_arg[rows, cand_docs[cand_off[q] : cand_off[q + 1]]].T
        )
        assert (mine[:, int(q_len[q]) :] == -1).all()


def test_offsets_past_2_31_bytes() -> None:
    """Documents whose bytes start beyond 2^31: 64-bit index arithmetic (the peers' overflow bug)."""
    dim = 128
    n_tokens = (1 << 31) // dim + 100_000  # 2.16 GB of int8 tokens
    gen = torch.Generator(device="cuda").manual_seed(2)
    d8 = torch.randint(-127, 128, (n_tokens, dim), dtype=torch.int8, device="cuda", generator=gen)
    sd = torch.rand(n_tokens, device="cuda", generator=gen) * 1e-3 + 1e-4
    lengths = torch.full((n_tokens // 200,), 200, dtype=torch.int64)
    lengths[-1] += n_tokens - int(lengths.sum())
    do = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    do[1:] = lengths.cumsum(0)
    do = do.cuda()
    queries = torch.randn(32, dim, device="cuda", generator=gen)
    qo = torch.tensor([0, 32], device="cuda")
    scores, arg = maxsim_varlen_int8(queries, qo, d8, do, doc_scales=sd, return_argmax=True)
    tail = 300  # the last documents, all past 2^31 bytes: check them against the reference on their slice
    first_doc = do.numel() - 1 - tail
    start = int(do[first_doc])
    assert start * dim > 2**31
    sub_off = do[first_doc:] - start
    ref, ref_arg = maxsim_int8_reference(
        queries, qo, d8[start:], sub_off, doc_scales=sd[start:], return_argmax=True
    )
    assert_scores(scores[:, first_doc:], ref, score_tolerance(queries, qo, d8[start:], sub_off, sd[start:]))
    assert torch.equal(arg[:, first_doc:], ref_arg)
