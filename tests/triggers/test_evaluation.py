"""Triggers evaluated by the real SparkSession over batch DataFrames built like the
executor's (new/old VARIANT via parse_json), delivered to a loopback receiver."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from structlog.testing import capture_logs

from daemon.config import parse_triggers
from tests.triggers.support import (
    FakeClock,
    Receiver,
    batch,
    batch_df,
    event,
    run_batch,
    sample,
    webhook,
)
from triggers import MAX_DEPTH, Spec, TriggerConfigError, TriggerEngine

pytestmark = pytest.mark.spark


def mixed_events() -> list[dict[str, Any]]:
    """Orders with amounts around the threshold, other ops, another collection,
    a null new, a non-numeric amount in another collection, one derived event."""
    return [
        event(1, op="insert", key="o1", new={"amount": 1500}),
        event(2, op="insert", key="o2", new={"amount": 999.5}),
        event(3, op="update", key="o1", new={"amount": 2000}, old={"amount": 1500}),
        event(4, op="delete", key="o1", new=None, old={"amount": 2000}),
        event(5, collection="users", op="insert", key="u1", new={"amount": "lots"}),
        event(6, op="update", key="o2", new={"amount": 1000.01}, old={"amount": 999.5}),
        event(7, op="insert", key="o3", new={"note": "no amount"}),
        event(8, op="insert", key="o4", new={"amount": 5000}, depth=1, source="copy"),
        event(9, op="update", key="o1", new={"amount": 1001}, old={"amount": 2000}),
    ]


async def test_webhook_gets_exactly_the_rows_when_matches_in_lsn_order(
    spark: Any, make_engine: Any, receiver: Receiver, metrics: Any
) -> None:
    s = Spec(
        name="large-orders", collection="orders", on=("insert", "update"),
        when="new:amount::double > 1000", action=webhook(receiver.url), batch_size=2,
    )  # fmt: skip
    engine = await make_engine([s], spark)
    # Shuffle the input: the engine must restore LSN order.
    events = mixed_events()
    df = batch_df(spark, [events[i] for i in (8, 2, 0, 5, 1, 3, 4, 6, 7)], batch_id=42)

    await run_batch(engine, spark, df, batch_id=42)

    # Matched: 1 (1500), 3 (2000), 6 (1000.01), 9 (1001). Excluded: 999.5, a delete,
    # another collection, no amount, a derived event.
    assert receiver.all_lsns == [1, 3, 6, 9]
    assert [r.headers["Idempotency-Key"] for r in receiver.requests] == [
        "large-orders:1-3",
        "large-orders:6-9",
    ]
    first = receiver.requests[0].body
    assert first["trigger"] == "large-orders"
    assert first["rows"][0] == {
        "idempotency_key": "large-orders:1",
        "lsn": 1, "core": 1, "seq": 1, "collection": "orders", "op": "insert", "key": "o1",
        "new": {"amount": 1500}, "old": None, "ingest_ts": "2025-01-02T03:04:05.000000Z",
        "batch_id": 42, "event_id": None, "event_time": None, "producer": None, "depth": 0,
        "source": "",
    }  # fmt: skip
    assert first["rows"][1]["old"] == {"amount": 1500}
    assert sample(metrics, "eventplane_trigger_fires_total", trigger="large-orders") == 4
    assert sample(metrics, "eventplane_trigger_action_successes_total", trigger="large-orders") == 2


async def test_several_triggers_share_one_batch_and_derived_rows_need_opt_in(
    spark: Any, make_engine: Any, receiver: Receiver
) -> None:
    from tests.triggers import actions_for_tests as a

    a.CALLS.clear()
    specs = [
        Spec(name="deletes", collection="orders", on=("delete",), action=webhook(receiver.url)),
        Spec(name="all-orders", collection="orders", fire_on_derived=True,
             action={"type": "python", "function": "tests.triggers.actions_for_tests:record"}),
        Spec(name="users", collection="users", when="key = 'u1'",
             action={"type": "python",
                     "function": "tests.triggers.actions_for_tests:record_async"}),
        Spec(name="off", collection="orders", enabled=False, action=webhook(receiver.url)),
    ]  # fmt: skip
    engine = await make_engine(specs, spark)

    await run_batch(engine, spark, batch_df(spark, mixed_events()))

    assert receiver.all_lsns == [4]
    calls = {name: lsns for name, lsns, _, _ in a.CALLS}
    assert calls["record"] == [1, 2, 3, 4, 6, 7, 8, 9]  # derived lsn 8 included: opted in
    assert calls["record_async"] == [5]
    [(_, _, news, keys)] = [c for c in a.CALLS if c[0] == "record_async"]
    assert news == [{"amount": "lots"}]
    assert keys == ["users:5"]


async def test_bad_when_is_rejected_naming_the_trigger_and_quoting_spark(spark: Any) -> None:
    specs = [
        Spec(name="typo", collection="orders", when="nosuch > 1", action={"type": "emit",
             "collection": "x"}),
        Spec(name="syntax", collection="orders", when="new:amount::double >", action={
             "type": "emit", "collection": "x"}),
        Spec(name="not-bool", collection="orders", when="new:amount", action={"type": "emit",
             "collection": "x"}),
        Spec(name="fine", collection="orders", when="new:amount::double > 1", action={
             "type": "emit", "collection": "x"}),
    ]  # fmt: skip
    engine = TriggerEngine(specs, data_dir="/nonexistent")

    errors = await asyncio.to_thread(engine.validate, spark)

    assert len(errors) == 3
    assert errors[0].startswith(
        "triggers[0] (\"typo\").when: Spark cannot use 'nosuch > 1' as a condition: "
        "[UNRESOLVED_COLUMN.WITH_SUGGESTION] A column, variable, or function parameter "
        "with name `nosuch` cannot be resolved."
    )
    assert errors[1].startswith('triggers[1] ("syntax").when:')
    assert "[PARSE_SYNTAX_ERROR]" in errors[1]
    assert errors[2].startswith('triggers[2] ("not-bool").when:')
    assert "[DATATYPE_MISMATCH" in errors[2] and "boolean" in errors[2]
    with pytest.raises(TriggerConfigError):
        engine.run_in_spark(spark, batch_df(spark, []), batch())


async def test_bad_action_expressions_and_statements_are_rejected(spark: Any) -> None:
    specs = [
        Spec(name="emit-key", collection="o",
             action={"type": "emit", "collection": "x", "key": "nope(1)"}),
        Spec(name="emit-new", collection="o",
             action={"type": "emit", "collection": "x", "new": "key"}),
        Spec(name="sql-table", collection="o",
             action={"type": "sql", "statement": "INSERT INTO nope SELECT * FROM matched"}),
        Spec(name="sql-syntax", collection="o",
             action={"type": "sql", "statement": "INSRT INTO t SELECT 1"}),
    ]  # fmt: skip
    errors = TriggerEngine(specs, data_dir="/nonexistent").validate(spark)
    assert [e.split(":")[0] for e in errors] == [
        'triggers[0] ("emit-key").action.key',
        'triggers[1] ("emit-new").action.new',
        'triggers[2] ("sql-table").action.statement',
        'triggers[3] ("sql-syntax").action.statement',
    ]
    assert "UNRESOLVED_ROUTINE" in errors[0]
    assert "TABLE_OR_VIEW_NOT_FOUND" in errors[2]
    assert "PARSE_SYNTAX_ERROR" in errors[3]


async def test_reload_with_a_broken_trigger_keeps_the_old_set(
    spark: Any, make_engine: Any, receiver: Receiver
) -> None:
    """1. Start with one good trigger.
    2. Reload a set holding a broken `when`: errors come back and are logged,
       the old set stays, and the next batch still fires it.
    3. Reload a good set: it replaces the old one from the next batch on."""
    old = Spec(name="big", collection="orders", when="new:amount::double > 1000",
               action=webhook(receiver.url))  # fmt: skip
    engine = await make_engine([old], spark)
    broken = [
        Spec(name="big", collection="orders", when="new:amount::double > 10",
             action=webhook(receiver.url)),
        Spec(name="bad", collection="orders", when="new:amount::double >>> 1",
             action=webhook(receiver.url)),
    ]  # fmt: skip

    with capture_logs() as logs:
        errors = await asyncio.to_thread(engine.reload, broken, spark)

    assert len(errors) == 1 and errors[0].startswith('triggers[1] ("bad").when:')
    assert [x["event"] for x in logs if x["log_level"] == "error"] == [
        "trigger_reload_rejected",
        "trigger_reload_kept_old_set",
    ]
    assert engine.triggers["big"].when == "new:amount::double > 1000"
    await run_batch(engine, spark, batch_df(spark, mixed_events()))
    assert receiver.all_lsns == [1, 3, 6, 9]

    good = [Spec(name="small", collection="orders", when="new:amount::double < 1000",
                 action=webhook(receiver.url))]  # fmt: skip
    with capture_logs() as logs:
        assert await engine.reload_specs(good) == []
    [done] = [x for x in logs if x["event"] == "triggers_reloaded"]
    assert done["added"] == ["small"] and done["removed"] == ["big"]
    await run_batch(engine, spark, batch_df(spark, mixed_events(), batch_id=2), batch_id=2)
    assert receiver.all_lsns[4:] == [2]


async def test_batches_reuse_the_trigger_columns_until_a_reload_replaces_the_set(
    spark: Any, make_engine: Any, receiver: Receiver
) -> None:
    """1. Two batches with one trigger set: the second reuses the first's Columns
       and still gets its own rows (its own batch id in every row).
    2. After a reload the next batch builds new Columns from the new set."""
    big = Spec(name="big", collection="orders", when="new:amount::double > 1000",
               action=webhook(receiver.url))  # fmt: skip
    engine = await make_engine([big], spark)

    first = await run_batch(engine, spark, batch_df(spark, mixed_events(), batch_id=1), 1)
    second = await run_batch(engine, spark, batch_df(spark, mixed_events(), batch_id=2), 2)

    assert first.selection is not None and second.selection is first.selection
    assert receiver.all_lsns == [1, 3, 6, 9, 1, 3, 6, 9]
    batch_ids = [row["batch_id"] for r in receiver.requests for row in r.body["rows"]]
    assert batch_ids == [1, 1, 1, 1, 2, 2, 2, 2]

    small = Spec(name="small", collection="orders", when="new:amount::double < 1000",
                 action=webhook(receiver.url))  # fmt: skip
    assert await engine.reload_specs([small]) == []
    third = await run_batch(engine, spark, batch_df(spark, mixed_events(), batch_id=3), 3)

    assert third.selection is not None and third.selection is not first.selection
    assert receiver.all_lsns[8:] == [2]


async def test_when_failing_at_run_time_dead_letters_the_row_of_its_own_collection_only(
    spark: Any, make_engine: Any, receiver: Receiver
) -> None:
    """A non-numeric amount in *another* collection never reaches `when` (the
    CASE gate); in the trigger's own collection the row goes to that trigger's
    DLQ with Spark's error, and the batch goes on (tests/triggers/test_poison.py)."""
    s = Spec(name="users-amount", collection="users", when="new:amount::double > 1",
             action=webhook(receiver.url))  # fmt: skip
    orders_only = Spec(name="orders-amount", collection="orders", when="new:amount::double > 1",
                       action=webhook(receiver.url))  # fmt: skip
    engine = await make_engine([orders_only], spark)
    await run_batch(engine, spark, batch_df(spark, mixed_events()))  # "lots" is a users row
    assert receiver.all_lsns == [1, 2, 3, 6, 9]
    assert engine._store.dlq_list() == []

    assert await asyncio.to_thread(engine.reload, [orders_only, s], spark) == []
    await run_batch(engine, spark, batch_df(spark, mixed_events(), batch_id=2), batch_id=2)
    assert receiver.all_lsns[5:] == [1, 2, 3, 6, 9]
    [dead] = engine._store.dlq_list()
    assert (dead.trigger, dead.lsn, dead.collection) == ("users-amount", 5, "users")
    assert "INVALID_VARIANT_CAST" in dead.last_error and "try_variant_get" in dead.last_error


