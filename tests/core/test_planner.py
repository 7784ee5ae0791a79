"""Micro-batch planner: plan before run, retry forever with the same id and rows,
hold while the executor is not ready, bounded pending memory."""

from __future__ import annotations

import asyncio
import threading
from array import array
from collections.abc import Callable
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from daemon.config import MicrobatchConfig
from daemon.plane.batch import MicroBatch
from daemon.plane.parts import RECORD_OVERHEAD_BYTES, join_small_parts, part_bytes
from daemon.plane.planlog import PlanLog, Ranges
from daemon.plane.planner import IDLE_MIN_WAIT, RUN_TIME_MARGIN, PlanMismatchError, Planner
from daemon.plane.watermarks import Watermarks, WatermarkSnapshot
from daemon.service.metrics import Metrics
from tests.core.conftest import RecordingExecutor, columnar, rec
from wal.reader import RecordBatch
from wal.record import Record


def make_planner(
    tmp_path: Path,
    executor: RecordingExecutor,
    metrics: Metrics,
    *,
    cores: int = 2,
    cfg: MicrobatchConfig | None = None,
    pending_max_bytes: int = 1 << 20,
    wal: list[Record] | None = None,
    persisted: WatermarkSnapshot | None = None,
    clock: Callable[[], float] | None = None,
) -> tuple[Planner, PlanLog]:
    plan_log = PlanLog(tmp_path / "plans.log", "wal-t", cores)
    plans = plan_log.open()
    wm = Watermarks(persisted or WatermarkSnapshot("wal-t", cores, 0, (0,) * cores), metrics)
    stored = wal or []

    async def load_slice(core: int, first: int, last: int) -> list[list[Record]]:
        return [[r for r in stored if r.core == core and first <= r.lsn <= last]]

    planner = Planner(
        cores=cores,
        cfg=cfg or MicrobatchConfig(interval_ms=10, retry_initial_ms=1, retry_max_ms=4),
        pending_max_bytes=pending_max_bytes,
        executor=executor,
        plan_log=plan_log,
        watermarks=wm,
        metrics=metrics,
        plans=plans,
        load_slice=load_slice,
        **({"clock": clock} if clock is not None else {}),
    )
    return planner, plan_log


async def test_plan_is_durable_before_the_executor_runs(
    tmp_path: Path, executor: RecordingExecutor, metrics: Metrics
) -> None:
    planner, plan_log = make_planner(tmp_path, executor, metrics)
    seen_on_disk: list[dict[int, Ranges]] = []
    original = executor.execute

    async def execute(batch):  # type: ignore[no-untyped-def]
        seen_on_disk.append(PlanLog(plan_log.path, "wal-t", 2).open())
        await original(batch)

    executor.execute = execute  # type: ignore[method-assign]
    planner.add(0, [rec(1, 0), rec(3, 0)])
    planner.add(1, [rec(2, 1)])

    batch = await planner.run_once()

    assert batch is not None and batch.batch_id == 1
    assert seen_on_disk == [{1: {0: (1, 3), 1: (2, 2)}}]
    assert planner.watermarks.lsns == [3, 2]


async def test_failed_batch_is_retried_with_the_same_id_and_rows_until_it_commits(
    tmp_path: Path, executor: RecordingExecutor, metrics: Metrics
) -> None:
    planner, _ = make_planner(tmp_path, executor, metrics)
    executor.fail_next = 3
    planner.add(0, [rec(1), rec(2)])

    with capture_logs() as logs:
        await planner.run_once()

    assert [b.batch_id for b in executor.attempts] == [1, 1, 1, 1]
    assert {tuple(b.slices[0].records) for b in executor.attempts} == {(rec(1), rec(2))}
    assert [b.batch_id for b in executor.committed] == [1]
    failures = [e for e in logs if e["event"] == "microbatch_failed"]
    assert [e["attempt"] for e in failures] == [1, 2, 3]
    assert [e["retry_in_s"] for e in failures] == [0.001, 0.002, 0.004]  # doubling
    sample = metrics.registry.get_sample_value
    assert sample("eventplane_microbatch_outcomes_total", {"outcome": "failed"}) == 3
    assert sample("eventplane_microbatch_outcomes_total", {"outcome": "committed"}) == 1
    assert planner.last_batch is not None and planner.last_batch["attempts"] == 4


async def test_backoff_is_capped_at_retry_max(
    tmp_path: Path, executor: RecordingExecutor, metrics: Metrics
) -> None:
    planner, _ = make_planner(tmp_path, executor, metrics)
    executor.fail_next = 5
    planner.add(0, [rec(1)])
    with capture_logs() as logs:
        await planner.run_once()
    delays = [e["retry_in_s"] for e in logs if e["event"] == "microbatch_failed"]
    assert delays == [0.001, 0.002, 0.004, 0.004, 0.004]


