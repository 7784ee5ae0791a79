"""The CDC writers' limits on a payload (``new``/``old``), checked before ingest acknowledges it.

The writers parse every payload with Jackson and Spark's ``VariantBuilder``
(``jvm/src/eventplane/inbox/JsonCheck.java``); an acknowledged payload they
refuse would fail every batch of its stream, forever. Most of what they
refuse msgspec refuses already (syntax, lone surrogate escapes, control
characters), and ``IngestServer._parse`` checks a body's UTF-8 once. This
module holds the rest: nesting depth, the digits of a number and the bytes of
an object key (docs/ingest.md, "What the CDC writers accept").

:func:`problem` is the hot path's check of one payload that msgspec accepted:
C-speed filters first (one ``translate`` that keeps the bytes of brackets and
numbers), a precise scan only when a filter says a limit may be broken. Payloads shorter than
:func:`min_length` cannot break any limit and are not looked at.
"""

from __future__ import annotations

import re
from array import array
from itertools import accumulate
from typing import NamedTuple

import msgspec

# Jackson StreamReadConstraints.DEFAULT_MAX_DEPTH (2.21.2); the outermost object is level 1.
WRITER_MAX_DEPTH = 1000
# Jackson DEFAULT_MAX_NUM_LEN: the digits of the integer part, fraction and exponent together.
MAX_NUMBER_DIGITS = 1000
# Jackson DEFAULT_MAX_NAME_LEN; its UTF-8 parser counts the key's unescaped UTF-8 bytes.
MAX_KEY_BYTES = 50_000
# Jackson DEFAULT_MAX_STRING_LEN (characters). Unreachable: config caps ingest.max_event_bytes
# at this many bytes (daemon.config.MAX_EVENT_BYTES), and a string has at most as many
# characters as its payload has bytes.
MAX_STRING_CHARS = 20_000_000
# VariantBuilder's SIZE_LIMIT (128 MiB) is unreachable too: a byte of JSON makes at most ~3
# bytes of VARIANT (2.5 measured for an array of 0s, the densest case), and a payload is
# at most MAX_STRING_CHARS bytes.


class Problem(NamedTuple):
    """Why the writers (or ``ingest.max_json_depth``) refuse a payload, and where."""

    offset: int  # the byte in the payload where the offending value starts
    reason: str


def min_length(max_depth: int) -> int:
    """The shortest payload that can break a limit: ``max_depth + 1`` levels take two
    bytes each, a number of ``MAX_NUMBER_DIGITS + 1`` digits as many bytes (a long key
    takes more)."""
    return min(2 * (max_depth + 1), MAX_NUMBER_DIGITS + 1)


# -- the filters (C speed) -----------------------------------------------------------

# The one pass every checked payload gets: a translate that only deletes (CPython's
# fastest), keeping the opening brackets, whose count bounds the depth, and in a
# payload long enough to hold a long number also the bytes numbers are made of
# (digits, ".", "e", "E", "+", "-"), whose count bounds the digits of any one number.
_NUMBER_BYTES = b"0123456789.eE+-"
_NOT_OPENING = bytes(b for b in range(256) if b not in b"{[")
_NOT_COUNTED = bytes(b for b in range(256) if b not in b"{[" + _NUMBER_BYTES)
# Every byte classified in place: "0" a byte of a number, " " anything else.
_MARKS = bytes(ord("0") if b in _NUMBER_BYTES else ord(" ") for b in range(256))
# A number of more than MAX_NUMBER_DIGITS digits is a run of at least this many number bytes.
_NUMBER_RUN = b"0" * (MAX_NUMBER_DIGITS + 1)
# Brackets and quotes only, "{}" mapped to "[]" (the depth scan).
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')
_QUOTED = re.compile(rb'"[^"]*"')
_SIGNS = bytes.maketrans(b"[]", b"\x01\xff")
# Leaves removed by bytes.replace before the depth is counted byte by byte.
_DEPTH_PASSES = 8
# A key of more than MAX_KEY_BYTES bytes is a run of at least this many bytes without a quote.
_QUOTE_MARKS = bytes(ord('"') if b == ord('"') else ord(".") for b in range(256))
_KEY_RUN = b"." * (MAX_KEY_BYTES + 1)


