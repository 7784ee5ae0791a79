"""Stored events -> Arrow columns, field by field over a whole chunk at once.

A batch's payloads are msgpack :class:`daemon.events.StoredEvent` arrays back
to back. Decoding them into one Python object per event and building each
Arrow column from those objects (``daemon.spark.frame``'s general path) cost
0.8 µs per event of the daemon's interpreter, on the same lock as ingest.
Here numpy reads the same bytes one *field* at a time for every event of a
chunk together, and pyarrow cuts the string columns out of the payload
buffer in C++:

1. Every event starts at a known offset (``starts``); its first byte must be
   the array header of the short (8 fields) or long (10 fields) form.
2. For each field in order, the type byte at every event's position says the
   field's length and where its value starts; the position moves past it.
   A type this reader does not expect anywhere in the chunk stops it.
3. Every event must end exactly where the next one starts (the last at the
   end of the data): a payload that does not is not read here.
4. Each string field becomes an Arrow array without a copy per event: a
   binary array over the whole payload buffer whose even elements are the
   values (the odd ones are what lies between them), then one ``take`` of the
   even elements, one null mask and one UTF-8 check (``cast``).

A chunk this reader refuses (``None``) goes to the general path, which reads
any payload msgspec reads and raises on a bad one, so the two paths never
disagree on what a batch holds (``tests/spark/test_unpack.py`` compares them
on generated events).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

Ints = npt.NDArray[np.int64]
Mask = npt.NDArray[np.bool_]

# msgpack type bytes (the subset msgspec writes for StoredEvent's fields).
_NIL = 0xC0
_SHORT_FORM = 0x98  # fixarray of 8: collection .. source
_LONG_FORM = 0x9A  # fixarray of 10: .. event_id, event_time_us
_PRODUCER_FORM = 0x9B  # fixarray of 11: .. producer
_STR_SIZED = ((0xD9, 1), (0xDA, 2), (0xDB, 4))  # str8/16/32: length bytes
_BIN_SIZED = ((0xC4, 1), (0xC5, 2), (0xC6, 4))  # bin8/16/32
_INT_SIZED = (  # (type byte, value bytes, signed)
    (0xCC, 1, False),
    (0xCD, 2, False),
    (0xCE, 4, False),
    (0xCF, 8, False),
    (0xD0, 1, True),
    (0xD1, 2, True),
    (0xD2, 4, True),
    (0xD3, 8, True),
)
# Bytes read past a position at most (a type byte and an 8-byte integer): the
# buffer is padded so that a truncated payload reads zeros, not out of bounds,
# and is then refused by step 3.
_PAD = 9


class _Refused(Exception):
    """The chunk holds something this reader does not read: use the general path."""


def stored_columns(data: bytes, starts: Ints) -> dict[str, Any] | None:
    """The StoredEvent fields of the events at ``starts`` in ``data``, as Arrow arrays.

    Keys: ``collection``, ``op``, ``key``, ``new``, ``old`` (strings, JSON
    text, null for nil), ``source``, ``event_id`` and ``producer`` (string or null),
    ``ingest_ts_ns`` and ``event_time_us`` (int64, the latter null when
    absent) and ``depth`` (int32). None when the chunk is not one this reader
    reads (see the module docstring); then nothing about the data is known.
    """
    try:
        return _columns(data, starts)
    except _Refused:
        return None


def _columns(data: bytes, starts: Ints) -> dict[str, Any]:
    import pyarrow as pa

    n = len(starts)
    if n == 0:
        raise _Refused
    buf = np.frombuffer(data + bytes(_PAD), np.uint8)
    # Step 1. The array header.
    head = buf[starts]
    producer_form = head == _PRODUCER_FORM
    long_form = (head == _LONG_FORM) | producer_form
    if not (long_form | (head == _SHORT_FORM)).all():
        raise _Refused
    # Step 2. Field by field, every event at once.
    pos = starts + 1
    spans: dict[str, tuple[Ints, Ints, Mask | None]] = {}
    for name, kind, nullable in (
        ("collection", _STR_SIZED, False),
        ("op", _STR_SIZED, False),
        ("key", _STR_SIZED, False),
        ("new", _BIN_SIZED, True),
        ("old", _BIN_SIZED, True),
    ):
        start, length, valid = _sized(buf, pos, kind, nullable)
        spans[name] = (start, length, valid)
        pos = start + length
    ts, pos, _ = _int(buf, pos, nullable=False)
    depth, pos, _ = _int(buf, pos, nullable=False)
    start, length, _ = _sized(buf, pos, _STR_SIZED, nullable=False)
    spans["source"] = (start, length, None)
    pos = start + length
    # The long form's event_id (string or nil) and event_time_us (int or nil).
    eid_start = pos.copy()  # absent: an empty span where it would be (offsets ascend)
    eid_len = np.zeros(n, np.int64)
    eid_valid = np.zeros(n, np.bool_)
    etime = np.zeros(n, np.int64)
    etime_valid = np.zeros(n, np.bool_)
    if long_form.any():
        at = pos[long_form]
        s, ln, v = _sized(buf, at, _STR_SIZED, nullable=True)
        eid_start[long_form], eid_len[long_form] = s, ln
        eid_valid[long_form] = True if v is None else v
        value, after, ok = _int(buf, s + ln, nullable=True)
        etime[long_form], etime_valid[long_form] = value, ok
        pos[long_form] = after
    spans["event_id"] = (eid_start, eid_len, eid_valid)
    # The producer form's producer (string or nil).
    who_start = pos.copy()
    who_len = np.zeros(n, np.int64)
    who_valid = np.zeros(n, np.bool_)
    if producer_form.any():
        s, ln, v = _sized(buf, pos[producer_form], _STR_SIZED, nullable=True)
        who_start[producer_form], who_len[producer_form] = s, ln
        who_valid[producer_form] = True if v is None else v
        pos[producer_form] = s + ln
    spans["producer"] = (who_start, who_len, who_valid)
    # Step 3. Each event ends where the next begins.
    ends = np.empty(n, np.int64)
    ends[:-1] = starts[1:]
    ends[-1] = len(data)
    if not np.array_equal(pos, ends):
        raise _Refused
    # Step 4. Strings cut out of the payload buffer.
    whole = pa.py_buffer(data)
    cols: dict[str, Any] = {name: _strings(pa, whole, *span) for name, span in spans.items()}
    cols["ingest_ts_ns"] = pa.array(ts, pa.int64())
    cols["depth"] = pa.array(depth.astype(np.int32), pa.int32())
    cols["event_time_us"] = pa.array(etime, pa.int64(), mask=~etime_valid)
    return cols


def _kind(buf: npt.NDArray[np.uint8], pos: Ints) -> npt.NDArray[np.uint8]:
    """The type bytes at ``pos``, when every position is inside the data (a
    length read from a damaged payload can point anywhere; the padding covers
    the value bytes read after a type byte at the very end)."""
    if pos.max() > len(buf) - _PAD:
        raise _Refused
    return buf[pos]


def _be(buf: npt.NDArray[np.uint8], at: Ints, width: int) -> Ints:
    """The big-endian unsigned integers of ``width`` bytes at ``at``."""
    value = buf[at].astype(np.int64)
    for k in range(1, width):
        value = (value << 8) | buf[at + k]
    return value


def _sized(
    buf: npt.NDArray[np.uint8],
    pos: Ints,
    sized: tuple[tuple[int, int], ...],
    nullable: bool,
) -> tuple[Ints, Ints, Mask | None]:
    """A str (``_STR_SIZED``, and fixstr) or bin (``_BIN_SIZED``) field at
    ``pos``: ``(value starts, lengths, valid or None when all are)``."""
    kind = _kind(buf, pos)
    start = np.empty_like(pos)
    length = np.empty_like(pos)
    seen = np.zeros(len(pos), np.bool_)
    if sized == _STR_SIZED:
        fix = (kind >= 0xA0) & (kind <= 0xBF)
        start[fix] = pos[fix] + 1
        length[fix] = kind[fix] & 0x1F
        seen |= fix
    for code, width in sized:
        m = kind == code
        if m.any():
            at = pos[m]
            length[m] = _be(buf, at + 1, width)
            start[m] = at + 1 + width
            seen |= m
    valid: Mask | None = None
    if nullable:
        nil = kind == _NIL
        if nil.any():
            start[nil] = pos[nil] + 1
            length[nil] = 0
            seen |= nil
            valid = ~nil
    if not seen.all():
        raise _Refused
    return start, length, valid


def _int(buf: npt.NDArray[np.uint8], pos: Ints, nullable: bool) -> tuple[Ints, Ints, Mask]:
    """An integer field at ``pos``: ``(values, positions after it, valid)``."""
    kind = _kind(buf, pos).astype(np.int64)
    value = np.zeros(len(pos), np.int64)
    size = np.zeros(len(pos), np.int64)
    fix = kind <= 0x7F  # positive fixint
    value[fix] = kind[fix]
    neg = kind >= 0xE0  # negative fixint
    value[neg] = kind[neg] - 0x100
    size[fix | neg] = 1
    seen = fix | neg
    for code, width, signed in _INT_SIZED:
        m = kind == code
        if m.any():
            v = _be(buf, pos[m] + 1, width)  # a uint64 past 2**63 wraps, as int64 does
            if signed and width < 8:
                v = np.where(v >= 1 << (8 * width - 1), v - (1 << (8 * width)), v)
            value[m] = v
            size[m] = 1 + width
            seen |= m
    valid = np.ones(len(pos), np.bool_)
    if nullable:
        nil = kind == _NIL
        size[nil] = 1
        valid[nil] = False
        seen |= nil
    if not seen.all():
        raise _Refused
    return value, pos + size, valid


def _strings(pa: Any, whole: Any, start: Ints, length: Ints, valid: Mask | None) -> Any:
    """Step 4 for one field: the values as an Arrow string array."""
    n = len(start)
    bounds = np.empty(2 * n, np.int64)
    bounds[0::2] = start
    bounds[1::2] = start + length
    # Elements 0, 2, 4, ... are the values; 1, 3, ... the bytes between them.
    interleaved = pa.Array.from_buffers(
        pa.large_binary(), 2 * n - 1, [None, pa.py_buffer(bounds), whole]
    )
    values = interleaved.take(pa.array(np.arange(0, 2 * n, 2, dtype=np.int64)))
    if valid is not None and not valid.all():
        mask = pa.py_buffer(np.packbits(valid, bitorder="little"))
        values = pa.Array.from_buffers(values.type, n, [mask, *values.buffers()[1:]])
    # One UTF-8 check for the column (the general path does the same for new/old).
    return values.cast(pa.string())
