"""Micro-batch planner: per-core pending slices, a durable plan log, and the run loop.

Consumers add delivered records to their core's pending slice. The planner
closes one slice per core into a :class:`~daemon.plane.batch.MicroBatch` and runs
it. One batch runs at a time, so batches commit in id order and watermarks
only move forward.

When a batch closes: ``microbatch.interval_ms`` is the time from an event's
delivery to its batch's commit that the planner aims for. It closes a batch
when its oldest pending event has waited ``interval_ms`` less the expected run
time (``RUN_TIME_MARGIN`` x the slowest of the last ``RECENT_BATCHES`` runs),
and sooner when a core reaches ``max_rows`` (``catchup_max_rows`` while it
catches up) or its memory budget. With fast batches that is about once per
interval; a slower executor gets batches closed sooner, so rows do not wait a
whole interval and then a run on top of it (a batch that is due while another
runs starts right after it commits, prepared meanwhile if the executor can).
With none running, a batch waits at least a quarter of the interval
(``IDLE_MIN_WAIT``) after its oldest row, so that a burst's first batch is not
its first few rows alone.

How much a slice takes: everything the core has pending, up to
``catchup_max_rows``. Rows that piled up while a batch ran (more than
``max_rows`` of them: the executor is behind) go out in one large batch, as
a Structured Streaming source without a per-trigger limit does; every batch
pays a fixed cost in Spark (a few hundred ms for a CDC write here), so many
``max_rows`` batches would keep the executor behind for longer.

Batch protocol (Spark's offset-log rule):

1. Close one slice per core and give the batch the next id.
2. Append ``batch_id -> {core: (first_lsn, last_lsn)}`` to the plan log and
   fsync it, *before* anything runs.
3. ``await executor.execute(batch, stages)`` for the stages level with the
   batch (``daemon.plane.stages``); if it fails as a whole (or every stage fails),
   retry with exponential backoff, same id and same rows, forever (a batch
   is never dropped). A stage that fails on its own falls behind: it re-runs
   the batch later from its plan, and the others go on (invariant 6).
4. Commit: each stage's progress moves for the batches it committed; the
   watermarks of the batch's cores move once every stage committed it.

Closing ahead: while batch N runs (step 3), an executor that prepares
(``Preparer``) gets batch N+1 early: it goes through steps 1-2 and
``executor.prepare``, and runs right after N's step 4 (``run``). N+1 closes
when N is expected to commit less N+1's preparation (``ahead_due``), not
before its rows' own deadline, and at once only when a core's slice cannot
grow (``catchup_max_rows`` rows, or the memory budget). Its rows cannot
commit before N has and N+1 has run, so an earlier close would only push
the rows that arrive meanwhile into N+2, a run later; and a backlog that
builds while N runs goes out in one batch, not in ``max_rows`` pieces.

After a crash, plans above the persisted watermarks' ``batch_id`` are read
back from the WAL and re-run first with their own ids (the executor's sinks
dedupe by batch id), and consumers resume after the highest planned LSN.

A CDC stream new to the data_dir may **backfill** (``start = "earliest"`` or
an LSN): the planner then commits chunks of the WAL below the live batches
to it, between live batches, before it joins them (:meth:`Planner._backfill`;
docs/cdc.md, "Adding a stream: backfill").

The plan log's format and recovery: :mod:`daemon.plane.planlog`; pending
parts and their memory cost: :mod:`daemon.plane.parts`.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from daemon.errors import DaemonError, LsnRegressionError, error_text
from daemon.plane.batch import Executor, MicroBatch, Preparer, Slice
from daemon.plane.parts import Part, Rows, first_lsn, last_lsn, part_bytes, split_part
from daemon.plane.planlog import PlanLog, PlanLogError, Ranges
from daemon.plane.stages import WHOLE_BATCH, StageTracker, stage_names
from daemon.plane.tasks import uncancellable, wait_event
from daemon.plane.watermarks import Backfill

if TYPE_CHECKING:
    from daemon.config import MicrobatchConfig
    from daemon.metrics import Metrics
    from daemon.plane.watermarks import Watermarks

log = structlog.get_logger(__name__)

# Rewrite the plan log once this many of its entries are covered by persisted
# watermarks: about 17 minutes of 1 s batches, a few tens of KiB of file.
COMPACT_AFTER = 1024

# The close deadline (module docstring) expects the next run to take this
# many times the slowest of the last RECENT_BATCHES runs: room for the next
# one's variance, and for delivery before and the actions' hand-off after.
RECENT_BATCHES = 8
RUN_TIME_MARGIN = 1.25

# While batch N runs, N+1 closes when N is expected to commit, less the time
# its input takes to prepare (module docstring, "Closing ahead"). N's run is
# expected to take the shortest of the last ETA_BATCHES runs: closing late
# costs more than closing early. Late, N+1 builds its input in its own run,
# with Spark idle, and on a busy machine that run took about twice as long
# as a prepared one (1.7-2.4 s against 0.8-1.3 s for 20-35k rows); early,
# only the rows that arrive in between wait for N+2. The shortest also
# ignores a stalled or retried run. The margin covers the plan log's fsync
# and the hand-over to ``prepare``.
ETA_BATCHES = 3
CLOSE_AHEAD_MARGIN_S = 0.05

# With no batch running, a batch closes no sooner than this share of
# ``interval_ms`` after its oldest row's delivery (``idle_close_due``). When
# the last runs took about the interval (large batches under load), the close
# deadline falls on the first row's delivery, so the first batch of a burst
# closed with the first ring run in it and the burst's rows waited behind a
# whole run of that near-empty batch: in a 1M-event run here, 4,096 rows and
# 1.3 s of Spark before the rows that piled up meanwhile could start. Waiting a
# quarter of the interval lets them join it; at most that is added to the
# first row's commit, where a separate batch adds a whole run to the others'.
IDLE_MIN_WAIT = 0.25


class PlanMismatchError(DaemonError):
    """A re-run batch's rows read back from the WAL do not match its plan."""