async def test_batches_are_held_while_the_executor_is_not_ready(
    tmp_path: Path, executor: RecordingExecutor, metrics: Metrics
) -> None:
    planner, _ = make_planner(tmp_path, executor, metrics)
    executor.is_ready = False
    planner.add(0, [rec(1)])
    with capture_logs() as logs:
        task = asyncio.create_task(planner.run())
        await asyncio.sleep(0.1)
        assert executor.attempts == []
        executor.is_ready = True
        await executor.wait_rows(1, within_s=5)
        planner.request_stop()
        await asyncio.wait_for(task, 5)
    assert [e["event"] for e in logs if e["event"].startswith("microbatch_")][:2] == [
        "microbatch_held",
        "microbatch_resumed",
    ]


async def test_slice_closes_at_max_rows_without_waiting_for_the_interval(
    tmp_path: Path, executor: RecordingExecutor, metrics: Metrics
) -> None:
    cfg = MicrobatchConfig(interval_ms=60_000, max_rows=3, catchup_max_rows=10)
    planner, _ = make_planner(tmp_path, executor, metrics, cfg=cfg)
    task = asyncio.create_task(planner.run())
    planner.add(0, [rec(lsn) for lsn in range(1, 4)])
    await executor.wait_rows(3, within_s=5)
    planner.add(0, [rec(lsn) for lsn in range(4, 6)])
    await asyncio.sleep(0.05)
    planner.request_stop()
    await asyncio.wait_for(task, 5)

    assert [b.ranges() for b in executor.committed] == [{0: (1, 3)}]
    assert planner.pending_rows(0) == 2  # under max_rows: waits for the deadline


async def test_backlog_beyond_max_rows_goes_out_whole_in_slices_of_catchup_max_rows(
    tmp_path: Path, executor: RecordingExecutor, metrics: Metrics
) -> None:
    """13 rows piled up (max_rows 3): not four max_rows batches, but the most a
    slice may take (catchup_max_rows 10), then the rest."""
    cfg = MicrobatchConfig(interval_ms=60_000, max_rows=3, catchup_max_rows=10)
    planner, _ = make_planner(tmp_path, executor, metrics, cfg=cfg)
    task = asyncio.create_task(planner.run())
    planner.add(0, [rec(lsn) for lsn in range(1, 14)])
    await executor.wait_rows(13, within_s=5)
    planner.request_stop()
    await asyncio.wait_for(task, 5)

    assert [b.ranges() for b in executor.committed] == [{0: (1, 10)}, {0: (11, 13)}]


async def test_catching_up_core_is_due_at_catchup_max_rows_and_gets_catchup_sized_slices(
    tmp_path: Path, executor: RecordingExecutor, metrics: Metrics
) -> None:
    """4 rows (twice max_rows) of a catching-up core are not due yet; at 7 the
    batch is due and takes catchup_max_rows (5) of them, with the other core's row."""
    cfg = MicrobatchConfig(interval_ms=60_000, max_rows=2, catchup_max_rows=5)
    planner, _ = make_planner(tmp_path, executor, metrics, cfg=cfg)
    planner.set_catching_up(0, True)
    task = asyncio.create_task(planner.run())
    planner.add(0, [rec(lsn) for lsn in range(1, 5)])
    await asyncio.sleep(0.2)
    assert executor.committed == []

    planner.add(1, [rec(8, 1)])  # under max_rows: core 1 makes nothing due
    planner.add(0, [rec(lsn) for lsn in range(5, 8)])
    await executor.wait_rows(5 + 1, within_s=5)
    planner.request_stop()
    await asyncio.wait_for(task, 5)
    assert executor.committed[0].ranges() == {0: (1, 5), 1: (8, 8)}


async def test_pending_bytes_bound_closes_room_until_a_batch_takes_the_rows(
    tmp_path: Path, executor: RecordingExecutor, metrics: Metrics
) -> None:
    bound = 3 * (RECORD_OVERHEAD_BYTES + 100)
    planner, _ = make_planner(tmp_path, executor, metrics, pending_max_bytes=bound)
    planner.add(0, [rec(1, payload=b"x" * 100), rec(2, payload=b"x" * 100)])
    assert planner.has_room(0)
    planner.add(0, [rec(3, payload=b"x" * 100)])
    assert not planner.has_room(0)
    waiter = asyncio.create_task(planner.wait_room(0))
    await asyncio.sleep(0)
    assert not waiter.done()

    await planner.run_once()

    await asyncio.wait_for(waiter, 1)
    assert planner.has_room(0) and planner.pending_bytes(0) == 0


