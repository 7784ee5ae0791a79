"""Per-stage progress: each consumer of the batches moves on its own (invariant 6).

A *stage* is one consumer of every micro-batch: a CDC stream (``cdc:<name>``),
the trigger engine (``triggers``), a ``[[cdc.handlers]]`` function
(``handler:<pkg.mod:func>``). Each has a durable progress, the last batch id
it committed (kept in the watermarks file). The planner runs a batch for the
stages that are level with it (progress = batch id - 1); a stage that fails
falls behind, and only it:

- the others keep committing batch after batch;
- the failed stage re-runs the batches it missed from their plans (the WAL
  keeps their events), oldest first, with exponential backoff between failed
  attempts (``microbatch.retry_initial_ms`` .. ``retry_max_ms``), and joins
  the live batches again once it is level;
- the watermarks (what every stage committed) stop at the slowest stage, so
  WAL retention keeps what it still needs, and its lag is visible.

This module keeps the bookkeeping: progress lives in :class:`Watermarks`,
failure state and backoff here. It does no I/O and never blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from daemon.errors import error_text

if TYPE_CHECKING:
    from daemon.config import MicrobatchConfig
    from daemon.plane.watermarks import Watermarks
    from daemon.service.metrics import Metrics

log = structlog.get_logger("eventplane.stages")

# The stage of an executor that does not name its stages (tests, NullExecutor):
# the whole batch is one stage, which is how every batch ran before stages.
WHOLE_BATCH = "batch"
# Error texts kept per stage for status (Spark's messages can be long).
ERROR_CHARS = 2000


@dataclass(slots=True)
class StageState:
    """One stage's failure streak and backoff (progress is in the watermarks)."""

    name: str
    attempts: int = 0  # failed attempts since the last commit
    failing_since: float | None = None  # planner clock, first failure of the streak
    failing_since_wall: float | None = None  # Unix time of the same
    error: str | None = None  # the latest failure
    error_batch_id: int | None = None
    next_due: float = 0.0  # planner clock: when a behind stage may try again
    last_commit_wall: float | None = None


