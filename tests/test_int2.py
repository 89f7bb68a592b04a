"""The int2 codec of `maxsim_kernels.code_packing`: 2 bits a dimension on a per-dimension grid, a scale a
token. Its encoding against its definition, its scores against the float64 reference of the decoded values
on adversarial data (CPU), and on an sm_90 GPU the Gluon stream kernel that unpacks it in registers."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from maxsim_kernels import maxsim_candidates, maxsim_varlen
from maxsim_kernels.code_packing import Int2Levels, decode_int2, encode_int2, int2_values
from maxsim_kernels.codes_host import int2_queries
from maxsim_kernels.reference import maxsim_codes_reference
from tierlib import PRODUCER_CONFIGS, check_close, one_line_open_error, rewrite_metadata
from typer.testing import CliRunner

from maxsim_cli import codecs
from maxsim_cli.cli import app
from maxsim_cli.shards import open_corpus

# one-token documents, an empty one, documents that straddle the 64-token tiles, a long one
DOC_LENGTHS = [1, 0, 63, 64, 65, 1, 2, 127, 128, 129, 300, 0, 5]


def _levels(dim: int, gen: torch.Generator) -> Int2Levels:
    return Int2Levels(0.1 * torch.randn(dim, generator=gen), 0.1 + 0.4 * torch.rand(dim, generator=gen))


def _corpus(lengths: list[int], dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    docs = torch.randn(sum(lengths), dim, generator=gen)
    docs[: docs.shape[0] // 2] *= -1
    return docs, torch.tensor([0, *lengths]).cumsum(0)


def _bound(
    queries: torch.Tensor, q_off: torch.Tensor, levels: Int2Levels, scales: torch.Tensor
) -> torch.Tensor:
    """Per query, what fp32 rounding can move a score by: a few ulps of the sum of each row's largest
    term (its integer product times the scales, and its offset)."""
    side = int2_queries(queries, levels)
    biggest = side.scales.double() * 3 * side.q8.double().abs().sum(dim=1) * scales.double().abs().max()
    per_row = biggest + side.row_offsets.double().abs()
    sums = torch.zeros(q_off.numel() - 1, dtype=torch.float64).index_add_(
        0, torch.repeat_interleave(torch.arange(q_off.numel() - 1), q_off.diff()), per_row
    )
    return (sums * 2.0**-20)[:, None]




@pytest.mark.parametrize("dim", [4, 20, 96, 128])
def test_int2_codes_decode_to_the_nearest_point_of_the_grid_on_the_tokens_line(dim: int) -> None:
    """Each code is the nearest odd value (-3, -1, 1, 3) to the centred, stepped value (clamped beyond
    the grid); the scale is the least-squares one (the error orthogonal to the decoded direction); the
    bytes hold dimension 4m + p in bits 2p, 2p + 1 of byte m. Constant and all-zero tokens included."""
    gen = torch.Generator().manual_seed(dim)
    levels = _levels(dim, gen)
    x = torch.randn(50, dim, generator=gen)
    x[3] = 0.0
    x[4] = 1.5
    x[5] = levels.offsets  # decodes to itself: every value at a grid's centre
    codes, scales = encode_int2(x, levels)
    assert codes.shape == (50, dim // 4) and codes.dtype == torch.uint8 and scales.dtype == torch.float32
    c = int2_values(codes)
    assert set(c.unique().tolist()) <= {-3, -1, 1, 3}
    y = (x - levels.offsets) / levels.steps
    distance = (y - c.float()).abs()
    assert bool(((distance <= 1.0 + 1e-5) | (y.abs() > 3.0)).all())
    assert bool((scales >= 0).all())  # each c_k has its value's sign: what readers of a shard require
    spread = levels.steps.double() * c.double()
    err = (x.double() - levels.offsets.double()) - scales.double()[:, None] * spread
    assert float((err * spread).sum(dim=1).abs().max()) < 1e-5
    decoded = decode_int2(codes, scales, levels)
    assert torch.allclose(decoded[5], levels.offsets, atol=1e-6)
    v = ((c.long() + 3) // 2).view(50, dim // 4, 4)
    packed = v[:, :, 0] | (v[:, :, 1] << 2) | (v[:, :, 2] << 4) | (v[:, :, 3] << 6)
    assert torch.equal(packed.to(torch.uint8), codes)


def test_int2_refuses_dims_it_cannot_pack_and_levels_that_do_not_fit() -> None:
    gen = torch.Generator().manual_seed(1)
    with pytest.raises(ValueError, match="multiple of 4"):
        encode_int2(torch.randn(3, 10, generator=gen), _levels(10, gen))
    levels = _levels(16, gen)
    codes, scales = encode_int2(torch.randn(5, 16, generator=gen), levels)
    q, q_off, d_off = torch.randn(2, 16, generator=gen), torch.tensor([0, 2]), torch.tensor([0, 5])
    with pytest.raises(ValueError, match="doc_scales"):
        maxsim_varlen(q, q_off, codes, d_off, codebook=levels)
    with pytest.raises(ValueError, match="do not fit dim 16"):
        maxsim_varlen(q, q_off, codes, d_off, doc_scales=scales, codebook=_levels(12, gen))
    with pytest.raises(ValueError, match="4 bytes a token"):
        maxsim_varlen(q, q_off, codes[:, :3], d_off, doc_scales=scales, codebook=levels)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("dim", [20, 128])
def test_int2_query_side_in_one_launch_matches_the_torch_ops(dim: int, dtype: torch.dtype) -> None:
    """The Triton query side (`int2_queries` with query offsets: one program a query, 17 rows straddling
    its 16-row blocks) gives the int8 codes and scales of the torch ops bit for bit (the same correctly
    rounded products, divisions and ties to even), with an all-zero row (scale 1) and a row of one value;
    each row's offset and each query's sum are float64 sums in another order, rounded to fp32: within an
    ulp of them."""
    gen = torch.Generator().manual_seed(dim)
    levels = _levels(dim, gen)
    queries, q_off = _corpus([1, 32, 17, 5], dim, gen)
    queries[3] = 0
    queries[4] = 0
    queries[4, dim - 1] = -2.5
    queries = queries.to(dtype)
    torch_side = int2_queries(queries, levels, query_offsets=q_off)
    side = int2_queries(queries, levels, backend="triton", query_offsets=q_off)
    assert torch.equal(side.q8, torch_side.q8) and torch.equal(side.scales, torch_side.scales)
    assert float(side.scales[3]) == 1.0
    ulp = torch.finfo(torch.float32).eps
    rows = torch_side.row_offsets
    assert torch.allclose(side.row_offsets, rows, rtol=ulp, atol=ulp * float(rows.abs().max()))
    sums = torch_side.query_sums
    assert torch.allclose(side.query_sums, sums, rtol=ulp, atol=ulp * float(sums.abs().max()))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dim", [20, 96, 128])
def test_int2_scores_within_rounding_of_the_float64_reference(dim: int, backend: str) -> None:
    """All pairs and candidates (CPU): within fp32 rounding of the float64 scores of the decoded values
    against the int8 query the kernels score (`maxsim_codes_reference`), -inf for empty documents; the
    same scores through int8 queries with their scales; close to the float query's scores of the decoded
    values (the int8 query's rounding: at most a few thousandths of a score's scale). Both backends (the
    Triton one decodes with `int2_to_int8` and scores with the int8 kernels)."""
    gen = torch.Generator().manual_seed(10 + dim)
    levels = _levels(dim, gen)
    docs, d_off = _corpus(DOC_LENGTHS, dim, gen)
    docs[int(d_off[6]) + 1] = docs[int(d_off[6])]  # an exact tie
    codes, scales = encode_int2(docs, levels)
    queries, q_off = _corpus([1, 32, 7], dim, gen)
    scores = maxsim_varlen(queries, q_off, codes, d_off, doc_scales=scales, codebook=levels, backend=backend)
    reference = maxsim_codes_reference(queries, q_off, codes, d_off, doc_scales=scales, codebook=levels)
    check_close(scores, reference, _bound(queries, q_off, levels, scales))

    decoded = decode_int2(codes, scales, levels).double()
    for i in range(3):
        q = queries[int(q_off[i]) : int(q_off[i + 1])].double()
        for d in range(len(DOC_LENGTHS)):
            if DOC_LENGTHS[d]:
                exact = float((q @ decoded[int(d_off[d]) : int(d_off[d + 1])].T).max(dim=1).values.sum())
                assert abs(float(scores[i, d]) - exact) <= 0.01 * float(q.abs().sum()), (i, d)

    cand_off = torch.tensor([0, 4, 4, 9])
    cand = torch.tensor([1, 12, 10, 0, 3, 3, 8, 2, 4])
    picked = maxsim_candidates(
        queries, q_off, codes, d_off, cand_off, cand, doc_scales=scales, codebook=levels, backend=backend
    )
    owner = torch.tensor([0, 0, 0, 0, 2, 2, 2, 2, 2])
    check_close(picked, reference[owner, cand], _bound(queries, q_off, levels, scales)[owner, 0])
    with pytest.raises(ValueError, match=r"candidate_docs\[1\] = 13"):
        maxsim_candidates(queries, q_off, codes, d_off, torch.tensor([0, 2, 2, 2]), torch.tensor([0, 13]),
                          doc_scales=scales, codebook=levels, backend=backend)  # fmt: skip


# ------------------------------------------------------------------------------------------------------
# GPU: the Gluon stream kernel (sm_90)
# ------------------------------------------------------------------------------------------------------


def _stream_or_skip(queries: torch.Tensor, codes: torch.Tensor) -> None:
    from maxsim_kernels.maxsim_int8 import hopper_stream

    side = torch.zeros(queries.shape[0], 128, dtype=torch.int8, device=codes.device)
    if hopper_stream(torch.tensor([0, queries.shape[0]]), side, codes, False, int2=True) is None:
        pytest.skip("the Gluon stream kernel needs an sm_90 GPU and the Triton release it was built with")


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 13, 32])
def test_int2_stream_kernel_within_rounding_of_the_reference(q_len: int) -> None:
    """One query, then ragged queries against their candidates, on the stream kernel: within fp32 rounding
    of the float64 reference, -inf for empty documents, NaN for a bad candidate index; the same bits as
    the decoded int8 path's maxima allow (the reference), and for every ring depth, loop unroll, items a
    program, walk of one query (offsets or walk table) and ring filled by a producer warp or not."""
    from maxsim_kernels import maxsim_int8_hopper_stream as stream

    gen = torch.Generator().manual_seed(20 + q_len)
    levels = _levels(128, gen)
    lengths = DOC_LENGTHS + torch.randint(0, 301, (400,), generator=gen).tolist()
    docs, d_off = _corpus(lengths, 128, gen)
    codes, scales = encode_int2(docs, levels)
    queries, q_off = _corpus([q_len], 128, gen)
    codes_d, scales_d, d_off_d, levels_d = codes.cuda(), scales.cuda(), d_off.cuda(), levels.to("cuda")
    _stream_or_skip(queries, codes_d)
    got = maxsim_varlen(queries.cuda(), q_off, codes_d, d_off_d, doc_scales=scales_d, codebook=levels_d).cpu()
    reference = maxsim_codes_reference(queries, q_off, codes, d_off, doc_scales=scales, codebook=levels)
    check_close(got, reference, _bound(queries, q_off, levels, scales))
    side = int2_queries(queries.cuda(), levels_d)
    first = stream.stream_with_tiles(side.q8, side.scales, q_off.cuda(), None, None, codes_d, scales_d,
                                     d_off_d, q_len, int2=True).cpu()  # fmt: skip
    for cfg in (dict(items_per_prog=1), dict(items_per_prog=64, stages=3, group=2),
                dict(items_per_prog=8, stages=8, group=8), dict(maxnreg=168), dict(table=True),
                dict(table=False), dict(items_per_prog=8, table=True), *PRODUCER_CONFIGS):  # fmt: skip
        again = stream.stream_with_tiles(side.q8, side.scales, q_off.cuda(), None, None, codes_d, scales_d,
                                         d_off_d, q_len, int2=True, **cfg).cpu()  # fmt: skip
        assert torch.equal(again, first), cfg

    # several queries, all pairs: the documents decoded to int8 for the int8 kernels (the Gluon all-pairs
    # kernel on sm_90)
    queries, q_off = _corpus([q_len, 32, 5], 128, gen)
    got = maxsim_varlen(queries.cuda(), q_off, codes_d, d_off_d, doc_scales=scales_d, codebook=levels_d).cpu()
    reference = maxsim_codes_reference(queries, q_off, codes, d_off, doc_scales=scales, codebook=levels)
    check_close(got, reference, _bound(queries, q_off, levels, scales))

    counts = [0, 1, 37, 5, 120, 16]
    queries, q_off = _corpus([1, 32, q_len, 31, 7, 16], 128, gen)
    cand_off = torch.tensor([0, *counts]).cumsum(0)
    nd = d_off.numel() - 1
    cand = torch.randint(0, nd, (int(cand_off[-1]),), generator=gen)
    cand[:13] = torch.arange(13)  # the adversarial documents first
    cand[40] = nd
    picked = maxsim_candidates(queries.cuda(), q_off, codes_d, d_off_d, cand_off, cand.cuda(),
                               doc_scales=scales_d, codebook=levels_d).cpu()  # fmt: skip
    reference = maxsim_codes_reference(queries, q_off, codes, d_off, doc_scales=scales, codebook=levels)
    owner = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    nan = cand == nd
    assert torch.equal(torch.isnan(picked), nan)
    ok = ~nan
    bound = _bound(queries, q_off, levels, scales)
    check_close(picked[ok], reference[owner[ok], cand[ok]], bound[owner[ok], 0])


@pytest.mark.gpu
def test_int2_stream_kernel_offsets_past_2_31_bytes() -> None:
    """int2 codes whose bytes start beyond 2^31 (67.2M tokens of 32 bytes): the stream kernel scores the
    last documents as it scores them alone (the same bits), for one query and for candidates."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    n_tokens = (1 << 31) // 32 + 100_000
    codes = torch.randint(0, 256, (n_tokens, 32), dtype=torch.uint8, device="cuda", generator=gen)
    scales = torch.rand(n_tokens, device="cuda", generator=gen) - 0.25
    lengths = torch.randint(20, 301, (n_tokens // 20,), device="cuda", generator=gen)
    ends = lengths.cumsum(0)
    ends = ends[ends <= n_tokens]
    d_off = torch.cat([torch.zeros(1, dtype=torch.int64, device="cuda"), ends])
    levels = _levels(128, torch.Generator().manual_seed(8)).to("cuda")
    queries = torch.randn(32, 128, device="cuda", generator=gen)
    q_off = torch.tensor([0, 32])
    _stream_or_skip(queries, codes)
    scores = maxsim_varlen(queries, q_off, codes, d_off, doc_scales=scales, codebook=levels)
    first = d_off.numel() - 1 - 300
    start = int(d_off[first])
    assert start * 32 > 2**31
    alone = maxsim_varlen(queries, q_off, codes[start:], d_off[first:] - start, doc_scales=scales[start:],
                          codebook=levels)  # fmt: skip
    assert torch.equal(scores[:, first:], alone)
    cand = torch.arange(first, d_off.numel() - 1, device="cuda").flip(0)
    picked = maxsim_candidates(queries, q_off, codes, d_off, torch.tensor([0, cand.numel()]), cand,
                               doc_scales=scales, codebook=levels)  # fmt: skip
    assert torch.equal(picked, scores[0, cand])


def test_the_fitted_grid_is_lloyds_for_gaussian_values_and_keeps_constant_dimensions(monkeypatch) -> None:
    """`fit_int2_levels` on Gaussian columns of several means and spreads: the offsets at the means, the
    steps at the optimal evenly spaced 4-level quantizer's (half of 0.9957 sigma) and its squared error
    (at most 0.1188 sigma^2 summed over the columns: the per-token scale lowers the sum); a constant
    column gets step 0 and decodes exactly, and its query weight is 0."""
    from maxsim_cli.codecs import fit_int2_levels

    gen = torch.Generator().manual_seed(3)
    means = torch.tensor([0.0, 1.0, -2.0, 0.5, 3.0, 0.0, -0.1, 0.2])
    sigmas = torch.tensor([1.0, 0.1, 2.0, 0.5, 0.0, 1.0, 0.3, 0.05])
    x = means + sigmas * torch.randn(200_000, 8, generator=gen)
    offsets, steps = fit_int2_levels(x)
    varies = sigmas > 0
    assert torch.allclose(offsets, means, atol=0.01 * float(sigmas.max()))
    assert torch.allclose(steps[varies], 0.4979 * sigmas[varies], rtol=0.01)
    assert float(steps[4]) == 0.0 and float(offsets[4]) == 3.0
    levels = Int2Levels(offsets, steps)
    codes, scales = encode_int2(x[:20_000], levels)
    decoded = decode_int2(codes, scales, levels)
    err = ((decoded - x[:20_000]) ** 2).mean(dim=0)
    assert float(err.sum()) <= 0.1188 * float((sigmas**2).sum())  # the scale fits the token, not a column
    assert torch.equal(decoded[:, 4], x[:20_000, 4])
    side = int2_queries(torch.randn(3, 8, generator=gen), levels)
    assert torch.equal(side.q8[:, 4], torch.zeros(3, dtype=torch.int8))
    # the sample is read in blocks of rows (bounded memory): any block size, the same grid to rounding
    monkeypatch.setattr(codecs, "BUCKET_BLOCK_ELEMS", 8 * 777)
    again = fit_int2_levels(x)
    assert torch.allclose(again[0], offsets, atol=1e-6) and torch.allclose(again[1], steps, atol=1e-6)


# ------------------------------------------------------------------------------------------------------
# maxsim quantize --bits 2 --codec int2, the shards and their codebook, maxsim score
# ------------------------------------------------------------------------------------------------------

SAMPLE = os.path.join(os.path.dirname(__file__), "..", "sample_data")


@pytest.fixture(scope="module")
def int2_corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = str(tmp_path_factory.mktemp("int2") / "corpus")
    args = ["quantize", os.path.join(SAMPLE, "corpus"), "-o", folder, "--bits", "2", "--codec", "int2", "-q"]
    result = CliRunner().invoke(app, [*args, "--sample-queries", "0"])
    assert result.exit_code == 0, result.output
    return folder




def test_quantize_int2_writes_36_bytes_a_token_at_dim_128_and_its_grid(int2_corpus: str) -> None:
    """dim / 4 bytes of codes and a scale a token (sample_data: dim 384, 96 + 4 bytes), the grid beside
    the shards; the scores of `maxsim score` are the kernels' on those codes, the two-stage search's the
    float corpus's exactly."""
    with open_corpus([int2_corpus]) as corpus:
        assert (corpus.dtype, corpus.quantization, corpus.dim) == ("uint8", "int2-grid", 384)
        assert isinstance(corpus.codebook, codecs.Int2Grid) and corpus.codebook.dim == 384
        batch = corpus.shards[0].read_docs(0, 3)
        assert batch.embeddings.shape[1] == 96 and batch.scales is not None
        levels = corpus.codebook.for_kernels()
        codes, scales = encode_int2(_float_docs(0, 3), levels)
        assert torch.equal(batch.embeddings, codes) and torch.equal(batch.scales, scales)


def _float_docs(first: int, count: int) -> torch.Tensor:
    with open_corpus([os.path.join(SAMPLE, "corpus")]) as corpus:
        return corpus.shards[0].read_docs(first, count).embeddings.float()


def test_score_on_int2_codes_and_two_stage_exact_scores(int2_corpus: str, tmp_path) -> None:
    queries = os.path.join(SAMPLE, "queries.safetensors")
    run, exact, two = tmp_path / "run.trec", tmp_path / "exact.trec", tmp_path / "two.trec"
    float_corpus = os.path.join(SAMPLE, "corpus")
    for out, corpus, extra in ((run, int2_corpus, []), (exact, float_corpus, []),
                               (two, int2_corpus, ["--exact-from", float_corpus])):  # fmt: skip
        args = ["score", queries, corpus, "-k", "10", "-o", str(out), "-q", *extra]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
    lines = run.read_text().splitlines()
    assert len(lines) == 200 * 10 and lines[0].split()[:2] == ["q001", "Q0"]
    assert two.read_text() == exact.read_text()  # sample_data's 400 documents: all within the depth


def test_int2_codebook_faults_are_one_line_errors(int2_corpus: str, tmp_path) -> None:
    """Missing, of another codec, with a NaN, or with a negative step: one line naming both files."""
    folder = str(tmp_path / "copy")
    shutil.copytree(int2_corpus, folder)
    book_path = os.path.join(folder, "codebook.safetensors")
    with open_corpus([folder]) as corpus:
        grid = corpus.codebook
    os.remove(book_path)
    message = one_line_open_error([folder])
    assert "codebook.safetensors" in message and "shard-00000.safetensors" in message and "missing" in message

    def install(book) -> None:  # noqa: ANN001
        written = codecs.write_codebook(folder, book)
        for name in ("shard-00000.safetensors", "shard-00001.safetensors"):  # make the checksums agree
            rewrite_metadata(os.path.join(folder, name), {"codebook_sha256": written.sha256})

    residual = codecs.Codebook(torch.zeros(4, 384).half(), torch.zeros(384, 4), torch.zeros(384, 3))
    install(residual)
    message = one_line_open_error([folder])
    assert "a residual2-kmeans codebook, where the shard holds int2-grid codes" in message
    bad = grid.offsets.clone()
    bad[7] = float("nan")
    install(codecs.Int2Grid(bad, grid.steps))
    assert "NaN or Inf in offsets" in one_line_open_error([folder])
    steps = grid.steps.clone()
    steps[3] = -1.0
    install(codecs.Int2Grid(grid.offsets, steps))
    assert "negative step" in one_line_open_error([folder])
    install(codecs.Int2Grid(grid.offsets[:380], grid.steps[:380]))
    assert "the shard needs fp32 [384]" in one_line_open_error([folder])
    install(grid)
    with open_corpus([folder]) as corpus:
        assert torch.equal(corpus.codebook.offsets, grid.offsets)




def test_codec_option_is_checked(tmp_path) -> None:
    out = str(tmp_path / "out")
    args = ["quantize", os.path.join(SAMPLE, "corpus"), "-o", out, "-q", "--sample-queries", "0"]
    result = CliRunner().invoke(app, [*args, "--bits", "2", "--codec", "int3"])
    assert result.exit_code == 2 and "--codec must be one of residual2, int2" in result.output
    result = CliRunner().invoke(app, [*args, "--bits", "4", "--codec", "int2"])
    assert result.exit_code == 2 and "give --bits 2 with it" in result.output
    result = CliRunner().invoke(app, [*args, "--bits", "2", "--codec", "int2", "--centroids", "64"])
    assert result.exit_code == 2 and "--codec int2 has no centroids" in result.output
    assert not os.path.exists(tmp_path / "out")


def test_int2_rows_decode_to_int8_on_the_kernel_as_on_the_host(sm90_build) -> None:
    """`int2_to_int8` (the Triton decode of int2 for the int8 kernels) gives `int2_values`' odd values for
    every byte, a ragged row count and widths that are not powers of two; it builds for Hopper."""
    from maxsim_kernels.maxsim_codes import int2_to_int8

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(4)
    for width in (32, 24, 5):
        codes = torch.randint(0, 256, (131, width), generator=gen, dtype=torch.int32).to(torch.uint8)
        codes[: 256 // width + 1].view(-1)[:256] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        out = torch.full((131, 4 * width), 99, dtype=torch.int8, device=device)
        int2_to_int8(codes.to(device), out)
        assert torch.equal(out.cpu(), int2_values(codes)), width
    built = sm90_build(
        """
from maxsim_kernels import maxsim_codes as m
sig = {"codes": "*u8", "out": "*i8", "n_rows": "i32", "WIDTH": "constexpr", "BLOCK_W": "constexpr",
       "BLOCK_ROWS": "constexpr"}
const = dict(WIDTH=32, BLOCK_W=32, BLOCK_ROWS=m._DECODE_ROWS)
k = triton.compile(ASTSource(m._int2_to_int8_kernel, sig, const), target=SM90, options={"num_warps": 4})
print(json.dumps([resource_usage(k)]))
"""
    )
    assert not built[0] or "LOCAL:0" in built[0], built


class _FakeStream:
    """A stand-in for the Gluon stream module (`maxsim_int8.hopper_stream`'s first value): records how it is
    launched, scores every item 0."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def maxsim_int8_stream(self, q8, sq, q_off, item_off, items, d8, sd, d_off, max_query_len, **kw):  # noqa: ANN001, ANN201
        self.calls.append({"items": items, "max_query_len": max_query_len, "sd": sd, **kw})
        return torch.zeros(d_off.numel() - 1 if items is None else items.numel())


def test_every_codec_reaches_the_stream_kernel_through_one_dispatch(monkeypatch) -> None:
    """Where `hopper_stream` takes the scan, `maxsim_codes.code_stream` launches it for int4, int2 and
    residual2 alike (the codec's query side bound: residual2's tables, int2's flag), and int2's scores get
    each query's sum of q . offsets after it, for all pairs and for candidates."""
    from maxsim_kernels import code_packing, codes_host, maxsim_codes

    fake = _FakeStream()
    asked = []

    def stream(q_off, q8, codes, argmax, residual=False, int2=False):  # noqa: ANN001, ANN202
        asked.append({"residual": residual, "int2": int2})
        return fake, int(q8.shape[0])

    monkeypatch.setattr(maxsim_codes, "hopper_stream", stream)
    gen = torch.Generator().manual_seed(30)
    levels = _levels(128, gen)
    docs, d_off = _corpus([3, 0, 70], 128, gen)
    codes, scales = encode_int2(docs, levels)
    queries, q_off = _corpus([5], 128, gen)
    side = int2_queries(queries, levels)
    want = float(side.row_offsets.double().sum())
    kw = {"doc_scales": scales, "codebook": levels, "backend": "triton"}
    got = codes_host.maxsim_varlen_codes(queries, q_off, codes, d_off, **kw)
    assert asked[-1] == {"residual": False, "int2": True} and fake.calls[-1]["int2"] is True
    assert fake.calls[-1]["residual"] is None and fake.calls[-1]["max_query_len"] == 5
    assert torch.allclose(got, torch.full((1, 3), want), rtol=1e-6)
    cand = torch.tensor([2, 0])
    got = codes_host.maxsim_candidates_codes(queries, q_off, codes, d_off, torch.tensor([0, 2]), cand, **kw)
    assert torch.equal(fake.calls[-1]["items"], cand)
    assert torch.allclose(got, torch.full((2,), want), rtol=1e-6)

    int4_codes, int4_scales = code_packing.encode_int4(docs)
    codes_host.maxsim_varlen_codes(
        queries, q_off, int4_codes, d_off, doc_scales=int4_scales, backend="triton"
    )
    assert asked[-1] == {"residual": False, "int2": False} and fake.calls[-1]["residual"] is None
    assert fake.calls[-1]["int2"] is False
    base = (torch.arange(128, dtype=torch.float32) / 1024 - 0.0625)[:, None]  # exact sums below
    weights = torch.cat([base, base + 0.25, base + 0.5, base + 0.75], dim=1)  # separable: w3 - w2 = w1 - w0
    book = code_packing.ResidualCodebook(torch.randn(4, 128, generator=gen).half(), weights)
    ids = torch.randint(0, 4, (docs.shape[0],), generator=gen)
    rows = code_packing.encode_residual2(docs, ids, book.centroids, torch.zeros(128, 3))
    codes_host.maxsim_varlen_codes(queries, q_off, rows, d_off, codebook=book, backend="triton")
    assert asked[-1] == {"residual": True, "int2": False} and fake.calls[-1]["residual"] is not None


def test_document_chunks_cover_every_document_once_within_the_bound() -> None:
    """The decoded paths' walk (`codes_host._document_chunks`): consecutive runs of whole documents of at
    most ``chunk`` tokens, a longer document alone, empty documents included, each run's offsets from its
    first token."""
    import numpy as np
    from maxsim_kernels.codes_host import _document_chunks

    d_host = np.cumsum([0, 3, 0, 4, 9, 1, 1, 0, 2])
    runs = list(_document_chunks(d_host, 5))
    assert [(a, b) for a, b, _ in runs] == [(0, 2), (2, 3), (3, 4), (4, 8)]
    for a, b, offsets in runs:
        assert offsets.tolist() == (d_host[a : b + 1] - d_host[a]).tolist()
        assert b - a == 1 or int(d_host[b] - d_host[a]) <= 5


@pytest.mark.parametrize(
    ("backend", "device"),
    [("torch", "cpu"), ("triton", "cpu"), pytest.param("triton", "cuda", marks=pytest.mark.gpu)],
)
def test_int2_all_pairs_in_chunks_give_the_bits_of_one(monkeypatch, backend: str, device: str) -> None:
    """All pairs decoded a chunk of documents at a time (`codes_host._decoded_varlen`; here chunks of a
    few tokens, so a long document alone and runs of empty documents make chunks of their own; on CUDA the
    chunks alternate between two streams): the same bits as one chunk of every document, -inf for empty
    documents."""
    from maxsim_kernels import codes_host
    from maxsim_kernels.cpu import int8_stream_applies

    gen = torch.Generator().manual_seed(31)
    levels = _levels(128, gen)
    lengths = [0, 0, 40, 5, 0, 0, 1, 7, 0, 3, 9, 2, 0, 0, 0, 6]  # a chunk of empty documents first
    docs, d_off = _corpus(lengths, 128, gen)
    codes, scales = encode_int2(docs, levels)
    queries, q_off = _corpus([1, 32, 7, 4] * 20, 128, gen)  # past the CPU stream's few query rows
    assert not int8_stream_applies(queries, queries.device)
    queries, codes, scales = queries.to(device), codes.to(device), scales.to(device)
    levels = levels.to(device)
    whole = maxsim_varlen(queries, q_off, codes, d_off, doc_scales=scales, codebook=levels, backend=backend)
    monkeypatch.setattr(codes_host, "DECODE_CHUNK_BYTES", 128 * 8)
    monkeypatch.setattr(codes_host, "cpu_decode_bytes", lambda: 128 * 8)  # the CPU's bound
    chunked = maxsim_varlen(queries, q_off, codes, d_off, doc_scales=scales, codebook=levels, backend=backend)
    assert torch.equal(chunked, whole)
    assert (whole[:, torch.tensor(lengths) == 0] == float("-inf")).all()


def test_int2_candidates_on_the_cpu_in_runs_give_the_bits_of_one(monkeypatch) -> None:
    """int2 candidates on the CPU are decoded (by the byte table: `int2_values`' values) a run of
    candidates at a time (`codes_host.cpu_decode_bytes`; here runs of a few tokens, so a long
    document alone and queries whose candidates straddle runs): the same bits as one run of every
    candidate, with repeats, empty documents and queries without candidates."""
    from maxsim_kernels import codes_host

    gen = torch.Generator().manual_seed(37)
    levels = _levels(128, gen)
    lengths = [0, 40, 5, 1, 7, 0, 3, 9, 2, 6, 300]
    docs, d_off = _corpus(lengths, 128, gen)
    codes, scales = encode_int2(docs, levels)
    out = torch.empty(codes.shape[0], 4 * codes.shape[1], dtype=torch.int8)
    codes_host._int8_values("int2", "torch", codes, out)
    assert torch.equal(out, int2_values(codes))
    queries, q_off = _corpus([3, 1, 32, 7, 4], 128, gen)
    lists = [[1, 2, 2, 0], [], [10, 4, 5, 6, 7, 8, 9, 3, 1], [3], [0, 5]]
    c_off = torch.tensor([0] + [len(x) for x in lists]).cumsum(0)
    c_docs = torch.tensor([d for x in lists for d in x], dtype=torch.int64)
    args = (queries, q_off, codes, d_off, c_off, c_docs)
    whole = maxsim_candidates(*args, doc_scales=scales, codebook=levels, backend="torch")
    monkeypatch.setattr(codes_host, "cpu_decode_bytes", lambda: 128 * 4 * 8)
    runs = maxsim_candidates(*args, doc_scales=scales, codebook=levels, backend="torch")
    assert torch.equal(runs, whole)
    reference = maxsim_codes_reference(queries, q_off, codes, d_off, doc_scales=scales, codebook=levels)
    owner = torch.repeat_interleave(torch.arange(len(lists)), c_off.diff())
    assert torch.equal(whole.isneginf(), reference[owner, c_docs].isneginf())