async def test_running_batch_counts_against_the_budget_until_it_commits(
    tmp_path: Path, executor: RecordingExecutor, metrics: Metrics
) -> None:
    """Closing a slice moves its bytes from pending to in flight, not out of the
    budget: room opens only once the batch that holds them commits."""
    bound = 3 * (RECORD_OVERHEAD_BYTES + 100)
    planner, _ = make_planner(tmp_path, executor, metrics, pending_max_bytes=bound)
    executor.stall = asyncio.Event()
    started = asyncio.Event()
    original = executor.execute

    async def execute(batch: MicroBatch) -> None:
        started.set()
        await original(batch)

    executor.execute = execute  # type: ignore[method-assign]
    planner.add(0, [rec(lsn, payload=b"x" * 100) for lsn in (1, 2, 3)])
    running = asyncio.create_task(planner.run_once())
    await asyncio.wait_for(started.wait(), 1)

    assert planner.pending_bytes(0) == 0
    assert planner.inflight_bytes(0) == bound
    assert not planner.has_room(0)
    planner.add(0, [rec(4, payload=b"x" * 100)])
    waiter = asyncio.create_task(planner.wait_room(0))
    await asyncio.sleep(0.01)
    assert not waiter.done()

    executor.stall.set()
    await asyncio.wait_for(running, 1)
    await asyncio.wait_for(waiter, 1)
    assert planner.inflight_bytes(0) == 0
    assert planner.has_room(0) and planner.pending_rows(0) == 1


async def test_planned_batch_is_rerun_after_restart_with_the_same_id_and_rows(
    tmp_path: Path, executor: RecordingExecutor, metrics: Metrics
) -> None:
    """1. Plan and run batches 1 and 2; only batch 1 is covered by persisted watermarks.
    2. Restart: batch 2 is re-run first, same id, rows read back from the WAL.
    3. New rows get batch id 3; consumers resume after batch 2's LSNs."""
    wal = [rec(lsn, lsn % 2) for lsn in range(1, 9)]
    first, _log = make_planner(tmp_path, executor, metrics)
    first.add(0, [r for r in wal[:4] if r.core == 0])
    first.add(1, [r for r in wal[:4] if r.core == 1])
    await first.run_once()
    first.add(0, [r for r in wal[4:] if r.core == 0])
    first.add(1, [r for r in wal[4:] if r.core == 1])
    await first.run_once()
    _log.close()

    again = RecordingExecutor()
    persisted = WatermarkSnapshot("wal-t", 2, 1, (4, 3))
    second, log2 = make_planner(tmp_path, again, Metrics(), wal=wal, persisted=persisted)
    assert (second.resume_lsn(0), second.resume_lsn(1)) == (8, 7)
    assert second.owes(0) and second.owes(1)
    task = asyncio.create_task(second.run())
    await again.wait_rows(4, within_s=5)
    second.add(0, [rec(10, 0)])
    await again.wait_rows(5, within_s=5)
    second.request_stop()
    await asyncio.wait_for(task, 5)
    log2.close()

    assert [b.batch_id for b in again.committed] == [2, 3]
    assert again.committed[0].slices[0].records == executor.committed[1].slices[0].records
    assert again.committed[0].slices[1].records == executor.committed[1].slices[1].records
    assert second.watermarks.lsns == [10, 7]


async def test_rerun_refuses_a_wal_that_does_not_match_the_plan(
    tmp_path: Path, executor: RecordingExecutor, metrics: Metrics
) -> None:
    first, log1 = make_planner(tmp_path, executor, metrics, cores=1)
    first.add(0, [rec(1), rec(2)])
    await first.run_once()
    log1.close()

    second, log2 = make_planner(tmp_path, RecordingExecutor(), Metrics(), cores=1, wal=[rec(2)])
    with pytest.raises(
        PlanMismatchError, match=r"plan says LSN 1\.\.2 but the WAL returned 2\.\.2"
    ):
        await second.run()
    log2.close()


async def test_slices_split_wal_batches_exactly_at_the_row_limit(
    tmp_path: Path, executor: RecordingExecutor, metrics: Metrics
) -> None:
    cfg = MicrobatchConfig(interval_ms=60_000, max_rows=2, catchup_max_rows=4)
    planner, _ = make_planner(tmp_path, executor, metrics, cfg=cfg)
    planner.set_catching_up(0, True)
    planner.add(0, columnar([1, 2, 3]))
    planner.add(0, columnar([4, 5, 6]))
    planner.add(0, [rec(7, seq=7)])

    first = await planner.run_once()
    second = await planner.run_once()

    assert first is not None and second is not None
    assert first.ranges() == {0: (1, 4)} and first.rows == 4
    assert second.ranges() == {0: (5, 7)} and second.rows == 3
    assert [r.lsn for r in [*first.slices[0].records, *second.slices[0].records]] == list(
        range(1, 8)
    )
    assert planner.pending_rows(0) == 0 and planner.pending_bytes(0) == 0


