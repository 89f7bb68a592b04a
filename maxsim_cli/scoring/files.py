"""A scoring run whose inputs are files and whose output is a run file: what `maxsim score` does on one
device (`maxsim_cli.scoring.entry.score` without ``--devices``, and a job with a single device)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from maxsim_cli import timeline
from maxsim_cli.codecs import code_width, has_scales
from maxsim_cli.errors import log_to_stderr
from maxsim_cli.memory import HostMeter
from maxsim_cli.queries import read_queries
from maxsim_cli.run_files import RunWriter, read_run
from maxsim_cli.scoring import engine, resources
from maxsim_cli.scoring.engine import Logger, RankContext
from maxsim_cli.scoring.request import ScoreRequest
from maxsim_cli.scoring.stats import ScoreStats
from maxsim_cli.scoring.topk import RunningTopK
from maxsim_cli.scoring.warmup import KernelWarmup
from maxsim_cli.shards import Corpus, DocBatch, check_same_dim, input_notes, open_corpus, report_notes
from maxsim_cli.shards.files import check_output
from maxsim_cli.shards.format import read_id_file


def score_files(request: ScoreRequest, *, log: Logger = log_to_stderr) -> ScoreStats:
    """Open the request's corpus, read its queries (and candidates), score them with `engine.run` and
    write the run to ``request.output``; the corpus is closed on every exit path. ``setup_s`` and
    ``wall_s`` count from this call."""
    started = time.perf_counter()
    device = request.check()
    # the run may not overwrite an input and must be writable: refused now, not after the scoring
    check_output(request.output, [request.queries, *request.corpus, request.candidates])
    writer = RunWriter(request.output, tag=request.run_tag, fmt=request.fmt)  # opens only in the pass
    # what --max-host-memory bounds: the growth from here on, the inputs' ids and offsets included
    meter = HostMeter(device if device.type == "cuda" else None)
    timeline.mark("checked")
    # on CUDA the first Triton launch's once-a-process work starts now, beside the set-up (`warmup`)
    warmup = KernelWarmup.start(device, request.backend)
    try:
        # on CUDA the staging memory locks while the corpus opens (`resources.open_arena`)
        arena = resources.open_arena(request, device) if device.type == "cuda" else None
        corpus = open_corpus(list(request.corpus))
    except BaseException:
        meter.close()
        if warmup is not None:
            warmup.close()
        raise
    timeline.mark("corpus_open")
    try:
        queries = read_queries(request.queries).batch  # a query shard, a folder of them, or stdin
        check_same_dim(queries, request.query_name, corpus)  # before the run is read, as always
        # empty shards skipped, no queries, another encoder: warnings (--strict: errors), before any work
        report_notes(input_notes(corpus, queries, request.query_name), strict=request.strict, log=log)
        timeline.mark("queries_read")
        if warmup is not None and queries.num_docs and corpus.num_docs:
            warmup.load(first_launches(request, corpus, queries, device))
        candidates = read_run(request.candidates) if request.candidates is not None else None
        disallowed = request_filter(request, corpus, log)
        entered = time.perf_counter()
        stats = engine.run(
            request,
            corpus,
            queries,
            writer,
            candidates=candidates,
            context=RankContext(arena=arena, host_meter=meter, warmup=warmup),
            log=log,
            disallowed=disallowed,
        )
    finally:
        if warmup is not None:
            warmup.close()  # joined on every exit path
        corpus.close()
        meter.close()
    timeline.mark("run_written")
    if warmup is not None:
        stats.extra["warmup"] = warmup.stats()
    stats.setup_s += entered - started
    stats.wall_s = time.perf_counter() - started
    return stats


def request_filter(request: ScoreRequest, corpus: Corpus, log: Logger) -> np.ndarray | None:
    """The mask of ``request``'s filter files over ``corpus`` (`maxsim_cli.scoring.filters`), None
    without one."""
    from maxsim_cli.scoring import filters

    if not request.filtered:
        return None
    include = exclude = None
    if request.include_ids is not None:
        include = read_id_file(request.include_ids, str(filters.INCLUDE))
    if request.exclude_ids is not None:
        exclude = read_id_file(request.exclude_ids, str(filters.EXCLUDE))
    return filters.disallowed_mask(
        corpus, include, exclude, strict=request.strict, log=log, where=request.where
    )


def first_launches(
    request: ScoreRequest, corpus: Corpus, queries: DocBatch, device: torch.device
) -> Callable[[], None]:
    """The run's first kernel launches, for `KernelWarmup`: its first query batch against one document
    of 16 zero tokens, and the top-k merge's key kernel. The kernels' compile-time choices depend on the
    queries (how many, the longest), the documents' dtype and dim, never on the documents, so these load
    the kernels that the pass launches (a memory plan that cuts the queries into smaller batches than
    ``--batch-queries`` may still pick another). Made in the warm-up's thread: the calls that
    `engine._Engine` makes for the pass's first batch."""
    from maxsim_kernels import maxsim_candidates, maxsim_varlen

    num = queries.num_docs
    first = min(num, request.batch_queries or num)

    def launch() -> None:
        q_emb = resources.query_embeddings(queries, corpus.dtype, corpus.quantization)
        q_off = queries.offsets[: first + 1].to(torch.int64)
        q = q_emb[: int(q_off[-1])].to(device)
        q_scales = None
        scaled = has_scales(corpus.quantization)
        if scaled and device.type == "cuda":
            from maxsim_kernels.int8_host import quantize_per_token

            q, q_scales = quantize_per_token(q)
        width = code_width(corpus.quantization, corpus.dim)
        docs = torch.zeros((16, width), dtype=getattr(torch, corpus.dtype), device=device)
        d_off = torch.tensor([0, 16], dtype=torch.int64)
        d_scales = torch.ones(16, dtype=torch.float32, device=device) if scaled else None
        kernel_args = dict(backend=request.backend, doc_scales=d_scales, query_scales=q_scales)
        if getattr(corpus, "codebook", None) is not None:
            kernel_args["codebook"] = corpus.codebook.for_kernels(device)
        if request.candidates is not None:
            one_each = torch.arange(first + 1, dtype=torch.int64), torch.zeros(first, dtype=torch.int64)
            maxsim_candidates(q, q_off, docs, d_off, *one_each, **kernel_args)
            return
        maxsim_varlen(q, q_off, docs, d_off, **kernel_args)
        # the merge's order-key kernel is specialised on its sizes being multiples of 16: both kinds,
        # and a block wider than the top-k (the partial sort)
        k = min(request.top_k, 1024)
        for width in (16, k + 1):
            ranks = torch.from_numpy(np.arange(width, dtype=np.int64)).to(device)
            RunningTopK(first, k).add(torch.zeros((first, width), device=device), ranks)

    return launch
