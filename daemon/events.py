"""The stored form of a change event: what the WAL payload holds.

Encoded once at ingest with msgpack (msgspec, array-like: compact and the
fastest codec available to us) and decoded by consumers of the payload
(Spark executor, triggers). ``new`` and ``old`` keep the producer's JSON bytes
verbatim, so Spark's ``parse_json`` sees exactly what was sent.

Fields are only ever added at the end, with defaults: an array written before
they existed (the 8-element form of payloads already in WALs) still decodes.
Ingest encodes an event without ``event_id``/``event_time_us`` in that short
8-element form, with them in the 10-element form, and an authenticated
producer's event in the 11-element form (``daemon.ingest.validate._stored_payload``).
"""

from __future__ import annotations

from typing import Literal

import msgspec

Op = Literal["insert", "update", "delete"]


class StoredEvent(msgspec.Struct, array_like=True, frozen=True, gc=False):
    collection: str
    op: Op
    key: str
    new: bytes | None  # raw JSON object text, or None for null
    old: bytes | None
    ingest_ts_ns: int  # wall clock (time.time_ns) when the request was accepted
    depth: int = 0  # 0 = from a producer; n = made by an emit action n levels deep
    source: str = ""  # trigger name for derived events
    event_id: str | None = None  # the producer's event id ("id"), if it sent one
    event_time_us: int | None = None  # the producer's event time ("time"), UTC epoch µs
    # The authenticated producer's name (its token's or certificate's entry,
    # docs/security.md); None when ingest is open.
    producer: str | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StoredEvent)


def encode(event: StoredEvent) -> bytes:
    return _encoder.encode(event)


def decode(payload: bytes | memoryview) -> StoredEvent:
    return _decoder.decode(payload)
