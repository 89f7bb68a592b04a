"""A corpus held in a device's memory: every shard's packed rows and scales, read once.

`Corpus.to(device)` calls `make_resident`: each shard becomes one ``[T, dim]`` tensor (and ``[T]`` int8
scales) on the device, all of them views of one buffer when the shards agree on dtype and dim (with the
whole corpus's ``[N + 1]`` offsets beside it), filled chunk by chunk by reader threads through the
shard's checked reader (NaN/Inf are refused as on every read), so host memory holds only the chunks in
flight. Scoring then takes its document batches as views of these tensors and reads nothing from disk.

Bytes on the device: ``T * (dim * itemsize + 4 if int8) + (n + 1) * 8`` per shard (at most), checked
against the device's free memory (or the host's available memory for ``cpu``) before anything is
allocated.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from maxsim_cli.errors import MaxsimError

if TYPE_CHECKING:
    import torch

    from maxsim_cli.shards.shard import Shard

# Rows are read and copied in chunks of about this many bytes: large enough that a chunk's read and
# copy dwarf their per-call costs, small enough that the chunks in flight (reader threads + 2) stay a
# small share of host memory.
CHUNK_BYTES = 64 << 20
# Share of the free device memory a resident corpus may take: scoring needs the rest for query
# batches, scores and the top-k state.
FREE_SHARE = 0.9


@dataclass
class ResidentShard:
    """One shard on the device: document i is ``embeddings[host_offsets[i]:host_offsets[i + 1]]``."""

    embeddings: torch.Tensor  # [T, dim], the shard's dtype
    host_offsets: np.ndarray  # int64 [n + 1]: the kernels get a batch's offsets with the batch
    scales: torch.Tensor | None  # float32 [T] for int8 shards


@dataclass
class Residency:
    """Every shard of a corpus on ``device``: one buffer of every row in shard order (the shards of a
    corpus share dtype, dim and quantization), so that a batch of consecutive documents is one view and
    one kernel launch, across shards too (a corpus of 15 shards was 15 launches a search).
    ``doc_base[s]`` is shard ``s``'s first document within the residency; ``shards`` are views of it."""

    device: torch.device
    shards: list[ResidentShard]
    nbytes: int
    embeddings: torch.Tensor  # [T, dim]: every shard's rows
    scales: torch.Tensor | None  # float32 [T] for int8 shards
    doc_base: np.ndarray  # int64 [S + 1]: each shard's first document, then the total
    host_offsets: np.ndarray  # int64 [N + 1]: every document's first row in ``embeddings``
    # the same offsets as a host tensor whose device copy (``offsets``) the kernels are handed with it
    # (`maxsim_kernels.share_device_copy`): one object, so its checks are made once
    offsets_host: torch.Tensor
    offsets: torch.Tensor
    # each document's docno rank on the device (the tie-break of a search's top-k), made at the first
    # search scored directly (`maxsim_cli.scoring.direct`)
    doc_ranks: torch.Tensor | None = None
    # the reused launcher of small reranks on a float corpus on CUDA (`direct.candidate_scores`), made at
    # the first one
    candidates: Any = None
    # residual2 codes: the kernels' codebook on the device, made at the first call scored directly
    codebook: Any = None
    # a corpus resident on the host: the page-locked buffer a rerank on a GPU stages its candidates' rows
    # in (`maxsim_cli.scoring.host_rows.HostStaging`), made at the first one
    staging: Any = None


def assign_shards(tokens: Sequence[int], world: int) -> list[list[int]]:
    """Shard indices of each of ``world`` ranks, balanced by token count.

    Largest shard first (ties: lower shard index first) onto the rank with the fewest tokens so far
    (ties: lower rank); each rank's list is in shard order. Deterministic, so every rank computes the
    same shares. The largest share is at most ``sum(tokens) / world + max(tokens)``.
    """
    if world < 1:
        raise ValueError(f"assign_shards: world must be >= 1, got {world}")
    load = [0] * world
    shares: list[list[int]] = [[] for _ in range(world)]
    for s in sorted(range(len(tokens)), key=lambda i: (-int(tokens[i]), i)):
        r = min(range(world), key=lambda j: (load[j], j))
        shares[r].append(s)
        load[r] += int(tokens[s])
    return [sorted(share) for share in shares]


def shard_bytes(shard: Shard) -> int:
    """Device bytes of one resident shard."""
    info = shard.info
    per_token = info.width * (1 if info.dtype in ("int8", "uint8") else _itemsize(info.dtype))
    per_token += 4 if info.scaled else 0
    return info.num_tokens * per_token + (info.num_docs + 1) * 8


def _itemsize(dtype: str) -> int:
    return {"float16": 2, "bfloat16": 2, "float32": 4, "int8": 1}[dtype]


def available_bytes(device: torch.device) -> int:
    """Memory a resident corpus may take on ``device``: a share of the free GPU memory, or of the
    host's available memory (``MemAvailable``) for the CPU."""
    import torch

    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * FREE_SHARE)
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * FREE_SHARE)
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") * FREE_SHARE)


