"""Payloads the CDC writers cannot parse are refused over HTTP, and say where; nothing is stored.

Every test sends one good request first; afterwards the WAL must hold exactly
what that request stored.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec
import pytest

from daemon.ingest.server import IngestServer
from tests.ingest.conftest import JSON, StartIngest, event, post, stored

PREFIX = b'{"collection":"c","op":"update","key":"k","new":'


def line(new: bytes, *, old: bytes = b"null") -> bytes:
    return PREFIX + new + b',"old":' + old + b"}\n"


@pytest.fixture
async def server(start_ingest: StartIngest) -> IngestServer:
    return await start_ingest()


GOOD = msgspec.json.encode(event(7)) + b"\n"


async def refused(
    http: aiohttp.ClientSession, server: IngestServer, body: bytes, status: int
) -> dict[str, Any]:
    code, headers, doc = await post(http, server, body)
    assert code == status, doc
    assert headers["Content-Type"].startswith("application/json")
    assert "nothing was stored" in doc["message"]
    return dict(doc)


# -- 400: not UTF-8 ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [b"\xc0\xaf", b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xff", b"\xe2\x82"],
    ids=["overlong-2", "overlong-3", "surrogate", "past-10ffff", "ff", "cut"],
)
async def test_invalid_utf8_in_new_is_400_with_line_event_field_and_byte(
    server: IngestServer, http: aiohttp.ClientSession, baseline: list[Any], bad: bytes
) -> None:
    """Overlong forms included: Jackson takes them, but they are not UTF-8."""
    body = GOOD + line(b'{"a":{"b":"x' + bad + b'"}}')
    doc = await refused(http, server, body, 400)
    assert doc["error"] == "malformed"
    assert "invalid UTF-8" in doc["message"]
    assert (doc["line"], doc["index"], doc["field"]) == (2, 1, "new")
    assert doc["position"] == body.index(bad)
    assert f'(byte {doc["position"]}, event 1, field "new")' in doc["message"]


async def test_invalid_utf8_in_an_array_body_names_the_event_and_field(
    server: IngestServer, http: aiohttp.ClientSession, baseline: list[Any]
) -> None:
    body = b"[" + GOOD.strip() + b",\n" + line(b"{}", old=b'{"s":"\xc0\xaf"}').strip() + b"]"
    code, _, doc = await post(http, server, body, JSON)
    assert code == 400, doc
    assert (doc["index"], doc["field"], doc["position"]) == (1, "old", body.index(b"\xc0"))


# -- 400: lone surrogate escapes -----------------------------------------------------------


async def test_a_lone_high_surrogate_escape_is_named_not_called_truncated(
    server: IngestServer, http: aiohttp.ClientSession, baseline: list[Any]
) -> None:
    body = GOOD + line(b'{"s":"\\ud800"}')
    doc = await refused(http, server, body, 400)
    assert "a lone UTF-16 surrogate escape \\ud800" in doc["message"]
    assert "truncated" not in doc["message"]
    assert doc["position"] == body.index(b"\\ud800")
    assert (doc["line"], doc["index"], doc["field"]) == (2, 1, "new")


async def test_an_escaped_backslash_before_u_is_not_a_surrogate(
    server: IngestServer, http: aiohttp.ClientSession, wal: Any
) -> None:
    code, _, _ = await post(http, server, line(b'{"s":"\\\\ud800"}'))
    assert code == 200
    assert stored(wal)[0][2].new == b'{"s":"\\\\ud800"}'


# -- 422: the writers' limits ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("new", "culprit", "reason"),
    [
        (
            b'{"a":' * 128 + b"{}" + b"}" * 128,
            b'{"a":' * 128,
            "nested deeper than 128 levels (ingest.max_json_depth",
        ),
        (b'{"n":[1,' + b"9" * 1001 + b"]}", b"9" * 1001, "a number of 1001 digits"),
        (
            b'{"n":-0.' + b"5" * 990 + b"e-1234567890}",
            b"-0." + b"5" * 990,
            "a number of 1001 digits",
        ),
        (b'{"' + b"k" * 50_001 + b'":1}', b'"' + b"k" * 50_001, "an object key of 50001 bytes"),
    ],
    ids=["depth", "integer", "float", "key"],
)
async def test_a_payload_past_a_writer_limit_is_422_at_its_byte(
    server: IngestServer,
    http: aiohttp.ClientSession,
    baseline: list[Any],
    new: bytes,
    culprit: bytes,
    reason: str,
) -> None:
    body = GOOD + line(b'{"ok":1}', old=new)
    doc = await refused(http, server, body, 422)
    assert doc["error"] == "invalid_events"
    [error] = doc["errors"]
    assert (error["index"], error["line"], error["field"]) == (1, 2, "old")
    assert reason in error["reason"]
    start = len(GOOD) + len(PREFIX) + len(b'{"ok":1},"old":')
    if culprit.startswith(b'{"a":'):  # the bracket that opens level 129
        assert error["position"] == start + 5 * 128
    else:
        assert error["position"] == body.index(culprit)
    assert f'event 1 at line 2, field "old" (byte {error["position"]})' in doc["message"]


async def test_each_refused_payload_of_a_request_is_listed(
    server: IngestServer, http: aiohttp.ClientSession, baseline: list[Any]
) -> None:
    deep = b'{"x":' + b"[" * 200 + b"]" * 200 + b"}"
    long_number = b'{"n":' + b"1" * 1500 + b"}"
    events = [GOOD, line(deep), GOOD, line(long_number, old=deep)]
    body = b"".join(events)
    doc = await refused(http, server, body, 422)
    assert doc["message"].startswith("2 of 4 events are invalid")
    found = [(e["index"], e["field"], e["reason"].split(" (")[0]) for e in doc["errors"]]
    assert found == [
        (1, "new", "nested deeper than 128 levels"),
        (3, "new", "a number of 1500 digits; the CDC writers take at most 1000"),
        (3, "old", "nested deeper than 128 levels"),
    ]


async def test_ingest_max_json_depth_sets_the_depth_limit(
    start_ingest: StartIngest, http: aiohttp.ClientSession, wal: Any
) -> None:
    server = await start_ingest(max_json_depth=3)
    code, _, _ = await post(http, server, line(b'{"a":{"b":[1]}}'))
    assert code == 200
    code, _, doc = await post(http, server, line(b'{"a":{"b":[[1]]}}'))
    assert code == 422
    assert doc["errors"][0]["reason"].startswith("nested deeper than 3 levels")
    assert wal.head_lsn() == 1


@pytest.mark.parametrize("array", [False, True], ids=["ndjson", "array"])
async def test_nesting_too_deep_to_decode_is_422_not_500(
    server: IngestServer, http: aiohttp.ClientSession, baseline: list[Any], array: bool
) -> None:
    """5,000 levels: msgspec raises RecursionError in the hot path and in the slow path."""
    deep = b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}"
    if array:
        body = b"[" + GOOD.strip() + b"," + line(deep).strip() + b"]"
        code, _, doc = await post(http, server, body, JSON)
        level = 2  # the array is level 1, an event level 2
    else:
        body = GOOD + line(deep)
        code, _, doc = await post(http, server, body)
        level = 1
    assert code == 422, doc
    [error] = doc["errors"]
    assert (error["index"], error["field"]) == (1, "new")
    assert error["reason"].startswith("nested deeper than 128 levels")
    # The first bracket past level 128 of the payload.
    start = body.index(deep)
    assert error["position"] == start + 5 + 127
    assert level + 128 < body[: error["position"] + 1].count(b"[") + level + 1
    assert "the rest of the request was not checked" in doc["message"]


async def test_an_integer_python_will_not_hold_is_422_not_malformed(
    server: IngestServer, http: aiohttp.ClientSession, baseline: list[Any]
) -> None:
    """5,000 digits is past Python's int-from-text limit (4,300): msgspec's slow path
    cannot decode the event, yet the answer names the number."""
    body = GOOD + line(b'{"n":' + b"7" * 5000 + b"}")
    doc = await refused(http, server, body, 422)
    [error] = doc["errors"]
    assert (error["index"], error["field"], error["position"]) == (1, "new", body.index(b"7777"))
    assert error["reason"].startswith("a number of 5000 digits")


async def test_numbers_python_floats_cannot_hold_are_taken(
    server: IngestServer, http: aiohttp.ClientSession, wal: Any
) -> None:
    """The writers take 1e400 (as Infinity). A request with another invalid event is
    explained by the slow path, which must not choke on it either."""
    new = b'{"big":1e400,"small":-1e-400,"long":' + b"1" * 999 + b".5}"
    code, _, _ = await post(http, server, line(new))
    assert code == 200
    body = line(new) + b'{"collection":"c","op":"update","key":"k"}\n'
    code, _, doc = await post(http, server, body)
    assert code == 422
    assert doc["errors"] == [
        {"index": 1, "line": 2, "field": "new", "reason": 'an update needs the "new" object'}
    ]
    assert wal.head_lsn() == 1


async def test_edge_payloads_within_the_limits_are_stored_byte_for_byte(
    server: IngestServer, http: aiohttp.ClientSession, wal: Any
) -> None:
    payloads = [
        b'{"a":' * 127 + b"{}" + b"}" * 127,
        b'{"n":-' + b"9" * 1000 + b',"f":0.' + b"1" * 999 + b"}",
        b'{"' + "\U0001f600".encode() * 12_500 + b'":1}',
        b'{"dup":1,"dup":2}',
        '{"s":"\ufeff\U0010ffff\\ud83d\\ude00"}'.encode(),
    ]
    code, _, doc = await post(http, server, b"".join(line(p) for p in payloads))
    assert code == 200, doc
    assert [ev.new for _, _, ev in stored(wal)] == payloads
