"""The raw inbox (``daemon.spark.rawinbox`` and the jar's ``eventplane.inbox``):
Spark reads a batch's WAL payloads as written and decodes them in its tasks
into exactly the rows the Parquet inbox gives."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from py4j.protocol import Py4JJavaError

from daemon.events import StoredEvent, encode
from daemon.plane.batch import MicroBatch, Slice
from daemon.plane.parts import Rows, split_part
from daemon.spark import frame, rawinbox
from tests import requires
from tests.core.test_batch_table import as_columnar, records
from tests.core.test_unpack import stored
from tests.spark.support import batch_lsns, make_batches, read_table
from wal.record import Record

# Every column of the inbox, the timestamps as µs since the epoch: the extreme
# event times the generator draws do not fit Python's datetime.
COLUMNS = [
    f"unix_micros({name}) AS {name}" if kind == "TIMESTAMP" else name
    for name, kind in (c.split() for c in frame.INBOX_SCHEMA.split(","))
]


@pytest.fixture
def reader(spark: Any) -> Any:
    """The shared session, which must be able to load the reader."""
    reason = rawinbox.missing(spark)
    requires.daemon_jar(reason)  # `make test` builds it; a machine without javac cannot
    return spark


def both_ways(spark: Any, batch: MicroBatch, inbox: Path, parallelism: int = 2) -> Any:
    """The batch's rows read from a raw and from a Parquet inbox file, sorted."""
    raw = frame.write_inbox(batch, inbox, parallelism, raw=True)
    parquet = frame.write_inbox(batch, inbox, parallelism, raw=False)
    assert raw.splits is not None and parquet.splits is None
    got = rawinbox.read(spark, raw.path, raw.splits, batch.batch_id).selectExpr(*COLUMNS)
    want = frame._read_inbox(spark, parquet.path).selectExpr(*COLUMNS)
    return sorted(got.collect()), sorted(want.collect()), raw, parquet


def variants_both_ways(spark: Any, batch: MicroBatch, inbox: Path) -> tuple[list[Any], list[Any]]:
    """(lsn, new, old) of the batch's contract frame from a raw inbox (the reader
    parsed the JSON) and from a Parquet one (``parse_json``), each VARIANT as its
    (value, metadata) bytes, sorted by lsn."""

    def rows(file: frame.InboxFile) -> list[Any]:
        def raw_variant(v: Any) -> Any:
            return None if v is None else (bytes(v.value), bytes(v.metadata))

        df = frame.read_inbox(spark, file, batch.batch_id).select("lsn", "new", "old")
        return sorted((r.lsn, raw_variant(r.new), raw_variant(r.old)) for r in df.collect())

    raw = frame.write_inbox(batch, inbox, 2, raw=True)
    parquet = frame.write_inbox(batch, inbox, 2, raw=False)
    return rows(raw), rows(parquet)


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(stored(), min_size=1, max_size=60))
def test_every_field_of_every_form_reads_as_the_parquet_inbox_reads_it(
    reader: Any, tmp_path: Path, payloads: list[bytes]
) -> None:
    """Short and long forms, emit actions' events, nil and non-nil optional fields,
    strings and JSON in every msgpack size class, the extreme integers."""
    recs = [Record(i + 1, 0, 10 + i, p) for i, p in enumerate(payloads)]
    batch = MicroBatch(3, {0: Slice(0, 1, len(recs), recs)})

    got, want, _, _ = both_ways(reader, batch, tmp_path)

    assert len(got) == len(payloads)
    assert got == want


def _json_text(draw: Any, depth: int = 0) -> str:
    """A JSON document as a producer might write it: numbers of every kind Variant
    stores differently (int widths, decimals, exponents, beyond int64), strings
    with escapes and non-ASCII text, nested objects and arrays, odd spacing."""
    kinds = ["int", "num", "str", "lit"] + (["obj", "arr"] if depth < 3 else [])
    kind = draw(st.sampled_from(kinds))
    space = draw(st.sampled_from(["", " ", "\n  "]))
    if kind == "int":
        return str(draw(st.integers(min_value=-(2**70), max_value=2**70)))
    if kind == "num":
        return draw(
            st.one_of(
                st.floats(allow_nan=False, allow_infinity=False).map(repr),
                st.decimals(allow_nan=False, allow_infinity=False, places=4).map(str),
                st.sampled_from(["1e400", "-0.0", "0.1000", "12345678901234567890.5", "1E-7"]),
            )
        )
    if kind == "str":
        return json.dumps(draw(st.text(max_size=20)), ensure_ascii=draw(st.booleans()))
    if kind == "lit":
        return draw(st.sampled_from(["true", "false", "null"]))
    if kind == "arr":
        items = draw(st.lists(st.just(0), max_size=4))
        return "[" + f",{space}".join(_json_text(draw, depth + 1) for _ in items) + "]"
    keys = draw(st.lists(st.text(max_size=8), max_size=4, unique=True))
    fields = (f"{json.dumps(k)}:{space}{_json_text(draw, depth + 1)}" for k in keys)
    return "{" + f",{space}".join(fields) + "}"


