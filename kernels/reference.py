"""The float64 MaxSim reference: similarities materialised in bounded chunks, the obvious way.

    score(q, d)     = sum_i max_j <q_i, d_j>          i over the query's tokens, j over the document's
    argmax(q_i, d)  = min { j : <q_i, d_j> = max_j' <q_i, d_j'> }     (ties go to the lowest index)

It shares no code with the fast paths: documents are gathered chunk by chunk into a padded
[n, L_max, dim] block in `dtype` (float64 by default), multiplied with a block of query tokens, padding
is masked with -inf (never 0, which would change the max of all-negative similarities), and
`Tensor.max(dim)` (which returns the first maximal index) gives the max and argmax. int8 documents are
dequantized exactly (`d8 * s_d` in float64) and the float queries are used as given, so against an int8
kernel the difference also holds the kernel's on-the-fly query quantization.

A document with no tokens scores -inf and has argmax -1. Memory: at most `max_elements` similarities
(128 MB in float64 by default) plus one padded chunk of documents, whatever the corpus size.
"""

from __future__ import annotations

import numpy as np
import torch

from .validation import check_candidates, check_inputs

_MAX_CHUNK_TOKENS = 1 << 16  # padded document tokens per chunk (bounds the gathered block)


def _doc_values(docs: torch.Tensor, rows: torch.Tensor, doc_scales: torch.Tensor | None, dtype: torch.dtype):
    block = docs.index_select(0, rows).to(dtype)
    if doc_scales is not None:
        block = block * doc_scales.index_select(0, rows).to(dtype)[:, None]
    return block


