"""daemon.ingest.payload: each CDC writer limit, exactly at it and one past it.

The figures are the writers' (Jackson 2.21.2's StreamReadConstraints under
Spark 4.2.0's VariantBuilder, as under 4.3.0's, measured with JsonCheck.checkMany);
tests/ingest/test_payload_differential.py asks the writer itself.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.config import MAX_JSON_DEPTH
from daemon.ingest import payload
from daemon.ingest.payload import (
    MAX_KEY_BYTES,
    MAX_NUMBER_DIGITS,
    depth,
    first_too_deep,
    min_length,
    problem,
)
from daemon.ingest.validate import _decode_any, _decode_one

DEPTH = 128
RAW = msgspec.json.Decoder(msgspec.Raw).decode


def nested(levels: int, *, arrays: bool = False) -> bytes:
    """A payload nested ``levels`` deep (the outermost object is level 1)."""
    if arrays:
        return b'{"a":' + b"[" * (levels - 1) + b"]" * (levels - 1) + b"}"
    return b'{"a":' * (levels - 1) + b"{}" + b"}" * (levels - 1)


def check(text: bytes, max_depth: int = DEPTH) -> payload.Problem | None:
    """As the server checks: msgspec-valid JSON, and only from min_length on."""
    RAW(text)  # the precondition: msgspec takes it, as the hot path reads new/old
    return problem(text, max_depth) if len(text) >= min_length(max_depth) else None


# -- depth -------------------------------------------------------------------------


@pytest.mark.parametrize("arrays", [False, True], ids=["objects", "arrays"])
def test_a_payload_at_max_depth_is_taken_and_one_level_more_is_refused_at_its_bracket(
    arrays: bool,
) -> None:
    assert check(nested(DEPTH, arrays=arrays)) is None
    text = nested(DEPTH + 1, arrays=arrays)
    found = check(text)
    assert found is not None
    assert "nested deeper than 128 levels (ingest.max_json_depth" in found.reason
    assert text[found.offset] in b"[{"
    # The offending bracket is the first one that opens level 129.
    assert text[: found.offset].count(b"[") + text[: found.offset].count(b"{") == DEPTH


def test_brackets_inside_strings_escaped_quotes_and_backslashes_do_not_count() -> None:
    deep_text = '{"s": "' + "[{" * 300 + '\\" [ \\\\", "t": "\\\\\\"]]]"}'
    assert depth(deep_text.encode()) == 1
    assert check(deep_text.encode()) is None
    # Closing brackets in strings do not make a deep payload look shallow.
    text = b'{"a":' * DEPTH + b'{"s":"' + b"]" * 400 + b'"}' + b"}" * DEPTH
    assert depth(text) == DEPTH + 1
    assert check(text) is not None


def test_the_depth_of_a_wide_and_deep_payload_counts_every_level() -> None:
    branch = b"[" * 40 + b"]" * 40
    text = b'{"a":[' + b",".join([branch] * 50) + b'],"b":' + nested(DEPTH - 1) + b"}"
    assert depth(text) == DEPTH
    assert check(text) is None
    assert depth(b'{"a":[' + b",".join([branch] * 50) + b'],"b":' + nested(DEPTH) + b"}") == (
        DEPTH + 1
    )


def _reference_depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_reference_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_reference_depth, value), default=0)
    return 0


_text = st.text(alphabet=st.sampled_from('[]{}"\\/ :,aé\U0001f600\n'), max_size=8)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=60,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_text, _json, max_size=4), st.booleans())
def test_depth_agrees_with_a_walk_of_the_decoded_value(value: dict[str, Any], ascii: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii).encode()
    assert depth(text) == _reference_depth(value)
    found = first_too_deep(text, _reference_depth(value) - 1)
    assert found is not None and text[found] in b"[{"
    assert first_too_deep(text, _reference_depth(value)) is None


def test_payloads_shorter_than_min_length_cannot_break_a_limit() -> None:
    assert min_length(DEPTH) == 2 * (DEPTH + 1)
    assert len(nested(DEPTH + 1, arrays=True)) > min_length(DEPTH)
    assert min_length(MAX_JSON_DEPTH) == MAX_NUMBER_DIGITS + 1


def test_msgspec_decodes_payloads_at_the_depth_ceiling_with_frames_to_spare() -> None:
    """The config ceiling keeps every refused depth within what msgspec decodes (it
    raises RecursionError near Python's recursion limit), so the slow path can say
    where the payload is too deep; this holds with 200 frames already on the stack."""
    line = (
        b'{"collection":"c","op":"insert","key":"k","new":'
        + nested(MAX_JSON_DEPTH + 10, arrays=True)
        + b"}"
    )

    def decode_at(frames: int) -> None:
        if frames:
            return decode_at(frames - 1)
        _decode_one(line)
        _decode_any(line)
        return None

    assert sys.getrecursionlimit() >= 1000
    decode_at(200)


# -- numbers -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "number",
    [
        b"1" * 1000,
        b"-" + b"1" * 1000,  # a sign is not a digit
        b"0." + b"1" * 999,
        b"-1." + b"1" * 997 + b"e11",  # integer part, fraction and exponent
        b"1." + b"1" * 997 + b"e+11",  # the exponent's sign is not a digit
        b"1" * 999 + b"E-1",
    ],
)
def test_a_number_of_1000_digits_is_taken(number: bytes) -> None:
    assert check(b'{"n":' + number + b"}") is None


@pytest.mark.parametrize(
    "number",
    [
        b"1" * 1001,
        b"-" + b"1" * 1001,
        b"0." + b"1" * 1000,
        b"1." + b"1" * 997 + b"e111",
        b"1." + b"1" * 997 + b"e-111",
        b"1" * 1000 + b"e1",
    ],
)
def test_a_number_of_1001_digits_is_refused_at_its_first_byte(number: bytes) -> None:
    text = b'{"a":[1,2,{"n":' + number + b"}]}"
    found = check(text)
    assert found is not None
    assert found.offset == text.index(number)
    assert "a number of 1001 digits; the CDC writers take at most 1000" in found.reason


def test_digits_inside_strings_are_not_a_number() -> None:
    text = b'{"s":"' + b"1" * 5000 + b'","t":"1.5e' + b"9" * 2000 + b'"}'
    assert check(text) is None


# -- object keys -------------------------------------------------------------------


def key(name: bytes) -> bytes:
    return b'{"' + name + b'":1,"v":"' + b"x" * 60_000 + b'"}'


@pytest.mark.parametrize(
    "name",
    [
        b"k" * MAX_KEY_BYTES,
        "é".encode() * (MAX_KEY_BYTES // 2),  # 2 bytes each
        "\U0001f600".encode() * (MAX_KEY_BYTES // 4),  # 4 bytes each
        b"\\u00e9" * (MAX_KEY_BYTES // 2),  # escapes count unescaped: 2 bytes each
        b"\\n" * MAX_KEY_BYTES,
    ],
    ids=["ascii", "2-byte", "4-byte", "escaped-2-byte", "escaped-newline"],
)
def test_a_key_of_50000_bytes_is_taken(name: bytes) -> None:
    assert check(key(name)) is None


@pytest.mark.parametrize(
    ("name", "nbytes"),
    [
        (b"k" * (MAX_KEY_BYTES + 1), 50_001),
        ("é".encode() * (MAX_KEY_BYTES // 2) + b"k", 50_001),
        ("\U0001f600".encode() * (MAX_KEY_BYTES // 4 + 1), 50_004),
        (b"\\u00e9" * (MAX_KEY_BYTES // 2 + 1), 50_002),
        (b"\\n" * MAX_KEY_BYTES + b'\\"', 50_001),
    ],
    ids=["ascii", "2-byte", "4-byte", "escaped-2-byte", "escaped-quote"],
)
def test_a_key_one_byte_past_50000_is_refused_at_its_quote(name: bytes, nbytes: int) -> None:
    text = b'{"a":{"b":1,"' + name + b'":2}}'
    found = check(text)
    assert found is not None
    assert found.offset == text.index(b'"' + name[:8])
    assert f"an object key of {nbytes} bytes" in found.reason


def test_long_string_values_are_not_keys() -> None:
    text = b'{"a":"' + b"v" * 200_000 + b'","b":["' + b"w" * 60_000 + b'\\":"]}'
    assert check(text) is None
