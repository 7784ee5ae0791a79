"""Poison rows: a row that makes a trigger's `when` fail at run time goes to
that trigger's DLQ; the rest of the batch is evaluated and delivered as usual.
Real SparkSession, batch DataFrames built like the executor's, a loopback receiver."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from structlog.testing import capture_logs

from daemon.cli.main import main as cli
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
from triggers import Spec, TriggerEvaluationError, evaluate
from triggers import rows as rowsmod
from triggers.store import DeadRows

pytestmark = pytest.mark.spark

BIG = "new:amount::double > 1000"  # fails on {"amount": "lots"} (ANSI cast)
POISON = "eventplane_trigger_action_failures_total"


def orders(n: int, poison: set[int]) -> list[dict[str, Any]]:
    """Orders 1..n: even LSNs are large (2000), odd ones small (10); LSNs in
    ``poison`` carry an amount no double can be cast from."""
    return [
        event(lsn, key=f"o{lsn}",
              new={"amount": "lots"} if lsn in poison else {"amount": 2000 if lsn % 2 == 0 else 10})
        for lsn in range(1, n + 1)
    ]  # fmt: skip


def spark_jobs(spark: Any) -> int:
    """The newest Spark job id: job ids only grow, so a difference counts the jobs run."""
    ids = spark.sparkContext.statusTracker().getJobIdsForGroup(None)
    return max(ids, default=-1)


@pytest.mark.parametrize("poison", [{17}, {1, 20, 40}], ids=["one", "three"])
async def test_poison_row_goes_to_dlq_and_rest_of_batch_is_delivered(
    spark: Any, make_engine: Any, receiver: Receiver, metrics: Any, poison: set[int]
) -> None:
    """1. A batch of 40 orders; `poison` of them make `when` fail (ANSI cast).
    2. run_in_spark does not raise: the batch is split, the poison rows isolated.
    3. Every good matching row is delivered, in LSN order, in the usual chunks.
    4. Each poison row sits in the trigger's DLQ with its LSN, its document
       (marked as never evaluated) and Spark's error, durable when finish returns."""
    s = Spec(name="big", collection="orders", when=BIG, action=webhook(receiver.url), batch_size=8)
    engine = await make_engine([s], spark)
    events = orders(40, poison)

    with capture_logs() as logs:
        result = await run_batch(engine, spark, batch_df(spark, events[::-1], batch_id=7), 7)

    good = [e["lsn"] for e in events if e["lsn"] not in poison and e["lsn"] % 2 == 0]
    assert receiver.all_lsns == good
    assert all(r.lsns == sorted(r.lsns) for r in receiver.requests)
    dead = engine._store.dlq_list()
    assert [d.lsn for d in dead] == sorted(poison)
    for d in dead:
        assert d.trigger == "big" and d.attempts == 0
        assert d.last_error.startswith("evaluation failed on this row: [INVALID_VARIANT_CAST]")
        row = json.loads(d.row)
        assert row["idempotency_key"] == f"big:{d.lsn}" and row["stage"] == "when"
        assert row["new"] == {"amount": "lots"} and row["batch_id"] == 7
    assert result.batch_error is not None and "INVALID_VARIANT_CAST" in result.batch_error
    [line] = [x for x in logs if x["event"] == "trigger_rows_poisoned"]
    assert line["trigger"] == "big" and line["batch_id"] == 7 and line["capped"] is False
    assert line["rows"] == len(poison) and line["lsns"] == sorted(poison)
    assert "INVALID_VARIANT_CAST" in line["error"]
    assert sample(metrics, POISON, trigger="big", kind="poison") == len(poison)
    assert sample(metrics, "eventplane_trigger_fires_total", trigger="big") == len(good)


