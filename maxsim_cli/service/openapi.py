"""`maxsim serve`'s OpenAPI schema (``GET /openapi.json``, the ``/docs`` page): every endpoint, body and
answer, error bodies included.

The scoring routes (``POST /search``, ``POST /rerank``) are plain Starlette routes that read their raw
body (`app.http_app`: FastAPI's parameter machinery has nothing to do there and would cost each request
its dependency solving), so FastAPI cannot describe them; their path items are written here from the
models the server reads with (`schema.SearchIn`, `schema.RerankIn`) and the models below, which describe
the bytes `schema.answer_json` writes. ``/health`` and ``/metrics`` are described here too, with their
answers' models; a FastAPI route of the app described nowhere here keeps FastAPI's own description.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from maxsim_cli.service.schema import (
    ARROW_TYPE,
    DEFAULT_K,
    JSON_TYPE,
    MAX_WHERE_CHARS,
    QueryIn,
    RerankIn,
    SearchIn,
)

REF = "#/components/schemas/{model}"


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenMatchOut(_Answer):
    """One query token's term of the score (`maxsim_cli.explain.TokenMatch`)."""

    query_token: int = Field(description="The query token's index")
    doc_token: int = Field(description="The document token it matched (its index; the lowest on ties)")
    similarity: float = Field(description="Their similarity: the float32 term the score adds")
    share: float | None = Field(description="similarity / score (None when the score is 0)")
    patch: list[int] | None = Field(
        None,
        min_length=2,
        max_length=2,
        description="[row, column] of the matched token in the image's patch grid (shards with a grid only)",
    )


class ExplanationOut(_Answer):
    """Why a hit scores what it does (`Explanation.to_dict`, what ``maxsim explain --format json``
    prints)."""

    qid: str
    docno: str
    score: float
    total: float = Field(description="The similarities added in the kernel's order")
    exact: bool = Field(description="total is score bit for bit")
    order: Literal["sequential", "pairwise"] = Field(description="The order the kernel adds them in")
    doc_tokens: int = Field(description="The document's length in tokens")
    tokens: list[TokenMatchOut]
    patch_grid: list[int] | None = Field(
        None, min_length=2, max_length=2, description="[rows, columns] (shards with a grid only)"
    )
    patch_start: int | None = Field(None, description="The first patch token (shards with a grid only)")


class Hit(_Answer):
    """One document of a query's answer."""

    docno: str = Field(description="The document's id")
    score: float = Field(
        description="Its float32 MaxSim score, with enough digits to give back the same float32"
    )
    explanation: ExplanationOut | None = Field(None, description='With "explain": true only')


class SearchResult(_Answer):
    """One query's top-k, best first (score descending, ties by docno descending)."""

    qid: str = Field(description="The query's id, as a string")
    hits: list[Hit]


class SearchOut(_Answer):
    """The answer to ``POST /search``: one result per query, in the request's order."""

    results: list[SearchResult]
    scores: Literal["exact", "approximate"] | None = Field(
        None,
        description=(
            "A server of a compressed tier only (maxsim quantize --bits 4 or 2): exact with --exact-from "
            "(a search: the exact scores of the compressed tier's top depth; a rerank: from the exact "
            "tier), approximate without (the codes' scores). Absent on a server of a float or int8 "
            "corpus, whose scores are maxsim score's"
        ),
    )


class RerankResult(_Answer):
    """One query's candidates re-scored, best first (score descending, ties by docno descending), cut
    to ``k`` when given."""

    qid: str = Field(description="The query's id, as a string")
    hits: list[Hit]
    missing: list[str] = Field(description="The query's candidates that are not in the corpus")


class RerankOut(_Answer):
    """The answer to ``POST /rerank``: one result per query, in the request's order."""

    results: list[RerankResult]
    scores: Literal["exact", "approximate"] | None = Field(
        None,
        description=(
            "A server of a compressed tier only (maxsim quantize --bits 4 or 2): exact with --exact-from "
            "(a search: the exact scores of the compressed tier's top depth; a rerank: from the exact "
            "tier), approximate without (the codes' scores). Absent on a server of a float or int8 "
            "corpus, whose scores are maxsim score's"
        ),
    )


class ErrorOut(_Answer):
    """A request that cannot be answered: one line saying what is wrong and what to do."""

    detail: str = Field(description="One line: what is wrong with the request, and what to do")


class HealthOut(BaseModel):
    """``GET /health``: the corpus and what the server has done (fields may be added)."""

    status: str = Field(description='"ok"')
    documents: int = Field(description="Documents in the corpus")
    tokens: int = Field(description="Token vectors in the corpus")
    dim: int = Field(description="Values per vector")
    dtype: str = Field(description="float16, bfloat16, float32 or int8")
    devices: list[str] = Field(description="Where the corpus is resident ([]: it streams from the files)")
    requests: int = Field(description="Scoring requests answered")
    batches: int = Field(description="Batches they were scored in")
    workers: int = Field(description="HTTP worker processes (0: HTTP in the scoring process)")
    scores: Literal["exact", "approximate"] | None = Field(
        None, description="A server of a compressed tier only: what its answers' scores are"
    )
    generation: int | None = Field(
        None, description="The corpus generation served (0: a folder never changed)"
    )
    deleted: int | None = Field(None, description="Documents of that generation deleted (not counted above)")


