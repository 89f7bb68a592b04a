"""Planning a scoring run: from document lengths, shard bounds, the queries' sizes and a memory budget to
query batches and document batches. Pure: numpy arrays in, a `Plan` out; no device, no file.

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
the CPU within one shard (`_cut_at`: one read a batch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from maxsim_cli.errors import BATCH_QUERIES, MAX_HOST_MEMORY, MAX_MEMORY, InputError, MaxsimError
from maxsim_cli.scoring.pipeline import BatchStream, Part
from maxsim_cli.scoring.staging import PinnedArena
from maxsim_cli.scoring.topk import MAX_RANKS, PAIR_BYTES, STATE_BYTES
from maxsim_cli.units import format_size

# Share of a memory budget that plans fill: the rest absorbs the caching allocator's block rounding and
# the kernels' scratch (a few MiB), which the plan does not see.
BUDGET_FILL = 0.85
# Bytes per rerank pair in a batch: the kernel's float32 score (4), the candidate index and the pair's
# output position in the side data (16) in each of the two device slots (32), and the scatter (4).
RERANK_PAIR_BYTES = 48
# Document batches: aim at MIN_BATCHES per pass over the corpus so reading, copying and scoring overlap
# (the first batch's read and the last one's scoring are not hidden: with 16 batches that is ~1/8 of a
# pass), within these sizes. 16 MiB keeps launches long against their ~20 us overhead; 256 MiB keeps the
# pinned slots (reader_threads + 2 of them) at a few GiB. On the 2-core CPU machine fewer batches gained at
# most 1.10x (a rerank at 8, with 1.4x the memory) and lost past that
# (benchmarks/results/cpu/min-batches-cpu-2core.txt).
MIN_BATCHES = 16
MIN_BATCH_BYTES = 16 << 20
MAX_BATCH_BYTES = 256 << 20
# With a budget this small, a query batch is split rather than the document batches shrunk further.
MIN_BATCH_TOKENS = 16384
# Reader threads on CUDA: one a core up to 16 (44 GB/s from the page cache with 16 threads, 33 with 8:
# docs/kernel-notes.md, "`maxsim score`: the host-side constants"). They run at `pipeline.READER_NICE`.
# On the CPU one thread: reading is a small share of the time there and every other core scores.
DEFAULT_READER_THREADS = 16
# Pinned staging memory on CUDA: page-locking costs ~0.17 s/GiB once per process (staging.PinnedArena), so
# the slots share one arena of at most this size: (16 + 2) shares of ~28 MiB, i.e. 110K fp16 tokens of
# d = 128, a batch that still takes ~1.5 ms of kernel time for 512 queries (several times the launch
# and merge overheads).
STAGING_BYTES = 512 << 20


@dataclass
class Budget:
    device_bytes: int  # scoring-device budget (GPU, or the CPU's working set)
    host_bytes: int  # host staging budget (CUDA only)
    reader_threads: int
    cuda: bool
    staging_bytes: int = 0  # the pinned arena (CUDA)
    device: str = "cpu"  # the scoring device, as messages name it
    # The corpus is resident on the scoring device (`Corpus.to`): batches are views of its buffer, so
    # nothing is staged and batches need not be small for reads to overlap.
    resident_corpus: bool = False
    # CPU: host bytes the run holds before its batches (inputs, id order, unplanned reserve) when
    # `device_bytes` is what they leave of the host budget: a budget too small names their sum.
    host_reserved: int = 0


def _too_small(budget: Budget, need: int, what: str) -> MaxsimError:
    """The error of a plan that does not fit: what it needs in all, and the options that give it."""
    if budget.cuda:
        return MaxsimError(
            f"the memory budget ({format_size(budget.device_bytes)} on {budget.device}) is too small {what}: "
            f"it needs about {format_size(int(need / BUDGET_FILL))}; raise {MAX_MEMORY} or pass "
            f"{BATCH_QUERIES}"
        )
    if budget.host_reserved:
        mib = -(-(budget.host_reserved + int(need / BUDGET_FILL)) // (1 << 20))  # rounded up
        return MaxsimError(
            f"the host memory budget ({format_size(budget.host_bytes)}) is too small {what}: with "
            f"{format_size(budget.host_reserved)} held for the corpus's ids and offsets, the queries and "
            f"the scoring threads, the run needs at least {mib} MiB; give "
            f"{MAX_HOST_MEMORY.given(f'{mib}MiB')} or more"
        )
    return MaxsimError(
        f"the memory budget ({format_size(budget.device_bytes)} on {budget.device}) is too small {what}: "
        f"it needs about {format_size(int(need / BUDGET_FILL))}; raise {MAX_MEMORY} or {MAX_HOST_MEMORY} "
        f"or pass {BATCH_QUERIES}"
    )


@dataclass
class Plan:
    """Query batches of `query_batch_size` queries, each a pass over the document batches `spans`.

    ``spans[i] = (a, b)``: documents ``a..b-1`` of the planned documents, whose token offsets are
    `tok_cum` (exhaustive: the corpus in ordinal order; rerank: the candidates' documents, `docs`);
    `parts[i]`: the same documents as per-shard parts (`maxsim_cli.scoring.pipeline.Part`). Rerank plans add
    each batch's side data (`sides`: candidate offsets per query, candidate documents, output positions) and
    the query of each pair in output order (`pair_query`).
    """

    num_queries: int
    query_batch_size: int
    spans: list[tuple[int, int]]
    tok_cum: np.ndarray
    parts: list[list[Part]]
    planned_bytes: int  # scoring-device bytes the plan needs (at most BUDGET_FILL of the budget)
    resident: bool = False  # the document batches stay on the device across query batches
    sides: list[np.ndarray] | None = None
    docs: np.ndarray | None = None
    pair_query: np.ndarray | None = None

    @property
    def query_batches(self) -> list[tuple[int, int]]:
        """``(q0, q1)`` of each query batch."""
        n, size = self.num_queries, self.query_batch_size
        return [(q0, min(q0 + size, n)) for q0 in range(0, n, size)]

    @property
    def num_docs(self) -> int:
        return len(self.tok_cum) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.tok_cum[-1])

    @property
    def num_pairs(self) -> int:
        """Rerank: (query, candidate) pairs scored."""
        return 0 if self.pair_query is None else len(self.pair_query)

    def batch_tokens(self, i: int) -> int:
        a, b = self.spans[i]
        return int(self.tok_cum[b] - self.tok_cum[a])

    @property
    def max_batch_docs(self) -> int:
        return max(b - a for a, b in self.spans)

    @property
    def max_batch_tokens(self) -> int:
        return max(self.batch_tokens(i) for i in range(len(self.spans)))


def _cut_at(spans: list[tuple[int, int]], bounds: np.ndarray) -> list[tuple[int, int]]:
    """``spans`` (document ranges) cut at the shard boundaries ``bounds``, so that each lies in one shard.

    On the CPU each batch is then one read of one shard (and one `Shard.read_docs` for other
    containers, used as it is rather than packed into a slot). The CUDA path copies every batch into a
    slot anyway and keeps its larger batches."""
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


def _batch_token_limit(total_bytes: int, tb: int, budget: Budget) -> float:
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


def query_bytes(query_offsets: np.ndarray, token_bytes: int, q0: int, q1: int) -> int:
    """Device bytes of queries ``q0..q1-1``: their tokens (``token_bytes`` each) and offsets."""
    t = int(query_offsets[q1] - query_offsets[q0])
    return t * token_bytes + (q1 - q0 + 1) * 8


def shard_parts(bounds: np.ndarray, start: int, stop: int) -> list[Part]:
    """Global ordinals [start, stop) as per-shard ranges (shard ``s`` holds ``bounds[s]..bounds[s+1]-1``)."""
    parts: list[Part] = []
    s = int(np.searchsorted(bounds, start, side="right")) - 1
    while start < stop:
        end = min(stop, int(bounds[s + 1]))
        if end > start:
            parts.append((s, start - int(bounds[s]), end - int(bounds[s])))
        start = end
        s += 1
    return parts


def index_parts(bounds: np.ndarray, ordinals: np.ndarray) -> list[Part]:
    """Sorted global ordinals as per-shard index lists."""
    parts: list[Part] = []
    shard_of = np.searchsorted(bounds, ordinals, side="right") - 1
    cuts = np.flatnonzero(np.diff(shard_of)) + 1
    for chunk, shards in zip(np.split(ordinals, cuts), np.split(shard_of, cuts), strict=True):
        s = int(shards[0])
        parts.append((s, chunk - bounds[s]))
    return parts


# --------------------------------------------------------------------------------------------------
# exhaustive


def plan_exhaustive(
    doc_lengths: np.ndarray,
    bounds: np.ndarray,
    query_offsets: np.ndarray,
    query_token_bytes: int,
    tb: int,
    top_k: int,
    batch_queries: int | None,
    budget: Budget,
) -> Plan | None:
    """Query batches and the document batches of each pass over the whole corpus, sized to the budgets.

    ``doc_lengths``: tokens of every document (ordinal order); ``bounds``: the shards' first ordinals and
    the total (``[0, n0, n0 + n1, ...]``); ``query_offsets``: the queries' token offsets; ``tb``: bytes a
    document token. None when there is nothing to score (no query or no document)."""
    n_docs = len(doc_lengths)
    if n_docs >= MAX_RANKS:
        raise InputError(f"the corpus has {n_docs} documents; at most {MAX_RANKS - 1} can be ranked at once")
    nq = len(query_offsets) - 1
    if nq == 0 or n_docs == 0:
        return None
    tok_cum = np.concatenate([[0], np.cumsum(doc_lengths)]).astype(np.int64)

    total_bytes = int(tok_cum[-1]) * tb
    usable = int(budget.device_bytes * BUDGET_FILL)
    if budget.resident_corpus:
        # one batch's offsets and side data are copied (tb = 0: no token is staged); no size limit
        # for overlap
        token_limit, slots, staged_tb = float(tok_cum[-1]), 1, 0
    else:
        token_limit = _batch_token_limit(total_bytes, tb, budget)
        slots = BatchStream.DEVICE_SLOTS if budget.cuda else BatchStream.host_slots(budget.reader_threads)
        staged_tb = tb
    longest = int(doc_lengths.max())
    nq_b = min(nq, batch_queries or nq)
    while True:
        k_eff = min(top_k, n_docs)
        fixed = max(
            query_bytes(query_offsets, query_token_bytes, q0, min(q0 + nq_b, nq)) for q0 in range(0, nq, nq_b)
        )
        fixed += nq_b * k_eff * STATE_BYTES
        per_doc = nq_b * PAIR_BYTES + slots * 16
        rest = usable - fixed
        # tokens per batch such that staging + scores fit, with docs of average length
        avg_len = max(tok_cum[-1] / n_docs, 1.0)
        fit_tokens = rest / (slots * staged_tb + per_doc / avg_len) if rest > 0 else 0
        tokens = min(token_limit, fit_tokens)
        # Fewer queries a pass only make room on the scoring device; `token_limit` (overlap, host
        # staging) does not depend on them. Testing it here would split the 512 queries of a 32 MB
        # corpus into 512 passes of one query: its staging slots, sized to the corpus, hold ~7K
        # tokens, under MIN_BATCH_TOKENS.
        enough = fit_tokens >= min(int(tok_cum[-1]), max(longest, MIN_BATCH_TOKENS))
        if enough or nq_b == 1 or batch_queries is not None:
            break
        nq_b = (nq_b + 1) // 2
    spans, planned = _fit_spans(
        tok_cum, tokens, per_doc, slots, fixed, usable, nq_b, longest, staged_tb, budget
    )
    if not budget.cuda and not budget.resident_corpus:
        # a batch within one shard: one read (a resident corpus is one buffer: a view across shards)
        spans = _cut_at(spans, bounds)
    resident = False
    n_jobs = math.ceil(nq / nq_b)
    if budget.cuda and n_jobs > 1 and not budget.resident_corpus:
        need = _device_total(
            spans,
            tok_cum,
            [b - a for a, b in spans],
            [nq_b * PAIR_BYTES * (b - a) for a, b in spans],
            tb,
            fixed,
            0,
        )
        resident = need <= usable
        if resident:
            planned = need
    parts = [shard_parts(bounds, a, b) for a, b in spans]
    return Plan(nq, nq_b, spans, tok_cum, parts, planned, resident)


def _fit_spans(
    tok_cum: np.ndarray,
    tokens: float,
    per_doc: int,
    slots: int,
    fixed: int,
    usable: int,
    nq_b: int,
    longest: int,
    tb: int,
    budget: Budget,
) -> tuple[list[tuple[int, int]], int]:
    """Document batches whose staging and scoring fit ``usable`` bytes, shrunk until they do, and the
    bytes they need."""
    n_docs = len(tok_cum) - 1
    avg_len = max(tok_cum[-1] / n_docs, 1.0)
    token_limit = max(tokens, 1.0)
    doc_limit = max(token_limit / avg_len * 1.25, 1.0)
    doc_cum = np.arange(n_docs + 1, dtype=np.float64)
    while True:
        spans = _split(doc_cum, tok_cum, doc_limit, token_limit)
        need = _device_total(
            spans,
            tok_cum,
            [b - a for a, b in spans],
            [per_doc * (b - a) for a, b in spans],
            tb,
            fixed,
            slots,
        )
        if need <= usable:
            return spans, need
        if doc_limit <= 1 and token_limit <= longest:
            queries = "1 query" if nq_b == 1 else f"{nq_b} queries"
            raise _too_small(budget, need, f"for {queries} and the longest document ({longest} tokens)")
        token_limit = max(token_limit * 0.8, 1.0)
        doc_limit = max(doc_limit * 0.8, 1.0)


# --------------------------------------------------------------------------------------------------
# rerank


def plan_rerank(
    pair_query: np.ndarray,
    pair_doc: np.ndarray,
    doc_lengths: np.ndarray,
    bounds: np.ndarray,
    query_offsets: np.ndarray,
    query_token_bytes: int,
    tb: int,
    budget: Budget,
) -> Plan | None:
    """All queries in one batch and the document batches of the (query, document) pairs to score.

    ``pair_query`` / ``pair_doc``: each pair's query index and corpus ordinal, in (query, run) order
    within each query; the other arguments as for `plan_exhaustive`. Each batch's side data lists, per
    query, the batch's documents it needs and where each pair's score goes in the output (pairs in
    (query, run order) order). None when there is no pair."""
    nq = len(query_offsets) - 1
    q_arr = np.asarray(pair_query, dtype=np.int64)
    d_arr = np.asarray(pair_doc, dtype=np.int64)
    if len(q_arr) == 0:
        return None
    # pair position = index in (query, run order) order, which is how results are gathered
    order = np.argsort(q_arr, kind="stable")
    q_arr, d_arr = q_arr[order], d_arr[order]
    unique_docs, u_of_pair = np.unique(d_arr, return_inverse=True)
    lengths = doc_lengths[unique_docs]
    tok_cum = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    pairs_per_doc = np.bincount(u_of_pair, minlength=len(unique_docs))

    total_bytes = int(tok_cum[-1]) * tb
    usable = int(budget.device_bytes * BUDGET_FILL)
    if budget.resident_corpus:
        # nothing is staged: a batch gathers its candidates' rows on the device, one batch at a time, so
        # only the device budget splits the candidates (the staging limits would cut one batch a document)
        token_limit, slots = float(tok_cum[-1]), 1
    else:
        token_limit = _batch_token_limit(total_bytes, tb, budget)
        slots = BatchStream.DEVICE_SLOTS if budget.cuda else BatchStream.host_slots(budget.reader_threads)
    fixed = query_bytes(query_offsets, query_token_bytes, 0, nq) + (nq + 1) * 8 * (slots + 1) + len(q_arr) * 4
    cost = pairs_per_doc * RERANK_PAIR_BYTES + lengths * tb * slots + 16 * slots
    cost_cum = np.concatenate([[0], np.cumsum(cost)]).astype(np.float64)
    cost_limit = max(usable - fixed, 1)
    while True:
        spans = _split(cost_cum, tok_cum, cost_limit, token_limit)
        pair_counts = [int(pairs_per_doc[a:b].sum()) for a, b in spans]
        sides = [nq + 1 + 2 * c for c in pair_counts]
        need = _device_total(
            spans, tok_cum, sides, [c * RERANK_PAIR_BYTES for c in pair_counts], tb, fixed, slots
        )
        if need <= usable:
            break
        if cost_limit <= 1 and token_limit <= 1:
            raise _too_small(budget, need, f"to rerank {nq} queries")
        cost_limit = max(cost_limit * 0.8, 1)
        token_limit = max(token_limit * 0.8, 1)
    # pairs grouped by batch, then by query (candidate lists are per query, contiguous)
    batch_of_u = np.zeros(len(unique_docs), dtype=np.int64)
    for i, (a, b) in enumerate(spans):
        batch_of_u[a:b] = i
    pair_pos = np.arange(len(q_arr), dtype=np.int64)
    batch_of_pair = batch_of_u[u_of_pair]
    by_batch = np.lexsort((u_of_pair, q_arr, batch_of_pair))
    starts = np.searchsorted(batch_of_pair[by_batch], np.arange(len(spans) + 1))
    side_data = []
    for i, (a, _b) in enumerate(spans):
        sel = by_batch[starts[i] : starts[i + 1]]
        cand_offsets = np.searchsorted(q_arr[sel], np.arange(nq + 1)).astype(np.int64)
        side_data.append(np.concatenate([cand_offsets, u_of_pair[sel] - a, pair_pos[sel]]).astype(np.int64))
    parts = [index_parts(bounds, unique_docs[a:b]) for a, b in spans]
    return Plan(nq, nq, spans, tok_cum, parts, need, sides=side_data, docs=unique_docs, pair_query=q_arr)
