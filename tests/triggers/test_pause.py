"""Pausing one trigger at run time: its calls are queued, not made, durably,
across a restart of the engine; resumed, they go out in LSN order with their
keys. Real aiohttp receiver on loopback and the real SQLite store; evaluations
built by hand as run_in_spark returns them (the daemon test is in
tests/service/test_pause.py)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.triggers.support import (
    FakeClock,
    Receiver,
    Reply,
    batch,
    event,
    hand_evaluation,
    sample,
    webhook,
)
from triggers import Spec
from triggers.errors import UnknownTriggerError
from triggers.store import SCHEMA_VERSION, TriggerStore, store_path

PAUSED_ROWS = "eventplane_trigger_paused_rows"


def spec(name: str, url: str, **kwargs: Any) -> Spec:
    return Spec(name=name, collection="orders", action=webhook(url), **kwargs)


async def test_a_paused_trigger_queues_its_calls_and_the_others_keep_calling(
    make_engine: Any, receiver: Receiver, clock: FakeClock, metrics: Any
) -> None:
    """1. ``hook`` is paused, ``other`` is not.  2. Two batches match both:
    ``other`` is called at once, ``hook``'s chunks are queued without a call
    and a retry pass leaves them alone.  3. Resumed, ``hook``'s chunks go out
    oldest first, each under the key it was formed with."""
    engine = await make_engine([spec("hook", receiver.url), spec("other", receiver.url)])
    with capture_logs() as logs:
        assert await engine.pause_trigger("hook", reason="receiver upgrade", by="ops") is True
    assert next(e for e in logs if e["event"] == "trigger.paused")["reason"] == "receiver upgrade"
    assert await engine.pause_trigger("hook") is False  # the first pause stays

    first, second = [event(10), event(11)], [event(20)]
    await engine.finish(batch(1), hand_evaluation(engine, {"hook": first, "other": first}))
    await engine.finish(batch(2), hand_evaluation(engine, {"hook": second, "other": second}))
    clock.advance(3600)
    assert await engine.deliver_due() == 0

    assert {r.headers["Idempotency-Key"] for r in receiver.requests} == {
        "other:10-11",
        "other:20-20",
    }
    entry = engine.status()["triggers"]["paused"]["hook"]
    assert (entry["paused_by"], entry["paused_reason"], entry["queued_rows"]) == (
        "ops",
        "receiver upgrade",
        3,
    )
    assert sample(metrics, PAUSED_ROWS, trigger="hook") == 3
    assert sample(metrics, PAUSED_ROWS, trigger="other") == 0

    assert await engine.resume_trigger("hook") is True
    assert await engine.deliver_due() == 2
    hook_calls = [r for r in receiver.requests if r.headers["Idempotency-Key"].startswith("hook")]
    assert [r.headers["Idempotency-Key"] for r in hook_calls] == ["hook:10-11", "hook:20-20"]
    assert [r.lsns for r in hook_calls] == [[10, 11], [20]]
    assert engine.status()["triggers"]["paused"] == {}
    assert engine.status()["retry_queue"] == {"depth": 0}
    assert sample(metrics, PAUSED_ROWS, trigger="hook") == 0
    assert await engine.resume_trigger("hook") is False


async def test_a_pause_survives_a_restart_and_holds_its_rows(
    make_engine: Any, receiver: Receiver, clock: FakeClock
) -> None:
    """1. Pause, one batch queued.  2. The engine stops and a new one opens the
    same store: the trigger is still paused and its entry still waits, even
    though a restart makes every pending retry due.  3. Resumed, it is sent."""
    specs = [spec("hook", receiver.url)]
    engine = await make_engine(specs)
    await engine.pause_trigger("hook", reason="maintenance")
    await engine.finish(batch(1), hand_evaluation(engine, {"hook": [event(5)]}))
    await engine.stop()

    again = await make_engine(specs)
    assert again.is_paused("hook")
    assert again.status()["triggers"]["paused"]["hook"]["paused_reason"] == "maintenance"
    clock.advance(60)
    assert await again.deliver_due() == 0
    assert receiver.requests == []
    await again.resume_trigger("hook")
    assert await again.deliver_due() == 1
    assert [r.lsns for r in receiver.requests] == [[5]]


async def test_rows_replayed_from_the_dlq_by_another_process_count_as_queued_while_paused(
    make_engine: Any, receiver: Receiver, tmp_path: Path, metrics: Any
) -> None:
    """1. ``hook``'s call is refused for good (HTTP 400): its rows go to the DLQ.
    2. ``hook`` is paused. 3. ``eventplane dlq replay`` (its own store
    connection, as the CLI has) moves them back to the retry queue. 4. The
    next retry pass makes no call and counts them as the paused trigger's."""
    receiver.default = Reply(status=400)
    engine = await make_engine([spec("hook", receiver.url)])
    await engine.finish(batch(1), hand_evaluation(engine, {"hook": [event(7), event(8)]}))
    assert engine.status()["dlq"] == {"entries": 2}
    await engine.pause_trigger("hook")
    calls = len(receiver.requests)

    cli_store = TriggerStore(store_path(tmp_path / "data"))
    try:
        assert cli_store.dlq_replay(trigger="hook") == 2
    finally:
        cli_store.close()
    assert await engine.deliver_due() == 0

    assert len(receiver.requests) == calls
    assert engine.status()["triggers"]["paused"]["hook"]["queued_rows"] == 2
    assert sample(metrics, PAUSED_ROWS, trigger="hook") == 2


async def test_pausing_an_unknown_trigger_names_the_known_ones(
    make_engine: Any, receiver: Receiver
) -> None:
    engine = await make_engine([spec("hook", receiver.url)])
    with pytest.raises(UnknownTriggerError, match=r"no trigger 'nope'; the triggers are: hook"):
        await engine.pause_trigger("nope")
    with pytest.raises(UnknownTriggerError):
        await engine.resume_trigger("nope")


def test_a_store_of_layout_2_opens_with_no_trigger_paused(tmp_path: Path) -> None:
    path = store_path(tmp_path)
    TriggerStore(path).close()
    db = sqlite3.connect(path)
    db.execute("DROP TABLE paused")  # what a version 2 file lacks
    db.execute("PRAGMA user_version = 2")
    db.commit()
    db.close()

    store = TriggerStore(path)
    try:
        assert store.pauses() == {}
        assert store.pause("hook", 1.0, "ops", "") is True
        version = store._db.execute("PRAGMA user_version").fetchone()[0]
        assert version == SCHEMA_VERSION == 3
    finally:
        store.close()
