"""A worker process of ``maxsim serve --workers N``: HTTP on the server's socket, scoring elsewhere.

Started by the scoring process (`workers.Hub`) as ``python -m maxsim_cli.service.front --listen-fd FD
--hub PATH --worker I``. It ties itself to that process (`lifeline`: it dies with it), connects to its
Unix socket, says hello and gets the server's settings back, then runs uvicorn on the inherited
listening socket. Each request is read, its token and size checked and its body checked into arrays
here (`schema.check_request`), then sent to the scoring process (`wire`); the answer is encoded here.
``GET /health`` asks the scoring process. SIGTERM: stop accepting, finish the requests in flight, exit 0.

No torch is imported here: a worker stays small and starts in about a second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from typing import Any

from maxsim_cli import lifeline, tuning
from maxsim_cli.service.awake import Awake
from maxsim_cli.service.takeover import SOCKET_NAME as DIRECT_SOCKET


class HubClient:
    """The worker's end of its Unix socket: requests sent as they come, answers matched by id. With
    ``busy_poll_s`` > 0 the worker announces each request as it arrives (`heads_up`) and keeps its
    event loop turning while an answer is due and that long after (`Awake`)."""

    def __init__(self, sock: socket.socket, busy_poll_s: float = 0.0) -> None:
        self.sock = sock
        self._next_id = 0
        self._waiting: dict[int, asyncio.Future] = {}
        self.awake = Awake(busy_poll_s)
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task | None = None
        self._gone = False

    async def start(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(sock=self.sock)
        self._reading = asyncio.get_running_loop().create_task(self._read(reader))

    async def close(self) -> None:
        await self.awake.close()
        if self._writer is not None:
            self._writer.close()
        if self._reading is not None:
            self._reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reading

    async def _read(self, reader: asyncio.StreamReader) -> None:
        from maxsim_cli.service.wire import FrameError, read_frame

        try:
            while True:
                header, payload = await read_frame(reader)
                future = self._waiting.pop(header.get("id"), None)  # type: ignore[arg-type]
                if future is not None and not future.done():
                    future.set_result((header, payload))
        except (asyncio.IncompleteReadError, ConnectionError, FrameError):
            self._lost()

    def _lost(self) -> None:
        """The scoring process is gone (it exits, and this worker with it): fail what waits."""
        from maxsim_cli.service.schema import RequestError

        self._gone = True
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(RequestError(503, "the server is shutting down"))
        self._waiting.clear()
        os.kill(os.getpid(), signal.SIGTERM)  # stop accepting; the scoring process replaces us if alive

    async def _call(self, frame_of: Any) -> tuple[dict[str, Any], bytes]:
        from maxsim_cli.service.schema import RequestError

        if self._gone or self._writer is None:
            raise RequestError(503, "the server is shutting down")
        self._next_id += 1
        request_id = self._next_id
        future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        with self.awake.waiting():
            self._writer.write(frame_of(request_id))
            await self._writer.drain()
            return await future

    def heads_up(self) -> None:
        """A request has arrived: tell the scoring process, which wakes while this worker reads it."""
        from maxsim_cli.service.wire import SOON

        if self.awake.on and not self._gone and self._writer is not None:
            self._writer.write(SOON)

    async def submit(self, kind: str, checked: Any) -> Any:
        """Have a checked request scored: its `app.Answered` (raises the `RequestError` it fails with)."""
        from maxsim_cli.service.app import Answered
        from maxsim_cli.service.schema import RequestError
        from maxsim_cli.service.wire import answers_from_frame, request_frame

        sent = time.perf_counter()
        header, payload = await self._call(lambda request_id: request_frame(request_id, kind, checked))
        if header.get("status") != 200:
            raise RequestError(int(header["status"]), str(header["detail"]))
        answers = answers_from_frame(header, payload)
        queue_s, score_s = float(header["queue_s"]), float(header["score_s"])
        round_trip = time.perf_counter() - sent
        ipc_s = max(0.0, round_trip - queue_s - score_s)
        return Answered(answers, queue_s, score_s, int(header["batch"]), ipc_s)

    async def refresh_metrics(self) -> None:
        """Have the scoring process set its scrape-time gauges (`maxsim_cli.service.metrics`)."""
        from maxsim_cli.service.wire import pack

        await self._call(lambda request_id: pack({"op": "metrics", "id": request_id}))

    async def reload(self) -> dict[str, Any]:
        """Have the scoring process serve the corpus's latest generation (`maxsim_cli.service.reload`)."""
        from maxsim_cli.service.schema import RequestError
        from maxsim_cli.service.wire import pack

        header, _ = await self._call(lambda request_id: pack({"op": "reload", "id": request_id}))
        if header.get("status") != 200:
            raise RequestError(int(header["status"]), str(header["detail"]))
        return header["reload"]

    async def health(self) -> dict[str, Any]:
        from maxsim_cli.service.wire import pack

        header, _ = await self._call(lambda request_id: pack({"op": "health", "id": request_id}))
        return header["health"]


