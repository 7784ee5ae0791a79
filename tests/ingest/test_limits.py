"""Slow or many clients cannot hold the daemon: deadlines, connection cap, memory budget."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from daemon.ingest.server import ByteBudget, IngestServer
from daemon.service.metrics import Metrics
from tests.ingest.conftest import StartIngest, event, ndjson, post

HEAD = (
    b"POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-ndjson\r\n"
    b"Content-Length: %d\r\n\r\n"
)


async def read_all(reader: asyncio.StreamReader, limit_s: float) -> tuple[bytes, float]:
    """Everything until the server closes (a reset counts as closed, and so does a
    broken pipe our own write met, which the stream re-raises here); (bytes, seconds)."""
    t0 = time.monotonic()
    try:
        data = await asyncio.wait_for(reader.read(-1), limit_s)
    except ConnectionError:
        data = b""
    return data, time.monotonic() - t0


async def test_slow_loris_headers_are_cut_at_the_header_deadline(
    start_ingest: StartIngest, http: aiohttp.ClientSession
) -> None:
    """1. Open a connection and send half a request line, then nothing.
    2. The server closes it after ingest.header_timeout_s, without an answer.
    3. A normal client is served meanwhile."""
    server = await start_ingest(header_timeout_s=0.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Ty")
    await writer.drain()
    assert (await post(http, server, ndjson([event(1)])))[0] == 200
    data, took = await read_all(reader, 5.0)
    writer.close()
    assert data == b""
    assert 0.3 <= took <= 2.0


async def test_headers_trickled_byte_by_byte_are_cut_at_the_header_deadline(
    start_ingest: StartIngest,
) -> None:
    server = await start_ingest(header_timeout_s=0.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    t0 = time.monotonic()
    head = HEAD % 10
    closed = False
    for byte in head[:-1]:  # never the final newline
        try:
            writer.write(bytes([byte]))
            await writer.drain()
        except (ConnectionError, RuntimeError):
            # uvloop raises RuntimeError ("unable to perform operation on
            # <TCPTransport closed=True>") for a write after the server's close.
            closed = True
            break
        if reader.at_eof():
            closed = True
            break
        await asyncio.sleep(0.02)
        if time.monotonic() - t0 > 3.0:
            break
    data, _ = await read_all(reader, 3.0)
    writer.close()
    assert closed or data == b""
    assert time.monotonic() - t0 < 3.0


async def test_idle_keepalive_connection_is_closed_at_the_header_deadline(
    start_ingest: StartIngest,
) -> None:
    server = await start_ingest(header_timeout_s=0.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    body = ndjson([event(1)])
    writer.write(HEAD % len(body) + body)
    await writer.drain()
    first = await asyncio.wait_for(reader.readuntil(b'"last_lsn":1}'), 5.0)
    assert first.startswith(b"HTTP/1.1 200")
    data, took = await read_all(reader, 5.0)
    writer.close()
    assert data == b""
    assert took <= 2.0


async def test_slow_body_gets_408_at_the_body_deadline(start_ingest: StartIngest, wal: Any) -> None:
    server = await start_ingest(body_timeout_s=0.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    body = ndjson([event(1)])
    writer.write(HEAD % len(body) + body[:10])  # the rest never comes
    await writer.drain()
    data, took = await read_all(reader, 5.0)
    writer.close()
    assert data.startswith(b"HTTP/1.1 408"), data[:100]
    assert b'"error":"body_timeout"' in data
    assert b"ingest.body_timeout_s" in data
    assert b"Connection: close" in data
    assert took < 1.5  # no lingering for a client that is too slow already
    assert wal.head_lsn() == 0


async def test_connections_over_the_cap_get_503_and_are_closed(
    start_ingest: StartIngest, metrics: Metrics
) -> None:
    """1. Open max_connections idle connections: all are accepted and held.
    2. One more gets a canned 503 (JSON, Retry-After) and is closed.
    3. After one of the first closes, a new connection is served again."""
    server = await start_ingest(max_connections=3)
    held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(3)]
    await asyncio.sleep(0.05)
    assert metrics.registry.get_sample_value("eventplane_ingest_connections") == 3

    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    body = ndjson([event(1)])
    writer.write(HEAD % len(body) + body)
    data, _ = await read_all(reader, 5.0)
    writer.close()
    assert data.startswith(b"HTTP/1.1 503"), data[:100]
    assert b"Retry-After: 1" in data
    assert b'"error":"over_capacity"' in data
    assert b"ingest.max_connections" in data

    held[0][1].close()
    await asyncio.sleep(0.1)
    async with aiohttp.ClientSession() as session:
        assert (await post(session, server, body))[0] == 200
    for _, w in held[1:]:
        w.close()


async def test_ack_latency_events_and_bytes_are_measured(
    ingest: IngestServer, http: aiohttp.ClientSession, metrics: Metrics
) -> None:
    body = ndjson([event(i) for i in range(10)])
    assert (await post(http, ingest, body))[0] == 200
    assert metrics.registry.get_sample_value("eventplane_ingest_events_total") == 10
    assert metrics.registry.get_sample_value("eventplane_ingest_request_bytes_total") == len(body)
    text = metrics.render().decode()
    assert "eventplane_ingest_ack_latency_seconds_count 1.0" in text


# -- the memory budget ------------------------------------------------------------


async def test_byte_budget_is_fifo_and_never_overcommits() -> None:
    budget = ByteBudget(100)
    await budget.acquire(60)
    order: list[str] = []

    async def take(name: str, n: int) -> None:
        await budget.acquire(n)
        order.append(name)

    big = asyncio.ensure_future(take("big", 80))
    await asyncio.sleep(0)
    small = asyncio.ensure_future(take("small", 10))  # would fit, but waits its turn
    await asyncio.sleep(0.01)
    assert order == []
    budget.release(60)
    await asyncio.gather(big, small)
    assert order == ["big", "small"]
    assert budget.free == 10


async def test_byte_budget_waiter_cancelled_frees_its_place() -> None:
    budget = ByteBudget(100)
    await budget.acquire(100)
    waiter = asyncio.ensure_future(budget.acquire(50))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    budget.release(100)
    assert budget.free == 100
    await asyncio.wait_for(budget.acquire(100), 1.0)


async def test_requests_beyond_the_memory_budget_wait_then_succeed(
    start_ingest: StartIngest, wal: Any
) -> None:
    """With the budget (ingest.max_buffered_bytes) taken, a request waits within its
    body deadline, then runs."""
    server = await start_ingest(max_body_bytes=4096, max_buffered_bytes=8192, body_timeout_s=5.0)
    assert server._budget.limit == 8192
    await server._budget.acquire(server._budget.limit)
    async with aiohttp.ClientSession() as session:
        pending = asyncio.ensure_future(post(session, server, ndjson([event(1)])))
        await asyncio.sleep(0.1)
        assert not pending.done()
        server._budget.release(server._budget.limit)
        status, _, doc = await asyncio.wait_for(pending, 5.0)
    assert status == 200 and doc["accepted"] == 1
