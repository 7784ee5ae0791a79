"""The engine as a stage of the real SparkExecutor: the executor's own batch
DataFrame (Arrow -> parse_json), run_in_spark in its worker thread, finish
on the loop before the batch commits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from daemon.service.metrics import Metrics
from daemon.spark.executor import SparkExecutor
from tests.spark.support import event_for, make_batches, make_config
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
