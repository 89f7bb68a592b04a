"""What `maxsim serve` reads and writes: the JSON request models, the Arrow IPC stream, the JSON answer.

Requests are checked here, one request at a time, before they are batched with others: a request that
is malformed, has the wrong dim, NaN/Inf, an empty query, an unknown field or candidates that name no
query is refused with a `RequestError` (an HTTP status and a one-line message; the library's own
`InputError` messages where it has one), so a batch only ever holds requests that can be scored.

Two steps: `check_request` reads and checks a body into a `Checked` request of numpy arrays (no torch:
``serve --workers`` runs it in the HTTP worker processes), and `to_parsed` wraps those arrays as the
library's `Queries` (torch, in the scoring process). `parse_request` does both.

JSON (``Content-Type: application/json``)::

    POST /search  {"queries": [{"qid": "q1", "embedding": [[...], ...]}, ...], "k": 10}
    POST /rerank  {"queries": [...], "candidates": {"q1": ["d7", ...]}, "k": 100, "strict": false}

and ``"explain": true`` on either gives every hit an ``explanation`` (`maxsim_cli.explain`).

Arrow (``Content-Type: application/vnd.apache.arrow.stream``): the query shard stream that
``maxsim score -`` reads (docs/format.md: ``id``, ``embedding``, ``scales`` for int8, the metadata keys
in the schema metadata); for ``/rerank`` one more column, ``candidates`` (``list<utf8>``, one list of
docnos per query); ``k``, ``strict`` and ``explain`` as query-string parameters
(``/rerank?k=100&strict=true&explain=true``).
Every record batch is fully validated (offsets, UTF-8, null counts) before a value is read: a corrupt
stream is a 400, where an unchecked read of a bad offset would crash the process.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError
from pydantic_core import to_json

from maxsim_cli.errors import InputError, MaxsimError
from maxsim_cli.queries import IN_MEMORY_NAME, Queries, as_query_ids, check_query_lengths
from maxsim_cli.shards.format import check_ids, check_values

try:  # the serve extra's JSON reader for well-formed requests (`_read_json_fast`)
    import simdjson
except ImportError:  # pragma: no cover - the pydantic models read every request
    simdjson = None

JSON_TYPE = "application/json"
ARROW_TYPE = "application/vnd.apache.arrow.stream"
# Hits per query of a search that does not say (`maxsim score` keeps 1000; an answer in JSON is meant to
# be read, so it keeps fewer unless asked).
DEFAULT_K = 10
# How messages name the request's queries and candidates (the library calls in-memory queries
# "queries" too).
QUERIES = "queries"
CANDIDATES = "candidates"


class RequestError(Exception):
    """A request that cannot be answered: an HTTP status and a one-line message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = " ".join(str(message).split())


# --------------------------------------------------------------------------------------------------
# JSON models


INCLUDE_HELP = (
    "Filter: only these docnos may be returned (a search: the top-k among them; a rerank: the other "
    "candidates are dropped). Ids not in the corpus are skipped."
)
EXCLUDE_HELP = "Filter: these docnos are never returned; with include, include minus exclude."
WHERE_HELP = (
    "Filter: a condition on the metadata columns of the corpus's Arrow or Parquet shards, in "
    'pyarrow\'s expression syntax (lang == "en" and year >= 2020); only the documents it holds for '
    "may be returned (a rerank: the other candidates are dropped). With include / exclude: documents "
    "allowed by all of them."
)
# the longest "where" a request may carry: `maxsim_cli.scoring.where.MAX_WHERE_CHARS`, written out so
# that reading a request without one loads no pyarrow.compute
MAX_WHERE_CHARS = 4096


class _Model(BaseModel):
    # unknown fields are refused; numbers stay numbers ("1.5" is not a float here)
    model_config = ConfigDict(extra="forbid", strict=True)


class QueryIn(_Model):
    """One query: an id (unique within the request) and its token vectors, ``[tokens][dim]``."""

    qid: StrictStr | StrictInt
    embedding: list[list[float]]


