"""PyLate-shaped ColBERT scores on the fused kernels: `colbert_scores` (all pairs) and `colbert_kd_scores`
(each query against its own documents), drop-ins for `pylate.scores.colbert_scores` / `colbert_kd_scores`.

    score(q, d) = sum over unmasked query tokens i of  max over unmasked document tokens j of <q_i, d_j>

The padded (or listed) inputs are packed - masked tokens left out, nothing padded - and scored by the same
fused kernels as `maxsim_varlen` (all pairs) and `maxsim_candidates` (per query), so no
[queries x documents x q_tokens x d_tokens] similarity tensor is ever built; gradients flow back through
the packing (a row gather) to the padded inputs, through the kernels' argmax backward.

Masking: exact exclusion, not PyLate's zeroing
----------------------------------------------
A masked token takes no part: a masked document token is -inf before the max (it is not packed), a masked
query token adds nothing to the sum. PyLate instead multiplies the similarities by the masks, so a masked
document token still enters the max with similarity 0. The two agree whenever no document token is
masked, or each query token has a non-negative similarity with some unmasked token of each document. They
differ when every unmasked similarity of a query token with a document is negative: PyLate's max is then
0, taken from a padding row (the score depends on how much padding the batch gave that document, and that
query token's gradient goes nowhere), ours is the true, negative, maximum. Masked query tokens add 0 in
both.

Empty items: a query with no unmasked token scores 0 against every document (an empty sum, as in PyLate)
and gets a zero gradient. A document with no unmasked token has no score (the max over an empty set): it
raises ValueError naming its index, rather than returning -inf, which makes a loss infinite or NaN (a
target scored -inf; a min-max normalisation of the scores).

Inputs: torch tensors, numpy arrays, or lists of [len, dim] tensors / arrays (ragged lengths allowed).
float16, bfloat16 and float32 are scored as given (accumulation in fp32; queries converted to the
documents' dtype, as in `maxsim_varlen`); float64 and other dtypes are scored in float32. A dim that is
not a multiple of 8 is zero-padded to one (a copy of the packed rows; the scores are unchanged). Masks may
be bool, integer or float (nonzero = keep). Scores are float32 on the inputs' device: the Triton kernels
for CUDA tensors, the torch path for CPU tensors (`backend` as in `maxsim_varlen`). numpy arrays and lists
go to the device of the other argument where that one is a torch tensor.

Cost beyond the kernels: the token counts of each masked side are copied to the host (the host waits for
the device there: the kernels take their offsets on the host), and each masked side is gathered into a
packed copy on the device (none where a side has no mask, or a mask with no False). Offsets tensors are
kept per distinct list of lengths, so a training loop whose lengths repeat (queries without a mask, say)
reuses the kernels' checks and launch plans.

The package root imports this module, so this module does not import the root: it dispatches to the
autograd, Triton and torch functions the way `maxsim_varlen` / `maxsim_candidates` do (float inputs only).
The module shares its name with the function `maxsim_kernels.colbert_scores`, which is what the package
exports under that name.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .cpu import maxsim_candidates_cpu, maxsim_varlen_cpu
from .validation import FLOAT_DTYPES, host_to_device, resolve_backend

__all__ = ["colbert_scores", "colbert_kd_scores"]

Embeddings = Any  # torch.Tensor | np.ndarray | Sequence of [len, dim] tensors / arrays
Mask = Any  # torch.Tensor | np.ndarray | Sequence of 1-D masks | None


# ----------------------------------------------------------------------------------------------------
# packing
# ----------------------------------------------------------------------------------------------------


@dataclass
class _Packed:
    """One side packed: rows [sum(lengths), dim] (unmasked tokens, item after item) and host lengths."""

    rows: torch.Tensor
    lengths: np.ndarray  # int64 [n]


def _is_array(x: object) -> bool:
    return isinstance(x, torch.Tensor) or (isinstance(x, np.ndarray) and x.dtype != object)


def _device_of(*xs: object) -> torch.device:
    """The device of the first torch tensor among `xs` (or their lists' first items), else the CPU."""
    for x in xs:
        while isinstance(x, (list, tuple)) and x:
            x = x[0]
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def _tensor(x: object, device: torch.device, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x)).to(device)
    try:
        return torch.as_tensor(x, dtype=torch.float32, device=device)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{name}: cannot read {type(x).__name__} as a tensor ({exc})") from exc


