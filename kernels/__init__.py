"""maxsim_kernels: exact late-interaction (MaxSim) scoring, Triton on CUDA tensors, torch on CPU tensors.

    score(q, d) = sum_i max_j <q_i, d_j>        i over the query's tokens, j over the document's tokens

Both sides are *packed*: a [total_tokens, dim] tensor plus int64 offsets [n+1] (item k owns rows
offsets[k]:offsets[k+1]); nothing is padded. Two layouts:

- `maxsim_varlen`: every query against every document -> fp32 scores [nq, nd];
- `maxsim_candidates`: query i against its own documents candidate_docs[candidate_offsets[i]:
  candidate_offsets[i+1]] (indices into the packed documents, read in place) -> fp32 scores [C].

`return_argmax=True` also returns, for each query token and scored document, the int32 index within the
document of the winning token (ties go to the lowest index; -1 for a document with no tokens):
[Tq, nd] for `maxsim_varlen`, [C, max_query_len] (-1 past a query's length) for `maxsim_candidates`.

Inputs: float16, bfloat16 or float32 with fp32 accumulation; queries are converted to the documents'
dtype. float32 inputs use exact fp32 products unless `allow_tf32=True` (TF32 tensor cores: 10-bit
mantissa products, ~1e-3 relative error). int8 documents with per-token `doc_scales` go to
`maxsim_kernels.int8_host` (its Triton kernels in `maxsim_int8`); uint8 documents are codes below 8 bits
(int4 with `doc_scales`, residual2 with `codebook=`, int2 with both) and go to `maxsim_kernels.codes_host`;
inputs that require grad go to `maxsim_kernels.maxsim_backward`.
dim is any multiple of 8 up to 4096. A query with no tokens raises ValueError; a document with no tokens
scores -inf. Offsets may live on the CPU or on the tensors' device: each offsets tensor is checked (on a
host copy) and copied to the device once, then remembered per tensor object and in-place version, so
repeated calls cost no transfer; change offsets in place through torch (not through a numpy view).
On the Triton path the checks and launch arguments are also remembered per pair of offsets tensors and
input shapes, and a launch repeated with them calls the compiled kernel directly: a training loop that
passes the same offsets tensors every step pays little more than the launches on the host.

On an sm_90 GPU (H100, H200) with triton 3.6, scores-only long queries (over 128 tokens: ColPali, dim 128) in
fp16/bf16 go to a Gluon kernel, `maxsim_kernels.maxsim_forward_hopper`, whose scores are bitwise the
Triton kernel's and which runs the max of one tile while the next tile's product is computed.

backend: "auto" (Triton for CUDA tensors, torch for CPU tensors), "triton" (CPU tensors only under
TRITON_INTERPRET=1, for tests), "torch" (blocked torch ops; the CPU path, also valid on CUDA tensors).
`maxsim_reference` is the independent float64 reference.

PyLate-shaped inputs (padded tensors with masks, lists of [len, dim], numpy arrays): `colbert_scores`
(all pairs, [n_queries, n_docs]) and `colbert_kd_scores` (each query against its own documents
[n_queries, n_docs_each, L, dim] -> [n_queries, n_docs_each]) take the arguments of
`pylate.scores.colbert_scores` / `colbert_kd_scores`, pack the unmasked tokens and call the kernels above.
Masked tokens are left out exactly (-inf before the max), where PyLate zeroes masked similarities: the
scores differ when every unmasked similarity of a query token with a document is negative
(`maxsim_kernels.colbert_scores` has the details).
"""

from __future__ import annotations

from typing import Any

import torch

from . import int8_host  # imports no Triton: its kernels come with the calls that run them
from .colbert_scores import colbert_kd_scores, colbert_scores
from .cpu import NonFiniteDocuments, maxsim_candidates_cpu, maxsim_varlen_cpu
from .reference import maxsim_candidates_reference, maxsim_reference
from .validation import MAX_DIM, Layout, check_candidates, check_inputs, resolve_backend, share_device_copy

__all__ = [
    "maxsim_varlen",
    "maxsim_candidates",
    "colbert_scores",
    "colbert_kd_scores",
    "maxsim_reference",
    "maxsim_candidates_reference",
    "maxsim_varlen_cpu",
    "maxsim_candidates_cpu",
    "maxsim_varlen_forward_triton",
    "maxsim_candidates_forward_triton",
    "check_inputs",
    "check_candidates",
    "Layout",
    "resolve_backend",
    "share_device_copy",
    "MAX_DIM",
    "NonFiniteDocuments",
]


