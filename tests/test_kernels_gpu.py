"""The fused Triton forward on a CUDA GPU at realistic sizes, against the float64 reference.

Tolerances (as in tests/test_kernels.py): fp16 and bf16 products are exact in fp32 and the reference
multiplies the same rounded values, so only fp32 accumulation differs: |err| <= 2e-6 * Lq * max(1, dim/32)
+ 1e-6 * |ref|. TF32 rounds both factors to 10-bit mantissas (relative 2^-11 each), so a dot product of
unit vectors is off by up to ~1e-3: |err| <= 2e-3 * Lq. Argmax must equal the reference wherever the two
best similarities differ by more than 1e-5 (1e-2 under TF32).
"""

from __future__ import annotations

import os

import pytest
import torch
from maxsim_kernels import (
    maxsim_candidates,
    maxsim_candidates_reference,
    maxsim_reference,
    maxsim_varlen,
)

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def packed(lens, dim, dtype, gen):
    lens = torch.as_tensor(lens, dtype=torch.int64)
    off = torch.zeros(len(lens) + 1, dtype=torch.int64)
    off[1:] = torch.cumsum(lens, 0)
    x = torch.randn(int(off[-1]), dim, generator=gen, device=CUDA, dtype=torch.float32)
    x = torch.nn.functional.normalize(x, dim=-1).to(dtype)
    return x, off


def bound(ref, q_lens, dim, tf32=False):
    q_lens = torch.as_tensor(q_lens, dtype=torch.float64, device=ref.device)
    if tf32:
        return 2e-3 * q_lens + 1e-6 * ref.abs()
    return 2e-6 * q_lens * max(1.0, dim / 32) + 1e-6 * ref.abs()


def assert_close(out, ref, q_lens, dim, tf32=False):
    out = out.double()
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(out), inf)
    err = torch.where(inf, 0.0, (out - ref).abs())
    limit = bound(ref, q_lens, dim, tf32)
    worst = (err / limit).max().item()
    assert worst <= 1.0, f"error {err.max().item():.3g} is {worst:.2f}x the bound"


def assert_argmax(arg, queries, q_off, docs, d_off, doc_ids, gap):
    """Every query token against the documents `doc_ids`: arg [Tq, len(doc_ids)]."""
    q64 = queries.double()
    for col, di in enumerate(doc_ids):
        d = docs[d_off[di] : d_off[di + 1]].double()
        if d.shape[0] == 0:
            assert bool((arg[:, col] == -1).all())
            continue
        sim = q64 @ d.T
        top = sim.topk(min(2, d.shape[0]), dim=1).values
        first = (sim == top[:, :1]).int().argmax(dim=1)
        clear = (top[:, 0] - top[:, -1] > gap) if d.shape[0] > 1 else torch.ones_like(first, dtype=torch.bool)
        got = arg[:, col].long()
        assert bool((got[clear] == first[clear]).all())
        assert bool((sim.gather(1, got[:, None])[:, 0] >= top[:, 0] - gap).all())


