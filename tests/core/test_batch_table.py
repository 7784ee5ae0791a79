"""The executor's batch -> Arrow table step: chunked, columnar parts without Records."""

from __future__ import annotations

from array import array
from itertools import accumulate
from pathlib import Path

import pytest

from daemon.events import StoredEvent, encode
from daemon.plane.batch import MicroBatch, Slice
from daemon.plane.parts import Rows, split_part
from daemon.spark import frame
from daemon.spark.frame import batch_table, write_batch_file
from wal.reader import RecordBatch
from wal.record import Record


def event(i: int) -> bytes:
    new = b'{"n":%d}' % i
    old = None if i % 3 == 0 else b'{"n":%d}' % (i - 1)
    op = "insert" if old is None else "update"
    return encode(StoredEvent(f"c{i % 2}", op, f"k{i}", new, old, 1_700_000_000_000_000_000 + i))


def records(core: int, lsns: range) -> list[Record]:
    return [Record(lsn, core, 100 + lsn, event(lsn)) for lsn in lsns]


def as_columnar(recs: list[Record]) -> RecordBatch:
    payloads = [r.payload for r in recs]
    offsets = array("Q", accumulate(map(len, payloads), initial=0))
    return RecordBatch(
        recs[0].core, array("Q", [r.lsn for r in recs]), recs[0].seq, offsets, b"".join(payloads)
    )


def test_columnar_and_record_parts_give_the_same_table_across_chunk_edges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Core 0 arrives as Record lists, core 1 as WAL-style columnar parts (one of them
    split as the planner splits); with 7-row chunks both give the rows of one
    Record-per-event decode, in core then LSN order."""
    core0 = records(0, range(1, 30))
    core1 = records(1, range(30, 61))
    head, tail = split_part(as_columnar(core1[:20]), 9)
    mixed = MicroBatch(
        1,
        {
            1: Slice(1, 30, 60, Rows([head, tail, as_columnar(core1[20:])])),
            0: Slice(0, 1, 29, Rows([core0[:10], core0[10:]])),
        },
    )
    plain = MicroBatch(1, {0: Slice(0, 1, 29, core0), 1: Slice(1, 30, 60, core1)})

    monkeypatch.setattr(frame, "TABLE_CHUNK_ROWS", 7)
    chunked = batch_table(mixed)
    monkeypatch.setattr(frame, "TABLE_CHUNK_ROWS", 1_000)
    whole = batch_table(plain)

    assert chunked.equals(whole)
    assert chunked["lsn"].to_pylist() == list(range(1, 61))
    assert chunked["seq"].to_pylist() == [100 + lsn for lsn in range(1, 61)]
    assert chunked["core"].to_pylist() == [0] * 29 + [1] * 31
    assert chunked["key"].to_pylist() == [f"k{lsn}" for lsn in range(1, 61)]
    assert chunked["old_json"].to_pylist()[:4] == ['{"n":0}', '{"n":1}', None, '{"n":3}']


def test_an_empty_batch_gives_an_empty_table_with_the_full_schema() -> None:
    table = batch_table(MicroBatch(1, {}))
    assert table.num_rows == 0
    assert table.column_names[:3] == ["lsn", "core", "seq"]
    assert str(table.schema.field("ingest_ts").type) == "timestamp[us, tz=UTC]"


def test_wal_payloads_without_event_fields_give_null_event_id_and_time() -> None:
    """Old 8-element payloads (written before the fields existed), ingest's short
    form, the 10-element form with values and an emit action's event (no
    producer fields) share one table."""
    import msgspec

    from daemon.ingest.validate import _stored_payload

    old = msgspec.msgpack.encode(["c0", "insert", "k1", b"{}", None, 1_000, 0, "t"])
    short = _stored_payload("c0", "insert", "k2", b"{}", None, 2_000)
    full = encode(StoredEvent("c0", "insert", "k3", b"{}", None, 3_000, 0, "", "e-3", 1_500))
    derived = encode(StoredEvent("c0", "insert", "k4", b"{}", None, 4_000, 1, "t"))
    payloads = (old, short, full, derived)
    recs = [Record(i + 1, 0, i + 1, p) for i, p in enumerate(payloads)]

    table = batch_table(MicroBatch(1, {0: Slice(0, 1, 4, recs)}))

    assert table["event_id"].to_pylist() == [None, None, "e-3", None]
    assert str(table.schema.field("event_time").type) == "timestamp[us, tz=UTC]"
    assert table["event_time"].cast("int64").to_pylist() == [None, None, 1_500, None]
    assert table["source"].to_pylist() == ["t", "", "", "t"]


def test_streamed_inbox_file_holds_the_batch_table_in_bounded_row_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file written chunk by chunk reads back as ``batch_table``; row groups
    are at least the minimum, at most the maximum, about one per Spark core."""
    import pyarrow.parquet as pq

    monkeypatch.setattr(frame, "TABLE_CHUNK_ROWS", 4)
    monkeypatch.setattr(frame, "_MIN_ROW_GROUP", 5)
    monkeypatch.setattr(frame, "_MAX_ROW_GROUP", 12)
    core0 = records(0, range(1, 30))
    batch = MicroBatch(
        2,
        {
            0: Slice(0, 1, 29, core0),
            1: Slice(1, 30, 60, Rows([as_columnar(records(1, range(30, 61)))])),
        },
    )
    path = tmp_path / "b.parquet"

    rows, counts = write_batch_file(batch, path, parallelism=2)

    assert rows == 60 and counts == {"c0": 30, "c1": 30}
    assert pq.read_table(path).equals(batch_table(batch))
    meta = pq.ParquetFile(path).metadata
    sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    assert sum(sizes) == 60 and max(sizes) <= 12 and min(sizes[:-1]) >= 5