class StageTracker:
    """Which stage runs which batch, and how each one fares."""

    def __init__(
        self,
        watermarks: Watermarks,
        cfg: MicrobatchConfig,
        metrics: Metrics | None = None,
        *,
        stall_after_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.watermarks = watermarks
        self.cfg = cfg
        self.metrics = metrics
        self.stall_after_s = stall_after_s
        self._clock = clock
        self._wall = wall
        self._states: dict[str, StageState] = {}
        self._names: tuple[str, ...] = ()

    # -- the set of stages ---------------------------------------------------

    def sync(self, names: Iterable[str], batch_id: int) -> tuple[str, ...]:
        """Adopt the executor's current stages before running ``batch_id``.

        A stage seen for the first time starts level with ``batch_id`` (it
        takes the batches from this one on: a new stream starts at the head);
        one no longer configured is forgotten, so it holds nothing back.
        """
        current = tuple(dict.fromkeys(names)) or (WHOLE_BATCH,)
        if current == self._names:
            return current
        wm = self.watermarks
        for name in current:
            if name not in wm.stages:
                wm.stages[name] = max(batch_id - 1, wm.batch_id)
            self._states.setdefault(name, StageState(name))
            self._publish(name)
        for gone in set(self._names) - set(current):
            self._states.pop(gone, None)
            log.info("stage_removed", stage=gone)
        wm.forget_stages(set(current))
        self._names = current
        return current

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    def progress(self, name: str) -> int:
        return self.watermarks.stages.get(name, self.watermarks.batch_id)

    def participants(self, batch_id: int) -> list[str]:
        """The stages level with ``batch_id``: they run it on the live path."""
        return [n for n in self._names if self.progress(n) == batch_id - 1]

    def floor(self) -> int:
        """The last batch every stage committed."""
        return min((self.progress(n) for n in self._names), default=self.watermarks.batch_id)

    # -- outcomes ------------------------------------------------------------

    def succeeded(self, name: str, batch_id: int) -> None:
        st = self._states.setdefault(name, StageState(name))
        self.watermarks.stage_done(name, batch_id)
        if st.failing_since is not None:
            log.info(
                "stage_recovered",
                stage=name,
                batch_id=batch_id,
                failed_attempts=st.attempts,
                failing_s=round(self._clock() - st.failing_since, 3),
            )
        st.attempts = 0
        st.failing_since = st.failing_since_wall = None
        st.next_due = 0.0
        st.last_commit_wall = self._wall()
        self._publish(name)

    def failed(
        self, name: str, batch_id: int, exc: BaseException | str, *, quiet: bool = False
    ) -> float:
        """Record a failed attempt; returns the backoff before the next one (s)."""
        st = self._states.setdefault(name, StageState(name))
        now = self._clock()
        st.attempts += 1
        if st.failing_since is None:
            st.failing_since, st.failing_since_wall = now, self._wall()
        st.error = error_text(exc, ERROR_CHARS)
        st.error_batch_id = batch_id
        delay = self.backoff_s(st.attempts)
        st.next_due = now + delay
        if self.metrics is not None:
            self.metrics.stage_failures.labels(stage=name).inc()
        if quiet:
            return delay
        log.warning(
            "stage_failed",
            stage=name,
            batch_id=batch_id,
            attempt=st.attempts,
            error=st.error,
            retry_in_s=round(delay, 3),
        )
        return delay

    def backoff_s(self, attempts: int) -> float:
        """retry_initial_ms * 2^(attempts - 1), capped at retry_max_ms."""
        initial = self.cfg.retry_initial_ms / 1000
        return min(initial * 2.0 ** min(attempts - 1, 32), self.cfg.retry_max_ms / 1000)

    # -- stages behind the live batches --------------------------------------

    def behind(self, live_id: int) -> list[str]:
        return [n for n in self._names if self.progress(n) < live_id]

    def next_due(self, live_id: int) -> float | None:
        """When (planner clock) the next behind stage may run; None if none is behind."""
        return min((self._states[n].next_due for n in self.behind(live_id)), default=None)

    def due(self, live_id: int) -> tuple[int, list[str]] | None:
        """The oldest batch that behind stages due now need, and those stages."""
        now = self._clock()
        ready = [n for n in self.behind(live_id) if self._states[n].next_due <= now]
        if not ready:
            return None
        oldest = min(self.progress(n) for n in ready)
        return oldest + 1, [n for n in ready if self.progress(n) == oldest]

    # -- reporting -----------------------------------------------------------

    def failing_for_s(self, name: str) -> float:
        st = self._states.get(name)
        if st is None or st.failing_since is None:
            return 0.0
        return max(self._clock() - st.failing_since, 0.0)

    def stalled(self, name: str) -> bool:
        """Failing for longer than ``stall_after_s`` (health.stall_after_s)."""
        return self.failing_for_s(name) > self.stall_after_s

    def report(self, live_id: int) -> list[dict[str, Any]]:
        """Per stage, for ``/v1/status``."""
        out = []
        now = self._clock()
        for name in self._names:
            st = self._states[name]
            done = self.progress(name)
            out.append(
                {
                    "name": name,
                    "batch_id": done,
                    "behind_batches": max(live_id - done, 0),
                    "failing": st.failing_since is not None,
                    "stalled": self.stalled(name),
                    "failing_since": st.failing_since_wall,
                    "failing_for_s": round(self.failing_for_s(name), 3),
                    "attempts": st.attempts,
                    "last_error": st.error,
                    "last_error_batch_id": st.error_batch_id,
                    "next_retry_in_s": round(max(st.next_due - now, 0.0), 3)
                    if st.failing_since is not None
                    else None,
                    "last_commit_at": st.last_commit_wall,
                }
            )
        return out

    def publish(self, live_id: int) -> None:
        """Refresh the per-stage lag gauges (the planner calls it after each batch)."""
        if self.metrics is None:
            return
        for name in self._names:
            self.metrics.stage_lag_batches.labels(stage=name).set(
                max(live_id - self.progress(name), 0)
            )
            self.metrics.stage_batch_id.labels(stage=name).set(self.progress(name))

    def _publish(self, name: str) -> None:
        m = self.metrics
        if m is None:
            return
        m.stage_batch_id.labels(stage=name).set(self.progress(name))
        m.stage_failures.labels(stage=name)
        m.stage_failing_seconds.labels(stage=name).set_function(lambda: self.failing_for_s(name))
        m.stage_stalled.labels(stage=name).set_function(lambda: float(self.stalled(name)))


def stage_names(executor: Any) -> Sequence[str]:
    """The stages an executor runs (``stage_names()``), or none if it does not say."""
    names = getattr(executor, "stage_names", None)
    return tuple(names()) if callable(names) else ()
