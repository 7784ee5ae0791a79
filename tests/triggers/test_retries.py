"""Retry queue and DLQ against a real aiohttp receiver on loopback (no Spark:
evaluations are built by hand, exactly as run_in_spark returns them)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
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
    doc,
    event,
    hand_evaluation,
    sample,
    webhook,
)
from triggers import PermanentError, Retry, Spec
from triggers import rows as rowsmod
from triggers.actions import parse_retry_after
from triggers.store import TriggerStore, store_path

FAILURES = "eventplane_trigger_action_failures_total"
SUCCESSES = "eventplane_trigger_action_successes_total"


def spec(url: str, **kwargs: Any) -> Spec:
    kwargs.setdefault("retry", Retry(max_attempts=5, initial_backoff_ms=1000, max_backoff_ms=8000))
    return Spec(name="hook", collection="orders", action=webhook(url), **kwargs)


async def test_500_twice_then_200_is_delivered_with_attempts_counted(
    make_engine: Any, receiver: Receiver, clock: FakeClock, metrics: Any
) -> None:
    """1. First attempt (in finish) gets 500: the chunk is queued, attempts = 1.
    2. The retry after the first backoff gets 500 again: attempts = 2.
    3. The next retry gets 200: the entry is gone; the same body and
       Idempotency-Key went out three times."""
    receiver.script = [Reply(500), Reply(500)]
    engine = await make_engine([spec(receiver.url)])
    events = [event(10, new={"amount": 1}), event(11, new={"amount": 2})]

    await engine.finish(batch(), hand_evaluation(engine, {"hook": events}))
    store: TriggerStore = engine._store
    [entry] = store.pending()
    assert entry.attempts == 1
    # Backoff 1: initial (1 s) with equal jitter -> between 0.5 and 1 s.
    assert clock.now + 0.5 <= entry.next_due <= clock.now + 1.0
    assert await engine.deliver_due() == 0  # not due yet

    clock.advance(1.0)
    assert await engine.deliver_due() == 1
    [entry] = store.pending()
    assert entry.attempts == 2
    assert clock.now + 1.0 <= entry.next_due <= clock.now + 2.0  # initial * 2

    clock.advance(2.0)
    assert await engine.deliver_due() == 1
    assert store.pending() == []
    assert store.dlq_size() == 0

    assert [r.status for r in receiver.requests] == [500, 500, 200]
    assert {r.headers["Idempotency-Key"] for r in receiver.requests} == {"hook:10-11"}
    assert all(r.lsns == [10, 11] for r in receiver.requests)
    assert receiver.requests[-1].body["rows"][0]["idempotency_key"] == "hook:10"
    assert sample(metrics, FAILURES, trigger="hook", kind="retriable") == 2
    assert sample(metrics, SUCCESSES, trigger="hook") == 1
    assert sample(metrics, "eventplane_trigger_fires_total", trigger="hook") == 2
    assert sample(metrics, "eventplane_trigger_retry_queue_depth") == 0


async def test_400_goes_to_the_dlq_at_once_with_the_answer(
    make_engine: Any, receiver: Receiver, metrics: Any
) -> None:
    receiver.default = Reply(400, body="amount missing")
    engine = await make_engine([spec(receiver.url)])
    events = [event(5, key="a", new={"x": 1}), event(6, key="b", new={"x": 2})]

    await engine.finish(batch(), hand_evaluation(engine, {"hook": events}))

    store: TriggerStore = engine._store
    assert store.pending() == []
    entries = store.dlq_list()
    assert [(e.trigger, e.key, e.op, e.lsn, e.attempts) for e in entries] == [
        ("hook", "a", "insert", 5, 1),
        ("hook", "b", "insert", 6, 1),
    ]
    assert entries[0].last_error == f"HTTP 400 from {receiver.url}: amount missing"
    assert json.loads(entries[0].row)["new"] == {"x": 1}
    assert len(receiver.requests) == 1
    assert sample(metrics, FAILURES, trigger="hook", kind="permanent") == 1
    assert sample(metrics, "eventplane_dlq_entries") == 2


async def test_timeouts_are_retried_then_dead_lettered(
    make_engine: Any, receiver: Receiver, clock: FakeClock
) -> None:
    receiver.default = Reply(200, delay_s=2.0)
    s = Spec(
        name="slow", collection="orders", action=webhook(receiver.url, timeout_s=0.1),
        retry=Retry(max_attempts=3, initial_backoff_ms=100, max_backoff_ms=100),
    )  # fmt: skip
    engine = await make_engine([s])

    await engine.finish(batch(), hand_evaluation(engine, {"slow": [event(1)]}))
    for _ in range(2):
        clock.advance(1.0)
        assert await engine.deliver_due() == 1

    store: TriggerStore = engine._store
    assert store.pending() == []
    [dead] = store.dlq_list()
    assert dead.attempts == 3
    assert dead.last_error.startswith("gave up after 3 attempt(s): no answer from")
    assert "within 0.1 s" in dead.last_error
    assert len(receiver.requests) == 3


async def test_429_retry_after_is_honoured_over_a_shorter_backoff(
    make_engine: Any, receiver: Receiver, clock: FakeClock
) -> None:
    receiver.script = [Reply(429, headers={"Retry-After": "30"})]
    engine = await make_engine([spec(receiver.url)])

    await engine.finish(batch(), hand_evaluation(engine, {"hook": [event(1)]}))
    [entry] = engine._store.pending()
    assert entry.next_due == clock.now + 30
    clock.advance(29)
    assert await engine.deliver_due() == 0
    clock.advance(1)
    assert await engine.deliver_due() == 1
    assert [r.status for r in receiver.requests] == [429, 200]


async def test_connection_refused_is_retriable(make_engine: Any, clock: FakeClock) -> None:
    from tests.conftest import free_port

    engine = await make_engine([spec(f"http://127.0.0.1:{free_port()}/hook")])
    await engine.finish(batch(), hand_evaluation(engine, {"hook": [event(1)]}))
    [entry] = engine._store.pending()
    assert entry.last_error.startswith("cannot reach http://127.0.0.1:")


async def test_python_permanent_error_dead_letters_and_other_errors_retry(
    make_engine: Any, clock: FakeClock
) -> None:
    specs = [
        Spec(name="perm", collection="orders", action={"type": "python",
             "function": "tests.triggers.actions_for_tests:reject"}),
        Spec(name="flaky", collection="orders", action={"type": "python",
             "function": "tests.triggers.actions_for_tests:flaky_async"}),
    ]  # fmt: skip
    from tests.triggers import actions_for_tests as a

    a.CALLS.clear()
    a.FLAKY_FAILURES[:] = [1]
    engine = await make_engine(specs)
    await engine.finish(
        batch(), hand_evaluation(engine, {"perm": [event(1)], "flaky": [event(2, new={"v": 1})]})
    )
    store: TriggerStore = engine._store
    assert [(e.trigger, e.lsn, e.last_error) for e in store.dlq_list()] == [
        ("perm", 1, "no such customer")
    ]
    [entry] = store.pending()
    assert entry.trigger == "flaky"
    assert entry.last_error == "RuntimeError: flaky once"

    clock.advance(10)
    await engine.deliver_due()
    assert store.pending() == []
    assert a.CALLS[-1] == ("flaky_async", [2], [{"v": 1}], ["flaky:2"])


async def test_dlq_cap_evicts_the_oldest_and_counts_it(
    make_engine: Any, receiver: Receiver, metrics: Any
) -> None:
    receiver.default = Reply(404)
    engine = await make_engine([spec(receiver.url, batch_size=1)], dlq_max_entries=3)

    with capture_logs() as logs:
        await engine.finish(
            batch(), hand_evaluation(engine, {"hook": [event(i) for i in range(1, 6)]})
        )

    assert [e.lsn for e in engine._store.dlq_list()] == [3, 4, 5]
    assert sample(metrics, "eventplane_dlq_evicted_total") == 2
    assert sample(metrics, "eventplane_dlq_entries") == 3
    assert [x["entries"] for x in logs if x["event"] == "dlq_evicted"] == [2]


async def test_entries_of_a_removed_trigger_go_to_the_dlq(
    make_engine: Any, receiver: Receiver, clock: FakeClock
) -> None:
    receiver.script = [Reply(503)]
    engine = await make_engine([spec(receiver.url)])
    await engine.finish(batch(), hand_evaluation(engine, {"hook": [event(1)]}))
    assert (
        await engine.reload_specs(
            [Spec(name="other", collection="x", action=webhook(receiver.url))]
        )
        == []
    )

    clock.advance(100)
    await engine.deliver_due()
    [dead] = engine._store.dlq_list()
    assert dead.trigger == "hook"
    assert "no longer configured" in dead.last_error
    assert len(receiver.requests) == 1


async def test_entries_of_a_disabled_trigger_wait(
    make_engine: Any, receiver: Receiver, clock: FakeClock
) -> None:
    receiver.script = [Reply(503)]
    engine = await make_engine([spec(receiver.url)])
    await engine.finish(batch(), hand_evaluation(engine, {"hook": [event(1)]}))
    await engine.reload_specs([spec(receiver.url, enabled=False)])
    clock.advance(100)
    assert await engine.deliver_due() == 0
    await engine.reload_specs([spec(receiver.url)])
    assert await engine.deliver_due() == 1
    assert [r.status for r in receiver.requests] == [503, 200]


async def test_background_loop_delivers_due_retries(make_engine: Any, receiver: Receiver) -> None:
    """Real clock, 20 ms backoff: the supervised loop delivers without being poked."""
    import time

    receiver.script = [Reply(500)]
    s = spec(receiver.url, retry=Retry(max_attempts=3, initial_backoff_ms=20, max_backoff_ms=20))
    engine = await make_engine([s], retry_loop=True, clock=time.time, poll_s=0.05)
    await engine.finish(batch(), hand_evaluation(engine, {"hook": [event(1)]}))
    for _ in range(100):
        if receiver.accepted():
            break
        await asyncio.sleep(0.02)
    assert [r.status for r in receiver.requests] == [500, 200]
    for _ in range(100):  # the receiver records before it answers
        if engine.status()["retry_queue"] == {"depth": 0}:
            break
        await asyncio.sleep(0.02)
    assert engine.status()["retry_queue"] == {"depth": 0}


async def test_finish_returns_only_after_failures_are_durable(
    make_engine: Any, receiver: Receiver, tmp_path: Any
) -> None:
    """What finish queued is readable from a fresh connection the moment it returns."""
    receiver.default = Reply(502)
    engine = await make_engine([spec(receiver.url, batch_size=2)])
    events = [event(i) for i in range(1, 6)]
    await engine.finish(batch(), hand_evaluation(engine, {"hook": events}))
    other = TriggerStore(engine.store_path)
    try:
        assert [(e.first_lsn, e.last_lsn) for e in other.pending()] == [(1, 2), (3, 4), (5, 5)]
    finally:
        other.close()


def test_backoff_doubles_from_initial_and_is_capped_with_jitter() -> None:
    from triggers.engine import TriggerEngine

    retry = Retry(max_attempts=99, initial_backoff_ms=500, max_backoff_ms=60_000)
    s = Spec(name="b", collection="c", action={"type": "emit", "collection": "d"}, retry=retry)
    engine = TriggerEngine([s], data_dir="/nonexistent", rng=random.Random(1))
    t = engine.triggers["b"]
    for attempts, nominal in [(1, 0.5), (2, 1.0), (3, 2.0), (8, 60.0), (99, 60.0), (5000, 60.0)]:
        delays = [engine.backoff_s(t, attempts) for _ in range(200)]
        assert nominal / 2 <= min(delays) and max(delays) <= nominal
        assert max(delays) - min(delays) > nominal / 4  # jitter spreads them


def test_retry_after_accepts_seconds_and_http_dates() -> None:
    now = 1_700_000_000.0
    assert parse_retry_after("7", now) == 7.0
    assert parse_retry_after("Tue, 14 Nov 2023 22:13:40 GMT", now) == 20.0
    assert parse_retry_after("garbage", now) is None
    assert parse_retry_after(None, now) is None
    assert parse_retry_after("999999", now) == 3600.0


def test_permanent_error_is_exported_for_python_actions() -> None:
    assert issubclass(PermanentError, Exception)
    assert PermanentError.retriable is False
    with pytest.raises(PermanentError):
        raise PermanentError("x")


async def test_hanging_receiver_costs_one_timeout_then_batches_queue_without_waiting(
    make_engine: Any, receiver: Receiver, clock: FakeClock
) -> None:
    """1. The receiver hangs: the first chunk times out (one timeout_s).
    2. The batch's other chunks, and the next batch's, are queued without a
       call, so finish returns at once and the CDC tables are not held.
    3. The receiver answers again: the retry loop delivers every row once and
       the next batch is attempted in finish again."""
    receiver.default = Reply(200, delay_s=2.0)
    s = Spec(
        name="hook", collection="orders", batch_size=2,
        action=webhook(receiver.url, timeout_s=0.2),
        retry=Retry(max_attempts=5, initial_backoff_ms=100, max_backoff_ms=100),
    )  # fmt: skip
    engine = await make_engine([s])

    with capture_logs() as logs:
        started = asyncio.get_running_loop().time()
        await engine.finish(
            batch(1), hand_evaluation(engine, {"hook": [event(i) for i in range(1, 7)]})
        )
        await engine.finish(
            batch(2), hand_evaluation(engine, {"hook": [event(i) for i in range(7, 9)]})
        )
        took = asyncio.get_running_loop().time() - started

    assert len(receiver.requests) == 1  # one timed-out call, nothing else waited on
    assert took < 1.5
    deferred = [e for e in logs if e["event"] == "trigger_calls_deferred"]
    assert [(e["batch_id"], e["rows"]) for e in deferred] == [(1, 4), (2, 2)]
    store: TriggerStore = engine._store
    assert sorted(
        lsn for e in store.pending() for lsn in range(e.first_lsn, e.last_lsn + 1)
    ) == list(range(1, 9))

    receiver.default = Reply(200)
    clock.advance(1.0)
    while await engine.deliver_due():
        clock.advance(1.0)
    assert store.pending() == [] and store.dlq_size() == 0
    # After the timed-out call (which the receiver may still have processed: at
    # least once), every row went out exactly once more.
    assert sorted(lsn for r in receiver.requests[1:] for lsn in r.lsns) == list(range(1, 9))

    await engine.finish(batch(3), hand_evaluation(engine, {"hook": [event(9)]}))
    assert receiver.accepted()[-1].lsns == [9]  # attempted in finish again


async def test_retry_loop_keeps_retrying_a_failing_store_and_recovers_by_itself(
    make_engine: Any, receiver: Receiver
) -> None:
    """A full store volume fails the loop's passes: it neither stops nor makes the
    daemon restart (that would not free the disk); status shows it; it recovers."""
    import sqlite3
    import time
    from unittest import mock

    from triggers.store import TriggerStore

    s = spec(receiver.url, retry=Retry(max_attempts=3, initial_backoff_ms=20, max_backoff_ms=20))
    engine = await make_engine([s], retry_loop=True, clock=time.time, poll_s=0.01)
    full = sqlite3.OperationalError("database or disk is full")
    with mock.patch.object(TriggerStore, "due", autospec=True, side_effect=full):
        for _ in range(200):
            if engine.loop_failing is not None and engine.status()["retry_loop"]:
                break
            await asyncio.sleep(0.01)
        assert "disk is full" in engine.status()["retry_loop"]["error"]
        await asyncio.sleep(0.2)  # several failed passes
        assert engine.retry_task is not None and not engine.retry_task.done()
    receiver.script = [Reply(500)]
    await engine.finish(batch(), hand_evaluation(engine, {"hook": [event(1)]}))
    for _ in range(300):
        if receiver.accepted() and engine.status()["retry_loop"] is None:
            break
        await asyncio.sleep(0.02)
    assert engine.status()["retry_loop"] is None
    assert [r.status for r in receiver.requests] == [500, 200]


async def test_a_chunk_keeps_its_key_through_retries_the_dlq_and_a_smaller_batch_size(
    make_engine: Any, receiver: Receiver, clock: FakeClock
) -> None:
    """1. Rows 10-12 of one batch in chunks of 2: [10, 11] is called and gets 503, so
       [12] is queued without a call (the action is failing).
    2. Retries fail until max_attempts (2): both chunks go to the DLQ.
    3. A replay with batch_size 1 (a reload shrank it) sends [10, 11] together under
       hook:10-11 and [12] under hook:12-12: every key the receiver ever saw went
       with one set of rows."""
    receiver.default = Reply(503)
    s = spec(receiver.url, batch_size=2,
             retry=Retry(max_attempts=2, initial_backoff_ms=1000, max_backoff_ms=1000))  # fmt: skip
    engine = await make_engine([s])
    await engine.finish(
        batch(), hand_evaluation(engine, {"hook": [event(n) for n in (10, 11, 12)]})
    )
    store: TriggerStore = engine._store
    assert [(e.call_key, e.attempts) for e in store.pending()] == [
        ("hook:10-11", 1),
        ("hook:12-12", 0),
    ]
    assert await engine.deliver_due() == 1  # [12], due at once
    clock.advance(10)
    assert await engine.deliver_due() == 2
    assert store.pending() == []
    assert sorted((e.lsn, e.call_key, e.attempts) for e in store.dlq_list()) == [
        (10, "hook:10-11", 2),
        (11, "hook:10-11", 2),
        (12, "hook:12-12", 2),
    ]

    receiver.default = Reply(200)
    assert store.dlq_replay(trigger="hook", chunk_sizes={"hook": 1}) == 3
    assert await engine.deliver_due() == 2

    assert [(r.headers["Idempotency-Key"], r.lsns) for r in receiver.accepted()] == [
        ("hook:10-11", [10, 11]),
        ("hook:12-12", [12]),
    ]
    seen: dict[str, set[tuple[int, ...]]] = {}
    for r in receiver.requests:
        seen.setdefault(r.headers["Idempotency-Key"], set()).add(tuple(r.lsns))
    assert seen == {"hook:10-11": {(10, 11)}, "hook:12-12": {(12,)}}
    assert len(receiver.requests) == 2 + 2 + 2  # first attempts, retries, replay


# The layout eventplane wrote before the call key was stored (user_version 1).
STORE_V1 = """
CREATE TABLE retry (id INTEGER PRIMARY KEY AUTOINCREMENT, trigger TEXT NOT NULL,
    first_lsn INTEGER NOT NULL, last_lsn INTEGER NOT NULL, rows TEXT NOT NULL,
    attempts INTEGER NOT NULL, next_due REAL NOT NULL, first_attempt REAL NOT NULL,
    last_attempt REAL NOT NULL, last_error TEXT NOT NULL);
