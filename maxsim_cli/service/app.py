"""`maxsim serve`: a corpus opened once and kept resident, answering exact search and rerank over HTTP.

`create_app(corpus, ...)` builds the FastAPI application (``GET /health``, ``POST /search``,
``POST /rerank``, ``GET /metrics``: `maxsim_cli.service.metrics`; ``GET /openapi.json`` and ``/docs``:
`maxsim_cli.service.openapi`) over an open corpus; `serve(paths, ...)` opens the corpus, makes it
resident, checks the address and token, and runs it under uvicorn until SIGTERM or Ctrl-C.
docs/serve.md is the guide.

Errors: every refused request gets ``{"detail": "<one line>"}`` and a status: 400 an unreadable body
(not JSON, not an Arrow stream), 401 a missing or wrong bearer token, 413 a body over the limit, 415
another Content-Type, 422 a request that is readable but invalid (unknown fields, wrong dim, NaN/Inf,
an empty query, duplicate ids, candidates without a query, ``strict`` with candidates not in the
corpus: the library's `InputError` messages), 503 out of memory even alone or shutting down, 500
anything else (logged with its traceback). None of them stops the server.
"""

from __future__ import annotations

import contextlib
import copy
import hmac
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from maxsim_cli import tuning
from maxsim_cli.errors import InputError, MaxsimError, UsageError
from maxsim_cli.service.awake import Awake
from maxsim_cli.service.batching import Batcher, QueryAnswer, Scorer, Timing, resident_on_gpus
from maxsim_cli.service.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    ConnectionLimits,
    limit_connections,
)
from maxsim_cli.service.metrics import Metrics
from maxsim_cli.service.schema import JSON_TYPE, Parsed, RequestError, answer_json, parse_request

if TYPE_CHECKING:
    from maxsim_cli.api import Corpus

logger = logging.getLogger("maxsim.serve")

DEFAULT_MAX_REQUEST_BYTES = 64 << 20
DEFAULT_WINDOW_MS = 2.0
DEFAULT_MAX_BATCH_QUERIES = 256
# How long the event loops keep turning after a request is announced or answered, when GPUs score
# (`maxsim_cli.service.awake`; docs/serve.md, "Busy polling"). Long enough for a client that sends its
# next request as soon as it has read an answer.
DEFAULT_BUSY_POLL_MS = 2.0
# With workers, the connections the scoring process serves itself (`maxsim_cli.service.takeover`): one,
# so that a lone client skips the hop to a worker, while under load its share of the HTTP work (one
# connection of many) leaves the scoring to the scoring process.
DEFAULT_DIRECT_CONNECTIONS = 1
# After SIGTERM, requests in flight get this long to finish before they are cancelled.
GRACEFUL_SHUTDOWN_S = 60
# Bodies up to this size are parsed on the event loop (well under a millisecond); larger ones on a
# worker thread, so that a big request does not hold up the small ones.
INLINE_PARSE_BYTES = 256 << 10
INLINE_ANSWER_HITS = 10_000
# --workers at most (each is a process of ~100 MB resident).
MAX_WORKERS = 64
STOPS = "(SIGTERM or Ctrl-C stops, after the requests in flight)"


