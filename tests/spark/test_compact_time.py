"""Compaction of time-partitioned streams: leaf folders (``collection=X/date=D``,
``.../hour=H``) are swapped; readers, pruning, status, and retention beside it."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from unittest import mock

import pyarrow.dataset as pads
import pytest

from daemon.cli.compact import describe_plan
from daemon.config import CdcStream
from daemon.spark.executor import SparkExecutor
from daemon.table import compact, retention
from daemon.table.compact import compact_stream
from daemon.table.compactplan import Progress, plan_stream
from daemon.table.durable import atomic_write_json
from daemon.table.errors import CdcRecoveryError
from daemon.table.layout import META_DIR
from daemon.table.parquet import CdcSink
from tests.spark.support import BASE_TS_NS, CORES, batch_lsns, event_for, make_batches
from tests.spark.test_compact import (
    REAL_WRITE,
    arrow_lsns,
    compaction_leftovers,
    files_per_partition,
    visible_lsns,
)

pytestmark = pytest.mark.spark

DATE = ("collection", "date")
HOUR = ("collection", "date", "hour")
MINUTE_NS = 60 * 10**9
# 12 batches x 40 events, 6 minutes apart: 2023-11-14T22:19Z .. 2023-11-16T22:13Z,
# so each day folder gets the files of 6-7 batches.
N_BATCHES, PER_BATCH, DATE_NS = 12, 40, 6 * MINUTE_NS
TWO_DAYS = 2 * 86_400
# With retention 2 d at 2023-11-18T00:00Z, 2023-11-14 and 2023-11-15 are expired.
NOW = datetime(2023, 11, 18, tzinfo=UTC).timestamp()
EXPIRED_DATES = ("2023-11-14", "2023-11-15")


def leaf_of(lsn: int, ns_per_lsn: int, partition_by: tuple[str, ...]) -> str:
    at = datetime.fromtimestamp((BASE_TS_NS + lsn * ns_per_lsn) / 1e9, UTC)
    out = f"collection={event_for(lsn).collection}/date={at:%Y-%m-%d}"
    return out + (f"/hour={at:%H}" if "hour" in partition_by else "")


def arrow_leaves(table: Path, partition_by: tuple[str, ...]) -> Counter[str]:
    """Rows per leaf as pyarrow (hive discovery) reads them."""
    t = pads.dataset(str(table), format="parquet", partitioning="hive").to_table()
    cols = [t[c].to_pylist() for c in partition_by]
    out: Counter[str] = Counter()
    for values in zip(*cols, strict=True):
        parts = []
        for c, v in zip(partition_by, values, strict=True):
            parts.append(f"{c}={v:02d}" if c == "hour" else f"{c}={v}")
        out["/".join(parts)] += 1
    return out


async def committed(
    executor_factory: Any, partition_by: tuple[str, ...], ns_per_lsn: int
) -> tuple[SparkExecutor, list[int]]:
    ex: SparkExecutor = await executor_factory(
        partition_by=partition_by, stream_options={"compaction": False}
    )
    batches = make_batches(N_BATCHES, PER_BATCH, ns_per_lsn=ns_per_lsn)
    for b in batches:
        await ex.execute(b)
    return ex, batch_lsns(batches)


def retention_stream(table: Path) -> CdcStream:
    return CdcStream(
        "all", ("*",), table, partition_by=DATE, retention_s=TWO_DAYS, format="parquet"
    )


async def wait_request(ex: SparkExecutor, rid: int) -> dict[str, Any]:
    assert ex.compaction is not None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        status = ex.compaction.status("all")
        assert status is not None
        if status["requests_done"] >= rid:
            return status
        await asyncio.sleep(0.1)
    raise AssertionError("the compaction request did not finish")


async def test_a_date_partitioned_stream_compacts_each_day_folder_and_readers_still_prune(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """1. 12 batches leave 6-7 files in each day folder; the dry run names the
    leaf folders.  2. The service's full compaction swaps each day folder: one
    merged file per leaf, status and ledger keyed by the leaf's path.  3. Spark
    and pyarrow see every row once, in its own partition, and a date filter
    still reads only that day's folders."""
    ex, lsns = await committed(executor_factory, DATE, DATE_NS)
    table = tmp_path / "cdc" / "all"
    leaves = Counter(leaf_of(n, DATE_NS, DATE) for n in lsns)
    before = files_per_partition(table, DATE)
    assert set(before) == set(leaves) and max(before.values()) >= 6
    assert ex.compaction is not None

    dry = ex.compaction.plan("all")
    assert dry is not None
    planned = {p["partition"]: p for p in dry}
    assert set(planned) == {p for p, n in before.items() if n > 1}
    assert all(planned[p]["inputs"] == before[p] for p in planned)
    line = describe_plan(planned["collection=orders/date=2023-11-15"])  # cdc compact --dry-run
    assert line.startswith("collection=orders/date=2023-11-15: 7 of 7 files"), line

    status = await wait_request(ex, ex.compaction.request("all") or 0)
    assert status["last_error"] is None and status["compactions"] == len(planned)
    after = {p: (1 if p in planned else n) for p, n in before.items()}
    assert status["files_per_partition"] == after
    assert files_per_partition(table, DATE) == after
    for p in planned:
        (merged,) = (table / p).iterdir()
        assert merged.name.startswith("part-c")
    ledger = ex.sinks[0].ledger
    assert sorted(c["partition"] for c in ledger.compactions) == sorted(planned)
    assert compaction_leftovers(table) == []

    assert visible_lsns(spark, table) == lsns
    assert arrow_lsns(table) == lsns
    assert arrow_leaves(table, DATE) == leaves
    day = spark.read.parquet(str(table)).where("date = '2023-11-15'")
    plan = day._jdf.queryExecution().executedPlan().toString()
    assert "PartitionFilters: [" in plan and "PartitionFilters: []" not in plan
    want = [n for n in lsns if "date=2023-11-15" in leaf_of(n, DATE_NS, DATE)]
    assert sorted(r.lsn for r in day.select("lsn").collect()) == want
    dataset = pads.dataset(str(table), format="parquet", partitioning="hive")
    fragments = list(dataset.get_fragments(filter=pads.field("date") == "2023-11-15"))
    assert len(fragments) == 2  # one merged file per collection: pruned to that day
    got = dataset.to_table(columns=["lsn"], filter=pads.field("date") == "2023-11-15")
    assert sorted(got.column("lsn").to_pylist()) == want

    # Later batches land beside the merged files; a restart's recovery keeps them.
    more = make_batches(
        2, PER_BATCH, first_batch_id=N_BATCHES + 1, first_lsn=len(lsns) + 1, ns_per_lsn=DATE_NS
    )
    for b in more:
        await ex.execute(b)
    await ex.stop()
    await executor_factory(partition_by=DATE, stream_options={"compaction": False})
    assert visible_lsns(spark, table) == lsns + batch_lsns(more)