class ReloadOut(BaseModel):
    """``POST /reload``: the generation served after the call."""

    generation: int = Field(description="The generation served now")
    previous: int = Field(description="The generation served before the call")
    changed: bool = Field(description="Whether a new generation was loaded (false: the latest was served)")


MODELS: tuple[type[BaseModel], ...] = (
    QueryIn, SearchIn, RerankIn, TokenMatchOut, ExplanationOut, Hit, SearchResult, SearchOut, RerankResult,
    RerankOut, ErrorOut, HealthOut, ReloadOut,
)  # fmt: skip

# The refusals of any request (docs/serve.md, "Errors"), each with the body `ErrorOut`.
ANY_REQUEST_ERRORS = {
    "401": "The server has a token (--token-file) and the Authorization: Bearer header is missing or wrong",
    "408": (
        "The request's line and headers took longer than --header-timeout, or its body longer than "
        "--body-timeout; the connection is closed"
    ),
    "503": (
        "At --max-connections, the connection was closed to make room for a new one (or the new one, when "
        "every open connection has a request being answered); or the server is shutting down"
    ),
}
# The refusals of the scoring endpoints.
SCORING_ERRORS = {
    "400": "The body is not JSON, not an Arrow IPC stream (or a corrupt one), or empty",
    **ANY_REQUEST_ERRORS,
    "413": "The body is over --max-request-bytes",
    "415": "Another Content-Type",
    "422": (
        "Readable but invalid: an unknown field, a wrong type, wrong dim, NaN/Inf, an empty query, duplicate "
        "qids, k < 1, scores that overflow float32, candidates for a qid the request has no query for, a "
        "docno twice, strict with missing candidates, a filter id that is empty or holds whitespace; a "
        "search's depth below k, or on a server without an exact tier; a where that is not a condition, "
        "names a column the shards lack, or compares one with a value of another type"
    ),
    "500": "A bug (logged on the server's stderr with its traceback)",
    "503": (
        "Out of memory even for this request alone, or the server is shutting down; or, at "
        "--max-connections, the connection was closed to make room for a new one"
    ),
}

SEARCH_EXAMPLE = {"queries": [{"qid": "q1", "embedding": [[0.12, -0.05, 0.33], [0.01, 0.27, -0.4]]}], "k": 10}
RERANK_EXAMPLE = {
    "queries": [{"qid": "q1", "embedding": [[0.12, -0.05, 0.33], [0.01, 0.27, -0.4]]}],
    "candidates": {"q1": ["d7", "d2", "d913"]},
    "k": 100,
    "strict": False,
}


