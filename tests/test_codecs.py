"""Codes below 8 bits (int4 per token, 2-bit residual over k-means centroids): packing, the scan kernels
(Triton under the interpreter, and the torch CPU path) against the float64 reference of the decoded
values, the shard format's checks, and `maxsim quantize --bits 4/2` then `maxsim score` end to end.

Tolerance. The reference (`maxsim_codes_reference`) scores the same int8 queries against the same
decoded values in float64, so the only difference is the kernels' arithmetic: int4 products are exact
integers times one fp32 document scale (relative error 2^-24); the CPU path's residual2 values are decoded
to fp32 (one rounding) and their products accumulated in fp32 over dim terms; then Lq fp32 additions of
the per-token maxima. Each rounding is at most 2^-24 of the magnitude it touches, so |kernel - reference|
<= (dim + Lq + 3) * 2^-24 * sum_i s_q[i] * max_j sum_k |q8[i, k] * x[j, k]|, the bound `_bound` computes
per (query, document) pair. The residual2 scan kernels take the query side of `residual2_query_tables`:
a centroid table rounded once to fp32, and query planes q8 * D_v rounded to fp16 (2^-11 relative, 2^-25
* 2^e absolute below fp16's normal range) whose products with the documents' bit planes are accumulated
in fp32 over 3 * dim terms; `_bound` adds those roundings for them (`_planes_bound`), and the decoding
plans' rounding of each value to fp16 (2^-11 of sum_k |q8[i, k] * x[j, k]|).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from maxsim_kernels import maxsim_candidates, maxsim_varlen
from maxsim_kernels.code_packing import (
    ResidualCodebook,
    decode_int4,
    decode_residual2,
    encode_int4,
    encode_residual2,
    residual2_ids,
)
from maxsim_kernels.codes_host import quantized_queries
from maxsim_kernels.maxsim_codes import residual2_plane_weights, residual2_query_tables
from maxsim_kernels.reference import maxsim_codes_reference
from tierlib import check_close, one_line_open_error, rewrite_metadata
from typer.testing import CliRunner

from maxsim_cli.cli import app
from maxsim_cli.errors import InputError
from maxsim_cli.shards import open_corpus, write_shard

SAMPLE = os.path.join(os.path.dirname(__file__), "..", "sample_data")


def _packed(lengths: list[int], dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.randn(sum(lengths), dim, generator=gen)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    return values, offsets


def _codebook(
    dim: int, k: int, gen: torch.Generator, separable: bool = False
) -> tuple[ResidualCodebook, torch.Tensor]:
    """Random centroids and buckets; ``separable``: values b0 + l D0 + h D1 (bucket l + 2h) on a grid of
    2^-20, as `maxsim quantize` fits them (the kernels' third bit plane exactly zero)."""
    centroids = torch.randn(k, dim, generator=gen).half()
    cutoffs = torch.tensor([-0.4, 0.0, 0.4]).repeat(dim, 1) + 0.05 * torch.randn(dim, 3, generator=gen)
    cutoffs = cutoffs.sort(dim=1).values
    weights = torch.tensor([-0.7, -0.2, 0.2, 0.7]).repeat(dim, 1) + 0.05 * torch.randn(dim, 4, generator=gen)
    if separable:
        b0, d0, d1 = (torch.round(x * 2**20) / 2**20 for x in (weights[:, 0], weights[:, 1] - weights[:, 0],
                                                                weights[:, 2] - weights[:, 0]))  # fmt: skip
        weights = torch.stack([b0, b0 + d0, b0 + d1, b0 + d0 + d1], dim=1)
    return ResidualCodebook(centroids, weights.float()), cutoffs.float()


def _encoded(codec: str, docs: torch.Tensor, gen: torch.Generator, k: int = 7) -> dict:
    """Keyword arguments (docs and their scales or codebook) of the codes of ``docs`` (``codec``: int4,
    residual2, or residual2-separable: a codebook of separable buckets)."""
    if codec == "int4":
        codes, scales = encode_int4(docs)
        return {"docs": codes, "doc_scales": scales}
    book, cutoffs = _codebook(docs.shape[1], k, gen, separable=codec == "residual2-separable")
    ids = torch.randint(0, k, (docs.shape[0],), generator=gen)
    return {"docs": encode_residual2(docs, ids, book.centroids, cutoffs), "codebook": book}


def _decoded(enc: dict) -> torch.Tensor:
    if "codebook" in enc:
        return decode_residual2(enc["docs"], enc["codebook"]).double()
    return decode_int4(enc["docs"]).double() * enc["doc_scales"].double()[:, None]


def _bound(queries, q_off, enc: dict) -> torch.Tensor:
    """The fp32 error bound of the module docstring, per (query, document): [nq, nd]."""
    q8, sq = quantized_queries(queries)
    values = _decoded(enc)
    if "doc_scales" in enc:
        values = values / enc["doc_scales"].double()[:, None]  # int4: the integer codes (scale after)
    magnitude = (q8.double().abs() @ values.abs().T) * sq.double()[:, None]  # [Tq, Td]
    if "doc_scales" in enc:
        magnitude = magnitude * enc["doc_scales"].double()[None, :]
    per_row = magnitude.max(dim=1).values  # a bound on every max_j, for all documents at once
    q_lens = q_off.diff()
    per_query = torch.zeros(len(q_lens), dtype=torch.float64).index_add_(
        0, torch.repeat_interleave(torch.arange(len(q_lens)), q_lens), per_row
    )
    dim = queries.shape[1]
    factor = (dim + int(q_lens.max()) + 3) * 2.0**-24
    bound = (factor * per_query)[:, None] + 1e-30
    if "codebook" in enc:  # the bit planes' roundings, or the decoding kernels' fp16 values (2^-11)
        extra = _planes_bound(q8, sq, q_lens, enc["codebook"]) + 2.0**-11 * per_query
        bound = bound + extra[:, None]
    return bound


def _planes_bound(q8, sq, q_lens, book) -> torch.Tensor:
    """The residual2 scan kernels' extra error, per query: the fp16 rounding of the query planes and the
    fp32 sums over 3 * dim plane products plus the centroid table's term (module docstring)."""
    planes_d = residual2_plane_weights(book.bucket_weights).abs()  # [3, dim]
    q = q8.double().abs()
    plane_mag = q @ planes_d.sum(0)  # [Tq]: sum_k |q8| (|D_0| + |D_1| + |D_2|)
    base = (book.centroids.double() + book.bucket_weights.double()[:, 0][None, :]).abs()
    table_mag = (q @ base.T).max(dim=1).values  # [Tq]: the largest |q8| . |C + W0| over centroids
    plane_scale = residual2_query_tables(q8, book).plane_scale
    dim = q8.shape[1]
    per_row = (
        2.0**-11 * plane_mag
        + 3 * dim * 2.0**-25 * plane_scale
        + (3 * dim + 4) * 2.0**-24 * (plane_mag + table_mag)
    ) * sq.double()
    rows = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
    return torch.zeros(len(q_lens), dtype=torch.float64).index_add_(0, rows, per_row)




CODECS = ["int4", "residual2", "residual2-separable"]
BACKENDS = ["torch", "triton"]
# (query lengths, document lengths, dim): one-token documents, an empty document, documents that
# straddle the 16- and 32-token tiles, dims that are not powers of two (int4: even; residual2: / 4)
SHAPES = [
    ([3, 1, 7], [1, 40, 17, 0, 33, 1, 2], 20),
    ([5], [16, 17, 31, 33, 64, 1], 36),
    ([2, 9, 4, 1], [3, 70, 1], 128),
]


def _cpu_backend_or_skip(backend: str) -> None:
    """The Triton backend on CPU tensors runs under the interpreter, which a GPU machine does not set."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend on CPU tensors needs TRITON_INTERPRET=1 (set without a GPU)")


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_lengths,d_lengths,dim", SHAPES)
def test_all_pairs_within_the_fp32_bound_of_the_decoded_reference(codec, backend, q_lengths, d_lengths, dim):
    _cpu_backend_or_skip(backend)
    gen = torch.Generator().manual_seed(dim + len(d_lengths))
    queries, q_off = _packed(q_lengths, dim, gen)
    docs, d_off = _packed(d_lengths, dim, gen)
    enc = _encoded(codec, docs, gen)
    codes = enc.pop("docs")
    scores = maxsim_varlen(queries, q_off, codes, d_off, backend=backend, **enc)
    reference = maxsim_codes_reference(queries, q_off, codes, d_off, **enc)
    check_close(scores, reference, _bound(queries, q_off, {"docs": codes, **enc}))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_candidates_score_as_all_pairs(codec, backend):
    _cpu_backend_or_skip(backend)
    gen = torch.Generator().manual_seed(3)
    dim = 24
    queries, q_off = _packed([4, 1, 6], dim, gen)
    docs, d_off = _packed([5, 1, 40, 0, 18], dim, gen)
    enc = _encoded(codec, docs, gen)
    codes = enc.pop("docs")
    cand_off = torch.tensor([0, 3, 3, 7])
    cand_docs = torch.tensor([4, 0, 2, 1, 3, 2, 2])
    scores = maxsim_candidates(queries, q_off, codes, d_off, cand_off, cand_docs, backend=backend, **enc)
    reference = maxsim_codes_reference(queries, q_off, codes, d_off, **enc)
    owner = torch.repeat_interleave(torch.arange(3), cand_off.diff())
    expected = reference[owner, cand_docs]
    bound = _bound(queries, q_off, {"docs": codes, **enc})[owner, 0]
    check_close(scores, expected, bound)


@pytest.mark.parametrize("dim", [128, 40])
def test_int4_all_pairs_on_the_cpu_are_the_torch_path_bitwise(dim, monkeypatch):
    """int4 all pairs of many query rows on the CPU are decoded to int8 values a chunk of documents at a time
    and scored by the int8 CPU path's workers (`codes_host._decoded_varlen`; here chunks of a few documents):
    the bits of the per-block torch path (`codes_host._varlen_torch`), with empty and one-token documents."""
    from maxsim_kernels import codes_host

    gen = torch.Generator().manual_seed(dim)
    queries, q_off = _packed([32, 1, 7] * 50, dim, gen)  # past the CPU stream's few query rows
    docs, d_off = _packed([0, 5, 1, 40, 300, 0, 18, 2, 7], dim, gen)
    enc = _encoded("int4", docs, gen)
    codes = enc.pop("docs")
    monkeypatch.setattr(codes_host, "cpu_decode_bytes", lambda: 50 * dim)
    scores = maxsim_varlen(queries, q_off, codes, d_off, backend="torch", **enc)
    q8, sq = codes_host.quantized_queries(queries)
    assert torch.equal(scores, codes_host._varlen_torch(q8, sq, q_off, codes, enc["doc_scales"], d_off, None))


# Every branch of the Triton kernels with small tiles: the few-rows plan (one loop over the tiles of all
# of a program's documents), the all-pairs plan with groups of queries, queries longer than a program's
# query tile (the per-document branch), and candidate programs that hold one query's run (one loop) or
# several queries' (per candidate).
PLANS = {
    "few-rows": dict(_FEW_ROWS_MAX=64, _FEW_ROWS=(64, 16, 4, 4, 1)),
    "all-pairs": dict(_FEW_ROWS_MAX=0, _ALL_PAIRS=(32, 16, 2, 4, 1)),
    "long-queries": dict(_FEW_ROWS_MAX=0, _ALL_PAIRS=(16, 16, 2, 4, 1)),
    "candidate-runs": dict(_CANDIDATES=(64, 16, 2, 4, 1)),
    "few-rows-doc-major": dict(_FEW_ROWS_MAX=64, _FEW_ROWS=(64, 16, 4, 4, 1, True)),
    "long-queries-doc-major": dict(_FEW_ROWS_MAX=0, _ALL_PAIRS=(16, 16, 2, 4, 1, True)),
    "candidate-runs-doc-major": dict(_CANDIDATES=(64, 16, 2, 4, 1, True)),
    # residual2 with the values decoded in place of the bit planes (int4: the same kernels as above)
    "all-pairs-decode": dict(_FEW_ROWS_MAX=0, _ALL_PAIRS=(32, 16, 2, 4, 1, False, True)),
    "long-queries-decode": dict(_FEW_ROWS_MAX=0, _ALL_PAIRS=(16, 16, 2, 4, 1, True, True)),
    "candidate-runs-decode": dict(_CANDIDATES=(64, 16, 2, 4, 1, False, True)),
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_every_kernel_branch_within_the_bound(codec, plan, device, monkeypatch):
    from maxsim_kernels import maxsim_codes

    for name, tiles in PLANS[plan].items():
        if name == "_FEW_ROWS":  # a plan for each codec
            tiles = {c: maxsim_codes.Tiles(*tiles) for c in CODECS}
        elif not isinstance(tiles, int):
            tiles = maxsim_codes.Tiles(*tiles)
        monkeypatch.setattr(maxsim_codes, name, tiles)
    gen = torch.Generator().manual_seed(11)
    dim = 36 if codec == "int4" else 40
    queries, q_off = _packed([3, 40, 1, 7, 2], dim, gen)
    docs, d_off = _packed([1, 40, 17, 0, 33, 1, 2, 16, 15], dim, gen)
    enc = _encoded(codec, docs, gen)
    codes = enc.pop("docs")
    reference = maxsim_codes_reference(queries, q_off, codes, d_off, **enc)
    bound = _bound(queries, q_off, {"docs": codes, **enc})
    on = {k: v.to(device) for k, v in enc.items()} if device == "cuda" else enc
    if "codebook" in on:
        on["codebook"] = ResidualCodebook(*(t.to(device) for t in enc["codebook"]))
    gpu_codes, gpu_queries = codes.to(device), queries.to(device)
    if plan.startswith("candidate-runs"):
        cand_off = torch.tensor([0, 4, 5, 5, 9, 12])
        cand_docs = torch.tensor([8, 3, 1, 0, 2, 4, 5, 6, 7, 1, 1, 3])
        scores = maxsim_candidates(
            gpu_queries, q_off, gpu_codes, d_off, cand_off, cand_docs, backend="triton", **on
        ).cpu()
        owner = torch.repeat_interleave(torch.arange(5), cand_off.diff())
        check_close(scores, reference[owner, cand_docs], bound[owner, 0])
    else:
        scores = maxsim_varlen(gpu_queries, q_off, gpu_codes, d_off, backend="triton", **on).cpu()
        check_close(scores, reference, bound)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_residual2_centroid_tables_split_over_launches(device, monkeypatch):
    """More query rows than one centroid table holds: launches of whole queries, each within the bound
    (all pairs and candidates, a query alone past the table's size included)."""
    from maxsim_kernels import maxsim_codes

    gen = torch.Generator().manual_seed(13)
    dim = 24
    queries, q_off = _packed([3, 9, 1, 4, 2], dim, gen)
    docs, d_off = _packed([5, 1, 40, 0, 18, 7], dim, gen)
    enc = _encoded("residual2", docs, gen, k=6)
    codes = enc.pop("docs")
    monkeypatch.setattr(maxsim_codes, "_CENTROID_TABLE_BYTES", 5 * 6 * 4)  # 5 rows: the 9-row query alone
    chunks = maxsim_codes._query_chunks(enc["codebook"], queries, q_off, maxsim_codes._CANDIDATES)
    assert [c[:2] for c in chunks] == [
        (0, 1), (1, 2), (2, 4), (4, 5)
    ]  # fmt: skip
    reference = maxsim_codes_reference(queries, q_off, codes, d_off, **enc)
    bound = _bound(queries, q_off, {"docs": codes, **enc})
    book = ResidualCodebook(*(t.to(device) for t in enc["codebook"]))
    args = (queries.to(device), q_off, codes.to(device), d_off)
    check_close(maxsim_varlen(*args, backend="triton", codebook=book).cpu(), reference, bound)
    cand_off = torch.tensor([0, 2, 2, 5, 6, 8])
    cand_docs = torch.tensor([2, 0, 5, 3, 1, 2, 4, 2])
    scores = maxsim_candidates(*args, cand_off, cand_docs, backend="triton", codebook=book).cpu()
    owner = torch.repeat_interleave(torch.arange(5), cand_off.diff())
    check_close(scores, reference[owner, cand_docs], bound[owner, 0])


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_constant_vectors_negative_similarities_and_exact_ties(codec, backend):
    # every document token the same vector, queries its negation: all similarities negative and tied;
    # a zero document scores 0 (int4: scale 1, codes 0)
    dim = 16
    gen = torch.Generator().manual_seed(5)
    token = torch.full((dim,), 0.5)
    docs = torch.cat([token.repeat(3, 1), token.repeat(1, 1), torch.zeros(2, dim)])
    d_off = torch.tensor([0, 3, 4, 6])
    queries = -token.repeat(4, 1)
    q_off = torch.tensor([0, 2, 4])
    enc = _encoded(codec, docs, gen, k=1)
    codes = enc.pop("docs")
    scores = maxsim_varlen(queries, q_off, codes, d_off, backend=backend, **enc)
    reference = maxsim_codes_reference(queries, q_off, codes, d_off, **enc)
    assert bool((scores[:, :2] < 0).all())
    assert torch.equal(scores[:, 0], scores[:, 1])  # the same maxima: three tied tokens or one
    check_close(scores, reference, _bound(queries, q_off, {"docs": codes, **enc}))


def test_int4_packing_round_trips_and_bounds_the_error():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(50, 30, generator=gen)
    codes, scales = encode_int4(x)
    assert codes.dtype == torch.uint8 and codes.shape == (50, 15)
    values = decode_int4(codes)
    assert int(values.abs().max()) == 7
    assert bool(((values.float() * scales[:, None] - x).abs() <= scales[:, None] / 2 + 1e-6).all())
    every_nibble = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None]
    decoded = decode_int4(every_nibble)
    assert decoded.min() == -8 and decoded.max() == 7  # readers accept -8 from other writers


def test_int4_rows_decode_to_int8_on_the_kernel_as_on_the_host(sm90_build):
    """`int4_to_int8` (the Triton decode of int4 all pairs on sm_90) gives `decode_int4`'s values for every
    byte and a ragged row count; it builds for Hopper."""
    from maxsim_kernels.maxsim_codes import int4_to_int8

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 256, (131, 64), generator=gen, dtype=torch.int32).to(torch.uint8)
    codes[0] = torch.arange(64, dtype=torch.int32).to(torch.uint8)
    codes[1] = torch.arange(192, 256, dtype=torch.int32).to(torch.uint8)
    out = torch.full((131, 128), 99, dtype=torch.int8, device=device)
    int4_to_int8(codes.to(device), out)
    assert torch.equal(out.cpu(), decode_int4(codes))
    built = sm90_build(
        """
from maxsim_kernels import maxsim_codes as m
sig = {"codes": "*u8", "out": "*i8", "n_rows": "i32", "WIDTH": "constexpr", "BLOCK_ROWS": "constexpr"}
const = dict(WIDTH=64, BLOCK_ROWS=m._DECODE_ROWS)
k = triton.compile(ASTSource(m._int4_to_int8_kernel, sig, const), target=SM90, options={"num_warps": 4})
print(json.dumps([resource_usage(k)]))
"""
    )
    assert not built[0] or "LOCAL:0" in built[0], built


