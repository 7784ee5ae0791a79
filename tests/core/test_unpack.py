"""Stored events -> Arrow columns a field at a time (``daemon.spark.unpack``)
give what one decode per event gives, or refuse and leave it to that path."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.events import StoredEvent, encode
from daemon.ingest.validate import _stored_payload
from daemon.spark import frame
from daemon.spark.unpack import stored_columns
from wal.record import Record

FIELDS = (
    "collection",
    "op",
    "key",
    "new",
    "old",
    "ingest_ts_ns",
    "event_id",
    "event_time_us",
    "depth",
    "source",
    "producer",
)

# Lengths that cross every msgpack size class: fixstr (< 32), str8/bin8 (< 256),
# str16/bin16 (< 65,536) and str32/bin32.
_text = st.one_of(
    st.text(max_size=40),
    st.text(min_size=250, max_size=300),
    st.builds(lambda n: "é" * n, st.sampled_from([0, 31, 32, 255, 256, 40_000])),
)
_json = st.one_of(
    st.none(),
    st.binary(max_size=40).map(lambda b: b'{"b":"' + b.hex().encode() + b'"}'),
    st.sampled_from([300, 70_000]).map(lambda n: b'{"x":"' + b"y" * n + b'"}'),
)
_int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@st.composite
def stored(draw: Any) -> bytes:
    """One payload as the WAL holds it: ingest's short, long or producer form,
    or an emit action's ``encode(StoredEvent)`` with a depth and a source."""
    collection, key = draw(_text), draw(_text)
    new, old = draw(_json), draw(_json)
    op = draw(st.sampled_from(["insert", "update", "delete"]))
    ts = draw(st.integers(min_value=0, max_value=2**63 - 1))
    form = draw(st.sampled_from(["ingest", "derived"]))
    event_id = draw(st.one_of(st.none(), _text))
    event_time = draw(st.one_of(st.none(), _int64))
    producer = draw(st.one_of(st.none(), _text))
    if form == "ingest":
        return _stored_payload(collection, op, key, new, old, ts, event_id, event_time, producer)
    depth = draw(st.integers(min_value=0, max_value=2**31 - 1))
    source = draw(_text)
    return encode(
        StoredEvent(
            collection, op, key, new, old, ts, depth, source, event_id, event_time, producer
        )
    )


def starts_of(payloads: list[bytes]) -> np.ndarray:
    lengths = np.array([len(p) for p in payloads], np.int64)
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)


def as_lists(cols: dict[str, Any]) -> dict[str, list[Any]]:
    return {name: cols[name].to_pylist() for name in FIELDS}


@settings(max_examples=150, deadline=None)
@given(st.lists(stored(), min_size=1, max_size=40))
def test_every_field_of_every_form_reads_as_one_decode_per_event_reads_it(
    payloads: list[bytes],
) -> None:
    data = b"".join(payloads)

    cols = stored_columns(data, starts_of(payloads))

    assert cols is not None
    assert as_lists(cols) == as_lists(frame._decoded_columns(len(payloads), data))


def test_the_batch_table_is_the_same_with_and_without_the_field_reader() -> None:
    """Through ``_chunks`` and ``_record_batch``, both kinds of part."""
    from daemon.plane.parts import Rows, pack

    recs = [
        Record(
            i + 1,
            0,
            i + 1,
            _stored_payload(
                f"c{i % 3}",
                "update",
                f"k{i}",
                b'{"n":%d}' % i,
                b"{}",
                10**18 + i,
                f"e{i}" if i % 4 == 0 else None,
                i * 1000 if i % 5 == 0 else None,
                "svc" if i % 3 == 0 else None,
            ),
        )
        for i in range(100)
    ]
    for records in (recs, Rows([pack(recs[:33]), pack(recs[33:])])):
        for chunk in frame._chunks(records, 16):
            fast = frame._record_batch(*chunk, 7)
            general = frame._record_batch(*chunk[:4], None, 7)
            assert fast.equals(general)


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (msgspec.msgpack.encode(["c0", "insert", "k1", b"{}", None, 1_000]), "6 fields"),
        (msgspec.msgpack.encode(["c0", "insert", "k1", b"{}", None, 1.5, 0, ""]), "a float"),
        (msgspec.msgpack.encode(["c0", "insert", "k1", "{}", None, 1, 0, ""]), "str for bin"),
        (_stored_payload("c0", "insert", "k1", b"{}", None, 1)[:-1], "truncated"),
        (_stored_payload("c0", "insert", "k1", b"{}", None, 1) + b"\x00", "trailing byte"),
    ],
)
def test_a_payload_outside_the_stored_forms_is_left_to_the_general_path(
    payload: bytes, why: str
) -> None:
    good = _stored_payload("c0", "insert", "k0", b"{}", None, 1)
    payloads = [good, payload, good]

    assert stored_columns(b"".join(payloads), starts_of(payloads)) is None, why


def test_every_truncation_of_a_payload_is_left_to_the_general_path() -> None:
    """Cut anywhere (inside a length, an integer, a string), a payload is
    refused, never read past its end."""
    payload = _stored_payload("c0", "insert", "k1", b'{"a":1}', None, 2**62, "e-1", -5)
    for cut in range(len(payload)):
        assert stored_columns(payload[:cut], np.zeros(1, np.int64)) is None, cut


def test_an_old_eight_field_payload_reads_like_the_short_form() -> None:
    """Payloads written before event_id existed have 8 fields, like ingest's short form."""
    old = msgspec.msgpack.encode(["c0", "insert", "k1", b"{}", None, 1_000, 0, "t"])

    cols = stored_columns(old, np.zeros(1, np.int64))

    assert cols is not None
    assert as_lists(cols) == as_lists(frame._decoded_columns(1, old))


def test_a_corrupt_payload_still_raises_where_the_general_path_raises() -> None:
    bad = b"\x98\xff"
    with pytest.raises(msgspec.DecodeError):
        frame._record_batch([1], [0], [1], bad, np.zeros(1, np.int64), 1)
