"""MaxSim forward (Triton under the interpreter, torch CPU backend) against the float64 reference.

Tolerances. Every backend multiplies the *same* rounded inputs (fp16/bf16/fp32 values are exact in
float64), so the only error is fp32 accumulation: a dot product of `dim` terms of unit vectors is off by
at most ~dim * 2^-24 * sum|q_k d_k| <= dim * 6e-8, and a score adds up to `Lq` such maxima. We allow
|score - ref| <= 2e-6 * Lq * max(1, dim / 32) + 1e-6 * |ref|, a few times that bound (tf32 is never used
here). The argmax must equal the reference wherever the best and second-best similarity of a (query
token, document) pair differ by more than 1e-5 (far above fp32 rounding of one dot product); elsewhere
the chosen token's similarity must be within 1e-5 of the max.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

# tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA (never on a GPU machine, where the
# GPU-marked tests must compile real kernels in this same process).
import maxsim_kernels
import numpy as np
import pytest
import torch
from maxsim_kernels import (
    maxsim_candidates,
    maxsim_candidates_reference,
    maxsim_reference,
    maxsim_varlen,
)

HAS_TRITON_CPU = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
BACKENDS = ["torch"] + (["triton"] if HAS_TRITON_CPU else [])


def packed(lens, dim, dtype=torch.float32, *, sign=None, gen=None):
    """Unit vectors packed as [sum(lens), dim] + int64 offsets; `sign` forces every coordinate's sign."""
    lens = torch.as_tensor(lens, dtype=torch.int64)
    off = torch.zeros(len(lens) + 1, dtype=torch.int64)
    off[1:] = torch.cumsum(lens, 0)
    x = torch.randn(int(off[-1]), dim, generator=gen, dtype=torch.float64)
    if sign is not None:
        x = sign * x.abs()
    x = torch.nn.functional.normalize(x, dim=-1)
    return x.to(dtype), off


def tol(ref: torch.Tensor, q_lens, dim: int) -> torch.Tensor:
    return 2e-6 * torch.as_tensor(q_lens, dtype=torch.float64) * max(1.0, dim / 32) + 1e-6 * ref.abs()


def check_scores(out: torch.Tensor, ref: torch.Tensor, q_lens, dim: int) -> None:
    assert out.dtype == torch.float32
    out = out.double()
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(out), inf), "empty documents must score -inf, nothing else"
    bound = tol(ref, q_lens, dim)
    err = (out - ref).abs()
    ok = err <= bound
    assert bool((ok | inf).all()), f"max err {err[~inf].max().item():.3g} over bound"


def check_argmax(arg, queries, q_off, docs, d_off, pairs) -> None:
    """`pairs`: list of (query index, doc index, argmax row [Lq]) to check against float64 similarities."""
    q64, d64 = queries.double(), docs.double()
    for qi, di, row in pairs:
        q = q64[q_off[qi] : q_off[qi + 1]]
        d = d64[d_off[di] : d_off[di + 1]]
        if d.shape[0] == 0:
            assert bool((row[: q.shape[0]] == -1).all())
            continue
        sim = q @ d.T
        best = sim.max(dim=1).values
        first = (sim == best[:, None]).int().argmax(dim=1)  # lowest index reaching the max
        second = sim.topk(min(2, d.shape[0]), dim=1).values[:, -1] if d.shape[0] > 1 else best - 1
        row = row[: q.shape[0]].long()
        assert bool(((row >= 0) & (row < d.shape[0])).all())
        chosen = sim.gather(1, row[:, None])[:, 0]
        clear = (best - second) > 1e-5
        assert bool((row[clear] == first[clear]).all()), "argmax differs where the max is clear"
        assert bool((chosen >= best - 1e-5).all())


def assert_same_as_argmax_scores(plain: torch.Tensor, scores: torch.Tensor, backend: str) -> None:
    """Scores without and with the argmax. On the GPU they are bitwise equal (tests/test_kernels_gpu.py
    checks that). Under Triton's interpreter, tl.dot is numpy's float32 matmul, whose sums follow the
    operands' layout (triton 3.8: 1 ulp apart between the scores-only document-major tiles and the argmax
    tiles), so here they agree to 4 float32 ulps of the score."""
    if backend == "triton" and HAS_TRITON_CPU:
        torch.testing.assert_close(plain, scores, rtol=4 * 2**-23, atol=1e-6)
    else:
        assert torch.equal(plain, scores), "scores must not depend on return_argmax"


def varlen_case(q_lens, d_lens, dim, dtype, backend, *, seed=0, q_sign=None, d_sign=None):
    gen = torch.Generator().manual_seed(seed)
    queries, q_off = packed(q_lens, dim, dtype, sign=q_sign, gen=gen)
    docs, d_off = packed(d_lens, dim, dtype, sign=d_sign, gen=gen)
    scores, arg = maxsim_varlen(queries, q_off, docs, d_off, return_argmax=True, backend=backend)
    ref, ref_arg = maxsim_reference(queries, q_off, docs, d_off, return_argmax=True)
    assert scores.shape == (len(q_lens), len(d_lens)) and arg.shape == (queries.shape[0], len(d_lens))
    assert arg.dtype == torch.int32
    check_scores(scores, ref, torch.as_tensor(q_lens)[:, None], dim)
    plain = maxsim_varlen(queries, q_off, docs, d_off, backend=backend)
    if backend == "triton":
        assert_same_as_argmax_scores(plain, scores, backend)
    else:  # the CPU path streams when no argmax is asked for: the same maxima, another summation order
        check_scores(plain, ref, torch.as_tensor(q_lens)[:, None], dim)
    pairs = []
    for qi in range(len(q_lens)):
        for di in range(len(d_lens)):
            pairs.append((qi, di, arg[q_off[qi] : q_off[qi + 1], di]))
    check_argmax(arg, queries, q_off, docs, d_off, pairs)
    return scores, arg, ref, ref_arg


# ---------------------------------------------------------------------------------------------------
# the reference itself


def test_reference_matches_per_document_loop():
    gen = torch.Generator().manual_seed(1)
    queries, q_off = packed([3, 1, 7], 16, gen=gen)
    docs, d_off = packed([5, 1, 0, 9, 2], 16, gen=gen)
    ref, arg = maxsim_reference(queries, q_off, docs, d_off, return_argmax=True, max_elements=7)
    q64, d64 = queries.double(), docs.double()
    for qi in range(3):
        for di in range(5):
            q = q64[q_off[qi] : q_off[qi + 1]]
            d = d64[d_off[di] : d_off[di + 1]]
            if d.shape[0] == 0:
                assert ref[qi, di] == -torch.inf
                assert bool((arg[q_off[qi] : q_off[qi + 1], di] == -1).all())
                continue
            best, where = (q @ d.T).max(dim=1)
            assert torch.allclose(ref[qi, di], best.sum(), rtol=0, atol=1e-12)
            assert torch.equal(arg[q_off[qi] : q_off[qi + 1], di], where.int())


def test_reference_ties_go_to_lowest_index():
    q = torch.tensor([[1.0, 0, 0, 0, 0, 0, 0, 0]])
    d = torch.tensor([[0.5, 0, 0, 0, 0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0, 0, 0]])
    _, arg = maxsim_reference(q, torch.tensor([0, 1]), d, torch.tensor([0, 3]), return_argmax=True)
    assert arg.item() == 1


