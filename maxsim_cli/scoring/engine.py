"""The scoring engine: one process, one device. It runs a plan (`maxsim_cli.scoring.plan`) over an open
corpus and hands the results to a sink.

    score(q, d) = sum_i max_j <q_i, d_j>        i over the query's tokens, j over the document's

**Exhaustive mode** (the default) ranks every document of every shard for every query. Queries are split
into as few *query batches* as the memory budget allows (one, usually); each query batch makes one pass
over the corpus, streamed in *document batches* (`maxsim_cli.scoring.pipeline`) and scored with
`maxsim_kernels.maxsim_varlen` into a ``[nq, nd]`` block that is folded into a running top-k on the device
(`maxsim_cli.scoring.topk`). Ties are broken by docno descending through order keys, so the run does not
depend on batch sizes, shard order or memory budgets.

**Rerank mode** (``candidates=RUN``) scores exactly the (query, document) pairs of a first-stage run:
documents are found through one id index, only those some query needs are read (`Shard.read_doc_indices`),
and each document batch is scored with one `maxsim_kernels.maxsim_candidates` launch. Each query's
candidates that exist are written re-sorted by MaxSim (cut to ``top_k``).

A CUDA out-of-memory error while scoring halves the document batch (down to one document) and the run
continues, with a note on stderr.

**Sinks.** Results go to ``sink``: ``write_query(qid, docnos, scores)`` for one query's results, best first
(rerank mode always; exhaustive mode when the sink has neither method below), or, when the sink has them,
``write_ordinals(scores, ordinals)`` (exhaustive: float32 scores and the corpus's int64 ordinals,
``[nq, m]`` numpy arrays, rows best first) or else ``write_ranked(qids, docnos, scores)`` (exhaustive: a
query batch at once, docnos an Arrow array query after query, scores ``[nq, m]`` float32). A sink that is
a context manager (`maxsim_cli.run_files.RunWriter`) is entered around the pass only: the run file is created
once the plan is made and kept only if the pass succeeds.

Where the time goes (one H200, 10 GB of fp16 shards, 512 queries x 32 tokens): the pass over the corpus
takes 0.50-0.53 s against 0.43 s for the kernel alone, so the kernel bounds it; set-up and writing the run
come on top (the pieces: docs/kernel-notes.md, "`maxsim score`: the host-side constants").
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from maxsim_kernels import NonFiniteDocuments, resolve_backend, share_device_copy
from maxsim_kernels.cpu import worker_count

from maxsim_cli import settings, timeline, tuning
from maxsim_cli.codecs import CODE_QUANTIZATIONS, code_width, has_scales
from maxsim_cli.devices import DEFAULT_GPU_FREE_SHARE
from maxsim_cli.errors import (
    BATCH_QUERIES,
    MAX_MEMORY,
    MaxsimError,
    RankStopped,
    log_to_stderr,
)
from maxsim_cli.memory import UNPLANNED_HOST_BYTES, HostMeter, worker_host_bytes
from maxsim_cli.scoring import plan as planning
from maxsim_cli.scoring.pipeline import Batch, BatchPlan, BatchStream, read_parts
from maxsim_cli.scoring.plan import Budget, Plan
from maxsim_cli.scoring.request import ScoreRequest
from maxsim_cli.scoring.resources import (
    allocated_bytes,
    device_queries,
    host_budget_of,
    note_host_memory,
    open_arena,
    query_embeddings,
    reader_threads,
)
from maxsim_cli.scoring.results import (
    drop_disallowed,
    locate_candidates,
    subset_candidates,
    write_reranked,
    write_topk,
)
from maxsim_cli.scoring.staging import PinnedArena
from maxsim_cli.scoring.stats import ScoreStats
from maxsim_cli.scoring.topk import RunningTopK
from maxsim_cli.shards import check_same_dim
from maxsim_cli.shards.resident import shard_bytes

if TYPE_CHECKING:
    from maxsim_cli.progress import ScoreProgress
    from maxsim_cli.scoring.warmup import KernelWarmup
    from maxsim_cli.shards import Corpus, DocBatch
    from maxsim_cli.shards.resident import Residency

Logger = Callable[[str], None]


@dataclass(frozen=True)
class RankContext:
    """What a caller adds to a run beyond its request: a rank of a job (`maxsim_cli.parallel`), or a caller
    that started the staging memory early."""

    stop: threading.Event | None = None  # set when another rank of the job has failed: stop scoring
    staging_bytes: int | None = None  # the pinned staging arena's size cap (default `plan.STAGING_BYTES`)
    progress: ScoreProgress | None = None  # a bar shared by the job's rank threads (else the run's own)
    # Pinned staging memory already locking (`open_arena`): `files.score_files` starts it before it
    # opens the corpus, so that the page-locking overlaps the opening.
    arena: PinnedArena | None = None
    # The host memory meter of the run (`maxsim_cli.memory`), started by a caller that opened the inputs
    # (`files.score_files`), so that they count; else the run starts its own.
    host_meter: HostMeter | None = None
    # The first Triton launch's once-a-process work, started beside the set-up (`maxsim_cli.scoring.warmup`):
    # waited for before the pass's first launch.
    warmup: KernelWarmup | None = None


def run(
    request: ScoreRequest,
    corpus: Corpus,
    queries: DocBatch,
    sink: Any,
    *,
    candidates: dict[str, list[tuple[str, float]]] | None = None,
    context: RankContext | None = None,
    log: Logger = log_to_stderr,
    disallowed: np.ndarray | None = None,
) -> ScoreStats:
    """Score ``queries`` against the open ``corpus`` as ``request`` says and hand the results to ``sink``
    (see the module docstring); return the stats.

    ``candidates``: rerank mode's run (``qid -> [(docno, score), ...]``, as `maxsim_cli.run_files.read_run`
    returns it); None scores every document. The corpus is neither opened nor closed here. Raises
    `UsageError` / `InputError` / `MaxsimError` with one-line messages; the request's ``devices`` is
    ignored (a job is `maxsim_cli.parallel`'s business). ``setup_s`` and ``wall_s`` count from this call.

    ``disallowed``: a filter's mask (`maxsim_cli.scoring.filters`: bool, one entry a corpus ordinal, True
    for a document that may not be returned): a search keeps the allowed documents' top-k (masked in the
    scan, or the allowed documents scored as candidates when they are few: `filters.use_subset`), a
    rerank drops the disallowed candidates.
    """
    started = time.perf_counter()
    context = context or RankContext()
    dev = request.check()
    cuda = dev.type == "cuda"
    meter = context.host_meter
    own_meter = meter is None
    if meter is None:
        meter = HostMeter(dev if cuda else None)
    try:
        return _run(request, corpus, queries, sink, candidates, context, log, meter, started, disallowed)
    finally:
        if own_meter:
            meter.close()


def _run(
    request: ScoreRequest,
    corpus: Corpus,
    queries: DocBatch,
    sink: Any,
    candidates: dict[str, list[tuple[str, float]]] | None,
    context: RankContext,
    log: Logger,
    meter: HostMeter,
    started: float,
    disallowed: np.ndarray | None = None,
) -> ScoreStats:
    from maxsim_cli import progress as progress_mod
    from maxsim_cli.scoring import filters

    dev = request.check()
    backend = request.backend
    cuda = dev.type == "cuda"
    stats = ScoreStats(
        mode="rerank" if candidates is not None else "exhaustive",
        device=str(dev),
        backend=backend,
        output=request.output,
    )
    if corpus.quantization in CODE_QUANTIZATIONS:  # the compressed tier's scores; exact: --exact-from
        stats.extra.update(scores="approximate", quantization=corpus.quantization)
    host_budget = host_budget_of(request)
    threads = reader_threads(request, cuda)
    # A corpus resident on this device (`Corpus.to`) is scored from its device tensors: nothing to read,
    # so no staging memory to lock.
    residency = corpus.residency if corpus.residency is not None and corpus.residency.device == dev else None
    # A corpus resident in host memory, scored on CUDA: batches are gathered from it, not read from files.
    host_residency = corpus.residency if cuda and residency is None and _on_host(corpus) else None
    arena = context.arena
    if cuda and arena is None and residency is None:
        # an in-memory corpus scored away from its device has no files to size the staging by
        held = None if corpus.paths else sum(shard_bytes(s) for s in corpus.shards)
        arena = open_arena(request, dev, context.staging_bytes, held)
    if cuda:
        torch.cuda.set_device(dev)
        free, _total = torch.cuda.mem_get_info(dev)
        gpu_budget = (
            request.max_memory if request.max_memory is not None else int(free * DEFAULT_GPU_FREE_SHARE)
        )
        stats.gpu_budget_bytes = gpu_budget
        torch.cuda.reset_peak_memory_stats(dev)
        base_allocated = allocated_bytes(dev)["current"]
    qname = request.query_name
    check_same_dim(queries, qname, corpus)
    q_emb = query_embeddings(queries, corpus.dtype, corpus.quantization)
    q_offsets = queries.offsets.to(torch.int64)
    qids = list(queries.ids)
    stats.queries = len(qids)

    stats.host_budget_bytes = host_budget
    stats.reader_threads = threads
    budget = Budget(
        # the budget bounds what this run allocates, on top of what the process already holds; on the
        # CPU the planned working set is also what is left of the host budget (`_Engine.fit_host`)
        device_bytes=gpu_budget if cuda else min(host_budget, request.max_memory or host_budget),
        host_bytes=host_budget,
        reader_threads=threads,
        cuda=cuda,
        staging_bytes=arena.nbytes if arena is not None else 0,
        device=str(dev),
        resident_corpus=residency is not None,
    )
    stats.extra["resident_corpus"] = residency is not None

    engine = _Engine(corpus, q_emb, q_offsets, dev, backend, budget, stats, log, request.corpus)
    engine.meter = meter
    engine.max_memory = request.max_memory
    engine.arena = arena
    engine.residency = residency
    engine.host_residency = host_residency
    engine.stop = context.stop
    engine.disallowed = disallowed
    # few documents allowed: they are every query's candidates (`filters.use_subset`)
    subset = candidates is None and disallowed is not None and filters.use_subset(disallowed)
    if disallowed is not None:
        stats.extra["filter"] = {
            "allowed": filters.allowed_count(disallowed, len(corpus)),
            "path": "subset" if subset else ("candidates" if candidates is not None else "scan"),
        }
    if candidates is not None or subset:
        passes = engine.rerank_passes(candidates, qids, qname, request.candidates_name, request.strict)
        total_tokens = engine.rerank_total_tokens(passes)
    else:
        passes = engine.exhaustive_passes(request.top_k, request.batch_queries)
        total_tokens = sum(p.num_tokens for p in passes[0].plans) * len(passes) if passes else 0
    shared_bar = context.progress  # the job's, shared by its rank threads
    if shared_bar is not None:
        shared_bar.add_total(total_tokens)
    bar_context = (
        contextlib.nullcontext(shared_bar)
        if shared_bar is not None
        else progress_mod.ScoreProgress(request.show_progress, total_tokens)
    )
    sink_context = sink if hasattr(sink, "__enter__") else contextlib.nullcontext(sink)
    first_stream = passes[0].stream if passes else None
    with bar_context as bar, sink_context:
        engine.progress = bar
        try:
            if arena is not None:
                # The pass starts once the arena is locked, so that no page-locking runs during it (with
                # cudaHostAlloc, locking that overlapped the pass made it wait; see `open_arena`).
                stats.extra["arena_ready_s"] = round(arena.wait(), 4)
                timeline.mark("arena_locked")
            early = arena is not None or context.warmup is not None
            if first_stream is not None and early and settings.early_reads():
                # the first batches are read (into the locked arena, on CUDA) while the kernels' warm-up
                # finishes, not at the pass's start (docs/kernel-notes.md, "The fresh process's pass")
                first_stream.start()
            if context.warmup is not None:
                stats.extra["kernels_wait_s"] = round(context.warmup.wait(), 4)
                timeline.mark("kernels_joined")
            stats.setup_s = time.perf_counter() - started
            tuning.pass_begins()
            if candidates is not None or subset:
                engine.run_rerank(passes, qids, request.top_k, sink)
            else:
                engine.run_exhaustive(passes, qids, request.top_k, sink)
        finally:
            if first_stream is not None:
                first_stream.close()  # its readers stopped on every exit path (the passes close it too)
    if cuda:
        torch.cuda.synchronize(dev)
        stats.peak_gpu_bytes = allocated_bytes(dev)["peak"] - base_allocated
    note_host_memory(stats, meter, host_budget, request.max_host_memory is not None, log)
    stats.wall_s = time.perf_counter() - started
    return stats


def _on_host(corpus: Corpus) -> bool:
    """Whether the corpus is resident in host memory, all of it in one residency (`Corpus.to("cpu")`)."""
    residency = corpus.residency
    return residency is not None and corpus.placement is None and residency.device.type == "cpu"


@dataclass
class _Pass:
    """One query batch: queries [q0, q1) and the document batches of its pass."""

    q0: int
    q1: int
    plans: list[BatchPlan]
    stream: BatchStream | None = None
    num_pairs: int = 0  # rerank: (query, candidate) pairs scored


class _Engine:
    """Runs a plan: streams document batches, scores them against the queries, folds the top-k (or
    gathers the candidates' scores) and hands the results to the sink; halves a batch on CUDA OOM."""

    def __init__(
        self,
        corpus: Corpus,
        q_emb: torch.Tensor,
        q_offsets: torch.Tensor,
        device: torch.device,
        backend: str,
        budget: Budget,
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
        self.scaled = has_scales(corpus.quantization)
        self.doc_dtype = getattr(torch, corpus.dtype)
        self.width = code_width(corpus.quantization, corpus.dim)  # values a token: dim, or its codes' bytes
        self.tb = self.width * self.doc_dtype.itemsize + (4 if self.scaled else 0)
        # residual2 codes: the codebook the kernels decode with, on the device (a few MB at most)
        codebook = getattr(corpus, "codebook", None)
        self.codebook = None if codebook is None else codebook.for_kernels(device)
        # The torch backend checks float documents for NaN/Inf from the similarities it computes anyway
        # (`maxsim_varlen`'s check_finite), so the reader need not: on the 2-core machine the
        # reader's check took 0.16-0.20 s of a core per GB, next to ~0.9 s of scoring per GB on both.
        self.backend_checks = (
            not self.cuda and corpus.quantization == "none" and resolve_backend(backend, device) == "torch"
        )
        self.piece_docs: int | None = None  # set after a CUDA OOM: documents per kernel call
        self.progress = None
        self.stop: threading.Event | None = None  # set by a job whose other rank failed
        sizes = [s.num_docs for s in self.shards]
        self.shard_base = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        lengths = [np.diff(np.asarray(s.offsets, dtype=np.int64)) for s in self.shards]
        self.doc_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
        self.score_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.arena: PinnedArena | None = None
        self.residency: Residency | None = None  # the corpus on this device, when it is resident
        self.host_residency: Residency | None = None  # the corpus in host memory, scored on CUDA
        self.docnos_of: dict[int, list[str]] = {}  # rerank: each query's candidates found, in run order
        self.meter: HostMeter | None = None
        self.max_memory: int | None = None  # --max-memory
        # a filter's mask (`maxsim_cli.scoring.filters`): True for a document that may not be returned
        self.disallowed: np.ndarray | None = None
        self.hidden: torch.Tensor | None = None  # the same mask on the device, for the exhaustive pass
        # the deleted documents' ordinals, sorted (exhaustive pass): each block's are found among them
        # (`_left_out`) instead of by scanning its ranks
        self.deleted_ordinals: np.ndarray = np.zeros(0, dtype=np.int64)

    def fit_host(self) -> None:
        """CPU: the plan's budget is what is left of the host budget once the run holds its inputs (the
        corpus's ids and offsets, the queries, the id order), its worker threads' buffers
        (`worker_host_bytes`) and `UNPLANNED_HOST_BYTES` for what no plan sizes; at most --max-memory. The
        planner's error names the total a run needs when not even one batch fits."""
        if self.cuda or self.meter is None:
            return
        workers = worker_count()
        held = self.meter.used() + UNPLANNED_HOST_BYTES + worker_host_bytes(workers)
        self.stats.extra["cpu_workers"] = workers
        room = max(self.budget.host_bytes - held, 1)
        self.budget.device_bytes = min(room, self.max_memory or room)
        self.budget.host_reserved = held if self.budget.device_bytes == room else 0
        self.stats.extra["host_reserved_bytes"] = held

    # ---------------------------------------------------------------------------- query helpers

    def _query_slice(self, q0: int, q1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Queries q0..q1-1 on the device: (embeddings, host offsets, per-token scales or None), as
        `device_queries` makes them."""
        t0, t1 = int(self.q_offsets[q0]), int(self.q_offsets[q1])
        offsets = self._host_ints((self.q_offsets[q0 : q1 + 1] - t0).numpy())
        emb, scales = device_queries(self.q_emb[t0:t1], self.device, self.scaled)
        return emb, offsets, scales

    def _host_ints(self, values: np.ndarray) -> torch.Tensor:
        """int64 values for a kernel argument, kept on the host.

        The kernels read offsets and candidate lists on the host (checks, launch grid) and copy them to
        the device themselves, without waiting for the stream (`maxsim_kernels.validation.host_to_device`),
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

    def _query_offsets(self) -> np.ndarray:
        return self.q_offsets.numpy()

    def _query_token_bytes(self) -> int:
        return int(self.q_emb.shape[1]) * self.q_emb.element_size()

    def _note_plan(self, plan: Plan) -> None:
        self.stats.planned_device_bytes = plan.planned_bytes
        self.stats.query_batch_size = plan.query_batch_size
        self.stats.max_batch_docs = plan.max_batch_docs
        self.stats.max_batch_tokens = plan.max_batch_tokens

    # ---------------------------------------------------------------------------- exhaustive

    def exhaustive_passes(self, top_k: int, batch_queries: int | None) -> list[_Pass]:
        """Query batches and the document batches of each pass, sized to the budgets (`plan_exhaustive`)."""
        if len(self.q_offsets) > 1 and len(self.doc_lengths):
            # docno ranks (ascending byte order) for the tie-break, and the id order that decodes results
            # (`write_topk`): made before the plan, whose budget is what they leave of the host budget
            # (`fit_host`)
            self.rank_of_ordinal = self.corpus.rank_of_ordinal()
            self.deleted_ordinals = self.corpus.deleted_ordinals()
        self.fit_host()
        allowed = len(self.doc_lengths) if self.disallowed is None else int((~self.disallowed).sum())
        if allowed == 0:  # a filter that allows nothing: an empty run
            return []
        plan = planning.plan_exhaustive(
            self.doc_lengths,
            self.shard_base,
            self._query_offsets(),
            self._query_token_bytes(),
            self.tb,
            min(top_k, allowed),
            batch_queries,
            self.budget,
        )
        if plan is None:
            return []
        self._note_plan(plan)
        self.stats.resident = plan.resident
        spans = list(enumerate(plan.spans))
        if self.disallowed is not None:
            # batches that hold no allowed document are neither read nor scored
            allowed_before = np.concatenate([[0], np.cumsum(~self.disallowed)])
            spans = [(i, (a, b)) for i, (a, b) in spans if allowed_before[b] > allowed_before[a]]
            self.hidden = torch.from_numpy(self.disallowed).to(self.device)
        plans = [
            BatchPlan(
                i,
                plan.parts[i],
                b - a,
                plan.batch_tokens(i),
                side=_RankSlice(self.rank_of_ordinal, a, b),
                side_len=b - a,
            )
            for i, (a, b) in spans
        ]
        stream = self._stream(plans, resident=plan.resident)
        self.stats.documents = sum(p.num_docs for p in plans)
        self.stats.tokens = sum(p.num_tokens for p in plans)
        return [_Pass(q0, q1, plans, stream) for q0, q1 in plan.query_batches]

    def run_exhaustive(self, passes: list[_Pass], qids: list[str], top_k: int, sink: Any) -> None:
        stats = self.stats
        stats.query_batches = len(passes)
        stream = passes[0].stream if passes else None
        try:
            for qpass in passes:
                q_emb, q_off, q_scales = self._query_slice(qpass.q0, qpass.q1)
                topk = RunningTopK(qpass.q1 - qpass.q0, self._kept(top_k))
                assert qpass.stream is not None
                for batch in qpass.stream:
                    self._score_block(batch, 0, batch.plan.num_docs, (q_emb, q_off, q_scales), topk)
                    self._batch_done(batch)
                scores, ranks = topk.result()
                started = time.perf_counter()
                write_topk(sink, qids[qpass.q0 : qpass.q1], scores, ranks, self.corpus)
                stats.write_s += time.perf_counter() - started
                stats.pairs += (qpass.q1 - qpass.q0) * stats.documents
        finally:
            if stream is not None:
                stream.close()
                self._fold_times(stream)

    def _kept(self, top_k: int) -> int:
        """The results a query keeps: ``top_k``, at most the documents a filter allows (so that no
        disallowed document fills a place: `RunningTopK.add`'s ``hidden``)."""
        if self.disallowed is None:
            return top_k
        return max(1, min(top_k, len(self.disallowed) - int(np.count_nonzero(self.disallowed))))

    def _hidden(self, batch: Batch, a: int, b: int) -> torch.Tensor | None:
        """The filter's mask of documents [a, b) of a batch on the device; None when all are allowed."""
        if self.hidden is None or self.disallowed is None:
            return None
        side = batch.plan.side
        assert isinstance(side, _RankSlice)
        lo, hi = side.a + a, side.a + b
        if not self.disallowed[lo:hi].any():  # an unfiltered merge
            return None
        return self.hidden[lo:hi]

    def _left_out(self, batch: Batch, a: int, b: int) -> torch.Tensor:
        """The columns of the deleted documents among [a, b) of a batch (their ranks are -1): a slice of
        the sorted deleted ordinals, so that `order_keys` does not scan the block's ranks for them."""
        side = batch.plan.side
        assert isinstance(side, _RankSlice)
        lo = side.a + a
        i, j = np.searchsorted(self.deleted_ordinals, [lo, side.a + b])
        return torch.from_numpy(self.deleted_ordinals[i:j] - lo)

    def _batch_done(self, batch: Batch) -> None:
        """After each batch: the progress bar, and a stop when another rank of the job has failed."""
        timeline.mark("first_batch_launched")
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
                lambda check: maxsim_varlen(
                    q_emb,
                    q_off,
                    docs,
                    offsets,
                    backend=self.backend,
                    doc_scales=scales,
                    query_scales=q_scales,
                    check_finite=check,
                    **self._codebook_arg(),
                ),
            )
            topk.add(scores, ranks, self._hidden(batch, a, b), self._left_out(batch, a, b))
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
                f"{topk.num_queries} queries; lower {BATCH_QUERIES} or {MAX_MEMORY}, or free GPU memory"
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

    # ---------------------------------------------------------------------------- rerank

    def rerank_passes(
        self,
        run: dict[str, list[tuple[str, float]]] | None,
        qids: list[str],
        qname: str,
        cname: str,
        strict: bool,
    ) -> list[_Pass]:
        """Map the run's candidates to corpus documents and plan the document batches (`plan_rerank`).
        ``run`` None: a filter's few allowed documents are every query's candidates."""
        if run is None:
            assert self.disallowed is not None
            located = subset_candidates(self.corpus, self.disallowed, len(qids))
        else:
            located = locate_candidates(
                self.corpus, run, qids, qname, cname, strict, self.corpus_paths, self.log
            )
            if self.disallowed is not None:
                located = drop_disallowed(located, self.disallowed)
                self.stats.extra["filtered_candidates"] = located.filtered
        pair_q, pair_doc, docnos_of = located.pair_query, located.pair_doc, located.docnos_of
        self.stats.missing_candidates = located.missing
        self.docnos_of = docnos_of
        self.stats.pairs = len(pair_q)
        self.stats.queries_with_candidates = len(set(pair_q))
        self.fit_host()
        plan = planning.plan_rerank(
            pair_q,
            pair_doc,
            self.doc_lengths,
            self.shard_base,
            self._query_offsets(),
            self._query_token_bytes(),
            self.tb,
            self.budget,
        )
        if plan is None:
            return []
        assert plan.sides is not None and plan.pair_query is not None
        self.stats.documents = plan.num_docs
        self.stats.tokens = plan.num_tokens
        self._note_plan(plan)
        plans = [
            BatchPlan(i, plan.parts[i], b - a, plan.batch_tokens(i), side=side, side_len=len(side))
            for i, ((a, b), side) in enumerate(zip(plan.spans, plan.sides, strict=True))
        ]
        stream = self._stream(plans)
        self.pair_q = plan.pair_query
        return [_Pass(0, plan.num_queries, plans, stream, num_pairs=plan.num_pairs)]

    @staticmethod
    def rerank_total_tokens(passes: list[_Pass]) -> int:
        return sum(p.num_tokens for one in passes for p in one.plans)

    def run_rerank(self, passes: list[_Pass], qids: list[str], top_k: int, sink: Any) -> None:
        from maxsim_kernels import maxsim_candidates

        stats = self.stats
        stats.query_batches = 1 if passes else 0
        pair_scores = None
        for qpass in passes:
            nq = qpass.q1 - qpass.q0
            q_emb, q_off, q_scales = self._query_slice(qpass.q0, qpass.q1)
            pair_scores = torch.zeros(qpass.num_pairs, dtype=torch.float32, device=self.device)
            assert qpass.stream is not None
            try:
                for batch in qpass.stream:
                    assert batch.side is not None
                    host_side = batch.plan.side_array()
                    assert host_side is not None
                    n_pairs = (host_side.shape[0] - (nq + 1)) // 2
                    # candidate lists on the host (see `_host_ints`), output positions on the device
                    cand_offsets = self._batch_ints(host_side[: nq + 1], batch.side[: nq + 1])
                    if batch.ordinals is not None:  # in place: documents of the whole resident corpus
                        assert self.residency is not None
                        cand_docs = self._host_ints(batch.ordinals[host_side[nq + 1 : nq + 1 + n_pairs]])
                        doc_offsets = self.residency.offsets_host
                    else:
                        cand_docs = self._batch_ints(
                            host_side[nq + 1 : nq + 1 + n_pairs], batch.side[nq + 1 : nq + 1 + n_pairs]
                        )
                        doc_offsets = self._batch_ints(batch.host_offsets, batch.offsets)
                    positions = batch.side[nq + 1 + n_pairs :]
                    timer = self._timer()
                    try:
                        args = (q_emb, q_off, batch.embeddings, doc_offsets, cand_offsets, cand_docs)
                        s = self._checked(
                            batch,
                            lambda check, args=args, scales=batch.scales, q_scales=q_scales: (
                                maxsim_candidates(
                                    *args,
                                    backend=self.backend,
                                    doc_scales=scales,
                                    query_scales=q_scales,
                                    check_finite=check,
                                    **self._codebook_arg(),
                                )
                            ),
                        )
                        pair_scores.index_copy_(0, positions, s.to(torch.float32))
                    finally:
                        self._timer_end(timer)
                    self._batch_done(batch)
            finally:
                qpass.stream.close()
                self._fold_times(qpass.stream)
        scores_np = pair_scores.cpu().numpy() if pair_scores is not None else np.zeros(0, dtype=np.float32)
        started = time.perf_counter()
        write_reranked(sink, qids, self.docnos_of, self.pair_q if passes else None, scores_np, top_k)
        stats.write_s += time.perf_counter() - started

    # ---------------------------------------------------------------------------- timing

    def _stream(self, plans: list[BatchPlan], *, resident: bool = False) -> BatchStream:
        """The background reader over `plans`, interleaved across shards."""
        return BatchStream(
            self.shards,
            _interleave(plans),
            dim=self.width,
            dtype=self.doc_dtype,
            scaled=self.scaled,
            device=self.device,
            reader_threads=self.budget.reader_threads,
            resident=resident,
            arena=self.arena,
            check_values=not self.backend_checks,
            residency=self.residency,
            host_residency=self.host_residency,
        )

    def _codebook_arg(self) -> dict[str, object]:
        """The kernels' ``codebook=`` for a residual2 corpus, nothing for any other."""
        return {} if self.codebook is None else {"codebook": self.codebook}

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
    results do not depend on the order (see `maxsim_cli.scoring.topk`)."""
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
