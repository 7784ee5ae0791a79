"""Delta Lake streams (``format = "delta"``): exactly once through Delta's own
``txnAppId``/``txnVersion``, a layout every reader opens, recovery from a crash
between the Delta commit and the ledger, quarantine, maintenance."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pytest

from daemon.errors import ExecutorError, IdentityMismatchError
from daemon.table import quarantine
from daemon.table.crash import DELTA_CRASH_POINTS, REPLAY_CRASH_POINTS
from daemon.table.delta import DELTA_COLUMNS, app_id, log_commits
from daemon.table.errors import CdcLayoutError
from daemon.table.layout import META_DIR
from daemon.table.ledger import read_ledger
from tests import requires
from tests.spark import quarantine_worker
from tests.spark.support import batch_lsns, compact_now, make_batches, say
from tests.spark.test_crash import run_quarantine_worker, run_worker

pytestmark = pytest.mark.spark

DELTA = {"format": "delta"}
# Seconds of the reader stress test; --soak (make soak) runs it for ten minutes.
STRESS_S = 10.0
# The crash points CI kills a Delta stream at (a subprocess each, about a
# minute); `make soak` runs every one of DELTA_CRASH_POINTS and
# REPLAY_CRASH_POINTS.
CI_CRASH_POINTS = (
    "cdc.after_quarantine",
    "delta.before_commit",
    "delta.after_commit",
    "cdc.replay_after_publish",
)
SOAK_STRESS_S = 600.0


@pytest.fixture(autouse=True)
def _needs_delta(spark: Any) -> None:
    requires.delta_jars()


# How each reader says a file of its snapshot is gone (VACUUM removed it).
FILE_GONE = re.compile(r"not found|no such file|FileNotFound|NOT_EXIST|does not exist", re.I)


def removed_files(table: Path) -> int:
    """Data files a commit of the table's log added that are no longer on disk."""
    added = set()
    for entry in (table / "_delta_log").glob("*.json"):
        for line in entry.read_text().splitlines():
            if line.strip() and "add" in (action := json.loads(line)):
                added.add(action["add"]["path"])
    return sum(1 for path in added if not (table / unquote(path)).exists())


def delta_lsns(spark: Any, table: Path) -> list[int]:
    return sorted(r.lsn for r in spark.read.format("delta").load(str(table)).collect())


def txn_versions(table: Path, app: str) -> list[int]:
    """The ``txnVersion`` of every commit of ``app`` in the table's log, in order."""
    return [
        int(t["version"])
        for _, actions in log_commits(table, -1)
        for t in actions.get("txn", [])
        if t["appId"] == app
    ]


