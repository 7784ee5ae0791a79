"""A mirror's reduction in Arrow (daemon/table/mirror.py, ``newest_in_arrow``)
against the fold of one dict per event (``_events`` then ``fold_events``), on
generated batches: the same rows, the same typed values, the same failures
counted; and where it does not apply it says so (None)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.spark import frame
from daemon.table.mirror import _events, fold_events, newest_in_arrow
from tests.table.test_mirror import make_batch, mirror_config

# Every column type, so each cast rule meets the Arrow path's typed arrays.
TYPED = (
    ("amount", "double"),
    ("n", "long"),
    ("price", "decimal(10,2)"),
    ("status", "string"),
    ("paid", "boolean"),
    ("at", "timestamp"),
    ("day", "date"),
)
VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.floats(allow_nan=False, allow_infinity=False),
    st.decimals(places=3, allow_nan=False, allow_infinity=False).map(float),
    st.sampled_from(["paid", "2024-05-01", "2024-05-01T10:00:00+02:00", "x", ""]),
    st.lists(st.integers(), max_size=2),
)
DOC = st.one_of(
    st.dictionaries(st.sampled_from([n for n, _ in TYPED]), VALUE, max_size=len(TYPED)),
    st.sampled_from([[1, 2], 5, "text", None]),  # a document that is no object
)
EVENT = st.tuples(
    st.sampled_from(["orders", "orders", "orders", "other"]),
    st.sampled_from(["insert", "update", "delete"]),
    st.integers(0, 30).map(lambda i: f"k{i}"),
    DOC,
)
BATCHES = st.lists(st.lists(EVENT, min_size=1, max_size=60), min_size=1, max_size=4)


def _tables(batches: list[list[tuple[str, str, str, Any]]]) -> list[Any]:
    tables, lsn = [], 0
    for bid, evs in enumerate(batches, 1):
        planned = []
        for collection, op, key, doc in evs:
            lsn += 1
            planned.append((lsn, collection, op, key, None if op == "delete" else doc))
        tables.append(frame.batch_table(make_batch(bid, planned)))
    return tables


def _by_key(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {r["key"]: r for r in rows}
    assert len(out) == len(rows), "a key twice"
    return out


@settings(max_examples=150, deadline=None)
@given(BATCHES)
def test_the_arrow_reduction_is_the_fold_of_one_dict_per_event(
    batches: list[list[tuple[str, str, str, Any]]],
) -> None:
    mirror = mirror_config(Path("/nonexistent"), columns=TYPED)
    tables = _tables(batches)
    got = newest_in_arrow(mirror, tables)
    assert got is not None and got.rows == []  # the rows are in got.source
    evs, count = [], 0
    for table in tables:
        mine, _, n = _events(mirror, table)
        evs += mine
        count += n
    want = fold_events(mirror, evs, count)
    assert got.events == want.events
    assert _by_key(got.row_dicts()) == _by_key(want.rows)
    assert got.cast_failures == want.cast_failures
    assert got.keys == want.keys


def test_history_strict_or_an_lsn_twice_take_the_fold_of_one_dict_per_event() -> None:
    mirror = mirror_config(Path("/nonexistent"))
    ev = [(1, "orders", "insert", "k1", {"amount": 1}), (2, "orders", "update", "k2", {})]
    table = frame.batch_table(make_batch(1, ev))
    assert newest_in_arrow(mirror, [table]) is not None
    assert newest_in_arrow(dataclasses.replace(mirror, history=True), [table]) is None
    assert newest_in_arrow(dataclasses.replace(mirror, strict=True), [table]) is None
    # An LSN twice (never from one WAL) that is one key's highest and another
    # key's lower one: no choice made in Arrow.
    again = frame.batch_table(make_batch(2, [(3, "orders", "update", "k1", {})]))
    twice = frame.batch_table(make_batch(3, [(1, "orders", "update", "k3", {})]))
    assert newest_in_arrow(mirror, [table, again, twice]) is None


def test_batches_without_the_collection_reduce_to_nothing() -> None:
    mirror = mirror_config(Path("/nonexistent"))
    table = frame.batch_table(make_batch(1, [(1, "other", "insert", "k1", {"amount": 1})]))
    got = newest_in_arrow(mirror, [table])
    assert got is not None and (got.keys, got.events, got.closes) == (0, 0, [])
