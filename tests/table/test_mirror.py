"""Mirror tables (daemon/table/mirror.py) on real Delta tables on disk, without Spark.

- Generated histories (hypothesis): after every committed batch, the table
  delta-rs reads equals a Python fold of the events so far (per key, the last
  event unless it is a delete), and a re-run of the batch changes nothing.
- Each casting rule, on values that fit and values that do not.
- delta-rs, Polars and DuckDB over delta-rs read the same rows.
- A changed ``buckets``, changed columns and another WAL's table refuse at open.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from daemon import events
from daemon.config import CdcMirror
from daemon.errors import IdentityMismatchError
from daemon.plane.batch import MicroBatch, Slice
from daemon.shard import core_of
from daemon.spark import frame
from daemon.table import quarantine
from daemon.table.errors import CdcLayoutError
from daemon.table.mirror import (
    MirrorTable,
    NoFit,
    bucket_of,
    cast,
    check_new,
    parse_doc,
)
from wal.record import Record

CORES = 2
COLUMNS = (("amount", "double"), ("status", "string"), ("n", "long"))
# Histories per run; `--soak` runs more (the counts go in the closing note).
HISTORIES = {"ci": 6, "soak": 100}
COUNTS: dict[str, int] = {"histories": 0, "batches": 0, "events": 0}


def mirror_config(path: Path, **kw: Any) -> CdcMirror:
    return CdcMirror("orders", "orders", path, kw.pop("columns", COLUMNS), buckets=4, **kw)


def make_batch(batch_id: int, evs: list[tuple[int, str, str, str, Any]]) -> MicroBatch:
    """``(lsn, collection, op, key, new)`` events as the planner hands them over."""
    per: dict[int, list[Record]] = {}
    for lsn, collection, op, key, new in evs:
        core = core_of(collection, key, CORES)
        body = None if new is None else json.dumps(new).encode()
        payload = events.encode(
            events.StoredEvent(collection, op, key, body, None, lsn * 1000, producer="p1")  # type: ignore[arg-type]
        )
        per.setdefault(core, []).append(Record(lsn, core, lsn, payload))
    slices = {c: Slice(c, rs[0].lsn, rs[-1].lsn, rs) for c, rs in per.items()}
    return MicroBatch(batch_id, slices)


def read_rows(path: Path) -> dict[str, dict[str, Any]]:
    from deltalake import DeltaTable

    rows = DeltaTable(str(path)).to_pyarrow_table().to_pylist()
    out = {r["key"]: r for r in rows}
    assert len(out) == len(rows), "a key has two rows"
    return out


def commit(mirror: MirrorTable, batch: MicroBatch) -> Any:
    return mirror.commit(frame.batch_table(batch), batch)


# -- generated histories --------------------------------------------------------

KEYS = st.integers(0, 299).map(lambda i: f"k{i}")
OPS = st.sampled_from(["insert", "update", "delete"])
AMOUNT = st.one_of(st.integers(-1000, 1000), st.floats(-1e6, 1e6, allow_nan=False), st.just("x"))
EVENT = st.tuples(st.sampled_from(["orders", "orders", "orders", "other"]), OPS, KEYS, AMOUNT)
HISTORY = st.lists(st.lists(EVENT, min_size=1, max_size=80), min_size=35, max_size=45)


def _history_examples(request: pytest.FixtureRequest) -> int:
    return HISTORIES["soak" if request.config.getoption("--soak") else "ci"]


def test_after_every_batch_the_mirror_is_the_fold_of_the_events(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    @settings(
        max_examples=_history_examples(request),
        deadline=None,
        # No shrinking: an example takes seconds; a failure prints its history.
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(HISTORY)
    def run(history: list[list[tuple[str, str, str, Any]]]) -> None:
        path = tmp_path / f"h{COUNTS['histories']}"
        shutil.rmtree(path, ignore_errors=True)
        m = MirrorTable(mirror_config(path), wal_id="w1", cores=CORES)
        m.open()
        fold: dict[str, tuple[int, str, str]] = {}  # key -> (lsn, op, doc)
        lsn = 0
        try:
            for bid, evs in enumerate(history, 1):
                planned = []
                for collection, op, key, amount in evs:
                    lsn += 1
                    new = None if op == "delete" else {"amount": amount, "status": op, "n": lsn}
                    planned.append((lsn, collection, op, key, new))
                    if collection != "orders":
                        continue
                    if op == "delete":
                        fold.pop(key, None)
                    else:
                        fold[key] = (lsn, op, json.dumps(new))
                if not planned:
                    continue
                batch = make_batch(bid, planned)
                commit(m, batch)
                got = read_rows(path)
                assert {k: (r["lsn"], r["op"], r["doc"]) for k, r in got.items()} == fold
                for key, row in got.items():
                    assert row["bucket"] == bucket_of(key, 4)
                    assert row["n"] == row["lsn"] and row["status"] == row["op"]
                    amount = json.loads(row["doc"])["amount"]
                    assert row["amount"] == (None if amount == "x" else float(amount))
                # A re-run of the committed batch (a crash before the stage's
                # progress was recorded) changes nothing.
                version = m._table(create=False).version()
                again = commit(m, batch)
                assert again.noop or not again.keys or again.metrics["num_output_rows"] == 0
                assert m._table(create=False).version() == version
                COUNTS["batches"] += 1
                COUNTS["events"] += len(planned)
        finally:
            m.close()
        COUNTS["histories"] += 1

    run()
    assert COUNTS["histories"] >= _history_examples(request)
    print(f"generated histories: {COUNTS}")


def test_a_batch_reduces_to_the_highest_lsn_per_key(tmp_path: Path) -> None:
    m = MirrorTable(mirror_config(tmp_path / "m"), wal_id="w1", cores=CORES)
    m.open()
    # In one batch: insert, update, delete, re-insert of k1; update and delete
    # of keys the mirror never held; a delete then an update of k3.
    batch = make_batch(
        1,
        [
            (1, "orders", "insert", "k1", {"amount": 1}),
            (2, "orders", "update", "k1", {"amount": 2}),
            (3, "orders", "delete", "k1", None),
            (4, "orders", "insert", "k1", {"amount": 4}),
            (5, "orders", "update", "k2", {"amount": 5}),
            (6, "orders", "delete", "k9", None),
            (7, "orders", "delete", "k3", None),
            (8, "orders", "update", "k3", {"amount": 8}),
            (9, "other", "insert", "k4", {"amount": 9}),
        ],
    )
    result = commit(m, batch)
    assert (result.events, result.keys) == (8, 4)
    rows = read_rows(tmp_path / "m")
    assert {k: (r["lsn"], r["amount"]) for k, r in rows.items()} == {
        "k1": (4, 4.0),
        "k2": (5, 5.0),
        "k3": (8, 8.0),
    }
    assert rows["k2"]["op"] == "update" and rows["k2"]["producer"] == "p1"
    assert rows["k1"]["updated_at"] == dt.datetime.fromtimestamp(4e-6, dt.UTC)
    commit(m, make_batch(2, [(10, "orders", "delete", "k1", None)]))
    assert set(read_rows(tmp_path / "m")) == {"k2", "k3"}
    m.close()


# -- casting rules --------------------------------------------------------------

UTC = dt.UTC
CASTS = [
    # (type, JSON text of the value, the column's value, or NoFit)
    ("long", "42", 42),
    ("long", "42.0", 42),
    ("long", "1e3", 1000),
    ("long", "42.5", NoFit),
    ("long", "9223372036854775807", 2**63 - 1),
    ("long", "9223372036854775808", NoFit),
    ("long", '"42"', NoFit),
    ("long", "true", NoFit),
    ("double", "1.5", 1.5),
    ("double", "3", 3.0),
    ("double", "1e400", NoFit),
    ("double", '"1.5"', NoFit),
    ("decimal(10,2)", "12.3", Decimal("12.30")),
    ("decimal(10,2)", "12.345", NoFit),
    ("decimal(10,2)", "99999999.99", Decimal("99999999.99")),
    ("decimal(10,2)", "100000000", NoFit),
    ("decimal(10,2)", '"12.3"', NoFit),
    ("string", '"paid"', "paid"),
    ("string", "12", NoFit),
    ("string", "{}", NoFit),
    ("boolean", "true", True),
    ("boolean", "1", NoFit),
    ("boolean", '"true"', NoFit),
    ("timestamp", '"2024-05-01T10:00:00Z"', dt.datetime(2024, 5, 1, 10, tzinfo=UTC)),
    ("timestamp", '"2024-05-01T12:00:00+02:00"', dt.datetime(2024, 5, 1, 10, tzinfo=UTC)),
    ("timestamp", '"2024-05-01 10:00:00"', dt.datetime(2024, 5, 1, 10, tzinfo=UTC)),
    ("timestamp", '"2024-05-01"', dt.datetime(2024, 5, 1, tzinfo=UTC)),
    ("timestamp", "1714557600000", dt.datetime(2024, 5, 1, 10, tzinfo=UTC)),
    ("timestamp", "1714557600000.5", NoFit),
    ("timestamp", '"yesterday"', NoFit),
    ("timestamp", "true", NoFit),
    ("date", '"2024-05-01"', dt.date(2024, 5, 1)),
    ("date", '"2024-05-01T23:30:00-02:00"', dt.date(2024, 5, 2)),
    ("date", "1714557600000", dt.date(2024, 5, 1)),
    ("date", '"05/01/2024"', NoFit),
    ("long", "null", None),
    ("timestamp", "null", None),
]


@pytest.mark.parametrize(("kind", "text", "want"), CASTS, ids=[f"{k}<-{t}" for k, t, _ in CASTS])
def test_each_casting_rule(kind: str, text: str, want: Any) -> None:
    value = parse_doc(text)
    if want is NoFit:
        with pytest.raises(NoFit):
            cast(value, kind)
        assert check_new({"f": value}, (("f", kind),)) is not None
    else:
        got = cast(value, kind)
        assert got == want and type(got) is type(want)
        assert check_new({"f": value}, (("f", kind),)) is None


def test_a_value_that_does_not_fit_is_null_and_counted_and_doc_keeps_it(tmp_path: Path) -> None:
    columns = (("amount", "decimal(6,2)"), ("placed", "timestamp"), ("day", "date"))
    m = MirrorTable(mirror_config(tmp_path / "m", columns=columns), wal_id="w1", cores=CORES)
    m.open()
    good = {"amount": 12.5, "placed": "2024-05-01T10:00:00Z", "day": "2024-05-01"}
    bad = {"amount": "12.5", "placed": "soon", "day": 1.5}
    result = commit(
        m,
        make_batch(
            1,
            [(1, "orders", "insert", "a", good), (2, "orders", "insert", "b", bad)],
        ),
    )
    assert dict(result.cast_failures) == {"amount": 1, "placed": 1, "day": 1}
    rows = read_rows(tmp_path / "m")
    assert rows["a"]["amount"] == Decimal("12.50")
    assert rows["a"]["placed"] == dt.datetime(2024, 5, 1, 10, tzinfo=UTC)
    assert rows["a"]["day"] == dt.date(2024, 5, 1)
    assert (rows["b"]["amount"], rows["b"]["placed"], rows["b"]["day"]) == (None, None, None)
    assert json.loads(rows["b"]["doc"]) == bad
    assert check_new(bad, columns) == ("amount", "string", "decimal(6,2)")
    m.close()


# -- readers ----------------------------------------------------------------------


def test_delta_rs_polars_and_duckdb_read_the_same_rows(tmp_path: Path) -> None:
    import duckdb
    import polars as pl
    from deltalake import DeltaTable

    path = tmp_path / "m"
    m = MirrorTable(mirror_config(path), wal_id="w1", cores=CORES)
    m.open()
    lsn = 0
    for bid in range(1, 6):
        evs = []
        for i in range(200):
            lsn += 1
            op = "delete" if i % 7 == 0 else "update"
            evs.append((lsn, "orders", op, f"k{(i * bid) % 150}", {"amount": i, "n": lsn}))
        commit(m, make_batch(bid, evs))
    m.compact()  # readers read the compacted table too
    m.close()
    want = sorted((r["key"], r["lsn"], r["amount"]) for r in read_rows(path).values())
    live = len(want)
    assert 0 < live < 150

    polars = pl.read_delta(str(path)).select("key", "lsn", "amount").sort("key")
    assert sorted(polars.iter_rows()) == want
    dataset = DeltaTable(str(path)).to_pyarrow_dataset()  # DuckDB over delta-rs
    con = duckdb.connect()
    con.register("orders", dataset)
    rows = con.execute("SELECT key, lsn, amount FROM orders ORDER BY key").fetchall()
    assert sorted(rows) == want
    assert con.execute("SELECT count(*) FROM orders").fetchone() == (live,)
    assert pl.read_delta(str(path)).height == live


# -- what the table is made with refuses to change ------------------------------------


def test_changed_buckets_columns_or_another_wal_refuse_at_open(tmp_path: Path) -> None:
    path = tmp_path / "m"
    m = MirrorTable(mirror_config(path), wal_id="w1", cores=CORES)
    m.open()
    commit(m, make_batch(1, [(1, "orders", "insert", "a", {"amount": 1})]))
    m.close()

    changed = CdcMirror("orders", "orders", path, COLUMNS, buckets=8)
    with pytest.raises(CdcLayoutError, match="rebuild the mirror"):
        MirrorTable(changed, wal_id="w1", cores=CORES).open()
    retyped = mirror_config(path, columns=(("amount", "long"), *COLUMNS[1:]))
    with pytest.raises(CdcLayoutError, match="rebuild the mirror"):
        MirrorTable(retyped, wal_id="w1", cores=CORES).open()
    with pytest.raises(IdentityMismatchError, match="another event plane"):
        MirrorTable(mirror_config(path), wal_id="w2", cores=CORES).open()
    # Unchanged, it opens, knows the last batch, and a re-run changes nothing.
    again = MirrorTable(mirror_config(path), wal_id="w1", cores=CORES)
    again.open()
    assert again.last_batch_id == 1
    assert commit(again, make_batch(1, [(1, "orders", "insert", "a", {"amount": 1})])).noop
    again.close()


def test_a_strict_mirror_sets_aside_an_event_that_does_not_fit_before_the_merge(
    tmp_path: Path,
) -> None:
    """An emit action's event skips ingest's refusal: in a strict mirror it
    goes to the quarantine, durably, and the key keeps the events that fit."""
    path = tmp_path / "m"
    m = MirrorTable(mirror_config(path, strict=True), wal_id="w1", cores=CORES)
    m.open()
    commit(m, make_batch(1, [(1, "orders", "insert", "a", {"amount": 1, "n": 1})]))
    batch = make_batch(
        2,
        [
            (2, "orders", "update", "a", {"amount": 2, "n": 2}),
            (3, "orders", "update", "a", {"amount": "two", "n": 3}),  # does not fit
            (4, "orders", "insert", "b", {"amount": 4, "n": 4.5}),  # does not fit
        ],
    )
    result = commit(m, batch)
    assert result.cast_failures == {}
    rows = read_rows(path)
    assert {k: (r["lsn"], r["amount"]) for k, r in rows.items()} == {"a": (2, 2.0)}
    assert [p.name for p in (path / "_eventplane" / "quarantine").glob("b*.json")] == [
        "b000000000002.json"
    ]
    events = quarantine.load(path / "_eventplane")
    assert [(e.lsn, e.key, e.batch_id) for e in events] == [(3, "a", 2), (4, "b", 2)]
    assert events[1].error == 'field "new.n": a number does not fit the long column'
    assert json.loads(events[0].shown()["new"]) == {"amount": "two", "n": 3}
    assert m.status()["quarantined"] == 2
    assert commit(m, batch).noop  # a re-run: nothing merged, nothing set aside again
    m.close()
    again = MirrorTable(mirror_config(path, strict=True), wal_id="w1", cores=CORES)
    again.open()
    assert again.quarantined == 2
    again.close()