class SearchIn(_Model):
    queries: list[QueryIn] = Field(min_length=1)
    k: int = Field(DEFAULT_K, ge=1)
    explain: bool = False
    include: list[StrictStr] | None = Field(None, description=INCLUDE_HELP)
    exclude: list[StrictStr] | None = Field(None, description=EXCLUDE_HELP)
    where: StrictStr | None = Field(None, max_length=MAX_WHERE_CHARS, description=WHERE_HELP)
    depth: int | None = Field(
        None,
        ge=1,
        description=(
            "A server with an exact tier (maxsim serve COMPRESSED --exact-from CORPUS): the compressed "
            "tier's candidates a query whose exact scores are ranked, at least k (default: maxsim score "
            "--exact-from's, by the codec and k)"
        ),
    )


class RerankIn(_Model):
    queries: list[QueryIn] = Field(min_length=1)
    candidates: dict[str, list[str]]
    k: int | None = Field(None, ge=1)
    strict: bool = False
    explain: bool = False
    include: list[StrictStr] | None = Field(None, description=INCLUDE_HELP)
    exclude: list[StrictStr] | None = Field(None, description=EXCLUDE_HELP)
    where: StrictStr | None = Field(None, max_length=MAX_WHERE_CHARS, description=WHERE_HELP)


# --------------------------------------------------------------------------------------------------
# parsed requests


@dataclass(eq=False)
class Parsed:
    """A checked request: its queries (packed, as the library takes them), ``k`` (None: every
    candidate), for a rerank its candidates ``{qid: [docno, ...]}`` and ``strict``, and ``explain``
    (every hit with its explanation)."""

    queries: Queries
    k: int | None
    candidates: dict[str, list[str]] | None = None
    strict: bool = False
    explain: bool = False
    # a search's filter (`maxsim_cli.scoring.filters`): the docnos it may return, and may not; a
    # rerank's is applied to its candidates when it is read
    include: list[str] | None = None
    exclude: list[str] | None = None

    @property
    def filter_key(self) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None, str | None]:
        """The filter as a key: requests of one batch with equal keys are searched together."""
        return (
            None if self.include is None else tuple(self.include),
            None if self.exclude is None else tuple(self.exclude),
            self.where,
        )

    depth: int | None = None  # a search of a server with an exact tier: the compressed tier's candidates
    # a condition on the corpus's metadata columns, as text (`maxsim_cli.scoring.where`): a search's
    # filter, or the candidates a rerank keeps (applied by the scorer, which holds the corpus)
    where: str | None = None


@dataclass(eq=False)
class Checked:
    """A checked request as numpy arrays, before any torch: the query ids, their token vectors packed
    ``[T, dim]`` (``dtype``: float32 from JSON; an Arrow stream's own dtype, bfloat16 held as int16,
    int8 with float32 per-token ``scales``), ``offsets`` int64 ``[n + 1]``, and what `Parsed` holds.
    ``name`` is how messages name the queries."""

    ids: list[str]
    embeddings: np.ndarray
    offsets: np.ndarray
    dtype: str
    scales: np.ndarray | None
    k: int | None
    candidates: dict[str, list[str]] | None = None
    strict: bool = False
    name: str = QUERIES
    explain: bool = False
    include: list[str] | None = None
    exclude: list[str] | None = None
    depth: int | None = None
    where: str | None = None


def parse_request(
    kind: str, content_type: str | None, body: bytes, params: Mapping[str, str], corpus_dim: int
) -> Parsed:
    """The request ``body`` of ``/search`` or ``/rerank`` (``kind``), checked; raises `RequestError`."""
    return to_parsed(check_request(kind, content_type, body, params, corpus_dim))