async def test_rows_replayed_by_a_finished_catchup_still_go_out_in_one_catchup_sized_slice(
    tmp_path: Path, executor: RecordingExecutor, metrics: Metrics
) -> None:
    cfg = MicrobatchConfig(interval_ms=60_000, max_rows=2, catchup_max_rows=5)
    planner, _ = make_planner(tmp_path, executor, metrics, cfg=cfg)
    planner.set_catching_up(0, True)
    planner.add(0, columnar([1, 2, 3, 4]))
    planner.set_catching_up(0, False)  # caught up before the slice closed

    first = await planner.run_once()
    planner.add(0, [rec(5), rec(6), rec(7)])
    second = await planner.run_once()

    assert first is not None and first.ranges() == {0: (1, 4)}
    assert second is not None and second.ranges() == {0: (5, 7)}


class PreparingExecutor(RecordingExecutor):
    """A RecordingExecutor that also takes ``prepare`` hints (``daemon.plane.batch.Preparer``)."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared: list[int] = []
        self.committed_when_prepared: list[list[int]] = []
        self.called = asyncio.Event()  # set on every execute and prepare call

    def prepare(self, batch: MicroBatch) -> None:
        self.prepared.append(batch.batch_id)
        self.committed_when_prepared.append([b.batch_id for b in self.committed])
        self.called.set()

    async def execute(self, batch: MicroBatch) -> None:
        self.called.set()
        await super().execute(batch)

    async def wait_until(self, condition: Callable[[], bool], within_s: float = 2.0) -> None:
        async with asyncio.timeout(within_s):
            while not condition():
                self.called.clear()
                await self.called.wait()


async def test_next_batch_is_planned_and_prepared_while_one_runs_and_commits_after_it(
    tmp_path: Path, metrics: Metrics
) -> None:
    """1. Batch 1 (LSN 1-2) runs and stalls in the executor.
    2. Core 0 fills the next slice to the most it may take (catchup_max_rows):
       batch 2 (LSN 3-4) is closed,
       durably planned and handed to ``prepare`` while batch 1 still runs; both
       count against the core's budget; no watermark moved.
    3. Released, batch 1 commits, then batch 2; watermarks follow in order."""
    executor = PreparingExecutor()
    executor.stall = asyncio.Event()
    cfg = MicrobatchConfig(interval_ms=60_000, max_rows=2, catchup_max_rows=2, retry_initial_ms=1)
    planner, plan_log = make_planner(tmp_path, executor, metrics, cfg=cfg)
    rows = [rec(lsn, payload=b"x" * 10) for lsn in range(1, 5)]
    planner.add(0, rows[:2])
    task = asyncio.create_task(planner.run())
    await executor.wait_until(lambda: len(executor.attempts) == 1)

    planner.add(0, rows[2:])
    await executor.wait_until(lambda: executor.prepared == [2])

    assert executor.committed_when_prepared == [[]]
    assert sorted(PlanLog(plan_log.path, "wal-t", 2).open()) == [1, 2]
    assert planner.pending_rows(0) == 0
    assert planner.inflight_bytes(0) == 4 * (RECORD_OVERHEAD_BYTES + 10)
    assert planner.owes(0) and planner.watermarks.lsns == [0, 0]

    executor.stall.set()
    await executor.wait_rows(4, within_s=2)
    planner.request_stop()
    await asyncio.wait_for(task, 2)
    assert [b.batch_id for b in executor.committed] == [1, 2]
    assert [r.lsn for b in executor.committed for r in b.slices[0].records] == [1, 2, 3, 4]
    assert planner.watermarks.lsns == [4, 0] and planner.inflight_bytes(0) == 0
    assert not planner.owes(0)


async def test_a_core_out_of_room_gets_its_next_slice_closed_ahead(
    tmp_path: Path, metrics: Metrics
) -> None:
    """Below max_rows, but the running batch and the new rows use the core's whole
    budget: the slice cannot grow until a commit, so it is closed and prepared now."""
    executor = PreparingExecutor()
    executor.stall = asyncio.Event()
    cfg = MicrobatchConfig(interval_ms=60_000, max_rows=100, retry_initial_ms=1)
    bound = 3 * (RECORD_OVERHEAD_BYTES + 10)
    planner, _ = make_planner(tmp_path, executor, metrics, cfg=cfg, pending_max_bytes=bound)
    planner.add(0, [rec(lsn, payload=b"x" * 10) for lsn in (1, 2, 3)])  # full: closes now
    task = asyncio.create_task(planner.run())
    await executor.wait_until(lambda: len(executor.attempts) == 1)

    planner.add(0, [rec(4, payload=b"x" * 10)])
    await executor.wait_until(lambda: executor.prepared == [2])
    assert not planner.has_room(0)

    executor.stall.set()
    await executor.wait_rows(4, within_s=2)
    planner.request_stop()
    await asyncio.wait_for(task, 2)
    assert [b.ranges() for b in executor.committed] == [{0: (1, 3)}, {0: (4, 4)}]
    assert planner.has_room(0)


async def test_batches_closed_ahead_are_rerun_in_order_after_a_crash(
    tmp_path: Path, metrics: Metrics
) -> None:
    """1. Batch 1 runs (stalled) and batch 2 is closed ahead; the process dies
       (the run task is cancelled, nothing committed).
    2. Restart on the same plan log and WAL: batches 1 and 2 re-run first, in
       order, with their ids and rows; consumers resume after LSN 4."""
    wal = [rec(lsn, payload=b"x" * 10) for lsn in range(1, 5)]
    executor = PreparingExecutor()
    executor.stall = asyncio.Event()
    cfg = MicrobatchConfig(interval_ms=60_000, max_rows=2, catchup_max_rows=2, retry_initial_ms=1)
    first, log1 = make_planner(tmp_path, executor, metrics, cfg=cfg)
    first.add(0, wal[:2])
    task = asyncio.create_task(first.run())
    await executor.wait_until(lambda: len(executor.attempts) == 1)
    first.add(0, wal[2:])
    await executor.wait_until(lambda: executor.prepared == [2])
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    log1.close()
    assert executor.committed == []

    again = RecordingExecutor()
    second, log2 = make_planner(tmp_path, again, Metrics(), cfg=cfg, wal=wal)
    assert second.resume_lsn(0) == 4
    rerun = asyncio.create_task(second.run())
    await again.wait_rows(4, within_s=2)
    second.request_stop()
    await asyncio.wait_for(rerun, 2)
    log2.close()
    assert [(b.batch_id, b.ranges()) for b in again.committed] == [
        (1, {0: (1, 2)}),
        (2, {0: (3, 4)}),
    ]
    assert second.watermarks.lsns == [4, 0]


class _NoteFreed(list):  # type: ignore[type-arg]
    """A ring part that notes which thread frees it."""

    freed_by: list[str] = []
    freed = threading.Event()

    def __del__(self) -> None:
        _NoteFreed.freed_by.append(threading.current_thread().name)
        _NoteFreed.freed.set()


class _Forgetful:
    """Commits at once and keeps nothing (RecordingExecutor keeps every batch)."""

    def __init__(self) -> None:
        self.done = asyncio.Event()

    async def start(self) -> None:
        return None

    def ready(self) -> bool:
        return True

    async def execute(self, batch: MicroBatch) -> None:
        self.done.set()

    async def stop(self) -> None:
        return None


async def test_committed_batch_rows_are_freed_off_the_event_loop(
    tmp_path: Path, metrics: Metrics
) -> None:
    """Freeing 100k records took ~30 ms in one piece; it must not happen on the loop."""
    _NoteFreed.freed_by.clear()
    _NoteFreed.freed.clear()
    executor = _Forgetful()
    planner, _ = make_planner(tmp_path, executor, metrics)  # type: ignore[arg-type]
    planner.add(0, _NoteFreed([rec(1), rec(2)]))
    task = asyncio.create_task(planner.run())
    await asyncio.wait_for(executor.done.wait(), 2)
    assert await asyncio.to_thread(_NoteFreed.freed.wait, 2)
    planner.request_stop()
    await asyncio.wait_for(task, 2)
    await planner.aclose()
    assert _NoteFreed.freed_by == ["eventplane-free"]
    assert planner.watermarks.lsns == [2, 0]


class ClockedExecutor(RecordingExecutor):
    """Each run takes ``run_s`` on the test's clock."""

    def __init__(self, clock: list[float], run_s: float) -> None:
        super().__init__()
        self.clock = clock
        self.run_s = run_s

    async def execute(self, batch: MicroBatch) -> None:
        self.clock[0] += self.run_s
        await super().execute(batch)


