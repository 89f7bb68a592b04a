"""Autograd MaxSim (kernels/maxsim_backward.py) on the CPU: the torch path and the Triton kernels under
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 on machines without a GPU).

References are float64 and independent of the code under test:
- `_amax_reference`: torch autograd of materialised similarities reduced with `amax` (random inputs,
  where ties have probability 0; at an exact tie autograd of amax splits the gradient evenly);
- `_lowest_index_reference`: autograd of the similarities gathered at `argmax` (the first maximum),
  which routes the whole gradient to the lowest tied index, the forward's rule (tie tests).

Tolerances: fp32 inputs reduce at most a few dozen unit-scale products in fp32, so each entry is within
~n * 2^-24 * max|term| of float64: atol = rtol = 1e-5 holds with a wide margin. fp16 inputs return fp16
gradients, whose rounding alone is 2^-11 ~ 4.9e-4 relative: rtol 2e-3, atol 2e-3 (unit-scale data).
"""

from __future__ import annotations

import itertools
import os

import maxsim_kernels
import pytest
import torch
from maxsim_kernels import maxsim_backward as mb

# Triton on CPU tensors runs only under the interpreter; tests/test_backward_gpu.py covers CUDA.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")),
]


# ----------------------------------------------------------------------------------------------------
# inputs and references
# ----------------------------------------------------------------------------------------------------


def _offsets(lengths: list[int]) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int64)