async def test_each_batch_is_one_delta_commit_and_a_rerun_writes_nothing(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """1. Three batches of 300 events into a Delta stream: one Delta commit
       each, carrying the stream's app id and the batch id as ``txnVersion``.
    2. Batch 2 again (a re-run): no commit, no row twice.
    3. The layout has the JSON text and no VARIANT column; the table's
       properties name the WAL and ``cores``."""
    ex = await executor_factory(stream_options=DELTA)
    batches = make_batches(3, 300)
    table = tmp_path / "cdc" / "all"
    for b in batches:
        assert not await ex.execute(b)
    assert not await ex.execute(batches[1])

    assert delta_lsns(spark, table) == batch_lsns(batches)
    assert txn_versions(table, app_id("wal-1", "all")) == [1, 2, 3]
    df = spark.read.format("delta").load(str(table))
    assert tuple(df.columns) == DELTA_COLUMNS
    amount = df.selectExpr("parse_json(new_json):amount::int AS a", "lsn").collect()
    assert {r.lsn: r.a for r in amount}[7] == 70
    props = {r.key: r.value for r in spark.sql(f"SHOW TBLPROPERTIES delta.`{table}`").collect()}
    assert props["eventplane.wal_id"] == "wal-1" and props["eventplane.cores"] == "4"
    ledger = read_ledger(table)
    assert ledger is not None and ledger.table_format == "delta"
    assert ledger.last_batch_id == 3 and ledger.rows_total == 900


async def test_a_failed_delta_commit_leaves_no_file_and_one_after_the_commit_is_kept(
    spark: Any, executor_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1. The delta-rs commit of batch 1 fails before it commits: the batch
       fails, its files are gone from the table's folders; run again, it
       commits once.
    2. The commit of batch 2 raises after it committed: the batch succeeds
       (the log has it), nothing is written twice."""
    from daemon.table import deltacommit

    real = deltacommit.commit
    calls: list[str] = []

    def before(*args: Any, **kwargs: Any) -> None:
        calls.append("before")
        raise OSError("injected: the store refused the commit")

    def after(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        calls.append("after")
        raise TimeoutError("injected: the answer to a commit that landed was lost")

    ex = await executor_factory(stream_options=DELTA)
    table = tmp_path / "cdc" / "all"
    first, second, third = make_batches(3, 120)
    assert not await ex.execute(first)  # creates the table

    monkeypatch.setattr(deltacommit, "commit", before)
    with pytest.raises(ExecutorError, match="injected: the store refused"):
        await ex.execute(second)
    assert not list(table.rglob("part-b000000000002-*"))
    monkeypatch.setattr(deltacommit, "commit", real)
    assert not await ex.execute(second)

    monkeypatch.setattr(deltacommit, "commit", after)
    assert not await ex.execute(third)
    assert calls == ["before", "after"]
    assert delta_lsns(spark, table) == batch_lsns([first, second, third])
    assert txn_versions(table, app_id("wal-1", "all")) == [1, 2, 3]
    assert len(list(table.rglob("part-b000000000003-*"))) >= 1


async def test_a_variant_delta_stream_commits_through_a_spark_append_exactly_once(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """``variant = true`` (Spark-only readers): the batch goes through one
    Spark append per batch (no delta-rs commit: delta-rs cannot open the
    table), with the VARIANT columns; a re-run writes nothing."""
    ex = await executor_factory(stream_options={**DELTA, "variant": True})
    batches = make_batches(2, 100)
    table = tmp_path / "cdc" / "all"
    for b in batches:
        assert not await ex.execute(b)
    assert not await ex.execute(batches[1])
    df = spark.read.format("delta").load(str(table))
    assert {"new", "old", "new_json"} <= set(df.columns)
    assert delta_lsns(spark, table) == batch_lsns(batches)
    assert df.selectExpr("new:amount::int AS a").where("lsn = 7").first().a == 70
    assert txn_versions(table, app_id("wal-1", "all")) == [1, 2]
    engines = {a["commitInfo"].get("engineInfo", "") for _, a in log_commits(table, 0)}
    assert all(e.startswith("Apache-Spark") for e in engines), engines


async def test_every_reader_reads_the_same_rows_without_a_jvm(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """delta-rs (pyarrow, pandas), Polars and DuckDB read what Spark reads,
    and query a payload field with their own JSON functions."""
    import deltalake
    import duckdb
    import polars as pl

    ex = await executor_factory(stream_options=DELTA, partition_by=("collection", "date"))
    batches = make_batches(2, 200)
    for b in batches:
        assert not await ex.execute(b)
    table = tmp_path / "cdc" / "all"
    want = batch_lsns(batches)

    dt = deltalake.DeltaTable(str(table))
    assert sorted(dt.to_pyarrow_table(columns=["lsn"])["lsn"].to_pylist()) == want
    assert sorted(dt.to_pandas(columns=["lsn"])["lsn"]) == want
    assert sorted(pl.read_delta(str(table)).get_column("lsn").to_list()) == want
    dataset = dt.to_pyarrow_dataset()  # noqa: F841 (DuckDB finds it by name)
    got = duckdb.sql(
        "SELECT lsn, CAST(json_extract(new_json, '$.amount') AS INT) AS a FROM dataset"
    ).fetchall()
    assert sorted(lsn for lsn, _ in got) == want
    assert dict(got)[7] == 70
    # Filters on the columns with statistics skip files, never rows.
    df = spark.read.format("delta").load(str(table))
    assert sorted(r.lsn for r in df.where("lsn >= 150").collect()) == [n for n in want if n >= 150]
    last = df.agg({"ingest_ts": "max"}).first()[0]
    assert df.where(df.ingest_ts >= last).count() >= 1
    assert df.where("op = 'insert' OR op <> 'insert'").count() == len(want)
    filtered = dt.to_pyarrow_table(columns=["lsn"], filters=[("lsn", "<", 40)])
    assert sorted(filtered["lsn"].to_pylist()) == [n for n in want if n < 40]


async def test_a_table_of_another_wal_or_format_refuses_to_open(
    executor_factory: Any, tmp_path: Path
) -> None:
    ex = await executor_factory(stream_options=DELTA)
    assert not await ex.execute(make_batches(1, 50)[0])
    await ex.stop()
    with pytest.raises(IdentityMismatchError, match="another event plane"):
        await executor_factory(wal_id="wal-2", stream_options=DELTA)
    with pytest.raises(CdcLayoutError, match=r'format = "parquet" but .* holds a delta table'):
        await executor_factory()


async def test_rows_that_fail_alone_go_to_the_quarantine_before_the_delta_commit(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    ex = await executor_factory(stream_options=DELTA)
    batches = make_batches(2, 150, bad_every=50)
    for b in batches:
        assert not await ex.execute(b)
    table = tmp_path / "cdc" / "all"
    everything = batch_lsns(batches)
    assert delta_lsns(spark, table) == [n for n in everything if n % 50]
    assert [r.lsn for r in quarantine.load(table / META_DIR)] == [50, 100, 150, 200, 250, 300]
    assert ex.status()["streams"]["all"]["quarantined"] == 6


async def test_replay_writes_quarantined_rows_into_the_delta_table_once_after_the_fix(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """1. The writer refuses duplicate keys: rows 3, 6 and 9 are set aside.
    2. The cause fixed, replay: they are in the table once, in a commit of
       their own; the quarantine is empty. 3. Replay again writes nothing."""
    key = "spark.sql.variant.allowDuplicateKeys"
    before = spark.conf.get(key)
    ex = await executor_factory(stream_options=DELTA)
    table = tmp_path / "cdc" / "all"
    spark.conf.set(key, "false")
    try:
        assert not await ex.execute(quarantine_worker.batch())
    finally:
        spark.conf.set(key, before)
    assert [r.lsn for r in quarantine.load(table / META_DIR)] == [3, 6, 9]

    spark.conf.set(key, "true")
    try:
        done = await ex.quarantine_action("all", "replay", None)
        again = await ex.quarantine_action("all", "replay", None)
    finally:
        spark.conf.set(key, before)

    assert done["lsns"] == [3, 6, 9] and done["quarantined"] == 0
    assert again["replayed"] == 0
    assert delta_lsns(spark, table) == list(range(1, 13))
    row = spark.read.format("delta").load(str(table)).where("lsn = 3").first()
    assert row.new_json == '{"a":1,"a":2}' and row.batch_id == 1


@pytest.mark.crash
@pytest.mark.parametrize(
    "point",
    [
        p if p in CI_CRASH_POINTS else pytest.param(p, marks=pytest.mark.soak)
        for p in REPLAY_CRASH_POINTS
    ],
)
async def test_sigkill_during_a_delta_replay_leaves_each_row_in_one_place(
    spark: Any, executor_factory: Any, tmp_path: Path, point: str
) -> None:
    """A real executor process sets rows 3, 6 and 9 aside in a Delta stream
    and SIGKILLs itself at ``point`` while replaying them. At open, a replay
    whose append committed rolls forward (the rows leave the quarantine), one
    that did not rolls back (they stay); either way each row is in one place."""
    proc = run_quarantine_worker(tmp_path, point, "delta")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert "committed 1" in proc.stdout and "replayed" not in proc.stdout
    table = tmp_path / "cdc" / "all"
    meta = table / META_DIR

    await executor_factory(stream_options=DELTA)  # restart: recovery runs in start()

    held = [r.lsn for r in quarantine.load(meta)]
    committed = point == "cdc.replay_after_publish"
    assert held == ([] if committed else [3, 6, 9])
    assert sorted(delta_lsns(spark, table) + held) == list(range(1, 13))
    assert not list((meta / "quarantine").glob("r*.json"))


@pytest.mark.crash
@pytest.mark.parametrize(
    "point",
    [
        p if p in CI_CRASH_POINTS else pytest.param(p, marks=pytest.mark.soak)
        for p in DELTA_CRASH_POINTS
    ],
)
async def test_sigkill_at_a_delta_commit_step_recovers_to_exactly_once(
    spark: Any, executor_factory: Any, tmp_path: Path, point: str
) -> None:
    """1. A real executor process commits batches 1-2 into a Delta stream and
       SIGKILLs itself at ``point`` in batch 3 (three bad rows per batch).
    2. A new executor opens the stream: a commit Delta holds and the ledger
       missed (``delta.after_commit``) is taken from the log.
    3. Batches 3 and 4 run (3 is a no-op if it was committed): every event is
       in the table or the quarantine, once."""
    batches = make_batches(4, 150, bad_every=50)
    table = tmp_path / "cdc" / "all"
    proc = run_worker(
        tmp_path, batches=4, crash_at=f"{point}@3", bad_every=50, table_format="delta"
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert "committed 2" in proc.stdout and "committed 3" not in proc.stdout

    ex = await executor_factory(stream_options=DELTA)
    ledger = read_ledger(table)
    assert ledger is not None
    committed = point in ("delta.after_commit", "cdc.after_ledger", "executor.after_commit")
    assert ledger.last_batch_id == (3 if committed else 2)
    # The direct write's files of batch 3 stay only if Delta committed them
    # (delta.before_commit: in the table's folders, not in its log, removed).
    assert bool(list(table.rglob("part-b000000000003-*"))) == committed
    done = batch_lsns(batches[: ledger.last_batch_id])
    assert delta_lsns(spark, table) == [n for n in done if n % 50]

    await ex.execute(batches[2])
    await ex.execute(batches[3])
    everything = batch_lsns(batches)
    assert delta_lsns(spark, table) == [n for n in everything if n % 50]
    held = [r.lsn for r in quarantine.load(table / META_DIR)]
    assert held == [n for n in everything if n % 50 == 0]
    assert txn_versions(table, app_id("wal-1", "all")) == [1, 2, 3, 4]


async def test_compaction_is_optimize_and_readers_keep_every_row(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """Twelve batches, then a compaction request: Delta's OPTIMIZE merges the
    small files into one per partition, in a commit of its own; the rows are
    the same, once, for Spark and delta-rs."""
    import deltalake

    ex = await executor_factory(stream_options={**DELTA, "compact_min_files": 4})
    batches = make_batches(12, 40)
    for b in batches:
        assert not await ex.execute(b)
    table = tmp_path / "cdc" / "all"
    before = len(deltalake.DeltaTable(str(table)).file_uris())
    status = await compact_now(ex, "all")
    assert status is not None and status["last_error"] is None, status
    dt = deltalake.DeltaTable(str(table))
    assert len(dt.file_uris()) == 2 < before  # one per collection
    assert sorted(dt.to_pyarrow_table(columns=["lsn"])["lsn"].to_pylist()) == batch_lsns(batches)
    operations = [a.get("commitInfo", {}).get("operation") for _, a in log_commits(table, -1)]
    assert "OPTIMIZE" in operations


def test_delta_user_metadata_names_the_batch_and_its_ranges(tmp_path: Path) -> None:
    """The log parser reads what a Delta commit file holds (a unit test of
    ``log_commits`` on a hand-written log)."""
    log_dir = tmp_path / "_delta_log"
    log_dir.mkdir()
    meta = {"eventplane": {"batch_id": 5, "ranges": {"0": [1, 9]}, "rows": 9}}
    lines = [
        {"commitInfo": {"operation": "WRITE", "userMetadata": json.dumps(meta)}},
        {"txn": {"appId": "eventplane/w/s", "version": 5}},
        {"add": {"path": "a.parquet"}},
    ]
    (log_dir / f"{7:020d}.json").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (log_dir / f"{3:020d}.json").write_text(json.dumps({"commitInfo": {}}) + "\n")
    got = list(log_commits(tmp_path, 3))
    assert [v for v, _ in got] == [7]
    assert got[0][1]["txn"] == [{"appId": "eventplane/w/s", "version": 5}]
    assert json.loads(got[0][1]["commitInfo"]["userMetadata"]) == meta


@pytest.mark.timeout(1200)
async def test_plain_readers_never_see_wrong_rows_while_commits_optimize_and_vacuum_run(
    spark: Any, executor_factory: Any, tmp_path: Path, request: Any, monkeypatch: Any
) -> None:
    """1. Batches of 40 events commit back to back, 100 ms apart, for ``STRESS_S`` seconds,
       while OPTIMIZE (checked every 1 s, after 3 commits) and VACUUM run in
       the daemon's compaction thread. VACUUM's window is 0 h here (the
       configured one is whole hours, longer than the test), so it removes
       the files OPTIMIZE merged away while readers read.
    2. Readers in threads read the table in a loop, each read a new snapshot:
       delta-rs (pyarrow), Polars, DuckDB over a delta-rs dataset, Spark.
    3. Every read that completes sees exactly the rows of batches 1..k for
       some k: no row missing, none twice. A read whose snapshot's files
       VACUUM removed may fail, with a file-not-found error and nothing else
       (invariant 16: its snapshot is older than the window); such failures
       are counted (Spark's slow reads mostly end so). VACUUM removed files
       meanwhile."""
    from daemon.table.delta import DeltaSink

    monkeypatch.setattr(DeltaSink, "vacuum_window_hours", lambda self: 0)
    import deltalake
    import duckdb
    import polars as pl

    options = {
        **DELTA,
        "compact_min_files": 3,
        "compact_interval_s": 1.0,
        "vacuum_retain_hours": 1,
    }
    ex = await executor_factory(stream_options=options)
    table = str(tmp_path / "cdc" / "all")
    seconds = SOAK_STRESS_S if request.config.getoption("--soak") else STRESS_S
    batches = make_batches(int(seconds * 20), 40)
    # What a reader may see: the LSNs of batches 1..k, for each k.
    prefixes = {tuple(batch_lsns(batches[:k])) for k in range(len(batches) + 1)}
    assert not await ex.execute(batches[0])

    def arrow() -> list[int]:
        return deltalake.DeltaTable(table).to_pyarrow_table(columns=["lsn"])["lsn"].to_pylist()

    def polars() -> list[int]:
        return pl.read_delta(table, columns=["lsn"]).get_column("lsn").to_list()

    def duck() -> list[int]:
        dataset = deltalake.DeltaTable(table).to_pyarrow_dataset()  # noqa: F841
        return [r[0] for r in duckdb.sql("SELECT lsn FROM dataset").fetchall()]

    def spark_read() -> list[int]:
        return [r.lsn for r in spark.read.format("delta").load(table).select("lsn").collect()]

    readers = {"delta-rs": arrow, "polars": polars, "duckdb": duck, "spark": spark_read}
    # A pause between reads, so that four readers leave the writer a core.
    pause = {"delta-rs": 0.05, "polars": 0.05, "duckdb": 0.05, "spark": 1.0}
    counts = {name: {"reads": 0, "bad": 0, "failed": 0, "max_s": 0.0} for name in readers}
    errors: list[str] = []
    gone: list[str] = []  # reads that failed on a file VACUUM removed
    stop = threading.Event()

    def loop(name: str) -> None:
        read = readers[name]
        while not stop.is_set():
            started = time.monotonic()
            try:
                got = tuple(sorted(read()))
            except Exception as exc:
                counts[name]["failed"] += 1
                took = time.monotonic() - started
                why = f"{name} after {took:.1f} s: {type(exc).__name__}: {exc}"
                (gone if FILE_GONE.search(why) else errors).append(why[:300])
                continue
            took = time.monotonic() - started
            counts[name]["max_s"] = max(counts[name]["max_s"], round(took, 2))
            counts[name]["reads"] += 1
            if got not in prefixes:
                counts[name]["bad"] += 1
                errors.append(f"{name}: {len(got)} rows, {len(got) - len(set(got))} twice")
            stop.wait(pause[name])

    threads = [threading.Thread(target=loop, args=(n,), daemon=True) for n in readers]
    for t in threads:
        t.start()
    deadline = time.monotonic() + seconds
    committed = 1

    def optimized() -> int:
        status = ex.compaction.status("all") if ex.compaction else None
        return 0 if status is None else int(status["compactions"])

    def settled() -> bool:
        """An OPTIMIZE ran, its VACUUM removed files, and every reader ended a read."""
        ended = all(c["reads"] + c["failed"] > 0 for c in counts.values())
        return ended and optimized() > 0 and removed_files(tmp_path / "cdc" / "all") > 0

    try:
        # Past the deadline until settled (on a loaded 2-core machine Spark's
        # first read alone can take a minute), at most two minutes.
        while committed < len(batches) and (
            time.monotonic() < deadline or (not settled() and time.monotonic() < deadline + 120)
        ):
            assert not await ex.execute(batches[committed])
            committed += 1
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    vacuumed = removed_files(tmp_path / "cdc" / "all")
    say(f"delta reader stress: {committed} batches, {vacuumed} files vacuumed, {counts}")
    assert not errors, errors[:5]
    # Spark's reads (a second or more on a busy machine) outlast a 0 h window
    # most times; the others complete many reads between two VACUUMs.
    assert all(c["reads"] > 0 for n, c in counts.items() if n != "spark"), counts
    assert counts["spark"]["reads"] + counts["spark"]["failed"] > 0, counts
    assert sum(c["failed"] for c in counts.values()) == len(gone), counts
    assert optimized() >= 1  # OPTIMIZE and VACUUM ran meanwhile
    assert vacuumed > 0, "VACUUM removed no file while the readers read"
    # The compaction thread still runs: a last read may meet a VACUUM too.
    for _ in range(20):
        try:
            final = sorted(arrow())
            break
        except Exception as exc:
            if not FILE_GONE.search(str(exc)):
                raise
            await asyncio.sleep(0.5)
    assert final == batch_lsns(batches[:committed])
    # VACUUM leaves the daemon's own folder alone (it skips "_" folders).
    assert {p.name for p in (tmp_path / "cdc" / "all" / META_DIR).iterdir()} >= {
        "ledger.json",
        "lock",
    }


async def test_the_cdc_verbs_show_a_delta_table_or_say_why_not(
    spark: Any, executor_factory: Any, tmp_path: Path, capsys: Any
) -> None:
    """``eventplane cdc show`` reads the Delta table; ``files`` and ``rewrite``,
    which only mean something for Parquet folders, answer with the reason."""
    import io

    from daemon.cli import cdc as cdccmd
    from daemon.cli.main import build_parser
    from tests.spark.support import make_config

    ex = await executor_factory(stream_options=DELTA)
    assert not await ex.execute(make_batches(1, 30)[0])
    cfg = make_config(tmp_path, stream_options=DELTA)
    parse = build_parser().parse_args
    out = io.StringIO()
    assert (
        cdccmd.main(parse(["cdc", "show", "all", "--limit", "3"]), cfg, session=spark, out=out) == 0
    )
    lines = out.getvalue().splitlines()
    assert "last committed batch 1, latest 3 rows" in lines[0]
    assert [ln.split()[0] for ln in lines[3:]] == ["30", "29", "28"]
    assert '{"amount": 300' in lines[3]  # the payload's JSON text
    for verb in ("files", "rewrite"):
        assert cdccmd.main(parse(["cdc", verb, "all"]), cfg, out=io.StringIO()) == 1
        assert "is a Delta table" in capsys.readouterr().err


async def test_retention_deletes_expired_days_and_delta_readers_see_them_gone(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """Events ingested in 2023 (``support.BASE_TS_NS``), retention 1 day: one
    run DELETEs every row (a Delta commit) and reports the partitions, files
    and bytes its remove actions name, VACUUM keeps the files for
    ``vacuum_retain_hours``, and time travel still reads the version before."""
    from deltalake import DeltaTable

    ex = await executor_factory(
        stream_options=DELTA, partition_by=("collection", "date"), retention_s=86_400
    )
    batches = make_batches(2, 100)
    for b in batches:
        assert not await ex.execute(b)
    table = tmp_path / "cdc" / "all"
    before = int(spark.sql(f"DESCRIBE HISTORY delta.`{table}`").first()["version"])
    # What the DELETE must report removing: every file of the version before.
    added = pa.table(
        DeltaTable(str(table), version=before).get_add_actions(flatten=True)
    ).to_pylist()
    partitions = {(a["partition.collection"], a["partition.date"]) for a in added}
    assert len(partitions) > 1 and len(added) > len(partitions)

    result = await ex.run_retention("all")

    assert result["rows"] == 200, result
    assert result["partitions"] == len(partitions), result
    assert result["files"] == len(added), result
    assert result["bytes"] == sum(a["size_bytes"] for a in added) > 0, result
    assert delta_lsns(spark, table) == []
    old = spark.read.format("delta").option("versionAsOf", before).load(str(table))
    assert sorted(r.lsn for r in old.collect()) == batch_lsns(batches)
    assert ex.status()["streams"]["all"]["retention"]["partitions_removed"] == len(partitions)


async def test_a_delta_table_made_before_the_producer_column_gets_it_and_reads_whole(
    spark: Any, executor_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table whose files and schema predate ``producer`` (the earlier column
    list put in place for batch 1): when the stream opens again, the column is
    added to the table (a metadata-only commit); batch 1's rows read null,
    batch 2's the producer each event was sent by, for Spark and delta-rs."""
    from deltalake import DeltaTable

    from daemon.table import delta
    from daemon.table.delta import DeltaSink
    from tests.spark.support import producer_of

    earlier = tuple(c for c in DELTA_COLUMNS if c != "producer")
    monkeypatch.setattr(DeltaSink, "_table_columns", lambda self: earlier)
    stats = ",".join(c for c in delta.STATS_COLUMNS if c != "producer")
    properties = {**delta.DELTA_PROPERTIES, "delta.dataSkippingStatsColumns": stats}
    monkeypatch.setattr(delta, "DELTA_PROPERTIES", properties)
    first, second = make_batches(2, 60)
    ex = await executor_factory(stream_options=DELTA)
    assert not await ex.execute(first)
    await ex.stop()
    table = tmp_path / "cdc" / "all"
    assert "producer" not in {f.name for f in DeltaTable(str(table)).schema().fields}
    monkeypatch.undo()

    ex = await executor_factory(stream_options=DELTA)
    assert not await ex.execute(second)

    wanted = {n: None for n in batch_lsns([first])} | {
        n: producer_of(n) for n in batch_lsns([second])
    }
    rows = spark.read.format("delta").load(str(table)).select("lsn", "producer").collect()
    assert {r.lsn: r.producer for r in rows} == wanted
    assert any(wanted.values())
    dt = DeltaTable(str(table)).to_pyarrow_table(columns=["lsn", "producer"])
    assert dict(zip(dt["lsn"].to_pylist(), dt["producer"].to_pylist(), strict=True)) == wanted