json_texts = st.composite(_json_text)


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    st.lists(st.tuples(json_texts(), st.one_of(st.none(), json_texts())), min_size=1, max_size=40)
)
def test_the_readers_variants_are_parse_jsons_byte_for_byte(
    reader: Any, tmp_path: Path, docs: list[tuple[str, str | None]]
) -> None:
    """The raw inbox's reader parses new/old itself, from the payload's bytes;
    every VARIANT it builds is the one ``parse_json`` builds from the text, value
    and metadata bytes alike, and nil stays NULL."""
    recs = [
        Record(
            i + 1,
            0,
            i + 1,
            encode(StoredEvent("c", "update", f"k{i}", new.encode(), old and old.encode(), 1)),
        )
        for i, (new, old) in enumerate(docs)
    ]
    batch = MicroBatch(2, {0: Slice(0, 1, len(recs), recs)})

    got, want = variants_both_ways(reader, batch, tmp_path)

    assert [lsn for lsn, _, _ in got] == list(range(1, len(docs) + 1))
    assert got == want


def test_json_the_reader_cannot_parse_fails_the_batch_naming_the_event(
    reader: Any, tmp_path: Path
) -> None:
    """Ingest refuses such JSON; were it in the WAL, the batch fails as
    ``parse_json`` would fail it, and the error says which event and field."""
    recs = [
        Record(1, 0, 1, encode(StoredEvent("c", "insert", "k1", b'{"a":1}', None, 1))),
        Record(2, 0, 2, encode(StoredEvent("c", "update", "k2", b'{"a":1}', b'{"a":', 1))),
    ]
    batch = MicroBatch(4, {0: Slice(0, 1, 2, recs)})
    file = frame.write_inbox(batch, tmp_path, 1, raw=True, count_collections=False)

    with pytest.raises(Py4JJavaError) as err:
        frame.read_inbox(reader, file, 4).collect()

    message = str(err.value)
    assert "event 1 (lsn 2)" in message and "field old: not a VARIANT" in message


