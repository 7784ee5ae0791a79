"""The statistics of a directly written file's Delta ``add`` action: exact
bounds or none, so that a reader skipping files on them never skips a row."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from daemon.table import deltacommit


def _write(path: Path, table: pa.Table, **kwargs: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, **kwargs)  # type: ignore[arg-type]
    return path


def test_stats_hold_counts_and_exact_bounds_of_every_row_group(tmp_path: Path) -> None:
    table = pa.table(
        {
            "lsn": pa.array([7, 3, 11, 5], pa.int64()),
            "op": pa.array(["update", None, "insert", "delete"]),
            "core": pa.array([1, 0, 3, 2], pa.int32()),
        }
    )
    # Two row groups: the bounds are over both.
    file = _write(tmp_path / "f.parquet", table, row_group_size=2)
    stats = json.loads(deltacommit.file_stats(file, ("lsn", "op", "core", "absent")))
    assert stats == {
        "numRecords": 4,
        "minValues": {"lsn": 3, "op": "delete", "core": 0},
        "maxValues": {"lsn": 11, "op": "update", "core": 3},
        "nullCount": {"lsn": 0, "op": 1, "core": 0},
    }


def test_a_long_string_gets_no_bound_and_timestamps_widen_to_milliseconds(
    tmp_path: Path,
) -> None:
    long = "k" * (deltacommit.STRING_STATS_CHARS + 1)
    early = dt.datetime(2026, 11, 28, 13, 0, 0, 123456, tzinfo=dt.UTC)
    late = dt.datetime(2026, 11, 28, 14, 0, 0, 999001, tzinfo=dt.UTC)
    table = pa.table(
        {
            "key": pa.array(["a", long]),
            "ingest_ts": pa.array([late, early], pa.timestamp("us", tz="UTC")),
        }
    )
    file = _write(tmp_path / "f.parquet", table)
    stats = json.loads(deltacommit.file_stats(file, ("key", "ingest_ts")))
    assert "key" not in stats["minValues"] and "key" not in stats["maxValues"]
    assert stats["nullCount"]["key"] == 0
    # Floor of the earliest, ceiling of the latest: both rows stay inside.
    assert stats["minValues"]["ingest_ts"] == "2026-11-28T13:00:00.123Z"
    assert stats["maxValues"]["ingest_ts"] == "2026-11-28T14:00:01.000Z"


def test_a_column_of_nulls_only_has_a_null_count_and_no_bounds(tmp_path: Path) -> None:
    table = pa.table({"event_time": pa.array([None, None], pa.timestamp("us", tz="UTC"))})
    file = _write(tmp_path / "f.parquet", table)
    stats = json.loads(deltacommit.file_stats(file, ("event_time",)))
    assert stats["nullCount"] == {"event_time": 2}
    assert stats["minValues"] == {} and stats["maxValues"] == {}


def test_partition_values_and_paths_come_from_the_folders(tmp_path: Path) -> None:
    rel = "collection=orders/date=2026-11-28/hour=13/part-b000000000001-0.parquet"
    _write(tmp_path / rel, pa.table({"lsn": pa.array([1], pa.int64())}))
    add = deltacommit.add_action(tmp_path / rel, rel, ("lsn",))
    assert add.partition_values == {"collection": "orders", "date": "2026-11-28", "hour": "13"}
    assert add.path == rel and add.size == (tmp_path / rel).stat().st_size
    assert add.data_change is True
    assert json.loads(add.stats)["numRecords"] == 1
