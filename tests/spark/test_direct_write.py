"""Batches written without a Spark job (``sparkio.RawInbox``, the jar's
``DirectWrite``): the files a Spark job would have written, byte for byte where
it counts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from daemon.errors import ExecutorError
from daemon.events import StoredEvent, encode
from daemon.plane.batch import MicroBatch, Slice
from daemon.service.metrics import Metrics
from daemon.spark.executor import SparkExecutor
from daemon.table import quarantine, sparkio
from daemon.table.layout import META_DIR
from tests import requires
from tests.spark.support import batch_lsns, make_batches, make_config, read_table
from wal.record import Record

pytestmark = pytest.mark.spark


@pytest.fixture
def direct(spark: Any) -> Any:
    """The shared session, which must be able to load the direct writer."""
    reason = sparkio.direct_write_missing(spark)
    requires.daemon_jar(reason)  # `make test` builds it; a machine without javac cannot
    return spark


def spark_jobs(spark: Any) -> int:
    """Jobs the session has run (outside job groups: all of the daemon's)."""
    return len(spark.sparkContext.statusTracker().getJobIdsForGroup())


async def run(
    spark: Any, root: Path, batches: list[MicroBatch], direct_write: bool = True, **config: Any
) -> int:
    """The batches through a new executor whose tables are under ``root``, with
    ``spark.direct_write`` as given; returns the Spark jobs they ran. Its
    status says how it wrote them."""
    cfg = make_config(root, **config)
    cfg = replace(cfg, spark=replace(cfg.spark, direct_write=direct_write))
    ex = SparkExecutor(cfg, Metrics(), wal_id="wal-1", session=spark)
    await ex.start()
    try:
        before = spark_jobs(spark)
        for b in batches:
            await ex.execute(b)
        assert ex.status()["cdc_write"] == (
            "direct" if direct_write else "spark job (spark.direct_write = false)"
        )
        return spark_jobs(spark) - before
    finally:
        await ex.stop()


def files(table: Path) -> list[tuple[str, list[Any], Any, Any, list[Any]]]:
    """Each data file, in order: its folder, its rows in file order, its Parquet
    schema, its footer's key-values and, per column, its encodings and whether
    it has statistics."""
    out = []
    for f in sorted(table.glob("collection=*/**/*.parquet")):
        md = pq.read_metadata(f)
        columns = [
            (c.path_in_schema, sorted(c.encodings), c.statistics is not None)
            for g in range(md.num_row_groups)
            for c in (md.row_group(g).column(i) for i in range(md.num_columns))
        ]
        rows = pq.ParquetFile(f).read().to_pylist()
        folder = str(f.parent.relative_to(table))
        out.append((folder, rows, md.schema.to_arrow_schema(), md.metadata, columns))
    return out


@pytest.mark.parametrize(
    ("collections", "compaction", "partition_by", "shape", "folders"),
    [
        (("*",), True, ("collection",), (3, 400), 2),
        (("orders",), True, ("collection",), (3, 400), 1),
        (("*",), False, ("collection",), (3, 400), 2),
        (("*",), True, ("collection", "date"), (3, 400), 8),
        (("orders",), True, ("collection", "date", "hour"), (3, 400), 51),
        (("*",), True, ("collection", "date"), (1, 12_000), 4),
    ],
    ids=["all", "some", "all-not-compacting", "by-date", "some-by-hour", "two-splits"],
)
async def test_batches_are_written_without_a_spark_job_into_the_files_a_job_writes(
    direct: Any,
    tmp_path: Path,
    collections: tuple[str, ...],
    compaction: bool,
    partition_by: tuple[str, ...],
    shape: tuple[int, int],
    folders: int,
) -> None:
    """Batches of 400 rows are one split (a job's one task); 12,000 rows are two
    splits, two tasks written in parallel, a file each per folder. From
    2023-11-14 22:13 UTC, the 1,200 small ones are 150 s apart (four UTC days,
    51 hours), the 12,000 5 s apart (two days)."""
    batches = make_batches(*shape, ns_per_lsn=150 * 10**9 // (shape[1] // 400))
    config: dict[str, Any] = {
        "streams": [("s", collections)],
        "stream_options": {"compaction": compaction},
        "partition_by": partition_by,
    }

    jobs = await run(direct, tmp_path / "direct", batches, **config)
    job_jobs = await run(direct, tmp_path / "job", batches, direct_write=False, **config)

    assert jobs == 0 and job_jobs >= len(batches)
    got, want = files(tmp_path / "direct" / "cdc" / "s"), files(tmp_path / "job" / "cdc" / "s")
    assert len({f[0] for f in got}) == folders
    assert [f[0] for f in got] == [f[0] for f in want]  # a file per folder, batch and task
    assert got == want
    rows = read_table(direct, tmp_path / "direct" / "cdc" / "s")
    everything = batch_lsns(batches)
    assert sorted(r.lsn for r in rows) == (
        everything if collections == ("*",) else [lsn for lsn in everything if lsn % 2 == 0]
    )


@pytest.mark.parametrize(("rows", "bad"), [(2, 2), (12_000, 10_000)], ids=["one-split", "two"])
async def test_with_the_quarantine_off_json_the_direct_write_cannot_parse_fails_the_batch(
    direct: Any, executor_factory: Any, tmp_path: Path, rows: int, bad: int
) -> None:
    """As through a Spark job: the batch fails whole (its one stage failed), the
    error names the event and field, and nothing of it is published or left,
    also when the bad event is in the second split and the first one's task
    wrote its files."""
    recs = [Record(lsn, 0, lsn, encode(_event(lsn, bad))) for lsn in range(1, rows + 1)]
    ex = await executor_factory(stream_options={"quarantine_max_rows": 0})

    with pytest.raises(ExecutorError) as err:
        await ex.execute(MicroBatch(1, {0: Slice(0, 1, rows, recs)}))

    assert f"(lsn {bad})" in str(err.value) and "field old: not a VARIANT" in str(err.value)
    table = tmp_path / "cdc" / "all"
    assert not list(table.glob("collection=*/*"))
    assert not list((table / META_DIR / "staging").iterdir())
    assert not list((table / META_DIR / "pending").glob("*"))


@pytest.mark.parametrize(("rows", "bad"), [(2, 2), (12_000, 10_000)], ids=["one-split", "two"])
async def test_json_the_direct_write_cannot_parse_goes_to_the_quarantine_and_the_rest_commits(
    direct: Any, executor_factory: Any, tmp_path: Path, rows: int, bad: int
) -> None:
    """The bad event, also in the second split, is set aside with its error;
    every other row is in the table once."""
    recs = [Record(lsn, 0, lsn, encode(_event(lsn, bad))) for lsn in range(1, rows + 1)]
    ex = await executor_factory()

    assert not await ex.execute(MicroBatch(1, {0: Slice(0, 1, rows, recs)}))

    table = tmp_path / "cdc" / "all"
    got = read_table(direct, table)
    assert sorted(r.lsn for r in got) == [lsn for lsn in range(1, rows + 1) if lsn != bad]
    held = quarantine.load(table / META_DIR)
    assert [(r.lsn, r.error.split(":")[0]) for r in held] == [(bad, "old")]


def _event(lsn: int, bad: int) -> StoredEvent:
    """An insert, but an update whose ``old`` is not JSON at LSN ``bad``."""
    old = b'{"a":' if lsn == bad else None
    return StoredEvent("c", "update" if old else "insert", f"k{lsn}", b'{"a":1}', old, 1)
