"""The Spark executor: batch DataFrame, consumers, failures, status, metrics, start-up checks."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from daemon.errors import ConfigError, ExecutorError
from daemon.plane.batch import MicroBatch
from daemon.service.metrics import Metrics
from daemon.spark import frame
from daemon.spark.executor import SparkExecutor
from daemon.spark.frame import (
    BATCH_COLUMNS,
    FRAME_COLUMNS,
    INBOX_SCHEMA,
    batch_dataframe,
    batch_table,
    write_batch_file,
)
from daemon.table.layout import CDC_COLUMNS, TABLE_COLUMNS
from tests.spark import handlers
from tests.spark.support import (
    SharedSession,
    batch_lsns,
    make_batches,
    make_config,
    read_table,
)

pytestmark = pytest.mark.spark

CONTRACT_TYPES = {
    "lsn": "bigint",
    "core": "int",
    "seq": "bigint",
    "collection": "string",
    "op": "string",
    "key": "string",
    "new": "variant",
    "old": "variant",
    "ingest_ts": "timestamp",
    "batch_id": "bigint",
    "event_id": "string",
    "event_time": "timestamp",
    "producer": "string",
    "depth": "int",
    "source": "string",
    "new_json": "string",
    "old_json": "string",
}


def test_batch_dataframe_has_contract_columns_with_variant_new_and_old(spark: Any) -> None:
    (batch,) = make_batches(1, 200, first_batch_id=7)
    df = batch_dataframe(spark, batch_table(batch), batch.batch_id)

    assert tuple(df.columns) == FRAME_COLUMNS
    assert dict(df.dtypes) == CONTRACT_TYPES
    rows = (
        df.selectExpr(
            "lsn",
            "new:amount::double AS amount",
            "new:lsn::bigint AS new_lsn",
            "old",
            "op",
            "batch_id",
            "ingest_ts",
            "depth",
            "source",
        )
        .orderBy("lsn")
        .collect()
    )
    assert [r.lsn for r in rows] == batch_lsns([batch])
    assert all(r.new_lsn == r.lsn and r.amount == float(r.lsn * 10 % 2000) for r in rows)
    assert all((r.old is None) == (r.op == "insert") for r in rows)
    assert {r.batch_id for r in rows} == {7}
    assert rows[0].ingest_ts.year == 2023 and rows[0].depth == 0 and rows[0].source == ""


def test_inbox_file_and_arrow_transfer_give_the_same_rows(spark: Any, tmp_path: Path) -> None:
    (batch,) = make_batches(1, 300, first_batch_id=3)
    table = batch_table(batch)
    via_arrow = batch_dataframe(spark, table, 3)
    via_file = batch_dataframe(spark, table, 3, inbox=tmp_path)

    assert via_file.dtypes == via_arrow.dtypes
    as_text = ["*", "to_json(new) AS new_j", "to_json(old) AS old_j"]
    a = via_arrow.selectExpr(*as_text).drop("new", "old").orderBy("lsn").collect()
    b = via_file.selectExpr(*as_text).drop("new", "old").orderBy("lsn").collect()
    assert a[0].new_j.startswith('{"amount":')
    assert a == b and len(a) == 300


def test_inbox_schema_given_to_spark_is_the_schema_of_the_written_file(
    spark: Any, tmp_path: Path
) -> None:
    """The read skips the footer because INBOX_SCHEMA is given; it must not drift
    from what ``write_batch_file`` writes, or Spark would read nulls."""
    (batch,) = make_batches(1, 50, first_batch_id=4)
    file = tmp_path / "b.parquet"
    write_batch_file(batch, file, parallelism=1)

    inferred = spark.read.parquet(str(file)).schema
    given = spark.read.schema(INBOX_SCHEMA).parquet(str(file)).schema
    assert [(f.name, f.dataType) for f in given] == [(f.name, f.dataType) for f in inferred]


async def test_cdc_table_holds_each_event_exactly_once_after_normal_runs(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    ex = await executor_factory()
    batches = make_batches(4, 300)
    for b in batches:
        await ex.execute(b)

    rows = read_table(spark, tmp_path / "cdc" / "all")
    assert sorted(r.lsn for r in rows) == batch_lsns(batches)
    table = spark.read.parquet(str(tmp_path / "cdc" / "all"))
    assert sorted(table.columns) == sorted(TABLE_COLUMNS)
    assert {k: v for k, v in table.dtypes} == {c: CONTRACT_TYPES[c] for c in TABLE_COLUMNS}
    assert table.where("new:amount::double >= 0").count() == len(rows)


async def test_prepared_batch_commits_from_the_file_built_ahead_and_a_failed_one_is_rebuilt(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """1. Batch 1 runs (Spark's parallelism is known from then on).
    2. ``prepare(2)`` builds batch 2's inbox file in the prep thread; ``execute(2)``
       uses it: one build in all, none in the Spark thread.
    3. ``prepare(3)`` fails (injected into the real writer): ``execute(3)`` builds
       the file itself. The table holds every event of the three batches once."""
    ex = await executor_factory()
    batches = make_batches(3, 200)
    await ex.execute(batches[0])
    builds: list[str] = []
    real = frame.write_inbox

    def counting(batch: MicroBatch, *args: Any) -> Any:
        builds.append(threading.current_thread().name)
        if batch.batch_id == 3 and len(builds) == 2:
            raise OSError("injected: disk full while preparing")
        return real(batch, *args)

    with mock.patch.object(frame, "write_inbox", side_effect=counting):
        ex.prepare(batches[1])
        await ex.execute(batches[1])
        assert [name.startswith("eventplane-prep") for name in builds] == [True]
        ex.prepare(batches[2])
        await ex.execute(batches[2])

    assert [name.split("_")[0] for name in builds] == [
        "eventplane-prep",
        "eventplane-prep",
        "eventplane-spark",
    ]
    rows = read_table(spark, tmp_path / "cdc" / "all")
    assert sorted(r.lsn for r in rows) == batch_lsns(batches)
    assert not list((tmp_path / "var" / "spark-inbox").iterdir())


async def test_a_run_of_a_batch_removes_only_its_own_inbox_file_while_another_run_reads_one(
    executor_factory: Any, tmp_path: Path
) -> None:
    """A batch retried (a stage failed) while the first run's commit still
    reads its inbox file: each run's clean-up removes its own file, and a run
    whose write failed part-way removes only the files no run reads (a glob
    of the batch id once removed the retry's file under its Spark job:
    NoSuchFileException)."""
    ex = await executor_factory()
    inbox = tmp_path / "var" / "spark-inbox"
    first, retry, torn = (inbox / f"b{7:012d}-{n}.epin" for n in (901, 902, 903))
    for f in (first, retry, torn):
        f.write_bytes(b"rows")
    ex._inbox_reading |= {first, retry}
    ex._remove_inbox_files(7, retry)  # the retry is over first
    assert (first.exists(), retry.exists(), torn.exists()) == (True, False, True)
    ex._remove_inbox_files(7)  # a run without a file of its own
    assert (first.exists(), torn.exists()) == (True, False)
    ex._remove_inbox_files(7, first)  # the first run's commit is over
    assert not list(inbox.iterdir())


async def test_prepare_seconds_estimates_from_the_preparations_timed_in_the_prep_thread(
    executor_factory: Any,
) -> None:
    """The planner closes the next batch this long before the running one should
    commit: 0 before any preparation; after one that took at least 0.2 s for
    2,000 rows, at least 0.1 ms a row; a failed preparation changes nothing."""
    ex = await executor_factory()
    batches = make_batches(3, 2000)
    await ex.execute(batches[0])
    assert ex.prepare_seconds(2000) == 0.0
    real = frame.write_inbox

    def slow(batch: MicroBatch, *args: Any) -> Any:
        time.sleep(0.2)
        if batch.batch_id == 3 and threading.current_thread().name.startswith("eventplane-prep"):
            raise OSError("injected: disk full while preparing")
        return real(batch, *args)

    with mock.patch.object(frame, "write_inbox", side_effect=slow):
        ex.prepare(batches[1])
        await ex.execute(batches[1])
        estimate = ex.prepare_seconds(2000)
        assert estimate >= 0.2
        assert ex.prepare_seconds(4000) == pytest.approx(2 * estimate)
        ex.prepare(batches[2])
        await ex.execute(batches[2])
    assert ex.prepare_seconds(2000) == estimate


async def test_rerun_of_a_committed_batch_is_a_noop(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    ex = await executor_factory()
    batches = make_batches(2, 200)
    for b in batches:
        await ex.execute(b)
    files_before = sorted((tmp_path / "cdc" / "all").rglob("part-*"))

    await ex.execute(batches[0])
    await ex.execute(batches[1])

    assert sorted((tmp_path / "cdc" / "all").rglob("part-*")) == files_before
    assert sorted(r.lsn for r in read_table(spark, tmp_path / "cdc" / "all")) == batch_lsns(batches)


async def test_same_batch_id_yields_the_same_rows_in_a_fresh_table(
    spark: Any, tmp_path: Path, metrics: Metrics
) -> None:
    """1. Run batches 1-3 into table A.  2. Regenerate batch 2 from its plan and run it
    alone into table B.  3. Batch 2's rows in A equal B's rows, id included."""
    batches = make_batches(3, 250)
    tables = []
    for name, todo in (("a", batches), ("b", make_batches(3, 250)[1:2])):
        cfg = make_config(tmp_path / name)
        ex = SparkExecutor(cfg, metrics, wal_id="w", session=spark)
        await ex.start()
        for b in todo:
            await ex.execute(b)
        await ex.stop()
        tables.append(read_table(spark, tmp_path / name / "cdc" / "all"))
    in_a = sorted((r for r in tables[0] if r.batch_id == 2), key=lambda r: r.lsn)
    assert in_a == sorted(tables[1], key=lambda r: r.lsn)
    assert len(in_a) == 250


async def test_per_key_lsns_increase_with_batch_id(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    ex = await executor_factory()
    for b in make_batches(5, 200, keys=7):
        await ex.execute(b)

    rows = read_table(spark, tmp_path / "cdc" / "all")
    by_key: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for r in rows:
        by_key.setdefault((r.collection, r.key), []).append((r.batch_id, r.lsn))
    assert len(by_key) == 14
    for seen in by_key.values():
        seen.sort()
        assert [lsn for _, lsn in seen] == sorted(lsn for _, lsn in seen)
        assert len({b for b, _ in seen}) == 5  # every key changed in every batch


async def test_stream_with_named_collections_takes_only_those(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    ex = await executor_factory(streams=[("all", ["*"]), ("orders", ["orders"])])
    batches = make_batches(2, 100)
    for b in batches:
        await ex.execute(b)

    orders = read_table(spark, tmp_path / "cdc" / "orders")
    every = read_table(spark, tmp_path / "cdc" / "all")
    assert {r.collection for r in orders} == {"orders"}
    assert sorted(r.lsn for r in orders) == sorted(r.lsn for r in every if r.collection == "orders")
    assert len(every) == 200


class RecordingStage:
    """A BatchStage double: what triggers would see, and when finish runs."""

    name = "recording"

    def __init__(self) -> None:
        self.ran: list[tuple[int, int, list[str], str]] = []
        self.finished: list[tuple[int, Any]] = []

    def run_in_spark(self, spark: Any, df: Any, batch: MicroBatch) -> Any:
        thread = threading.current_thread().name
        self.ran.append((batch.batch_id, df.count(), list(df.columns), thread))
        return {"matched": df.where("new:amount::double > 1000").count()}

    async def finish(self, batch: MicroBatch, result: Any) -> None:
        await asyncio.sleep(0)
        self.finished.append((batch.batch_id, result))


async def test_stages_get_the_batch_dataframe_and_finish_on_the_loop(executor_factory: Any) -> None:
    stage = RecordingStage()
    ex = await executor_factory(stages=[stage], handlers=["tests.spark.handlers:record"])
    batches = make_batches(2, 100)
    for b in batches:
        await ex.execute(b)

    assert [(b, n) for b, n, _, _ in stage.ran] == [(1, 100), (2, 100)]
    assert stage.ran[0][2] == list(BATCH_COLUMNS)
    assert all(t.startswith("eventplane-spark") for *_, t in stage.ran)
    assert [b for b, _ in stage.finished] == [1, 2]
    assert all(isinstance(r["matched"], int) for _, r in stage.finished)
    assert [(1, 100, list(CDC_COLUMNS)), (2, 100, list(CDC_COLUMNS))] == handlers.CALLS


async def test_add_stage_plugs_a_stage_into_later_batches(executor_factory: Any) -> None:
    ex = await executor_factory()
    stage = RecordingStage()
    ex.add_stage(stage)
    await ex.execute(make_batches(1, 10)[0])
    assert [b for b, _ in stage.finished] == [1]
    assert ex.status()["stages"] == ["recording"]


@pytest.mark.parametrize(
    ("ref", "reason"),
    [
        ("tests.spark.no_such_module:record", "cannot import module"),
        ("tests.spark.handlers:missing", "has no attribute 'missing'"),
        ("tests.spark.handlers:NOT_CALLABLE", "is not callable"),
    ],
)
async def test_bad_handler_name_fails_at_startup(
    spark: Any, tmp_path: Path, ref: str, reason: str
) -> None:
    ex = SparkExecutor(make_config(tmp_path, handlers=[ref]), Metrics(), session=spark)
    with pytest.raises(ConfigError) as info:
        await ex.start()
    assert "cdc.handlers[0].function" in str(info.value) and reason in str(info.value)


async def test_overlapping_stream_paths_fail_at_startup(spark: Any, tmp_path: Path) -> None:
    cfg = make_config(tmp_path)
    inner = type(cfg.cdc.streams[0])("inner", ("*",), cfg.cdc.streams[0].path / "sub")
    cfg = type(cfg)(
        **{
            **{f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
            "cdc": type(cfg.cdc)(streams=(cfg.cdc.streams[0], inner)),
        }
    )
    with pytest.raises(ConfigError, match=r"cdc.streams\[1\].path: .* overlaps"):
        await SparkExecutor(cfg, Metrics(), session=spark).start()


async def test_handler_failure_fails_its_stage_and_shows_in_status(
    executor_factory: Any, metrics: Metrics
) -> None:
    ex = await executor_factory(streams=[], handlers=["tests.spark.handlers:explode"])
    batch = make_batches(1, 50)[0]
    # The handler is the only stage: nothing committed, the batch fails whole.
    with pytest.raises(ExecutorError, match=r"micro-batch 1 .* handler failed on batch 1"):
        await ex.execute(batch)

    st = ex.status()
    assert st["batches_failed"] == 1 and st["last_error_batch_id"] == 1
    assert "handler failed" in st["last_error"]
    # The planner counts the failed attempt; counting it here too would double it.
    assert 'eventplane_microbatch_outcomes_total{outcome="failed"}' not in metrics.render().decode()


async def test_status_reports_the_last_committed_batch_and_batch_metrics_are_the_planners(
    executor_factory: Any, metrics: Metrics
) -> None:
    """The planner sees every batch whatever runs it and owns the
    ``eventplane_microbatch_*`` series; the executor adding to them counted
    each batch twice."""
    ex = await executor_factory()
    for b in make_batches(3, 40):
        await ex.execute(b)

    st = ex.status()
    assert st["ready"] and st["state"] == "ready"
    assert (st["last_batch_id"], st["last_batch_rows"], st["batches_committed"]) == (3, 40, 3)
    assert st["last_batch_duration_s"] > 0 and st["last_error"] is None
    assert st["streams"]["all"]["last_batch_id"] == 3
    text = metrics.render().decode()
    assert 'eventplane_microbatch_outcomes_total{outcome="committed"}' not in text
    assert "eventplane_microbatch_rows_total 0.0" in text
    assert "eventplane_microbatch_duration_seconds_count 0.0" in text


async def test_batches_wait_for_the_session_built_in_the_background(
    spark: Any, tmp_path: Path
) -> None:
    """1. The factory blocks, as a JVM start does.  2. start() returns at once, not ready.
    3. A batch handed over waits.  4. The session arrives; the batch commits."""
    release = threading.Event()

    def factory() -> Any:
        release.wait(30)
        return SharedSession(spark)

    ex = SparkExecutor(make_config(tmp_path), Metrics(), session_factory=factory)
    started = time.monotonic()
    await ex.start()
    assert time.monotonic() - started < 1.0
    assert not ex.ready() and ex.status()["state"] == "starting"
    run = asyncio.create_task(ex.execute(make_batches(1, 20)[0]))
    await asyncio.sleep(0.2)
    assert not run.done()

    release.set()
    await asyncio.wait_for(run, 60)
    assert ex.ready() and ex.status()["last_batch_id"] == 1
    await ex.stop()
    assert ex.status()["state"] == "stopped"


async def test_session_build_failures_retry_with_backoff_and_show_in_status(
    spark: Any, tmp_path: Path
) -> None:
    attempts: list[float] = []
    sleeps: list[float] = []

    def factory() -> Any:
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise RuntimeError("Java gateway process exited before sending its port number")
        return SharedSession(spark)

    async def fake_sleep(s: float) -> None:
        sleeps.append(s)

    ex = SparkExecutor(make_config(tmp_path), Metrics(), session_factory=factory, sleep=fake_sleep)
    await ex.start()
    await asyncio.wait_for(ex.wait_ready(), 30)
    assert len(attempts) == 3 and sleeps == [0.5, 1.0]
    assert ex.status()["session_attempts"] == 3 and ex.status()["session_error"] is None
    await ex.stop()


async def test_event_loop_keeps_running_while_a_batch_runs(executor_factory: Any) -> None:
    """A ticker on the loop ticks about every 10 ms while two batches run, in
    proportion to how long they took (a fixed tick count assumed slow batches:
    two 2,000-row batches came to take under 0.2 s), and never stalls."""
    ex = await executor_factory()
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    started = time.monotonic()
    for b in make_batches(2, 2000):
        await ex.execute(b)
    elapsed = time.monotonic() - started
    stop.set()
    await tick
    # A quarter of the ticks a free loop makes: room for a loaded machine.
    assert len(gaps) >= int(elapsed / 0.01 / 4), f"{len(gaps)} ticks in {elapsed:.3f}s of batches"
    assert max(gaps) < 0.5, f"event loop stalled {max(gaps):.3f}s during a batch"


async def test_stopped_executor_refuses_batches(executor_factory: Any) -> None:
    ex = await executor_factory()
    await ex.stop()
    with pytest.raises(ExecutorError, match="stopped"):
        await ex.execute(make_batches(1, 5)[0])


async def test_failing_handler_holds_back_only_itself_the_stream_commits(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    ex = await executor_factory(
        handlers=["tests.spark.handlers:explode", "tests.spark.handlers:record"]
    )
    (batch,) = make_batches(1, 60)

    failures = await ex.execute(batch)

    assert set(failures) == {"handler:tests.spark.handlers:explode"}
    assert "handler failed on batch 1" in str(failures["handler:tests.spark.handlers:explode"])
    assert [c[0] for c in handlers.CALLS] == [1]  # the other handler ran
    assert sorted(r.lsn for r in read_table(spark, tmp_path / "cdc" / "all")) == batch_lsns([batch])
    assert ex.stage_names() == [
        "cdc:all",
        "handler:tests.spark.handlers:explode",
        "handler:tests.spark.handlers:record",
    ]


async def test_execute_runs_only_the_stages_asked_for(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """A stage behind re-runs a batch alone: the other stream is not written twice."""
    ex = await executor_factory(streams=[("a", ["*"]), ("b", ["*"])])
    (batch,) = make_batches(1, 40)

    assert await ex.execute(batch, ["cdc:b"]) == {}

    assert not list((tmp_path / "cdc" / "a").glob("collection=*"))
    assert sorted(r.lsn for r in read_table(spark, tmp_path / "cdc" / "b")) == batch_lsns([batch])