def create_app(
    corpus: Corpus,
    *,
    token: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    batch_window_ms: float = DEFAULT_WINDOW_MS,
    max_batch_queries: int = DEFAULT_MAX_BATCH_QUERIES,
    device: str = "auto",
    busy_poll_ms: float = 0.0,
    metrics: bool = True,
    exact: Corpus | None = None,
    watch: bool = False,
    owned: bool = False,
    exact_owned: bool | None = None,
) -> FastAPI:
    """The application over an open ``corpus`` (resident or not; scoring on ``device``, ``auto``: the
    corpus's); ``exact``: the exact tier of a compressed ``corpus``, checked by the caller to hold the
    same documents (`serve`'s ``exact_from``). The batcher starts and stops with the application's
    lifespan (``with TestClient(app)`` in tests). ``app.state.batcher.counters`` counts the batches.
    ``busy_poll_ms``: how long the event loop keeps turning after an answer, for the next request
    (`Awake`; 0: never). ``metrics``: answer ``GET /metrics`` (`maxsim_cli.service.metrics`; needs
    prometheus-client). ``POST /reload`` serves the corpus's latest generation
    (`maxsim_cli.service.reload`); ``watch``: also when a corpus folder's index.json changes;
    ``owned``: the corpus may be closed once a reload replaces it (``exact_owned``: the exact tier;
    None: as ``owned``)."""
    from maxsim_cli.service.metrics import available
    from maxsim_cli.service.reload import Reloader

    scorer = Scorer(corpus, device=device, exact=exact)
    batcher = Batcher(scorer, window_s=batch_window_ms / 1000, max_queries=max_batch_queries)
    measured = Metrics() if metrics and available() else None
    if measured is not None:
        measured.watch(corpus, batcher)
    # stops while the batcher's thread scores (it needs the interpreter lock) or requests queue
    # (under load the loop has work enough)
    awake = Awake(busy_poll_ms / 1000, paused=batcher.loaded)
    index_ids(corpus)
    if exact is not None:
        index_ids(exact)
    reloader = Reloader(
        batcher,
        owned=owned,
        exact_owned=owned if exact_owned is None else exact_owned,
        on_swap=measured.show_corpus if measured is not None else None,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        await batcher.start()
        if watch:
            reloader.watch()
        try:
            yield
        finally:
            await awake.close()
            await batcher.close()  # every queued request is answered first
            reloader.close()

    app = scoring_app(
        batcher,
        lambda: health_of(corpus, batcher, workers=0),
        corpus_dim=corpus.dim,
        token=token,
        max_request_bytes=max_request_bytes,
        lifespan=lifespan,
        on_answer=awake.linger,
        metrics=measured,
        scores=scorer.scores,
        reload=reloader.reload,
    )
    app.state.batcher = batcher
    app.state.corpus = corpus
    app.state.reloader = reloader
    return app


def scoring_app(
    batcher: Batcher,
    health: Callable[[], dict[str, Any]],
    *,
    corpus_dim: int,
    token: str | None,
    max_request_bytes: int,
    lifespan: Callable[[FastAPI], Any] | None = None,
    on_answer: Callable[[], None] | None = None,
    metrics: Metrics | None = None,
    scores: str | None = None,
    reload: Callable[[], Awaitable[dict[str, Any]]] | None = None,
) -> FastAPI:
    """`http_app` in the process that scores: bodies read into `Parsed` requests, scored by ``batcher``
    (the one-process server's app, and the app of the connections a `--workers` server's scoring
    process takes over: `maxsim_cli.service.takeover`)."""

    async def submit(kind: str, parsed: Parsed) -> Answered:
        timing = Timing()
        answers = await batcher.submit(kind, parsed, timing)
        return Answered(answers, timing.queue_s, timing.score_s, timing.batch_requests)

    async def health_now() -> dict[str, Any]:
        return health()

    return http_app(
        parse_request,
        submit,
        health_now,
        corpus_dim=corpus_dim,
        token=token,
        max_request_bytes=max_request_bytes,
        lifespan=lifespan,
        on_answer=on_answer,
        metrics=metrics,
        scores=scores,
        reload=reload,
    )


@dataclass
class Answered:
    """A request's answers and where its time went: queued, its batch's scoring, the batch's size in
    requests, and (from a worker process) the round trip to the scoring process beyond those."""

    answers: list[QueryAnswer]
    queue_s: float
    score_s: float
    batch_requests: int
    ipc_s: float | None = None


def http_app(
    parse: Callable[[str, str | None, bytes, Mapping[str, str], int], Any],
    submit: Callable[[str, Any], Awaitable[Answered]],
    health: Callable[[], Awaitable[dict[str, Any]]],
    *,
    corpus_dim: int,
    token: str | None,
    max_request_bytes: int,
    lifespan: Callable[[FastAPI], Any] | None,
    on_request: Callable[[], None] | None = None,
    on_answer: Callable[[], None] | None = None,
    metrics: Metrics | None = None,
    scores: str | None = None,
    reload: Callable[[], Awaitable[dict[str, Any]]] | None = None,
) -> FastAPI:
    """The HTTP side of the server: ``parse`` reads a body (`schema.parse_request` in one process,
    `schema.check_request` in a worker process), ``submit`` has it scored, ``health`` says how the
    server is; ``on_request`` is called as a scoring request arrives, ``on_answer`` once its answer is
    made (`maxsim_cli.service.awake`); ``metrics``: what ``GET /metrics`` answers (None: 404). Both
    sides answer with the same bytes and errors. ``scores``: what every answer says of its scores
    (``"exact"`` or ``"approximate"``: a server of a compressed tier, `batching.scores_label`), or None.
    ``reload``: what ``POST /reload`` does (`maxsim_cli.service.reload.Reloader.reload`; None: 404)."""
    from maxsim_cli import __version__
    from maxsim_cli.service import metrics as metrics_module
    from maxsim_cli.service.openapi import openapi_schema

    app = FastAPI(
        title="maxsim",
        summary="Exact MaxSim search and rerank over a resident corpus",
        description="The guide: docs/serve.md.",
        version=__version__,
        lifespan=lifespan,
        redoc_url=None,
        swagger_ui_oauth2_redirect_url=None,
    )
    app.openapi = lambda: openapi_schema(app, token=token is not None)  # type: ignore[method-assign]

    @app.get("/health")
    async def health_route() -> dict[str, Any]:
        return await health()

    @app.get("/metrics")
    async def metrics_route() -> Response:
        if metrics is None:
            off = "this server was started with --no-metrics"
            detail = metrics_module.NO_METRICS if not metrics_module.available() else f"/metrics: {off}"
            return JSONResponse({"detail": detail}, status_code=404)
        try:
            body = await metrics.scrape()
        except Exception as exc:  # noqa: BLE001 - a worker whose scoring process is gone: 503, one line
            return error_response(exc)
        return Response(body, media_type=metrics_module.CONTENT_TYPE)

    async def answer(kind: str, request: Request) -> Response:
        if on_request is not None:
            on_request()
        try:
            body = await _read_body(request, max_request_bytes)
            started = time.perf_counter()
            args = (kind, request.headers.get("content-type"), body, request.query_params, corpus_dim)
            if len(body) <= INLINE_PARSE_BYTES:
                parsed = parse(*args)
            else:
                parsed = await run_in_threadpool(parse, *args)
            parsed_at = time.perf_counter()
            answered = await submit(kind, parsed)
            answered_at = time.perf_counter()
            if sum(len(hits) for _, hits, _ in answered.answers) <= INLINE_ANSWER_HITS:
                content = answer_json(answered.answers, scores)
            else:
                content = await run_in_threadpool(answer_json, answered.answers, scores)
            header = server_timing(parsed_at - started, answered, time.perf_counter() - answered_at)
            response = Response(content, media_type=JSON_TYPE, headers={"server-timing": header})
        except Exception as exc:  # noqa: BLE001 - every failure is one request's answer
            response = error_response(exc)
        if on_answer is not None:
            on_answer()
        return response

    # The two scoring endpoints are plain Starlette routes: FastAPI's parameter machinery has nothing to
    # do for a raw body, and costs each request its dependency solving.
    async def search(request: Request) -> Response:
        """``{"queries": [{"qid", "embedding"}, ...], "k": 10}`` or an Arrow stream (``?k=``)."""
        return await answer("search", request)

    async def rerank(request: Request) -> Response:
        """``{"queries": [...], "candidates": {qid: [docno, ...]}, "k": null, "strict": false}`` or an
        Arrow stream with a ``candidates`` column (``?k=&strict=``)."""
        return await answer("rerank", request)

    app.add_route("/search", search, methods=["POST"])
    app.add_route("/rerank", rerank, methods=["POST"])

    @app.post("/reload")
    async def reload_route() -> Response:
        """Serve the corpus's latest committed generation (docs/serve.md, "A corpus that changes")."""
        if reload is None:
            return JSONResponse({"detail": "/reload: this server cannot reload its corpus"}, status_code=404)
        try:
            return JSONResponse(await reload())
        except Exception as exc:  # noqa: BLE001 - a refused reload is one line; the old generation serves
            return error_response(exc)

    if token is not None:
        app.add_middleware(BearerToken, token=token)
    if metrics is not None:  # added last: outermost, so the token's refusals are counted too
        app.add_middleware(metrics_module.MetricsMiddleware, metrics=metrics, routes=app.routes)
    return app


def health_of(corpus: Corpus, batcher: Batcher, *, workers: int) -> dict[str, Any]:
    """``GET /health``'s answer: the corpus, the batcher's counters, the HTTP worker processes (and for
    a compressed tier what its answers' scores are: ``scores``)."""
    corpus = batcher.scorer.corpus  # the generation served now (a reload swaps it)
    health = {
        "status": "ok",
        "generation": corpus.generation,
        "documents": corpus.num_live,
        "deleted": corpus.num_deleted,
        "tokens": corpus.num_tokens,
        "dim": corpus.dim,
        "dtype": corpus.dtype,
        "devices": corpus_devices(corpus),
        "requests": batcher.counters.requests,
        "batches": batcher.counters.batches,
        "workers": workers,
    }
    scores = batcher.scorer.scores
    if scores is not None:
        health["scores"] = scores
    return health


def server_timing(parse_s: float, answered: Answered, encode_s: float) -> str:
    """The ``Server-Timing`` header of an answer (milliseconds): parsing the body, (from a worker
    process) the way to the scoring process and back, waiting for its batch, the batch's scoring
    (shared by the batch's requests: ``desc`` says how many), encoding the answer."""
    ipc = f"ipc;dur={answered.ipc_s * 1e3:.3f}, " if answered.ipc_s is not None else ""
    return (
        f"parse;dur={parse_s * 1e3:.3f}, {ipc}queue;dur={answered.queue_s * 1e3:.3f}, "
        f'score;dur={answered.score_s * 1e3:.3f};desc="batch of {answered.batch_requests}", '
        f"encode;dur={encode_s * 1e3:.3f}"
    )


def corpus_devices(corpus: Corpus) -> list[str]:
    """The devices the corpus is resident on, one a share ([] when it streams from the files)."""
    return corpus.device.split(",") if corpus.device is not None else []


def index_ids(corpus: Corpus) -> None:
    """Build the corpus's id lookup once (`Corpus.id_lookup`: 16 bytes a document), so that the first
    rerank request does not pay for it: the corpus's, and each device share's for a corpus spread over
    several (the library's `rerank` looks candidates up in each share)."""
    corpus.id_lookup()
    for part in corpus.placement or ():
        part.corpus.id_lookup()


def error_response(exc: BaseException) -> JSONResponse:
    """The one-line answer to a request that failed with ``exc`` (module doc: the statuses)."""
    status, message = error_status(exc)
    return JSONResponse({"detail": message}, status_code=status)


def error_status(exc: BaseException) -> tuple[int, str]:
    """The HTTP status and one-line message of a request that failed with ``exc``."""
    if isinstance(exc, RequestError):
        status, message = exc.status, exc.message
    elif isinstance(exc, (InputError, UsageError)):
        status, message = 422, str(exc)
    elif type(exc).__name__ == "OutOfMemoryError":  # torch's, raised even for this request alone
        status, message = 503, f"out of memory scoring this request alone: {exc}"
    elif isinstance(exc, MaxsimError):
        status, message = (503 if "out of memory" in str(exc) else 500), str(exc)
    else:
        logger.error("request failed", exc_info=exc)
        status, message = 500, f"internal error: {type(exc).__name__}: {exc}"
    return status, " ".join(message.split())


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    too_big = f"over the limit of {limit} bytes (maxsim serve --max-request-bytes)"
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"request body of {int(declared)} bytes is {too_big}")
    chunks = []
    total = 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise RequestError(413, f"request body is {too_big}")
            chunks.append(chunk)
    except ClientDisconnect:  # gone, or closed by the server's time limit: nothing to log
        raise RequestError(400, "the connection closed before the request's body arrived") from None
    return b"".join(chunks)