CREATE INDEX retry_due ON retry (next_due, id);
CREATE TABLE dlq (id INTEGER PRIMARY KEY AUTOINCREMENT, trigger TEXT NOT NULL,
    collection TEXT NOT NULL, key TEXT NOT NULL, op TEXT NOT NULL, lsn INTEGER NOT NULL,
    attempts INTEGER NOT NULL, last_error TEXT NOT NULL, first_attempt REAL NOT NULL,
    last_attempt REAL NOT NULL, row TEXT NOT NULL);
CREATE INDEX dlq_trigger ON dlq (trigger, id);
PRAGMA user_version = 1;
"""


async def test_a_store_of_layout_1_opens_and_its_entries_keep_the_keys_they_were_sent_with(
    make_engine: Any, receiver: Receiver, tmp_path: Path
) -> None:
    """1. A version 1 store holds a retry entry of rows 10-11 and a DLQ row 12.
    2. The engine opens it: the file becomes version 2; the retry entry is sent with
       hook:10-11, the key version 1 sent it with; the DLQ row has no key.
    3. Replayed, the DLQ row is keyed by its LSN range, as before."""
    path = store_path(tmp_path / "data")
    path.parent.mkdir(parents=True)
    docs = [rowsmod.with_key("hook", n, doc(event(n))) for n in (10, 11, 12)]
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.executescript(STORE_V1)
        db.execute(
            "INSERT INTO retry (trigger, first_lsn, last_lsn, rows, attempts, next_due, "
            "first_attempt, last_attempt, last_error) VALUES ('hook', 10, 11, ?, 1, 0, 1, 1, 'x')",
            (rowsmod.join(docs[:2]).decode(),),
        )
        db.execute(
            "INSERT INTO dlq (trigger, collection, key, op, lsn, attempts, last_error, "
            "first_attempt, last_attempt, row) VALUES ('hook', 'orders', 'k12', 'insert', 12, "
            "1, 'x', 1, 1, ?)",
            (docs[2].decode(),),
        )
        db.commit()

    engine = await make_engine([spec(receiver.url)])
    store: TriggerStore = engine._store
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == 3  # 1 -> 2 -> 3
    assert [e.call_key for e in store.pending()] == ["hook:10-11"]
    assert [e.call_key for e in store.dlq_list()] == [None]
    assert await engine.deliver_due() == 1
    assert store.dlq_replay(trigger="hook") == 1
    assert await engine.deliver_due() == 1

    assert [(r.headers["Idempotency-Key"], r.lsns) for r in receiver.requests] == [
        ("hook:10-11", [10, 11]),
        ("hook:12-12", [12]),
    ]
    TriggerStore(path).close()  # a version 2 file opens as it is
