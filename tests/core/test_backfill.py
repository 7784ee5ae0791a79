"""A new CDC stream fills from the retained WAL, then joins the live batches
(docs/cdc.md, "Adding a stream: backfill"), at the planner level."""

from __future__ import annotations

import asyncio
from collections import Counter
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from daemon.config import MicrobatchConfig
from daemon.errors import ExecutorError, LsnRegressionError
from daemon.plane.batch import InFlight, MicroBatch
from daemon.plane.planlog import PlanLog
from daemon.plane.planner import BackfillError, Planner
from daemon.plane.watermarks import Watermarks, WatermarkSnapshot
from daemon.service.metrics import Metrics
from tests.core.conftest import StagedExecutor, rec
from wal.record import Record

CORES = 2
MAX_ROWS = 3
CFG = MicrobatchConfig(interval_ms=10, retry_initial_ms=1, retry_max_ms=4, max_rows=MAX_ROWS)


class LedgerExecutor(StagedExecutor):
    """Stages with a CDC ledger each, checked like ``daemon.table.parquet.CdcSink``:
    a committed id must come back with the same ranges (and writes nothing),
    a new id must start every core above what the ledger holds."""

    def __init__(self, starts: dict[str, str | int]) -> None:
        super().__init__(("cdc:a", "cdc:b"))
        self.starts = starts
        # stage -> [(batch id, ranges)], and every LSN written, in order.
        self.ledgers: dict[str, list[tuple[int, dict[int, tuple[int, int]]]]] = {
            n: [] for n in self.names
        }
        self.rows: dict[str, list[int]] = {n: [] for n in self.names}
        # stage -> [(batch id, rows of each core's slice)]
        self.sizes: dict[str, list[tuple[int, list[int]]]] = {n: [] for n in self.names}

    def stream_start(self, stage: str) -> str | int | None:
        return self.starts.get(stage, "head")

    def stream_position(self, stage: str) -> tuple[int, dict[int, int]]:
        ledger = self.ledgers[stage]
        high: dict[int, int] = {}
        for _, ranges in ledger:
            for core, (_, last) in ranges.items():
                high[core] = max(high.get(core, 0), last)
        return (ledger[-1][0] if ledger else 0), high

    async def execute(  # type: ignore[override]
        self, batch: MicroBatch, stages: Any = None
    ) -> dict[str, BaseException]:
        failures = await super().execute(batch, stages)
        for name in self.names if stages is None else stages:
            if name in failures:
                continue
            ledger = self.ledgers[name]
            last_id, high = self.stream_position(name)
            if batch.batch_id <= last_id:
                old = dict(ledger).get(batch.batch_id)
                if old is not None and old != batch.ranges():
                    raise ExecutorError(f"{name}: batch {batch.batch_id} changed ranges")
                continue
            for core, (first, _) in batch.ranges().items():
                if first <= high.get(core, 0):
                    raise LsnRegressionError(f"{name}: batch {batch.batch_id} core {core}")
            ledger.append((batch.batch_id, batch.ranges()))
            self.sizes[name].append((batch.batch_id, [s.rows for s in batch.slices.values()]))
            self.rows[name].extend(r.lsn for s in batch.slices.values() for r in s.records)
        return failures


def make(
    tmp_path: Path,
    executor: StagedExecutor,
    wal: list[Record],
    persisted: WatermarkSnapshot | None = None,
    floor: int = 1,
) -> Planner:
    plan_log = PlanLog(tmp_path / "plans.log", "wal-t", CORES)
    plans = plan_log.open()
    wm = Watermarks(persisted or WatermarkSnapshot("wal-t", CORES, 0, (0,) * CORES))

    async def load_slice(core: int, first: int, last: int) -> list[list[Record]]:
        return [[r for r in wal if r.core == core and first <= r.lsn <= last]]

    return Planner(
        cores=CORES,
        cfg=CFG,
        pending_max_bytes=1 << 20,
        executor=executor,
        plan_log=plan_log,
        watermarks=wm,
        metrics=Metrics(),
        plans=plans,
        load_slice=load_slice,
        retained_floor=lambda: floor,
    )