async def test_other_triggers_in_the_same_batch_are_unaffected(
    spark: Any, make_engine: Any, receiver: Receiver, emitted: list[dict[str, Any]]
) -> None:
    """A trigger failing on one row leaves the others whole: a webhook on the
    same rows with a safe `when`, an emit with expressions, a python action."""
    from tests.triggers import actions_for_tests as a

    a.CALLS.clear()
    specs = [
        Spec(name="big", collection="orders", when=BIG, action=webhook(receiver.url)),
        Spec(name="safe", collection="orders",
             when="try_variant_get(new, '$.amount', 'double') > 1000",
             action={"type": "python", "function": "tests.triggers.actions_for_tests:record"}),
        Spec(name="copy", collection="orders", when="lsn % 10 = 0",
             action={"type": "emit", "collection": "copies", "key": "concat('c-', key)"}),
    ]  # fmt: skip
    engine = await make_engine(specs, spark)

    await run_batch(engine, spark, batch_df(spark, orders(30, {5})))

    large = [lsn for lsn in range(2, 31, 2)]
    assert receiver.all_lsns == large
    assert [lsns for name, lsns, _, _ in a.CALLS if name == "record"] == [large]
    assert [e["key"] for e in emitted] == ["c-o10", "c-o20", "c-o30"]
    assert [(d.trigger, d.lsn) for d in engine._store.dlq_list()] == [("big", 5)]


async def test_over_the_cap_the_culprits_rows_land_in_the_dlq_unevaluated_and_none_is_lost(
    spark: Any, make_engine: Any, receiver: Receiver
) -> None:
    """1. The cap is 2 poison rows per trigger per batch; the batch has 5.
    2. The rows whose casts pass (no suspects) are evaluated in one job and
       delivered; the first two poison rows are in the DLQ with their error.
    3. The other suspects are in the DLQ, unevaluated, saying so; delivered +
       DLQ = all of the trigger's rows.
    4. Another trigger on the same rows gets all of its rows."""
    specs = [
        Spec(name="any", collection="orders", when="new:amount::double > 1",
             action=webhook(receiver.url)),
        Spec(name="every-fifth", collection="orders", when="lsn % 5 = 0",
             action=webhook(receiver.url)),
    ]  # fmt: skip
    engine = await make_engine(specs, spark)
    poison = {3, 9, 14, 21, 27}

    with mock.patch.object(evaluate, "MAX_POISON_ROWS_PER_BATCH", 2), capture_logs() as logs:
        result = await run_batch(engine, spark, batch_df(spark, orders(30, poison), batch_id=4), 4)

    delivered = {name: [lsn for r in receiver.requests if r.body["trigger"] == name
                        for lsn in r.lsns] for name in ("any", "every-fifth")}  # fmt: skip
    dead = engine._store.dlq_list()
    assert delivered["every-fifth"] == [5, 10, 15, 20, 25, 30]
    assert {d.trigger for d in dead} == {"any"}
    assert sorted(delivered["any"] + [d.lsn for d in dead]) == list(range(1, 31))
    assert [d.lsn for d in dead if d.last_error.startswith("evaluation failed")] == [3, 9]
    assert delivered["any"] == [lsn for lsn in range(1, 31) if lsn not in poison]
    unevaluated = [d for d in dead if d.lsn not in (3, 9)]
    assert [d.lsn for d in unevaluated] == [14, 21, 27]  # the suspects past the cap
    assert all(
        "not evaluated: trigger 'any' failed on more than 2 rows of batch 4" in d.last_error
        for d in unevaluated
    )
    assert all(json.loads(d.row)["stage"] == "when" for d in dead)
    assert result.capped == {"any"}
    [line] = [x for x in logs if x["event"] == "trigger_rows_poisoned"]
    assert line["capped"] is True and "unevaluated" in line["message"]


