"""`maxsim serve --workers N`: HTTP in N worker processes, scoring in this one.

This process (the scoring process) holds the corpus and the one `Batcher`; it has bound the listening
socket, and starts N workers (``python -m maxsim_cli.service.front``, the socket passed by file
descriptor: never a fork of a process holding CUDA and threads). The kernel spreads the connections
over the workers; each reads HTTP, checks the token, the body's size and the request (no torch), and
sends the checked arrays here over its one Unix socket (`wire`), in a private folder (mode 0700)
removed at exit. Answers go back the same way and each worker writes the HTTP answer itself, with the
bytes and errors of the one-process server. Up to ``--direct-connections`` connections are taken over
from the workers and served here instead, without the hop (`takeover`).

Lifecycle:

- A worker dies with this process (`lifeline`: the kernel's parent-death signal, and a watcher).
- A worker that exits (killed, crashed, or sent SIGTERM alone) is logged and replaced; the requests it
  held fail with it, the others go on. A worker that exits before it is ready (it cannot start: an
  import error, ...) stops the server with a one-line error instead of being restarted in a loop.
- SIGTERM or SIGINT here: every worker gets SIGTERM, stops accepting and finishes its requests in
  flight while this process goes on scoring them; once all have exited the batcher stops, the folder is
  removed, and `serve` returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from maxsim_cli.errors import MaxsimError
from maxsim_cli.lifeline import ENV_LAUNCHER_PID
from maxsim_cli.service.awake import Awake
from maxsim_cli.service.batching import Batcher, QueryAnswer, Scorer, Timing
from maxsim_cli.service.limits import ConnectionLimits
from maxsim_cli.service.reload import Reloader
from maxsim_cli.service.schema import Parsed, to_parsed
from maxsim_cli.service.takeover import DirectConnections
from maxsim_cli.service.wire import (
    FrameError,
    answer_frame,
    checked_from_frame,
    error_frame,
    pack,
    read_frame,
)

if TYPE_CHECKING:
    from maxsim_cli.api import Corpus
    from maxsim_cli.service.metrics import Metrics

logger = logging.getLogger("maxsim.serve")

# How long a worker may take from its start to its hello (imports of FastAPI, uvicorn, pyarrow: about
# a second; much more on a loaded machine).
READY_TIMEOUT_S = 120.0
# How often the workers are looked at (a dead one is replaced within this).
POLL_S = 0.1
# Beyond the graceful shutdown's own limit, how long a worker may take to exit before it is killed.
EXIT_GRACE_S = 10.0


def auto_workers(corpus_devices: list[str]) -> int:
    """``--workers auto``: none when the CPU scores (its cores are the scorers; HTTP in the same
    process costs them nothing extra), else a quarter of the cores, 1 to 4: each worker takes about a
    core under full load, and a few of them feed the GPUs' batches faster than one event loop can
    (which spends ~1 ms of CPU per request on HTTP, JSON and the answer)."""
    if not any(device.startswith("cuda") for device in corpus_devices):
        return 0
    return min(4, max(1, (os.cpu_count() or 1) // 4))


@dataclass(eq=False)
class _Worker:
    index: int
    proc: subprocess.Popen
    started: float
    ready: bool = False
    tasks: set[asyncio.Task] = field(default_factory=set)


class Hub:
    """The scoring process of ``serve --workers`` (module doc)."""

    def __init__(
        self,
        corpus: Corpus,
        listener: socket.socket,
        workers: int,
        *,
        token: str | None,
        max_request_bytes: int,
        batch_window_ms: float,
        max_batch_queries: int,
        access_log: bool,
        health: Callable[[Batcher], dict[str, Any]],
        error_status: Callable[[BaseException], tuple[int, str]],
        graceful_shutdown_s: float,
        device: str = "auto",
        busy_poll_s: float = 0.0,
        direct_connections: int = 0,
        direct_app: Callable[[Batcher, Callable[[], None]], Any] | None = None,
        limits: ConnectionLimits | None = None,
        metrics: Metrics | None = None,
        exact: Corpus | None = None,
        watch: bool = False,
        owned: bool = False,
        exact_owned: bool = False,
    ) -> None:
        """``health``: ``GET /health``'s answer; ``error_status``: a failed request's HTTP status and
        message; ``graceful_shutdown_s``: how long a stopping worker may finish its requests (the
        HTTP side's, in `maxsim_cli.service.app`); ``busy_poll_s``: how long this process and the
        workers keep their event loops turning after a request is announced or answered (`Awake`;
        0: never); ``direct_connections``: how many HTTP connections this process takes over from the
        workers and serves itself (`maxsim_cli.service.takeover`; 0: none), with the app that
        ``direct_app(batcher, on_answer)`` makes (`app.scoring_app`); ``limits``: the time limits and the
        connection cap of every HTTP connection (`maxsim_cli.service.limits`); ``metrics``: this
        process's, in the folder the workers write theirs to (`maxsim_cli.service.metrics.shared_metrics`);
        ``exact``: the exact tier of a compressed ``corpus`` (`Scorer`). A worker's ``POST /reload``
        (and, with ``watch``, a change of the corpus's index.json) reloads the corpus here
        (`maxsim_cli.service.reload`; ``owned``, ``exact_owned``: `Reloader`'s)."""
        self.corpus = corpus
        self.health = health
        self.error_status = error_status
        self.graceful_shutdown_s = graceful_shutdown_s
        self.listener = listener
        self.count = workers
        self.limits = limits or ConnectionLimits()
        self.config = {
            "op": "config",
            "dim": corpus.dim,
            "token": token,
            "max_request_bytes": max_request_bytes,
            "access_log": access_log,
            "workers": workers,
            "busy_poll_s": busy_poll_s,
            "header_timeout_s": self.limits.header_timeout_s,
            "body_timeout_s": self.limits.body_timeout_s,
            "max_connections": self.limits.max_connections,
        }
        scorer = Scorer(corpus, device=device, exact=exact)
        self.config["scores"] = scorer.scores  # what the workers' answers say of their scores
        self.batcher = Batcher(scorer, window_s=batch_window_ms / 1000, max_queries=max_batch_queries)
        self.watch = watch
        self.metrics = metrics
        if metrics is not None:
            metrics.watch(corpus, self.batcher)
            self.config["metrics"] = metrics.folder
        self.reloader = Reloader(
            self.batcher,
            owned=owned,
            exact_owned=exact_owned,
            on_swap=metrics.show_corpus if metrics is not None else None,
        )
        # turns on a worker's heads-up, so that its request finds this loop awake; stops while the
        # batcher's thread scores (it needs the interpreter lock) or requests queue (under load the
        # loop has work enough)
        self.awake = Awake(busy_poll_s, paused=self.batcher.loaded)
        self.workers: list[_Worker] = []
        self.folder = ""
        self.path = ""
        self.direct_connections = direct_connections if direct_app is not None else 0
        self.direct_app = direct_app
        self.direct: DirectConnections | None = None

    async def run(self, on_ready: Callable[[], None]) -> None:
        """Serve until SIGTERM or SIGINT (``on_ready`` once every worker is up); raises `MaxsimError`
        when a worker cannot start."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self.batcher.start()
        if self.watch:
            self.reloader.watch()
        self.folder = tempfile.mkdtemp(prefix="maxsim-serve-")  # mode 0700: only this user connects
        self.path = os.path.join(self.folder, "hub.sock")
        server = await asyncio.start_unix_server(self._connection, self.path)
        if self.direct_connections > 0:
            self.direct = self._direct()
            self.config["direct"] = self.direct.start(self.folder)
        try:
            self.workers = [self._start(i) for i in range(self.count)]
            announced = False
            while not stop.is_set():
                self._look_after_workers()
                if not announced and all(w.ready for w in self.workers):
                    announced = True
                    on_ready()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), POLL_S)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            await asyncio.gather(
                self._stop_workers(), self.direct.close() if self.direct else asyncio.sleep(0)
            )
            server.close()
            await self.awake.close()
            await self.batcher.close()
            self.reloader.close()
            shutil.rmtree(self.folder, ignore_errors=True)

    def _direct(self) -> DirectConnections:
        """The connections taken over from the workers, served by the one-process server's app."""
        assert self.direct_app is not None
        return DirectConnections(
            self.direct_app(self.batcher, self.awake.linger),
            self.direct_connections,
            access_log=bool(self.config["access_log"]),
            graceful_shutdown_s=self.graceful_shutdown_s,
            limits=self.limits,
        )

    # ----------------------------------------------------------------------------------------------
    # the workers

    def _start(self, index: int) -> _Worker:
        command = [
            sys.executable,
            "-m",
            "maxsim_cli.service.front",
            "--listen-fd",
            str(self.listener.fileno()),
            "--hub",
            self.path,
            "--worker",
            str(index),
        ]
        proc = subprocess.Popen(
            command,
            pass_fds=(self.listener.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr.fileno(),  # stdout carries data only; a worker has none
            env={**os.environ, ENV_LAUNCHER_PID: str(os.getpid())},
            start_new_session=True,  # Ctrl-C reaches this process only, which then stops the workers
        )
        return _Worker(index, proc, time.monotonic())

    def _look_after_workers(self) -> None:
        for i, worker in enumerate(self.workers):
            status = worker.proc.poll()
            if status is None:
                if not worker.ready and time.monotonic() - worker.started > READY_TIMEOUT_S:
                    raise MaxsimError(
                        f"serve worker {worker.index} (pid {worker.proc.pid}) did not start within "
                        f"{READY_TIMEOUT_S:.0f} s"
                    )
                continue
            if not worker.ready:
                raise MaxsimError(
                    f"serve worker {worker.index} (pid {worker.proc.pid}) exited with status {status} "
                    "before it was ready (its message is above); check that 'maxsim[serve]' is installed"
                )
            logger.warning(
                "serve worker %d (pid %d) exited with status %d; its requests in flight failed; "
                "starting another",
                worker.index,
                worker.proc.pid,
                status,
            )
            self.workers[i] = self._start(worker.index)

    async def _stop_workers(self) -> None:
        """SIGTERM to every worker, then wait for them to finish their requests and exit (killed after
        the graceful shutdown's limit)."""
        for worker in self.workers:
            if worker.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.graceful_shutdown_s + EXIT_GRACE_S
        while any(w.proc.poll() is None for w in self.workers) and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        for worker in self.workers:
            if worker.proc.poll() is None:
                logger.warning(
                    "serve worker %d (pid %d) did not exit; killing it", worker.index, worker.proc.pid
                )
                worker.proc.kill()
                worker.proc.wait()
        # answers still being scored for workers that are gone are dropped; wait for them all the same
        pending = [task for worker in self.workers for task in worker.tasks]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    # ----------------------------------------------------------------------------------------------
    # the connections

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One worker's connection: its hello, then its requests until it closes."""
        worker: _Worker | None = None
        try:
            header, _ = await read_frame(reader)
            pid = header.get("pid")
            worker = next((w for w in self.workers if w.proc.pid == pid), None)
            if header.get("op") != "hello" or worker is None:
                raise FrameError("a connection that is not from a worker of this server")
            writer.write(pack(self.config))
            worker.ready = True
            while True:
                header, payload = await read_frame(reader)
                op = header.get("op")
                if op == "soon":  # a request is on its way: be awake for it
                    self.awake.linger()
                elif op == "health":
                    health = self.health(self.batcher)
                    writer.write(pack({"id": header.get("id"), "status": 200, "health": health}))
                elif op == "metrics":  # a scrape at a worker: the gauges of this process set first
                    if self.metrics is not None:
                        self.metrics.refresh_here()
                    writer.write(pack({"id": header.get("id"), "status": 200}))
                elif op == "reload":  # in a task: the reload loads on a thread while requests go on
                    task = asyncio.get_running_loop().create_task(self._reload(header.get("id"), writer))
                    worker.tasks.add(task)
                    task.add_done_callback(worker.tasks.discard)
                elif op in ("search", "rerank"):
                    self._request(worker, op, header, payload, writer)
                else:
                    raise FrameError(f"a frame with op {op!r}")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the worker has gone: the supervision sees to it
        except FrameError as exc:
            logger.error("serve worker connection closed: %s", exc)
        finally:
            writer.close()

    def _request(
        self, worker: _Worker, kind: str, header: dict[str, Any], payload: bytes, writer: asyncio.StreamWriter
    ) -> None:
        """A request frame: answered here when the server is idle and the request quick
        (`Batcher.score_now`: no task and no queue between this reader and the scorer), else queued for
        the batcher in a task of its own."""
        request_id = header.get("id")
        try:
            parsed = to_parsed(checked_from_frame(header, payload))
            timing = Timing()
            answers = self.batcher.score_now(kind, parsed, timing)
            if answers is None:
                task = asyncio.get_running_loop().create_task(self._answer(kind, request_id, parsed, writer))
                worker.tasks.add(task)
                task.add_done_callback(worker.tasks.discard)
                return
            frame = _answer_frame(request_id, answers, timing)
        except Exception as exc:  # noqa: BLE001 - every failure is one request's answer
            frame = error_frame(request_id, *self.error_status(exc))
        if not writer.is_closing():
            writer.write(frame)

    async def _reload(self, request_id: Any, writer: asyncio.StreamWriter) -> None:
        try:
            frame = pack({"id": request_id, "status": 200, "reload": await self.reloader.reload()})
        except Exception as exc:  # noqa: BLE001 - a refused reload is one line; the old generation serves
            frame = error_frame(request_id, *self.error_status(exc))
        if not writer.is_closing():
            writer.write(frame)

    async def _answer(self, kind: str, request_id: Any, parsed: Parsed, writer: asyncio.StreamWriter) -> None:
        try:
            timing = Timing()
            answers = await self.batcher.submit(kind, parsed, timing)
            frame = _answer_frame(request_id, answers, timing)
        except Exception as exc:  # noqa: BLE001 - every failure is one request's answer
            frame = error_frame(request_id, *self.error_status(exc))
        if not writer.is_closing():
            writer.write(frame)


def _answer_frame(request_id: Any, answers: list[QueryAnswer], timing: Timing) -> bytes:
    """A request's answers as a frame, with where its time went."""
    return answer_frame(request_id, answers, timing.queue_s, timing.score_s, timing.batch_requests)