def _keep(mask: object, shape: tuple[int, ...], device: torch.device, name: str) -> torch.Tensor:
    """`mask` as a bool tensor of `shape` on `device` (nonzero = keep)."""
    if isinstance(mask, torch.Tensor):
        keep = mask.detach().to(device) != 0
    else:
        keep = torch.from_numpy(np.asarray(mask) != 0).to(device)
    if tuple(keep.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(keep.shape)} but the embeddings need {shape}")
    return keep


def _pack_padded(emb: torch.Tensor, mask: Mask, mask_name: str) -> _Packed:
    """emb [n, L, dim] with mask [n, L] (or None: every token)."""
    n, length, dim = emb.shape
    rows = emb.reshape(n * length, dim)
    if mask is None:
        return _Packed(rows, np.full(n, length, dtype=np.int64))
    keep = _keep(mask, (n, length), emb.device, mask_name)
    lengths = keep.sum(dim=1).cpu().numpy().astype(np.int64)  # waits for the device: offsets live on the host
    if lengths.sum() < n * length:
        # the gather index built on the device (its backward scatters into the padded gradient): 0.44-0.57
        # vs 1.45-1.65 ms from the mask's host copy (colbert_kd_scores, 64 x 32 docs x 180 tokens, bf16)
        rows = rows.index_select(0, keep.reshape(-1).nonzero().squeeze(1))
    return _Packed(rows, lengths)


def _pack_list(items: Sequence, masks: Mask, device: torch.device, name: str, mask_name: str) -> _Packed:
    """A list of [len_k, dim] items with, optionally, one 1-D mask [len_k] per item."""
    if masks is not None and len(masks) != len(items):
        raise ValueError(f"{mask_name} has {len(masks)} entries but {name} has {len(items)} items")
    parts, lengths = [], []
    for k, item in enumerate(items):
        x = _tensor(item, device, name)
        if x.dim() != 2:
            raise ValueError(f"{name}[{k}] must be [tokens, dim], got shape {tuple(x.shape)}")
        if masks is not None:
            keep = _keep(masks[k], (x.shape[0],), torch.device("cpu"), f"{mask_name}[{k}]").numpy()
            if not keep.all():  # the gather index from the mask's host copy
                x = x.index_select(0, host_to_device(torch.from_numpy(np.flatnonzero(keep)), device))
        parts.append(x)
        lengths.append(x.shape[0])
    dims = {x.shape[1] for x in parts}
    if len(dims) > 1:
        raise ValueError(f"{name}: the items have different dims {sorted(dims)}")
    return _Packed(
        torch.cat(parts) if parts else torch.empty(0, 0, device=device), np.array(lengths, np.int64)
    )


def _pack(x: Embeddings, mask: Mask, device: torch.device, name: str, mask_name: str) -> _Packed:
    """Queries or documents: [n, L, dim] padded (tensor / array) or a list of [len, dim] items."""
    if _is_array(x):
        emb = _tensor(x, device, name)
        if emb.dim() != 3:
            raise ValueError(
                f"{name} must be [n, tokens, dim] or a list of [tokens, dim], got {tuple(emb.shape)}"
            )
        return _pack_padded(emb, mask, mask_name)
    if isinstance(x, (list, tuple, np.ndarray)):
        return _pack_list(list(x), mask, device, name, mask_name)
    raise ValueError(f"{name} must be a tensor, an array or a list of [tokens, dim], got {type(x).__name__}")


