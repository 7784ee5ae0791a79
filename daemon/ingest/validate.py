"""Ingest's parse/validate seam: the event as producers send it, and the answers
that refuse a request.

``InEvent`` and the msgspec decoders are the hot path (step 3 of
:mod:`daemon.ingest.server`); ``explain_body`` and ``explain_event`` are the
slow path behind a 400/413/422, run only when the hot path refused a body,
and say every problem with its line, column or index and field.
``_stored_payload`` is the stored form (step 4), checked against
:class:`daemon.events.StoredEvent` at import time.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

import msgspec
import structlog
from aiohttp import web

from daemon.config import OPS, IngestConfig
from daemon.errors import DaemonError
from daemon.events import StoredEvent
from daemon.events import decode as decode_stored
from daemon.events import encode as encode_stored

log = structlog.get_logger("eventplane.ingest")

# A collection names a Spark partition directory: bounded like a file name.
COLLECTION_MAX_CHARS = 256
# A 422 lists at most this many problems; the message gives the full count.
MAX_REPORTED_ERRORS = 100
# ``ingest.max_event_id_chars``'s default, for callers without a config.
EVENT_ID_MAX_CHARS = IngestConfig().max_event_id_chars

# The producer's event time ("time"): an RFC 3339 date-time with an offset, or
# integer epoch milliseconds. Stored as UTC epoch microseconds (Spark's
# TIMESTAMP), within years 0001-9999 UTC, the range Spark and Python share.
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
EVENT_TIME_MIN_US = (datetime(1, 1, 1, tzinfo=UTC) - _EPOCH) // _MICROSECOND
EVENT_TIME_MAX_US = (
    datetime(9999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC) - _EPOCH
) // _MICROSECOND
_AwareDatetime = Annotated[datetime, msgspec.Meta(tz=True)]
_EpochMillis = Annotated[
    int, msgspec.Meta(ge=-(-EVENT_TIME_MIN_US // 1000), le=EVENT_TIME_MAX_US // 1000)
]
_TIME_FORMS = (
    'an RFC 3339 date-time with an offset ("2025-01-02T03:04:05.123Z") '
    "or integer epoch milliseconds"
)
_TIME_RANGE = "outside 0001-01-01T00:00:00Z .. 9999-12-31T23:59:59.999999Z"


def event_time_us(value: datetime | int) -> int | None:
    """A decoded ``time`` (aware datetime, or epoch ms) as UTC epoch µs; None when out of range.

    Digits past the microsecond were rounded by the decoder.
    """
    us = value * 1000 if isinstance(value, int) else (value - _EPOCH) // _MICROSECOND
    return us if EVENT_TIME_MIN_US <= us <= EVENT_TIME_MAX_US else None


# -- the event as producers send it -------------------------------------------

_NULL = msgspec.Raw(b"null")
_LBRACE = 0x7B  # first byte of a JSON object's raw text


class InEvent(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """One event of a request. ``new``/``old`` stay raw JSON text (``Raw``).

    ``id`` and ``time`` (``event_id``/``event_time`` here) are optional; the
    length limit of ``id`` is a setting, so ``IngestServer._encode`` checks it,
    and it turns ``time`` into µs (:func:`event_time_us`).
    """

    collection: Annotated[str, msgspec.Meta(min_length=1, max_length=COLLECTION_MAX_CHARS)]
    op: Literal["insert", "update", "delete"]
    key: str
    new: msgspec.Raw = _NULL
    old: msgspec.Raw = _NULL
    event_id: Annotated[str, msgspec.Meta(min_length=1)] | None = msgspec.field(
        default=None, name="id"
    )
    event_time: _AwareDatetime | _EpochMillis | None = msgspec.field(default=None, name="time")


_FIELDS = ("collection", "op", "key", "new", "old", "id", "time")
_decode_one = msgspec.json.Decoder(InEvent).decode
_decode_many = msgspec.json.Decoder(list[InEvent]).decode
_decode_any = msgspec.json.Decoder().decode
_json = msgspec.json.Encoder().encode
# msgspec's encode() hands back its growing buffer as the bytes object: up to
# 1.5x the payload's length allocated (tracemalloc, msgspec 0.22: 1.0-1.85x from
# 66 B to 20 KiB). Ingest uses it all the same (``IngestServer._encode``): it is
# ~110 ns per event cheaper than encoding into a reused bytearray and copying
# out, and a payload object now lives only until its group commit, which joins
# the payloads of each core into one exact-size buffer (the frame section that
# the rings hold, ``wal.Wal.set_batch_listener``).
_msgpack_encode = msgspec.msgpack.Encoder().encode
_msgpack_into = msgspec.msgpack.Encoder().encode_into


def _stored_payload(
    collection: str,
    op: str,
    key: str,
    new: bytes | None,
    old: bytes | None,
    ts: int,
    event_id: str | None = None,
    event_time_us: int | None = None,
) -> bytes:
    """``encode(StoredEvent(...))`` without building the struct.

    ``StoredEvent`` is ``array_like``, so its msgpack form is the array of its
    fields in order; encoding that tuple gives the same bytes a third faster.
    An event without ``event_id`` and ``event_time_us`` is written in the
    8-element form (what every payload was before those fields existed): it
    decodes to the same ``StoredEvent`` and costs ingest nothing for them.
    :func:`_check_payload_layout` proves both at import time;
    ``IngestServer._encode`` inlines this.
    """
    scratch = bytearray()
    if event_id is None and event_time_us is None:
        _msgpack_into((collection, op, key, new, old, ts, 0, ""), scratch)
    else:
        _msgpack_into((collection, op, key, new, old, ts, 0, "", event_id, event_time_us), scratch)
    return bytes(scratch)


def _check_payload_layout() -> None:
    new = b'{"a":1}'
    full = StoredEvent("c", "update", "k", new, None, 123, 0, "", "e-1", 1_700_000_000_000_000)
    plain = StoredEvent("c", "update", "k", new, None, 123)
    plain_long = encode_stored(plain)
    short = _stored_payload("c", "update", "k", new, None, 123)
    if (
        encode_stored(full)
        != _stored_payload("c", "update", "k", new, None, 123, "e-1", 1_700_000_000_000_000)
        # The short form is StoredEvent's encoding without its two trailing
        # nils: the same bytes but for the array header (fixarray 10 -> 8).
        or plain_long[0] != 0x9A
        or plain_long[-2:] != b"\xc0\xc0"
        or short != b"\x98" + plain_long[1:-2]
        or decode_stored(short) != plain
    ):  # StoredEvent changed: update _stored_payload and IngestServer._encode
        raise DaemonError(
            "daemon.ingest.validate: _stored_payload no longer matches StoredEvent's layout"
        )


_check_payload_layout()


# -- rejections ---------------------------------------------------------------


class Rejection(Exception):
    """An answer other than 200; the body is JSON with ``error`` and ``message``."""

    def __init__(
        self,
        status: int,
        error: str,
        message: str,
        *,
        close: bool = False,
        retry_after: int | None = None,
        **details: Any,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body: dict[str, Any] = {"error": error, "message": message, **details}
        self.close = close
        self.retry_after = retry_after

    def response(self) -> web.Response:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        resp = web.Response(
            status=self.status,
            body=_json(self.body),
            content_type="application/json",
            headers=headers,
        )
        if self.close:
            resp.force_close()
        return resp


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _explain_time(value: Any) -> str | None:
    """Why ``value`` is not an accepted ``time``; None when it is."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            parsed: datetime | int = msgspec.convert(value, _AwareDatetime)
        except msgspec.ValidationError:
            try:
                msgspec.convert(value, datetime)
            except msgspec.ValidationError:
                shown = value if len(value) <= 40 else value[:37] + "..."
                return f"expected {_TIME_FORMS}, got {_json(shown).decode()}"
            return 'a date-time needs its UTC offset: end it with "Z" or "+hh:mm"'
    elif isinstance(value, int) and not isinstance(value, bool):
        parsed = value
    elif isinstance(value, float):
        return f"expected {_TIME_FORMS}, got a number that is not an integer"
    else:
        return f"expected {_TIME_FORMS}, got {_kind(value)}"
    return None if event_time_us(parsed) is not None else _TIME_RANGE


