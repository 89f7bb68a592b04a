"""MaxSim from torch ops in memory-bounded blocks: the CPU backend (every core), also valid on CUDA.

    score(q, d) = sum_i max_j <q_i, d_j>

Plan. Documents are sorted by length and cut into groups of consecutive lengths holding at most
`_GROUP_TOKENS` padded tokens. A group of n documents with longest length L is gathered into an
[n * L, dim] fp32 block in which position l >= len of a document holds a copy of its last token: a
duplicate cannot change a max, so the padding needs no mask at all (and an argmax that lands on a copy
is mapped back to len - 1, the token it copies). One matrix product of the block with all query tokens
(or `_QUERY_ROWS` of them at a time) gives the similarities [n * L, Tq]; a max over L of the
[n, L, Tq] view gives each token's max per document, and an index_add over query tokens gives the
scores of every query at once. Sorting keeps the padding small (uniform lengths 20-300 in groups of
consecutive lengths pad by ~1%), and the matrix product is large enough to run at the BLAS rate.

Precision: fp16/bf16 inputs are upcast to fp32 in blocks and everything accumulates in fp32 (float64
inputs stay float64). Cost: 2 * Tq * Td' * dim FLOPs with Td' the padded token count, one read of the
documents, and n * L * Tq similarities that stay in cache-sized blocks.
A document with no tokens scores -inf and has argmax -1.

Checking values on the way (``check_finite``): a document token with a NaN or +-Inf component has a
non-finite similarity with *every* finite query token (x * NaN = NaN, 0 * Inf = NaN, x * Inf = +-Inf for
x != 0, and a non-finite term keeps the fp32 sum non-finite), so the similarities of one query token,
already computed, find every such token: `NonFiniteDocuments` is raised. Within fp16's range finite
tokens cannot overflow the fp32 sum (|q . d| <= dim * 65504^2); larger finite values (bf16, fp32) can,
which raises the same error on finite values: a caller that needs to tell the two apart checks those
documents' values itself.
"""

from __future__ import annotations

import functools
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from .validation import Layout, check_candidates, check_inputs

# Padded document tokens per group and query tokens per matrix product. Measured on the 2-core dev
# machine (Xeon with AVX-512, torch 2.13, fp32, dim 128), 64 queries x 32 tokens against 4000 documents
# of 20-300 tokens, 4 interleaved rounds, best / median (sgemm 4096^3 at 317-324 GFLOP/s in the same
# process): groups x rows = 2048 x 512 -> 1.69 / 1.72 s (200 GFLOP/s), 2048 x 256 1.64 / 1.74,
# 4096 x 128 1.67 / 1.77, 1024 x 1024 1.72 / 1.77, 1024 x 512 1.72-1.75 / 1.77-1.79, 512 x 1024 1.95 /
# 1.96, 512 x 2048 (the previous choice, from a run when other jobs held the cores) 1.88-1.93 / 1.95-2.01,
# 256 x 512 2.19 / 2.28: about 1M similarities a block, with longer document groups. (An earlier sweep
# on 1000 documents, with other jobs on the cores and sgemm at 90 GFLOP/s, ranked them otherwise:
# 512 x 2048 81 GFLOP/s, 2048 x 2048 58, 2048 x 512 18.)
_GROUP_TOKENS = 2048
_QUERY_ROWS = 512

# On the CPU each group is one unit of work for the worker threads (see _stream_pool), all query rows at
# once. The groups used to run in order on the caller's thread, each op split over an OpenMP team of
# torch's thread count: ~15 ops a group, and at each one the team waits for its slowest member, which
# on a core another process holds waits for the scheduler. 2-core machine, 50 queries x 32 tokens
# against 1000 documents of 20-300 tokens, fp32, load average 5-11 from other jobs, 3 alternating
# rounds: 1.5-2.6 s on the workers against 5.2-17.1 s in order and 5.6-11.4 s for a padded torch
# version (one einsum, masked amax); with two busy processes started beside them 3.4-5.5 against 29-34
# and 13-27 s. Cutting the queries into ranges too, so that few groups still make many units, was
# slower: 50 x 10 documents (one group) 28 ms median in one unit, 61 in 8; 50 x 40 127 against 160;
# 512 x 100 2.6 s either way.


# Few query tokens (one query, or a handful): stream the documents in their packed order instead, with
# no gather: S = D_chunk . Q^T [chunk, Tq] (the orientation of the blocked path, so the similarities are
# the same bits) and a scatter max of each token row into its document's row, chunks spread over one
# thread per core. Below _STREAM_MAX_ROWS query rows this reads the documents once and touches Tq floats
# per token, against dim floats per token for the gather of the blocked path. Measured on the 2-core dev
# machine, 1 query x 4000 documents of 20-300 tokens, fp32, 12 interleaved rounds (medians): 16K-token
# chunks with S^T = Q . D^T and np.maximum.reduceat 69.4 ms, 32K 64.0, 64K 67.3; this path with 32K
# chunks 62.7 ms (sgemm on cold [chunk, 128] x [128, 32] runs at ~130 GFLOP/s, 40% of the 4096^3 rate,
# and is ~75% of the time; the scatter max ~15%).
# A chunk is sized by the bytes of its worker's buffers (the upcast rows and the similarities, counted as
# `_stream_token_bytes`), not by tokens: 2-core Xeon, 1 query of 8 / 32 / 96 tokens against 2.1M fp16
# tokens in memory, 7 alternating rounds, medians, the same bits at every size (ms, 4 / 8 / 12 / 16 / 24 /
# 32 MiB): 8 rows 214 / 164 / 157 / 162 / 177 / 204, 32 rows 233 / 171 / 148 / 143 / 170 / 202, 96 rows
# 380 / 310 / 279 / 278 / 323 / 361 (benchmarks/results/cpu/stream-chunk-bytes-2core.txt). 32K tokens, the
# earlier size, are 20 MiB at 32 rows and 28 MiB at 96.
_STREAM_MAX_ROWS = 128
_STREAM_CHUNK_BYTES = 12 << 20


def _stream_token_bytes(dim: int, query_rows: int, compute: torch.dtype) -> int:
    """A document token's bytes in a stream worker's buffers: its row upcast (or decoded) and its similarities
    with every query row (and their int32 products, for int8 queries: counted for every call)."""
    size = torch.finfo(compute).bits // 8
    return dim * size + query_rows * (size + 4)

# Batch invariance: MKL's sgemm switches to other kernels, with other summation orders along dim, when
# either operand has fewer than ~8 rows (seen with torch 2.13 on AVX-512: 1 x 50, 3 x 7, 300 x 5 and
# 2 x 3000 products differ in the last bit from the same rows inside a large product; from 8 rows on
# they agree). Padding both operands to _MIN_GEMM_ROWS rows makes a similarity independent of which
# other queries and documents share its product, so scores do not depend on batch sizes or budgets.
_MIN_GEMM_ROWS = 16

# int8 query codes against int8 document values (int8 shards; int4 and int2 codes decoded a chunk at a
# time): the product in integers (`torch._int_mm`, int32, exact) in place of the chunk's upcast to fp32 and
# an fp32 product. Both are exact (every partial sum an integer below 2^24), so the scores are the same
# bits either way; only the speed differs. Taken where the CPU has int8 dot-product instructions (VNNI or
# AMX); None: decided by the CPU's flags, once. Measured: docs/kernel-notes.md, "CPU backend".
_INT8_PRODUCT: bool | None = None
_INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


# The worker threads live across calls: starting two threads took ~4 ms of a 63 ms call (1 query x 4000
# documents, 2-core dev machine). A new pool when the worker count changes, and in a forked child (which
# has none of the parent's threads). Each worker runs its products on one thread (torch's thread count is
# per thread): otherwise every worker's product opens an OpenMP team as wide as the machine and the cores
# are oversubscribed; 52.4 / 55.6 ms best / median against 58.9 / 62.7 (12 interleaved rounds,
# maxsim-cpu 92.2 / 96.1 in the same rounds).
# Work goes to the workers as many small units through the pool's one queue, never as a fixed share per
# thread: a worker that another process keeps off its core holds up one unit, not a half of the call,
# and no OpenMP team waits at a barrier for its descheduled member (see `_score_docs`). The workers are
# as many as the CPUs this process may use (`_worker_count`), not fewer when the machine is busy: with
# two busy processes beside it on the 2-core machine (load average ~10), 50 queries x 1000 documents
# took 9.6-15.1 s on one worker against 7.3-8.6 s on two (4 alternating rounds); the queue already gives
# the units of a worker that waits for its core to the other.
_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (workers, pool)
_POOL_LOCK = threading.Lock()
_CGROUP_CPUS: list[int | None] = []  # the cgroup's CPU limit, read once per process


