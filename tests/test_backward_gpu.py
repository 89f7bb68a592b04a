"""Autograd MaxSim on the GPU: accuracy against float64 at training shapes, bitwise reproducibility, the
Triton and torch backends agreeing, and the peak memory of forward + backward.

Tolerances are on the relative error ||g - g_ref|| / ||g_ref|| against float64 (`gradient_check`):
fp16 gradients carry their own output rounding (2^-11 relative per entry), so 1e-3; bf16 (2^-8 per entry)
8e-3; fp32 inputs with fp32 accumulation and no TF32, 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from maxsim_kernels import maxsim_backward as mb

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}


def _batch(num_queries, q_len, num_docs, d_len, dtype, *, seed=0, ragged=True, dim=128):
    """L2-normalised random token vectors on the GPU; lengths in [len/2, len] when ragged."""
    gen = torch.Generator().manual_seed(seed)

    def lengths(n, top):
        if not ragged:
            return torch.full((n,), top, dtype=torch.int64)
        return torch.randint(top // 2, top + 1, (n,), generator=gen)

    def offsets(lens):
        return torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).cuda()

    q_lens, d_lens = lengths(num_queries, q_len), lengths(num_docs, d_len)
    queries = torch.nn.functional.normalize(torch.randn(int(q_lens.sum()), dim, generator=gen), dim=-1)
    docs = torch.nn.functional.normalize(torch.randn(int(d_lens.sum()), dim, generator=gen), dim=-1)
    return queries.to("cuda", dtype), offsets(q_lens), docs.to("cuda", dtype), offsets(d_lens)


def _candidates(num_queries, per_query, num_docs, *, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cand_docs = torch.randint(0, num_docs, (num_queries * per_query,), generator=gen)  # repeats included
    cand_offsets = torch.arange(0, num_queries * per_query + 1, per_query)
    return cand_offsets.cuda(), cand_docs.cuda()


def _fwd_bwd(queries, qo, docs, do, upstream, *, cands=None, backend="auto"):
    q = queries.detach().requires_grad_(True)
    d = docs.detach().requires_grad_(True)
    if cands is None:
        scores = mb.maxsim_varlen_autograd(q, qo, d, do, backend=backend)
    else:
        scores = mb.maxsim_candidates_autograd(q, qo, d, do, *cands, backend=backend)
    return torch.autograd.grad(scores, (q, d), upstream)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["all-pairs", "candidates"])
def test_gradients_against_float64(dtype, layout):
    queries, qo, docs, do = _batch(24, 32, 48, 180, dtype, seed=1)
    kw = {}
    if layout == "candidates":
        kw = dict(zip(("candidate_offsets", "candidate_docs"), _candidates(24, 16, 48, seed=2), strict=True))
    report = mb.gradient_check(queries, qo, docs, do, seed=5, **kw)
    assert report["dq_rel_error"] <= TOLERANCE[dtype], report
    assert report["dd_rel_error"] <= TOLERANCE[dtype], report
    assert report["bitwise_repeatable"], report


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_two_runs_are_bitwise_equal_at_training_shapes(dtype):
    """ColBERT contrastive (128 x 32 vs 256 x 180, ragged; four steps) and per-query candidates (64 x 32)."""
    queries, qo, docs, do = _batch(128, 32, 256, 180, dtype, seed=3)
    upstream = torch.randn(128, 256, device="cuda")
    first = _fwd_bwd(queries, qo, docs, do, upstream)
    for _ in range(3):  # from the third step on, the launches go through the compiled launchers
        again = _fwd_bwd(queries, qo, docs, do, upstream)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))

    cands = _candidates(128, 32, 256, seed=4)
    upstream = torch.randn(128 * 32, device="cuda")
    first = _fwd_bwd(queries, qo, docs, do, upstream, cands=cands)
    second = _fwd_bwd(queries, qo, docs, do, upstream, cands=cands)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_triton_and_torch_backends_agree_on_cuda():
    queries, qo, docs, do = _batch(32, 32, 64, 180, torch.float32, seed=6)
    upstream = torch.randn(32, 64, device="cuda")
    triton_grads = _fwd_bwd(queries, qo, docs, do, upstream, backend="triton")
    torch_grads = _fwd_bwd(queries, qo, docs, do, upstream, backend="torch")
    for a, b in zip(triton_grads, torch_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # same argmax, fp32 sums in other orders


def test_peak_memory_of_forward_and_backward():
    """ColPali 32 x 1024 vs 32 x 1024 (fp16): what fwd + bwd allocates beyond the inputs.

    It holds the two gradients (= the inputs' size), the argmax (int16 for documents under 2^15 tokens:
    2 B a pair), the int16 inverse lists (2 B a pair) and their int16 row pointers and counts (4 B x 8
    segments x 32768 tokens), the lists freed before the query gradient exists: ~19 MiB by the byte
    count; 48 B a pair allowed. Materialising the similarities alone would take
    2 B x 32 x 32 x 1024 x 1024 = 2 GiB.
    """
    queries, qo, docs, do = _batch(32, 1024, 32, 1024, torch.float16, seed=7, ragged=False)
    peak = _step_peak_bytes(queries, qo, docs, do)
    pairs = queries.shape[0] * 32
    input_bytes = queries.nbytes + docs.nbytes
    similarity_bytes = 2 * 32 * 32 * 1024 * 1024
    print(f"fwd+bwd peak beyond the inputs: {peak / 2**20:.1f} MiB ({pairs} pairs)")
    assert peak <= input_bytes + 48 * pairs + (4 << 20)
    assert peak * 25 <= similarity_bytes


def _step_peak_bytes(queries, qo, docs, do) -> int:  # noqa: ANN001
    """Peak bytes one forward + backward allocates beyond what was allocated before it (a first step
    compiles and warms the allocator outside the measurement); 32 x 32 pairs."""
    upstream = torch.randn(32, 32, device="cuda")
    _fwd_bwd(queries, qo, docs, do, upstream)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = _fwd_bwd(queries, qo, docs, do, upstream)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del grads
    return peak


@pytest.mark.parametrize("layout", ["all-pairs", "candidates"])
def test_offsets_on_the_host_give_the_same_gradients(layout):
    """The forward takes offsets and candidate lists on the host; so must the backward."""
    queries, qo, docs, do = _batch(8, 32, 40, 100, torch.float16, seed=4)
    cands = _candidates(8, 10, 40, seed=4) if layout == "candidates" else None
    scores_shape = (80,) if cands else (8, 40)
    upstream = torch.randn(scores_shape, device="cuda")
    on_gpu = _fwd_bwd(queries, qo, docs, do, upstream, cands=cands)
    host_cands = tuple(c.cpu() for c in cands) if cands else None
    on_host = _fwd_bwd(queries, qo.cpu(), docs, do.cpu(), upstream, cands=host_cands)
    for a, b in zip(on_gpu, on_host, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("path", ["onehot", "csr"])
def test_document_gradient_paths_at_short_queries_against_long_documents(dtype, path, monkeypatch):
    """ColPali-shaped batches (32-token queries, documents of ~1000 tokens, ragged) on both document-gradient
    paths: against float64, bitwise repeatable, and the two paths within rounding of each other."""
    monkeypatch.setattr(mb, "_DD_PATH", path)
    queries, qo, docs, do = _batch(32, 32, 32, 1024, dtype, seed=11)
    report = mb.gradient_check(queries, qo, docs, do, seed=12)
    assert report["dq_rel_error"] <= TOLERANCE[dtype], report
    assert report["dd_rel_error"] <= TOLERANCE[dtype], report
    assert report["bitwise_repeatable"], report


@pytest.mark.parametrize(
    "q_lens, d_lens, dim",
    [
        ([1, 32, 7, 1], [1, 1000, 0, 64, 65, 3], 96),  # length 1, an empty document, dim not a power of 2
        ([100, 3], [300, 129], 128),  # a query over 64 tokens (128-token blocks), blocks past a document
        ([40, 33, 5], [70, 1], 8),  # dim under 16 (the tile pads it)
    ],
)
def test_onehot_document_gradient_on_adversarial_layouts(q_lens, d_lens, dim, monkeypatch):
    monkeypatch.setattr(mb, "_DD_PATH", "onehot")
    gen = torch.Generator().manual_seed(sum(q_lens) + dim)
    queries = torch.nn.functional.normalize(torch.randn(sum(q_lens), dim, generator=gen), dim=-1)
    docs = torch.nn.functional.normalize(torch.randn(sum(d_lens), dim, generator=gen), dim=-1)
    docs[1::7] = docs[0]  # exact ties: the lowest index takes the gradient
    qo = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]).cuda()
    do = torch.tensor([0, *torch.tensor(d_lens).cumsum(0).tolist()]).cuda()
    report = mb.gradient_check(queries.cuda().half(), qo, docs.cuda().half(), do, seed=3)
    assert report["dq_rel_error"] <= TOLERANCE[torch.float16], report
    assert report["dd_rel_error"] <= TOLERANCE[torch.float16], report
    assert report["bitwise_repeatable"], report


def test_peak_memory_at_short_queries_against_long_documents():
    """32 queries x 32 tokens vs 32 documents x 1024 (fp16): beyond the inputs, the two gradients, the
    int16 argmax and the scores (the one-hot document gradient keeps no inverse map)."""
    queries, qo, docs, do = _batch(32, 32, 32, 1024, torch.float16, seed=13, ragged=False)
    peak = _step_peak_bytes(queries, qo, docs, do)
    pairs = queries.shape[0] * 32
    assert peak <= queries.nbytes + docs.nbytes + 8 * pairs + (1 << 20), peak