async def test_an_hour_partitioned_stream_compacts_each_hour_folder(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    ex, lsns = await committed(executor_factory, HOUR, MINUTE_NS)
    table = tmp_path / "cdc" / "all"
    leaves = Counter(leaf_of(n, MINUTE_NS, HOUR) for n in lsns)
    before = files_per_partition(table, HOUR)
    several = {p for p, n in before.items() if n > 1}
    assert set(before) == set(leaves) and len(several) >= 8

    done = await asyncio.to_thread(compact_stream, ex.sinks[0], spark, full=True)

    assert sorted(p.partition for p in done) == sorted(several)
    assert files_per_partition(table, HOUR) == dict.fromkeys(leaves, 1)
    assert compaction_leftovers(table) == []
    # The date folders above the hours are never swapped: they hold only hours.
    assert all(d.name.startswith("hour=") for d in table.glob("collection=*/date=*/*"))
    assert visible_lsns(spark, table) == lsns
    assert arrow_leaves(table, HOUR) == leaves
    hour = spark.read.parquet(str(table)).where("date = '2023-11-15' and hour = 3")
    plan = hour._jdf.queryExecution().executedPlan().toString()
    assert "PartitionFilters: [" in plan and "PartitionFilters: []" not in plan
    assert sorted(r.lsn for r in hour.select("lsn").collect()) == [
        n for n in lsns if leaf_of(n, MINUTE_NS, HOUR).endswith("date=2023-11-15/hour=03")
    ]


async def test_retention_after_compaction_removes_exactly_the_expired_partitions(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    ex, lsns = await committed(executor_factory, DATE, DATE_NS)
    table = tmp_path / "cdc" / "all"
    (sink,) = ex.sinks
    await asyncio.to_thread(compact_stream, sink, spark, full=True)
    files = files_per_partition(table, DATE)
    gone = {p for p in files if p.rsplit("=", 1)[1] in EXPIRED_DATES}
    assert gone and gone != set(files)

    result = retention.apply(retention_stream(table), NOW, sink=sink)

    assert {r["partition"] for r in result.removed} == gone
    assert result.deferred == []
    assert {r["partition"]: r["files"] for r in result.removed} == {p: files[p] for p in gone}
    kept = [n for n in lsns if leaf_of(n, DATE_NS, DATE) not in gone]
    assert visible_lsns(spark, table) == kept
    assert arrow_lsns(table) == kept
    assert retention.read_log(table, "all").rows_removed == len(lsns) - len(kept)
    assert files_per_partition(table, DATE) == {p: n for p, n in files.items() if p not in gone}


async def test_the_planner_skips_partitions_retention_would_remove(
    executor_factory: Any, tmp_path: Path
) -> None:
    """Merging a day that retention removes at its next look is wasted work."""
    ex, _lsns = await committed(executor_factory, DATE, DATE_NS)
    (sink,) = ex.sinks
    everything = {p.partition for p in plan_stream(sink, full=True)}
    assert {p.split("/")[1] for p in everything} == {"date=2023-11-15", "date=2023-11-16"}
    # Real time is years after these events: every day but the newest is expired.
    with mock.patch.object(sink, "stream", dataclasses.replace(sink.stream, retention_s=TWO_DAYS)):
        kept = {p.partition for p in plan_stream(sink, full=True)}
    assert kept == {p for p in everything if p.endswith("date=2023-11-16")}


async def test_retention_defers_a_partition_being_compacted_and_never_gets_it_back(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """1. A compaction of the expired day collection=orders/date=2023-11-15 is in
    its Spark write.  2. Retention runs meanwhile: it removes every other expired
    partition and defers that one (the compaction claimed it).  3. The compaction
    swaps it; the next planned leaf, collection=users/date=2023-11-15, which
    retention removed after the plan, is skipped and not brought back.
    4. Retention's next run removes the compacted partition (one file)."""
    ex, lsns = await committed(executor_factory, DATE, DATE_NS)
    table = tmp_path / "cdc" / "all"
    (sink,) = ex.sinks
    claimed = "collection=orders/date=2023-11-15"
    entered, release = threading.Event(), threading.Event()

    def slow(spark: Any, folder: Path, plan: Any, out: Path) -> None:
        if plan.partition == claimed:
            entered.set()
            release.wait(120)
        REAL_WRITE(spark, folder, plan, out)

    with mock.patch.object(compact, "write_merged", side_effect=slow):
        running = asyncio.create_task(asyncio.to_thread(compact_stream, sink, spark, full=True))
        assert await asyncio.to_thread(entered.wait, 120)
        first = retention.apply(retention_stream(table), NOW, sink=sink)
        release.set()
        done = await running

    assert first.deferred == [claimed]
    assert {r["partition"] for r in first.removed} == {
        f"collection={c}/date={d}" for c in ("orders", "users") for d in EXPIRED_DATES
    } - {claimed}
    assert [p.partition for p in done] == [
        claimed,
        "collection=orders/date=2023-11-16",
        "collection=users/date=2023-11-16",
    ]
    assert not (table / "collection=users/date=2023-11-15").exists()
    assert compaction_leftovers(table) == []
    assert sink.compacting == set()
    assert files_per_partition(table, DATE)[claimed] == 1

    second = retention.apply(retention_stream(table), NOW, sink=sink)
    assert [(r["partition"], r["files"]) for r in second.removed] == [(claimed, 1)]
    kept = [n for n in lsns if leaf_of(n, DATE_NS, DATE).endswith("date=2023-11-16")]
    assert visible_lsns(spark, table) == kept
    assert arrow_lsns(table) == kept
    assert retention.read_log(table, "all").rows_removed == len(lsns) - len(kept)


async def test_a_compaction_that_failed_after_its_swap_keeps_its_claim_until_recovered(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """The ledger write fails after the swap: the leaf stays claimed (retention
    defers it) until recovery. Removed meanwhile by a retention that does not
    know of the compaction (the CLI's, after a crash), the intent is cleaned and
    nothing comes back."""
    ex, lsns = await committed(executor_factory, DATE, DATE_NS)
    table = tmp_path / "cdc" / "all"
    (sink,) = ex.sinks
    target = "collection=orders/date=2023-11-15"
    (plan,) = [p for p in plan_stream(sink, full=True) if p.partition == target]
    progress = Progress.of("all", plan)
    with (
        mock.patch.object(sink, "record_compaction", side_effect=OSError("disk full")),
        pytest.raises(OSError, match="disk full"),
    ):
        await asyncio.to_thread(compact.run_compaction, sink, spark, plan, progress)
    assert files_per_partition(table, DATE)[target] == 1  # swapped
    assert sink.compacting == {target}
    assert retention.apply(retention_stream(table), NOW, sink=sink).deferred == [target]

    retention.apply(retention_stream(table), NOW)  # no sink: does not see the claim
    assert not (table / target).exists()
    report = compact.recover(sink)
    assert report.compactions_rolled_back == [1] and report.compactions_rolled_forward == []
    assert sink.compacting == set()
    assert compaction_leftovers(table) == []
    assert not (table / target).exists()
    kept = [n for n in lsns if leaf_of(n, DATE_NS, DATE).endswith("date=2023-11-16")]
    assert arrow_lsns(table) == kept


async def test_recovery_refuses_an_intent_that_names_no_leaf_partition(
    executor_factory: Any, tmp_path: Path
) -> None:
    """A date-partitioned stream's intent must name collection=X/date=D: one
    naming the collection folder (or a path out of the table) is never acted on."""
    ex, lsns = await committed(executor_factory, DATE, DATE_NS)
    await ex.stop()
    table = tmp_path / "cdc" / "all"
    intent = table / META_DIR / "compact" / "c000000000001.json"
    for bad in ("collection=orders", "collection=orders/../../x", "/etc"):
        atomic_write_json(intent, {"partition": bad, "outputs": ["part-c1"]})
        sink = CdcSink(
            CdcStream("all", ("*",), table, partition_by=DATE, format="parquet"),
            wal_id="wal-1",
            cores=CORES,
        )
        with pytest.raises(CdcRecoveryError, match="not a leaf"):
            sink.open()
    assert sorted(files_per_partition(table, DATE)) == sorted(
        {leaf_of(n, DATE_NS, DATE) for n in lsns}
    )