async def test_batch_closes_early_by_the_expected_run_time_so_rows_commit_within_the_interval(
    tmp_path: Path, metrics: Metrics
) -> None:
    """1. No run seen yet: the batch is due ``interval`` after its oldest row.
    2. After runs of 0.3 s and 0.2 s, it is due ``interval - 1.25 x 0.3`` after
       the oldest row, on whichever core that row waits."""
    now = [100.0]
    executor = ClockedExecutor(now, run_s=0.3)
    cfg = MicrobatchConfig(interval_ms=1000, max_rows=100)
    planner, _ = make_planner(tmp_path, executor, metrics, cfg=cfg, clock=lambda: now[0])
    assert planner.close_due() is None
    planner.add(0, [rec(1)])
    assert planner.close_due() == pytest.approx(101.0)

    assert await planner.run_once() is not None
    executor.run_s = 0.2
    planner.add(1, [rec(2, core=1)])
    assert await planner.run_once() is not None
    assert planner.expected_run_s() == pytest.approx(RUN_TIME_MARGIN * 0.3)

    now[0] = 200.0
    planner.add(1, [rec(3, core=1)])
    now[0] = 200.5
    planner.add(0, [rec(4)])
    assert planner.close_due() == pytest.approx(200.0 + 1.0 - RUN_TIME_MARGIN * 0.3)


