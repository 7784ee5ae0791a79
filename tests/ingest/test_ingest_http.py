"""Accepted requests: atomic, durable before the ack, consecutive LSNs in request order."""

from __future__ import annotations

import asyncio
import random
import sys
import time
import tracemalloc
from typing import Any
from unittest import mock

import aiohttp
import msgspec

from daemon.ingest import server as ingest_module
from daemon.ingest.server import IngestServer
from daemon.service.metrics import Metrics
from daemon.shard import core_of
from tests.ingest.conftest import JSON, StartIngest, event, ndjson, post, stored
from wal.reader import RecordBatch


async def test_events_get_consecutive_lsns_in_request_order(
    ingest: IngestServer, http: aiohttp.ClientSession, wal: Any
) -> None:
    acks = []
    for r in range(3):
        events = [event(r * 100 + i) for i in range(100)]
        status, _, ack = await post(http, ingest, ndjson(events))
        assert status == 200
        acks.append(ack)
    assert acks == [
        {"accepted": 100, "first_lsn": 1, "last_lsn": 100},
        {"accepted": 100, "first_lsn": 101, "last_lsn": 200},
        {"accepted": 100, "first_lsn": 201, "last_lsn": 300},
    ]
    records = stored(wal)
    assert [lsn for lsn, _, _ in records] == list(range(1, 301))
    assert [ev.key for _, _, ev in records] == [f"k{i}" for i in range(300)]


async def test_stored_events_keep_the_producers_json_verbatim(
    ingest: IngestServer, http: aiohttp.ClientSession, wal: Any
) -> None:
    new = b'{ "amount" : 12.50, "note": "caf\\u00e9 \xe2\x98\x95", "tags": [ ] }'
    old = b'{"amount":1e2}'
    lines = [
        b'{"collection":"orders","op":"update","key":"o-1","new":' + new + b',"old":' + old + b"}",
        b'  {"op":"delete","key":"o-2","collection":"orders","old":null}  ',
        b'{"collection":"users","op":"insert","key":"","new":{}}',
    ]
    t0 = time.time_ns()
    status, _, ack = await post(http, ingest, b"\r\n".join(lines) + b"\n")
    t1 = time.time_ns()
    assert status == 200 and ack["accepted"] == 3
    (_, c1, e1), (_, _, e2), (_, _, e3) = stored(wal)
    assert (e1.collection, e1.op, e1.key, e1.new, e1.old) == ("orders", "update", "o-1", new, old)
    assert (e2.op, e2.new, e2.old) == ("delete", None, None)
    assert (e3.collection, e3.key, e3.new) == ("users", "", b"{}")
    assert e1.ingest_ts_ns == e2.ingest_ts_ns == e3.ingest_ts_ns  # one stamp per request
    assert t0 <= e1.ingest_ts_ns <= t1
    assert (e1.depth, e1.source) == (0, "")
    assert c1 == core_of("orders", "o-1", 4)


async def test_a_json_array_is_stored_like_ndjson(
    ingest: IngestServer, http: aiohttp.ClientSession, wal: Any
) -> None:
    events = [event(1), event(2, op="update"), event(3, op="delete")]
    status, _, ack = await post(http, ingest, msgspec.json.encode(events), JSON)
    assert status == 200 and ack == {"accepted": 3, "first_lsn": 1, "last_lsn": 3}
    assert [(ev.op, ev.key) for _, _, ev in stored(wal)] == [
        ("insert", "k1"),
        ("update", "k2"),
        ("delete", "k3"),
    ]


async def test_concurrent_requests_each_get_one_contiguous_lsn_range(
    ingest: IngestServer, wal: Any
) -> None:
    """1. 24 concurrent requests of 1..400 events each, over 8 connections.
    2. Each ack's range has exactly its events, and ranges tile 1..N.
    3. Inside each range the records are that request's events, in order."""
    rng = random.Random(7)
    sizes = [rng.randint(1, 400) for _ in range(24)]
    conn = aiohttp.TCPConnector(limit=8)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def send(r: int, n: int) -> tuple[int, dict[str, Any]]:
            events = [event(i, collection=f"req{r}") for i in range(n)]
            status, _, ack = await post(session, ingest, ndjson(events))
            assert status == 200
            return r, ack

        acks = await asyncio.gather(*(send(r, n) for r, n in enumerate(sizes)))
    records = {lsn: ev for lsn, _, ev in stored(wal)}
    assert len(records) == sum(sizes)
    covered = []
    for r, ack in acks:
        assert ack["accepted"] == sizes[r]
        lsns = range(ack["first_lsn"], ack["last_lsn"] + 1)
        assert len(lsns) == sizes[r]
        assert [(records[x].collection, records[x].key) for x in lsns] == [
            (f"req{r}", f"k{i}") for i in range(sizes[r])
        ]
        covered.extend(lsns)
    assert sorted(covered) == list(range(1, sum(sizes) + 1))


async def test_a_request_is_one_wal_append(
    ingest: IngestServer, http: aiohttp.ClientSession, wal: Any
) -> None:
    with mock.patch.object(wal, "append", wraps=wal.append) as spy:
        status, _, ack = await post(http, ingest, ndjson([event(i) for i in range(5000)]))
    assert status == 200 and ack["accepted"] == 5000
    assert spy.call_count == 1
    assert len(spy.call_args.args[0]) == 5000


