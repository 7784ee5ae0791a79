"""Time-partitioned CDC tables and retention: layout, readers, removal, crashes, CLI."""

from __future__ import annotations

import argparse
import calendar
import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow.dataset as pads
import pytest

from daemon.cli import cdc as cdc_cli
from daemon.config import CdcStream
from daemon.spark.executor import SparkExecutor
from daemon.table import retention
from daemon.table.crash import CRASH_POINTS, ENV_CRASH_AT
from daemon.table.errors import CdcLayoutError
from daemon.table.layout import META_DIR, SUMMARY_FILE, committed_files
from daemon.table.ledger import read_ledger
from daemon.table.parquet import CdcSink
from daemon.table.snapshot import read_generation
from tests.spark.support import BASE_TS_NS, batch_lsns, event_for, make_batches

pytestmark = pytest.mark.spark

REPO = Path(__file__).resolve().parents[2]
HOUR_NS = 3_600 * 10**9
DATE = ("collection", "date")
RETENTION_POINTS = tuple(p for p in CRASH_POINTS if p.startswith("cdc.retention."))
# 4 batches x 40 events, one hour apart: 2023-11-14T23:13Z .. 2023-11-21T14:13Z.
N_BATCHES, PER_BATCH = 4, 40
# With retention 2 d at 2023-11-20T00:00Z, dates up to 2023-11-17 are expired.
NOW = float(calendar.timegm((2023, 11, 20, 0, 0, 0)))
TWO_DAYS = 2 * 86_400


def ingest_date(lsn: int) -> str:
    ts = (BASE_TS_NS + lsn * HOUR_NS) / 1e9
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d")


def expected_partitions(lsns: list[int]) -> Counter[str]:
    return Counter(f"collection={event_for(n).collection}/date={ingest_date(n)}" for n in lsns)


def visible_partitions(table: Path) -> Counter[str]:
    """Rows per partition as a non-Spark reader (pyarrow, hive layout) sees them."""
    dataset = pads.dataset(str(table), format="parquet", partitioning="hive")
    t = dataset.to_table(columns=["collection", "date"])
    return Counter(
        f"collection={c}/date={d}"
        for c, d in zip(t["collection"].to_pylist(), t["date"].to_pylist(), strict=True)
    )


async def committed_table(executor_factory: Any, tmp_path: Path, **kw: Any) -> SparkExecutor:
    ex: SparkExecutor = await executor_factory(partition_by=DATE, **kw)
    for b in make_batches(N_BATCHES, PER_BATCH, ns_per_lsn=HOUR_NS):
        await ex.execute(b)
    return ex


def stream_of(tmp_path: Path, retention_s: int | None = TWO_DAYS) -> CdcStream:
    return CdcStream(
        "all",
        ("*",),
        tmp_path / "cdc" / "all",
        partition_by=DATE,
        retention_s=retention_s,
        format="parquet",
    )