def test_residual2_packing_keeps_ids_and_buckets():
    gen = torch.Generator().manual_seed(2)
    book, cutoffs = _codebook(8, 300, gen)
    x = torch.randn(6, 8, generator=gen)
    ids = torch.tensor([0, 1, 255, 256, 299, 7])
    rows = encode_residual2(x, ids, book.centroids, cutoffs)
    assert rows.shape == (6, 4 + 2)
    assert torch.equal(residual2_ids(rows), ids)
    residual = x - book.centroids[ids].float()
    buckets = (residual[:, :, None] >= cutoffs[None]).sum(dim=2)
    expected = book.centroids[ids].float() + book.bucket_weights.gather(1, buckets.T).T
    assert torch.equal(decode_residual2(rows, book), expected)


@pytest.mark.parametrize("codec,dim", [("int4", 15), ("residual2", 18)])
def test_dims_the_codec_cannot_store_are_refused_in_one_line(codec, dim):
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match=r"dim") as err:
        if codec == "int4":
            encode_int4(torch.randn(3, dim, generator=gen))
        else:
            encode_residual2(
                torch.randn(3, dim), torch.zeros(3, dtype=torch.int64), torch.zeros(1, dim), None
            )
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_centroid_id_outside_the_codebook(backend):
    gen = torch.Generator().manual_seed(4)
    queries, q_off = _packed([3], 8, gen)
    docs, d_off = _packed([2, 3], 8, gen)
    enc = _encoded("residual2", docs, gen, k=3)
    codes = enc.pop("docs")
    codes[3, 0] = 3  # id 3 of 3 centroids, in the second document
    if backend == "torch":
        with pytest.raises(ValueError, match="row 3: centroid id 3 outside the codebook's 3 centroids"):
            maxsim_varlen(queries, q_off, codes, d_off, backend=backend, **enc)
        return
    scores = maxsim_varlen(queries, q_off, codes, d_off, backend=backend, **enc)
    assert torch.isfinite(scores[0, 0]) and torch.isnan(scores[0, 1])  # never read, scored NaN