async def test_rows_left_by_a_full_slice_keep_their_delivery_time_for_the_next_deadline(
    tmp_path: Path, metrics: Metrics
) -> None:
    now = [10.0]
    cfg = MicrobatchConfig(interval_ms=1000, max_rows=2, catchup_max_rows=2)
    planner, _ = make_planner(tmp_path, RecordingExecutor(), metrics, cfg=cfg, clock=lambda: now[0])
    planner.add(0, [rec(1), rec(2), rec(3)])
    now[0] = 10.4
    planner.add(0, [rec(4)])
    batch = await planner.run_once()
    assert batch is not None and batch.ranges() == {0: (1, 2)}
    assert planner.close_due() == pytest.approx(11.0)  # LSN 3 came at 10.0, not 10.4


async def test_slow_runs_close_a_burst_in_one_batch_a_quarter_interval_after_its_first_row(
    tmp_path: Path, metrics: Metrics
) -> None:
    """Runs take longer than the 60 s interval, so the expected run is capped at
    it: a batch closed while another runs is due at its first row's delivery
    (``close_due``). With none running, the planner waits a quarter of the
    interval (``IDLE_MIN_WAIT``), not the interval on top of the run, and the
    rows that arrive meanwhile go in the same batch instead of behind a run of
    the first row alone."""
    now = [0.0]
    executor = ClockedExecutor(now, run_s=90.0)
    cfg = MicrobatchConfig(interval_ms=60_000, max_rows=100, retry_initial_ms=1)
    planner, _ = make_planner(tmp_path, executor, metrics, cfg=cfg, clock=lambda: now[0])
    planner.add(0, [rec(1)])
    assert await planner.run_once() is not None
    assert planner.expected_run_s() == 60.0

    task = asyncio.create_task(planner.run())
    planner.add(0, [rec(2)])
    assert planner.close_due() == pytest.approx(90.0)
    assert planner.idle_close_due() == pytest.approx(90.0 + IDLE_MIN_WAIT * 60.0)
    await asyncio.sleep(0.2)
    assert [b.ranges() for b in executor.committed] == [{0: (1, 1)}]  # still waiting

    now[0] = 90.0 + IDLE_MIN_WAIT * 60.0
    planner.add(1, [rec(3, core=1)])  # a core's first row wakes the run loop
    await executor.wait_rows(3, within_s=5)
    planner.request_stop()
    await asyncio.wait_for(task, 5)
    assert [b.ranges() for b in executor.committed] == [{0: (1, 1)}, {0: (2, 2), 1: (3, 3)}]


async def test_a_batch_due_by_its_deadline_while_another_runs_is_closed_and_prepared_ahead(
    tmp_path: Path, metrics: Metrics
) -> None:
    """Batch 1 runs (stalled). One row arrives 2 s after batch 1 closed, and the
    planner's clock says its deadline has passed: batch 2 is closed, planned and
    prepared now, not when batch 1 commits."""
    now = [50.0]
    executor = PreparingExecutor()
    executor.stall = asyncio.Event()
    cfg = MicrobatchConfig(interval_ms=1000, max_rows=2, retry_initial_ms=1)
    planner, _ = make_planner(tmp_path, executor, metrics, cfg=cfg, clock=lambda: now[0])
    planner.add(0, [rec(1), rec(2)])  # full: due now
    task = asyncio.create_task(planner.run())
    await executor.wait_until(lambda: len(executor.attempts) == 1)

    planner.add(0, [rec(3)])
    assert executor.prepared == []  # 1 s to its deadline on the planner's clock
    now[0] += 2.0
    planner.add(1, [rec(4, core=1)])  # wakes the planner, which sees the deadline
    await executor.wait_until(lambda: executor.prepared == [2])
    assert executor.committed == []

    executor.stall.set()
    await executor.wait_rows(4, within_s=2)
    planner.request_stop()
    await asyncio.wait_for(task, 2)
    assert [b.ranges() for b in executor.committed] == [{0: (1, 2)}, {0: (3, 3), 1: (4, 4)}]


def test_small_replayed_parts_are_joined_per_sequence_run_and_keep_every_event() -> None:
    """300 one-event frames, one 300-event frame, then 5 one-event frames after a
    sequence restart: three parts, the events and payloads unchanged, in order."""
    singles = [columnar([lsn], payload=b"e%d" % lsn) for lsn in range(1, 301)]
    big = columnar(list(range(301, 601)), payload=b"big")
    after_restart = [
        RecordBatch(0, array("Q", [lsn]), 1 + i, array("Q", [0, 2]), b"r%d" % i)
        for i, lsn in enumerate(range(601, 606))
    ]
    parts = [*singles, big, *after_restart]

    joined = join_small_parts(parts)

    assert [(len(p), p.first_seq) for p in joined] == [(300, 1), (300, 301), (5, 1)]
    assert joined[1] is big
    events = [r for p in joined for r in p.records()]
    assert events == [r for p in parts for r in p.records()]
    assert sum(map(part_bytes, joined)) < sum(map(part_bytes, parts)) - 290 * 512


