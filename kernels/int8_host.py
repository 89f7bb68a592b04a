"""int8 MaxSim without Triton: its public entry points, the checks, per-token quantization in torch, the
CPU and torch paths, and the float64 reference of the integer math (`maxsim_int8`'s docstring gives the
math). A call on CPU tensors, or with backend "torch", runs here alone; a call for the Triton backend
imports `maxsim_int8` (the Triton and Gluon kernels and their launchers) at that call. Importing Triton
takes ~0.15 s on a 2-core CPU, a third of `maxsim score`'s wall time on the quickstart's int8 corpus,
where no kernel of it runs."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from types import ModuleType

import numpy as np
import torch

from .cpu import (
    int8_stream_applies,
    maxsim_int8_candidates_cpu,
    maxsim_int8_docs_cpu,
    maxsim_int8_varlen_cpu,
)
from .validation import check_candidate_docs, host_offsets, memo, on_device, resolve_backend

# Codes are in [-127, 127]; shards written elsewhere may hold -128, so bounds use 128.
INT8_ABSMAX = 127.0
MAX_DIM = 1024  # |acc| <= 128^2 * dim stays below 2^24, where fp32 holds every integer exactly

# CPU path: at most this many fp32 similarities materialised at once (64 MiB).
_TORCH_BLOCK_ELEMS = 1 << 24


def _kernels() -> ModuleType:
    """`maxsim_int8`: the Triton kernels and launchers, imported by the first call that runs them."""
    from . import maxsim_int8

    return maxsim_int8


# ----------------------------------------------------------------------------------------------------------
# Checks and quantization
# ----------------------------------------------------------------------------------------------------------


def _quantize_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    absmax = xf.abs().amax(dim=1)
    # A tensor divisor: torch multiplies by the reciprocal of a Python-scalar divisor on CUDA, which is
    # not the correctly rounded quotient the kernel computes.
    scale = absmax / torch.full_like(absmax, INT8_ABSMAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(xf / scale[:, None]).clamp_(-INT8_ABSMAX, INT8_ABSMAX).to(torch.int8)
    return codes, scale


def quantize_per_token(x: torch.Tensor, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-token int8 quantization of `x` [T, dim] (fp16, bf16 or fp32; computed in fp32).

    Returns (codes int8 [T, dim], scales fp32 [T]) with

        scale = absmax(x_t) / 127   (scale := 1 where that is 0: an all-zero token gets codes 0, scale 1)
        codes = clamp(round_half_even(x_t / scale), -127, 127)

    so x_t ~= scale * codes with |error| <= scale / 2 per value. Both backends give identical bits (IEEE
    division, ties to even); "auto" runs the Triton kernel on CUDA tensors and torch ops otherwise.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_per_token expects a [tokens, dim] tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"quantize_per_token expects float16/bfloat16/float32 values, got {x.dtype}")
    if x.shape[1] == 0:
        raise ValueError("quantize_per_token: dim is 0")
    if resolve_backend(backend, x.device) == "triton":
        return _kernels().quantize_triton(x)
    return _quantize_torch(x)


def device_offsets(
    name: str, offsets: torch.Tensor, total: int, device: torch.device, *, empty_ok: bool, check: bool
):
    """`offsets` on `device`, after checking dtype and shape and, when it is on the host or `check` is set,
    its values: from 0 to `total`, non-decreasing (increasing unless `empty_ok`)."""
    if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int64 or offsets.dim() != 1:
        what = (
            f"{offsets.dtype} {tuple(offsets.shape)}" if isinstance(offsets, torch.Tensor) else type(offsets)
        )
        raise ValueError(f"{name} must be a 1-D int64 tensor [n+1], got {what}")
    if offsets.numel() < 1:
        raise ValueError(f"{name} must hold at least one entry (0)")
    if offsets.device not in (device, torch.device("cpu")):
        raise ValueError(f"{name} is on {offsets.device}, the embeddings on {device}")
    if check or offsets.device.type == "cpu":
        host = host_offsets(name, offsets, total)  # checked once per tensor (memoised)
        if not empty_ok:
            lens = memo(offsets, ("lens", total), lambda: np.diff(host))
            if len(lens) and lens.min() <= 0:
                i = int(np.argmin(lens))
                raise ValueError(f"{name}: entry {i} has no tokens ({host[i]} -> {host[i + 1]}); drop it")
    return on_device(offsets, device)  # one transfer per offsets tensor (memoised)


def backend_and_offsets(
    backend: str,
    device: torch.device,
    query_offsets: torch.Tensor,
    query_tokens: int,
    doc_offsets: torch.Tensor,
    doc_tokens: int,
) -> tuple[str, torch.Tensor, torch.Tensor]:
    """The backend for tensors on `device` and both offsets there (`device_offsets`: their values checked
    on the host where they come from it, and always by the torch backend; a query needs a token)."""
    backend = resolve_backend(backend, device)
    check = backend == "torch" or device.type != "cuda"
    query_offsets = device_offsets(
        "query_offsets", query_offsets, query_tokens, device, empty_ok=False, check=check
    )
    doc_offsets = device_offsets("doc_offsets", doc_offsets, doc_tokens, device, empty_ok=True, check=check)
    return backend, query_offsets, doc_offsets


def _prepare(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    doc_scales: torch.Tensor | None,
    query_scales: torch.Tensor | None,
    backend: str,
) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate, pick the backend, quantize float queries.

    Returns (backend, q8, s_q, query_offsets, d8, s_d, doc_offsets), the offsets moved to the tensors'
    device. Offset values are checked when they come from the host, and always by the torch path; the
    Triton path never synchronises with the device to look at offsets already there (the Gluon all-pairs
    kernel reads them back once per tensor: `hopper_allpairs`).
    """
    if not isinstance(docs, torch.Tensor) or docs.dtype != torch.int8 or docs.dim() != 2:
        got = f"{docs.dtype} {tuple(docs.shape)}" if isinstance(docs, torch.Tensor) else type(docs)
        raise ValueError(f"int8 MaxSim expects int8 documents [tokens, dim], got {got}")
    if not isinstance(queries, torch.Tensor) or queries.dim() != 2 or queries.shape[1] != docs.shape[1]:
        got = tuple(queries.shape) if isinstance(queries, torch.Tensor) else type(queries)
        raise ValueError(f"queries {got} and documents {tuple(docs.shape)} must be 2-D and share dim")
    dim = docs.shape[1]
    if not 1 <= dim <= MAX_DIM:
        raise ValueError(f"int8 MaxSim supports dim 1..{MAX_DIM} (exact int32->fp32 up to there), got {dim}")
    device = docs.device
    if queries.device != device:
        raise ValueError(f"queries are on {queries.device}, documents on {device}")
    if doc_scales is None:
        raise ValueError("int8 documents need doc_scales (fp32 [doc tokens], one per token)")
    if doc_scales.shape != (docs.shape[0],) or doc_scales.device != device:
        raise ValueError(
            f"doc_scales must be [{docs.shape[0]}] on {device}, "
            f"got {tuple(doc_scales.shape)} on {doc_scales.device}"
        )
    backend, query_offsets, doc_offsets = backend_and_offsets(
        backend, device, query_offsets, queries.shape[0], doc_offsets, docs.shape[0]
    )
    if queries.dtype == torch.int8:
        if query_scales is None:
            raise ValueError("int8 queries need query_scales (fp32 [query tokens])")
        if query_scales.shape != (queries.shape[0],) or query_scales.device != device:
            raise ValueError(f"query_scales must be [{queries.shape[0]}] on {device}")
        q8, sq = queries, query_scales.float()
    elif queries.is_floating_point():
        q8, sq = _kernels().quantize_triton(queries) if backend == "triton" else _quantize_torch(queries)
    else:
        raise ValueError(f"queries must be float16/bfloat16/float32 or int8, got {queries.dtype}")
    d8 = docs if docs.stride(1) == 1 else docs.contiguous()
    q8 = q8 if q8.stride(1) == 1 else q8.contiguous()
    return backend, q8, sq.contiguous(), query_offsets, d8, doc_scales.float().contiguous(), doc_offsets