@pytest.mark.parametrize(
    "dtype, dim, tf32",
    [
        (torch.float16, 128, False),
        (torch.bfloat16, 128, False),
        (torch.float32, 128, False),
        (torch.float32, 128, True),
        (torch.float16, 96, False),
        (torch.float16, 136, False),
        (torch.float16, 512, False),
    ],
)
@pytest.mark.parametrize("num_queries", [1, 5, 96])  # the "few", "some" and "many" shape classes
def test_varlen_realistic(dtype, dim, tf32, num_queries):
    gen = torch.Generator(device=CUDA).manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    q_lens = torch.randint(1, 33, (num_queries,), generator=cpu_gen)
    d_lens = torch.randint(1, 301, (1500,), generator=cpu_gen)
    d_lens[::97] = 0  # empty documents
    d_lens[5::101] = 1
    queries, q_off = packed(q_lens, dim, dtype, gen)
    docs, d_off = packed(d_lens, dim, dtype, gen)
    scores, arg = maxsim_varlen(queries, q_off, docs, d_off, return_argmax=True, allow_tf32=tf32)
    ref = maxsim_reference(queries, q_off, docs, d_off)
    assert_close(scores, ref, q_lens[:, None], dim, tf32)
    plain = maxsim_varlen(queries, q_off.to(CUDA), docs, d_off.to(CUDA), allow_tf32=tf32)
    assert torch.equal(plain, scores)
    picked = list(range(0, 1500, 37))
    assert_argmax(arg[:, picked], queries, q_off, docs, d_off, picked, 1e-2 if tf32 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_varlen_long_queries(dtype):
    gen = torch.Generator(device=CUDA).manual_seed(1)
    queries, q_off = packed([1024, 700], 128, dtype, gen)
    docs, d_off = packed([1024] * 20 + [3, 0, 517], 128, dtype, gen)
    scores, arg = maxsim_varlen(queries, q_off, docs, d_off, return_argmax=True)
    ref = maxsim_reference(queries, q_off, docs, d_off)
    assert_close(scores, ref, torch.tensor([[1024], [700]]), 128)
    assert_argmax(arg, queries, q_off, docs, d_off, list(range(23)), 1e-5)


def _uses_hopper_kernel(queries, q_off, docs, d_off) -> bool:
    from maxsim_kernels import maxsim_forward as fwd
    from maxsim_kernels.validation import check_inputs

    layout = check_inputs(queries, q_off, docs, d_off)
    plan = fwd._varlen_plan(queries, q_off, docs, d_off, False, False, layout, None, None)
    return type(plan.launch).__name__ == "LongLaunch"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_long_queries_on_hopper_equal_the_triton_kernel(dtype):
    """Scores-only long queries take the Gluon kernel on Hopper (maxsim_forward_hopper): bit for bit the
    Triton kernel's scores, on ragged documents (empty, 1 token, tiles straddling documents, a run longer
    than a tile group, groups where every tile ends a document) and negative similarities; within the
    float64 bound."""
    from maxsim_kernels import maxsim_forward as fwd

    gen = torch.Generator(device=CUDA).manual_seed(4)
    cpu_gen = torch.Generator().manual_seed(4)
    d_lens = [0, 1, 63, 64, 65, 1024, 7, 128, 129, 1030] + torch.randint(
        0, 700, (53,), generator=cpu_gen
    ).tolist()
    d_lens += torch.randint(0, 65, (60,), generator=cpu_gen).tolist()  # one-tile docs: groups of ends
    queries, q_off = packed([1024, 129, 300, 1030], 128, dtype, gen)
    docs, d_off = packed(d_lens, 128, dtype, gen)
    docs[: docs.shape[0] // 2] *= -1
    if not _uses_hopper_kernel(queries, q_off, docs, d_off):
        pytest.skip("the Hopper kernel needs an sm_90 GPU and the Triton release it was built with")
    scores = maxsim_varlen(queries, q_off, docs, d_off)
    triton_scores = fwd.maxsim_varlen_forward_triton(queries, q_off, docs, d_off, config=fwd._TUNING["long"])
    assert torch.equal(scores, triton_scores)
    ref = maxsim_reference(queries, q_off, docs, d_off)
    assert_close(scores, ref, torch.tensor([[1024], [129], [300], [1030]]), 128)
    # other sizes and lengths: no recompilation
    from maxsim_kernels import maxsim_forward_hopper as hopper

    compiled = _compiles(hopper._maxsim_long_kernel)
    more_q, more_q_off = packed([200, 1024, 517], 128, dtype, gen)
    more_d, more_d_off = packed(d_lens[:17], 128, dtype, gen)
    more = maxsim_varlen(more_q, more_q_off, more_d, more_d_off)
    assert torch.equal(more, fwd.maxsim_varlen_forward_triton(more_q, more_q_off, more_d, more_d_off,
                                                              config=fwd._TUNING["long"]))  # fmt: skip
    assert _compiles(hopper._maxsim_long_kernel) == compiled


_HOPPER_SM90_BUILD = r"""
import torch
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
import maxsim_kernels.maxsim_forward_hopper as hopper

kernel = hopper._maxsim_long_kernel
names = kernel.arg_names
docs = torch.zeros(1000, 128, dtype=torch.float16)
layout = hopper._tile_layout(hopper.BLOCK_T, 128, docs.dtype)
desc = hopper.TensorDescriptor.from_tensor(docs, [hopper.BLOCK_T, 128], layout)
consts = {"DIM": 128, "BLOCK_T": hopper.BLOCK_T, "STAGES": hopper.STAGES, "GROUP": hopper.GROUP}
sig = {n: "i32" for n in names}
sig.update({"q_ptr": "*fp16", "q_off_ptr": "*i64", "d_off_ptr": "*i64", "out_ptr": "*fp32",
            "d_desc": mangle_type(desc), **{n: "constexpr" for n in consts}})
src = GluonASTSource(kernel, sig, constexprs={(names.index(n),): v for n, v in consts.items()})
compiled = triton.compile(src, target=SM90, options={"num_warps": hopper.NUM_WARPS})
info = ptxas_report(compiled)
print(json.dumps({"ptxas": info, "usage": resource_usage(compiled)}))
"""


def test_hopper_kernel_builds_without_serialized_wgmma(sm90_build):
    """The overlap of the Hopper kernel exists only while ptxas keeps its wgmma asynchronous: ptxas
    serializes them all (C7514) when an accumulator is copied or in flight across a loop's back edge
    (maxsim_forward_hopper). Built for sm_90 with the Triton release the kernel is used with."""
    import triton
    from maxsim_kernels.launch import GLUON_TRITON

    if not triton.__version__.startswith(GLUON_TRITON):
        pytest.skip(f"the Hopper kernel is built with triton {GLUON_TRITON}x, not {triton.__version__}")
    report = sm90_build(_HOPPER_SM90_BUILD)
    assert "C7514" not in report["ptxas"] and "serialized" not in report["ptxas"], report["ptxas"]
    assert not report["usage"] or "LOCAL:0" in report["usage"], report["usage"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_candidates_realistic(dtype):
    gen = torch.Generator(device=CUDA).manual_seed(2)
    cpu_gen = torch.Generator().manual_seed(2)
    d_lens = torch.randint(0, 200, (3000,), generator=cpu_gen)
    queries, q_off = packed(torch.randint(1, 33, (16,), generator=cpu_gen), 128, dtype, gen)
    docs, d_off = packed(d_lens, 128, dtype, gen)
    counts = torch.randint(0, 300, (16,), generator=cpu_gen)
    counts[3] = 0
    c_off = torch.zeros(17, dtype=torch.int64)
    c_off[1:] = counts.cumsum(0)
    cand = torch.randint(0, 3000, (int(c_off[-1]),), generator=cpu_gen)
    scores, arg = maxsim_candidates(queries, q_off, docs, d_off, c_off, cand.to(CUDA), return_argmax=True)
    ref, ref_arg = maxsim_candidates_reference(queries, q_off, docs, d_off, c_off, cand, return_argmax=True)
    q_lens = torch.repeat_interleave(q_off.diff(), counts)
    assert_close(scores, ref, q_lens, 128)
    # argmax: agree wherever the reference's best two similarities are clearly apart
    agree = (arg == ref_arg).float().mean().item()
    assert agree > 0.999, agree


def test_candidates_of_new_tensors_every_call_match_the_reference():
    """A served rerank's pattern: new query offsets, candidates and program blocks at every call, for 1
    and several queries and odd and even numbers of program blocks."""
    gen = torch.Generator(device=CUDA).manual_seed(4)
    cpu_gen = torch.Generator().manual_seed(4)
    docs, d_off = packed(torch.randint(1, 200, (2000,), generator=cpu_gen), 128, torch.float16, gen)
    for counts in ([1], [1000], [999, 1], [37, 0, 300], [64] * 5):
        queries, q_off = packed([32] * len(counts), 128, torch.float16, gen)
        c_off = torch.zeros(len(counts) + 1, dtype=torch.int64)
        c_off[1:] = torch.tensor(counts).cumsum(0)
        cand = torch.randint(0, 2000, (int(c_off[-1]),), generator=cpu_gen)
        scores = maxsim_candidates(queries, q_off.clone(), docs, d_off, c_off.clone(), cand.clone())
        ref = maxsim_candidates_reference(queries, q_off, docs, d_off, c_off, cand)
        assert_close(scores, ref, torch.repeat_interleave(q_off.diff(), torch.tensor(counts)), 128)


def test_offsets_past_2_pow_31_elements():
    """A docs tensor of > 2^31 elements; the scored documents at its end need 64-bit offsets."""
    dim, doc_len = 128, 1024
    num_docs = (2**31 // (dim * doc_len)) + 8  # 16392 documents, 2.15e9 elements (4.3 GB in fp16)
    docs = torch.empty(num_docs * doc_len, dim, dtype=torch.float16, device=CUDA)
    assert docs.numel() > 2**31
    docs.normal_()
    d_off = torch.arange(num_docs + 1, dtype=torch.int64) * doc_len
    gen = torch.Generator(device=CUDA).manual_seed(3)
    queries, q_off = packed([32], dim, torch.float16, gen)
    scores = maxsim_varlen(queries, q_off, docs, d_off)
    tail = 16
    sub = docs[d_off[-tail - 1] :]
    ref = maxsim_reference(queries, q_off, sub, d_off[-tail - 1 :] - d_off[-tail - 1])
    # unnormalised randn docs: similarities ~ N(0, 1) x sqrt(dim) scale, so scale the bound
    err = (scores[0, -tail:].double() - ref[0]).abs().max().item()
    assert err <= 1e-3 * ref.abs().max().item(), err
    cand = torch.tensor([num_docs - 1, 0, num_docs - 2])
    c_scores = maxsim_candidates(queries, q_off, docs, d_off, torch.tensor([0, 3]), cand)
    assert torch.allclose(c_scores[[0, 2]], scores[0, [num_docs - 1, num_docs - 2]], rtol=0, atol=0)
    # a long query (the Hopper kernel's class on an H200): the same tail, and the Triton kernel's bits
    from maxsim_kernels import maxsim_forward as fwd

    long_q, long_off = packed([300], dim, torch.float16, gen)
    long_scores = maxsim_varlen(long_q, long_off, docs, d_off)
    ref = maxsim_reference(long_q, long_off, sub, d_off[-tail - 1 :] - d_off[-tail - 1])
    err = (long_scores[0, -tail:].double() - ref[0]).abs().max().item()
    assert err <= 1e-3 * ref.abs().max().item(), err
    triton_scores = fwd.maxsim_varlen_forward_triton(
        long_q, long_off, docs, d_off, config=fwd._TUNING["long"]
    )
    assert torch.equal(long_scores, triton_scores)


def _compiles(kernel) -> int:
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def test_no_recompilation_within_a_bucket():
    """Sizes that are 1 or multiples of 16, and odd slice alignments, reuse the compiled kernels (after
    one warm-up per class: the backward's inverse map has one for 64 documents or more, one below)."""
    from maxsim_kernels import int8_host
    from maxsim_kernels import maxsim_backward as bwd
    from maxsim_kernels import maxsim_forward as fwd
    from maxsim_kernels import maxsim_int8 as i8

    kernels = [
        fwd._maxsim_varlen_kernel,
        fwd._maxsim_candidates_kernel,
        i8._maxsim_int8_varlen_kernel,
        i8._maxsim_int8_candidates_kernel,
        i8._quantize_rows_kernel,
        bwd._maxsim_inverse_csr_kernel,
        bwd._maxsim_grad_queries_kernel,
        bwd._maxsim_grad_docs_kernel,
    ]
    gen = torch.Generator(device=CUDA).manual_seed(4)
    cpu_gen = torch.Generator().manual_seed(4)

    def run(nq, q_max, nd, d_max):
        q_lens = torch.randint(1, q_max + 1, (nq,), generator=cpu_gen)
        q_lens[0] = q_max
        queries, q_off = packed(q_lens, 128, torch.float16, gen)
        docs, d_off = packed(torch.randint(0, d_max + 1, (nd,), generator=cpu_gen), 128, torch.float16, gen)
        maxsim_varlen(queries, q_off, docs, d_off)
        c_off = torch.linspace(0, nd, nq + 1).long()
        maxsim_candidates(queries, q_off, docs, d_off, c_off, torch.arange(nd))
        codes, scales = int8_host.quantize_per_token(docs)
        # the int8 tiling is chosen by the mean query length: hold it in one class (17 to 32 tokens)
        q8, q8_off = packed([q_max] * nq, 128, torch.float16, gen)
        maxsim_varlen(q8, q8_off, codes, d_off, doc_scales=scales)
        maxsim_candidates(q8, q8_off, codes, d_off, c_off, torch.arange(nd), doc_scales=scales)
        q = queries.float().requires_grad_()
        d = docs.float().requires_grad_()
        maxsim_varlen(q, q_off, d, d_off).sum().backward()

    run(64, 32, 1000, 300)  # warm: one compile per kernel
    run(64, 32, 16, 300)  # and per class of the backward's inverse map (fewer than 64 documents)
    before = [_compiles(k) for k in kernels]
    for nq, q_max, nd, d_max in [(65, 17, 1, 5), (128, 32, 4097, 1000), (200, 25, 16, 64), (96, 31, 333, 1)]:
        run(nq, q_max, nd, d_max)
    after = [_compiles(k) for k in kernels]
    assert after == before, [(k.fn.__name__, b, a) for k, b, a in zip(kernels, before, after, strict=True)]


def test_repeated_calls_through_the_compiled_launcher_agree():
    """From its third call on, a launch plan calls the compiled kernel's own launcher (`KernelLaunch`):
    the results must stay bitwise equal to the first call's, for every layout and with the argmax."""
    from maxsim_kernels import maxsim_forward as fwd

    gen = torch.Generator(device=CUDA).manual_seed(11)
    queries, q_off = packed([32, 7, 19, 32], 128, torch.float16, gen)
    docs, d_off = packed([180, 3, 0, 77, 300], 128, torch.float16, gen)
    c_off, cands = torch.tensor([0, 2, 2, 5, 7]), torch.tensor([4, 0, 1, 2, 3, 3, 4])
    q_head = q_off[:2]  # one object: a fresh slice in every call would be a new partner, planned afresh
    calls = [
        lambda: fwd.maxsim_varlen_forward_triton(queries, q_off, docs, d_off),
        lambda: fwd.maxsim_varlen_forward_triton(queries, q_off, docs, d_off, return_argmax=True),
        lambda: fwd.maxsim_varlen_forward_triton(queries[:32], q_head, docs, d_off, return_argmax=True),
        lambda: maxsim_candidates(queries, q_off, docs, d_off, c_off, cands, return_argmax=True),
    ]
    for call in calls:
        first = call()
        for _ in range(4):
            again = call()
            torch.cuda.synchronize()
            first_parts = first if isinstance(first, tuple) else (first,)
            again_parts = again if isinstance(again, tuple) else (again,)
            assert all(torch.equal(a, b) for a, b in zip(first_parts, again_parts, strict=True))
    plans = _plans(d_off)
    assert plans and all(plan.launch.runner is not None for plan in plans)


def _plans(offsets):
    """The launch plans remembered on ``offsets``: per partner tensor, and by a few host query offsets'
    values (`memo_plan`)."""
    from maxsim_kernels import validation as v

    memos = v._MEMO[id(offsets)][2]
    by_tensor = [entry[1] for entry in memos.get("pairs", {}).values()]
    return by_tensor + list(memos.get("plans by query offsets", {}).values())


@pytest.mark.gpu
def test_gpu_tests_run_compiled_kernels_not_the_interpreter():
    """Nothing in the test session may switch Triton to its interpreter on a GPU machine."""
    assert os.environ.get("TRITON_INTERPRET", "0") != "1"


def test_host_offsets_reach_the_device_without_waiting_for_the_stream():
    """`host_to_device` (how the kernels take offsets from the host) queues its copy behind the kernels
    already on the stream instead of waiting for them, and reads the caller's tensor at once: changing
    it after the call does not change what arrives."""
    from maxsim_kernels.validation import host_to_device

    values = torch.arange(100_000, dtype=torch.int64)
    for source in (values.clone(), values.clone().pin_memory()):
        torch.cuda.synchronize()
        busy = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of the copy
        busy.record()
        copied = host_to_device(source, CUDA)
        returned_while_busy = not busy.query()
        source.fill_(-1)
        assert returned_while_busy
        assert torch.equal(copied.cpu(), values)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_resident_candidates_equal_the_launcher_bit_for_bit(dtype):
    """A server's reranks through `ResidentCandidates` (one reused pinned buffer, the compiled kernel of
    each specialisation from its second call on): the generic launcher's scores, bit for bit, call after
    call, for 1 and several queries, odd and even program counts, candidate counts that are and are not
    multiples of 16, and within the reference's bound."""
    import numpy as np
    from maxsim_kernels.maxsim_forward import ResidentCandidates, maxsim_candidates_forward_triton

    gen = torch.Generator(device=CUDA).manual_seed(8)
    cpu_gen = torch.Generator().manual_seed(8)
    docs, d_off = packed(torch.randint(1, 200, (3000,), generator=cpu_gen), 128, dtype, gen)
    staged = ResidentCandidates(docs, d_off.to(CUDA))
    cases = [([32], [1000]), ([32], [1]), ([32], [999]), ([7, 32], [999, 1]), ([3, 32, 17], [37, 0, 300])]
    for _ in range(3):
        for q_lens, counts in cases:
            queries, q_off = packed(q_lens, 128, torch.float32, gen)
            c_off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            cand = torch.randint(0, 3000, (int(c_off[-1]),), generator=cpu_gen).numpy()
            got = staged(queries.cpu(), q_off.cpu().numpy(), c_off, cand)
            want = maxsim_candidates_forward_triton(
                queries.to(dtype), q_off, docs, d_off, torch.from_numpy(c_off), torch.from_numpy(cand)
            )
            assert np.array_equal(got, want.cpu().numpy()), (q_lens, counts)
            ref = maxsim_candidates_reference(
                queries.to(dtype), q_off, docs, d_off, torch.from_numpy(c_off), torch.from_numpy(cand)
            )
            assert_close(
                torch.from_numpy(got).to(CUDA),
                ref,
                torch.repeat_interleave(q_off.diff(), torch.tensor(counts)).to(CUDA),
                128,
            )
    assert all(launch._compiled for launch in staged._launches.values())


def service_batches(n_docs: int, nq: int, seeds, max_count: int = 60):
    """A service's candidate batches: per batch, new candidate offsets on the host and new candidate
    indices on the GPU (made before any check of synchronisation starts)."""
    batches = []
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        counts = torch.randint(0, max_count, (nq,), generator=gen)
        c_off = torch.zeros(nq + 1, dtype=torch.int64)
        c_off[1:] = counts.cumsum(0)
        batches.append((c_off, torch.randint(0, n_docs, (int(c_off[-1]),), generator=gen).to(CUDA)))
    return batches


@pytest.mark.parametrize("doc_offsets_on", ["cpu", "cuda"])
def test_new_device_candidates_cost_no_synchronisation(doc_offsets_on):
    """A new candidates tensor on the GPU each call (as a service passes them), the corpus and the query
    offsets as before, candidate offsets from the host: no call waits for the device."""
    gen = torch.Generator(device=CUDA).manual_seed(3)
    cpu_gen = torch.Generator().manual_seed(3)
    queries, q_off = packed(torch.randint(1, 33, (16,), generator=cpu_gen), 128, torch.float16, gen)
    docs, d_off = packed(torch.randint(1, 200, (500,), generator=cpu_gen), 128, torch.float16, gen)
    d_off = d_off.to(doc_offsets_on)
    first, *batches = service_batches(500, 16, range(5))
    maxsim_candidates(queries, q_off, docs, d_off, *first)  # compiles; reads the corpus offsets once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        scores = [maxsim_candidates(queries, q_off, docs, d_off, *batch) for batch in batches]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for batch, got in zip(batches, scores, strict=True):
        ref = maxsim_candidates_reference(queries, q_off, docs, d_off, *batch)
        q_lens = torch.repeat_interleave(q_off.diff(), batch[0].diff()).to(CUDA)
        assert_close(got, ref, q_lens, 128)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("q_lens", [[32] * 8, [7, 150, 32]])  # 150: a long query, scored in chunks
def test_bad_device_candidate_indices_score_nan(dtype, q_lens):
    """Candidate indices on the GPU outside [0, num_docs) are never read through: NaN for them (argmax
    -1), the other candidates' scores and argmax bit for bit those of the same call without them."""
    gen = torch.Generator(device=CUDA).manual_seed(6)
    cpu_gen = torch.Generator().manual_seed(6)
    queries, q_off = packed(q_lens, 128, dtype, gen)
    docs, d_off = packed(torch.randint(0, 300, (2000,), generator=cpu_gen), 128, dtype, gen)
    c_off, valid = service_batches(2000, len(q_lens), [7], max_count=100)[0]
    bad = torch.rand(valid.shape, generator=cpu_gen).to(CUDA) < 0.1
    bad[0] = bad[-1] = True
    picks = torch.tensor([-1, 2000, 2**32 + 5, -(2**62), 2**62], device=CUDA)
    cand = torch.where(bad, picks[torch.arange(valid.numel(), device=CUDA) % picks.numel()], valid)
    for return_argmax in (False, True):
        got = maxsim_candidates(queries, q_off, docs, d_off, c_off, cand, return_argmax=return_argmax)
        want = maxsim_candidates(queries, q_off, docs, d_off, c_off, valid, return_argmax=return_argmax)
        if return_argmax:
            (got, got_arg), (want, want_arg) = got, want
            assert bool((got_arg[bad] == -1).all())
            assert torch.equal(got_arg[~bad], want_arg[~bad])
        assert torch.equal(torch.isnan(got), bad)
        assert torch.equal(got[~bad], want[~bad])