def explain_event(
    item: Any, max_id_chars: int = EVENT_ID_MAX_CHARS
) -> list[tuple[str | None, str]]:
    """Every problem of one decoded event as ``(field, reason)``; empty when valid.

    This is the slow path behind a 422 and the reference for the rules the hot
    path checks: ``collection`` a non-empty string of at most 256 characters,
    ``op`` one of insert/update/delete, ``key`` a string, ``new``/``old`` an
    object or null (absent means null), optional ``id`` (null, or a non-empty
    string of at most ``max_id_chars`` characters) and ``time`` (null, an RFC
    3339 date-time with an offset, or integer epoch milliseconds, within years
    0001-9999 UTC), no other fields; an insert carries ``new`` and no ``old``,
    an update carries ``new`` (``old`` optional), a delete carries no ``new``
    (``old`` optional).
    """
    if not isinstance(item, dict):
        return [(None, f"expected an event object, got {_kind(item)}")]
    problems: list[tuple[str | None, str]] = []
    collection = item.get("collection")
    if "collection" not in item:
        problems.append(("collection", "required field is missing"))
    elif not isinstance(collection, str):
        problems.append(("collection", f"expected a string, got {_kind(collection)}"))
    elif not collection:
        problems.append(("collection", "must not be empty"))
    elif len(collection) > COLLECTION_MAX_CHARS:
        problems.append(("collection", f"longer than {COLLECTION_MAX_CHARS} characters"))
    op = item.get("op")
    if "op" not in item:
        problems.append(("op", "required field is missing"))
    elif op not in OPS:
        shown = f'"{op}"' if isinstance(op, str) else _kind(op)
        problems.append(("op", f'expected "insert", "update" or "delete", got {shown}'))
    if "key" not in item:
        problems.append(("key", "required field is missing"))
    elif not isinstance(item["key"], str):
        problems.append(("key", f"expected a string, got {_kind(item['key'])}"))
    for name in ("new", "old"):
        value = item.get(name)
        if value is not None and not isinstance(value, dict):
            problems.append((name, f"expected an object or null, got {_kind(value)}"))
    new, old = item.get("new"), item.get("old")
    if op == "insert":
        if new is None:
            problems.append(("new", 'an insert needs the "new" object'))
        if old is not None:
            problems.append(("old", 'an insert has no previous row: send null or leave "old" out'))
    elif op == "update":
        if new is None:
            problems.append(("new", 'an update needs the "new" object'))
    elif op == "delete" and new is not None:
        problems.append(("new", 'a delete has no new row: send null or leave "new" out'))
    event_id = item.get("id")
    if event_id is None:
        pass
    elif not isinstance(event_id, str):
        problems.append(("id", f"expected a string or null, got {_kind(event_id)}"))
    elif not event_id:
        problems.append(("id", 'must not be empty: send null or leave "id" out'))
    elif len(event_id) > max_id_chars:
        problems.append(
            ("id", f"longer than {max_id_chars} characters (ingest.max_event_id_chars)")
        )
    time_problem = _explain_time(item.get("time"))
    if time_problem is not None:
        problems.append(("time", time_problem))
    for name in item:
        if name not in _FIELDS:
            problems.append((name, f"unknown field (fields: {', '.join(_FIELDS)})"))
    return problems


