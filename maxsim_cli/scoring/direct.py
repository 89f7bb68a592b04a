"""Small requests against a resident corpus, scored in one launch without the engine's planning.

A corpus made resident on one device (`Corpus.to`) holds every document in one buffer with its offsets
beside it (`maxsim_cli.shards.resident.Residency`). A search is then one `maxsim_kernels.maxsim_varlen`
launch over that buffer and one `maxsim_cli.scoring.topk.RunningTopK` merge; a rerank is one launch on the
candidates' corpus ordinals (`candidate_scores`: on CUDA the residency's reused launcher, as `maxsim
serve` scores a request), found in the corpus's id lookup (`Corpus.id_lookup`, built once per corpus,
so that a call costs what its candidates cost, not what the corpus's ids cost). The engine
(`maxsim_cli.scoring.engine`) issues exactly these launches for a resident corpus too, but around them
it pays, at every call, for what a streamed run needs: a plan under memory budgets, a batch stream with
its threads, device and host memory meters. For a served request that is most of the call: the
in-process rerank of one query against 1,000 candidates took 4.5 ms on the H200 host for a kernel of
about 0.1 ms (benchmarks/results/serve/archive/serve-h200-7cf1e9f.json).

This path runs the same kernels on the same inputs (the queries converted as the engine converts them,
int8 queries quantized once per call as the engine does), keys and sorts results the same way
(`order_keys`, `sort_trec`), and hands them to the same sink, so a run is the engine's bit for bit
(tests/test_direct.py compares the two on every layout). It is taken when:

- the corpus is resident on the device the call scores on (one device; a corpus spread over several
  goes through `maxsim_cli.parallel`), and there are queries to score;
- the call gives no memory budget, query batch size or progress bar (those are the engine's to plan);
- the work is small: the search's ``[queries, documents]`` score block, or the rerank's pairs, within
  `MAX_BLOCK_BYTES` (the engine's per-pair accounting, `maxsim_cli.scoring.topk.PAIR_BYTES`).

A rerank on CUDA of a corpus resident in host memory (`Corpus.to("cpu")`: a two-stage search's exact
tier) is taken too: its candidates' rows alone are gathered into a reused page-locked buffer, copied to
the GPU and scored there in one launch (`maxsim_cli.scoring.host_rows`), where the engine would read
them from the shard files; more than `host_rows.MAX_STAGED_BYTES` of rows go to the engine.

A CUDA out-of-memory error hands the call to the engine, which splits the work.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from maxsim_cli.arrays import values_array
from maxsim_cli.scoring.request import ScoreRequest
from maxsim_cli.scoring.resources import candidate_scores_on, device_queries, query_embeddings
from maxsim_cli.scoring.results import (
    drop_disallowed,
    locate_candidates,
    subset_candidates,
    write_reranked,
    write_topk,
)
from maxsim_cli.scoring.stats import ScoreStats
from maxsim_cli.scoring.topk import PAIR_BYTES, RunningTopK

if TYPE_CHECKING:
    from collections.abc import Callable

    from maxsim_cli.shards import Corpus, DocBatch
    from maxsim_cli.shards.resident import Residency

# The largest score block (pairs x `PAIR_BYTES`) scored here; larger calls go to the engine, which plans
# query batches under the memory budget. On the GPU, 1 GiB is 256 queries against 130K documents, under
# 1% of an H200; on the CPU the block is host memory, so the default budget's planning takes over sooner.
MAX_BLOCK_BYTES = {"cuda": 1 << 30, "cpu": 256 << 20}


def eligible(request: ScoreRequest, corpus: Corpus, num_queries: int, pairs: int) -> Residency | None:
    """The residency to score ``request`` from directly, or None when the engine should run it (module
    docstring). ``pairs``: the (query, document) pairs the call scores."""
    residency = corpus.residency
    if residency is None or corpus.placement is not None or num_queries == 0 or len(corpus) == 0:
        return None
    if request.max_memory is not None or request.max_host_memory is not None:
        return None
    if request.batch_queries is not None or request.show_progress:
        return None
    device = request.check()
    if residency.device != device and not host_staged(request, corpus, residency, device):
        return None
    if not fits(device, pairs):
        return None
    return residency


def host_staged(request: ScoreRequest, corpus: Corpus, residency: Residency, device: torch.device) -> bool:
    """Whether the call is a rerank on CUDA of a corpus resident on the host, scored by staging its
    candidates' rows on the GPU (`host_rows`)."""
    from maxsim_cli.scoring import host_rows

    return device.type == "cuda" and request.candidates is not None and host_rows.supported(corpus, residency)


