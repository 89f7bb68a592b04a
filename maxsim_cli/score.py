"""`maxsim score`: exact MaxSim of queries against a sharded corpus, exhaustive top-k or reranking.

    score(q, d) = sum_i max_j <q_i, d_j>        i over the query's tokens, j over the document's

**Exhaustive mode** (the default) ranks every document of every shard for every query. Queries are split
into as few *query batches* as the memory budget allows (one, usually); each query batch makes one pass
over the corpus, streamed in *document batches* (`maxsim_cli.pipeline`) and scored with
`maxsim_kernels.maxsim_varlen` into a ``[nq, nd]`` block that is folded into a running top-k on the device
(`maxsim_cli.topk`). Ties are broken by docno descending through order keys, so the run does not depend on
batch sizes, shard order or memory budgets.

**Rerank mode** (``candidates=RUN``) scores exactly the (query, document) pairs of a first-stage run:
documents are found through one id index, only those some query needs are read (`Shard.read_doc_indices`),
and each document batch is scored with one `maxsim_kernels.maxsim_candidates` launch. Each query's
candidates that exist are written re-sorted by MaxSim (cut to ``top_k``).

**Memory accounting** (bytes; ``tb`` = bytes per token = dim x itemsize (+4 for an int8 scale)):

- scoring device (the GPU; on the CPU, the CPU's working set): the queries of a batch
  (``Tq * dim * itemsize``), the top-k state (``nq * k * STATE_BYTES``), the staging slots of the document
  batches (two, or the whole corpus when resident: ``tokens * tb + (docs + 1 + side) * 8`` each), and the
  largest batch's scores and top-k merge (``nq * nd * PAIR_BYTES``; rerank: ``C * RERANK_PAIR_BYTES``).
  Plans use `BUDGET_FILL` of the budget, leaving the rest for the allocator's rounding and the kernels'
  own scratch.
  On the CPU the staging slots (``reader_threads + 2`` batches) count here too.
- host (CUDA): ``(reader_threads + 2)`` pinned slots, carved from one arena of at most `STAGING_BYTES`,
  plus one unstaged batch per reader thread for containers read through `Shard.read_docs`.

Batches are also kept small enough for the stages to overlap: about ``corpus bytes / MIN_BATCHES``, between
`MIN_BATCH_BYTES` and `MAX_BATCH_BYTES`, on CUDA small enough that the slots fit the pinned arena, and on
the CPU within one shard (`_cut_at`: a safetensors batch is then scored from a map of its file,
uncopied). A CUDA out-of-memory error while scoring halves the document batch (down to one document) and
the run continues, with a note on stderr.

Where the time goes (one H200, 10 GB of fp16 safetensors shards, 512 queries x 32 tokens, warm page cache,
benchmarks/results/score-h200-read-pieces.json, ab-trees-h200x2-seeded-offsets.json, docs/benchmarks.md):
the pass over the corpus takes 0.50-0.53 s against 0.43 s for the kernel alone (reading the files alone:
0.20 s with 16 threads; copying them to the GPU alone: 0.18 s), so the kernel bounds it; on top come the
set-up (opening the shards, the docno order, page-locking the staging arena: 0.05-0.14 s) and writing the
run (0.02 s for 100 results a query, 0.07-0.10 s for 1000).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from maxsim_kernels._validate import resolve_backend, share_device_copy
from maxsim_kernels.cpu import NonFiniteDocuments

from maxsim_cli.errors import InputError, MaxsimError, RankStopped, UsageError
from maxsim_cli.pipeline import Batch, BatchPlan, BatchStream, Part, PinnedArena, read_parts
from maxsim_cli.shards import write_text_atomic
from maxsim_cli.topk import MAX_RANKS, PAIR_BYTES, STATE_BYTES, RunningTopK
from maxsim_cli.units import format_size

if TYPE_CHECKING:
    from maxsim_cli.distributed import RankPart

# Share of a memory budget that plans fill: the rest absorbs the caching allocator's block rounding and
# the kernels' scratch (a few MiB), which the plan does not see.
BUDGET_FILL = 0.85
# Bytes per rerank pair in a batch: the kernel's float32 score (4), the candidate index and the pair's
# output position in the side data (16) in each of the two device slots (32), and the scatter (4).
RERANK_PAIR_BYTES = 48
# Document batches: aim at MIN_BATCHES per pass over the corpus so reading, copying and scoring overlap
# (the first batch's read and the last one's scoring are not hidden: with 16 batches that is ~1/8 of a
# pass), within these sizes. 16 MiB keeps launches long against their ~20 us overhead; 256 MiB keeps the
# pinned slots (reader_threads + 2 of them) at a few GiB.
MIN_BATCHES = 16
MIN_BATCH_BYTES = 16 << 20
MAX_BATCH_BYTES = 256 << 20
# With a budget this small, a query batch is split rather than the document batches shrunk further.
MIN_BATCH_TOKENS = 16384
# Reader threads on CUDA: one a core up to 16 (the H200 machine's cores read its page cache at 44 GB/s
# with 16 threads, 33 with 8 and 20 with 4, benchmarks/results/read-rate-h200.json; with 4 the pass
# waited 0.45 s for reads, pass-breakdown-h200-a.json). They run at `pipeline.READER_NICE`. On the CPU
# one thread: reading is a small share of the time there and every other core scores.
DEFAULT_READER_THREADS = 16
# Defaults: host staging memory, and the share of free GPU memory used without --max-memory.
DEFAULT_HOST_BYTES = 4 << 30
DEFAULT_GPU_FREE_SHARE = 0.9
# Pinned staging memory on CUDA: page-locking costs ~0.17 s/GiB once per process (pipeline.PinnedArena), so
# the slots share one arena of at most this size: (16 + 2) shares of ~28 MiB, i.e. 110K fp16 tokens of
# d = 128, a batch that still takes ~1.5 ms of kernel time for 512 queries (several times the launch
# and merge overheads).
STAGING_BYTES = 512 << 20

Logger = Callable[[str], None]


def _stderr(message: str) -> None:
    print(f"maxsim: {message}", file=sys.stderr, flush=True)


@dataclass
class ScoreStats:
    """What a run did and where the time went (seconds; `read_s` is summed over reader threads)."""

    mode: str
    device: str
    backend: str
    output: str
    queries: int = 0
    documents: int = 0
    tokens: int = 0
    pairs: int = 0
    query_batches: int = 0
    doc_batches: int = 0
    resident: bool = False
    missing_candidates: int = 0
    oom_retries: int = 0
    wall_s: float = 0.0
    read_s: float = 0.0
    copy_s: float = 0.0
    score_s: float = 0.0
    wait_s: float = 0.0
    setup_s: float = 0.0
    write_s: float = 0.0
    bytes_read: int = 0
    peak_gpu_bytes: int | None = None
    peak_host_bytes: int = 0
    gpu_budget_bytes: int | None = None
    host_budget_bytes: int = 0
    reader_threads: int = 1
    query_batch_size: int = 0
    max_batch_docs: int = 0
    max_batch_tokens: int = 0
    planned_device_bytes: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def docs_per_s(self) -> float:
        """Documents scored (against every query) per second of wall time."""
        return self.documents / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Document tokens scored (against every query) per second of wall time."""
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict:
        """The stats as a JSON-ready dict, with throughput added."""
        out = asdict(self)
        out.pop("extra")
        out.update(self.extra)
        out["docs_per_s"] = self.docs_per_s
        out["tokens_per_s"] = self.tokens_per_s
        return out

    def summary(self) -> str:
        """One line for stderr."""
        gpu = f", peak GPU {format_size(self.peak_gpu_bytes)}" if self.peak_gpu_bytes is not None else ""
        what = f"{self.pairs:,} candidates of " if self.mode == "rerank" else ""
        return (
            f"scored {self.queries:,} queries x {what}{self.documents:,} documents ({self.tokens:,} tokens) "
            f"in {self.wall_s:.2f} s: {_si(self.docs_per_s)} docs/s, {_si(self.tokens_per_s)} tokens/s"
            f" on {self.device}{gpu}"
        )

    def write_json(self, path: str) -> None:
        """Write `as_dict` to ``path`` atomically."""
        write_text_atomic(path, json.dumps(self.as_dict(), indent=2, sort_keys=True) + "\n")


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