def check_request(
    kind: str, content_type: str | None, body: bytes, params: Mapping[str, str], corpus_dim: int
) -> Checked:
    """`parse_request` without torch: the checked request as numpy arrays; raises `RequestError`."""
    media = (content_type or JSON_TYPE).split(";", 1)[0].strip().lower()
    if not body:
        raise RequestError(400, "empty request body; send JSON or an Arrow IPC stream of queries")
    try:
        if media == JSON_TYPE:
            if params:
                raise RequestError(
                    422,
                    f"query-string parameter {sorted(params)[0]!r}: with JSON, k, strict and explain go in "
                    "the body",
                )
            return _parse_json(kind, body, corpus_dim)
        if media == ARROW_TYPE:
            return _parse_arrow(kind, body, params, corpus_dim)
    except MaxsimError as exc:  # InputError / UsageError: the library's one-line message
        raise RequestError(422, str(exc)) from None
    raise RequestError(
        415, f"Content-Type {media!r}: send {JSON_TYPE} or {ARROW_TYPE} (an Arrow IPC stream of queries)"
    )


def to_parsed(checked: Checked) -> Parsed:
    """The library's `Queries` over a checked request's arrays (shared, not copied)."""
    import torch

    from maxsim_cli.shards.format import DocBatch

    if checked.dtype == "bfloat16":
        embeddings = torch.from_numpy(checked.embeddings.view(np.int16)).view(torch.bfloat16)
    else:
        embeddings = torch.from_numpy(checked.embeddings)
    scales = torch.from_numpy(checked.scales) if checked.scales is not None else None
    batch = DocBatch(checked.ids, embeddings, torch.from_numpy(checked.offsets), scales)
    return Parsed(
        Queries(batch, checked.name),
        checked.k,
        checked.candidates,
        checked.strict,
        checked.explain,
        checked.include,
        checked.exclude,
        checked.depth,
        checked.where,
    )


def _parse_json(kind: str, body: bytes, corpus_dim: int) -> Checked:
    qids, arrays, k, candidates, strict, explain, include, exclude, where, depth = _read_json_fast(
        kind, body
    ) or _read_json_models(kind, body, corpus_dim)
    _check_depth(depth, k)
    ids, embeddings, offsets = _checked_queries(qids, arrays, corpus_dim)
    checked = _check_candidates(candidates, ids) if kind == "rerank" else None
    return _filtered(
        Checked(
            ids,
            embeddings,
            offsets,
            "float32",
            None,
            k,
            checked,
            strict,
            IN_MEMORY_NAME,
            explain,
            depth=depth,
        ),
        include,
        exclude,
        where,
    )


def _check_depth(depth: int | None, k: int | None) -> None:
    """A search's ``depth`` is at least its ``k``: the exact tier ranks the compressed tier's top depth."""
    if depth is not None and k is not None and depth < k:
        raise RequestError(
            422,
            f"depth: {depth} is below k ({k}); the exact scores come for the compressed tier's top depth "
            f"only: give a depth of at least {k}, or leave it out",
        )


def _filtered(
    checked: Checked, include: list[str] | None, exclude: list[str] | None, where: str | None = None
) -> Checked:
    """``checked`` with its filter (each id checked: not empty, no whitespace; ``where`` read as a
    condition, `maxsim_cli.scoring.where.parse_where`): a search keeps it for the scorer; a rerank's
    candidates outside ``include`` / ``exclude`` are dropped now (`maxsim_cli.scoring.filters`: as a mask
    over the corpus would drop them, docnos being unique), and its ``where``, which reads the corpus's
    metadata columns, is kept for the scorer (`Scorer._rerank`)."""
    for name, ids in (("include", include), ("exclude", exclude)):
        for docno in ids or ():
            if not docno or len(docno.split()) != 1 or docno.strip() != docno:
                raise RequestError(422, f"{name}: the id {docno[:60]!r} is empty or holds whitespace")
    if where is not None:
        from maxsim_cli.errors import python_terms
        from maxsim_cli.scoring.where import parse_where

        with python_terms():  # the request's field is named as the API names it: where
            parse_where(where)  # a `UsageError` (422) for what is not a condition, before any scoring
    checked.where = where
    if checked.candidates is None:
        checked.include, checked.exclude = include, exclude
        return checked
    if include is not None or exclude is not None:
        keep = set(include) if include is not None else None
        drop = set(exclude or ())
        checked.candidates = {
            qid: [d for d in docnos if (keep is None or d in keep) and d not in drop]
            for qid, docnos in checked.candidates.items()
        }
    return checked


