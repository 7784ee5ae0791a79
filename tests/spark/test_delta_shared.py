"""Shared Delta tables (``writers = "shared"``): several daemons, each with
its own WAL and ``[daemon] name``, append to one table (docs/cdc.md, "Shared
tables"). Here two executors in one process on a table on disk; the real
processes, with SIGKILLs, on disk and on S3: tests/spark/test_delta_shared_procs.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from daemon.errors import IdentityMismatchError
from daemon.table.layout import META_DIR
from tests import requires
from tests.spark.support import batch_lsns, make_batches

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

SHARED = {"format": "delta", "writers": "shared"}


@pytest.fixture(autouse=True)
def _needs_delta(spark: Any) -> None:
    requires.delta_jars()


def writer_lsns(table: Path | str, storage_options: dict[str, str] | None = None) -> list[Any]:
    """``(writer, lsn)`` of every row delta-rs reads, sorted."""
    from deltalake import DeltaTable

    dt = DeltaTable(str(table), storage_options=storage_options)
    got = dt.to_pyarrow_table(columns=["writer", "lsn"]).to_pydict()
    return sorted(zip(got["writer"], got["lsn"], strict=True))


async def test_two_daemons_append_to_one_table_and_each_row_carries_its_writer(
    executor_factory: Any, tmp_path: Path
) -> None:
    """1. ep-1 (WAL wal-1) and ep-2 (WAL wal-2) commit their batches 1-3, of
       the same LSNs, to one table on disk, in turns.
    2. delta-rs and DuckDB read every (writer, lsn) once; each writer's files
       are under its own writer=<name> folders, its state under
       _eventplane/writers/<name>.
    3. A re-run of ep-1's batch 2 writes nothing."""
    import duckdb

    lake = tmp_path / "lake"
    one = await executor_factory(
        root=tmp_path / "a", wal_id="wal-1", daemon_name="ep-1", tables=lake, stream_options=SHARED
    )
    two = await executor_factory(
        root=tmp_path / "b", wal_id="wal-2", daemon_name="ep-2", tables=lake, stream_options=SHARED
    )
    batches = make_batches(3, 120)
    for b in batches:
        assert not await one.execute(b)
        assert not await two.execute(b)
    assert not await one.execute(batches[1])
    table = lake / "all"
    want = sorted((w, n) for w in ("ep-1", "ep-2") for n in batch_lsns(batches))
    assert writer_lsns(table) == want
    from deltalake import DeltaTable

    dataset = DeltaTable(str(table)).to_pyarrow_dataset()  # noqa: F841 (DuckDB reads it)
    got = duckdb.sql("SELECT writer, lsn FROM dataset").fetchall()
    assert sorted(got) == want
    folders = {p.parent.name for p in table.rglob("part-*.parquet")}
    assert folders == {"writer=ep-1", "writer=ep-2"}
    for name in ("ep-1", "ep-2"):
        assert (table / META_DIR / "writers" / name / "ledger.json").is_file()
    assert not (table / META_DIR / "ledger.json").exists()


async def test_an_open_removes_its_own_uncommitted_files_and_leaves_the_other_writers(
    executor_factory: Any, tmp_path: Path
) -> None:
    """Files of a batch above each writer's last, in each writer's folder (a
    crash between the write and the commit leaves such files): ep-1's open
    removes its own only; ep-2's committed and uncommitted files stay."""
    lake = tmp_path / "lake"
    kw = {"tables": lake, "stream_options": SHARED}
    one = await executor_factory(root=tmp_path / "a", wal_id="wal-1", daemon_name="ep-1", **kw)
    two = await executor_factory(root=tmp_path / "b", wal_id="wal-2", daemon_name="ep-2", **kw)
    batches = make_batches(4, 100)
    for b in batches[:2]:
        assert not await one.execute(b)
    for b in batches:  # ep-2's batches 3 and 4 are above ep-1's last
        assert not await two.execute(b)
    await one.stop()
    table = lake / "all"
    committed = sorted(table.rglob("part-*.parquet"))
    orphans = []
    for name in ("ep-1", "ep-2"):
        folder = table / "collection=orders" / f"writer={name}"
        orphans.append(folder / "part-b000000000009-orphan.parquet")
        orphans[-1].write_bytes(b"not committed")
    await executor_factory(root=tmp_path / "a", wal_id="wal-1", daemon_name="ep-1", **kw)
    assert not orphans[0].exists()
    assert orphans[1].exists()
    assert all(f.exists() for f in committed)
    want = sorted(
        [("ep-1", n) for n in batch_lsns(batches[:2])] + [("ep-2", n) for n in batch_lsns(batches)]
    )
    assert writer_lsns(table) == want


