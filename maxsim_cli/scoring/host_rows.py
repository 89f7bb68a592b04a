"""A rerank on a GPU against a corpus resident in host memory: only the candidates' rows cross.

A corpus made resident on the CPU (`Corpus.to("cpu")`: the exact tier of a two-stage search kept in host
memory while the compressed tier is scanned on the GPU) holds every token row in one host buffer
(`maxsim_cli.shards.resident.Residency`). Scoring a rerank of it on CUDA needs the candidates' rows alone
on the device. At its first such call the buffer is page-locked and mapped into the GPUs' address space
(`maxsim_kernels.gather_rows.map_host`, kept with the residency in `HostStaging`), and from then on the
GPU reads the candidates' rows over PCIe itself (`maxsim_kernels.gather_rows.gather_rows`) into one packed
buffer in its memory: no host thread touches them. Where CUDA refuses the mapping (or with
``MAXSIM_MAP_HOST=0``) they are gathered instead (`staging.gather_rows`: one `torch.index_select` over a
piece's rows) by the threads of `gather_pool`, a piece of about `PIECE_BYTES` each, into a page-locked
staging buffer kept with the residency and reused from call to call (sized by the largest call's
candidates, never by the corpus); each piece's host-to-device copy is queued as soon as it is gathered,
so that the copies overlap the gathering. Either way one `maxsim_kernels.maxsim_candidates` launch then
scores every candidate over the gathered rows (their offsets rebased), and the scores come back in one
copy.

One query's 1,000 candidates of an 8 GB fp16 corpus (70.8 MB of rows) on the H100 machine: docs/two-stage.md
gives both ways' times, side by side (benchmarks/bench_two_stage.py).

The kernel, the queries (converted as the engine converts them) and each pair's document rows are those
the engine's rerank scores, so the scores are the engine's bit for bit; the gathered rows are the
resident ones, whose values were checked when the corpus was made resident. The engine's batch stream
gathers from such a corpus with the threads (`BatchStream(host_residency=)`), for the calls this path
leaves to it. On the CPU (``device`` cpu: tests) the rows are gathered into plain memory and scored there.

What it replaces: a CUDA rerank of a host-resident corpus went to the engine, which read the candidates
from the shard files (the host copy unused), a document a read with a float32 sum of its values on the
host, packed with `torch.cat` and copied again into a slot. One query's 2,000 candidates (138.6 MB of
fp16 rows, 2 GB corpus) on the idle 2-core machine, p50: 192 ms of reads that way, 18 ms read straight
into the slots (`SafetensorsShard.read_docs_into`), 12 ms gathered here against 9 ms for one
contiguous copy of as many bytes (benchmarks/bench_host_rows.py).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import numpy as np
import torch
from maxsim_kernels.cpu import one_torch_thread

from maxsim_cli import settings
from maxsim_cli.codecs import CODE_QUANTIZATIONS
from maxsim_cli.scoring.resources import candidate_scores_on, device_queries, query_embeddings
from maxsim_cli.scoring.staging import gather_rows, gathered_offsets

if TYPE_CHECKING:
    from maxsim_kernels.gather_rows import HostMapping

    from maxsim_cli.shards import Corpus, DocBatch
    from maxsim_cli.shards.resident import Residency

# The most bytes of candidates' rows one call stages (host and device): a larger call goes to the engine,
# which plans batches under the memory budgets. One query's 2,000 candidates of 300 fp32 tokens at
# dim 128 are 307 MB.
MAX_STAGED_BYTES = 512 << 20
# Rows a gathering thread takes at a time, and whose copy is queued once they are gathered: the copies of
# the first pieces (0.08 ms each at 53 GB/s) run while later ones are gathered, and the last piece's copy
# is all the copying that does not overlap.
PIECE_BYTES = 4 << 20
# Threads that gather a call's pieces (`gather_pool`).
GATHER_THREADS = min(16, os.cpu_count() or 1)


def supported(corpus: Corpus, residency: Residency) -> bool:
    """Whether a rerank of ``corpus`` (resident on the host as ``residency``) can be staged here: float
    or int8 rows (codes go to the engine, which decodes them with their codebook)."""
    return residency.device.type == "cpu" and corpus.quantization not in CODE_QUANTIZATIONS


def staged_bytes(residency: Residency, docs: np.ndarray) -> int:
    """Bytes of the rows (and int8 scales) of documents ``docs`` (residency ordinals)."""
    offsets = residency.host_offsets
    tokens = int((offsets[docs + 1] - offsets[docs]).sum())
    return tokens * _token_bytes(residency)


def _token_bytes(residency: Residency) -> int:
    embeddings = residency.embeddings
    scale_bytes = 4 if residency.scales is not None else 0
    return embeddings.shape[1] * embeddings.element_size() + scale_bytes


class HostStaging:
    """What a host-resident corpus keeps for its reranks on a GPU (``Residency.staging``): the mapping of its
    rows into the GPUs' address space (`maxsim_kernels.gather_rows.map_host`, made at the first call and
    released with this object), or where that was refused, the page-locked buffer the rows are staged in,
    reused: grown to the largest call's rows (less than twice them), at most `MAX_STAGED_BYTES`. Calls are
    serialised (``lock``): a call holds it until its copies out of the buffer have finished."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.mapping: HostMapping | None = None
        self.map_tried = False

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` page-locked bytes (uint8): the kept buffer, grown first if it is smaller (to a power of
        two, so that calls of growing size lock memory a few times only)."""
        if self.buffer.numel() < nbytes:
            size = max(min(1 << max(nbytes - 1, 1).bit_length(), MAX_STAGED_BYTES), nbytes)
            self.buffer = torch.empty(0, dtype=torch.uint8)  # the old one freed before the new is locked
            self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return self.buffer[:nbytes]

    def mapped(self, residency: Residency) -> HostMapping | None:
        """The residency's rows mapped for the GPUs, made at the first call (under ``lock``); None where
        CUDA refused (the buffer is used then) or ``MAXSIM_MAP_HOST=0``."""
        if not self.map_tried:
            self.map_tried = True
            if settings.map_host():
                from maxsim_kernels.gather_rows import map_host

                tensors = [t for t in (residency.embeddings, residency.scales) if t is not None]
                self.mapping = map_host(tensors)
                if self.mapping is not None:
                    # unlocked when this object goes (with its residency, whose tensors it keeps until then)
                    weakref.finalize(self, self.mapping.release).atexit = False
        return self.mapping


def staging_of(residency: Residency) -> HostStaging:
    """The residency's staging buffer, made at its first staged call."""
    if residency.staging is None:
        residency.staging = HostStaging()
    return residency.staging


def candidate_scores(
    corpus: Corpus,
    residency: Residency,
    queries: DocBatch,
    candidate_offsets: np.ndarray,
    candidate_docs: np.ndarray,
    device: torch.device,
    *,
    backend: str = "auto",
) -> tuple[np.ndarray, int] | None:
    """float32 scores of query ``i`` against the residency's documents
    ``candidate_docs[candidate_offsets[i]:candidate_offsets[i + 1]]`` (int64 numpy arrays), scored on
    ``device`` from the host ``residency``: the candidates' rows gathered and copied there (module
    docstring), one `maxsim_candidates` launch; and the bytes staged. None when the rows are more than
    `MAX_STAGED_BYTES` or the device ran out of memory (nothing staged is kept: the engine runs it)."""
    docs, local = np.unique(candidate_docs, return_inverse=True)
    nbytes = staged_bytes(residency, docs)
    if nbytes > MAX_STAGED_BYTES:
        return None
    starts, offsets = gathered_offsets(residency.host_offsets, docs)
    rows = int(offsets[-1])
    embeddings, scales = residency.embeddings, residency.scales
    width, dtype = embeddings.shape[1], embeddings.dtype
    scaled = scales is not None
    q_emb = query_embeddings(queries, corpus.dtype, corpus.quantization)
    q_offsets = queries.offsets.to(torch.int64)
    cand_offsets = torch.from_numpy(np.ascontiguousarray(candidate_offsets, dtype=np.int64))
    cand_docs = torch.from_numpy(local.astype(np.int64, copy=False).reshape(-1))
    doc_offsets = torch.from_numpy(offsets)

    def score(rows_emb: torch.Tensor, rows_scales: torch.Tensor | None) -> np.ndarray:
        """The one launch over the gathered rows (the queries copied to ``device`` first)."""
        q_dev, q_scales = device_queries(q_emb, device, scaled)
        return candidate_scores_on(
            q_dev, q_offsets, rows_emb, doc_offsets, cand_offsets, cand_docs,
            backend=backend, doc_scales=rows_scales, query_scales=q_scales,
        )  # fmt: skip

    if device.type != "cuda":  # gathered into plain memory and scored where it is
        out = torch.empty((rows, width), dtype=dtype)
        out_scales = torch.empty(rows, dtype=torch.float32) if scaled else None
        stage_rows(residency, starts, offsets, out, out_scales)
        return score(out, out_scales), nbytes
    torch.cuda.set_device(device)  # Triton launches on the calling thread's current device
    staging = staging_of(residency)
    try:
        with staging.lock:
            if staging.mapped(residency) is not None:
                return score(*_gather_on_device(residency, starts, offsets, device)), nbytes
            emb_bytes = rows * width * embeddings.element_size()
            scales_at = -(-emb_bytes // 64) * 64  # the scales aligned after the rows
            host = staging.take(scales_at + rows * 4 if scaled else emb_bytes)
            host_emb = host[:emb_bytes].view(dtype).view(rows, width)
            host_scales = host[scales_at:].view(torch.float32) if scaled else None
            dev_emb = torch.empty((rows, width), dtype=dtype, device=device)
            dev_scales = torch.empty(rows, dtype=torch.float32, device=device) if scaled else None

            def queue_copy(t0: int, t1: int) -> None:
                # on the stream the kernel runs on: the launch waits for every piece
                dev_emb[t0:t1].copy_(host_emb[t0:t1], non_blocking=True)
                if dev_scales is not None and host_scales is not None:
                    dev_scales[t0:t1].copy_(host_scales[t0:t1], non_blocking=True)

            stage_rows(residency, starts, offsets, host_emb, host_scales, queue_copy)
            # its copy back waits for the kernel, and so for every copy out of the staging buffer
            return score(dev_emb, dev_scales), nbytes
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def _gather_on_device(
    residency: Residency, starts: np.ndarray, offsets: np.ndarray, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows of a gather (`gathered_offsets`) from the mapped host ``residency`` into new tensors on
    ``device``, read by the GPU (`maxsim_kernels.gather_rows`); its launch is on the current stream, which
    the scoring launch after it shares."""
    from maxsim_kernels.gather_rows import gather_rows as gather_on_gpu
    from maxsim_kernels.validation import host_to_device

    n = len(starts)
    rows = int(offsets[-1])
    embeddings, scales = residency.embeddings, residency.scales
    # queued behind the stream's work, not waiting for it (a plain copy from pageable memory would)
    index = np.concatenate([starts, offsets]).astype(np.int64, copy=False)
    index = host_to_device(torch.from_numpy(index), device)
    dev_emb = torch.empty((rows, embeddings.shape[1]), dtype=embeddings.dtype, device=device)
    dev_scales = torch.empty(rows, dtype=torch.float32, device=device) if scales is not None else None
    longest = int((offsets[1:] - offsets[:-1]).max()) if n else 0
    gather_on_gpu(embeddings, index[:n], index[n:], dev_emb, scales, dev_scales, max_rows=longest)
    return dev_emb, dev_scales


def stage_rows(
    residency: Residency,
    starts: np.ndarray,
    offsets: np.ndarray,
    out_embeddings: torch.Tensor,
    out_scales: torch.Tensor | None,
    queue_copy: Callable[[int, int], None] | None = None,
) -> None:
    """The rows of a gather (`gathered_offsets`) from the host ``residency`` into ``out_embeddings`` (and
    ``out_scales``), in pieces of about `PIECE_BYTES` (whole documents); ``queue_copy(t0, t1)`` once each
    piece is gathered, in order, with its rows: the caller's copy of them runs while later pieces are
    gathered. The pieces are gathered by the threads of `gather_pool` (one piece: on this thread). Returns
    once every piece is gathered (a piece's error raised after all have stopped writing)."""
    cuts = _pieces(offsets, _token_bytes(residency))

    def gather(a: int, b: int) -> None:
        t0, t1 = int(offsets[a]), int(offsets[b])
        scales = out_scales[t0:t1] if out_scales is not None else None
        gather_rows(
            residency.embeddings, residency.scales, starts, offsets, a, b, out_embeddings[t0:t1], scales
        )

    pieces = list(zip(cuts[:-1], cuts[1:], strict=True))
    if len(pieces) == 1 or GATHER_THREADS == 1:
        for a, b in pieces:
            gather(a, b)
            if queue_copy is not None:
                queue_copy(int(offsets[a]), int(offsets[b]))
        return
    futures = [gather_pool().submit(gather, a, b) for a, b in pieces]
    try:
        for (a, b), future in zip(pieces, futures, strict=True):
            future.result()
            if queue_copy is not None:
                queue_copy(int(offsets[a]), int(offsets[b]))
    finally:
        wait(futures)  # no piece is still written into the buffer when this returns


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def gather_pool() -> ThreadPoolExecutor:
    """The process's gathering threads (`GATHER_THREADS`), started at the first gather of several pieces.
    Each runs torch's CPU operations on one thread (the pool is the parallelism), as the batch stream's
    readers do. A piece a thread, not torch's intra-op threads a piece: with another process busy on the
    2-core machine, 34 pieces of 4 MiB took 548 ms through torch's threads (each piece's parallel region
    waits for its slowest thread) against 17-20 ms here; nor do they depend on how many threads the
    caller's torch operations use (`maxsim serve` on GPUs sets one)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(
                GATHER_THREADS,
                thread_name_prefix="maxsim-gather",
                initializer=one_torch_thread,
            )
        return _POOL


def _pieces(offsets: np.ndarray, token_bytes: int) -> list[int]:
    """Document cuts [0, ..., n] into pieces of about `PIECE_BYTES` of rows (a document is not split)."""
    n = len(offsets) - 1
    step = max(PIECE_BYTES // token_bytes, 1)
    marks = np.arange(step, int(offsets[-1]), step)
    inner = np.unique(np.searchsorted(offsets, marks, side="left"))
    inner = inner[(inner > 0) & (inner < n)]
    return [0, *inner.tolist(), n]