def _cgroup_cpu_limit(root: str = "/sys/fs/cgroup") -> int | None:
    """The CPUs this process's cgroup may use (its CFS quota over its period, rounded up), None when it
    has no quota: cgroup v2's ``cpu.max`` ("max 100000" or "150000 100000"), else v1's
    ``cpu/cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` (quota -1: none)."""
    try:
        with open(os.path.join(root, "cpu.max"), encoding="ascii") as fh:
            quota, period = fh.read().split()[:2]
    except (OSError, ValueError):
        try:
            with open(os.path.join(root, "cpu", "cpu.cfs_quota_us"), encoding="ascii") as fh:
                quota = fh.read().strip()
            with open(os.path.join(root, "cpu", "cpu.cfs_period_us"), encoding="ascii") as fh:
                period = fh.read().strip()
        except OSError:
            return None
    try:
        q, t = int(quota), int(period)
    except ValueError:  # "max": no quota
        return None
    return max(1, -(-q // t)) if q > 0 and t > 0 else None


def _usable_cpus() -> int:
    """The CPUs this thread may run on now: its affinity mask (``os.sched_getaffinity``), capped by the
    cgroup's CPU quota where there is one (read once per process)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity masks on this platform
        cpus = os.cpu_count() or 1
    if not _CGROUP_CPUS:
        _CGROUP_CPUS.append(_cgroup_cpu_limit())
    limit = _CGROUP_CPUS[0]
    return max(1, min(cpus, limit) if limit is not None else cpus)


def _worker_count() -> int:
    """Worker threads a CPU call spreads over: torch's thread count for this thread (what a caller sets
    with ``torch.set_num_threads``), at most the CPUs it may run on (`_usable_cpus`). torch's default
    follows the affinity mask at start-up but neither a later mask nor a cgroup quota, and a worker
    beyond the CPUs only adds switches."""
    return max(1, min(torch.get_num_threads(), _usable_cpus()))


# `torch.set_num_threads` sets the calling thread's count and also the process's default, which a thread
# takes at its first call that reads its count: a pool whose threads each set 1 made every thread started
# after it, and a thread that had not read its count yet (the main thread of `maxsim score`, whose readers
# start first), run CPU calls on one worker. `one_torch_thread` puts the default back; the count of the
# thread that imports this module is read here, at the default.
_DEFAULT_THREADS_LOCK = threading.Lock()
torch.get_num_threads()


def one_torch_thread() -> None:
    """This thread's torch CPU operations on one thread (a pool's initializer: the pool is the
    parallelism), leaving the count that threads started later take as it was. ``torch.set_num_threads``
    sets both; the default is set back from a thread of its own, so that this one keeps 1."""
    with _DEFAULT_THREADS_LOCK:
        default = torch.get_num_threads()  # a new thread's first read: the default, as it is now
        torch.set_num_threads(1)
        restore = threading.Thread(target=torch.set_num_threads, args=(default,), name="maxsim-threads")
        restore.start()
        restore.join()


def worker_count() -> int:
    """The worker threads a CPU call from this thread spreads over now."""
    return _worker_count()


def _stream_pool(workers: int) -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != workers:
            if _POOL is not None:
                _POOL[1].shutdown(wait=False)
            _POOL = (
                workers,
                ThreadPoolExecutor(workers, thread_name_prefix="maxsim-cpu", initializer=one_torch_thread),
            )
        return _POOL[1]


def _run_units(work: Callable[[Any], None], units: list[Any], workers: int) -> None:
    """work(unit) for every unit on `workers` pool threads, which take the units from one queue in order,
    under the caller's grad and inference modes (each thread has its own: an autograd function's forward
    runs without grad, and only a thread in inference mode may write into the caller's inference tensors)."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def run(unit: Any) -> None:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            work(unit)

    list(_stream_pool(workers).map(run, units))


def _forget_pool_after_fork() -> None:
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()
    _CGROUP_CPUS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


class NonFiniteDocuments(ValueError):
    """A document token's similarities are NaN or Inf: it holds NaN/Inf values (or, for bf16 and fp32
    documents, values so large that the fp32 sum overflows). Raised by ``check_finite``."""


def _require_finite(similarities: torch.Tensor) -> None:
    """One query token's similarities with a set of document tokens (any shape) must all be finite."""
    if not bool(torch.isfinite(similarities).all()):
        raise NonFiniteDocuments(
            "a document token has NaN or Inf similarities: its embedding holds NaN or Inf values"
        )


@functools.cache
def _cpu_has_int8_dot() -> bool:
    """Whether this CPU lists an int8 dot-product instruction set (`_INT8_FLAGS`) in /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as fh:
            words = set(fh.read().split())
    except OSError:
        return False
    return any(flag in words for flag in _INT8_FLAGS)


# A chunk's int32 products made from codes without their int8 values: (t0, t1, out [t1 - t0, rows]).
IntProducts = Callable[[int, int, torch.Tensor], object]


def int8_columns(rows: torch.Tensor) -> torch.Tensor:
    """int8 query rows [n, k] as `torch._int_mm`'s right operand [k, n]: the contiguous rows seen
    transposed (the int8 product runs 1.5x faster so than on contiguous columns: a 32K-token chunk at
    d = 128 against 32 rows, one thread, 1.18 against 1.82 ms)."""
    return rows.contiguous().T


def int8_products(k: int) -> bool:
    """Whether the int8 stream multiplies rows of ``k`` int8 values in integers (`_INT8_PRODUCT`). Not
    for k = 1: `torch._int_mm` on the CPU misreads operands of one column (their strides are ambiguous)
    and returns other numbers."""
    return k > 1 and (_cpu_has_int8_dot() if _INT8_PRODUCT is None else _INT8_PRODUCT)


def _int8_query_rows(q8: torch.Tensor) -> torch.Tensor:
    """int8 query rows as the int8 paths multiply them: as they are where the products are made in integers
    (`int8_products`), else their fp32 values (both exact)."""
    return q8.contiguous() if int8_products(q8.shape[1]) else q8.float().contiguous()


def _similarities(a: torch.Tensor, b_t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a [m, dim] . b_t [dim, n] as a contiguous [m, n], computed identically whatever m and n are
    (into ``out``, a contiguous [m, n], when given and no padding is needed).

    The right operand comes transposed and contiguous (the query tokens as columns): MKL multiplies
    [n_tokens, 128] x [128, 32] 2-8% faster that way than through a transposed view (2-core dev machine,
    1 query x 4000 documents, 12 interleaved rounds: 56.8 / 59.0 ms best / median against 58.2 / 64.2)."""
    m, n = a.shape[0], b_t.shape[1]
    if m >= _MIN_GEMM_ROWS and n >= _MIN_GEMM_ROWS and out is not None:
        return torch.mm(a, b_t, out=out)
    if m < _MIN_GEMM_ROWS:
        a = torch.cat([a, a.new_zeros(_MIN_GEMM_ROWS - m, a.shape[1])])
    if n < _MIN_GEMM_ROWS:
        b_t = torch.cat([b_t, b_t.new_zeros(b_t.shape[0], _MIN_GEMM_ROWS - n)], dim=1)
    product = torch.mm(a, b_t)
    return product if product.shape == (m, n) else product[:m, :n].contiguous()


# Each stream worker's upcast chunk and similarity block live in buffers kept per thread (12 MiB a chunk,
# `_STREAM_CHUNK_BYTES`): fresh 16 MB tensors (32K-token chunks then) were mapped and unmapped by malloc on
# every chunk, a page fault per 4 KB each time: 1.31-1.73 s -> 1.04-1.34 s (docs/history.md). The blocked
# path's gathered rows, upcast block and similarities (~5.5 MiB a worker at d = 128) too: 64 queries x 512 MiB
# of fp16 took 5.65 s against 6.75 with fresh tensors a group, and the process grew 142 MiB against 183
# (what the C allocator kept of them in each worker's arena; 2-core Xeon, medians of 5,
# benchmarks/results/cpu/blocked-buffers-2core.txt).
_SCRATCH = threading.local()