def test_wrong_code_width_and_missing_codebook_raise():
    gen = torch.Generator().manual_seed(6)
    queries, q_off = _packed([2], 8, gen)
    codes, scales = encode_int4(torch.randn(3, 8, generator=gen))
    d_off = torch.tensor([0, 3])
    with pytest.raises(ValueError, match="4 bytes a token, but the documents have 3"):
        maxsim_varlen(queries, q_off, codes[:, :3], d_off, doc_scales=scales)
    with pytest.raises(ValueError, match="give doc_scales"):
        maxsim_varlen(queries, q_off, codes, d_off)


# ----------------------------------------------------------------------------------------------------------
# maxsim quantize --bits, the shard format, maxsim score
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """sample_data/corpus quantized with --bits 4 and --bits 2 (the quality check skipped)."""
    out = {}
    runner = CliRunner()
    for bits in (4, 2):
        folder = str(tmp_path_factory.mktemp("codes") / f"bits{bits}")
        args = ["quantize", os.path.join(SAMPLE, "corpus"), "-o", folder, "--bits", str(bits), "-q"]
        args += ["--codec", "residual2"] if bits == 2 else []
        result = runner.invoke(app, [*args, "--sample-queries", "0", "--centroids", "64"])
        assert result.exit_code == 0, result.output
        out[bits] = folder
    return out


def test_quantize_writes_the_stated_bytes_per_token(quantized):
    with open_corpus([quantized[4]]) as c4, open_corpus([quantized[2]]) as c2:
        assert (c4.dtype, c4.quantization, c4.dim) == ("uint8", "int4-per-token", 384)
        assert c2.quantization == "residual2-kmeans" and c2.codebook.num_centroids == 64
        b4 = c4.shards[0].read_docs(0, 2)
        assert b4.embeddings.shape[1] == 192 and b4.scales is not None  # 192 + 4 bytes = dim / 2 + 4
        b2 = c2.shards[0].read_docs(0, 2)
        assert b2.embeddings.shape[1] == 4 + 96 and b2.scales is None  # dim / 4 + 4


@pytest.mark.parametrize("bits", [4, 2])
def test_score_on_the_compressed_folder_writes_a_run(quantized, bits, tmp_path):
    run = tmp_path / "run.trec"
    queries = os.path.join(SAMPLE, "queries.safetensors")
    result = CliRunner().invoke(app, ["score", queries, quantized[bits], "-k", "10", "-o", str(run), "-q"])
    assert result.exit_code == 0, result.output
    lines = run.read_text().splitlines()
    assert len(lines) == 200 * 10 and lines[0].split()[:2] == ["q001", "Q0"]


def test_arrow_codes_shard_reads_back(tmp_path):
    gen = torch.Generator().manual_seed(7)
    docs = torch.randn(9, 12, generator=gen)
    codes, scales = encode_int4(docs)
    path = str(tmp_path / "codes.arrow")
    from maxsim_cli.shards import ShardWriter

    with ShardWriter(
        path, 12, "uint8", quantization="int4-per-token", code_metadata={"codes_version": "1"}
    ) as w:
        w.add(["a", "b"], codes, offsets=torch.tensor([0, 4, 9]), scales=scales)
    with open_corpus([path]) as corpus:
        batch = corpus.shards[0].read_docs(0, 2)
    assert torch.equal(batch.embeddings, codes) and torch.equal(batch.scales, scales)