async def test_the_ack_waits_for_the_wal_append_to_return(
    ingest: IngestServer, http: aiohttp.ClientSession, wal: Any
) -> None:
    release = asyncio.Event()
    real_append = wal.append

    async def slow_append(items: Any) -> tuple[int, int]:
        await release.wait()
        result: tuple[int, int] = await real_append(items)
        return result

    with mock.patch.object(wal, "append", side_effect=slow_append):
        pending = asyncio.ensure_future(post(http, ingest, ndjson([event(1)])))
        await asyncio.sleep(0.2)
        assert not pending.done()
        assert wal.head_lsn() == 0
        release.set()
        status, _, ack = await asyncio.wait_for(pending, 5.0)
    assert status == 200 and ack["last_lsn"] == 1 == wal.head_lsn()


async def test_draining_finishes_in_flight_requests_and_refuses_new_ones(
    start_ingest: StartIngest, http: aiohttp.ClientSession, wal: Any
) -> None:
    """1. A request is in flight (its WAL append is held back).
    2. begin_drain(): a new request gets 503 draining.
    3. The held append completes: the in-flight request still gets its 200.
    4. stop() returns once it is done; the port is closed afterwards."""
    server = await start_ingest()
    release = asyncio.Event()
    real_append = wal.append

    async def held(items: Any) -> tuple[int, int]:
        await release.wait()
        result: tuple[int, int] = await real_append(items)
        return result

    with mock.patch.object(wal, "append", side_effect=held):
        in_flight = asyncio.ensure_future(post(http, server, ndjson([event(1)])))
        await asyncio.sleep(0.1)
        server.begin_drain()
        async with aiohttp.ClientSession() as other:
            status, _, doc = await post(other, server, ndjson([event(2)]))
        assert status == 503 and doc["error"] == "draining"
        stopping = asyncio.ensure_future(server.stop(5.0))
        await asyncio.sleep(0.1)
        assert not stopping.done()
        release.set()
        status, _, ack = await asyncio.wait_for(in_flight, 5.0)
        await asyncio.wait_for(stopping, 5.0)
    assert status == 200 and ack["last_lsn"] == 1
    assert [ev.key for _, _, ev in stored(wal)] == ["k1"]
    port = server.port
    try:
        _, w = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        pass
    else:
        w.close()
        raise AssertionError("the ingest port still accepts connections after stop()")


async def test_expect_100_continue_refuses_before_the_body_is_sent(
    ingest: IngestServer, wal: Any
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", ingest.port)
    writer.write(
        b"POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-ndjson\r\n"
        b"Content-Length: 1073741824\r\nExpect: 100-continue\r\n\r\n"
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
    writer.close()
    assert head.startswith(b"HTTP/1.1 413")

    body = ndjson([event(1)])
    reader, writer = await asyncio.open_connection("127.0.0.1", ingest.port)
    writer.write(
        b"POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-ndjson\r\n"
        b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % len(body)
    )
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(body)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
    writer.close()
    assert head.startswith(b"HTTP/1.1 200")
    assert wal.head_lsn() == 1


async def test_a_client_gone_mid_body_stores_nothing(
    ingest: IngestServer, wal: Any, metrics: Metrics
) -> None:
    body = ndjson([event(i) for i in range(100)])
    _, writer = await asyncio.open_connection("127.0.0.1", ingest.port)
    writer.write(
        b"POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-ndjson\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body[: len(body) // 2]
    )
    await writer.drain()
    writer.close()
    for _ in range(50):
        if metrics.registry.get_sample_value("eventplane_ingest_requests_total", {"code": "499"}):
            break
        await asyncio.sleep(0.02)
    assert metrics.registry.get_sample_value("eventplane_ingest_requests_total", {"code": "499"})
    assert wal.head_lsn() == 0


async def test_port_zero_binds_a_free_port_and_exposes_it(ingest: IngestServer) -> None:
    assert ingest.port > 0
    assert ingest.url == f"http://127.0.0.1:{ingest.port}"


async def test_stored_payloads_do_not_outlive_their_group_commit(
    ingest: IngestServer, http: aiohttp.ClientSession, wal: Any
) -> None:
    """Ingest's payloads come from msgspec's encode(), which may allocate up to 1.5x
    their length; none of them outlives the request. What stays (here: what the
    batch listener got, as the rings keep it) is one exact-size buffer per core
    (ingest joins each core's payloads: ``CoreSections``), holding exactly the
    stored payloads."""
    groups: list[list[RecordBatch]] = []
    wal.set_batch_listener(groups.append)
    body = ndjson([event(i, new={"id": i, "pad": "x" * 1000}) for i in range(200)])
    tracemalloc.start()
    try:
        status, _, _ = await post(http, ingest, body)
        where = tracemalloc.Filter(True, ingest_module.__file__)
        held = tracemalloc.take_snapshot().filter_traces([where]).statistics("filename")
    finally:
        tracemalloc.stop()

    assert status == 200
    batches = [b for group in groups for b in group]
    assert sum(map(len, batches)) == 200
    assert sorted(p for b in batches for p in b.payloads()) == sorted(
        r.payload for r in wal.read(1)
    )
    exact = sys.getsizeof(b"")
    assert all(sys.getsizeof(b.data) - len(b.data) == exact for b in batches)
    stored = sum(len(b.data) for b in batches)
    assert stored > 200_000
    assert sum(s.size for s in held) < stored + 10 * 1024  # 1.5x if the payloads lived on