def thread_buffer(name: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous [rows, cols] view of this thread's reusable buffer ``name`` (grown when too small).

    A thread keeps at most `worker_keep_bytes` of buffers: a new one lets go of those used least recently
    first (a call's own stay alive through its views until it returns). Every path's buffers of one call
    fit that at the dims of the field, so a worker that runs one path keeps them all, and one that ran
    another path before drops that path's instead of holding both.

    The buffer is a normal tensor, never an inference tensor, even when made under ``torch.inference_mode``
    (a call from `maxsim score` or the API): written in place outside inference mode by a later call, an
    inference tensor raises."""
    need = shape[0] * shape[1]
    kept: OrderedDict[str, torch.Tensor] | None = getattr(_SCRATCH, "buffers", None)
    if kept is None:
        kept = _SCRATCH.buffers = OrderedDict()
    buf = kept.pop(name, None)
    if buf is None or buf.dtype != dtype or buf.numel() < need:
        buf = None  # let go of the smaller one before the new one is made
        held = sum(b.numel() * b.element_size() for b in kept.values())
        while kept and held + need * dtype.itemsize > worker_keep_bytes():
            _, old = kept.popitem(last=False)
            held -= old.numel() * old.element_size()
        with torch.inference_mode(False):
            buf = torch.empty(need, dtype=dtype)
    kept[name] = buf  # the most recently used last
    return buf[:need].view(shape)


def worker_keep_bytes() -> int:
    """The buffers a worker thread keeps (`thread_buffer`): the largest of one call's on any path, at d <=
    256 and documents of a few thousand tokens: the stream's chunk (`_STREAM_CHUNK_BYTES`) or a rerank
    group's rows (its budget and the rows before their upcast: 1.5 x `_QUERY_GROUP_BYTES`), and 4 MiB for
    a chunk's long last document and its decoded codes (the blocked path's group: 5.5 MiB at d = 128)."""
    return max(_STREAM_CHUNK_BYTES, 3 * _QUERY_GROUP_BYTES // 2) + (4 << 20)


def _empty_document_scores(
    token_query: torch.Tensor, nq: int, query_scales: torch.Tensor | None
) -> torch.Tensor:
    """fp32 [nq]: a document with no tokens scores -inf, or with int8 queries what the blocked int8 path
    sums for it: each query row's scale times -inf (NaN where a scale is 0)."""
    if query_scales is None:
        return torch.full((nq,), -torch.inf)
    return torch.zeros(nq).index_add_(0, token_query, query_scales * -torch.inf)


def _score_stream(
    q: torch.Tensor,
    q_offsets: np.ndarray,
    docs: torch.Tensor | Callable[[int, int], torch.Tensor],
    d_offsets: np.ndarray,
    scores: torch.Tensor,
    check_finite: bool = False,
    doc_scales: torch.Tensor | None = None,
    query_scales: torch.Tensor | None = None,
    int_products: IntProducts | None = None,
) -> None:
    """All documents in packed order (CPU tensors, no argmax): fills scores [nq, nd]. ``docs`` is the
    token rows, or a function of (t0, t1) that returns rows t0 .. t1 - 1 (decoded codes); with int8
    queries ``int_products`` (if given) makes a chunk's int32 products in place of ``docs``. With
    ``doc_scales`` each similarity is multiplied by its token's scale before the max, and with
    ``query_scales`` each query token's max by its scale before the sum (`maxsim_int8_varlen_cpu`)."""
    lens = np.diff(d_offsets)
    nd = len(lens)
    out = scores.numpy()
    nq = len(q_offsets) - 1
    token_query = torch.from_numpy(np.repeat(np.arange(nq), np.diff(q_offsets)))
    out[:, lens == 0] = _empty_document_scores(token_query, nq, query_scales).numpy()[:, None]
    workers = _worker_count()
    integers = q.dtype == torch.int8
    # chunk boundaries (document indices) of about _STREAM_CHUNK_BYTES of buffers each
    compute = torch.float32 if integers else q.dtype
    chunk_tokens = max(1, _STREAM_CHUNK_BYTES // _stream_token_bytes(q.shape[1], q.shape[0], compute))
    cuts = np.searchsorted(d_offsets, np.arange(0, d_offsets[-1], chunk_tokens), side="right") - 1
    bounds = np.unique(np.concatenate([cuts, [nd]]))
    q_t = int8_columns(q) if integers else q.T.contiguous()  # floats: contiguous columns (`_similarities`)

    def work(chunk_docs: tuple[int, int]) -> None:
        a, b = chunk_docs
        t0, t1 = int(d_offsets[a]), int(d_offsets[b])
        full = np.flatnonzero(lens[a:b] > 0) + a
        if t1 == t0 or len(full) == 0:
            return
        shape = (t1 - t0, q_t.shape[1])
        if integers:  # exact int32 products, then fp32 (the values the fp32 product gives)
            ints = thread_buffer("ints", shape, torch.int32)
            if int_products is not None:
                int_products(t0, t1, ints)
            else:
                chunk = docs(t0, t1) if callable(docs) else docs[t0:t1]
                torch._int_mm(chunk.contiguous(), q_t, out=ints)
            sim = thread_buffer("sim", shape, torch.float32).copy_(ints)
        else:
            chunk = docs(t0, t1) if callable(docs) else docs[t0:t1]
            if chunk.dtype != q.dtype:  # upcast into this thread's buffer
                chunk = thread_buffer("chunk", tuple(chunk.shape), q.dtype).copy_(chunk)
            # [tokens, Tq], as the blocked path computes it
            sim = _similarities(chunk, q_t, out=thread_buffer("sim", shape, q.dtype))
        if check_finite:
            _require_finite(sim[:, 0])
        if doc_scales is not None:
            sim.mul_(doc_scales[t0:t1, None])
        owner = torch.from_numpy(np.repeat(np.arange(b - a), lens[a:b]))[:, None].expand(-1, sim.shape[1])
        best = sim.new_full((b - a, sim.shape[1]), -torch.inf).scatter_reduce_(0, owner, sim, "amax")
        best = best[torch.from_numpy(full - a)]  # [docs, Tq]
        if query_scales is not None:
            best.mul_(query_scales)
        # the same sequential sum over query tokens as the blocked path (np.add.reduceat sums in
        # another order), so a score does not depend on which path its batch took
        out[:, full] = best.new_zeros(len(full), nq).index_add_(1, token_query, best).T.numpy()

    _run_units(work, list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)), workers)


