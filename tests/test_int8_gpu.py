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
from maxsim_kernels.int8_host import (
    maxsim_candidates_int8,
    maxsim_int8_reference,
    maxsim_varlen_int8,
    quantize_per_token,
)
from tierlib import PRODUCER_CONFIGS

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


def uses_hopper(queries, qo, d8, do, return_argmax: bool = False) -> bool:
    """Whether `maxsim_varlen_int8` takes these inputs to the Gluon kernel (maxsim_int8_hopper)."""
    from maxsim_kernels import maxsim_int8

    q8 = queries if queries.dtype == torch.int8 else quantize_per_token(queries)[0]
    return maxsim_int8.hopper_allpairs(qo, do, q8, d8, return_argmax) is not None


def uses_stream(queries, qo, d8) -> bool:
    """Whether scores-only int8 calls with these queries go to the Gluon kernel for HBM-bound shapes
    (maxsim_int8_hopper_stream: one query, or candidates with host query offsets)."""
    from maxsim_kernels import maxsim_int8

    q8 = queries if queries.dtype == torch.int8 else quantize_per_token(queries)[0]
    return maxsim_int8.hopper_stream(qo, q8, d8, False) is not None


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
    scores_only = maxsim_varlen_int8(queries, qo, d8, do, doc_scales=sd)
    if uses_stream(queries, qo, d8) or uses_hopper(queries, qo, d8, do):
        # scores only on sm_90: a Gluon kernel (one query: the stream kernel; several query groups, offsets
        # on the host or the device: the all-pairs one), whose sums run in another order than the argmax's
        assert_scores(scores_only, scores.double(), 2 * score_tolerance(queries, qo, d8, do, sd))
    else:
        assert torch.equal(scores_only, scores)
    # Offsets from the host (as `maxsim score` passes them): checked there; the same scores, or on Hopper
    # (the Gluon kernel, whose sums run in another order) scores within the same bound.
    host = maxsim_varlen_int8(queries, qo.cpu(), d8, do.cpu(), doc_scales=sd)
    if uses_hopper(queries, qo.cpu(), d8, do.cpu()) or uses_stream(queries, qo.cpu(), d8):
        ref = maxsim_int8_reference(queries, qo, d8, do, doc_scales=sd)
        assert_scores(host, ref, score_tolerance(queries, qo, d8, do, sd))
    else:
        assert torch.equal(host, scores)
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