async def test_dlq_replay_after_fixing_the_trigger_delivers_exactly_the_matching_rows(
    spark: Any, make_engine: Any, receiver: Receiver, tmp_path: Path, capsys: Any
) -> None:
    """1. Three rows break `when` and go to the DLQ; the good rows are delivered.
    2. The trigger is fixed (SIGHUP reload) so that one of them matches, one
       does not, and one still fails; then `eventplane dlq replay`.
    3. The retry pass evaluates `when` again with Spark: the matching row is
       delivered exactly as a batch renders it, the non-matching one is done,
       the failing one is back in the DLQ with the new error."""
    broken = Spec(name="big", collection="orders", when="new:amount::double > 1000",
                  action=webhook(receiver.url))  # fmt: skip
    engine = await make_engine([broken], spark, data_dir=tmp_path / "data")
    events = [
        event(1, new={"amount": 2000}),
        event(2, new={"amount": "lots"}),  # never large
        event(3, new={"amount": {"value": 5000}}),  # large, once the trigger reads .value
        event(4, new={"amount": {"value": "x"}}),  # still breaks the fixed trigger
        event(5, new={"amount": 10}),
    ]
    await run_batch(engine, spark, batch_df(spark, events))
    assert receiver.all_lsns == [1]
    assert [d.lsn for d in engine._store.dlq_list()] == [2, 3, 4]

    fixed_when = (
        "coalesce(try_variant_get(new, '$.amount', 'double'), new:amount.value::double) > 1000"
    )
    fixed = Spec(name="big", collection="orders", when=fixed_when, action=webhook(receiver.url))
    assert await engine.reload_specs([fixed]) == []
    config = tmp_path / "config.toml"
    config.write_text(
        f'[daemon]\ndata_dir = "data"\n\n[[triggers]]\nname = "big"\ncollection = "orders"\n'
        f'when = "{fixed_when}"\naction = {{ type = "webhook", url = "{receiver.url}" }}\n'
    )
    assert cli(["dlq", "replay", "--trigger", "big", "--config", str(config)]) == 0
    capsys.readouterr()
    receiver.requests.clear()

    with capture_logs() as logs:
        assert await engine.deliver_due() == 1

    assert receiver.all_lsns == [3]
    [row] = receiver.requests[0].body["rows"]
    assert row == {
        "idempotency_key": "big:3", "lsn": 3, "core": 3, "seq": 3, "collection": "orders",
        "op": "insert", "key": "k3", "new": {"amount": {"value": 5000}}, "old": None,
        "ingest_ts": "2025-01-02T03:04:05.000000Z", "batch_id": 1, "event_id": None,
        "event_time": None, "producer": None, "depth": 0, "source": "",
    }  # fmt: skip
    assert receiver.requests[0].headers["Idempotency-Key"] == "big:3-3"
    assert engine._store.pending() == []
    [again] = engine._store.dlq_list()
    assert again.lsn == 4 and "INVALID_VARIANT_CAST" in again.last_error
    assert json.loads(again.row)["stage"] == "when"
    [line] = [x for x in logs if x["event"] == "trigger_replay_evaluated"]
    assert (line["rows"], line["matched"], line["failed"], line["not_matched"]) == (3, 1, 1, 1)


async def test_replayed_unevaluated_rows_wait_for_spark(
    make_engine: Any, receiver: Receiver, clock: FakeClock
) -> None:
    """Before Spark is up, a replayed poison row stays queued (no attempt
    counted) instead of reaching the action unevaluated."""
    s = Spec(name="big", collection="orders", when=BIG, action=webhook(receiver.url))
    engine = await make_engine([s])  # no Spark
    e = event(2, new={"amount": "lots"})
    doc = rowsmod.unevaluated("big", 2, json.dumps({**e, "ingest_ts": None, "batch_id": 1},
                                                   separators=(",", ":")).encode())  # fmt: skip
    store = engine._store
    store.record([], [DeadRows("big", [doc], 0, "evaluation failed on this row: x", 1.0, 1.0)])
    assert store.dlq_replay(trigger="big") == 1

    assert await engine.deliver_due() == 1

    [entry] = store.pending()
    assert entry.attempts == 0 and entry.next_due > clock.now
    assert "waiting for Spark" in entry.last_error
    assert receiver.requests == []


