"""`maxsim serve --workers N`: the scoring process takes over a few HTTP connections and serves them itself.

A request that a worker reads crosses to the scoring process and back (`wire`): ~0.8-0.9 ms of a one-client
rerank's ~3.4-3.8 ms on the H200 host, where the one-process server (`--workers 0`) answers the same
request in ~2.1-2.8 ms (docs/serve.md). The workers are there for load: under 64 clients their parsing
and encoding in parallel carry 1,100+ queries/s where one process carries ~770. So the scoring process
serves up to ``--direct-connections`` connections itself, the first ones to come while it holds fewer,
and the workers serve the others: a client alone is answered without the hop, and a crowd of clients is
served by the workers as before (the scoring process's share is one connection of many).

How a connection changes hands: the worker that accepted it holds what it reads of it (from its
protocol's ``connection_made``) and, once its turn comes (the offers go one at a time), pauses it and
offers its descriptor over a second Unix socket in the server's private folder (``direct.sock``;
SCM_RIGHTS, `socket.send_fds`). The scoring process answers one byte: ``n`` (no slot,
or stopping), and the worker resumes the connection and serves it; or ``y``, and the worker sends the
bytes its event loop had read from the connection before the pause took hold (a 4-byte length, then
the bytes: a client that writes its request at once may have them there) and closes its copy; the
scoring process then makes the connection its own (an HTTP protocol of the one-process server's app on
the same descriptor, `loop.connect_accepted_socket`, fed those bytes first). Closing a copy of a
descriptor ends nothing: the connection ends when its last holder closes it. Answers and errors are
the one-process server's, byte for byte (the same `app.http_app` over the same batcher);
``Server-Timing`` has no ``ipc`` for them.

SIGTERM: the scoring process stops taking connections, lets each one it holds finish the request in
flight (``Connection: close``), and closes them once answered (at most the graceful shutdown's limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from maxsim_cli.service.limits import ConnectionLimits, Connections, limited_protocol

logger = logging.getLogger("maxsim.serve")

SOCKET_NAME = "direct.sock"
TAKEN, DECLINED = b"y", b"n"


class DirectConnections:
    """The scoring process's side: up to ``limit`` HTTP connections taken over from the workers and served
    by ``app`` (an ASGI app: `app.http_app` over the scoring process's batcher)."""

    def __init__(
        self,
        app: Any,
        limit: int,
        *,
        access_log: bool,
        graceful_shutdown_s: float,
        limits: ConnectionLimits | None = None,
    ) -> None:
        """``limits``: the time limits of the connections' requests (their number is ``limit``)."""
        import uvicorn
        from uvicorn.server import ServerState

        self.limit = limit
        self.graceful_shutdown_s = graceful_shutdown_s
        config = uvicorn.Config(
            app, log_config=None, access_log=access_log, server_header=False, lifespan="off"
        )
        config.load()
        self._state = ServerState()
        timed = limited_protocol(config.http_protocol_class, Connections(limits or ConnectionLimits(), None))
        self._protocol = functools.partial(
            _fed_protocol(timed), config=config, server_state=self._state, app_state={}
        )
        self._taking = 0  # descriptors accepted, their protocols not made yet
        self._stopping = False
        self._listener: socket.socket | None = None
        self._peer_state: dict[socket.socket, _Peer] = {}

    @property
    def held(self) -> int:
        return len(self._state.connections) + self._taking

    def start(self, folder: str) -> str:
        """Listen for the workers' offers at ``folder``/direct.sock; its path."""
        path = os.path.join(folder, SOCKET_NAME)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        asyncio.get_running_loop().add_reader(listener.fileno(), self._accept_worker)
        return path

    def _accept_worker(self) -> None:
        assert self._listener is not None
        try:
            peer, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        peer.setblocking(False)
        self._peer_state[peer] = _Peer()
        asyncio.get_running_loop().add_reader(peer.fileno(), self._offers, peer)

    def _offers(self, peer: socket.socket) -> None:
        """Messages from one worker, in order: an offer (``o`` and a descriptor), answered ``y`` or
        ``n``; after a ``y``, the bytes read before the hand-over (length, bytes)."""
        state = self._peer_state[peer]
        try:
            message, fds, _, _ = socket.recv_fds(peer, 1 << 16, 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            message, fds = b"", []
        if not message and not fds:  # the worker has gone
            self._drop(peer)
            return
        state.data += message
        state.fds.extend(fds)
        while True:
            if state.taking is None:  # an offer
                if not state.data or not state.fds:
                    return
                del state.data[:1]
                fd = state.fds.pop(0)
                if self._stopping or self.held >= self.limit:
                    os.close(fd)
                    self._reply(peer, DECLINED)
                    continue
                state.taking = fd
                self._taking += 1
                self._reply(peer, TAKEN)
            else:  # the bytes read before the hand-over
                if len(state.data) < 4:
                    return
                size = int.from_bytes(state.data[:4], "little")
                if len(state.data) < 4 + size:
                    return
                prefix = bytes(state.data[4 : 4 + size])
                del state.data[: 4 + size]
                fd, state.taking = state.taking, None
                asyncio.get_running_loop().create_task(self._serve(fd, prefix))

    def _reply(self, peer: socket.socket, answer: bytes) -> None:
        with contextlib.suppress(OSError):
            peer.send(answer)

    async def _serve(self, fd: int, prefix: bytes) -> None:
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        try:
            protocol = functools.partial(self._protocol, prefix=prefix)
            await asyncio.get_running_loop().connect_accepted_socket(protocol, sock)
        except OSError as exc:  # the client went away meanwhile
            logger.debug("a connection taken over from a worker closed at once: %s", exc)
            sock.close()
        finally:
            self._taking -= 1

    def _drop(self, peer: socket.socket) -> None:
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(peer.fileno())
        state = self._peer_state.pop(peer, None)
        if state is not None:
            for fd in state.fds + ([state.taking] if state.taking is not None else []):
                os.close(fd)
            self._taking -= state.taking is not None
        peer.close()

    async def close(self) -> None:
        """Take no more; finish the requests in flight on the connections held, then close them."""
        self._stopping = True
        loop = asyncio.get_running_loop()
        if self._listener is not None:
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(self._listener.fileno())
            self._listener.close()
        for peer in list(self._peer_state):
            self._drop(peer)
        for connection in list(self._state.connections):
            connection.shutdown()  # closes an idle one now, a busy one after its answer
        deadline = time.monotonic() + self.graceful_shutdown_s
        while (self._state.connections or self._taking) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for task in list(self._state.tasks):
            task.cancel()
        for connection in list(self._state.connections):
            connection.transport.abort()


@dataclass
class _Peer:
    """One worker's offer socket: bytes and descriptors received and not yet used, and the descriptor
    taken over whose first bytes are still to come."""

    data: bytearray = field(default_factory=bytearray)
    fds: list[int] = field(default_factory=list)
    taking: int | None = None


def _fed_protocol(base: type) -> type:
    """``base`` (uvicorn's HTTP protocol) that reads ``prefix`` as the connection's first bytes."""

    class Fed(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, prefix: bytes = b"", **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._prefix = prefix

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            if self._prefix:  # before anything this process reads from the socket
                self.data_received(self._prefix)

    return Fed


class Offerer:
    """A worker's side: offers each new connection's descriptor to the scoring process (one at a time:
    the replies come in order) and says whether it was taken over."""

    def __init__(self, path: str) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        sock.setblocking(False)
        self.sock = sock
        self._lock = asyncio.Lock()
        self._gone = False
        self.in_flight: Any = None  # the connection whose descriptor is being offered

    async def offer(
        self, fd: int, read: Callable[[], bytes], *, ready: Callable[[], bool], owner: Any = None
    ) -> bool:
        """Offer ``fd``; when it is taken, send ``read()`` (the bytes read from it here) after it.
        ``ready()`` once its turn comes: stops reading the connection here and says whether it is still
        open (one closed here meanwhile is not offered: its descriptor number may be another
        connection's by then); ``owner`` is `in_flight` while it is offered."""
        if self._gone:
            return False
        loop = asyncio.get_running_loop()
        async with self._lock:
            if not ready():
                return False
            self.in_flight = owner
            try:
                return await self._offer(loop, fd, read)
            finally:
                self.in_flight = None

    async def _offer(self, loop: asyncio.AbstractEventLoop, fd: int, read: Callable[[], bytes]) -> bool:
        """`offer` under its lock: the descriptor, the reply, the bytes read here."""
        try:
            socket.send_fds(self.sock, [b"o"], [fd])
        except BlockingIOError:  # its buffer is full of offers not yet answered: serve it here
            return False
        except OSError:
            self._gone = True
            return False
        try:
            reply = await loop.sock_recv(self.sock, 1)
        except OSError:
            reply = b""
        if reply != TAKEN:
            self._gone = not reply  # nothing: the scoring process has gone (this worker stops too)
            return False
        await asyncio.sleep(0)  # data read along with the pause's callback arrives first
        prefix = read()
        try:
            await loop.sock_sendall(self.sock, len(prefix).to_bytes(4, "little") + prefix)
        except OSError:
            self._gone = True
        return True

    def close(self) -> None:
        self.sock.close()


def offering_protocol(base: type, offerer: Offerer) -> type:
    """``base`` (uvicorn's HTTP protocol) that, as a connection is made, offers it to the scoring process
    (paused once its turn comes): closed here when taken over, resumed and served here when declined."""

    class Offering(base):  # type: ignore[misc, valid-type]
        @property
        def handing_over(self) -> bool:
            """Whether the connection's descriptor is in flight to the scoring process (it is not to be
            closed here meanwhile: `maxsim_cli.service.limits`). One waiting for its turn may be."""
            return offerer.in_flight is self

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._offered: bytearray | None = None
            sock = transport.get_extra_info("socket")
            if sock is None or transport.is_closing():  # closed at once (`limits`: no room)
                return
            self._offered = bytearray()  # what the loop reads until the offer is sent, held until the answer
            asyncio.get_running_loop().create_task(self._offer(transport, sock.fileno()))

        def data_received(self, data: bytes) -> None:
            if self._offered is not None:
                self._offered += data
                return
            super().data_received(data)

        async def _offer(self, transport: asyncio.Transport, fd: int) -> None:
            held = self._offered
            assert held is not None

            def ready() -> bool:
                # paused as the offer is sent (not as the connection is made: uvloop starts reading only
                # once connection_made has returned), so what this process reads of the connection is
                # only what it had read already, all of it in ``held``. Read until then, as the offers
                # before it are answered: a connection closed here while it waits has nothing left
                # unread, which would reset it and lose its answer.
                if transport.is_closing():
                    return False
                transport.pause_reading()
                return True

            try:
                taken = await offerer.offer(fd, lambda: bytes(held), ready=ready, owner=self)
            except Exception:  # noqa: BLE001 - an offer that fails is declined: serve it here
                taken = False
            self._offered = None
            if taken:
                transport.abort()  # this process's copy; the connection is the scoring process's now
                return
            if transport.is_closing():  # closed while it waited for its turn (`limits`)
                return
            if held:
                super().data_received(bytes(held))
            if not transport.is_closing():
                transport.resume_reading()

    Offering.__name__ = Offering.__qualname__ = f"Offering{base.__name__}"
    return Offering