# --------------------------------------------------------------------------------------------------
# options


def resolve_device(device: str) -> torch.device:
    """``auto`` (CUDA when there is one), ``cpu``, ``cuda`` or ``cuda:N``; `UsageError` otherwise."""
    name = device.strip().lower()
    if name == "auto":
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: no CUDA device is available here; use --device cpu")
        try:
            dev = torch.device(name)
        except RuntimeError:
            raise UsageError(f"--device {device}: not a device; use auto, cpu, cuda or cuda:N") from None
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise UsageError(
                f"--device {device}: there are {torch.cuda.device_count()} CUDA devices (cuda:0 to "
                f"cuda:{torch.cuda.device_count() - 1})"
            )
        return torch.device("cuda", index)
    raise UsageError(f"--device {device}: not a device; use auto, cpu, cuda or cuda:N")


def check_backend_option(backend: str, device: torch.device) -> str:
    """`--backend` checked against `--device` (usage errors); returned as given, "auto" included."""
    if backend not in ("auto", "triton", "torch"):
        raise UsageError(f"--backend {backend}: use auto, triton or torch")
    if backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise UsageError(
            "--backend triton on the CPU needs Triton's interpreter: set TRITON_INTERPRET=1, "
            "or use --backend torch"
        )
    return backend


# --------------------------------------------------------------------------------------------------
# planning


@dataclass
class _Budget:
    device_bytes: int  # scoring-device budget (GPU, or the CPU's working set)
    host_bytes: int  # host staging budget (CUDA only)
    reader_threads: int
    cuda: bool
    staging_bytes: int = 0  # the pinned arena (CUDA)


def _cut_at(spans: list[tuple[int, int]], bounds: np.ndarray) -> list[tuple[int, int]]:
    """``spans`` (document ranges) cut at the shard boundaries ``bounds``, so that each lies in one shard.

    On the CPU a batch within one safetensors shard is scored straight from a map of the file; one that
    spans two shards is copied into a staging slot first, on the cores that score (1 GB in 8 shards:
    about half of the 17 batches). Measured interleaved on the 2-core machine, the gain depends on the
    machine's state (docs/benchmarks.md). The CUDA path copies every batch anyway and keeps its larger
    batches."""
    out = []
    for a, b in spans:
        inner = bounds[(bounds > a) & (bounds < b)].tolist()
        edges = [a, *inner, b]
        out.extend(zip(edges[:-1], edges[1:], strict=True))
    return out


def _split(
    cost_cum: np.ndarray, tok_cum: np.ndarray, cost_limit: float, token_limit: float
) -> list[tuple[int, int]]:
    """Greedy consecutive batches ``[start, stop)`` with summed cost <= ``cost_limit`` and tokens <=
    ``token_limit`` (a single document over either limit is a batch of its own)."""
    n = len(cost_cum) - 1
    out = []
    start = 0
    while start < n:
        by_cost = int(np.searchsorted(cost_cum, cost_cum[start] + cost_limit, side="right")) - 1
        by_tok = int(np.searchsorted(tok_cum, tok_cum[start] + token_limit, side="right")) - 1
        stop = max(start + 1, min(by_cost, by_tok, n))
        out.append((start, stop))
        start = stop
    return out