def problem(text: bytes, max_depth: int) -> Problem | None:
    """None when the writers take ``text``, a JSON object msgspec accepted, in valid UTF-8,
    and it is nested at most ``max_depth`` levels; else the first problem found."""
    if len(text) <= MAX_NUMBER_DIGITS:
        opens = len(text.translate(None, _NOT_OPENING))
        numbers = 0
    else:
        counted = text.translate(None, _NOT_COUNTED)
        opens = counted.count(b"{") + counted.count(b"[")
        numbers = len(counted) - opens
    if opens > max_depth and depth(text) > max_depth:
        return _depth_problem(text, max_depth)
    if numbers > MAX_NUMBER_DIGITS and _NUMBER_RUN in text.translate(_MARKS):
        found = long_number(text)
        if found is not None:
            return found
    if len(text) > MAX_KEY_BYTES + 3 and _KEY_RUN in _unescaped_quotes(text).translate(
        _QUOTE_MARKS
    ):
        return _long_key(text)
    return None


def _unescaped_quotes(text: bytes) -> bytes:
    """``text`` with every escaped quote and backslash replaced by two other bytes: the
    same length, and each ``"`` left starts or ends a string."""
    if b'\\"' not in text:  # then no quote is escaped
        return text
    return text.replace(b"\\\\", b"__").replace(b'\\"', b"__")


def depth(text: bytes) -> int:
    """How deep ``text`` (valid JSON) nests: 1 for ``{}``, 2 for ``{"a":[]}``.

    Strings are dropped, then each ``bytes.replace`` pass removes the innermost
    (empty) containers; past a few passes the rest is counted byte by byte, so a
    deep payload costs one pass over its brackets, not one per level.
    """
    s = _unescaped_quotes(text).translate(_BRACKETS, _NOT_STRUCTURE).replace(b'""', b"")
    # Removing "" either drops an empty string or joins two strings with no bracket
    # between them: every quote left still pairs with its partner.
    if b'"' in s:
        s = _QUOTED.sub(b"", s)  # strings that hold brackets
    levels = 0
    while s and levels < _DEPTH_PASSES:
        s = s.replace(b"[]", b"")
        levels += 1
    if s:  # each pass removed one level of every branch: the rest is that much shallower
        levels += max(accumulate(array("b", s.translate(_SIGNS))))
    return levels


# -- the precise scans (Python; only when a filter fired) ------------------------------

# A JSON string's text (use with re.S: a byte after a backslash may be any byte).
STRING = rb'"[^"\\]*(?:\\.[^"\\]*)*"'
# Strings (skipped whole, so nothing inside one is taken for structure), brackets, numbers.
_TOKENS = re.compile(STRING + rb"|[\[{]|[\]}]|-?[0-9][0-9.eE+-]*", re.S)
_KEYS = re.compile(rb"(" + STRING + rb")([ \t\r\n]*:)?", re.S)
_NOT_DIGITS = b"-+.eE"


def first_too_deep(text: bytes, limit: int, start: int = 0, stop: int | None = None) -> int | None:
    """The offset of the first bracket in ``text[start:stop]`` that opens level
    ``limit + 1`` (levels counted from ``start``), or None. Works on a prefix or a
    malformed text as far as its strings end."""
    level = 0
    for m in _TOKENS.finditer(text, start, len(text) if stop is None else stop):
        c = text[m.start()]
        if c == 0x7B or c == 0x5B:  # { [
            level += 1
            if level > limit:
                return m.start()
        elif c == 0x7D or c == 0x5D:  # } ]
            level -= 1
    return None


def too_deep(max_depth: int) -> str:
    """The reason given for a payload nested deeper than ``max_depth``."""
    return (
        f"nested deeper than {max_depth} levels (ingest.max_json_depth; the CDC writers "
        f"take at most {WRITER_MAX_DEPTH})"
    )


def _depth_problem(text: bytes, max_depth: int) -> Problem:
    at = first_too_deep(text, max_depth)
    return Problem(0 if at is None else at, too_deep(max_depth))


def long_number(text: bytes) -> Problem | None:
    """The first number of ``text`` with more than ``MAX_NUMBER_DIGITS`` digits, or None."""
    for m in _TOKENS.finditer(text):
        token = m.group()
        if len(token) > MAX_NUMBER_DIGITS and token[0] != 0x22:  # not a string
            digits = len(token.translate(None, _NOT_DIGITS))
            if digits > MAX_NUMBER_DIGITS:
                return Problem(
                    m.start(),
                    f"a number of {digits} digits; the CDC writers take at most "
                    f"{MAX_NUMBER_DIGITS} (send it as a string)",
                )
    return None


def _long_key(text: bytes) -> Problem | None:
    for m in _KEYS.finditer(text):
        token = m.group(1)
        if m.group(2) is not None and len(token) > MAX_KEY_BYTES + 2:
            nbytes = len(msgspec.json.decode(token, type=str).encode())
            if nbytes > MAX_KEY_BYTES:
                return Problem(
                    m.start(),
                    f"an object key of {nbytes} bytes (UTF-8, unescaped); the CDC "
                    f"writers take at most {MAX_KEY_BYTES}",
                )
    return None