def _copy(folder: str, tmp_path) -> str:
    target = str(tmp_path / "copy")
    shutil.copytree(folder, target)
    return target




def test_missing_codebook_names_both_files(quantized, tmp_path):
    folder = _copy(quantized[2], tmp_path)
    os.remove(os.path.join(folder, "codebook.safetensors"))
    message = one_line_open_error([folder])
    assert "codebook.safetensors" in message and "shard-00000.safetensors" in message and "missing" in message


def test_codebook_of_another_corpus_is_refused(quantized, tmp_path):
    folder = _copy(quantized[2], tmp_path)
    other = str(tmp_path / "other")
    result = CliRunner().invoke(
        app,
        [
            "quantize",
            os.path.join(SAMPLE, "corpus"),
            "-o",
            other,
            "--bits",
            "2",
            "-q",
            "--sample-queries",
            "0",
        ]
        + ["--codec", "residual2", "--centroids", "64", "--seed", "1"],
    )
    assert result.exit_code == 0, result.output
    shutil.copy(os.path.join(other, "codebook.safetensors"), os.path.join(folder, "codebook.safetensors"))
    message = one_line_open_error([folder])
    assert "belongs to another corpus" in message and "shard-00000.safetensors" in message


def test_nan_in_codebook_is_refused(quantized, tmp_path):
    from maxsim_cli import codecs

    folder = _copy(quantized[2], tmp_path)
    with open_corpus([folder]) as corpus:
        book = corpus.codebook
    bad = book.centroids.clone()
    bad[3, 5] = float("nan")
    written = codecs.write_codebook(folder, codecs.Codebook(bad, book.bucket_weights, book.bucket_cutoffs))
    for name in ("shard-00000.safetensors", "shard-00001.safetensors"):  # make the checksums agree
        rewrite_metadata(os.path.join(folder, name), {"codebook_sha256": written.sha256})
    assert "NaN or Inf in centroids" in one_line_open_error([folder])


def test_a_codebook_written_again_has_the_same_bytes(quantized, tmp_path):
    """The shards record the codebook's sha256: the same codebook must give the same bytes, in any
    process (the safetensors library orders its header from a hash map), and read back as it was."""
    import subprocess
    import sys

    from maxsim_cli import codecs

    folder = _copy(quantized[2], tmp_path)
    with open_corpus([folder]) as corpus:
        book = corpus.codebook
    first = codecs.write_codebook(folder, book).sha256
    assert first == book.sha256  # what quantize wrote
    script = (
        "import sys; from maxsim_cli import codecs, open_corpus\n"
        "c = open_corpus([sys.argv[1]]); print(codecs.write_codebook(sys.argv[1], c.codebook).sha256)"
    )
    for _ in range(2):  # fresh processes: another hash seed each
        out = subprocess.run([sys.executable, "-c", script, folder], capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.strip() == first, out.stderr
    with open_corpus([folder]) as corpus:
        again = corpus.codebook
        assert torch.equal(again.centroids, book.centroids)
        assert torch.equal(again.bucket_weights, book.bucket_weights)




def test_truncated_codes_are_refused_in_one_line(quantized, tmp_path):
    folder = _copy(quantized[4], tmp_path)
    path = os.path.join(folder, "shard-00001.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    assert "truncated" in one_line_open_error([path])


def test_wrong_code_width_in_a_shard_is_refused(tmp_path):
    gen = torch.Generator().manual_seed(8)
    codes, scales = encode_int4(torch.randn(4, 16, generator=gen))
    path = str(tmp_path / "wide.safetensors")
    from maxsim_cli.shards import ShardWriter

    with ShardWriter(
        path, 16, "uint8", quantization="int4-per-token", code_metadata={"codes_version": "1"}
    ) as w:
        w.add(["a"], codes, offsets=torch.tensor([0, 4]), scales=scales)
    rewrite_metadata(path, {"dim": "18"})  # 8 bytes a token stored, 9 expected
    message = one_line_open_error([path])
    assert "embeddings rows are 8 bytes but int4-per-token codes of dim 18 take 9" in message


def test_centroid_id_out_of_range_in_a_shard_is_refused_on_read(quantized, tmp_path):
    folder = _copy(quantized[2], tmp_path)
    path = os.path.join(folder, "shard-00000.safetensors")
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    start = 8 + length + header["embeddings"]["data_offsets"][0] + 100 * 3  # token 3: its id bytes
    with open(path, "r+b") as f:
        f.seek(start)
        f.write((64).to_bytes(4, "little"))  # 64 of 64 centroids
    with open_corpus([folder]) as corpus, pytest.raises(InputError) as err:
        corpus.shards[0].read_docs(0, 5)
    assert "centroid id 64, outside the codebook's 64 centroids" in str(err.value)


def test_quantize_refuses_a_dim_the_codec_cannot_store(tmp_path):
    gen = torch.Generator().manual_seed(9)
    source = str(tmp_path / "odd.safetensors")
    write_shard(source, ["a", "b"], [torch.randn(3, 18, generator=gen), torch.randn(2, 18, generator=gen)])
    result = CliRunner().invoke(app, ["quantize", source, "-o", str(tmp_path / "out"), "--bits", "2", "-q"])
    # the corpus reader's rule (a multiple of 8) comes first on the command line; the codecs' own rule
    # holds for the library
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    from maxsim_cli import codecs

    assert "multiple of 4" in codecs.dim_problem("residual2-kmeans", 18)
    assert "even dim" in codecs.dim_problem("int4-per-token", 15)
    assert codecs.dim_problem("residual2-kmeans", 20) is None


def test_quantize_overwrite_replaces_the_codebook_with_the_shards(quantized, tmp_path):
    folder = _copy(quantized[2], tmp_path)
    args = ["quantize", os.path.join(SAMPLE, "corpus"), "-o", folder, "--bits", "2", "-q", "--overwrite"]
    args += ["--codec", "residual2"]
    result = CliRunner().invoke(app, [*args, "--sample-queries", "0", "--centroids", "32"])
    assert result.exit_code == 0, result.output
    with open_corpus([folder]) as corpus:
        assert corpus.codebook.num_centroids == 32
    result = CliRunner().invoke(app, [*args[:5], "4", *args[6:-2], "--sample-queries", "0"])  # no --codec
    assert result.exit_code == 0, result.output
    assert not os.path.exists(os.path.join(folder, "codebook.safetensors"))  # part of the old corpus


@pytest.mark.gpu
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dim", [128, 96, 40])
def test_compiled_kernels_on_the_gpu_within_the_bound(codec, dim):
    # ragged documents of 20-300 tokens, one query and a block of queries: the compiled tiles
    gen = torch.Generator().manual_seed(11)
    lengths = torch.randint(20, 301, (300,), generator=gen).tolist()
    docs, d_off = _packed(lengths, dim, gen)
    enc = _encoded(codec, docs, gen, k=256)
    for q_lengths in ([32], [32] * 16):
        queries, q_off = _packed(q_lengths, dim, gen)
        on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v.to("cuda") for k, v in enc.items()}
        codes = on_gpu.pop("docs")
        scores = maxsim_varlen(queries.cuda(), q_off, codes, d_off, **on_gpu).cpu()
        host = dict(enc)
        reference = maxsim_codes_reference(queries, q_off, host.pop("docs"), d_off, **host)
        check_close(scores, reference, _bound(queries, q_off, enc))


# residual2 on the Gluon stream kernel (sm_90, dim 128, separable buckets, queries of at most 32 tokens):
# documents that are empty, one token, end at or next to a 64-token tile's end, runs of short documents,
# negative similarities and an exact tie
STREAM_DOC_LENGTHS = [0, 1, 63, 64, 65, 128, 129, 300, 7, 0, 2, 0]


def _residual2_stream_or_skip(queries, q_off, codes, book) -> None:
    from maxsim_kernels import maxsim_codes

    q8, _ = quantized_queries(queries)
    if maxsim_codes.code_stream("residual2", q_off, q8, codes, book) is None:
        pytest.skip("the Gluon stream kernel needs an sm_90 GPU and the Triton release it was built with")


def _stream_corpus(gen: torch.Generator, k: int = 300):
    """Adversarial ragged documents (d = 128) as residual2 codes of separable buckets: (documents, offsets,
    codes, codebook), on the CPU."""
    lengths = STREAM_DOC_LENGTHS + torch.randint(0, 301, (400,), generator=gen).tolist()
    lengths += torch.randint(1, 65, (200,), generator=gen).tolist()
    docs, d_off = _packed(lengths, 128, gen)
    docs[: docs.shape[0] // 2] *= -1
    docs[int(d_off[20]) + 1] = docs[int(d_off[20])]
    enc = _encoded("residual2-separable", docs, gen, k=k)
    enc["docs"][int(d_off[20]) + 1] = enc["docs"][int(d_off[20])]  # the same codes: an exact tie
    return docs, d_off, enc


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 13, 17, 32])
def test_residual2_stream_kernel_within_the_bound_of_the_decoded_values(q_len: int) -> None:
    """One query, then ragged queries against their candidates, on the stream kernel: every score within
    the float64 bound of the decoded values (the bit planes' bound), -inf for empty documents, NaN for a
    centroid id outside the codebook (one past it, and one that reads negative as int32) and for a bad
    candidate index; the same bits for every ring depth, loop unroll, items a program and walk (offsets or
    walk table)."""
    from maxsim_kernels import maxsim_codes
    from maxsim_kernels import maxsim_int8_hopper_stream as stream

    gen = torch.Generator().manual_seed(70 + q_len)
    _, d_off, enc = _stream_corpus(gen)
    codes, book = enc["docs"], enc["codebook"]
    queries, q_off = _packed([q_len], 128, gen)
    book_d = ResidualCodebook(book.centroids.cuda(), book.bucket_weights.cuda())
    broken = codes.clone()
    broken[int(d_off[14]) + 3, :4] = torch.tensor([44, 1, 0, 0], dtype=torch.uint8)  # id 300 of 300
    broken[int(d_off[15]), :4] = 255  # id 2^32 - 1
    codes_d, d_off_d = broken.cuda(), d_off.cuda()
    _residual2_stream_or_skip(queries.cuda(), q_off, codes_d, book_d)
    scores = maxsim_varlen(queries.cuda(), q_off, codes_d, d_off_d, codebook=book_d).cpu()
    reference = maxsim_codes_reference(queries, q_off, codes, d_off, codebook=book)
    bound = _bound(queries, q_off, enc)
    bad = torch.zeros(d_off.numel() - 1, dtype=torch.bool)
    bad[[14, 15]] = True
    assert torch.isnan(scores[0, bad]).all() and not torch.isnan(scores[0, ~bad]).any()
    check_close(scores[:, ~bad], reference[:, ~bad], bound)
    q8, sq = quantized_queries(queries.cuda())
    tables = maxsim_codes.residual2_query_tables(q8, book_d)
    q_off_d = q_off.cuda()
    for cfg in (dict(items_per_prog=1), dict(items_per_prog=64, stages=3, group=2),
                dict(items_per_prog=8, stages=8, group=8), dict(maxnreg=168), dict(table=True),
                dict(table=False), dict(items_per_prog=8, table=True)):  # fmt: skip
        again = stream.stream_with_tiles(q8, sq, q_off_d, None, None, codes_d, None, d_off_d, q_len,
                                         residual=tables, **cfg).cpu()  # fmt: skip
        assert torch.equal(again[~bad], scores[0, ~bad]) and torch.isnan(again[bad]).all(), cfg

    # ragged queries (1..32 tokens, host offsets) against their candidates: repeats, empty documents, a
    # query with none, lists that start inside another query's run of items, an index past the documents
    counts = [0, 1, 37, 5, 120, 16]
    queries, q_off = _packed([1, 32, q_len, 31, 7, 16], 128, gen)
    cand_off = torch.tensor([0, *counts]).cumsum(0)
    nd = d_off.numel() - 1
    cand = torch.randint(0, nd, (int(cand_off[-1]),), generator=gen)
    cand[:16] = torch.arange(16)  # the adversarial documents and the bad ids first
    cand[40] = nd
    picked = maxsim_candidates(queries.cuda(), q_off, codes_d, d_off_d, cand_off, cand.cuda(),
                               codebook=book_d).cpu()  # fmt: skip
    reference = maxsim_codes_reference(queries, q_off, codes, d_off, codebook=book)
    bound = _bound(queries, q_off, enc)
    owner = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    nan = (cand == nd) | bad[cand.clamp(max=nd - 1)]
    assert torch.equal(torch.isnan(picked), nan)
    ok = ~nan
    check_close(picked[ok], reference[owner[ok], cand[ok]], bound[owner[ok], 0])