def _layout(q_lens, d_lens, dim, *, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    queries = torch.randn(sum(q_lens), dim, generator=gen).to(dtype)
    docs = torch.randn(sum(d_lens), dim, generator=gen).to(dtype)
    return queries, _offsets(q_lens), docs, _offsets(d_lens)


def _pair_score(q_rows, d_rows, rule):
    sims = q_rows @ d_rows.T
    if rule == "amax":
        return sims.amax(dim=1).sum()
    first = sims.detach().argmax(dim=1, keepdim=True)  # first maximum: the lowest index
    return sims.gather(1, first).sum()


def _reference(queries, qo, docs, do, upstream, *, cands=None, rule="amax"):
    """float64 (dL/dQ, dL/dD) for L = <upstream, S> by autograd, pair by pair."""
    q = queries.detach().double().requires_grad_(True)
    d = docs.detach().double().requires_grad_(True)
    qo, do = qo.tolist(), do.tolist()
    if cands is None:
        pairs = [(a, b) for a in range(len(qo) - 1) for b in range(len(do) - 1)]
    else:
        co, cd = cands[0].tolist(), cands[1].tolist()
        pairs = [(a, cd[c]) for a in range(len(qo) - 1) for c in range(co[a], co[a + 1])]
    scores = [_pair_score(q[qo[a] : qo[a + 1]], d[do[b] : do[b + 1]], rule) for a, b in pairs]
    scores = torch.stack(scores).reshape(upstream.shape)
    scores.backward(upstream.double())
    return scores.detach(), q.grad, d.grad


def _run(queries, qo, docs, do, upstream, *, backend, cands=None):
    q = queries.clone().requires_grad_(True)
    d = docs.clone().requires_grad_(True)
    if cands is None:
        scores = mb.maxsim_varlen_autograd(q, qo, d, do, backend=backend)
    else:
        scores = mb.maxsim_candidates_autograd(q, qo, d, do, cands[0], cands[1], backend=backend)
    scores.backward(upstream.to(scores.dtype))
    return scores.detach(), q.grad, d.grad


def _upstream(shape, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------
# all pairs
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "q_lens, d_lens, dim",
    [
        ([4, 4, 4], [6, 6], 16),  # uniform
        ([3, 9, 1, 5], [7, 1, 12, 4, 2], 24),  # ragged both sides, length-1 items, dim not a power of 2
        ([17], [3, 30, 5], 8),  # one long query, more tokens than a kernel block
    ],
)
def test_all_pairs_random_fp32(backend, q_lens, d_lens, dim):
    queries, qo, docs, do = _layout(q_lens, d_lens, dim)
    upstream = _upstream((len(q_lens), len(d_lens)))
    ref_s, ref_q, ref_d = _reference(queries, qo, docs, do, upstream)
    s, gq, gd = _run(queries, qo, docs, do, upstream, backend=backend)
    assert gq.dtype == torch.float32 and gd.dtype == torch.float32
    torch.testing.assert_close(s.double(), ref_s, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gq.double(), ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gd.double(), ref_d, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_pairs_fp16_returns_fp16_gradients(backend):
    queries, qo, docs, do = _layout([5, 2, 7], [9, 3, 6, 4], 32, dtype=torch.float16)
    upstream = _upstream((3, 4))
    _, ref_q, ref_d = _reference(queries, qo, docs, do, upstream)
    _, gq, gd = _run(queries, qo, docs, do, upstream, backend=backend)
    assert gq.dtype == torch.float16 and gd.dtype == torch.float16
    torch.testing.assert_close(gq.double(), ref_q, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(gd.double(), ref_d, atol=2e-3, rtol=2e-3)


def _tie_layout():
    """Integer-valued embeddings, so every dot product is exact and ties are exact in any order."""
    gen = torch.Generator().manual_seed(3)
    queries = torch.randint(-1, 3, (10, 8), generator=gen).float()
    docs = torch.randint(-1, 2, (14, 8), generator=gen).float()
    docs[3] = docs[1]  # doc 0 (rows 0-5): rows 1 and 3 tie for every query token
    docs[5] = docs[1]
    docs[9] = docs[7]  # doc 1 (rows 6-9)
    docs[10:14] = 0.0  # doc 2: all four tokens tie at similarity 0
    return queries, _offsets([4, 1, 5]), docs, _offsets([6, 4, 4])


@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_ties_route_to_lowest_index(backend):
    queries, qo, docs, do = _tie_layout()
    upstream = _upstream((3, 3))
    _, ref_q, ref_d = _reference(queries, qo, docs, do, upstream, rule="lowest")
    _, gq, gd = _run(queries, qo, docs, do, upstream, backend=backend)
    torch.testing.assert_close(gq.double(), ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gd.double(), ref_d, atol=1e-5, rtol=1e-5)
    # the tied later copies never win, so their gradient is exactly zero
    assert not gd[[3, 5, 9, 11, 12, 13]].any()
    assert gd[10].abs().sum() > 0  # first of the all-zero tokens takes every query token of doc 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_hot_token_and_unchosen_token(backend):
    """One document token wins for every query token; another never wins and gets an exact zero."""
    gen = torch.Generator().manual_seed(5)
    queries = torch.rand(40, 16, generator=gen) + 0.1  # positive entries
    docs = torch.randn(12, 16, generator=gen) * 0.1
    docs[2] = 5.0  # hot: the largest dot product with every (positive) query token
    docs[7] = -5.0  # cold: the smallest, never chosen
    qo, do = _offsets([13, 27]), _offsets([5, 7])
    upstream = _upstream((2, 2))
    _, ref_q, ref_d = _reference(queries, qo, docs, do, upstream)
    _, gq, gd = _run(queries, qo, docs, do, upstream, backend=backend)
    torch.testing.assert_close(gq.double(), ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gd.double(), ref_d, atol=1e-4, rtol=1e-5)  # a 40-term sum of |Q| ~ 0.6
    assert torch.equal(gd[7], torch.zeros(16))
    expected_hot = upstream[0, 0] * queries[:13].sum(0) + upstream[1, 0] * queries[13:].sum(0)
    torch.testing.assert_close(gd[2], expected_hot, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_one_side_requires_grad(backend):
    queries, qo, docs, do = _layout([3, 4], [5, 2], 8)
    q = queries.clone().requires_grad_(True)
    scores = mb.maxsim_varlen_autograd(q, qo, docs, do, backend=backend)
    scores.sum().backward()
    _, ref_q, _ = _reference(queries, qo, docs, do, torch.ones(2, 2))
    torch.testing.assert_close(q.grad.double(), ref_q, atol=1e-5, rtol=1e-5)
    d = docs.clone().requires_grad_(True)
    scores, argmax = mb.maxsim_varlen_autograd(queries, qo, d, do, backend=backend, return_argmax=True)
    assert argmax.dtype == torch.int32 and argmax.shape == (7, 2) and not argmax.requires_grad
    scores.sum().backward()
    assert d.grad.shape == docs.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_document_and_many_csr_segments(backend, monkeypatch):
    """An empty document scores -inf and takes no gradient; the inverse map built from 16-token segments
    (several per batch of queries) gives the same gradients."""
    monkeypatch.setattr(mb, "_CSR_MAX_SEGMENT", 16)
    queries, qo, docs, do = _layout([3, 6, 11, 9], [4, 5, 2], 16, seed=13)
    do_empty = torch.tensor([0, 4, 4, 9, 11])  # doc 1 is empty
    upstream = _upstream((4, 4))
    s, gq, gd = _run(queries, qo, docs, do_empty, upstream, backend=backend)
    assert torch.isinf(s[:, 1]).all() and (s[:, 1] < 0).all()
    _, ref_q, ref_d = _reference(queries, qo, docs, do, upstream[:, [0, 2, 3]])
    torch.testing.assert_close(gq.double(), ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gd.double(), ref_d, atol=1e-5, rtol=1e-5)


def _inverse_lists(inverse, doc_offsets: torch.Tensor) -> list[list[int]]:
    """Every document token's full list of query tokens, read from an `InverseMap` on the host."""
    order, start, count = (t.long().cpu() for t in (inverse.order, inverse.row_start, inverse.row_count))
    offsets = doc_offsets.cpu().tolist()
    num_query_tokens = order.numel() // max(1, len(offsets) - 1)
    out = []
    for d in range(len(offsets) - 1):
        for j in range(offsets[d], offsets[d + 1]):
            listed = []
            for s in range(start.shape[0]):
                r = d * num_query_tokens + s * inverse.segment + int(start[s, j])
                listed += [s * inverse.segment + int(x) for x in order[r : r + int(count[s, j])]]
            out.append(listed)
    return out


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("max_segment, doc_block, query_tokens", [(256, 256, 21), (16, 16, 37), (16, 4, 64)])
def test_all_pairs_inverse_csr_lists_every_pair_in_order(max_segment, doc_block, query_tokens, monkeypatch):
    """Every (query token, document) pair is listed once, under its winner, in increasing query token
    order, across segments; ties, an empty document, a one-token document and a token no query picks."""
    monkeypatch.setattr(mb, "_CSR_MAX_SEGMENT", max_segment)
    monkeypatch.setattr(mb, "_CSR_DOC_BLOCK", doc_block)
    gen = torch.Generator().manual_seed(17)
    lens = (3, 0, 5, 1, 12)
    do = torch.tensor([0, *itertools.accumulate(lens)])
    columns = [torch.randint(0, n, (query_tokens,), generator=gen) if n else torch.full((query_tokens,), -1)
               for n in lens]  # fmt: skip
    columns[4] = columns[4] % 6 * 2  # doc 4: only even tokens win, many times each
    argmax = torch.stack(columns, dim=1).to(torch.int32)
    inverse = mb.build_inverse_csr_all_pairs(argmax, do, int(do[-1]), max(lens))
    listed = _inverse_lists(inverse, do)
    for doc, n in enumerate(lens):
        for local in range(n):
            want = (argmax[:, doc] == local).nonzero().flatten().tolist()
            assert listed[int(do[doc]) + local] == want, (doc, local)
    assert sum(len(x) for x in listed) == query_tokens * 4


def test_inverse_map_launch_does_not_depend_on_batch_size_or_lengths(monkeypatch):
    """The CSR kernel's compile-time constants come from the document-count class only (and a cap for
    documents of 2^19 tokens or more), so batch sizes and lengths never recompile it."""
    monkeypatch.setattr(mb, "_CSR_MAX_SEGMENT", 4096)  # the GPU sizes (the interpreter's are smaller)
    monkeypatch.setattr(mb, "_CSR_MANY_DOCS_SEGMENT", 1024)
    for docs in ([1, 16, 63], [64, 333, 4097]):
        assert len({mb._csr_segment(n, max_len) for n in docs for max_len in (1, 5, 64, 1000, 1 << 18)}) == 1
    assert mb._csr_segment(1, 1 << 20) < mb._csr_segment(1, 1000)  # int31 keys for a very long document


def test_triton_matches_torch_path_and_repeats_bitwise():
    if not INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1")
    queries, qo, docs, do = _layout([6, 1, 9], [4, 11, 7, 3], 16, seed=7)
    upstream = _upstream((3, 4), seed=8)
    _, tq, td = _run(queries, qo, docs, do, upstream, backend="torch")
    _, gq, gd = _run(queries, qo, docs, do, upstream, backend="triton")
    _, gq2, gd2 = _run(queries, qo, docs, do, upstream, backend="triton")
    torch.testing.assert_close(gq, tq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gd, td, atol=1e-5, rtol=1e-5)
    assert torch.equal(gq, gq2) and torch.equal(gd, gd2)


# ----------------------------------------------------------------------------------------------------
# per-query candidates
# ----------------------------------------------------------------------------------------------------


def _candidates():
    # query 0: docs 2, 0; query 1: none; query 2: docs 0, 3, 2, 0 (doc 0 twice); query 3: doc 1
    return torch.tensor([0, 2, 2, 6, 7]), torch.tensor([2, 0, 0, 3, 2, 0, 1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_candidates_random_fp32(backend):
    queries, qo, docs, do = _layout([5, 3, 12, 1], [4, 9, 1, 6], 24, seed=11)
    cands = _candidates()
    upstream = _upstream((7,))
    ref_s, ref_q, ref_d = _reference(queries, qo, docs, do, upstream, cands=cands)
    s, gq, gd = _run(queries, qo, docs, do, upstream, backend=backend, cands=cands)
    torch.testing.assert_close(s.double(), ref_s, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gq.double(), ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gd.double(), ref_d, atol=1e-5, rtol=1e-5)
    assert not gq[5:8].any()  # query 1 has no candidates


@pytest.mark.parametrize("backend", BACKENDS)
def test_candidates_exact_ties(backend):
    queries, qo, docs, do = _tie_layout()
    cands = (torch.tensor([0, 2, 3, 5]), torch.tensor([0, 2, 1, 2, 0]))
    upstream = _upstream((5,))
    _, ref_q, ref_d = _reference(queries, qo, docs, do, upstream, cands=cands, rule="lowest")
    _, gq, gd = _run(queries, qo, docs, do, upstream, backend=backend, cands=cands)
    torch.testing.assert_close(gq.double(), ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gd.double(), ref_d, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# gradcheck (float64, torch path), the inverse CSR, int8 documents, gradient_check
# ----------------------------------------------------------------------------------------------------


def test_gradcheck_all_pairs_float64():
    queries, qo, docs, do = _layout([3, 1, 4], [2, 5, 3], 8, seed=21, dtype=torch.float64)
    q = queries.requires_grad_(True)
    d = docs.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: mb.maxsim_varlen_autograd(a, qo, b, do), (q, d))


def test_gradcheck_candidates_float64():
    queries, qo, docs, do = _layout([2, 3, 1], [4, 1, 3], 8, seed=22, dtype=torch.float64)
    co, cd = torch.tensor([0, 2, 5, 6]), torch.tensor([1, 2, 0, 2, 0, 1])
    q = queries.requires_grad_(True)
    d = docs.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: mb.maxsim_candidates_autograd(a, qo, b, do, co, cd), (q, d))


def test_sorted_inverse_csr_groups_pairs_in_order():
    num_doc_tokens = 5
    keys = torch.tensor([3, 0, 3, 5, 1, 3, 0], dtype=torch.int32)  # 5 = no winner
    row_ptr, order = mb.build_inverse_csr(keys, num_doc_tokens)
    assert row_ptr.tolist() == [0, 2, 3, 3, 6, 6]
    assert order[:6].tolist() == [1, 6, 4, 0, 2, 5]


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_docs_query_gradient_uses_dequantized_rows(backend):
    gen = torch.Generator().manual_seed(31)
    docs8 = torch.randint(-127, 128, (15, 16), generator=gen, dtype=torch.int8)
    scales = torch.rand(15, generator=gen) * 0.02 + 0.005
    queries = torch.randn(9, 16, generator=gen)
    qo, do = _offsets([4, 5]), _offsets([6, 2, 7])
    dequant = docs8.double() * scales.double()[:, None]
    upstream = _upstream((2, 3))
    _, argmax = maxsim_kernels.maxsim_reference(queries, qo, docs8, do, return_argmax=True, doc_scales=scales)
    gq, gd = mb.maxsim_backward(upstream, argmax, queries, qo, docs8, do, doc_scales=scales, backend=backend)
    assert gd is None
    _, ref_q, _ = _reference(queries, qo, dequant, do, upstream)
    torch.testing.assert_close(gq.double(), ref_q, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cands", [None, _candidates()])
def test_gradient_check_reports_small_errors(cands):
    queries, qo, docs, do = _layout([5, 3, 12, 1], [4, 9, 1, 6], 24, seed=41)
    kw = {} if cands is None else {"candidate_offsets": cands[0], "candidate_docs": cands[1]}
    report = mb.gradient_check(queries, qo, docs, do, seed=3, **kw)
    assert report["dq_rel_error"] <= 1e-6 and report["dd_rel_error"] <= 1e-6
    assert report["argmax_agreement"] == 1.0 and report["bitwise_repeatable"]
    assert report["pairs"] == (21 * 4 if cands is None else 5 * 2 + 12 * 4 + 1)
    assert report["seed"] == 3


def test_torch_path_gradients_are_bitwise_repeatable_with_several_threads():
    """Many query tokens choosing the same few document tokens: the CPU sums must not depend on threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        g = torch.Generator().manual_seed(7)
        queries = torch.randn(4000, 64, generator=g, dtype=torch.float32)
        docs = torch.randn(6, 64, generator=g, dtype=torch.float32)
        query_offsets = torch.arange(0, 4001, 40, dtype=torch.int64)
        doc_offsets = torch.tensor([0, 3, 6], dtype=torch.int64)
        grads = []
        for _ in range(3):
            q = queries.clone().requires_grad_(True)
            d = docs.clone().requires_grad_(True)
            scores = maxsim_kernels.maxsim_varlen(q, query_offsets, d, doc_offsets, backend="torch")
            scores.backward(torch.ones_like(scores))
            grads.append((q.grad, d.grad))
        for gq, gd in grads[1:]:
            assert torch.equal(gq, grads[0][0]) and torch.equal(gd, grads[0][1])
    finally:
        torch.set_num_threads(threads)


_CSR_SM90_BUILD = r"""
import maxsim_kernels.maxsim_backward as mb

kernel = mb._maxsim_inverse_csr_kernel
names = kernel.arg_names
report = {}
for segment in (mb._CSR_MANY_DOCS_SEGMENT, mb._CSR_MAX_SEGMENT):
  for argmax in ("*i32", "*i16"):  # the autograd path keeps an int16 argmax for documents under 2^15
    consts = dict(SEGMENT=segment, LOG_SEGMENT=segment.bit_length() - 1, DOC_BLOCK=mb._CSR_DOC_BLOCK)
    sig = {"argmax_ptr": argmax, "doc_offsets_ptr": "*i64", "order_ptr": "*i16", "row_start_ptr": "*i16",
           "row_count_ptr": "*i16", "num_query_tokens": "i32", "num_docs": "i32", "num_doc_tokens": "i32",
           **{c: "constexpr" for c in consts}}
    src = ASTSource(kernel, sig, constexprs={(names.index(c),): v for c, v in consts.items()})
    warps = 8 if segment >= 4096 else 4
    compiled = triton.compile(src, target=SM90, options={"num_warps": warps})
    report[f"{segment} {argmax}"] = resource_usage(compiled)
print(json.dumps(report))
"""


def test_inverse_map_kernel_builds_for_sm90_without_spills(sm90_build):
    """The CSR kernel at both segment sizes compiles for Hopper with triton's own ptxas (no GPU needed)
    and keeps its sort in registers: nothing spills to local memory."""
    for segment, usage in sm90_build(_CSR_SM90_BUILD).items():
        assert not usage or "LOCAL:0" in usage, f"segment {segment}: spills to local memory: {usage}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_queries_give_zero_document_gradients(backend):
    """A batch with no queries scores [0, nd] and sends an exact zero gradient to every document (the
    inverse map has no segment, so no list is read)."""
    queries = torch.zeros(0, 16, requires_grad=True)
    docs = torch.randn(7, 16, requires_grad=True)
    no_offsets, doc_offsets = torch.zeros(1, dtype=torch.int64), torch.tensor([0, 3, 7])
    scores = maxsim_kernels.maxsim_varlen(queries, no_offsets, docs, doc_offsets, backend=backend)
    assert scores.shape == (0, 2)
    grad_q, grad_d = torch.autograd.grad(scores.sum(), (queries, docs))
    assert grad_q.shape == (0, 16) and torch.equal(grad_d, torch.zeros_like(docs))


@pytest.mark.parametrize("backend", BACKENDS)
def test_returned_argmax_takes_no_part_in_the_backward(backend):
    """With the argmax returned too, the gradients are those of the scores alone: the Functions ask for
    no zero-filled stand-in for the argmax's gradient (`set_materialize_grads(False)`)."""
    torch.manual_seed(3)
    queries = torch.randn(9, 16, requires_grad=True)
    docs = torch.randn(11, 16, requires_grad=True)
    qo, do = torch.tensor([0, 4, 9]), torch.tensor([0, 5, 11])
    weights = torch.randn(2, 2)
    plain = maxsim_kernels.maxsim_varlen(queries, qo, docs, do, backend=backend)
    expected = torch.autograd.grad((plain * weights).sum(), (queries, docs))
    scores, argmax = maxsim_kernels.maxsim_varlen(queries, qo, docs, do, backend=backend, return_argmax=True)
    assert not argmax.requires_grad
    got = torch.autograd.grad((scores * weights).sum() + argmax.sum(), (queries, docs))
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    empty = mb.MaxSimVarlenFunction.backward(None, None, None)  # no gradient reached the scores
    assert all(g is None for g in empty)


# ----------------------------------------------------------------------------------------------------
# the one-hot document gradient (16-bit inputs, short queries)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    "q_lens, d_lens, dim",
    [
        ([3, 1, 7], [70, 1, 0, 5], 24),  # length 1, an empty document, two token blocks, dim not 2^k
        ([40, 2], [9, 65], 8),  # a query over 32 tokens (64-token blocks), dim under the tile's 16
        ([32, 32, 32], [64, 64], 16),  # queries and documents exactly one block long
    ],
)
def test_onehot_document_gradient_matches_float64(q_lens, d_lens, dim, monkeypatch):
    monkeypatch.setattr(mb, "_DD_PATH", "onehot")
    queries, qo, docs, do = _layout(q_lens, d_lens, dim, seed=21, dtype=torch.float16)
    upstream = _upstream((len(q_lens), len(d_lens)))
    nonempty = [b for b, n in enumerate(d_lens) if n]
    _, ref_q, ref_d = _reference(queries, qo, docs, _offsets([d_lens[b] for b in nonempty]),
                                 upstream[:, nonempty])  # fmt: skip
    _, gq, gd = _run(queries, qo, docs, do, upstream, backend="triton")
    assert gd.dtype == torch.float16
    torch.testing.assert_close(gq.double(), ref_q, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(gd.double(), ref_d, atol=2e-3, rtol=2e-3)


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")
def test_onehot_document_gradient_ties_and_unchosen_tokens(monkeypatch):
    """Exact ties route to the lowest index on the one-hot path too; tied copies get exact zeros."""
    monkeypatch.setattr(mb, "_DD_PATH", "onehot")
    queries, qo, docs, do = (t.half() if t.is_floating_point() else t for t in _tie_layout())
    upstream = _upstream((3, 3))
    _, ref_q, ref_d = _reference(queries, qo, docs, do, upstream, rule="lowest")
    _, gq, gd = _run(queries, qo, docs, do, upstream, backend="triton")
    torch.testing.assert_close(gd.double(), ref_d, atol=2e-2, rtol=2e-3)  # integer sums up to ~20
    assert not gd[[3, 5, 9, 11, 12, 13]].any()


def test_onehot_path_is_taken_by_dtype_and_size(monkeypatch):
    """The one-hot document gradient takes 16-bit batches of short queries, fewer documents than the
    inverse map's many-documents class and at most _ONEHOT_MAX_STEPS steps (32 x 32 tokens vs 32 x 1024)."""
    monkeypatch.setattr(mb, "_DD_PATH", "auto")
    pick = mb._onehot_block_i
    assert pick(torch.float16, 32, 1024, 32, 32, 1024) == 32
    assert pick(torch.bfloat16, 32, 1024, 32, 33, 1024) == 64
    assert pick(torch.float32, 32, 1024, 32, 32, 1024) is None  # fp32: the inverse map
    assert pick(torch.float16, 32, 1024, 32, 129, 1024) is None  # long queries: the inverse map
    assert pick(torch.float16, 64, 2048, mb._CSR_MANY_DOCS, 32, 1024) is None  # many documents
    assert pick(torch.float16, 63, 2016, 63, 32, 1024) is None  # 63 x 63 x 16 steps > _ONEHOT_MAX_STEPS
    monkeypatch.setattr(mb, "_DD_PATH", "csr")
    assert pick(torch.float16, 32, 1024, 32, 32, 1024) is None
    monkeypatch.setattr(mb, "_DD_PATH", "onehot")
    assert pick(torch.float16, 128, 4096, 128, 32, 1024) == 32