class ClockedPreparer(PreparingExecutor):
    """A preparing executor whose runs end ``run_s`` later on the test's clock (after
    ``stall``, when set), and that expects ``prep_s_per_row`` to prepare a row."""

    def __init__(self, clock: list[float], run_s: float, prep_s_per_row: float = 0.0) -> None:
        super().__init__()
        self.clock = clock
        self.run_s = run_s
        self.prep_s_per_row = prep_s_per_row

        self.run_s_of: dict[int, float] = {}  # batch id -> its own run time

    async def execute(self, batch: MicroBatch) -> None:
        await super().execute(batch)
        self.clock[0] += self.run_s_of.get(batch.batch_id, self.run_s)

    def prepare_seconds(self, rows: int) -> float:
        return self.prep_s_per_row * rows


def _add_idle_due(planner: Planner, now: list[float], lsn: int) -> None:
    """Add a row on core 0 and move the clock to where no batch running, it is
    due (``IDLE_MIN_WAIT`` of the 1 s interval later; runs slower than the
    interval have made ``close_due`` its delivery)."""
    planner.add(0, [rec(lsn)])
    now[0] += IDLE_MIN_WAIT * 1.0
    assert planner.idle_close_due() == pytest.approx(now[0])


async def _two_runs_of(planner: Planner, executor: ClockedPreparer) -> None:
    """Give the planner a history of two runs of ``executor.run_s`` each."""
    for lsn in (1, 2):
        planner.add(0, [rec(lsn)])
        assert await planner.run_once() is not None


async def test_next_batch_is_due_when_the_running_one_should_commit_less_its_preparation(
    tmp_path: Path, metrics: Metrics
) -> None:
    """Runs took 2 s and 3 s: a batch is expected to take the shortest, 2 s (a
    late close costs more than an early one). One that should commit at 106
    has the next one due at 106 less the 50 ms margin less its rows'
    preparation (0.1 s a row here), and never before its rows' own deadline."""
    now = [100.0]
    executor = ClockedPreparer(now, run_s=2.0, prep_s_per_row=0.1)
    executor.run_s_of[2] = 3.0
    cfg = MicrobatchConfig(interval_ms=1000, max_rows=100)
    planner, _ = make_planner(tmp_path, executor, metrics, cfg=cfg, clock=lambda: now[0])
    await _two_runs_of(planner, executor)
    assert planner.expected_duration_s() == pytest.approx(2.0)
    assert planner.ahead_due(106.0) is None  # nothing pending

    planner.add(0, [rec(3), rec(4)])
    planner.add(1, [rec(5, core=1)])
    assert planner.ahead_due(106.0) == pytest.approx(106.0 - 0.05 - 0.3)
    # A running batch that should commit soon: the rows' deadline (105, when
    # they came, as runs are slower than the interval) comes later.
    assert planner.close_due() == pytest.approx(105.0)
    assert planner.ahead_due(105.3) == pytest.approx(105.0)


async def test_rows_arriving_while_a_batch_runs_go_into_one_batch_closed_just_before_it_commits(
    tmp_path: Path, metrics: Metrics
) -> None:
    """1. Runs took 2 s; batch 3 starts at 104.25, when its row has waited the
       idle minimum (stalled in the executor).
    2. Three rows come, more than max_rows (2): before, the next batch closed at
       once; now nothing closes while batch 3 is not near its commit (106.25).
    3. At 106.21 (after 106.25 less the 50 ms margin) batch 4 closes with every
       row pending, and is prepared; it commits after batch 3."""
    now = [100.0]
    executor = ClockedPreparer(now, run_s=2.0)
    cfg = MicrobatchConfig(interval_ms=1000, max_rows=2, catchup_max_rows=100)
    planner, _ = make_planner(tmp_path, executor, metrics, cfg=cfg, clock=lambda: now[0])
    await _two_runs_of(planner, executor)
    assert now[0] == 104.0
    executor.stall = asyncio.Event()
    _add_idle_due(planner, now, 3)
    task = asyncio.create_task(planner.run())
    await executor.wait_until(lambda: len(executor.attempts) == 3)

    planner.add(0, [rec(4), rec(5), rec(6)])  # over max_rows: wakes the planner
    now[0] = 106.15
    planner.add(1, [rec(7, core=1)])  # wakes it again, 10 ms before its time
    await asyncio.sleep(0.05)
    assert executor.prepared == []

    now[0] = 106.21
    planner.add(1, [rec(8, core=1)])
    await executor.wait_until(lambda: executor.prepared == [4])
    assert executor.committed_when_prepared == [[1, 2]]
    planner.add(0, [rec(9)])  # after the close: the batch after

    executor.stall.set()
    await executor.wait_rows(9, within_s=2)
    planner.request_stop()
    await asyncio.wait_for(task, 2)
    assert [b.ranges() for b in executor.committed[2:]] == [
        {0: (3, 3)},
        {0: (4, 6), 1: (7, 8)},
        {0: (9, 9)},
    ]