class BearerToken:
    """ASGI middleware: every HTTP request needs ``Authorization: Bearer <token>``, compared in
    constant time (`hmac.compare_digest`); 401 otherwise."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, given = header.partition(b" ")
            ok = scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.token)
            if not ok:
                response = JSONResponse(
                    {"detail": "missing or wrong bearer token: send Authorization: Bearer <token>"},
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# --------------------------------------------------------------------------------------------------
# the server


def read_token(path: str, log: Callable[[str], None] | None = None) -> str:
    """The bearer token in ``path`` (surrounding whitespace dropped); `UsageError` when it is empty or
    not one word of printable ASCII."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
        mode = os.stat(path).st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(
            f"--token-file {path}: cannot read it: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    if not token:
        raise UsageError(f"--token-file {path}: the file is empty; put the bearer token in it")
    if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
        raise UsageError(f"--token-file {path}: the token must be one word of printable ASCII")
    if len(token) < 16:
        raise UsageError(f"--token-file {path}: the token has {len(token)} characters; use at least 16")
    if mode & 0o077 and log is not None:
        log(f"warning: --token-file {path} can be read by other users (chmod 600 it)")
    return token


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address (127.0.0.0/8, ::1)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    addresses = {info[4][0].split("%", 1)[0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def check_bind(host: str, token: str | None) -> None:
    """Refuse an address other machines can reach unless clients must present a token."""
    if token is None and not is_loopback(host):
        raise UsageError(
            f"--host {host} is not a loopback address: other machines could query the corpus; pass "
            "--token-file FILE (clients then send Authorization: Bearer <token>) or bind 127.0.0.1"
        )


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as exc:
        raise UsageError(f"--host {host}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise MaxsimError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's logging, all of it on stderr (stdout carries data only), plus the ``maxsim`` loggers."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    config["loggers"]["maxsim"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


@contextlib.contextmanager
def _signals_end_cleanly() -> Iterator[None]:
    """uvicorn traps SIGTERM and SIGINT for its graceful shutdown and, once done, raises the signal again
    for the handler that was there before it. That handler is this no-op, so `serve` returns and the
    command exits 0 after a SIGTERM that let every request in flight finish."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def warm_up(corpus: Corpus, device: str = "auto", exact: Corpus | None = None) -> None:
    """One search and one rerank of a one-token query: the kernels are compiled or loaded now, not on a
    client's first request (with an exact tier: one two-stage search and a rerank from it too)."""
    import numpy as np

    from maxsim_cli.api import Queries, rerank, search

    queries = Queries.from_embeddings(["warm-up"], [np.zeros((1, corpus.dim), dtype=np.float32)])
    search(queries, corpus, k=1, device=device)
    first = corpus.shards[0].id_array[0].as_py()
    rerank(queries, corpus, {"warm-up": [first]}, device=device)
    if exact is not None:
        search(queries, corpus, k=1, device=device, exact_from=exact, depth=1)
        rerank(queries, exact, {"warm-up": [first]}, device=device)


def _settle_for_serving(corpus: Corpus) -> None:
    """Once the corpus is resident and the kernels loaded, the server's process-wide settings
    (`maxsim_cli.tuning`): one torch host thread on GPUs, what exists frozen out of the collector."""
    if resident_on_gpus(corpus):
        tuning.one_torch_host_thread()
    tuning.freeze_collector()


def _stderr(message: str) -> None:
    print(f"maxsim: {message}", file=sys.stderr, flush=True)


def serve(
    corpus_paths: Sequence[str] | Corpus,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    device: str = "auto",
    devices: Sequence[str] | None = None,
    token_file: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    batch_window_ms: float = DEFAULT_WINDOW_MS,
    max_batch_queries: int = DEFAULT_MAX_BATCH_QUERIES,
    access_log: bool = False,
    workers: int | None = None,
    busy_poll_ms: float | None = None,
    direct_connections: int = DEFAULT_DIRECT_CONNECTIONS,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    metrics: bool = True,
    exact_from: Sequence[str] | Corpus | None = None,
    log: Callable[[str], None] = _stderr,
    watch: bool = False,
) -> None:
    """Open the corpus, make it resident on ``device`` (or spread over ``devices``), and answer requests
    on ``host:port`` (0: a free port; the line ``serving ... on http://HOST:PORT`` on stderr says which)
    until SIGTERM or Ctrl-C, which let the requests in flight finish first. ``corpus_paths`` may be an
    open `Corpus` instead (an in-memory one too: `Corpus.from_embeddings`): served where it is resident
    unless ``device`` or ``devices`` say otherwise, and left open. ``workers``: HTTP in that
    many worker processes (`maxsim_cli.service.workers`), 0 in this one, None: `auto_workers`.
    ``busy_poll_ms``: how long the event loops keep turning for a request on its way (`Awake`); None:
    `DEFAULT_BUSY_POLL_MS` when GPUs score, 0 on the CPU (whose cores are the scorers).
    ``direct_connections``: with workers, how many HTTP connections the scoring process takes over and
    serves itself (`maxsim_cli.service.takeover`). ``header_timeout``, ``body_timeout`` (seconds),
    ``max_connections``: the limits on slow clients and open connections (`maxsim_cli.service.limits`).
    ``metrics``: answer ``GET /metrics`` (needs prometheus-client; `maxsim_cli.service.metrics`).
    ``exact_from``: the exact tier of a compressed corpus (shard paths or an open `Corpus`, left where
    it is: a path is read from its shards per request), checked to hold the corpus's documents before
    anything is made resident; searches are then two-stage and reranks exact (docs/serve.md).
    ``POST /reload`` serves the corpus's latest committed generation; ``watch``: also as soon as a
    corpus folder's index.json changes (`maxsim_cli.service.reload`)."""
    import uvicorn

    from maxsim_cli.api import Corpus, open_corpus
    from maxsim_cli.service.metrics import available, shared_metrics

    if max_request_bytes < 1:
        raise UsageError(f"--max-request-bytes {max_request_bytes}: must be positive")
    if batch_window_ms < 0:
        raise UsageError(f"--batch-window-ms {batch_window_ms}: must be 0 or more")
    if max_batch_queries < 1:
        raise UsageError(f"--max-batch-queries {max_batch_queries}: must be at least 1")
    if busy_poll_ms is not None and busy_poll_ms < 0:
        raise UsageError(f"--busy-poll-ms {busy_poll_ms}: must be 0 or more")
    if direct_connections < 0:
        raise UsageError(f"--direct-connections {direct_connections}: must be 0 or more")
    if workers is not None and not 0 <= workers <= MAX_WORKERS:
        raise UsageError(f"--workers {workers}: must be 0 to {MAX_WORKERS}, or auto")
    if exact_from is not None and devices:
        raise UsageError("--exact-from serves from one device; leave --devices out")
    limits = ConnectionLimits(header_timeout, body_timeout, max_connections)
    limits.check()
    token = read_token(token_file, log) if token_file is not None else None
    check_bind(host, token)
    if metrics and not available():
        log("warning: no prometheus-client, so no /metrics: pip install 'maxsim[serve]'")
        metrics = False
    sock = _bind(host, port)  # a port in use fails now, before the corpus is loaded
    try:
        given = corpus_paths if isinstance(corpus_paths, Corpus) else None  # the caller's: left open
        opened = contextlib.nullcontext(given) if given is not None else open_corpus(list(corpus_paths))
        with opened as corpus, _exact_tier(corpus, corpus_paths, exact_from) as exact:
            started = time.perf_counter()
            if given is None or devices or device != "auto" or corpus.device is None:
                corpus.to(list(devices) if devices else device)
            log(f"{corpus!r}: resident in {time.perf_counter() - started:.1f} s")
            if exact is not None:
                where = "resident" if exact.device is not None else "read from its shards per request"
                log(f"exact tier {exact!r}: {where}; searches take the compressed tier's top depth")
            warm_up(corpus, exact=exact)
            _settle_for_serving(corpus)
            if busy_poll_ms is None:
                busy_poll_ms = DEFAULT_BUSY_POLL_MS if resident_on_gpus(corpus) else 0.0
            if workers is None:
                from maxsim_cli.service.workers import auto_workers

                workers = auto_workers(corpus_devices(corpus))
            if workers > 0:
                with shared_metrics() if metrics else contextlib.nullcontext() as shared:
                    _serve_with_workers(
                        corpus,
                        sock,
                        workers,
                        host=host,
                        token=token,
                        max_request_bytes=max_request_bytes,
                        batch_window_ms=batch_window_ms,
                        max_batch_queries=max_batch_queries,
                        access_log=access_log,
                        busy_poll_ms=busy_poll_ms,
                        direct_connections=direct_connections,
                        limits=limits,
                        metrics=shared,
                        log=log,
                        exact=exact,
                        watch=watch,
                        owned=given is None,
                        exact_owned=not isinstance(exact_from, Corpus),
                    )
                return
            app = create_app(
                corpus,
                token=token,
                max_request_bytes=max_request_bytes,
                batch_window_ms=batch_window_ms,
                max_batch_queries=max_batch_queries,
                busy_poll_ms=busy_poll_ms,
                metrics=metrics,
                exact=exact,
                watch=watch,
                owned=given is None,
                exact_owned=not isinstance(exact_from, Corpus),
            )
            bound = sock.getsockname()[1]
            config = uvicorn.Config(
                app,
                host=host,
                port=bound,
                log_config=uvicorn_log_config(),
                access_log=access_log,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                server_header=False,
            )
            limit_connections(config, limits, log=log)  # slow clients timed out, connections capped
            server = uvicorn.Server(config)
            sock.listen(config.backlog)
            log(f"serving on {_url(host, bound)} {STOPS}")
            # the event loop and the scoring thread hand Python's lock over quickly: a request that arrives
            # while a batch is planned or merged is read without waiting out Python's 5 ms
            with _signals_end_cleanly(), tuning.quick_thread_switches():
                server.run(sockets=[sock])
            log("stopped")
    finally:
        sock.close()


@contextlib.contextmanager
def _exact_tier(
    corpus: Corpus, corpus_paths: Sequence[str] | Corpus, exact_from: Sequence[str] | Corpus | None
) -> Iterator[Corpus | None]:
    """`serve`'s exact tier: opened (a `Corpus` given is used as it is, and left open) and checked to be
    the corpus ``corpus`` was quantized from (`two_stage.check_pair`: one line naming both if not);
    None without one."""
    if exact_from is None:
        yield None
        return
    from maxsim_cli.api import Corpus as CorpusType
    from maxsim_cli.api import open_corpus
    from maxsim_cli.scoring.resources import corpus_name
    from maxsim_cli.scoring.two_stage import check_pair

    given = exact_from if isinstance(exact_from, CorpusType) else None
    opened = contextlib.nullcontext(given) if given is not None else open_corpus(list(exact_from))
    with opened as exact:
        names = [
            corpus_name(list(paths)) if not isinstance(paths, CorpusType) else (paths.name or repr(paths))
            for paths in (corpus_paths, exact_from)
        ]
        check_pair(corpus, exact, names[0], names[1])
        if exact.dim != corpus.dim:  # a quantized corpus has its source's dim: a damaged pair
            raise InputError(f"{names[1]}: dim {exact.dim}, but {names[0]} has dim {corpus.dim}")
        yield exact


def _serve_with_workers(
    corpus: Corpus,
    sock: socket.socket,
    workers: int,
    *,
    host: str,
    token: str | None,
    max_request_bytes: int,
    batch_window_ms: float,
    max_batch_queries: int,
    access_log: bool,
    busy_poll_ms: float,
    direct_connections: int,
    limits: ConnectionLimits,
    metrics: Metrics | None,
    log: Callable[[str], None],
    exact: Corpus | None = None,
    watch: bool = False,
    owned: bool = False,
    exact_owned: bool = False,
) -> None:
    """`serve`'s scoring process under ``--workers N`` (`maxsim_cli.service.workers`); ``metrics``: every
    process's, in one folder (`metrics.shared_metrics`)."""
    import asyncio
    import logging.config

    from maxsim_cli.service.workers import Hub

    logging.config.dictConfig(uvicorn_log_config())
    index_ids(corpus)
    if exact is not None:
        index_ids(exact)
    hub = Hub(
        corpus,
        sock,
        workers,
        token=token,
        max_request_bytes=max_request_bytes,
        batch_window_ms=batch_window_ms,
        max_batch_queries=max_batch_queries,
        access_log=access_log,
        health=lambda batcher: health_of(batcher.scorer.corpus, batcher, workers=workers),
        error_status=error_status,
        graceful_shutdown_s=GRACEFUL_SHUTDOWN_S,
        busy_poll_s=busy_poll_ms / 1000,
        direct_connections=direct_connections,
        limits=limits,
        direct_app=lambda batcher, on_answer: scoring_app(
            batcher,
            lambda: health_of(batcher.scorer.corpus, batcher, workers=workers),
            corpus_dim=corpus.dim,
            token=token,
            max_request_bytes=max_request_bytes,
            on_answer=on_answer,
            metrics=metrics,
            scores=batcher.scorer.scores,
            reload=lambda: hub.reloader.reload(),
        ),
        metrics=metrics,
        exact=exact,
        watch=watch,
        owned=owned,
        exact_owned=exact_owned,
    )
    bound = sock.getsockname()[1]
    sock.listen(2048)

    def ready() -> None:
        log(f"serving on {_url(host, bound)} with {workers} HTTP worker processes {STOPS}")

    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    try:
        with tuning.quick_thread_switches():
            loop.run_until_complete(hub.run(ready))
    finally:
        loop.close()
    log("stopped")