@pytest.mark.gpu
def test_residual2_stream_kernel_offsets_past_2_31_bytes() -> None:
    """residual2 codes whose bytes start beyond 2^31 (59.7M tokens of 36 bytes): the stream kernel scores
    the last documents as it scores them alone (the same bits), for one query and for candidates."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    k = 4096
    n_tokens = (1 << 31) // 36 + 100_000
    codes = torch.randint(0, 256, (n_tokens, 36), dtype=torch.uint8, device="cuda", generator=gen)
    ids = torch.randint(0, k, (n_tokens,), dtype=torch.int32, device="cuda", generator=gen)
    codes[:, :4] = ids.view(torch.uint8).view(n_tokens, 4)
    lengths = torch.randint(20, 301, (n_tokens // 20,), device="cuda", generator=gen)
    ends = lengths.cumsum(0)
    ends = ends[ends <= n_tokens]
    d_off = torch.cat([torch.zeros(1, dtype=torch.int64, device="cuda"), ends])
    host_book, _ = _codebook(128, k, torch.Generator().manual_seed(8), separable=True)
    book = ResidualCodebook(host_book.centroids.cuda(), host_book.bucket_weights.cuda())
    queries = torch.randn(32, 128, device="cuda", generator=gen)
    q_off = torch.tensor([0, 32])
    _residual2_stream_or_skip(queries, q_off, codes, book)
    scores = maxsim_varlen(queries, q_off, codes, d_off, codebook=book)
    first = d_off.numel() - 1 - 300
    start = int(d_off[first])
    assert start * 36 > 2**31
    alone = maxsim_varlen(queries, q_off, codes[start:], d_off[first:] - start, codebook=book)
    assert torch.equal(scores[:, first:], alone)
    tail = {"docs": codes[start:].cpu(), "codebook": host_book}
    tail_off = (d_off[first:] - start).cpu()
    reference = maxsim_codes_reference(queries.cpu(), q_off, tail["docs"], tail_off, codebook=host_book)
    check_close(alone.cpu(), reference, _bound(queries.cpu(), q_off, tail))
    cand = torch.arange(first, d_off.numel() - 1, device="cuda").flip(0)
    cand_off = torch.tensor([0, cand.numel()])
    picked = maxsim_candidates(queries, q_off, codes, d_off, cand_off, cand, codebook=book)
    assert torch.equal(picked, scores[0, cand])


def test_residual2_encoding_in_blocks_equals_one_block(monkeypatch) -> None:
    """`encode_residual2` works a block of rows at a time (bounded memory): any block size, the same bytes."""
    from maxsim_kernels import code_packing

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(37, 12, generator=gen)
    centroids = torch.randn(5, 12, generator=gen).half()
    ids = torch.randint(0, 5, (37,), generator=gen)
    cutoffs = torch.tensor([-0.5, 0.0, 0.5]).repeat(12, 1)
    whole = code_packing.encode_residual2(x, ids, centroids, cutoffs)
    monkeypatch.setattr(code_packing, "ENCODE_BLOCK_ELEMS", 12 * 4)  # blocks of 4 rows, the last of 1
    assert torch.equal(code_packing.encode_residual2(x, ids, centroids, cutoffs), whole)


def _recorded_training(monkeypatch) -> dict:
    """fastkmeans and `nearest_centroids` replaced by recorders (no GPU needed): what `train_codebook`
    asked of them."""
    import fastkmeans

    from maxsim_cli import codecs

    seen: dict = {"assigned_on": []}

    class Recorder:
        def __init__(self, **kwargs) -> None:
            seen.update(kwargs)
            self.centroids = torch.zeros(kwargs["k"], kwargs["d"]).numpy()

        def train(self, data) -> None:
            pass

    def nearest(x, centroids, block_elems=None, *, device=None):
        seen["assigned_on"].append(device)
        return torch.zeros(x.shape[0], dtype=torch.int64)

    monkeypatch.setattr(fastkmeans, "FastKMeans", Recorder)
    monkeypatch.setattr(codecs, "nearest_centroids", nearest)
    return seen


@pytest.mark.parametrize("k,triton_path", [(64, False), (100, False), (128, True), (4096, True)])
def test_gpu_kmeans_takes_the_triton_assignment_only_for_whole_tiles(monkeypatch, k, triton_path) -> None:
    """fastkmeans' Triton assignment kernel can return a centroid id past k when k is not a multiple of its
    128-centroid tile (a device-side assert on the GPU); such k take its torch path."""
    from maxsim_cli import codecs

    seen = _recorded_training(monkeypatch)
    codecs.train_codebook(torch.randn(5000, 8), k, device=torch.device("cuda"))
    assert seen["use_triton"] is triton_path and seen["gpu"] is True


def test_the_training_sample_is_assigned_where_the_kmeans_ran(monkeypatch) -> None:
    """k-means on a GPU: the sample's nearest centroids (for the bucket residuals) are computed there too.
    On the host that is an fp32 product of the sample and every centroid (262,144 x 65,536 x 128 for an
    8 GB corpus): most of a GPU quantize's time. k-means on the host: the host."""
    from maxsim_cli import codecs

    seen = _recorded_training(monkeypatch)
    codecs.train_codebook(torch.randn(500, 8), 128, device=torch.device("cuda"))
    codecs.train_codebook(torch.randn(500, 8), 128, device=torch.device("cpu"))
    codecs.train_codebook(torch.randn(500, 8), 128)
    assert seen["assigned_on"] == [torch.device("cuda"), None, None]