def openapi_schema(app: Any, *, token: bool) -> dict[str, Any]:
    """The app's OpenAPI schema (made once, kept on ``app.openapi_schema``): FastAPI's for its own
    routes, then the path items written here. ``token``: the server needs a bearer token (every
    endpoint then says so)."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi
    from pydantic.json_schema import models_json_schema

    schema = get_openapi(
        title=app.title,
        version=app.version,
        summary=app.summary,
        description=app.description,
        routes=app.routes,
    )
    _, top = models_json_schema([(model, "validation") for model in MODELS], ref_template=REF)
    components = schema.setdefault("components", {})
    components.setdefault("schemas", {}).update(top["$defs"])
    schema.setdefault("paths", {}).update(
        {
            "/search": {"post": _scoring("search", SearchIn, SearchOut, SEARCH_EXAMPLE)},
            "/rerank": {"post": _scoring("rerank", RerankIn, RerankOut, RERANK_EXAMPLE)},
            "/health": {"get": _health()},
            "/metrics": {"get": _metrics()},
            "/reload": {"post": _reload()},
        }
    )
    if token:
        components["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer", "description": "The token of --token-file"}
        }
        schema["security"] = [{"bearer": []}]
    app.openapi_schema = schema
    return schema


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _errors(statuses: dict[str, str]) -> dict[str, Any]:
    return {
        status: {"description": text, "content": {JSON_TYPE: {"schema": _ref(ErrorOut)}}}
        for status, text in statuses.items()
    }


def _scoring(kind: str, request: type[BaseModel], answer: type[BaseModel], example: dict) -> dict[str, Any]:
    k_default = f"{DEFAULT_K}" if kind == "search" else "every candidate"
    parameters = [
        {
            "name": "k",
            "in": "query",
            "required": False,
            "description": f"Hits per query (Arrow bodies only: JSON bodies carry k; default {k_default})",
            "schema": {"type": "integer", "minimum": 1, "maximum": (1 << 63) - 1},
        }
    ]
    parameters.append(
        {
            "name": "where",
            "in": "query",
            "required": False,
            "description": (
                "Filter: a condition on the metadata columns of the corpus's Arrow or Parquet shards, in "
                "pyarrow's expression syntax, URL-encoded (Arrow bodies only: JSON bodies carry where)"
                + ("; the candidates it does not hold for are dropped" if kind == "rerank" else "")
            ),
            "schema": {"type": "string", "maxLength": MAX_WHERE_CHARS},
        }
    )
    if kind == "search":
        parameters.append(
            {
                "name": "depth",
                "in": "query",
                "required": False,
                "description": (
                    "A server with an exact tier (--exact-from): the compressed tier's candidates a query "
                    "whose exact scores are ranked, at least k (Arrow bodies only: JSON bodies carry depth; "
                    "default: maxsim score --exact-from's)"
                ),
                "schema": {"type": "integer", "minimum": 1, "maximum": (1 << 63) - 1},
            }
        )
    if kind == "rerank":
        parameters.append(
            {
                "name": "strict",
                "in": "query",
                "required": False,
                "description": "A candidate not in the corpus fails the request (Arrow bodies only)",
                "schema": {"type": "boolean", "default": False},
            }
        )
    parameters.append(
        {
            "name": "explain",
            "in": "query",
            "required": False,
            "description": "Every hit carries its explanation (Arrow bodies only)",
            "schema": {"type": "boolean", "default": False},
        }
    )
    arrow = (
        "The query shard stream that `maxsim score -` reads (docs/format.md): an `id` column, an "
        "`embedding` column of token vectors, `scales` for int8"
        + (", and a `candidates` column (list<utf8>: each query's docnos)" if kind == "rerank" else "")
        + "; optional `include` / `exclude` columns (list<utf8>): the request's filter, the ids of every "
        "row together"
    )
    summary = "The top-k of the whole corpus" if kind == "search" else "Re-score candidates"
    return {
        "operationId": kind,
        "summary": summary,
        "description": (
            "Exact MaxSim; the answers of `maxsim score` for the same inputs (a compressed tier served "
            "with --exact-from: those of `maxsim score --exact-from`; the answer's `scores` says which). "
            "The answer carries a `Server-Timing` header (parse, ipc with workers, queue, score, encode; "
            "milliseconds)."
        ),
        "parameters": parameters,
        "requestBody": {
            "required": True,
            "content": {
                JSON_TYPE: {"schema": _ref(request), "example": example},
                ARROW_TYPE: {"schema": {"type": "string", "format": "binary", "description": arrow}},
            },
        },
        "responses": {
            "200": {
                "description": "One result per query, in the request's order",
                "headers": {
                    "Server-Timing": {
                        "description": "Where the request's time went",
                        "schema": {"type": "string"},
                    }
                },
                "content": {JSON_TYPE: {"schema": _ref(answer)}},
            },
            **_errors(SCORING_ERRORS),
        },
    }


def _health() -> dict[str, Any]:
    return {
        "operationId": "health",
        "summary": "The corpus, and the requests and batches so far",
        "responses": {
            "200": {"description": "The server is up", "content": {JSON_TYPE: {"schema": _ref(HealthOut)}}},
            **_errors(ANY_REQUEST_ERRORS),
        },
    }


def _reload() -> dict[str, Any]:
    return {
        "operationId": "reload",
        "summary": "Serve the corpus's latest committed generation",
        "description": (
            "The new generation is loaded beside the served one and swapped; batches already started finish "
            'on the old one (docs/serve.md, "A corpus that changes")'
        ),
        "responses": {
            "200": {
                "description": "The generation served now",
                "content": {JSON_TYPE: {"schema": _ref(ReloadOut)}},
            },
            "409": {
                "description": "Nothing to reload (a corpus not opened from a folder), or the new generation "
                "cannot be opened",
                "content": {JSON_TYPE: {"schema": _ref(ErrorOut)}},
            },
            "507": {
                "description": "The new generation does not fit beside the served one: the served one stays",
                "content": {JSON_TYPE: {"schema": _ref(ErrorOut)}},
            },
            **_errors(ANY_REQUEST_ERRORS),
        },
    }


def _metrics() -> dict[str, Any]:
    return {
        "operationId": "metrics",
        "summary": "Prometheus metrics",
        "description": 'Prometheus\' text exposition format, version 0.0.4 (docs/serve.md, "GET /metrics")',
        "responses": {
            "200": {
                "description": "The metrics of every process of the server",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
            **_errors(ANY_REQUEST_ERRORS),
            **_errors(
                {
                    "404": "The server runs without prometheus-client (pip install 'maxsim[serve]') or "
                    "with --no-metrics",
                }
            ),
        },
    }
