"""`maxsim_kernels.colbert_scores` / `colbert_kd_scores`: PyLate-shaped inputs on the fused kernels.

The reference is float64 plain torch, written here and independent of the code under test: the
similarities of the padded inputs, masked document tokens set to -inf before the max, the maxima of masked
query tokens left out of the sum. Gradients are float64 autograd of that reference (random inputs, where
ties have probability 0). Padding rows hold random values, not zeros, so a padding row that leaked into a
max or a sum would show.

Tolerances (fp32 inputs, CPU: the torch backend, and the Triton kernels under TRITON_INTERPRET=1):
entries are randn / sqrt(dim), so each similarity is O(1) and a score sums at most 16 maxima of dim
products. fp32 rounding of one product chain is ~sqrt(dim) * 2^-24 ~ 1e-6 at most here; measured on these
shapes: <= 3e-7 for scores, <= 2e-7 for gradient entries (both backends). atol 2e-5 with rtol 1e-5 for
scores and 1e-5 for gradients leave a ~50x margin, and sit far below what a leak of a padding row into a
max or a sum would change (O(0.1)) or PyLate's zero masking changes in the tests below (> 0.01).
GPU (fp16 / bf16): the reference takes the same rounded inputs, whose products are exact in fp32; what is
left is fp32 accumulation in a different order, so scores hold atol 1e-3 / rtol 1e-4 (fp32 inputs too,
TF32 being off). Gradients come back in the input dtype: their rounding alone is 2^-11 (fp16) / 2^-8
(bf16) relative, so rtol 2e-3 / 1.6e-2 (torch.testing's bf16 default) with atol at the same level times
the gradients' O(1) scale.
"""

from __future__ import annotations

import os

import maxsim_kernels
import numpy as np
import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")),
]
ATOL, RTOL = 2e-5, 1e-5  # scores, fp32 (module docstring)
GRAD_TOL = 1e-5  # gradients, fp32


# ----------------------------------------------------------------------------------------------------
# inputs and the float64 reference
# ----------------------------------------------------------------------------------------------------


def _mask(shape: tuple[int, ...], gen: torch.Generator, *, keep: float = 0.6) -> torch.Tensor:
    """A ragged bool mask over the last axis: a random subset of tokens, at least one per item."""
    mask = torch.rand(shape, generator=gen) < keep
    first = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    return mask.scatter(-1, first.unsqueeze(-1), True)


def _embeddings(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64).div(shape[-1] ** 0.5).float()


def _reference(q, d, q_mask, d_mask, *, kd=False):
    """float64 scores: sum over unmasked query tokens of the max over unmasked document tokens."""
    q, d = q.double(), d.double()
    if kd:  # d [nq, N, Ld, dim], d_mask [nq, N, Ld]
        sims = torch.einsum("aih,abjh->abij", q, d)
        sims = sims.masked_fill(~d_mask[:, :, None, :], float("-inf"))
    else:  # d [nd, Ld, dim], d_mask [nd, Ld]
        sims = torch.einsum("aih,bjh->abij", q, d)
        sims = sims.masked_fill(~d_mask[None, :, None, :], float("-inf"))
    best = sims.amax(dim=-1)  # [nq, nd or N, Lq]
    return best.masked_fill(~q_mask[:, None, :], 0.0).sum(dim=-1)


def _pylate_convention(q, d, q_mask, d_mask, *, kd=False):
    """PyLate's rule, for contrast: similarities multiplied by the masks (masked tokens count as 0)."""
    q, d = q.double(), d.double()
    if kd:
        sims = torch.einsum("aih,abjh->abij", q, d) * d_mask[:, :, None, :]
    else:
        sims = torch.einsum("aih,bjh->abij", q, d) * d_mask[None, :, None, :]
    sims = sims * q_mask[:, None, :, None]
    return sims.amax(dim=-1).sum(dim=-1)


def _close(actual, expected, *, atol=ATOL, rtol=RTOL):
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


# (n_queries, n_docs, q_tokens, d_tokens, dim): weird shapes included - length 1, dims that are no power
# of two (24, 40, 96) and dims that are no multiple of 8 (3, 33: zero-padded inside)
SHAPES = [
    (3, 4, 5, 7, 16),
    (1, 1, 1, 1, 8),
    (2, 3, 1, 9, 24),
    (4, 2, 12, 3, 40),
    (5, 6, 9, 17, 96),
    (2, 3, 4, 5, 3),
    (3, 2, 6, 11, 33),
]