async def test_emit_cascade_stops_at_depth_16_with_a_clear_log_line(
    spark: Any, make_engine: Any, emitted: list[dict[str, Any]]
) -> None:
    """1. A trigger re-emits every `loop` event into `loop` (fire_on_derived).
    2. Each round feeds the derived events back as the next batch.
    3. Depths 1..16 are emitted; the depth-16 event is not re-emitted: it goes
       to the DLQ and an error line says why."""
    s = Spec(name="echo", collection="loop", fire_on_derived=True,
             action={"type": "emit", "collection": "loop"})  # fmt: skip
    engine = await make_engine([s], spark)
    events = [event(1, collection="loop", new={"n": 1})]
    lsn = 1
    with capture_logs() as logs:
        for round_ in range(1, MAX_DEPTH + 3):
            emitted.clear()
            await run_batch(engine, spark, batch_df(spark, events, batch_id=round_), round_)
            if not emitted:
                break
            events = []
            for e in emitted:
                lsn += 1
                events.append(event(lsn, collection=e["collection"], op=e["op"], key=e["key"],
                                    new=e["new"], old=e["old"], depth=e["depth"],
                                    source=e["source"]))  # fmt: skip
    assert round_ == MAX_DEPTH + 1
    assert lsn == MAX_DEPTH + 1  # 16 derived events, depths 1..16
    assert events[0]["depth"] == MAX_DEPTH and events[0]["source"] == "echo"
    [line] = [x for x in logs if x["event"] == "trigger_cascade_depth_exceeded"]
    assert line["log_level"] == "error" and line["max_depth"] == 16 and line["lsns"] == [17]
    assert "emit cascade stopped" in line["message"]
    [dead] = engine._store.dlq_list()
    assert dead.lsn == 17 and "depth 16, the limit" in dead.last_error