async def live(planner: Planner, wal: list[Record], lsns: range, per_batch: int = 4) -> None:
    """Events alternate between the cores; one live batch per ``per_batch`` events."""
    for lsn in lsns:
        record = rec(lsn, core=lsn % CORES)
        wal.append(record)
        planner.add(record.core, [record])
        if lsn % per_batch == 0:
            await planner.run_once()
    await planner.run_once()


def restart(
    tmp_path: Path, planner: Planner, executor: StagedExecutor, wal: list[Record]
) -> Planner:
    """A new planner over the same plan log and the watermarks as they are now."""
    snap = planner.watermarks.snapshot()
    planner.plan_log.close()
    return make(tmp_path, executor, wal, snap)


async def history(
    tmp_path: Path, events: int, per_batch: int = 2, start: str | int = "earliest", floor: int = 1
) -> tuple[LedgerExecutor, list[Record], Planner]:
    """A data_dir whose only stream (a) committed ``events`` events; then a
    restart with stream b added, start = "earliest"."""
    wal: list[Record] = []
    first = LedgerExecutor({})
    first.names = ("cdc:a",)
    planner = make(tmp_path, first, wal)
    await live(planner, wal, range(1, events + 1), per_batch)
    executor = LedgerExecutor({"cdc:b": start})
    executor.ledgers["cdc:a"] = first.ledgers["cdc:a"]
    executor.rows["cdc:a"] = first.rows["cdc:a"]
    snap = planner.watermarks.snapshot()
    planner.plan_log.close()
    return executor, wal, make(tmp_path, executor, wal, snap, floor)


async def test_backfill_covers_every_lsn_once_in_bounded_chunks_and_hands_over_without_gap(
    tmp_path: Path,
) -> None:
    """1. a commits 1..20 in 10 batches; 2. b is added with start = "earliest";
    3. live batches flow while b fills (b takes none of them); 4. b's chunks
    cover 1..20 exactly, at most max_rows per core, with ids below its hand-over
    batch; 5. b then runs the batches planned since, and joins the live ones."""
    executor, wal, planner = await history(tmp_path, 20)
    p0 = planner.watermarks.batch_id
    assert p0 == 10
    with capture_logs() as logs:
        assert planner.prepare_backfills() == ["cdc:b"]
        await live(planner, wal, range(21, 29))  # live traffic, b not in it
        assert executor.rows["cdc:b"] == []
        assert planner.backfill_floor() == 0  # the WAL keeps 1.. for b
        report = {s["name"]: s for s in planner.stages.report(planner.live_id)}["cdc:b"]
        assert report["backfilling"] and not report["failing"]
        assert report["backfill"]["events_total"] == 20
        assert report["backfill"]["events_remaining"] == 20
        await planner._run_behind()  # chunks, then the plans since b was added
        await live(planner, wal, range(29, 33))

    chunks = [(bid, r) for bid, r in executor.ledgers["cdc:b"] if bid <= p0]
    assert [bid for bid, _ in chunks] == list(range(1, len(chunks) + 1))
    sizes = [n for bid, per_core in executor.sizes["cdc:b"] if bid <= p0 for n in per_core]
    assert len(chunks) == 4 and max(sizes) == MAX_ROWS  # 10 events per core
    # Every LSN once, in order per core, and the hand-over leaves no gap.
    assert sorted(executor.rows["cdc:b"]) == list(range(1, 33))
    assert Counter(executor.rows["cdc:b"]).most_common(1)[0][1] == 1
    assert sorted(executor.rows["cdc:a"]) == list(range(1, 33))  # a unaffected
    assert len(executor.rows["cdc:a"]) == 32
    hand_over = next(r for bid, r in executor.ledgers["cdc:b"] if bid > p0)
    backfilled_high = {c: max(r[c][1] for _, r in chunks if c in r) for c in range(CORES)}
    assert {c: first for c, (first, _) in hand_over.items()} == {
        c: backfilled_high[c] + CORES for c in range(CORES)
    }
    # The ids b took from the planner are the plans' own: 6, 7, ...
    assert [bid for bid, _ in executor.ledgers["cdc:b"] if bid > p0] == list(
        range(p0 + 1, planner.live_id + 1)
    )
    assert planner.watermarks.backfill == {}
    assert planner.watermarks.batch_id == planner.live_id and not planner.owes(0)
    events = [e["event"] for e in logs if e["event"].startswith("cdc.")]
    assert events[0] == "cdc.backfill_started" and "cdc.backfill_done" in events


