"""Per-stage progress: a failing stage holds back only itself (invariant 6)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from daemon.config import MicrobatchConfig
from daemon.plane.planlog import PlanLog
from daemon.plane.planner import Planner
from daemon.plane.stages import WHOLE_BATCH, UnknownStageError
from daemon.plane.watermarks import Pause, Watermarks, WatermarkSnapshot, WatermarkStore
from daemon.service.metrics import Metrics
from tests.core.conftest import RecordingExecutor, StagedExecutor, rec
from wal.record import Record

CFG = MicrobatchConfig(interval_ms=10, retry_initial_ms=1, retry_max_ms=4)


def make(
    tmp_path: Path,
    executor: RecordingExecutor,
    wal: list[Record],
    persisted: WatermarkSnapshot | None = None,
    metrics: Metrics | None = None,
    clock: Callable[[], float] = time.monotonic,
    **planner_kw: Any,
) -> Planner:
    plan_log = PlanLog(tmp_path / "plans.log", "wal-t", 1)
    plans = plan_log.open()
    wm = Watermarks(persisted or WatermarkSnapshot("wal-t", 1, 0, (0,)), metrics)

    async def load_slice(core: int, first: int, last: int) -> list[list[Record]]:
        return [[r for r in wal if r.core == core and first <= r.lsn <= last]]

    return Planner(
        cores=1,
        cfg=CFG,
        pending_max_bytes=1 << 20,
        executor=executor,
        plan_log=plan_log,
        watermarks=wm,
        metrics=metrics or Metrics(),
        plans=plans,
        load_slice=load_slice,
        clock=clock,
        **planner_kw,
    )


async def run_batches(planner: Planner, wal: list[Record], lsns: range) -> None:
    for lsn in lsns:
        record = rec(lsn)
        wal.append(record)
        planner.add(0, [record])
        await planner.run_once()


async def test_failing_stage_falls_behind_while_the_others_keep_committing(
    tmp_path: Path,
) -> None:
    """1. Stage b fails from batch 2 on; 2. a commits batches 1-4 regardless;
    3. the watermarks stop at batch 1 (what both committed) and the core owes."""
    executor = StagedExecutor()
    wal: list[Record] = []
    planner = make(tmp_path, executor, wal)
    await run_batches(planner, wal, range(1, 2))
    executor.failing.add("cdc:b")

    with capture_logs() as logs:
        await run_batches(planner, wal, range(2, 5))

    assert executor.runs == {"cdc:a": [1, 2, 3, 4], "cdc:b": [1]}
    assert planner.watermarks.batch_id == 1 and planner.watermarks.lsns == [1]
    assert planner.owes(0)
    assert planner.plan_floor(0) == 0  # the WAL keeps what b still needs
    report = {s["name"]: s for s in planner.stages.report(planner.live_id)}
    assert report["cdc:b"]["failing"] and report["cdc:b"]["behind_batches"] == 3
    assert "cdc:b cannot write batch 2" in report["cdc:b"]["last_error"]
    assert not report["cdc:a"]["failing"] and report["cdc:a"]["behind_batches"] == 0
    # b failed on batch 2 only: later live batches no longer include it.
    assert [c for c in executor.calls if "cdc:b" in c[1]] == [
        (1, ("cdc:a", "cdc:b")),
        (2, ("cdc:a", "cdc:b")),
    ]
    assert [e["stage"] for e in logs if e["event"] == "stage_failed"] == ["cdc:b"]


async def test_recovered_stage_replays_missed_batches_in_order_then_rejoins_live(
    tmp_path: Path,
) -> None:
    now = [100.0]
    executor = StagedExecutor()
    wal: list[Record] = []
    planner = make(tmp_path, executor, wal, clock=lambda: now[0])
    executor.failing.add("cdc:b")
    await run_batches(planner, wal, range(1, 4))
    executor.failing.clear()
    now[0] += 1.0  # past b's backoff (1 ms), whatever the machine's speed

    await planner._run_behind()  # what the run loop does between live batches
    await run_batches(planner, wal, range(4, 5))

    assert executor.runs == {"cdc:a": [1, 2, 3, 4], "cdc:b": [1, 2, 3, 4]}
    replayed = [(b, s) for b, s in executor.calls if s == ("cdc:b",)]
    assert replayed == [(1, ("cdc:b",)), (2, ("cdc:b",)), (3, ("cdc:b",))]
    assert planner.watermarks.batch_id == 4 and planner.watermarks.lsns == [4]
    assert not planner.owes(0)


async def test_behind_stage_waits_for_its_backoff_between_failed_attempts(
    tmp_path: Path,
) -> None:
    now = [100.0]
    executor = StagedExecutor()
    wal: list[Record] = []
    planner = make(tmp_path, executor, wal, clock=lambda: now[0])
    executor.failing.add("cdc:b")
    await run_batches(planner, wal, range(1, 3))  # b fails batch 1 (attempt 1)

    def replays() -> int:
        return len([c for c in executor.calls if c[1] == ("cdc:b",)])

    await planner._run_behind()
    assert replays() == 0  # the 1 ms backoff has not passed on this clock
    now[0] += 0.001
    await planner._run_behind()
    assert replays() == 1  # attempt 2, then 2 ms of backoff
    now[0] += 0.001
    await planner._run_behind()
    assert replays() == 1
    now[0] += 0.001
    await planner._run_behind()
    assert replays() == 2
    assert planner.stages.next_due(planner.live_id) == now[0] + 0.004


async def test_batch_failing_for_every_stage_is_retried_whole_and_logged_once(
    tmp_path: Path,
) -> None:
    executor = StagedExecutor()
    wal: list[Record] = []
    planner = make(tmp_path, executor, wal)
    executor.fail_next = 2

    with capture_logs() as logs:
        await run_batches(planner, wal, range(1, 2))

    assert [c[0] for c in executor.calls] == [1, 1, 1]
    assert executor.runs == {"cdc:a": [1], "cdc:b": [1]}
    assert [e["event"] for e in logs if e["event"] in ("microbatch_failed", "stage_failed")] == [
        "microbatch_failed",
        "microbatch_failed",
    ]
    assert planner.watermarks.batch_id == 1
    assert not any(s["failing"] for s in planner.stages.report(planner.live_id))


async def test_restart_reruns_a_batch_only_for_the_stages_that_had_not_committed_it(
    tmp_path: Path,
) -> None:
    """1. b fails batches 2-3 and the watermarks (with stage progress) are kept;
    2. a new planner on the same plan log and watermarks re-runs 2 and 3 for b
       only, and the watermarks reach batch 3."""
    executor = StagedExecutor()
    wal: list[Record] = []
    planner = make(tmp_path, executor, wal)
    await run_batches(planner, wal, range(1, 2))
    executor.failing.add("cdc:b")
    await run_batches(planner, wal, range(2, 4))
    persisted = planner.watermarks.snapshot()
    planner.plan_log.close()
    assert dict(persisted.stages) == {"cdc:a": 3, "cdc:b": 1}

    again = StagedExecutor()
    restarted = make(tmp_path, again, wal, persisted)
    task = asyncio.create_task(restarted.run())
    await again.wait_rows(2, within_s=5)
    restarted.request_stop()
    await asyncio.wait_for(task, 5)

    assert again.calls == [(2, ("cdc:b",)), (3, ("cdc:b",))]
    assert restarted.watermarks.batch_id == 3 and restarted.watermarks.lsns == [3]


async def test_new_stage_starts_at_the_next_batch_and_removed_stage_holds_nothing_back(
    tmp_path: Path,
) -> None:
    executor = StagedExecutor(("cdc:a", "cdc:b"))
    wal: list[Record] = []
    planner = make(tmp_path, executor, wal)
    executor.failing.add("cdc:b")
    await run_batches(planner, wal, range(1, 3))
    assert planner.watermarks.batch_id == 0

    executor.names = ("cdc:a", "cdc:c")  # b removed from the config, c added
    executor.runs["cdc:c"] = []
    await run_batches(planner, wal, range(3, 4))

    assert executor.runs["cdc:c"] == [3]
    assert planner.watermarks.batch_id == 3
    assert set(planner.watermarks.stages) == {"cdc:a", "cdc:c"}


async def test_executor_without_named_stages_is_one_stage(tmp_path: Path) -> None:
    executor = RecordingExecutor()
    wal: list[Record] = []
    planner = make(tmp_path, executor, wal)
    await run_batches(planner, wal, range(1, 3))
    assert planner.stages.names == (WHOLE_BATCH,)
    assert planner.watermarks.stages == {WHOLE_BATCH: 2}


async def test_stage_metrics_show_lag_failures_and_time_failing(tmp_path: Path) -> None:
    metrics = Metrics()
    executor = StagedExecutor()
    wal: list[Record] = []
    planner = make(tmp_path, executor, wal, metrics=metrics)
    executor.failing.add("cdc:b")
    await run_batches(planner, wal, range(1, 4))

    sample = metrics.registry.get_sample_value
    assert sample("eventplane_stage_lag_batches", {"stage": "cdc:b"}) == 3
    assert sample("eventplane_stage_lag_batches", {"stage": "cdc:a"}) == 0
    assert sample("eventplane_stage_committed_batch_id", {"stage": "cdc:a"}) == 3
    assert sample("eventplane_stage_failures_total", {"stage": "cdc:b"}) == 1
    assert (sample("eventplane_stage_failing_seconds", {"stage": "cdc:b"}) or 0) > 0
    assert sample("eventplane_stage_failing_seconds", {"stage": "cdc:a"}) == 0
    assert sample("eventplane_microbatch_last_commit_timestamp_seconds") > 0


async def test_stage_still_failing_after_restart_does_not_hold_the_others(
    tmp_path: Path,
) -> None:
    executor = StagedExecutor()
    wal: list[Record] = []
    planner = make(tmp_path, executor, wal)
    executor.failing.add("cdc:b")
    await run_batches(planner, wal, range(1, 3))
    persisted = planner.watermarks.snapshot()
    planner.plan_log.close()

    again = StagedExecutor()
    again.failing.add("cdc:b")
    restarted = make(tmp_path, again, wal, persisted)
    task = asyncio.create_task(restarted.run())
    await again.wait_rows(2, within_s=5)  # the re-runs for b, which fail
    record = rec(3)
    wal.append(record)
    restarted.add(0, [record])
    await again.wait_run("cdc:a", 3)  # live, while b keeps failing behind
    restarted.request_stop()
    await asyncio.wait_for(task, 5)

    assert again.runs["cdc:a"] == [3] and again.runs["cdc:b"] == []
    assert restarted.watermarks.batch_id == 0


# -- pause and resume ----------------------------------------------------------


def rows_by_call(executor: StagedExecutor, stage: str) -> dict[int, list[int]]:
    """batch id -> the LSNs ``stage`` was handed for it (the last call for it)."""
    out: dict[int, list[int]] = {}
    for (bid, names), batch in zip(executor.calls, executor.attempts, strict=True):
        if stage in names:
            out[bid] = [r.lsn for s in batch.slices.values() for r in s.records]
    return out


async def test_paused_stage_runs_nothing_and_keeps_its_plans_while_the_other_commits(
    tmp_path: Path,
) -> None:
    """1. Both stages commit batch 1; b is paused.
    2. a commits batches 2-4; b is never called; the watermarks stop at batch 1,
       the plans b needs stay, and the core owes them."""
    executor = StagedExecutor()
    wal: list[Record] = []
    planner = make(tmp_path, executor, wal)
    await run_batches(planner, wal, range(1, 2))

    assert planner.pause_stage("cdc:b", reason="table maintenance", by="ops@host")
    await run_batches(planner, wal, range(2, 5))
    await planner._run_behind()  # a paused stage does not catch up either

    assert executor.runs == {"cdc:a": [1, 2, 3, 4], "cdc:b": [1]}
    assert [c for c in executor.calls if "cdc:b" in c[1]] == [(1, ("cdc:a", "cdc:b"))]
    assert planner.watermarks.batch_id == 1 and planner.watermarks.lsns == [1]
    assert planner.owes(0)
    assert planner.plan_floor(1) == 1  # batch 2 (LSN 2) on: the WAL keeps it
    assert sorted(planner._logged) == [1, 2, 3, 4]
    b = planner.stages.entry("cdc:b", planner.live_id)
    assert b["paused"] and b["paused_reason"] == "table maintenance"
    assert b["paused_by"] == "ops@host" and b["paused_since"] is not None
    assert (b["behind_batches"], b["behind_events"]) == (3, 3)  # LSN 2..4
    assert not b["failing"] and not b["stalled"] and not b["paused_over_limit"]
    assert planner.stages.entry("cdc:a", planner.live_id)["paused"] is False


async def test_resumed_stage_catches_up_with_the_same_batch_ids_and_rows(tmp_path: Path) -> None:
    executor = StagedExecutor()
    wal: list[Record] = []
    planner = make(tmp_path, executor, wal)
    planner.pause_stage("cdc:b")
    for lsn in range(1, 7):  # two rows per batch: ids 1-3
        records = [rec(lsn * 2 - 1), rec(lsn * 2)]
        wal.extend(records)
        planner.add(0, records)
        if lsn % 2 == 0:
            await planner.run_once()
    live_rows = rows_by_call(executor, "cdc:a")

    with capture_logs() as logs:
        assert planner.resume_stage("cdc:b")
        await planner._run_behind()

    assert executor.runs["cdc:b"] == [1, 2, 3]
    assert rows_by_call(executor, "cdc:b") == live_rows
    assert live_rows[1] == [1, 2, 3, 4]
    assert planner.watermarks.batch_id == 3 and planner.watermarks.lsns == [12]
    assert not planner.owes(0)
    assert [e["event"] for e in logs].count("stage.resumed") == 1
    b = planner.stages.entry("cdc:b", planner.live_id)
    assert not b["paused"] and b["behind_batches"] == 0 and b["behind_events"] == 0


async def test_paused_failing_stage_is_neither_retried_nor_failing_nor_stalled(
    tmp_path: Path,
) -> None:
    """A stage that failed, then was paused: however long it stays paused, it is
    not retried, and health does not call it failing or stalled."""
    now = [100.0]
    metrics = Metrics()
    executor = StagedExecutor()
    wal: list[Record] = []
    planner = make(tmp_path, executor, wal, metrics=metrics, clock=lambda: now[0])
    executor.failing.add("cdc:b")
    await run_batches(planner, wal, range(1, 3))
    assert planner.stages.entry("cdc:b", planner.live_id)["failing"]

    planner.pause_stage("cdc:b")
    now[0] += 10_000.0  # far past stall_after_s (60 s) and any backoff
    calls = len(executor.calls)
    await planner._run_behind()
    await run_batches(planner, wal, range(3, 4))

    assert len(executor.calls) == calls + 1 and executor.calls[-1] == (3, ("cdc:a",))
    assert planner.stages.next_due(planner.live_id) is None  # nothing to wake up for
    b = planner.stages.entry("cdc:b", planner.live_id)
    assert b["paused"] and not b["failing"] and not b["stalled"] and b["attempts"] == 0
    assert b["failing_for_s"] == 0.0 and b["next_retry_in_s"] is None
    sample = metrics.registry.get_sample_value
    assert sample("eventplane_stage_paused", {"stage": "cdc:b"}) == 1
    assert sample("eventplane_stage_paused", {"stage": "cdc:a"}) == 0
    assert sample("eventplane_stage_stalled", {"stage": "cdc:b"}) == 0
    assert sample("eventplane_stage_lag_batches", {"stage": "cdc:b"}) == 3
    assert sample("eventplane_stage_lag_events", {"stage": "cdc:b"}) == 3


async def test_pause_and_resume_are_idempotent_and_an_unknown_stage_is_refused_with_the_names(
    tmp_path: Path,
) -> None:
    executor = StagedExecutor()
    planner = make(tmp_path, executor, [])
    assert planner.pause_stage("cdc:b", reason="first")
    since = planner.watermarks.paused["cdc:b"].since
    assert not planner.pause_stage("cdc:b", reason="second")  # changes nothing
    assert planner.watermarks.paused["cdc:b"] == Pause(since, None, "first")
    assert planner.resume_stage("cdc:b")
    assert not planner.resume_stage("cdc:b")
    with pytest.raises(UnknownStageError) as info:
        planner.pause_stage("cdc:nope")
    assert info.value.names == ("cdc:a", "cdc:b")
    assert "no stage 'cdc:nope'; the stages are: cdc:a, cdc:b" in str(info.value)


async def test_pause_survives_a_reopen_of_the_watermarks_file_and_the_plan_log(
    tmp_path: Path,
) -> None:
    """1. b is paused; a commits batches 1-3; the watermarks go to a real file.
    2. A new planner on the same files: b is still paused (same record), the
       re-run of batches 1-3 is for nobody, a's new batch 4 runs without b.
    3. Resumed, b runs 1-4 with their ids."""
    executor = StagedExecutor()
    wal: list[Record] = []
    planner = make(tmp_path, executor, wal)
    planner.pause_stage("cdc:b", reason="backfill", by="ops@host")
    await run_batches(planner, wal, range(1, 4))
    store = WatermarkStore(tmp_path / "watermarks.json")
    store.save(planner.watermarks.snapshot())
    pause = planner.watermarks.paused["cdc:b"]
    planner.plan_log.close()

    loaded = store.load("wal-t", 1)
    assert dict(loaded.paused) == {"cdc:b": pause}
    again = StagedExecutor()
    restarted = make(tmp_path, again, wal, loaded)
    task = asyncio.create_task(restarted.run())
    try:
        record = rec(4)
        wal.append(record)
        restarted.add(0, [record])
        await again.wait_run("cdc:a", 4)
        assert again.calls == [(4, ("cdc:a",))]
        assert restarted.watermarks.paused == {"cdc:b": pause}

        restarted.resume_stage("cdc:b")
        await again.wait_run("cdc:b", 4)
    finally:
        restarted.request_stop()
        await asyncio.wait_for(task, 5)
    assert again.runs == {"cdc:a": [4], "cdc:b": [1, 2, 3, 4]}
    assert restarted.watermarks.batch_id == 4 and restarted.watermarks.paused == {}


async def test_paused_stage_no_longer_configured_at_start_is_dropped_and_logged(
    tmp_path: Path,
) -> None:
    persisted = WatermarkSnapshot(
        "wal-t", 1, 0, (0,), (("cdc:gone", 0),), (("cdc:gone", Pause(1.0, "ops", "old")),)
    )
    with capture_logs() as logs:
        planner = make(tmp_path, StagedExecutor(), [], persisted)
    assert planner.watermarks.paused == {} and "cdc:gone" not in planner.watermarks.stages
    (dropped,) = [e for e in logs if e["event"] == "stage.pause_dropped"]
    assert dropped["stage"] == "cdc:gone" and dropped["log_level"] == "warning"
    assert planner.watermarks.dirty  # the next flush writes the file without it


async def test_paused_stage_past_its_backlog_limit_is_over_it_and_keeps_every_plan(
    tmp_path: Path,
) -> None:
    metrics = Metrics()
    executor = StagedExecutor()
    wal: list[Record] = []
    planner = make(tmp_path, executor, wal, metrics=metrics, paused_max_lag_events=4)
    planner.pause_stage("cdc:b")
    await run_batches(planner, wal, range(1, 5))
    sample = metrics.registry.get_sample_value
    assert not planner.stages.entry("cdc:b", planner.live_id)["paused_over_limit"]
    assert sample("eventplane_stage_paused_backlog_ratio", {"stage": "cdc:b"}) == 1.0

    await run_batches(planner, wal, range(5, 6))

    b = planner.stages.entry("cdc:b", planner.live_id)
    assert b["paused_over_limit"] and b["behind_events"] == 5
    assert sample("eventplane_stage_paused_backlog_ratio", {"stage": "cdc:b"}) == 1.25
    assert sample("eventplane_stage_paused_backlog_ratio", {"stage": "cdc:a"}) == 0
    assert sorted(planner._logged) == [1, 2, 3, 4, 5]  # nothing dropped
    planner.resume_stage("cdc:b")
    assert sample("eventplane_stage_paused_backlog_ratio", {"stage": "cdc:b"}) == 0


async def test_events_behind_count_from_the_lowest_first_lsn_of_any_batch_missed(
    tmp_path: Path,
) -> None:
    """A core catching up plans old LSNs in a later batch: the count starts at
    the lowest first LSN of every batch above the stage's progress, and the
    plans the persisted watermarks cover are forgotten."""
    plan_log = PlanLog(tmp_path / "plans.log", "wal-t", 2)
    plan_log.open()
    plans = {1: {0: (10, 12)}, 2: {1: (2, 5)}, 3: {0: (13, 14)}, 4: {1: (6, 9), 0: (15, 15)}}
    for bid, ranges in plans.items():
        plan_log.append(bid, ranges)
    planner = Planner(
        cores=2,
        cfg=CFG,
        pending_max_bytes=1 << 20,
        executor=StagedExecutor(),
        plan_log=plan_log,
        watermarks=Watermarks(WatermarkSnapshot("wal-t", 2, 0, (0, 0))),
        metrics=Metrics(),
        plans=plans,
        load_slice=lambda core, first, last: asyncio.sleep(0, []),
        head_lsn=lambda: 20,
    )
    assert [planner._first_after(b) for b in range(5)] == [2, 2, 6, 6, None]
    planner._live_id = 4
    assert [planner._events_behind(b) for b in range(5)] == [19, 19, 15, 15, 0]
    await planner.forget_through(2)
    assert [planner._first_after(b) for b in range(2, 5)] == [6, 6, None]
    plan_log.close()


def test_a_held_batch_is_taken_not_progress_and_a_failure_sends_the_stage_back() -> None:
    from daemon.plane.stages import StageTracker

    wm = Watermarks(WatermarkSnapshot("wal-t", 1, 0, (0,)), Metrics())
    st = StageTracker(wm, MicrobatchConfig(retry_initial_ms=1, retry_max_ms=1))
    st.sync(["mirror:m", "cdc:a"], 1)
    for bid in (1, 2, 3):
        assert "mirror:m" in st.participants(bid)
        st.held("mirror:m", bid)
        st.succeeded("cdc:a", bid)
    # Taken up to 3 (it runs batch 4 live), committed none: the floor stays at 0.
    assert st.position("mirror:m") == 3 and st.progress("mirror:m") == 0
    assert st.floor() == 0 and st.holds("mirror:m") == 3
    assert st.behind(3) == []
    # Its merge of 1..3 failed: back to its progress, it re-runs batch 1 first.
    st.failed("mirror:m", 3, OSError("no"))
    assert st.position("mirror:m") == 0 and "mirror:m" in st.behind(3)
    assert st.participants(4) == ["cdc:a"]
    # Re-run and merged at 3: progress 3 in one step.
    st.held("mirror:m", 1)
    st.held("mirror:m", 2)
    st.succeeded("mirror:m", 3)
    assert st.progress("mirror:m") == 3 == st.floor() and st.holds("mirror:m") == 0
