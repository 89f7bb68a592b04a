"""Batching: concurrent requests gathered for a short window into one `search` or `rerank` call.

`Batcher` (on the server's event loop) queues checked requests (`Job`s). Once the first request of a
batch has waited ``window_s`` (or the queued queries reach ``max_queries``), it takes every queued
request of that kind, hands them to `Scorer.score` on its one worker thread, and answers each request
from the result; requests that arrive meanwhile make the next batch, so batches grow with the load.
One worker thread means one engine pass (one kernel launch per document batch) at a time.

The window is waited only while the server is busy: when the last batch held several requests or
others were queued behind it. A request that reaches an idle server is scored at once, so one client
alone pays no window; under concurrent load every batch gathers for up to the window. When that request
is small and the corpus is on GPUs (`Scorer.quick`: a few launches, a few milliseconds), it is scored
on the event loop itself, sparing it the two hand-overs between threads; a caller on the loop that
holds such a request already (the scoring process reading a worker's frame) scores it there and then
(`Batcher.score_now`), sparing also the queue and the hand-overs between tasks.

A request's answer does not depend on what it was batched with:

- Queries are concatenated under internal ids (request index, query index), so two requests may use
  the same qids; each answer is put back under the request's own qids, in its order. A request scored
  alone keeps its own qids, so the library's messages (a score that overflows float32, ...) name them.
- A search batch runs with the largest ``k`` of its requests and cuts each request's hits to its own
  ``k``: top-k in trec_eval's order (score descending, ties by docno descending) is prefix-closed, so
  the cut is exactly the request's own top-k. Scores do not depend on the batch (the kernels are
  batch-invariant: the library gives the same run for any query batch and memory budget).
- A rerank batch concatenates the candidate maps under the internal ids and keeps every candidate;
  each request is cut to its ``k``, its missing docnos are those of its candidates the run does not
  hold, and a ``strict`` request with missing docnos fails alone.
- A batch that fails (out of memory even after the engine's own halving, or anything else) is split in
  two and each half is scored again, down to single requests: only a request that fails alone fails,
  with the error of its scoring alone (which names its own qids).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from maxsim_cli.errors import InputError
from maxsim_cli.service.schema import CANDIDATES, Hits, Parsed, QueryAnswer, RequestError

if TYPE_CHECKING:
    import torch

    from maxsim_cli.api import Corpus, Queries
    from maxsim_cli.shards.resident import Residency

logger = logging.getLogger("maxsim.serve")

# A request scored on the event loop when the server is idle (`Scorer.quick`): at most this many queries
# and rerank candidates, a few milliseconds of GPU work.
QUICK_MAX_QUERIES = 4
QUICK_MAX_CANDIDATES = 10_000
# `Batcher.score_now` leaves a request to the queue when it comes this soon after the last scoring ended:
# it was waiting behind that scoring (its bytes read as soon as the event loop was free again, tens of
# microseconds after), which is a loaded server, where batches must form. A lone client's next request
# comes at least ~1.2 ms after its answer left on the H200 host (the answer to the worker, the HTTP
# answer, the client's next request, its parsing and frame: `python benchmarks/probe_hop_trace.py`).
# Without it, 64 clients' single-query searches through 4 workers were scored one at a time: 324-342
# queries/s instead of 1,100+ (benchmarks/results/serve/takeover/search-w4-direct*.json).
QUICK_GAP_S = 0.0005


@dataclass
class Timing:
    """Where one request's time went, for its ``Server-Timing`` header: queued (from its arrival to its
    batch's start), the batch's scoring, and the batch's size in requests."""

    queue_s: float = 0.0
    score_s: float = 0.0
    batch_requests: int = 0


@dataclass(eq=False)
class Job:
    """One request in the queue: ``kind`` is "search" or "rerank"."""

    kind: str
    request: Parsed
    future: asyncio.Future | None = None
    arrived: float = 0.0  # time.perf_counter() (uvloop's loop.time() counts whole milliseconds)
    timing: Timing | None = None

    @property
    def num_queries(self) -> int:
        return len(self.request.queries)


