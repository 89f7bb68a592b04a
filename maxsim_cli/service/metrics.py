"""`maxsim serve`'s Prometheus metrics, ``GET /metrics`` (docs/serve.md, "GET /metrics").

What is measured, and where:

- every process that answers HTTP (the one-process server; with ``--workers N`` each worker, and the
  scoring process for the connections it takes over) counts each request by endpoint and status and
  observes its latency (`MetricsMiddleware`: a counter increment and a histogram observation a request,
  nothing held while the request is scored);
- the scoring process observes each batch's size (`BatchCounters`, from the batcher's own counters),
  sets the corpus's size once, and the queue depth and device memory at each scrape (`Metrics.watch`).

Across processes (``--workers N``) the values are prometheus_client's multiprocess mode
(`shared_metrics`): the scoring process makes a private folder (mode 0700, removed at exit), names it in
``PROMETHEUS_MULTIPROC_DIR`` for itself and its workers, and each process writes its values to its own
memory-mapped files there; a scrape, in whichever process it lands, sums them (`MultiProcessCollector`),
so every scrape sees the whole server. A worker asks the scoring process to write its scrape-time
gauges first (one round trip, `Metrics.refresh`). With ``--workers 0`` the values stay in the process's
memory, in the app's own registry.

prometheus-client comes with ``pip install 'maxsim[serve]'``; without it the server runs and
``/metrics`` answers 404 with what to install.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from maxsim_cli.service.batching import Counters

if TYPE_CHECKING:
    from maxsim_cli.api import Corpus
    from maxsim_cli.service.batching import Batcher

ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text format
NO_METRICS = (
    "/metrics: this server runs without prometheus-client; pip install 'maxsim[serve]' and restart it"
)
# Seconds. A served rerank takes ~2 ms on a GPU and ~20 ms on 2 CPU cores; a loaded search ~50 ms.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 30.0, 60.0,
)  # fmt: skip
# Requests in a batch (at most --max-batch-queries queries: 256 by default).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# The endpoint label of a path that is none of the app's routes (the label set stays bounded).
OTHER = "other"


def available() -> bool:
    """Whether prometheus-client is installed."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


