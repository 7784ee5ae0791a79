"""Ingest's parse/validate seam: the event as producers send it, and the answers
that refuse a request.

``InEvent`` and the msgspec decoders are the hot path (step 3 of
:mod:`daemon.ingest.server`); ``explain_body`` and ``explain_event`` are the
slow path behind a 400/413/422, run only when the hot path refused a body,
and say every problem with its line, column or index and field.
``_stored_payload`` is the stored form (step 4), checked against
:class:`daemon.events.StoredEvent` at import time. The CDC writers' limits on
``new``/``old`` are :mod:`daemon.ingest.payload`'s; the slow path reports
them with the payload's byte position in the body.
"""

from __future__ import annotations

import re
from bisect import bisect_right
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
from daemon.ingest import payload

log = structlog.get_logger("eventplane.ingest")

# A collection names a Spark partition directory: bounded like a file name.
COLLECTION_MAX_CHARS = 256
# A 422 lists at most this many problems; the message gives the full count.
MAX_REPORTED_ERRORS = 100
# ``ingest.max_event_id_chars``'s default, for callers without a config.
EVENT_ID_MAX_CHARS = IngestConfig().max_event_id_chars
# ``ingest.max_json_depth``'s default, likewise.
JSON_DEPTH_MAX = IngestConfig().max_json_depth

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
# Any JSON into Python objects; a float Python cannot hold (1e400, which the CDC
# writers take as Infinity) becomes inf rather than msgspec's "Number out of range".
_decode_any = msgspec.json.Decoder(float_hook=float).decode
# The slow path's view of a body's structure: raw items of an array, raw members of an object.
_decode_raw_items = msgspec.json.Decoder(list[msgspec.Raw]).decode
_decode_raw_members = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
# What msgspec raises for a body it cannot take; RecursionError for one nested ~1000 deep.
DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError)
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
    producer: str | None = None,
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
    if producer is not None:  # an authenticated producer's event: the 11-element form
        fields = (collection, op, key, new, old, ts, 0, "", event_id, event_time_us, producer)
        _msgpack_into(fields, scratch)
    elif event_id is None and event_time_us is None:
        _msgpack_into((collection, op, key, new, old, ts, 0, ""), scratch)
    else:
        _msgpack_into((collection, op, key, new, old, ts, 0, "", event_id, event_time_us), scratch)
    return bytes(scratch)