def test_an_empty_batch_streams_to_a_readable_file_with_no_rows(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    path = tmp_path / "empty.parquet"
    assert write_batch_file(MicroBatch(1, {}), path, parallelism=2) == (0, {})
    table = pq.read_table(path)
    assert table.num_rows == 0 and table.schema.equals(batch_table(MicroBatch(1, {})).schema)


@pytest.mark.parametrize(
    ("total", "cores", "expected"),
    [
        (300_000, 2, 75_000),  # 4 equal groups, two full waves (not 131k+131k+38k)
        (1_000_000, 2, 125_000),  # 8 groups of at most the 131,072 maximum
        (200_000, 2, 100_000),
        (8_000, 2, 5_000),  # a small batch: groups of at least the minimum
        (50_000, 4, 12_500),
    ],
)
def test_row_groups_come_in_equal_whole_waves_within_the_bounds(
    total: int, cores: int, expected: int
) -> None:
    rows = frame.row_group_rows(total, cores)
    groups = -(-total // rows)
    assert rows == expected
    assert rows <= frame._MAX_ROW_GROUP
    assert groups % cores == 0 or total < cores * frame._MIN_ROW_GROUP


def test_row_groups_of_large_events_stay_within_build_max_bytes(tmp_path: Path) -> None:
    """With ~10 KiB events, ``max_bytes`` (not the row maximum) sizes the row
    groups: none holds more than about that much Arrow data."""
    import pyarrow.parquet as pq

    def big(i: int) -> bytes:
        new = b'{"n":%d,"pad":"%s"}' % (i, b"x" * 10_000)
        return encode(StoredEvent("c0", "insert", f"k{i}", new, None, 1_700_000_000_000_000_000))

    core0 = [Record(lsn, 0, lsn, big(lsn)) for lsn in range(1, 61)]
    batch = MicroBatch(1, {0: Slice(0, 1, 60, Rows([as_columnar(core0)]))})
    path = tmp_path / "big.parquet"

    rows, _ = write_batch_file(batch, path, parallelism=2, max_bytes=50_000)

    meta = pq.ParquetFile(path).metadata
    sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    assert rows == 60 and sum(sizes) == 60
    assert max(sizes) == 4  # 4 x ~10 KiB: within 50,000 bytes (the row maximum is 131,072)
    assert pq.read_table(path).equals(batch_table(batch))


@pytest.mark.parametrize(
    ("total", "cores", "max_rows", "expected"),
    [
        (1_000_000, 2, 50_000, 50_000),  # 20 groups: the byte bound, not 131,072
        (300_000, 2, 1_000_000, 75_000),  # above the row maximum: that still rules
        (10, 2, 3, 3),  # fewer rows than the minimum: 4 groups of at most 3
    ],
)
def test_a_byte_bound_on_rows_keeps_equal_whole_waves(
    total: int, cores: int, max_rows: int, expected: int
) -> None:
    rows = frame.row_group_rows(total, cores, max_rows)
    assert rows == expected
    assert (-(-total // rows)) % cores == 0