def scoring_device(request: ScoreRequest, residency: Residency) -> torch.device:
    """The device an eligible call scores on: the residency's, or the GPU a corpus resident on the host
    stages its candidates on (`host_staged`)."""
    if residency.device.type == "cpu":
        from maxsim_cli.devices import resolve_device

        return resolve_device(request.device)
    return residency.device


def fits(device: torch.device, pairs: int) -> bool:
    """Whether a call of ``pairs`` (query, document) pairs is small enough for one launch on ``device``
    (`MAX_BLOCK_BYTES`)."""
    return pairs * PAIR_BYTES <= MAX_BLOCK_BYTES.get(device.type, 0)


def run(
    request: ScoreRequest,
    corpus: Corpus,
    residency: Residency,
    queries: DocBatch,
    sink: Any,
    *,
    candidates: dict[str, list[tuple[str, float]]] | None,
    log: Callable[[str], None],
    disallowed: np.ndarray | None = None,
    device: torch.device | None = None,
) -> ScoreStats | None:
    """Score ``queries`` against the resident corpus into ``sink`` (rows as the engine hands them over);
    the stats, or None when the device ran out of memory (nothing was written: run the engine).
    ``disallowed``: a filter's mask, as `maxsim_cli.scoring.engine.run` takes it. ``device``: the device
    scored on (`scoring_device`; default the residency's)."""
    from maxsim_cli.scoring import filters

    started = time.perf_counter()
    dev = residency.device if device is None else device
    stats = ScoreStats(
        mode="rerank" if candidates is not None else "exhaustive",
        device=str(dev),
        backend=request.backend,
        output=request.output,
        queries=len(queries.ids),
        query_batches=1,
        doc_batches=1,
        resident=True,
    )
    stats.extra["resident_corpus"] = True
    stats.extra["direct"] = True
    notes: list[str] = []  # given to ``log`` once the call has succeeded: the engine would repeat them
    subset = candidates is None and disallowed is not None and filters.use_subset(disallowed)
    if disallowed is not None:
        stats.extra["filter"] = {
            "allowed": filters.allowed_count(disallowed, len(corpus)),
            "path": "subset" if subset else ("candidates" if candidates is not None else "scan"),
        }
    if dev != residency.device and candidates is None:  # only a rerank stages rows (`eligible`)
        return None
    try:
        if candidates is None and not subset:
            kernel_args, kernel_kwargs = _kernel_inputs(corpus, residency, queries, request.backend)
            _search(request, corpus, residency, queries, sink, stats, kernel_args, kernel_kwargs, disallowed)
        elif not _rerank(
            request, corpus, residency, queries, sink, stats, candidates, notes.append, disallowed, dev
        ):
            return None
    except torch.OutOfMemoryError:
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        return None
    for note in notes:
        log(note)
    stats.wall_s = stats.score_s = time.perf_counter() - started
    return stats


def candidate_scores(
    corpus: Corpus,
    residency: Residency,
    queries: DocBatch,
    candidate_offsets: np.ndarray,
    candidate_docs: np.ndarray,
    *,
    backend: str = "auto",
) -> np.ndarray | None:
    """float32 scores of query ``i`` against the corpus ordinals
    ``candidate_docs[candidate_offsets[i]:candidate_offsets[i + 1]]`` (int64 numpy arrays), in one
    `maxsim_kernels.maxsim_candidates` launch on the resident corpus; None when the device ran out of
    memory. For a caller that finds its candidates itself (`maxsim_cli.service.batching`: a served
    rerank sorts its answers itself), and for the library's (`run`; a corpus resident on the host and
    scored on a GPU: `host_rows.candidate_scores`)."""
    try:
        if _staged(corpus, residency, backend):
            if residency.device.type == "cuda":
                torch.cuda.set_device(residency.device)  # as `_kernel_inputs`: Triton launches on it
            scores = _staged_launcher(residency)(
                query_embeddings(queries, corpus.dtype, corpus.quantization),
                queries.offsets.numpy(),
                candidate_offsets,
                candidate_docs,
            )
            if scores is not None:
                return scores
        kernel_args, kernel_kwargs = _kernel_inputs(corpus, residency, queries, backend)
        candidates = torch.from_numpy(candidate_offsets), torch.from_numpy(candidate_docs)
        return candidate_scores_on(*kernel_args, *candidates, **kernel_kwargs)
    except torch.OutOfMemoryError:
        if residency.device.type == "cuda":
            torch.cuda.empty_cache()
        return None