async def test_a_clean_batch_runs_exactly_one_spark_job(spark: Any, make_engine: Any) -> None:
    """Isolation costs nothing until a row fails: one job for all triggers.
    The same count on a poison batch shows the splitting jobs."""
    specs = [
        Spec(name="big", collection="orders", when=BIG, action=webhook("http://127.0.0.1:9/")),
        Spec(name="small", collection="orders",
             when="try_variant_get(new, '$.amount', 'double') < 100",
             action=webhook("http://127.0.0.1:9/")),
    ]  # fmt: skip
    engine = await make_engine(specs, spark)
    clean, poisoned = batch_df(spark, orders(64, set())), batch_df(spark, orders(64, {33}))

    before = spark_jobs(spark)
    result = engine.run_in_spark(spark, clean, batch())
    clean_jobs = spark_jobs(spark) - before
    before = spark_jobs(spark)
    split = engine.run_in_spark(spark, poisoned, batch())
    split_jobs = spark_jobs(spark) - before

    assert clean_jobs == 1
    assert result.isolation_jobs == 0 and result.batch_error is None and not result.poisoned
    assert len(result.matched["big"]) == 32 and len(result.matched["small"]) == 32
    assert [p.lsn for p in split.poisoned["big"]] == [33]
    assert split_jobs == 1 + split.isolation_jobs > 2
    assert len(split.matched["small"]) == 31 and "small" not in split.poisoned


async def test_a_spark_failure_that_is_not_about_a_row_still_fails_the_batch(
    spark: Any, make_engine: Any
) -> None:
    """No row to blame (py4j, a stopped session): nothing goes to the DLQ; the
    batch fails with TriggerEvaluationError and the executor retries it."""
    s = Spec(name="big", collection="orders", when=BIG, action=webhook("http://127.0.0.1:9/"))
    engine = await make_engine([s], spark)
    df = batch_df(spark, orders(4, set()))

    gone = ConnectionError("py4j is gone")
    with (
        mock.patch.object(type(df), "collect", side_effect=gone),
        pytest.raises(TriggerEvaluationError, match="py4j is gone; the batch is retried"),
    ):
        engine.run_in_spark(spark, df, batch())
    assert engine._store.dlq_list() == []


async def test_a_poison_cast_in_a_large_batch_is_isolated_in_a_handful_of_jobs(
    spark: Any, make_engine: Any, receiver: Receiver
) -> None:
    """The TRY-cast pass names the suspect rows at once: one poison row among
    2000 costs a few jobs, not a bisection of the whole batch (~1.5 log2(n))."""
    engine = await make_engine(
        [Spec(name="big", collection="orders", when=BIG, action=webhook(receiver.url))], spark
    )
    before = spark_jobs(spark)
    result = await run_batch(engine, spark, batch_df(spark, orders(2000, {1234})))
    jobs = spark_jobs(spark) - before

    assert [p.lsn for p in result.poisoned["big"]] == [1234]
    large = [lsn for lsn in range(2, 2001, 2) if lsn != 1234]
    assert sorted(receiver.all_lsns) == large  # every large order, none lost
    assert jobs == 2, jobs  # the batch's job (it failed), the suspects pass


async def test_a_row_failing_otherwise_than_a_cast_is_still_isolated(
    spark: Any, make_engine: Any, receiver: Receiver
) -> None:
    """A division by zero (ANSI) is no cast: no suspects, the other rows are
    bisected by LSN range, and the failing row still lands in the DLQ alone."""
    when = "100 / (new:amount::int - 10) > 1"  # amount 10: division by zero
    engine = await make_engine(
        [Spec(name="ratio", collection="orders", when=when, action=webhook(receiver.url))], spark
    )
    events = [event(lsn, new={"amount": 10 if lsn == 7 else 20}) for lsn in range(1, 13)]
    result = await run_batch(engine, spark, batch_df(spark, events))

    assert [p.lsn for p in result.poisoned["ratio"]] == [7]
    assert "DIVIDE_BY_ZERO" in result.poisoned["ratio"][0].error
    assert sorted(receiver.all_lsns) == [lsn for lsn in range(1, 13) if lsn != 7]
