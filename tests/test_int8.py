"""INT8 x INT8 MaxSim on CPU: the Triton kernels under the interpreter and the torch path, against the
float64 evaluation of the same integer math (`maxsim_int8_reference`).

Tolerances. The argmax must match exactly: every path rounds ``s_d[j] * acc[i, j]`` once to fp32 from the
exact integer `acc`, and the reference does the same (`round_products=True`), so the max is the same
number everywhere and ties go to the lowest index. Scores then differ from the float64 reference only by
the fp32 query-scale products and the fp32 sum over the query's tokens: at most (L + 1) roundings of
2^-24 relative to the sum of the terms' magnitudes (L = query length), hence
``atol = (L + 1) * 2^-24 * sum_i |s_q[i] * max_j(...)|``, with a factor 2 of slack.
"""

from __future__ import annotations

import os

import pytest
import torch
from maxsim_kernels.int8_host import (
    maxsim_candidates_int8,
    maxsim_int8_reference,
    maxsim_varlen_int8,
    quantize_per_token,
)

EPS32 = 2.0**-24
# These tests hand CPU tensors to the Triton kernels: only Triton's interpreter runs them (set by
# conftest on machines without a GPU); tests/test_int8_gpu.py covers the compiled kernels.
_NEEDS_TRITON = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)
BACKENDS = ["torch", pytest.param("triton", marks=_NEEDS_TRITON)]


def packed(
    lengths: list[int], dim: int, gen: torch.Generator, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random float tokens (both signs) packed [T, dim] with int64 offsets."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    return torch.randn(int(offsets[-1]), dim, generator=gen) * scale, offsets


def term_abs_sum(q8, sq, qo, d8, sd, do) -> torch.Tensor:
    """sum_i |s_q[i] * max_j fp32(s_d[j] * acc[i, j])| per (query, doc), by brute force (float64)."""
    prod = (q8.double() @ d8.double().T).float() * sd.float()
    maxima = torch.stack([prod[:, do[d] : do[d + 1]].max(dim=1).values for d in range(len(do) - 1)], dim=1)
    terms = (sq.double()[:, None] * maxima.double()).abs()
    return torch.stack([terms[qo[q] : qo[q + 1]].sum(0) for q in range(len(qo) - 1)])


def assert_scores(scores, reference, abs_sum, q_lengths) -> None:
    lengths = torch.tensor(q_lengths, dtype=torch.float64)[:, None]
    atol = 2 * (lengths + 1) * EPS32 * abs_sum + 1e-30
    err = (scores.double() - reference).abs()
    assert torch.isfinite(scores).all()
    assert (err <= atol).all(), (
        f"max error {err.max().item():.3g}, worst ratio {(err / atol).max().item():.3g}"
    )


# -- quantization ------------------------------------------------------------------------------------------


def test_quantize_rounds_half_to_even_and_clamps() -> None:
    x = torch.tensor([[127.0, 2.5, -2.5, 3.5, -0.5, 0.5, 1.5, -127.0]])
    codes, scales = quantize_per_token(x, backend="torch")
    assert scales.tolist() == [1.0]
    assert codes.tolist() == [[127, 2, -2, 4, 0, 0, 2, -127]]


def test_quantize_zero_token_gets_scale_one() -> None:
    x = torch.zeros(2, 16)
    x[1, 3] = -0.25
    codes, scales = quantize_per_token(x, backend="torch")
    assert scales[0].item() == 1.0 and (codes[0] == 0).all()
    assert codes[1, 3].item() == -127 and scales[1].item() == pytest.approx(0.25 / 127)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [8, 40, 128, 200])
def test_quantize_error_bound(dtype: torch.dtype, dim: int) -> None:
    gen = torch.Generator().manual_seed(dim)
    x = (torch.randn(50, dim, generator=gen) * torch.rand(50, 1, generator=gen) * 3).to(dtype)
    codes, scales = quantize_per_token(x, backend="torch")
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert codes.abs().max() <= 127 and (codes.abs().amax(1) == 127).all()
    err = (codes.float() * scales[:, None] - x.float()).abs()
    # |x/s - round(x/s)| <= 1/2, plus the rounding of the division and of s itself.
    assert (err <= scales[:, None] * (0.5 + 1e-5)).all()


@pytest.mark.parametrize("backend", BACKENDS[1:])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantize_triton_matches_torch_bitwise(backend: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 72, generator=gen).to(dtype)
    x[5] = 0
    x[7, :4] = torch.tensor([127.0, 2.5, -2.5, 3.5], dtype=dtype)  # halves land on exact .5
    x[7, 4:] = 0
    want_codes, want_scales = quantize_per_token(x, backend="torch")
    codes, scales = quantize_per_token(x, backend=backend)
    assert torch.equal(codes, want_codes)
    assert torch.equal(scales, want_scales)


# -- exactness ---------------------------------------------------------------------------------------------