def _groups(lens: np.ndarray, group_tokens: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Non-empty documents sorted by length, cut into runs whose padded size n * L_max <= group_tokens."""
    order = np.argsort(lens, kind="stable")
    order = order[lens[order] > 0]
    # a run [a, b) pads to its last (longest) document: the cut of `_unit_groups`
    return order, _unit_groups(lens[order], group_tokens)


def _score_docs(
    q: torch.Tensor,
    token_query: torch.Tensor,
    num_queries: int,
    docs: torch.Tensor,
    doc_scales: torch.Tensor | None,
    starts: np.ndarray,
    lens: np.ndarray,
    scores: torch.Tensor,
    argmax: torch.Tensor | None,
    check_finite: bool = False,
    token_scales: torch.Tensor | None = None,
    query_scales: torch.Tensor | None = None,
) -> None:
    """Fill scores[:, k] (and argmax[:, k]) for the documents k with rows [starts[k], starts[k] + lens[k]).

    `q` [Tq, dim] is already in the compute dtype; `token_query` [Tq] maps each query token to its query.
    On the CPU the groups are units of work for the worker threads, elsewhere they run in order on the
    caller's thread. int8 documents (`maxsim_int8_docs_cpu`): ``token_scales`` multiplies each
    similarity by its document token's scale before the max and ``query_scales`` each max by its query
    token's before the sum; `q` is then the int8 query rows (products in integers, `int8_products`) or
    their fp32 values, and the documents' int8 values are multiplied as they are.
    """
    integers = q.dtype == torch.int8
    compute, device = (torch.float32 if token_scales is not None else q.dtype), q.device
    on_cpu, tq, dim = device.type == "cpu", q.shape[0], docs.shape[1]
    order, spans = _groups(lens, _GROUP_TOKENS)
    q_t_blocks = [
        int8_columns(q[r0 : r0 + _QUERY_ROWS]) if integers else q[r0 : r0 + _QUERY_ROWS].T.contiguous()
        for r0 in range(0, tq, _QUERY_ROWS)
    ]
    scores[:, torch.from_numpy(np.flatnonzero(lens == 0)).to(device)] = _empty_document_scores(
        token_query, num_queries, query_scales
    ).to(device, scores.dtype)[:, None]

    def work(span: tuple[int, int]) -> None:
        lo, hi = span
        picked = torch.from_numpy(order[lo:hi]).to(device)
        g_lens = lens[order[lo:hi]]
        width = int(g_lens[-1])
        rows = starts[order[lo:hi], None] + np.minimum(np.arange(width)[None, :], g_lens[:, None] - 1)
        rows_t = torch.from_numpy(rows.reshape(-1)).to(device)
        if on_cpu:  # into this worker's buffers (the similarities too): see _SCRATCH
            rows_buffer = thread_buffer("docs_rows", (len(rows_t), dim), docs.dtype)
            block = torch.index_select(docs, 0, rows_t, out=rows_buffer)
            if not integers and block.dtype != compute:
                block = thread_buffer("docs_block", tuple(block.shape), compute).copy_(block)
        else:
            block = docs.index_select(0, rows_t)
            block = block if integers else block.to(compute)
        if doc_scales is not None:
            block *= doc_scales.index_select(0, rows_t).to(compute)[:, None]
        row_scales = None if token_scales is None else token_scales.index_select(0, rows_t)[:, None]
        n = len(picked)
        best = torch.empty(n, tq, dtype=compute, device=device)
        for r0, q_t in zip(range(0, tq, _QUERY_ROWS), q_t_blocks, strict=True):
            r1 = min(tq, r0 + _QUERY_ROWS)
            shape = (block.shape[0], r1 - r0)
            if integers and on_cpu:  # exact int32 products, as fp32
                ints = torch._int_mm(block, q_t, out=thread_buffer("docs_ints", shape, torch.int32))
                sim = thread_buffer("docs_sim", shape, compute).copy_(ints)
            elif integers:
                sim = torch._int_mm(block, q_t).to(compute)
            else:
                out = thread_buffer("docs_sim", shape, compute) if on_cpu else None
                sim = _similarities(block, q_t, out=out)
            if row_scales is not None:  # the one fp32 rounding of s_d * acc
                sim.mul_(row_scales)
            sim = sim.view(n, width, r1 - r0)
            if check_finite and r0 == 0:
                _require_finite(sim[:, :, 0])
            if argmax is None:
                torch.amax(sim, dim=1, out=best[:, r0:r1])
            else:
                vals, idx = sim.max(dim=1)
                best[:, r0:r1] = vals
                last = torch.from_numpy(g_lens - 1).to(device)[:, None]
                argmax[r0:r1, picked] = torch.minimum(idx, last).T.to(torch.int32)
        if query_scales is not None:
            best.mul_(query_scales)
        per_query = torch.zeros(n, num_queries, dtype=compute, device=device).index_add_(1, token_query, best)
        scores[:, picked] = per_query.T.to(scores.dtype)

    if on_cpu:
        _run_units(work, spans, _worker_count())
    else:
        for span in spans:
            work(span)


def _compute_dtype(queries: torch.Tensor) -> torch.dtype:
    return torch.float64 if queries.dtype == torch.float64 else torch.float32


def maxsim_varlen_cpu(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    *,
    return_argmax: bool = False,
    doc_scales: torch.Tensor | None = None,
    layout: Layout | None = None,
    check_finite: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Every query against every document with torch ops: fp32 scores [nq, nd] (+ int32 argmax [Tq, nd]).

    Float documents only (int8 documents go through `maxsim_kernels.maxsim_int8`); `doc_scales`, when
    given, multiplies each document token before the max. Pass a `layout` from `check_inputs` to skip
    the checks. ``check_finite``: raise `NonFiniteDocuments` if a document token holds NaN/Inf (see the
    module docstring; the queries must be finite).
    """
    if layout is None:
        layout = check_inputs(
            queries, query_offsets, docs, doc_offsets, doc_scales=doc_scales, allow_float64=True
        )
    compute = _compute_dtype(queries)
    out_dtype = torch.float64 if compute == torch.float64 else torch.float32
    nq, nd = layout.num_queries, layout.num_docs
    device = docs.device
    scores = torch.zeros(nq, nd, dtype=out_dtype, device=device)
    argmax = (
        torch.full((queries.shape[0], nd), -1, dtype=torch.int32, device=device) if return_argmax else None
    )
    stream = (
        device.type == "cpu"
        and not return_argmax
        and doc_scales is None
        and queries.shape[0] <= _STREAM_MAX_ROWS
    )
    if nq and nd and stream:
        _score_stream(
            queries.to(compute).contiguous(), layout.q_offsets, docs, layout.d_offsets, scores, check_finite
        )
    elif nq and nd:
        token_query = torch.from_numpy(np.repeat(np.arange(nq), layout.q_lens)).to(device)
        _score_docs(
            queries.to(compute).contiguous(),
            token_query,
            nq,
            docs,
            doc_scales,
            layout.d_offsets[:-1],
            layout.d_lens,
            scores,
            argmax,
            check_finite,
        )
    return (scores, argmax) if return_argmax else scores


def int8_stream_applies(q8: torch.Tensor, device: torch.device) -> bool:
    """Whether `maxsim_int8_varlen_cpu` takes int8 query rows `q8` against documents on `device`."""
    return device.type == "cpu" and q8.shape[0] <= _STREAM_MAX_ROWS


def maxsim_int8_varlen_cpu(
    q8: torch.Tensor,
    sq: torch.Tensor,
    q_offsets: np.ndarray,
    values: torch.Tensor | Callable[[int, int], torch.Tensor],
    doc_scales: torch.Tensor,
    d_offsets: np.ndarray,
    int_products: IntProducts | None = None,
) -> torch.Tensor:
    """int8 scores [nq, nd] of a few query rows (`int8_stream_applies`) on the CPU, streamed as the float
    path's: ``sum_i sq[i] * max_j (sd[j] * (q8[i] . v[j]))`` with the documents' int8 values ``values``
    [Td, dim] (or a function of (t0, t1) that decodes rows t0 .. t1 - 1 of codes to them) and their scales
    ``doc_scales`` [Td]. Where the products are made in integers (`int8_products`), ``int_products``, if
    given, makes them for a chunk of codes without its values: ``int_products(t0, t1, out)`` writes the
    int32 ``v[j] . q8[i]`` of rows t0 .. t1 - 1 into ``out`` [t1 - t0, rows]. The integer products are
    exact in fp32 too (every partial sum an integer below 2^24 at the callers' dims: `int8_host.MAX_DIM`,
    `code_packing.MAX_DIM`), each takes one fp32 rounding by its token's scale, and the scaled maxima are
    summed in query-token order: the bits of `int8_host`'s blocked torch path, chunks of whole
    documents spread over every core."""
    nq, nd = len(q_offsets) - 1, len(d_offsets) - 1
    scores = torch.empty(nq, nd, dtype=torch.float32)
    if nq and nd:
        q = _int8_query_rows(q8)
        _score_stream(q, q_offsets, values, d_offsets, scores, doc_scales=doc_scales, query_scales=sq.float(),
                      int_products=int_products)  # fmt: skip
    return scores


def maxsim_int8_docs_cpu(
    q8: torch.Tensor,
    sq: torch.Tensor,
    q_offsets: np.ndarray,
    d8: torch.Tensor,
    doc_scales: torch.Tensor,
    d_offsets: np.ndarray,
    documents: np.ndarray | None = None,
) -> torch.Tensor:
    """int8 scores [nq, nd] of many query rows against int8 documents on the CPU (no argmax):
    `maxsim_int8_varlen_cpu`'s scores, ``sum_i sq[i] * max_j (sd[j] * (q8[i] . v[j]))``, computed by the
    float path's document groups (`_score_docs`: documents sorted by length, padded groups spread over
    the worker threads), the products in integers where the CPU has int8 dot-product instructions
    (`int8_products`), else on the values as fp32; both exact, so the scores are the bits of
    `int8_host`'s blocked torch path (one document group after another on the caller's thread).
    ``documents``: only these documents (indices into d_offsets, read in place), a column each."""
    nq = len(q_offsets) - 1
    starts, lens = d_offsets[:-1], np.diff(d_offsets)
    if documents is not None:
        starts, lens = starts[documents], lens[documents]
    scores = torch.empty(nq, len(lens), dtype=torch.float32)
    if nq and len(lens):
        token_query = torch.from_numpy(np.repeat(np.arange(nq), np.diff(q_offsets)))
        _score_docs(_int8_query_rows(q8), token_query, nq, d8, None, starts, lens, scores, None,
                    token_scales=doc_scales.float(), query_scales=sq.float())  # fmt: skip
    return scores


def maxsim_int8_candidates_cpu(
    q8: torch.Tensor,
    sq: torch.Tensor,
    q_offsets: np.ndarray,
    d8: torch.Tensor,
    doc_scales: torch.Tensor,
    d_offsets: np.ndarray,
    c_offsets: np.ndarray,
    c_docs: np.ndarray,
) -> torch.Tensor:
    """int8 scores [C] of each query against its own candidates on the CPU (no argmax), the documents read
    in place: groups of one query's candidates of similar length spread over the workers
    (`_int8_query_group`); for queries of few candidates (`_INT8_QUERY_GROUP_MIN_PAIRS`) the document units
    of the float rerank (`_rerank_by_document`) on the int8 values as fp32; or, where the candidates are
    dense (`dense_listing`), every query against every listed document by the document groups of
    `maxsim_int8_docs_cpu`, each pair's score picked from them.
    A pair scores as it does among all pairs, so the scores are the bits of `int8_host`'s torch rerank
    (`_candidates_torch`, which scores one query's candidates after another on the caller's thread: 3.5-4.6x
    slower on the 2-core Xeon, `bench_cpu_rerank_dense.py`)."""
    nq = len(q_offsets) - 1
    if not len(c_docs):
        return torch.empty(0, dtype=torch.float32)
    pair_query = np.repeat(np.arange(nq), np.diff(c_offsets))
    dense = dense_listing(c_docs, nq)
    if dense is not None:
        listed, column = dense
        block = maxsim_int8_docs_cpu(q8, sq, q_offsets, d8, doc_scales, d_offsets, listed)
        return block[torch.from_numpy(pair_query), torch.from_numpy(column)]
    q = _int8_query_rows(q8)
    token_scales, query_scales = doc_scales.float(), sq.float()
    q_lens, d_lens = np.diff(q_offsets), np.diff(d_offsets)
    scores = torch.empty(len(c_docs), dtype=torch.float32)
    pair_len = d_lens[c_docs]
    empty = np.flatnonzero(pair_len == 0)
    if len(empty):  # each query row's scale times -inf, summed in order (NaN where a scale is 0)
        token_query = torch.from_numpy(np.repeat(np.arange(nq), q_lens))
        per_query = _empty_document_scores(token_query, nq, query_scales)
        scores[torch.from_numpy(empty)] = per_query[torch.from_numpy(pair_query[empty])]
    full = np.flatnonzero(pair_len > 0)
    if _few_candidates_a_query(pair_query[full], _INT8_QUERY_GROUP_MIN_PAIRS):
        # few candidates a query: the document units, on the int8 values as fp32 (exact products)
        layout = Layout(q_offsets, d_offsets, q_lens, d_lens, q8.shape[1])
        _rerank_by_document(q8.float(), layout, d8, None, pair_query, c_docs, full, scores, None, False,
                            token_scales, query_scales)  # fmt: skip
        return scores
    # pairs by query, then document length (groups pad little), then document
    order = full[np.lexsort((c_docs[full], pair_len[full], pair_query[full]))]
    sorted_query, sorted_len = pair_query[order], pair_len[order]
    cols = -(-q_lens // _ONEDNN_COLS) * _ONEDNN_COLS  # a query's columns padded with its last row
    pair_bytes = sorted_len.astype(np.int64) * (q8.shape[1] * q.element_size() + cols[sorted_query] * 8)
    spans = _query_groups(sorted_query, pair_bytes, _QUERY_GROUP_BYTES)
    pair_scores = torch.zeros(len(order), 1, dtype=torch.float32)
    args = (q, q_offsets, q_lens, cols, d8, token_scales, query_scales, d_offsets[:-1][c_docs[order]],
            sorted_len, sorted_query)  # fmt: skip
    _run_units(lambda span: _int8_query_group(*args, span, pair_scores), spans, _worker_count())
    scores[torch.from_numpy(order)] = pair_scores[:, 0]
    return scores


def _padded_rows(starts: np.ndarray, lens: np.ndarray, width: int) -> torch.Tensor:
    """The token rows of documents at ``starts`` of ``lens`` tokens (none empty), each padded to ``width``
    with copies of its last row, flat (int64). Torch ops, not numpy: they leave the GIL to the other
    workers while they run."""
    last_row = torch.from_numpy(lens[:, None] - 1)
    return (torch.from_numpy(starts[:, None]) + torch.minimum(torch.arange(width), last_row)).view(-1)


def _int8_query_group(
    q: torch.Tensor,
    q_offsets: np.ndarray,
    q_lens: np.ndarray,
    cols: np.ndarray,
    d8: torch.Tensor,
    token_scales: torch.Tensor,
    query_scales: torch.Tensor,
    d_starts: np.ndarray,
    d_lens: np.ndarray,
    pair_query: np.ndarray,
    span: tuple[int, int],
    scores: torch.Tensor,
) -> None:
    """Pairs [p0, p1) of one query (ascending document length, none empty) of `maxsim_int8_candidates_cpu`:
    the documents' int8 rows gathered (each padded with copies of its last), one product with the query's
    int8 rows `q` (in integers, or their fp32 values: both exact) padded to cols[i] columns with copies of
    its last, each similarity times its token's scale (one fp32 rounding), the max over a document's rows,
    times the query row's scale, and the sum over the query's rows in order: scores[p, 0]."""
    p0, p1 = span
    i = int(pair_query[p0])
    r0, tq, width = int(q_offsets[i]), int(q_lens[i]), int(d_lens[p1 - 1])
    n, dim = p1 - p0, d8.shape[1]
    rows = _padded_rows(d_starts[p0:p1], d_lens[p0:p1], width)
    q_rows = q[r0 + torch.minimum(torch.arange(int(cols[i])), torch.tensor(tq - 1))]
    block8 = torch.index_select(d8, 0, rows, out=thread_buffer("rerank_int8", (len(rows), dim), torch.int8))
    if q.dtype == torch.int8:
        sim = torch._int_mm(block8, int8_columns(q_rows)).to(torch.float32)
    else:
        block = thread_buffer("rerank_block", (len(rows), dim), torch.float32).copy_(block8)
        sim = _similarities(block, q_rows.T.contiguous())
    sim.mul_(token_scales.index_select(0, rows)[:, None])  # the one fp32 rounding of s_d * acc
    best = torch.amax(sim.view(n, width, -1)[:, :, :tq], dim=1)
    best.mul_(query_scales[r0 : r0 + tq])
    scores[p0:p1].index_add_(1, torch.zeros(tq, dtype=torch.int64), best)


# Rerank (each query against its own candidates) by document units, the path where oneDNN's product is
# not used (see _QUERY_GROUP_BYTES below): the (query, document) pairs of all queries are scored
# together, a document once against all the queries that list it. A "unit" is a document with up to
# k_max of its pairs (k_max query widths fit _QUERY_ROWS columns). Units are sorted by pair count k, then
# document length, and cut into groups of equal k whose buffers (document rows, query rows, similarities,
# in the compute dtype) fit _RERANK_GROUP_BYTES. A group of n units is one batched product
# [n, L, dim] x [n, dim, k * W] (each document's tokens, padded with copies of its last one, against the
# tokens of its k queries, each padded to W columns with copies of its last token), a max over L, and
# the same sequential sum over a query's tokens as the other paths. For fp16/bf16/fp32 inputs a score is
# then bitwise the exhaustive path's and the per-query loop's this replaced (tests/test_cpu_rerank.py;
# float64: MKL's batched and single double products may differ in the last bit). Groups are spread over
# the worker threads (one product thread each: a product split over an OpenMP team stalls whenever
# another process holds a core), into per-thread buffers (a unit larger than the budget is a
# group on its own).
# Measured on the 2-core EPYC machine (torch 2.14, MKL, dim 128; benchmarks/bench_cpu_rerank.py,
# docs/benchmarks.md), 64 queries x 1000 own candidates of 20-300 tokens, fp32, medians: each candidate a
# distinct document 12.5 us a pair, against 14.4 for the per-query loop and 7.5 for the exhaustive path
# (which reads a document once for 64 queries; here each pair copies its own from memory, ~2.7 us, and
# the copy does not overlap the products); documents shared by ~8 queries 8.4 us (1.12x). Group budget,
# same workload, 5 rounds: 2 / 4 / 6 / 8 MiB took 0.94 / 0.77 / 0.75 / 0.79 s.
_RERANK_GROUP_BYTES = 4 << 20
# Every group goes to the worker threads, also in small calls. Earlier, calls of fewer than 32 groups a
# worker ran on the caller's thread with each op split over an OpenMP team: 1.7 against 3.4 ms for 1
# query x 100 candidates on a quiet machine, but a team waits at every op for its slowest thread. 2-core
# machine, load average 4-5 from other jobs, fp32, 4000 documents of 20-300 tokens, 3 alternating
# rounds, medians of 5 calls, caller's thread against workers: 1 x 10 candidates (one group) 0.4-7.0
# against 0.7-1.8 ms, 1 x 100 2.1-48.6 against 3.6-4.7, 1 x 1000 109-219 against 27-32; beside two busy
# processes 21-58 against 1.3-9.7, 89-190 against 13-29 and 744-1342 against 56-97 ms. Cutting a small
# call's groups smaller, so that every worker gets some, was slower: 1 x 10 in 4 groups 1.64 ms (median
# of 60) against 0.78 in one, 1 x 100 4.53 against 4.03.


def _unit_groups(unit_bytes: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """Cut units sorted by ascending padded length into runs [a, b) with (b - a) * unit_bytes[b - 1] <=
    budget (at least one unit each); unit_bytes[i]: a unit's buffers when padded to unit i's length."""
    spans = []
    start, count = 0, len(unit_bytes)
    while start < count:
        limit = min(count - start, max(1, budget // int(unit_bytes[start])))
        k = np.arange(1, limit + 1)
        fits = int(np.count_nonzero(k * unit_bytes[start : start + limit] <= budget))
        stop = start + max(1, fits)
        spans.append((start, stop))
        start = stop
    return spans


def _score_units(
    q: torch.Tensor,
    q_starts: np.ndarray,
    q_lens: np.ndarray,
    docs: torch.Tensor,
    doc_scales: torch.Tensor | None,
    d_starts: np.ndarray,
    d_lens: np.ndarray,
    group: tuple[int, int, int, int],
    scores: torch.Tensor,
    argmax: torch.Tensor | None,
    check_finite: bool,
    token_scales: torch.Tensor | None = None,
    query_scales: torch.Tensor | None = None,
) -> None:
    """One group: units [u0, u1) (ascending document length, none empty) of k pairs each, pairs [p0, p0 +
    (u1 - u0) * k). Unit u is document rows [d_starts[u], + d_lens[u]); pair p is query rows
    [q_starts[p], + q_lens[p]) of `q` (compute dtype). Adds each pair's score into scores[p, 0] (zeros
    on entry) and writes argmax[p, :q_lens[p]]. int8 documents (`maxsim_int8_candidates_cpu`): `q` holds
    the int8 query rows' fp32 values (the products exact), ``token_scales`` multiplies each similarity by
    its document token's scale before the max and ``query_scales`` each max by its query token's before
    the sum, as `_score_docs` does."""
    u0, u1, k, p0 = group
    n, m = u1 - u0, (u1 - u0) * k
    compute, device, dim = q.dtype, q.device, q.shape[1]
    on_cpu = device.type == "cpu"

    def buffer(name: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        if on_cpu:
            return thread_buffer("rerank_" + name, (rows, cols), dtype)
        return torch.empty(rows, cols, dtype=dtype, device=device)

    lens = d_lens[u0:u1]
    width = max(int(lens[-1]), _MIN_GEMM_ROWS)  # short documents padded too: see _MIN_GEMM_ROWS
    rows = d_starts[u0:u1, None] + np.minimum(np.arange(width), lens[:, None] - 1)
    rows = torch.from_numpy(rows.reshape(-1)).to(device)
    block = buffer("block", n * width, dim, compute)
    if docs.dtype == compute:
        torch.index_select(docs, 0, rows, out=block)
    else:
        block.copy_(torch.index_select(docs, 0, rows, out=buffer("raw", n * width, dim, docs.dtype)))
    if doc_scales is not None:
        block *= doc_scales.index_select(0, rows).to(compute)[:, None]
    row_scales = None if token_scales is None else token_scales.index_select(0, rows).view(n, width, 1)
    block = block.view(n, width, dim)
    p1 = p0 + m
    ql = q_lens[p0:p1]
    tq = int(ql.max())
    best = torch.empty(m, tq, dtype=compute, device=device)
    per_product = max(1, _QUERY_ROWS // k)  # query tokens of each pair per product (all when k > 1)
    one_query = k == 1 and bool((q_starts[p0:p1] == q_starts[p0]).all())
    for c0 in range(0, tq, per_product):
        c1 = min(tq, c0 + per_product)
        cols_n = max(c1 - c0, -(-_MIN_GEMM_ROWS // k))
        # each pair's query tokens c0.. (past its length: copies of its last token, dropped below)
        if one_query:  # the same rows for every document: a broadcast operand, not a copy per pair
            cols = q_starts[p0] + np.minimum(c0 + np.arange(cols_n), ql[0] - 1)
            q_g = q.index_select(0, torch.from_numpy(cols).to(device)).expand(n, cols_n, dim)
        else:
            cols = q_starts[p0:p1, None] + np.minimum(c0 + np.arange(cols_n), ql[:, None] - 1)
            q_g = buffer("query", m * cols_n, dim, compute)
            torch.index_select(q, 0, torch.from_numpy(cols.reshape(-1)).to(device), out=q_g)
            q_g = q_g.view(n, k * cols_n, dim)
        sim = torch.bmm(
            block,
            q_g.transpose(1, 2),
            out=buffer("sim", n * width, k * cols_n, compute).view(n, width, k * cols_n),
        )
        if row_scales is not None:  # the one fp32 rounding of s_d * acc
            sim.mul_(row_scales)
        if check_finite and c0 == 0:
            _require_finite(sim[:, :, 0])
        if argmax is None:
            best[:, c0:c1] = torch.amax(sim, dim=1).view(m, cols_n)[:, : c1 - c0]
        else:
            vals, idx = sim.max(dim=1)
            best[:, c0:c1] = vals.view(m, cols_n)[:, : c1 - c0]
            last = torch.from_numpy(np.repeat(lens - 1, k)).to(device)[:, None]
            argmax[p0:p1, c0:c1] = torch.minimum(idx.view(m, cols_n)[:, : c1 - c0], last).to(torch.int32)
    if query_scales is not None:  # each query token's max times its scale (past a query's length: dropped)
        q_rows = q_starts[p0:p1, None] + np.minimum(np.arange(tq), ql[:, None] - 1)
        best.mul_(query_scales[torch.from_numpy(q_rows).to(device)])
    if int(ql.min()) < tq:  # a shorter query's extra columns: -0.0 leaves a sum unchanged, argmax -1
        extra = torch.from_numpy(np.arange(tq)[None, :] >= ql[:, None]).to(device)
        best.masked_fill_(extra, -0.0)
        if argmax is not None:
            argmax[p0:p1, :tq].masked_fill_(extra, -1)
    # the same sequential sum over query tokens as _score_docs
    scores[p0:p1].index_add_(1, torch.zeros(tq, dtype=torch.int64, device=device), best)


# Rerank through oneDNN's product, each query against its own candidates. On the 2-core AMD machine MKL's
# fp32 product runs ~100 GFLOP/s a core (its AVX2 kernels: MKL takes AVX-512 only on Intel) and oneDNN's
# (avx512_core brgemm, through `torch.ops.mkldnn._linear_pointwise`, the op torch's compiler calls for
# linear layers) 240-250, [8192, 128] x [128, 32] on one thread. A rerank pair's document is read from
# memory for its queries alone, so where the exhaustive path is bound by the product, the rerank pays
# the product and a copy of the document (~2.9 us a pair of 160 tokens on two cores at ~14 GB/s a core,
# the rate one core reads memory at): with MKL's product that floor was ~1.35x the exhaustive path's
# time a pair, with oneDNN's it is below it. oneDNN's products are used only where they give the bits
# MKL's give, checked once per dimension in each process (`_onednn_product`; equal for dim <= 136 on
# that machine, not for 256 and over, where oneDNN cuts the sum over dim otherwise): a pair's score
# stays bitwise the exhaustive path's. Elsewhere (no oneDNN, other bits, float64, CUDA) the document
# units above score the pairs with MKL's batched product.
# A group: pairs of one query, sorted by document length, whose padded block and similarities fit
# _QUERY_GROUP_BYTES; one gather of the documents' rows (upcast, scaled) into the worker's buffer, one
# product with the query's tokens, a max over each document's rows, the same sequential sum over query
# tokens as the other paths.
# Measured on the 2-core EPYC machine (benchmarks/bench_cpu_rerank.py, docs/benchmarks.md), 64 queries x
# 1000 own candidates of 20-300 tokens, 9 interleaved rounds, medians: every candidate a distinct document
# 8.18 us a pair fp32 (1.15x the exhaustive path's 7.15; the document units 13.48), 8.57 fp16 (1.13x);
# documents shared by ~8 queries 7.99 (1.09x; units 8.58). Group budget, 64 queries x 250 candidates on a
# loaded machine: 1 / 2 / 3 / 4 / 6 / 8 MiB took 16.4 / 10.8-11.2 / 10.4 / 9.1-9.3 / 9.4 / 10.4 us a pair.
# A group also costs a part whatever its size, which larger groups spread; past the caches they lose
# again. On a 2-core Xeon with 2 MiB of L2 a core (64 x 1000 own candidates, 5 alternating rounds,
# benchmarks/sweep_cpu_rerank_groups.py, docs/kernel-notes.md "CPU rerank"): fp16 1 / 2 / 4 / 8 / 16 / 32
# MiB 56.5 / 33.4 / 22.8 / 17.6 / 15.9 / 19.1 us a pair, int8 2 / 4 / 8 / 16 MiB 22.3 / 13.9 / 11.0 / 12.3.
# The budget is 4 x the L2 cache of a core (the Xeon's 2 MiB: 8 MiB), at least the 4 MiB measured best on
# the EPYC (an EPYC's L2, 1 MiB at most, gives no more) and at most 16 (`_query_group_bytes`).
_QUERY_GROUP_L2_TIMES = 4
_QUERY_GROUP_MIN, _QUERY_GROUP_MAX = 4 << 20, 16 << 20


def _l2_cache_bytes(root: str = "/sys/devices/system/cpu") -> int | None:
    """The L2 cache of the first CPU this process may run on (sysfs ``cache/index*/``: the unified or data
    cache of level 2, its ``size`` such as "2048K"), None where it cannot be read."""
    try:
        cpu = min(os.sched_getaffinity(0))
    except (AttributeError, OSError, ValueError):
        cpu = 0
    folder = os.path.join(root, f"cpu{cpu}", "cache")
    try:
        indexes = sorted(os.listdir(folder))
    except OSError:
        return None
    for index in indexes:
        try:
            with open(os.path.join(folder, index, "level"), encoding="ascii") as fh:
                level = fh.read().strip()
            with open(os.path.join(folder, index, "type"), encoding="ascii") as fh:
                kind = fh.read().strip()
            with open(os.path.join(folder, index, "size"), encoding="ascii") as fh:
                size = fh.read().strip()
        except OSError:
            continue
        if level != "2" or kind not in ("Unified", "Data"):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        try:
            return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except ValueError:
            return None
    return None


def _query_group_bytes(l2: int | None) -> int:
    """A rerank group's budget for a core of ``l2`` bytes of L2 cache (None: unknown, the EPYC's 4 MiB)."""
    if l2 is None:
        return _QUERY_GROUP_MIN
    return min(_QUERY_GROUP_MAX, max(_QUERY_GROUP_MIN, _QUERY_GROUP_L2_TIMES * l2))


_QUERY_GROUP_BYTES = _query_group_bytes(_l2_cache_bytes())
# The query groups take a call whose queries have at least this many candidates each on average; fewer go
# to the document units. A group also costs a part whatever its pairs (the calls around its product, and
# the padding to its longest document, which sorting a query's few candidates does little to reduce), so
# a query of few candidates pays it over few pairs. `maxsim score --candidates` on the CPU scores a batch of
# documents at a time: 150 candidates a query came as ~9 a call in 16 batches. 2-core Xeon, 64 queries,
# fp16, 5 alternating rounds, the same bits (`python benchmarks/bench_cpu_rerank_per_query.py`), us a pair
# query groups / document units, candidates a query 9: 78.3 / 36.0, 20: 47.4 / 32.1, 32: 36.7 / 31.8, 40: 35.3
# / 30.9, 80: 29.3 / 29.3, 150: 25.0 / 29.3. The crossing is ~80 there; it comes earlier where oneDNN's
# product outruns MKL's (the EPYC: 2.4x, not measured at these counts), hence 32.
_QUERY_GROUP_MIN_PAIRS = 32
# The same for int8 documents (`maxsim_int8_candidates_cpu`), whose query groups multiply in integers and
# whose document units multiply the int8 values as fp32: 2-core Xeon, 64 queries, 5 alternating rounds, the
# same bits, us a pair query groups / document units, candidates a query 9: 81.4 / 48.9, 20: 49.9 / 47.2, 32:
# 29.9 / 36.3, 40: 26.7 / 33.1, 150: 17.6 / 31.8 (benchmarks/results/cpu/cpu-int8-rerank-per-query-xeon.txt).
_INT8_QUERY_GROUP_MIN_PAIRS = 24


def _few_candidates_a_query(pair_query: np.ndarray, min_pairs: int) -> bool:
    """Whether the queries of these pairs (each pair's query, grouped by query) list fewer than ``min_pairs``
    candidates each on average (queries without candidates not counted)."""
    return len(pair_query) < min_pairs * (1 + np.count_nonzero(np.diff(pair_query)))
# oneDNN builds a primitive for each new shape (~0.2 ms, against ~0.03 ms for a cached 1000-row call):
# a product's rows are padded to a multiple of _ONEDNN_ROWS and its columns (the query's tokens, padded
# with copies of the last one) to a multiple of _ONEDNN_COLS, so that shapes repeat. Columns >= 16 also
# keep every product clear of the kernels that sum otherwise (see _MIN_GEMM_ROWS).
_ONEDNN_ROWS = 256
_ONEDNN_COLS = _MIN_GEMM_ROWS

_ONEDNN_SAME_BITS: dict[int, bool] = {}
_ONEDNN_LOCK = threading.Lock()


def _onednn_linear(block: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """block [m, dim] . weight [n, dim]^T as a new contiguous [m, n] (fp32, oneDNN)."""
    return torch.ops.mkldnn._linear_pointwise(block, weight, None, "none", [], "")


def _onednn_matches_mkl(dim: int) -> bool:
    """Whether oneDNN's fp32 product gives the bits of `_similarities` (MKL, as the exhaustive path calls
    it) on random vectors of this dim, in the shapes `_score_query_group` uses."""
    if not torch.backends.mkldnn.is_available():
        return False
    gen = torch.Generator().manual_seed(dim)
    block = torch.randn(2 * _ONEDNN_ROWS, dim, generator=gen)
    weight = torch.randn(_QUERY_ROWS, dim, generator=gen)
    try:
        got = [_onednn_linear(block, weight[:cols]) for cols in (_ONEDNN_COLS, 3 * _ONEDNN_COLS)]
    except (AttributeError, RuntimeError, NotImplementedError):  # no such op in this build
        return False
    want = _similarities(block, weight.T.contiguous())
    return all(torch.equal(sim, want[:, : sim.shape[1]]) for sim in got)


def _onednn_product(dim: int) -> bool:
    """Whether reranks of this dim go through oneDNN (checked once per process and dim)."""
    with _ONEDNN_LOCK:
        if dim not in _ONEDNN_SAME_BITS:
            _ONEDNN_SAME_BITS[dim] = _onednn_matches_mkl(dim)
        return _ONEDNN_SAME_BITS[dim]


def _query_groups(pair_query: np.ndarray, pair_bytes: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """Pairs sorted by query, then document length, cut into runs [a, b) of one query each with (b - a) *
    pair_bytes[b - 1] <= budget (at least one pair each)."""
    bounds = np.flatnonzero(np.concatenate([[True], pair_query[1:] != pair_query[:-1], [True]]))
    spans = []
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        if (b - a) * int(pair_bytes[b - 1]) <= budget:
            spans.append((a, b))
        else:
            spans.extend((a + x, a + y) for x, y in _unit_groups(pair_bytes[a:b], budget))
    return spans


def _score_query_group(
    weights: torch.Tensor,
    w_starts: np.ndarray,
    w_cols: np.ndarray,
    q_lens: np.ndarray,
    docs: torch.Tensor,
    doc_scales: torch.Tensor | None,
    d_starts: np.ndarray,
    d_lens: np.ndarray,
    pair_query: np.ndarray,
    span: tuple[int, int],
    scores: torch.Tensor,
    argmax: torch.Tensor | None,
    check_finite: bool,
) -> None:
    """Pairs [p0, p1) of one query (ascending document length, none empty): pair p is document rows
    [d_starts[p], + d_lens[p]); query i is rows [w_starts[i], + w_cols[i]) of `weights` (fp32, its
    q_lens[i] tokens then copies of the last). Writes scores[p, 0] and argmax[p, :q_lens[i]]."""
    p0, p1 = span
    i = int(pair_query[p0])
    tq, cols = int(q_lens[i]), int(w_cols[i])
    weight = weights[int(w_starts[i]) : int(w_starts[i]) + cols]
    lens = d_lens[p0:p1]
    n, width, dim = p1 - p0, int(lens[-1]), weights.shape[1]
    m = n * width
    rows = _padded_rows(d_starts[p0:p1], lens, width)
    block = thread_buffer("rerank_block", (-(-m // _ONEDNN_ROWS) * _ONEDNN_ROWS, dim), torch.float32)
    if docs.dtype == torch.float32:
        torch.index_select(docs, 0, rows, out=block[:m])
    else:
        raw = thread_buffer("rerank_raw", (m, dim), docs.dtype)
        block[:m].copy_(torch.index_select(docs, 0, rows, out=raw))
    if doc_scales is not None:
        block[:m] *= doc_scales.index_select(0, rows).to(torch.float32)[:, None]
    block[m:].zero_()  # rows computed and dropped: zeros, not stale values (denormals are slow)
    sim = _onednn_linear(block, weight)[:m].view(n, width, cols)
    if check_finite:
        _require_finite(sim[:, :, 0])
    if argmax is None:
        best = torch.amax(sim, dim=1)
    else:
        best, idx = sim.max(dim=1)
        last = torch.from_numpy(lens - 1)[:, None]
        argmax[p0:p1, :tq] = torch.minimum(idx[:, :tq], last).to(torch.int32)
    # the same sequential sum over query tokens as _score_docs
    scores[p0:p1].index_add_(1, torch.zeros(tq, dtype=torch.int64), best[:, :tq])


def _rerank_by_query(
    queries: torch.Tensor,
    layout: Layout,
    docs: torch.Tensor,
    doc_scales: torch.Tensor | None,
    pair_query: np.ndarray,
    pair_doc: np.ndarray,
    pairs: np.ndarray,
    scores: torch.Tensor,
    argmax: torch.Tensor | None,
    check_finite: bool,
) -> None:
    """Fill scores[pairs] (and argmax[pairs]) of the CPU pairs `pairs` (documents not empty) through
    oneDNN, a group of one query's pairs a product (see _QUERY_GROUP_BYTES)."""
    # each query's tokens, then copies of its last up to a multiple of _ONEDNN_COLS columns
    w_cols = -(-layout.q_lens // _ONEDNN_COLS) * _ONEDNN_COLS
    w_starts = np.cumsum(w_cols) - w_cols
    w_rows = np.repeat(layout.q_offsets[:-1], w_cols) + np.minimum(
        np.arange(int(w_cols.sum())) - np.repeat(w_starts, w_cols), np.repeat(layout.q_lens - 1, w_cols)
    )
    weights = queries.index_select(0, torch.from_numpy(w_rows)).to(torch.float32)
    # pairs by query, then document length (groups pad little), then document (a document's rows stay
    # near each other)
    pair_len = layout.d_lens[pair_doc[pairs]]
    order = pairs[np.lexsort((pair_doc[pairs], pair_len, pair_query[pairs]))]
    sorted_query, sorted_doc = pair_query[order], pair_doc[order]
    sorted_len = layout.d_lens[sorted_doc]
    # a pair's rows of the block and of the similarities, fp32
    pair_bytes = sorted_len.astype(np.int64) * (layout.dim + w_cols[sorted_query]) * 4
    spans = _query_groups(sorted_query, pair_bytes, _QUERY_GROUP_BYTES)
    pair_scores = torch.zeros(len(order), 1, dtype=torch.float32)
    pair_argmax = (
        torch.full((len(order), layout.max_query_len), -1, dtype=torch.int32) if argmax is not None else None
    )
    args = (
        weights,
        w_starts,
        w_cols,
        layout.q_lens,
        docs,
        doc_scales,
        layout.d_offsets[:-1][sorted_doc],
        sorted_len,
        sorted_query,
    )

    def work(span: tuple[int, int]) -> None:
        _score_query_group(*args, span, pair_scores, pair_argmax, check_finite)

    _run_units(work, spans, _worker_count())
    placed = torch.from_numpy(order)
    scores[placed] = pair_scores[:, 0].to(scores.dtype)
    if argmax is not None:
        argmax[placed] = pair_argmax


def maxsim_candidates_cpu(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor,
    candidate_docs: torch.Tensor,
    *,
    return_argmax: bool = False,
    doc_scales: torch.Tensor | None = None,
    layout: Layout | None = None,
    check_finite: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Query i against candidate_docs[candidate_offsets[i]:candidate_offsets[i+1]] with torch ops.

    Returns fp32 scores [C] (+ int32 argmax [C, max_query_len], -1 past a query's length). Documents are
    read in place through their indices. The pairs of all queries are scored in one plan, in groups of
    documents of similar length spread over the cores: groups of one query's candidates through
    oneDNN's product where it gives MKL's bits and the queries have enough candidates each (see
    _QUERY_GROUP_BYTES, _QUERY_GROUP_MIN_PAIRS), otherwise document units, each document once against
    every query that lists it (see _RERANK_GROUP_BYTES); candidates that are dense
    (`dense_listing`, DENSE_CANDIDATES) as every query against every listed document, by the exhaustive
    path's document groups. A score is bitwise the exhaustive path's for the same pair and does not depend
    on the other pairs of the call.
    ``check_finite`` as in `maxsim_varlen_cpu` (for the candidates' tokens).
    """
    if layout is None:
        layout = check_inputs(
            queries, query_offsets, docs, doc_offsets, doc_scales=doc_scales, allow_float64=True
        )
    c_off, c_docs = check_candidates(candidate_offsets, candidate_docs, layout.num_queries, layout.num_docs)
    compute = _compute_dtype(queries)
    out_dtype = torch.float64 if compute == torch.float64 else torch.float32
    num_c = len(c_docs)
    device = docs.device
    scores = torch.zeros(num_c, dtype=out_dtype, device=device)
    argmax = (
        torch.full((num_c, layout.max_query_len), -1, dtype=torch.int32, device=device)
        if return_argmax
        else None
    )
    if num_c == 0:
        return (scores, argmax) if return_argmax else scores
    pair_query = np.repeat(np.arange(layout.num_queries), np.diff(c_off))
    pair_len = layout.d_lens[c_docs]
    empty = pair_len == 0
    if empty.any():  # an empty document scores -inf, argmax -1
        scores[torch.from_numpy(np.flatnonzero(empty)).to(device)] = -torch.inf
    full = np.flatnonzero(~empty)
    if len(full) == 0:
        return (scores, argmax) if return_argmax else scores
    dense = dense_listing(c_docs[full], layout.num_queries) if device.type == "cpu" else None
    if dense is not None:
        _rerank_as_all_pairs(
            queries.to(compute).contiguous(), layout, docs, doc_scales, pair_query[full], dense, full, scores,
            argmax, check_finite,
        )  # fmt: skip
    elif (
        device.type == "cpu"
        and compute == torch.float32
        and not _few_candidates_a_query(pair_query[full], _QUERY_GROUP_MIN_PAIRS)
        and _onednn_product(layout.dim)
    ):
        _rerank_by_query(
            queries, layout, docs, doc_scales, pair_query, c_docs, full, scores, argmax, check_finite
        )
    else:
        _rerank_by_document(
            queries.to(compute).contiguous(),
            layout,
            docs,
            doc_scales,
            pair_query,
            c_docs,
            full,
            scores,
            argmax,
            check_finite,
        )
    return (scores, argmax) if return_argmax else scores


# Reranks whose candidates are dense are scored as all pairs of their queries and the documents they list
# (`dense_listing`; `_rerank_as_all_pairs`, `maxsim_int8_candidates_cpu`): each listed document gathered (fp16
# and bf16 upcast) once for every query instead of once for each query that lists it, and the query rows of
# many queries in one product, at the price of the pairs nobody asked for. Taken where the candidates hold at
# least DENSE_CANDIDATES of those pairs and each listed document is listed DENSE_SHARING times on average (a
# two-stage search whose depth reaches the corpus's size; one shortlist for many queries). The rerank's time
# over the all pairs' on the 2-core Xeon (`python benchmarks/bench_cpu_rerank_dense.py`,
# benchmarks/results/cpu/cpu-rerank-dense.json, medians of 3 rounds; 64 queries x 1000 candidates of 20-300
# tokens from pools of 1000-4000 documents): fp16 documents at density 1.0 3.04x, 0.77 2.41x, 0.50 1.60x, 0.25
# 0.82x; fp32 2.84x, 2.22x, 1.42x, 0.81x; int8 (the query groups) 1.90x, 1.57x, 1.02x, 0.58x; sample_data's
# shape (200 queries x 400 documents of 7-12 tokens, dim 384, every document listed by every query) fp16
# 7.09x, int8 5.03x. Density 1.0 with fewer queries: fp32 one 0.56x, two 1.02x, four 1.55x, eight 2.21x; int8
# 0.40x, 0.70x, 1.10x, 1.76x. The 2-core EPYC's rerank ran fp16 pairs at 1.13x the exhaustive path's time a
# pair (see _QUERY_GROUP_BYTES), where all pairs break even at a density of ~0.9.
DENSE_CANDIDATES, DENSE_SHARING = 0.9, 4.0


def dense_listing(pair_doc: np.ndarray, num_queries: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(the distinct documents listed, each pair's index among them) where candidate pairs of these
    documents are dense: they cover at least DENSE_CANDIDATES of all pairs of the call's queries and the
    documents they list, each listed DENSE_SHARING times on average; else None."""
    listed, column = np.unique(pair_doc, return_inverse=True)
    if len(pair_doc) < max(DENSE_CANDIDATES * num_queries, DENSE_SHARING) * len(listed):
        return None
    return listed, column


def _rerank_as_all_pairs(
    q: torch.Tensor,
    layout: Layout,
    docs: torch.Tensor,
    doc_scales: torch.Tensor | None,
    owner: np.ndarray,
    dense: tuple[np.ndarray, np.ndarray],
    full: np.ndarray,
    scores: torch.Tensor,
    argmax: torch.Tensor | None,
    check_finite: bool,
) -> None:
    """Fill scores[full] (and argmax[full]) of the pairs `full` (documents not empty; their queries
    ``owner``; ``dense`` = `dense_listing` of their documents) from the scores of every query against the
    listed documents, by the exhaustive path's document groups (`_score_docs`, the documents read in
    place): a pair's score is the exhaustive path's, as on the other rerank paths. `q` in the compute
    dtype."""
    listed, column = dense
    nq, device = layout.num_queries, q.device
    block = torch.zeros(nq, len(listed), dtype=scores.dtype, device=device)
    block_arg = (
        torch.full((q.shape[0], len(listed)), -1, dtype=torch.int32, device=device)
        if argmax is not None
        else None
    )
    token_query = torch.from_numpy(np.repeat(np.arange(nq), layout.q_lens)).to(device)
    starts, lens = layout.d_offsets[:-1][listed], layout.d_lens[listed]
    _score_docs(q, token_query, nq, docs, doc_scales, starts, lens, block, block_arg, check_finite)
    placed = torch.from_numpy(full).to(device)
    scores[placed] = block[torch.from_numpy(owner), torch.from_numpy(column)]
    if argmax is not None:
        width = argmax.shape[1]  # a pair's rows: its query's tokens, -1 past its length
        rows = layout.q_offsets[:-1][owner, None] + np.arange(width)[None, :]
        inside = np.arange(width)[None, :] < layout.q_lens[owner, None]
        picked = block_arg[torch.from_numpy(np.where(inside, rows, 0)), torch.from_numpy(column)[:, None]]
        argmax[placed] = torch.where(torch.from_numpy(inside), picked, -1)


def _rerank_by_document(
    q: torch.Tensor,
    layout: Layout,
    docs: torch.Tensor,
    doc_scales: torch.Tensor | None,
    pair_query: np.ndarray,
    pair_doc: np.ndarray,
    full: np.ndarray,
    scores: torch.Tensor,
    argmax: torch.Tensor | None,
    check_finite: bool,
    token_scales: torch.Tensor | None = None,
    query_scales: torch.Tensor | None = None,
) -> None:
    """Fill scores[full] (and argmax[full]) of the pairs `full` (documents not empty) in document units
    through MKL's batched product (see _RERANK_GROUP_BYTES); `q` in the compute dtype (int8 documents:
    ``token_scales`` and ``query_scales`` as in `_score_units`)."""
    compute, device = q.dtype, q.device
    # pairs by document (then query); each document's run of pairs cut into units of <= k_max pairs
    by_doc = full[np.lexsort((pair_query[full], pair_doc[full]))]
    doc_of = pair_doc[by_doc]
    run_start = np.flatnonzero(np.concatenate([[True], doc_of[1:] != doc_of[:-1]]))
    run_len = np.diff(np.append(run_start, len(by_doc)))
    columns = max(_MIN_GEMM_ROWS, min(layout.max_query_len, _QUERY_ROWS))
    k_max = max(1, _QUERY_ROWS // columns)
    units_per_run = -(-run_len // k_max)
    first_unit = np.repeat(np.cumsum(units_per_run) - units_per_run, units_per_run)
    unit_start = np.repeat(run_start, units_per_run) + (np.arange(len(first_unit)) - first_unit) * k_max
    unit_k = np.minimum(k_max, np.repeat(run_start + run_len, units_per_run) - unit_start)
    unit_doc = doc_of[unit_start]
    unit_len = layout.d_lens[unit_doc]
    # units by pair count, then length (groups pad little), then document (a run's units stay adjacent)
    u_order = np.lexsort((unit_start, unit_len, unit_k))
    unit_start, unit_k, unit_doc, unit_len = (x[u_order] for x in (unit_start, unit_k, unit_doc, unit_len))
    unit_pair0 = np.cumsum(unit_k) - unit_k  # first pair of each unit in the scoring order
    pair_order = by_doc[np.repeat(unit_start - unit_pair0, unit_k) + np.arange(int(unit_k.sum()))]
    groups = []
    k_bounds = np.flatnonzero(np.concatenate([[True], unit_k[1:] != unit_k[:-1], [True]]))
    itemsize = torch.empty(0, dtype=compute).element_size()
    padded = np.maximum(unit_len, _MIN_GEMM_ROWS).astype(np.int64)
    # a unit's document rows, its k queries' rows and its similarities, in the compute dtype
    unit_bytes = ((padded + unit_k * columns) * layout.dim + padded * unit_k * columns) * itemsize
    for ka, kb in zip(k_bounds[:-1], k_bounds[1:], strict=True):
        for a, b in _unit_groups(unit_bytes[ka:kb], _RERANK_GROUP_BYTES):
            groups.append((int(ka + a), int(ka + b), int(unit_k[ka]), int(unit_pair0[ka + a])))
    pair_scores = torch.zeros(len(pair_order), 1, dtype=compute, device=device)
    pair_argmax = (
        torch.full((len(pair_order), layout.max_query_len), -1, dtype=torch.int32, device=device)
        if argmax is not None
        else None
    )
    sorted_query = pair_query[pair_order]
    args = (
        q,
        layout.q_offsets[:-1][sorted_query],
        layout.q_lens[sorted_query],
        docs,
        doc_scales,
        layout.d_offsets[:-1][unit_doc],
        unit_len,
    )

    def work(group: tuple[int, int, int, int]) -> None:
        _score_units(*args, group, pair_scores, pair_argmax, check_finite, token_scales, query_scales)

    if device.type == "cpu":
        _run_units(work, groups, _worker_count())
    else:
        for group in groups:
            work(group)
    placed = torch.from_numpy(pair_order).to(device)
    scores[placed] = pair_scores[:, 0].to(scores.dtype)
    if argmax is not None:
        argmax[placed] = pair_argmax
