"""CDC compaction: merged files, exactly-once reads, ledger, policy, failures, readers."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from daemon.cli import cdc as cdccmd
from daemon.table import compact
from daemon.table.compact import compact_stream
from daemon.table.compactplan import DataFile, data_files, partitions, plan_partition, tier
from daemon.table.errors import CompactionError, CompactionUnsupportedError
from daemon.table.layout import META_DIR, committed_files
from daemon.table.ledger import read_ledger
from daemon.table.snapshot import consistent, read_generation, snapshot
from daemon.table.snapshot import data_files as table_files
from tests.spark.support import (
    COLLECTIONS,
    batch_lsns,
    consistent_arrow_lsns,
    consistent_spark_lsns,
    make_batches,
    read_table,
)

pytestmark = pytest.mark.spark

KiB = 1024
REAL_WRITE = compact.write_merged


def visible_lsns(spark: Any, path: Path) -> list[int]:
    return sorted(r.lsn for r in read_table(spark, path))


def arrow_lsns(path: Path) -> list[int]:
    """What a non-Spark reader sees: pyarrow's dataset discovery of the root."""
    import pyarrow.dataset as ds

    table = ds.dataset(str(path), format="parquet", partitioning="hive").to_table(columns=["lsn"])
    return sorted(table.column("lsn").to_pylist())


def collection_of(lsn: int) -> str:
    return COLLECTIONS[lsn % len(COLLECTIONS)]  # as tests.spark.support.event_for


def missing_file(exc: BaseException) -> bool:
    """Spark's ways of saying that a file it listed was gone when it opened it:
    ``FAILED_READ_FILE.FILE_NOT_EXIST``, or another ``FAILED_READ_FILE`` or
    ``CANNOT_READ_FILE_FOOTER`` caused by ``FileNotFoundException`` /
    ``NoSuchFileException``; with an explicit file list (a snapshot), a file gone
    before Spark looked it up is ``PATH_NOT_FOUND``."""
    text = str(exc)
    return any(
        s in text
        for s in (
            "FILE_NOT_EXIST",
            "FileNotFoundException",
            "NoSuchFileException",
            "PATH_NOT_FOUND",
        )
    )


def files_per_partition(
    path: Path, partition_by: tuple[str, ...] = ("collection",)
) -> dict[str, int]:
    """Data files per leaf partition, by its path relative to the table."""
    return {
        d.relative_to(path).as_posix(): len(data_files(d)) for d in partitions(path, partition_by)
    }


def compaction_leftovers(path: Path) -> list[str]:
    return sorted(p.name for p in (path / META_DIR / "compact").iterdir())


# -- policy (no Spark) ----------------------------------------------------------


def _files(sizes: list[int], first: int = 1) -> list[DataFile]:
    return [
        DataFile(f"part-b{first + i:012d}-x", s, first + i, first + i) for i, s in enumerate(sizes)
    ]


def test_full_plan_packs_small_files_in_batch_order_up_to_the_target() -> None:
    files = [*_files([300] * 10), DataFile("part-b000000000099-big", 900, 99, 99)]
    plan = plan_partition(
        "collection=a", files, target=1000, min_files=4, last_committed=99, full=True
    )
    assert plan is not None
    # 900 bytes is >= half the target: done, never rewritten.
    assert [[f.first for f in b] for b in plan.bins] == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert plan.to_json()["files_after"] == 11 - 9 + 3


def test_tiered_plan_waits_for_a_full_tier_and_takes_the_smaller_files_along() -> None:
    target, f = 64 * KiB, 4
    # Tier 0 is [8 KiB, 32 KiB), tier 1 [2 KiB, 8 KiB), tier 2 [512 B, 2 KiB).
    assert tier(40 * KiB, target, f) is None
    assert [tier(s, target, f) for s in (20 * KiB, 5 * KiB, 1 * KiB)] == [0, 1, 2]
    smalls = _files([1 * KiB] * 3)
    assert plan_partition("p", smalls, target=target, min_files=f, last_committed=9) is None
    mids = _files([5 * KiB] * 4, first=10)
    plan = plan_partition("p", smalls + mids, target=target, min_files=f, last_committed=20)
    assert plan is not None and plan.mode == "tiered"
    assert sorted(x.first for x in plan.inputs) == [1, 2, 3, 10, 11, 12, 13]
    # Files of batches not yet in the ledger are never inputs.
    plan = plan_partition("p", smalls + mids, target=target, min_files=f, last_committed=12)
    assert plan is None