async def test_emit_expressions_shape_the_derived_event(
    spark: Any, make_engine: Any, emitted: list[dict[str, Any]]
) -> None:
    s = Spec(name="summary", collection="orders", on=("insert",),
             when="new:amount::double > 1000",
             action={"type": "emit", "collection": "big_orders", "op": "insert",
                     "key": "concat('big-', key)",
                     "new": "named_struct('amount', new:amount::double, 'from_lsn', lsn)"},
             )  # fmt: skip
    engine = await make_engine([s], spark)
    await run_batch(engine, spark, batch_df(spark, mixed_events()))
    assert emitted == [
        {"collection": "big_orders", "op": "insert", "key": "big-o1",
         "new": {"amount": 1500.0, "from_lsn": 1}, "old": None, "depth": 1, "source": "summary"},
    ]  # fmt: skip


async def test_sql_action_writes_matched_rows_and_retries_when_the_table_is_gone(
    spark: Any, make_engine: Any, clock: FakeClock, tmp_path: Any
) -> None:
    """1. INSERT over `matched` lands the matched rows with their idempotency keys.
    2. With the table dropped, the batch's call fails and is queued.
    3. Once the table is back, the retry rebuilds `matched` from the stored rows."""
    table = "trig_sql_sink"
    spark.sql(f"DROP TABLE IF EXISTS {table}")
    create = (
        f"CREATE TABLE {table} (lsn BIGINT, k STRING, amount DOUBLE, ik STRING) USING parquet "
        f"LOCATION '{tmp_path / 'sink'}'"
    )
    spark.sql(create)
    s = Spec(name="to-table", collection="orders", when="new:amount::double > 1000",
             action={"type": "sql", "statement": f"INSERT INTO {table} SELECT lsn, key, "
                     "new:amount::double, idempotency_key FROM matched"})  # fmt: skip
    engine = await make_engine([s], spark)

    await run_batch(engine, spark, batch_df(spark, mixed_events()))
    rows = sorted(tuple(r) for r in spark.table(table).collect())
    assert rows == [(1, "o1", 1500.0, "to-table:1"), (3, "o1", 2000.0, "to-table:3"),
                    (6, "o2", 1000.01, "to-table:6"), (9, "o1", 1001.0, "to-table:9")]  # fmt: skip

    spark.sql(f"DROP TABLE {table}")
    await run_batch(engine, spark, batch_df(spark, [event(20, new={"amount": 3000})]), 2)
    [entry] = engine._store.pending()
    assert "TABLE_OR_VIEW_NOT_FOUND" in entry.last_error

    spark.sql(create)
    clock.advance(60)
    assert await engine.deliver_due() == 1
    assert engine._store.pending() == []
    assert (20, "k20", 3000.0, "to-table:20") in [tuple(r) for r in spark.table(table).collect()]
    spark.sql(f"DROP TABLE {table}")