# A JSON request as read, before the checks of `_checked_queries` and `_check_candidates`: its qids,
# each query's float32 vectors [tokens, width], k, its candidates ({} for a search), strict and explain,
# the filter's include and exclude ids and a search's where, where the request gives them (read by the
# models alone), and depth (None unless a search gives it).
_JsonRequest = tuple[
    list[str | int],
    list[np.ndarray],
    int | None,
    dict[str, list[str]],
    bool,
    bool,
    list[str] | None,
    list[str] | None,
    str | None,
    int | None,
]


def _read_json_models(kind: str, body: bytes, corpus_dim: int) -> _JsonRequest:
    """The request read by the pydantic models, which word every error: each query's rows made an
    array once they are known to have one width (in the order, and with the messages, of
    `Queries.from_embeddings`)."""
    model = SearchIn if kind == "search" else RerankIn
    try:
        request = model.model_validate_json(body)
    except ValidationError as exc:
        raise RequestError(*_validation_message(exc)) from None
    arrays = []
    for i, item in enumerate(request.queries):
        rows = item.embedding
        if not rows:
            arrays.append(np.zeros((0, corpus_dim), dtype=np.float32))  # refused by the checks: no tokens
            continue
        width = len(rows[0])
        for row in rows:
            if len(row) != width:
                raise InputError(
                    f"{QUERIES}: query {str(item.qid)!r} (index {i}) has token vectors of {width} and "
                    f"{len(row)} values; every vector of a query has dim values"
                )
        with np.errstate(over="ignore"):  # a value past float32's range is refused by the checks, as Inf
            arrays.append(np.asarray(rows, dtype=np.float32))
    qids = [item.qid for item in request.queries]
    filter_ids = (request.include, request.exclude)
    if isinstance(request, SearchIn):
        return qids, arrays, request.k, {}, False, request.explain, *filter_ids, request.where, request.depth
    rerank = (request.candidates, request.strict, request.explain)
    return qids, arrays, request.k, *rerank, *filter_ids, request.where, None


_KEYS = {
    "search": frozenset({"queries", "k", "explain", "depth"}),
    "rerank": frozenset({"queries", "candidates", "k", "strict", "explain"}),
}
_QUERY_KEYS = ["embedding", "qid"]
_PARSERS = threading.local()
# Bodies up to this size reuse their thread's parser, whose buffers grow to the largest body it read;
# a larger one gets a parser of its own, freed with it (the worker threads of large bodies would
# otherwise each keep buffers the size of the largest request, up to --max-request-bytes).
KEPT_PARSER_BYTES = 1 << 20


def _read_json_fast(kind: str, body: bytes) -> _JsonRequest | None:
    """A well-formed JSON request read by simdjson, its numbers straight into numpy: (qids, each query's
    float32 vectors, k, candidates, strict); None for anything else (without simdjson too), which the
    pydantic models then read and word the error of. The JSON numbers are most of a request's parsing:
    the models make 4,096 Python floats of a 32-token query before numpy sees them; simdjson hands them
    over as one buffer of doubles. A 1 x 1000 rerank body read and checked: 0.14 ms against 0.24 on
    2 cores (`python benchmarks/probe_serve_host.py`).

    The buffer flattens any nesting, so the shape is proven apart: every query's rows are arrays of
    one width whose numbers add up, and the body holds no ``[`` beyond those arrays, the queries' and
    the candidate lists' and the ones inside the strings. A body with a backslash (a ``\\u`` escape
    could spell a ``[`` the raw bytes do not show), duplicate keys, unknown fields, or types that
    pydantic's strict models refuse (a bool for a number, a float for ``k``) takes the models. Values
    are those of the models: doubles rounded once to float32."""
    if simdjson is None or b"\\" in body:
        return None
    parser = getattr(_PARSERS, "parser", None) if len(body) <= KEPT_PARSER_BYTES else simdjson.Parser()
    if parser is None:  # one a thread for small bodies, its buffers kept: a new one costs an allocation
        parser = _PARSERS.parser = simdjson.Parser()
    doc = None
    try:
        try:
            doc = parser.parse(body)
        except RuntimeError:  # its last document is still referred to somewhere: take a fresh parser
            parser = _PARSERS.parser = simdjson.Parser()
            doc = parser.parse(body)
        return _read_request(kind, doc, int(np.count_nonzero(np.frombuffer(body, dtype=np.uint8) == 91)))
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError):  # simdjson refused it
        return None
    finally:
        doc = None  # the parser is reused only once nothing refers to its last document