def _staged(corpus: Corpus, residency: Residency, backend: str) -> bool:
    """Whether a rerank goes through the residency's reused launcher (`ResidentCandidates`): a float
    corpus on CUDA, scored by the Triton kernel."""
    return (
        residency.device.type == "cuda"
        and backend in ("auto", "triton")
        and corpus.quantization == "none"
        and corpus.dtype in ("float16", "bfloat16", "float32")
    )


def _staged_launcher(residency: Residency) -> Any:
    if residency.candidates is None:
        from maxsim_kernels.maxsim_forward import ResidentCandidates

        residency.candidates = ResidentCandidates(residency.embeddings, residency.offsets)
    return residency.candidates


def _kernel_inputs(
    corpus: Corpus, residency: Residency, queries: DocBatch, backend: str
) -> tuple[tuple, dict]:
    """The kernels' positional and keyword arguments for ``queries`` against the residency: the queries
    converted and put on the device as the engine does it (`device_queries`)."""
    dev = residency.device
    if dev.type == "cuda":
        # Triton launches on the calling thread's current device, whatever the tensors' (the engine does
        # the same): a corpus resident on cuda:1, scored from a thread whose device is cuda:0
        torch.cuda.set_device(dev)
    q_emb = query_embeddings(queries, corpus.dtype, corpus.quantization)
    q_emb, query_scales = device_queries(q_emb, dev, corpus.quantization != "none")
    kernel_args = (q_emb, queries.offsets.to(torch.int64), residency.embeddings, residency.offsets_host)
    kernel_kwargs = {"backend": backend, "doc_scales": residency.scales, "query_scales": query_scales}
    if getattr(corpus, "codebook", None) is not None:  # residual2 codes decode with their codebook
        if residency.codebook is None:
            residency.codebook = corpus.codebook.for_kernels(dev)
        kernel_kwargs["codebook"] = residency.codebook
    return kernel_args, kernel_kwargs


def _search(
    request: ScoreRequest,
    corpus: Corpus,
    residency: Residency,
    queries: DocBatch,
    sink: Any,
    stats: ScoreStats,
    kernel_args: tuple,
    kernel_kwargs: dict,
    disallowed: np.ndarray | None = None,
) -> None:
    from maxsim_kernels import maxsim_varlen

    ranks = _device_ranks(corpus, residency)
    top_k, hidden = request.top_k, None
    if disallowed is not None:
        allowed = np.flatnonzero(~disallowed)
        if len(allowed) == 0:  # a filter that allows nothing: an empty run
            stats.documents = stats.tokens = stats.pairs = 0
            return
        top_k = min(top_k, len(allowed))  # no disallowed document fills a place (`RunningTopK.add`)
        # the documents from the first allowed to the last are scored: a filter of a few shards scores
        # those shards' rows only
        lo, hi = int(allowed[0]), int(allowed[-1]) + 1
        if disallowed[lo:hi].any():
            hidden = torch.from_numpy(disallowed[lo:hi]).to(residency.device)
        if hi - lo < len(disallowed):
            kernel_args, kernel_kwargs = _doc_span(kernel_args, kernel_kwargs, lo, hi)
            ranks = ranks[lo:hi]
    scores = maxsim_varlen(*kernel_args, **kernel_kwargs)
    topk = RunningTopK(len(queries.ids), top_k)
    topk.add(scores, ranks, hidden)
    del scores
    top_scores, top_ranks = topk.result()
    stats.documents = len(corpus)
    stats.tokens = corpus.num_tokens
    stats.pairs = len(queries.ids) * len(corpus)
    write_topk(sink, queries.ids, top_scores, top_ranks, corpus)


