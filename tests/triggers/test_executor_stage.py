"""The engine as a stage of the real SparkExecutor: the executor's own batch
DataFrame (Arrow -> parse_json), run_in_spark in its worker thread, finish
on the loop before the batch commits."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from daemon.service.metrics import Metrics
from daemon.spark.executor import SparkExecutor
from tests.spark.support import batch_lsns, event_for, make_batches, make_config, read_table
from tests.triggers.support import Receiver, Reply, webhook
from triggers import Spec

pytestmark = pytest.mark.spark


def expected_lsns(first: int, last: int) -> list[int]:
    out = []
    for lsn in range(first, last + 1):
        e = event_for(lsn)
        if e.collection == "orders" and json.loads(e.new or b"{}")["amount"] > 1500:
            out.append(lsn)
    return out


async def test_executor_commits_batches_after_the_engine_delivered_or_queued(
    spark: Any,
    make_engine: Any,
    receiver: Receiver,
    tmp_path: Path,
    metrics: Metrics,
    clock: Any,
) -> None:
    """1. Two batches of 200 events through SparkExecutor with the engine as a stage.
    2. The receiver answers 503 to the first call: that chunk is queued, and so
       are the trigger's later chunks, without a call (its action is failing);
       both batches still commit (every call sits durably in the retry queue).
    3. The retry passes deliver every matched row once, in LSN order per call."""
    receiver.script = [Reply(503)]
    s = Spec(name="big", collection="orders", when="new:amount::double > 1500",
             action=webhook(receiver.url), batch_size=16)  # fmt: skip
    engine = await make_engine([s])  # no validate: the first batch validates with Spark
    cfg = make_config(tmp_path, streams=())
    ex = SparkExecutor(cfg, metrics, [engine], wal_id="wal-1", session=spark)
    await ex.start()
    try:
        batches = make_batches(2, 200)
        for b in batches:
            await ex.execute(b)
        committed = ex.status()["batches_committed"]
    finally:
        await ex.stop()

    assert committed == 2
    want = expected_lsns(1, 400)
    assert want  # the data has matches
    assert receiver.accepted() == []  # one 503, then nothing was attempted in finish
    pending = engine._store.pending()
    queued = [json.loads(d)["lsn"] for e in pending for d in e.chunk().docs]
    assert sorted(queued) == want
    assert [e.attempts for e in pending if e.first_lsn == want[0]] == [1]  # the 503
    assert all(e.attempts == 0 for e in pending if e.first_lsn != want[0])  # deferred
    clock.advance(60)
    while await engine.deliver_due():
        clock.advance(60)
    accepted = [lsn for r in receiver.accepted() for lsn in r.lsns]
    assert sorted(accepted) == want and len(set(accepted)) == len(accepted)
    for r in receiver.accepted():
        assert r.lsns == sorted(r.lsns)
        assert all(row["batch_id"] in (1, 2) for row in r.body["rows"])


# -- the trigger stage does not wait for the CDC commit of its batch ----------

# How long a slowed CDC commit waits for the webhook before it gives up: with
# the old order (CDC first, triggers after) it always waits this long.
GATE_S = 5.0


def wait_for_calls(receiver: Receiver, timeout_s: float) -> list[int]:
    """Worker thread: wait until the receiver has a request; the LSNs it holds."""
    deadline = time.monotonic() + timeout_s
    while not receiver.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    return [lsn for r in list(receiver.requests) for lsn in r.lsns]


async def _executor_with_stream(
    spark: Any, make_engine: Any, receiver: Receiver, tmp_path: Path, metrics: Metrics
) -> tuple[SparkExecutor, Any]:
    s = Spec(name="big", collection="orders", when="new:amount::double > 1500",
             action=webhook(receiver.url))  # fmt: skip
    engine = await make_engine([s], spark)
    cfg = make_config(tmp_path)  # one stream "all" of every collection
    ex = SparkExecutor(cfg, metrics, [engine], wal_id="wal-1", session=spark)
    await ex.start()
    return ex, engine


async def test_webhook_gets_its_rows_before_the_batch_cdc_commit_finishes(
    spark: Any,
    make_engine: Any,
    receiver: Receiver,
    tmp_path: Path,
    metrics: Metrics,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """1. One CDC stream and one webhook trigger; the stream's commit is slowed
       by a hook that, before the real commit, waits (up to GATE_S) for the
       receiver to hold a request, and notes what it holds.
    2. The batch's matched rows reached the receiver before its CDC commit
       started (the trigger's Spark part runs first and its calls go out while
       the thread writes the table); the hook did not wait out its gate.
    3. ``execute`` returned once both were done: no failed stage, the table
       holds every row of the batch, and the stage order says so."""
    ex, _ = await _executor_with_stream(spark, make_engine, receiver, tmp_path, metrics)
    (sink,) = ex.sinks
    real_commit = sink.commit
    seen: dict[int, tuple[list[int], float]] = {}

    def slow_commit(df: Any, batch: Any, rows: int, raw: Any = None) -> Any:
        waited = time.monotonic()
        lsns = wait_for_calls(receiver, GATE_S)
        seen[batch.batch_id] = (lsns, time.monotonic() - waited)
        return real_commit(df, batch, rows, raw)

    monkeypatch.setattr(sink, "commit", slow_commit)
    (batch,) = make_batches(1, 300)
    try:
        failures = await ex.execute(batch)
    finally:
        await ex.stop()

    want = expected_lsns(1, 300)
    assert want
    assert failures == {}
    lsns, waited = seen[1]
    assert lsns == want, "the webhook had not got the batch's rows when its CDC commit began"
    assert waited < GATE_S
    assert sorted(r.lsn for r in read_table(spark, tmp_path / "cdc" / "all")) == batch_lsns([batch])
    assert ex.stage_names() == ["triggers", "cdc:all"]


async def test_a_failing_cdc_commit_does_not_stop_the_trigger_delivery(
    spark: Any,
    make_engine: Any,
    receiver: Receiver,
    tmp_path: Path,
    metrics: Metrics,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """1. The stream's commit fails (an injected error, after the trigger's
    calls went out). 2. ``execute`` reports only ``cdc:all`` as failed; the
    receiver got every matched row once and the table has none."""
    ex, _ = await _executor_with_stream(spark, make_engine, receiver, tmp_path, metrics)
    (sink,) = ex.sinks

    def failing_commit(df: Any, batch: Any, rows: int, raw: Any = None) -> Any:
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(sink, "commit", failing_commit)
    (batch,) = make_batches(1, 300)
    try:
        failures = await ex.execute(batch)
    finally:
        await ex.stop()

    assert set(failures) == {"cdc:all"}
    assert "No space left" in str(failures["cdc:all"])
    delivered = [lsn for r in receiver.accepted() for lsn in r.lsns]
    assert delivered == expected_lsns(1, 300)
    assert not list((tmp_path / "cdc" / "all").glob("collection=*"))


async def test_a_failing_trigger_finish_does_not_stop_the_cdc_commit(
    spark: Any,
    make_engine: Any,
    receiver: Receiver,
    tmp_path: Path,
    metrics: Metrics,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """1. The engine's ``finish`` fails (an injected error) while the CDC
       commit runs beside it; its Spark part failing is the other case.
    2. ``execute`` waits for both and reports only ``triggers`` as failed;
       the stream committed the whole batch each time."""
    ex, engine = await _executor_with_stream(spark, make_engine, receiver, tmp_path, metrics)

    async def failing_finish(batch: Any, result: Any) -> None:
        await asyncio.sleep(0.2)  # still running when the CDC commit starts
        raise RuntimeError("trigger store unavailable (injected)")

    def failing_run(spark: Any, df: Any, batch: Any) -> Any:
        raise RuntimeError("trigger job failed (injected)")

    batches = make_batches(2, 300)
    try:
        monkeypatch.setattr(engine, "finish", failing_finish)
        first = await ex.execute(batches[0])
        monkeypatch.setattr(engine, "run_in_spark", failing_run)
        second = await ex.execute(batches[1])
    finally:
        await ex.stop()

    assert set(first) == {"triggers"} and "store unavailable" in str(first["triggers"])
    assert set(second) == {"triggers"} and "job failed" in str(second["triggers"])
    assert sorted(r.lsn for r in read_table(spark, tmp_path / "cdc" / "all")) == batch_lsns(batches)


async def test_execute_returns_only_after_the_trigger_calls_that_outlast_the_cdc_commit(
    spark: Any, make_engine: Any, receiver: Receiver, tmp_path: Path, metrics: Metrics
) -> None:
    """The receiver takes 1.5 s to answer, longer than the CDC commit: ``execute``
    still returns only once the call is done (invariant 6), and the call carried
    every matched row."""
    receiver.default = Reply(200, delay_s=1.5)
    ex, _ = await _executor_with_stream(spark, make_engine, receiver, tmp_path, metrics)
    (batch,) = make_batches(1, 300)
    try:
        started = time.monotonic()
        failures = await ex.execute(batch)
        took = time.monotonic() - started
        answered = [lsn for r in receiver.accepted() for lsn in r.lsns]
    finally:
        await ex.stop()

    assert failures == {}
    assert took >= 1.5
    assert answered == expected_lsns(1, 300)