def _nearest_reference(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """The nearest centroids by one fp32 product of every row and every centroid (what `nearest_centroids`
    computed before it worked in reused blocks)."""
    cent = centroids.float()
    return (x.float() @ cent.T - 0.5 * (cent * cent).sum(dim=1)).argmax(dim=1)


@pytest.mark.parametrize("block_elems", [1, 5 * 3, 5 * 8, 5 * 37, None])
def test_nearest_centroids_in_blocks_are_the_one_product(block_elems) -> None:
    """`nearest_centroids` a block of rows at a time (one reused distance block): the same ids as one
    product of all rows, the first centroid of a tie, whatever the block size (one row, a last block
    shorter than the others, one block)."""
    from maxsim_cli import codecs

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 16, generator=gen).half()
    centroids = torch.randn(5, 16, generator=gen).half()
    centroids[3] = centroids[1]  # a tie: id 1 wins
    x[:4] = centroids[1]
    ids = codecs.nearest_centroids(x, centroids, block_elems)
    assert ids.dtype == torch.int64 and torch.equal(ids, _nearest_reference(x, centroids))
    assert ids[:4].tolist() == [1] * 4
    assert codecs.nearest_centroids(x[:0], centroids, block_elems).shape == (0,)


def test_quantized_codes_are_those_of_one_product(tmp_path, monkeypatch) -> None:
    """`quantize --bits 2` on the host writes, byte for byte, the codes of one fp32 product of every token
    and every centroid of the codebook it wrote (ids little-endian, then four 2-bit buckets a byte, the
    lowest dimension in the low bits), with distance blocks of a few rows."""
    from maxsim_cli import codecs
    from maxsim_cli.quantize import quantize_corpus

    monkeypatch.setattr(codecs, "NEAREST_BLOCK_ELEMS", 64 * 7)  # 7 tokens a block
    folder = str(tmp_path / "bits2")
    source = os.path.join(SAMPLE, "corpus")
    quantize_corpus(
        [source], folder, bits=2, codec="residual2", num_centroids=64, sample_queries=0, device="cpu"
    )
    with open_corpus([source]) as corpus:
        x = torch.cat([shard.read_docs(0, shard.num_docs).embeddings for shard in corpus.shards])
    with open_corpus([folder]) as quantized:
        book = quantized.codebook
        rows = torch.cat([shard.read_docs(0, shard.num_docs).embeddings for shard in quantized.shards])
    ids = _nearest_reference(x, book.centroids)
    residuals = x.float() - book.centroids[ids].float()
    buckets = (residuals[:, :, None] >= book.bucket_cutoffs[None]).sum(dim=2).view(x.shape[0], -1, 4)
    packed = buckets[:, :, 0] | buckets[:, :, 1] << 2 | buckets[:, :, 2] << 4 | buckets[:, :, 3] << 6
    id_bytes = torch.stack([(ids >> (8 * i)) & 0xFF for i in range(4)], dim=1)
    assert torch.equal(rows, torch.cat([id_bytes, packed], dim=1).to(torch.uint8))


@pytest.mark.parametrize("dim,rows,k", [(128, 300, 200), (20, 37, 5), (384, 130, 129), (260, 10, 3)])
def test_nearest_centroid_kernel_picks_the_best_score_and_the_first_of_a_tie(dim, rows, k) -> None:
    """The GPU assignment kernel (here under Triton's interpreter): the centroid of the largest
    ``x . c - |c|^2 / 2`` up to fp32 rounding, the first of an exact tie, rows and centroids past a tile
    (the last tiles masked), rows in one tile and wider rows read a chunk at a time."""
    from maxsim_kernels.nearest_centroid import nearest_centroid_ids

    gen = torch.Generator().manual_seed(dim + k)
    x = torch.randn(rows, dim, generator=gen).half()
    centroids = torch.randn(k, dim, generator=gen).half()
    centroids[-1] = centroids[min(1, k - 1)]  # a tie: the lower id wins
    x[:2] = centroids[-1]
    cent = centroids.float()
    half_norm = 0.5 * (cent * cent).sum(dim=1)
    ids = nearest_centroid_ids(x, centroids, half_norm)
    assert ids.dtype == torch.int64 and ids.shape == (rows,)
    assert ids[:2].tolist() == [min(1, k - 1)] * 2
    exact = x.double() @ centroids.double().T - 0.5 * (centroids.double() ** 2).sum(dim=1)
    picked = exact[torch.arange(rows), ids]
    bound = 2 * (dim + 2) * 2.0**-24 * float((x.double().abs() @ centroids.double().abs().T).max() + 1)
    assert float((exact.max(dim=1).values - picked).max()) <= bound


