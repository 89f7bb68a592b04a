"""`maxsim serve`: slow and idle clients. Time limits on reading a request and on a client that does not
read its answer, a cap on the open connections, and the descriptor budget that keeps the cap honest.

uvicorn times out only idle kept-alive connections (5 s); a client that sends half a request line, or
headers and then half a body, holds its connection (and one descriptor) for as long as it likes, and
enough of them use up the process's descriptors: the event loop can no longer accept a connection and
every new client is refused. So each HTTP connection of every serving process (the one-process server,
each `--workers` worker, the connections the scoring process takes over) runs a protocol that tracks
where its request is (`limited_protocol`):

- headers: from the connection's start, or from the first byte of the next request on a kept-alive
  connection, until the request's line and headers are in; at most ``header_timeout_s``;
- body: from the end of the headers until the whole body is in; at most ``body_timeout_s`` (and more
  while uvicorn holds the body's first bytes unread by the app: a server that is behind is no slow
  client);
- busy: the request is scored and answered (no limit: that is the server's own time); while its answer
  cannot be written because the client does not read it, at most ``body_timeout_s`` again;
- idle: between requests on a kept-alive connection (uvicorn's keep-alive timeout).

A request whose headers or body are late is answered 408 (``{"detail": ...}``, ``Connection: close``)
and its connection closed; a client that does not read its answer has its connection aborted.

The cap (`Connections`): a process holds at most ``cap`` connections. One more, and the connection that
has waited longest for its client (idle, or sending its request, or not reading its answer, ranked by
when its client last made progress) is closed to make room (503 if it was sending a request); when
every connection has a request being scored, the new one is answered 503 and closed instead. A crowd
of stalled clients thus cannot keep a new client out.

The budget (`descriptor_budget`): the event loop accepts every connection waiting in the listen queue
before the cap sees them, so a process needs descriptors for the cap, plus that queue, plus what it
holds already, plus a reserve. At start the soft descriptor limit is raised to the hard limit (as nginx's
``worker_rlimit_nofile`` or Go's runtime do), then the listen queue and, when needed, the cap are
lowered to fit what the process may open; the server says so on stderr.
"""

from __future__ import annotations

import contextlib
import http
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from maxsim_cli.errors import MaxsimError, UsageError

logger = logging.getLogger("maxsim.serve")

DEFAULT_HEADER_TIMEOUT_S = 10.0
# 64 MiB (the default --max-request-bytes) in 30 s is ~2.2 MB/s; typical requests are far smaller.
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 1024
# The listen queue (uvicorn's default backlog), and the least it is lowered to under a small limit: a
# quarter of the room, at least 16 (a queue that is full drops a connecting client's SYN, which it
# sends again only after a second).
LISTEN_BACKLOG = 2048
MIN_BACKLOG = 16
MIN_BACKLOG_SHARE = 4
# Descriptors kept free beyond those open at start: the event loop's own, a streamed corpus's files, the
# scoring process's sockets, log files.
RESERVED_DESCRIPTORS = 64
# The soft limit asked for when the hard limit is unlimited (Linux refuses more than fs.nr_open, 2^20
# by default; macOS more than OPEN_MAX, 10240).
UNLIMITED_SOFT_LIMITS = (1 << 20, 10240)
# At most one log line this often about connections closed to make room.
LIMIT_LOG_EVERY_S = 60.0

# How soon a connection whose limit passed while the server was the one holding it up is looked at again.
RECHECK_S = 0.5

HEADERS, BODY, BUSY, IDLE = "headers", "body", "busy", "idle"


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits of `maxsim serve --header-timeout --body-timeout --max-connections` (module doc)."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def check(self) -> None:
        """`UsageError` for a limit that is not a positive number."""
        for option, value in (
            ("--header-timeout", self.header_timeout_s),
            ("--body-timeout", self.body_timeout_s),
        ):
            if not value > 0 or value == float("inf"):  # also NaN
                raise UsageError(f"{option} {value}: must be a number of seconds above 0")
        if self.max_connections < 1:
            raise UsageError(f"--max-connections {self.max_connections}: must be at least 1")


# --------------------------------------------------------------------------------------------------
# descriptors


def raise_descriptor_limit() -> tuple[int, int]:
    """Raise this process's soft limit on open descriptors (RLIMIT_NOFILE) to its hard limit, as far as
    the system allows; the (soft, hard) limits after. (-1, -1) where there are none to read."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return -1, -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    targets = [hard] if hard != resource.RLIM_INFINITY else list(UNLIMITED_SOFT_LIMITS)
    for target in targets:
        if soft != resource.RLIM_INFINITY and soft >= target:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def open_descriptors() -> int:
    """How many descriptors this process holds (0 where it cannot be seen)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return len(os.listdir(folder)) - 1  # less the one listdir opened
    return 0