def _batch_token_limit(total_bytes: int, tb: int, budget: _Budget) -> float:
    """Tokens per batch for overlap (MIN_BATCHES per pass, within the batch-size bounds) and the host."""
    target = min(max(total_bytes // MIN_BATCHES, MIN_BATCH_BYTES), MAX_BATCH_BYTES)
    if budget.cuda:
        slots = BatchStream.host_slots(budget.reader_threads)
        # (reader_threads + 2) pinned slots and one unstaged batch per reader, and each slot within its
        # share of the pinned arena (with room for its offsets and side data, 16 bytes a token at most,
        # and the alignment of its three parts, with room to spare)
        target = min(target, budget.host_bytes // (slots + budget.reader_threads))
        share = PinnedArena.slot_share(budget.staging_bytes, slots) - 3 * PinnedArena.ALIGN
        return max(min(target // tb, share // (tb + 16)), 1)
    return max(target // tb, 1)


def _device_total(
    spans: Sequence[tuple[int, int]],
    tok_cum: np.ndarray,
    side_lens: Sequence[int],
    pair_bytes: Sequence[int],
    tb: int,
    fixed: int,
    slots: int,
) -> int:
    """Device bytes of a plan: `slots` staging slots of the largest batch (or all batches when
    ``slots == 0``, i.e. resident), plus the largest batch's scoring workspace, plus ``fixed``."""
    tokens = [int(tok_cum[b] - tok_cum[a]) for a, b in spans]
    docs = [b - a for a, b in spans]
    if slots:
        staging = slots * BatchStream.slot_bytes(max(tokens), max(docs), max(side_lens), 1, tb, False)
    else:
        staging = sum(
            BatchStream.slot_bytes(t, d, s, 1, tb, False)
            for t, d, s in zip(tokens, docs, side_lens, strict=True)
        )
    return fixed + staging + max(pair_bytes)


# --------------------------------------------------------------------------------------------------
# the engine


def score(
    queries: str,
    corpus: Sequence[str],
    *,
    output: str = "-",
    top_k: int = 1000,
    candidates: str | None = None,
    strict: bool = False,
    device: str = "auto",
    backend: str = "auto",
    max_memory: int | None = None,
    max_host_memory: int | None = None,
    run_tag: str = "maxsim",
    fmt: str = "trec",
    batch_queries: int | None = None,
    reader_threads: int | None = None,
    show_progress: bool = False,
    log: Logger = _stderr,
    devices: str | None = None,
    part: RankPart | None = None,
) -> ScoreStats:
    """Score the queries of ``queries`` against the shards ``corpus`` and write a run to ``output``.

    Exhaustive top-``top_k`` per query, or, with ``candidates`` (a run file, ``-`` = stdin), the
    candidates of that run re-scored. ``queries`` may be ``-`` (an Arrow IPC stream on stdin); at most
    one input may be stdin. ``max_memory`` bounds the scoring device's memory (GPU memory, or the CPU
    working set with device ``cpu``), ``max_host_memory`` the host staging buffers. Returns the stats;
    raises `UsageError` / `InputError` / `MaxsimError` with one-line messages, leaving no output file.
    ``devices`` (``"0,1"``, ``"all"``, ``"cpu:N"``) or a torchrun environment makes it a job of several
    processes with the same output (`maxsim_cli.distributed`); ``part`` is one rank's share of such a job.
    """
    options = dict(locals())  # the arguments as given, for a distributed job
    from maxsim_cli import distributed

    if part is None and (devices is not None or distributed.world_size() > 1):
        return distributed.dispatch(options)
    from maxsim_cli import progress as progress_mod
    from maxsim_cli.runs import RunWriter, read_run
    from maxsim_cli.shards import check_same_dim, open_corpus, read_queries

    wall_start = time.perf_counter()
    if top_k < 1:
        raise UsageError(f"--top-k {top_k}: must be at least 1")
    if batch_queries is not None and batch_queries < 1:
        raise UsageError(f"--batch-queries {batch_queries}: must be at least 1")
    if not corpus:
        raise UsageError("no corpus given: pass one or more shard files or directories after QUERIES")
    if any(str(p) == "-" for p in corpus):
        raise UsageError("the corpus cannot be read from stdin ('-'); pass shard files or directories")
    if str(queries) == "-" and candidates is not None and str(candidates) == "-":
        raise UsageError("QUERIES and --candidates are both '-': at most one input can be stdin")
    if fmt not in ("trec", "jsonl"):
        raise UsageError(f"--format {fmt}: use trec or jsonl")
    dev = resolve_device(device)
    backend = check_backend_option(backend, dev)
    cuda = dev.type == "cuda"
    if max_memory is not None and max_memory <= 0:
        raise UsageError("--max-memory must be positive")
    if max_host_memory is not None and max_host_memory <= 0:
        raise UsageError("--max-host-memory must be positive")

    writer = RunWriter(output, tag=run_tag, fmt=fmt)  # checks the tag and format now, opens later
    if part is not None:
        writer = part.sink  # a rank of a distributed job hands its results to rank 0
    stats = ScoreStats(
        mode="rerank" if candidates is not None else "exhaustive",
        device=str(dev),
        backend=backend,
        output=str(output),
    )
    host_budget = max_host_memory if max_host_memory is not None else _default_host_bytes()
    threads = reader_threads or (min(DEFAULT_READER_THREADS, os.cpu_count() or 1) if cuda else 1)
    arena = None
    if cuda:
        # Page-locked staging memory, locked piece by piece from the start, so that the locking is over
        # before the pass begins. It slows the set-up it overlaps (opening 19 shards, an mmap each, took
        # 0.29 s instead of 0.07 s on the H200 machine: both take the process's address-space lock), but
        # started later it overlapped the pass, whose CUDA calls and reads then waited for the pieces:
        # 1.2-1.3 s instead of 0.54 s for the first pass of a process on a fresh machine.
        cap = part.staging_bytes if part is not None and part.staging_bytes else STAGING_BYTES
        staging = min(cap, host_budget, _files_bytes(corpus) + (1 << 20))
        arena = PinnedArena(staging, BatchStream.host_slots(threads), dev)
    corpus_obj = part.corpus if part is not None else open_corpus([str(p) for p in corpus])
    try:
        if cuda:
            torch.cuda.set_device(dev)
            free, _total = torch.cuda.mem_get_info(dev)
            gpu_budget = max_memory if max_memory is not None else int(free * DEFAULT_GPU_FREE_SHARE)
            stats.gpu_budget_bytes = gpu_budget
            torch.cuda.reset_peak_memory_stats(dev)
            base_allocated = torch.cuda.memory_allocated(dev)
        qbatch = read_queries(str(queries))
        qname = "<stdin>" if str(queries) == "-" else str(queries)
        check_same_dim(qbatch, qname, corpus_obj)
        q_emb = _query_embeddings(qbatch, corpus_obj.dtype, corpus_obj.quantization)
        q_offsets = qbatch.offsets.to(torch.int64)
        qids = list(qbatch.ids)
        stats.queries = len(qids)

        stats.host_budget_bytes = host_budget
        stats.reader_threads = threads
        budget = _Budget(
            # the budget bounds what this run allocates, on top of what the process already holds
            device_bytes=gpu_budget if cuda else min(host_budget, max_memory or host_budget),
            host_bytes=host_budget,
            reader_threads=threads,
            cuda=cuda,
            staging_bytes=arena.nbytes if arena is not None else 0,
        )

        engine = _Engine(corpus_obj, q_emb, q_offsets, dev, backend, budget, stats, log, corpus)
        engine.arena = arena
        engine.stop = part.stop if part is not None else None
        if candidates is not None:
            from_rank = part is not None and part.candidates is not None
            run = part.candidates if from_rank else read_run(str(candidates))  # type: ignore[union-attr]
            cname = "<stdin>" if str(candidates) == "-" else str(candidates)
            jobs = engine.rerank_jobs(run, qids, qname, cname, strict)
            total_tokens = engine.rerank_total_tokens(jobs)
        else:
            jobs = engine.exhaustive_jobs(top_k, batch_queries)
            total_tokens = corpus_obj.num_tokens * len(jobs)
        shared_bar = part.progress if part is not None else None  # the job's, shared by its rank threads
        if shared_bar is not None:
            shared_bar.add_total(total_tokens)
        bar_context = (
            contextlib.nullcontext(shared_bar)
            if shared_bar is not None
            else progress_mod.ScoreProgress(show_progress, total_tokens)
        )
        with bar_context as bar, writer:
            engine.progress = bar
            if arena is not None:
                # The pass starts once the arena is locked, so that no page-locking runs during it (with
                # cudaHostAlloc, locking that overlapped the pass made it wait; see the comment above).
                stats.extra["arena_ready_s"] = round(arena.wait(), 4)
            stats.setup_s = time.perf_counter() - wall_start
            if candidates is not None:
                engine.run_rerank(jobs, qids, top_k, writer)
            else:
                engine.run_exhaustive(jobs, qids, top_k, writer)
    finally:
        for shard in corpus_obj.shards:
            shard.close()
    if cuda:
        torch.cuda.synchronize(dev)
        stats.peak_gpu_bytes = torch.cuda.max_memory_allocated(dev) - base_allocated
    stats.peak_host_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    stats.wall_s = time.perf_counter() - wall_start
    return stats


def _corpus_name(corpus: Sequence[str]) -> str:
    names = [str(p) for p in corpus]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _files_bytes(paths: Sequence[str]) -> int:
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
            return STAGING_BYTES  # open_corpus reports the problem
    return total


def _default_host_bytes() -> int:
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return DEFAULT_HOST_BYTES
    return min(DEFAULT_HOST_BYTES, physical // 4)


def _query_embeddings(qbatch, corpus_dtype: str, quantization: str) -> torch.Tensor:  # noqa: ANN001
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


@dataclass
class _Job:
    """One query batch: queries [q0, q1) and the document batches of its pass."""

    q0: int
    q1: int
    plans: list[BatchPlan]
    stream: BatchStream | None = None
    num_pairs: int = 0  # rerank: (query, candidate) pairs scored


class _Engine:
    def __init__(
        self,
        corpus,
        q_emb: torch.Tensor,
        q_offsets: torch.Tensor,
        device: torch.device,  # noqa: ANN001
        backend: str,
        budget: _Budget,
        stats: ScoreStats,
        log: Logger,
        corpus_paths: Sequence[str],
    ) -> None:
        self.corpus = corpus
        self.shards = corpus.shards
        self.q_emb = q_emb
        self.q_offsets = q_offsets
        self.device = device
        self.cuda = device.type == "cuda"
        self.backend = backend
        self.budget = budget
        self.stats = stats
        self.log = log
        self.corpus_paths = corpus_paths
        self.scaled = corpus.quantization != "none"
        self.doc_dtype = getattr(torch, corpus.dtype)
        self.tb = corpus.dim * self.doc_dtype.itemsize + (4 if self.scaled else 0)
        # The CPU backend checks float documents for NaN/Inf from the similarities it computes anyway
        # (`maxsim_kernels.cpu`, check_finite), so the reader need not: on the 2-core machine the
        # reader's check took 0.16-0.20 s of a core per GB, next to ~0.9 s of scoring per GB on both.
        self.backend_checks = (
            not self.cuda and not self.scaled and resolve_backend(backend, device) == "torch"
        )
        self.piece_docs: int | None = None  # set after a CUDA OOM: documents per kernel call
        self.progress = None
        self.stop: threading.Event | None = None  # set by a job whose other rank failed
        sizes = [s.num_docs for s in self.shards]
        self.shard_base = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        lengths = [np.diff(np.asarray(s.offsets, dtype=np.int64)) for s in self.shards]
        self.doc_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
        self.tok_cum = np.concatenate([[0], np.cumsum(self.doc_lengths)]).astype(np.int64)
        self.score_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.arena: PinnedArena | None = None
        self.docnos_of: dict[int, list[str]] = {}  # rerank: each query's candidates found, in run order

    # ---------------------------------------------------------------------------- query helpers

    def _query_slice(self, q0: int, q1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Queries q0..q1-1 on the device: (embeddings, host offsets, per-token scales or None). For an
        int8 corpus on CUDA the queries are quantized here, once (int8 codes and their scales), rather
        than by the kernel for every document batch (a launch and ~60 us of host time each)."""
        from maxsim_kernels.maxsim_int8 import quantize_per_token

        t0, t1 = int(self.q_offsets[q0]), int(self.q_offsets[q1])
        emb = self.q_emb[t0:t1].to(self.device, non_blocking=False)
        offsets = self._host_ints((self.q_offsets[q0 : q1 + 1] - t0).numpy())
        if self.cuda and self.scaled:
            q8, scales = quantize_per_token(emb)
            return q8, offsets, scales
        return emb, offsets, None

    def _host_ints(self, values: np.ndarray) -> torch.Tensor:
        """int64 values for a kernel argument, kept on the host.

        The kernels read offsets and candidate lists on the host (checks, launch grid) and copy them to
        the device themselves, without waiting for the stream (`maxsim_kernels._validate.host_to_device`),
        so launches queue up while the GPU scores earlier batches. A device tensor would cost a
        device-to-host synchronisation per launch.
        """
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))

    def _batch_ints(self, values: np.ndarray, device_copy: torch.Tensor) -> torch.Tensor:
        """`_host_ints` of values that the batch stream has already copied to the device with the batch
        (`device_copy`): the kernels use that copy instead of copying the values again."""
        host = self._host_ints(values)
        if device_copy.device.type == "cuda":
            share_device_copy(host, device_copy)
        return host

    def _query_bytes(self, q0: int, q1: int) -> int:
        t = int(self.q_offsets[q1] - self.q_offsets[q0])
        return t * self.q_emb.shape[1] * self.q_emb.element_size() + (q1 - q0 + 1) * 8

    def _parts(self, start: int, stop: int) -> list[Part]:
        """Global ordinals [start, stop) as per-shard ranges."""
        parts: list[Part] = []
        s = int(np.searchsorted(self.shard_base, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self.shard_base[s + 1]))
            if end > start:
                parts.append((s, start - int(self.shard_base[s]), end - int(self.shard_base[s])))
            start = end
            s += 1
        return parts

    # ---------------------------------------------------------------------------- exhaustive

    def exhaustive_jobs(self, top_k: int, batch_queries: int | None) -> list[_Job]:
        """Query batches and the document batches of each pass, sized to the budgets."""
        n_docs = len(self.doc_lengths)
        if n_docs >= MAX_RANKS:
            raise InputError(
                f"the corpus has {n_docs} documents; at most {MAX_RANKS - 1} can be ranked at once"
            )
        nq = int(self.q_offsets.shape[0] - 1)
        if nq == 0 or n_docs == 0:
            return []
        # docno ranks (ascending byte order) for the tie-break, and the inverse to decode results
        _, self.ordinal_of_rank, self.ids_by_rank = self.corpus.id_order()
        self.rank_of_ordinal = self.corpus.rank_of_ordinal()

        total_bytes = int(self.tok_cum[-1]) * self.tb
        token_limit = _batch_token_limit(total_bytes, self.tb, self.budget)
        usable = int(self.budget.device_bytes * BUDGET_FILL)
        slots = BatchStream.DEVICE_SLOTS if self.cuda else BatchStream.host_slots(self.budget.reader_threads)
        longest = int(self.doc_lengths.max())
        nq_b = min(nq, batch_queries or nq)
        while True:
            k_eff = min(top_k, n_docs)
            fixed = max(self._query_bytes(q0, min(q0 + nq_b, nq)) for q0 in range(0, nq, nq_b))
            fixed += nq_b * k_eff * STATE_BYTES
            per_doc = nq_b * PAIR_BYTES + slots * 16
            rest = usable - fixed
            # tokens per batch such that staging + scores fit, with docs of average length
            avg_len = max(self.tok_cum[-1] / n_docs, 1.0)
            fit_tokens = rest / (slots * self.tb + per_doc / avg_len) if rest > 0 else 0
            tokens = min(token_limit, fit_tokens)
            # Fewer queries a pass only make room on the scoring device; `token_limit` (overlap, host
            # staging) does not depend on them. Testing it here split the 512 queries of a 32 MB
            # corpus into 512 passes of one query: its staging slots, sized to the corpus, hold ~7K
            # tokens, under MIN_BATCH_TOKENS.
            enough = fit_tokens >= min(int(self.tok_cum[-1]), max(longest, MIN_BATCH_TOKENS))
            if enough or nq_b == 1 or batch_queries is not None:
                break
            nq_b = (nq_b + 1) // 2
        spans = self._fit_spans(tokens, per_doc, slots, fixed, usable, nq_b, longest)
        if not self.cuda:
            spans = _cut_at(spans, self.shard_base)
        resident = False
        n_jobs = math.ceil(nq / nq_b)
        if self.cuda and n_jobs > 1:
            need = _device_total(
                spans,
                self.tok_cum,
                [b - a for a, b in spans],
                [nq_b * PAIR_BYTES * (b - a) for a, b in spans],
                self.tb,
                fixed,
                0,
            )
            resident = need <= usable
            if resident:
                self.stats.planned_device_bytes = need
        self.stats.resident = resident
        self.stats.query_batch_size = nq_b
        self._note_batches(spans, self.tok_cum)
        plans = [
            BatchPlan(
                i,
                self._parts(a, b),
                b - a,
                int(self.tok_cum[b] - self.tok_cum[a]),
                side=_RankSlice(self.rank_of_ordinal, a, b),
                side_len=b - a,
            )
            for i, (a, b) in enumerate(spans)
        ]
        stream = self._stream(plans, resident=resident)
        self.stats.documents = n_docs
        self.stats.tokens = int(self.tok_cum[-1])
        return [_Job(q0, min(q0 + nq_b, nq), plans, stream) for q0 in range(0, nq, nq_b)]

    def _note_batches(self, spans: Sequence[tuple[int, int]], tok_cum: np.ndarray) -> None:
        self.stats.max_batch_docs = max(b - a for a, b in spans)
        self.stats.max_batch_tokens = max(int(tok_cum[b] - tok_cum[a]) for a, b in spans)

    def _fit_spans(
        self, tokens: float, per_doc: int, slots: int, fixed: int, usable: int, nq_b: int, longest: int
    ) -> list[tuple[int, int]]:
        """Document batches whose staging and scoring fit ``usable`` bytes; shrinks until they do."""
        avg_len = max(self.tok_cum[-1] / len(self.doc_lengths), 1.0)
        token_limit = max(tokens, 1.0)
        doc_limit = max(token_limit / avg_len * 1.25, 1.0)
        doc_cum = np.arange(len(self.doc_lengths) + 1, dtype=np.float64)
        while True:
            spans = _split(doc_cum, self.tok_cum, doc_limit, token_limit)
            need = _device_total(
                spans,
                self.tok_cum,
                [b - a for a, b in spans],
                [per_doc * (b - a) for a, b in spans],
                self.tb,
                fixed,
                slots,
            )
            if need <= usable:
                self.stats.planned_device_bytes = need
                return spans
            if doc_limit <= 1 and token_limit <= longest:
                raise MaxsimError(
                    f"the memory budget ({format_size(self.budget.device_bytes)} on {self.device}) is too "
                    f"small for {nq_b} queries and the longest document ({longest} tokens): it needs about "
                    f"{format_size(int(need / BUDGET_FILL))}; raise --max-memory"
                    + (" or --max-host-memory" if not self.cuda else "")
                    + " or pass --batch-queries"
                )
            token_limit = max(token_limit * 0.8, 1.0)
            doc_limit = max(doc_limit * 0.8, 1.0)

    def run_exhaustive(self, jobs: list[_Job], qids: list[str], top_k: int, writer) -> None:  # noqa: ANN001
        stats = self.stats
        stats.query_batches = len(jobs)
        stream = jobs[0].stream if jobs else None
        try:
            for job in jobs:
                q_emb, q_off, q_scales = self._query_slice(job.q0, job.q1)
                topk = RunningTopK(job.q1 - job.q0, top_k)
                assert job.stream is not None
                for batch in job.stream:
                    self._score_block(batch, 0, batch.plan.num_docs, (q_emb, q_off, q_scales), topk)
                    self._batch_done(batch)
                scores, ranks = topk.result()
                started = time.perf_counter()
                self._write_topk(writer, qids[job.q0 : job.q1], scores, ranks)
                stats.write_s += time.perf_counter() - started
                stats.pairs += (job.q1 - job.q0) * stats.documents
        finally:
            if stream is not None:
                stream.close()
                self._fold_times(stream)

    def _batch_done(self, batch: Batch) -> None:
        """After each batch: the progress bar, and a stop when another rank of the job has failed."""
        if self.progress is not None:
            self.progress.advance(batch.plan.num_docs, batch.plan.num_tokens)
        if self.stop is not None and self.stop.is_set():
            raise RankStopped("stopped because another rank of the job failed")

    def _score_block(
        self,
        batch: Batch,
        a: int,
        b: int,
        queries: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
        topk: RunningTopK,
    ) -> None:
        """Score documents [a, b) of a batch into the top-k; on CUDA OOM halve and retry. `queries`:
        `_query_slice`'s (embeddings, offsets, scales)."""
        from maxsim_kernels import maxsim_varlen
        from maxsim_kernels.cpu import maxsim_varlen_cpu

        q_emb, q_off, q_scales = queries

        piece = self.piece_docs
        if piece is not None and b - a > piece:
            for s in range(a, b, piece):
                self._score_block(batch, s, min(s + piece, b), queries, topk)
            return
        t0, t1 = int(batch.host_offsets[a]), int(batch.host_offsets[b])
        whole = a == 0 and b == batch.plan.num_docs
        docs = batch.embeddings if whole else batch.embeddings[t0:t1]
        if whole:
            offsets = self._batch_ints(batch.host_offsets, batch.offsets)
        else:
            offsets = self._host_ints(batch.host_offsets[a : b + 1] - t0)
        scales = None if batch.scales is None else (batch.scales if whole else batch.scales[t0:t1])
        assert batch.side is not None
        ranks = batch.side[a:b]
        timer = self._timer()
        try:
            scores = self._checked(
                batch,
                lambda check: (
                    maxsim_varlen_cpu(q_emb, q_off, docs, offsets, doc_scales=scales, check_finite=True)
                    if check
                    else maxsim_varlen(
                        q_emb,
                        q_off,
                        docs,
                        offsets,
                        backend=self.backend,
                        doc_scales=scales,
                        query_scales=q_scales,
                    )  # fmt: skip
                ),
            )
            topk.add(scores, ranks)
            del scores
        except torch.OutOfMemoryError:
            oom = True
        else:
            oom = False
        self._timer_end(timer)
        if not oom:
            return
        if b - a <= 1:
            raise MaxsimError(
                f"out of memory on {self.device} scoring one document ({t1 - t0} tokens) against "
                f"{topk.num_queries} queries; lower --batch-queries or --max-memory, or free GPU memory"
            )
        self._oom_note(b - a)
        mid = a + (b - a) // 2
        self._score_block(batch, a, mid, queries, topk)
        self._score_block(batch, mid, b, queries, topk)

    def _oom_note(self, docs: int) -> None:
        self.stats.oom_retries += 1
        half = max(docs // 2, 1)
        self.piece_docs = half if self.piece_docs is None else min(self.piece_docs, half)
        if self.cuda:
            torch.cuda.empty_cache()
        self.log(
            f"note: out of memory on {self.device} scoring {docs} documents at once; "
            f"continuing with at most {self.piece_docs} documents per kernel call"
        )

    def _write_topk(self, writer, qids: list[str], scores: torch.Tensor, ranks: torch.Tensor) -> None:  # noqa: ANN001
        import pyarrow as pa

        scores_np = scores.numpy()
        if hasattr(writer, "write_ordinals"):  # a rank of a distributed job: columns for rank 0's merge
            writer.write_ordinals(scores_np, self.ordinal_of_rank[ranks.numpy()])
            return
        docnos = self.ids_by_rank.take(pa.array(ranks.numpy().reshape(-1)))  # query after query
        if hasattr(writer, "write_ranked"):  # the whole block at once
            writer.write_ranked(qids, docnos, scores_np)
            return
        m = scores_np.shape[1] if scores_np.ndim == 2 else 0
        for i, qid in enumerate(qids):
            writer.write_query(qid, docnos[i * m : (i + 1) * m].to_pylist(), scores_np[i].tolist())

    # ---------------------------------------------------------------------------- rerank

    def rerank_jobs(
        self, run: dict[str, list[tuple[str, float]]], qids: list[str], qname: str, cname: str, strict: bool
    ) -> list[_Job]:
        """Map the run's candidates to corpus documents and plan the document batches."""
        qindex = {q: i for i, q in enumerate(qids)}
        for qid in run:
            if qid not in qindex:
                raise InputError(
                    f"{cname}: query {qid!r} has candidates but no embedding in {qname}; "
                    "add it to the query file or drop it from the run"
                )
        id_index = self.corpus.candidate_index(docno for cands in run.values() for docno, _ in cands)
        missing: list[str] = []
        n_missing = 0
        pair_q: list[int] = []
        pair_doc: list[int] = []
        docnos_of: dict[int, list[str]] = {}
        for qid, cands in run.items():
            qi = qindex[qid]
            found = []
            for docno, _ in cands:
                where = id_index.get(docno)
                if where is None:
                    n_missing += 1
                    if len(missing) < 3 and docno not in missing:
                        missing.append(docno)
                    continue
                pair_q.append(qi)
                pair_doc.append(int(self.shard_base[where[0]]) + where[1])
                found.append(docno)
            docnos_of[qi] = found
        self.stats.missing_candidates = n_missing
        if n_missing:
            examples = ", ".join(repr(m) for m in missing)
            if strict:
                raise InputError(
                    f"{cname}: {n_missing} candidates are not in the corpus "
                    f"({_corpus_name(self.corpus_paths)}), e.g. {examples}; check the run and the corpus, "
                    "or drop --strict to skip them"
                )
            self.log(
                f"warning: {cname}: {n_missing} candidates are not in the corpus, e.g. {examples}; "
                "they are left out (--strict makes this an error)"
            )
        self.docnos_of = docnos_of
        nq = len(qids)
        q_arr = np.asarray(pair_q, dtype=np.int64)
        d_arr = np.asarray(pair_doc, dtype=np.int64)
        self.stats.pairs = len(q_arr)
        if len(q_arr) == 0:
            return []
        # pair position = index in (query, run order) order, which is how results are gathered
        order = np.argsort(q_arr, kind="stable")
        q_arr, d_arr = q_arr[order], d_arr[order]
        unique_docs, u_of_pair = np.unique(d_arr, return_inverse=True)
        lengths = self.doc_lengths[unique_docs]
        tok_cum = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        pairs_per_doc = np.bincount(u_of_pair, minlength=len(unique_docs))
        self.stats.documents = len(unique_docs)
        self.stats.tokens = int(tok_cum[-1])

        total_bytes = int(tok_cum[-1]) * self.tb
        token_limit = _batch_token_limit(total_bytes, self.tb, self.budget)
        usable = int(self.budget.device_bytes * BUDGET_FILL)
        slots = BatchStream.DEVICE_SLOTS if self.cuda else BatchStream.host_slots(self.budget.reader_threads)
        fixed = self._query_bytes(0, nq) + (nq + 1) * 8 * (slots + 1) + len(q_arr) * 4
        cost = pairs_per_doc * RERANK_PAIR_BYTES + lengths * self.tb * slots + 16 * slots
        cost_cum = np.concatenate([[0], np.cumsum(cost)]).astype(np.float64)
        cost_limit = max(usable - fixed, 1)
        while True:
            spans = _split(cost_cum, tok_cum, cost_limit, token_limit)
            pair_counts = [int(pairs_per_doc[a:b].sum()) for a, b in spans]
            sides = [nq + 1 + 2 * c for c in pair_counts]
            need = _device_total(
                spans, tok_cum, sides, [c * RERANK_PAIR_BYTES for c in pair_counts], self.tb, fixed, slots
            )
            if need <= usable:
                self.stats.planned_device_bytes = need
                break
            if cost_limit <= 1 and token_limit <= 1:
                raise MaxsimError(
                    f"the memory budget ({format_size(self.budget.device_bytes)} on {self.device}) is too "
                    f"small to rerank {nq} queries: it needs about "
                    f"{format_size(int(need / BUDGET_FILL))}; raise --max-memory"
                )
            cost_limit = max(cost_limit * 0.8, 1)
            token_limit = max(token_limit * 0.8, 1)
        self.stats.query_batch_size = nq
        self._note_batches(spans, tok_cum)
        # pairs grouped by batch, then by query (candidate lists are per query, contiguous)
        batch_of_u = np.zeros(len(unique_docs), dtype=np.int64)
        for i, (a, b) in enumerate(spans):
            batch_of_u[a:b] = i
        pair_pos = np.arange(len(q_arr), dtype=np.int64)
        batch_of_pair = batch_of_u[u_of_pair]
        by_batch = np.lexsort((u_of_pair, q_arr, batch_of_pair))
        bounds = np.searchsorted(batch_of_pair[by_batch], np.arange(len(spans) + 1))
        plans = []
        for i, (a, b) in enumerate(spans):
            sel = by_batch[bounds[i] : bounds[i + 1]]
            cand_offsets = np.searchsorted(q_arr[sel], np.arange(nq + 1)).astype(np.int64)
            side = np.concatenate([cand_offsets, u_of_pair[sel] - a, pair_pos[sel]]).astype(np.int64)
            plans.append(
                BatchPlan(
                    i,
                    self._index_parts(unique_docs[a:b]),
                    b - a,
                    int(tok_cum[b] - tok_cum[a]),
                    side=side,
                    side_len=len(side),
                )
            )
        stream = self._stream(plans)
        self.pair_q = q_arr
        return [_Job(0, nq, plans, stream, num_pairs=len(q_arr))]

    def _index_parts(self, ordinals: np.ndarray) -> list[Part]:
        """Sorted global ordinals as per-shard index lists."""
        parts: list[Part] = []
        shard_of = np.searchsorted(self.shard_base, ordinals, side="right") - 1
        cuts = np.flatnonzero(np.diff(shard_of)) + 1
        for chunk, shards in zip(np.split(ordinals, cuts), np.split(shard_of, cuts), strict=True):
            s = int(shards[0])
            parts.append((s, chunk - self.shard_base[s]))
        return parts

    @staticmethod
    def rerank_total_tokens(jobs: list[_Job]) -> int:
        return sum(p.num_tokens for job in jobs for p in job.plans)

    def run_rerank(self, jobs: list[_Job], qids: list[str], top_k: int, writer) -> None:  # noqa: ANN001
        from maxsim_kernels import maxsim_candidates
        from maxsim_kernels.cpu import maxsim_candidates_cpu

        from maxsim_cli.runs import sort_trec

        stats = self.stats
        stats.query_batches = 1 if jobs else 0
        pair_scores = None
        for job in jobs:
            nq = job.q1 - job.q0
            q_emb, q_off, q_scales = self._query_slice(job.q0, job.q1)
            pair_scores = torch.zeros(job.num_pairs, dtype=torch.float32, device=self.device)
            assert job.stream is not None
            try:
                for batch in job.stream:
                    assert batch.side is not None
                    host_side = batch.plan.side_array()
                    assert host_side is not None
                    n_pairs = (host_side.shape[0] - (nq + 1)) // 2
                    # candidate lists on the host (see `_host_ints`), output positions on the device
                    cand_offsets = self._batch_ints(host_side[: nq + 1], batch.side[: nq + 1])
                    cand_docs = self._batch_ints(
                        host_side[nq + 1 : nq + 1 + n_pairs], batch.side[nq + 1 : nq + 1 + n_pairs]
                    )
                    positions = batch.side[nq + 1 + n_pairs :]
                    timer = self._timer()
                    try:
                        args = (
                            q_emb,
                            q_off,
                            batch.embeddings,
                            self._batch_ints(batch.host_offsets, batch.offsets),
                            cand_offsets,
                            cand_docs,
                        )
                        s = self._checked(
                            batch,
                            lambda check, args=args, scales=batch.scales, q_scales=q_scales: (
                                maxsim_candidates_cpu(*args, doc_scales=scales, check_finite=True)
                                if check
                                else maxsim_candidates(
                                    *args, backend=self.backend, doc_scales=scales, query_scales=q_scales
                                )
                            ),
                        )
                        pair_scores.index_copy_(0, positions, s.to(torch.float32))
                    finally:
                        self._timer_end(timer)
                    self._batch_done(batch)
            finally:
                job.stream.close()
                self._fold_times(job.stream)
        scores_np = pair_scores.cpu().numpy() if pair_scores is not None else np.zeros(0, dtype=np.float32)
        started = time.perf_counter()
        # pairs are in (query, run order) order: split by query
        starts = np.searchsorted(self.pair_q, np.arange(len(qids) + 1)) if jobs else None
        for qi, qid in enumerate(qids):
            docnos = self.docnos_of.get(qi)
            if not docnos:
                continue
            assert starts is not None
            sc = scores_np[starts[qi] : starts[qi + 1]].tolist()
            keep = sort_trec(docnos, sc)[:top_k]
            writer.write_query(qid, [docnos[i] for i in keep], [sc[i] for i in keep])
        stats.write_s += time.perf_counter() - started

    # ---------------------------------------------------------------------------- timing

    def _stream(self, plans: list[BatchPlan], *, resident: bool = False) -> BatchStream:
        """The background reader over `plans`, interleaved across shards."""
        return BatchStream(
            self.shards,
            _interleave(plans),
            dim=self.corpus.dim,
            dtype=self.doc_dtype,
            scaled=self.scaled,
            device=self.device,
            reader_threads=self.budget.reader_threads,
            resident=resident,
            arena=self.arena,
            check_values=not self.backend_checks,
        )

    def _checked(self, batch: Batch, compute: Callable[[bool], torch.Tensor]) -> torch.Tensor:
        """``compute(check)``: with ``check``, the CPU backend checks the documents' values (the reader
        did not: `backend_checks`). A flagged batch is read again through the shards' checked reader,
        whose error names the document and token; if that finds nothing (finite values whose products
        overflow fp32), the batch is scored again without the check."""
        if not self.backend_checks:
            return compute(False)
        try:
            return compute(True)
        except NonFiniteDocuments:
            read_parts(self.shards, batch.plan.parts)
            return compute(False)

    def _timer(self) -> object:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return start
        return time.perf_counter()

    def _timer_end(self, timer: object) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.score_events.append((timer, end))  # type: ignore[arg-type]
        else:
            self.stats.score_s += time.perf_counter() - timer  # type: ignore[operator]

    def _fold_times(self, stream: BatchStream) -> None:
        t = stream.times
        self.stats.read_s += t.read_s
        self.stats.copy_s += t.copy_s
        self.stats.wait_s += t.wait_s
        self.stats.bytes_read += t.bytes_read
        self.stats.doc_batches += t.batches
        t.read_s = t.copy_s = t.wait_s = 0.0
        t.bytes_read = t.batches = 0
        for start, end in self.score_events:
            end.synchronize()
            self.stats.score_s += start.elapsed_time(end) / 1000.0
        self.score_events.clear()


def _interleave(plans: list[BatchPlan]) -> list[BatchPlan]:
    """Plans reordered round-robin over shards (first the first batch of every shard, then the second
    ...), so that reader threads read different shards at once: a shard serialises its own reads. The
    results do not depend on the order (see `maxsim_cli.topk`)."""
    seen: dict[int, int] = {}
    keyed = []
    for plan in plans:
        shard = int(plan.parts[0][0])
        keyed.append((seen.get(shard, 0), shard, plan.index, plan))
        seen[shard] = seen.get(shard, 0) + 1
    out = [item[3] for item in sorted(keyed, key=lambda item: item[:3])]
    for i, plan in enumerate(out):
        plan.index = i
    return out


class _RankSlice:
    """Docno ranks of global ordinals [a, b), computed in the reader thread."""

    __slots__ = ("ranks", "a", "b")

    def __init__(self, ranks: np.ndarray, a: int, b: int) -> None:
        self.ranks, self.a, self.b = ranks, a, b

    def __call__(self) -> np.ndarray:
        return self.ranks[self.a : self.b]