SHAPES = [
    # (query lengths, doc lengths, dim)
    ([3, 1, 7, 5], [2, 9, 1, 17, 4], 40),  # ragged, length-1 on both sides, dim not a power of two
    ([1], [1], 8),  # the smallest case
    ([32, 32, 32, 32, 32], [20, 65, 64, 130, 33, 1, 7], 128),  # a group boundary inside the batch
    ([6, 2], [5, 70, 3], 24),
    ([4, 9], [12, 3, 66], 300),  # wider than the exact-bias conversion: the plain int32 -> fp32 path
    ([140, 3], [30, 5], 16),  # a query longer than one query tile (multi-tile path)
    ([1, 1, 1, 1, 1, 1, 1, 130], [5, 40, 1], 32),  # a group of several queries longer than its tile
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_lengths,d_lengths,dim", SHAPES)
def test_varlen_exact(backend: str, q_lengths: list[int], d_lengths: list[int], dim: int) -> None:
    gen = torch.Generator().manual_seed(len(q_lengths) * 1000 + dim)
    queries, qo = packed(q_lengths, dim, gen)
    docs, do = packed(d_lengths, dim, gen, scale=0.1)
    d8, sd = quantize_per_token(docs, backend="torch")
    ref, ref_arg = maxsim_int8_reference(queries, qo, d8, do, doc_scales=sd, return_argmax=True)
    scores, arg = maxsim_varlen_int8(queries, qo, d8, do, doc_scales=sd, return_argmax=True, backend=backend)
    assert scores.dtype == torch.float32 and scores.shape == (len(q_lengths), len(d_lengths))
    assert arg.dtype == torch.int32 and arg.shape == (sum(q_lengths), len(d_lengths))
    q8, sq = quantize_per_token(queries, backend="torch")
    assert_scores(scores, ref, term_abs_sum(q8, sq, qo, d8, sd, do), q_lengths)
    assert torch.equal(arg, ref_arg)
    # Without argmax the same scores come out (the argmax variant is a separate compilation).
    assert torch.equal(maxsim_varlen_int8(queries, qo, d8, do, doc_scales=sd, backend=backend), scores)


@_NEEDS_TRITON
@pytest.mark.parametrize("q_lengths,d_lengths,dim", SHAPES)
def test_element_max_tiles_give_the_same_scores(monkeypatch, q_lengths, d_lengths, dim) -> None:
    """The running max kept per tile element (reduced at each document's end) gives the bits of the
    per-row running max: the max of the same fp32 products, in whatever order, is the same number."""
    import maxsim_kernels.maxsim_int8 as int8

    gen = torch.Generator().manual_seed(31 + dim)
    queries, qo = packed(q_lengths, dim, gen)
    docs, do = packed(d_lengths, dim, gen, scale=0.1)
    d8, sd = quantize_per_token(docs, backend="torch")
    cand_off = torch.arange(len(q_lengths) + 1) * len(d_lengths)  # every query: every doc, reversed
    cand_docs = torch.arange(len(d_lengths)).flip(0).repeat(len(q_lengths))

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        all_pairs = maxsim_varlen_int8(queries, qo, d8, do, doc_scales=sd, backend="triton")
        cands = maxsim_candidates_int8(
            queries, qo, d8, do, cand_off, cand_docs, doc_scales=sd, backend="triton"
        )
        return all_pairs, cands

    by_row = run()
    for name in ("_VARLEN_ELEMENT_MAX", "_FEW_QUERIES_ELEMENT_MAX", "_CAND_ELEMENT_MAX"):
        monkeypatch.setattr(int8, name, True)
    by_element = run()
    assert torch.equal(by_row[0], by_element[0]) and torch.equal(by_row[1], by_element[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_lengths,d_lengths,dim", SHAPES[:4] + SHAPES[5:])
def test_candidates_exact(backend: str, q_lengths: list[int], d_lengths: list[int], dim: int) -> None:
    gen = torch.Generator().manual_seed(7 + dim)
    queries, qo = packed(q_lengths, dim, gen)
    docs, do = packed(d_lengths, dim, gen, scale=3.0)
    d8, sd = quantize_per_token(docs, backend="torch")
    nq, nd = len(q_lengths), len(d_lengths)
    # Each query gets its own candidates, repeats and an empty list included.
    counts = [(q * 3 + 2) % (nd + 2) for q in range(nq)]
    counts[-1] = 0 if nq > 1 else counts[-1] + 1
    cand_docs = torch.randint(0, nd, (sum(counts),), generator=gen)
    cand_off = torch.zeros(nq + 1, dtype=torch.int64)
    cand_off[1:] = torch.tensor(counts).cumsum(0)
    ref, ref_arg = maxsim_int8_reference(queries, qo, d8, do, doc_scales=sd, return_argmax=True)
    q8, sq = quantize_per_token(queries, backend="torch")
    abs_sum = term_abs_sum(q8, sq, qo, d8, sd, do)
    scores, arg = maxsim_candidates_int8(
        queries, qo, d8, do, cand_off, cand_docs, doc_scales=sd, return_argmax=True, backend=backend
    )
    owner = torch.repeat_interleave(torch.arange(nq), torch.tensor(counts))
    assert scores.shape == (sum(counts),) and arg.shape == (sum(counts), max(q_lengths))
    lengths = [q_lengths[q] for q in owner.tolist()]
    assert_scores(
        scores[:, None], ref[owner, cand_docs][:, None], abs_sum[owner, cand_docs][:, None], lengths
    )
    for c, (q, d) in enumerate(zip(owner.tolist(), cand_docs.tolist(), strict=True)):
        n = q_lengths[q]
        assert torch.equal(arg[c, :n], ref_arg[qo[q] : qo[q + 1], d])
        assert (arg[c, n:] == -1).all()


def test_torch_candidates_score_bitwise_as_all_pairs_whatever_the_block() -> None:
    """The torch path adds a query's terms one after another for candidates as for all pairs: a pair's
    score is the same bits whether it was searched or reranked, and whatever the other candidates of its
    block (torch's sum over dim 0 ordered its additions by the block's width: a 40-token query's score
    changed in the last bits with the number of candidates)."""
    gen = torch.Generator().manual_seed(5)
    queries, qo = packed([40], 64, gen)
    docs, do = packed([7, 30, 1, 64, 12, 3], 64, gen, scale=3.0)
    d8, sd = quantize_per_token(docs, backend="torch")
    all_pairs = maxsim_varlen_int8(queries, qo, d8, do, doc_scales=sd, backend="torch")[0]
    for docs_of_query in ([1], [1, 4], [0, 1, 2, 3, 4, 5]):
        cand = torch.tensor(docs_of_query, dtype=torch.int64)
        scores = maxsim_candidates_int8(
            queries, qo, d8, do, torch.tensor([0, len(cand)]), cand, doc_scales=sd, backend="torch"
        )
        assert torch.equal(scores, all_pairs[cand]), docs_of_query


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_pick_the_lowest_index(backend: str) -> None:
    gen = torch.Generator().manual_seed(11)
    base = torch.randn(3, 32, generator=gen)
    # Document 0 repeats one token (exact ties); document 1 holds the same token after a different one.
    docs = torch.cat([base[0:1], base[0:1], base[0:1], base[1:2], base[0:1], base[0:1]])
    do = torch.tensor([0, 3, 6])
    queries = torch.cat([base[0:1], -base[2:3]])
    qo = torch.tensor([0, 2])
    d8, sd = quantize_per_token(docs, backend="torch")
    _, ref_arg = maxsim_int8_reference(queries, qo, d8, do, doc_scales=sd, return_argmax=True)
    _, arg = maxsim_varlen_int8(queries, qo, d8, do, doc_scales=sd, return_argmax=True, backend=backend)
    assert arg[0].tolist() == [0, 1]
    assert torch.equal(arg, ref_arg)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_queries_with_scales(backend: str) -> None:
    gen = torch.Generator().manual_seed(5)
    queries, qo = packed([4, 6], 48, gen)
    docs, do = packed([3, 8, 2], 48, gen)
    d8, sd = quantize_per_token(docs, backend="torch")
    q8, sq = quantize_per_token(queries, backend="torch")
    from_float = maxsim_varlen_int8(queries, qo, d8, do, doc_scales=sd, backend=backend)
    from_int8 = maxsim_varlen_int8(q8, qo, d8, do, doc_scales=sd, query_scales=sq, backend=backend)
    assert torch.equal(from_float, from_int8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_public_entry_points_take_quantized_queries(backend: str) -> None:
    """`maxsim score` quantizes a query batch once and passes the codes with `query_scales`: the public
    entry points give the same scores as from the float queries, and refuse scales with float docs."""
    from maxsim_kernels import maxsim_candidates, maxsim_varlen

    gen = torch.Generator().manual_seed(6)
    queries, qo = packed([5, 3, 7], 40, gen)
    docs, do = packed([2, 9, 4, 1], 40, gen)
    d8, sd = quantize_per_token(docs, backend="torch")
    q8, sq = quantize_per_token(queries, backend=backend)
    from_float = maxsim_varlen(queries, qo, d8, do, doc_scales=sd, backend=backend)
    from_int8 = maxsim_varlen(q8, qo, d8, do, doc_scales=sd, query_scales=sq, backend=backend)
    assert torch.equal(from_float, from_int8)
    co, cd = torch.tensor([0, 2, 3, 5]), torch.tensor([3, 0, 1, 2, 1])
    cand_float = maxsim_candidates(queries, qo, d8, do, co, cd, doc_scales=sd, backend=backend)
    cand_int8 = maxsim_candidates(q8, qo, d8, do, co, cd, doc_scales=sd, query_scales=sq, backend=backend)
    assert torch.equal(cand_float, cand_int8)
    with pytest.raises(ValueError, match="query_scales go with int8"):
        maxsim_varlen(queries, qo, docs, do, query_scales=sq, backend=backend)
    with pytest.raises(ValueError, match="query_scales go with int8"):
        maxsim_candidates(queries, qo, docs, do, co, cd, query_scales=sq, backend=backend)


def test_reference_unrounded_products_agree_within_fp32() -> None:
    gen = torch.Generator().manual_seed(9)
    queries, qo = packed([5, 3], 64, gen)
    docs, do = packed([7, 2, 9], 64, gen)
    d8, sd = quantize_per_token(docs, backend="torch")
    rounded = maxsim_int8_reference(queries, qo, d8, do, doc_scales=sd)
    exact = maxsim_int8_reference(queries, qo, d8, do, doc_scales=sd, round_products=False)
    torch.testing.assert_close(rounded, exact, rtol=1e-6, atol=1e-9)


def test_backends_agree_exactly_on_argmax_and_closely_on_scores() -> None:
    gen = torch.Generator().manual_seed(21)
    queries, qo = packed([8, 8, 8], 64, gen)
    docs, do = packed([10, 25, 1, 40, 12], 64, gen)
    d8, sd = quantize_per_token(docs, backend="torch")
    s_torch, a_torch = maxsim_varlen_int8(
        queries, qo, d8, do, doc_scales=sd, return_argmax=True, backend="torch"
    )
    s_auto = maxsim_varlen_int8(queries, qo, d8, do, doc_scales=sd)  # CPU tensors: the torch path
    assert torch.equal(s_auto, s_torch)
    torch.testing.assert_close(s_torch, maxsim_int8_reference(queries, qo, d8, do, doc_scales=sd).float())
    assert a_torch.min() >= 0


# -- errors ------------------------------------------------------------------------------------------------


def _small() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    queries, qo = packed([2, 3], 16, gen)
    docs, do = packed([4, 1], 16, gen)
    d8, sd = quantize_per_token(docs, backend="torch")
    return queries, qo, d8, do, sd


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda a: a.update(doc_scales=None), "need doc_scales"),
        (lambda a: a.update(docs=a["docs"].float()), "int8 documents"),
        (lambda a: a.update(doc_scales=a["doc_scales"][:-1]), "doc_scales must be"),
        (lambda a: a.update(query_offsets=torch.tensor([0, 2, 2, 5])), "has no tokens"),
        (lambda a: a.update(query_offsets=torch.tensor([0, 2, 4])), "has 5 rows"),
        (lambda a: a.update(doc_offsets=torch.tensor([0, 5, 3, 5])), "decreases"),
        (lambda a: a.update(queries=a["queries"][:, :8]), "share dim"),
        (lambda a: a.update(queries=a["queries"].to(torch.int8)), "query_scales"),
        (lambda a: a.update(backend="cuda"), "backend must be"),
    ],
)
def test_invalid_inputs_raise(mutate, message: str) -> None:
    queries, qo, d8, do, sd = _small()
    args = dict(queries=queries, query_offsets=qo, docs=d8, doc_offsets=do, doc_scales=sd, backend="torch")
    mutate(args)
    with pytest.raises(ValueError, match=message):
        maxsim_varlen_int8(
            args["queries"], args["query_offsets"], args["docs"], args["doc_offsets"],
            doc_scales=args["doc_scales"], backend=args["backend"],
        )  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_document_without_tokens_scores_minus_inf(backend: str) -> None:
    gen = torch.Generator().manual_seed(4)
    queries, qo = packed([3, 2], 32, gen)
    docs, _ = packed([4, 1], 32, gen)
    do = torch.tensor([0, 4, 4, 5])  # document 1 is empty
    d8, sd = quantize_per_token(docs, backend="torch")
    scores, arg = maxsim_varlen_int8(queries, qo, d8, do, doc_scales=sd, return_argmax=True, backend=backend)
    ref, ref_arg = maxsim_int8_reference(queries, qo, d8, do, doc_scales=sd, return_argmax=True)
    assert (scores[:, 1] == float("-inf")).all() and (ref[:, 1] == float("-inf")).all()
    assert (arg[:, 1] == -1).all() and torch.equal(arg, ref_arg)
    assert torch.isfinite(scores[:, [0, 2]]).all()


def test_candidate_index_out_of_range_raises() -> None:
    queries, qo, d8, do, sd = _small()
    with pytest.raises(ValueError, match=r"not a document index in \[0, 2\)"):
        maxsim_candidates_int8(
            queries, qo, d8, do, torch.tensor([0, 1, 2]), torch.tensor([0, 2]), doc_scales=sd
        )


# Outside [0, 23): below 0, the number of documents, past 2^32 (low 32 bits valid), far below 0.
BAD_CANDIDATES = [-1, 23, 2**32 + 5, -(2**62)]


def _bad_candidates_case() -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Two queries with 9 and 11 candidates among 23 documents (one empty): the Triton kernel's first run
    of 16 crosses from one query to the next (its per-candidate branch), the second lies in one query (its
    planned branch). Entries 0, 8, 16 and 19 are BAD_CANDIDATES. Returns (inputs, the candidates, the same
    with valid indices in place of the bad ones, the bad entries' mask, the doc_scales argument)."""
    gen = torch.Generator().manual_seed(12)
    queries, qo = packed([5, 9], 32, gen)
    lengths = torch.randint(0, 90, (23,), generator=gen)
    lengths[3] = 0
    docs, do = packed(lengths.tolist(), 32, gen)
    d8, sd = quantize_per_token(docs, backend="torch")
    valid = torch.randint(0, 23, (20,), generator=gen)
    bad = torch.zeros(20, dtype=torch.bool)
    bad[[0, 8, 16, 19]] = True
    cand = valid.clone()
    cand[bad] = torch.tensor(BAD_CANDIDATES)
    return (queries, qo, d8, do, torch.tensor([0, 9, 20])), cand, valid, bad, {"doc_scales": sd}


@_NEEDS_TRITON
@pytest.mark.parametrize("return_argmax", [False, True])
def test_bad_candidate_indices_on_the_device_score_nan_without_a_host_copy(
    device_candidates, return_argmax: bool
) -> None:
    """Candidates on a GPU are not read by the host on the Triton path: the kernel never reads through
    a bad index, scores its candidate NaN (argmax -1) and the others bit for bit as without it."""
    inputs, cand, valid, bad, scales = _bad_candidates_case()
    kwargs = dict(**scales, return_argmax=return_argmax, backend="triton")
    got = maxsim_candidates_int8(*inputs, cand, **kwargs)
    want = maxsim_candidates_int8(*inputs, valid, **kwargs)
    assert device_candidates == [], "the candidates were copied to the host"
    if return_argmax:
        (got, got_arg), (want, want_arg) = got, want
        assert (got_arg[bad] == -1).all()
        assert torch.equal(got_arg[~bad], want_arg[~bad])
    assert torch.equal(torch.isnan(got), bad)
    assert torch.equal(got[~bad], want[~bad])
    on_torch = maxsim_candidates_int8(*inputs, valid, **scales, backend="torch")
    torch.testing.assert_close(want, on_torch, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", BAD_CANDIDATES)
def test_bad_candidate_index_on_the_host_raises_naming_it(backend: str, bad: int) -> None:
    inputs, _, valid, _, scales = _bad_candidates_case()
    valid[5] = bad
    message = rf"candidate_docs\[5\] = {bad} is not a document index in \[0, 23\)"
    with pytest.raises(ValueError, match=message):
        maxsim_candidates_int8(*inputs, valid, **scales, backend=backend)


def test_torch_path_checks_device_candidates_on_the_host(device_candidates) -> None:
    inputs, _, valid, _, scales = _bad_candidates_case()
    valid[5] = 23
    with pytest.raises(ValueError, match=r"candidate_docs\[5\] = 23 is not a document index"):
        maxsim_candidates_int8(*inputs, valid, **scales, backend="torch")
    assert device_candidates


def test_dim_beyond_exact_range_raises() -> None:
    docs = torch.zeros(2, 1025, dtype=torch.int8)
    with pytest.raises(ValueError, match="dim 1..1024"):
        maxsim_varlen_int8(
            torch.ones(1, 1025), torch.tensor([0, 1]), docs, torch.tensor([0, 2]), doc_scales=torch.ones(2)
        )


def test_hopper_tile_table_walks_every_document() -> None:
    """The host tile table of the Gluon all-pairs kernel (maxsim_int8_hopper): every document's tiles in
    order, from its first token, one tile for an empty document, its last tile marked; and the tile scales:
    each token's scale, NaN past the document."""
    import numpy as np
    from maxsim_kernels import maxsim_int8_hopper as hopper

    lengths = [0, 1, 63, 64, 65, 128, 129, 0, 7, 300]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    first, ends, doc_tile, inside = hopper.tile_table(offsets, block_t=64)
    want_first, want_ends, want_inside, want_doc_tile = [], [], [], [0]
    for d, n in enumerate(lengths):
        tiles = max(1, -(-n // 64))
        for k in range(tiles):
            want_first.append(offsets[d] + 64 * k)
            want_inside.append(min(64, max(0, n - 64 * k)))
            want_ends.append(int(k == tiles - 1))
        want_doc_tile.append(want_doc_tile[-1] + tiles)
    assert first.tolist() == want_first and inside.tolist() == want_inside
    assert ends.tolist() == want_ends and doc_tile.tolist() == want_doc_tile
    assert first.dtype == ends.dtype == doc_tile.dtype == np.int32

    scales = torch.arange(1, offsets[-1] + 1, dtype=torch.float32)
    tables = hopper.device_tables(offsets, torch.from_numpy(offsets), scales)  # CPU: the host tables
    for got, want in zip(tables[:3], (first, ends, doc_tile), strict=True):
        assert got.dtype == torch.int32 and got.numpy().tolist() == want.tolist()
    assert all(t.data_ptr() % 16 == 0 for t in tables)
    table = tables[3]
    assert table.shape == (len(first), 64) and table.is_contiguous()
    for t in range(len(first)):
        n = int(inside[t])
        assert torch.equal(table[t, :n], scales[first[t] : first[t] + n])
        assert torch.isnan(table[t, n:]).all()
    # the kernel that makes the table on CUDA (here under the interpreter), on the same tile table
    kernel_table = hopper.tile_scales_triton(scales, tables[0], torch.from_numpy(inside), block_t=64)
    assert torch.equal(kernel_table.isnan(), table.isnan())
    assert torch.equal(kernel_table.nan_to_num(), table.nan_to_num())


@pytest.mark.parametrize("seed", [0, 1])
def test_tile_table_kernel_equals_the_host_table(seed):
    """`tile_table_triton` (one launch, on the device) gives `tile_table`'s numbers: empty and one-token
    documents, tiles cut exactly at the tile size, long documents, batches of several kernel steps."""
    import numpy as np
    from maxsim_kernels import maxsim_int8_hopper as hopper

    rng = np.random.default_rng(seed)
    cases = [
        [0, 1, 63, 64, 65, 128, 129, 0, 7, 300],
        [0],
        [64] * (hopper._TABLE_DOCS + 5),
        list(rng.integers(0, 700, 2 * hopper._TABLE_DOCS + 17)),
        [],
    ]
    for lengths in cases:
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        want = hopper.tile_table(offsets, block_t=64)
        got = hopper.tile_table_triton(torch.from_numpy(offsets), len(want[0]), block_t=64)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == torch.int32 and g.numpy().tolist() == w.tolist()


def test_hopper_kernel_is_not_planned_off_the_gpu() -> None:
    """CPU tensors, the argmax, another dim or too few query groups keep the Triton/torch paths."""
    import numpy as np
    from maxsim_kernels import maxsim_int8
    from maxsim_kernels import maxsim_int8_hopper as hopper

    d8 = torch.zeros(1000, 128, dtype=torch.int8)
    many = np.full(64, 32)
    assert not hopper.supports(many, d8, False)  # on the CPU
    assert not hopper.supports(many, d8, True)
    assert not hopper.supports(many, torch.zeros(1000, 96, dtype=torch.int8), False)
    assert not hopper.supports(np.full(4, 32), d8, False)
    assert not hopper.supports(np.full(64, 129), d8, False)
    assert hopper.queries_per_group(32) == 4 and hopper.queries_per_group(1) == hopper.MAX_QPG
    q_off = torch.arange(65, dtype=torch.int64) * 32
    d_off = torch.tensor([0, 500, 1000])
    q8 = torch.zeros(64 * 32, 128, dtype=torch.int8)
    assert maxsim_int8.hopper_allpairs(q_off, d_off, q8, d8, False) is None


def test_stream_kernel_is_not_planned_off_the_gpu(monkeypatch) -> None:
    """The Gluon stream kernel (one query, candidates) takes sm_90 only, scores only, dim 128, queries of
    1..64 tokens; its query tile is 16, 32 or 64 columns, each with register caps."""
    import numpy as np
    from maxsim_kernels import maxsim_int8
    from maxsim_kernels import maxsim_int8_hopper_stream as stream

    d8 = torch.zeros(1000, 128, dtype=torch.int8)
    assert [stream.query_columns(n) for n in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    assert set(stream.REGISTERS) == {stream.query_columns(n) for n in range(1, stream.MAX_QUERY_TOKENS + 1)}
    assert not stream.supports(np.array([32]), d8, False)  # on the CPU
    q_off = torch.tensor([0, 32])
    assert maxsim_int8.hopper_stream(q_off, torch.zeros(32, 128, dtype=torch.int8), d8, False) is None
    monkeypatch.setattr(stream, "hopper_device", lambda device: True)  # the shape rules alone
    assert stream.supports(np.array([32, 1, 64]), d8, False)
    assert not stream.supports(np.array([32]), d8, True)  # the argmax
    assert not stream.supports(np.array([32]), torch.zeros(1000, 96, dtype=torch.int8), False)
    assert not stream.supports(np.array([32, 65]), d8, False)
    assert not stream.supports(np.array([32, 0]), d8, False)
    assert not stream.supports(np.array([32]), torch.zeros(0, 128, dtype=torch.int8), False)
    # int4 codes (uint8, two values a byte) of dim 128, with their own tiles
    codes = torch.zeros(1000, 64, dtype=torch.uint8)
    assert stream.supports(np.array([32, 1, 64]), codes, False)
    assert not stream.supports(np.array([32]), torch.zeros(1000, 128, dtype=torch.uint8), False)
    assert not stream.supports(np.array([32]), torch.zeros(1000, 64, dtype=torch.int8), False)
    assert stream.tiles_for(codes) is stream.INT4_TILES and stream.tiles_for(d8) is stream.INT8_TILES
    assert set(stream.INT4_TILES.registers) == set(stream.REGISTERS)


def test_stream_tiles_refuse_an_odd_group_and_too_many_candidates() -> None:
    """`stream_with_tiles` refuses, before any launch, a group of tiles a turn that is not an even number
    (the loop takes its tiles in pairs: group=1 faulted on an H100) and more than `MAX_ITEMS_CANDIDATES`
    candidates a program; every tuned plan takes 2 tiles a turn."""
    from maxsim_kernels import maxsim_int8_hopper_stream as stream

    codes = torch.zeros(1000, 32, dtype=torch.uint8)
    q8, sq = torch.zeros(32, 128, dtype=torch.int8), torch.ones(32)
    q_off, d_off = torch.tensor([0, 32]), torch.tensor([0, 500, 1000])
    for group in (0, 1, 3):
        with pytest.raises(ValueError, match=f"an even number from 2\\), got {group}"):
            stream.stream_with_tiles(q8, sq, q_off, None, None, codes, torch.ones(1000), d_off, 32, int2=True,
                                     group=group)  # fmt: skip
    with pytest.raises(ValueError, match="at most 64 candidates a program"):
        stream.stream_with_tiles(q8, sq, q_off, torch.tensor([0, 2]), torch.tensor([0, 1]), codes,
                                 torch.ones(1000), d_off, 32, int2=True, items_per_prog=65)  # fmt: skip
    tunings = (stream.INT8_TILES, stream.INT4_TILES, stream.INT2_TILES, stream.RESIDUAL2_TILES)
    assert all(t.group == 2 for t in tunings)


def test_stream_producer_warp_is_refused_where_it_is_not_measured() -> None:
    """A producer warp fills the ring only where it ran with the same bits: not for residual2 (every
    thread's cp.async copies), not with more than `PRODUCER_MAX_ITEMS` items a program (refused before any
    launch); the caps it takes give the scan's warps 2 cap - 24 registers, four programs an SM by default.
    The tuned plans take it for int2's and int4's one query at N = 16 (a cap of 56) and 32 alone."""
    from maxsim_kernels import maxsim_int8_hopper_stream as stream

    codes = torch.zeros(1000, 32, dtype=torch.uint8)
    q8, sq = torch.zeros(32, 128, dtype=torch.int8), torch.ones(32)
    q_off, d_off = torch.tensor([0, 32]), torch.tensor([0, 500, 1000])
    with pytest.raises(ValueError, match="at most 32 items a program"):
        stream.stream_with_tiles(q8, sq, q_off, None, None, codes, torch.ones(1000), d_off, 32, int2=True,
                                 producer=True, items_per_prog=64)  # fmt: skip
    with pytest.raises(ValueError, match="residual2's copies"):
        stream.stream_with_tiles(q8, sq, q_off, None, None, torch.zeros(1000, 36, dtype=torch.uint8), None,
                                 d_off, 32, residual=object(), producer=True)  # fmt: skip
    tuned = stream.INT2_TILES
    assert tuned.cap(32, True, True) == stream.PRODUCER_CAP == 64
    assert 65536 // (stream.PRODUCER_CAP * 256) == 4 and 2 * stream.PRODUCER_CAP - 24 == 104
    assert tuned.cap(32, True, False) == tuned.registers[32][0]
    assert tuned.cap(16, True, True) == 56 and 65536 // (56 * 256) == 4 and 2 * 56 - 24 == 88
    # the tuned plans: int2's and int4's one query at N = 16 and 32 (measured faster), programs of 32 items
    for tiles in (stream.INT2_TILES, stream.INT4_TILES):
        for n in (16, 32):
            assert stream.takes_producer(tiles, n, True, tiles.items_one_query)
            assert not stream.takes_producer(tiles, n, True, stream.PRODUCER_MAX_ITEMS + 1)
            assert not stream.takes_producer(tiles, n, False, tiles.items_candidates)
        assert not stream.takes_producer(tiles, 64, True, 32)
    for tiles in (stream.INT8_TILES, stream.RESIDUAL2_TILES):
        assert not any(stream.takes_producer(tiles, n, True, 32) for n in tiles.registers)


def test_stream_ring_depth_by_query_tile() -> None:
    """A codec's ring is `Tuning.stages` deep for candidates at every query tile, and for one query too but
    at the tiles its `ring` names (int4's one query at N = 64: 6 deep, its candidates 4)."""
    from maxsim_kernels import maxsim_int8_hopper_stream as stream

    for tuned in (stream.INT8_TILES, stream.INT4_TILES, stream.INT2_TILES, stream.RESIDUAL2_TILES):
        for n in tuned.registers:
            assert tuned.stages_at(n, False) == tuned.stages
            assert tuned.stages_at(n, True) == dict(tuned.ring).get(n, tuned.stages)
    assert stream.INT4_TILES.stages_at(64, True) == 6 and stream.INT4_TILES.stages_at(64, False) == 4


@pytest.mark.parametrize("items", [1, 5, 32])
def test_stream_walk_table_is_the_tile_table(items: int) -> None:
    """The stream kernel's walk of one query (`walk_table`, made by a Triton kernel: here under the
    interpreter) holds the all-pairs kernel's tile table (`maxsim_int8_hopper.tile_table`, numpy): each
    tile's first token, its rows in the document and whether it is the document's last, with the
    document's slot in its program (index mod `items`), and each program's first tile; empty, one-token
    and long documents, tiles cut exactly at the tile size, more documents than a program of the kernel
    takes. Offsets that do not add up stay inside the table."""
    import numpy as np
    from maxsim_kernels import maxsim_int8_hopper as hopper
    from maxsim_kernels import maxsim_int8_hopper_stream as stream

    rng = np.random.default_rng(items)
    cases = [
        [0, 1, 63, 64, 65, 128, 129, 0, 7, 300],
        [0],
        [5],
        [64] * (stream._WALK_DOCS + 5),
        list(rng.integers(0, 700, 2 * stream._WALK_DOCS + 17)) + [5000],
    ]
    for lengths in cases:
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        first, ends, doc_tile, inside = hopper.tile_table(offsets, block_t=stream.BLOCK_T)
        entries, firsts = stream.walk_table(torch.from_numpy(offsets), int(offsets[-1]), items)
        n_tiles = len(first)
        assert entries.dtype == torch.int64 and len(entries) >= n_tiles
        walk = entries[:n_tiles].numpy()
        meta = walk >> 32
        assert (walk & 0xFFFFFFFF).tolist() == first.tolist()
        assert (meta & 127).tolist() == inside.tolist()
        assert ((meta >> 7) & 1).tolist() == ends.tolist()
        docs = np.repeat(np.arange(len(lengths)), np.diff(doc_tile))
        assert (meta >> 8).tolist() == (docs % items).tolist()
        assert firsts.dtype == torch.int32
        assert firsts.tolist() == doc_tile[::items].tolist() + ([n_tiles] if len(lengths) % items else [])

    # offsets that do not add up (a document ends before it starts, another runs past the tokens): the
    # walk is cut at the table's size, each program's first tile inside it
    offsets = torch.tensor([0, 900, 100, 5000, 5064])
    entries, firsts = stream.walk_table(offsets, 200, items)
    assert int(firsts.max()) < len(entries) and int(firsts.min()) >= 0


def test_stream_walk_table_is_counted_for_offsets_walked_again() -> None:
    """One query walks the table (`walks_table`) where the codec's tuning takes it at the query tile's N
    and its offsets tensor is walked for the second time (a resident corpus), not for offsets seen once (a
    streamed batch); an explicit choice wins; an inference tensor keeps the offsets' walk; a change in
    place starts the count again."""
    from maxsim_kernels import maxsim_int8_hopper_stream as stream

    tuned = stream.INT2_TILES
    n = tuned.table[0]
    offsets = torch.tensor([0, 5, 70])
    assert not stream.walks_table(offsets, n, tuned)
    assert stream.walks_table(offsets, n, tuned) and stream.walks_table(offsets, n, tuned)
    assert not stream.walks_table(torch.tensor([0, 5, 70]), n, tuned)  # another tensor: seen once
    assert not stream.walks_table(offsets, n, stream.INT8_TILES)  # not taken at any N
    assert stream.walks_table(torch.tensor([0, 5]), n, tuned, table=True)
    assert not stream.walks_table(offsets, n, tuned, table=False)
    offsets[2] = 71  # changed in place: a new walk
    assert not stream.walks_table(offsets, n, tuned)
    with torch.inference_mode():
        frozen = torch.tensor([0, 5, 70])
    assert not stream.walks_table(frozen, n, tuned) and not stream.walks_table(frozen, n, tuned)
    assert not stream.walks_table(frozen, n, tuned, table=True)


def test_document_and_candidate_runs_are_maximal_within_the_budget() -> None:
    """The torch paths' blocks (`int8_host.document_runs`, `candidate_runs`): consecutive runs covering every
    document (or candidate) once, each the longest that fits the budget from its first, a longer one alone;
    empty documents join the run before them."""
    import random

    from maxsim_kernels.int8_host import candidate_runs, document_runs

    def consecutive(runs: list[tuple[int, int]], first: int, stop: int) -> bool:
        bounds = [first] + [b for _, b in runs]
        return [a for a, _ in runs] == bounds[:-1] and bounds[-1] == stop

    rng = random.Random(4)
    for _ in range(200):
        lens = [rng.choice([0, 0, 1, 2, 5, 9, 30]) for _ in range(rng.randint(0, 12))]
        budget = rng.randint(1, 20)
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        runs = list(document_runs(offsets, budget))
        assert consecutive(runs, 0, len(lens))
        for a, b in runs:
            assert b - a == 1 or offsets[b] - offsets[a] <= budget
            assert b == len(lens) or offsets[b + 1] - offsets[a] > budget  # the next document does not fit
        first, stop = sorted(rng.sample(range(len(lens) + 1), 2)) if lens else (0, 0)
        runs = list(candidate_runs(lens, first, stop, budget))
        assert consecutive(runs, first, stop)
        for a, b in runs:
            assert b - a == 1 or sum(lens[a:b]) <= budget
            assert b == stop or sum(lens[a : b + 1]) > budget
