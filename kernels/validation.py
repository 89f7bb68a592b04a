"""Input checks shared by the MaxSim backends (Triton, torch CPU, float64 reference).

Every check raises ValueError with one line that names the argument, the offending position and what to do.
Checks that read offset values run on a host copy of the offsets (they are small: 8 bytes per document).
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

T = TypeVar("T")

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_DIM = 4096  # the Triton kernels walk the embedding dimension in chunks, so any multiple of 8 works
BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class Layout:
    """Host-side view of a packed problem, produced by `check_inputs`.

    q_offsets/d_offsets are int64 numpy copies of the offsets; q_lens/d_lens the token counts.
    """

    q_offsets: np.ndarray
    d_offsets: np.ndarray
    q_lens: np.ndarray
    d_lens: np.ndarray
    dim: int

    @property
    def num_queries(self) -> int:
        return len(self.q_lens)

    @property
    def num_docs(self) -> int:
        return len(self.d_lens)

    @functools.cached_property
    def max_query_len(self) -> int:
        return int(self.q_lens.max()) if len(self.q_lens) else 0

    @functools.cached_property
    def max_doc_len(self) -> int:
        return int(self.d_lens.max()) if len(self.d_lens) else 0


# Per-tensor memo of derived data (validated host copies, device copies, launch tables): the same
# offsets tensors come back for every query batch, and recomputing from them costs a device<->host copy
# that stalls the launch queue (1 query x 100K documents: 1.66 ms with offsets on the GPU against 1.22 ms
# on the host; docs/kernel-notes.md, "Version 1 (commit 93c4de8)..."). An entry is keyed by the
# tensor object and its in-place version counter, and dies with the tensor. Writes that bypass the
# version counter (through a numpy view or `.data`) are not seen: treat offsets as immutable.
_MEMO: dict[int, tuple[weakref.ref, int, dict[Hashable, Any]]] = {}


def _forget(key: int, ref: weakref.ref) -> None:
    if _MEMO is None:  # interpreter shutdown
        return
    entry = _MEMO.get(key)
    if entry is not None and entry[0] is ref:
        del _MEMO[key]


def memo(tensor: torch.Tensor, key: Hashable, compute: Callable[[], T]) -> T:
    """compute(), remembered for this tensor object until it changes in place or is freed."""
    try:
        version = tensor._version
    except RuntimeError:  # inference tensors have no version counter
        return compute()
    entry = _MEMO.get(id(tensor))
    if entry is None or entry[0]() is not tensor or entry[1] != version:
        entry = (weakref.ref(tensor, functools.partial(_forget, id(tensor))), version, {})
        _MEMO[id(tensor)] = entry
    store = entry[2]
    if key not in store:
        store[key] = compute()
    return store[key]


_PAIRS_PER_TENSOR = 8  # launch plans kept per offsets tensor: one per recent partner (query batch, say)


def memo_pair(first: torch.Tensor, second: torch.Tensor, key: Hashable, compute: Callable[[], T]) -> T:
    """compute(), remembered for this pair of tensor objects until either changes in place or is freed.

    Kept on `first`, at most _PAIRS_PER_TENSOR partners (the oldest is dropped): a corpus's offsets meet
    many query batches, and each batch's plan is only worth keeping while that batch is in use. The value
    must not hold `first` or `second` themselves (nor a tensor that views them): the memo would then keep
    them alive for ever."""
    try:
        version = second._version
    except RuntimeError:  # inference tensors have no version counter
        return compute()
    pairs: dict = memo(first, "pairs", dict)
    full_key = (id(second), version, key)
    entry = pairs.get(full_key)
    if entry is not None and entry[0]() is second:
        return entry[1]
    value = compute()
    pairs.pop(full_key, None)
    while len(pairs) >= _PAIRS_PER_TENSOR:
        pairs.pop(next(iter(pairs)))
    pairs[full_key] = (weakref.ref(second), value)
    return value


def alignment_key(*tensors: torch.Tensor) -> tuple | None:
    """What a launch plan depends on besides the offsets' identities: shape, strides, dtype, device and
    16-byte alignment (Triton specialises pointers on it) of each data tensor; None for a non-tensor."""
    key: list = []
    for x in tensors:
        if not isinstance(x, torch.Tensor):
            return None
        key += (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16 == 0)
    return tuple(key)


# Query offsets of at most this many entries, on the host, key a plan by their values (`memo_plan`): a
# search or a served call brings a new offsets tensor each time, of a few queries.
_BY_VALUE_MAX = 65


def memo_plan(first: object, second: object, key: tuple | None, compute: Callable[[], T]) -> T:
    """compute() remembered per (first, second) offsets pair and `key` (`memo_pair`), or simply computed
    where an argument is not a tensor (the checks inside compute() then say what is wrong).

    Where ``second`` is a few host offsets (`_BY_VALUE_MAX`), the plan is remembered by their values
    instead, on ``first``, for the `_PAIRS_PER_TENSOR` latest: a plan depends on the offsets' values, not
    on which tensor holds them, and a search or a served call brings a new tensor of a few queries each
    time, whose plan (checks, configuration and launch, with its compiled launcher) is then the one
    made for the same lengths before (one query x 200K documents: 0.18 ms of host time a call on the
    H100's host, docs/kernel-notes.md, "The API's search and rerank: the host around one launch")."""
    if key is None or not isinstance(first, torch.Tensor) or not isinstance(second, torch.Tensor):
        return compute()
    if second.device.type == "cpu" and second.dim() == 1 and second.numel() <= _BY_VALUE_MAX:
        plans: dict = memo(first, "plans by query offsets", dict)  # (a fresh dict: nothing is kept)
        full_key = (second.dtype, tuple(second.tolist()), key)
        value = plans.get(full_key)
        if value is None:
            value = compute()
            while len(plans) >= _PAIRS_PER_TENSOR:
                plans.pop(next(iter(plans)))
            plans[full_key] = value
        return value
    return memo_pair(first, second, key, compute)


def on_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An int64 contiguous copy of `x` on `device` (memoised: one transfer per offsets tensor)."""
    if x.device == device and x.dtype == torch.int64 and x.is_contiguous():
        return x
    return memo(x, ("device", str(device)), lambda: host_to_device(x.to(torch.int64).contiguous(), device))


def share_device_copy(host: torch.Tensor, device_copy: torch.Tensor) -> None:
    """Tell the launchers that `device_copy` already holds `host`'s values, so that `on_device` hands it
    out instead of staging and copying `host` again.

    `maxsim score` copies each document batch's offsets to the GPU together with its embeddings; the
    kernels take the host offsets (for their checks and launch grids) and would otherwise copy them a
    second time per batch, on the stream the kernel runs on, which then waits for it: ~0.45 ms a batch
    (docs/kernel-notes.md, "`maxsim score`: the pass against the kernel"). The caller guarantees that the
    values are equal and that `device_copy` is not overwritten while `host` lives.
    """
    if device_copy.dtype != torch.int64 or not device_copy.is_contiguous():
        raise ValueError("share_device_copy: the device copy must be a contiguous int64 tensor")
    if tuple(device_copy.shape) != tuple(host.shape) or host.dtype != torch.int64:
        raise ValueError(
            f"share_device_copy: host {tuple(host.shape)} {host.dtype} and device copy "
            f"{tuple(device_copy.shape)} {device_copy.dtype} differ"
        )
    if device_copy.device == host.device:
        return
    memo(host, ("device", str(device_copy.device)), lambda: device_copy)


def host_to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`x` copied to `device` without the host waiting for the device.

    A host -> GPU copy that is not `non_blocking` synchronises the stream first: the host waits for
    every kernel queued before it. `maxsim score` passes each document batch's offsets on the host, so
    that wait made every batch's launches start only once the previous batch had been scored (the GPU
    idle meanwhile). Here the values go through a private page-locked buffer (from torch's caching host
    allocator, which keeps the block until the copy has run) and the copy is queued on the stream;
    the caller's tensor is read now, so it may change as soon as this returns."""
    if device.type != "cuda" or x.device.type != "cpu":
        return x.to(device)
    staged = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    staged.copy_(x)
    return staged.to(device, non_blocking=True)


def host_offsets(name: str, offsets: torch.Tensor, total: int) -> np.ndarray:
    """Check a packed-offsets tensor (int, 1-D, offsets[0] == 0, non-decreasing, offsets[-1] == total).

    Returns a read-only int64 host copy, memoised per tensor.
    """
    if not isinstance(offsets, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of int64 offsets, got {type(offsets).__name__}")
    return memo(offsets, ("host", name, total), lambda: _host_offsets(name, offsets, total))


def _host_offsets(name: str, offsets: torch.Tensor, total: int) -> np.ndarray:
    if not isinstance(offsets, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of int64 offsets, got {type(offsets).__name__}")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(
            f"{name} must be a 1-D tensor [n+1] starting with 0, got shape {tuple(offsets.shape)}"
        )
    if offsets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be int64 (or int32), got {offsets.dtype}: cast it with .long()")
    host = offsets.detach().to("cpu", torch.int64).numpy()
    if host[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(host[0])}")
    if host[-1] != total:
        raise ValueError(
            f"{name}[-1] = {int(host[-1])} but the packed tensor has {total} rows: offsets and rows disagree"
        )
    steps = np.diff(host)
    if len(steps) and steps.min() < 0:
        bad = int(np.argmin(steps))
        raise ValueError(
            f"{name} decreases at entry {bad} ({int(host[bad])} -> {int(host[bad + 1])}): must be sorted"
        )
    host = host.copy() if host.base is not None else host  # never a view of the caller's memory
    host.flags.writeable = False
    return host


def check_inputs(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    *,
    doc_scales: torch.Tensor | None = None,
    allow_float64: bool = False,
) -> Layout:
    """Validate the packed queries/documents pair and return host copies of the offsets.

    Rules: 2-D tensors [tokens, dim] on one device; dim a multiple of 8 in [8, MAX_DIM]; float16, bfloat16
    or float32 (float64 too where `allow_float64`), or int8 documents with fp32 `doc_scales` [Td];
    every query has at least one token (a document may have none: its score is -inf).
    """
    for name, x in (("queries", queries), ("docs", docs)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a 2-D packed tensor [tokens, dim], got {shape}")
    dim = queries.shape[1]
    if docs.shape[1] != dim:
        raise ValueError(f"queries have dim {dim} but docs have dim {docs.shape[1]}: they must match")
    if dim % 8 != 0 or not 8 <= dim <= MAX_DIM:
        raise ValueError(
            f"dim must be a multiple of 8 between 8 and {MAX_DIM}, got {dim}: pad the embeddings"
        )
    allowed = FLOAT_DTYPES + ((torch.float64,) if allow_float64 else ())
    if queries.dtype not in allowed:
        raise ValueError(f"queries must be one of {[str(d) for d in allowed]}, got {queries.dtype}")
    if docs.dtype == torch.int8:
        if doc_scales is None:
            raise ValueError("int8 docs need doc_scales (fp32 [Td], one scale per document token)")
        if doc_scales.shape != (docs.shape[0],):
            raise ValueError(f"doc_scales must have shape [{docs.shape[0]}], got {tuple(doc_scales.shape)}")
    elif docs.dtype not in allowed:
        raise ValueError(f"docs must be one of {[str(d) for d in allowed]} or int8, got {docs.dtype}")
    devices = {queries.device, docs.device}
    if len(devices) != 1:
        raise ValueError(f"queries and docs are on different devices ({queries.device}, {docs.device})")
    q_off = host_offsets("query_offsets", query_offsets, queries.shape[0])
    d_off = host_offsets("doc_offsets", doc_offsets, docs.shape[0])
    q_lens = memo(query_offsets, ("lens", queries.shape[0]), lambda: np.diff(q_off))
    if len(q_lens) and q_lens.min() <= 0:
        bad = int(np.argmin(q_lens))
        raise ValueError(
            f"query {bad} has no tokens (query_offsets[{bad}] == query_offsets[{bad + 1}]): drop it"
        )
    d_lens = memo(doc_offsets, ("lens", docs.shape[0]), lambda: np.diff(d_off))
    return Layout(q_off, d_off, q_lens, d_lens, dim)


def check_candidates(
    candidate_offsets: torch.Tensor,
    candidate_docs: torch.Tensor,
    num_queries: int,
    num_docs: int,
    *,
    guarded: bool = False,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Check the per-query candidate lists; return host copies (offsets int64 [nq+1], docs int64 [C]).

    The offsets are always read on the host (memoised per tensor): the launchers plan their programs from
    them, so offsets on a GPU cost one device->host copy, and with it a wait for the device, per new
    offsets tensor. The document indices are checked as `check_candidate_docs` says: with `guarded` (the
    caller's kernel guards each index itself) indices on a GPU are not read here and the docs copy is None.
    """
    if not isinstance(candidate_docs, torch.Tensor) or candidate_docs.dim() != 1:
        raise ValueError("candidate_docs must be a 1-D int64 tensor of document indices")
    if candidate_docs.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"candidate_docs must be int64 (or int32), got {candidate_docs.dtype}")
    c_off = host_offsets("candidate_offsets", candidate_offsets, candidate_docs.numel())
    if len(c_off) != num_queries + 1:
        raise ValueError(
            f"candidate_offsets has {len(c_off)} entries but there are {num_queries} queries: need nq+1"
        )
    return c_off, check_candidate_docs(candidate_docs, num_docs, guarded=guarded)


def values_on_host(x: torch.Tensor) -> bool:
    """Whether `x`'s values can be read without waiting for a device (a CPU tensor)."""
    return x.device.type == "cpu"


def check_candidate_docs(candidate_docs: torch.Tensor, num_docs: int, *, guarded: bool) -> np.ndarray | None:
    """The checked int64 host copy of `candidate_docs` (memoised per tensor), or None where `guarded` and
    the indices live on a device.

    Candidates on the host are checked here: an index outside [0, num_docs) raises ValueError naming the
    entry. Candidates on a GPU for a kernel that guards each index (`guarded`: the Triton kernels of the
    candidates layout, fp16/bf16/fp32 and int8) are not copied to the host: a service passes a new
    candidates tensor with every batch, and reading it here would make the host wait for the device
    before every launch (1.23 against 0.96 ms for a rerank of 64 queries x 1,000 candidates on an H100).
    The kernel then never dereferences a bad index and scores its candidate NaN (argmax -1), so bad input
    shows in the scores instead of raising."""
    if guarded and not values_on_host(candidate_docs):
        return None
    return memo(candidate_docs, ("candidates", num_docs), lambda: host_candidates(candidate_docs, num_docs))


def host_candidates(candidate_docs: torch.Tensor, num_docs: int) -> np.ndarray:
    c_docs = candidate_docs.detach().to("cpu", torch.int64).numpy().copy()
    c_docs.flags.writeable = False
    if len(c_docs):
        lo, hi = int(c_docs.min()), int(c_docs.max())
        if lo < 0 or hi >= num_docs:
            bad = int(np.argmax((c_docs < 0) | (c_docs >= num_docs)))
            raise ValueError(
                f"candidate_docs[{bad}] = {int(c_docs[bad])} is not a document index in [0, {num_docs})"
            )
    return c_docs


def interpreting() -> bool:
    """Whether Triton runs its interpreter (TRITON_INTERPRET=1: kernels on CPU tensors, as the tests run
    them), which takes no compile options and no inline PTX."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device) -> str:
    """ "triton" or "torch" for `backend` on tensors of `device` ("auto": Triton on CUDA, torch elsewhere).

    Triton on CPU tensors needs its interpreter (TRITON_INTERPRET=1), as the tests use it.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and not interpreting():
        raise ValueError(
            "backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors); use 'torch'"
        )
    return backend


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host integers (``triton.cdiv`` is a Triton function: ~2 us a call from Python)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
