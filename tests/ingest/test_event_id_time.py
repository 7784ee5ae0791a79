"""The producer's optional ``id`` and ``time``: stored with the event, refused with a 422
that names the field, and free for events that do not carry them."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from daemon.events import StoredEvent, decode
from daemon.ingest import validate
from daemon.ingest.server import IngestServer
from daemon.service.metrics import Metrics
from tests.ingest.conftest import JSON, StartIngest, event, make_cfg, ndjson, post, stored

EPOCH_MS = 1_735_787_045_123  # 2025-01-02T03:04:05.123Z


def us(text: str) -> int:
    return (datetime.fromisoformat(text) - datetime(1970, 1, 1, tzinfo=UTC)) // datetime.resolution


async def test_id_and_time_are_stored_with_the_event_in_utc_microseconds(
    ingest: IngestServer, http: aiohttp.ClientSession, wal: Any
) -> None:
    events = [
        event(1, id="evt-1", time="2025-01-02T04:04:05.123456+01:00"),
        event(2, id="evt-2", time=EPOCH_MS),
        event(3, op="delete", time="2025-01-02 03:04:05.1234567z"),  # rounded to the µs
        event(4, id="evt-4", time=None),
        event(5, id=None, time=None),
        event(6),
    ]
    status, _, ack = await post(http, ingest, ndjson(events))
    assert status == 200 and ack["accepted"] == 6

    got = [(ev.event_id, ev.event_time_us) for _, _, ev in stored(wal)]
    assert got == [
        ("evt-1", us("2025-01-02T03:04:05.123456+00:00")),
        ("evt-2", EPOCH_MS * 1000),
        (None, us("2025-01-02T03:04:05.123457+00:00")),
        ("evt-4", None),
        (None, None),
        (None, None),
    ]


async def test_events_without_id_and_time_keep_the_eight_element_payload(
    ingest: IngestServer, http: aiohttp.ClientSession, wal: Any
) -> None:
    """No extra byte for producers that do not send them: the payload is the
    8-element array every payload was before (msgpack fixarray 0x98)."""
    status, _, _ = await post(http, ingest, ndjson([event(1), event(2, id="e-2")]))
    assert status == 200
    plain, with_id = (r.payload for r in wal.read(1))
    assert plain[0] == 0x98 and len(msgspec.msgpack.decode(plain)) == 8
    assert with_id[0] == 0x9A and msgspec.msgpack.decode(with_id)[8:] == ["e-2", None]


def test_wal_payloads_of_eight_elements_decode_with_null_id_and_time() -> None:
    """A payload written before the fields existed (what a WAL holds after an upgrade)."""
    old = msgspec.msgpack.encode(["orders", "update", "k", b'{"a":1}', b"{}", 123, 2, "t1"])

    assert decode(old) == StoredEvent("orders", "update", "k", b'{"a":1}', b"{}", 123, 2, "t1")
    assert (decode(old).event_id, decode(old).event_time_us) == (None, None)


async def test_a_json_array_carries_id_and_time_too(
    ingest: IngestServer, http: aiohttp.ClientSession, wal: Any
) -> None:
    body = msgspec.json.encode([event(1, id="a", time=0)])
    status, _, _ = await post(http, ingest, body, JSON)
    assert status == 200
    [(_, _, ev)] = stored(wal)
    assert (ev.event_id, ev.event_time_us) == ("a", 0)


BAD_TIMES = [
    ("2025-01-02T03:04:05", 'needs its UTC offset: end it with "Z" or "+hh:mm"'),
    ("2025-01-02", 'got "2025-01-02"'),
    ("yesterday", 'got "yesterday"'),
    ("2016-12-31T23:59:60Z", 'got "2016-12-31T23:59:60Z"'),  # leap seconds are refused
    ("2025-01-02T03:04:05,5Z", 'got "2025-01-02T03:04:05,5Z"'),
    (1.5, "got a number that is not an integer"),
    (1.7e12, "got a number that is not an integer"),
    (True, "got boolean"),
    ({"ms": 1}, "got object"),
    (253_402_300_800_000, "outside 0001-01-01T00:00:00Z .. 9999-12-31T23:59:59.999999Z"),
    ("0001-01-01T00:00:00+01:00", "outside 0001-01-01T00:00:00Z"),
]


@pytest.mark.parametrize(("value", "phrase"), BAD_TIMES)
async def test_bad_time_forms_get_a_422_naming_the_field_and_store_nothing(
    ingest: IngestServer, http: aiohttp.ClientSession, wal: Any, value: Any, phrase: str
) -> None:
    body = ndjson([event(0), event(1, time=value)])
    status, _, doc = await post(http, ingest, body)

    assert status == 422 and doc["error"] == "invalid_events"
    [problem] = doc["errors"]
    assert (problem["index"], problem["line"], problem["field"]) == (1, 2, "time")
    assert phrase in problem["reason"], problem["reason"]
    assert 'field "time"' in doc["message"] and "nothing was stored" in doc["message"]
    assert wal.head_lsn() == 0


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("", 'must not be empty: send null or leave "id" out'),
        (17, "expected a string or null, got number"),
        (["a"], "expected a string or null, got array"),
        ("x" * 9, "longer than 8 characters (ingest.max_event_id_chars)"),
    ],
)
async def test_bad_ids_get_a_422_naming_the_field(
    start_ingest: StartIngest, http: aiohttp.ClientSession, wal: Any, value: Any, reason: str
) -> None:
    server = await start_ingest(max_event_id_chars=8)
    status, _, doc = await post(http, server, ndjson([event(0, id="x" * 8), event(1, id=value)]))

    assert status == 422
    assert doc["errors"] == [{"index": 1, "line": 2, "field": "id", "reason": reason}]
    assert wal.head_lsn() == 0


async def test_a_misspelt_field_next_to_id_and_time_is_still_refused(
    ingest: IngestServer, http: aiohttp.ClientSession, wal: Any
) -> None:
    status, _, doc = await post(http, ingest, ndjson([event(1, id="a", event_time=EPOCH_MS)]))

    assert status == 422
    [problem] = doc["errors"]
    assert problem["field"] == "event_time"
    assert problem["reason"] == "unknown field (fields: collection, op, key, new, old, id, time)"


TIME_VALUES: list[Any] = [
    None,
    0,
    -1,
    EPOCH_MS,
    -62_135_596_800_000,  # 0001-01-01T00:00:00Z
    -62_135_596_800_001,
    253_402_300_799_999,  # 9999-12-31T23:59:59.999Z
    253_402_300_800_000,
    1.0,
    False,
    "2025-01-02T03:04:05Z",
    "2025-01-02T03:04:05.123456789-07:30",
    "2025-01-02t03:04:05z",
    "2025-01-02 03:04:05+00:00",
    "2025-01-02T03:04:05",
    "2025-01-02T03:04Z",
    "9999-12-31T23:59:59.999999Z",
    "9999-12-31T23:59:59-00:01",
    "0001-01-01T00:00:00Z",
    "0001-01-01T00:00:00+00:01",
    "",
    [],
]


@pytest.mark.parametrize("value", TIME_VALUES, ids=repr)
def test_hot_path_and_explanation_agree_on_every_time_form(tmp_path: Path, value: Any) -> None:
    """The typed decoder + ``_encode`` accept exactly what ``explain_event`` finds no problem in."""
    server = IngestServer(make_cfg(tmp_path), None, Metrics(), lambda: 0)  # type: ignore[arg-type]
    line = msgspec.json.encode(event(1, time=value))
    try:
        accepted = server._encode([validate._decode_one(line)]) is not None
    except msgspec.ValidationError:
        accepted = False
    problems = validate.explain_event(msgspec.json.decode(line))

    assert accepted == (problems == []), problems
    assert all(field == "time" for field, _ in problems)


def test_a_refused_request_leaves_nothing_for_the_next_one_in_the_per_core_lists(
    tmp_path: Path,
) -> None:
    """``_encode`` reuses its per-core lists: a request refused half way (a rule
    broken at event 5, an event over the size limit at event 7) must not leave
    its first events to be stored with the next request."""
    server = IngestServer(
        make_cfg(tmp_path, cores=8, max_event_bytes=200), None, Metrics(), lambda: 0
    )  # type: ignore[arg-type]

    def decoded(events: list[dict[str, Any]]) -> list[validate.InEvent]:
        return [validate._decode_one(msgspec.json.encode(e)) for e in events]

    broken = [event(i) for i in range(8)]
    broken[5] = event(5, op="delete", new={"x": 1})  # a delete with a new row
    assert server._encode(decoded(broken)) is None
    too_large = [event(i) for i in range(8)]
    too_large[7] = event(7, new={"pad": "x" * 300})
    with pytest.raises(validate.Rejection):
        server._encode(decoded(too_large))

    good = server._encode(decoded([event(i) for i in (100, 101, 102)]))
    assert good is not None and len(good) == 3
    assert [decode(payload).key for _core, payload in good] == ["k100", "k101", "k102"]
    assert sum(len(s.deltas) for s in good.sections) == 3
