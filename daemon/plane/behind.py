"""Catch-up of stages behind: a stage that failed or was paused re-runs the plans it missed.

Invariant 6: a stage that fails on its own falls behind while the others go
on. This mixin of :class:`~daemon.plane.planner.Planner` brings it back:

1. Between two live batches, ``_run_behind`` asks the stage tracker for the
   oldest batch a stage is due to re-run (its backoff allows), or else for a
   backfill chunk (:mod:`daemon.plane.backfill`).
2. It rebuilds that batch from its plan and the WAL (``_load``), runs it for
   those stages only (``_call``) and records each stage's outcome (``_record``).
3. ``_advance`` moves the watermarks over every batch that all stages have
   committed, and publishes the stages' progress.

Up to ``CATCHUP_PER_LIVE`` behind batches run per stage and call when due,
so a recovered stage catches up under steady load, and a stage further
behind does not keep another one behind from trying. The executor does not wait for a
failing stage's commit behind (a stream's commit, a mirror's merge; ``wait_s = 0``): it
goes on in the stage's own thread (``InFlight``) and lands later (``_landed``), so a
stage behind whose store hangs never holds back the live batches.

How far a healthy stage may run ahead of a stuck one: as far as the WAL
keeps, never by memory. A stuck stage holds one batch in memory at most (its
attempt in flight); the batches it has not taken are plans (a few hundred
bytes each) and WAL segments, which retention keeps (invariant 9). The bound
is ``ingest.max_lag_events`` (invariant 12, measured from the watermarks,
which stop at the slowest stage): past it, ingest answers 429 and producers
wait; the healthy stages have then committed everything acknowledged, and
nothing is dropped. ``health.paused_max_lag_events`` is not that bound: it
only turns a paused stage's backlog into a problem. Why: docs/design.md, "Invariants" (6).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from daemon.plane.backfill import Backfills
from daemon.plane.batch import Held, InFlight, MicroBatch
from daemon.plane.planlog import PlanLogError, Ranges
from daemon.plane.stages import WHOLE_BATCH

if TYPE_CHECKING:
    pass

log = structlog.get_logger("daemon.plane.planner")

# Behind batches each stage may run between two live batches once one is
# due: two, so a stage whose commits take as long as a live batch's still
# gains one batch per live batch (with one it would never level).
CATCHUP_PER_LIVE = 2


class CatchUp(Backfills):
    """Stages behind the live batches (a mixin of ``Planner``, which owns the state)."""

    _stopping: bool
    _live_id: int
    _logged: dict[int, Ranges]
    _named_stages: bool
    _on_commit: Callable[[], None] | None
    _due_by_size: Callable[[], bool]
    _deadline_passed: Callable[[], bool]
    _load: Callable[[int, Ranges], Awaitable[MicroBatch]]
    _wake: asyncio.Event
    _clock: Callable[[], float]

    async def _run_behind(self, live_waiting: bool = False) -> None:
        """Stages behind the live batches re-run the plans they missed, oldest
        first, while their backoff allows and no live batch is due.

        Once a live batch is due, each stage may still run up to
        ``CATCHUP_PER_LIVE`` behind batches in this call, so a stage that
        recovered catches up even under steady load, and every stage behind
        gets its turn (not only the furthest behind).
        """
        ran: dict[str, int] = {}
        while not self._stopping and self.executor.ready():
            live_due = live_waiting or self._due_by_size() or self._deadline_passed()
            done = {n for n, k in ran.items() if k >= CATCHUP_PER_LIVE} if live_due else set()
            todo = self.stages.due(self._live_id, skip=done)
            if todo is None and live_due and ran:
                return
            if todo is None:
                filling = self.stages.backfill_due()
                if filling is None:
                    return
                await self._backfill(filling)
                self._advance()
                ran[filling] = ran.get(filling, 0) + CATCHUP_PER_LIVE
                if live_due:
                    return
                continue
            bid, names = todo
            ranges = self._logged.get(bid)
            if ranges is None:  # pragma: no cover - plans stay until every stage is past them
                raise PlanLogError(f"stages {names} need batch {bid}, but its plan is gone")
            batch = await self._load(bid, ranges)
            with structlog.contextvars.bound_contextvars(batch_id=bid):
                failures = await self._call(batch, names, behind=True)
            self._record(bid, names, failures)
            log.info(
                "stage_caught_up_batch",
                batch_id=bid,
                stages=[n for n in names if n not in failures],
                failed=sorted(n for n, f in failures.items() if not isinstance(f, InFlight | Held)),
                held=sorted(n for n, f in failures.items() if isinstance(f, Held)),
                in_flight=sorted(n for n, f in failures.items() if isinstance(f, InFlight)),
                behind=max(self._live_id - bid, 0),
            )
            self._advance()
            self._reaper.give(batch)
            del batch
            for n in names:
                ran[n] = ran.get(n, 0) + 1

    async def _call(
        self, batch: MicroBatch, names: Sequence[str], behind: bool = False
    ) -> dict[str, BaseException]:
        """Run ``batch`` for ``names``; the stages that failed, each with its error
        (every one of them when the executor raised: the batch failed whole),
        and those still running (``InFlight``)."""
        for name in names:
            self.stages.attempt_started(name, batch.batch_id)
        try:
            if not self._named_stages or tuple(names) == (WHOLE_BATCH,):
                await self.executor.execute(batch)
                return {}
            if behind and _takes_wait(self.executor) and any(map(self.stages.failing, names)):
                # A failing stage's retry must not hold the live batches for
                # attempt_slow_s each time (a store that hangs): not waited for.
                got = await self.executor.execute(batch, names, wait_s=0.0)  # type: ignore[call-arg]
            else:
                got = await self.executor.execute(batch, names)
            return dict(got or {})
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
            failure = failures.get(name)
            if isinstance(failure, Held):
                self.stages.held(name, batch_id)
            elif isinstance(failure, InFlight):
                self.stages.in_flight(name, batch_id)
                self._on_landing(failure, name, batch_id)
            elif failure is not None:
                self.stages.failed(name, batch_id, failure, quiet=quiet)
            else:
                self.stages.succeeded(name, batch_id)

    def _on_landing(self, marker: InFlight, name: str, batch_id: int) -> None:
        loop = asyncio.get_running_loop()

        def landed(done: Any) -> None:  # in the stream's thread
            loop.call_soon_threadsafe(self._landed, name, batch_id, done)

        marker.done.add_done_callback(landed)

    def _landed(self, name: str, batch_id: int, done: Any) -> None:
        """An attempt handed back ``InFlight`` is over (on the loop): record it,
        move the watermarks, and let the run loop give the stage its next batch."""
        if name not in self.stages.names:
            return  # removed by a reload meanwhile: it holds nothing back
        exc = done.exception()
        if exc is None:
            self.stages.succeeded(name, batch_id)
            log.info("stage_attempt_landed", stage=name, batch_id=batch_id)
        else:
            self.stages.failed(name, batch_id, exc)
        self._advance()
        self._wake.set()

    def _coalesce_due(self) -> float | None:
        """When (planner clock) the executor's next coalesced merge is due, if
        it holds batches for one (``Held``); None if it holds none."""
        due_in = getattr(self.executor, "coalesce_due_s", None)
        wait = due_in() if callable(due_in) else None
        return None if wait is None else self._clock() + max(wait, 0.0)

    async def _flush_coalesced(self, force: bool = False) -> None:
        """The coalesced merges that are due (all of them when ``force``: a
        clean stop), their outcomes recorded at the last batch each covers."""
        flush = getattr(self.executor, "flush_coalesced", None)
        if not callable(flush):
            return
        if not force:
            due = self._coalesce_due()
            if due is None or due > self._clock():
                return
        got: Mapping[str, tuple[int, BaseException | None]] = await flush(force=force)
        for name, (bid, outcome) in got.items():
            if name in self.stages.names:
                self._record(bid, [name], {} if outcome is None else {name: outcome})
        if got:
            self._advance()

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


def _takes_wait(executor: Any) -> bool:
    """The executor can hand a stage's attempt back unfinished (``wait_s``)."""
    try:
        return "wait_s" in inspect.signature(executor.execute).parameters
    except (TypeError, ValueError):
        return False