def _doc_span(kernel_args: tuple, kernel_kwargs: dict, lo: int, hi: int) -> tuple[tuple, dict]:
    """`_kernel_inputs`'s arguments for documents [lo, hi) of the residency alone."""
    q_emb, q_offsets, embeddings, offsets_host = kernel_args
    t0, t1 = int(offsets_host[lo]), int(offsets_host[hi])
    scales = kernel_kwargs.get("doc_scales")
    kwargs = {**kernel_kwargs, "doc_scales": None if scales is None else scales[t0:t1]}
    return (q_emb, q_offsets, embeddings[t0:t1], offsets_host[lo : hi + 1] - t0), kwargs


def _rerank(
    request: ScoreRequest,
    corpus: Corpus,
    residency: Residency,
    queries: DocBatch,
    sink: Any,
    stats: ScoreStats,
    candidates: dict[str, list[tuple[str, float]]] | None,
    log: Callable[[str], None],
    disallowed: np.ndarray | None = None,
    device: torch.device | None = None,
) -> bool:
    """The candidates looked up (`locate_candidates`: the corpus's id lookup, built once) and scored in
    one `candidate_scores` launch, the launch a served rerank makes (on ``device``, away from a
    residency on the host: `host_rows.candidate_scores`); False when the device ran out of memory, or
    the rows to stage were too many (nothing written)."""
    qids = list(queries.ids)
    if candidates is None:  # a filter's few allowed documents, every query's candidates
        assert disallowed is not None
        located = subset_candidates(corpus, disallowed, len(qids))
    else:
        located = locate_candidates(
            corpus,
            candidates,
            qids,
            request.query_name,
            request.candidates_name,
            request.strict,
            request.corpus,
            log,
        )
        if disallowed is not None:
            located = drop_disallowed(located, disallowed)
            stats.extra["filtered_candidates"] = located.filtered
    stats.missing_candidates = located.missing
    stats.pairs = len(located.pair_query)
    if not stats.pairs:
        return True
    # the kernel takes each query's candidates as one run of the list: pairs grouped by query, each
    # query's in run order (the order `write_reranked` reads the scores in)
    pair_query, pair_doc, pair_docnos = located.pair_query, located.pair_doc, located.pair_docnos
    if not bool((pair_query[1:] >= pair_query[:-1]).all()):  # queries in another order than the run's
        order = np.argsort(pair_query, kind="stable")
        pair_query, pair_doc = pair_query[order], pair_doc[order]
        pair_docnos = None if pair_docnos is None else pair_docnos.take(values_array(order))
    counts = np.bincount(pair_query, minlength=len(qids))
    stats.queries_with_candidates = int(np.count_nonzero(counts))
    cand_offsets = np.zeros(len(qids) + 1, dtype=np.int64)
    np.cumsum(counts, out=cand_offsets[1:])
    if device is not None and device != residency.device:
        from maxsim_cli.scoring import host_rows

        staged = host_rows.candidate_scores(
            corpus, residency, queries, cand_offsets, pair_doc, device, backend=request.backend
        )
        if staged is None:
            return False
        scores_np, stats.bytes_read = staged
        stats.extra["host_rows"] = True
    else:
        scores_np = candidate_scores(
            corpus, residency, queries, cand_offsets, pair_doc, backend=request.backend
        )
    if scores_np is None:
        return False
    # a query lists a document once (`read_run`, the API's candidates, a run's rows): one query's
    # documents are distinct as they are
    distinct = pair_doc if stats.queries_with_candidates == 1 else np.unique(pair_doc)
    stats.documents = len(distinct)
    stats.tokens = int((residency.host_offsets[distinct + 1] - residency.host_offsets[distinct]).sum())
    write_reranked(
        sink,
        qids,
        located.docnos_of,
        pair_query,
        scores_np,
        request.top_k,
        pair_docnos=pair_docnos,
    )
    return True


def _device_ranks(corpus: Corpus, residency: Residency) -> torch.Tensor:
    """Each document's docno rank (`Corpus.rank_of_ordinal`, the tie-break of `order_keys`) on the
    residency's device: made at the first search, kept with the residency."""
    if residency.doc_ranks is None:
        residency.doc_ranks = torch.from_numpy(corpus.rank_of_ordinal()).to(residency.device)
    return residency.doc_ranks
