"""The CPU's streamed int8 path (`maxsim_kernels.cpu.maxsim_int8_varlen_cpu`: int8 documents, int4 and int2
codes against a few query rows) and its document groups for many query rows against int8 documents
(`maxsim_int8_docs_cpu`), with integer and with fp32 products, give the bits of the blocked torch paths
they replaced, on ragged documents with empty and one-token ones, several queries, a query token of zeros,
and a query scale of 0 (its product with an empty document's -inf is NaN, in both)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from maxsim_kernels import code_packing, codes_host, int8_host, maxsim_varlen
from maxsim_kernels.cpu import int8_stream_applies
from maxsim_kernels.int8_host import quantize_per_token


def _ragged(gen: torch.Generator, n: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.randint(1, 90, (n,), generator=gen)
    lengths[[0, 7, n - 1]] = 0  # empty documents, first and last among them
    lengths[[3, 11]] = 1
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    x = torch.randn(int(offsets[-1]), dim, generator=gen)
    return x, offsets


def _queries(gen: torch.Generator, lengths: list[int], dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randn(sum(lengths), dim, generator=gen)
    q[1] = 0.0  # a token of zeros
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return q, offsets


@pytest.mark.parametrize("integers", [True, False], ids=["int-products", "fp32-products"])
@pytest.mark.parametrize("dim", [128, 40])
@pytest.mark.parametrize("q_lengths", [[32], [5, 1, 12]])
def test_streamed_int8_paths_are_the_blocked_paths_bitwise(dim, q_lengths, integers, monkeypatch):
    """Both ways of the chunks' products (`cpu.int8_products`: int32 products, int4's from its nibbles
    without its values; or the values upcast to fp32) give the blocked paths' bits."""
    from maxsim_kernels import cpu

    # chunks of ~700 tokens: many, documents across their edges
    chunk_bytes = 700 * cpu._stream_token_bytes(dim, sum(q_lengths), torch.float32)
    monkeypatch.setattr(cpu, "_STREAM_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(cpu, "_INT8_PRODUCT", integers)
    gen = torch.Generator().manual_seed(5)
    x, d_off = _ragged(gen, 300, dim)
    q, q_off = _queries(gen, q_lengths, dim)
    q8, sq = quantize_per_token(q)
    assert int8_stream_applies(q8, x.device)

    d8, s8 = quantize_per_token(x)
    streamed = maxsim_varlen(q, q_off, d8, d_off, doc_scales=s8)
    blocked = int8_host._varlen_torch(q8, sq, q_off, d8, s8, d_off, False)[0]
    assert torch.allclose(streamed, blocked, equal_nan=True, atol=0, rtol=0)  # bitwise, NaN where NaN
    assert streamed[:, 0].isneginf().all()  # an empty document
    zero_scale = sq.clone()
    zero_scale[1] = 0.0
    streamed = int8_host.maxsim_varlen_int8(q8, q_off, d8, d_off, doc_scales=s8, query_scales=zero_scale)
    blocked = int8_host._varlen_torch(q8, zero_scale, q_off, d8, s8, d_off, False)[0]
    assert torch.allclose(streamed, blocked, equal_nan=True, atol=0, rtol=0)
    assert streamed[0, 0].isnan() and streamed[0, 1:].isfinite().any()

    c4, s4 = code_packing.encode_int4(x)
    streamed = maxsim_varlen(q, q_off, c4, d_off, doc_scales=s4)
    blocked = codes_host._varlen_torch(q8, sq, q_off, c4, s4, d_off, None)
    assert torch.allclose(streamed, blocked, equal_nan=True, atol=0, rtol=0)

    levels = code_packing.Int2Levels(x.mean(0), x.std(0) / 2)
    c2, s2 = code_packing.encode_int2(x, levels)
    streamed = maxsim_varlen(q, q_off, c2, d_off, doc_scales=s2, codebook=levels)
    side = codes_host.int2_queries(q, levels, query_offsets=q_off)
    blocked = int8_host._varlen_torch(side.q8, side.scales, q_off, code_packing.int2_values(c2), s2, d_off,
                                        False)[0]  # fmt: skip
    blocked += side.query_sums[:, None]
    assert torch.allclose(streamed, blocked, equal_nan=True, atol=0, rtol=0)


def test_many_query_rows_keep_the_blocked_path():
    q8 = torch.zeros(129, 128, dtype=torch.int8)
    assert not int8_stream_applies(q8, torch.device("cpu"))
    assert not int8_stream_applies(q8[:1], torch.device("meta"))


def test_byte_tables_decode_as_the_torch_decoders():
    codes = torch.arange(256, dtype=torch.uint8).repeat(3, 1).T.contiguous()  # every byte, [256, 3]
    assert torch.equal(codes_host._decoded_rows("int4", codes, 0, 256), code_packing.decode_int4(codes))
    part = codes_host._decoded_rows("int2", codes, 1, 200)
    assert torch.equal(part, code_packing.int2_values(codes[1:200]))
    assert codes_host._decoded_rows("int2", codes, 7, 7).shape == (0, 12)


@pytest.mark.parametrize("dim", [128, 40, 2])
def test_int4_products_from_the_nibbles_are_the_decoded_values_products(dim):
    """`_Int4Products` (the low nibbles, then the high ones, against the query's even columns, then its odd
    ones) is `decode_int4`'s values times the query rows, exactly, for every byte and the extreme query
    codes, at any chunk (rows t0 .. t1 - 1)."""
    gen = torch.Generator().manual_seed(3)
    every_byte = torch.arange(256, dtype=torch.uint8)
    codes = every_byte[torch.randint(0, 256, (300, dim // 2), generator=gen)]
    codes[:256, 0] = every_byte
    q8 = torch.randint(-128, 128, (7, dim), generator=gen, dtype=torch.int8)
    q8[0], q8[1] = 127, -128
    want = code_packing.decode_int4(codes).int() @ q8.int().T
    products = codes_host._Int4Products(codes, q8)
    for t0, t1 in ((0, 300), (5, 6), (17, 260)):
        out = torch.empty(t1 - t0, 7, dtype=torch.int32)
        assert torch.equal(products(t0, t1, out), want[t0:t1])


def test_int8_products_follow_the_cpu_flags(monkeypatch):
    """Integer products where /proc/cpuinfo lists VNNI or AMX (`_INT8_FLAGS`), fp32 ones elsewhere; the
    module's switch overrides the flags."""
    from maxsim_kernels import cpu

    monkeypatch.setattr(cpu, "_INT8_PRODUCT", None)
    assert cpu.int8_products(128) == cpu._cpu_has_int8_dot()
    monkeypatch.setattr(cpu, "_INT8_PRODUCT", False)
    assert not cpu.int8_products(128)
    monkeypatch.setattr(cpu, "_INT8_PRODUCT", True)
    assert cpu.int8_products(2) and not cpu.int8_products(1)  # one column: fp32 products


@pytest.mark.parametrize("integers", [True, False])
def test_int8_documents_of_one_and_two_dims_stream_as_the_blocked_path(integers, monkeypatch):
    """int8 rows of one value (whose products stay in fp32) and of two, and int4 codes of two values (one
    byte a token), bitwise the blocked paths."""
    from maxsim_kernels import cpu

    monkeypatch.setattr(cpu, "_INT8_PRODUCT", integers)
    gen = torch.Generator().manual_seed(8)
    for dim in (1, 2):
        x, d_off = _ragged(gen, 40, dim)
        q, q_off = _queries(gen, [6], dim)
        q8, sq = quantize_per_token(q)
        d8, s8 = quantize_per_token(x)
        streamed = maxsim_varlen(q, q_off, d8, d_off, doc_scales=s8)
        blocked = int8_host._varlen_torch(q8, sq, q_off, d8, s8, d_off, False)[0]
        assert torch.allclose(streamed, blocked, equal_nan=True, atol=0, rtol=0), dim
    c4, s4 = code_packing.encode_int4(x)
    streamed = maxsim_varlen(q, q_off, c4, d_off, doc_scales=s4)
    blocked = codes_host._varlen_torch(q8, sq, q_off, c4, s4, d_off, None)
    assert torch.allclose(streamed, blocked, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("integers", [True, False], ids=["int-products", "fp32-products"])
@pytest.mark.parametrize("dim", [128, 40, 1])
@pytest.mark.parametrize("q_lengths", [[32] * 9 + [1, 5], [32] * 20 + [7]])
def test_many_query_rows_in_document_groups_are_the_blocked_path_bitwise(
    dim, q_lengths, integers, monkeypatch
):
    """int8 documents against more query rows than the stream takes (`maxsim_int8_docs_cpu`: the float
    path's document groups over the workers; 294 rows, and 647 in two blocks of query rows) give the
    blocked path's bits, with empty and one-token documents, a token of zeros, and a query scale of 0 (NaN
    against an empty document, in both)."""
    from maxsim_kernels import cpu

    monkeypatch.setattr(cpu, "_INT8_PRODUCT", integers)
    monkeypatch.setattr(cpu, "_GROUP_TOKENS", 256)  # many groups
    gen = torch.Generator().manual_seed(6)
    x, d_off = _ragged(gen, 300, dim)
    q, q_off = _queries(gen, q_lengths, dim)
    q8, sq = quantize_per_token(q)
    d8, s8 = quantize_per_token(x)
    assert not int8_stream_applies(q8, x.device)
    for scales in (sq, torch.where(torch.arange(len(sq)) == 1, 0.0, sq)):
        grouped = int8_host.maxsim_varlen_int8(q8, q_off, d8, d_off, doc_scales=s8, query_scales=scales)
        blocked = int8_host._varlen_torch(q8, scales, q_off, d8, s8, d_off, False)[0]
        assert torch.allclose(grouped, blocked, equal_nan=True, atol=0, rtol=0)
    assert grouped[0, 0].isnan() and grouped[1:, 0].isneginf().all()


@pytest.mark.parametrize("integers", [True, False], ids=["int-products", "fp32-products"])
@pytest.mark.parametrize("path", ["all-pairs", "query-groups", "document-units"])
@pytest.mark.parametrize("workers", [False, True], ids=["one-group", "small-groups-on-2-workers"])
@pytest.mark.parametrize("dim", [128, 40, 2])
def test_int8_candidates_on_the_cpu_are_the_torch_rerank_bitwise(dim, workers, path, integers, monkeypatch):
    """`maxsim_int8_candidates_cpu` on each of its paths (every query against every listed document where
    the candidates are dense; groups of one query's candidates over the workers; documents once against
    every query that lists them, for queries of few candidates) gives `_candidates_torch`'s bits:
    candidates that are empty and one-token documents, a document listed twice by one query and by many,
    queries without candidates (first and between) and of one token, a query scale of 0 (NaN against an
    empty document)."""
    from maxsim_kernels import cpu

    monkeypatch.setattr(cpu, "_INT8_PRODUCT", integers)
    if workers:
        monkeypatch.setattr(cpu, "_QUERY_GROUP_BYTES", 3000)
        monkeypatch.setattr(cpu, "_RERANK_GROUP_BYTES", 3000)
        monkeypatch.setattr(cpu, "_worker_count", lambda: 2)
    dense = path == "all-pairs"
    monkeypatch.setattr(cpu, "_INT8_QUERY_GROUP_MIN_PAIRS", 0 if path == "query-groups" else 10**9)
    units, real_units = [], cpu._rerank_by_document
    monkeypatch.setattr(cpu, "_rerank_by_document", lambda *a, **k: (units.append(1), real_units(*a, **k)))
    monkeypatch.setattr(cpu, "DENSE_CANDIDATES", 0.0 if dense else float("inf"))
    monkeypatch.setattr(cpu, "DENSE_SHARING", 0.0)
    original, taken = cpu._score_docs, []

    def recording(*args, **kwargs):  # the document groups: the all-pairs path alone calls them here
        taken.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(cpu, "_score_docs", recording)
    gen = torch.Generator().manual_seed(11)
    x, d_off = _ragged(gen, 120, dim)
    q, q_off = _queries(gen, [5, 1, 12, 32, 3, 7], dim)
    q8, sq = quantize_per_token(q)
    sq[50] = 0.0  # a token of query 4, whose first candidate is empty
    d8, s8 = quantize_per_token(x)
    lists = [
        [],
        [0, 3, 3, 50, 7],
        [],
        [int(i) for i in torch.randperm(120, generator=gen)[:90]],
        [0, 11, 119],
        [3],
    ]
    c_off = torch.tensor([0] + [len(x) for x in lists]).cumsum(0)
    c_docs = torch.tensor([d for x in lists for d in x], dtype=torch.int64)
    got = int8_host.maxsim_candidates_int8(
        q8, q_off, d8, d_off, c_off, c_docs, doc_scales=s8, query_scales=sq
    )
    want = int8_host._candidates_torch(q8, sq, q_off, d8, s8, d_off, c_off, c_docs, False)[0]
    assert torch.allclose(got, want, equal_nan=True, atol=0, rtol=0)  # bitwise, NaN where NaN
    assert got[int(c_off[4])].isnan() and got[int(c_off[1])].isneginf()  # empty document 0
    assert bool(taken) == dense and bool(units) == (path == "document-units")


def test_dense_listing_needs_the_fraction_and_the_sharing(monkeypatch):
    """All pairs where the candidates hold the fraction of the pairs of their queries and listed documents
    and list each document often enough on average; one query's own list is not shared. The listing is
    the distinct documents and each pair's column among them."""
    from maxsim_kernels import cpu

    def dense(pair_doc, num_queries, fraction, sharing):
        monkeypatch.setattr(cpu, "DENSE_CANDIDATES", fraction)
        monkeypatch.setattr(cpu, "DENSE_SHARING", sharing)
        return cpu.dense_listing(pair_doc, num_queries)

    every = np.tile(np.arange(10), 4)  # 4 queries, each listing all 10 documents
    listed, column = dense(every, 4, 0.9, 4.0)
    assert np.array_equal(listed, np.arange(10)) and np.array_equal(listed[column], every)
    assert dense(every, 4, 0.9, 5.0) is None  # listed 4 times each, not 5
    assert dense(np.arange(10), 1, 0.9, 4.0) is None  # one query: density 1, nothing shared
    # 3 queries: all 10 documents, the first 5, the last 5: 20 of 30 pairs, each document listed twice
    two_thirds = np.concatenate([np.arange(10), np.arange(5), np.arange(5, 10)])
    assert dense(two_thirds, 3, 0.25, 2.0) is not None and dense(two_thirds, 3, 0.9, 2.0) is None