def test_columnar_and_record_parts_read_whole_in_one_task_per_core(
    reader: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Core 0 arrives as Record lists, core 1 as WAL runs (one split as the
    planner splits them), in 7-event chunks. 60 rows on 2 cores are 2 splits of
    30 rows (a chunk is cut where a split ends), one task each, every row once;
    with at least 40 rows a split, they are one."""
    monkeypatch.setattr(rawinbox, "CHUNK_ROWS", 7)
    monkeypatch.setattr(frame, "_MIN_ROW_GROUP", 5)
    core1 = records(1, range(30, 61))
    head, tail = split_part(as_columnar(core1[:20]), 9)
    batch = MicroBatch(
        5,
        {
            0: Slice(0, 1, 29, Rows([records(0, range(1, 11)), records(0, range(11, 30))])),
            1: Slice(1, 30, 60, Rows([head, tail, as_columnar(core1[20:])])),
        },
    )

    got, want, raw, _ = both_ways(reader, batch, tmp_path)

    assert got == want
    assert [r.lsn for r in got] == list(range(1, 61))
    assert [r.seq for r in got] == [100 + lsn for lsn in range(1, 61)]
    assert raw.splits is not None
    df = rawinbox.read(reader, raw.path, raw.splits, 5)
    sizes = df.rdd.glom().map(len).collect()
    assert sizes == [30, 30]

    monkeypatch.setattr(frame, "_MIN_ROW_GROUP", 40)
    one = frame.write_inbox(batch, tmp_path, 2, raw=True)
    assert one.splits is not None and "," not in one.splits


def test_the_raw_inbox_has_the_parquet_inbox_schema_nullability_included(
    reader: Any, tmp_path: Path
) -> None:
    """The CDC table's files take their schema from the batch's input: one table
    must have one physical schema whichever inbox a batch came through (a NOT
    NULL column here made new files differ from old ones)."""
    (batch,) = make_batches(1, 20)
    raw = frame.write_inbox(batch, tmp_path, 1, raw=True)
    parquet = frame.write_inbox(batch, tmp_path, 1, raw=False)
    assert raw.splits is not None

    got = frame.read_inbox(reader, raw, 1).schema
    want = frame.read_inbox(reader, parquet, 1).schema

    assert [(f.name, f.dataType, f.nullable) for f in got] == [
        (f.name, f.dataType, f.nullable) for f in want
    ]
    assert str(got["new"].dataType) == "VariantType()"


def test_rows_per_collection_are_counted_only_when_asked(tmp_path: Path) -> None:
    (batch,) = make_batches(1, 400)

    counted = frame.write_inbox(batch, tmp_path, 2, raw=True, count_collections=True)
    skipped = frame.write_inbox(batch, tmp_path, 2, raw=True, count_collections=False)
    parquet = frame.write_inbox(batch, tmp_path, 2, raw=False)

    assert counted.counts == parquet.counts and sum(counted.counts.values()) == 400
    assert skipped.counts is None and skipped.rows == 400


def test_a_damaged_payload_fails_the_read_naming_the_file_chunk_and_lsn(
    reader: Any, tmp_path: Path
) -> None:
    """The WAL checks every payload's checksum before the inbox sees it, so this is
    a bug, never input: the task fails, and says where."""
    good = records(0, range(1, 6))
    # Event lsn 4's op is an integer, not a string.
    bad = msgspec.msgpack.encode(["c0", 7, "k4", b"{}", None, 4_000, 0, ""])
    recs = [*good[:3], Record(4, 0, 104, bad), good[4]]
    batch = MicroBatch(1, {0: Slice(0, 1, 5, recs)})
    file = frame.write_inbox(batch, tmp_path, 1, raw=True, count_collections=False)
    assert file.splits is not None

    with pytest.raises(Py4JJavaError) as err:
        rawinbox.read(reader, file.path, file.splits, 1).collect()

    message = str(err.value)
    assert f"eventplane inbox {file.path}: chunk at byte 0, event 3 (lsn 4)" in message
    assert "unexpected type byte 0x7" in message


async def test_without_the_reader_the_executor_writes_parquet_and_says_why_once(
    spark: Any, executor_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session that cannot load the reader (no jar: a machine without javac)
    gets the Parquet inbox; the table is the same; the reason is logged once."""
    monkeypatch.setattr(rawinbox, "_why_not", lambda spark: "test: the jar was not built")
    monkeypatch.setattr(rawinbox, "_usable", None)
    monkeypatch.setattr(rawinbox, "_fallback_logged", False)
    written: list[str] = []
    real = frame.write_inbox

    def spy(batch: MicroBatch, inbox: Path, *args: Any) -> Any:
        out = real(batch, inbox, *args)
        written.append(out.path.suffix)
        return out

    ex = await executor_factory()
    batches = make_batches(2, 300)
    monkeypatch.setattr(frame, "write_inbox", spy)
    with structlog.testing.capture_logs() as logs:
        for b in batches:
            await ex.execute(b)

    assert written == [".parquet", ".parquet"]
    assert ex.status()["inbox"] == "parquet (test: the jar was not built)"
    assert ex.status()["cdc_write"] == "spark job (no raw inbox)"
    assert [e["reason"] for e in logs if e["event"] == "spark_inbox_parquet"] == [
        "test: the jar was not built"
    ]
    rows = read_table(spark, tmp_path / "cdc" / "all")
    assert sorted(r.lsn for r in rows) == batch_lsns(batches)


async def test_the_executor_reads_the_raw_inbox_and_counts_only_for_streams_that_filter(
    reader: Any, executor_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every batch goes to Spark as a raw file; a stream of some collections gets
    its rows (they were counted), the stream of all gets every row."""
    calls: list[tuple[str, bool]] = []
    real = frame.write_inbox

    def spy(batch: MicroBatch, inbox: Path, *args: Any) -> Any:
        out = real(batch, inbox, *args)
        calls.append((out.path.suffix, out.counts is not None))
        return out

    ex = await executor_factory(streams=[("all", ["*"]), ("orders", ["orders"])])
    batches = make_batches(2, 300)
    monkeypatch.setattr(frame, "write_inbox", spy)
    for b in batches:
        await ex.execute(b)

    assert calls == [(rawinbox.SUFFIX, True), (rawinbox.SUFFIX, True)]
    assert ex.status()["inbox"] == "raw"
    every = read_table(reader, tmp_path / "cdc" / "all")
    orders = read_table(reader, tmp_path / "cdc" / "orders")
    assert sorted(r.lsn for r in every) == batch_lsns(batches)
    assert sorted(r.lsn for r in orders) == sorted(r.lsn for r in every if r.collection == "orders")
    assert orders and not list((tmp_path / "var" / "spark-inbox").iterdir())


def test_masters_other_than_local_and_spark_connect_keep_the_parquet_inbox() -> None:
    """The reader is on the driver's class path only: executors in other JVMs
    would fail the tasks."""
    cluster = SimpleNamespace(_sc=SimpleNamespace(master="spark://h:7077", _jsc=object()))
    assert "spark://h:7077" in (rawinbox._why_not(cluster) or "")
    assert "Spark Connect" in (rawinbox._why_not(SimpleNamespace()) or "")
