"""CDC sink: exactly-once under injected failures, recovery of leftovers, identity checks."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from daemon.errors import ExecutorError, IdentityMismatchError, LsnRegressionError
from daemon.table.errors import CdcLedgerMismatchError, CdcStreamLockedError
from daemon.table.layout import META_DIR
from daemon.table.ledger import KEEP_BATCHES, Ledger, LedgerEntry, read_ledger
from daemon.table.parquet import CdcSink
from tests.spark.support import batch_lsns, make_batches, read_table

pytestmark = pytest.mark.spark

REAL_WRITE = CdcSink._write_staged


def visible_lsns(spark: Any, path: Path) -> list[int]:
    return sorted(r.lsn for r in read_table(spark, path))


def leftovers(path: Path) -> list[str]:
    meta = path / META_DIR
    return sorted(
        str(p.relative_to(meta))
        for p in meta.rglob("*")
        if p.is_file() and p.name not in ("lock", "generation")  # a stream's, always there
    ) + sorted(str(p.relative_to(meta)) for p in (meta / "staging").iterdir())


async def test_write_failure_after_partial_write_retries_to_exactly_once(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """1. Batch 2's Spark write writes its files, then fails (as a lost executor would).
    2. execute raises; readers still see batch 1 only.  3. The planner retries: batch 2
    commits once, no staging left behind."""
    ex = await executor_factory()
    batches = make_batches(3, 150)
    table = tmp_path / "cdc" / "all"
    await ex.execute(batches[0])

    def write_then_fail(self: CdcSink, df: Any, staging: Path) -> None:
        REAL_WRITE(self, df, staging)
        raise RuntimeError("Job aborted due to stage failure: lost executor 1")

    wrapped = mock.patch.object(
        CdcSink, "_write_staged", autospec=True, side_effect=write_then_fail
    )
    with wrapped, pytest.raises(ExecutorError, match="lost executor"):
        await ex.execute(batches[1])
    assert visible_lsns(spark, table) == batch_lsns(batches[:1])
    assert leftovers(table) == ["ledger.json"]

    await ex.execute(batches[1])
    await ex.execute(batches[2])
    assert visible_lsns(spark, table) == batch_lsns(batches)
    assert leftovers(table) == ["ledger.json"]


async def test_write_failures_on_every_other_attempt_never_duplicate(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    ex = await executor_factory()
    batches = make_batches(4, 80)
    calls = {"n": 0}

    def flaky(self: CdcSink, df: Any, staging: Path) -> None:
        calls["n"] += 1
        if calls["n"] % 2:
            raise OSError(28, "No space left on device")
        REAL_WRITE(self, df, staging)

    with mock.patch.object(CdcSink, "_write_staged", autospec=True, side_effect=flaky):
        for b in batches:
            for _attempt in range(3):
                try:
                    await ex.execute(b)
                    break
                except ExecutorError:
                    continue
    assert calls["n"] == 8
    assert visible_lsns(spark, tmp_path / "cdc" / "all") == batch_lsns(batches)
    assert ex.status()["batches_failed"] == 4


async def test_publish_failure_after_the_intent_rolls_forward_on_retry(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """1. The first rename of step 3 succeeds, the second fails (EIO).  2. The intent is
    kept.  3. The retry completes the renames without a new Spark write."""
    ex = await executor_factory()
    (batch,) = make_batches(1, 200)
    real_rename = os.rename
    renames = {"n": 0}

    def rename_once(src: Any, dst: Any) -> None:
        renames["n"] += 1
        if renames["n"] == 2:
            raise OSError(5, "Input/output error")
        real_rename(src, dst)

    failing = mock.patch("daemon.table.parquet.os.rename", side_effect=rename_once)
    with failing, pytest.raises(ExecutorError, match="Input/output error"):
        await ex.execute(batch)
    table = tmp_path / "cdc" / "all"
    assert (table / META_DIR / "pending" / "b000000000001.json").exists()

    with mock.patch.object(CdcSink, "_write_staged", autospec=True) as write:
        await ex.execute(batch)
    write.assert_not_called()  # rolled forward from the intent, no second write
    assert visible_lsns(spark, table) == batch_lsns([batch])
    assert leftovers(table) == ["ledger.json"]


async def test_ledger_records_batch_ranges_rows_and_identity(
    executor_factory: Any, tmp_path: Path
) -> None:
    ex = await executor_factory(wal_id="wal-abc")
    batches = make_batches(2, 60)
    for b in batches:
        await ex.execute(b)

    ledger = read_ledger(tmp_path / "cdc" / "all")
    assert ledger is not None
    assert (ledger.stream, ledger.wal_id, ledger.cores, ledger.last_batch_id) == (
        "all",
        "wal-abc",
        4,
        2,
    )
    assert [e.batch_id for e in ledger.batches] == [1, 2]
    assert [e.ranges for e in ledger.batches] == [b.ranges() for b in batches]
    assert [e.rows for e in ledger.batches] == [60, 60] and ledger.rows_total == 120
    assert ledger.high_lsn == {c: hi for c, (_, hi) in batches[1].ranges().items()}
    for e in ledger.batches:
        assert all((tmp_path / "cdc" / "all" / f).is_file() for f in e.files)


async def test_ledger_of_another_wal_refuses_to_start(
    executor_factory: Any, tmp_path: Path
) -> None:
    ex = await executor_factory(wal_id="wal-1")
    await ex.execute(make_batches(1, 10)[0])
    await ex.stop()

    with pytest.raises(IdentityMismatchError, match=r"WAL id wal-1 -> wal-2.*new folder"):
        await executor_factory(wal_id="wal-2")
    with pytest.raises(IdentityMismatchError, match="cores 4 -> 8"):
        await executor_factory(wal_id="wal-1", cores=8)


async def test_same_lsns_under_a_new_batch_id_are_refused(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    ex = await executor_factory()
    batches = make_batches(2, 50)
    for b in batches:
        await ex.execute(b)
    replanned = make_batches(1, 50, first_batch_id=3, first_lsn=51)[0]

    with pytest.raises(LsnRegressionError, match="duplicate rows"):
        await ex.execute(replanned)
    assert visible_lsns(spark, tmp_path / "cdc" / "all") == batch_lsns(batches)


async def test_committed_id_with_other_ranges_is_refused(executor_factory: Any) -> None:
    ex = await executor_factory()
    await ex.execute(make_batches(1, 50)[0])
    changed = make_batches(1, 60)[0]
    with pytest.raises(CdcLedgerMismatchError, match="came back with"):
        await ex.execute(changed)


async def test_second_writer_of_a_stream_is_refused(executor_factory: Any) -> None:
    await executor_factory()
    with pytest.raises(CdcStreamLockedError, match="locked by another process"):
        await executor_factory()


async def test_restart_removes_staging_temp_files_and_orphans(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """Leftovers a crash can leave (and a few it cannot) are removed at start, while
    committed files stay."""
    ex = await executor_factory()
    batches = make_batches(2, 100)
    await ex.execute(batches[0])
    await ex.stop()
    table = tmp_path / "cdc" / "all"
    meta = table / META_DIR
    stray = meta / "staging" / "b000000000002" / "collection=orders"
    stray.mkdir(parents=True)
    (stray / "part-00000-x.snappy.parquet").write_bytes(b"PAR1")
    (meta / ".ledger.json.999.tmp").write_text("{")
    orphan = table / "collection=orders" / "part-b000000000002-00000-x.snappy.parquet"
    orphan.write_bytes(b"PAR1 not really")

    ex2 = await executor_factory()
    assert not orphan.exists()
    assert leftovers(table) == ["ledger.json"]
    assert visible_lsns(spark, table) == batch_lsns(batches[:1])
    await ex2.execute(batches[1])
    assert visible_lsns(spark, table) == batch_lsns(batches)


async def test_intent_left_by_a_dead_process_is_rolled_forward_at_start(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    ex = await executor_factory()
    batches = make_batches(2, 100)
    await ex.execute(batches[0])
    failing = mock.patch.object(CdcSink, "_publish", autospec=True, side_effect=OSError(5, "EIO"))
    with failing, pytest.raises(ExecutorError):
        await ex.execute(batches[1])
    await ex.stop()

    await executor_factory()
    ledger = read_ledger(tmp_path / "cdc" / "all")
    assert ledger is not None and ledger.last_batch_id == 2
    assert visible_lsns(spark, tmp_path / "cdc" / "all") == batch_lsns(batches)


async def test_batch_without_rows_for_a_stream_is_recorded_without_files(
    executor_factory: Any, tmp_path: Path
) -> None:
    ex = await executor_factory(streams=[("nothing", ["no-such-collection"])])
    batches = make_batches(2, 30)
    for b in batches:
        await ex.execute(b)
    ledger = read_ledger(tmp_path / "cdc" / "nothing")
    assert ledger is not None and ledger.last_batch_id == 2
    assert [e.files for e in ledger.batches] == [[], []]
    assert not list((tmp_path / "cdc" / "nothing").glob("collection=*"))
    raw = json.loads((tmp_path / "cdc" / "nothing" / META_DIR / "ledger.json").read_text())
    assert raw["format"] == 1 and raw["high_lsn"]


DICTIONARY = {"PLAIN_DICTIONARY", "RLE_DICTIONARY"}
PAYLOAD_LEAVES = ("new.value", "new.metadata", "old.value", "old.metadata", "new_json", "old_json")


@pytest.mark.parametrize("compaction", [True, False], ids=["compacting", "not-compacting"])
async def test_cdc_files_skip_dictionaries_and_statistics_only_where_they_do_not_pay(
    executor_factory: Any, tmp_path: Path, compaction: bool
) -> None:
    """The writer options reach Parquet: lsn, seq and key are written without a
    dictionary; a repeating column (op) keeps one. A stream that compacts writes
    its batch files (which a compaction replaces) without the dictionary of the
    VARIANT values and without min/max statistics of the payload columns; one
    that does not keeps both (``old`` repeats: 7 distinct documents)."""
    import pyarrow.parquet as pq

    ex = await executor_factory(stream_options={"compaction": compaction})
    (batch,) = make_batches(1, 400)
    await ex.execute(batch)

    files = sorted((tmp_path / "cdc" / "all").glob("collection=*/part-*.parquet"))
    assert files
    for f in files:
        meta = pq.ParquetFile(f).metadata
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            columns = {
                group.column(c).path_in_schema: group.column(c) for c in range(group.num_columns)
            }
            encodings = {name: set(col.encodings) for name, col in columns.items()}
            for name in ("lsn", "seq", "key"):
                assert not DICTIONARY & encodings[name], (f, name)
            assert DICTIONARY & encodings["op"], f
            assert DICTIONARY & encodings["new.metadata"], f
            assert bool(DICTIONARY & encodings["old.value"]) is not compaction, f
            for name in PAYLOAD_LEAVES:
                stats = columns[name].statistics
                assert (stats is not None and stats.has_min_max) is not compaction, (f, name)
            lsn_stats = columns["lsn"].statistics  # compaction orders files by them
            assert lsn_stats is not None and lsn_stats.has_min_max, f


def test_ledger_keeps_a_bounded_window_but_every_total() -> None:
    """The entries are bounded (the ledger is rewritten per commit); the last id,
    row total and per-core high LSNs still count every batch."""
    ledger = Ledger("all", "wal-1", 2)
    n = KEEP_BATCHES + 50
    for b in range(1, n + 1):
        ledger.append(LedgerEntry(b, {0: (2 * b - 1, 2 * b - 1), 1: (2 * b, 2 * b)}, 2, [], 0.0))
    assert len(ledger.batches) == KEEP_BATCHES
    assert ledger.batches[0].batch_id == n - KEEP_BATCHES + 1
    assert ledger.entry(n - KEEP_BATCHES) is None  # out of the window
    assert ledger.entry(n) is ledger.batches[-1]
    assert (ledger.last_batch_id, ledger.rows_total, ledger.high_lsn) == (
        n,
        2 * n,
        {0: 2 * n - 1, 1: 2 * n},
    )


async def test_staged_write_leaves_no_checksum_or_marker_files_and_replaces_leftovers(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """Step 1 writes only the Parquet files: no ``.crc`` beside each one and no
    ``_SUCCESS`` (each cost a forked ``chmod``), and a failed attempt's leftover in
    the staging folder is gone (the write appends into a folder it empties first)."""
    ex = await executor_factory()
    (batch,) = make_batches(1, 200)
    staged: list[str] = []
    jvm = spark.sparkContext._jvm

    def session_fs() -> str:
        conf = spark.sparkContext._jsc.hadoopConfiguration()
        fs = jvm.org.apache.hadoop.fs.FileSystem.get(jvm.java.net.URI("file:///"), conf)
        return str(fs.getClass().getName())

    def write_and_list(self: CdcSink, df: Any, staging: Path) -> None:
        leftover = staging / "collection=c0" / "part-99999-old.c000.snappy.parquet"
        leftover.parent.mkdir(parents=True)
        leftover.write_bytes(b"an earlier attempt")
        REAL_WRITE(self, df, staging)
        staged.extend(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())

    before = session_fs()
    with mock.patch.object(CdcSink, "_write_staged", autospec=True, side_effect=write_and_list):
        await ex.execute(batch)
    assert staged and all(p.endswith(".parquet") for p in staged), staged
    assert not any("part-99999-old" in p for p in staged)
    assert visible_lsns(spark, tmp_path / "cdc" / "all") == batch_lsns([batch])
    # The staging write's file system is its own: the session's is left as it was.
    assert session_fs() == before != "org.apache.hadoop.fs.RawLocalFileSystem"


async def test_write_columns_are_built_once_per_session(spark: Any, executor_factory: Any) -> None:
    """The write's Columns (JVM objects) are reused batch after batch, and built
    again for another session: a rebuilt session's JVM does not know the old ones."""
    ex = await executor_factory()
    (sink,) = ex.sinks
    columns, keep = sink._write_columns(spark)
    again, _ = sink._write_columns(spark)
    assert again is columns and keep is None
    other = spark.newSession()
    rebuilt, _ = sink._write_columns(other)
    assert rebuilt is not columns
    assert sink._write_columns(other)[0] is rebuilt