async def test_config_trigger_specs_run_unchanged(
    spark: Any, make_engine: Any, receiver: Receiver
) -> None:
    """daemon.config's TriggerSpec objects are accepted as they are."""
    errors: list[str] = []
    specs = parse_triggers(
        [{"name": "cfg", "collection": "orders", "on": ["delete"],
          "action": {"type": "webhook", "url": receiver.url, "timeout_s": 2}}],
        errors,
    )  # fmt: skip
    assert errors == []
    engine = await make_engine(specs, spark)
    await run_batch(engine, spark, batch_df(spark, mixed_events()))
    assert receiver.all_lsns == [4]


async def test_a_when_on_producer_matches_and_the_row_names_the_producer(
    spark: Any, make_engine: Any, receiver: Receiver
) -> None:
    """Who wrote it, in triggers: ``when`` can test ``producer``, and each row
    an action gets carries it (null for an event sent to an open ingest)."""
    s = Spec(
        name="from-billing", collection="orders", on=("insert",),
        when="producer = 'billing' OR producer IS NULL", action=webhook(receiver.url),
    )  # fmt: skip
    engine = await make_engine([s], spark)
    events = [
        {**event(1, new={"a": 1}), "producer": "billing"},
        {**event(2, new={"a": 2}), "producer": "orders-svc"},
        event(3, new={"a": 3}),
    ]
    await run_batch(engine, spark, batch_df(spark, events, batch_id=7), batch_id=7)
    rows = [row for r in receiver.requests for row in r.body["rows"]]
    assert [(row["lsn"], row["producer"]) for row in rows] == [(1, "billing"), (3, None)]