# ---------------------------------------------------------------------------------------------------
# backends against the reference


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "q_lens, d_lens, dim",
    [
        ([5, 1, 9, 3], [7, 1, 20, 3, 1, 12, 40, 2], 24),  # ragged both sides, length-1 docs and queries
        ([1], [1, 1, 1], 8),  # the smallest everything
        ([33, 2], [65, 64, 63, 1, 129], 40),  # lengths around tile sizes: tiles straddle boundaries
        ([4, 6], [17, 3, 30], 136),  # dim not a power of two, above 128
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_varlen_random(backend, q_lens, d_lens, dim, dtype):
    varlen_case(q_lens, d_lens, dim, dtype, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_all_negative_similarities(backend):
    # every similarity < 0: zero padding would turn maxima into 0; -inf masking must not
    scores, _, ref, _ = varlen_case([3, 5], [2, 9, 1, 17], 16, torch.float32, backend, q_sign=1, d_sign=-1)
    assert bool((ref < 0).all()) and bool((scores < 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_exact_ties_pick_lowest_index(backend):
    gen = torch.Generator().manual_seed(3)
    base, _ = packed([4], 16, gen=gen)
    # document 0: tokens [a, b, a, b, c, a]; every query token equals one of them -> exact ties
    docs = torch.cat([base[[0, 1, 0, 1, 2, 0]], base[[3, 3, 3]]])
    d_off = torch.tensor([0, 6, 9])
    queries = base[[0, 1, 2, 3]]
    q_off = torch.tensor([0, 2, 4])
    scores, arg = maxsim_varlen(queries, q_off, docs, d_off, return_argmax=True, backend=backend)
    ref, ref_arg = maxsim_reference(queries, q_off, docs, d_off, return_argmax=True)
    assert arg[:, 0].tolist() == [0, 1, 4, ref_arg[3, 0].item()]
    assert arg[3, 1].item() == 0
    assert torch.equal(arg, ref_arg)
    check_scores(scores, ref, 2, 16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_empty_documents_score_minus_inf(backend):
    scores, arg, ref, _ = varlen_case([2, 3], [0, 4, 0, 0, 2, 0], 8, torch.float32, backend)
    assert bool(torch.isinf(scores[:, [0, 2, 3, 5]]).all())
    assert bool((arg[:, [0, 2, 3, 5]] == -1).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_candidates_random(backend, dtype):
    gen = torch.Generator().manual_seed(5)
    d_lens = torch.randint(0, 50, (23,), generator=gen)
    d_lens[3] = 1
    queries, q_off = packed([6, 1, 11, 4], 24, dtype, gen=gen)
    docs, d_off = packed(d_lens, 24, dtype, gen=gen)
    # query 1 has no candidates; query 2 lists one document twice
    cand = torch.tensor([3, 0, 7, 22, 5, 5, 9, 1, 3, 14, 2], dtype=torch.int64)
    c_off = torch.tensor([0, 3, 3, 9, 11], dtype=torch.int64)
    scores, arg = maxsim_candidates(
        queries, q_off, docs, d_off, c_off, cand, return_argmax=True, backend=backend
    )
    ref, ref_arg = maxsim_candidates_reference(queries, q_off, docs, d_off, c_off, cand, return_argmax=True)
    assert scores.shape == (11,) and arg.shape == (11, 11) and arg.dtype == torch.int32
    q_lens = torch.tensor([6] * 3 + [11] * 6 + [4] * 2)
    check_scores(scores, ref, q_lens, 24)
    assert scores[4] == scores[5]
    pairs = []
    for qi in range(4):
        for c in range(int(c_off[qi]), int(c_off[qi + 1])):
            lq = int(q_off[qi + 1] - q_off[qi])
            assert bool((arg[c, lq:] == -1).all())
            pairs.append((qi, int(cand[c]), arg[c]))
    check_argmax(arg, queries, q_off, docs, d_off, pairs)
    plain = maxsim_candidates(queries, q_off, docs, d_off, c_off, cand, backend=backend)
    assert_same_as_argmax_scores(plain, scores, backend)


def test_cpu_bf16_and_float64():
    for dtype in (torch.bfloat16, torch.float64):
        gen = torch.Generator().manual_seed(7)
        queries, q_off = packed([3, 8], 32, dtype, gen=gen)
        docs, d_off = packed([5, 30, 1], 32, dtype, gen=gen)
        out = maxsim_varlen(queries, q_off, docs, d_off, backend="torch")
        ref = maxsim_reference(queries, q_off, docs, d_off)
        if dtype == torch.float64:
            assert out.dtype == torch.float64 and torch.allclose(out, ref, rtol=0, atol=1e-12)
        else:
            check_scores(out, ref, torch.tensor([[3], [8]]), 32)


def test_cpu_groups_cover_every_document_once():
    from maxsim_kernels.cpu import _groups

    lens = np.array([0, 5, 300, 20, 20, 1, 0, 4096, 5000, 17])
    order, spans = _groups(lens, 64)
    seen = np.concatenate([order[a:b] for a, b in spans])
    assert sorted(seen.tolist()) == [i for i in range(len(lens)) if lens[i] > 0]
    for a, b in spans:
        assert (b - a) * lens[order[b - 1]] <= 64 or b - a == 1


def test_cpu_many_groups_and_query_blocks(monkeypatch):
    import maxsim_kernels.cpu as cpu

    monkeypatch.setattr(cpu, "_GROUP_TOKENS", 16)
    monkeypatch.setattr(cpu, "_QUERY_ROWS", 5)
    varlen_case([7, 3, 9], [3, 30, 2, 8, 8, 0, 1], 16, torch.float32, "torch")


# ---------------------------------------------------------------------------------------------------
# input checks


@pytest.mark.parametrize("backend", BACKENDS)
def test_errors(backend):
    q, q_off = packed([2, 3], 16)
    d, d_off = packed([4, 1], 16)
    with pytest.raises(ValueError, match="query 1 has no tokens"):
        maxsim_varlen(q, torch.tensor([0, 5, 5]), d, d_off, backend=backend)
    with pytest.raises(ValueError, match="multiple of 8"):
        maxsim_varlen(q[:, :12], q_off, d[:, :12], d_off, backend=backend)
    with pytest.raises(ValueError, match="dim"):
        maxsim_varlen(q, q_off, d[:, :8], d_off, backend=backend)
    with pytest.raises(ValueError, match=r"doc_offsets\[-1\]"):
        maxsim_varlen(q, q_off, d, torch.tensor([0, 4, 4]), backend=backend)
    with pytest.raises(ValueError, match="decreases"):
        maxsim_varlen(q, q_off, d, torch.tensor([0, 4, 2, 5]), backend=backend)
    with pytest.raises(ValueError, match="not a document index"):
        maxsim_candidates(q, q_off, d, d_off, torch.tensor([0, 1, 2]), torch.tensor([0, 2]), backend=backend)
    with pytest.raises(ValueError, match="nq\\+1"):
        maxsim_candidates(q, q_off, d, d_off, torch.tensor([0, 2]), torch.tensor([0, 1]), backend=backend)
    with pytest.raises(ValueError, match="backend"):
        maxsim_varlen(q, q_off, d, d_off, backend="cuda")


def test_empty_problem_shapes():
    q, q_off = packed([2], 8)
    d = torch.zeros(0, 8)
    scores, arg = maxsim_varlen(q, q_off, d, torch.zeros(1, dtype=torch.int64), return_argmax=True)
    assert scores.shape == (1, 0) and arg.shape == (2, 0)


def test_lazy_triton_exports():
    assert callable(maxsim_kernels.maxsim_varlen_forward_triton)
    assert callable(maxsim_kernels.maxsim_candidates_forward_triton)


# ---------------------------------------------------------------------------------------------------
# Triton launcher: every shape class, chunked long queries, small tiles, no recompilation

needs_interpreter = pytest.mark.skipif(
    not HAS_TRITON_CPU, reason="needs TRITON_INTERPRET=1 on a CPU-only host"
)


# Candidate indices outside [0, num_docs): below 0, num_docs itself, past 2^32 (its low 32 bits are a
# valid index), and far below 0.
BAD_CANDIDATES = [-1, 23, 2**32 + 5, -(2**62)]


def bad_candidates_case(q_lens, dtype=torch.float16):
    """23 documents (one empty); 13 candidates for the queries `q_lens`, of which entries 0, 4, 8 and 12
    (first and last of a run, inside one) are BAD_CANDIDATES: (inputs, the candidates with the bad ones,
    the same with each bad one replaced by a valid index, the bad entries' mask)."""
    gen = torch.Generator().manual_seed(8)
    d_lens = torch.randint(0, 50, (23,), generator=gen)
    d_lens[4] = 0
    queries, q_off = packed(q_lens, 24, dtype, gen=gen)
    docs, d_off = packed(d_lens, 24, dtype, gen=gen)
    counts = torch.full((len(q_lens),), 13 // len(q_lens))
    counts[-1] += 13 - int(counts.sum())
    c_off = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    c_off[1:] = counts.cumsum(0)
    valid = torch.randint(0, 23, (13,), generator=gen)
    bad = torch.zeros(13, dtype=torch.bool)
    bad[[0, 4, 8, 12]] = True
    cand = valid.clone()
    cand[bad] = torch.tensor(BAD_CANDIDATES)
    return (queries, q_off, docs, d_off, c_off), cand, valid, bad


@needs_interpreter
@pytest.mark.parametrize("q_lens", [[6, 1, 11, 4], [140, 3]])  # [140, 3]: a long query, in chunks
@pytest.mark.parametrize("return_argmax", [False, True])
def test_bad_candidate_indices_on_the_device_score_nan_without_a_host_copy(
    device_candidates, q_lens, return_argmax
):
    """Candidates on a GPU are not read by the host (no copy, no wait for the device): the kernel never
    reads through a bad index, scores its candidate NaN (argmax -1) and the others as without it."""
    inputs, cand, valid, bad = bad_candidates_case(q_lens)
    got = maxsim_candidates(*inputs, cand, return_argmax=return_argmax, backend="triton")
    want = maxsim_candidates(*inputs, valid, return_argmax=return_argmax, backend="triton")
    assert device_candidates == [], "the candidates were copied to the host"
    if return_argmax:
        (got, got_arg), (want, want_arg) = got, want
        assert bool((got_arg[bad] == -1).all())
        assert torch.equal(got_arg[~bad], want_arg[~bad])
    assert torch.equal(torch.isnan(got), bad)
    assert torch.equal(got[~bad], want[~bad])
    ref = maxsim_candidates_reference(*inputs, valid)
    q_lens_c = torch.repeat_interleave(torch.tensor(q_lens), inputs[4].diff())
    check_scores(want, ref, q_lens_c, 24)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", BAD_CANDIDATES)
def test_bad_candidate_index_on_the_host_raises_naming_it(backend, bad):
    inputs, _, valid, _ = bad_candidates_case([6, 1, 11, 4], torch.float32)
    valid[5] = bad
    message = rf"candidate_docs\[5\] = {bad} is not a document index in \[0, 23\)"
    with pytest.raises(ValueError, match=message):
        maxsim_candidates(*inputs, valid, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_and_differentiable_paths_check_device_candidates_on_the_host(device_candidates, backend):
    """The torch path indexes through the candidates and the backward's kernels read through them: both
    check candidates on the host wherever they live, as before."""
    (queries, *rest), _, valid, _ = bad_candidates_case([6, 1, 11, 4], torch.float32)
    valid[5] = 23
    if backend == "torch":
        with pytest.raises(ValueError, match=r"candidate_docs\[5\] = 23 is not a document index"):
            maxsim_candidates(queries, *rest, valid, backend=backend)
    with pytest.raises(ValueError, match=r"candidate_docs\[5\] = 23 is not a document index"):
        maxsim_candidates(queries.clone().requires_grad_(True), *rest, valid, backend=backend)
    assert device_candidates, "the host did not check the candidates"


@needs_interpreter
@pytest.mark.parametrize(
    ("num_queries", "cls", "qpb", "fill_gpu"),
    [
        (9, "many", 8, True),  # 256-row blocks of 8 queries: a full one and a partial one
        (5, "some", 4, True),  # 128-row blocks of 4 queries
        (9, "many", 8, False),  # the table's 64 documents a program: one partial run
    ],
)
def test_triton_many_queries_classes_with_partial_groups(monkeypatch, num_queries, cls, qpb, fill_gpu):
    from maxsim_kernels import maxsim_forward as fwd
    from maxsim_kernels.validation import check_inputs

    if not fill_gpu:  # keep the table's documents a program instead of lowering it for a small grid
        monkeypatch.setattr(fwd, "_MIN_PROGRAMS_PER_SM", 0)
    gen = torch.Generator().manual_seed(11)
    q_lens = torch.randint(1, 33, (num_queries,), generator=gen)  # padded to 32 rows
    d_lens = torch.randint(0, 70, (37,), generator=gen)  # runs of documents, the last one partial
    queries, q_off = packed(q_lens, 32, torch.float16, gen=gen)
    docs, d_off = packed(d_lens, 32, torch.float16, gen=gen)
    got_cls, cfg, got_qpb, rows = fwd.varlen_config(check_inputs(queries, q_off, docs, d_off))
    assert (got_cls, got_qpb, rows) == (cls, qpb, 32)
    blocks = -(-num_queries // qpb)
    per = fwd._docs_per_program(cfg.docs_per_prog, blocks, 37, docs.device)
    assert per == 64 if not fill_gpu else 1 < per < 37
    scores, arg = maxsim_varlen(queries, q_off, docs, d_off, return_argmax=True, backend="triton")
    ref, ref_arg = maxsim_reference(queries, q_off, docs, d_off, return_argmax=True)
    check_scores(scores, ref, q_lens[:, None], 32)
    pairs = [(qi, di, arg[q_off[qi] : q_off[qi + 1], di]) for qi in range(num_queries) for di in range(37)]
    check_argmax(arg, queries, q_off, docs, d_off, pairs)


@pytest.mark.parametrize(("name", "family"), [("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", None)])
def test_the_tuning_table_is_chosen_by_the_device(monkeypatch, name, family):
    from maxsim_kernels import maxsim_forward as fwd

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    fwd._device_family.cache_clear()
    try:
        cuda = torch.device("cuda", 0)
        for cls in fwd._TUNING:
            want = fwd._DEVICE_TUNING.get(family, {}).get(cls, fwd._TUNING[cls])
            assert fwd.tuning(cls, cuda) == want
            assert fwd.tuning(cls, torch.device("cpu")) == fwd.tuning(cls) == fwd._TUNING[cls]
    finally:
        fwd._device_family.cache_clear()


@pytest.mark.parametrize("family", ["H100"])
def test_device_tuning_entries_give_the_same_bits(family):
    """Every per-device entry scores bit for bit what the default table's entry scores (ragged documents,
    documents past one tile, an empty document, a query shorter than its rows)."""
    from maxsim_kernels import maxsim_forward as fwd

    gen = torch.Generator().manual_seed(5)
    q_lens = torch.tensor([32, 7])
    d_lens = torch.cat([torch.randint(1, 150, (40,), generator=gen), torch.tensor([0, 64, 65])])
    queries, q_off = packed(q_lens, 64, torch.float16, gen=gen)
    docs, d_off = packed(d_lens, 64, torch.float16, gen=gen)
    entries = fwd._DEVICE_TUNING[family]
    for q, qo in ((queries[:32], q_off[:2]), (queries, q_off)):
        base = fwd.maxsim_varlen_forward_triton(q, qo, docs, d_off, config=fwd._TUNING["few"])
        got = fwd.maxsim_varlen_forward_triton(q, qo, docs, d_off, config=entries["few"])
        assert torch.equal(got, base)
    c_off = torch.tensor([0, 5, 12])
    c_docs = torch.tensor([3, 0, 41, 42, 7, 1, 2, 40, 9, 9, 30, 11])
    base = fwd.maxsim_candidates_forward_triton(queries, q_off, docs, d_off, c_off, c_docs,
                                                config=fwd._candidates_config(32)[0])  # fmt: skip
    cfg = dataclasses.replace(entries["cands"], block_q=32)
    got = fwd.maxsim_candidates_forward_triton(queries, q_off, docs, d_off, c_off, c_docs, config=cfg)
    assert torch.equal(got, base)


@pytest.mark.parametrize(
    ("num_blocks", "num_docs", "want"),
    [
        (8, 1000, 31),  # ColPali: 33 runs x 8 chunks fill 264 slots once
        (16, 1000, 31),  # two waves of 31 beat one of 63
        (512, 1000, 1000),  # more blocks than slots: whole runs, two waves
        (200, 1000, 59),  # 17 runs x 200 blocks: 13 waves, 770 against an ideal 758 documents' time
        (8, 10, 1),
        (3, 1, 1),
    ],
)
def test_persistent_docs_per_program(num_blocks, num_docs, want):
    from maxsim_kernels.maxsim_forward import persistent_docs_per_program

    per = persistent_docs_per_program(num_blocks, num_docs, slots=264, start_docs=0.25)
    assert per == want


@needs_interpreter
def test_triton_long_queries_are_chunked():
    # 150 tokens pad to 256 > 128 rows: two 128-row chunks whose partial sums are added
    varlen_case([150, 20], [5, 140, 1, 0, 64], 16, torch.float32, "triton")
    gen = torch.Generator().manual_seed(2)
    queries, q_off = packed([150, 3], 16, gen=gen)
    docs, d_off = packed([5, 140, 1, 64], 16, gen=gen)
    c_off, cand = torch.tensor([0, 3, 4]), torch.tensor([1, 0, 3, 2])
    scores, arg = maxsim_candidates(
        queries, q_off, docs, d_off, c_off, cand, return_argmax=True, backend="triton"
    )
    ref, ref_arg = maxsim_candidates_reference(queries, q_off, docs, d_off, c_off, cand, return_argmax=True)
    check_scores(scores, ref, torch.tensor([150, 150, 150, 3]), 16)
    assert arg.shape == (4, 150) and bool((arg[3, 3:] == -1).all())


@needs_interpreter
@pytest.mark.parametrize("block_t, per_prog", [(16, 2), (32, 1)])
def test_triton_small_tiles_straddle_many_boundaries(block_t, per_prog):
    from maxsim_kernels.maxsim_forward import (
        KernelConfig,
        maxsim_candidates_forward_triton,
        maxsim_varlen_forward_triton,
    )

    gen = torch.Generator().manual_seed(4)
    queries, q_off = packed([3, 17, 1], 24, gen=gen)
    docs, d_off = packed([15, 16, 17, 0, 1, 33, 48, 2], 24, gen=gen)
    cfg = KernelConfig(block_q=32, block_t=block_t, docs_per_prog=per_prog, num_warps=4, num_stages=2)
    scores, arg = maxsim_varlen_forward_triton(queries, q_off, docs, d_off, return_argmax=True, config=cfg)
    ref, ref_arg = maxsim_reference(queries, q_off, docs, d_off, return_argmax=True)
    check_scores(scores, ref, torch.tensor([[3], [17], [1]]), 24)
    assert torch.equal(arg, ref_arg)
    c_off, cand = torch.tensor([0, 4, 4, 8]), torch.tensor([7, 6, 5, 3, 0, 1, 2, 6])
    scores = maxsim_candidates_forward_triton(queries, q_off, docs, d_off, c_off, cand, config=cfg)
    ref = maxsim_candidates_reference(queries, q_off, docs, d_off, c_off, cand)
    check_scores(scores, ref, torch.tensor([3] * 4 + [1] * 4), 24)


@needs_interpreter
@pytest.mark.parametrize(
    "block_q, block_t, dim, doc_major", [(32, 16, 24, True), (64, 16, 200, True), (32, 16, 24, False)]
)
def test_triton_element_max_tiles_match_reference(block_q, block_t, dim, doc_major):
    """The running max kept per tile element across a document's tiles and reduced at its end, on
    S^T = D . Q^T tiles (doc_major) and on S = Q . D^T tiles; ragged, empty and one-token documents,
    tiles straddling boundaries, dims over one K chunk."""
    from maxsim_kernels.maxsim_forward import (
        KernelConfig,
        maxsim_candidates_forward_triton,
        maxsim_varlen_forward_triton,
    )

    gen = torch.Generator().manual_seed(12)
    queries, q_off = packed([3, 17, 1, 9], dim, gen=gen)
    docs, d_off = packed([15, 16, 17, 0, 1, 33, 48, 2], dim, gen=gen)
    docs[d_off[5] : d_off[5] + 4] = -docs[d_off[5] : d_off[5] + 4].abs()  # negative similarities
    cfg = KernelConfig(block_q, block_t, 4, num_warps=4, num_stages=2, doc_major=doc_major, element_max=True)
    scores = maxsim_varlen_forward_triton(queries, q_off, docs, d_off, config=cfg)
    check_scores(
        scores, maxsim_reference(queries, q_off, docs, d_off), torch.tensor([[3], [17], [1], [9]]), dim
    )
    # argmax requests take the query-major tiles, whatever the config says
    scores, arg = maxsim_varlen_forward_triton(queries, q_off, docs, d_off, return_argmax=True, config=cfg)
    assert torch.equal(arg, maxsim_reference(queries, q_off, docs, d_off, return_argmax=True)[1])
    c_off, cand = torch.tensor([0, 4, 4, 8, 9]), torch.tensor([7, 6, 5, 3, 0, 1, 2, 6, 5])
    cfg = KernelConfig(32, block_t, 2, num_warps=4, num_stages=2, doc_major=doc_major, element_max=True)
    scores = maxsim_candidates_forward_triton(queries, q_off, docs, d_off, c_off, cand, config=cfg)
    ref = maxsim_candidates_reference(queries, q_off, docs, d_off, c_off, cand)
    check_scores(scores, ref, torch.tensor([3] * 4 + [1] * 4 + [9]), dim)


@needs_interpreter
def test_triton_fp32_tf32_switch_and_mixed_query_dtype():
    gen = torch.Generator().manual_seed(9)
    queries, q_off = packed([4, 2], 16, torch.float32, gen=gen)
    docs, d_off = packed([3, 9], 16, torch.float16, gen=gen)
    # queries are converted to the documents' dtype: compare with the reference on converted queries
    out = maxsim_varlen(queries, q_off, docs, d_off, backend="triton")
    ref = maxsim_reference(queries.half(), q_off, docs, d_off)
    check_scores(out, ref, torch.tensor([[4], [2]]), 16)
    docs32 = docs.float()
    tf32 = maxsim_varlen(queries, q_off, docs32, d_off, backend="triton", allow_tf32=True)
    assert torch.allclose(tf32.double(), maxsim_reference(queries, q_off, docs32, d_off), atol=5e-3)


class _Recorder:
    """Stands in for a @triton.jit kernel and records the arguments of each launch."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def test_launch_keys_do_not_change_within_a_bucket(monkeypatch):
    """Triton compiles once per constexpr set (and per specialisation of non-excluded ints): only
    power-of-two length buckets may change them, never batch sizes or lengths within a bucket."""
    import maxsim_kernels.maxsim_forward as fwd

    rec = _Recorder()
    monkeypatch.setattr(fwd, "_maxsim_varlen_kernel", rec)
    monkeypatch.setattr(fwd, "_maxsim_candidates_kernel", rec)
    gen = torch.Generator().manual_seed(0)
    # batch sizes, document counts and lengths vary; the longest query stays in the (16, 32] bucket
    for nq, q_hi, nd, d_hi in [(64, 32, 100, 300), (17, 20, 1, 7), (200, 32, 33, 1000), (8, 17, 16, 64)]:
        q_lens = torch.randint(1, q_hi + 1, (nq,), generator=gen)
        q_lens[0] = q_hi
        queries, q_off = packed(q_lens, 16, gen=gen)
        docs, d_off = packed(torch.randint(0, d_hi, (nd,), generator=gen), 16, gen=gen)
        fwd.maxsim_varlen_forward_triton(queries, q_off, docs, d_off)
        c_off = torch.arange(nq + 1) * 1
        fwd.maxsim_candidates_forward_triton(
            queries, q_off, docs, d_off, c_off, torch.zeros(nq, dtype=torch.int64)
        )
    varlen_keys = {tuple(sorted(kw.items())) for args, kw in rec.calls[0::2]}
    cand_keys = {tuple(sorted(kw.items())) for args, kw in rec.calls[1::2]}
    assert len(varlen_keys) == 1, varlen_keys
    assert len(cand_keys) == 1, cand_keys
    # every int argument that changes with the batch is excluded from specialisation
    for kernel, sizes in (
        ("_maxsim_varlen_kernel", ("num_queries", "num_docs", "num_blocks", "num_chunks")),
        ("_maxsim_candidates_kernel", ("num_queries", "num_cands", "num_chunks", "num_docs")),
    ):
        monkeypatch.undo()
        jit = getattr(fwd, kernel)
        names = list(jit.arg_names)
        listed = (
            getattr(jit, "do_not_specialize", None) or jit.kwargs["do_not_specialize"]
        )  # jit | interpreter
        excluded = {names[i] if isinstance(i, int) else i for i in listed}
        assert set(sizes) <= excluded


def test_offsets_memo_follows_in_place_changes_and_frees():
    import gc

    from maxsim_kernels import validation as v

    off = torch.tensor([0, 2, 5])
    first = v.host_offsets("doc_offsets", off, 5)
    assert v.host_offsets("doc_offsets", off, 5) is first  # remembered
    assert not first.flags.writeable
    off[1] = 3  # an in-place change bumps the version counter: checked again
    assert v.host_offsets("doc_offsets", off, 5).tolist() == [0, 3, 5]
    off[2] = 4
    with pytest.raises(ValueError, match=r"doc_offsets\[-1\]"):
        v.host_offsets("doc_offsets", off, 5)
    key = id(off)
    del off, first
    gc.collect()
    assert key not in v._MEMO
    q, q_off = packed([2, 3], 8)
    d, d_off = packed([4, 0, 1], 8)
    before = maxsim_varlen(q, q_off, d, d_off)
    d_off[1:] = torch.tensor([1, 4, 5])  # same object, new content: new scores
    after = maxsim_varlen(q, q_off, d, d_off)
    check_scores(after, maxsim_reference(q, q_off, d, d_off), torch.tensor([[2], [3]]), 8)
    assert not torch.equal(before, after)


def test_a_shared_device_copy_replaces_the_launchers_own_and_follows_the_host_tensor():
    """`share_device_copy`: `on_device` hands out the registered copy (no second transfer) while the host
    tensor is unchanged; an in-place change or a new tensor copies again; a copy that cannot hold the
    values is refused. The meta device stands in for a GPU."""
    import gc

    from maxsim_kernels import validation as v

    meta = torch.device("meta")
    host = torch.tensor([0, 3, 7], dtype=torch.int64)
    copy = torch.empty(3, dtype=torch.int64, device=meta)
    v.share_device_copy(host, copy)
    assert v.on_device(host, meta) is copy
    host[1] = 2  # in place: the registered copy no longer holds these values
    assert v.on_device(host, meta) is not copy
    other = torch.tensor([0, 3, 7], dtype=torch.int64)
    assert v.on_device(other, meta) is not copy  # registered per tensor object
    v.share_device_copy(host, host)  # same device: nothing to share, nothing remembered
    assert v.on_device(host, torch.device("cpu")) is host
    for bad in (
        torch.empty(4, dtype=torch.int64, device=meta),
        torch.empty(3, dtype=torch.int32, device=meta),
        torch.empty(6, dtype=torch.int64, device=meta)[::2],
    ):
        with pytest.raises(ValueError, match="share_device_copy"):
            v.share_device_copy(other, bad)
    key = id(host)
    del host, copy
    gc.collect()
    assert key not in v._MEMO


def test_launch_plans_follow_their_offsets_and_never_keep_them_alive():
    """The Triton launchers remember checks and launch arguments per pair of offsets tensors: an in-place
    change, another partner or a new shape plans again; a plan holds neither offsets tensor (else the memo
    would keep every batch's offsets for ever); at most a few partners are kept per tensor. A few host
    query offsets key their plan by value: a new tensor of the same lengths (a search's, every call)
    finds the plan made before."""
    import gc
    import weakref

    import maxsim_kernels.maxsim_forward as fwd
    from maxsim_kernels import validation as v

    def plans(offsets: torch.Tensor, store: str) -> dict:
        return v._MEMO[id(offsets)][2][store]

    by_value = "plans by query offsets"
    q, q_off = packed([2, 3], 16)
    d, d_off = packed([4, 0, 1], 16)
    first = fwd.maxsim_varlen_forward_triton(q, q_off, d, d_off)
    assert torch.equal(fwd.maxsim_varlen_forward_triton(q, q_off, d, d_off), first)
    assert torch.equal(fwd.maxsim_varlen_forward_triton(q, q_off.clone(), d, d_off), first)
    assert len(plans(d_off, by_value)) == 1  # the clone's values found the plan
    d_off[1:] = torch.tensor([1, 4, 5])  # same object, new content
    moved = fwd.maxsim_varlen_forward_triton(q, q_off, d, d_off)
    check_scores(moved, maxsim_reference(q, q_off, d, d_off), torch.tensor([[2], [3]]), 16)
    planned = len(plans(d_off, by_value))
    q_off[1] = 4  # the partner changes in place: planned again too
    regrouped = fwd.maxsim_varlen_forward_triton(q, q_off, d, d_off)
    assert len(plans(d_off, by_value)) == planned + 1
    check_scores(regrouped, maxsim_reference(q, q_off, d, d_off), torch.tensor([[4], [1]]), 16)
    q2, q2_off = packed([5], 16)  # another partner, and another shape
    check_scores(
        fwd.maxsim_varlen_forward_triton(q2, q2_off, d, d_off),
        maxsim_reference(q2, q2_off, d, d_off),
        torch.tensor([[5]]),
        16,
    )
    for lengths in range(1, 2 * v._PAIRS_PER_TENSOR + 1):  # as many lengths: the oldest plans go
        q3, q3_off = packed([lengths], 16)
        fwd.maxsim_varlen_forward_triton(q3, q3_off, d, d_off)
    assert len(plans(d_off, by_value)) <= v._PAIRS_PER_TENSOR
    # many queries: plans kept per offsets tensor (`memo_pair`)
    qm, qm_off = packed([1] * v._BY_VALUE_MAX, 16)
    fwd.maxsim_varlen_forward_triton(qm, qm_off, d, d_off)
    assert len(plans(d_off, "pairs")) == 1
    for _ in range(2 * v._PAIRS_PER_TENSOR):
        fwd.maxsim_varlen_forward_triton(qm, qm_off.clone(), d, d_off)
    assert len(plans(d_off, "pairs")) <= v._PAIRS_PER_TENSOR
    refs = [weakref.ref(t) for t in (q_off, d_off, q2_off, qm_off)]
    del q_off, d_off, q2_off, qm_off
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_backward_plans_follow_their_offsets():
    """The all-pairs backward's plan (kept per offsets pair) gives the torch backend's gradients on every
    step, again after the offsets change in place, and does not keep the offsets alive."""
    import gc
    import weakref

    from maxsim_kernels import maxsim_backward as mb

    q, q_off = packed([3, 5], 16)
    d, d_off = packed([4, 1, 6], 16)
    upstream = torch.randn(2, 3, dtype=torch.float64).float()

    def grads(q_off, d_off, backend):
        qg, dg = q.clone().requires_grad_(True), d.clone().requires_grad_(True)
        scores = mb.maxsim_varlen_autograd(qg, q_off, dg, d_off, backend=backend)
        return torch.autograd.grad(scores, (qg, dg), upstream)

    for _ in range(2):
        expected = grads(q_off, d_off, "torch")
        for _ in range(3):
            got = grads(q_off, d_off, "triton")
            for a, b in zip(got, expected, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        d_off[1:] = torch.tensor([2, 9, 11])  # same object, new content: planned again
        q_off[1] = 2  # and the partner's
    refs = [weakref.ref(q_off), weakref.ref(d_off)]
    del q_off, d_off
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_a_query_only_backward_never_builds_the_inverse_map(monkeypatch):
    """Frozen documents: the backward plans only the query gradient, so the inverse map's size limits
    (2^31 pairs, 2^22-token documents) never apply to it."""
    from maxsim_kernels import maxsim_backward as mb

    def refuse(*args, **kwargs):
        raise AssertionError("the inverse map was planned for a query-only backward")

    monkeypatch.setattr(mb, "_csr_launch", refuse)
    q, q_off = packed([3, 5], 16)
    d, d_off = packed([4, 1, 6], 16)
    upstream = torch.randn(2, 3, dtype=torch.float64).float()
    expected = None
    for backend in ("torch", "triton", "triton"):
        qg = q.clone().requires_grad_(True)
        scores = mb.maxsim_varlen_autograd(qg, q_off, d, d_off, backend=backend)
        (got,) = torch.autograd.grad(scores, (qg,), upstream)
        if expected is None:
            expected = got
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


_SM90_BUILD = r"""
import maxsim_kernels.maxsim_forward as fwd

ints = {"num_queries", "num_docs", "num_blocks", "num_chunks", "num_cands", "dim", "stride_q", "stride_d"}
ints.add("docs_per_prog")
ints.add("stride_arg")
pointers = {"q_ptr": "*fp16", "d_ptr": "*fp16", "out_ptr": "*fp32", "arg_ptr": "*i32"}
report = {}
# every entry scores-only, and the all-pairs classes also with the autograd path's int16 argmax
builds = [(cls, cfg, False) for cls, cfg in fwd._TUNING.items()]
argmax_tuning = {**fwd._TUNING, **fwd._ARGMAX_TUNING}
builds += [(cls, cfg, True) for cls, cfg in argmax_tuning.items() if cls != "cands"]
for cls, cfg, argmax in builds:
    kernel = fwd._maxsim_candidates_kernel if cls == "cands" else fwd._maxsim_varlen_kernel
    rows = 32 if cls in ("many", "some") else cfg.block_q
    consts = dict(ROWS=rows, BLOCK_T=cfg.block_t, BLOCK_K=128, NUM_K=1, EVEN_K=True, PRECISION="tf32",
                  RETURN_ARGMAX=argmax)
    if cls == "cands":
        consts.update(CANDS_PER_PROG=cfg.docs_per_prog)
    else:
        consts.update(QPB=cfg.block_q // rows, DOCS_PER_PROG=cfg.docs_per_prog)
    consts.update(cfg.tile_variant(argmax))
    pointers["arg_ptr"] = "*i16" if argmax else "*i32"
    names = kernel.arg_names
    kinds = {**{n: "i32" for n in ints}, **{n: "constexpr" for n in consts}}
    sig = {n: kinds.get(n, pointers.get(n, "*i64")) for n in names}
    # what Triton's launcher infers at run time for dim 128: 16-aligned pointers, strides and dim
    aligned = [i for i, n in enumerate(names) if n.endswith("_ptr") or n in ("dim", "stride_q", "stride_d")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    compiled = triton.compile(src, target=SM90, options=options)
    ttgir = compiled.asm["ttgir"]
    report[cls + ("+argmax16" if argmax else "")] = {
                   "pipelined": "async_copy_global_to_local" in ttgir, "wgmma": "warp_group_dot" in ttgir,
                   "usage": resource_usage(compiled), "wide": cfg.block_q >= 64 or consts["DOC_MAJOR"]}
print(json.dumps(report))
"""


def test_table_entries_build_for_sm90_without_spills(sm90_build):
    """Every tuning-table entry compiles for Hopper (sm_90) with triton's own ptxas, no GPU needed: the
    loads are cp.async-pipelined, the tensor-core classes use wgmma, and nothing spills to local memory."""
    for cls, r in sm90_build(_SM90_BUILD).items():
        assert r["pipelined"], f"{cls}: document loads are not pipelined"
        assert r["wgmma"] or not r["wide"], f"{cls}: no wgmma"
        assert not r["usage"] or "LOCAL:0" in r["usage"], f"{cls}: spills to local memory: {r['usage']}"


def test_cpu_backend_scores_do_not_depend_on_the_batch() -> None:
    """A (query, document) score is bitwise the same whatever else shares its call: `maxsim score`
    promises identical bytes under any --max-memory, so batches of 1..many queries and documents
    (the streaming and the blocked paths, tiny and large matrix products) must agree exactly."""
    g = torch.Generator().manual_seed(11)
    q_lens = [1, 3, 32, 7, 1, 64, 2, 40, 5, 9]
    d_lens = [int(x) for x in torch.randint(1, 60, (120,), generator=g)]
    dim = 96
    queries = torch.nn.functional.normalize(torch.randn(sum(q_lens), dim, generator=g), dim=1).half()
    docs = torch.nn.functional.normalize(torch.randn(sum(d_lens), dim, generator=g), dim=1).half()
    q_off = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int64)
    d_off = torch.tensor([0, *np.cumsum(d_lens)], dtype=torch.int64)
    full = maxsim_varlen(queries, q_off, docs, d_off, backend="torch")
    for qa, qb in [(0, 1), (0, 2), (2, 3), (1, 6), (0, 10)]:
        for da, db in [(0, 1), (5, 7), (3, 40), (0, 120)]:
            sub = maxsim_varlen(
                queries[q_off[qa] : q_off[qb]],
                q_off[qa : qb + 1] - q_off[qa],
                docs[d_off[da] : d_off[db]],
                d_off[da : db + 1] - d_off[da],
                backend="torch",
            )
            assert torch.equal(sub, full[qa:qb, da:db]), (qa, qb, da, db)


def _stream_scores_in_child(conn, inputs) -> None:  # noqa: ANN001
    conn.send(maxsim_varlen(*inputs, backend="torch").numpy())  # numpy: no shared-memory handles
    conn.close()


def test_cpu_stream_pool_is_reused_and_survives_fork() -> None:
    """The one-query stream keeps its worker threads across calls, starts a new pool when the worker
    count (torch's thread count, at most the usable CPUs) changes, and a forked child (none of the
    parent's threads) still scores."""
    import multiprocessing

    import maxsim_kernels.cpu as cpu

    q, q_off = packed([32], 16)
    d, d_off = packed([20, 40, 7], 16)
    first = maxsim_varlen(q, q_off, d, d_off, backend="torch")
    pool = cpu._POOL
    assert pool is not None
    assert torch.equal(maxsim_varlen(q, q_off, d, d_off, backend="torch"), first)
    assert cpu._POOL is pool  # reused
    # its workers run their products on one thread each; the caller's thread count is left alone
    assert pool[1].submit(torch.get_num_threads).result() == 1
    assert pool[0] == min(torch.get_num_threads(), cpu._usable_cpus())
    threads = torch.get_num_threads()
    other = 1 if pool[0] > 1 else 2
    torch.set_num_threads(other)
    try:
        assert torch.equal(maxsim_varlen(q, q_off, d, d_off, backend="torch"), first)
        assert cpu._POOL[0] == min(other, cpu._usable_cpus())
        assert (cpu._POOL is pool) == (cpu._POOL[0] == pool[0])
    finally:
        torch.set_num_threads(threads)
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork on this platform")
    parent, child = multiprocessing.get_context("fork").Pipe()
    inputs = (q, q_off, d, d_off)
    proc = multiprocessing.get_context("fork").Process(target=_stream_scores_in_child, args=(child, inputs))
    proc.start()
    assert parent.poll(60), "the forked child did not answer"
    assert torch.equal(torch.from_numpy(parent.recv()), first)
    proc.join(60)
    assert proc.exitcode == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cpu_workers_give_the_bits_of_the_groups_in_order(monkeypatch, dtype) -> None:
    """The worker threads (one product thread each, units from one queue) score the bits that the
    caller's thread scored running the groups in order with each op on all its threads, as the blocked
    path and small reranks did before: scores, argmax, document scales, candidates."""
    import maxsim_kernels.cpu as cpu

    gen = torch.Generator().manual_seed(21)
    q_lens = torch.randint(1, 40, (14,), generator=gen).tolist()  # 200+ rows: the blocked path
    d_lens = torch.randint(0, 90, (70,), generator=gen).tolist()
    queries, q_off = packed(q_lens, 48, dtype, gen=gen)
    docs, d_off = packed(d_lens, 48, dtype, gen=gen)
    scales = torch.rand(docs.shape[0], generator=gen)
    c_off = torch.arange(15) * 30
    c_docs = torch.randint(0, 70, (420,), generator=gen)
    monkeypatch.setattr(cpu, "_GROUP_TOKENS", 128)  # many groups
    monkeypatch.setattr(cpu, "_RERANK_GROUP_BYTES", 100_000)
    monkeypatch.setattr(cpu, "_QUERY_GROUP_BYTES", 100_000)

    def calls() -> list[torch.Tensor]:
        return [
            cpu.maxsim_varlen_cpu(queries, q_off, docs, d_off),
            *cpu.maxsim_varlen_cpu(queries, q_off, docs, d_off, return_argmax=True),
            cpu.maxsim_varlen_cpu(queries, q_off, docs, d_off, doc_scales=scales),
            *cpu.maxsim_candidates_cpu(queries, q_off, docs, d_off, c_off, c_docs, return_argmax=True),
        ]

    monkeypatch.setattr(cpu, "_worker_count", lambda: 2)
    on_workers = calls()
    monkeypatch.setattr(cpu, "_run_units", lambda work, units, workers: [work(unit) for unit in units])
    in_order = calls()
    for got, want in zip(on_workers, in_order, strict=True):
        assert torch.equal(got, want)


def test_cpu_workers_run_under_the_callers_grad_and_inference_modes(monkeypatch) -> None:
    """Grad and inference modes are per thread: the worker threads take the caller's, so inputs that
    require grad score under torch.no_grad() (as in an autograd function's forward), and a caller in
    torch.inference_mode() gets its scores, on every path."""
    import maxsim_kernels.cpu as cpu

    gen = torch.Generator().manual_seed(3)
    queries, q_off = packed([30] * 6, 32, gen=gen)
    docs, d_off = packed(torch.randint(1, 60, (40,), generator=gen).tolist(), 32, gen=gen)
    c_off, c_docs = torch.arange(7) * 20, torch.randint(0, 40, (120,), generator=gen)
    monkeypatch.setattr(cpu, "_worker_count", lambda: 2)
    monkeypatch.setattr(cpu, "_GROUP_TOKENS", 64)
    monkeypatch.setattr(cpu, "_QUERY_GROUP_BYTES", 20_000)
    monkeypatch.setattr(cpu, "_RERANK_GROUP_BYTES", 20_000)
    queries.requires_grad_(True)
    docs.requires_grad_(True)
    with torch.no_grad():
        for q, qo in ((queries, q_off), (queries[:30], q_off[:2])):  # the blocked path and the stream
            scores = cpu.maxsim_varlen_cpu(q, qo, docs, d_off)
            assert torch.equal(scores, cpu.maxsim_varlen_cpu(q.detach(), qo, docs.detach(), d_off))
        scores = cpu.maxsim_candidates_cpu(queries, q_off, docs, d_off, c_off, c_docs)
        assert torch.equal(
            scores, cpu.maxsim_candidates_cpu(queries.detach(), q_off, docs.detach(), d_off, c_off, c_docs)
        )
    plain = [
        cpu.maxsim_varlen_cpu(queries.detach(), q_off, docs.detach(), d_off),
        cpu.maxsim_candidates_cpu(queries.detach(), q_off, docs.detach(), d_off, c_off, c_docs),
    ]
    with torch.inference_mode():
        got = [
            cpu.maxsim_varlen_cpu(queries.detach(), q_off, docs.detach(), d_off),
            cpu.maxsim_candidates_cpu(queries.detach(), q_off, docs.detach(), d_off, c_off, c_docs),
        ]
    assert all(torch.equal(a, b) for a, b in zip(got, plain, strict=True))


_AFFINITY_CHILD = """
import os, sys, torch
os.sched_setaffinity(0, {int(sys.argv[1])})
torch.set_num_threads(4)  # more than the one CPU: the worker count follows the mask, not this
import maxsim_kernels.cpu as cpu
from maxsim_kernels import maxsim_varlen
gen = torch.Generator().manual_seed(5)
d_off = torch.tensor([0, 20, 60, 67, 367, 400])
docs = torch.randn(400, 32, generator=gen)
out = []
for nq in (1, 9):  # the one-query stream and the blocked path
    q = torch.randn(nq * 20, 32, generator=gen)
    out.append(maxsim_varlen(q, torch.arange(nq + 1) * 20, docs, d_off, backend="torch"))
    out.append(torch.tensor([cpu._worker_count(), cpu._POOL[0]], dtype=torch.float32))
print(torch.cat([t.flatten() for t in out]).numpy().tobytes().hex())
"""


def test_cpu_worker_count_follows_the_affinity_mask() -> None:
    """A process allowed one CPU (os.sched_setaffinity) spreads its work over one worker thread, whatever
    torch's thread count says, and scores the same bits as this process's workers."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity masks on this platform")
    import maxsim_kernels.cpu as cpu

    cpu_id = min(os.sched_getaffinity(0))
    child = subprocess.run(
        [sys.executable, "-c", _AFFINITY_CHILD, str(cpu_id)], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr
    got = torch.from_numpy(np.frombuffer(bytes.fromhex(child.stdout.strip()), dtype=np.float32).copy())
    stream, counts1, blocked, counts9 = torch.split(got, [5, 2, 45, 2])
    assert counts1.tolist() == [1.0, 1.0] and counts9.tolist() == [1.0, 1.0]
    gen = torch.Generator().manual_seed(5)
    d_off = torch.tensor([0, 20, 60, 67, 367, 400])
    docs = torch.randn(400, 32, generator=gen)
    for nq, want in ((1, stream), (9, blocked)):
        q = torch.randn(nq * 20, 32, generator=gen)
        scores = maxsim_varlen(q, torch.arange(nq + 1) * 20, docs, d_off, backend="torch")
        assert torch.equal(scores.flatten(), want)
    assert cpu._worker_count() == min(torch.get_num_threads(), cpu._usable_cpus())


def test_a_worker_thread_keeps_at_most_its_share_of_buffers(monkeypatch) -> None:
    """`cpu.thread_buffer` keeps at most `worker_keep_bytes` of buffers a thread: a buffer asked for again
    is reused, a new one that would go past the share lets go of those used least recently first, and one
    let go stays valid through the view its caller holds."""
    import threading

    import maxsim_kernels.cpu as cpu

    monkeypatch.setattr(cpu, "worker_keep_bytes", lambda: 1 << 20)
    seen = {}

    def run() -> None:  # a thread of its own: no buffers yet
        a = cpu.thread_buffer("a", (256, 256), torch.float32).fill_(1.0)  # 256 KiB
        seen["reused"] = cpu.thread_buffer("a", (128, 256), torch.float32).data_ptr() == a.data_ptr()
        cpu.thread_buffer("b", (512, 256), torch.float32)  # 512 KiB: both kept
        cpu.thread_buffer("c", (384, 256), torch.float32)  # 384 KiB more: past 1 MiB, "a" goes
        kept = cpu._SCRATCH.buffers
        seen["names"] = list(kept)
        seen["held"] = sum(b.numel() * b.element_size() for b in kept.values())
        seen["a"] = float(a.sum())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen["reused"] and seen["names"] == ["b", "c"]
    assert seen["held"] == (512 + 384) * 1024 and seen["a"] == 256 * 256


_THREAD_COUNT_CHILD = """
import threading, torch
from concurrent.futures import ThreadPoolExecutor
def count_in_a_new_thread():
    got = []
    thread = threading.Thread(target=lambda: got.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return got[0]
default = count_in_a_new_thread()  # torch's default here, read without touching this thread's
import maxsim_kernels.cpu as cpu
from maxsim_cli.scoring import host_rows, pipeline
def start_pools():  # every pool whose threads run torch on one thread, started from a thread of its own
    cpu._stream_pool(2).submit(int).result()
    host_rows.gather_pool().submit(int).result()
    ThreadPoolExecutor(2, initializer=pipeline._reader_thread_init).submit(int).result()
starter = threading.Thread(target=start_pools)
starter.start()
starter.join()
workers = cpu._stream_pool(2).submit(torch.get_num_threads).result()
print(default, torch.get_num_threads(), count_in_a_new_thread(), workers)
"""


def test_pools_of_one_torch_thread_leave_other_threads_their_count() -> None:
    """The kernels' workers, the gathering threads and the batch stream's readers each run torch on one
    thread, and leave the count other threads take as it was: the main thread (which read its count when
    the kernels were imported) and a thread started after the pools keep torch's default, so a CPU call
    there spreads over every worker. Before, the pools' count of 1 became the default: the main thread of
    `maxsim score` with one query, and any thread started later (a server's scoring thread), scored on
    one worker."""
    child = subprocess.run(
        [sys.executable, "-c", _THREAD_COUNT_CHILD], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr
    default, main, later, worker = map(int, child.stdout.split())
    if default < 2:
        pytest.skip("torch's default is one thread here: nothing to tell apart")
    assert (main, later, worker) == (default, default, 1)


def test_cpu_rerank_group_budget_follows_the_l2_cache(tmp_path, monkeypatch) -> None:
    """The CPU rerank's group budget is 4 x a core's L2 cache (sysfs, the first CPU this process may run
    on), within 4-16 MiB; 4 MiB where the cache cannot be read. The budget changes how pairs are grouped,
    never the bits (`tests/test_cpu_rerank.py`)."""
    import maxsim_kernels.cpu as cpu

    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {3, 5})
    cache = tmp_path / "cpu3" / "cache"
    for index, (level, kind, size) in enumerate(
        (
            ("1", "Data", "48K"),
            ("1", "Instruction", "64K"),
            ("2", "Unified", "2048K"),
            ("3", "Unified", "480M"),
        )
    ):
        folder = cache / f"index{index}"
        folder.mkdir(parents=True)
        for name, text in (("level", level), ("type", kind), ("size", size)):
            (folder / name).write_text(text + "\n")
    assert cpu._l2_cache_bytes(str(tmp_path)) == 2 << 20
    (cache / "index2" / "size").write_text("1M\n")
    assert cpu._l2_cache_bytes(str(tmp_path)) == 1 << 20
    (cache / "index2" / "size").write_text("junk\n")
    assert cpu._l2_cache_bytes(str(tmp_path)) is None
    assert cpu._l2_cache_bytes(str(tmp_path / "none")) is None
    mib = 1 << 20
    wants = ((None, 4), (512 << 10, 4), (mib, 4), (2 * mib, 8), (3 * mib, 12), (32 * mib, 16))
    assert [cpu._query_group_bytes(l2) // mib for l2, _ in wants] == [want for _, want in wants]


def test_cpu_worker_count_follows_the_cgroup_quota(tmp_path, monkeypatch) -> None:
    """A cgroup CPU quota (v2 cpu.max, v1 cfs_quota_us) caps the worker threads, rounded up."""
    import maxsim_kernels.cpu as cpu

    v2 = tmp_path / "v2"
    v2.mkdir()
    for text, want in (("150000 100000\n", 2), ("50000 100000\n", 1), ("max 100000\n", None)):
        (v2 / "cpu.max").write_text(text)
        assert cpu._cgroup_cpu_limit(str(v2)) == want, text
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    for text, want in (("-1\n", None), ("250000\n", 3)):
        (v1 / "cpu" / "cpu.cfs_quota_us").write_text(text)
        assert cpu._cgroup_cpu_limit(str(v1)) == want, text
    assert cpu._cgroup_cpu_limit(str(tmp_path / "none")) is None
    monkeypatch.setattr(cpu, "_CGROUP_CPUS", [1])
    assert cpu._usable_cpus() == 1 and cpu._worker_count() == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("query_tokens", [4, 160])  # the stream path (<= 128 rows) and the blocked path
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cpu_backend_check_finite_finds_a_non_finite_document_token(bad, query_tokens, dtype):
    """One query token's similarities find a NaN/Inf component anywhere in any document token, also a
    -Inf met only by positive query components (every similarity -Inf: a max would pass over it)."""
    from maxsim_kernels.cpu import NonFiniteDocuments, maxsim_candidates_cpu, maxsim_varlen_cpu

    gen = torch.Generator().manual_seed(11)
    queries = torch.rand(query_tokens, 24, generator=gen).to(dtype) + 0.1  # all components > 0
    qo = torch.tensor([0, query_tokens // 2, query_tokens])
    lens = [5, 1, 9, 3, 7]
    docs = torch.randn(sum(lens), 24, generator=gen).to(dtype)
    do = torch.tensor(np.concatenate([[0], np.cumsum(lens)]))
    co, cd = torch.tensor([0, 3, 5]), torch.tensor([4, 2, 0, 2, 1])
    plain = maxsim_varlen_cpu(queries, qo, docs, do)
    assert torch.equal(maxsim_varlen_cpu(queries, qo, docs, do, check_finite=True), plain)
    assert torch.equal(
        maxsim_candidates_cpu(queries, qo, docs, do, co, cd, check_finite=True),
        maxsim_candidates_cpu(queries, qo, docs, do, co, cd),
    )
    docs[int(do[2]) + 6, 17] = bad  # document 2, token 6
    with pytest.raises(NonFiniteDocuments, match="NaN or Inf"):
        maxsim_varlen_cpu(queries, qo, docs, do, check_finite=True)
    with pytest.raises(NonFiniteDocuments):
        maxsim_candidates_cpu(queries, qo, docs, do, co, cd, check_finite=True)
    maxsim_candidates_cpu(
        queries, qo, docs, do, co.new_tensor([0, 1, 2]), cd.new_tensor([4, 0]), check_finite=True
    )


def test_public_entries_check_finite_on_the_torch_backend_and_refuse_it_elsewhere():
    """``check_finite`` reaches the torch backend's check through `maxsim_varlen` / `maxsim_candidates`;
    the paths that cannot check (int8 documents, inputs that require grad, Triton) say so up front."""
    import maxsim_kernels as mk

    gen = torch.Generator().manual_seed(12)
    queries, qo = torch.rand(6, 16, generator=gen) + 0.1, torch.tensor([0, 2, 6])
    docs, do = torch.randn(9, 16, generator=gen), torch.tensor([0, 4, 9])
    co, cd = torch.tensor([0, 1, 2]), torch.tensor([1, 0])
    plain = mk.maxsim_varlen(queries, qo, docs, do)
    assert torch.equal(mk.maxsim_varlen(queries, qo, docs, do, check_finite=True), plain)
    assert torch.equal(
        mk.maxsim_candidates(queries, qo, docs, do, co, cd, check_finite=True),
        mk.maxsim_candidates(queries, qo, docs, do, co, cd),
    )
    docs[6, 3] = float("nan")
    with pytest.raises(mk.NonFiniteDocuments):
        mk.maxsim_varlen(queries, qo, docs, do, backend="torch", check_finite=True)
    with pytest.raises(mk.NonFiniteDocuments):
        mk.maxsim_candidates(queries, qo, docs, do, co, cd, check_finite=True)
    assert torch.isnan(mk.maxsim_varlen(queries, qo, docs, do)[:, 1]).all()  # unchecked by default
    grad_queries = queries.clone().requires_grad_()
    codes, scales = torch.zeros(9, 16, dtype=torch.int8), torch.ones(9)
    for call in (
        lambda: mk.maxsim_varlen(queries, qo, docs, do, backend="triton", check_finite=True),
        lambda: mk.maxsim_varlen(grad_queries, qo, docs, do, check_finite=True),
        lambda: mk.maxsim_candidates(queries, qo, codes, do, co, cd, doc_scales=scales, check_finite=True),
    ):
        with pytest.raises(ValueError, match="check_finite needs the torch backend"):
            call()


def test_int16_argmax_is_refused_for_documents_of_2_pow_15_tokens():
    """The autograd path's int16 argmax holds indices below 2^15; the forward refuses it otherwise (the
    check comes before any launch), and any other dtype."""
    import maxsim_kernels.maxsim_forward as fwd

    queries, qo = torch.randn(3, 8), torch.tensor([0, 3])
    docs, do = torch.zeros(1 << 15, 8), torch.tensor([0, 1 << 15])
    with pytest.raises(ValueError, match="under 2\\^15 tokens; the longest has 32768"):
        fwd.maxsim_varlen_forward_triton(queries, qo, docs, do, return_argmax=True, argmax_dtype=torch.int16)
    with pytest.raises(ValueError, match="int16 or torch.int32"):
        fwd.maxsim_varlen_forward_triton(
            queries, qo, docs[:4], torch.tensor([0, 4]), return_argmax=True, argmax_dtype=torch.int64
        )


# ---------------------------------------------------------------------------------------------------
# ResidentCandidates: reranks through one reused buffer, the generic launcher's scores


def test_specialisation_keys_follow_tritons_rules():
    from maxsim_kernels.launch import specialisation_key

    assert specialisation_key(1) != specialisation_key(2)  # 1 is a compile-time constant
    assert specialisation_key(16) == specialisation_key(4096) != specialisation_key(17)
    assert specialisation_key(2**31) != specialisation_key(2**31 - 16)  # i64 against i32
    x = torch.zeros(8, dtype=torch.int64)
    assert specialisation_key(x) == specialisation_key(x[2:]) != specialisation_key(x[1:])
    assert specialisation_key(x) != specialisation_key(x.float())


@pytest.mark.parametrize("c_off", [[0, 0], [0, 1], [0, 7], [0, 8], [0, 1000], [3, 20], [0, 5, 5, 21]])
def test_candidate_blocks_of_one_query_are_the_tables(c_off):
    """One query's program table (its shortcut) is what the table's arithmetic gives for it."""
    from maxsim_kernels.maxsim_forward import _candidate_blocks

    c_off = np.array(c_off, dtype=np.int64)
    counts = np.diff(c_off)
    n_blk = (counts + 7) // 8
    query = np.repeat(np.arange(len(counts), dtype=np.int64), n_blk)
    first = c_off[query] + (np.arange(len(query)) - np.repeat(np.cumsum(n_blk) - n_blk, n_blk)) * 8
    expected = (query, first, np.minimum(first + 8, c_off[query + 1]))
    got = _candidate_blocks(c_off, 8)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(got, expected, strict=True))


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_resident_candidates_equal_the_launcher(dtype):
    """Calls of every shape one after another through the reused buffer: the generic launcher's scores,
    bit for bit (the same kernel and inputs), within the reference's bound."""
    from maxsim_kernels.maxsim_forward import ResidentCandidates, maxsim_candidates_forward_triton

    gen = torch.Generator().manual_seed(21)
    d_lens = torch.randint(1, 40, (30,), generator=gen)
    d_lens[5] = 1
    docs, d_off = packed(d_lens, 24, dtype, gen=gen)
    staged = ResidentCandidates(docs, d_off)
    for q_lens, counts in [([5], [1]), ([32], [30]), ([3, 17], [9, 1]), ([1, 4, 7], [4, 0, 11]), ([5], [1])]:
        queries, q_off = packed(q_lens, 24, torch.float32, gen=gen)
        c_off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        cand = torch.randint(0, 30, (int(c_off[-1]),), generator=gen).numpy()
        got = staged(queries, q_off.numpy(), c_off, cand)
        want = maxsim_candidates_forward_triton(
            queries.to(dtype), q_off, docs, d_off, torch.from_numpy(c_off), torch.from_numpy(cand)
        )
        assert got.dtype == np.float32 and np.array_equal(got, want.numpy())
        ref = maxsim_candidates_reference(
            queries.to(dtype), q_off, docs, d_off, torch.from_numpy(c_off), torch.from_numpy(cand)
        )
        check_scores(
            torch.from_numpy(got), ref, torch.repeat_interleave(q_off.diff(), torch.tensor(counts)), 24
        )


def test_resident_candidates_refuse_what_they_cannot_score():
    from maxsim_kernels.maxsim_forward import ResidentCandidates

    docs, d_off = packed([3, 4], 16, torch.float32)
    staged = ResidentCandidates(docs, d_off)
    queries, _ = packed([2], 16)
    one, q_off = np.array([0, 1], dtype=np.int64), np.array([0, 2])
    with pytest.raises(ValueError, match="not a document index"):
        staged(queries, q_off, one, np.array([2]))
    with pytest.raises(ValueError, match="disagree"):
        staged(queries, q_off, np.array([0, 2]), np.array([1]))
    with pytest.raises(ValueError, match="disagree"):  # offsets past the queries' rows
        staged(queries, np.array([0, 3]), one, np.array([1]))
    assert staged(queries, q_off, np.array([0, 0]), np.zeros(0, dtype=np.int64)).shape == (0,)
    long_query, _ = packed([129], 16)
    assert staged(long_query, np.array([0, 129]), one, np.array([1])) is None  # chunked: the generic path
    with pytest.raises(ValueError, match="float16/bfloat16/float32"):
        ResidentCandidates(docs.to(torch.int8), d_off)