def _read_request(kind: str, doc: Any, brackets: int) -> _JsonRequest | None:
    if not isinstance(doc, simdjson.Object):
        return None
    keys = list(doc.keys())
    if len(set(keys)) != len(keys) or not _KEYS[kind].issuperset(keys) or "queries" not in keys:
        return None
    k = doc.get("k", DEFAULT_K if kind == "search" else None)
    strict = doc.get("strict", False)
    explain = doc.get("explain", False)
    if not (type(k) is int and k >= 1) and not (k is None and kind == "rerank") or type(strict) is not bool:
        return None
    if type(explain) is not bool:
        return None
    depth = doc.get("depth")
    if depth is not None and not (type(depth) is int and depth >= 1):
        return None
    queries = doc["queries"]
    if not isinstance(queries, simdjson.Array) or len(queries) == 0:
        return None
    seen = 1  # the "[" of the queries
    qids: list[str | int] = []
    arrays: list[np.ndarray] = []
    texts: list[str] = []  # strings whose "[" (byte 91) the body holds too
    for query in queries:
        if not isinstance(query, simdjson.Object) or sorted(query.keys()) != _QUERY_KEYS:
            return None
        qid, rows = query["qid"], query["embedding"]
        if type(qid) not in (str, int) or not isinstance(rows, simdjson.Array) or len(rows) == 0:
            return None
        widths = {len(row) if isinstance(row, simdjson.Array) else -1 for row in rows}
        width = widths.pop()
        if widths or width < 1:
            return None
        flat = np.frombuffer(rows.as_buffer(of_type="d"), dtype=np.float64)
        if flat.size != len(rows) * width:
            return None
        with np.errstate(over="ignore"):  # refused as Inf by the checks that follow
            arrays.append(flat.astype(np.float32).reshape(len(rows), width))
        qids.append(qid)
        if type(qid) is str:
            texts.append(qid)
        seen += 1 + len(rows)
    candidates: dict[str, list[str]] = {}
    if kind == "rerank":
        lists = doc["candidates"]
        if not isinstance(lists, simdjson.Object):
            return None
        names = list(lists.keys())
        if len(set(names)) != len(names):
            return None
        for name in names:
            docnos = lists[name]
            if not isinstance(docnos, simdjson.Array):
                return None
            docnos = docnos.as_list()
            texts.append("".join(docnos))  # a docno that is not a string: TypeError
            texts.append(name)
            candidates[name] = docnos
            seen += 1
    if brackets != seen + "".join(texts).count("["):
        return None
    return qids, arrays, k, candidates, strict, explain, None, None, None, depth  # a filter: the models


def _validation_message(exc: ValidationError) -> tuple[int, str]:
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return 400, f"malformed JSON: {first['msg'].removeprefix('Invalid JSON: ')}"
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"])
    where = where.removeprefix(".") or "body"
    if first["type"] == "extra_forbidden":
        message = f"{where}: unknown field"
    else:
        message = f"{where}: {first['msg']}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return 422, message


