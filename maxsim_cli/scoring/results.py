"""How a scoring run's results reach its sink: an exhaustive pass's top-k (`write_topk`), and a rerank's
candidates found in the corpus (`locate_candidates`) and written back re-sorted (`write_reranked`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from maxsim_cli.errors import STRICT, InputError
from maxsim_cli.scoring.resources import corpus_name

if TYPE_CHECKING:
    from maxsim_cli.shards import Corpus

Logger = Callable[[str], None]


def write_topk(
    sink: Any, qids: Sequence[str], scores: torch.Tensor, ranks: torch.Tensor, corpus: Corpus
) -> None:
    """A running top-k's result (`RunningTopK.result`: float32 scores and docno ranks, ``[nq, m]``, best
    first) to ``sink``: corpus ordinals to a rank of a distributed job (``write_ordinals``), else docnos,
    the whole block at once (``write_ranked``) or query by query (``write_query``)."""
    from maxsim_cli.arrays import values_array

    _, ordinal_of_rank, ids_by_rank = corpus.id_order()
    scores_np = scores.numpy()
    if hasattr(sink, "write_ordinals"):  # a rank of a distributed qpass: columns for rank 0's merge
        sink.write_ordinals(scores_np, ordinal_of_rank[ranks.numpy()])
        return
    docnos = ids_by_rank.take(values_array(ranks.numpy()))  # query after query
    if hasattr(sink, "write_ranked"):  # the whole block at once (corpus ids, checked when read)
        sink.write_ranked(list(qids), docnos, scores_np, corpus_ids=True)
        return
    m = scores_np.shape[1] if scores_np.ndim == 2 else 0
    for i, qid in enumerate(qids):
        sink.write_query(qid, docnos[i * m : (i + 1) * m].to_pylist(), scores_np[i].tolist())


class DocnoRows(Sequence[tuple[str, float]]):
    """A query's candidates given as docnos alone: the rows ``(docno, 0.0)`` of a first-stage run, kept
    as the list of docnos (`locate_candidates` looks that list up as it is; a row's tuple is made only
    when one is asked for). ``docnos``: ``str`` (their string values are what count), each once
    (`locate_candidates` checks it). ``joined``: the docnos joined as the lookup joins them
    (`maxsim_cli.shards.lookup.join_docnos`), where the caller made the join: it is not made again."""

    __slots__ = ("docnos", "joined", "ordinals")

    def __init__(
        self, docnos: list[str], joined: str | None = None, ordinals: np.ndarray | None = None
    ) -> None:
        self.docnos = docnos
        self.joined = joined
        # the documents' ordinals (int64), where the rows come from a corpus that holds the scored
        # corpus's documents in its order (a two-stage search's scan, its tiers checked first): no lookup
        self.ordinals = ordinals

    def __len__(self) -> int:
        return len(self.docnos)

    def __getitem__(self, index: int | slice) -> tuple[str, float] | list[tuple[str, float]]:
        if isinstance(index, slice):
            return [(docno, 0.0) for docno in self.docnos[index]]
        return (self.docnos[index], 0.0)

    def __iter__(self) -> Iterator[tuple[str, float]]:
        return zip(self.docnos, itertools.repeat(0.0))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DocnoRows):
            return self.docnos == other.docnos
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass
class LocatedCandidates:
    """A first-stage run's candidates found in the corpus: pair ``i`` is query ``pair_query[i]`` against
    the document of corpus ordinal ``pair_doc[i]``, in (query, run order) order; ``docnos_of[q]`` are
    query ``q``'s candidates found, in run order; ``missing`` counts candidates not in the corpus,
    ``filtered`` those a filter left out (`drop_disallowed`). ``pair_docnos``: pair ``i``'s docno as an
    Arrow (large) binary or string array, where the lookup made one (`IdLookup.locate`), else None."""

    pair_query: np.ndarray
    pair_doc: np.ndarray
    docnos_of: dict[int, list[str]]
    missing: int
    filtered: int = 0
    pair_docnos: Any = None


def locate_candidates(
    corpus: Corpus,
    run: dict[str, list[tuple[str, float]]],
    qids: Sequence[str],
    qname: str,
    cname: str,
    strict: bool,
    corpus_paths: Sequence[str],
    log: Logger,
) -> LocatedCandidates:
    """Find ``run``'s candidates among the corpus's documents: one lookup of every candidate in the
    corpus's `Corpus.id_lookup`, built once per corpus, so a call costs what its candidates cost. A qid
    of the run that names no query, or a query that lists a docno twice, is an `InputError`; candidates
    not in the corpus are a warning through ``log`` (``strict``: an `InputError`)."""
    from maxsim_cli.shards.lookup import first_repeat, join_docnos
    qindex = {q: i for i, q in enumerate(qids)}
    for qid in run:
        if qid not in qindex:
            raise InputError(
                f"{cname}: query {qid!r} has candidates but no embedding in {qname}; "
                "add it to the query file or drop it from the run"
            )
    # every query's candidates in one list (queries in run order, each query's in run order), looked up
    # at once: a served rerank pays this at every request
    query_of = np.fromiter((qindex[qid] for qid in run), dtype=np.int64, count=len(run))
    if run and all(isinstance(c, DocnoRows) and c.ordinals is not None for c in run.values()):
        return _located_by_ordinals(corpus, run, query_of)
    docnos_per_query = [
        cands.docnos if isinstance(cands, DocnoRows) else [docno for docno, _ in cands]
        for cands in run.values()
    ]
    counts = np.fromiter(map(len, docnos_per_query), dtype=np.int64, count=len(docnos_per_query))
    listed = (
        docnos_per_query[0]
        if len(docnos_per_query) == 1
        else [docno for docnos in docnos_per_query for docno in docnos]
    )
    # the docnos' join, where the caller made it (`DocnoRows.joined`): made once, not again here
    joins = [cands.joined if isinstance(cands, DocnoRows) else None for cands in run.values()]
    if None in joins:
        joined = None
    elif len(joins) == 1:
        joined = joins[0]
    else:
        joined = join_docnos([j for j, n in zip(joins, counts.tolist(), strict=True) if n])
    ordinals, asked, hashes = corpus.id_lookup().locate(listed, joined)
    twice = first_repeat(hashes, counts, listed)
    if twice >= 0:
        qid = list(run)[int(np.searchsorted(np.cumsum(counts), twice, side="right"))]
        raise InputError(
            f"{cname}: docno {listed[twice]!r} appears twice for query {qid!r}; a run lists each "
            "document at most once per query"
        )
    pair_query = np.repeat(query_of, counts)
    found = ordinals >= 0
    n_missing = len(listed) - int(np.count_nonzero(found))
    if not n_missing:
        docnos_of = dict(zip(query_of.tolist(), docnos_per_query, strict=True))
        return LocatedCandidates(pair_query, ordinals, docnos_of, 0, pair_docnos=asked)
    missing: list[str] = []  # the first three distinct, for the message
    for i in np.flatnonzero(~found).tolist():
        if listed[i] not in missing:
            missing.append(listed[i])
            if len(missing) == 3:
                break
    examples = ", ".join(repr(m) for m in missing)
    if strict:
        raise InputError(
            f"{cname}: {n_missing} candidates are not in the corpus ({corpus_name(corpus_paths)}), "
            f"e.g. {examples}; check the run and the corpus, or drop {STRICT.given(True)} to skip them"
        )
    log(
        f"warning: {cname}: {n_missing} candidates are not in the corpus, e.g. {examples}; "
        f"they are left out ({STRICT.given(True)} makes this an error)"
    )
    keep = found.tolist()
    docnos_of: dict[int, list[str]] = {}
    start = 0
    for qi, docnos in zip(query_of.tolist(), docnos_per_query, strict=True):
        kept = keep[start : start + len(docnos)]
        start += len(docnos)
        docnos_of[qi] = docnos if all(kept) else [d for d, k in zip(docnos, kept, strict=True) if k]
    return LocatedCandidates(
        pair_query[found], ordinals[found], docnos_of, n_missing, pair_docnos=_rows(asked, found)
    )


def ids_by_ordinal(corpus: Corpus) -> Any:
    """The corpus's ids as one Arrow array in ordinal order (one shard's own array, else `Corpus.id_order`'s,
    made once)."""
    return corpus.id_order()[0] if len(corpus.shards) > 1 else corpus.shards[0].id_array


def _located_by_ordinals(
    corpus: Corpus, run: dict[str, Any], query_of: np.ndarray
) -> LocatedCandidates:
    """`locate_candidates` of rows that carry their ordinals (`DocnoRows.ordinals`): each query's
    documents distinct and in the corpus, as the scan that found them made them."""
    from maxsim_cli.arrays import values_array

    rows = list(run.values())
    counts = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    pair_doc = np.concatenate([r.ordinals for r in rows]).astype(np.int64, copy=False)
    ids = ids_by_ordinal(corpus)
    docnos_of = dict(zip(query_of.tolist(), (r.docnos for r in rows), strict=True))
    pair_docnos = ids.take(values_array(pair_doc))
    return LocatedCandidates(np.repeat(query_of, counts), pair_doc, docnos_of, 0, pair_docnos=pair_docnos)


def _rows(array: Any, keep: np.ndarray) -> Any:
    """The rows of an Arrow array where the bool mask ``keep`` is True (None stays None)."""
    from maxsim_cli.arrays import values_array

    return None if array is None else array.take(values_array(np.flatnonzero(keep)))


def drop_disallowed(located: LocatedCandidates, disallowed: np.ndarray) -> LocatedCandidates:
    """``located`` without the candidates a filter's mask disallows (`maxsim_cli.scoring.filters`),
    counted in ``filtered``: left out as missing candidates are, without a warning."""
    keep = ~disallowed[located.pair_doc]
    dropped = len(keep) - int(np.count_nonzero(keep))
    if not dropped:
        return located
    # each query's pairs are one run of the list, in the order of ``docnos_of`` (run order)
    docnos_of: dict[int, list[str]] = {}
    start = 0
    for qi, docnos in located.docnos_of.items():
        kept = keep[start : start + len(docnos)]
        start += len(docnos)
        docnos_of[qi] = [d for d, k in zip(docnos, kept.tolist(), strict=True) if k]
    return LocatedCandidates(
        located.pair_query[keep],
        located.pair_doc[keep],
        docnos_of,
        located.missing,
        dropped,
        _rows(located.pair_docnos, keep),
    )


def subset_candidates(corpus: Corpus, disallowed: np.ndarray, num_queries: int) -> LocatedCandidates:
    """Every document a filter allows as every query's candidates (a filtered search of few documents:
    `maxsim_cli.scoring.filters.use_subset`), in corpus order."""
    allowed = np.flatnonzero(~disallowed).astype(np.int64)
    ids = ids_by_ordinal(corpus)
    docnos = ids.take(allowed).to_pylist() if len(allowed) else []
    pair_query = np.repeat(np.arange(num_queries, dtype=np.int64), len(allowed))
    pair_doc = np.tile(allowed, num_queries)
    return LocatedCandidates(pair_query, pair_doc, dict.fromkeys(range(num_queries), docnos), 0)


def write_reranked(
    sink: Any,
    qids: Sequence[str],
    docnos_of: dict[int, list[str]],
    pair_query: np.ndarray | None,
    scores: np.ndarray,
    top_k: int,
    *,
    pair_docnos: Any = None,
) -> None:
    """Each query's candidates with their float32 ``scores`` (pairs in (query, run order) order, as
    `locate_candidates` gives them) to ``sink``, re-sorted in trec_eval's order and cut to ``top_k``.

    With ``pair_docnos`` (each pair's docno, an Arrow string or binary array in the order of ``scores``:
    `LocatedCandidates.pair_docnos`), a query whose scores are finite is sorted by its scores, the few
    runs of equal scores by their docnos (`_trec_order`), and handed over as Arrow rows taken from it
    (``sink.write_ranked``, which checks them as ``write_query`` does): no Python string a row. A query
    with a non-finite score goes through ``write_query`` with ``docnos_of``, as every query did before,
    which names it: the same rows either way."""
    from maxsim_cli.arrays import values_array
    from maxsim_cli.run_files import sort_trec

    if pair_query is None:
        return
    starts = np.searchsorted(pair_query, np.arange(len(qids) + 1)).tolist()
    for qi, qid in enumerate(qids):
        a, b = starts[qi], starts[qi + 1]
        if pair_docnos is not None and b > a:
            order = _trec_order(scores[a:b], docnos_of.get(qi))
            if order is not None:
                keep = order[:top_k]
                docnos = pair_docnos.slice(a, b - a).take(values_array(keep))
                # found docnos are corpus ids (checked when their shards were read)
                sink.write_ranked([qid], docnos, scores[a:b][keep].reshape(1, -1), corpus_ids=True)
                continue
        docnos = docnos_of.get(qi)
        if not docnos:
            continue
        sc = scores[a:b].tolist()
        kept = sort_trec(docnos, sc)[:top_k]
        sink.write_query(qid, [docnos[i] for i in kept], [sc[i] for i in kept])


def _trec_order(scores: np.ndarray, docnos: Sequence[str] | None) -> np.ndarray | None:
    """`sort_trec`'s order (int64 indices) of one query's float32 ``scores``, ``docnos`` (its Python
    strings, in the scores' order) deciding between equal scores: the scores sorted in numpy, then each
    run of equal scores (few: float32 scores rarely tie but for copies of a document, or fp16 products)
    sorted by docno descending, as `sort_trec` does with every docno. None where a score is not finite
    (`write_query` then names it), or where there are ties and no ``docnos``."""
    keys = np.asarray(scores, dtype=np.float32) + np.float32(0.0)  # -0 is 0, as in `sort_trec`
    order = np.argsort(-keys, kind="stable")
    ranked = keys[order]
    if not np.isfinite(ranked).all():
        return None
    tied = np.flatnonzero(ranked[:-1] == ranked[1:])  # i: ranks i and i + 1 share a score
    if len(tied) == 0:
        return order
    if docnos is None:
        return None
    # runs of equal scores: [first, last] ranks, from the tied neighbours that follow each other
    breaks = np.flatnonzero(np.diff(tied) != 1)
    firsts = tied[np.concatenate(([0], breaks + 1))].tolist()
    lasts = (tied[np.concatenate((breaks, [len(tied) - 1]))] + 1).tolist()
    for first, last in zip(firsts, lasts, strict=True):
        run = order[first : last + 1].tolist()
        order[first : last + 1] = sorted(run, key=docnos.__getitem__, reverse=True)
    return order