class Metrics:
    """One process's metrics. ``folder``: the multiprocess folder (`shared_metrics`, `worker_metrics`),
    None for values in this process's memory, in `registry`. ``refresh``: how a process that does not
    score has the scoring process set its scrape-time gauges (a worker: a round trip)."""

    def __init__(self, folder: str | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.folder = folder
        registry = None if folder is not None else CollectorRegistry()
        self.registry = registry
        labels = ("endpoint", "status")
        self.requests = Counter(
            "maxsim_http_requests",
            "HTTP requests answered, by endpoint and status",
            labels,
            registry=registry,
        )
        self.errors = Counter(
            "maxsim_http_errors",
            "HTTP requests answered with a status of 400 or more, by endpoint and status",
            labels,
            registry=registry,
        )
        self.latency = Histogram(
            "maxsim_http_request_duration_seconds",
            "Time from a request's arrival to its answer written, by endpoint",
            ("endpoint",),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        # (endpoint, status) -> the children to update: `labels` looked up once, not per request
        self._children: dict[tuple[str, int], tuple[Any, Any, Any]] = {}
        self.refresh: Callable[[], Awaitable[None]] | None = None
        self._watched: Callable[[], None] | None = None

    def observe(self, endpoint: str, status: int, seconds: float) -> None:
        """One request answered (the hot path: two or three increments)."""
        children = self._children.get((endpoint, status))
        if children is None:
            code = str(status)
            children = (
                self.requests.labels(endpoint, code),
                self.errors.labels(endpoint, code) if status >= 400 else None,
                self.latency.labels(endpoint),
            )
            self._children[(endpoint, status)] = children
        count, error, latency = children
        count.inc()
        if error is not None:
            error.inc()
        latency.observe(seconds)

    def show_corpus(self, corpus: Corpus) -> None:
        """The corpus gauges set to ``corpus``: at the start, and after a reload swaps in a generation."""
        documents, tokens, size = self._corpus_gauges
        documents.set(corpus.num_live)
        tokens.set(corpus.num_tokens)
        size.set(corpus_bytes(corpus))

    def watch(self, corpus: Corpus, batcher: Batcher) -> None:
        """This process scores: the corpus's size now, each batch's size as it is scored (the batcher's
        counters become `BatchCounters`), and the queue depth and device memory at each scrape."""
        from prometheus_client import Gauge, Histogram

        registry = self.registry
        # in a multiprocess folder, only this process writes these: the largest of one value is it
        mode: Any = "max"

        def gauge(name: str, text: str, labels: Sequence[str] = ()) -> Any:
            return Gauge(name, text, labels, registry=registry, multiprocess_mode=mode)

        self._corpus_gauges = (
            gauge("maxsim_corpus_documents", "Documents in the corpus (deleted ones left out)"),
            gauge("maxsim_corpus_tokens", "Token vectors in the corpus"),
            gauge("maxsim_corpus_bytes", "Bytes of the corpus where it is resident"),
        )
        self.show_corpus(corpus)
        queue = gauge("maxsim_queue_depth", "Requests waiting for a batch")
        allocated = gauge(
            "maxsim_device_memory_allocated_bytes", "GPU memory held by tensors (torch)", ("device",)
        )
        reserved = gauge(
            "maxsim_device_memory_reserved_bytes", "GPU memory reserved by torch's allocator", ("device",)
        )
        total = gauge("maxsim_device_memory_total_bytes", "The GPU's memory", ("device",))
        batches = Histogram(
            "maxsim_batch_requests",
            "Requests scored together in one batch",
            buckets=BATCH_BUCKETS,
            registry=registry,
        )
        old = batcher.scorer.counters
        batcher.scorer.counters = BatchCounters(batches.observe, old)
        devices = [d for d in (corpus.device or "").split(",") if d.startswith("cuda")]

        def now() -> None:
            queue.set(batcher.queued)
            for device, (used, held, size) in device_memory(devices).items():
                allocated.labels(device).set(used)
                reserved.labels(device).set(held)
                total.labels(device).set(size)

        self._watched = now
        now()

    def refresh_here(self) -> None:
        """Set the scrape-time gauges of the scoring process (this one)."""
        if self._watched is not None:
            self._watched()

    async def scrape(self) -> bytes:
        """``GET /metrics``'s body: the scrape-time gauges set (here or by the scoring process), then every
        process's values."""
        if self._watched is not None:
            self.refresh_here()
        elif self.refresh is not None:
            await self.refresh()
        return self.exposition()

    def exposition(self) -> bytes:
        """The values in Prometheus' text format (with a folder: every process's, summed)."""
        from prometheus_client import CollectorRegistry, generate_latest

        if self.folder is None:
            return generate_latest(self.registry)
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.folder)
        return generate_latest(registry)


class BatchCounters(Counters):
    """The batcher's `Counters` that also hand each batch's size (requests) to ``observe``."""

    def __init__(self, observe: Callable[[float], None], start: Counters | None = None) -> None:
        super().__init__()
        if start is not None:  # what was counted before the metrics came
            self.batches, self.requests, self.largest = start.batches, start.requests, start.largest
            self.splits, self.sizes = start.splits, list(start.sizes)
        self._observe = observe

    def note(self, size: int) -> None:
        super().note(size)
        self._observe(size)


class MetricsMiddleware:
    """ASGI middleware: each HTTP request's endpoint (the route's path, `OTHER` for a path that is no
    route), status and time to its answer, handed to `Metrics.observe`. Outermost, so that the token's
    401s are counted too. ``routes``: the app's routes, read at the first request (all are added by
    then)."""

    def __init__(self, app: Any, metrics: Metrics, routes: Sequence[Any]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes
        self.paths: frozenset[str] | None = None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # an exception before the answer started: what the client gets

        async def sending(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            if self.paths is None:
                self.paths = frozenset(getattr(route, "path", "") for route in self.routes)
            path = scope["path"]
            self.metrics.observe(path if path in self.paths else OTHER, status, time.perf_counter() - started)


def corpus_bytes(corpus: Corpus) -> int:
    """The bytes of the corpus on its devices (vectors, int8 scales, document offsets); when it streams
    from the files, what it would take there."""
    from maxsim_cli.shards.resident import shard_bytes

    parts = corpus.placement
    residencies = [part.corpus.residency for part in parts] if parts else [corpus.residency]
    if all(r is not None for r in residencies):
        return sum(r.nbytes for r in residencies)  # type: ignore[union-attr]
    return sum(shard_bytes(shard) for shard in corpus.shards)


def device_memory(devices: Sequence[str]) -> dict[str, tuple[int, int, int]]:
    """Each CUDA device's memory: (allocated by tensors, reserved by torch's allocator, total), in bytes;
    torch's counters of this process, read without a synchronisation."""
    if not devices:
        return {}
    import torch

    out = {}
    for device in devices:
        out[device] = (
            int(torch.cuda.memory_allocated(device)),
            int(torch.cuda.memory_reserved(device)),
            int(torch.cuda.get_device_properties(device).total_memory),
        )
    return out


def _multiprocess_values(folder: str) -> None:
    """prometheus_client's values of this process in ``folder``'s memory-mapped files, from now on (it
    reads ``PROMETHEUS_MULTIPROC_DIR`` when it is imported; it may have been imported before)."""
    os.environ[ENV] = folder
    from prometheus_client import values

    if not getattr(values.ValueClass, "_multiprocess", False):
        values.ValueClass = values.MultiProcessValue()


@contextlib.contextmanager
def shared_metrics() -> Iterator[Metrics | None]:
    """The scoring process's metrics under ``serve --workers N``: values in a private folder named in
    ``PROMETHEUS_MULTIPROC_DIR`` (inherited by the workers, `worker_metrics`), the folder removed and the
    process's settings put back at exit. None without prometheus-client."""
    if not available():
        yield None
        return
    from prometheus_client import values

    before_env, before_class = os.environ.get(ENV), values.ValueClass
    folder = tempfile.mkdtemp(prefix="maxsim-metrics-")  # mode 0700: only this user reads it
    try:
        _multiprocess_values(folder)
        yield Metrics(folder)
    finally:
        close = getattr(values.ValueClass, "close_all_files", None)
        if close is not None:
            close()
        values.ValueClass = before_class
        if before_env is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before_env
        shutil.rmtree(folder, ignore_errors=True)


# The folder of this worker process's metrics (`worker_metrics`), for `remove_if_orphaned`.
_worker_folder: str | None = None


def worker_metrics(folder: str | None) -> Metrics | None:
    """A worker's metrics: its values in the scoring process's ``folder`` (None: the server has no
    metrics)."""
    global _worker_folder
    if folder is None or not available():
        return None
    _multiprocess_values(folder)
    _worker_folder = folder
    return Metrics(folder)


def remove_if_orphaned() -> None:
    """As a worker exits: when the scoring process is gone (killed, it could not remove the metrics
    folder), remove it."""
    from maxsim_cli import lifeline

    if _worker_folder is not None and lifeline.launcher_gone():
        shutil.rmtree(_worker_folder, ignore_errors=True)