@dataclass(frozen=True)
class Budget:
    """The connections a process may hold (``cap``) and its listen queue (``backlog``), and why."""

    cap: int
    backlog: int
    soft_limit: int
    open_at_start: int


def descriptor_budget(max_connections: int, soft_limit: int, open_now: int) -> Budget:
    """Fit ``max_connections`` and the listen queue into ``soft_limit`` descriptors of which ``open_now``
    are held (module doc): the queue shrinks first (to a quarter of the room), then the cap.
    `MaxsimError` when not even one connection fits. A ``soft_limit`` below 0 is no limit."""
    if soft_limit < 0:
        return Budget(max_connections, LISTEN_BACKLOG, soft_limit, open_now)
    room = soft_limit - open_now - RESERVED_DESCRIPTORS
    backlog = min(LISTEN_BACKLOG, max(MIN_BACKLOG, room // MIN_BACKLOG_SHARE, room - max_connections))
    cap = min(max_connections, room - backlog)
    if cap < 1:
        raise MaxsimError(
            f"this process may open {soft_limit} descriptors and holds {open_now}: too few to serve "
            f"connections; raise the limit (ulimit -n {open_now + RESERVED_DESCRIPTORS + MIN_BACKLOG + 64} "
            "or more)"
        )
    return Budget(cap, backlog, soft_limit, open_now)


def budget_note(budget: Budget, max_connections: int) -> str | None:
    """The line that says the cap was lowered to fit the descriptor limit (None when it was not)."""
    if budget.cap >= max_connections:
        return None
    return (
        f"--max-connections {max_connections} lowered to {budget.cap}: this process may open "
        f"{budget.soft_limit} descriptors (ulimit -n) and holds {budget.open_at_start}; raise the limit "
        "for more"
    )


def limit_connections(
    config: Any, limits: ConnectionLimits, *, log: Callable[[str], None] | None = None
) -> Connections:
    """Make a uvicorn ``config``'s connections keep ``limits``: its protocol `limited_protocol`, its listen
    queue and cap fitted to the descriptors this process may open (after raising its soft limit); the
    cap's lowering said through ``log``. The `Connections` it holds."""
    soft, _ = raise_descriptor_limit()
    budget = descriptor_budget(limits.max_connections, soft, open_descriptors())
    note = budget_note(budget, limits.max_connections)
    if note is not None and log is not None:
        log(note)
    if not config.loaded:
        config.load()
    config.backlog = budget.backlog
    connections = Connections(limits, budget.cap)
    config.http_protocol_class = limited_protocol(config.http_protocol_class, connections)
    return connections


# --------------------------------------------------------------------------------------------------
# the connections of one process


class Connections:
    """The open connections of one process, and their cap (None: none; the connections the scoring
    process takes over are capped by ``--direct-connections`` before they get here)."""

    def __init__(self, limits: ConnectionLimits, cap: int | None) -> None:
        self.limits = limits
        self.cap = cap
        self.open: set[Any] = set()
        self.made_room = 0  # connections closed to make room for new ones
        self.refused = 0  # new connections refused: every open one had a request being answered
        self._logged_at = -LIMIT_LOG_EVERY_S

    def admit(self, connection: Any) -> None:
        """A new connection: held, after closing the one that waited longest when at the cap."""
        self.open.add(connection)
        if self.cap is None or len(self.open) <= self.cap:
            return
        at_limit = (
            f"the server is at its limit of {self.cap} open connections (maxsim serve --max-connections)"
        )
        waiting = [c for c in self.open if c is not connection and c.waits_for_client()]
        if waiting:
            min(waiting, key=lambda c: c.client_progress).close_for(
                503, f"{at_limit} and closed the one that waited longest for its client"
            )
            self.made_room += 1
        else:
            connection.close_for(503, f"{at_limit}, each with a request being answered; retry later")
            self.refused += 1
        now = time.monotonic()
        if now - self._logged_at >= LIMIT_LOG_EVERY_S:
            self._logged_at = now
            logger.warning(
                "at the limit of %d open connections (--max-connections): %d closed to make room for new "
                "ones, %d new ones refused so far (said at most once a minute)",
                self.cap,
                self.made_room,
                self.refused,
            )

    def discard(self, connection: Any) -> None:
        self.open.discard(connection)


def _response(status: int, detail: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """An HTTP answer with the server's one-line error body, that closes the connection."""
    body = json.dumps({"detail": detail}, ensure_ascii=False, separators=(",", ":")).encode()
    lines = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}".encode()]
    lines += [name + b": " + value for name, value in default_headers]
    lines += [b"content-type: application/json", b"content-length: %d" % len(body), b"connection: close"]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def limited_protocol(base: type, connections: Connections) -> type:
    """``base`` (uvicorn's HTTP protocol) whose connections keep ``connections``' limits (module doc).
    Where a request is, is read from uvicorn's own state after each event (its current
    ``RequestResponseCycle``: none or answered, body still coming, or being answered)."""
    limits = connections.limits

    class Limited(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._phase = IDLE
            self._deadline: Any = None  # the timer of the headers' or the body's limit
            self._unread: Any = None  # the timer of an answer the client does not read
            self.client_progress = time.monotonic()
            self._enter(HEADERS)
            connections.admit(self)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self.client_progress = time.monotonic()
            self._follow(data_came=True)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.client_progress = time.monotonic()
            self._follow(data_came=False)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._unread is None and not self.transport.is_closing():
                self._unread = self.loop.call_later(limits.body_timeout_s, self._answer_unread)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._unread is not None:
                self._unread.cancel()
                self._unread = None
                self.client_progress = time.monotonic()

        def connection_lost(self, exc: Exception | None) -> None:
            connections.discard(self)
            self._stop_timers()
            super().connection_lost(exc)

        # where the request is

        def _follow(self, data_came: bool) -> None:
            if self.transport.is_closing():
                self._stop_timers()
                return
            cycle = self.cycle
            if cycle is None or cycle.response_complete:  # between requests
                phase = HEADERS if data_came or self._phase == HEADERS else IDLE
            elif cycle.more_body:
                phase = BODY
            else:
                phase = BUSY
            if phase != self._phase:
                self._enter(phase)

        def _enter(self, phase: str) -> None:
            self._phase = phase
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            limit = {HEADERS: limits.header_timeout_s, BODY: limits.body_timeout_s}.get(phase)
            if limit is not None:
                self._deadline = self.loop.call_later(limit, self._late)

        def _stop_timers(self) -> None:
            for timer in (self._deadline, self._unread):
                if timer is not None:
                    timer.cancel()
            self._deadline = self._unread = None

        def waits_for_client(self) -> bool:
            """Whether the connection waits for its client (idle, sending its request, or not reading
            its answer) and may be closed to make room; not one being handed over to the scoring
            process (`maxsim_cli.service.takeover`), whose descriptor is in flight."""
            if self.transport.is_closing() or getattr(self, "handing_over", False):
                return False
            return self._phase != BUSY or self._unread is not None

        # closing

        def _late(self) -> None:
            self._deadline = None
            # its descriptor in flight to the scoring process, or its body's bytes read and not yet taken
            # by the app (uvicorn stops reading then): the wait is the server's, look again soon
            if getattr(self, "handing_over", False) or (self._phase == BODY and self.flow.read_paused):
                self._deadline = self.loop.call_later(RECHECK_S, self._late)
                return
            if self._phase == HEADERS:
                detail = (
                    f"the request's line and headers did not arrive within {limits.header_timeout_s:g} s "
                    "(maxsim serve --header-timeout)"
                )
            else:
                detail = (
                    f"the request's body did not arrive within {limits.body_timeout_s:g} s of its "
                    "headers (maxsim serve --body-timeout)"
                )
            logger.debug("closing a connection: %s", detail)
            self.close_for(408, detail)

        def _answer_unread(self) -> None:
            self._unread = None
            logger.debug(
                "closing a connection whose client read none of its answer for %g s", limits.body_timeout_s
            )
            connections.discard(self)
            self._stop_timers()
            self.transport.abort()

        def close_for(self, status: int, detail: str) -> None:
            """Close the connection: a client sending its request is first answered ``status`` with
            ``detail``; an idle one, or one whose answer has started, gets nothing more. An app still
            reading the body sees the client gone."""
            cycle = self.cycle
            answer_started = cycle is not None and cycle.response_started and not cycle.response_complete
            answering = self._unread is not None or answer_started
            connections.discard(self)
            self._stop_timers()
            transport = self.transport
            if transport.is_closing():
                return
            if answering:
                transport.abort()
                return
            if self._phase != IDLE:
                transport.write(_response(status, detail, self.server_state.default_headers))
            transport.close()

    Limited.__name__ = Limited.__qualname__ = f"Limited{base.__name__}"
    return Limited