def run(listen_fd: int, hub_path: str, index: int) -> None:
    """Connect to the scoring process, then serve HTTP on ``listen_fd`` until SIGTERM."""
    import logging

    import uvicorn

    from maxsim_cli.service.app import GRACEFUL_SHUTDOWN_S, http_app, uvicorn_log_config
    from maxsim_cli.service.limits import ConnectionLimits, limit_connections
    from maxsim_cli.service.metrics import worker_metrics
    from maxsim_cli.service.schema import check_request
    from maxsim_cli.service.wire import pack, recv_frame

    hub = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hub.connect(hub_path)
    hub.sendall(pack({"op": "hello", "worker": index, "pid": os.getpid()}))
    config, _ = recv_frame(hub)
    client = HubClient(hub, float(config.get("busy_poll_s", 0.0)))
    metrics = worker_metrics(config.get("metrics"))  # its values where the scoring process's are
    if metrics is not None:
        metrics.refresh = client.refresh_metrics

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> Any:
        await client.start()
        try:
            yield
        finally:
            await client.close()

    app = http_app(
        check_request,
        client.submit,
        client.health,
        corpus_dim=int(config["dim"]),
        token=config["token"],
        max_request_bytes=int(config["max_request_bytes"]),
        lifespan=lifespan,
        on_request=client.heads_up,
        on_answer=client.awake.linger,
        metrics=metrics,
        scores=config.get("scores"),
        reload=client.reload,
    )
    log_config = uvicorn_log_config()
    log_config["loggers"]["uvicorn.error"]["level"] = "WARNING"  # no start-up lines from every worker
    listener = socket.socket(fileno=listen_fd)
    server_config = uvicorn.Config(
        app,
        log_config=log_config,
        access_log=bool(config["access_log"]),
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        server_header=False,
    )
    limits = ConnectionLimits(
        float(config["header_timeout_s"]), float(config["body_timeout_s"]), int(config["max_connections"])
    )
    # slow clients timed out, connections capped; the first worker says when the cap had to be lowered
    limit_connections(
        server_config, limits, log=(lambda m: _stderr(f"each serve worker: {m}")) if index == 0 else None
    )
    if config.get("direct"):  # each new connection offered to the scoring process first (`takeover`)
        from maxsim_cli.service.takeover import Offerer, offering_protocol

        server_config.http_protocol_class = offering_protocol(
            server_config.http_protocol_class, Offerer(str(config["direct"]))
        )
    server = uvicorn.Server(server_config)
    logging.getLogger("maxsim.serve").debug("serve worker %d ready", index)
    # the imported modules out of the collector's generations, as in the scoring process: its full
    # collections, which a request's allocations start, then walk only what requests made
    tuning.freeze_collector()
    _STOP["server"] = server
    if _STOP["asked"]:  # asked to stop while starting: uvicorn starts, sees it, and stops at once
        server.should_exit = True
    server.run(sockets=[listener])


def _stderr(message: str) -> None:
    print(f"maxsim: {message}", file=sys.stderr, flush=True)


# A SIGTERM noted before uvicorn serves, and the server to hand it to once there is one.
_STOP: dict[str, Any] = {"asked": False, "server": None}


def _note_stop(signum: int, frame: Any) -> None:
    _STOP["asked"] = True
    if _STOP["server"] is not None:
        _STOP["server"].should_exit = True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maxsim_cli.service.front", description=__doc__)
    parser.add_argument("--listen-fd", type=int, required=True, help="the listening socket's descriptor")
    parser.add_argument("--hub", required=True, help="the scoring process's Unix socket")
    parser.add_argument("--worker", type=int, default=0, help="this worker's number, for messages")
    args = parser.parse_args(argv)
    lifeline.tie_to_launcher(armed=False)  # dies with the scoring process
    # A SIGTERM only ever asks the worker to stop: before uvicorn serves (imports, the hello) it is
    # noted and handed to uvicorn, while it serves it is uvicorn's, after it is ignored. Several come
    # when the scoring process dies (the kernel's, the lifeline's, the lost connection's): none may end
    # the process before the `finally` below removes the orphaned socket.
    signal.signal(signal.SIGTERM, _note_stop)
    try:
        run(args.listen_fd, args.hub, args.worker)
    except Exception as exc:  # noqa: BLE001 - one line for the scoring process's log, then exit 1
        message = " ".join(f"{type(exc).__name__}: {exc}".split())
        print(f"maxsim: serve worker {args.worker}: {message}", file=sys.stderr, flush=True)
        return 1
    finally:
        # a scoring process that was killed left its socket and folder: the last worker removes them
        folder = os.path.dirname(args.hub)
        lifeline.remove_if_orphaned([args.hub, os.path.join(folder, DIRECT_SOCKET)], folder)
        metrics = sys.modules.get("maxsim_cli.service.metrics")  # there once the worker made its metrics
        if metrics is not None:
            metrics.remove_if_orphaned()
    return 0


if __name__ == "__main__":
    sys.exit(main())