class BackfillError(DaemonError):
    """A new stream's backfill cannot start (below the retained floor, say)."""


# A backfill logs its progress at most this often (cdc.backfill_progress).
BACKFILL_LOG_S = 5.0


class _BackfillRun:
    """A backfill's position in this process: per core, the next LSN to take."""

    __slots__ = ("done_at_start", "logged", "next", "started")

    def __init__(self, next_lsns: list[int], done: int, started: float) -> None:
        self.next = next_lsns
        self.done_at_start = done
        self.started = started
        self.logged = started


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


class _Pending:
    __slots__ = (
        "catching_up",
        "inflight",
        "last_lsn",
        "nbytes",
        "parts",
        "room",
        "rows",
    )

    def __init__(self) -> None:
        # (part, part_bytes, when it was delivered: the planner's clock)
        self.parts: list[tuple[Part, int, float]] = []
        self.rows = 0
        self.nbytes = 0
        # Bytes of this core's slice in the running batch: still in memory
        # (and decoded by the executor) until the batch commits, so they
        # count against the same budget as the pending parts.
        self.inflight = 0
        self.last_lsn = 0
        self.catching_up = False
        self.room = asyncio.Event()
        self.room.set()


SliceLoader = Callable[[int, int, int], Awaitable[Sequence[Part]]]
# (core, first LSN, last LSN, at most this many rows) -> that core's first rows.
ChunkReader = Callable[[int, int, int, int], Awaitable[Sequence[Part]]]


