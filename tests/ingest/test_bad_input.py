"""The bad-input battery: each refusal has its status, its message, and leaves the WAL unchanged.

Every test sends one good request first, so "unchanged" means the head LSN and
the records stay exactly what the good request made.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from typing import Any
from unittest import mock

import aiohttp
import msgspec
import pytest
from structlog.testing import capture_logs

from daemon.ingest.server import IngestServer
from daemon.service.metrics import Metrics
from tests.ingest.conftest import JSON, NDJSON, StartIngest, event, ndjson, post, stored
from wal.errors import WalClosedError, WalFatalError

LIMITS = {
    "max_body_bytes": 64 * 1024,
    "max_event_bytes": 2048,
    "max_events_per_request": 50,
}


@pytest.fixture
async def server(start_ingest: StartIngest) -> IngestServer:
    return await start_ingest(**LIMITS)


def check(
    got: tuple[int, dict[str, Any], Any], status: int, error: str, *phrases: str
) -> dict[str, Any]:
    code, headers, body = got
    assert code == status, body
    assert headers["Content-Type"].startswith("application/json")
    assert body["error"] == error
    for phrase in phrases:
        assert phrase in body["message"], body["message"]
    return dict(body)


# -- 400 malformed ----------------------------------------------------------------


async def test_malformed_ndjson_line_names_line_column_and_position(
    server: IngestServer, http: aiohttp.ClientSession, baseline: list[Any]
) -> None:
    good = msgspec.json.encode(event(5))
    body = good + b"\n" + b'{"collection": "orders", "op": "insert", oops}\n' + good + b"\n"
    got = await post(http, server, body)
    doc = check(got, 400, "malformed", "line 2, column 42", "nothing was stored")
    assert doc["line"] == 2
    assert doc["column"] == 42
    assert doc["position"] == len(good) + 1 + 41
    assert body[doc["position"] : doc["position"] + 4] == b"oops"


async def test_malformed_array_names_the_byte_position(
    server: IngestServer, http: aiohttp.ClientSession, baseline: list[Any]
) -> None:
    body = b'[{"collection": "orders", "op": "delete", "key": "a"},\n {"key": tru}]'
    doc = check(await post(http, server, body, JSON), 400, "malformed", "line 2, column")
    line_start = body.index(b"\n") + 1
    # msgspec reports the byte where it gave up: inside or just after the bad token.
    assert body.index(b"tru}") <= doc["position"] <= body.index(b"tru}") + 5
    assert doc["line"] == 2
    assert doc["column"] == doc["position"] - line_start + 1
    assert f"line 2, column {doc['column']} (byte {doc['position']}" in doc["message"]


async def test_truncated_array_points_at_its_end(
    server: IngestServer, http: aiohttp.ClientSession, baseline: list[Any]
) -> None:
    body = b'[{"collection": "orders", "op": "delete", "key": "a"}'
    doc = check(await post(http, server, body, JSON), 400, "malformed", "truncated")
    assert doc["position"] == len(body)


async def test_json_body_that_is_not_an_array_is_malformed(
    server: IngestServer, http: aiohttp.ClientSession, baseline: list[Any]
) -> None:
    body = msgspec.json.encode(event(1))
    check(await post(http, server, body, JSON), 400, "malformed", "must be an array", "object")


@pytest.mark.parametrize("body", [b"", b"\n\n  \n", b"[]"], ids=["empty", "blank-lines", "[]"])
async def test_a_body_without_events_is_refused(
    server: IngestServer, http: aiohttp.ClientSession, baseline: list[Any], body: bytes
) -> None:
    headers = JSON if body == b"[]" else NDJSON
    check(await post(http, server, body, headers), 400, "empty", "no events")


async def test_invalid_utf8_is_malformed_with_its_position(
    server: IngestServer, http: aiohttp.ClientSession, baseline: list[Any]
) -> None:
    line = b'{"collection": "orders", "op": "delete", "key": "caf\xe9"}\n'
    doc = check(await post(http, server, line), 400, "malformed", "invalid UTF-8")
    assert doc["position"] == line.index(b"\xe9")


# -- 415 ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content_type", "phrase"),
    [
        ("text/plain", '"text/plain" is not accepted'),
        ("application/octet-stream", "application/x-ndjson"),
        ("application/x-ndjson; charset=latin-1", 'charset "latin-1"'),
    ],
)
async def test_wrong_content_type_is_415(
    server: IngestServer,
    http: aiohttp.ClientSession,
    baseline: list[Any],
    content_type: str,
    phrase: str,
) -> None:
    got = await post(http, server, ndjson([event(9)]), {"Content-Type": content_type})
    check(got, 415, "unsupported_media_type", phrase)


async def test_ndjson_and_json_content_types_with_utf8_charset_are_accepted(
    server: IngestServer, http: aiohttp.ClientSession, wal: Any
) -> None:
    for ctype in ("application/x-ndjson; charset=utf-8", "application/jsonl"):
        status, _, _ = await post(http, server, ndjson([event(1)]), {"Content-Type": ctype})
        assert status == 200
    body = msgspec.json.encode([event(2)])
    status, _, _ = await post(http, server, body, {"Content-Type": "application/json"})
    assert status == 200
    assert wal.head_lsn() == 3


# -- 422 per item -----------------------------------------------------------------


async def test_invalid_events_are_listed_with_index_line_field_and_reason(
    server: IngestServer, http: aiohttp.ClientSession, baseline: list[Any]
) -> None:
    events = [
        event(0),
        {"collection": "", "op": "upsert", "key": 7},
        event(2),
        {"collection": "orders", "op": "insert", "key": "x", "old": {"a": 1}},
        {"collection": "orders", "op": "delete", "key": "y", "new": {"a": 1}, "extra": 1},
        {"collection": "orders", "op": "update", "key": "z", "new": [1, 2]},
        "not an object",
    ]
    doc = check(
        await post(http, server, ndjson(events)),
        422,
        "invalid_events",
        "5 of 7 events are invalid",
        'first: event 1 at line 2, field "collection": must not be empty',
        "nothing was stored",
    )
    found = {(e["index"], e["line"], e["field"]): e["reason"] for e in doc["errors"]}
    assert found == {
        (1, 2, "collection"): "must not be empty",
        (1, 2, "op"): 'expected "insert", "update" or "delete", got "upsert"',
        (1, 2, "key"): "expected a string, got number",
        (3, 4, "new"): 'an insert needs the "new" object',
        (3, 4, "old"): 'an insert has no previous row: send null or leave "old" out',
        (4, 5, "new"): 'a delete has no new row: send null or leave "new" out',
        (4, 5, "extra"): "unknown field (fields: collection, op, key, new, old, id, time)",
        (5, 6, "new"): "expected an object or null, got array",
        (6, 7, None): "expected an event object, got string",
    }
    assert doc["truncated"] is False


async def test_invalid_events_in_an_array_are_listed_by_index(
    server: IngestServer, http: aiohttp.ClientSession, baseline: list[Any]
) -> None:
    body = msgspec.json.encode([event(0), {"collection": "orders", "op": "update", "key": "k"}])
    doc = check(await post(http, server, body, JSON), 422, "invalid_events", "1 of 2")
    assert doc["errors"] == [
        {"index": 1, "field": "new", "reason": 'an update needs the "new" object'}
    ]


@pytest.mark.parametrize(
    ("bad", "field", "reason"),
    [
        ({"op": "insert", "key": "k", "new": {}}, "collection", "required field is missing"),
        ({"collection": "c" * 257, "op": "delete", "key": "k"}, "collection", "longer than 256"),
        ({"collection": 5, "op": "delete", "key": "k"}, "collection", "expected a string"),
        ({"collection": "c", "key": "k"}, "op", "required field is missing"),
        ({"collection": "c", "op": "delete"}, "key", "required field is missing"),
        ({"collection": "c", "op": "insert", "key": "k", "new": "{}"}, "new", "got string"),
        ({"collection": "c", "op": "delete", "key": "k", "old": 3}, "old", "got number"),
    ],
)
async def test_each_field_rule_has_its_own_reason(
    server: IngestServer,
    http: aiohttp.ClientSession,
    baseline: list[Any],
    bad: dict[str, Any],
    field: str,
    reason: str,
) -> None:
    doc = check(await post(http, server, ndjson([bad])), 422, "invalid_events", reason)
    assert doc["errors"][0]["field"] == field
    assert reason in doc["errors"][0]["reason"]


async def test_a_long_error_list_is_truncated_but_counted(
    start_ingest: StartIngest, http: aiohttp.ClientSession, wal: Any
) -> None:
    server = await start_ingest(max_events_per_request=1000)
    bad = [{"collection": "c", "op": "insert", "key": str(i)} for i in range(300)]
    doc = check(await post(http, server, ndjson(bad)), 422, "invalid_events", "300 of 300")
    assert len(doc["errors"]) == 100
    assert doc["truncated"] is True
    assert wal.head_lsn() == 0


# -- 413 --------------------------------------------------------------------------


async def test_too_many_events_is_413(
    server: IngestServer, http: aiohttp.ClientSession, baseline: list[Any]
) -> None:
    events = [event(i) for i in range(51)]
    check(await post(http, server, ndjson(events)), 413, "too_many_events", "51 events", "(50)")
    body = msgspec.json.encode(events)
    check(await post(http, server, body, JSON), 413, "too_many_events", "51 events")


async def test_an_event_over_max_event_bytes_is_413_with_its_index(
    server: IngestServer, http: aiohttp.ClientSession, baseline: list[Any]
) -> None:
    big = event(1, new={"blob": "x" * 3000})
    doc = check(
        await post(http, server, ndjson([event(0), big])),
        413,
        "event_too_large",
        "event 1 is",
        "max_event_bytes (2048)",
    )
    assert doc["index"] == 1


async def test_content_length_over_the_limit_is_413_before_reading(
    server: IngestServer, http: aiohttp.ClientSession, baseline: list[Any], metrics: Metrics
) -> None:
    before = metrics.registry.get_sample_value("eventplane_ingest_request_bytes_total")
    body = ndjson([event(i, new={"pad": "p" * 1500}) for i in range(45)])
    assert len(body) > LIMITS["max_body_bytes"]
    code, headers, doc = await post(http, server, body)
    check((code, headers, doc), 413, "too_large", f"body of {len(body)} bytes", "(65536)")
    assert headers.get("Connection") == "close"
    assert (
        metrics.registry.get_sample_value("eventplane_ingest_request_bytes_total") == before
    )  # not a byte of it was taken


async def test_huge_streamed_body_is_refused_at_the_limit_with_flat_memory(
    server: IngestServer, baseline: list[Any], metrics: Metrics
) -> None:
    """A 1 GiB chunked body: 413 once the count passes the limit; memory stays flat.

    1. Open a raw connection and send a chunked POST head (no Content-Length).
    2. Stream 256 KiB chunks, reading the socket at the same time.
    3. The 413 arrives after about max_body_bytes; keep streaming 128 MiB more
       into the server's lingering close to show it discards, not buffers.
    4. Python's traced memory peak stays far below the bytes sent.
    """
    taken_before = metrics.registry.get_sample_value("eventplane_ingest_request_bytes_total")
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(
        b"POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-ndjson\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b"x" * (256 * 1024)
    frame = [b"%x\r\n" % len(chunk), chunk, b"\r\n"]
    response = asyncio.ensure_future(reader.read(4096))
    sent = 0
    sent_after_answer = 0
    tracemalloc.start()
    try:
        while sent < (1 << 30) and sent_after_answer < (128 << 20):
            writer.writelines(frame)
            try:
                await writer.drain()
            except ConnectionError:
                break
            sent += len(chunk)
            if response.done():
                sent_after_answer += len(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        writer.close()
    head = await response
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert b'"error":"too_large"' in head
    assert sent_after_answer >= 16 << 20  # the server kept discarding after its answer
    assert peak < 16 << 20, f"peak traced memory {peak} bytes while sending {sent}"
    # The handler took one byte past the limit; the rest was discarded.
    taken = metrics.registry.get_sample_value("eventplane_ingest_request_bytes_total")
    assert taken - taken_before == LIMITS["max_body_bytes"] + 1


# -- 429, 503 -------------------------------------------------------------------------


async def test_over_the_lag_limit_is_429_with_retry_after(
    start_ingest: StartIngest, http: aiohttp.ClientSession, wal: Any
) -> None:
    lag = {"value": 0}
    server = await start_ingest(max_lag_events=1000, retry_after_s=3, lag=lambda: lag["value"])
    assert (await post(http, server, ndjson([event(1)])))[0] == 200
    lag["value"] = 1001
    code, headers, doc = await post(http, server, ndjson([event(2)]))
    check((code, headers, doc), 429, "over_lag_limit", "1001 events behind", "(1000)")
    assert headers["Retry-After"] == "3"
    assert doc["lag"] == 1001
    lag["value"] = 1000
    assert (await post(http, server, ndjson([event(3)])))[0] == 200
    assert [ev.key for _, _, ev in stored(wal)] == ["k1", "k3"]


async def test_draining_answers_503_and_closes(
    server: IngestServer, http: aiohttp.ClientSession, baseline: list[Any]
) -> None:
    server.begin_drain()
    code, headers, doc = await post(http, server, ndjson([event(3)]))
    check((code, headers, doc), 503, "draining", "shutting down")
    assert headers["Retry-After"] == "1"
    assert headers.get("Connection") == "close"


@pytest.mark.parametrize(
    "error", [WalFatalError("fdatasync failed: EIO"), WalClosedError("closed")]
)
async def test_a_failed_wal_answers_503_and_acks_nothing(
    server: IngestServer,
    http: aiohttp.ClientSession,
    baseline: list[Any],
    wal: Any,
    error: Exception,
) -> None:
    with mock.patch.object(wal, "append", side_effect=error), capture_logs() as logs:
        code, headers, doc = await post(http, server, ndjson([event(3)]))
        again = await post(http, server, ndjson([event(4)]))
    check((code, headers, doc), 503, "wal_unavailable", str(error), "nothing from this request")
    assert "Retry-After" in headers
    assert again[0] == 503
    logged = [e for e in logs if e["event"] == "ingest.wal_unavailable"]
    assert len(logged) == 1  # once per kind of failure, not once per request
    assert logged[0]["kind"] == type(error).__name__


# -- other routes ----------------------------------------------------------------------


async def test_get_on_events_is_405_and_unknown_paths_404(
    server: IngestServer, http: aiohttp.ClientSession, baseline: list[Any]
) -> None:
    async with http.get(server.url + "/v1/events") as resp:
        assert resp.status == 405
        assert resp.headers["Allow"] == "POST"
        assert (await resp.json())["error"] == "method_not_allowed"
    async with http.post(server.url + "/v2/events", data=b"{}") as resp:
        assert resp.status == 404
        assert "use POST /v1/events" in (await resp.json())["message"]


async def test_refusals_are_counted_by_status_code(
    server: IngestServer, http: aiohttp.ClientSession, baseline: list[Any], metrics: Metrics
) -> None:
    await post(http, server, b"{", NDJSON)
    await post(http, server, b"{}", {"Content-Type": "text/plain"})
    text = metrics.render().decode()
    assert 'eventplane_ingest_requests_total{code="200"} 1.0' in text
    assert 'eventplane_ingest_requests_total{code="400"} 1.0' in text
    assert 'eventplane_ingest_requests_total{code="415"} 1.0' in text
