"""EventPlane end to end: WAL -> rings -> consumers -> planner -> executor -> watermarks."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import structlog
from structlog.testing import capture_logs

import daemon.plane.consumer as consumer_module
from daemon.config import Config
from daemon.errors import ConsumerFailedError, IdentityMismatchError
from daemon.plane.consumer import Mode
from daemon.plane.eventplane import EventPlane
from daemon.plane.watermarks import WatermarkStore
from daemon.service.metrics import Metrics
from tests.core.conftest import MakeConfig, RecordingExecutor
from wal import Wal, WalReadError
from wal.record import Record


class Harness:
    """One plane over one real WAL (real files, real fsync), with helpers."""

    def __init__(self, cfg: Config, wal: Wal, executor: RecordingExecutor) -> None:
        self.cfg = cfg
        self.wal = wal
        self.executor = executor
        self.metrics = Metrics()
        self.plane = EventPlane(cfg, wal, executor, self.metrics)
        wal.set_batch_listener(self.plane.on_durable_batches)

    async def feed(self, items: list[tuple[int, bytes]]) -> tuple[int, int]:
        return await self.wal.append(items)

    async def until(self, predicate: Callable[[], bool], within_s: float = 20.0) -> None:
        async with asyncio.timeout(within_s):
            while not predicate():  # noqa: ASYNC110 - polling plane state from outside
                await asyncio.sleep(0.002)

    async def normal(self) -> None:
        """Wait until every consumer finished its boot catch-up."""
        await self.until(lambda: all(c.mode is Mode.NORMAL for c in self.plane.consumers))

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def by_core(self) -> dict[int, list[Record]]:
        out: dict[int, list[Record]] = {}
        for r in self.wal.read(self.wal.retained_floor()):
            out.setdefault(r.core, []).append(r)
        return out

    async def crash(self) -> None:
        """Stop everything without the orderly drain and flush (like SIGKILL)."""
        tasks = list(self.plane._tasks.values())
        self.plane._state = "stopped"
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        self.plane._plan_log.close()
        await self.wal.aclose()


@pytest.fixture
async def harnesses() -> AsyncIterator[list[Harness]]:
    made: list[Harness] = []
    yield made
    for h in made:
        if h.plane._state == "running":
            await h.plane.stop(5)
        await h.wal.aclose()


MakeHarness = Callable[..., Harness]


@pytest.fixture
def make_harness(make_config: MakeConfig, harnesses: list[Harness], tmp_path: Path) -> MakeHarness:
    """A plane on a real WAL in ``wal_dir`` (default: shared by the test's harnesses)."""

    def make(
        wal_dir: Path | None = None, executor: RecordingExecutor | None = None, **overrides: Any
    ) -> Harness:
        cfg = make_config(**overrides)
        w = cfg.wal
        wal = Wal.open(
            wal_dir or tmp_path / "wal",
            segment_bytes=w.segment_bytes,
            fsync=w.fsync,
            fsync_interval_ms=w.fsync_interval_ms,
            max_group_bytes=w.max_group_bytes,
        )
        h = Harness(cfg, wal, executor or RecordingExecutor())
        harnesses.append(h)
        return h

    return make


def keys(per_core: dict[int, list[Record]]) -> dict[int, list[tuple[int, bytes]]]:
    return {c: [(r.lsn, r.payload) for r in rs] for c, rs in per_core.items()}


# ---------------------------------------------------------------------------


async def run_10k(make_harness: MakeHarness, tmp_path: Path, ring_capacity: int) -> Harness:
    """Feed the same 10,000 events, in the same groups, and wait for all of them."""
    rnd = random.Random(20240611)
    # A tiny ring also gets a tiny byte bound, so drops happen with room left
    # by count: that makes sequence gaps, not only full-ring suspensions.
    h = make_harness(
        wal_dir=tmp_path / f"wal-{ring_capacity}",
        data_dir=tmp_path / f"ring-{ring_capacity}",
        ring_capacity=ring_capacity,
        ring_max_bytes=200 if ring_capacity < 16 else 64 << 20,
        max_rows=500,
    )
    await h.plane.start()
    sent = 0
    while sent < 10_000:
        n = min(rnd.choice((1, 1, 2, 3, 5, 8, 40)), 10_000 - sent)
        items = []
        for i in range(n):
            size = 150 if rnd.random() < 0.2 else 5
            items.append((rnd.randrange(4), f"{sent + i:05d}".encode().ljust(size, b".")))
        await h.feed(items)
        sent += n
        if rnd.random() < 0.3:
            await asyncio.sleep(rnd.choice((0, 0, 0.001)))
    await h.executor.wait_rows(10_000)
    await h.plane.stop(5)
    return h


async def test_same_10k_events_through_ring_of_4_and_ring_of_65536_give_identical_executor_input(
    make_harness: MakeHarness, tmp_path: Path
) -> None:
    tiny = await run_10k(make_harness, tmp_path, 4)
    large = await run_10k(make_harness, tmp_path, 65_536)

    expected = keys(tiny.by_core())
    assert keys(tiny.executor.per_core()) == expected  # each event once, LSN order per core
    assert keys(large.executor.per_core()) == expected
    assert keys(large.by_core()) == expected  # the same input both times
    assert tiny.executor.rows_seen == large.executor.rows_seen == 10_000

    def entries(h: Harness, reason: str) -> float:
        return sum(
            h.sample("eventplane_consumer_catchup_entries_total", core=str(c), reason=reason)
            for c in range(4)
        )

    drops = sum(tiny.sample("eventplane_ring_dropped_events_total", core=str(c)) for c in range(4))
    assert drops > 1000
    assert entries(tiny, "gap") > 0
    assert entries(tiny, "tail_drop") > 0
    assert entries(tiny, "backpressure") > 0
    assert (
        sum(large.sample("eventplane_ring_dropped_events_total", core=str(c)) for c in range(4))
        == 0
    )
    assert entries(large, "gap") == entries(large, "tail_drop") == 0


def merged_logs() -> Any:
    """capture_logs with contextvars merged, so ``core`` bound by a task shows."""
    return capture_logs(processors=[structlog.contextvars.merge_contextvars])


async def test_boot_enters_catchup_from_watermark_and_logs_each_transition_with_core(
    make_harness: MakeHarness,
) -> None:
    h = make_harness(cores=2)
    await h.feed([(0, b"a"), (1, b"b"), (0, b"c")])  # before start: only the WAL has them
    with merged_logs() as logs:
        await h.plane.start()
        await h.executor.wait_rows(3)
        await h.normal()
    modes = [e for e in logs if e["event"] == "consumer_mode_changed"]
    boot = {e["core"]: e for e in modes if e["reason"] == "boot"}
    assert set(boot) == {0, 1}
    assert all(e["mode"] == "catchup" and e["lsn"] == 0 for e in boot.values())
    caught_up = {e["core"]: e for e in modes if e["reason"] == "caught_up"}
    assert caught_up[0]["replayed"] == 2 and caught_up[1]["replayed"] == 1
    assert keys(h.executor.per_core()) == {0: [(1, b"a"), (3, b"c")], 1: [(2, b"b")]}


async def test_tail_drop_is_detected_and_the_dropped_event_delivered(
    make_harness: MakeHarness,
) -> None:
    """1. The ring holds 100 bytes; fill stays low, so backpressure stays Normal.
    2. A 10-byte event fits, the 95-byte event after it does not: it is dropped,
       and nothing comes after it (a tail drop, not a sequence gap).
    3. The consumer takes the first, sees the ring empty with ``emitted`` ahead,
       catches up from the WAL, and delivers the dropped event once."""
    h = make_harness(cores=1, ring_capacity=1000, ring_max_bytes=100)
    await h.plane.start()
    await h.normal()
    with merged_logs() as logs:
        await h.feed([(0, b"s" * 10), (0, b"B" * 95)])
        await h.executor.wait_rows(2)
    assert h.plane.rings[0].dropped == 1
    assert h.plane.rings[0].state.name == "NORMAL"
    reasons = [e["reason"] for e in logs if e["event"] == "consumer_mode_changed"]
    assert reasons == ["tail_drop", "caught_up"]
    assert keys(h.executor.per_core()) == {0: [(1, b"s" * 10), (2, b"B" * 95)]}
    assert h.sample("eventplane_consumer_catchup_entries_total", core="0", reason="tail_drop") == 1
    assert h.sample("eventplane_consumer_replayed_events_total", core="0") == 1


async def test_suspended_backpressure_enters_catchup_and_loses_nothing(
    make_harness: MakeHarness,
) -> None:
    h = make_harness(cores=1, ring_capacity=100)
    await h.plane.start()
    await h.normal()
    with merged_logs() as logs:
        await h.feed([(0, b"%d" % i) for i in range(96)])  # one group: 96 % fill
        assert h.plane.rings[0].state.name == "SUSPENDED"
        await h.executor.wait_rows(96)
    entered = [e for e in logs if e["event"] == "consumer_mode_changed" and e["mode"] == "catchup"]
    assert [(e["reason"], e["core"]) for e in entered] == [("backpressure", 0)]
    assert [r.payload for r in h.executor.per_core()[0]] == [b"%d" % i for i in range(96)]
    assert h.plane.rings[0].state.name == "NORMAL"  # stale entries dropped after catch-up
    assert h.sample("eventplane_backpressure_transitions_total", core="0", to="suspended") == 1


async def test_pending_memory_budget_sends_consumer_to_catchup_and_loses_nothing(
    make_harness: MakeHarness,
) -> None:
    """1. The executor is not ready, so batches are held and pending slices grow.
    2. At the pending-bytes budget the consumer leaves Normal for CatchUp (memory)
       and waits for room instead of buffering more.
    3. Once the executor is ready, everything arrives once, in order."""
    h = make_harness(cores=1, pending_max_bytes=4096, max_rows=10)
    h.executor.is_ready = False
    await h.plane.start()
    await h.normal()
    with merged_logs() as logs:
        for i in range(0, 200, 10):
            await h.feed([(0, b"%03d" % (i + j)) for j in range(10)])
            await asyncio.sleep(0.002)
        await h.until(lambda: h.plane.consumers[0].mode is Mode.CATCHUP)
        assert h.plane.planner is not None
        assert h.plane.planner.pending_bytes(0) < 4096 + 200 * 170
        h.executor.is_ready = True
        await h.executor.wait_rows(200)
    reasons = [e["reason"] for e in logs if e["event"] == "consumer_mode_changed"]
    assert reasons[0] == "memory"
    assert [r.payload for r in h.executor.per_core()[0]] == [b"%03d" % i for i in range(200)]


async def test_idle_cores_heartbeat_so_watermarks_and_retention_move(
    make_harness: MakeHarness,
) -> None:
    h = make_harness()
    await h.plane.start()
    await h.feed([(0, b"only core 0")] * 5)
    await h.executor.wait_rows(5)
    with mock.patch.object(h.wal, "truncate_below", wraps=h.wal.truncate_below) as truncate:
        await h.until(lambda: h.plane.watermarks is not None and min(h.plane.watermarks.lsns) == 5)
        snap = await h.plane.flush()
    assert snap is not None and snap.lsns == (5, 5, 5, 5)
    truncate.assert_called_with(6)


async def test_retention_removes_segments_below_the_watermarks_and_replay_still_works(
    make_harness: MakeHarness, tmp_path: Path
) -> None:
    """1. Tiny segments: 300 events span many of them.
    2. Once committed and flushed, sealed segments below the watermarks go.
    3. After a restart every core replays from its watermark + 1 without error."""
    h = make_harness(cores=2, segment_bytes=4096, watermark_flush_ms=3_600_000)
    await h.plane.start()
    for i in range(30):
        await h.feed([(j % 2, b"%04d" % (i * 10 + j) + b"." * 60) for j in range(10)])
    await h.executor.wait_rows(300)
    await h.until(lambda: h.plane.watermarks is not None and h.plane.watermarks.lsns == [299, 300])
    await h.plane.flush()
    # 300 events of ~80 bytes filled several 4 KiB segments; only the last one
    # or two stay (a flush after a catch-up may have removed some already).
    assert h.wal.segment_count() <= 2
    assert 1 < h.wal.retained_floor() <= 300
    await h.plane.stop(5)
    await h.wal.aclose()

    again = make_harness(cores=2, segment_bytes=4096)
    await again.plane.start()
    await again.feed([(0, b"new"), (1, b"new")])
    await again.executor.wait_rows(2)
    assert again.plane.failure is None
    assert [r.lsn for rs in again.executor.per_core().values() for r in rs] == [301, 302]


async def test_executor_failures_are_retried_with_the_same_id_and_nothing_is_dropped(
    make_harness: MakeHarness,
) -> None:
    h = make_harness(cores=2)
    h.executor.fail_next = 4
    await h.plane.start()
    await h.feed([(0, b"a"), (1, b"b")])
    await h.executor.wait_rows(2)
    ids = [b.batch_id for b in h.executor.attempts]
    assert ids == [ids[0]] * 5
    assert {b.ranges()[0] for b in h.executor.attempts} == {(1, 1)}
    assert h.plane.status()["last_batch"]["attempts"] == 5


async def test_restart_before_watermarks_persisted_reruns_uncommitted_batches_same_ids_and_rows(
    make_harness: MakeHarness,
) -> None:
    """1. Feed 20 events, let them commit, flush the watermarks (batch B).
    2. Feed 20 more; they commit, but the process dies before the next flush.
    3. Restart on the same WAL and data_dir: the batches after B run again with
       the same ids and rows; no event at or below the flushed watermarks does."""
    first = make_harness(cores=2, watermark_flush_ms=3_600_000)
    await first.plane.start()
    await first.feed([(i % 2, b"a%d" % i) for i in range(20)])
    await first.executor.wait_rows(20)
    flushed = await first.plane.flush()
    assert flushed is not None
    await first.feed([(i % 2, b"b%d" % i) for i in range(20)])
    await first.executor.wait_rows(40)
    await first.crash()
    unpersisted = [b for b in first.executor.committed if b.batch_id > flushed.batch_id]
    assert unpersisted

    second = make_harness(cores=2, watermark_flush_ms=3_600_000)
    with merged_logs() as logs:
        await second.plane.start()
        await second.executor.wait_rows(20)
        await asyncio.sleep(0.05)  # nothing else may arrive

    assert [b.batch_id for b in second.executor.committed] == [b.batch_id for b in unpersisted]
    for again, before in zip(second.executor.committed, unpersisted, strict=True):
        assert again.ranges() == before.ranges()
        assert {c: list(s.records) for c, s in again.slices.items()} == {
            c: list(s.records) for c, s in before.slices.items()
        }
    delivered = [r for rs in second.executor.per_core().values() for r in rs]
    assert min(r.lsn for r in delivered) > min(flushed.lsns)
    assert all(r.payload.startswith(b"b") for r in delivered)
    reruns = [e["batch_id"] for e in logs if e["event"] == "microbatch_rerun"]
    assert reruns == [b.batch_id for b in unpersisted]


async def test_watermarks_of_another_wal_refuse_to_start(
    make_harness: MakeHarness, tmp_path: Path
) -> None:
    first = make_harness(wal_dir=tmp_path / "wal-one")
    await first.plane.start()
    await first.plane.stop(5)

    second = make_harness(wal_dir=tmp_path / "wal-two")
    with pytest.raises(IdentityMismatchError) as info:
        await second.plane.start()
    assert f"belongs to WAL {first.wal.wal_id}" in str(info.value)
    assert f"has id {second.wal.wal_id}" in str(info.value)


async def test_changed_core_count_refuses_to_start(make_harness: MakeHarness) -> None:
    first = make_harness(cores=4)
    await first.plane.start()
    await first.plane.stop(5)
    await first.wal.aclose()

    second = make_harness(cores=8)
    with pytest.raises(IdentityMismatchError, match=r"daemon\.cores = 4.*now says 8"):
        await second.plane.start()


async def test_retention_never_deletes_what_a_watermark_or_running_plan_needs(
    make_harness: MakeHarness,
) -> None:
    """1. Core 0's batch stalls in the executor: it is planned, not committed.
    2. Other cores move on and heartbeat; watermarks flush.
    3. Retention stays below core 0's first planned LSN until the batch commits."""
    h = make_harness(cores=2)
    h.executor.stall = asyncio.Event()
    await h.plane.start()
    await h.feed([(0, b"x")] * 3)  # LSN 1..3
    await h.until(lambda: bool(h.executor.attempts))
    await h.feed([(1, b"y")] * 3)  # LSN 4..6
    with mock.patch.object(h.wal, "truncate_below", wraps=h.wal.truncate_below) as truncate:
        await h.plane.flush()
        assert all(c.args[0] <= 1 for c in truncate.call_args_list)  # core 0 still needs 1..3

        h.executor.stall.set()
        await h.executor.wait_rows(6)
        await h.until(lambda: h.plane.watermarks is not None and h.plane.watermarks.lsns == [6, 6])
        await h.plane.flush()
    truncate.assert_called_with(7)


async def test_replay_errors_are_retried_then_stop_the_daemon_with_a_clear_error(
    make_harness: MakeHarness,
) -> None:
    h = make_harness(cores=1, replay_retries=3)
    await h.feed([(0, b"x")])
    failing = mock.patch.object(h.wal, "read_batches", side_effect=WalReadError("EIO on segment 1"))
    with failing, merged_logs() as logs:
        await h.plane.start()
        error = await asyncio.wait_for(h.plane.wait_failed(), 5)
    assert isinstance(error, ConsumerFailedError)
    assert "replay from LSN 1 failed 4 times" in str(error)
    assert "EIO on segment" in str(error)
    retries = [e for e in logs if e["event"] == "replay_retry"]
    assert [e["attempt"] for e in retries] == [1, 2, 3]
    assert all(e["core"] == 0 for e in retries)
    assert h.executor.rows_seen == 0


async def test_replay_error_that_clears_within_the_retries_loses_nothing(
    make_harness: MakeHarness,
) -> None:
    h = make_harness(cores=1, replay_retries=3)
    await h.feed([(0, b"x"), (0, b"y")])
    real = h.wal.read_batches
    effects = [WalReadError("transient"), WalReadError("transient")]

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if effects:
            raise effects.pop(0)
        return real(*args, **kwargs)

    with mock.patch.object(h.wal, "read_batches", side_effect=flaky):
        await h.plane.start()
        await h.executor.wait_rows(2)
    assert h.plane.failure is None
    assert [r.payload for r in h.executor.per_core()[0]] == [b"x", b"y"]


async def test_replay_below_the_retained_floor_stops_at_once_naming_both_lsns(
    make_harness: MakeHarness,
) -> None:
    h = make_harness(cores=1, replay_retries=50, segment_bytes=4096)
    for _ in range(20):
        await h.feed([(0, b"." * 100)] * 5)
    assert h.wal.truncate_below(50) > 0  # retention ran ahead of the (zero) watermark
    floor = h.wal.retained_floor()
    with merged_logs() as logs:
        await h.plane.start()
        error = await asyncio.wait_for(h.plane.wait_failed(), 5)
    assert isinstance(error, ConsumerFailedError)
    assert "must replay from LSN 1" in str(error)
    assert f"retained floor is LSN {floor}" in str(error)
    assert not [e for e in logs if e["event"] == "replay_retry"]


async def test_stop_lets_the_running_batch_finish_within_the_budget(
    make_harness: MakeHarness,
) -> None:
    h = make_harness(cores=1)
    h.executor.stall = asyncio.Event()
    await h.plane.start()
    await h.feed([(0, b"x")])
    await h.until(lambda: bool(h.executor.attempts))
    asyncio.get_running_loop().call_later(0.05, h.executor.stall.set)

    await h.plane.stop(5)

    assert h.executor.rows_seen == 1
    assert h.plane.watermarks is not None and h.plane.watermarks.persisted.lsns == (1,)


async def test_stop_cuts_a_stalled_batch_at_the_budget_and_it_reruns_after_restart(
    make_harness: MakeHarness,
) -> None:
    h = make_harness(cores=1)
    h.executor.stall = asyncio.Event()
    await h.plane.start()
    await h.feed([(0, b"x")])
    await h.until(lambda: bool(h.executor.attempts))
    loop = asyncio.get_running_loop()
    started = loop.time()
    with merged_logs() as logs:
        await h.plane.stop(0.2)
    assert loop.time() - started < 1.5
    assert any(e["event"] == "microbatch_cut_short" for e in logs)
    await h.wal.aclose()

    again = make_harness(cores=1)
    await again.plane.start()
    await again.executor.wait_rows(1)
    assert [b.batch_id for b in again.executor.committed] == [h.executor.attempts[0].batch_id]


async def test_an_executor_leaking_cancellation_stops_the_daemon_instead_of_batching_silently(
    make_harness: MakeHarness,
) -> None:
    h = make_harness(cores=1)

    async def cancelled(batch: Any) -> None:
        raise asyncio.CancelledError

    h.executor.execute = cancelled  # type: ignore[method-assign]
    await h.plane.start()
    await h.feed([(0, b"x")])
    error = await asyncio.wait_for(h.plane.wait_failed(), 5)
    assert "planner: cancelled while the plane was running" in str(error)


async def test_status_reports_mode_watermark_lag_ring_and_last_batch(
    make_harness: MakeHarness,
) -> None:
    h = make_harness(cores=2)
    await h.plane.start()
    await h.feed([(0, b"abc"), (0, b"d")])
    await h.executor.wait_rows(2)
    await h.until(lambda: h.plane.max_lag() == 0)
    status = h.plane.status()
    assert status["head_lsn"] == 2
    core0 = status["cores"][0]
    assert core0["mode"] == "normal" and core0["watermark"] == 2 and core0["lag"] == 0
    assert core0["backpressure"] == "normal" and core0["ring"]["events"] == 0
    assert core0["catchup"] is None
    assert status["last_batch"]["state"] == "committed"
    assert 0 <= status["expected_run_s"] <= 0.01  # capped at interval_ms (10 ms)
    assert status["failure"] is None


async def test_status_shows_catchup_progress_while_replaying(
    make_harness: MakeHarness,
) -> None:
    h = make_harness(cores=1, pending_max_bytes=2048)
    h.executor.is_ready = False  # catch-up stalls on the pending budget
    for _ in range(50):  # one WAL frame each: replay reads them one by one
        await h.feed([(0, b"z" * 100)])
    await h.plane.start()

    def catchup() -> Any:
        return h.plane.status()["cores"][0]["catchup"]

    await h.until(lambda: catchup() is not None and catchup()["replayed"] > 0)
    await asyncio.sleep(0.02)  # the budget holds it here: the executor is not ready
    progress = catchup()
    assert progress["reason"] == "boot"
    assert 0 < progress["replayed"] < 50
    assert progress["remaining_lsns"] == 50 - progress["replayed"]
    assert progress["rate"] > 0 and progress["eta_s"] is not None
    h.executor.is_ready = True
    await h.executor.wait_rows(50)


async def test_max_lag_counts_events_not_yet_committed_by_the_slowest_core(
    make_harness: MakeHarness,
) -> None:
    h = make_harness(cores=2)
    h.executor.stall = asyncio.Event()
    await h.plane.start()
    await h.feed([(0, b"x")] * 7)
    assert h.plane.max_lag() == 7
    h.executor.stall.set()
    await h.until(lambda: h.plane.max_lag() == 0)


async def test_adaptive_poll_backs_off_after_the_configured_empty_polls(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """Injected sleep: the idle consumer sleeps poll_min 32 times, then poll_max."""
    cfg = make_config(cores=1, poll_min_ms=1.0, poll_max_ms=50.0, idle_polls_before_backoff=32)
    sleeps: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)
        await asyncio.sleep(0)

    wal = Wal.open(tmp_path / "wal", segment_bytes=1 << 20)
    try:
        plane = EventPlane(cfg, wal, RecordingExecutor(), Metrics(), sleep=fake_sleep)
        wal.set_batch_listener(plane.on_durable_batches)
        await plane.start()
        async with asyncio.timeout(5):
            while len(sleeps) < 40:  # noqa: ASYNC110
                await asyncio.sleep(0.001)
        polls = sleeps[:40]
        assert polls == [0.001] * 32 + [0.05] * 8
        await wal.append([(0, b"wake")])
        count = len(sleeps)
        async with asyncio.timeout(5):
            while len(sleeps) < count + 3:  # noqa: ASYNC110
                await asyncio.sleep(0.001)
        assert 0.001 in sleeps[count:]  # a delivery resets the backoff
        await plane.stop(5)
    finally:
        await wal.aclose()


async def test_watermarks_are_flushed_as_soon_as_a_catchup_is_committed(
    make_harness: MakeHarness,
) -> None:
    """1. 30 events wait in the WAL before start; the periodic flush is an hour away.
    2. The boot catch-up replays them; once the batch holding its end commits,
       watermarks.json already says so (a crash would not repeat the replay)."""
    h = make_harness(cores=1, watermark_flush_ms=3_600_000)
    await h.feed([(0, b"e%d" % i) for i in range(30)])
    await h.plane.start()
    await h.executor.wait_rows(30)
    store = WatermarkStore(h.cfg.data_dir / "watermarks.json")
    await h.until(lambda: store.load(h.wal.wal_id, 1).lsns == (30,))


async def test_long_catchup_logs_replayed_rate_and_eta_at_a_steady_cadence(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the cadence at zero every replayed chunk logs its progress line."""
    monkeypatch.setattr(consumer_module, "PROGRESS_LOG_S", 0.0)
    h = make_harness(cores=1)
    for _ in range(20):
        await h.feed([(0, b"p" * 100)])
    with structlog.testing.capture_logs() as logs:
        await h.plane.start()
        await h.executor.wait_rows(20)
    lines = [e for e in logs if e["event"] == "catchup_progress"]
    assert lines, "no catchup_progress line during a boot catch-up"
    last = lines[-1]
    assert last["reason"] == "boot" and last["replayed"] > 0
    assert {"rate", "eta_s", "remaining_lsns"} <= last.keys()
