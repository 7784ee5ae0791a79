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

At least one behind batch runs per call when one is due, so a recovered stage
catches up under steady load. Why: docs/design.md, "Invariants" (6).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from daemon.plane.backfill import Backfills
from daemon.plane.batch import MicroBatch
from daemon.plane.planlog import PlanLogError, Ranges
from daemon.plane.stages import WHOLE_BATCH

if TYPE_CHECKING:
    pass

log = structlog.get_logger("daemon.plane.planner")


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