@dataclass
class Counters:
    """What the batcher has done: batches run, requests answered, the largest batch (requests)."""

    batches: int = 0
    requests: int = 0
    largest: int = 0
    splits: int = 0
    sizes: list[int] = field(default_factory=list)  # the last batches' sizes (requests), for tests

    def note(self, size: int) -> None:
        self.batches += 1
        self.requests += size
        self.largest = max(self.largest, size)
        self.sizes = [*self.sizes[-999:], size]


class Scorer:
    """Scores a batch of jobs of one kind against the corpus (called on the batcher's worker thread).

    ``exact``: the exact tier of a compressed ``corpus`` (`maxsim serve COMPRESSED --exact-from CORPUS`,
    checked to hold the same documents): a search is the dispatch's two-stage plan (the library's
    `search` with ``exact_from``: the compressed tier's top ``depth``, then those candidates scored
    exactly), and a rerank scores its candidates from the exact tier."""

    def __init__(
        self,
        corpus: Corpus,
        *,
        device: str = "auto",
        counters: Counters | None = None,
        exact: Corpus | None = None,
    ) -> None:
        self.corpus = corpus
        self.device = device
        self.counters = counters or Counters()
        self.exact = exact
        # batches being scored by this scorer now, and what to call once a scorer replaced by a reload
        # (`maxsim_cli.service.reload`) has scored its last one: both touched on the event loop only
        self._active = 0
        self._on_retired: Callable[[], None] | None = None

    @contextlib.contextmanager
    def in_use(self) -> Iterator[Scorer]:
        """Marks a batch scored by this scorer, from its start to its end (on the event loop)."""
        self._active += 1
        try:
            yield self
        finally:
            self._active -= 1
            if self._active == 0 and self._on_retired is not None:
                retired, self._on_retired = self._on_retired, None
                retired()

    def retire(self, release: Callable[[], None]) -> None:
        """This scorer has been replaced: ``release`` its generation now, or once its last batch ends."""
        if self._active == 0:
            release()
        else:
            self._on_retired = release

    @property
    def scores(self) -> str | None:
        """What the answers' scores are, for a server of a compressed tier: `scores_label`."""
        return scores_label(self.corpus, self.exact)

    def quick(self, jobs: Sequence[Job]) -> bool:
        """Whether ``jobs`` is one small request against a corpus resident on GPUs: its scoring is a few
        launches that the GPU runs in a few milliseconds, short enough to run on the event loop."""
        if len(jobs) != 1 or jobs[0].num_queries > QUICK_MAX_QUERIES:
            return False
        request = jobs[0].request
        if request.candidates is not None and (
            sum(len(docnos) for docnos in request.candidates.values()) > QUICK_MAX_CANDIDATES
        ):
            return False
        if self.exact is not None:  # the exact tier is read from its shards: not a few launches
            return False
        if request.where is not None:  # reads the shards' metadata columns: not on the event loop
            return False
        return self.on_gpus

    @property
    def on_gpus(self) -> bool:
        """Whether this scorer scores a corpus resident on GPUs (on one device: the one it scores on)."""
        from maxsim_cli.scoring.dispatch import one_residency

        if self.corpus.placement is None and one_residency(self.corpus, self.device) is None:
            return False
        return resident_on_gpus(self.corpus)

    def score(self, jobs: Sequence[Job]) -> list[list[QueryAnswer] | BaseException]:
        """Each job's answers, or the exception that job alone fails with."""
        if jobs[0].kind == "search" and self.exact is None and any(j.request.depth is not None for j in jobs):
            # a depth needs an exact tier: those requests fail alone, the others are scored
            rest = [job for job in jobs if job.request.depth is None]
            scored = iter(self.score(rest) if rest else ())
            return [NO_EXACT_TIER if job.request.depth is not None else next(scored) for job in jobs]
        try:
            if jobs[0].kind == "search":
                results: list[list[QueryAnswer] | BaseException] = list(self._search(jobs))
            else:
                results = self._rerank(jobs)
            return self._explained(jobs, results)
        except Exception as exc:  # noqa: BLE001 - split the batch, and let a request that fails alone fail
            if len(jobs) == 1:
                return [exc]
            self.counters.splits += 1
            logger.info("a batch of %d requests failed (%s); scoring its halves apart", len(jobs), exc)
            _free_device_memory()
            mid = len(jobs) // 2
            return self.score(jobs[:mid]) + self.score(jobs[mid:])

    def _explained(
        self, jobs: Sequence[Job], results: list[list[QueryAnswer] | BaseException]
    ) -> list[list[QueryAnswer] | BaseException]:
        """``results`` with every hit's explanation for the jobs that asked (``"explain": true``):
        `maxsim_cli.explain.explain_hits` on the scoring device, one query's hits at a time, compared
        with the scores of the answer."""
        from maxsim_cli.explain import explain_hits

        corpus = self.scores_corpus
        for job, answers in zip(jobs, results, strict=True):
            if not job.request.explain or isinstance(answers, BaseException):
                continue
            for qid, hits, _ in answers:
                explanations = explain_hits(
                    job.request.queries,
                    corpus,
                    qid,
                    list(hits.docnos),
                    device=self.device,
                    scores=hits.scores.tolist(),
                    vectors=False,
                )
                hits.explanations = [e.to_dict() for e in explanations]
        return results

    def _search(self, jobs: Sequence[Job]) -> list[list[QueryAnswer]]:
        """The batch's answers: one search a group of requests that share a filter (``include`` /
        ``exclude`` / ``where``) and, on a server with an exact tier, a depth (given, or the default of
        maxsim score --exact-from for their own k), so that an answer does not depend on its batch."""
        documents = len(self.corpus)
        groups: dict[Any, list[int]] = {}
        for j, job in enumerate(jobs):
            depth = None
            if self.exact is not None:
                from maxsim_cli.scoring.request import default_depth

                k = min(job.request.k or documents, documents)
                depth = job.request.depth or default_depth(self.corpus.quantization, k)
            groups.setdefault((job.request.filter_key, depth), []).append(j)
        out: list[list[QueryAnswer]] = [[] for _ in jobs]
        for (_, depth), members in groups.items():
            two_stage = {} if self.exact is None else {"exact_from": self.exact, "depth": depth}
            answers = self._search_group([jobs[j] for j in members], **two_stage)
            for j, answer in zip(members, answers, strict=True):
                out[j] = answer
        self.counters.note(len(jobs))
        return out

    def _search_group(self, jobs: Sequence[Job], **two_stage: Any) -> list[list[QueryAnswer]]:
        """One `search` of the jobs' queries, which share a filter (``two_stage``: its ``exact_from`` and
        ``depth``), each request's hits cut to its own ``k``."""
        from maxsim_cli.api import MaxsimWarning, search

        parts = [job.request.queries for job in jobs]
        keys = _batch_ids(parts)
        queries = _concat(parts)
        documents = len(self.corpus)
        k = max(min(job.request.k or documents, documents) for job in jobs)
        first = jobs[0].request
        given = (("include", first.include), ("exclude", first.exclude), ("where", first.where))
        filters = {name: value for name, value in given if value is not None}
        with warnings.catch_warnings():
            # a filter's unknown ids, or one that allows nothing: its answer is what it allows
            warnings.simplefilter("ignore", MaxsimWarning)
            rows = search(queries, self.corpus, k=k, device=self.device, **filters, **two_stage).to_dict()
        return [
            [
                (qid, Hits.from_pairs(rows.get(key, [])[: job.request.k]), None)
                for qid, key in zip(job.request.queries.ids, keys[j], strict=True)
            ]
            for j, job in enumerate(jobs)
        ]

    def _rerank(self, jobs: Sequence[Job]) -> list[list[QueryAnswer] | BaseException]:
        refused = self._drop_outside_where(jobs)
        if not any(refused):
            return self._rerank_candidates(jobs)
        kept = [job for job, error in zip(jobs, refused, strict=True) if error is None]
        scored = iter(self._rerank_candidates(kept) if kept else ())
        return [error if error is not None else next(scored) for error in refused]

    def _drop_outside_where(self, jobs: Sequence[Job]) -> list[BaseException | None]:
        """Each rerank's candidates without those its ``where`` disallows, as the library's `rerank`
        drops them (`maxsim_cli.scoring.results.drop_disallowed`): a document of the corpus that the
        condition does not hold for is left out, not missing; a docno not in the corpus stays, to be
        answered missing. The condition is read over the corpus the candidates are scored from (its masks
        kept per corpus: `maxsim_cli.scoring.where.matching`). Per job: None, or the error (a column the
        shards lack, ...) that it alone fails with."""
        from maxsim_cli.errors import MaxsimError, python_terms
        from maxsim_cli.scoring.where import matching

        corpus = self.scores_corpus
        refused: list[BaseException | None] = []
        for job in jobs:
            request = job.request
            refused.append(None)
            if request.where is None:
                continue
            try:
                with python_terms():  # the request's field is named as the API names it: where
                    allowed = matching(corpus, request.where)
            except MaxsimError as exc:
                refused[-1] = exc
                continue
            if not request.candidates:
                continue
            lists = list(request.candidates.items())
            ordinals = corpus.id_lookup().ordinals_of([docno for _, docnos in lists for docno in docnos])
            keep = (ordinals < 0) | allowed[np.maximum(ordinals, 0)]
            if keep.all():
                continue
            candidates: dict[str, list[str]] = {}
            start = 0
            for qid, docnos in lists:
                kept = keep[start : start + len(docnos)].tolist()
                start += len(docnos)
                candidates[qid] = [docno for docno, k in zip(docnos, kept, strict=True) if k]
            request.candidates = candidates
        return refused

    def _rerank_candidates(self, jobs: Sequence[Job]) -> list[list[QueryAnswer] | BaseException]:
        from maxsim_cli.scoring import dispatch

        asked = sum(_candidate_count(job.request) for job in jobs)  # found ones: at most these
        plan = dispatch.plan_served_rerank(self.scores_corpus, self.device, asked)
        if plan.path == dispatch.DIRECT:
            assert plan.residency is not None
            answers = self._rerank_resident(jobs, plan.residency)
            if answers is not None:
                return answers
        return self._rerank_library(jobs)

    @property
    def scores_corpus(self) -> Corpus:
        """The corpus a rerank and an explanation score from: the exact tier when there is one."""
        return self.exact if self.exact is not None else self.corpus

    def _rerank_resident(
        self, jobs: Sequence[Job], residency: Residency
    ) -> list[list[QueryAnswer] | BaseException] | None:
        """The batch's answers through one `direct.candidate_scores` launch on the resident corpus (the
        plan's ``direct`` path: `dispatch.plan_served_rerank`); None (the library's `rerank` is to score
        it) when the device ran out of memory.

        The library's `rerank` does the same work for any caller: its candidates as a run, looked up in
        the same `Corpus.id_lookup` and scored by the same launch, its answer as a `Run` in trec_eval's
        order. Here the request's docnos (unique per query: checked when it was read) go straight to
        corpus ordinals and each query's scores are ordered in numpy by the same keys,
        float32 score then docno rank (`Corpus.rank_of_ordinal`, the byte order of the ids), both
        descending; tests/test_serve.py holds its answers equal to the library's. One query against
        1,000 candidates: 1.0 ms against the public `rerank`'s 2.4 ms on the H200 host, kernel included
        (benchmarks/results/serve/archive/serve-rerank-h200-workers0-resident-path.json); without the
        kernel 0.13 ms on 2 cores (`python benchmarks/probe_serve_host.py`)."""
        from maxsim_cli.scoring import direct

        corpus = self.scores_corpus
        asked_of: list[list[str]] = []  # each query's candidates, request order
        for job in jobs:
            assert job.request.candidates is not None
            asked_of.extend(job.request.candidates.get(qid, []) for qid in job.request.queries.ids)
        # every candidate of the batch looked up at once in the corpus's id lookup (built once)
        found_all = corpus.id_lookup().ordinals_of([docno for asked in asked_of for docno in asked])
        kept: list[list[str]] = []  # each query's candidates in the corpus, request order
        ordinals: list[np.ndarray] = []
        missing_of: list[list[str]] = []
        start = 0
        for asked in asked_of:
            found = found_all[start : start + len(asked)]
            start += len(asked)
            if len(found) and found.min() < 0:
                missing_of.append([d for d, o in zip(asked, found.tolist(), strict=True) if o < 0])
                asked = [d for d, o in zip(asked, found.tolist(), strict=True) if o >= 0]
                found = found[found >= 0]
            else:
                missing_of.append([])
            kept.append(asked)
            ordinals.append(found)
        counts = np.fromiter(map(len, ordinals), dtype=np.int64, count=len(ordinals))
        offsets = np.zeros(len(ordinals) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        pairs = int(offsets[-1])
        cand_docs = ordinals[0] if len(ordinals) == 1 else np.concatenate(ordinals)
        scores = np.zeros(0, dtype=np.float32)
        if pairs:
            queries = _concat([job.request.queries for job in jobs])
            scores = direct.candidate_scores(corpus, residency, queries.batch, offsets, cand_docs)
            if scores is None:
                return None
        ranks = corpus.rank_of_ordinal()
        self.counters.note(len(jobs))
        out: list[list[QueryAnswer] | BaseException] = []
        n = 0
        for job in jobs:
            answers: list[QueryAnswer] = []
            missing_total: list[str] = []
            failure: InputError | None = None
            for qid in job.request.queries.ids:
                a, b = int(offsets[n]), int(offsets[n + 1])
                docnos, missing = kept[n], missing_of[n]
                n += 1
                if failure is None and not np.isfinite(scores[a:b]).all():
                    failure = _not_finite(qid, docnos, scores[a:b])
                # trec_eval's order (`maxsim_cli.run_files.sort_trec`): float32 score, then docno, descending
                keys = scores[a:b].astype(np.float64) + 0.0  # -0.0 ties with 0.0
                order = np.lexsort((ranks[cand_docs[a:b]], keys))[::-1]
                if job.request.k is not None:
                    order = order[: job.request.k]
                hits = Hits([docnos[i] for i in order.tolist()], scores[a:b][order])
                missing_total.extend(missing)
                answers.append((qid, hits, missing))
            if failure is not None:
                out.append(failure)
                continue
            out.append(_strict_failure(missing_total) if job.request.strict and missing_total else answers)
        return out

    def _rerank_library(self, jobs: Sequence[Job]) -> list[list[QueryAnswer] | BaseException]:
        from maxsim_cli.api import MaxsimWarning, rerank

        parts = [job.request.queries for job in jobs]
        keys = _batch_ids(parts)
        queries = _concat(parts)
        candidates: dict[str, list[str]] = {}
        for j, job in enumerate(jobs):
            assert job.request.candidates is not None
            key_of = dict(zip(job.request.queries.ids, keys[j], strict=True))
            for qid, docnos in job.request.candidates.items():
                candidates[key_of[qid]] = docnos
        with warnings.catch_warnings():
            # missing candidates are reported per request below, not as a warning of the batch
            warnings.simplefilter("ignore", MaxsimWarning)
            rows = rerank(queries, self.scores_corpus, candidates, device=self.device).to_dict()
        self.counters.note(len(jobs))
        out: list[list[QueryAnswer] | BaseException] = []
        for j, job in enumerate(jobs):
            answers: list[QueryAnswer] = []
            missing_total: list[str] = []
            for qid, key in zip(job.request.queries.ids, keys[j], strict=True):
                hits = rows.get(key, [])
                asked = job.request.candidates.get(qid, []) if job.request.candidates else []
                missing: list[str] = []
                if len(hits) < len(asked):  # hits are distinct docnos of the asked ones
                    found = {docno for docno, _ in hits}
                    missing = [docno for docno in asked if docno not in found]
                missing_total.extend(missing)
                k = job.request.k
                answers.append((qid, Hits.from_pairs(hits if k is None else hits[:k]), missing))
            out.append(_strict_failure(missing_total) if job.request.strict and missing_total else answers)
        return out


# A search with a depth, on a server without an exact tier.
NO_EXACT_TIER = InputError(
    "depth: this server has no exact tier (maxsim serve COMPRESSED --exact-from CORPUS); leave depth out"
)


def scores_label(corpus: Corpus, exact: Corpus | None) -> str | None:
    """What a server's answers say of their scores (``"scores"`` in the JSON answer): ``"exact"`` with an
    exact tier, ``"approximate"`` for a corpus of 4-bit or 2-bit codes without one, else None (the
    answer says nothing: its scores are those `maxsim score` gives on the corpus served)."""
    from maxsim_cli.codecs import CODE_QUANTIZATIONS

    if exact is not None:
        return "exact"
    return "approximate" if corpus.quantization in CODE_QUANTIZATIONS else None


def _candidate_count(request: Parsed) -> int:
    """The candidates a rerank request asks to score, over its queries."""
    candidates = request.candidates or {}
    return sum(len(candidates.get(qid, ())) for qid in request.queries.ids)


def _strict_failure(missing: list[str]) -> InputError:
    """What a ``strict`` rerank request with candidates not in the corpus fails with."""
    examples = ", ".join(repr(d) for d in dict.fromkeys(missing[:3]))
    return InputError(
        f"{CANDIDATES}: {len(missing)} candidates are not in the corpus, e.g. {examples}; check the "
        "candidates, or drop strict to skip them"
    )


def _not_finite(qid: str, docnos: Sequence[str], scores: np.ndarray) -> InputError:
    """What a rerank request whose query scores a candidate to Inf or NaN (float32 overflow: the request's
    values are finite, checked when it was read) fails with: the library's message for the same score
    (`runs.RankedSink`), which a search or a rerank through the library gives."""
    i = int(np.flatnonzero(~np.isfinite(scores))[0])
    return InputError(
        f"run: score {float(scores[i])} of docno {docnos[i]!r} for query {qid!r} is not finite; check the "
        "embeddings for NaN or Inf, or for values so large that their products overflow float32"
    )


def resident_on_gpus(corpus: Corpus) -> bool:
    """Whether the corpus is resident, every part of it on a GPU."""
    if corpus.placement is not None:
        return all(part.device.type == "cuda" for part in corpus.placement)
    return corpus.residency is not None and corpus.residency.device.type == "cuda"


def _internal(job: int, query: int) -> str:
    """The id of a request's query inside a batch: unique across the batch's requests."""
    return f"{job}.{query}"


def _batch_ids(parts: Sequence[Queries]) -> list[list[str]]:
    """Each request's query ids inside its batch: a request alone keeps its own (unique within it,
    checked when it was read), so that what the library says of a query names the client's qid; the
    requests of a larger batch get `_internal` ids, unique across them."""
    if len(parts) == 1:
        return [parts[0].ids]
    return [[_internal(j, i) for i in range(len(part))] for j, part in enumerate(parts)]


def _concat(parts: Sequence[Queries]) -> Queries:
    """The queries of several requests as one `Queries` under their `_batch_ids`. Requests of one dtype
    are concatenated as they are; mixed dtypes go to float32 first (int8 queries dequantized as the
    engine does it), which every float dtype converts to exactly, so each query's values reach the
    kernels as they would alone."""
    import torch

    from maxsim_cli.queries import Queries
    from maxsim_cli.shards import DocBatch

    if len(parts) == 1:
        return parts[0]
    ids = [key for keys in _batch_ids(parts) for key in keys]
    same = len({p.embeddings.dtype for p in parts}) == 1 and len({p.scales is None for p in parts}) == 1
    embeddings = torch.cat([p.embeddings if same else _float32(p) for p in parts])
    scales = torch.cat([p.scales for p in parts]) if same and parts[0].scales is not None else None
    lengths = torch.cat([p.offsets[1:] - p.offsets[:-1] for p in parts])
    offsets = torch.zeros(len(ids) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    return Queries(DocBatch(ids, embeddings, offsets, scales), parts[0].name)


def _float32(queries: Queries) -> torch.Tensor:
    import torch

    emb = queries.embeddings
    if queries.scales is not None:
        return emb.to(torch.float32) * queries.scales.to(torch.float32)[:, None]
    return emb.to(torch.float32)


def _free_device_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Batcher:
    """Gathers jobs on the event loop and scores them in batches on one worker thread (module doc)."""

    def __init__(self, scorer: Scorer, *, window_s: float = 0.002, max_queries: int = 256) -> None:
        self.scorer = scorer
        self.window_s = max(0.0, window_s)
        self.max_queries = max(1, max_queries)
        self._pending: deque[Job] = deque()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closing = False
        self._executor: ThreadPoolExecutor | None = None
        self._busy = False  # the last batch had company: wait the window for the next one
        self._scored_at = -math.inf  # when the last scoring ended (`QUICK_GAP_S`); never yet
        self.in_thread = False  # a batch is being scored on the worker thread now

    @property
    def counters(self) -> Counters:
        return self.scorer.counters

    def loaded(self) -> bool:
        """Whether a batch is being scored on the worker thread or requests are queued."""
        return self.in_thread or bool(self._pending)

    @property
    def queued(self) -> int:
        """Requests waiting for a batch now."""
        return len(self._pending)

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._closing = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="maxsim-serve")
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        """Answer every queued job, then stop."""
        if self._task is None:
            return
        self._closing = True
        assert self._wake is not None
        self._wake.set()
        await self._task
        self._task = None
        assert self._executor is not None
        self._executor.shutdown(wait=True)

    def score_now(self, kind: str, request: Parsed, timing: Timing | None = None) -> list[QueryAnswer] | None:
        """A request's answers scored here and now when the server is idle (nothing scored in the last
        `QUICK_GAP_S` either) and the request quick (`Scorer.quick`), as the batcher would score it
        alone; None otherwise (`submit` it). For a caller on the event loop that holds the request
        already (a worker's frame): no queue, no tasks to hand it over. Raises what the request fails
        with."""
        if self._task is None or self._closing or self._busy or self._pending or self.in_thread:
            return None
        job = Job(kind, request, None, time.perf_counter(), timing)
        if job.arrived - self._scored_at < QUICK_GAP_S or not self.scorer.quick([job]):
            return None
        with self.scorer.in_use() as scorer:
            result = scorer.score([job])[0]
        self._scored_at = time.perf_counter()
        if timing is not None:
            timing.score_s = time.perf_counter() - job.arrived
            timing.batch_requests = 1
        if isinstance(result, BaseException):
            raise result
        return result

    async def submit(self, kind: str, request: Parsed, timing: Timing | None = None) -> list[QueryAnswer]:
        """Queue a checked request and wait for its answers (raises what it fails with); ``timing`` is
        filled in when given."""
        if self._task is None or self._closing:
            raise RequestError(503, "the server is shutting down")
        loop = asyncio.get_running_loop()
        job = Job(kind, request, loop.create_future(), time.perf_counter(), timing)
        self._pending.append(job)
        assert self._wake is not None
        self._wake.set()
        return await job.future  # type: ignore[misc]

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        while True:
            while not self._pending:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
            first = self._pending[0]
            deadline = first.arrived + (self.window_s if self._busy else 0.0)
            while not self._closing and self._queued(first.kind) < self.max_queries:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            batch = self._take(first.kind)
            if not batch:
                continue
            started = time.perf_counter()
            # the batch is scored on the generation served as it starts, whatever a reload swaps in
            with self.scorer.in_use() as scorer:
                try:
                    if not self._busy and not self._pending and scorer.quick(batch):
                        # an idle server and a small request on a GPU: scored here, without the two
                        # thread hand-overs (nothing else is waiting to be read while it runs)
                        results: list[Any] = scorer.score(batch)
                    else:
                        self.in_thread = True
                        try:
                            results = await loop.run_in_executor(self._executor, scorer.score, batch)
                        finally:
                            self.in_thread = False
                except Exception as exc:  # noqa: BLE001 - a bug in the scorer: fail this batch, keep serving
                    logger.exception("scoring a batch failed")
                    results = [exc] * len(batch)
            self._scored_at = time.perf_counter()
            score_s = self._scored_at - started
            for job, result in zip(batch, results, strict=True):
                if job.timing is not None:
                    job.timing.queue_s = started - job.arrived
                    job.timing.score_s = score_s
                    job.timing.batch_requests = len(batch)
                assert job.future is not None
                if job.future.done():  # the client went away
                    continue
                if isinstance(result, BaseException):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)
            # company: this batch had several requests, or more came while it was scored
            self._busy = len(batch) > 1 or bool(self._pending)

    def _queued(self, kind: str) -> int:
        return sum(job.num_queries for job in self._pending if job.kind == kind)

    def _take(self, kind: str) -> list[Job]:
        """The queued jobs of ``kind`` up to ``max_queries`` queries (at least one job), in arrival order;
        jobs whose client went away are dropped."""
        batch: list[Job] = []
        rest: deque[Job] = deque()
        total = 0
        full = False
        while self._pending:
            job = self._pending.popleft()
            assert job.future is not None
            if job.future.done():
                continue
            full = full or (bool(batch) and total + job.num_queries > self.max_queries)
            if job.kind != kind or full:
                rest.append(job)
                continue
            batch.append(job)
            total += job.num_queries
        self._pending = rest
        return batch
