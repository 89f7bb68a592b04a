"""What a scoring run holds besides its plan: the host budget and the note when the run outgrew it, the
reader threads, the page-locked staging arena of a CUDA run, and the queries as the kernels take them."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from maxsim_cli.devices import default_host_bytes
from maxsim_cli.errors import MAX_HOST_MEMORY, InputError
from maxsim_cli.memory import HostMeter
from maxsim_cli.scoring import plan as planning
from maxsim_cli.scoring.pipeline import BatchStream
from maxsim_cli.scoring.request import ScoreRequest
from maxsim_cli.scoring.staging import PinnedArena
from maxsim_cli.scoring.stats import ScoreStats
from maxsim_cli.units import format_size

if TYPE_CHECKING:
    from maxsim_cli.shards import DocBatch

Logger = Callable[[str], None]


def allocated_bytes(dev: torch.device) -> dict[str, int]:
    """The caching allocator's allocated bytes on ``dev`` ("current", "peak", ...): one nested dict, where
    `torch.cuda.memory_allocated` and `max_memory_allocated` each flatten every statistic into a new dict
    (in Python), which a served request of a few milliseconds paid twice."""
    return torch.cuda.memory_stats_as_nested_dict(dev)["allocated_bytes"]["all"]


def note_host_memory(stats: ScoreStats, meter: HostMeter, budget: int, given: bool, log: Logger) -> None:
    """The host memory the run used (`maxsim_cli.memory`) into the stats, and a warning when it grew past
    the budget."""
    peak = meter.peak()
    stats.peak_host_bytes = max(0, peak - meter.base)
    stats.extra["host_base_bytes"] = meter.base
    stats.extra["peak_rss_bytes"] = peak
    if stats.peak_host_bytes > budget:
        option = (
            MAX_HOST_MEMORY.given(format_size(budget))
            if given
            else f"the host budget ({format_size(budget)})"
        )
        log(
            f"warning: the process's memory grew by {format_size(stats.peak_host_bytes)} during the run, "
            f'over {option}; a larger budget avoids this, or see docs/reliability.md, "Memory bounds"'
        )


def reader_threads(request: ScoreRequest, cuda: bool) -> int:
    """Reader threads of a run: ``--reader-threads``, else one a core up to `DEFAULT_READER_THREADS` on
    CUDA and one on the CPU (see there)."""
    if request.reader_threads:
        return request.reader_threads
    return min(planning.DEFAULT_READER_THREADS, os.cpu_count() or 1) if cuda else 1


def host_budget_of(request: ScoreRequest) -> int:
    return request.max_host_memory if request.max_host_memory is not None else default_host_bytes()


def open_arena(
    request: ScoreRequest,
    device: torch.device,
    staging_bytes: int | None = None,
    corpus_bytes: int | None = None,
) -> PinnedArena:
    """Start page-locking the staging memory of a CUDA run: at most ``staging_bytes`` (default
    `plan.STAGING_BYTES`), the host budget, or the corpus's size (``corpus_bytes``, else its files').

    Locked piece by piece from the start, so that the locking is over before the pass begins: locking that
    overlaps the pass makes its CUDA calls and reads wait for the pieces (1.2-1.3 s instead of 0.54 s for
    a fresh process's first pass on the H200 machine), though it slows the set-up it overlaps (both take
    the process's address-space lock; docs/kernel-notes.md, "`maxsim score`: the host-side constants")."""
    host_budget = host_budget_of(request)
    cap = staging_bytes or planning.STAGING_BYTES
    size = files_bytes(request.corpus) if corpus_bytes is None else corpus_bytes
    staging = min(cap, host_budget, size + (1 << 20))
    return PinnedArena(staging, BatchStream.host_slots(reader_threads(request, True)), device)


def corpus_name(corpus: Sequence[str]) -> str:
    names = [str(p) for p in corpus]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def files_bytes(paths: Sequence[str]) -> int:
    """Bytes of the shard files named (directories: their shard files), for sizing the staging arena."""
    total = 0
    for path in paths:
        try:
            if os.path.isdir(path):  # a manifest may name shards in sub-directories
                total += sum(
                    os.path.getsize(os.path.join(root, name))
                    for root, _dirs, names in os.walk(path)
                    for name in names
                    if name.endswith((".safetensors", ".arrow", ".parquet"))
                )
            else:
                total += os.path.getsize(path)
        except OSError:
            return planning.STAGING_BYTES  # open_corpus reports the problem
    return total


def query_embeddings(qbatch: DocBatch, corpus_dtype: str, quantization: str) -> torch.Tensor:
    """Queries in the dtype the kernels take for this corpus: the corpus's float dtype, or float32
    for an int8 corpus (the kernels quantize them per token). int8 query files are dequantized."""
    emb = qbatch.embeddings
    if emb.dtype == torch.int8:
        if qbatch.scales is None:
            raise InputError(
                "the query file is int8 without per-token scales; re-create it with `maxsim pack`"
            )
        emb = emb.to(torch.float32) * qbatch.scales.to(torch.float32)[:, None]
    if corpus_dtype == "int8" or quantization != "none":
        return emb.to(torch.float32).contiguous()
    return emb.to(getattr(torch, corpus_dtype)).contiguous()


# Queries of at most this many bytes go to the GPU through a page-locked copy (`device_queries`): 16
# queries of 32 tokens at d = 128 in float32.
_PINNED_QUERY_BYTES = 1 << 18


def device_queries(
    q_emb: torch.Tensor, device: torch.device, scaled: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Queries (`query_embeddings`' dtype) on ``device`` as the kernels take them: for an int8 corpus on
    CUDA quantized once (int8 codes and their per-token scales) rather than by the kernel for every
    document batch (a launch and ~60 us of host time each); else as they are, scales None."""
    if device.type == "cuda" and q_emb.device.type == "cpu" and q_emb.numel() * q_emb.element_size() <= (
        _PINNED_QUERY_BYTES
    ):
        # a few queries (a search, a served call): through a page-locked copy, so that the transfer is
        # queued with the launches that follow instead of the host waiting for it
        emb = q_emb.pin_memory().to(device, non_blocking=True)
    else:
        emb = q_emb.to(device, non_blocking=False)
    if device.type == "cuda" and scaled:
        from maxsim_kernels.int8_host import quantize_per_token

        return quantize_per_token(emb)
    return emb, None


def candidate_scores_on(
    queries: torch.Tensor,
    query_offsets: torch.Tensor,
    docs: torch.Tensor,
    doc_offsets: torch.Tensor,
    candidate_offsets: torch.Tensor,
    candidate_docs: torch.Tensor,
    **kernel_kwargs: object,
) -> np.ndarray:
    """float32 host scores of one `maxsim_kernels.maxsim_candidates` launch (``kernel_kwargs``: its
    backend, doc_scales, query_scales, codebook): the launch of a rerank scored in one go, from a
    residency (`direct`) or from rows staged from the host (`host_rows`)."""
    from maxsim_kernels import maxsim_candidates

    scores = maxsim_candidates(
        queries, query_offsets, docs, doc_offsets, candidate_offsets, candidate_docs, **kernel_kwargs
    )
    return scores.to(torch.float32).cpu().numpy()
