"""Per-stage progress: a failing stage holds back only itself (invariant 6)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from structlog.testing import capture_logs

from daemon.config import MicrobatchConfig
from daemon.plane.planlog import PlanLog
from daemon.plane.planner import Planner
from daemon.plane.stages import WHOLE_BATCH
from daemon.plane.watermarks import Watermarks, WatermarkSnapshot
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