def maxsim_reference(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float64,
    return_argmax: bool = False,
    doc_scales: torch.Tensor | None = None,
    max_elements: int = 1 << 24,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Every query against every document, computed in `dtype` on the documents' device.

    Returns scores [nq, nd] in `dtype` and, with `return_argmax`, int32 [Tq, nd]: for each query token and
    document, the index within the document of the first token reaching the max (-1 for empty documents).
    """
    layout = check_inputs(
        queries, query_offsets, docs, doc_offsets, doc_scales=doc_scales, allow_float64=True
    )
    device = docs.device
    nq, nd, tq = layout.num_queries, layout.num_docs, queries.shape[0]
    scores = torch.zeros(nq, nd, dtype=dtype, device=device)
    argmax = torch.full((tq, nd), -1, dtype=torch.int32, device=device) if return_argmax else None
    if nd == 0 or nq == 0:
        return (scores, argmax) if return_argmax else scores
    q = queries.to(device=device, dtype=dtype)
    token_query = torch.from_numpy(np.repeat(np.arange(nq), layout.q_lens)).to(device)
    d_lens, d_starts = layout.d_lens, layout.d_offsets[:-1]
    max_len = max(layout.max_doc_len, 1)
    docs_per_chunk = max(1, _MAX_CHUNK_TOKENS // max_len)
    for c0 in range(0, nd, docs_per_chunk):
        c1 = min(nd, c0 + docs_per_chunk)
        lens = d_lens[c0:c1]
        width = int(lens.max())
        if width == 0:
            scores[:, c0:c1] = -torch.inf
            continue
        # padded gather: position l of document n reads token min(l, len-1) and is masked when l >= len
        pos = np.arange(width)[None, :]
        rows = d_starts[c0:c1, None] + np.minimum(pos, np.maximum(lens[:, None] - 1, 0))
        rows = np.minimum(rows, docs.shape[0] - 1)  # an empty document may start at the end (masked anyway)
        valid = torch.from_numpy(pos < lens[:, None]).to(device)  # [n, width]
        block = _doc_values(docs, torch.from_numpy(rows.reshape(-1)).to(device), doc_scales, dtype)
        n = c1 - c0
        rows_per_step = max(1, max_elements // (n * width))
        for r0 in range(0, tq, rows_per_step):
            r1 = min(tq, r0 + rows_per_step)
            sim = (q[r0:r1] @ block.T).view(r1 - r0, n, width)
            sim = sim.masked_fill(~valid[None], -torch.inf)
            best, where = sim.max(dim=2)  # first maximal index on ties
            scores[:, c0:c1].index_add_(0, token_query[r0:r1], best)
            if argmax is not None:
                argmax[r0:r1, c0:c1] = torch.where(valid[:, 0][None], where, -1).to(torch.int32)
    return (scores, argmax) if return_argmax else scores


def maxsim_candidates_reference(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor,
    candidate_docs: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float64,
    return_argmax: bool = False,
    doc_scales: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Query i against its own candidates candidate_docs[candidate_offsets[i]:candidate_offsets[i+1]].

    Returns scores [C] in `dtype` and, with `return_argmax`, int32 [C, max_query_len] (-1 past a query's
    length and for empty documents). Each query's candidates are gathered into a packed block and scored
    with `maxsim_reference`.
    """
    layout = check_inputs(
        queries, query_offsets, docs, doc_offsets, doc_scales=doc_scales, allow_float64=True
    )
    c_off, c_docs = check_candidates(candidate_offsets, candidate_docs, layout.num_queries, layout.num_docs)
    device = docs.device
    num_c = len(c_docs)
    scores = torch.zeros(num_c, dtype=dtype, device=device)
    argmax = torch.full((num_c, layout.max_query_len), -1, dtype=torch.int32, device=device)
    for i in range(layout.num_queries):
        c0, c1 = int(c_off[i]), int(c_off[i + 1])
        if c0 == c1:
            continue
        picked = c_docs[c0:c1]
        lens = layout.d_lens[picked]
        sub_off = np.zeros(len(picked) + 1, dtype=np.int64)
        np.cumsum(lens, out=sub_off[1:])
        rows = np.concatenate([np.arange(layout.d_offsets[d], layout.d_offsets[d + 1]) for d in picked])
        rows_t = torch.from_numpy(rows.astype(np.int64)).to(device)
        sub_docs = docs.index_select(0, rows_t)
        sub_scales = doc_scales.index_select(0, rows_t) if doc_scales is not None else None
        q0, q1 = int(layout.q_offsets[i]), int(layout.q_offsets[i + 1])
        s, a = maxsim_reference(
            queries[q0:q1],
            torch.tensor([0, q1 - q0]),
            sub_docs,
            torch.from_numpy(sub_off),
            dtype=dtype,
            return_argmax=True,
            doc_scales=sub_scales,
        )
        scores[c0:c1] = s[0]
        argmax[c0:c1, : q1 - q0] = a.T
    return (scores, argmax) if return_argmax else scores


def maxsim_codes_reference(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    *,
    doc_scales: torch.Tensor | None = None,
    codebook: tuple[torch.Tensor, torch.Tensor] | None = None,
    query_scales: torch.Tensor | None = None,
    block_tokens: int = _MAX_CHUNK_TOKENS,
) -> torch.Tensor:
    """Every query against documents stored as codes (`maxsim_kernels.code_packing`), in float64 on the
    *decoded* values: int4 ``s_d[j] * c[j]``, residual2 ``C[id, k] + W[k, b_k]`` (exact in float64); int2
    (``codebook`` its `Int2Levels`) ``s_d[j] * steps * c[j]`` scored against the int8 query of
    `int2_queries`, each query row's ``q . offsets`` added to its maximum. The
    queries are those the kernels score: int8 codes times their scales (float queries are quantized per
    token first, as the kernels do), so the difference to a kernel is its rounding alone (fp32, and for
    the residual2 scan kernels the fp16 query planes of `residual2_query_tables`). Documents are
    decoded `block_tokens` tokens at a time (a document is never split), and any dim the codec stores is
    taken. Returns float64 [nq, nd].
    """
    from .code_packing import Int2Levels, decode_int4, int2_values, residual2_buckets, residual2_ids
    from .codes_host import int2_queries, quantized_queries

    if queries.dtype == torch.int8:
        if query_scales is None:
            raise ValueError("int8 queries need query_scales")
        q8, sq = queries, query_scales
    else:
        q8, sq = quantized_queries(queries)
    int2 = isinstance(codebook, Int2Levels)
    row_offsets = None
    if int2:  # the int8 query of q * steps; the rows' q . offsets added to their maxima
        given = q8.float() * sq.float()[:, None] if queries.dtype == torch.int8 else queries
        side = int2_queries(given, codebook)
        q8, sq, row_offsets = side.q8, side.scales, side.row_offsets.double()
    q = q8.double() * sq.double()[:, None]
    row_query = torch.repeat_interleave(
        torch.arange(query_offsets.numel() - 1, device=q.device), query_offsets.to(q.device).diff()
    )
    d_host = doc_offsets.tolist()
    nd = len(d_host) - 1
    out = torch.empty((query_offsets.numel() - 1, nd), dtype=torch.float64, device=docs.device)
    first = 0
    while first < nd:
        last = first + 1
        while last < nd and d_host[last + 1] - d_host[first] <= block_tokens:
            last += 1
        t0, t1 = d_host[first], d_host[last]
        if int2:
            assert doc_scales is not None, "int2 codes need doc_scales"
            values = int2_values(docs[t0:t1]).double() * doc_scales[t0:t1].double()[:, None]
        elif codebook is None:
            assert doc_scales is not None, "int4 codes need doc_scales"
            values = decode_int4(docs[t0:t1]).double() * doc_scales[t0:t1].double()[:, None]
        else:
            centroids, weights = codebook
            block = docs[t0:t1]
            buckets = residual2_buckets(block)
            values = centroids[residual2_ids(block)].double() + weights.double().gather(1, buckets.T).T
        sim = q @ values.T  # [Tq, block tokens], float64
        for doc in range(first, last):  # each document's max, -inf when it has no tokens
            a, b = d_host[doc] - t0, d_host[doc + 1] - t0
            best = sim[:, a:b].max(dim=1).values if b > a else torch.full_like(sim[:, 0], float("-inf"))
            if row_offsets is not None:
                best = best + row_offsets
            out[:, doc] = torch.zeros_like(out[:, doc]).index_add_(0, row_query, best)
        first = last
    return out