async def test_a_second_daemon_with_a_taken_name_is_refused_naming_both_wal_ids(
    executor_factory: Any, tmp_path: Path
) -> None:
    """1. ep-1 (wal-1) runs; a daemon of WAL wal-2 also named ep-1 is refused
       (the name's lock), naming both WAL ids.
    2. ep-1 stopped: still refused (the table names ep-1's WAL).
    3. wal-1 under another name is refused too (its commits carry ep-1)."""
    from daemon.table.errors import CdcStreamLockedError

    lake = tmp_path / "lake"
    kw = {"tables": lake, "stream_options": SHARED}
    one = await executor_factory(root=tmp_path / "a", wal_id="wal-1", daemon_name="ep-1", **kw)
    assert not await one.execute(make_batches(1, 50)[0])
    with pytest.raises(CdcStreamLockedError) as locked:
        await executor_factory(root=tmp_path / "b", wal_id="wal-2", daemon_name="ep-1", **kw)
    assert "two daemons named 'ep-1'" in str(locked.value)
    assert "WAL id wal-2" in str(locked.value) and "wal_id wal-1" in str(locked.value)
    await one.stop()
    with pytest.raises(IdentityMismatchError) as info:
        await executor_factory(root=tmp_path / "b", wal_id="wal-2", daemon_name="ep-1", **kw)
    assert "two daemons named 'ep-1'" in str(info.value)
    assert "WAL id wal-1" in str(info.value) and "WAL id is wal-2" in str(info.value)
    with pytest.raises(IdentityMismatchError, match="as 'ep-1', not as 'ep-9'"):
        await executor_factory(root=tmp_path / "a", wal_id="wal-1", daemon_name="ep-9", **kw)


async def test_a_stream_whose_writers_setting_disagrees_with_the_table_is_refused_naming_it(
    executor_factory: Any, tmp_path: Path
) -> None:
    lake = tmp_path / "lake"
    one = await executor_factory(
        root=tmp_path / "a", wal_id="wal-1", daemon_name="ep-1", tables=lake, stream_options=SHARED
    )
    assert not await one.execute(make_batches(1, 50)[0])
    with pytest.raises(IdentityMismatchError) as info:
        await executor_factory(
            root=tmp_path / "b", wal_id="wal-2", tables=lake, stream_options={"format": "delta"}
        )
    assert 'has writers = "single" (the default) but the Delta table' in str(info.value)
    assert "its writers: ep-1" in str(info.value)
    single = tmp_path / "single"
    alone = await executor_factory(
        root=tmp_path / "c", wal_id="wal-3", tables=single, stream_options={"format": "delta"}
    )
    assert not await alone.execute(make_batches(1, 50)[0])
    await alone.stop()
    with pytest.raises(IdentityMismatchError) as info:
        await executor_factory(
            root=tmp_path / "d",
            wal_id="wal-4",
            daemon_name="ep-4",
            tables=single,
            stream_options=SHARED,
        )
    assert 'has writers = "shared" but the Delta table' in str(info.value)
    assert "its writer is WAL id wal-3" in str(info.value)


async def test_a_commit_that_loses_its_version_to_another_writer_lands_on_the_next_one(
    executor_factory: Any, tmp_path: Path, metrics: Any
) -> None:
    """1. ep-1 reads the log and is about to commit its batch 2; meanwhile
       another writer's commit (a delta-rs append, as ep-2) takes that version.
    2. ep-1's commit fails (no automatic rebase), it reads the log again and
       commits at the next version: the batch lands once, and
       eventplane_cdc_commit_retries_total counts the retry."""
    from unittest import mock

    from deltalake import CommitProperties, DeltaTable

    from daemon.table import delta
    from daemon.table.deltacommit import NAME_KEY

    lake = tmp_path / "lake"
    one = await executor_factory(
        root=tmp_path / "a", wal_id="wal-1", daemon_name="ep-1", tables=lake, stream_options=SHARED
    )
    batches = make_batches(2, 80)
    assert not await one.execute(batches[0])
    table = lake / "all"
    taken: list[int] = []
    real = delta.crash_point

    def other_writer_first(point: str) -> None:
        if point == "delta.before_log_commit" and not taken:
            dt = DeltaTable(str(table))
            dt.create_write_transaction(
                [],
                "append",
                dt.schema(),
                partition_by=["collection", "writer"],
                commit_properties=CommitProperties(custom_metadata={NAME_KEY: "ep-2"}),
            )
            taken.append(int(DeltaTable(str(table)).version()))
        real(point)

    with mock.patch.object(delta, "crash_point", side_effect=other_writer_first):
        assert not await one.execute(batches[1])
    assert taken
    assert DeltaTable(str(table)).version() == taken[0] + 1
    assert writer_lsns(table) == [("ep-1", n) for n in batch_lsns(batches)]
    assert metrics.cdc_commit_retries.labels("all")._value.get() == 1