# ----------------------------------------------------------------------------------------------------------
# CPU path (torch ops; also runs on CUDA tensors)
# ----------------------------------------------------------------------------------------------------------


def segment_max(
    sim: torch.Tensor, segment: torch.Tensor, n_segments: int, local: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Max over the columns of each segment of `sim` [rows, cols] (segment id per column) and, with `local`
    (each column's index within its segment), the lowest index attaining it; -inf and -1 for an empty
    segment."""
    index = segment.expand(sim.shape[0], -1)
    best = sim.new_full((sim.shape[0], n_segments), float("-inf"))
    best.scatter_reduce_(1, index, sim, "amax", include_self=True)
    if local is None:
        return best, None
    never = torch.iinfo(torch.int32).max
    hit = sim == best.gather(1, index)
    where = torch.where(hit, local.expand_as(hit), never)
    arg = torch.full(best.shape, never, dtype=torch.int32, device=sim.device)
    arg.scatter_reduce_(1, index, where, "amin", include_self=True)
    return best, arg.masked_fill_(arg == never, -1)


def segment_ids(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment id, index within the segment) of every element of consecutive segments of these lengths."""
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    local = torch.arange(segment.numel(), device=lengths.device) - starts[segment]
    return segment, local.to(torch.int32)


def document_runs(d_host: Sequence[int] | np.ndarray, budget: int) -> Iterator[tuple[int, int]]:
    """Runs [first, stop) of consecutive whole documents of at most ``budget`` tokens (one document alone
    where it is longer; empty documents join the run before them) over the host offsets ``d_host``."""
    offsets = np.asarray(d_host)
    nd, first = len(offsets) - 1, 0
    while first < nd:
        stop = max(int(np.searchsorted(offsets, offsets[first] + budget, side="right")) - 1, first + 1)
        yield first, stop
        first = stop


def candidate_runs(len_host: Sequence[int], first: int, stop: int, budget: int) -> Iterator[tuple[int, int]]:
    """Runs [a, b) of the candidates first .. stop - 1 (their documents' token counts ``len_host``) of at most
    ``budget`` tokens together (one candidate alone where it is longer)."""
    while first < stop:
        last, tokens = first + 1, len_host[first]
        while last < stop and tokens + len_host[last] <= budget:
            tokens += len_host[last]
            last += 1
        yield first, last
        first = last


def sum_rows_in_order(terms: torch.Tensor) -> torch.Tensor:
    """The rows of ``terms`` [rows, n] added one after another (fp32), as `_varlen_torch`'s index_add adds
    a query's tokens on the CPU: a score's bits then depend neither on the other candidates of its block
    (torch's sum over dim 0 orders its additions by the block's width) nor on whether the pair was
    reranked or searched. On a GPU index_add adds with atomics, in no fixed order: a loop there."""
    if terms.device.type == "cpu":
        rows = torch.zeros(terms.shape[0], dtype=torch.int64)
        return torch.zeros((1, terms.shape[1])).index_add_(0, rows, terms)[0]
    total = torch.zeros(terms.shape[1], device=terms.device)
    for row in terms:
        total += row
    return total


def _varlen_torch(
    q8: torch.Tensor,
    sq: torch.Tensor,
    query_offsets: torch.Tensor,
    d8: torch.Tensor,
    sd: torch.Tensor,
    doc_offsets: torch.Tensor,
    return_argmax: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    nq, nd = query_offsets.numel() - 1, doc_offsets.numel() - 1
    device = d8.device
    n_rows = q8.shape[0]
    q_float = q8.float()
    row_query = torch.repeat_interleave(torch.arange(nq, device=device), query_offsets.diff())
    d_host = doc_offsets.tolist()
    out = torch.empty((nq, nd), dtype=torch.float32, device=device)
    arg = torch.empty((n_rows, nd), dtype=torch.int32, device=device) if return_argmax else None
    budget = max(1, _TORCH_BLOCK_ELEMS // max(1, n_rows))  # document tokens per block
    for first, last in document_runs(d_host, budget):
        t0, t1 = d_host[first], d_host[last]
        # int8 codes as fp32: the products and every partial sum are integers below 2^24, hence exact.
        sim = q_float @ d8[t0:t1].float().T
        sim.mul_(sd[t0:t1])  # the one fp32 rounding of s_d * acc, as in the kernel
        segment, local = segment_ids(doc_offsets[first : last + 1].diff())
        best, best_arg = segment_max(sim, segment, last - first, local if return_argmax else None)
        out[:, first:last] = torch.zeros((nq, last - first), device=device).index_add_(
            0, row_query, sq[:, None] * best
        )
        if arg is not None:
            arg[:, first:last] = best_arg
    return out, arg


def _candidates_torch(
    q8: torch.Tensor,
    sq: torch.Tensor,
    query_offsets: torch.Tensor,
    d8: torch.Tensor,
    sd: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor,
    candidate_docs: torch.Tensor,
    return_argmax: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    q_host = query_offsets.tolist()
    cand_host = candidate_offsets.tolist()
    nq = len(q_host) - 1
    device = d8.device
    n_cand = candidate_docs.numel()
    max_len = max((q_host[i + 1] - q_host[i] for i in range(nq)), default=0)
    out = torch.empty((n_cand,), dtype=torch.float32, device=device)
    arg = torch.full((n_cand, max_len), -1, dtype=torch.int32, device=device) if return_argmax else None
    cand_start = doc_offsets[candidate_docs]
    cand_len = doc_offsets[candidate_docs + 1] - cand_start
    len_host = cand_len.tolist()
    for query in range(nq):
        r0, r1 = q_host[query], q_host[query + 1]
        q_float = q8[r0:r1].float()
        budget = max(1, _TORCH_BLOCK_ELEMS // max(1, r1 - r0))
        for first, last in candidate_runs(len_host, cand_host[query], cand_host[query + 1], budget):
            segment, local = segment_ids(cand_len[first:last])
            token = cand_start[first:last][segment] + local
            sim = q_float @ d8[token].float().T
            sim.mul_(sd[token])
            best, best_arg = segment_max(sim, segment, last - first, local if return_argmax else None)
            out[first:last] = sum_rows_in_order(sq[r0:r1, None] * best)
            if arg is not None:
                arg[first:last, : r1 - r0] = best_arg.T
    return out, arg


# ----------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------


def maxsim_varlen_int8(
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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Every query against every document, int8 x int8 with per-token scales.

    queries [Tq, dim] float (quantized per token here, on the GPU for CUDA tensors) or int8 with
    `query_scales` fp32 [Tq]; query_offsets int64 [nq+1]; docs int8 [Td, dim] with `doc_scales` fp32 [Td];
    doc_offsets int64 [nd+1]. Returns fp32 scores [nq, nd]
    ``score[q, d] = sum_i s_q[i] * max_j (s_d[j] * (q8[i] . d8[j]))`` and, with `return_argmax`, int32
    [Tq, nd]: the winning token's index within the document (lowest on ties). A document with no tokens
    scores -inf (argmax -1). `allow_tf32` is accepted for the shared signature and has no effect (the
    products are integer). backend: "auto" (Triton on CUDA, torch on CPU), "triton", "torch".

    Offsets are checked on the host (a query needs >= 1 token) except by the Triton path on CUDA
    tensors, which never synchronises with the device; there they must be valid. Scores only, dim 128, on
    an sm_90 GPU: many queries run on the Gluon kernel of `maxsim_int8_hopper` (offsets on the device are
    read back and checked once per tensor, for its plan: one synchronisation per new tensor), one
    query of at most 64 tokens on the Gluon stream kernel of `maxsim_int8_hopper_stream` (same maxima;
    the query sums added in another order, within the same bound).
    """
    del allow_tf32
    given_q_off, given_d_off = query_offsets, doc_offsets
    backend, q8, sq, query_offsets, d8, sd, doc_offsets = _prepare(
        queries, query_offsets, docs, doc_offsets, doc_scales, query_scales, backend
    )
    if backend == "triton":
        gpu = _kernels()
        stream = hopper = None
        if query_offsets.numel() == 2:
            stream = gpu.hopper_stream(given_q_off, q8, d8, return_argmax)
        else:
            hopper = gpu.hopper_allpairs(given_q_off, given_d_off, q8, d8, return_argmax)
        if stream is not None:
            module, longest = stream
            out = module.maxsim_int8_stream(q8, sq, query_offsets, None, None, d8, sd, doc_offsets, longest)
            return out[None]
        if hopper is not None:
            return gpu.launch_hopper(
                hopper, given_q_off, given_d_off, query_offsets, doc_offsets, q8, sq, d8, sd
            )
        out, arg = gpu.launch_varlen(q8, sq, query_offsets, d8, sd, doc_offsets, return_argmax)
    elif not return_argmax and int8_stream_applies(q8, d8.device):  # a few query rows on the CPU
        out, arg = maxsim_int8_varlen_cpu(q8, sq, query_offsets.numpy(), d8, sd, doc_offsets.numpy()), None
    elif not return_argmax and d8.device.type == "cpu":  # many query rows on the CPU
        out, arg = maxsim_int8_docs_cpu(q8, sq, query_offsets.numpy(), d8, sd, doc_offsets.numpy()), None
    else:
        out, arg = _varlen_torch(q8, sq, query_offsets, d8, sd, doc_offsets, return_argmax)
    return (out, arg) if return_argmax else out


def _check_candidates(
    candidate_offsets: torch.Tensor,
    candidate_docs: torch.Tensor,
    n_queries: int,
    n_docs: int,
    device: torch.device,
    check: bool,
    guarded: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(candidate_offsets, candidate_docs) on `device`; offset values checked as in `device_offsets`, document
    indices as `check_candidate_docs` says (`guarded`: the Triton kernels, which guard each index)."""
    if not isinstance(candidate_docs, torch.Tensor) or candidate_docs.dtype != torch.int64:
        raise ValueError("candidate_docs must be a 1-D int64 tensor [C] of document indices")
    if candidate_docs.dim() != 1 or candidate_docs.device not in (device, torch.device("cpu")):
        raise ValueError(f"candidate_docs must be a 1-D int64 tensor on {device} or the CPU")
    if not isinstance(candidate_offsets, torch.Tensor) or candidate_offsets.shape != (n_queries + 1,):
        raise ValueError(f"candidate_offsets must have nq+1 = {n_queries + 1} entries")
    n_cand = candidate_docs.numel()
    offsets = device_offsets(
        "candidate_offsets", candidate_offsets, n_cand, device, empty_ok=True, check=check
    )
    if n_cand:
        check_candidate_docs(candidate_docs, n_docs, guarded=guarded)
    return offsets, on_device(candidate_docs, device)


def maxsim_candidates_int8(
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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Each query against its own candidates (reranking), int8 x int8 with per-token scales.

    Query i's candidates are ``candidate_docs[candidate_offsets[i]:candidate_offsets[i+1]]`` (int64 indices
    into doc_offsets), read in place. Returns fp32 scores [C] (same formula as `maxsim_varlen_int8`) and,
    with `return_argmax`, int32 [C, max query length] with -1 past each query's length. Checks as in
    `maxsim_varlen_int8` (the Triton path on CUDA synchronises only to size the argmax). Candidate indices
    on the host, or on any device with the torch backend, are checked there (ValueError naming the entry
    outside [0, number of documents)); on the GPU with the Triton backend they are not read by the host:
    the kernels (Triton and the Gluon stream kernel) never read through a bad index and score it NaN
    (argmax -1). Scores only, dim 128, queries of at most 64 tokens whose offsets come from the host, on
    an sm_90 GPU: the Gluon stream kernel of `maxsim_int8_hopper_stream` (same maxima, sums in another
    order, within the same bound). On the CPU without argmax: `cpu.maxsim_int8_candidates_cpu` (groups of
    one query's candidates over the worker threads, or all pairs of the queries and the documents listed
    where the candidates are dense), the same bits.
    """
    del allow_tf32
    given_q_off = query_offsets
    backend, q8, sq, query_offsets, d8, sd, doc_offsets = _prepare(
        queries, query_offsets, docs, doc_offsets, doc_scales, query_scales, backend
    )
    nq, nd = query_offsets.numel() - 1, doc_offsets.numel() - 1
    check = backend == "torch" or d8.device.type != "cuda"
    candidate_offsets, candidate_docs = _check_candidates(
        candidate_offsets, candidate_docs, nq, nd, d8.device, check, backend == "triton"
    )
    if backend == "triton":
        gpu = _kernels()
        stream = gpu.hopper_stream(given_q_off, q8, d8, return_argmax)
        if stream is not None:
            module, longest = stream
            return module.maxsim_int8_stream(
                q8, sq, query_offsets, candidate_offsets, candidate_docs, d8, sd, doc_offsets, longest
            )
        out, arg = gpu.launch_candidates(
            q8, sq, query_offsets, d8, sd, doc_offsets, candidate_offsets, candidate_docs, return_argmax
        )
    elif not return_argmax and d8.device.type == "cpu":
        c_off, c_docs = candidate_offsets.numpy(), candidate_docs.numpy()
        q_off, d_off = query_offsets.numpy(), doc_offsets.numpy()
        out, arg = maxsim_int8_candidates_cpu(q8, sq, q_off, d8, sd, d_off, c_off, c_docs), None
    else:
        out, arg = _candidates_torch(
            q8, sq, query_offsets, d8, sd, doc_offsets, candidate_offsets, candidate_docs, return_argmax
        )
    return (out, arg) if return_argmax else out


def maxsim_int8_reference(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    *,
    doc_scales: torch.Tensor,
    query_scales: torch.Tensor | None = None,
    return_argmax: bool = False,
    round_products: bool = True,
    block_elems: int = 1 << 23,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The float64 evaluation of the int8 integer math, all pairs: the reference the kernels are tested on.

    ``acc = q8 @ d8.T`` (exact in float64), ``score[q, d] = sum_i s_q[i] * max_j (s_d[j] * acc[i, j])`` in
    float64. With `round_products` (default) each ``s_d[j] * acc[i, j]`` is rounded to fp32 first, exactly
    as the kernels round it, so the max and the argmax (lowest index on ties) are defined identically and
    must match bit for bit; only the query-scale products and the sum differ, by fp32 rounding. Float
    queries are quantized with `quantize_per_token` (torch ops). Computed on the documents' device over
    padded blocks of documents (an implementation independent of the kernels' segmented max). Returns
    float64 [nq, nd] and optionally int32 argmax [Tq, nd].
    """
    device = docs.device
    if queries.dtype == torch.int8:
        if query_scales is None:
            raise ValueError("int8 queries need query_scales")
        q8, sq = queries.to(device), query_scales.to(device).double()
    else:
        q8, sq = _quantize_torch(queries.to(device))
        sq = sq.double()
    q_host = query_offsets.tolist()
    d_host = doc_offsets.tolist()
    nq, nd, n_rows = len(q_host) - 1, len(d_host) - 1, q8.shape[0]
    q64 = q8.double()
    sd = doc_scales.to(device).float()
    row_query = torch.repeat_interleave(
        torch.arange(nq, device=device), torch.tensor(q_host, device=device).diff()
    )
    out = torch.empty((nq, nd), dtype=torch.float64, device=device)
    arg = torch.empty((n_rows, nd), dtype=torch.int32, device=device)
    first = 0
    while first < nd:
        last = first + 1
        longest = max(1, d_host[first + 1] - d_host[first])
        while (
            last < nd
            and n_rows * (last + 1 - first) * max(longest, d_host[last + 1] - d_host[last]) <= block_elems
        ):
            longest = max(longest, d_host[last + 1] - d_host[last])
            last += 1
        t0, t1 = d_host[first], d_host[last]
        acc = q64 @ docs[t0:t1].double().T  # exact: integers below 2^53
        if round_products:
            prod = (acc.float() * sd[t0:t1]).double()  # acc < 2^24 is exact in fp32; one rounding
        else:
            prod = acc * sd[t0:t1].double()
        starts = torch.tensor(d_host[first:last], device=device) - t0
        lengths = torch.tensor(d_host[first + 1 : last + 1], device=device) - t0 - starts
        pos = torch.arange(longest, device=device)
        inside = pos[None, :] < lengths[:, None]  # [docs, longest]
        column = torch.where(inside, starts[:, None] + pos[None, :], 0)
        padded = prod[:, column].masked_fill_(~inside[None], float("-inf"))  # [Tq, docs, longest]
        best, best_arg = padded.max(dim=2)  # first maximal index on ties
        best_arg.masked_fill_(lengths[None, :] == 0, -1)  # a document with no tokens: -inf, argmax -1
        out[:, first:last] = torch.zeros((nq, last - first), dtype=torch.float64, device=device).index_add_(
            0, row_query, sq[:, None] * best
        )
        arg[:, first:last] = best_arg.to(torch.int32)
        first = last
    return (out, arg) if return_argmax else out