def _needs_grad(queries: torch.Tensor, docs: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (queries.requires_grad or docs.requires_grad)


def _codes_module() -> Any:
    from maxsim_kernels import codes_host  # only for documents stored as codes

    return codes_host


def _backward_module() -> Any:
    try:
        from maxsim_kernels import maxsim_backward
    except ImportError as exc:
        raise NotImplementedError(
            f"inputs that require grad need maxsim_kernels.maxsim_backward, which failed to import: {exc}"
        ) from exc
    return maxsim_backward


def _forward_module() -> Any:
    from maxsim_kernels import maxsim_forward  # imports triton: only when the Triton backend is used

    return maxsim_forward


def __getattr__(name: str) -> Any:
    # the Triton launchers are exported lazily so that `import maxsim_kernels` does not import triton
    if name in ("maxsim_varlen_forward_triton", "maxsim_candidates_forward_triton"):
        return getattr(_forward_module(), name)
    raise AttributeError(f"module 'maxsim_kernels' has no attribute {name!r}")


def _check_query_scales(query_scales: torch.Tensor | None, docs: torch.Tensor) -> None:
    if query_scales is not None and not (
        isinstance(docs, torch.Tensor) and docs.dtype in (torch.int8, torch.uint8)
    ):
        raise ValueError("query_scales go with int8 queries and int8 (or uint8 code) documents")


def _check_finite_supported(
    check_finite: bool, docs: torch.Tensor, queries: torch.Tensor, backend: str
) -> None:
    # the check reads the similarities the torch backend computes anyway; the other paths have none
    if check_finite and (
        docs.dtype in (torch.int8, torch.uint8)
        or _needs_grad(queries, docs)
        or resolve_backend(backend, docs.device) != "torch"
    ):
        raise ValueError(
            "check_finite needs the torch backend (backend='torch', or 'auto' on CPU tensors), float "
            "documents and inputs that do not require grad"
        )


def maxsim_varlen(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    *,
    return_argmax: bool = False,
    allow_tf32: bool = False,
    backend: str = "auto",
    doc_scales: torch.Tensor | None = None,
    query_scales: torch.Tensor | None = None,
    codebook: Any = None,
    check_finite: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Every query against every document: fp32 scores [nq, nd] (+ int32 argmax [Tq, nd]).

    queries [Tq, dim] with query_offsets int64 [nq+1]; docs [Td, dim] with doc_offsets int64 [nd+1].
    int8 docs take `doc_scales` fp32 [Td], and either float queries (quantized per token on each call)
    or int8 queries with `query_scales` fp32 [Tq] (`maxsim_kernels.int8_host.quantize_per_token`).
    uint8 docs are codes below 8 bits (`maxsim_kernels.code_packing`): int4 with `doc_scales`, the
    residual2 codec with `codebook` (a `code_packing.ResidualCodebook`), or int2 with `doc_scales` and
    `codebook` (its `code_packing.Int2Levels`).

    ``check_finite``: raise `NonFiniteDocuments` (a ValueError) when a document token's similarities
    are NaN or Inf: its embedding holds NaN/Inf (or, in bf16/fp32, values so large that the fp32 sum
    overflows). The similarities are computed anyway, so the check costs next to nothing; the queries
    must be finite. Only the torch backend on float documents without grad checks: with int8 (or code)
    documents, inputs that require grad or the Triton backend it raises ValueError.
    """
    _check_query_scales(query_scales, docs)
    _check_finite_supported(check_finite, docs, queries, backend)
    if docs.dtype == torch.uint8:
        return _codes_module().maxsim_varlen_codes(
            queries,
            query_offsets,
            docs,
            doc_offsets,
            doc_scales=doc_scales,
            codebook=codebook,
            query_scales=query_scales,
            return_argmax=return_argmax,
            allow_tf32=allow_tf32,
            backend=backend,
        )
    if codebook is not None:
        raise ValueError("a codebook goes with uint8 residual2 or int2 codes, not with float or int8 docs")
    if docs.dtype == torch.int8:
        return int8_host.maxsim_varlen_int8(
            queries,
            query_offsets,
            docs,
            doc_offsets,
            return_argmax=return_argmax,
            allow_tf32=allow_tf32,
            backend=backend,
            doc_scales=doc_scales,
            query_scales=query_scales,
        )
    if _needs_grad(queries, docs):
        return _backward_module().maxsim_varlen_autograd(
            queries,
            query_offsets,
            docs,
            doc_offsets,
            return_argmax=return_argmax,
            allow_tf32=allow_tf32,
            backend=backend,
            doc_scales=doc_scales,
        )
    if resolve_backend(backend, docs.device) == "triton":
        return _forward_module().maxsim_varlen_forward_triton(
            queries, query_offsets, docs, doc_offsets, return_argmax=return_argmax, allow_tf32=allow_tf32
        )
    return _torch_varlen(queries, query_offsets, docs, doc_offsets, return_argmax, doc_scales, check_finite)


def maxsim_candidates(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor,
    candidate_docs: torch.Tensor,
    *,
    return_argmax: bool = False,
    allow_tf32: bool = False,
    backend: str = "auto",
    doc_scales: torch.Tensor | None = None,
    query_scales: torch.Tensor | None = None,
    codebook: Any = None,
    check_finite: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-query candidates (reranking): fp32 scores [C] (+ int32 argmax [C, max_query_len], -1 padded).

    Query i's candidates are candidate_docs[candidate_offsets[i]:candidate_offsets[i+1]], int64 indices
    into doc_offsets; the documents are read in place, never gathered into a copy. Scales as in
    `maxsim_varlen`.

    Bad indices: candidate_docs on the host, the torch backend and the differentiable path check every
    index on the host and raise ValueError naming the first entry outside [0, number of documents).
    candidate_docs on the GPU with the Triton backend are not read by the host (a new candidates tensor
    per batch then costs no device->host copy and no wait for the device): the kernels never read through
    a bad index and score its candidate NaN (argmax -1), so bad input shows in the scores. For float
    documents the candidate_offsets are read on the host, to plan the launch: pass them from the host
    (offsets on the GPU cost one copy and one wait per new offsets tensor); the int8 kernels read them on
    the device.

    ``check_finite`` as in `maxsim_varlen` (for the candidates' tokens).
    """
    _check_query_scales(query_scales, docs)
    _check_finite_supported(check_finite, docs, queries, backend)
    if docs.dtype == torch.uint8:
        return _codes_module().maxsim_candidates_codes(
            queries,
            query_offsets,
            docs,
            doc_offsets,
            candidate_offsets,
            candidate_docs,
            doc_scales=doc_scales,
            codebook=codebook,
            query_scales=query_scales,
            return_argmax=return_argmax,
            allow_tf32=allow_tf32,
            backend=backend,
        )
    if codebook is not None:
        raise ValueError("a codebook goes with uint8 residual2 or int2 codes, not with float or int8 docs")
    if docs.dtype == torch.int8:
        return int8_host.maxsim_candidates_int8(
            queries,
            query_offsets,
            docs,
            doc_offsets,
            candidate_offsets,
            candidate_docs,
            return_argmax=return_argmax,
            allow_tf32=allow_tf32,
            backend=backend,
            doc_scales=doc_scales,
            query_scales=query_scales,
        )
    if _needs_grad(queries, docs):
        return _backward_module().maxsim_candidates_autograd(
            queries,
            query_offsets,
            docs,
            doc_offsets,
            candidate_offsets,
            candidate_docs,
            return_argmax=return_argmax,
            allow_tf32=allow_tf32,
            backend=backend,
            doc_scales=doc_scales,
        )
    if resolve_backend(backend, docs.device) == "triton":
        return _forward_module().maxsim_candidates_forward_triton(
            queries,
            query_offsets,
            docs,
            doc_offsets,
            candidate_offsets,
            candidate_docs,
            return_argmax=return_argmax,
            allow_tf32=allow_tf32,
        )
    return _torch_candidates(
        queries,
        query_offsets,
        docs,
        doc_offsets,
        candidate_offsets,
        candidate_docs,
        return_argmax,
        doc_scales,
        check_finite,
    )


def _torch_varlen(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    return_argmax: bool,
    doc_scales: torch.Tensor | None,
    check_finite: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    return maxsim_varlen_cpu(
        queries,
        query_offsets,
        docs,
        doc_offsets,
        return_argmax=return_argmax,
        doc_scales=doc_scales,
        check_finite=check_finite,
    )


def _torch_candidates(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor,
    candidate_docs: torch.Tensor,
    return_argmax: bool,
    doc_scales: torch.Tensor | None,
    check_finite: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    return maxsim_candidates_cpu(
        queries,
        query_offsets,
        docs,
        doc_offsets,
        candidate_offsets,
        candidate_docs,
        return_argmax=return_argmax,
        doc_scales=doc_scales,
        check_finite=check_finite,
    )