_CODES_SM90_BUILD = r"""
import maxsim_kernels.maxsim_codes as mc


def build(kernel, tiles, codec, pointers, **consts):
    # the codes kernel for sm_90 with `tiles`' plan, 32 query rows at dim 128: (PTX, resource usage)
    consts.update(CODEC=codec, BLOCK_Q=32, BLOCK_D=tiles.block_d, DOC_MAJOR=tiles.doc_major, ASM=True,
                  DECODE=tiles.decode, BLOCK_K=mc._part_width("int4" if codec == 0 else "residual2", 128))
    names = kernel.arg_names
    sig = {n: "i32" for n in names}
    sig.update({"q_ptr": "*i8" if codec == 0 else "*fp16", "q_scale_ptr": "*fp32", "d_ptr": "*u8",
                "d_scale_ptr": "*fp32" if codec == 0 else "*u8", "qc_ptr": "*u8" if codec == 0 else "*fp32",
                "wts_ptr": "*u8", "out_ptr": "*fp32", "plane_scale": "fp32", **pointers,
                **{c: "constexpr" for c in consts}})
    aligned = [i for i, n in enumerate(names) if n.endswith("_ptr") and n not in pointers]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(kernel, sig, constexprs={(names.index(c),): v for c, v in consts.items()}, attrs=attrs)
    compiled = triton.compile(src, target=SM90, options={"num_warps": tiles.warps,
                                                         "num_stages": tiles.stages})
    return compiled.asm["ptx"], resource_usage(compiled)


varlen = dict(q_off_ptr="*i64", d_off_ptr="*i64")  # index pointers: no alignment assumed
candidates = dict(q_off_ptr="*i64", d_off_ptr="*i64", cand_off_ptr="*i64", cand_docs_ptr="*i64")
report = {}
for codec in (1, 2):  # residual2, one query of 32 tokens against a corpus: the scan's plan
    ptx, usage = build(mc._maxsim_codes_varlen_kernel, mc._FEW_ROWS["residual2"], codec, varlen,
                       DOCS_PER_PROG=mc._FEW_ROWS["residual2"].docs_per_prog, QUERIES_PER_GROUP=1, MAX_Q=2)
    report[codec] = {"wgmma": ptx.count("wgmma.mma_async"), "usage": usage}
# int4 on the Triton scan (one query's plan): the nibbles unpacked by the inline PTX (`code_unpacking`)
ptx, usage = build(mc._maxsim_codes_varlen_kernel, mc._FEW_ROWS["int4"], 0, varlen,
                   DOCS_PER_PROG=mc._FEW_ROWS["int4"].docs_per_prog, QUERIES_PER_GROUP=1, MAX_Q=2)
report["int4"] = {"unpacked_by_ptx": "0x78787878" in ptx, "usage": usage}
# and the candidates kernel's plan (query-major tiles), which a two-stage search's scan does not take but
# a rerank of a 2-bit corpus does
for codec in (1, 2):
    ptx, usage = build(mc._maxsim_codes_candidates_kernel, mc._CANDIDATES, codec, candidates,
                       CANDS_PER_PROG=mc._CANDIDATES.docs_per_prog)
    report[f"candidates {codec}"] = {"wgmma": ptx.count("wgmma.mma_async"), "usage": usage}
print(json.dumps(report))
"""


def test_codes_scan_kernels_build_for_sm90(sm90_build) -> None:
    """The residual2 scan for sm_90 (triton's own ptxas, no GPU needed), one query's plan: with separable
    buckets (CODEC 2) a tile issues two thirds of the bit planes' tensor-core products (64 wgmma against
    96 in triton 3.6's build), and it does not spill (with three planes the build takes 255 registers and
    40 bytes of stack); the candidates kernel's plan builds with CODEC 2 as well, without spills. The int4
    scan (CODEC 0) keeps its inline PTX unpacking."""
    report = sm90_build(_CODES_SM90_BUILD)
    three, two = report["1"], report["2"]
    assert three["wgmma"] > 0 and 3 * two["wgmma"] == 2 * three["wgmma"], report
    assert not two["usage"] or ("LOCAL:0" in two["usage"] and "STACK:0" in two["usage"]), two
    # int4's Triton scan keeps the inline PTX unpacking (`code_unpacking`) in the compiled code
    assert report["int4"]["unpacked_by_ptx"], report["int4"]
    # candidates (query-major tiles: products on mma or wgmma as triton picks): fewer products, no spill
    three, two = report["candidates 1"], report["candidates 2"]
    assert two["wgmma"] <= three["wgmma"], report
    assert not two["usage"] or ("LOCAL:0" in two["usage"] and "STACK:0" in two["usage"]), two


_NEAREST_SM90_BUILD = r"""
import maxsim_kernels.nearest_centroid as nc

kernel = nc._nearest_centroid_kernel
names = kernel.arg_names
report = {}
for dim in (128, 96, 20, 256, 384):
    cfg = nc.launch_config(dim)
    consts = {k: v for k, v in cfg.items() if k != "num_warps"}
    sig = {"x_ptr": "*fp16", "c_ptr": "*fp16", "half_norm_ptr": "*fp32", "out_ptr": "*i64", "n_rows": "i32",
           "n_centroids": "i32", "dim": "i32", "stride_x": "i32", "stride_c": "i32",
           **{c: "constexpr" for c in consts}}
    # what Triton's launcher infers at run time for such a dim: 16-aligned pointers and strides
    aligned = [i for i, n in enumerate(names) if n.endswith("_ptr") or (n[:6] == "stride" and dim % 16 == 0)]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(kernel, sig, constexprs={(names.index(c),): v for c, v in consts.items()}, attrs=attrs)
    compiled = triton.compile(src, target=SM90, options={"num_warps": cfg["num_warps"]})
    ttgir = compiled.asm["ttgir"]
    report[dim] = {"pipelined": "async_copy_global_to_local" in ttgir, "wgmma": "warp_group_dot" in ttgir,
                   "usage": resource_usage(compiled)}
print(json.dumps(report))
"""


def test_nearest_centroid_kernel_builds_for_sm90_without_spills(sm90_build) -> None:
    """The GPU assignment kernel compiles for Hopper with triton's own ptxas (no GPU needed): the products
    on wgmma, the centroid tiles cp.async-pipelined where the rows fit one tile, nothing spilled."""
    for dim, r in sm90_build(_NEAREST_SM90_BUILD).items():
        assert r["wgmma"], f"dim {dim}: no wgmma"
        assert r["pipelined"] or int(dim) > 256, f"dim {dim}: centroid loads are not pipelined"
        assert not r["usage"] or ("LOCAL:0" in r["usage"] and "STACK:0" in r["usage"]), f"dim {dim}: {r}"


@pytest.mark.gpu
def test_nearest_centroids_on_the_gpu_are_those_of_the_fp32_product() -> None:
    """On a GPU fp16 tokens meet fp16 centroids on the tensor cores (exact products, fp32 sums in another
    order): a pick differs from that of the host's fp32 product only between centroids whose distances are
    within the fp32 rounding of the sums; rows on the host are assigned on the GPU when asked."""
    from maxsim_cli import codecs

    gen = torch.Generator().manual_seed(7)
    x = torch.nn.functional.normalize(torch.randn(20000, 128, generator=gen), dim=1).half()
    centroids = torch.nn.functional.normalize(torch.randn(4096, 128, generator=gen), dim=1).half()
    host = codecs.nearest_centroids(x, centroids)
    gpu = codecs.nearest_centroids(x.cuda(), centroids.cuda())
    asked = codecs.nearest_centroids(x, centroids, device="cuda")
    assert gpu.device.type == "cuda" and asked.device.type == "cpu"
    assert torch.equal(gpu.cpu(), asked)
    exact = x.double() @ centroids.double().T - 0.5 * (centroids.double() ** 2).sum(dim=1)
    rows = torch.arange(x.shape[0])
    # |x . c| <= 1: each of the 130 fp32 roundings of a score is at most 2^-24 (2^-23 for an accumulator
    # that truncates); both picks, both paths
    assert float((exact[rows, host] - exact[rows, asked]).abs().max()) <= 4 * 130 * 2.0**-23


def test_query_tiles_of_wide_rows_are_capped_to_fit_shared_memory() -> None:
    """A program's query tile stays within 96 KB of shared memory: the plan's 256 rows for int4 at dim 128,
    fewer for wider rows (residual2: 12 fp16 planes a row; at dim 384 with 256 rows an earlier layout did
    not fit an H100's shared memory)."""
    from maxsim_kernels.maxsim_codes import _ALL_PAIRS, _query_rows_cap

    planes = _ALL_PAIRS._replace(decode=False)
    assert (_query_rows_cap(_ALL_PAIRS, "int4", 128), _query_rows_cap(_ALL_PAIRS, "residual2", 128)) == (
        256,
        256,
    )
    assert _query_rows_cap(planes, "residual2", 128) == 128
    assert (_query_rows_cap(_ALL_PAIRS, "int4", 384), _query_rows_cap(planes, "residual2", 384)) == (128, 32)
    assert _query_rows_cap(_ALL_PAIRS, "residual2", 384) == 64
    assert _query_rows_cap(planes, "residual2", 1024) == 16


def _bucket_error(residuals: torch.Tensor, cutoffs: torch.Tensor, weights: torch.Tensor) -> float:
    buckets = (residuals[:, :, None] >= cutoffs[None]).sum(dim=2)
    return float(((weights.gather(1, buckets.T).T - residuals) ** 2).mean())


