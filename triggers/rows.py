"""Matched rows as the actions see them: one JSON object per row.

Spark renders each matched row once (``to_json`` of the batch columns), and
the engine keeps that text as ``bytes`` from then on: a webhook body, a retry
queue entry and a DLQ row are concatenations of the same bytes, never a
re-encoding. A row document::

    {"idempotency_key": "large-orders:42", "lsn": 42, "core": 1, "seq": 7,
     "collection": "orders", "op": "insert", "key": "o-1",
     "new": {"amount": 1500}, "old": null,
     "ingest_ts": "2025-01-02T03:04:05.123456Z", "batch_id": 9,
     "event_id": "evt-7", "event_time": "2025-01-02T03:04:05.000000Z",
     "producer": "orders-svc", "depth": 0, "source": ""}

``event_id``/``event_time`` are the producer's (null when it sent none, and for
events an emit action made); ``producer`` is the name of the token or client
certificate the request was authenticated with (null when ingest is open);
rows stored before they existed lack them.

Rows matched by an ``emit`` trigger with ``key``/``new`` expressions also
carry ``"emit": {"key": ..., "new": ...}``, the values Spark computed.

Rows a trigger's ``when`` (or emit expressions) failed on go to its DLQ
without ever being known to match; they carry ``"stage": "when"`` last. A
replay evaluates ``when`` on them again before any action sees them, and the
rows that match then are rendered afresh (without the marker).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec

_encode = msgspec.json.encode
_docs_decoder = msgspec.json.Decoder(list[msgspec.Raw])
_dict_decoder = msgspec.json.Decoder(dict[str, Any])


class Row(NamedTuple):
    lsn: int
    doc: bytes  # the row's JSON object, idempotency_key first


class RowMeta(msgspec.Struct, frozen=True):
    """The fields of a row document the engine and the DLQ index by."""

    lsn: int
    collection: str
    op: str
    key: str
    depth: int = 0


_meta_decoder = msgspec.json.Decoder(RowMeta)

# The value of a row document's "stage" member: the trigger's `when` has not
# given an answer for the row yet.
STAGE_WHEN = "when"


class _Stage(msgspec.Struct, frozen=True):
    stage: str | None = None  # top-level member only: "stage" inside new/old is data


_stage_decoder = msgspec.json.Decoder(_Stage)


def idempotency_key(trigger: str, lsn: int) -> str:
    """Invariant 8: every action gets ``"<trigger>:<lsn>"``."""
    return f"{trigger}:{lsn}"


def with_key(trigger: str, lsn: int, doc: bytes) -> bytes:
    """Prefix a Spark-rendered row object with its idempotency key."""
    return b'{"idempotency_key":' + _encode(idempotency_key(trigger, lsn)) + b"," + doc[1:]


def with_member(doc: bytes, name: str, value_json: bytes) -> bytes:
    """Append ``"name": value`` to a JSON object."""
    return doc[:-1] + b"," + _encode(name) + b":" + value_json + b"}"


def unevaluated(trigger: str, lsn: int, doc: bytes) -> bytes:
    """A row document (as Spark renders it) for the DLQ of a trigger that failed on it."""
    return with_member(with_key(trigger, lsn, doc), "stage", _encode(STAGE_WHEN))


def is_unevaluated(doc: bytes | str) -> bool:
    """True for a row its trigger's ``when`` has not been evaluated on (see :func:`unevaluated`)."""
    return _stage_decoder.decode(doc).stage == STAGE_WHEN


def join(docs: Sequence[bytes]) -> bytes:
    return b"[" + b",".join(docs) + b"]"


def split(array: bytes | str) -> list[bytes]:
    """Inverse of :func:`join`; each element keeps its exact bytes."""
    return [bytes(raw) for raw in _docs_decoder.decode(array)]


def meta(doc: bytes | str) -> RowMeta:
    return _meta_decoder.decode(doc)


def to_dict(doc: bytes | str) -> dict[str, Any]:
    return _dict_decoder.decode(doc)


def call_key(trigger: str, first_lsn: int, last_lsn: int) -> str:
    """The key a call gets when its chunk is formed: ``<trigger>:<first_lsn>-<last_lsn>``."""
    return f"{trigger}:{first_lsn}-{last_lsn}"


@dataclass(slots=True)
class Chunk:
    """Up to ``batch_size`` rows of one trigger, in LSN order: one action call.

    ``idempotency_key`` (the webhook's ``Idempotency-Key``) is fixed when the
    chunk is first formed, from its LSN range, and travels with its rows: the
    retry entry and the DLQ rows store it, and retries and DLQ replays send it
    again unchanged, so a receiver sees one key for one set of rows.
    """

    trigger: str
    docs: list[bytes]
    first_lsn: int
    last_lsn: int
    idempotency_key: str

    @classmethod
    def of(cls, trigger: str, rows: Sequence[Row], key: str | None = None) -> Chunk:
        """A chunk of ``rows``; a new one gets its key from their LSN range."""
        first, last = rows[0].lsn, rows[-1].lsn
        return cls(
            trigger, [r.doc for r in rows], first, last, key or call_key(trigger, first, last)
        )

    @classmethod
    def from_docs(cls, trigger: str, docs: list[bytes], key: str | None = None) -> Chunk:
        return cls.of(trigger, [Row(meta(d).lsn, d) for d in docs], key)

    def dicts(self) -> list[dict[str, Any]]:
        return [to_dict(d) for d in self.docs]

    def __len__(self) -> int:
        return len(self.docs)


def chunks(trigger: str, rows: Sequence[Row], size: int) -> list[Chunk]:
    return [Chunk.of(trigger, rows[i : i + size]) for i in range(0, len(rows), size)]