# ----------------------------------------------------------------------------------------------------
# scores against the reference
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("nq", "nd", "lq", "ld", "dim"), SHAPES)
def test_all_pairs_match_the_reference(nq, nd, lq, ld, dim, backend):
    gen = torch.Generator().manual_seed(nq * 1000 + ld * 10 + dim)
    q, d = _embeddings((nq, lq, dim), gen), _embeddings((nd, ld, dim), gen)
    q_mask, d_mask = _mask((nq, lq), gen), _mask((nd, ld), gen)
    scores = maxsim_kernels.colbert_scores(q, d, q_mask, d_mask, backend=backend)
    assert scores.shape == (nq, nd)
    _close(scores, _reference(q, d, q_mask, d_mask))
    # no masks: every token counts
    full_q, full_d = torch.ones(nq, lq, dtype=torch.bool), torch.ones(nd, ld, dtype=torch.bool)
    _close(maxsim_kernels.colbert_scores(q, d, backend=backend), _reference(q, d, full_q, full_d))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("nq", "per_query", "lq", "ld", "dim"), SHAPES)
def test_kd_matches_the_reference(nq, per_query, lq, ld, dim, backend):
    gen = torch.Generator().manual_seed(nq * 1000 + ld * 10 + dim + 1)
    q, d = _embeddings((nq, lq, dim), gen), _embeddings((nq, per_query, ld, dim), gen)
    q_mask, d_mask = _mask((nq, lq), gen), _mask((nq, per_query, ld), gen)
    scores = maxsim_kernels.colbert_kd_scores(q, d, q_mask, d_mask, backend=backend)
    assert scores.shape == (nq, per_query)
    _close(scores, _reference(q, d, q_mask, d_mask, kd=True))
    full_q, full_d = torch.ones(nq, lq, dtype=torch.bool), torch.ones(nq, per_query, ld, dtype=torch.bool)
    _close(
        maxsim_kernels.colbert_kd_scores(q, d, backend=backend),
        _reference(q, d, full_q, full_d, kd=True),
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_on_the_cpu(dtype):
    """The torch backend (the Triton interpreter's bf16 `tl.dot` is wrong: bf16 Triton runs on the GPU only).
    The reference takes the same rounded inputs, whose products are exact in fp32: fp32 tolerances."""
    gen = torch.Generator().manual_seed(5)
    q, d = _embeddings((3, 6, 24), gen).to(dtype), _embeddings((4, 9, 24), gen).to(dtype)
    q_mask, d_mask = _mask((3, 6), gen), _mask((4, 9), gen)
    _close(
        maxsim_kernels.colbert_scores(q, d, q_mask, d_mask, backend="torch"), _reference(q, d, q_mask, d_mask)
    )
    dk = _embeddings((3, 2, 9, 24), gen).to(dtype)
    dk_mask = _mask((3, 2, 9), gen)
    _close(
        maxsim_kernels.colbert_kd_scores(q, dk, q_mask, dk_mask, backend="torch"),
        _reference(q, dk, q_mask, dk_mask, kd=True),
    )


def test_kd_scores_are_the_diagonal_blocks_of_all_pairs():
    gen = torch.Generator().manual_seed(3)
    q, d = _embeddings((3, 6, 16), gen), _embeddings((3, 4, 9, 16), gen)
    q_mask, d_mask = _mask((3, 6), gen), _mask((3, 4, 9), gen)
    kd = maxsim_kernels.colbert_kd_scores(q, d, q_mask, d_mask)
    # 4-D documents in colbert_scores: group-major columns, query i's own documents at i*4 ... i*4+3
    every = maxsim_kernels.colbert_scores(q, d, q_mask, d_mask)
    assert every.shape == (3, 12)
    for i in range(3):
        torch.testing.assert_close(kd[i], every[i, i * 4 : (i + 1) * 4], atol=0, rtol=0)


def test_negative_similarities_are_not_clipped_to_zero():
    """Where every unmasked similarity of a query token is negative, PyLate's zeroing lets the padding win
    the max (0); the exact score keeps the negative maximum."""
    gen = torch.Generator().manual_seed(7)
    dim = 16
    q = _embeddings((2, 4, dim), gen).abs()  # positive queries ...
    d = -_embeddings((3, 6, dim), gen).abs()  # ... against negative documents: every similarity < 0
    q_mask = torch.ones(2, 4, dtype=torch.bool)
    d_mask = _mask((3, 6), gen)
    d_mask[0, 3:] = False  # padding for sure
    d_mask[2] = True  # and a document with none
    expected = _reference(q, d, q_mask, d_mask)
    assert (expected < 0).all()
    scores = maxsim_kernels.colbert_scores(q, d, q_mask, d_mask)
    _close(scores, expected)
    zeroed = _pylate_convention(q, d, q_mask, d_mask)
    padded = ~d_mask.all(dim=1)  # documents with a masked token: PyLate scores them 0
    assert (zeroed[:, padded] == 0).all()
    assert ((scores[:, padded].double() - zeroed[:, padded]).abs() > 0.01).all()
    # documents with no masked token agree under both rules
    torch.testing.assert_close(scores[:, ~padded].double(), zeroed[:, ~padded], atol=ATOL, rtol=RTOL)
    # the same for the per-query layout
    dk = -_embeddings((2, 3, 6, dim), gen).abs()
    dk_mask = _mask((2, 3, 6), gen)
    dk_mask[:, :, 4:] = False
    kd = maxsim_kernels.colbert_kd_scores(q, dk, q_mask, dk_mask)
    _close(kd, _reference(q, dk, q_mask, dk_mask, kd=True))
    assert (kd < 0).all() and (_pylate_convention(q, dk, q_mask, dk_mask, kd=True) == 0).all()


def test_masked_query_tokens_add_nothing_and_an_empty_query_scores_zero():
    gen = torch.Generator().manual_seed(11)
    q, d = _embeddings((3, 5, 8), gen), _embeddings((4, 6, 8), gen)
    q_mask = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)
    scores = maxsim_kernels.colbert_scores(q, d, q_mask)
    assert (scores[1] == 0).all()
    _close(scores, _reference(q, d, q_mask, torch.ones(4, 6, dtype=torch.bool)))
    # changing a masked query token changes nothing
    q2 = q.clone()
    q2[0, 2:] = 100.0
    torch.testing.assert_close(maxsim_kernels.colbert_scores(q2, d, q_mask), scores, atol=0, rtol=0)
    # every query empty: zeros, and backward still runs (zero gradients)
    qg = q.clone().requires_grad_(True)
    empty = maxsim_kernels.colbert_scores(qg, d, torch.zeros(3, 5, dtype=torch.bool))
    assert empty.shape == (3, 4) and (empty == 0).all()
    empty.sum().backward()
    assert (qg.grad == 0).all()
    # per-query layout
    dk = _embeddings((3, 2, 6, 8), gen)
    kd = maxsim_kernels.colbert_kd_scores(q, dk, q_mask)
    assert (kd[1] == 0).all()
    _close(kd, _reference(q, dk, q_mask, torch.ones(3, 2, 6, dtype=torch.bool), kd=True))