_BYTE_AT = re.compile(r"\s*\(byte (\d+)\)$")


def _malformed(body: bytes, base: int, chunk: bytes, exc: Exception, where: str) -> Rejection:
    """A 400 for ``exc`` raised while decoding ``chunk`` found at ``body[base:]``."""
    if isinstance(exc, UnicodeDecodeError):
        try:
            chunk.decode("utf-8")
            offset = 0
        except UnicodeDecodeError as bad:
            offset = bad.start
        reason = "invalid UTF-8"
    else:
        text = str(exc)
        m = _BYTE_AT.search(text)
        offset = int(m.group(1)) if m else len(chunk)
        reason = _BYTE_AT.sub("", text)
        if reason == "Input data was truncated":
            reason = "JSON is truncated (the value does not end)"
    position = base + offset
    line = body.count(b"\n", 0, position) + 1
    column = position - (body.rfind(b"\n", 0, position) + 1) + 1
    return Rejection(
        400,
        "malformed",
        f"malformed JSON at line {line}, column {column} (byte {position}{where}): "
        f"{reason}; nothing was stored",
        line=line,
        column=column,
        position=position,
    )


def _disagreement(exc: Exception | None) -> Rejection:
    """The typed decoder refused what :func:`explain_event` accepts: still a 422, never a 500."""
    log.warning("ingest.validation_disagreement", error=str(exc))
    reason = str(exc) if exc is not None else "an event breaks the op/new/old rules"
    return Rejection(
        422,
        "invalid_events",
        f"invalid events: {reason}; nothing was stored",
        errors=[{"index": None, "field": None, "reason": reason}],
        truncated=False,
    )


def explain_body(
    body: bytes,
    ndjson: bool,
    check_count: Callable[[int], None],
    max_id_chars: int = EVENT_ID_MAX_CHARS,
) -> None:
    """The slow path: find every problem and raise the 400/413/422 that says so.

    ``check_count`` raises the 413 for too many events (the server's limit);
    ``max_id_chars`` is ``ingest.max_event_id_chars``.
    """
    located: list[tuple[int | None, Any]] = []  # (line, decoded item)
    if ndjson:
        base = 0
        for lineno, line in enumerate(body.split(b"\n"), start=1):
            if line.strip():
                try:
                    located.append((lineno, _decode_any(line)))
                except (msgspec.DecodeError, UnicodeDecodeError) as exc:
                    raise _malformed(body, base, line, exc, "") from None
            base += len(line) + 1
    else:
        try:
            doc = _decode_any(body)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise _malformed(body, 0, body, exc, " of the array") from None
        if not isinstance(doc, list):
            raise Rejection(
                400,
                "malformed",
                f"an application/json body must be an array of events, got {_kind(doc)}; "
                "nothing was stored",
            )
        located = [(None, item) for item in doc]
    check_count(len(located))
    errors: list[dict[str, Any]] = []
    bad_items = 0
    for index, (at_line, item) in enumerate(located):
        problems = explain_event(item, max_id_chars)
        if problems:
            bad_items += 1
        for field, reason in problems:
            if len(errors) < MAX_REPORTED_ERRORS:
                entry: dict[str, Any] = {"index": index, "field": field, "reason": reason}
                if at_line is not None:
                    entry["line"] = at_line
                errors.append(entry)
    if not errors:
        return
    first = errors[0]
    where = f"event {first['index']}" + (f" at line {first['line']}" if "line" in first else "")
    field = f', field "{first["field"]}"' if first["field"] else ""
    raise Rejection(
        422,
        "invalid_events",
        f"{bad_items} of {len(located)} events are invalid (first: {where}{field}: "
        f"{first['reason']}); nothing was stored",
        errors=errors,
        truncated=bad_items > MAX_REPORTED_ERRORS or len(errors) >= MAX_REPORTED_ERRORS,
    )