async def test_date_partitioned_stream_reads_back_with_partition_pruning(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """Rows land in collection=x/date=<UTC day of ingest_ts>; a plain read sees each
    once with its date, `where date = ...` prunes to one folder, summaries sit in the
    root and collection folders only, and committed_files walks the nested folders."""
    await committed_table(executor_factory, tmp_path)
    table = tmp_path / "cdc" / "all"
    lsns = batch_lsns(make_batches(N_BATCHES, PER_BATCH, ns_per_lsn=HOUR_NS))

    df = spark.read.parquet(str(table))
    rows = df.select("lsn", "collection", "date").collect()
    assert sorted(r.lsn for r in rows) == lsns
    assert all(str(r.date) == ingest_date(r.lsn) for r in rows)
    assert {f"collection={r.collection}/date={r.date}" for r in rows} == set(
        expected_partitions(lsns)
    )

    one_day = df.where("date = '2023-11-16'")
    plan = one_day._jdf.queryExecution().executedPlan().toString()
    assert "PartitionFilters: [" in plan and "PartitionFilters: []" not in plan
    assert sorted(r.lsn for r in one_day.select("lsn").collect()) == [
        n for n in lsns if ingest_date(n) == "2023-11-16"
    ]

    ledger = read_ledger(table)
    assert ledger is not None and ledger.partition_by == list(DATE)
    listed = committed_files(table)
    assert sorted(str(f.relative_to(table)) for _, f in listed) == sorted(
        f for e in ledger.batches for f in e.files
    )
    assert all(len(f.relative_to(table).parts) == 3 for _, f in listed)
    summaries = sorted(str(p.relative_to(table)) for p in table.rglob(SUMMARY_FILE))
    assert summaries == [
        SUMMARY_FILE,
        f"collection=orders/{SUMMARY_FILE}",
        f"collection=users/{SUMMARY_FILE}",
    ]


async def test_hour_partitions_are_two_digit_utc_hours(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    ex: SparkExecutor = await executor_factory(partition_by=("collection", "date", "hour"))
    batch = make_batches(1, 30, ns_per_lsn=HOUR_NS)[0]
    await ex.execute(batch)
    table = tmp_path / "cdc" / "all"
    got = {str(f.parent.relative_to(table)) for _, f in committed_files(table)}
    want = set()
    for n in batch_lsns([batch]):
        ts = datetime.fromtimestamp((BASE_TS_NS + n * HOUR_NS) / 1e9, UTC)
        want.add(f"collection={event_for(n).collection}/date={ts:%Y-%m-%d}/hour={ts:%H}")
    assert got == want
    assert spark.read.parquet(str(table)).count() == 30


async def test_cdc_show_prints_the_newest_rows_of_a_date_partitioned_stream(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    ex = await committed_table(executor_factory, tmp_path)
    out = io.StringIO()
    args = argparse.Namespace(cdc_command="show", stream="all", limit=3)
    assert cdc_cli.main(args, ex.cfg, session=spark, out=out) == 0
    text = out.getvalue()
    assert f"last committed batch {N_BATCHES}" in text
    last = N_BATCHES * PER_BATCH
    assert [line.split()[0] for line in text.splitlines()[3:]] == [
        str(last),
        str(last - 1),
        str(last - 2),
    ]


async def test_changing_partition_by_of_a_written_stream_is_refused(
    executor_factory: Any, tmp_path: Path
) -> None:
    ex = await committed_table(executor_factory, tmp_path)
    await ex.stop()
    table = tmp_path / "cdc" / "all"
    sink = CdcSink(CdcStream("all", ("*",), table, format="parquet"), wal_id="wal-1", cores=4)
    with pytest.raises(CdcLayoutError, match=r"partition_by = \['collection'\] but .* written"):
        sink.open()
    # An empty stream takes the new layout.
    fresh = tmp_path / "cdc" / "fresh"
    sink = CdcSink(CdcStream("fresh", ("*",), fresh, format="parquet"), wal_id="w", cores=4)
    sink.open()
    sink.close()
    sink = CdcSink(
        CdcStream("fresh", ("*",), fresh, partition_by=DATE, format="parquet"), wal_id="w", cores=4
    )
    sink.open()
    sink.close()
    ledger = read_ledger(fresh)
    assert ledger is not None and ledger.partition_by == list(DATE)


async def test_recovery_removes_orphans_in_date_folders(
    executor_factory: Any, tmp_path: Path
) -> None:
    ex = await committed_table(executor_factory, tmp_path)
    await ex.stop()
    table = tmp_path / "cdc" / "all"
    before = committed_files(table)
    orphan = table / "collection=orders/date=2023-11-15/part-b000000000099-00000-x.parquet"
    orphan.write_bytes(b"not committed")
    sink = CdcSink(stream_of(tmp_path), wal_id="wal-1", cores=4)
    report = sink.open()
    sink.close()
    assert report.orphans_removed == [str(orphan.relative_to(table))]
    assert committed_files(table) == before


async def test_retention_removes_exactly_the_expired_partitions_and_logs_them(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    ex = await committed_table(executor_factory, tmp_path)
    table = tmp_path / "cdc" / "all"
    lsns = batch_lsns(make_batches(N_BATCHES, PER_BATCH, ns_per_lsn=HOUR_NS))
    parts = expected_partitions(lsns)
    stream = stream_of(tmp_path)
    gone = {p for p in parts if p.rsplit("=", 1)[1] <= "2023-11-17"}
    assert gone and gone != set(parts)

    preview = retention.plan(stream, NOW)
    assert {p.rel for p in preview.expired} == gone
    assert sum(p.rows or 0 for p in preview.expired) == sum(parts[p] for p in gone)
    assert visible_partitions(table) == parts  # a preview changes nothing

    generation = read_generation(table)
    result = retention.apply(stream, NOW)
    assert {r["partition"] for r in result.removed} == gone
    # Each removal went odd and back to even: snapshot readers list again.
    assert read_generation(table) == generation + 2 * len(gone)
    assert visible_partitions(table) == Counter({p: n for p, n in parts.items() if p not in gone})
    kept = [
        n for n in lsns if f"collection={event_for(n).collection}/date={ingest_date(n)}" not in gone
    ]
    assert sorted(r.lsn for r in spark.read.parquet(str(table)).select("lsn").collect()) == kept
    assert not [p for p in table.rglob(".expired-*")]
    rlog = retention.read_log(table, "all")
    assert rlog.partitions_removed == len(gone)
    assert rlog.rows_removed == sum(parts[p] for p in gone)
    assert rlog.last_run_at is not None

    # Idempotent, and the table keeps committing into its newer partitions.
    assert retention.apply(stream, NOW).removed == []
    more = make_batches(
        1, 10, first_batch_id=N_BATCHES + 1, first_lsn=len(lsns) + 1, ns_per_lsn=HOUR_NS
    )
    await ex.execute(more[0])
    assert spark.read.parquet(str(table)).count() == len(kept) + 10


async def test_retention_never_removes_the_newest_partition(
    executor_factory: Any, tmp_path: Path
) -> None:
    """Even when every partition is older than the retention: a stream behind
    writes rows with their original ingest times, so only partitions older than
    the newest committed one go."""
    await committed_table(executor_factory, tmp_path)
    far = float(calendar.timegm((2030, 1, 1, 0, 0, 0)))
    p = retention.plan(stream_of(tmp_path, 86_400), far)
    newest = max(q.start for q in p.kept)
    assert p.kept and all(q.start == newest for q in p.kept)
    assert all(q.end <= newest for q in p.expired)


async def test_a_concurrent_reader_sees_each_partition_whole_or_not_at_all(
    executor_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await committed_table(executor_factory, tmp_path)
    table = tmp_path / "cdc" / "all"
    parts = expected_partitions(batch_lsns(make_batches(N_BATCHES, PER_BATCH, ns_per_lsn=HOUR_NS)))
    real_unlink = Path.unlink

    def slow_unlink(self: Path, missing_ok: bool = False) -> None:
        time.sleep(0.02)  # deletion of a hidden partition, file by file, slowly
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", slow_unlink)
    stop = threading.Event()
    seen: list[Counter[str]] = []
    errors: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                seen.append(visible_partitions(table))
            except (OSError, ValueError) as exc:  # a file listed, then hidden: not a lie
                errors.append(str(exc))

    t = threading.Thread(target=reader)
    t.start()
    try:
        retention.apply(stream_of(tmp_path), NOW)
    finally:
        stop.set()
        t.join()
    assert len(seen) > 3
    for view in seen:
        assert all(view[p] == parts[p] for p in view), view


def run_retention_child(stream: CdcStream, crash_at: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from daemon.config import CdcStream\n"
        "from daemon.table import retention\n"
        f"s = CdcStream('all', ('*',), Path({str(stream.path)!r}), "
        f"partition_by={stream.partition_by!r}, retention_s={stream.retention_s!r}, "
        "format='parquet')\n"
        f"retention.apply(s, {NOW!r})\n"
        "print('done', flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), ENV_CRASH_AT: f"{crash_at}@2"}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.crash
@pytest.mark.parametrize("point", RETENTION_POINTS)
async def test_sigkill_during_retention_leaves_each_partition_whole_or_gone(
    executor_factory: Any, tmp_path: Path, point: str
) -> None:
    """1. A process applying retention SIGKILLs itself at ``point`` while removing
    the second expired partition.  2. A reader sees every partition whole or not at
    all.  3. Opening the stream (recovery) deletes the hidden leftovers and logs
    the removal once.  4. A second run removes exactly the rest."""
    ex = await committed_table(executor_factory, tmp_path)
    await ex.stop()
    table = tmp_path / "cdc" / "all"
    stream = stream_of(tmp_path)
    parts = expected_partitions(batch_lsns(make_batches(N_BATCHES, PER_BATCH, ns_per_lsn=HOUR_NS)))
    expired = [p.rel for p in retention.plan(stream, NOW).expired]

    proc = run_retention_child(stream, point)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert f"crash point {point} reached (hit 2)" in proc.stderr
    view = visible_partitions(table)
    assert all(view[p] == parts[p] for p in view)
    second_gone = point != "cdc.retention.before_rename"
    assert expired[0] not in view
    assert (expired[1] not in view) == second_gone
    assert all(p in view for p in expired[2:])

    sink = CdcSink(stream, wal_id="wal-1", cores=4)
    sink.open()  # recovery
    try:
        assert not list(table.rglob(".expired-*"))
        rlog = retention.read_log(table, "all")
        logged = [r["partition"] for r in rlog.removed]
        assert logged == expired[: 2 if second_gone else 1]
        assert [r.get("recovered", False) for r in rlog.removed][-1] == (
            point == "cdc.retention.after_rename"
        )
        retention.apply(stream, NOW)
    finally:
        sink.close()
    assert visible_partitions(table) == Counter(
        {p: n for p, n in parts.items() if p not in expired}
    )
    rlog = retention.read_log(table, "all")
    assert sorted(r["partition"] for r in rlog.removed) == sorted(expired)
    assert rlog.rows_removed == sum(parts[p] for p in expired)
    assert sorted(p.name for p in (table / META_DIR).iterdir() if p.is_file()) == [
        "generation",
        "ledger.json",
        "lock",
        "retention.json",
    ]


async def test_cli_previews_then_applies_retention_and_refuses_a_held_stream(
    executor_factory: Any, tmp_path: Path
) -> None:
    ex = await committed_table(executor_factory, tmp_path, retention_s=TWO_DAYS)
    table = tmp_path / "cdc" / "all"
    before = committed_files(table)
    args = argparse.Namespace(cdc_command="retention", stream="all", apply=False)
    out = io.StringIO()
    assert cdc_cli.main(args, ex.cfg, out=out) == 0
    text = out.getvalue()
    # Real clock: every date of 2023 but the newest is expired.
    p = retention.plan(ex.cfg.cdc.streams[0])
    assert f"would remove {len(p.expired)} partitions" in text
    assert all(f"  {q.rel}  files {q.files}" in text for q in p.expired)
    assert committed_files(table) == before

    args.apply = True
    assert cdc_cli.main(args, ex.cfg, out=io.StringIO()) == 1  # the executor holds it
    assert committed_files(table) == before
    await ex.stop()
    out = io.StringIO()
    assert cdc_cli.main(args, ex.cfg, out=out) == 0
    assert f"removed {len(p.expired)} partitions" in out.getvalue()
    assert {str(f.parent.relative_to(table)) for _, f in committed_files(table)} == {
        q.rel for q in p.kept
    }


async def test_daemon_runs_retention_off_the_batch_thread_and_reports_it(
    executor_factory: Any, tmp_path: Path, metrics: Any
) -> None:
    """The executor with a retention stream runs it at start (nothing to remove
    yet) and on demand; status and the metric show what went."""
    ex = await committed_table(executor_factory, tmp_path, retention_s=TWO_DAYS)
    expired = retention.plan(ex.cfg.cdc.streams[0]).expired
    answer = await ex.run_retention("all")
    assert answer["partitions"] == len(expired) > 0
    status = ex.status()["streams"]["all"]["retention"]
    assert status["partitions_removed"] >= len(expired) and status["last_error"] is None
    assert status["oldest_kept"] == retention.plan(ex.cfg.cdc.streams[0]).oldest_kept
    removed = metrics.registry.get_sample_value(
        "eventplane_cdc_retention_removed_partitions_total", {"stream": "all"}
    )
    assert removed is not None and removed >= len(expired)