def _flatten_groups(x: Embeddings, mask: Mask, device: torch.device, name: str, mask_name: str):
    """[G, N, L, dim] -> [G*N, L, dim] (and mask [G, N, L] -> [G*N, L]); a list of G groups (each
    [N, L, dim] or a list of N [len, dim] items, masks alike) -> a list of G*N items. Returns
    (embeddings, mask, G, N)."""
    if _is_array(x):
        emb = _tensor(x, device, name)
        if emb.dim() != 4:
            raise ValueError(f"{name} must be [n_queries, n_docs_each, tokens, dim], got {tuple(emb.shape)}")
        g, n, length, dim = emb.shape
        if mask is not None:
            mask = _keep(mask, (g, n, length), device, mask_name).reshape(g * n, length)
        return emb.reshape(g * n, length, dim), mask, g, n
    if not isinstance(x, (list, tuple, np.ndarray)):
        raise ValueError(f"{name} must be a tensor, an array or a list of groups, got {type(x).__name__}")
    if mask is not None and len(mask) != len(x):
        raise ValueError(f"{mask_name} has {len(mask)} groups but {name} has {len(x)}")
    items: list = []
    masks: list | None = None if mask is None else []
    sizes = set()
    for k, group in enumerate(x):
        members = list(group.unbind(0)) if isinstance(group, torch.Tensor) else list(group)
        sizes.add(len(members))
        items += members
        if masks is not None:
            group_mask = mask[k]
            rows = list(group_mask.unbind(0)) if isinstance(group_mask, torch.Tensor) else list(group_mask)
            if len(rows) != len(members):
                raise ValueError(f"{mask_name}[{k}] has {len(rows)} masks for {len(members)} documents")
            masks += rows
    if len(sizes) > 1:
        raise ValueError(f"{name}: every query needs the same number of documents, got {sorted(sizes)}")
    return items, masks, len(x), (sizes.pop() if sizes else 0)


def _check_documents(lengths: np.ndarray, name: str, per_query: int = 0) -> None:
    if len(lengths) and lengths.min() == 0:
        bad = int(np.argmin(lengths))
        where = f"{bad // per_query}, {bad % per_query}" if per_query else f"{bad}"
        raise ValueError(
            f"{name}[{where}] has no unmasked token: a document needs one to have a MaxSim score"
        )