async def test_backfill_resumes_after_a_restart_from_its_last_committed_chunk(
    tmp_path: Path,
) -> None:
    """1. b fills two chunks; 2. the process dies (the watermarks file holds the
    backfill, the ledger the chunks); 3. a new planner goes on with chunk 3, and
    b ends with every LSN once."""
    executor, wal, planner = await history(tmp_path, 24)
    planner.prepare_backfills()
    persisted = planner.watermarks.snapshot()  # what the plane saves before any batch
    assert persisted.version == 4 and dict(persisted.backfill)["cdc:b"].until == (24, 23)
    for _ in range(2):
        await planner._backfill("cdc:b")
    assert [bid for bid, _ in executor.ledgers["cdc:b"]] == [1, 2]
    done = list(executor.rows["cdc:b"])
    assert len(done) == 2 * CORES * MAX_ROWS

    planner.plan_log.close()
    again = make(tmp_path, executor, wal, persisted)
    with capture_logs() as logs:
        assert again.prepare_backfills() == []  # resumed, not started again
        # Chunk 2 ended core 0 at LSN 12 and core 1 at 11: the WAL keeps LSN 12 on.
        assert again.backfill_floor() == 11
        await again._run_behind()
    assert next(e["event"] for e in logs if e["event"].startswith("cdc.backfill")) == (
        "cdc.backfill_resumed"
    )
    assert [bid for bid, _ in executor.ledgers["cdc:b"]] == [1, 2, 3, 4]
    assert sorted(executor.rows["cdc:b"]) == list(range(1, 25))
    assert len(executor.rows["cdc:b"]) == 24
    assert again.watermarks.backfill == {}


async def test_a_failing_chunk_backs_off_and_is_retried_with_the_same_rows(
    tmp_path: Path,
) -> None:
    executor, _wal, planner = await history(tmp_path, 8)
    planner.prepare_backfills()
    executor.failing.add("cdc:b")
    await planner._backfill("cdc:b")
    report = {s["name"]: s for s in planner.stages.report(planner.live_id)}["cdc:b"]
    assert report["failing"] and report["backfilling"]
    executor.failing.clear()
    planner.stages._states["cdc:b"].next_due = 0.0
    await planner._run_behind()
    assert sorted(executor.rows["cdc:b"]) == list(range(1, 9))


class HangingLedgerExecutor(LedgerExecutor):
    """Stage ``cdc:b``'s commits while ``hang`` is set come back ``InFlight``
    (the stream's thread still runs them, as on a hung store); ``land`` commits
    the oldest one, as the thread would."""

    def __init__(self, starts: dict[str, str | int]) -> None:
        super().__init__(starts)
        self.hang = False
        self.pending: list[tuple[MicroBatch, Future[None]]] = []

    async def execute(  # type: ignore[override]
        self, batch: MicroBatch, stages: Any = None
    ) -> dict[str, BaseException]:
        wanted = tuple(self.names if stages is None else stages)
        if not self.hang or "cdc:b" not in wanted:
            return await super().execute(batch, wanted)
        failures = await super().execute(batch, tuple(n for n in wanted if n != "cdc:b"))
        done: Future[None] = Future()
        self.pending.append((batch, done))
        failures["cdc:b"] = InFlight("cdc:b", batch.batch_id, done)
        return failures

    async def land(self) -> None:
        batch, done = self.pending.pop(0)
        failures = await LedgerExecutor.execute(self, batch, ("cdc:b",))
        if failures:
            done.set_exception(failures["cdc:b"])
        else:
            done.set_result(None)
        await asyncio.sleep(0)  # the planner hears of it on the loop


