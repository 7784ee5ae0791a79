"""Draining the in-process ingest server over real loopback sockets.

What a producer sees while ``IngestServer.stop`` runs (the daemon's SIGTERM path:
``begin_drain()`` then ``stop()``): a request that arrives gets ``503 draining``
with ``Retry-After`` and ``Connection: close``, a request already being read or
stored finishes with its 200, and no connection is dropped under a request.
The raw HTTP here is deliberate: a client library would hide a reset behind its
own retries.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from unittest import mock

import msgspec
import pytest

from tests.ingest.conftest import StartIngest, event, ndjson, stored

HEAD = (
    b"POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-ndjson\r\n"
    b"Content-Length: %d\r\n\r\n"
)


class Answer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.doc: dict[str, Any] = msgspec.json.decode(body) if body else {}

    @property
    def error(self) -> str:
        return str(self.doc.get("error", ""))


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Answer(status, headers, body)


async def post_raw(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes
) -> Answer:
    writer.write(HEAD % len(body) + body)
    await writer.drain()
    return await read_answer(reader)


async def test_a_kept_alive_connection_gets_503_draining_not_a_reset_during_the_drain(
    start_ingest: StartIngest, wal: Any
) -> None:
    """The `eventplane send` case: a producer got its 200 and sends its next request
    on the same kept-alive connection just after SIGTERM.

    1. One request on a connection: 200.
    2. stop() begins (the daemon's drain).
    3. The next request on that connection gets 503 draining with Retry-After and
       Connection: close (it used to find the connection closed under it), and the
       connection is then closed cleanly.
    """
    server = await start_ingest(drain_grace_s=2.0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    first = await post_raw(reader, writer, ndjson([event(1)]))
    assert first.status == 200
    stopping = asyncio.ensure_future(server.stop(5.0))
    await asyncio.sleep(0.2)
    answer = await post_raw(reader, writer, ndjson([event(2)]))
    assert answer.status == 503 and answer.error == "draining"
    assert answer.headers["retry-after"] == "1"
    assert answer.headers["connection"] == "close"
    assert await asyncio.wait_for(reader.read(), 5.0) == b""  # closed after the answer
    writer.close()
    await asyncio.wait_for(stopping, 5.0)
    assert [e.key for _, _, e in stored(wal)] == ["k1"]


async def test_a_new_connection_during_the_drain_grace_gets_503_draining(
    start_ingest: StartIngest,
) -> None:
    """The listener stays open for ingest.drain_grace_s while connections are open,
    so a producer that connects then gets an answer rather than a refusal or a reset."""
    server = await start_ingest(drain_grace_s=2.0)
    _idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", server.port)
    stopping = asyncio.ensure_future(server.stop(5.0))
    await asyncio.sleep(0.2)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    answer = await post_raw(reader, writer, ndjson([event(1)]))
    writer.close()
    assert answer.status == 503 and answer.error == "draining"
    assert answer.headers["connection"] == "close"
    idle_writer.close()
    await asyncio.wait_for(stopping, 5.0)
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", server.port)


async def test_stop_with_no_open_connection_does_not_wait_for_the_grace(
    start_ingest: StartIngest,
) -> None:
    server = await start_ingest(drain_grace_s=30.0)
    t0 = time.monotonic()
    await server.stop(60.0)
    assert time.monotonic() - t0 < 1.0


async def test_the_grace_ends_when_the_last_connection_closes(start_ingest: StartIngest) -> None:
    server = await start_ingest(drain_grace_s=30.0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    assert (await post_raw(reader, writer, ndjson([event(1)]))).status == 200
    stopping = asyncio.ensure_future(server.stop(60.0))
    await asyncio.sleep(0.3)
    assert not stopping.done(), "an idle producer connection keeps the listener open"
    writer.close()
    await asyncio.wait_for(stopping, 2.0)


async def test_a_request_still_sending_its_body_when_the_drain_starts_is_stored_and_acked(
    start_ingest: StartIngest, wal: Any
) -> None:
    """1. A request's head and half its body arrive; the drain starts.
    2. The rest of the body arrives: the request is stored and answered 200.
    3. stop() returns after it."""
    server = await start_ingest(drain_grace_s=0.2)
    body = ndjson([event(i) for i in range(200)])
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(HEAD % len(body) + body[: len(body) // 2])
    await writer.drain()
    await asyncio.sleep(0.1)
    stopping = asyncio.ensure_future(server.stop(10.0))
    await asyncio.sleep(0.5)  # past the grace: the listener is closed by now
    writer.write(body[len(body) // 2 :])
    await writer.drain()
    answer = await read_answer(reader)
    writer.close()
    assert answer.status == 200 and answer.doc["last_lsn"] == 200
    await asyncio.wait_for(stopping, 5.0)
    assert wal.head_lsn() == 200


async def test_a_request_waiting_for_the_body_budget_gets_503_draining_and_its_answer(
    start_ingest: StartIngest, wal: Any
) -> None:
    """1. max_buffered_bytes fits one body: request A holds it (half its body sent),
       request B (whole body sent) waits for its share.
    2. The drain starts: B is answered 503 draining at once (it would otherwise wait
       for A, then be cut by the drain), its body read and discarded, not reset.
    3. A's body completes: A is stored and gets 200."""
    body = ndjson([event(i) for i in range(100)])
    server = await start_ingest(
        max_body_bytes=len(body), max_buffered_bytes=len(body), drain_grace_s=1.0
    )
    a_reader, a_writer = await asyncio.open_connection("127.0.0.1", server.port)
    a_writer.write(HEAD % len(body) + body[:100])
    await a_writer.drain()
    await asyncio.sleep(0.1)
    b_reader, b_writer = await asyncio.open_connection("127.0.0.1", server.port)
    b_writer.write(HEAD % len(body) + body)
    await b_writer.drain()
    await asyncio.sleep(0.2)
    stopping = asyncio.ensure_future(server.stop(10.0))
    b = await read_answer(b_reader)
    assert b.status == 503 and b.error == "draining"
    assert b.headers["connection"] == "close" and b.headers["retry-after"] == "1"
    b_writer.close()
    a_writer.write(body[100:])
    await a_writer.drain()
    a = await read_answer(a_reader)
    a_writer.close()
    assert a.status == 200 and a.doc["last_lsn"] == 100
    await asyncio.wait_for(stopping, 5.0)
    assert wal.head_lsn() == 100


async def test_producers_posting_in_a_loop_through_stop_see_200_or_503_never_a_reset(
    start_ingest: StartIngest, wal: Any
) -> None:
    """1. Four producers post 100-event requests back to back, each on its own
       kept-alive connection; WAL appends are slowed so requests overlap the drain.
    2. stop() runs as the daemon's SIGTERM does.
    3. Every request a producer sent got 200 or 503 draining (then the producer
       stops, as it would wait Retry-After); none saw a reset or an unanswered
       request. The WAL holds exactly the acknowledged requests."""
    server = await start_ingest(drain_grace_s=1.0)
    real_append = wal.append

    async def slow_append(*args: Any) -> tuple[int, int]:
        await asyncio.sleep(0.01)
        result: tuple[int, int] = await real_append(*args)
        return result

    outcomes: list[str] = []
    acked: list[int] = []

    async def produce(pid: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        i = 0
        try:
            while True:
                body = ndjson([event(pid * 1_000_000 + i * 100 + j) for j in range(100)])
                try:
                    answer = await post_raw(reader, writer, body)
                except (OSError, asyncio.IncompleteReadError) as exc:
                    outcomes.append(f"dropped: {type(exc).__name__}")
                    return
                if answer.status == 200:
                    outcomes.append("200")
                    acked.append(answer.doc["accepted"])
                    i += 1
                    continue
                outcomes.append(f"{answer.status} {answer.error}")
                return
        finally:
            writer.close()

    with mock.patch.object(wal, "append", side_effect=slow_append):
        producers = [asyncio.ensure_future(produce(p)) for p in range(4)]
        await asyncio.sleep(0.5)
        await asyncio.wait_for(server.stop(10.0), 10.0)
        await asyncio.wait_for(asyncio.gather(*producers), 10.0)
    assert set(outcomes) <= {"200", "503 draining"}, outcomes
    assert outcomes.count("503 draining") == 4
    assert wal.head_lsn() == sum(acked)


async def test_a_forced_stop_skips_the_grace(start_ingest: StartIngest) -> None:
    """A second SIGTERM (Daemon.request_exit twice) calls hurry(): an open producer
    connection no longer holds the listener open for the grace."""
    server = await start_ingest(drain_grace_s=30.0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    assert (await post_raw(reader, writer, ndjson([event(1)]))).status == 200
    stopping = asyncio.ensure_future(server.stop(60.0))
    await asyncio.sleep(0.2)
    assert not stopping.done()
    server.hurry()
    await asyncio.wait_for(stopping, 2.0)
    writer.close()