def corpus_past_2_31_bytes(dim: int, seed: int, n_tokens: int | None = None, device: str = "cuda"):
    """Random int8 documents of 200 tokens (the last one longer) filling 2^31 bytes and 100K tokens more:
    (codes [T, dim], scales [T], host offsets, the generator for the queries)."""
    n_tokens = n_tokens or (1 << 31) // dim + 100_000  # 2.16 GB of int8 tokens at dim 128
    gen = torch.Generator(device=device).manual_seed(seed)
    d8 = torch.randint(-127, 128, (n_tokens, dim), dtype=torch.int8, device=device, generator=gen)
    sd = torch.rand(n_tokens, device=device, generator=gen) * 1e-3 + 1e-4
    lengths = torch.full((n_tokens // 200,), 200, dtype=torch.int64)
    lengths[-1] += n_tokens - int(lengths.sum())
    do = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    do[1:] = lengths.cumsum(0)
    return d8, sd, do, gen


def test_offsets_past_2_31_bytes() -> None:
    """Documents whose bytes start beyond 2^31: 64-bit index arithmetic (the peers' overflow bug)."""
    dim = 128
    d8, sd, do, gen = corpus_past_2_31_bytes(dim, seed=2)
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


def hopper_or_skip(queries, qo, d8, do) -> None:
    if not uses_hopper(queries, qo, d8, do):
        pytest.skip("the Gluon int8 kernel needs an sm_90 GPU and the Triton release it was built with")


def packed_lengths(lengths: list[int], dim: int, gen: torch.Generator, dtype=torch.float16):
    """Items of the given lengths (L2-normalised, on the GPU) and their host offsets."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    values = torch.nn.functional.normalize(torch.randn(int(offsets[-1]), dim, generator=gen), dim=1)
    return values.to(dtype).cuda(), offsets


@pytest.mark.parametrize(
    "q_lens",
    [
        "ragged",  # 1..32 tokens: 4 queries a group, groups of ragged rows
        [128] * 8,  # one query a group
        [32] * 8,  # two groups of four: the fewest the kernel takes (`MIN_GROUPS`)
        [1, 2, 3, 4, 5, 6, 7, 8] * 16,  # short queries: 16 a group (the cap)
    ],
)
def test_hopper_allpairs_against_reference(q_lens, monkeypatch) -> None:
    """The Gluon all-pairs kernel (host offsets, scores only, dim 128, sm_90): every score within the
    float64 bound, -inf for empty documents, close to the Triton kernel's, on ragged documents (empty, one
    token, tiles straddling documents, runs of one-tile documents whose groups end a document at every
    tile), negative similarities and exact ties."""
    gen = torch.Generator().manual_seed(11)
    if q_lens == "ragged":
        q_lens = torch.randint(1, 33, (64,), generator=gen).tolist()
        q_lens[:3] = [32, 1, 32]
    d_lens = [0, 1, 63, 64, 65, 128, 129, 300, 7, 0]
    d_lens += torch.randint(0, 301, (400,), generator=gen).tolist()
    d_lens += torch.randint(1, 65, (200,), generator=gen).tolist()
    queries, qo = packed_lengths(q_lens, 128, gen)
    docs, do = packed_lengths(d_lens, 128, gen)
    docs[: docs.shape[0] // 2] *= -1
    docs[int(do[20]) + 1] = docs[int(do[20])]  # an exact tie inside a document
    d8, sd = quantize_per_token(docs)
    hopper_or_skip(queries, qo, d8, do)
    scores = maxsim_varlen_int8(queries, qo, d8, do, doc_scales=sd)
    qo_d, do_d = qo.cuda(), do.cuda()
    ref = maxsim_int8_reference(queries, qo_d, d8, do_d, doc_scales=sd)
    empty = do.diff() == 0
    assert (scores[:, empty.cuda()] == float("-inf")).all()
    tol = score_tolerance(queries, qo_d, d8, do_d, sd)
    assert_scores(scores[:, ~empty.cuda()], ref[:, ~empty.cuda()], tol[:, ~empty.cuda()])
    # offsets on the device: the same kernel (its plan from a host copy read once), the same bits
    assert torch.equal(maxsim_varlen_int8(queries, qo_d, d8, do_d, doc_scales=sd), scores)
    from maxsim_kernels import maxsim_int8

    monkeypatch.setattr(maxsim_int8, "hopper_allpairs", lambda *args: None)
    triton_scores = maxsim_varlen_int8(queries, qo_d, d8, do_d, doc_scales=sd)  # the Triton tiles
    keep = ~empty.cuda()
    assert ((scores - triton_scores)[:, keep].abs() <= 2 * tol[:, keep]).all()


def test_hopper_allpairs_offsets_past_2_31_bytes() -> None:
    """The Gluon kernel on documents whose bytes start beyond 2^31 (TMA coordinates and tile tables in
    tokens, int32)."""
    dim = 128
    d8, sd, do, gen = corpus_past_2_31_bytes(dim, seed=3)
    queries = torch.randn(32 * 32, dim, device="cuda", generator=gen)
    qo = torch.arange(33, dtype=torch.int64) * 32
    hopper_or_skip(queries, qo, d8, do)
    scores = maxsim_varlen_int8(queries, qo, d8, do, doc_scales=sd)
    assert_tail_past_2_31(scores, queries, qo, d8, sd, do)


def assert_tail_past_2_31(scores, queries, qo, d8, sd, do, tail: int = 300) -> int:
    """Scores of the last `tail` documents (all past 2^31 bytes) against the reference on their slice;
    returns the first of them."""
    first_doc = do.numel() - 1 - tail
    start = int(do[first_doc])
    assert start * d8.shape[1] > 2**31
    sub_off = (do[first_doc:] - start).cuda()
    qo_d = qo.cuda()
    ref = maxsim_int8_reference(queries, qo_d, d8[start:], sub_off, doc_scales=sd[start:])
    tol = score_tolerance(queries, qo_d, d8[start:], sub_off, sd[start:])
    assert_scores(scores[:, first_doc:], ref, tol)
    return first_doc


_INT8_HOPPER_SM90_BUILD = r"""
import torch
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
import maxsim_kernels.maxsim_int8_hopper as hopper
from triton.experimental.gluon import language as gl

kernel = hopper._int8_allpairs_kernel
names = kernel.arg_names
docs = torch.zeros(1000, 128, dtype=torch.int8)
scales = torch.zeros(1000, hopper.BLOCK_T, dtype=torch.float32)
d_desc = hopper.TensorDescriptor.from_tensor(
    docs, [hopper.BLOCK_T, 128], gl.NVMMASharedLayout.get_default_for([hopper.BLOCK_T, 128], gl.int8))
s_desc = hopper.TensorDescriptor.from_tensor(
    scales, [1, hopper.BLOCK_T], gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
consts = {"DIM": 128, "BLOCK_T": hopper.BLOCK_T, "STAGES": hopper.STAGES, "GROUP": hopper.GROUP, "QPG": 4,
          "I2F_TILES": hopper.I2F_TILES}
sig = {n: "i32" for n in names}
sig.update({"q_ptr": "*i8", "qs_ptr": "*fp32", "q_off_ptr": "*i32", "tile_tok_ptr": "*i32",
            "tile_ends_ptr": "*i32", "doc_tile_ptr": "*i32", "out_ptr": "*fp32",
            "d_desc": mangle_type(d_desc), "s_desc": mangle_type(s_desc), **{n: "constexpr" for n in consts}})
src = GluonASTSource(kernel, sig, constexprs={(names.index(n),): v for n, v in consts.items()})
compiled = triton.compile(src, target=SM90, options={"num_warps": hopper.NUM_WARPS})
info = ptxas_report(compiled)
print(json.dumps({"ptxas": info, "usage": resource_usage(compiled), "shared": compiled.metadata.shared}))
"""


def test_hopper_int8_kernel_builds_for_two_programs_an_sm(sm90_build) -> None:
    """The tuning assumes two programs an SM (PROGRAMS_PER_SM): no spills, at most 255 registers, at most
    half the shared memory; and asynchronous wgmma (no C7514 serialization)."""
    import re

    import triton
    from maxsim_kernels.launch import GLUON_TRITON

    if not triton.__version__.startswith(GLUON_TRITON):
        pytest.skip(f"the Hopper kernel is built with triton {GLUON_TRITON}x, not {triton.__version__}")
    report = sm90_build(_INT8_HOPPER_SM90_BUILD)
    assert "C7514" not in report["ptxas"] and "serialized" not in report["ptxas"], report["ptxas"]
    assert " 0 bytes spill stores" in report["ptxas"], report["ptxas"]
    registers = int(re.search(r"Used (\d+) registers", report["ptxas"]).group(1))
    assert registers * 128 * 2 <= 65536, registers
    assert report["shared"] <= 227 * 1024 // 2, report["shared"]


_INT8_STREAM_SM90_BUILD = r"""
import torch
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
import maxsim_kernels.maxsim_int8_hopper_stream as st

kernel = st._int8_stream_kernel
names = kernel.arg_names
reports = []
for codec, tuned in (("int8", st.INT8_TILES), ("int4", st.INT4_TILES), ("int2", st.INT2_TILES),
                     ("residual2", st.RESIDUAL2_TILES)):
    packed, residual, quarter = codec in ("int4", "int2"), codec == "residual2", codec == "int2"
    dtype, width = (torch.uint8, 32 if quarter else 64) if packed else (torch.int8, 128)
    if residual:
        d_type, q_type = "*i32", "*fp16"  # the codes as int32 words (cp.async), the fp16 query planes
    else:
        d_desc = st.TensorDescriptor.from_tensor(torch.zeros(1000, width, dtype=dtype), [st.BLOCK_T, width],
                                                 st._doc_layout(width, dtype))
        d_type, q_type = mangle_type(d_desc), "*i8"
    # with a producer warp: one query wherever the tuning takes it (int4's and int2's at N = 16 and 32)
    builds = [(n, identity, producer) for n in tuned.registers for identity in (True, False)
              for producer in (False, True) if not producer or (identity and n in dict(tuned.producer))]
    for n, identity, producer in builds:
        items = tuned.items_one_query if identity else tuned.items_candidates
        cap = tuned.cap(n, identity, producer)
        consts = {"DIM": 128, "N": n, "ITEMS": items, "BLOCK_T": st.BLOCK_T,
                  "STAGES": tuned.stages_at(n, identity), "GROUP": tuned.group, "IDENTITY": identity,
                  "PACKED": packed,
                  "DEFER": st.deferred(packed or residual, items, n), "RESIDUAL": residual,
                  "QUARTER": quarter, "PRODUCER": producer}
        sig = {k: "i32" for k in names}
        consts["TABLE"] = identity and n in tuned.table
        sig.update({"q_ptr": q_type, "qs_ptr": "*fp32", "q_off_ptr": "*i64", "cand_off_ptr": "*i64",
                    "cand_ptr": "*i64", "off_ptr": "*i64", "sd_ptr": "*fp32", "out_ptr": "*fp32",
                    "walk_ptr": "*i64", "walk_first_ptr": "*i32", "d_desc": d_type, "plane_scale": "fp32",
                    **{k: "constexpr" for k in consts}})
        src = GluonASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
        options = {"num_warps": st.NUM_WARPS, **({"maxnreg": cap} if cap else {})}
        compiled = triton.compile(src, target=SM90, options=options)
        reports.append({"codec": codec, "packed": packed, "n": n, "one_query": identity, "cap": cap,
                        "table": consts["TABLE"], "producer": producer,
                        "ptxas": ptxas_report(compiled), "shared": compiled.metadata.shared})
print(json.dumps(reports))
"""


def test_hopper_int8_stream_kernel_builds_for_its_programs_an_sm(sm90_build) -> None:
    """The stream kernel's register caps (the codec's `Tuning.registers`, by the query tile's N) and shared
    memory give the programs an SM the tuning assumes (65,536 registers / (cap x 128 threads)): int8 at
    N <= 32 five for one query and four for candidates, without spills; at N = 64 three, with at most a
    few spilled bytes (12 for candidates in triton 3.6's build, measured faster than without the cap);
    int4 four at N <= 32 and three at 64, a few spilled bytes allowed where the caps were measured
    faster; residual2 four at N <= 32. No serialised wgmma (int4's operands in registers included), but for
    residual2: at its cap of 128 registers ptxas serialises its eight products a tile (C7514), measured
    faster so, with four programs an SM, than unserialised with two (`RESIDUAL2_TILES`); and int4's and
    int2's one query at N = 32, whose cap of 80 registers serialises their products (C7512) and runs six
    programs an SM (int4 five, bound by its shared memory: the fewer of what the registers and the shared
    memory allow), measured faster than four unserialised (`INT4_TILES`, `INT2_TILES`), and int2's one
    query at N = 16, serialised under a cap of 72 registers, seven programs an SM. With a producer warp
    (int4's and int2's one query at N = 16 and 32, where it measured faster) a program holds eight warps'
    registers (cap x 256): four programs an SM, the scan's products not serialised, no spills."""
    import re

    import triton
    from maxsim_kernels.launch import GLUON_TRITON

    if not triton.__version__.startswith(GLUON_TRITON):
        pytest.skip(f"the Hopper kernel is built with triton {GLUON_TRITON}x, not {triton.__version__}")
    for report in sm90_build(_INT8_STREAM_SM90_BUILD):
        capped_n = {"int4": (32,), "int2": (16, 32)}.get(report["codec"], ())
        capped_one_query = report["one_query"] and report["n"] in capped_n and not report["producer"]
        if report["codec"] != "residual2" and not capped_one_query:  # (see the docstring)
            assert "C7514" not in report["ptxas"] and "serialized" not in report["ptxas"], report
        registers = report["cap"] or int(re.search(r"Used (\d+) registers", report["ptxas"]).group(1))
        programs = 65536 // (registers * (256 if report["producer"] else 128))
        if (report["codec"], report["n"], report["one_query"]) == ("int4", 32, True):
            programs = min(programs, 228 * 1024 // (report["shared"] + 1024))
        spilled = int(re.search(r"(\d+) bytes spill stores", report["ptxas"]).group(1))
        allowed = {"int8": 0 if report["n"] <= 32 else 32, "int4": 32, "int2": 32, "residual2": 512}
        allowed = allowed[report["codec"]]
        assert spilled <= (0 if report["producer"] else allowed), report
        assert programs == 4 or not report["producer"], report
        assert programs >= (3 if report["n"] > 32 else 4), report
        assert (report["shared"] + 1024) * programs <= 228 * 1024, report


def stream_or_skip(queries, qo, d8) -> None:
    if not uses_stream(queries, qo, d8):
        pytest.skip("the Gluon int8 stream kernel needs an sm_90 GPU and the Triton release it was built for")


ADVERSARIAL_DOC_LENGTHS = [0, 1, 63, 64, 65, 128, 129, 300, 7, 0, 2, 0]


def adversarial_docs(gen: torch.Generator, n_random: int = 600):
    """Ragged documents for the HBM-bound kernels: empty ones, one token, tiles that end exactly at a
    document's end or one token past or short of it, runs of short documents (several ends a ring), the
    first half negated (negative similarities), and an exact tie inside a document; (fp16 values on the
    GPU, host offsets, int8 codes, scales)."""
    d_lens = ADVERSARIAL_DOC_LENGTHS + torch.randint(0, 301, (n_random,), generator=gen).tolist()
    d_lens += torch.randint(1, 65, (n_random // 2,), generator=gen).tolist()
    docs, do = packed_lengths(d_lens, 128, gen)
    docs[: docs.shape[0] // 2] *= -1
    docs[int(do[20]) + 1] = docs[int(do[20])]
    d8, sd = quantize_per_token(docs)
    return docs, do, d8, sd


@pytest.mark.parametrize("q_len", [1, 13, 16, 17, 32, 33, 64])
def test_hopper_stream_one_query_against_reference(q_len: int) -> None:
    """One query against every document on the Gluon stream kernel (maxsim_int8_hopper_stream; wgmma's N
    16, 32 or 64): every score within the float64 bound, -inf for empty documents; the same bits for every
    ring depth, loop unroll, documents a program and walk (the offsets, or the corpus's walk table): the
    same sums in the same order."""
    from maxsim_kernels import maxsim_int8_hopper_stream as stream

    gen = torch.Generator().manual_seed(q_len)
    docs, do, d8, sd = adversarial_docs(gen)
    queries, qo = packed_lengths([q_len], 128, gen)
    stream_or_skip(queries, qo, d8)
    scores = maxsim_varlen_int8(queries, qo.cuda(), d8, do.cuda(), doc_scales=sd)
    qo_d, do_d = qo.cuda(), do.cuda()
    ref = maxsim_int8_reference(queries, qo_d, d8, do_d, doc_scales=sd)
    empty = (do.diff() == 0).cuda()
    assert (scores[:, empty] == float("-inf")).all()
    tol = score_tolerance(queries, qo_d, d8, do_d, sd)
    assert_scores(scores[:, ~empty], ref[:, ~empty], tol[:, ~empty])
    q8, sq = quantize_per_token(queries)
    for cfg in (dict(items_per_prog=1), dict(items_per_prog=64, stages=3, group=2),
                dict(items_per_prog=8, stages=8, group=8), dict(table=True), dict(table=False),
                dict(items_per_prog=8, table=True), dict(items_per_prog=1, stages=3,
                                                          table=True)):  # fmt: skip
        again = stream.stream_with_tiles(q8, sq, qo_d, None, None, d8, sd, do_d, q_len, **cfg)
        assert torch.equal(again, scores[0]), cfg


def test_hopper_stream_candidates_against_reference() -> None:
    """Each query against its own candidates on the Gluon stream kernel: ragged query lengths (1..64),
    ragged candidate counts (none, one, lists that start inside another query's run of items), repeated
    and empty candidate documents; within the float64 bound, the same bits for every configuration."""
    from maxsim_kernels import maxsim_int8_hopper_stream as stream

    gen = torch.Generator().manual_seed(5)
    docs, do, d8, sd = adversarial_docs(gen)
    nd = do.numel() - 1
    q_lens = [1, 64, 32, 17, 5, 33, 32, 2] + torch.randint(1, 65, (12,), generator=gen).tolist()
    queries, qo = packed_lengths(q_lens, 128, gen)
    nq = len(q_lens)
    counts = torch.randint(0, 90, (nq,), generator=gen)
    counts[:4] = torch.tensor([0, 1, 16, 0])
    cand_off = torch.zeros(nq + 1, dtype=torch.int64)
    cand_off[1:] = counts.cumsum(0)
    cand_docs = torch.randint(0, nd, (int(cand_off[-1]),), generator=gen)
    cand_docs[:3] = torch.tensor([0, 0, 1])  # an empty document, twice, and a one-token one
    cand_docs = cand_docs.cuda()
    stream_or_skip(queries, qo, d8)
    scores = maxsim_candidates_int8(queries, qo, d8, do, cand_off.cuda(), cand_docs, doc_scales=sd)
    qo_d, do_d = qo.cuda(), do.cuda()
    ref = maxsim_int8_reference(queries, qo_d, d8, do_d, doc_scales=sd)
    owner = torch.repeat_interleave(torch.arange(nq), counts).cuda()
    want = ref[owner, cand_docs]
    empty = (do.diff() == 0).cuda()[cand_docs]
    assert (scores[empty] == float("-inf")).all()
    tol = score_tolerance(queries, qo_d, d8, do_d, sd)[owner, cand_docs]
    assert_scores(scores[~empty], want[~empty], tol[~empty])
    q8, sq = quantize_per_token(queries)
    for cfg in (dict(items_per_prog=1), dict(items_per_prog=4, stages=3, group=2),
                dict(items_per_prog=64, stages=8, group=8)):  # fmt: skip
        again = stream.stream_with_tiles(q8, sq, qo_d, cand_off.cuda(), cand_docs, d8, sd, do_d, 64, **cfg)
        assert torch.equal(again, scores), cfg


def test_hopper_stream_offsets_past_2_31_bytes() -> None:
    """The stream kernel on documents whose bytes start beyond 2^31 (one query, and candidates there)."""
    dim = 128
    d8, sd, do, gen = corpus_past_2_31_bytes(dim, seed=4)
    queries = torch.randn(32, dim, device="cuda", generator=gen)
    qo = torch.tensor([0, 32])
    stream_or_skip(queries, qo, d8)
    do_d = do.cuda()
    scores = maxsim_varlen_int8(queries, qo, d8, do_d, doc_scales=sd)
    first_doc = assert_tail_past_2_31(scores, queries, qo, d8, sd, do)
    cand = torch.arange(first_doc, do.numel() - 1, device="cuda").flip(0)
    cand_off = torch.tensor([0, cand.numel()], device="cuda")
    picked = maxsim_candidates_int8(queries, qo, d8, do_d, cand_off, cand, doc_scales=sd)
    assert torch.equal(picked, scores[0, cand])


def int4_stream_or_skip(queries, qo, codes) -> None:
    from maxsim_kernels import maxsim_int8

    q8 = quantize_per_token(queries)[0]
    if maxsim_int8.hopper_stream(qo, q8, codes, False) is None:
        pytest.skip("the Gluon stream kernel needs an sm_90 GPU and the Triton release it was built for")


@pytest.mark.parametrize("q_len", [1, 17, 32, 64])
def test_hopper_stream_int4_is_the_int8_stream_on_the_decoded_values(q_len: int) -> None:
    """int4 codes on the stream kernel (PACKED: the nibbles unpacked in wgmma's register operand) score what
    the int8 stream kernel scores on the decoded values c (int8 -7..7) with the same scales: the same
    exact integer products and maxima, the query sums in another order (the int4 items' ends are
    deferred), so within the bound of each other. One query against every document
    and ragged queries against their candidates, adversarial documents (empty, one token, tiles that end
    at or next to a document's end, negative similarities, a tie); within the float64 bound of the
    decoded values; the same bits for every ring depth, loop unroll, items a program and walk (offsets or
    walk table)."""
    from maxsim_kernels import maxsim_int8_hopper_stream as stream
    from maxsim_kernels.code_packing import decode_int4, encode_int4
    from maxsim_kernels.codes_host import maxsim_candidates_codes, maxsim_varlen_codes

    gen = torch.Generator().manual_seed(40 + q_len)
    docs, do, _, _ = adversarial_docs(gen)
    codes, scales = encode_int4(docs)  # on the GPU, as `docs`
    values = decode_int4(codes)
    queries, qo = packed_lengths([q_len], 128, gen)
    int4_stream_or_skip(queries, qo, codes)
    qo_d, do_d = qo.cuda(), do.cuda()
    scores = maxsim_varlen_codes(queries, qo, codes, do_d, doc_scales=scales)
    empty = (do.diff() == 0).cuda()
    assert (scores[:, empty] == float("-inf")).all()
    ref = maxsim_int8_reference(queries, qo_d, values, do_d, doc_scales=scales)
    tol = score_tolerance(queries, qo_d, values, do_d, scales)
    assert_scores(scores[:, ~empty], ref[:, ~empty], tol[:, ~empty])
    int8 = maxsim_varlen_int8(queries, qo, values, do_d, doc_scales=scales)
    assert_scores(scores[:, ~empty], int8[:, ~empty].double(), tol[:, ~empty])
    q8, sq = quantize_per_token(queries)
    for cfg in (dict(items_per_prog=1), dict(items_per_prog=64, stages=3, group=2),
                dict(items_per_prog=8, stages=4, group=4), dict(maxnreg=0), dict(table=True),
                dict(table=False), dict(items_per_prog=8, table=True), *PRODUCER_CONFIGS):  # fmt: skip
        again = stream.stream_with_tiles(q8, sq, qo_d, None, None, codes, scales, do_d, q_len, **cfg)
        assert torch.equal(again, scores[0]), cfg

    # ragged queries (1..64 tokens, host offsets) against their candidates: repeats, empty documents, a
    # query with none, lists that start inside another query's run of items
    counts = [0, 1, 37, 5, 120, 16]
    queries, qo = packed_lengths([1, 64, q_len, 33, 7, 16], 128, gen)
    cand_off = torch.zeros(len(counts) + 1, dtype=torch.int64)
    cand_off[1:] = torch.tensor(counts).cumsum(0)
    cand_docs = torch.randint(0, do.numel() - 1, (int(cand_off[-1]),), generator=gen)
    cand_docs[:12] = torch.arange(12)  # the adversarial documents first
    cand_docs = cand_docs.cuda()
    picked = maxsim_candidates_codes(queries, qo, codes, do_d, cand_off, cand_docs, doc_scales=scales)
    want = maxsim_candidates_int8(queries, qo, values, do_d, cand_off, cand_docs, doc_scales=scales)
    owner = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).cuda()
    tol = score_tolerance(queries, qo.cuda(), values, do_d, scales)[owner, cand_docs]
    full = ~empty[cand_docs]
    assert (picked[~full] == float("-inf")).all() and (want[~full] == float("-inf")).all()
    assert_scores(picked[full], want[full].double(), tol[full])
    q8, sq = quantize_per_token(queries)
    for cfg in (dict(items_per_prog=1), dict(items_per_prog=64, stages=8, group=8)):
        again = stream.stream_with_tiles(
            q8, sq, qo.cuda(), cand_off.cuda(), cand_docs, codes, scales, do_d, 64, **cfg
        )
        assert torch.equal(again, picked), cfg


def int4_tail_past_2_31(codes: torch.Tensor, do: torch.Tensor, tail: int = 300):
    """The last ``tail`` documents of int4 ``codes`` (all past 2^31 bytes): (first of them, its first token,
    their decoded values, their host offsets from 0)."""
    from maxsim_kernels.code_packing import decode_int4

    first_doc = do.numel() - 1 - tail
    start = int(do[first_doc])
    assert start * 64 > 2**31
    return first_doc, start, decode_int4(codes[start:]), do[first_doc:] - start


def test_hopper_stream_int4_offsets_past_2_31_bytes() -> None:
    """int4 codes whose bytes start beyond 2^31 (33.6 M tokens of 64 bytes): one query, and candidates."""
    from maxsim_kernels.codes_host import maxsim_candidates_codes, maxsim_varlen_codes

    n_tokens = (1 << 31) // 64 + 100_000
    d8, sd, do, gen = corpus_past_2_31_bytes(64, seed=6, n_tokens=n_tokens)
    codes = d8.view(torch.uint8)  # any byte is a pair of nibbles
    del d8
    queries = torch.randn(32, 128, device="cuda", generator=gen)
    qo = torch.tensor([0, 32])
    int4_stream_or_skip(queries, qo, codes)
    do_d = do.cuda()
    scores = maxsim_varlen_codes(queries, qo, codes, do_d, doc_scales=sd)
    first_doc, start, values, sub_off = int4_tail_past_2_31(codes, do)
    sub_off = sub_off.cuda()
    ref = maxsim_int8_reference(queries, qo.cuda(), values, sub_off, doc_scales=sd[start:])
    tol = score_tolerance(queries, qo.cuda(), values, sub_off, sd[start:])
    assert_scores(scores[:, first_doc:], ref, tol)
    cand = torch.arange(first_doc, do.numel() - 1, device="cuda").flip(0)
    cand_off = torch.tensor([0, cand.numel()])
    picked = maxsim_candidates_codes(queries, qo, codes, do_d, cand_off, cand, doc_scales=sd)
    assert torch.equal(picked, scores[0, cand])


def int4_allpairs_or_skip(queries, qo, do) -> None:
    from maxsim_kernels import maxsim_int8

    rows = torch.empty((64, 128), dtype=torch.int8, device="cuda")
    if maxsim_int8.hopper_allpairs(qo, do, quantize_per_token(queries)[0], rows, False) is None:
        pytest.skip("the Gluon int8 kernel needs an sm_90 GPU and the Triton release it was built with")


def test_int4_all_pairs_are_the_int8_kernel_on_the_decoded_values(monkeypatch) -> None:
    """int4 all pairs of many queries on sm_90: the documents decoded chunk by chunk (whole documents, a
    chunk smaller than the corpus here: ~25 chunks, a run of 40 empty documents among them) and scored by the
    Gluon all-pairs kernel of int8: bit for bit `maxsim_varlen_int8` on the decoded values with the
    same scales, within the float64 bound of them, -inf for empty documents."""
    from maxsim_kernels import codes_host
    from maxsim_kernels.code_packing import decode_int4, encode_int4
    from maxsim_kernels.codes_host import maxsim_varlen_codes

    gen = torch.Generator().manual_seed(23)
    docs, do, _, _ = adversarial_docs(gen)
    lengths = do.diff().tolist()
    lengths[300:300] = [0] * 40  # a run of empty documents past a chunk's end
    do = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    do[1:] = torch.tensor(lengths).cumsum(0)
    codes, scales = encode_int4(docs)
    values = decode_int4(codes)
    q_lens = torch.randint(1, 33, (96,), generator=gen).tolist()
    queries, qo = packed_lengths(q_lens, 128, gen)
    int4_allpairs_or_skip(queries, qo, do)
    monkeypatch.setattr(codes_host, "DECODE_CHUNK_BYTES", 128 * 4000)
    qo_d, do_d = qo.cuda(), do.cuda()
    scores = maxsim_varlen_codes(queries, qo, codes, do, doc_scales=scales)
    want = maxsim_varlen_int8(queries, qo, values, do, doc_scales=scales)
    assert torch.equal(scores, want)
    empty = (do.diff() == 0).cuda()
    assert (scores[:, empty] == float("-inf")).all()
    ref = maxsim_int8_reference(queries, qo_d, values, do_d, doc_scales=scales)
    tol = score_tolerance(queries, qo_d, values, do_d, scales)
    assert_scores(scores[:, ~empty], ref[:, ~empty], tol[:, ~empty])
    # offsets on the device: the same bits; one chunk: the same bits
    assert torch.equal(maxsim_varlen_codes(queries, qo_d, codes, do_d, doc_scales=scales), scores)
    monkeypatch.setattr(codes_host, "DECODE_CHUNK_BYTES", 1 << 30)
    assert torch.equal(maxsim_varlen_codes(queries, qo, codes, do, doc_scales=scales), scores)


def test_int4_all_pairs_past_2_31_bytes(monkeypatch) -> None:
    """int4 all pairs whose codes start beyond 2^31 bytes (33.6 M tokens of 64 bytes), decoded in chunks."""
    from maxsim_kernels import codes_host
    from maxsim_kernels.codes_host import maxsim_varlen_codes

    n_tokens = (1 << 31) // 64 + 100_000
    d8, sd, do, gen = corpus_past_2_31_bytes(64, seed=8, n_tokens=n_tokens)
    codes = d8.view(torch.uint8)
    del d8
    queries = torch.randn(16 * 32, 128, device="cuda", generator=gen)
    qo = torch.arange(17, dtype=torch.int64) * 32
    int4_allpairs_or_skip(queries, qo, do)
    monkeypatch.setattr(codes_host, "DECODE_CHUNK_BYTES", 1 << 30)  # 8M tokens a chunk: five chunks
    scores = maxsim_varlen_codes(queries, qo, codes, do, doc_scales=sd)
    first_doc, start, values, sub_off = int4_tail_past_2_31(codes, do)
    want = maxsim_varlen_int8(queries, qo, values, sub_off, doc_scales=sd[start:].contiguous())
    assert torch.equal(scores[:, first_doc:], want)
    ref = maxsim_int8_reference(queries, qo.cuda(), values, sub_off.cuda(), doc_scales=sd[start:])
    tol = score_tolerance(queries, qo.cuda(), values, sub_off.cuda(), sd[start:])
    assert_scores(scores[:, first_doc:], ref, tol)


def device_candidate_batches(n_docs: int, nq: int, seeds, max_count: int = 60):
    """Per batch: new candidate offsets on the host and new candidate indices on the GPU."""
    batches = []
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        counts = torch.randint(0, max_count, (nq,), generator=gen)
        cand_off = torch.zeros(nq + 1, dtype=torch.int64)
        cand_off[1:] = counts.cumsum(0)
        batches.append((cand_off, torch.randint(0, n_docs, (int(cand_off[-1]),), generator=gen).cuda()))
    return batches


def with_bad_indices(valid: torch.Tensor, n_docs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`valid` with about one entry in ten (and the first and last) replaced by an index outside
    [0, n_docs), including ones whose low 32 bits are a valid index: (candidates, mask of the bad ones)."""
    gen = torch.Generator().manual_seed(seed)
    bad = (torch.rand(valid.shape, generator=gen) < 0.1).cuda()
    bad[0] = bad[-1] = True
    picks = torch.tensor([-1, n_docs, 2**32 + 5, -(2**62), 2**62], device="cuda")
    spread = picks[torch.arange(valid.numel(), device="cuda") % picks.numel()]
    return torch.where(bad, spread, valid), bad


@pytest.mark.parametrize("path", ["stream", "triton"])
def test_new_device_candidates_cost_no_synchronisation(monkeypatch, path: str) -> None:
    """A new candidates tensor on the GPU each call (as a service passes them), host offsets: no call
    waits for the device, on the Gluon stream kernel (sm_90) and on the Triton kernel."""
    from maxsim_kernels import maxsim_int8

    gen = torch.Generator().manual_seed(2)
    queries, qo = packed_lengths(torch.randint(1, 33, (16,), generator=gen).tolist(), 128, gen)
    docs, do = packed_lengths(torch.randint(1, 200, (500,), generator=gen).tolist(), 128, gen)
    d8, sd = quantize_per_token(docs)
    if path == "stream":
        stream_or_skip(queries, qo, d8)
    else:
        monkeypatch.setattr(maxsim_int8, "hopper_stream", lambda *args: None)
    first, *batches = device_candidate_batches(500, 16, range(5))
    maxsim_candidates_int8(queries, qo, d8, do, *first, doc_scales=sd)  # compiles; reads the offsets once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        scores = [maxsim_candidates_int8(queries, qo, d8, do, *batch, doc_scales=sd) for batch in batches]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    qo_d, do_d = qo.cuda(), do.cuda()
    ref = maxsim_int8_reference(queries, qo_d, d8, do_d, doc_scales=sd)
    tol = score_tolerance(queries, qo_d, d8, do_d, sd)
    for (cand_off, cand_docs), got in zip(batches, scores, strict=True):
        owner = torch.repeat_interleave(torch.arange(16), cand_off.diff()).cuda()
        assert_scores(got, ref[owner, cand_docs], tol[owner, cand_docs])


def test_bad_device_candidate_indices_score_nan_on_the_triton_kernel(monkeypatch) -> None:
    """Indices outside [0, nd) on the GPU are never read through: NaN (argmax -1), and every other
    candidate's score and argmax bit for bit those of the same call without the bad ones."""
    from maxsim_kernels import maxsim_int8

    monkeypatch.setattr(maxsim_int8, "hopper_stream", lambda *args: None)
    gen = torch.Generator().manual_seed(9)
    queries, qo = packed_lengths([5, 64, 32, 17, 100, 3, 32, 32], 128, gen)  # 100: the per-candidate branch
    docs, do, d8, sd = adversarial_docs(gen)
    nd = do.numel() - 1
    cand_off, valid = device_candidate_batches(nd, 8, [3], max_count=90)[0]
    cand, bad = with_bad_indices(valid, nd, 3)
    for return_argmax in (False, True):
        args = dict(doc_scales=sd, return_argmax=return_argmax)
        got = maxsim_candidates_int8(queries, qo, d8, do, cand_off, cand, **args)
        want = maxsim_candidates_int8(queries, qo, d8, do, cand_off, valid, **args)
        if return_argmax:
            (got, got_arg), (want, want_arg) = got, want
            assert (got_arg[bad] == -1).all()
            assert torch.equal(got_arg[~bad], want_arg[~bad])
        assert torch.equal(torch.isnan(got), bad)
        assert torch.equal(got[~bad], want[~bad])


def test_bad_device_candidate_indices_score_nan_on_the_stream_kernel() -> None:
    """The Gluon stream kernel: bad indices (first and last of a program's run, inside one, runs that
    start inside another query's) score NaN and are never read through; the others keep their bits, for
    every run length (the bad-index mask is an int32 up to 32 items a run, an int64 past that)."""
    from maxsim_kernels import maxsim_int8_hopper_stream as stream

    gen = torch.Generator().manual_seed(10)
    docs, do, d8, sd = adversarial_docs(gen)
    nd = do.numel() - 1
    q_lens = [1, 64, 32, 17, 5, 33, 32, 2]
    queries, qo = packed_lengths(q_lens, 128, gen)
    stream_or_skip(queries, qo, d8)
    cand_off, valid = device_candidate_batches(nd, len(q_lens), [4], max_count=90)[0]
    cand, bad = with_bad_indices(valid, nd, 4)
    got = maxsim_candidates_int8(queries, qo, d8, do, cand_off, cand, doc_scales=sd)
    want = maxsim_candidates_int8(queries, qo, d8, do, cand_off, valid, doc_scales=sd)
    assert torch.equal(torch.isnan(got), bad)
    assert torch.equal(got[~bad], want[~bad])
    q8, sq = quantize_per_token(queries)
    qo_d, do_d, cand_off_d = qo.cuda(), do.cuda(), cand_off.cuda()
    for cfg in (dict(items_per_prog=1), dict(items_per_prog=4, stages=3, group=2), dict(items_per_prog=32),
                dict(items_per_prog=64, stages=8, group=8)):  # fmt: skip
        again = stream.stream_with_tiles(q8, sq, qo_d, cand_off_d, cand, d8, sd, do_d, 64, **cfg)
        assert torch.equal(torch.isnan(again), bad), cfg
        assert torch.equal(again[~bad], got[~bad]), cfg
    with pytest.raises(ValueError, match="at most 64 candidates a program"):
        stream.stream_with_tiles(q8, sq, qo_d, cand_off_d, cand, d8, sd, do_d, 64, items_per_prog=128)