async def test_a_chunk_whose_commit_outlives_the_wait_lands_once_and_the_backfill_goes_on_after_it(
    tmp_path: Path,
) -> None:
    """1. b's first chunk is handed back in flight (its commit still runs):
    b is not failing and takes no other chunk, while a commits live batches;
    2. the commit lands: b's backfill moves past that chunk's rows; 3. b
    finishes from there and holds every LSN once, with no failed attempt
    (before the fix the chunk counted as failed, and its retry under the next
    id started below what it had committed: LsnRegressionError forever)."""
    executor, wal, planner = await history(tmp_path, 8)
    hanging = HangingLedgerExecutor({"cdc:b": "earliest"})
    hanging.ledgers, hanging.rows = executor.ledgers, executor.rows
    planner.executor = hanging
    assert planner.prepare_backfills() == ["cdc:b"]
    hanging.hang = True
    with capture_logs() as logs:
        await planner._backfill("cdc:b")  # Step 1.
        entry = planner.stages.entry("cdc:b", planner.live_id)
        assert entry["in_flight"] and not entry["failing"] and entry["backfilling"]
        await live(planner, wal, range(9, 13))
        await planner._run_behind()
        assert len(hanging.pending) == 1 and hanging.ledgers["cdc:b"] == []
        hanging.hang = False

        await hanging.land()  # Step 2.
        assert [bid for bid, _ in hanging.ledgers["cdc:b"]] == [1]
        entry = planner.stages.entry("cdc:b", planner.live_id)
        assert not entry["in_flight"] and not entry["failing"] and entry["backfilling"]

        await planner._run_behind()  # Step 3.
    assert not [e for e in logs if e["event"] == "stage_failed"], logs
    assert planner.watermarks.backfill == {}
    assert sorted(hanging.rows["cdc:b"]) == list(range(1, 13))
    assert Counter(hanging.rows["cdc:b"]).most_common(1)[0][1] == 1
    assert sorted(hanging.rows["cdc:a"]) == list(range(1, 13))


async def test_start_below_the_retained_floor_is_refused(tmp_path: Path) -> None:
    _executor, _wal, planner = await history(tmp_path, 8, start=3, floor=5)
    with pytest.raises(BackfillError, match=r"start = 3 is below the WAL's retained floor"):
        planner.prepare_backfills()
    assert planner.watermarks.backfill == {}


async def test_earliest_starts_at_the_retained_floor_and_an_lsn_where_it_says(
    tmp_path: Path,
) -> None:
    executor, _, planner = await history(tmp_path, 12, floor=5)
    planner.prepare_backfills()
    await planner._run_behind()
    assert sorted(executor.rows["cdc:b"]) == list(range(5, 13))
    (tmp_path / "lsn").mkdir()
    executor, _wal, planner = await history(tmp_path / "lsn", 12, start=8, floor=5)
    planner.prepare_backfills()
    await planner._run_behind()
    assert sorted(executor.rows["cdc:b"]) == list(range(8, 13))


async def test_start_on_a_stream_with_progress_is_ignored(tmp_path: Path) -> None:
    """b was running before: start = "earliest" in its config changes nothing."""
    wal: list[Record] = []
    executor = LedgerExecutor({})
    planner = make(tmp_path, executor, wal)
    await live(planner, wal, range(1, 9))
    executor.starts["cdc:b"] = "earliest"
    planner = restart(tmp_path, planner, executor, wal)
    with capture_logs() as logs:
        assert planner.prepare_backfills() == []
    assert [e["stage"] for e in logs if e["event"] == "cdc.start_ignored"] == ["cdc:b"]
    assert planner.watermarks.backfill == {}