class Planner:
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
            paused_max_lag_events=paused_max_lag_events,
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
    # Backfill: a new CDC stream fills from the WAL below the live batches

    def prepare_backfills(self, wall: Callable[[], float] = time.time) -> list[str]:
        """Start or resume the backfills of the executor's CDC streams; returns the
        stages whose backfill started now (the caller persists the watermarks
        before any batch runs, so a restart resumes them).

        A stream backfills only when it is new to this data_dir: no progress
        recorded for its stage and nothing in its ledger. Its progress is then
        the watermarks' batch id P; it fills each core c up to the core's
        watermark ``until[c]``: exactly the events of batches 1..P, since a
        watermark moves only over batches every stage committed (or an idle
        core). Every later event of the core is in a batch above P, which the
        stream runs from its plan once filled: no gap, no overlap. Chunks get
        the ids 1, 2, ... in the stream's ledger, all at most P, so they never
        meet an id the stream takes from the planner (all above P).

        Raises BackfillError for a start below the WAL's retained floor.
        """
        start_of = getattr(self.executor, "stream_start", None)
        position = getattr(self.executor, "stream_position", None)
        if not callable(start_of) or not callable(position):
            return []
        wm = self.watermarks
        started: list[str] = []
        for name in self.stages.names:
            spec = start_of(name)
            if spec is None:
                continue  # not a CDC stream
            last_id, high = position(name)
            if name in wm.backfill:
                bf = wm.backfill[name]
                self._backfills[name] = self._backfill_run(bf, high)
                log.info(
                    "cdc.backfill_resumed",
                    stage=name,
                    start_lsn=bf.start,
                    until=list(bf.until),
                    chunks_committed=last_id,
                    **self._progress(name),
                )
                continue
            if spec == "head":
                continue
            if name not in self._new_stages or last_id or high:
                log.info(
                    "cdc.start_ignored",
                    stage=name,
                    start=spec,
                    message=f"stream {name} has progress in this data_dir or rows in its "
                    "table: start applies only to a new stream; it goes on where it is",
                )
                continue
            floor = self._retained_floor()
            first = floor if spec == "earliest" else int(spec)
            if first < floor:
                raise BackfillError(
                    f"stage {name}: start = {spec} is below the WAL's retained floor "
                    f"(LSN {floor}): the events in between were removed (invariant 9). "
                    f'Use start = "earliest" (LSN {floor}) or a later LSN'
                )
            progress = self.stages.progress(name)
            until = tuple(wm.lsns)
            if progress == 0 or first > max(until):
                log.info(
                    "cdc.backfill_skipped",
                    stage=name,
                    start_lsn=first,
                    until=list(until),
                    message="nothing below the live batches from this start: "
                    "the stream starts with the live batches",
                )
                continue
            bf = Backfill(first, until, wall(), max(until) - first + 1)
            wm.backfill[name] = bf
            self._backfills[name] = self._backfill_run(bf, high)
            started.append(name)
            log.info(
                "cdc.backfill_started",
                stage=name,
                start=spec,
                start_lsn=first,
                until=list(until),
                hand_over_after_batch=progress,
                events_total=bf.total,
            )
        return started

    def _backfill_run(self, bf: Backfill, high: Mapping[int, int]) -> _BackfillRun:
        nxt = [max(bf.start, high.get(c, 0) + 1) for c in range(self.cores)]
        run = _BackfillRun(nxt, 0, self._clock())
        run.done_at_start = bf.total - self._remaining(bf, run)
        return run

    @staticmethod
    def _remaining(bf: Backfill, run: _BackfillRun) -> int:
        """Events still to fill: an LSN distance over the cores not done (LSNs are
        global, so one core's range spans the others' events: an upper bound)."""
        todo = [c for c, n in enumerate(run.next) if n <= bf.until[c]]
        if not todo:
            return 0
        return max(bf.until[c] for c in todo) - min(run.next[c] for c in todo) + 1

    def _progress(self, name: str) -> dict[str, Any]:
        bf = self.watermarks.backfill.get(name)
        run = self._backfills.get(name)
        if bf is None or run is None:
            return {}
        remaining = self._remaining(bf, run)
        done = max(bf.total - remaining, 0)
        elapsed = self._clock() - run.started
        rate = (done - run.done_at_start) / elapsed if elapsed > 0 else 0.0
        return {
            "events_done": done,
            "events_total": bf.total,
            "events_remaining": remaining,
            "rate_per_s": round(rate, 1),
            "eta_s": round(remaining / rate, 1) if rate > 0 else None,
        }

    def backfill_report(self, name: str) -> dict[str, Any] | None:
        """A backfilling stage's progress for status (None when not backfilling)."""
        bf = self.watermarks.backfill.get(name)
        if bf is None:
            return None
        run = self._backfills.get(name)
        return {
            "start_lsn": bf.start,
            "until": list(bf.until),
            "since": bf.since,
            "next_lsns": list(run.next) if run else None,
            **self._progress(name),
        }

    def backfill_floor(self) -> int | None:
        """Lowest LSN - 1 that a running backfill still needs (WAL retention)."""
        needs = [
            n
            for name, run in self._backfills.items()
            if (bf := self.watermarks.backfill.get(name)) is not None
            for c, n in enumerate(run.next)
            if n <= bf.until[c]
        ]
        return min(needs) - 1 if needs else None

    async def _read_chunk_whole(self, core: int, first: int, last: int, limit: int) -> list[Part]:
        """A chunk from ``load_slice`` (reads the whole range; tests)."""
        rows = list(Rows(await self._load_slice(core, first, last)))
        return [rows[:limit]] if rows else []

    async def _backfill(self, name: str) -> None:
        """Commit the next chunk of ``name``'s backfill, or finish it.

        Each core takes its events from its next LSN up to its ``until``, at
        most ``max_rows`` of them; more only when the stream has fewer chunk ids
        left (its progress P minus the ledger's last id) than ``max_rows``
        chunks, so that the last chunk id stays at most P. A chunk is a batch
        for this stage alone: the ledger's exactly-once checks apply (a
        re-run id must have the same ranges; a new one must start above every
        committed LSN of its cores). The ledger is the position: after a
        restart the backfill continues after its last committed chunk.
        """
        bf = self.watermarks.backfill[name]
        run = self._backfills[name]
        last_id, _ = self.executor.stream_position(name)  # type: ignore[attr-defined]
        ids_left = self.stages.progress(name) - last_id
        slices: dict[int, Slice] = {}
        limits: dict[int, int] = {}
        for core, first in enumerate(run.next):
            until = bf.until[core]
            if first > until:
                continue
            limit = max(self.cfg.max_rows, math.ceil((until - first + 1) / max(ids_left, 1)))
            limits[core] = limit
            rows = Rows(await self._read_chunk(core, first, until, limit))
            if not rows:
                run.next[core] = until + 1  # no event of this core left below the hand-over
                continue
            slices[core] = Slice(core, rows[0].lsn, rows[-1].lsn, rows)
        if not slices:
            self._finish_backfill(name)
            return
        if ids_left <= 0:  # pragma: no cover - the limit above takes everything by then
            raise BackfillError(f"stage {name}: no chunk id left below its hand-over batch")
        batch = MicroBatch(last_id + 1, slices)
        with structlog.contextvars.bound_contextvars(batch_id=batch.batch_id, backfill=name):
            failures = await self._call(batch, [name])
        if name in failures:
            self.stages.failed(name, batch.batch_id, failures[name])
            return
        self.stages.chunk_committed(name)
        for core, sl in slices.items():
            # A short read took everything of the core up to ``until``.
            done = sl.rows < limits[core] or sl.last_lsn >= bf.until[core]
            run.next[core] = bf.until[core] + 1 if done else sl.last_lsn + 1
        log.debug("cdc.backfill_chunk", stage=name, chunk=batch.batch_id, rows=batch.rows)
        self._reaper.give(batch)
        del batch
        now = self._clock()
        if now - run.logged >= BACKFILL_LOG_S:
            run.logged = now
            log.info("cdc.backfill_progress", stage=name, chunk=last_id + 1, **self._progress(name))

    def _finish_backfill(self, name: str) -> None:
        bf = self.watermarks.backfill.pop(name)
        run = self._backfills.pop(name, None)
        last_id, high = self.executor.stream_position(name)  # type: ignore[attr-defined]
        log.info(
            "cdc.backfill_done",
            stage=name,
            start_lsn=bf.start,
            until=list(bf.until),
            chunks=last_id,
            high_lsns={str(c): v for c, v in sorted(high.items())},
            seconds=round(self._clock() - run.started, 3) if run else None,
            hand_over_after_batch=self.stages.progress(name),
            message=f"stream {name} is filled up to the batch it was added at; it now "
            "runs the batches planned since, then joins the live ones",
        )
        self._wake.set()

    def _due_rows(self, p: _Pending) -> int:
        """Pending rows that make a batch due before its deadline. A slice takes up
        to ``catchup_max_rows`` whatever the mode: a backlog that built up while
        a batch ran goes out in few large batches, not many ``max_rows`` ones."""
        return self.cfg.catchup_max_rows if p.catching_up else self.cfg.max_rows

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
        # A batch closed ahead stays planned: a restart re-runs it from the plan log.

    def _deadline_passed(self) -> bool:
        due = self.idle_close_due()
        return due is not None and due <= self._clock()

    def _sync_stages(self, batch_id: int) -> tuple[str, ...]:
        return self.stages.sync(stage_names(self.executor), batch_id)

    async def _run_behind(self, live_waiting: bool = False) -> None:
        """Stages behind the live batches re-run the plans they missed, oldest
        first, while their backoff allows and no live batch is due.

        At least one behind batch runs per call when one is due, so a stage
        that recovered catches up even under steady load: the live batches it
        waits for grow meanwhile (their deadline is per row, not per batch),
        so there are fewer of them to catch up with.
        """
        ran = False
        while not self._stopping and self.executor.ready():
            if ran and (live_waiting or self._due_by_size() or self._deadline_passed()):
                return
            todo = self.stages.due(self._live_id)
            if todo is None:
                filling = self.stages.backfill_due()
                if filling is None:
                    return
                await self._backfill(filling)
                self._advance()
                ran = True
                continue
            bid, names = todo
            ranges = self._logged.get(bid)
            if ranges is None:  # pragma: no cover - plans stay until every stage is past them
                raise PlanLogError(f"stages {names} need batch {bid}, but its plan is gone")
            batch = await self._load(bid, ranges)
            with structlog.contextvars.bound_contextvars(batch_id=bid):
                failures = await self._call(batch, names)
            self._record(bid, names, failures)
            log.info(
                "stage_caught_up_batch",
                batch_id=bid,
                stages=[n for n in names if n not in failures],
                failed=sorted(failures),
                behind=max(self._live_id - bid, 0),
            )
            self._advance()
            self._reaper.give(batch)
            del batch
            ran = True

    async def _call(self, batch: MicroBatch, names: Sequence[str]) -> dict[str, BaseException]:
        """Run ``batch`` for ``names``; the stages that failed, each with its error
        (every one of them when the executor raised: the batch failed whole)."""
        try:
            if not self._named_stages or tuple(names) == (WHOLE_BATCH,):
                await self.executor.execute(batch)
                return {}
            return dict(await self.executor.execute(batch, names) or {})
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return dict.fromkeys(names, exc)

    def _record(
        self,
        batch_id: int,
        names: Sequence[str],
        failures: Mapping[str, Any],
        quiet: bool = False,
    ) -> None:
        for name in names:
            if name in failures:
                self.stages.failed(name, batch_id, failures[name], quiet=quiet)
            else:
                self.stages.succeeded(name, batch_id)

    def _advance(self) -> None:
        """Move the watermarks over every batch that all stages have committed."""
        floor = min(self.stages.floor(), self._live_id)
        wm = self.watermarks
        moved = False
        while wm.batch_id < floor:
            bid = wm.batch_id + 1
            ranges = self._logged.get(bid)
            if ranges is None:  # pragma: no cover - every planned id is logged
                raise PlanLogError(f"batch {bid} is committed by every stage but has no plan")
            wm.commit_ranges(bid, ranges)
            moved = True
        self.stages.publish(self._live_id)
        if moved and self._on_commit is not None:
            self._on_commit()

    def _live_done(self, batch_id: int) -> None:
        self._live_id = max(self._live_id, batch_id)
        self._advance()

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

    def expected_duration_s(self, prepared: bool = False) -> float:
        """What the batch starting now is expected to take at least: the shortest
        of the last ``ETA_BATCHES`` runs of batches prepared ahead (``prepared``)
        or not; of any runs while there are none of that kind (0 before the
        first).

        Apart, because a batch that builds its input in the run takes longer by
        that build. Mixed, a few such runs would make a prepared batch look
        slower than it is; its successor would then close after it committed,
        build its input in the run, and be one more such run.
        """
        recent = list(self._eta_runs[prepared]) or list(self._run_times)[-ETA_BATCHES:]
        if not recent:
            return 0.0
        return min(recent)

    def ahead_due(self, running_eta: float) -> float | None:
        """When (planner clock) the batch after the running one is due, the running
        one being expected to commit at ``running_eta``; None while nothing is
        pending. The later of the rows' own deadline and that commit less the
        next batch's preparation (``CLOSE_AHEAD_MARGIN_S`` on top)."""
        due = self.close_due()
        if due is None:
            return None
        rows = sum(p.rows for p in self._pending)
        lead = CLOSE_AHEAD_MARGIN_S + self._prepare_s(rows)
        return max(due, running_eta - lead)

    def _prepare_s(self, rows: int) -> float:
        """The executor's estimate of how long preparing ``rows`` takes (0 when it
        gives none)."""
        estimate = getattr(self._preparer, "prepare_seconds", None)
        return float(estimate(rows)) if callable(estimate) else 0.0

    def _ahead_full(self) -> bool:
        """While a batch runs: some core's pending slice cannot grow. It holds all
        a slice may take (``catchup_max_rows``), or pending plus running bytes
        are at the core's budget."""
        limit = self.cfg.catchup_max_rows
        return any(p.rows >= limit or (p.rows and not p.room.is_set()) for p in self._pending)

    def _due_by_size(self) -> bool:
        """Some core's pending slice makes a batch due now: it reached its row
        limit, or it cannot grow (pending plus running bytes at the budget)."""
        return any(
            p.rows >= self._due_rows(p) or (p.rows and not p.room.is_set()) for p in self._pending
        )

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
            behind = self.stages.next_due(self._live_id)
            if behind is not None:
                due = behind if due is None else min(due, behind)
            self._wake.clear()
            if due is None:
                await self._wake.wait()  # the first delivered row sets it
                continue
            remaining = due - self._clock()
            if remaining <= 0:
                return True
            await wait_event(self._wake, remaining)
        return False

    def expected_run_s(self) -> float:
        """What the close deadline expects the next batch's run to take (seconds)."""
        if not self._run_times:
            return 0.0
        return min(RUN_TIME_MARGIN * max(self._run_times), self.cfg.interval_ms / 1000)

    def close_due(self) -> float | None:
        """When (planner clock) the next batch is due so that its oldest row commits
        ``interval_ms`` after delivery; None while nothing is pending."""
        oldest = self._oldest_delivery()
        if oldest is None:
            return None
        return oldest + self.cfg.interval_ms / 1000 - self.expected_run_s()

    def idle_close_due(self) -> float | None:
        """``close_due`` for a batch that closes while none runs: not before its
        oldest row has waited ``IDLE_MIN_WAIT`` of the interval."""
        oldest = self._oldest_delivery()
        if oldest is None:
            return None
        interval = self.cfg.interval_ms / 1000
        return oldest + max(interval - self.expected_run_s(), IDLE_MIN_WAIT * interval)

    def _oldest_delivery(self) -> float | None:
        """Planner clock when the oldest pending row was delivered; None when none is."""
        return min((p.parts[0][2] for p in self._pending if p.parts), default=None)

    def _close(self) -> MicroBatch | None:
        slices: dict[int, Slice] = {}
        taken_bytes: dict[int, int] = {}
        for core, p in enumerate(self._pending):
            if not p.rows:
                continue
            before = p.nbytes
            taken = self._take(p, self.cfg.catchup_max_rows)
            taken_bytes[core] = before - p.nbytes
            p.inflight += taken_bytes[core]
            slices[core] = Slice(core, first_lsn(taken[0]), last_lsn(taken[-1]), Rows(taken))
        if not slices:
            return None
        batch = MicroBatch(self._next_id, slices)
        self._next_id += 1
        self._open[batch.batch_id] = batch.ranges()
        self._open_bytes[batch.batch_id] = taken_bytes
        return batch

    @staticmethod
    def _take(p: _Pending, limit: int) -> list[Part]:
        """Remove up to ``limit`` rows from the front of ``p``, splitting one part if needed."""
        if p.rows <= limit:
            taken = [part for part, _, _ in p.parts]
            p.parts, p.rows, p.nbytes = [], 0, 0
            return taken
        taken = []
        rows = 0
        i = 0
        while rows < limit:
            part, size, delivered = p.parts[i]
            if rows + len(part) <= limit:
                taken.append(part)
                rows += len(part)
                p.nbytes -= size
                i += 1
                continue
            head, tail = split_part(part, limit - rows)
            taken.append(head)
            rows = limit
            tail_bytes = part_bytes(tail)
            p.nbytes -= size - tail_bytes
            p.parts[i] = (tail, tail_bytes, delivered)
        del p.parts[:i]
        p.rows -= rows
        return taken

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
            info["failed_stages"] = sorted(failures)
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