async def test_a_batch_that_commits_sooner_than_expected_has_the_next_one_closed_at_its_commit(
    tmp_path: Path, metrics: Metrics
) -> None:
    """Runs took 2 s, but batch 3 commits 0.5 s after it started: the rows that
    came meanwhile were not closed ahead (not prepared); they go out right after
    the commit, in one batch."""
    now = [100.0]
    executor = ClockedPreparer(now, run_s=2.0)
    cfg = MicrobatchConfig(interval_ms=1000, max_rows=2, catchup_max_rows=100)
    planner, _ = make_planner(tmp_path, executor, metrics, cfg=cfg, clock=lambda: now[0])
    await _two_runs_of(planner, executor)
    executor.stall = asyncio.Event()
    executor.run_s = 0.0
    _add_idle_due(planner, now, 3)
    task = asyncio.create_task(planner.run())
    await executor.wait_until(lambda: len(executor.attempts) == 3)
    planner.add(0, [rec(4), rec(5), rec(6)])
    now[0] = 104.75
    planner.add(1, [rec(7, core=1)])
    await asyncio.sleep(0.05)
    assert executor.prepared == []

    executor.stall.set()
    await executor.wait_rows(7, within_s=2)
    planner.request_stop()
    await asyncio.wait_for(task, 2)
    assert executor.prepared == []
    assert [b.ranges() for b in executor.committed[2:]] == [{0: (3, 3)}, {0: (4, 6), 1: (7, 7)}]


async def test_a_slice_at_catchup_max_rows_is_closed_ahead_at_once_whatever_the_expected_commit(
    tmp_path: Path, metrics: Metrics
) -> None:
    """The next batch cannot take more of a core than catchup_max_rows (3): at that
    size it is closed and prepared at once, long before the running one should
    commit, and the rows after it wait for the batch after."""
    now = [100.0]
    executor = ClockedPreparer(now, run_s=2.0)
    cfg = MicrobatchConfig(interval_ms=1000, max_rows=2, catchup_max_rows=3)
    planner, _ = make_planner(tmp_path, executor, metrics, cfg=cfg, clock=lambda: now[0])
    await _two_runs_of(planner, executor)
    executor.stall = asyncio.Event()
    _add_idle_due(planner, now, 3)
    task = asyncio.create_task(planner.run())
    await executor.wait_until(lambda: len(executor.attempts) == 3)
    planner.add(0, [rec(4), rec(5), rec(6), rec(7)])
    await executor.wait_until(lambda: executor.prepared == [4])
    assert now[0] == 104.25

    executor.stall.set()
    await executor.wait_rows(7, within_s=2)
    planner.request_stop()
    await asyncio.wait_for(task, 2)
    assert [b.ranges() for b in executor.committed[2:]] == [
        {0: (3, 3)},
        {0: (4, 6)},
        {0: (7, 7)},
    ]


async def test_a_prepared_batch_is_expected_to_take_as_long_as_prepared_ones_did_not_the_others(
    tmp_path: Path, metrics: Metrics
) -> None:
    """Batch 1 built its input in its run (2 s); batch 2 was closed ahead and
    prepared (0.5 s). A prepared batch is expected to take 0.5 s, another one
    2 s: mixed, the slow runs would make prepared batches look slower, and their
    successors close after them, unprepared."""
    now = [100.0]
    executor = ClockedPreparer(now, run_s=2.0)
    executor.run_s_of[2] = 0.5
    executor.stall = asyncio.Event()
    cfg = MicrobatchConfig(interval_ms=1000, max_rows=2, catchup_max_rows=2)
    planner, _ = make_planner(tmp_path, executor, metrics, cfg=cfg, clock=lambda: now[0])
    planner.add(0, [rec(1), rec(2)])  # due at once: max_rows
    task = asyncio.create_task(planner.run())
    await executor.wait_until(lambda: len(executor.attempts) == 1)
    planner.add(0, [rec(3), rec(4)])  # a full slice: closed ahead at once
    await executor.wait_until(lambda: executor.prepared == [2])
    executor.stall.set()
    await executor.wait_rows(4, within_s=2)
    planner.request_stop()
    await asyncio.wait_for(task, 2)

    assert planner.expected_duration_s(prepared=True) == pytest.approx(0.5)
    assert planner.expected_duration_s(prepared=False) == pytest.approx(2.0)
