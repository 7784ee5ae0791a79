"""A fault-injecting TCP proxy on loopback, between producers and a daemon's ingest.

It forwards bytes both ways and, at random (seeded) moments, does what
networks and restarts do to a producer:

- ``drop_response``: the request went through to the daemon (it may be stored
  and acknowledged), but its answer never reaches the client: the client's
  connection is reset instead;
- ``reset_mid_body``: part of a request went through, then both connections
  are reset (the daemon sees a body cut short, the client a reset);
- ``delay``: a chunk waits before it is forwarded (slow networks, timeouts).

While the daemon is down, a new connection is accepted and then closed at
once, like a load balancer with no backend. ``stall(True)`` is a network
partition: connections are accepted and nothing is forwarded either way
until ``stall(False)`` (what was held is then delivered). ``refuse(True)`` is
a stopped server: open connections are reset and nothing listens on the port
until ``refuse(False)``. It runs its own event loop in a thread, so blocking
tests and producer threads can use it alike.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter
from contextlib import suppress
from typing import Any

CHUNK = 64 * 1024


class FaultyProxy:
    def __init__(
        self,
        upstream_port: int,
        *,
        seed: int,
        drop_response: float = 0.0,
        reset_mid_body: float = 0.0,
        delay: float = 0.0,
        max_delay_s: float = 0.3,
    ) -> None:
        self.upstream_port = upstream_port
        self.drop_response = drop_response
        self.reset_mid_body = reset_mid_body
        self.delay = delay
        self.max_delay_s = max_delay_s
        self.faults: Counter[str] = Counter()  # what was injected, for the test's asserts
        self.stalling = False
        self._flowing = asyncio.Event()  # cleared while stalling (its loop only)
        self._flowing.set()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.port = 0

    # -- control (any thread) ------------------------------------------------

    def start(self) -> FaultyProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_faults(self, **rates: float) -> None:
        """Change ``drop_response``, ``reset_mid_body`` or ``delay`` (0 turns one off)."""
        with self._lock:
            for name, rate in rates.items():
                if name not in ("drop_response", "reset_mid_body", "delay"):
                    raise ValueError(f"no fault {name!r}")
                setattr(self, name, rate)

    def stall(self, on: bool) -> None:
        """Hold every byte both ways (a partition) from now on, or let them go."""
        self.stalling = on
        self._loop.call_soon_threadsafe(self._flowing.clear if on else self._flowing.set)

    def refuse(self, on: bool) -> None:
        """From now on be what a stopped server is to its clients (open
        connections reset, new ones refused: nothing listens on the port), or
        listen on the same port again."""

        async def switch() -> None:
            if on:
                if self._server is not None:
                    self._server.close()
                    self._server = None
                for w in list(self._writers):
                    _abort(w)
            elif self._server is None:
                self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

        asyncio.run_coroutine_threadsafe(switch(), self._loop).result(10)

    def close(self) -> None:
        async def shut() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._writers):
                _abort(w)

        with suppress(Exception):
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> FaultyProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the proxy (its loop) ----------------------------------------------------

    def _roll(self, fault: str) -> bool:
        with self._lock:
            hit = self._rng.random() < getattr(self, fault)
            if hit:
                self.faults[fault] += 1
            return hit

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        self._writers.add(c_writer)
        try:
            await self._flowing.wait()  # while stalling: accepted, never answered
            try:
                u_reader, u_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            except OSError:
                self.faults["upstream_down"] += 1
                _abort(c_writer)
                return
            self._writers.add(u_writer)
            try:
                pumps = [
                    asyncio.ensure_future(self._pump(c_reader, u_writer, upstream=True)),
                    asyncio.ensure_future(self._pump(u_reader, c_writer, upstream=False)),
                ]
                # Either side ending ends both: no half-open connections linger.
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
                for p in pumps:
                    p.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
            finally:
                _abort(u_writer)
                self._writers.discard(u_writer)
        finally:
            _abort(c_writer)
            self._writers.discard(c_writer)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, upstream: bool
    ) -> None:
        while True:
            data = await reader.read(CHUNK)
            if not data:
                with suppress(OSError):
                    writer.write_eof()
                return
            await self._flowing.wait()
            if self.delay and self._roll("delay"):
                await asyncio.sleep(self._rng.uniform(0, self.max_delay_s))
            if upstream and self.reset_mid_body and self._roll("reset_mid_body"):
                writer.write(data[: len(data) // 2])
                with suppress(OSError):
                    await writer.drain()
                return  # the caller resets both sides
            if not upstream and self.drop_response and self._roll("drop_response"):
                return  # the answer is dropped; the client gets a reset
            writer.write(data)
            await writer.drain()


def _abort(writer: Any) -> None:
    with suppress(Exception):
        writer.transport.abort()
