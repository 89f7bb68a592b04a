"""The Python API: open a corpus once, keep it resident, score queries from files or from memory.

    >>> from maxsim_cli import open_corpus, read_queries, search
    >>> corpus = open_corpus("sample_data/corpus")
    >>> run = search(read_queries("sample_data/queries.safetensors"), corpus, k=10, device="cpu")
    >>> len(run.qids), len(run)
    (200, 2000)

`search` ranks the whole corpus for every query (exact top-k); `rerank` scores the candidates of a
first-stage run. Both return a `Run` (``run.to_trec(path)`` writes what ``maxsim score`` writes for the
same inputs, ``run.to_dataframe()`` gives PyTerrier's columns and ranks, ``run.explain(qid, docno)``
says which document token each query token matched: `maxsim_cli.explain`). ``corpus.to("cuda")``
makes the corpus *resident*: every shard is read once into GPU memory and later calls read nothing from
disk (``corpus.to("auto")``: the GPU when there is one, else host memory). Bad input raises
`maxsim_cli.errors.InputError` (and `UsageError` for bad options) with the one-line messages the
command line prints, naming these functions' keyword arguments where it names a flag (``k=0``, not
``--top-k 0``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from maxsim_cli.errors import (
    BATCH_QUERIES,
    DEPTH,
    EXACT_FROM,
    TOP_K,
    InputError,
    MaxsimWarning,
    Option,
    UsageError,
    in_python_terms,
)
from maxsim_cli.queries import Queries, read_queries
from maxsim_cli.run import Result, Run, RunCollector
from maxsim_cli.shards import Corpus
from maxsim_cli.shards import open_corpus as _open_corpus

if TYPE_CHECKING:
    from maxsim_cli.explain import Explanation

__all__ = [
    "Corpus",
    "MaxsimWarning",
    "Queries",
    "Result",
    "Run",
    "open_corpus",
    "read_queries",
    "rerank",
    "search",
]

PathLike = str | os.PathLike
# Rerank keeps every candidate unless told otherwise.
ALL_CANDIDATES = 2**31 - 1

logger = logging.getLogger("maxsim")


def open_corpus(paths: PathLike | Sequence[PathLike], *, verify_checksums: bool = False) -> Corpus:
    """Open a corpus: a shard file, a folder of shards (with an optional ``index.json``), or a list of
    both. Nothing is read but the shards' headers, offsets and ids; ``corpus.to(device)`` makes it
    resident. Close it with ``corpus.close()`` or a ``with`` block. A shard with no documents is left out
    with a `MaxsimWarning` (``corpus.skipped`` names it).

    >>> corpus = open_corpus("sample_data/corpus")
    >>> len(corpus), corpus.dim, corpus.dtype
    (400, 384, 'float16')
    """
    from maxsim_cli.shards import input_notes

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    corpus = _open_corpus(list(paths), verify_checksums=verify_checksums)
    for note in input_notes(corpus):
        warnings.warn(note.warning(), MaxsimWarning, stacklevel=2)
    return corpus


@in_python_terms
def search(
    queries: PathLike | Queries | tuple[Sequence[str | int], Any],
    corpus: Corpus | PathLike | Sequence[PathLike] | tuple[Sequence[str | int], Any],
    *,
    k: int = 1000,
    strict: bool = False,
    device: str = "auto",
    backend: str = "auto",
    max_memory: int | str | None = None,
    max_host_memory: int | str | None = None,
    batch_queries: int | None = None,
    show_progress: bool = False,
    exact_from: Corpus | PathLike | Sequence[PathLike] | tuple[Sequence[str | int], Any] | None = None,
    depth: int | None = None,
    include: Any = None,
    exclude: Any = None,
    where: Any = None,
) -> Run:
    """The exact top-``k`` documents of ``corpus`` for every query, as a `Run`.

    ``queries``: a query shard path (or folder of them), a `Queries`, or an ``(ids, embeddings)`` pair as
    `Queries.from_embeddings` takes it. ``corpus``: a `Corpus` (resident or not, or in memory:
    `Corpus.from_embeddings`), shard path(s), or an ``(ids, embeddings)`` pair as that takes it.
    ``device``: ``auto`` (the resident corpus's device, else CUDA when there is one), ``cpu``, ``cuda``,
    ``cuda:N``. ``max_memory`` bounds the scoring device's memory, ``max_host_memory`` what the call adds
    to the process's resident set (bytes, or a size such as ``"2GiB"``; `maxsim_cli.memory`). Ties
    are broken by docno descending, so the run does not depend on batch sizes or memory budgets. A
    query file with no queries, or whose metadata names another encoder than the corpus's (or another
    L2 normalisation), gives a `MaxsimWarning` (``strict=True``: an `InputError`). Messages name these
    keyword arguments (``k=0: must be at least 1``).

    A ``corpus`` of 4-bit or 2-bit codes (`maxsim quantize`) gives approximate scores
    (``run.stats.extra["scores"] == "approximate"``). With ``exact_from`` (the corpus it was quantized
    from, in any form ``corpus`` takes) the search has two stages: the compressed ``corpus`` gives each
    query's top ``depth`` (at least ``k``; default: the larger of 1000 and ``5 * k``, for 2-bit codes of
    2000 and ``20 * k``), which are
    then scored exactly from ``exact_from``: the scores are those a search of ``exact_from`` gives.

    ``include`` / ``exclude`` filter the documents the search may return: docnos (a list, set or array)
    or a boolean mask over the corpus (numpy or torch, one entry a document in corpus order); both given:
    include minus exclude. ``where``: a condition on the metadata columns of Arrow or Parquet shards, a
    `pyarrow.compute.Expression` (``pc.field("lang") == "en"``) or its text (``'lang == "en"'``): only
    the documents it holds for may be returned. The run is the top-``k`` among the allowed documents, the
    run a search of a corpus of those documents alone gives (docs/api.md, "Filters"); with
    ``exact_from``, the filter applies to the compressed scan (``where`` reads ``exact_from``'s columns).

    >>> run = search("sample_data/queries.safetensors", "sample_data/corpus", k=3, device="cpu")
    >>> [(r.docno, r.rank) for r in run][:3]  # doctest: +ELLIPSIS
    [('...', 1), ('...', 2), ('...', 3)]
    """
    run = _score(
        queries,
        corpus,
        None,
        top_k=_at_least_one(k, TOP_K),
        strict=strict,
        device=device,
        backend=backend,
        max_memory=max_memory,
        max_host_memory=max_host_memory,
        batch_queries=None if batch_queries is None else _at_least_one(batch_queries, BATCH_QUERIES),
        show_progress=show_progress,
        exact_from=exact_from,
        depth=None if depth is None else _at_least_one(depth, DEPTH),
        include=include,
        exclude=exclude,
        where=where,
    )
    return _explainable(run, queries, corpus if exact_from is None else exact_from, device, backend)


@in_python_terms
def rerank(
    queries: PathLike | Queries | tuple[Sequence[str | int], Any],
    corpus: Corpus | PathLike | Sequence[PathLike] | tuple[Sequence[str | int], Any],
    candidates: Any,
    *,
    k: int | None = None,
    strict: bool = False,
    device: str = "auto",
    backend: str = "auto",
    max_memory: int | str | None = None,
    max_host_memory: int | str | None = None,
    show_progress: bool = False,
    include: Any = None,
    exclude: Any = None,
    where: Any = None,
) -> Run:
    """Each query's candidates re-scored by MaxSim and re-sorted, as a `Run` (cut to ``k`` per query
    when given).

    ``candidates``: a run file path (TREC, MS MARCO or ColBERT TSV, optionally gzipped), a `Run`, a
    mapping ``{qid: [docno, ...]}`` (or ``[(docno, score), ...]``), or a pandas DataFrame with ``qid``
    and ``docno`` columns (PyTerrier's). Candidates missing from the corpus are left out with a
    `MaxsimWarning` (``strict=True``: an `InputError`); a qid without a query embedding is an error.
    A query file with no queries, or from another encoder (or L2 normalisation) than the corpus, gives
    a `MaxsimWarning` too (``strict=True``: an `InputError`). ``include`` / ``exclude`` / ``where`` (as
    `search` takes them) drop the candidates outside the filter (``run.stats.extra["filtered_candidates"]``).

    >>> run = rerank("sample_data/queries.safetensors", "sample_data/corpus",
    ...              "sample_data/candidates.trec", k=5, device="cpu")
    >>> max(len(rows) for rows in run.to_dict().values())
    5
    """
    run = _score(
        queries,
        corpus,
        candidates,
        top_k=ALL_CANDIDATES if k is None else _at_least_one(k, TOP_K),
        strict=strict,
        device=device,
        backend=backend,
        max_memory=max_memory,
        max_host_memory=max_host_memory,
        batch_queries=None,
        show_progress=show_progress,
        include=include,
        exclude=exclude,
        where=where,
    )
    return _explainable(run, queries, corpus, device, backend)


def _explainable(run: Run, queries: Any, corpus: Any, device: str, backend: str) -> Run:
    """``run`` able to explain its rows (`Run.explain`): it keeps the queries (read again from their file
    at the first explanation) and the corpus (a path is opened again for each explanation)."""
    kept: list[Queries] = []

    def explainer(qid: str, docno: str, score: float | None) -> Explanation:
        from maxsim_cli.explain import explain_hits

        if not kept:
            kept.append(_as_queries(queries))
        corpus_obj, owned = _as_corpus(corpus)
        try:
            return explain_hits(
                kept[0], corpus_obj, qid, [docno], device=device, backend=backend, scores=[score]
            )[0]
        finally:
            if owned:
                corpus_obj.close()

    run.set_explainer(explainer)
    return run


# --------------------------------------------------------------------------------------------------
# shared by search and rerank


def _score(
    queries: Any,
    corpus: Any,
    candidates: Any,
    *,
    top_k: int,
    strict: bool,
    device: str,
    backend: str,
    max_memory: int | str | None,
    max_host_memory: int | str | None,
    batch_queries: int | None,
    show_progress: bool,
    exact_from: Any = None,
    depth: int | None = None,
    include: Any = None,
    exclude: Any = None,
    where: Any = None,
) -> Run:
    from maxsim_cli.scoring import dispatch, filters
    from maxsim_cli.scoring.request import ScoreRequest
    from maxsim_cli.shards import check_same_dim, input_notes, report_notes

    q = _as_queries(queries)
    corpus_obj, owned = _as_corpus(corpus)
    exact_obj, exact_owned = (None, False)
    try:
        if exact_from is not None:
            exact_obj, exact_owned = _as_corpus(exact_from)
        elif depth is not None:
            raise UsageError(f"{DEPTH.given(depth)} goes with {EXACT_FROM}: give both, or neither")
        if len(q) == 0 and q.dim == 0:  # no queries from memory, so no dim: the corpus's
            q = _no_queries(q, corpus_obj.dim)
        run_candidates = None if candidates is None else _as_candidates(candidates)
        request = ScoreRequest(
            queries=q.name,
            corpus=tuple(corpus_obj.paths) or (corpus_obj.name,),  # an in-memory corpus: its name
            output="-",
            top_k=top_k,
            candidates=_candidates_name(candidates),
            strict=strict,
            device=device,
            backend=backend,
            max_memory=_size(max_memory, "max_memory"),
            max_host_memory=_size(max_host_memory, "max_host_memory"),
            batch_queries=batch_queries,
            show_progress=show_progress,
            exact_from=None if exact_obj is None else (tuple(exact_obj.paths) or (exact_obj.name,)),
            depth=depth,
        )
        check_same_dim(q.batch, q.name, corpus_obj)
        if exact_obj is not None:
            check_same_dim(q.batch, q.name, exact_obj)
        # no queries, another encoder or normalisation: `MaxsimWarning`s (strict: `InputError`); shards
        # skipped for holding no documents were reported when the corpus was opened
        notes_of = corpus_obj if exact_obj is None else exact_obj  # the scores' corpus
        report_notes(input_notes(notes_of, q.batch, q.name, skipped=False), strict=strict, log=_log)
        # two stages: the mask is over the exact corpus (its metadata columns and deletions), which
        # holds the compressed tier's documents in the same order (checked before the scan uses it)
        if exact_obj is not None and (include is not None or exclude is not None or where is not None):
            from maxsim_cli.scoring.two_stage import check_tiers

            check_tiers(request, corpus_obj, exact_obj)
        disallowed = filters.disallowed_mask(
            corpus_obj if exact_obj is None else exact_obj,
            include,
            exclude,
            strict=strict,
            log=_log,
            where=where,
        )
        collector = RunCollector()
        # how it runs (two stages, one launch, a thread a device, the engine): `dispatch` decides
        stats = dispatch.run_call(
            request,
            corpus_obj,
            q.batch,
            collector,
            candidates=run_candidates,
            exact=exact_obj,
            log=_log,
            disallowed=disallowed,
        )
        inputs = _input_paths(q, corpus_obj, candidates)
        if exact_obj is not None:
            inputs += _input_paths(q, exact_obj, None)
        return collector.run(stats, inputs=inputs)
    finally:
        if owned:
            corpus_obj.close()
        if exact_owned and exact_obj is not None:
            exact_obj.close()


def _at_least_one(value: Any, option: Option) -> int:
    """A count argument (``k``, ``batch_queries``): a whole number of at least 1 (a bool is refused,
    though Python counts it as an int)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise UsageError(f"{option.given(value)}: must be a whole number, at least 1")
    if value < 1:
        raise UsageError(f"{option.given(value)}: must be at least 1")
    return int(value)


def _no_queries(queries: Queries, dim: int) -> Queries:
    """An empty set of queries from memory, which carries no dim, given ``dim``: scored as a query
    file without queries is (a `MaxsimWarning`, an empty run)."""
    import torch

    from maxsim_cli.shards.format import DocBatch

    empty = DocBatch([], torch.zeros(0, dim), torch.zeros(1, dtype=torch.int64), None)
    return Queries(empty, queries.name)


def _input_paths(queries: Queries, corpus: Corpus, candidates: Any) -> tuple[str, ...]:
    """The files a run was made from, which `Run.to_trec` refuses to overwrite: the query file, the
    corpus's shards and their folders (their manifests), the candidates' run file."""
    paths = [] if queries.path is None else [queries.path]
    paths += _shard_inputs(os.getcwd(), tuple(corpus.paths))
    if isinstance(candidates, (str, os.PathLike)):
        paths.append(os.fspath(candidates))
    return tuple(paths)


@functools.lru_cache(maxsize=64)
def _shard_inputs(cwd: str, shard_paths: tuple[str, ...]) -> tuple[str, ...]:
    """The shards and their folders, as `_input_paths` lists them: made once per corpus and working
    directory (``cwd``, which the absolute paths depend on), not at every call."""
    return (*shard_paths, *dict.fromkeys(os.path.dirname(os.path.abspath(p)) for p in shard_paths))


def _candidates_name(candidates: Any) -> str | None:
    """What messages call the candidates: the run file's path, else "candidates"."""
    if candidates is None:
        return None
    return os.fspath(candidates) if isinstance(candidates, (str, os.PathLike)) else "candidates"


def _log(message: str) -> None:
    """The engine's notes: warnings become `MaxsimWarning`s, the rest goes to the ``maxsim`` logger."""
    if message.startswith("warning: "):
        warnings.warn(message.removeprefix("warning: "), MaxsimWarning, stacklevel=4)
    else:
        logger.info(message)


def _as_queries(queries: Any) -> Queries:
    if isinstance(queries, Queries):
        return queries
    if isinstance(queries, (str, os.PathLike)):
        return read_queries(queries)
    if isinstance(queries, tuple) and len(queries) == 2:
        return Queries.from_embeddings(queries[0], queries[1])
    raise UsageError(
        f"queries: got {type(queries).__name__}; pass a query shard path, a Queries, or an "
        "(ids, embeddings) pair"
    )


def _as_corpus(corpus: Any) -> tuple[Corpus, bool]:
    """The corpus and whether it was opened here (and so is closed here)."""
    if isinstance(corpus, Corpus):
        return corpus, False
    if isinstance(corpus, (str, os.PathLike)) or (
        isinstance(corpus, Sequence) and all(isinstance(p, (str, os.PathLike)) for p in corpus)
    ):
        return open_corpus(corpus), True
    if isinstance(corpus, tuple) and len(corpus) == 2:  # (ids, embeddings), as for queries
        return Corpus.from_embeddings(corpus[0], corpus[1]), True
    raise UsageError(
        f"corpus: got {type(corpus).__name__}; pass a Corpus, shard file/folder path(s), or an "
        "(ids, embeddings) pair"
    )


def _size(value: int | str | None, name: str) -> int | None:
    if isinstance(value, bool):
        raise UsageError(f"{name}={value}: give a number of bytes or a size such as '2GiB'")
    if value is None or isinstance(value, int):
        if value is not None and value <= 0:
            raise UsageError(f"{name}={value}: must be positive")
        return value
    from maxsim_cli.units import parse_size

    return parse_size(str(value), option=name)


def _as_candidates(candidates: Any) -> dict[str, list[tuple[str, float]]]:
    """A first-stage run as the engine takes it: ``{qid: [(docno, score), ...]}`` in first-seen order (a
    query's docnos given alone as a `DocnoRows`, which holds their list)."""
    from maxsim_cli.run_files import read_run
    from maxsim_cli.scoring.results import DocnoRows
    from maxsim_cli.shards.lookup import join_docnos

    if isinstance(candidates, (str, os.PathLike)):
        return read_run(candidates)
    if isinstance(candidates, Run):
        return candidates.to_dict()
    if hasattr(candidates, "columns") and hasattr(candidates, "itertuples"):  # a pandas DataFrame
        missing = [c for c in ("qid", "docno") if c not in candidates.columns]
        if missing:
            raise InputError(
                f"candidates: the DataFrame has no {' or '.join(missing)} column; PyTerrier's frames "
                "have qid and docno"
            )
        scores = candidates["score"] if "score" in candidates.columns else [0.0] * len(candidates)
        grouped: dict[str, list[tuple[str, float]]] = {}
        for qid, docno, score in zip(candidates["qid"], candidates["docno"], scores, strict=True):
            grouped.setdefault(str(qid), []).append((str(docno), _first_stage_score(score, qid, docno)))
        return grouped
    if isinstance(candidates, Mapping):
        grouped = {}
        for qid, rows in candidates.items():
            if isinstance(rows, (str, bytes)) or not isinstance(rows, Iterable):
                raise InputError(
                    f"candidates: query {str(qid)!r} has {rows!r} where a list of docnos belongs; pass "
                    f"{{qid: [docno, ...]}}, e.g. {{{str(qid)!r}: [{rows!r}]}}"
                )
            if not isinstance(rows, (list, tuple)):
                rows = list(rows)
            key = str(qid)
            joined = join_docnos(rows)  # docnos alone (every row a str), the common case: kept as they are
            if joined is not None:
                if key not in grouped:
                    grouped[key] = DocnoRows(list(rows), joined)
                else:  # two keys of one qid (1 and "1"): their rows one after the other
                    grouped[key] = [*grouped[key], *zip(rows, itertools.repeat(0.0))]
                continue
            grouped[key] = list(grouped.get(key, ()))
            grouped[key].extend(
                (str(row[0]), _first_stage_score(row[1], qid, row[0]))
                if isinstance(row, tuple) and len(row) == 2
                else (str(row), 0.0)
                for row in rows
            )
        return grouped
    raise UsageError(
        f"candidates: got {type(candidates).__name__}; pass a run file path, a Run, a {{qid: [docno, ...]}} "
        "mapping or a DataFrame with qid and docno columns"
    )


def _first_stage_score(score: Any, qid: Any, docno: Any) -> float:
    """A candidate's first-stage score as a float, or an `InputError` naming the query and the docno."""
    try:
        return float(score)
    except (TypeError, ValueError):
        raise InputError(
            f"candidates: query {str(qid)!r}, docno {str(docno)!r} has the score {score!r}, not a number; "
            "give (docno, score) pairs with numeric scores, or docnos alone"
        ) from None