def test_tiered_compaction_rewrites_each_row_a_few_times_and_bounds_the_files() -> None:
    """A simulated day of batch files: the files per partition stay bounded and
    every byte is rewritten about log_F(target/file) times."""
    target, f = 128 * 1024 * KiB, 16
    files: list[DataFile] = []
    written = rewritten = 0
    for b in range(1, 20_001):
        files.append(DataFile(f"part-b{b:012d}-x", 20 * KiB, b, b))
        written += 20 * KiB
        if b % 60 == 0:  # a check a minute
            plan = plan_partition("p", files, target=target, min_files=f, last_committed=b)
            if plan is None:
                continue
            for i, bin_ in enumerate(plan.bins):
                size = sum(x.size for x in bin_)
                rewritten += size
                gone = {x.name for x in bin_}
                files = [x for x in files if x.name not in gone]
                first, last = bin_[0].first, bin_[-1].last
                files.append(
                    DataFile(f"part-c{b:07d}{i}-b{first:012d}-b{last:012d}", size, first, last)
                )
    assert len(files) < 3 * f + written // target
    assert rewritten / written < 4.5


# -- with Spark --------------------------------------------------------------------


async def test_compaction_merges_files_and_every_reader_sees_each_row_once(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """1. 20 batches make 20 files per partition.  2. A full compaction leaves one
    merged file per partition, named after its batches, recorded in the ledger.
    3. Spark and pyarrow see every row once; later batches add files beside it.
    4. A restart (recovery, orphan removal) keeps the merged files."""
    ex = await executor_factory(stream_options={"compaction": False})
    table = tmp_path / "cdc" / "all"
    batches = make_batches(24, 60)
    for b in batches[:20]:
        await ex.execute(b)
    assert set(files_per_partition(table).values()) == {20}
    before = read_table(spark, table)

    (sink,) = ex.sinks
    done = await asyncio.to_thread(compact_stream, sink, spark, full=True)

    assert [p.partition for p in done] == ["collection=orders", "collection=users"]
    assert files_per_partition(table) == {"collection=orders": 1, "collection=users": 1}
    merged = sorted(table.glob("collection=*/part-c*"))
    assert [f.name[:46] for f in merged] == [
        "part-c000000000001-b000000000001-b000000000020",
        "part-c000000000002-b000000000001-b000000000020",
    ]
    assert sorted(read_table(spark, table)) == sorted(before)  # same rows, same values
    assert arrow_lsns(table) == batch_lsns(batches[:20])
    ledger = read_ledger(table)
    assert ledger is not None and ledger.last_compaction_id == 2
    rec = ledger.compactions[0]
    assert (rec["partition"], rec["inputs"], rec["first_batch"], rec["last_batch"]) == (
        "collection=orders",
        20,
        1,
        20,
    )
    assert rec["rows"] == sum(1 for r in before if r.collection == "orders")
    assert rec["outputs"] == [merged[0].name]
    assert compaction_leftovers(table) == []
    assert {b for b, _ in committed_files(table)} == {20}
    rows = cdccmd.latest_rows(spark, sink.stream, 3)  # eventplane cdc show
    assert [r["lsn"] for r in rows] == [1200, 1199, 1198]

    for b in batches[20:22]:
        await ex.execute(b)
    await ex.stop()
    await executor_factory(stream_options={"compaction": False})  # recovery
    assert files_per_partition(table) == {"collection=orders": 3, "collection=users": 3}
    assert visible_lsns(spark, table) == batch_lsns(batches[:22])


async def uncompacted_table(executor_factory: Any, tmp_path: Path) -> tuple[Path, Any, Any]:
    """20 batches, 20 files per partition, compaction off: (table, batches, sink)."""
    ex = await executor_factory(stream_options={"compaction": False})
    batches = make_batches(20, 30)
    for b in batches:
        await ex.execute(b)
    (sink,) = ex.sinks
    return tmp_path / "cdc" / "all", batches, sink


async def test_a_listing_cut_by_a_swap_misses_rows_and_the_snapshot_lists_again(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """1. 20 batches make 20 files per partition.  2. A reader lists the table's
    files; before it checks the generation again, a real compaction swaps both
    partitions (a slow reader, or a swap landing mid-listing).  3. What a plain
    reader keeps of that listing (the names that still exist when it looks them
    up, as Spark's and pyarrow's listings do) misses every merged row: the
    hazard is real.  4. The snapshot saw the generation move and listed again:
    Spark and pyarrow over its files see every row once."""
    table, batches, sink = await uncompacted_table(executor_factory, tmp_path)
    generation = read_generation(table)
    listings: list[list[str]] = []

    def slow_lister(root: Path) -> list[str]:
        files = table_files(root)
        listings.append(files)
        if len(listings) == 1:
            done = compact_stream(sink, spark, full=True)
            assert len(done) == 2
        return files

    snap = await asyncio.to_thread(snapshot, table, lister=slow_lister)

    kept = [f for f in listings[0] if Path(f).exists()]  # noqa: ASYNC240 (a test's look)
    import pyarrow.dataset as ds

    plain = ds.dataset(kept, format="parquet", partitioning="hive", partition_base_dir=str(table))
    assert plain.count_rows() == 0  # every input was merged away; the merged files unlisted
    assert snap.attempts == 2 and snap.generation == generation + 4  # two swaps
    assert len(snap.files) == 2 and all("part-c" in f for f in snap.files)
    assert consistent_arrow_lsns(table) == batch_lsns(batches)
    assert consistent_spark_lsns(spark, table) == batch_lsns(batches)


async def test_a_spark_read_that_a_swap_cuts_through_is_made_again_by_consistent(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """1. 20 batches make 20 files per partition.  2. A plain
    ``spark.read.parquet`` of the folder is made inside ``consistent()``;
    while the first one is made, a real compaction swaps both partitions.
    3. ``consistent()`` sees the generation move and makes the DataFrame
    again: it lists the merged files and reads every row once."""
    table, batches, sink = await uncompacted_table(executor_factory, tmp_path)
    listed: list[list[str]] = []

    def build() -> Any:
        df = spark.read.parquet(str(table))
        listed.append(df.inputFiles())
        if len(listed) == 1:
            assert len(compact_stream(sink, spark, full=True)) == 2
        return df

    df = await asyncio.to_thread(consistent, table, build)

    data = [[f for f in files if "/part-" in f] for files in listed]  # not _common_metadata
    assert [len(files) for files in data] == [40, 2]
    assert sorted(r.lsn for r in df.select("lsn").collect()) == batch_lsns(batches)


async def test_merged_files_keep_rows_sorted_and_get_the_writer_options_of_files_that_stay(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """A compacting stream writes its batch files without the VARIANT values'
    dictionary and the payloads' statistics (cdc.TRANSIENT_PARQUET_OPTIONS);
    the files a compaction merges them into have both, and still none for lsn."""
    import pyarrow.parquet as pq

    def columns(f: Path) -> dict[str, Any]:
        group = pq.ParquetFile(f).metadata.row_group(0)
        return {group.column(c).path_in_schema: group.column(c) for c in range(group.num_columns)}

    dictionary = {"PLAIN_DICTIONARY", "RLE_DICTIONARY"}
    # Compacting, but not in the background during the test.
    ex = await executor_factory(stream_options={"compact_interval_s": 3600})
    for b in make_batches(6, 200):
        await ex.execute(b)
    table = tmp_path / "cdc" / "all"
    for f in table.glob("collection=*/part-b*"):
        cols = columns(f)
        assert not dictionary & set(cols["old.value"].encodings), f
        assert not (cols["new_json"].statistics and cols["new_json"].statistics.has_min_max), f
    await asyncio.to_thread(compact_stream, ex.sinks[0], spark, full=True)
    merged = sorted(table.glob("collection=*/part-c*"))
    assert merged and not list(table.glob("collection=*/part-b*"))
    for f in merged:
        lsns = pq.read_table(f, columns=["lsn"]).column("lsn").to_pylist()
        assert lsns == sorted(lsns)
        cols = columns(f)
        assert not dictionary & set(cols["lsn"].encodings)
        assert dictionary & set(cols["old.value"].encodings), f  # 7 distinct documents
        for name in ("new.value", "old.value", "new_json", "old_json"):
            stats = cols[name].statistics
            assert stats is not None and stats.has_min_max, (f, name)


async def test_background_compaction_keeps_up_with_live_batches(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """The service compacts on its schedule while batches commit; status and
    metrics say what it did."""
    ex = await executor_factory(stream_options={"compact_min_files": 4, "compact_interval_s": 0.2})
    table = tmp_path / "cdc" / "all"
    batches = make_batches(16, 40)
    for b in batches:
        await ex.execute(b)
    deadline = time.monotonic() + 120
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status = ex.status()["streams"]["all"]["compaction"]
        if status["compactions"] >= 2 and status["running"] is None:
            break
        await asyncio.sleep(0.2)
    assert status["compactions"] >= 2, status
    assert status["last"]["step"] == "done" and status["last_error"] is None
    assert max(files_per_partition(table).values()) < 16
    # The service goes on compacting on its schedule: the read runs within one
    # table generation, as docs/cdc.md tells readers to (a plain read that a
    # swap cuts through fails or misses rows).
    assert consistent(table, lambda: visible_lsns(spark, table)) == batch_lsns(batches)
    text = ex.metrics.render().decode()
    assert 'eventplane_cdc_compactions_total{outcome="done",stream="all"}' in text


async def test_an_unsupported_file_system_refuses_compaction_and_the_table_works(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    ex = await executor_factory(stream_options={"compaction": False})
    batches = make_batches(5, 40)
    for b in batches[:4]:
        await ex.execute(b)
    table = tmp_path / "cdc" / "all"
    before = files_per_partition(table)

    unsupported = mock.patch.object(
        compact, "exchange", side_effect=CompactionUnsupportedError("no RENAME_EXCHANGE here")
    )
    compact._supported.clear()
    with unsupported, pytest.raises(CompactionUnsupportedError, match="RENAME_EXCHANGE"):
        await asyncio.to_thread(compact_stream, ex.sinks[0], spark, full=True)
    compact._supported.clear()
    assert files_per_partition(table) == before
    assert compaction_leftovers(table) == []
    await ex.execute(batches[4])
    assert visible_lsns(spark, table) == batch_lsns(batches)


def test_the_exchange_reports_einval_as_unsupported(tmp_path: Path) -> None:
    """What NFS answers: EINVAL (or ENOSYS on old kernels)."""
    import ctypes

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    fake = mock.MagicMock(return_value=-1)
    with (
        mock.patch.object(compact, "_libc", mock.MagicMock(renameat2=fake)),
        mock.patch.object(ctypes, "get_errno", return_value=22),
        pytest.raises(CompactionUnsupportedError, match="compaction = false"),
    ):
        compact.exchange(a, b)
    compact.exchange(a, b)  # the real one works here (ext4, tmpfs)


async def test_a_failed_spark_write_or_a_row_mismatch_changes_nothing(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    ex = await executor_factory(stream_options={"compaction": False})
    batches = make_batches(4, 40)
    for b in batches:
        await ex.execute(b)
    table = tmp_path / "cdc" / "all"
    before = files_per_partition(table)

    def fail(spark: Any, folder: Path, plan: Any, out: Path) -> None:
        raise RuntimeError("Job aborted: lost executor")

    def lose_a_row(spark: Any, folder: Path, plan: Any, out: Path) -> None:
        REAL_WRITE(spark, folder, plan, out)
        import pyarrow.parquet as pq

        (f,) = [p for p in out.iterdir() if p.name.startswith("part-")]
        t = pq.read_table(f)
        pq.write_table(t.slice(1), f)

    for bad, err in ((fail, RuntimeError), (lose_a_row, CompactionError)):
        with mock.patch.object(compact, "write_merged", side_effect=bad), pytest.raises(err):
            await asyncio.to_thread(compact_stream, ex.sinks[0], spark, full=True)
        assert files_per_partition(table) == before
        assert compaction_leftovers(table) == []
    assert visible_lsns(spark, table) == batch_lsns(batches)
    ledger = read_ledger(table)
    assert ledger is not None and ledger.last_compaction_id == 0


@pytest.mark.timeout(600)
async def test_concurrent_readers_see_every_committed_row_exactly_once(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """Readers (pyarrow threads and one Spark thread) read the table through
    snapshots (daemon/table/snapshot.py) in a loop while batches commit and the
    service compacts. Every observation has no duplicate, holds every batch
    committed before the read began, and nothing of a batch not yet begun. A
    read whose files a later swap removed before it opened them fails with
    FileNotFound: counted apart (retryable), never wrong rows."""
    ex = await executor_factory(stream_options={"compact_min_files": 3, "compact_interval_s": 0.1})
    table = tmp_path / "cdc" / "all"
    batches = make_batches(30, 40)
    batch_of = {r.lsn: b.batch_id for b in batches for sl in b.slices.values() for r in sl.records}
    committed = [0]  # batches committed so far (in order)
    started = [0]  # batches whose commit began
    stop = threading.Event()
    observations: list[tuple[str, int]] = []
    retryable: list[str] = []
    problems: list[str] = []

    def check(kind: str, lsns: list[int], low: int, high: int) -> None:
        if len(lsns) != len(set(lsns)):
            problems.append(f"{kind}: {len(lsns) - len(set(lsns))} duplicate rows")
        must = set(batch_lsns(batches[:low]))
        may = set(batch_lsns(batches[:high]))
        if not must <= set(lsns):
            problems.append(f"{kind}: {len(must - set(lsns))} committed rows missing")
        if not set(lsns) <= may:
            problems.append(f"{kind}: rows of batches not begun")
        # Per partition, a moment of the table: every batch below the newest one
        # seen there is whole (the newest may be mid-publish).
        for c in COLLECTIONS:
            seen = {x for x in lsns if collection_of(x) == c}
            if seen:
                newest = max(batch_of[x] for x in seen)
                whole = {x for x in batch_lsns(batches[: newest - 1]) if collection_of(x) == c}
                if not whole <= seen:
                    problems.append(f"{kind}: {c} misses rows of batches before {newest}")
        observations.append((kind, len(lsns)))

    def reader(kind: str, read: Any) -> None:
        while not stop.is_set():
            low = committed[0]
            try:
                lsns = read()
            except (FileNotFoundError, OSError) as exc:
                retryable.append(f"{kind}: {exc}"[:200])
                continue
            except Exception as exc:  # Spark's error for a file gone after listing
                if missing_file(exc):
                    retryable.append(f"{kind}: {str(exc)[:80]}")
                    continue
                problems.append(f"{kind}: {type(exc).__name__}: {exc}"[:500])
                return
            check(kind, lsns, low, started[0])
            time.sleep(0.01)

    def spark_read() -> list[int]:
        return consistent_spark_lsns(spark, table)

    def arrow_read() -> list[int]:
        return consistent_arrow_lsns(table)

    threads = [
        threading.Thread(target=reader, args=("arrow", arrow_read)),
        threading.Thread(target=reader, args=("arrow", arrow_read)),
        threading.Thread(target=reader, args=("spark", spark_read)),
    ]
    for t in threads:
        t.start()
    try:
        for i, b in enumerate(batches):
            started[0] = i + 1
            await ex.execute(b)
            committed[0] = i + 1
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = ex.status()["streams"]["all"]["compaction"]
            if status["running"] is None and status["max_files_per_partition"] < 6:
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert ex.compaction is not None
    await asyncio.to_thread(ex.compaction.stop)
    status = ex.status()["streams"]["all"]["compaction"]
    assert not problems, problems[:5]
    assert status["compactions"] >= 4, status
    assert sum(1 for k, _ in observations if k == "arrow") > 20
    assert sum(1 for k, _ in observations if k == "spark") > 3
    assert visible_lsns(spark, table) == batch_lsns(batches)
    print(
        f"observations {len(observations)}, retryable FileNotFound {len(retryable)}, "
        f"compactions {status['compactions']}"
    )


async def test_stop_interrupts_a_running_compaction_and_rolls_it_back(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    ex = await executor_factory(stream_options={"compaction": False})
    batches = make_batches(4, 40)
    for b in batches:
        await ex.execute(b)
    assert ex.compaction is not None
    release = threading.Event()
    entered = threading.Event()

    def slow(spark: Any, folder: Path, plan: Any, out: Path) -> None:
        entered.set()
        release.wait(30)
        raise RuntimeError("interrupted")

    with mock.patch.object(compact, "write_merged", side_effect=slow):
        assert ex.compaction.request("all") == 1
        await asyncio.to_thread(entered.wait, 60)
        assert ex.status()["streams"]["all"]["compaction"]["running"]["step"] == "writing"
        release.set()
        await ex.stop()
    table = tmp_path / "cdc" / "all"
    assert compaction_leftovers(table) == []
    assert visible_lsns(spark, table) == batch_lsns(batches)


async def test_a_failing_compaction_is_reported_and_retried_and_batches_go_on(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    ex = await executor_factory(stream_options={"compaction": False, "compact_interval_s": 0.1})
    batches = make_batches(5, 40)
    for b in batches[:4]:
        await ex.execute(b)
    assert ex.compaction is not None

    def fail(spark: Any, folder: Path, plan: Any, out: Path) -> None:
        raise RuntimeError("Job aborted: lost executor")

    with mock.patch.object(compact, "write_merged", side_effect=fail):
        ex.compaction.request("all")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = ex.status()["streams"]["all"]["compaction"]
            if status["requests_done"] == 1:
                break
            await asyncio.sleep(0.1)
        await ex.execute(batches[4])  # a live batch is not held by it
    assert status["failures_in_a_row"] == 1 and "lost executor" in status["last_error"]
    assert status["last"]["step"] == "failed" and status["next_check_in_s"] > 0
    text = ex.metrics.render().decode()
    assert 'eventplane_cdc_compactions_total{outcome="failed",stream="all"} 1.0' in text

    ex.compaction.request("all")  # the retry works once Spark does
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = ex.status()["streams"]["all"]["compaction"]
        if status["requests_done"] == 2:
            break
        await asyncio.sleep(0.2)
    assert status["last_error"] is None and status["compactions"] == 2
    assert visible_lsns(spark, tmp_path / "cdc" / "all") == batch_lsns(batches)


async def test_files_from_before_a_column_existed_keep_their_rows(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """Inputs whose footers disagree (an older daemon wrote one without ``seq``)
    are merged with the union of their schemas: the older rows get nulls."""
    ex = await executor_factory(stream_options={"compaction": False})
    batches = make_batches(3, 40)
    for b in batches:
        await ex.execute(b)
    table = tmp_path / "cdc" / "all"
    old = sorted(table.glob("collection=orders/part-b000000000001-*"))[0]
    staged = tmp_path / "older"
    spark.read.parquet(str(old)).drop("seq").coalesce(1).write.parquet(str(staged))
    (written,) = staged.glob("part-*.parquet")
    os.replace(written, old)

    await asyncio.to_thread(compact_stream, ex.sinks[0], spark, full=True)
    (merged,) = table.glob("collection=orders/part-c*")
    rows = spark.read.parquet(str(merged)).select("lsn", "seq").collect()
    assert sum(1 for r in rows if r.seq is None) == sum(1 for r in rows if r.lsn <= 40)
    assert visible_lsns(spark, table) == batch_lsns(batches)
