"""Backfill: a CDC stream new to the data_dir fills from the WAL below the live batches.

A stream configured with ``start = "earliest"`` (or an LSN) and no progress
yet backfills; this mixin of :class:`~daemon.plane.planner.Planner` runs it:

1. ``prepare_backfills`` at start: fix each core's ``until`` (its watermark)
   and record the backfill in the watermarks, or resume a recorded one.
2. Between live batches (``_run_behind``), ``_backfill`` commits the next
   chunk for that stage alone: per core from its next LSN, at most
   ``max_rows`` rows, with chunk ids 1, 2, ... below the hand-over batch.
3. When no core has events left below ``until``, ``_finish_backfill`` hands
   the stream over: it runs the batches planned since, then the live ones.

The stream's ledger is the position, so a restart continues after the last
committed chunk. Why and how to use it: docs/cdc.md, "Adding a stream: backfill".
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import structlog

from daemon.errors import DaemonError
from daemon.plane.batch import Executor, InFlight, MicroBatch, Slice
from daemon.plane.parts import Part, Rows
from daemon.plane.stages import StageTracker
from daemon.plane.watermarks import Backfill

if TYPE_CHECKING:
    from daemon.config import MicrobatchConfig
    from daemon.plane.watermarks import Watermarks

log = structlog.get_logger("daemon.plane.planner")


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


class Backfills:
    """The planner's backfills (a mixin of ``Planner``, which owns the state)."""

    cores: int
    cfg: MicrobatchConfig
    executor: Executor
    watermarks: Watermarks
    stages: StageTracker
    _backfills: dict[str, _BackfillRun]
    _new_stages: list[str]
    _clock: Callable[[], float]
    _wake: asyncio.Event
    _retained_floor: Callable[[], int]
    _load_slice: Callable[[int, int, int], Awaitable[Sequence[Part]]]
    _read_chunk: Callable[[int, int, int, int], Awaitable[Sequence[Part]]]
    _call: Callable[[MicroBatch, Sequence[str]], Awaitable[dict[str, BaseException]]]
    _reaper: Any

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
        failure = failures.get(name)
        if isinstance(failure, InFlight):
            # The chunk's commit goes on in the stream's thread (a slow or hung
            # store). It is not a failure: the commit may still land, and a
            # retry from the same ``run.next`` under the next chunk id would
            # then start below what it committed (LsnRegressionError, forever).
            # The stage takes no other chunk until it lands (``_chunk_landed``).
            self.stages.in_flight(name, batch.batch_id)
            loop = asyncio.get_running_loop()
            failure.done.add_done_callback(
                lambda done: loop.call_soon_threadsafe(
                    self._chunk_landed, name, run, batch, limits, done
                )
            )
            return
        if failure is not None:
            self.stages.failed(name, batch.batch_id, failure)
            return
        self._chunk_done(name, run, batch, limits)

    def _chunk_done(
        self, name: str, run: _BackfillRun, batch: MicroBatch, limits: Mapping[int, int]
    ) -> None:
        """A chunk committed: the backfill's position moves past its rows."""
        bf = self.watermarks.backfill[name]
        self.stages.chunk_committed(name)
        for core, sl in batch.slices.items():
            # A short read took everything of the core up to ``until``.
            done = sl.rows < limits[core] or sl.last_lsn >= bf.until[core]
            run.next[core] = bf.until[core] + 1 if done else sl.last_lsn + 1
        log.debug("cdc.backfill_chunk", stage=name, chunk=batch.batch_id, rows=batch.rows)
        self._reaper.give(batch)
        now = self._clock()
        if now - run.logged >= BACKFILL_LOG_S:
            run.logged = now
            log.info(
                "cdc.backfill_progress", stage=name, chunk=batch.batch_id, **self._progress(name)
            )

    def _chunk_landed(
        self,
        name: str,
        run: _BackfillRun,
        batch: MicroBatch,
        limits: Mapping[int, int],
        done: Future[None],
    ) -> None:
        """A chunk handed back ``InFlight`` is over (on the loop): its commit
        moves the position as if it had been waited for; its error is a failed
        attempt (the retry has the same id and rows)."""
        if self._backfills.get(name) is not run or name not in self.stages.names:
            return  # removed by a reload, or a new run: it holds nothing
        exc = done.exception()
        if exc is None:
            self._chunk_done(name, run, batch, limits)
            log.info("stage_attempt_landed", stage=name, chunk=batch.batch_id)
        else:
            self.stages.failed(name, batch.batch_id, exc)
        self._wake.set()

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
