"""Triggers see the producer's ``event_id`` and ``event_time``: in ``when``, in the rows
handed to actions, and in rows stored before those columns existed."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from daemon.events import StoredEvent
from daemon.service.metrics import Metrics
from daemon.spark.executor import SparkExecutor
from tests.spark.support import make_config
from tests.spark.test_event_fields import T_US, batch_of, records_of
from tests.triggers.support import Receiver, doc, event, webhook
from triggers import Spec, evaluate
from triggers import rows as rowsmod

pytestmark = pytest.mark.spark

INGEST_NS = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z


async def test_when_and_action_rows_see_the_producers_event_id_and_time(
    spark: Any, make_engine: Any, receiver: Receiver, tmp_path: Path, metrics: Metrics
) -> None:
    """Only o1 is late by its own clock and carries an id: o2 has no id, o3's
    time is its ingest time, o4 has no time (null never matches)."""
    s = Spec(name="late", collection="orders", action=webhook(receiver.url),
             when="event_id IS NOT NULL AND event_time < ingest_ts - INTERVAL 1 DAY")  # fmt: skip
    engine = await make_engine([s], spark)
    new = b'{"amount":1}'
    events = [
        StoredEvent("orders", "insert", "o1", new, None, INGEST_NS, 0, "", "evt-1", T_US),
        StoredEvent("orders", "insert", "o2", new, None, INGEST_NS, 0, "", None, T_US),
        StoredEvent("orders", "insert", "o3", new, None, INGEST_NS, 0, "", "evt-3",
                    INGEST_NS // 1000),
        StoredEvent("orders", "insert", "o4", new, None, INGEST_NS, 0, "", "evt-4", None),
    ]  # fmt: skip
    ex = SparkExecutor(make_config(tmp_path, streams=()), metrics, [engine], session=spark)
    await ex.start()
    try:
        await ex.execute(batch_of(1, records_of(events, first_lsn=1)))
    finally:
        await ex.stop()

    [row] = [row for r in receiver.requests for row in r.body["rows"]]
    assert (row["lsn"], row["key"], row["event_id"], row["event_time"]) == (
        1, "o1", "evt-1", "2025-01-02T03:04:05.123456Z"
    )  # fmt: skip
    assert row["ingest_ts"] == "2026-01-01T00:00:00.000000Z"


def test_sql_action_retry_rebuilds_rows_stored_with_and_without_event_fields(spark: Any) -> None:
    """A row stored in the retry queue or DLQ before the columns existed has no
    such members; it comes back with nulls, a newer one with its values."""
    before = json.loads(doc(event(1)))
    del before["event_id"], before["event_time"]
    stored_before = json.dumps(before, separators=(",", ":")).encode()
    stored_now = doc(
        event(2, event_id="evt-2", event_time=datetime(2025, 1, 2, 3, 4, 5, 123456, UTC))
    )
    docs = [rowsmod.with_key("t", n, d) for n, d in ((1, stored_before), (2, stored_now))]

    frame = evaluate.frame_from_docs(spark, docs)

    got = frame.selectExpr("lsn", "event_id", "unix_micros(event_time)").orderBy("lsn").collect()
    assert [tuple(r) for r in got] == [(1, None, None), (2, "evt-2", T_US)]
