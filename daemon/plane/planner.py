"""Micro-batch planner: pending slices per core, a durable plan log, and the run loop.

Consumers add delivered records to their core's pending slice; the planner
closes one slice per core into a batch and runs one batch at a time, so
batches commit in id order and watermarks only move forward. Batch protocol
(Spark's offset-log rule):

1. Close one slice per core, the next id (:mod:`daemon.plane.closing`).
2. Append ``batch_id -> {core: (first_lsn, last_lsn)}`` to the plan log and
   fsync it, *before* anything runs (:mod:`daemon.plane.planlog`).
3. Execute for the stages level with the batch; a batch that fails whole is
   retried with backoff, same id and same rows, forever. A stage that fails
   on its own falls behind and catches up later (:mod:`daemon.plane.behind`);
   so does one whose attempt outlives ``health.attempt_slow_s`` (the
   executor hands it back ``InFlight``): the others take the next batches.
4. Commit: stages' progress moves, then the watermarks once every stage has it.

After a crash, plans above the persisted watermarks are re-run first with
their own ids; new CDC streams may backfill (:mod:`daemon.plane.backfill`).
Why: docs/design.md, "Micro-batches" and "Invariants".
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from daemon.errors import DaemonError, LsnRegressionError, error_text
from daemon.plane.backfill import BackfillError, _BackfillRun
from daemon.plane.batch import Executor, Held, InFlight, MicroBatch, Preparer, Slice
from daemon.plane.behind import CatchUp
from daemon.plane.closing import (
    ETA_BATCHES,
    IDLE_MIN_WAIT,
    RECENT_BATCHES,
    RUN_TIME_MARGIN,
    ClosingPolicy,
    _Pending,
)
from daemon.plane.parts import Part, Rows, first_lsn, last_lsn, part_bytes
from daemon.plane.planlog import PlanLog, Ranges
from daemon.plane.stages import StageTracker, stage_names
from daemon.plane.tasks import uncancellable, wait_event

if TYPE_CHECKING:
    from daemon.config import MicrobatchConfig
    from daemon.metrics import Metrics
    from daemon.plane.watermarks import Watermarks

log = structlog.get_logger(__name__)

__all__ = [
    "IDLE_MIN_WAIT",
    "RUN_TIME_MARGIN",
    "BackfillError",
    "PlanMismatchError",
    "Planner",
]

# Rewrite the plan log once this many of its entries are covered by persisted
# watermarks: about 17 minutes of 1 s batches, a few tens of KiB of file.
COMPACT_AFTER = 1024


class PlanMismatchError(DaemonError):
    """A re-run batch's rows read back from the WAL do not match its plan."""


class _Reaper:
    """Frees committed batches in a thread of its own.

    Dropping the last reference to a batch frees everything it holds in one
    piece. When ring deliveries were one ``Record`` each, 100k of them were
    ~400k objects and stalled every ack for ~30 ms once per batch; packed
    parts made that cheap, and small replay parts are joined, but a batch can
    still hold many parts (one per ring run). Dropped in this thread, the
    interpreter's switch interval (5 ms) lets the loop run in between.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[MicroBatch | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def give(self, batch: MicroBatch) -> None:
        """Take ``batch``; the caller drops its own references right after."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="eventplane-free", daemon=True)
            self._thread.start()
        self._queue.put(batch)

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            # Let the giver drop its references first, so the last one is here.
            time.sleep(0.001)
            del batch

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)


SliceLoader = Callable[[int, int, int], Awaitable[Sequence[Part]]]
# (core, first LSN, last LSN, at most this many rows) -> that core's first rows.
ChunkReader = Callable[[int, int, int, int], Awaitable[Sequence[Part]]]