def test_fitted_buckets_are_the_means_of_their_residuals_and_beat_the_quantiles(monkeypatch) -> None:
    """`fit_buckets` (Lloyd-Max per dimension) without the separable constraint: each bucket value is the
    mean of the residuals its cutoffs put in it, values and cutoffs ascend, the squared error is below that
    of ColBERTv2's quantile buckets, and working a block of dimensions at a time changes nothing."""
    from maxsim_cli import codecs

    residuals = _heavy_tailed_residuals()
    cutoffs, weights = codecs.fit_buckets(residuals, grid="free")
    assert cutoffs.shape == (6, 3) and weights.shape == (6, 4)
    assert cutoffs.dtype == weights.dtype == torch.float32
    assert bool((cutoffs.diff(dim=1) >= 0).all()) and bool((weights.diff(dim=1) >= 0).all())
    buckets = (residuals[:, :, None] >= cutoffs[None]).sum(dim=2)
    for k in range(6):
        for j in range(4):
            inside = residuals[buckets[:, k] == j, k]
            assert inside.numel() > 0
            assert float(weights[k, j]) == pytest.approx(float(inside.double().mean()), abs=1e-6)
    quartiles = torch.quantile(residuals, torch.tensor([0.25, 0.5, 0.75]), dim=0).T
    eighths = torch.quantile(residuals, torch.tensor([0.125, 0.375, 0.625, 0.875]), dim=0).T
    assert _bucket_error(residuals, cutoffs, weights) < 0.8 * _bucket_error(residuals, quartiles, eighths)
    monkeypatch.setattr(codecs, "BUCKET_BLOCK_ELEMS", 4 * 2000)  # blocks of 4 dimensions, the last of 2
    blocked = codecs.fit_buckets(residuals, grid="free")
    assert torch.equal(blocked[0], cutoffs) and torch.equal(blocked[1], weights)


def _heavy_tailed_residuals() -> torch.Tensor:
    """2000 x 6 residuals with heavy tails (Laplace) and a spike at 0 (tokens that are their own
    centroid), as real residuals have."""
    gen = torch.Generator().manual_seed(6)
    u = torch.rand(2000, 6, generator=gen) - 0.5
    laplace = -0.1 * u.sign() * torch.log1p(-2 * u.abs())
    return laplace * (torch.rand(2000, 6, generator=gen) > 0.2)


def test_separable_buckets_zero_the_third_plane_exactly_at_the_same_error(monkeypatch) -> None:
    """`fit_buckets`' default (separable) values: w3 - w2 - w1 + w0 is exactly 0 in fp32 and in float64
    (the scan kernels' third bit plane, `residual2_plane_weights`), the values and cutoffs ascend, each
    value is on the least-squares fit of its buckets' members (the normal equations hold up to the
    grid's rounding), the squared error is within 2% of the unconstrained fit's, and working a block of
    dimensions at a time changes nothing."""
    from maxsim_kernels.maxsim_codes import residual2_plane_weights

    from maxsim_cli import codecs

    residuals = _heavy_tailed_residuals()
    cutoffs, weights = codecs.fit_buckets(residuals)
    assert bool((weights[:, 3] - weights[:, 2] == weights[:, 1] - weights[:, 0]).all())
    assert bool((residual2_plane_weights(weights)[2] == 0).all())
    assert bool((cutoffs.diff(dim=1) > 0).all()) and bool((weights.diff(dim=1) > 0).all())
    buckets = (residuals[:, :, None] >= cutoffs[None]).sum(dim=2)
    terms = torch.tensor(codecs._GRID_TERMS["separable"], dtype=torch.float64)
    for k in range(6):
        error = residuals[:, k].double() - weights[k].double()[buckets[:, k]]
        gradient = (error[:, None] * terms[buckets[:, k]]).sum(dim=0) / len(error)
        assert float(gradient.abs().max()) < 1e-6
    free = codecs.fit_buckets(residuals, grid="free")
    assert _bucket_error(residuals, cutoffs, weights) < 1.02 * _bucket_error(residuals, *free)
    monkeypatch.setattr(codecs, "BUCKET_BLOCK_ELEMS", 4 * 2000)
    blocked = codecs.fit_buckets(residuals)
    assert torch.equal(blocked[0], cutoffs) and torch.equal(blocked[1], weights)


def test_uniform_buckets_are_evenly_spaced_exactly() -> None:
    """`fit_buckets(grid="uniform")`: per dimension b0 + b D, the steps equal in fp32 and float64 (the
    third bit plane zero and D_1 = 2 D_0), each value the least-squares fit of its buckets' members, at a
    squared error between the free fit's and twice it."""
    from maxsim_cli import codecs

    gen = torch.Generator().manual_seed(21)
    residuals = torch.randn(4000, 6, generator=gen) * torch.linspace(0.05, 0.3, 6)
    residuals[:, 2] = residuals[:, 2].abs() ** 1.5  # a skewed dimension
    cutoffs, weights = codecs.fit_buckets(residuals, grid="uniform")
    steps = weights.diff(dim=1)
    assert bool((steps[:, 0] == steps[:, 1]).all()) and bool((steps[:, 1] == steps[:, 2]).all())
    planes = residual2_plane_weights(weights)
    assert bool((planes[1] == 2 * planes[0]).all()) and bool((planes[2] == 0).all())
    buckets = (residuals[:, :, None] >= cutoffs[None]).sum(dim=2)
    for k in range(6):
        error = residuals[:, k].double() - weights[k].double()[buckets[:, k]]
        terms = torch.stack([torch.ones_like(error), buckets[:, k].double()], dim=1)
        assert float(((error[:, None] * terms).sum(dim=0) / len(error)).abs().max()) < 1e-6
    free = _bucket_error(residuals, *codecs.fit_buckets(residuals, grid="free"))
    assert free <= _bucket_error(residuals, cutoffs, weights) < 2 * free
    with pytest.raises(ValueError, match="unknown bucket grid 'even'"):
        codecs.fit_buckets(residuals, grid="even")


@pytest.mark.parametrize("rows", [1, 5])
def test_fitted_buckets_of_constant_residuals_decode_them_exactly(rows) -> None:
    """A dimension whose residuals are all equal (a constant column, one token) has every bucket value at
    that residual: empty buckets get a value between their cutoffs, no NaN."""
    from maxsim_cli import codecs

    residuals = torch.tensor([[0.25, 0.0, -1.5]]).repeat(rows, 1)
    cutoffs, weights = codecs.fit_buckets(residuals)
    assert bool(torch.isfinite(cutoffs).all()) and bool(torch.isfinite(weights).all())
    assert _bucket_error(residuals, cutoffs, weights) == 0.0


def test_a_codebook_changed_in_place_is_scored_as_changed() -> None:
    """The kernels keep the codebook's part-major copy for the codebook tensor; an in-place change of the
    codebook makes a new copy, never a stale score."""
    gen = torch.Generator().manual_seed(13)
    queries, q_off = _packed([3, 5], 16, gen)
    docs, d_off = _packed([4, 9, 1], 16, gen)
    enc = _encoded("residual2", docs, gen)
    codes, book = enc["docs"], enc["codebook"]
    for _ in range(2):
        scores = maxsim_varlen(queries, q_off, codes, d_off, codebook=book, backend="triton")
        reference = maxsim_codes_reference(queries, q_off, codes, d_off, codebook=book)
        check_close(scores, reference, _bound(queries, q_off, {"docs": codes, "codebook": book}))
        book.centroids.mul_(-1)
        book.bucket_weights.add_(0.25)


def test_the_centroid_table_keeps_zeros_past_its_end_for_the_stream_kernel() -> None:
    """The stream kernel reads N columns of a table row from a query's first, unmasked (up to 64 past the
    last row's end): the table's storage holds TABLE_SLACK zeros past it, and the table itself is the
    float64 product rounded once."""
    from maxsim_kernels.maxsim_codes import TABLE_SLACK

    gen = torch.Generator().manual_seed(5)
    book, _ = _codebook(128, 37, gen, separable=True)
    q8, _ = quantized_queries(torch.randn(5, 128, generator=gen))
    table = residual2_query_tables(q8, book).by_centroid
    storage = torch.tensor([], dtype=torch.float32).set_(table.untyped_storage())
    assert table.is_contiguous() and table.storage_offset() == 0
    assert torch.equal(storage[table.numel() :], torch.zeros(TABLE_SLACK))
    base = book.centroids.double() + book.bucket_weights.double()[:, 0][None, :]
    assert torch.equal(table, (base @ q8.double().T).float())