def _checked_queries(
    qids: Sequence[str | int], arrays: Sequence[np.ndarray], corpus_dim: int
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The ids, packed float32 vectors and offsets of a JSON request's queries (each query's vectors a
    float32 array ``[tokens, width]``), checked as `Queries.from_embeddings` checks them, then against
    the corpus's dim."""
    name = IN_MEMORY_NAME
    ids = as_query_ids(qids, name)
    check_query_lengths(ids, [a.shape[0] for a in arrays], name)
    first = arrays[0].shape[1]
    for i, a in enumerate(arrays):
        if a.shape[1] != first:
            raise InputError(
                f"{name}: query {ids[i]!r} (index {i}) has vectors of {a.shape[1]} values but "
                f"query {ids[0]!r} has {first}; encode all queries with one model"
            )
    embeddings = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum([a.shape[0] for a in arrays], out=offsets[1:])
    check_ids(name, ids, what="query id")
    check_values(name, embeddings, None, offsets, ids, 0, what="query")
    _check_dim(embeddings.shape[1], corpus_dim)
    return ids, embeddings, offsets


def _check_dim(dim: int, corpus_dim: int) -> None:
    if dim != corpus_dim:
        raise InputError(
            f"{QUERIES}: the query vectors have {dim} values but the corpus has dim {corpus_dim}; "
            "encode queries and documents with the same model"
        )