def _check_payload_layout() -> None:
    new = b'{"a":1}'
    t = 1_700_000_000_000_000
    every = StoredEvent("c", "update", "k", new, None, 123, 0, "", "e-1", t, "svc")
    full = StoredEvent("c", "update", "k", new, None, 123, 0, "", "e-1", t)
    full_long = encode_stored(full)
    plain = StoredEvent("c", "update", "k", new, None, 123)
    plain_long = encode_stored(plain)
    short = _stored_payload("c", "update", "k", new, None, 123)
    if (
        encode_stored(every) != _stored_payload("c", "update", "k", new, None, 123, "e-1", t, "svc")
        # The 10-element form is StoredEvent's encoding without its trailing
        # nil producer (fixarray 11 -> 10); the short form also without the
        # nil event_id and event_time_us (fixarray 11 -> 8).
        or full_long[0] != 0x9B
        or full_long[-1:] != b"\xc0"
        or _stored_payload("c", "update", "k", new, None, 123, "e-1", t)
        != b"\x9a" + full_long[1:-1]
        or plain_long[-3:] != b"\xc0\xc0\xc0"
        or short != b"\x98" + plain_long[1:-3]
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
        headers: dict[str, str] | None = None,
        **details: Any,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body: dict[str, Any] = {"error": error, "message": message, **details}
        self.close = close
        self.retry_after = retry_after
        self.headers = headers

    def response(self) -> web.Response:
        headers = dict(self.headers) if self.headers else {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        try:
            body = _json(self.body)
        except UnicodeEncodeError:
            # A message quotes a header whose bytes were not UTF-8: aiohttp decodes them
            # to lone surrogates, which JSON cannot hold. Show them as escapes instead.
            body = _json(_escape_surrogates(self.body))
        resp = web.Response(
            status=self.status,
            body=body,
            content_type="application/json",
            headers=headers,
        )
        if self.close:
            resp.force_close()
        return resp


def _escape_surrogates(value: Any) -> Any:
    """``value`` with every lone surrogate in its strings written as ``\\udcff``."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {k: _escape_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escape_surrogates(v) for v in value]
    return value


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


# -- where a byte is: the slow path's walk over a body's structure -------------------------

_WS = re.compile(rb"[ \t\r\n]*")


def _ws(doc: bytes, pos: int = 0) -> int:
    """``pos`` moved past JSON whitespace."""
    m = _WS.match(doc, pos)
    return pos if m is None else m.end()


_STRING_AT = re.compile(payload.STRING, re.S)
# A value that is neither a string nor a container: a number, true, false, null.
_SCALAR_AT = re.compile(rb"[^ \t\r\n,\]}]+")
# The tokens of a walk that may stop inside a string (a prefix, or malformed text):
# strings (the closing quote optional), brackets, commas and colons; scalars are skipped.
_WALK = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{},:]', re.S)
_OPEN = frozenset(b"[{")
_CLOSE = frozenset(b"]}")


def _skip_value(doc: bytes, pos: int) -> int:
    """The end of the JSON value that starts at ``doc[pos]`` (text msgspec accepted)."""
    c = doc[pos]
    if c not in _OPEN:
        m = (_STRING_AT if c == 0x22 else _SCALAR_AT).match(doc, pos)
        return pos + 1 if m is None else m.end()
    level = 0
    for m in _WALK.finditer(doc, pos):
        c = doc[m.start()]
        if c in _OPEN:
            level += 1
        elif c in _CLOSE:
            level -= 1
            if level == 0:
                return m.end()
    return len(doc)


def _member_values(doc: bytes, start: int, end: int) -> dict[str, int]:
    """Where the value of each member of the JSON object ``doc[start:end]`` (text msgspec
    accepted) starts in ``doc``; of a repeated name, the last (the one decoders keep)."""
    raws = _decode_raw_members(memoryview(doc)[start:end])
    found: dict[str, int] = {}
    pos = _ws(doc, start) + 1  # past "{"
    while True:
        pos = _ws(doc, pos)
        m = _STRING_AT.match(doc, pos)
        if m is None:  # "}" of an empty object
            return found
        name = msgspec.json.decode(m.group(), type=str)
        pos = _ws(doc, _ws(doc, m.end()) + 1)  # past ":"
        found[name] = pos
        raw = raws[name]
        # A container that starts with the kept value's text is that value; anything
        # else (a scalar, an earlier value of a repeated name) is skipped token by token.
        if doc[pos] in _OPEN and doc.startswith(raw, pos):
            pos += len(raw)
        else:
            pos = _skip_value(doc, pos)
        pos = _ws(doc, pos)
        if doc[pos : pos + 1] != b",":
            return found
        pos += 1


def _item_spans(body: bytes) -> list[tuple[int, int]] | None:
    """Where each item of the JSON array ``body`` starts and ends; None when msgspec
    cannot decode it as an array."""
    try:
        items = _decode_raw_items(body)
    except DECODE_ERRORS:
        return None
    spans: list[tuple[int, int]] = []
    pos = _ws(body) + 1  # past "["
    for raw in items:
        pos = _ws(body, pos)
        if body[pos] == 0x2C:  # ","
            pos = _ws(body, pos + 1)
        spans.append((pos, pos + len(raw)))
        pos += len(raw)
    return spans


def _walk(doc: bytes, start: int, stop: int, level: int) -> tuple[int | None, str | None]:
    """Walk ``doc[start:stop]``, whose events are objects at nesting ``level``: how many
    items the enclosing array had before the one at ``stop`` (None outside an array),
    and the event's member whose value holds ``doc[stop]`` (None when not inside one)."""
    depth = 0
    items = 0
    key: str | None = None
    pending = b""  # the last string at the event's level: a member's name once ":" follows
    last = 0  # the last token at the event's level
    for m in _WALK.finditer(doc, start, stop):
        c = doc[m.start()]
        if c == 0x22:  # a string
            if depth == level and last != 0x3A:  # a name: the member before it has ended
                key = None
                pending = m.group()
        elif c == 0x3A:  # ":"
            if depth == level:
                try:
                    key = msgspec.json.decode(pending, type=str)
                except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
                    key = None
        elif c == 0x2C:  # ","
            if depth == level:
                key = None
            elif depth == level - 1:
                items += 1
        elif c in _OPEN:
            depth += 1
        else:
            depth -= 1
            if depth < level:
                key = None
        if depth == level:
            last = c
    index = items if level > 1 and depth >= level - 1 else None
    return index, (key if depth >= level else None)


def _locate(body: bytes, ndjson: bool, position: int) -> tuple[int | None, str | None]:
    """The event (its index in the request) and the field of it that hold ``body[position]``;
    None for either when the byte is not inside one."""
    if ndjson:
        start = body.rfind(b"\n", 0, position) + 1
        index = sum(1 for line in body[:start].split(b"\n") if line.strip())
        return index, _walk(body, start, position, 1)[1]
    spans = _item_spans(body)
    if spans is None:  # malformed or too deep: walk from the start
        return _walk(body, 0, position, 2)
    i = bisect_right(spans, (position, len(body))) - 1
    if i < 0 or position >= spans[i][1]:
        return None, None
    return i, _walk(body, spans[i][0], position, 1)[1]


# -- the answers of the slow path --------------------------------------------------------

_BYTE_AT = re.compile(r"\s*\(byte (\d+)\)$")
# What msgspec (0.23 and later) says of a string that is not UTF-8, without a position;
# earlier releases let Python's codec raise UnicodeDecodeError instead.
_INVALID_UTF8_SAID = "Invalid UTF-8 encoded string"
# What msgspec says of a high surrogate escape without a low one after it: "truncated"
# when fewer than six bytes follow it, else "unexpected end" of a pair.
_LONE_HIGH_SURROGATE_SAID = (
    "Input data was truncated",
    "JSON is malformed: unexpected end of escaped utf-16 surrogate pair",
)
_LONE_HIGH_SURROGATE = re.compile(
    rb"(?<!\\)(?:\\\\)*(\\u[dD][89abAB][0-9a-fA-F]{2})(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
)


def _where(index: int | None, field: str | None) -> str:
    event = f", event {index}" if index is not None else ""
    return event + (f', field "{field}"' if field is not None else "")


def _malformed(
    body: bytes, ndjson: bool, base: int, chunk: bytes, exc: Exception, where: str
) -> Rejection:
    """A 400 for ``exc`` raised while decoding ``chunk`` found at ``body[base:]``."""
    text = str(exc)
    if isinstance(exc, UnicodeDecodeError) or _BYTE_AT.sub("", text) == _INVALID_UTF8_SAID:
        # The first byte that is not UTF-8 by Python's codec, whichever layer refused it.
        try:
            chunk.decode("utf-8")
            offset = len(chunk)
        except UnicodeDecodeError as bad:
            offset = bad.start
        reason = "invalid UTF-8"
    else:
        m = _BYTE_AT.search(text)
        offset = int(m.group(1)) if m else len(chunk)
        reason = _BYTE_AT.sub("", text)
        if reason in _LONE_HIGH_SURROGATE_SAID:
            lone = _LONE_HIGH_SURROGATE.search(chunk)
            if lone is not None:
                offset = lone.start(1)
                escape = lone.group(1).decode()
                reason = (
                    f"a lone UTF-16 surrogate escape {escape}: a high surrogate "
                    "(\\ud800-\\udbff) must be followed by a low one (\\udc00-\\udfff)"
                )
            elif reason == "Input data was truncated":
                reason = "JSON is truncated (the value does not end)"
    position = base + offset
    line = body.count(b"\n", 0, position) + 1
    column = position - (body.rfind(b"\n", 0, position) + 1) + 1
    index, field = _locate(body, ndjson, position)
    return Rejection(
        400,
        "malformed",
        f"malformed JSON at line {line}, column {column} (byte {position}{where}"
        f"{_where(index, field)}): {reason}; nothing was stored",
        line=line,
        column=column,
        position=position,
        index=index,
        field=field,
    )


def _too_deep(body: bytes, ndjson: bool, base: int, chunk: bytes, max_depth: int) -> Rejection:
    """A 422 for a chunk that msgspec cannot decode for its depth (RecursionError)."""
    # An event's payload nests from level 2 of a line (the event is level 1), 3 of an array.
    level = 1 if ndjson else 2
    at = payload.first_too_deep(chunk, max_depth + level)
    return _undecodable(body, ndjson, base + (at or 0), payload.too_deep(max_depth))


def _huge_number(
    body: bytes, ndjson: bool, base: int, chunk: bytes, exc: msgspec.ValidationError
) -> Rejection:
    """A 422 for a chunk that msgspec cannot decode for an integer Python will not hold
    (more than ``sys.get_int_max_str_digits()``, 4300, digits)."""
    found = payload.long_number(chunk)
    if found is None:  # not a long number after all: say what msgspec said
        return _malformed(body, ndjson, base, chunk, exc, "" if ndjson else " of the array")
    return _undecodable(body, ndjson, base + found.offset, found.reason)


def _undecodable(body: bytes, ndjson: bool, position: int, reason: str) -> Rejection:
    """The 422 for a problem that stops the slow path's decoding: it is reported alone."""
    index, field = _locate(body, ndjson, position)
    entry: dict[str, Any] = {"index": index, "field": field, "reason": reason}
    if ndjson:
        entry["line"] = body.count(b"\n", 0, position) + 1
    entry["position"] = position
    return Rejection(
        422,
        "invalid_events",
        f"an event is invalid ({_describe(entry)}); the rest of the request was not "
        "checked; nothing was stored",
        errors=[entry],
        truncated=False,
    )


def _describe(entry: dict[str, Any]) -> str:
    """One 422 error entry as words: ``event 3 at line 4, field "new" (byte 97): why``."""
    where = "event" if entry["index"] is None else f"event {entry['index']}"
    if "line" in entry:
        where += f" at line {entry['line']}"
    if entry["field"]:
        where += f', field "{entry["field"]}"'
    if "position" in entry:
        where += f" (byte {entry['position']})"
    return f"{where}: {entry['reason']}"


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


def _payload_problems(
    body: bytes, start: int, end: int, item: Any, max_depth: int
) -> list[tuple[str, str, int]]:
    """``(field, reason, position in the body)`` of each of the event ``body[start:end]``'s
    payloads that :func:`daemon.ingest.payload.problem` refuses."""
    if not isinstance(item, dict) or start < 0:
        return []
    gate = payload.min_length(max_depth)
    raws: dict[str, msgspec.Raw] | None = None
    offsets: dict[str, int] | None = None
    found: list[tuple[str, str, int]] = []
    for field in ("new", "old"):
        if not isinstance(item.get(field), dict):
            continue
        if raws is None:
            raws = _decode_raw_members(memoryview(body)[start:end])
        text = bytes(raws[field])
        if len(text) < gate:
            continue
        problem = payload.problem(text, max_depth)
        if problem is None:
            continue
        if offsets is None:
            offsets = _member_values(body, start, end)
        found.append((field, problem.reason, offsets[field] + problem.offset))
    return found


def explain_body(
    body: bytes,
    ndjson: bool,
    check_count: Callable[[int], None],
    max_id_chars: int = EVENT_ID_MAX_CHARS,
    max_depth: int = JSON_DEPTH_MAX,
) -> None:
    """The slow path: find every problem and raise the 400/413/422 that says so.

    ``check_count`` raises the 413 for too many events (the server's limit);
    ``max_id_chars`` is ``ingest.max_event_id_chars``, ``max_depth``
    ``ingest.max_json_depth``.
    """
    # (line, where the event starts and ends in the body, the decoded item)
    located: list[tuple[int | None, int, int, Any]] = []
    if ndjson:
        base = 0
        for lineno, line in enumerate(body.split(b"\n"), start=1):
            if line.strip():
                try:
                    item = _decode_any(line)
                except msgspec.ValidationError as exc:
                    raise _huge_number(body, True, base, line, exc) from None
                except (msgspec.DecodeError, UnicodeDecodeError) as exc:
                    raise _malformed(body, True, base, line, exc, "") from None
                except RecursionError:
                    raise _too_deep(body, True, base, line, max_depth) from None
                located.append((lineno, base, base + len(line), item))
            base += len(line) + 1
    else:
        try:
            doc = _decode_any(body)
        except msgspec.ValidationError as exc:
            raise _huge_number(body, False, 0, body, exc) from None
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise _malformed(body, False, 0, body, exc, " of the array") from None
        except RecursionError:
            raise _too_deep(body, False, 0, body, max_depth) from None
        if not isinstance(doc, list):
            raise Rejection(
                400,
                "malformed",
                f"an application/json body must be an array of events, got {_kind(doc)}; "
                "nothing was stored",
            )
        spans = _item_spans(body)
        if spans is None or len(spans) != len(doc):  # cannot be: it decoded above
            spans = [(-1, -1)] * len(doc)
        located = [(None, a, b, item) for (a, b), item in zip(spans, doc, strict=True)]
    check_count(len(located))
    errors: list[dict[str, Any]] = []
    bad_items = 0
    for index, (at_line, start, end, item) in enumerate(located):
        problems: list[tuple[str | None, str, int | None]] = [
            (field, reason, None) for field, reason in explain_event(item, max_id_chars)
        ]
        problems.extend(_payload_problems(body, start, end, item, max_depth))
        if problems:
            bad_items += 1
        for field, reason, position in problems:
            if len(errors) < MAX_REPORTED_ERRORS:
                entry: dict[str, Any] = {"index": index, "field": field, "reason": reason}
                if at_line is not None:
                    entry["line"] = at_line
                if position is not None:
                    entry["position"] = position
                errors.append(entry)
    if not errors:
        return
    raise Rejection(
        422,
        "invalid_events",
        f"{bad_items} of {len(located)} events are invalid (first: {_describe(errors[0])}); "
        "nothing was stored",
        errors=errors,
        truncated=bad_items > MAX_REPORTED_ERRORS or len(errors) >= MAX_REPORTED_ERRORS,
    )
