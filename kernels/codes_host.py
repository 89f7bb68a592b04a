"""MaxSim over documents stored as codes below 8 bits (`code_packing`): the entry points, their checks, the
query side, and the paths that need no Triton (the CPU's, and the torch backend's on any device).

Scoring. Queries are quantized per token to int8 exactly as for the int8 corpus
(`int8_host.quantize_per_token`: codes ``q8`` and scales ``s_q``), or given so with ``query_scales``:

    int4:       score(q, d) = sum_i s_q[i] * max_j (s_d[j] * (q8[i] . c[j]))     q8 . c in int32, exact
    residual2:  score(q, d) = sum_i s_q[i] * max_j (q8[i] . x[j])
    int2:       score(q, d) = sum_i (q[i] . offsets + s_w[i] * max_j (s_d[j] * (w8[i] . c[j])))

where for int2 ``w8, s_w`` are the int8 codes and scales of ``q * steps`` (`int2_queries`: the float query,
not its int8 codes, is weighted) and ``q[i] . offsets`` is float64 rounded once: ``q . x = q . offsets + s *
(q * steps) . c`` exactly, so int2 is scored by the int8 products, maxima and sums of int4, bit for bit
the int8 kernels' on the decoded odd values, plus one constant a query row.

The int4 max is over exact integers times one fp32 scale, so the max and its winner are those of the
float64 evaluation of the decoded values. `maxsim_kernels.reference.maxsim_codes_reference` evaluates the
decoded values in float64; the tests state each path's tolerance. A document with no tokens scores -inf. A
centroid id outside the codebook is never dereferenced: the Triton kernels score its document NaN; the CPU
path raises ValueError naming it.

Where the calls go. With the Triton backend (CUDA tensors) the scans run on the kernels of `maxsim_codes`
(Triton scan kernels, and on sm_90 the Gluon stream kernel), imported by the first call that launches one:
importing Triton takes ~0.15 s, which a CPU run of `maxsim score` on a 4-bit or 2-bit corpus does not pay.
On the CPU, int4 and int2 against a few query rows stream through `cpu.maxsim_int8_varlen_cpu` (a chunk
of codes decoded by a byte table on each worker; int4's products made from the nibbles without a decode);
everything else decodes a bounded block of tokens at a time and multiplies in torch (`_varlen_torch`,
`_candidates_torch`). int2 documents elsewhere, and int4 all pairs of many queries on sm_90, are decoded
to int8 rows a bounded chunk at a time and scored by the int8 entry points (`_decoded_varlen`: the decode's
bytes are ~1% of such a call's time; on CUDA the chunks alternate between two streams, so that neither the
decode nor the end of each launch waits on the tensor cores).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .code_packing import (
    RESIDUAL_BUCKETS,
    Int2Levels,
    Int2Queries,
    ResidualCodebook,
    check_codec_dim,
    code_width,
    decode_int4,
    decode_residual2,
    int2_values,
    residual2_ids,
)
from .cpu import int8_columns, int8_stream_applies, maxsim_int8_varlen_cpu, thread_buffer, worker_count
from .int8_host import (
    backend_and_offsets,
    candidate_runs,
    device_offsets,
    document_runs,
    maxsim_candidates_int8,
    maxsim_varlen_int8,
    quantize_per_token,
    segment_ids,
    segment_max,
    sum_rows_in_order,
)
from .validation import check_candidate_docs, host_offsets, resolve_backend

if TYPE_CHECKING:
    from .maxsim_codes import Tiles


def _kernels() -> ModuleType:
    """`maxsim_codes`: the Triton and Gluon scans and their launchers, imported by the first call that runs
    them."""
    from . import maxsim_codes

    return maxsim_codes


def _code_stream(
    codec: str,
    backend: str,
    given_q_off: torch.Tensor,
    q8: torch.Tensor,
    codes: torch.Tensor,
    codebook: ResidualCodebook | Int2Queries | None,
) -> Callable[..., torch.Tensor] | None:
    """The Gluon stream kernel's launch where it takes the scan (`maxsim_codes.code_stream`); None without
    the Triton backend, which imports no kernel."""
    if backend != "triton":
        return None
    return _kernels().code_stream(codec, given_q_off, q8, codes, codebook)


# CPU path: at most this many fp32 similarities (and decoded values) materialised at once (64 MiB).
_TORCH_BLOCK_ELEMS = 1 << 24


def int2_queries(
    queries: torch.Tensor,
    levels: Int2Levels,
    backend: str = "torch",
    query_offsets: torch.Tensor | None = None,
) -> Int2Queries:
    """The query side of int2 scores (module docstring): ``q . x = q . offsets + s * (q * steps) . c``, so
    the kernels of int8 score ``q * steps`` (quantized per token to int8, as any query) against the codes'
    odd values c with the tokens' scales s, and each query row adds ``q . offsets`` (float64, rounded
    once) to its maximum. With `query_offsets` (int64 [nq + 1], checked, on the queries' device) also each
    query's sum of its rows' offsets (`query_sums`, float64 sums rounded once); the Triton backend then
    makes everything in one launch: q8 and the scales `quantize_per_token`'s bits, the offsets' float64
    sums added in another order than torch's product and `_query_sums`."""
    if query_offsets is not None and resolve_backend(backend, queries.device) == "triton":
        return _kernels().int2_queries_triton(queries, levels, query_offsets)
    q = queries.float()
    weighted = q * levels.steps.to(q.device, torch.float32)
    q8, sq = quantize_per_token(weighted, backend=backend)
    row_offsets = (queries.double() @ levels.offsets.to(q.device, torch.float64)).float()
    sums = None if query_offsets is None else _query_sums(row_offsets, query_offsets)
    return Int2Queries(q8, sq, row_offsets, sums)


def _codec_of(doc_scales: torch.Tensor | None, codebook: ResidualCodebook | Int2Levels | None) -> str:
    if isinstance(codebook, Int2Levels):
        if doc_scales is None:
            raise ValueError("int2 codes take doc_scales (fp32 [T]) beside their levels")
        return "int2"
    if codebook is not None and doc_scales is not None:
        raise ValueError("uint8 codes take doc_scales (int4) or a codebook (residual2), not both")
    if codebook is None and doc_scales is None:
        raise ValueError(
            "uint8 documents are codes: give doc_scales (int4, fp32 [T]), codebook= (residual2) or both "
            "(int2: its Int2Levels)"
        )
    return "int4" if codebook is None else "residual2"


def _prepare(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    doc_scales: torch.Tensor | None,
    query_scales: torch.Tensor | None,
    codebook: ResidualCodebook | None,
    backend: str,
) -> tuple:
    """Validate; pick the codec and the backend; quantize float queries to int8.

    Returns (codec, dim, backend, q8, s_q, query_offsets, codes, s_d or None, doc_offsets, codebook); for
    int2, q8 and s_q are those of `int2_queries` and the last entry its `Int2Queries`."""
    codec = _codec_of(doc_scales, codebook)
    if not isinstance(docs, torch.Tensor) or docs.dtype != torch.uint8 or docs.dim() != 2:
        got = f"{docs.dtype} {tuple(docs.shape)}" if isinstance(docs, torch.Tensor) else type(docs)
        raise ValueError(f"{codec} MaxSim expects uint8 codes [tokens, width], got {got}")
    if not isinstance(queries, torch.Tensor) or queries.dim() != 2:
        raise ValueError(f"queries must be a 2-D [tokens, dim] tensor, got {type(queries)}")
    dim = queries.shape[1]
    check_codec_dim(codec, dim)
    if docs.shape[1] != code_width(codec, dim):
        raise ValueError(
            f"{codec} codes of dim {dim} are {code_width(codec, dim)} bytes a token, but the documents "
            f"have {docs.shape[1]}; the queries and the codes come from different encoders or codecs"
        )
    device = docs.device
    if queries.device != device:
        raise ValueError(f"queries are on {queries.device}, documents on {device}")
    if codec in ("int4", "int2"):
        assert doc_scales is not None
        if doc_scales.shape != (docs.shape[0],) or doc_scales.device != device:
            raise ValueError(
                f"doc_scales must be [{docs.shape[0]}] on {device}, got {tuple(doc_scales.shape)}"
            )
        doc_scales = doc_scales.float().contiguous()
    if codec == "int2":
        offsets, steps = codebook
        if offsets.shape != (dim,) or steps.shape != (dim,):
            raise ValueError(
                f"int2 levels {tuple(offsets.shape)} and {tuple(steps.shape)} do not fit dim {dim} "
                f"(expected [{dim}] each)"
            )
        codebook = Int2Levels(offsets.to(device, torch.float32), steps.to(device, torch.float32))
    elif codec == "residual2":
        assert codebook is not None
        cent, wts = codebook
        if cent.dim() != 2 or cent.shape[1] != dim or wts.shape != (dim, RESIDUAL_BUCKETS):
            raise ValueError(
                f"codebook centroids {tuple(cent.shape)} and bucket weights {tuple(wts.shape)} do not fit "
                f"dim {dim} (expected [K, {dim}] and [{dim}, {RESIDUAL_BUCKETS}])"
            )
        codebook = ResidualCodebook(
            cent.to(device, torch.float16).contiguous(), wts.to(device, torch.float32).contiguous()
        )
    backend, query_offsets, doc_offsets = backend_and_offsets(
        backend, device, query_offsets, queries.shape[0], doc_offsets, docs.shape[0]
    )
    if queries.dtype == torch.int8:
        if query_scales is None or query_scales.shape != (queries.shape[0],):
            raise ValueError(f"int8 queries need query_scales (fp32 [{queries.shape[0]}])")
        q8, sq = queries, query_scales.to(device).float()
    elif queries.is_floating_point():
        q8, sq = (None, None) if codec == "int2" else quantize_per_token(queries, backend=backend)
    else:
        raise ValueError(f"queries must be float16/bfloat16/float32 or int8, got {queries.dtype}")
    if codec == "int2":  # the int8 scan of q * steps (`int2_queries`), from the float queries
        given = queries if q8 is None else q8.float() * sq[:, None]
        codebook = int2_queries(given, codebook, backend=backend, query_offsets=query_offsets)
        q8, sq = codebook.q8, codebook.scales
    codes = docs if docs.stride(1) == 1 else docs.contiguous()
    q8 = q8 if q8.stride(1) == 1 else q8.contiguous()
    return codec, dim, backend, q8, sq.contiguous(), query_offsets, codes, doc_scales, doc_offsets, codebook


# ----------------------------------------------------------------------------------------------------------
# CPU path (torch ops, documents decoded a bounded block at a time; also runs on CUDA tensors)
# ----------------------------------------------------------------------------------------------------------


def _decoded_block(
    codes: torch.Tensor, rows: slice | torch.Tensor, doc_scales: torch.Tensor | None, codebook
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(decoded values as fp32 [t, dim], the int4 scales [t] or None) of the token rows ``rows``."""
    block = codes[rows]
    if codebook is None:
        assert doc_scales is not None
        return decode_int4(block).float(), doc_scales[rows]
    ids = residual2_ids(block)
    bad = (ids >= codebook.centroids.shape[0]).nonzero()
    if bad.numel():  # name the row of the whole codes tensor
        i = int(bad[0, 0])
        row = rows.start + i if isinstance(rows, slice) else int(rows[i])
        raise ValueError(
            f"document token row {row}: centroid id {int(ids[i])} outside the codebook's "
            f"{codebook.centroids.shape[0]} centroids; the codes and the codebook do not belong together"
        )
    return decode_residual2(block, codebook).float(), None


def _block_sims(
    q_float: torch.Tensor,
    codes: torch.Tensor,
    rows: slice | torch.Tensor,
    doc_scales: torch.Tensor | None,
    codebook: ResidualCodebook | None,
) -> torch.Tensor:
    """Similarities [query rows, t] of the query rows with the decoded token rows ``rows``: int4's integer
    products are exact in fp32 and take the one fp32 rounding of ``s_d * acc``, as in the kernels."""
    values, scales = _decoded_block(codes, rows, doc_scales, codebook)
    sim = q_float @ values.T
    if scales is not None:
        sim.mul_(scales)
    return sim


def _varlen_torch(
    q8: torch.Tensor,
    sq: torch.Tensor,
    query_offsets: torch.Tensor,
    codes: torch.Tensor,
    doc_scales: torch.Tensor | None,
    doc_offsets: torch.Tensor,
    codebook: ResidualCodebook | None,
) -> torch.Tensor:
    nq, nd = query_offsets.numel() - 1, doc_offsets.numel() - 1
    device = codes.device
    dim = q8.shape[1]
    q_float = q8.float()
    row_query = torch.repeat_interleave(torch.arange(nq, device=device), query_offsets.diff())
    d_host = doc_offsets.tolist()
    out = torch.empty((nq, nd), dtype=torch.float32, device=device)
    budget = max(1, _TORCH_BLOCK_ELEMS // max(1, q8.shape[0], dim))  # document tokens per block
    for first, last in document_runs(d_host, budget):
        sim = _block_sims(q_float, codes, slice(d_host[first], d_host[last]), doc_scales, codebook)
        segment, _ = segment_ids(doc_offsets[first : last + 1].diff())
        best, _ = segment_max(sim, segment, last - first, None)
        out[:, first:last] = torch.zeros((nq, last - first), device=device).index_add_(
            0, row_query, sq[:, None] * best
        )
    return out


def _candidates_torch(
    q8: torch.Tensor,
    sq: torch.Tensor,
    query_offsets: torch.Tensor,
    codes: torch.Tensor,
    doc_scales: torch.Tensor | None,
    doc_offsets: torch.Tensor,
    codebook: ResidualCodebook | None,
    candidate_offsets: torch.Tensor,
    candidate_docs: torch.Tensor,
) -> torch.Tensor:
    q_host = query_offsets.tolist()
    cand_host = candidate_offsets.tolist()
    nq = len(q_host) - 1
    dim = q8.shape[1]
    out = torch.empty((candidate_docs.numel(),), dtype=torch.float32, device=codes.device)
    cand_start = doc_offsets[candidate_docs]
    cand_len = doc_offsets[candidate_docs + 1] - cand_start
    len_host = cand_len.tolist()
    for query in range(nq):
        r0, r1 = q_host[query], q_host[query + 1]
        q_float = q8[r0:r1].float()
        budget = max(1, _TORCH_BLOCK_ELEMS // max(1, r1 - r0, dim))
        for first, last in candidate_runs(len_host, cand_host[query], cand_host[query + 1], budget):
            segment, local = segment_ids(cand_len[first:last])
            token = cand_start[first:last][segment] + local
            sim = _block_sims(q_float, codes, token, doc_scales, codebook)
            best, _ = segment_max(sim, segment, last - first, None)
            out[first:last] = sum_rows_in_order(sq[r0:r1, None] * best)
    return out


# ----------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------


def maxsim_varlen_codes(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    *,
    doc_scales: torch.Tensor | None = None,
    codebook: ResidualCodebook | None = None,
    query_scales: torch.Tensor | None = None,
    return_argmax: bool = False,
    allow_tf32: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Every query against every document stored as codes: fp32 scores [nq, nd].

    docs: uint8 codes [Td, width] with `doc_scales` fp32 [Td] (int4, width dim / 2) or `codebook` (a
    `ResidualCodebook`: residual2, width 4 + dim / 4); queries [Tq, dim] float (quantized per token to
    int8 here) or int8 with `query_scales`. Scores as in the module docstring; a document with no tokens
    scores -inf. backend: "auto" (Triton on CUDA, torch on CPU), "triton", "torch". Offsets are checked
    on the host except by the Triton path on CUDA tensors. `allow_tf32` has no effect (the products are
    int8 or fp16); `return_argmax` is not available for codes.
    """
    del allow_tf32
    if return_argmax:
        raise ValueError("return_argmax is not available for compressed documents; score the float corpus")
    codec, dim, backend, q8, sq, q_off, codes, sd, d_off, cb = _prepare(
        queries, query_offsets, docs, doc_offsets, doc_scales, query_scales, codebook, backend
    )
    stream = _code_stream(codec, backend, query_offsets, q8, codes, cb) if q_off.numel() == 2 else None
    if stream is not None:
        scores = stream(q8, sq, q_off, None, None, codes, sd, d_off)[None]
    elif codec in _BYTE_TABLES and backend == "torch" and int8_stream_applies(q8, codes.device):
        # int4 or int2 against a few query rows on the CPU: decoded a chunk at a time on each worker
        decoded = functools.partial(_decoded_rows, codec, codes)
        products = _Int4Products(codes, q8) if codec == "int4" else None  # used where products are integers
        scores = maxsim_int8_varlen_cpu(q8, sq, q_off.numpy(), decoded, sd, d_off.numpy(), products)
    elif (
        codec == "int2"
        or (codec == "int4" and backend == "torch" and codes.device.type == "cpu")
        or (
            codec == "int4"
            and backend == "triton"
            and q_off.numel() > 2
            and _kernels().int4_allpairs_on_hopper(query_offsets, doc_offsets, q8, codes)
        )
    ):  # int2's query sums added to each chunk's scores as they are placed
        sums = cb.query_sums if codec == "int2" else None
        return _decoded_varlen(codec, backend, query_offsets, doc_offsets, q8, sq, codes, sd, sums)
    else:
        if backend == "triton":
            return _kernels().launch_varlen(codec, dim, q8, sq, q_off, codes, sd, d_off, cb)
        return _varlen_torch(q8, sq, q_off, codes, sd, d_off, cb)
    if codec == "int2":  # each query row's q . offsets (`int2_queries`)
        scores.add_(cb.query_sums[:, None])
    return scores


def maxsim_candidates_codes(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor,
    candidate_docs: torch.Tensor,
    *,
    doc_scales: torch.Tensor | None = None,
    codebook: ResidualCodebook | None = None,
    query_scales: torch.Tensor | None = None,
    return_argmax: bool = False,
    allow_tf32: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Each query against its own candidates, documents stored as codes: fp32 scores [C].

    Query i's candidates are ``candidate_docs[candidate_offsets[i]:candidate_offsets[i+1]]`` (int64
    indices into doc_offsets, read in place). Inputs as in `maxsim_varlen_codes`. Candidate indices on the
    host, or with the torch backend, are checked (ValueError naming the entry); on the GPU with the
    Triton backend a bad index is never read through and scores NaN.
    """
    del allow_tf32
    if return_argmax:
        raise ValueError("return_argmax is not available for compressed documents; score the float corpus")
    codec, dim, backend, q8, sq, q_off, codes, sd, d_off, cb = _prepare(
        queries, query_offsets, docs, doc_offsets, doc_scales, query_scales, codebook, backend
    )
    nq, nd = q_off.numel() - 1, d_off.numel() - 1
    device = codes.device
    if not isinstance(candidate_docs, torch.Tensor) or candidate_docs.dtype != torch.int64:
        raise ValueError("candidate_docs must be a 1-D int64 tensor [C] of document indices")
    if not isinstance(candidate_offsets, torch.Tensor) or candidate_offsets.shape != (nq + 1,):
        raise ValueError(f"candidate_offsets must have nq+1 = {nq + 1} entries")
    check = backend == "torch" or device.type != "cuda"
    c_off = device_offsets(
        "candidate_offsets", candidate_offsets, candidate_docs.numel(), device, empty_ok=True, check=check
    )
    stream = _code_stream(codec, backend, query_offsets, q8, codes, cb)
    # the kernels guard each index on the GPU; int2's decoded path gathers the candidates' rows first
    guarded = backend == "triton" and (stream is not None or codec != "int2")
    if candidate_docs.numel():
        check_candidate_docs(candidate_docs, nd, guarded=guarded)
    c_docs = candidate_docs.to(device)
    if stream is not None:
        scores = stream(q8, sq, q_off, c_off, c_docs, codes, sd, d_off)
    elif codec == "int2":
        scores = _int2_decoded_candidates(backend, query_offsets, q8, sq, codes, sd, d_off, c_off, c_docs)
    elif backend == "triton":
        return _kernels().launch_candidates(codec, dim, q8, sq, q_off, codes, sd, d_off, cb, c_off, c_docs)
    else:
        return _candidates_torch(q8, sq, q_off, codes, sd, d_off, cb, c_off, c_docs)
    if codec == "int2":  # each candidate's query's sum of q . offsets (`int2_queries`)
        scores.add_(cb.query_sums[_owners(c_off, c_docs.numel())])
    return scores


def launch_varlen_with_tiles(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    tiles: Tiles | None,
    *,
    doc_scales: torch.Tensor | None = None,
    codebook: ResidualCodebook | None = None,
) -> torch.Tensor:
    """`maxsim_varlen_codes` on the Triton scan kernel, with the tile plan `tiles` in place of the planned
    one (None: the planned one; never the Gluon stream kernel): for tile sweeps and for timing the scan
    beside the stream kernel (`benchmarks/bench_codes.py`), not for production."""
    codec, dim, _, q8, sq, q_off, codes, sd, d_off, cb = _prepare(
        queries, query_offsets, docs, doc_offsets, doc_scales, None, codebook, "triton"
    )
    return _kernels().launch_varlen(codec, dim, q8, sq, q_off, codes, sd, d_off, cb, tiles=tiles)


# int4 and int2 all pairs (`_decoded_varlen`): documents decoded to int8 rows, this many bytes of buffers
# in all (on CUDA two of half the size, a chunk of documents each, on two streams), each chunk scored by
# the int8 kernels (on sm_90 the Gluon all-pairs kernel). A bound on the scratch memory, not a tuned size.
# 512 x 50K (8.0M tokens) one chunk after another in one buffer: 0.986-0.995x the int8 rate, the products
# of four launches 1.5 ms longer than int8's one (allpairs-profile-h100-9b3c1b4.json); on two streams, each
# launch's end filled by the next chunk's, 1.008-1.022x for int4 and int2 in four runs beside 0.986-0.999x
# in five of the one buffer, alternating processes on one H100 (allpairs-two-streams-h100-*.json,
# allpairs-one-buffer-h100-e76e3b0-*.json, codes-h100-9fd970e.json; benchmarks/results/codes/)
DECODE_CHUNK_BYTES = 256 << 20
# Decoded int8 rows on the CPU (int4 and int2 all pairs, `_decoded_varlen`; int2 candidates, a run of
# candidates at a time, `_int2_decoded_candidates`): at most this many bytes at once, and 1 MiB more a worker
# thread (a chunk's document groups, 2,048 padded tokens each, keep every worker busy), so that a batch's
# decoded rows (2-4x its codes' bytes) stay out of the run's host memory. A bound, not a tuned size: 64 x 150
# int2 candidates at --max-host-memory 128MiB grew 365-558 MiB with one decode a batch, 106-117 in runs
# (benchmarks/results/cpu/int2-rerank-memory-2core.txt).
CPU_DECODE_BYTES = 4 << 20


def cpu_decode_bytes() -> int:
    """The decoded rows the CPU holds at once (`CPU_DECODE_BYTES` and 1 MiB a worker)."""
    return CPU_DECODE_BYTES + worker_count() * (1 << 20)


def _byte_table(values_of_byte: Callable[[torch.Tensor], torch.Tensor]) -> np.ndarray:
    """Every byte's int8 values (`decode_int4` or `int2_values` of the byte) as one little-endian word a
    byte: a table that `np.take` decodes a chunk of codes with (the CPU stream; 3x faster than int4's torch
    ops on a 32K-token chunk)."""
    rows = values_of_byte(torch.arange(256, dtype=torch.uint8)[:, None]).numpy()
    return rows.view({2: np.uint16, 4: np.uint32}[rows.shape[1]])[:, 0].copy()


_BYTE_TABLES = {"int4": _byte_table(decode_int4), "int2": _byte_table(int2_values)}


def _decoded_rows(codec: str, codes: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
    """Rows t0 .. t1 - 1 of int4 or int2 ``codes`` (CPU) decoded to their int8 values, `decode_int4`'s or
    `int2_values`'s: a chunk of the CPU stream (`cpu.maxsim_int8_varlen_cpu`), valid until this thread
    decodes the next."""
    chunk = codes[t0:t1]
    table = _BYTE_TABLES[codec]
    out = thread_buffer(f"{codec}_byte_values", (chunk.shape[0], chunk.shape[1] * table.itemsize), torch.int8)
    # into the worker thread's buffer (`cpu.thread_buffer`): 1.02 against 1.20 ms a new array, int2's
    # 32K-token chunk; "wrap", which a byte never needs (256 entries), spares the bounds check's copy
    np.take(table, chunk.numpy(), out=out.numpy().view(table.dtype), mode="wrap")
    return out


class _Int4Products:
    """The int32 products of rows of int4 codes (CPU) with int8 query rows ``q8`` [rows, dim], made
    without interleaving the codes' values (`cpu.maxsim_int8_varlen_cpu`'s ``int_products``): the low
    nibbles (values 2m) sign-extended by two shifts into the first half of each row of a buffer, the high
    ones (2m + 1) by one into the second, and multiplied with the query's even columns followed by its odd
    ones: exactly `decode_int4`'s values times q8. A 32K-token chunk at d = 128 against 32 rows on one
    thread: 1.8 ms with the product, against 3.2 ms for `_decoded_rows` (a table's values, interleaved)
    and 0.8 for the product after it. The buffers are the worker thread's (`cpu.thread_buffer`), not
    fresh tensors each chunk."""

    def __init__(self, codes: torch.Tensor, q8: torch.Tensor) -> None:
        self.codes = codes
        self.columns = int8_columns(torch.cat([q8[:, 0::2], q8[:, 1::2]], dim=1))

    def __call__(self, t0: int, t1: int, out: torch.Tensor) -> torch.Tensor:
        chunk = self.codes[t0:t1]
        rows, width = chunk.shape
        shifted = thread_buffer("int4_shifted", (rows, width), torch.uint8)
        values = thread_buffer("int4_values", (rows, 2 * width), torch.int8)
        torch.bitwise_left_shift(chunk, 4, out=shifted)
        torch.bitwise_right_shift(shifted.view(torch.int8), 4, out=values[:, :width])  # arithmetic shifts
        torch.bitwise_right_shift(chunk.view(torch.int8), 4, out=values[:, width:])
        return torch._int_mm(values, self.columns, out=out)


def _int8_values(codec: str, backend: str, codes: torch.Tensor, out: torch.Tensor) -> None:
    """int4 or int2 ``codes`` [T, width] decoded into ``out`` [T, dim] as their int8 values (`decode_int4`'s,
    `int2_values`'): by the Triton decode with the Triton backend, on the CPU by the byte table (no
    temporaries: those functions' int16 steps took ~8 bytes a value, 430-770 MiB for the decoded candidates of
    an int2 rerank batch), else by those torch functions."""
    if backend == "triton":
        gpu = _kernels()
        (gpu.int4_to_int8 if codec == "int4" else gpu.int2_to_int8)(codes, out)
    elif codes.device.type == "cpu" and out.is_contiguous():
        table = _BYTE_TABLES[codec]
        np.take(table, codes.contiguous().numpy(), out=out.numpy().view(table.dtype), mode="wrap")
    else:
        out.copy_((decode_int4 if codec == "int4" else int2_values)(codes))


def _odd_values(codes: torch.Tensor, backend: str) -> torch.Tensor:
    """int2 codes' odd values (int8, `_int8_values`)."""
    out = torch.empty((codes.shape[0], 4 * codes.shape[1]), dtype=torch.int8, device=codes.device)
    _int8_values("int2", backend, codes, out)
    return out


def _document_chunks(d_host: np.ndarray, chunk: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Runs of whole documents [first, stop) of at most ``chunk`` tokens (one document where it alone is
    longer) over the host offsets ``d_host``, with their offsets from their first token (int64, host)."""
    for first, stop in document_runs(d_host, chunk):
        yield first, stop, torch.from_numpy(np.ascontiguousarray(d_host[first : stop + 1] - d_host[first]))


def _owners(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """The segment of each of ``total`` entries of consecutive segments bounded by ``offsets`` [n + 1] (their
    count given: no wait for the device)."""
    segments = torch.arange(offsets.numel() - 1, device=offsets.device)
    return torch.repeat_interleave(segments, offsets.diff(), output_size=total)


def _query_sums(row_values: torch.Tensor, q_off: torch.Tensor) -> torch.Tensor:
    """Each query's sum of its rows' values (fp32 [nq], summed in float64): int2's ``sum_i q_i . offsets``."""
    sums = torch.zeros(q_off.numel() - 1, dtype=torch.float64, device=row_values.device)
    return sums.index_add_(0, _owners(q_off, row_values.numel()), row_values.double()).float()


def _decoded_varlen(
    codec: str,
    backend: str,
    given_q_off: torch.Tensor,
    given_d_off: torch.Tensor,
    q8: torch.Tensor,
    sq: torch.Tensor,
    codes: torch.Tensor,
    sd: torch.Tensor,
    query_sums: torch.Tensor | None = None,
) -> torch.Tensor:
    """All pairs of int4 or int2 codes as the int8 kernels score their values, plus ``query_sums[i]`` for
    query i where given (int2's sums of the query rows' offsets, `int2_queries`): the documents decoded
    into reused buffers of int8 rows a chunk of whole documents at a time (`_int8_values`;
    `DECODE_CHUNK_BYTES` in all, or one document alone where it is longer), each chunk scored by
    `maxsim_varlen_int8` with its scales and host offsets (the Gluon all-pairs kernel's plan reads them
    there): its exact integer products and maxima, bit for bit. Where one chunk holds every document its
    scores are the answer as they are; documents with no tokens score -inf. On CUDA, several chunks
    alternate between two buffers and two streams (`_chunk_streams`), so that one chunk's decode and the
    start of its products fill the end of the previous chunk's launch."""
    d_host = host_offsets("doc_offsets", given_d_off, codes.shape[0])
    nq, nd, dim = given_q_off.numel() - 1, len(d_host) - 1, q8.shape[1]
    total, longest = int(d_host[-1]), int(np.diff(d_host).max(initial=0))
    bound = cpu_decode_bytes() if codes.device.type == "cpu" else DECODE_CHUNK_BYTES
    if total * dim <= bound or nd == 1:  # one chunk: one buffer, the scores as they are
        scores = _scored_chunk(codec, backend, given_q_off, q8, sq, codes, sd, d_host, (0, nd), None)
        return scores if query_sums is None else scores.add_(query_sums[:, None])
    streams = _chunk_streams(codes.device)
    chunk = max(1, bound // (len(streams) * dim))  # a buffer a stream, in the same bound
    buffers = [torch.empty((min(total, max(chunk, longest)), dim), dtype=torch.int8, device=codes.device)
               for _ in streams]  # fmt: skip
    out = torch.empty((nq, nd), dtype=torch.float32, device=codes.device)
    side = streams[1:]
    for stream in side:  # the side stream starts once its inputs, buffers and output are made
        stream.wait_stream(streams[0])
    try:
        for i, (first, stop, offsets) in enumerate(_document_chunks(d_host, chunk)):
            with _on_stream(streams[i % len(streams)]):
                part = _scored_chunk(codec, backend, given_q_off, q8, sq, codes, sd, d_host, (first, stop),
                                     buffers[i % len(streams)], offsets)  # fmt: skip
                if query_sums is None:
                    out[:, first:stop] = part
                else:  # the sums added in the copy, on the chunk's stream
                    torch.add(part, query_sums[:, None], out=out[:, first:stop])
    finally:  # also on an error (out of memory): the buffers are not freed under the side stream's work
        for stream in side:
            streams[0].wait_stream(stream)
    return out


def _scored_chunk(
    codec: str,
    backend: str,
    given_q_off: torch.Tensor,
    q8: torch.Tensor,
    sq: torch.Tensor,
    codes: torch.Tensor,
    sd: torch.Tensor,
    d_host: np.ndarray,
    documents: tuple[int, int],
    buffer: torch.Tensor | None,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Documents [first, stop) of `_decoded_varlen` decoded into ``buffer`` (a new one where None) and
    scored: fp32 [nq, stop - first], -inf where they have no tokens. ``offsets``: theirs from their first
    token (host), where the caller has them."""
    first, stop = documents
    t0, t1 = int(d_host[first]), int(d_host[stop])
    if t1 == t0:
        return torch.full((given_q_off.numel() - 1, stop - first), float("-inf"), dtype=torch.float32,
                          device=codes.device)  # fmt: skip
    if offsets is None:
        offsets = torch.from_numpy(np.ascontiguousarray(d_host[first : stop + 1] - t0))
    if buffer is None:
        buffer = torch.empty((t1 - t0, q8.shape[1]), dtype=torch.int8, device=codes.device)
    values = buffer[: t1 - t0]
    _int8_values(codec, backend, codes[t0:t1], values)
    return maxsim_varlen_int8(q8, given_q_off, values, offsets, doc_scales=sd[t0:t1], query_scales=sq,
                              backend=backend)  # fmt: skip


def _chunk_streams(device: torch.device) -> tuple:
    """The streams `_decoded_varlen` alternates its chunks between: on CUDA the current stream and one side
    stream of the device (from torch's pool), elsewhere one placeholder."""
    if device.type != "cuda":
        return (None,)
    return torch.cuda.current_stream(device), torch.cuda.Stream(device)


def _on_stream(stream: Any) -> Any:
    """``torch.cuda.stream(stream)``, or no change where ``stream`` is None (the CPU)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def _int2_decoded_candidates(
    backend: str,
    given_q_off: torch.Tensor,
    q8: torch.Tensor,
    sq: torch.Tensor,
    codes: torch.Tensor,
    sd: torch.Tensor,
    d_off: torch.Tensor,
    c_off: torch.Tensor,
    c_docs: torch.Tensor,
) -> torch.Tensor:
    """int2 candidates without the query rows' offsets, decoded: the candidates' documents (indices checked)
    gathered once each, decoded to their odd values and scored by the int8 candidates kernels. On the CPU
    a run of candidates at a time, whose rows hold at most `cpu_decode_bytes` decoded."""

    def scored(run_off: torch.Tensor, run_docs: torch.Tensor) -> torch.Tensor:
        unique, local = torch.unique(run_docs, return_inverse=True)
        starts = d_off[unique]
        lengths = d_off[unique + 1] - starts
        offsets = torch.zeros(unique.numel() + 1, dtype=torch.int64, device=codes.device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        segment, within = segment_ids(lengths)
        rows = starts[segment] + within
        return maxsim_candidates_int8(
            q8, given_q_off, _odd_values(codes[rows], backend), offsets, run_off, local,
            doc_scales=sd[rows], query_scales=sq, backend=backend,
        )  # fmt: skip

    if c_docs.numel() == 0:
        return torch.empty(0, dtype=torch.float32, device=codes.device)
    if codes.device.type != "cpu":
        return scored(c_off, c_docs)
    scores = torch.empty(c_docs.numel(), dtype=torch.float32)
    lengths = (d_off[c_docs + 1] - d_off[c_docs]).numpy()
    run_tokens = max(1, cpu_decode_bytes() // (4 * codes.shape[1]))
    for a, b in document_runs(np.concatenate([[0], np.cumsum(lengths)]), run_tokens):
        # each query's candidates within the run (many have none)
        scores[a:b] = scored(c_off.clamp(a, b) - a, c_docs[a:b])
    return scores


def quantized_queries(queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 codes and scales the kernels score float queries with (for references and tests)."""
    return quantize_per_token(queries, backend="torch")


__all__ = [
    "int2_queries",
    "maxsim_varlen_codes",
    "maxsim_candidates_codes",
    "launch_varlen_with_tiles",
    "quantized_queries",
]