def _as_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    """Values as float32 for the NaN/Inf check (bfloat16 is held as int16: its bits are float32's top
    half)."""
    if dtype == "bfloat16":
        return (values.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return values


def _check_candidates(candidates: Mapping[str, Sequence[str]], qids: Sequence[str]) -> dict[str, list[str]]:
    """Every qid of the candidates names a query of the request; no docno twice for one query."""
    known = set(qids)
    out: dict[str, list[str]] = {}
    for qid, docnos in candidates.items():
        if qid not in known:
            raise InputError(
                f"{CANDIDATES}: query {qid!r} has candidates but no embedding in {QUERIES}; add it to the "
                "queries or drop it from the candidates"
            )
        docnos = list(docnos)
        if len(set(docnos)) != len(docnos):
            seen: set[str] = set()
            twice = next(d for d in docnos if d in seen or seen.add(d))  # type: ignore[func-returns-value]
            raise InputError(
                f"{CANDIDATES}: docno {twice!r} appears twice for query {qid!r}; list each document at "
                "most once per query"
            )
        out[qid] = docnos
    return out


# --------------------------------------------------------------------------------------------------
# Arrow IPC stream

ARROW_NAME = "<request>"  # how the Arrow shard checks name the request's stream


def _parse_arrow(kind: str, body: bytes, params: Mapping[str, str], corpus_dim: int) -> Checked:
    import pyarrow as pa

    from maxsim_cli.shards import ArrowShard
    from maxsim_cli.shards.arrow_shards import read_stream

    allowed = ("k", "explain", "depth", "where") if kind == "search" else ("k", "strict", "explain", "where")
    for name in params:
        if name not in allowed:
            raise RequestError(422, f"query-string parameter {name!r}: /{kind} takes {' and '.join(allowed)}")
    k = _int_param(params, "k", DEFAULT_K if kind == "search" else None)
    strict = _bool_param(params, "strict")
    explain = _bool_param(params, "explain")
    depth = _int_param(params, "depth", None)
    _check_depth(depth, k)
    try:
        # every record batch fully validated, before any value is read (a bad offset would be a crash)
        schema, batches = read_stream(ARROW_NAME, body)
    except InputError as exc:
        raise RequestError(400, str(exc)) from None
    with ArrowShard(ARROW_NAME, batches, schema, "arrow-stream") as shard:
        if shard.num_docs == 0:
            raise RequestError(422, f"{QUERIES}: the Arrow stream holds no queries")
        ids = list(shard.ids)
        offsets = np.asarray(shard.offsets, dtype=np.int64)
        embeddings, scales = shard.rows_numpy(0, shard.num_docs)
        dtype = shard.info.dtype
    check_values(ARROW_NAME, _as_float32(embeddings, dtype), scales, offsets, ids, 0, what="query")
    _check_dim(embeddings.shape[1], corpus_dim)
    include, exclude = (_arrow_filter(schema, batches, name) for name in ("include", "exclude"))
    if kind == "search":
        checked_search = Checked(ids, embeddings, offsets, dtype, scales, k, explain=explain, depth=depth)
        return _filtered(checked_search, include, exclude, _where_param(params))
    if "candidates" not in schema.names:
        raise RequestError(
            422, "the Arrow stream has no 'candidates' column (list<utf8>: each query's docnos) for /rerank"
        )
    if len(schema.get_all_field_indices("candidates")) > 1:
        raise RequestError(422, "the Arrow stream has more than one 'candidates' column; send one")
    column = pa.concat_arrays([b.column("candidates") for b in batches]) if batches else None
    if column is None or not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        raise RequestError(
            422, f"the 'candidates' column is {schema.field('candidates').type}; use list<utf8>"
        )
    if not (pa.types.is_string(column.type.value_type) or pa.types.is_large_string(column.type.value_type)):
        raise RequestError(422, f"the 'candidates' column is {column.type}; use list<utf8>")
    lists = column.to_pylist()
    candidates = {qid: docnos for qid, docnos in zip(ids, lists, strict=True) if docnos}
    if column.flatten().null_count:  # Arrow counts them; the query is looked for only then
        qid = next(qid for qid, docnos in candidates.items() if None in docnos)
        raise RequestError(422, f"{CANDIDATES}: query {qid!r} has a null docno")
    checked = _check_candidates(candidates, ids)
    checked_rerank = Checked(ids, embeddings, offsets, dtype, scales, k, checked, strict, explain=explain)
    return _filtered(checked_rerank, include, exclude, _where_param(params))


def _where_param(params: Mapping[str, str]) -> str | None:
    """An Arrow request's ``where`` query-string parameter (URL-encoded text), bounded in length."""
    where = params.get("where")
    if where is not None and len(where) > MAX_WHERE_CHARS:
        raise RequestError(422, f"where: {len(where)} characters; a filter may have {MAX_WHERE_CHARS}")
    return where


def _arrow_filter(schema: Any, batches: Sequence[Any], name: str) -> list[str] | None:
    """A filter's ids from the Arrow stream's ``name`` column (``list<utf8>``): the ids of every row
    together (one filter a request); None without the column."""
    import pyarrow as pa

    if name not in schema.names:
        return None
    if len(schema.get_all_field_indices(name)) > 1:
        raise RequestError(422, f"the Arrow stream has more than one {name!r} column; send one")
    field_type = schema.field(name).type
    if not (pa.types.is_list(field_type) or pa.types.is_large_list(field_type)) or not (
        pa.types.is_string(field_type.value_type) or pa.types.is_large_string(field_type.value_type)
    ):
        raise RequestError(422, f"the {name!r} column is {field_type}; use list<utf8>")
    if not batches:
        return []
    values = pa.concat_arrays([b.column(name) for b in batches]).flatten()
    if values.null_count:
        raise RequestError(422, f"{name}: a null id; give docnos")
    return values.to_pylist()


# The largest k of a query string: int64's (no corpus holds more documents; a k past the corpus's size
# gives every document). Python's int() refuses numbers of over 4,300 digits, with a ValueError.
MAX_PARAM_INT = (1 << 63) - 1


def _int_param(params: Mapping[str, str], name: str, default: int | None) -> int | None:
    if name not in params:
        return default
    text = params[name]
    # ASCII digits only: str.isdigit() takes '²' too, which int() refuses
    digits = text.lstrip("0") if text.isascii() and text.isdigit() else None
    if digits is None or not digits or len(digits) > 19 or int(digits) > MAX_PARAM_INT:
        raise RequestError(
            422, f"{name}={_show_param(text)}: must be a whole number from 1 to {MAX_PARAM_INT}"
        )
    return int(digits)


def _bool_param(params: Mapping[str, str], name: str) -> bool:
    text = params.get(name, "false").lower()
    if text not in ("true", "false", "1", "0"):
        raise RequestError(422, f"{name}={_show_param(params[name])}: must be true or false")
    return text in ("true", "1")


def _show_param(text: str, limit: int = 40) -> str:
    """A query-string value for a message: quoted, at most ``limit`` characters of it."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


# --------------------------------------------------------------------------------------------------
# answers


@dataclass(eq=False)
class Hits:
    """One query's hits, best first, as two columns: ``docnos`` and their float32 ``scores``. Iterating
    gives ``(docno, score)`` pairs, scores as Python floats; equal hits have the same docnos and scores.
    ``explanations``: each hit's explanation (`maxsim_cli.explain.Explanation.to_dict`) when the request
    asked for them, else None."""

    docnos: Sequence[str]
    scores: np.ndarray
    explanations: list[dict[str, Any]] | None = None

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[str, float]]) -> Hits:
        return cls([docno for docno, _ in pairs], np.array([s for _, s in pairs], dtype=np.float32))

    def __len__(self) -> int:
        return len(self.docnos)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Hits):
            return NotImplemented
        return list(self.docnos) == list(other.docnos) and np.array_equal(self.scores, other.scores)

    __hash__ = None  # type: ignore[assignment]

    def __iter__(self) -> Iterator[tuple[str, float]]:
        return zip(self.docnos, self.scores.tolist(), strict=True)


# One query's answer: its qid (as the request gave it), its hits, and for a rerank the candidates that
# are not in the corpus (None for a search).
QueryAnswer = tuple[str, Hits, "list[str] | None"]

_HIT_OPEN, _HIT_SEP, _HIT_NEXT = b'[{"docno":"', b'","score":', b'},{"docno":"'


def answer_json(results: Sequence[QueryAnswer], scores: str | None = None) -> bytes:
    """``{"results": [{"qid": ..., "hits": [{"docno": ..., "score": ...}, ...]}, ...]}`` (and each
    rerank result's ``"missing"`` docnos; each hit's ``"explanation"`` when the request asked for it;
    ``"scores": "exact"`` or ``"approximate"`` after the results when ``scores`` is given: a server of a
    compressed tier says which scores it answers with).
    Scores are the float32 values as Python floats, written with the shortest digits that read back as
    the same double, so as float32 too. A score that is not finite
    (which checked inputs do not give) is an error, as JSON has no such number."""
    parts = [b'{"results":[']
    for i, (qid, hits, missing) in enumerate(results):
        if not np.isfinite(hits.scores).all():
            raise ValueError(f"query {qid!r}: a score is not finite; JSON cannot carry it")
        parts += [b',{"qid":' if i else b'{"qid":', to_json(qid), b',"hits":', _hits_json(hits)]
        if missing is not None:
            parts += [b',"missing":', to_json(list(missing))]
        parts.append(b"}")
    parts.append(b"]}" if scores is None else b'],"scores":' + to_json(scores) + b"}")
    return b"".join(parts)


def _hits_json(hits: Hits) -> bytes:
    """A query's hits as a JSON array of ``{"docno", "score"}`` objects. pydantic's Rust encoder writes
    the docnos and the scores as two arrays, which are spliced into the objects when no docno needed an
    escape (the array's length says so: each docno then stands between its quotes as its own UTF-8
    bytes, and ``","`` separates them): a 1,000-hit answer encoded in 0.15 ms against 0.20 for a list of
    dicts through the same encoder on 2 cores (`python benchmarks/probe_serve_host.py`, "encode the
    answer", the two versions one after the other). A docno with a quote, a backslash or a control
    character takes the list of dicts."""
    count = len(hits)
    if count == 0:
        return b"[]"
    if hits.explanations is not None:
        return to_json(
            [
                {"docno": d, "score": s, "explanation": e}
                for (d, s), e in zip(hits, hits.explanations, strict=True)
            ]
        )
    docnos = to_json(list(hits.docnos))
    plain_bytes = len("".join(hits.docnos).encode("utf-8", "surrogatepass"))
    if len(docnos) != plain_bytes + 3 * count + 1:  # [ "d" , "d" ]: 2 quotes a docno, count - 1 commas
        return to_json([{"docno": d, "score": s} for d, s in hits])
    names = docnos[2:-2].split(b'","')
    scores = to_json(hits.scores.tolist())[1:-1].split(b",")
    objects = _HIT_NEXT.join(map(_HIT_SEP.join, zip(names, scores, strict=True)))
    return b"".join((_HIT_OPEN, objects, b"}]"))
