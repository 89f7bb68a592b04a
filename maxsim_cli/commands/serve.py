"""`maxsim serve`: a corpus kept resident, answering exact search and rerank requests over HTTP."""

from __future__ import annotations

from typing import Annotated

import typer

from maxsim_cli.commands import cli_errors
from maxsim_cli.errors import MaxsimError
from maxsim_cli.service.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
)

# Repeated from maxsim_cli.service.app, which imports FastAPI: `--help` stays light.
DEFAULT_MAX_REQUEST_BYTES = "64MiB"
DEFAULT_WINDOW_MS = 2.0
DEFAULT_MAX_BATCH_QUERIES = 256
DEFAULT_DIRECT_CONNECTIONS = 1


def register(app: typer.Typer) -> None:
    """Add the `serve` command to `app`."""

    @app.command("serve")
    @cli_errors
    def serve_command(
        corpus: Annotated[
            list[str],
            typer.Argument(
                help="Corpus shards: files and/or directories (with an optional index.json manifest)."
            ),
        ],
        host: str = typer.Option(
            "127.0.0.1",
            "--host",
            help="Address to listen on. Anything but loopback needs --token-file.",
        ),
        port: int = typer.Option(
            8000, "--port", help="Port to listen on (0: a free one, printed).", min=0, max=65535
        ),
        device: str = typer.Option(
            "auto", "--device", help="auto, cpu, cuda or cuda:N: where the corpus lives."
        ),
        devices: str | None = typer.Option(
            None, "--devices", help="Spread the corpus over several GPUs, e.g. 0,1 (each scores its share)."
        ),
        token_file: str | None = typer.Option(
            None,
            "--token-file",
            help="File holding a bearer token (16+ characters); clients send Authorization: Bearer <token>.",
        ),
        max_request_bytes: str = typer.Option(
            DEFAULT_MAX_REQUEST_BYTES, "--max-request-bytes", help="Largest request body, e.g. 64MiB."
        ),
        batch_window_ms: float = typer.Option(
            DEFAULT_WINDOW_MS,
            "--batch-window-ms",
            help="How long a request waits for others to share its batch (0: no wait).",
            min=0.0,
        ),
        max_batch_queries: int = typer.Option(
            DEFAULT_MAX_BATCH_QUERIES,
            "--max-batch-queries",
            help="Queries of one batch at most (a larger request is scored alone).",
            min=1,
        ),
        busy_poll_ms: float | None = typer.Option(
            None,
            "--busy-poll-ms",
            help=(
                "Keep the event loops polling (a core busy) this long after a request arrives or is "
                "answered, instead of sleeping, so that the next message needs no wake-up. Default: 2 "
                "when GPUs score, 0 (off) on the CPU."
            ),
            min=0.0,
            show_default=False,
        ),
        access_log: bool = typer.Option(False, "--access-log", help="Log every request on stderr."),
        metrics: bool = typer.Option(
            True, "--metrics/--no-metrics", help="Answer GET /metrics (Prometheus; docs/serve.md)."
        ),
        workers: str = typer.Option(
            "auto",
            "--workers",
            help=(
                "HTTP worker processes (0: HTTP in the scoring process). auto: 0 when the CPU scores (its "
                "cores are busy scoring), else a quarter of the cores, 1 to 4: on a GPU one process's "
                "HTTP and JSON work, not the GPU, caps the queries per second."
            ),
        ),
        direct_connections: int = typer.Option(
            DEFAULT_DIRECT_CONNECTIONS,
            "--direct-connections",
            help=(
                "With workers: HTTP connections the scoring process takes over and serves itself, the "
                "first ones to arrive while it holds fewer; their requests skip the hop to a worker and "
                "back (a lone client gets the latency of --workers 0). 0: none."
            ),
            min=0,
        ),
        header_timeout: float = typer.Option(
            DEFAULT_HEADER_TIMEOUT_S,
            "--header-timeout",
            help=(
                "Seconds a client has to send a request's line and headers, from its connection (or its "
                "next request's first byte); then 408 and the connection is closed."
            ),
        ),
        body_timeout: float = typer.Option(
            DEFAULT_BODY_TIMEOUT_S,
            "--body-timeout",
            help=(
                "Seconds a client has to send a request's whole body once its headers are in (then 408 "
                "and the connection is closed); also the longest a client may leave its answer unread."
            ),
        ),
        max_connections: int = typer.Option(
            DEFAULT_MAX_CONNECTIONS,
            "--max-connections",
            help=(
                "Open HTTP connections at most, in each HTTP process (the server, or each worker); "
                "lowered to fit the descriptor limit (ulimit -n). One more closes the connection that "
                "has waited longest for its client."
            ),
            min=1,
        ),
        exact_from: Annotated[
            list[str] | None,
            typer.Option(
                "--exact-from",
                help="CORPUS is a compressed tier (maxsim quantize): searches take each query's top depth "
                "from it and answer with the exact scores from these shards, the corpus it was quantized "
                "from (read per request); reranks are exact too. Repeat for several files or folders.",
            ),
        ] = None,
        watch: bool = typer.Option(
            False,
            "--watch",
            help="Serve a new generation of the corpus (maxsim add, delete, compact) as soon as its "
            "index.json changes (looked at every second), as POST /reload does.",
        ),
    ) -> None:
        """Keep a corpus resident and answer exact search and rerank requests over HTTP (JSON or Arrow).

        GET /health, POST /search, POST /rerank, POST /reload, GET /metrics, GET /openapi.json: see
        docs/serve.md.

        Example: maxsim serve corpus/ --device cuda --port 8000 --workers 4
        """
        try:
            import fastapi  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError:
            raise MaxsimError("maxsim serve needs FastAPI and uvicorn: pip install 'maxsim[serve]'") from None
        from maxsim_cli import cuda_early

        cuda_early.start(device, devices)  # the GPU's context made while torch is imported
        from maxsim_cli.devices import parse_serve_devices
        from maxsim_cli.service.app import serve
        from maxsim_cli.units import parse_size

        if devices is not None and device != "auto":
            from maxsim_cli.errors import UsageError

            raise UsageError("--device and --devices: give one of them")
        if workers.strip().lower() == "auto":
            worker_count = None
        elif workers.strip().isdigit():
            worker_count = int(workers)
        else:
            from maxsim_cli.errors import UsageError

            raise UsageError(f"--workers {workers}: a number of processes (0 or more) or auto")
        serve(
            corpus,
            host=host,
            port=port,
            device=device,
            devices=parse_serve_devices(devices) if devices is not None else None,
            token_file=token_file,
            max_request_bytes=parse_size(max_request_bytes, option="--max-request-bytes"),
            batch_window_ms=batch_window_ms,
            max_batch_queries=max_batch_queries,
            access_log=access_log,
            workers=worker_count,
            busy_poll_ms=busy_poll_ms,
            direct_connections=direct_connections,
            header_timeout=header_timeout,
            body_timeout=body_timeout,
            max_connections=max_connections,
            metrics=metrics,
            exact_from=exact_from,
            watch=watch,
        )