def make_resident(
    shards: Sequence[Shard], device: torch.device, *, name: str, reader_threads: int | None = None
) -> Residency:
    """Read every shard into ``device`` memory. Raises `MaxsimError` before allocating anything when the
    corpus does not fit: the message says how much is needed and how much is free."""
    import torch

    from maxsim_cli.units import format_size

    need = sum(shard_bytes(s) for s in shards)
    free = available_bytes(device)
    if need > free:
        raise MaxsimError(
            f"{name}: the corpus needs {format_size(need)} to be resident on {device} but only "
            f"{format_size(free)} is free there; score it streamed from disk instead (leave out .to()), "
            "free memory, or use a device with more"
        )
    layouts = {(s.info.dtype, s.info.dim, s.info.quantization) for s in shards}
    if len(layouts) != 1:  # `open_corpus` refuses such shards
        raise MaxsimError(f"{name}: only shards of one dim, dtype and quantization can be resident together")
    dtype_name, _dim, _quantization = layouts.pop()
    doc_base = np.concatenate([[0], np.cumsum([s.info.num_docs for s in shards])]).astype(np.int64)
    row_base = np.concatenate([[0], np.cumsum([s.info.num_tokens for s in shards])]).astype(np.int64)
    host_offsets = np.concatenate(
        [[0]] + [np.asarray(s.offsets, dtype=np.int64)[1:] + row_base[i] for i, s in enumerate(shards)]
    ).astype(np.int64)
    width = shards[0].info.width  # values a token: dim, or the bytes of its codes
    embeddings = torch.empty((int(row_base[-1]), width), dtype=getattr(torch, dtype_name), device=device)
    scaled = shards[0].info.scaled
    scales = torch.empty(int(row_base[-1]), dtype=torch.float32, device=device) if scaled else None
    resident = [
        ResidentShard(
            embeddings[row_base[i] : row_base[i + 1]],
            host_offsets[doc_base[i] : doc_base[i + 1] + 1] - row_base[i],
            scales[row_base[i] : row_base[i + 1]] if scales is not None else None,
        )
        for i in range(len(shards))
    ]
    chunks: list[tuple[int, int, int]] = []  # (shard, first doc, stop doc)
    for s, shard in enumerate(shards):
        info = shard.info
        per_doc_bytes = max(shard_bytes(shard) // max(info.num_docs, 1), 1)
        step = max(CHUNK_BYTES // per_doc_bytes, 1)
        chunks.extend((s, a, min(a + step, info.num_docs)) for a in range(0, info.num_docs, step))
    # round-robin over shards: a shard serialises its own reads, so threads read different shards
    chunks.sort(key=lambda c: (c[1], c[0]))
    threads = reader_threads or min(16, os.cpu_count() or 1)

    def read(chunk: tuple[int, int, int]):  # noqa: ANN202 - a DocBatch
        s, a, b = chunk
        return shards[s].read_docs(a, b)

    with ThreadPoolExecutor(threads, thread_name_prefix="maxsim-resident") as pool:
        in_flight = threads + 2
        futures = [pool.submit(read, c) for c in chunks[:in_flight]]
        for i, chunk in enumerate(chunks):
            batch = futures[i].result()
            futures[i] = None  # type: ignore[call-overload]  # let the chunk's host memory go
            if i + in_flight < len(chunks):
                futures.append(pool.submit(read, chunks[i + in_flight]))
            s, a, _b = chunk
            t0 = int(host_offsets[doc_base[s] + a])
            rows = batch.embeddings.shape[0]
            embeddings[t0 : t0 + rows].copy_(batch.embeddings)
            if scales is not None and batch.scales is not None:
                scales[t0 : t0 + rows].copy_(batch.scales)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    offsets_host, offsets_device = _device_offsets(host_offsets, device)
    return Residency(
        device, resident, need, embeddings, scales, doc_base, host_offsets, offsets_host, offsets_device
    )


def residency_of(
    embeddings: torch.Tensor, scales: torch.Tensor | None, host_offsets: np.ndarray
) -> Residency:
    """Packed rows already on a device (an in-memory corpus: `Corpus.from_embeddings`) as a residency of
    one shard on that device: nothing is copied but the offsets. ``host_offsets``: int64 [N + 1]."""
    device = embeddings.device
    nbytes = embeddings.numel() * embeddings.element_size() + len(host_offsets) * 8
    nbytes += scales.numel() * scales.element_size() if scales is not None else 0
    offsets_host, offsets_device = _device_offsets(host_offsets, device)
    doc_base = np.array([0, len(host_offsets) - 1], dtype=np.int64)
    shard = ResidentShard(embeddings, host_offsets, scales)
    return Residency(
        device, [shard], nbytes, embeddings, scales, doc_base, host_offsets, offsets_host, offsets_device
    )


def _device_offsets(host_offsets: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The offsets as a host tensor and its copy on ``device``, the pair the kernels are handed (on CUDA
    registered as one, so that their checks are made once)."""
    import torch

    offsets_host = torch.from_numpy(host_offsets)
    offsets_device = offsets_host.to(device)
    if device.type == "cuda":
        from maxsim_kernels import share_device_copy

        share_device_copy(offsets_host, offsets_device)
    return offsets_host, offsets_device