def test_a_document_with_no_token_raises():
    gen = torch.Generator().manual_seed(12)
    q, d = _embeddings((2, 3, 8), gen), _embeddings((3, 4, 8), gen)
    d_mask = torch.ones(3, 4, dtype=torch.bool)
    d_mask[2] = False
    with pytest.raises(ValueError, match=r"documents_embeddings\[2\] has no unmasked token"):
        maxsim_kernels.colbert_scores(q, d, None, d_mask)
    with pytest.raises(ValueError, match=r"documents_embeddings\[1\] has no unmasked token"):
        maxsim_kernels.colbert_scores(q, [d[0], d[1, :0], d[2]])
    dk = _embeddings((2, 3, 4, 8), gen)
    dk_mask = torch.ones(2, 3, 4, dtype=torch.bool)
    dk_mask[1, 2] = False
    with pytest.raises(ValueError, match=r"documents_embeddings\[1, 2\] has no unmasked token"):
        maxsim_kernels.colbert_kd_scores(q, dk, None, dk_mask)


# ----------------------------------------------------------------------------------------------------
# input forms: lists, numpy, mask dtypes, devices
# ----------------------------------------------------------------------------------------------------


def _trimmed(x: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    return [row[keep] for row, keep in zip(x, mask, strict=True)]


def test_lists_numpy_and_padded_inputs_give_the_same_scores():
    gen = torch.Generator().manual_seed(21)
    q, d = _embeddings((4, 7, 24), gen), _embeddings((5, 9, 24), gen)
    q_mask, d_mask = _mask((4, 7), gen), _mask((5, 9), gen)
    padded = maxsim_kernels.colbert_scores(q, d, q_mask, d_mask)
    _close(padded, _reference(q, d, q_mask, d_mask))
    same = lambda x: torch.testing.assert_close(x, padded, atol=0, rtol=0)  # noqa: E731
    # ragged lists of the unmasked tokens, as tensors and as numpy arrays
    same(maxsim_kernels.colbert_scores(_trimmed(q, q_mask), _trimmed(d, d_mask)))
    same(
        maxsim_kernels.colbert_scores(
            [x.numpy() for x in _trimmed(q, q_mask)], [x.numpy() for x in _trimmed(d, d_mask)]
        )
    )
    # lists of padded rows with one 1-D mask each; one side padded, the other a list
    same(maxsim_kernels.colbert_scores(list(q), list(d), list(q_mask), list(d_mask)))
    same(maxsim_kernels.colbert_scores(q, _trimmed(d, d_mask), q_mask))
    # numpy padded arrays with numpy masks of other dtypes (nonzero keeps); float64 is scored in fp32
    same(maxsim_kernels.colbert_scores(q.numpy(), d.numpy(), q_mask.numpy(), d_mask.numpy().astype(np.int64)))
    same(maxsim_kernels.colbert_scores(q, d, q_mask.float(), d_mask.to(torch.int32)))
    float64 = maxsim_kernels.colbert_scores(q.double().numpy(), d.double().numpy(), q_mask, d_mask)
    _close(float64, padded, atol=0, rtol=0)
    # numpy documents with torch queries: scored on the queries' device
    same(maxsim_kernels.colbert_scores(q, d.numpy(), q_mask, d_mask.numpy()))


def test_kd_lists_numpy_and_padded_inputs_give_the_same_scores():
    gen = torch.Generator().manual_seed(22)
    q, d = _embeddings((3, 6, 40), gen), _embeddings((3, 4, 8, 40), gen)
    q_mask, d_mask = _mask((3, 6), gen), _mask((3, 4, 8), gen)
    padded = maxsim_kernels.colbert_kd_scores(q, d, q_mask, d_mask)
    same = lambda x: torch.testing.assert_close(x, padded, atol=0, rtol=0)  # noqa: E731
    groups = [_trimmed(group, mask) for group, mask in zip(d, d_mask, strict=True)]  # ragged documents
    same(maxsim_kernels.colbert_kd_scores(_trimmed(q, q_mask), groups))
    same(maxsim_kernels.colbert_kd_scores(q, [[x.numpy() for x in g] for g in groups], q_mask))
    same(maxsim_kernels.colbert_kd_scores(q, list(d), q_mask, list(d_mask)))  # a 3-D group + 2-D mask each
    same(maxsim_kernels.colbert_kd_scores(q.numpy(), d.numpy(), q_mask.numpy(), d_mask.numpy()))


def test_bad_inputs_say_what_is_wrong():
    gen = torch.Generator().manual_seed(23)
    q, d = _embeddings((2, 3, 8), gen), _embeddings((3, 4, 8), gen)
    with pytest.raises(ValueError, match="documents_mask has shape"):
        maxsim_kernels.colbert_scores(q, d, None, torch.ones(3, 5))
    with pytest.raises(ValueError, match="dim"):
        maxsim_kernels.colbert_scores(q, _embeddings((3, 4, 16), gen))
    with pytest.raises(ValueError, match="has 3 groups but there are 2 queries"):
        maxsim_kernels.colbert_kd_scores(q, _embeddings((3, 2, 4, 8), gen))
    with pytest.raises(ValueError, match="same number of documents"):
        maxsim_kernels.colbert_kd_scores(q, [[d[0], d[1]], [d[2]]])


def test_a_few_exact_values():
    """dim 1, as PyLate's own examples: [1] . [10] = 10 and so on, plus one negative case."""
    q = torch.tensor([[[1.0], [0.0]], [[0.0], [-2.0]]])
    d = torch.tensor([[[10.0], [-3.0], [7.0]], [[-1.0], [-5.0], [0.0]]])
    d_mask = torch.tensor([[True, True, False], [True, True, False]])
    scores = maxsim_kernels.colbert_scores(q, d, None, d_mask)
    # query 0: token [1] -> max(10, -3) = 10 | max(-1, -5) = -1; token [0] adds 0 to both
    # query 1: token [-2] -> max(-20, 6) = 6 | max(2, 10) = 10 (PyLate's zeroing would also say 10 there)
    torch.testing.assert_close(scores, torch.tensor([[10.0, -1.0], [6.0, 10.0]]), atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------------
# gradients
# ----------------------------------------------------------------------------------------------------


def _reference_grads(q, d, q_mask, d_mask, upstream, *, kd=False):
    q64 = q.detach().double().requires_grad_(True)
    d64 = d.detach().double().requires_grad_(True)
    scores = _reference(q64, d64, q_mask, d_mask, kd=kd)
    scores.backward(upstream.double())
    return q64.grad, d64.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kd", [False, True], ids=["all-pairs", "kd"])
@pytest.mark.parametrize(
    ("nq", "nd", "lq", "ld", "dim"), [(3, 4, 5, 7, 16), (2, 3, 6, 9, 24), (3, 2, 4, 5, 12)]
)
def test_gradients_reach_the_padded_inputs(nq, nd, lq, ld, dim, kd, backend):
    gen = torch.Generator().manual_seed(31 + nq + ld + dim + kd)
    q = _embeddings((nq, lq, dim), gen).requires_grad_(True)
    d_shape = (nq, nd, ld) if kd else (nd, ld)
    d = _embeddings((*d_shape, dim), gen).requires_grad_(True)
    q_mask, d_mask = _mask((nq, lq), gen), _mask(d_shape, gen)
    q_mask[0] = False  # an empty query: zero gradient
    fn = maxsim_kernels.colbert_kd_scores if kd else maxsim_kernels.colbert_scores
    scores = fn(q, d, q_mask, d_mask, backend=backend)
    upstream = torch.randn(scores.shape, generator=gen)
    grad_q, grad_d = torch.autograd.grad(scores, (q, d), upstream)
    ref_q, ref_d = _reference_grads(q, d, q_mask, d_mask, upstream, kd=kd)
    torch.testing.assert_close(grad_q.double(), ref_q, atol=GRAD_TOL, rtol=GRAD_TOL)
    torch.testing.assert_close(grad_d.double(), ref_d, atol=GRAD_TOL, rtol=GRAD_TOL)
    assert (grad_q[~q_mask] == 0).all() and (grad_d[~d_mask] == 0).all()  # padding gets nothing


def test_gradients_through_lists_and_dim_padding():
    gen = torch.Generator().manual_seed(41)
    items_q = [_embeddings((n, 5), gen).requires_grad_(True) for n in (3, 1, 4)]
    items_d = [_embeddings((n, 5), gen).requires_grad_(True) for n in (2, 6)]
    scores = maxsim_kernels.colbert_scores(items_q, items_d)
    upstream = torch.randn(scores.shape, generator=gen)
    grads = torch.autograd.grad(scores, items_q + items_d, upstream)
    q_pad = torch.zeros(3, 4, 5)
    q_mask = torch.zeros(3, 4, dtype=torch.bool)
    for k, x in enumerate(items_q):
        q_pad[k, : len(x)], q_mask[k, : len(x)] = x.detach(), True
    d_pad = torch.zeros(2, 6, 5)
    d_mask = torch.zeros(2, 6, dtype=torch.bool)
    for k, x in enumerate(items_d):
        d_pad[k, : len(x)], d_mask[k, : len(x)] = x.detach(), True
    ref_q, ref_d = _reference_grads(q_pad, d_pad, q_mask, d_mask, upstream)
    for k, x in enumerate(items_q):
        torch.testing.assert_close(grads[k].double(), ref_q[k, : len(x)], atol=GRAD_TOL, rtol=GRAD_TOL)
    for k, x in enumerate(items_d):
        torch.testing.assert_close(grads[3 + k].double(), ref_d[k, : len(x)], atol=GRAD_TOL, rtol=GRAD_TOL)


# ----------------------------------------------------------------------------------------------------
# PyLate itself, where it is installed and the masking rules agree (nothing masked)
# ----------------------------------------------------------------------------------------------------


def test_pylate_agrees_when_nothing_is_masked():
    pylate_scores = pytest.importorskip("pylate").scores
    gen = torch.Generator().manual_seed(51)
    q, d, dk = _embeddings((3, 6, 32), gen), _embeddings((4, 9, 32), gen), _embeddings((3, 2, 9, 32), gen)
    ones_q, ones_d, ones_dk = torch.ones(3, 6), torch.ones(4, 9), torch.ones(3, 2, 9)
    ours = maxsim_kernels.colbert_scores(q, d, ones_q, ones_d)
    _close(ours, pylate_scores.colbert_scores(q, d, queries_mask=ones_q, documents_mask=ones_d).double())
    ours_kd = maxsim_kernels.colbert_kd_scores(q, dk, ones_q, ones_dk)
    _close(
        ours_kd, pylate_scores.colbert_kd_scores(q, dk, queries_mask=ones_q, documents_mask=ones_dk).double()
    )


# ----------------------------------------------------------------------------------------------------
# GPU: fp16 / bf16 / fp32 on CUDA, the Triton kernels
# ----------------------------------------------------------------------------------------------------

GPU_TOL = {  # dtype: (scores atol, rtol, gradients atol, rtol) - module docstring
    torch.float16: (1e-3, 1e-4, 2e-3, 2e-3),
    torch.bfloat16: (1e-3, 1e-4, 1.6e-2, 1.6e-2),
    torch.float32: (1e-3, 1e-4, 1e-5, 1e-5),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kd", [False, True], ids=["all-pairs", "kd"])
def test_gpu_against_the_float64_reference(dtype, kd):
    gen = torch.Generator().manual_seed(61)
    nq, nd, lq, ld, dim = 16, 8, 32, 180, 128
    d_shape = (nq, nd, ld) if kd else (nd, ld)
    q = torch.nn.functional.normalize(torch.randn(nq, lq, dim, generator=gen), dim=-1).to("cuda", dtype)
    d = torch.nn.functional.normalize(torch.randn(*d_shape, dim, generator=gen), dim=-1).to("cuda", dtype)
    q_mask, d_mask = _mask((nq, lq), gen, keep=0.8).cuda(), _mask(d_shape, gen, keep=0.8).cuda()
    q.requires_grad_(True)
    d.requires_grad_(True)
    fn = maxsim_kernels.colbert_kd_scores if kd else maxsim_kernels.colbert_scores
    scores = fn(q, d, q_mask, d_mask)
    assert scores.device == q.device and scores.dtype == torch.float32
    atol, rtol, grad_atol, grad_rtol = GPU_TOL[dtype]
    expected = _reference(q.detach(), d.detach(), q_mask, d_mask, kd=kd)  # the same rounded inputs
    _close(scores, expected, atol=atol, rtol=rtol)
    upstream = torch.randn(scores.shape, generator=gen).cuda()
    grad_q, grad_d = torch.autograd.grad(scores, (q, d), upstream)
    assert grad_q.dtype == dtype and grad_d.dtype == dtype
    ref_q, ref_d = _reference_grads(q, d, q_mask, d_mask, upstream, kd=kd)
    torch.testing.assert_close(grad_q.double(), ref_q, atol=grad_atol, rtol=grad_rtol)
    torch.testing.assert_close(grad_d.double(), ref_d, atol=grad_atol, rtol=grad_rtol)
    # lists of ragged documents on the GPU give the same scores as the padded batch
    if not kd:
        listed = maxsim_kernels.colbert_scores(q.detach(), _trimmed(d.detach(), d_mask), q_mask)
        torch.testing.assert_close(listed, scores.detach(), atol=0, rtol=0)
