"""The ingest listener's plumbing: the memory budget and the connection cap.

:class:`~daemon.ingest.server.IngestServer` uses these pieces:

1. :class:`ByteBudget`: each request holds its body's size of
   ``ingest.max_buffered_bytes`` while it is read and parsed (FIFO); a drain
   makes waiting requests fail at once (``refuse``).
2. :class:`_CappedSite`: binds ``ingest.listen`` (TLS when configured) with
   the server's protocol factory, which enforces ``ingest.max_connections``.
3. :class:`_Refuse`: the protocol of a connection over that cap: a canned 503,
   then the connection closes after a short linger.
4. :func:`_idle`: whether a connection waits for its next request head; a
   drain waits until every connection is idle before it closes them.
5. :func:`name_server`: the ``Server`` header of every answer (ingest's and
   admin's): ``eventplane``, not the Python and aiohttp versions.

What the limits are for: docs/ingest.md.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web

from daemon.security import ServerTls

SERVER = "eventplane"


async def name_server(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """``on_response_prepare``: runs before aiohttp sets its own ``Server``
    header (``Python/3.11 aiohttp/x.y``), which would tell any client the
    versions to look up vulnerabilities for."""
    response.headers["Server"] = SERVER


class ByteBudget:
    """A FIFO byte semaphore: requests hold their body size while they run."""

    __slots__ = ("_free", "_refusal", "_waiters", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free = limit
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._refusal: Callable[[], BaseException] | None = None

    @property
    def free(self) -> int:
        return self._free

    async def acquire(self, n: int) -> None:
        n = min(n, self.limit)
        if not self._waiters and n <= self._free:
            self._free -= n
            return
        if self._refusal is not None:
            raise self._refusal()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(n)  # granted, then cancelled before we could use it
            elif not fut.done():
                self._waiters.remove(entry)
                self._wake()
            raise

    def refuse(self, error: Callable[[], BaseException]) -> None:
        """From now on an acquire that would wait raises ``error()``, and so does
        every acquire waiting now (the drain answers them instead of letting them wait)."""
        self._refusal = error
        while self._waiters:
            _n, fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(error())

    def release(self, n: int) -> None:
        self._free += min(n, self.limit)
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._waiters[0][0] <= self._free:
            n, fut = self._waiters.popleft()
            if not fut.done():
                self._free -= n
                fut.set_result(None)


def _idle(conn: Any) -> bool:
    """Whether an aiohttp connection waits for its next request head: no request
    is being read, handled, answered, or its refused body read away.

    aiohttp has no public word for it; ``RequestHandler._waiter`` is the future its
    loop awaits between requests. Were it renamed, every connection would
    count as busy and the drain would wait its half budget, not end early.
    """
    return getattr(conn, "_waiter", None) is not None


class _CappedSite(web.BaseSite):
    """A TCP site whose protocol factory enforces ``ingest.max_connections``."""

    __slots__ = ("_factory", "_handshake_timeout_s", "_host", "_listener", "_port", "_tls")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        factory: Callable[[], asyncio.BaseProtocol],
        backlog: int,
        tls: ServerTls | None = None,
        handshake_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self._factory = factory
        self._tls = tls
        self._handshake_timeout_s = handshake_timeout_s
        self._listener: asyncio.Server | None = None

    @property
    def name(self) -> str:
        scheme = "https" if self._tls is not None else "http"
        return f"{scheme}://{self._host}:{self.port}"

    @property
    def port(self) -> int:
        if self._listener is not None and self._listener.sockets:
            return int(self._listener.sockets[0].getsockname()[1])
        return self._port

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        if self._tls is None:
            self._listener = await loop.create_server(
                self._factory, self._host, self._port, backlog=self._backlog, reuse_address=True
            )
        else:
            # The handshake counts against the header deadline's value: a client that
            # opens a connection and says nothing holds it no longer than that.
            self._listener = await loop.create_server(
                self._factory,
                self._host,
                self._port,
                backlog=self._backlog,
                reuse_address=True,
                ssl=self._tls.context,
                ssl_handshake_timeout=self._handshake_timeout_s,
            )
        self._server = self._listener


class _Refuse(asyncio.Protocol):
    """A connection over the cap: write a canned 503, half-close, drain briefly, close."""

    def __init__(self, response: bytes | None, grace_s: float, done: Callable[[], None]) -> None:
        self._response = response
        self._grace_s = grace_s
        self._done = done
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCPTransport is not an asyncio.Transport subclass: cast, do not check.
        transport = cast(asyncio.Transport, transport)
        self._transport = transport
        if self._response is None:  # even the refusals are over the cap
            transport.abort()
            return
        transport.write(self._response)
        if transport.can_write_eof():
            transport.write_eof()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._grace_s, transport.abort)

    def data_received(self, data: bytes) -> None:
        pass  # the request is not read: it was answered before it arrived

    def eof_received(self) -> bool:
        if self._transport is not None:
            self._transport.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._done()