class Planner(CatchUp, ClosingPolicy):
    """Closes slices into batches, plans them durably, runs them, commits them."""

    def __init__(
        self,
        *,
        cores: int,
        cfg: MicrobatchConfig,
        pending_max_bytes: int,
        executor: Executor,
        plan_log: PlanLog,
        watermarks: Watermarks,
        metrics: Metrics,
        plans: Mapping[int, Ranges],
        load_slice: SliceLoader,
        on_commit: Callable[[], None] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        stall_after_s: float = 60.0,
        attempt_slow_s: float = 5.0,
        paused_max_lag_events: int = 0,
        head_lsn: Callable[[], int] | None = None,
        read_chunk: ChunkReader | None = None,
        retained_floor: Callable[[], int] = lambda: 1,
    ) -> None:
        self.cores = cores
        self.cfg = cfg
        self.pending_max_bytes = pending_max_bytes
        self.executor = executor
        self.plan_log = plan_log
        self.watermarks = watermarks
        self.metrics = metrics
        self._load_slice = load_slice
        self._read_chunk = read_chunk or self._read_chunk_whole
        self._retained_floor = retained_floor
        # stage -> its running backfill (``prepare_backfills``).
        self._backfills: dict[str, _BackfillRun] = {}
        self._on_commit = on_commit
        self._sleep = sleep
        self._clock = clock
        self._pending = [_Pending() for _ in range(cores)]
        # Plans still in the file, id -> ranges; pruned once the persisted
        # watermarks cover them.
        self._logged: dict[int, Ranges] = dict(plans)
        # core -> the highest last LSN of any slice planned for it (``owes``).
        self._planned_high: dict[int, int] = {}
        for ranges in plans.values():
            self._note_planned(ranges)
        self._recovered = sorted(b for b in plans if b > watermarks.batch_id)
        self._next_id = max([watermarks.batch_id, *plans]) + 1
        # Batches closed (or reloaded) and not yet committed, id -> ranges: the
        # running one, and the next one when it was closed ahead (``run``).
        self._open: dict[int, Ranges] = {}
        # What each open batch took from its cores' budgets: id -> {core: bytes}.
        self._open_bytes: dict[int, dict[int, int]] = {}
        # Close the next batch while one runs, so the executor can prepare it.
        self._preparer = executor if isinstance(executor, Preparer) else None
        self._reaper = _Reaper()
        self._wake = asyncio.Event()
        self._stopping = False
        # Seconds the executor took for recent batches (the close deadline).
        self._run_times: deque[float] = deque(maxlen=RECENT_BATCHES)
        # The last ETA_BATCHES live runs again, apart by whether the batch was
        # prepared ahead (its input built while the one before ran) or built
        # its input in the run: the second take longer by that build, and a
        # prepared batch's expected commit must not be taken from them
        # (``expected_duration_s``).
        self._eta_runs: dict[bool, deque[float]] = {
            True: deque(maxlen=ETA_BATCHES),
            False: deque(maxlen=ETA_BATCHES),
        }
        self._last_run_s: float | None = None
        self._file_lock = asyncio.Lock()
        self.last_batch: dict[str, Any] | None = None
        # The WAL head (the plane's pushed LSN); by default the highest delivered.
        self._head_lsn = head_lsn or (lambda: max(p.last_lsn for p in self._pending))
        # (batch id, lowest first LSN) of each logged plan whose lowest first LSN
        # is below every later plan's; both grow along the list (``_first_after``).
        self._suffix_mins: list[tuple[int, int]] = []
        for bid in sorted(self._logged):
            self._note_first(bid, self._logged[bid])
        # Per-stage progress (invariant 6): who runs which batch, who is behind.
        self.stages = StageTracker(
            watermarks,
            cfg,
            metrics,
            stall_after_s=stall_after_s,
            attempt_slow_s=attempt_slow_s,
            paused_max_lag_events=paused_max_lag_events,
            waiting_for=self._waiting_for,
            events_behind=self._events_behind,
            backfill_report=self.backfill_report,
            clock=clock,
        )
        # An executor that names no stages runs every batch as one stage.
        self._named_stages = callable(getattr(executor, "stage_names", None))
        # The newest batch whose live run is over: stages below it are behind.
        self._live_id = watermarks.batch_id
        # Stages with no progress recorded: a new CDC stream among them may backfill.
        self._new_stages = [n for n in stage_names(executor) if n not in watermarks.stages]
        self._sync_stages(watermarks.batch_id + 1)
        # Planner clock when the live path began failing or waiting for the
        # executor with a batch in hand (health: a stall); None while it flows.
        self._blocked_since: float | None = None

    # ------------------------------------------------------------------
    # Consumer side (event loop only)

    def resume_lsn(self, core: int) -> int:
        """Where a consumer must resume: after its watermark and every planned slice."""
        lsn = self.watermarks.lsns[core]
        for b in self._recovered:
            r = self._logged[b].get(core)
            if r is not None:
                lsn = max(lsn, r[1])
        return lsn

    def add(self, core: int, part: Part, nbytes: int | None = None) -> None:
        """Append delivered events (LSN order) to the core's pending slice."""
        if not len(part):
            return
        p = self._pending[core]
        first = first_lsn(part)
        if first <= p.last_lsn:
            raise LsnRegressionError(f"core {core}: LSN {first} delivered after LSN {p.last_lsn}")
        size = part_bytes(part) if nbytes is None else nbytes
        if not p.parts:
            self._wake.set()  # the planner's close deadline starts now
        p.parts.append((part, size, self._clock()))
        p.rows += len(part)
        p.nbytes += size
        p.last_lsn = last_lsn(part)
        if p.nbytes + p.inflight >= self.pending_max_bytes:
            # Over budget: the consumer waits for room (the WAL keeps the
            # rest), and the slice will not grow: the run loop may close it
            # ahead of time (``_due_by_size``).
            p.room.clear()
            self._wake.set()
        elif p.rows >= self._due_rows(p):
            # Row limit reached: close a batch now, not at its deadline.
            self._wake.set()

    def has_room(self, core: int) -> bool:
        """Pending plus running bytes of the core are under ``pending_max_bytes``."""
        p = self._pending[core]
        return p.nbytes + p.inflight < self.pending_max_bytes

    async def wait_room(self, core: int) -> None:
        await self._pending[core].room.wait()

    def set_catching_up(self, core: int, flag: bool) -> None:
        self._pending[core].catching_up = flag

    def pending_rows(self, core: int) -> int:
        return self._pending[core].rows

    def pending_bytes(self, core: int) -> int:
        return self._pending[core].nbytes

    def inflight_bytes(self, core: int) -> int:
        """Bytes of the core's slice in the running batch (0 when none runs)."""
        return self._pending[core].inflight

    def owes(self, core: int) -> bool:
        """True while the core has rows that are delivered but not committed by
        every stage (pending, running, or planned and not done everywhere)."""
        if self._pending[core].rows or any(core in r for r in self._open.values()):
            return True
        # Plans of one core have growing LSNs: it owes while its newest planned
        # slice ends above its watermark (O(1): a stage behind keeps plans).
        return self._planned_high.get(core, 0) > self.watermarks.lsns[core]

    def _note_planned(self, ranges: Ranges) -> None:
        for core, (_, last) in ranges.items():
            if last > self._planned_high.get(core, 0):
                self._planned_high[core] = last

    def plan_floor(self, persisted_batch_id: int) -> int | None:
        """Lowest LSN - 1 that a plan above ``persisted_batch_id`` still needs."""
        firsts = [
            first
            for b, ranges in self._logged.items()
            if b > persisted_batch_id
            for first, _ in ranges.values()
        ]
        return min(firsts) - 1 if firsts else None

    def _note_first(self, batch_id: int, ranges: Ranges) -> None:
        """Keep ``_suffix_mins`` for a plan appended above every other one."""
        first = min((f for f, _ in ranges.values()), default=None)
        if first is None:
            return
        mins = self._suffix_mins
        while mins and mins[-1][1] >= first:
            mins.pop()
        mins.append((batch_id, first))

    def _first_after(self, batch_id: int) -> int | None:
        """Lowest first LSN of the logged plans above ``batch_id`` (None: none),
        in O(log plans): a stage paused for many batches stays cheap to report."""
        mins = self._suffix_mins
        i = bisect.bisect_right(mins, batch_id, key=lambda m: m[0])
        return mins[i][1] if i < len(mins) else None

    def _events_behind(self, progress: int) -> int:
        """A stage at ``progress``: events from the first one of the oldest batch
        it has not committed to the head (an LSN distance); 0 when it is level."""
        if progress >= self._live_id:
            return 0
        first = self._first_after(progress)
        return 0 if first is None else max(self._head_lsn() - first + 1, 0)

    def _waiting_for(self, name: str) -> str | None:
        ask = getattr(self.executor, "waiting_for", None)
        return ask(name) if callable(ask) else None

    def pause_stage(self, name: str, *, reason: str | None = None, by: str | None = None) -> bool:
        """Pause a stage from its next batch on (``StageTracker.pause``)."""
        return self.stages.pause(name, reason=reason, by=by)

    def resume_stage(self, name: str) -> bool:
        """Resume a paused stage; the run loop starts its catch-up at once."""
        changed = self.stages.resume(name)
        if changed:
            self._wake.set()
        return changed

    # ------------------------------------------------------------------
    # Run loop

    def request_stop(self) -> None:
        """Finish the running batch (if any), then return from :meth:`run`."""
        self._stopping = True
        self._wake.set()

    async def run(self) -> None:
        # Re-run planned batches that did not commit before the restart, in order,
        # each for the stages that had not committed it.
        while self._recovered and not self._stopping:
            bid = self._recovered[0]
            started = self._clock()
            self._sync_stages(bid)
            if self.stages.participants(bid):
                batch = await self._reload(bid, self._logged[bid])
                await self._execute(batch)
                self._commit(batch, started)
                del batch
            else:
                self._live_done(bid)
            self._recovered.pop(0)
        held = False
        ahead: MicroBatch | None = None
        was_ahead = False  # the batch about to run was closed ahead, so prepared
        while not self._stopping:
            await self._flush_coalesced()
            if ahead is not None:
                # Closed, planned and prepared while the previous batch ran;
                # stages behind get a turn first, as between any two batches.
                await self._run_behind(live_waiting=True)
                batch, ahead = ahead, None
            else:
                if not await self._wait_due():
                    break
                if not self.executor.ready():
                    if not held:
                        log.info("microbatch_held", reason="executor not ready")
                        held = True
                    self._blocked_since = self._blocked_since or self._clock()
                    await self._sleep(min(self.cfg.interval_ms / 1000, 0.1))
                    continue
                if held:
                    log.info("microbatch_resumed")
                    held = False
                    self._blocked_since = None
                # Stages behind the live batches, between two live batches.
                await self._run_behind()
                if not (self._due_by_size() or self._deadline_passed()):
                    continue
                if self._nobody_takes_it():
                    await self._wait_for_a_stage()
                    continue
                closed = await self._close_and_plan()
                if closed is None:
                    continue
                batch, closed = closed, None
            started = self._clock()
            ahead = await self._execute_closing_ahead(batch, prepared=was_ahead)
            was_ahead = ahead is not None
            self._commit(batch, started)
            self._reaper.give(batch)
            del batch
        # A clean stop: the batches held for a coalesced merge merge now, so
        # the watermarks flushed next record them.
        await self._flush_coalesced(force=True)
        # A batch closed ahead stays planned: a restart re-runs it from the plan log.

    def _nobody_takes_it(self) -> bool:
        """No stage would run the next live batch, but one will come back: every
        stage is behind (catching up, or backing off after failures) or has an
        attempt in flight. Closing batches then would only make many small
        plans that each stage re-runs one by one; the rows wait instead
        (pending slices are bounded by ``pending_max_bytes``, the rest stays in
        the WAL) and go out in one batch once a stage is level again."""
        if not self._named_stages:
            return False
        st = self.stages
        self._sync_stages(self._next_id)
        if st.participants(self._next_id):
            return False
        return bool(st.behind(self._live_id)) or st.any_in_flight()

    async def _wait_for_a_stage(self) -> None:
        """Until a stage behind is due, an attempt lands, or an interval passes."""
        due = self.stages.next_due(self._live_id)
        limit = self.cfg.interval_ms / 1000
        wait = limit if due is None else min(max(due - self._clock(), 0.0), limit)
        self._wake.clear()
        await wait_event(self._wake, wait)

    def _sync_stages(self, batch_id: int) -> tuple[str, ...]:
        return self.stages.sync(stage_names(self.executor), batch_id)

    async def run_once(self) -> MicroBatch | None:
        """Steps 1-4 for one batch; None when nothing is pending."""
        started = self._clock()
        batch = await self._close_and_plan()
        if batch is None:
            return None
        # Step 3. Execute, retrying with backoff; same id, same rows.
        await self._execute(batch)
        # Step 4. Commit: watermarks move only now (invariant 6).
        self._commit(batch, started)
        return batch

    async def _execute_closing_ahead(
        self, batch: MicroBatch, prepared: bool = False
    ) -> MicroBatch | None:
        """Step 3 for ``batch``; meanwhile close, plan and prepare the next one.
        Returns that batch (None when nothing was closed ahead).

        Only with an executor that prepares (``Preparer``): the next batch's
        input is then built while this one runs in Spark, instead of after it
        with Spark idle. It commits after this one; ids, plans and watermarks
        keep their order, and a crash re-runs both plans in order.

        When the next batch closes (``ahead_due``): not before its rows' own
        deadline (``close_due``), and not before this batch is expected to
        commit less the time the next one takes to prepare. Its rows cannot
        commit before this batch has and the next one has run, so closing it
        sooner would only leave the rows that arrive meanwhile for the batch
        after it, a whole run later. Sooner only when a core's slice cannot
        grow (``_ahead_full``): it holds all a slice may take, or the core is
        out of memory budget. ``max_rows`` does not close it: a backlog that
        builds while this batch runs goes out in one batch, not in several
        that each pay Spark's fixed cost.
        """
        if self._preparer is None:
            await self._execute(batch)
            return None
        eta = self._clock() + self.expected_duration_s(prepared)
        self._last_run_s = None
        running = asyncio.ensure_future(self._execute(batch))
        ahead: MicroBatch | None = None
        try:
            while not running.done():
                due = self.ahead_due(eta) if ahead is None and not self._stopping else None
                if due is not None and ((full := self._ahead_full()) or due <= self._clock()):
                    ahead = await self._close_and_plan()
                    if ahead is not None:
                        self._preparer.prepare(ahead)
                        # How early the close came against the expected commit:
                        # the rule's inputs, for tuning it from a debug log.
                        log.debug(
                            "microbatch_closed_ahead",
                            batch_id=ahead.batch_id,
                            running=batch.batch_id,
                            rows=ahead.rows,
                            full=full,
                            before_expected_commit_s=round(eta - self._clock(), 4),
                        )
                    continue
                self._wake.clear()
                woken = asyncio.ensure_future(self._wake.wait())
                timeout = None if due is None else max(due - self._clock(), 0.0)
                try:
                    await asyncio.wait(
                        (running, woken), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    woken.cancel()
        except BaseException:
            running.cancel()
            with contextlib.suppress(BaseException):
                await running
            raise
        await running
        if self._last_run_s is not None:
            self._eta_runs[prepared].append(self._last_run_s)
        return ahead

    async def _close_and_plan(self) -> MicroBatch | None:
        """Steps 1-2: the next batch, planned durably; None when nothing is pending."""
        # Step 1. Close one slice per core.
        batch = self._close()
        if batch is None:
            return None
        # Step 2. Record the plan durably before the batch runs.
        await uncancellable(self._append_plan(batch))
        return batch

    async def _append_plan(self, batch: MicroBatch) -> None:
        async with self._file_lock:
            await asyncio.to_thread(self.plan_log.append, batch.batch_id, batch.ranges())
            self._logged[batch.batch_id] = batch.ranges()
            self._note_planned(batch.ranges())
            self._note_first(batch.batch_id, batch.ranges())

    async def _wait_due(self) -> bool:
        """Wait until a batch is due, or a stage behind may try again. False when
        stopping."""
        while not self._stopping:
            if self._due_by_size():
                return True
            due = self.idle_close_due()
            for other in (self.stages.next_due(self._live_id), self._coalesce_due()):
                if other is not None:
                    due = other if due is None else min(due, other)
            self._wake.clear()
            if due is None:
                await self._wake.wait()  # the first delivered row sets it
                continue
            remaining = due - self._clock()
            if remaining <= 0:
                return True
            await wait_event(self._wake, remaining)
        return False

    async def _reload(self, batch_id: int, ranges: Ranges) -> MicroBatch:
        """Rebuild a planned batch from the WAL for a re-run after a restart."""
        batch = await self._load(batch_id, ranges)
        self._open[batch_id] = dict(ranges)
        log.info("microbatch_rerun", batch_id=batch_id, rows=batch.rows, cores=sorted(ranges))
        return batch

    async def _load(self, batch_id: int, ranges: Ranges) -> MicroBatch:
        """Rebuild a planned batch from the WAL: same id, same rows."""
        slices: dict[int, Slice] = {}
        for core, (first, last) in sorted(ranges.items()):
            rows = Rows(await self._load_slice(core, first, last))
            if not rows or rows[0].lsn != first or rows[-1].lsn != last:
                got = f"{rows[0].lsn}..{rows[-1].lsn}" if rows else "nothing"
                raise PlanMismatchError(
                    f"batch {batch_id} core {core}: plan says LSN {first}..{last} but the WAL "
                    f"returned {got}; the WAL and the plan log do not belong together"
                )
            slices[core] = Slice(core, first, last, rows)
        return MicroBatch(batch_id, slices)

    async def _execute(self, batch: MicroBatch) -> None:
        # The executor's and the stages' log lines carry the batch id too.
        with structlog.contextvars.bound_contextvars(batch_id=batch.batch_id):
            await self._execute_with_retries(batch)

    async def _execute_with_retries(self, batch: MicroBatch) -> None:
        """Step 3 on the live path: the batch for every stage level with it.

        A stage that fails on its own is recorded and left behind (it re-runs
        the batch later, ``_run_behind``); when the batch fails as a whole, or
        every stage fails, nothing of it committed and it is retried whole.
        """
        delay = self.cfg.retry_initial_ms / 1000
        attempt = 0
        self._sync_stages(batch.batch_id)
        names = self.stages.participants(batch.batch_id)
        info: dict[str, Any] = {
            "batch_id": batch.batch_id,
            "rows": batch.rows,
            "ranges": batch.ranges(),
            "state": "running",
            "attempts": 0,
            "error": None,
            "duration_s": None,
            "stages": names,
            "failed_stages": [],
        }
        self.last_batch = info
        if not names:  # every stage is behind: they take this batch from its plan
            info["state"] = "deferred"
            return
        while True:
            while not self.executor.ready():
                info["state"] = "held"
                self._blocked_since = self._blocked_since or self._clock()
                await self._sleep(min(self.cfg.interval_ms / 1000, 0.1))
            attempt += 1
            info["attempts"] = attempt
            info["state"] = "running"
            attempt_started = self._clock()
            failures = await self._call(batch, names)
            # Failed whole: every stage was asked and every one failed (Spark
            # down, say). Then nothing moves; the batch is retried whole, and
            # logged once, below. Otherwise a stage that failed falls behind
            # and the others, ahead or behind, go on (invariant 6). A paused
            # stage is not asked, and does not count.
            failed_whole = bool(failures) and set(failures) >= set(self.stages.active())
            failed_whole = failed_whole and not any(
                isinstance(f, InFlight | Held) for f in failures.values()
            )
            self._record(batch.batch_id, names, failures, quiet=failed_whole)
            if failed_whole:
                first = next(iter(failures.values()))
                self.metrics.batch_outcomes.labels(outcome="failed").inc()
                self._blocked_since = self._blocked_since or self._clock()
                info["state"] = "retrying"
                info["error"] = error_text(first)
                log.warning(
                    "microbatch_failed",
                    batch_id=batch.batch_id,
                    attempt=attempt,
                    error=info["error"],
                    stages=names,
                    retry_in_s=delay,
                )
                await self._sleep(delay)
                delay = min(delay * 2, self.cfg.retry_max_ms / 1000)
                # Nothing committed: a stage paused meanwhile is left out.
                names = self.stages.participants(batch.batch_id)
                info["stages"] = names
                if not names:
                    info["state"] = "deferred"
                    self._blocked_since = None
                    return
                continue
            self._blocked_since = None
            info["failed_stages"] = sorted(
                n for n, f in failures.items() if not isinstance(f, Held)
            )
            self._last_run_s = self._clock() - attempt_started
            self._run_times.append(self._last_run_s)
            return

    @property
    def live_id(self) -> int:
        """The newest batch whose live run is over."""
        return self._live_id

    def blocked_for_s(self) -> float:
        """How long the live path has been failing or waiting for the executor
        with a batch due (0 while batches flow)."""
        since = self._blocked_since
        return 0.0 if since is None else max(self._clock() - since, 0.0)

    def _commit(self, batch: MicroBatch, started: float) -> None:
        """Step 4: the live run of ``batch`` is over; free its memory, move the
        watermarks as far as every stage has committed."""
        self._open.pop(batch.batch_id, None)
        for core, nbytes in self._open_bytes.pop(batch.batch_id, {}).items():
            self._pending[core].inflight -= nbytes
        for p in self._pending:
            if p.nbytes + p.inflight < self.pending_max_bytes:
                p.room.set()
        elapsed = self._clock() - started
        m = self.metrics
        m.batch_duration.observe(elapsed)
        m.batch_rows.inc(batch.rows)
        m.batch_outcomes.labels(outcome="committed").inc()
        m.batch_last_id.set(batch.batch_id)
        m.batch_last_commit_time.set(time.time())
        if self.last_batch is not None and self.last_batch["batch_id"] == batch.batch_id:
            if self.last_batch["state"] != "deferred":
                self.last_batch["state"] = "committed"
            self.last_batch.update(duration_s=round(elapsed, 6), committed_at=time.time())
        log.debug("microbatch_committed", batch_id=batch.batch_id, rows=batch.rows)
        self._live_done(batch.batch_id)

    # ------------------------------------------------------------------
    # Plan log upkeep (called after watermarks were persisted)

    async def forget_through(self, persisted_batch_id: int) -> None:
        """Drop plans the persisted watermarks cover; compact the file now and then."""
        for b in [b for b in self._logged if b <= persisted_batch_id]:
            del self._logged[b]
        i = bisect.bisect_right(self._suffix_mins, persisted_batch_id, key=lambda m: m[0])
        del self._suffix_mins[:i]
        if self.plan_log.entries - len(self._logged) < COMPACT_AFTER:
            return
        await uncancellable(self._compact())

    async def _compact(self) -> None:
        async with self._file_lock:
            # Under the lock: a plan appended meanwhile must be in ``keep``.
            keep = dict(self._logged)
            await asyncio.to_thread(self.plan_log.rewrite, keep)
        log.debug("plan_log_compacted", kept=len(keep))

    async def aclose(self) -> None:
        """Close the plan log once no append or rewrite is in flight."""
        self._reaper.close()
        async with self._file_lock:
            self.plan_log.close()