def _match(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Common dtype (the documents'; float32 for anything the kernels do not take) and a dim that is a
    multiple of 8 (zero columns add exact zeros to every product)."""
    if d.dtype not in FLOAT_DTYPES:
        d = d.float()
    q = q.to(d.dtype)
    if q.shape[0] == 0 and q.shape[1] != d.shape[1]:  # an empty list has no dim of its own
        q = q.new_zeros((0, d.shape[1]))
    if d.shape[0] == 0 and q.shape[1] != d.shape[1]:
        d = d.new_zeros((0, q.shape[1]))
    if q.shape[1] != d.shape[1]:
        raise ValueError(
            f"queries have dim {q.shape[1]} but documents have dim {d.shape[1]}: they must match"
        )
    pad = -q.shape[1] % 8
    if pad:
        q, d = F.pad(q, (0, pad)), F.pad(d, (0, pad))
    return q.contiguous(), d.contiguous()


# Offsets and candidate tensors, kept per distinct content: the kernels remember their checks, device
# copies and launch plans per offsets tensor object, so handing back the same object for the same lengths
# lets a repeated batch shape skip that work. Bounded: 64 entries of 16 bytes per item or less.
_HOST_TENSORS: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
_HOST_TENSORS_MAX = 64
_HOST_TENSORS_LOCK = threading.Lock()


def _host_tensor(key: Hashable, build: Callable[[], np.ndarray]) -> torch.Tensor:
    with _HOST_TENSORS_LOCK:
        tensor = _HOST_TENSORS.get(key)
        if tensor is None:
            tensor = torch.from_numpy(build())
            _HOST_TENSORS[key] = tensor
            while len(_HOST_TENSORS) > _HOST_TENSORS_MAX:
                _HOST_TENSORS.popitem(last=False)
        else:
            _HOST_TENSORS.move_to_end(key)
        return tensor


def _offsets(lengths: np.ndarray) -> torch.Tensor:
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)

    def build() -> np.ndarray:
        out = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=out[1:])
        return out

    return _host_tensor(("offsets", lengths.tobytes()), build)


def _candidates(kept: np.ndarray, per_query: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate offsets [len(kept)+1] and documents (query kept[i] owns documents kept[i]*N ... +N-1)."""
    key = (kept.tobytes(), per_query)
    offsets = _host_tensor(
        ("cand_offsets", *key), lambda: np.arange(len(kept) + 1, dtype=np.int64) * per_query
    )
    docs = _host_tensor(
        ("cand_docs", *key),
        lambda: (kept[:, None] * per_query + np.arange(per_query, dtype=np.int64)).reshape(-1),
    )
    return offsets, docs


def _rows_back(scores: torch.Tensor, kept: np.ndarray, num_queries: int) -> torch.Tensor:
    """Scores of the kept queries placed at their rows, zeros for queries with no unmasked token."""
    if len(kept) == num_queries:
        return scores
    index = host_to_device(torch.from_numpy(kept), scores.device)
    return scores.new_zeros((num_queries, scores.shape[1])).index_copy(0, index, scores)


def _zeros(shape: tuple[int, int], q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Zeros for a problem with nothing to score, on the graph when an input requires grad (so that
    `.backward()` runs and gives zero gradients): an empty slice's sum is an exact 0."""
    anchor = (q[:0].sum() + d[:0].sum()).float()
    return torch.zeros(shape, dtype=torch.float32, device=d.device) + anchor


# ----------------------------------------------------------------------------------------------------
# dispatch (as `maxsim_varlen` / `maxsim_candidates`, float inputs only)
# ----------------------------------------------------------------------------------------------------


def _needs_grad(q: torch.Tensor, d: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or d.requires_grad)


def _all_pairs(q, q_off, d, d_off, allow_tf32: bool, backend: str) -> torch.Tensor:
    if _needs_grad(q, d):
        from .maxsim_backward import maxsim_varlen_autograd  # imports triton: only when asked for

        return maxsim_varlen_autograd(q, q_off, d, d_off, allow_tf32=allow_tf32, backend=backend)
    if resolve_backend(backend, d.device) == "triton":
        from .maxsim_forward import maxsim_varlen_forward_triton

        return maxsim_varlen_forward_triton(q, q_off, d, d_off, allow_tf32=allow_tf32)
    return maxsim_varlen_cpu(q, q_off, d, d_off)


def _per_query(q, q_off, d, d_off, c_off, c_docs, allow_tf32: bool, backend: str) -> torch.Tensor:
    if _needs_grad(q, d):
        from .maxsim_backward import maxsim_candidates_autograd

        return maxsim_candidates_autograd(
            q, q_off, d, d_off, c_off, c_docs, allow_tf32=allow_tf32, backend=backend
        )
    if resolve_backend(backend, d.device) == "triton":
        from .maxsim_forward import maxsim_candidates_forward_triton

        return maxsim_candidates_forward_triton(q, q_off, d, d_off, c_off, c_docs, allow_tf32=allow_tf32)
    return maxsim_candidates_cpu(q, q_off, d, d_off, c_off, c_docs)


# ----------------------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------------------


def colbert_scores(
    queries_embeddings: Embeddings,
    documents_embeddings: Embeddings,
    queries_mask: Mask = None,
    documents_mask: Mask = None,
    *,
    allow_tf32: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Every query against every document: float32 scores [n_queries, n_docs], as
    `pylate.scores.colbert_scores`, with the same argument names, order and shapes.

    queries_embeddings: [n_queries, q_tokens, dim] with queries_mask [n_queries, q_tokens], or a list of
    [len, dim] with a list of 1-D masks. documents_embeddings: [n_docs, d_tokens, dim] with documents_mask
    [n_docs, d_tokens], a list as for queries, or [n_groups, n_per_group, d_tokens, dim] with a mask
    [n_groups, n_per_group, d_tokens], scored as n_groups * n_per_group documents in group-major order
    (column g * n_per_group + k; what PyLate's `ColBERTScores` returns for stacked groups).
    Differentiable with respect to both embeddings. Raises ValueError for a document with no unmasked
    token; a query with none scores 0.

    Masks (bool, int or float; nonzero = keep) exclude tokens exactly: a masked document token is -inf
    before the max, a masked query token adds nothing. PyLate multiplies the similarities by the masks
    instead, so a masked document token enters the max as 0: where every unmasked similarity of a query
    token with a document is negative, PyLate's max is 0 (a padding row wins) and ours the true, negative
    maximum. Without masked document tokens the two agree.
    """
    device = _device_of(queries_embeddings, documents_embeddings)
    q = _pack(queries_embeddings, queries_mask, device, "queries_embeddings", "queries_mask")
    if _is_array(documents_embeddings) and np.ndim(documents_embeddings) == 4:
        documents_embeddings, documents_mask, _, _ = _flatten_groups(
            documents_embeddings, documents_mask, device, "documents_embeddings", "documents_mask"
        )
    d = _pack(documents_embeddings, documents_mask, device, "documents_embeddings", "documents_mask")
    _check_documents(d.lengths, "documents_embeddings")
    q_rows, d_rows = _match(q.rows, d.rows)
    kept = np.flatnonzero(q.lengths)
    shape = (len(q.lengths), len(d.lengths))
    if len(kept) == 0 or shape[1] == 0:
        return _zeros(shape, q_rows, d_rows)
    scores = _all_pairs(q_rows, _offsets(q.lengths[kept]), d_rows, _offsets(d.lengths), allow_tf32, backend)
    return _rows_back(scores, kept, shape[0])


def colbert_kd_scores(
    queries_embeddings: Embeddings,
    documents_embeddings: Embeddings,
    queries_mask: Mask = None,
    documents_mask: Mask = None,
    *,
    allow_tf32: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Each query against its own documents: float32 scores [n_queries, n_docs_each], as
    `pylate.scores.colbert_kd_scores`, with the same argument names, order and shapes.

    queries_embeddings as in `colbert_scores`. documents_embeddings: [n_queries, n_docs_each, d_tokens,
    dim] with documents_mask [n_queries, n_docs_each, d_tokens], or a list of n_queries groups, each
    [n_docs_each, d_tokens, dim] or a list of n_docs_each [len, dim] (masks alike: per group a 2-D mask or
    a list of 1-D masks). Query i's documents are read in place by `maxsim_candidates`, never repeated.
    Differentiable with respect to both embeddings. Raises ValueError for a document with no unmasked
    token (named [query, document]); a query with none scores 0. Masks exclude tokens exactly, where
    PyLate zeroes masked similarities (see `colbert_scores`).
    """
    device = _device_of(queries_embeddings, documents_embeddings)
    q = _pack(queries_embeddings, queries_mask, device, "queries_embeddings", "queries_mask")
    items, masks, groups, per_query = _flatten_groups(
        documents_embeddings, documents_mask, device, "documents_embeddings", "documents_mask"
    )
    if groups != len(q.lengths):
        raise ValueError(f"documents_embeddings has {groups} groups but there are {len(q.lengths)} queries")
    d = _pack(items, masks, device, "documents_embeddings", "documents_mask")
    _check_documents(d.lengths, "documents_embeddings", per_query)
    q_rows, d_rows = _match(q.rows, d.rows)
    kept = np.flatnonzero(q.lengths)
    shape = (groups, per_query)
    if len(kept) == 0 or per_query == 0:
        return _zeros(shape, q_rows, d_rows)
    c_off, c_docs = _candidates(kept, per_query)
    scores = _per_query(
        q_rows, _offsets(q.lengths[kept]), d_rows, _offsets(d.lengths), c_off, c_docs, allow_tf32, backend
    )
    return _rows_back(scores.reshape(len(kept), per_query), kept, groups)
