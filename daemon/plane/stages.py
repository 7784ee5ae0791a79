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

An operator may **pause** a stage (``eventplane pause``, the admin API): it
then runs no batch, live or behind, and falls behind exactly like a failing
stage (its plans are kept, the watermarks and WAL retention stop at it), but
it is neither retried nor reported failing or stalled; status shows it as
paused, with its backlog. **Resuming** makes it an ordinary stage behind: it
re-runs the batches it missed, with their ids and rows, oldest first, with
the usual backoff, and rejoins the live batches once level. A paused stage
whose backlog passes ``health.paused_max_lag_events`` is over its limit
(the daemon reports a problem; nothing is dropped). Pauses are kept in the
watermarks file, so they survive restarts.

A stage whose **attempt is slow** (still running after
``health.attempt_slow_s``) is reported at once, and when the executor hands
it back unfinished (``InFlight``: a stream's commit or a mirror's merge hung
on its store) it is *in flight*: it takes no other batch until that attempt
lands, the others run ahead of it as ahead of a failing stage. An error that retrying cannot
cure (its class says ``retriable = False``, ``daemon.errors.retry_cannot_cure``)
**stops** the stage: it is not retried, health names the error, and
``eventplane resume`` retries it after the fix.

A CDC stream new to the data_dir with ``start = "earliest"`` or an LSN
**backfills** (docs/cdc.md, "Adding a stream: backfill"): its progress stays
at the batch it was added at while the planner commits chunks read from the
WAL, below the live batches; meanwhile it runs no batch, live or behind, and
holds the watermarks like a stage behind, but it is not failing unless a
chunk fails. Once filled, it is an ordinary stage behind: it runs the
batches planned since it was added, then joins the live ones.

This module keeps the bookkeeping: progress and pauses live in
:class:`Watermarks`, failure state and backoff here. It does no I/O and never
blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from daemon.errors import DaemonError, error_text, retry_cannot_cure
from daemon.plane.watermarks import Pause

if TYPE_CHECKING:
    from daemon.config import MicrobatchConfig
    from daemon.metrics import Metrics
    from daemon.plane.watermarks import Watermarks

log = structlog.get_logger("eventplane.stages")

# The stage of an executor that does not name its stages (tests, NullExecutor):
# the whole batch is one stage, which is how every batch ran before stages.
WHOLE_BATCH = "batch"
# Error texts kept per stage for status (Spark's messages can be long).
ERROR_CHARS = 2000
# Longest pause reason and "by" kept (they are stored in the watermarks file).
PAUSE_TEXT_CHARS = 500


class UnknownStageError(DaemonError):
    """A stage name that is not one of the running stages (pause, resume)."""

    def __init__(self, name: str, names: Sequence[str]) -> None:
        self.name = name
        self.names = tuple(names)
        super().__init__(f"no stage {name!r}; the stages are: {', '.join(self.names) or 'none'}")


class StagesNotRunningError(DaemonError):
    """Stages cannot be paused or resumed now (the plane is starting or stopping)."""


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
    # Planner clock of the first attempt at the batch it is on (kept across
    # failed attempts, cleared by a commit): slow after attempt_slow_s.
    attempt_since: float | None = None
    attempt_batch_id: int | None = None
    in_flight: bool = False  # handed back unfinished (InFlight): takes no other batch
    stopped: str | None = None  # the class of an error retrying cannot cure
    # The last batch it took and holds uncommitted (``Held``: a coalesced
    # merge to come); it takes the batch after it. None: it holds none.
    held: int | None = None


class StageTracker:
    """Which stage runs which batch, and how each one fares."""

    def __init__(
        self,
        watermarks: Watermarks,
        cfg: MicrobatchConfig,
        metrics: Metrics | None = None,
        *,
        stall_after_s: float = 60.0,
        attempt_slow_s: float = 5.0,
        paused_max_lag_events: int = 0,
        waiting_for: Callable[[str], str | None] = lambda name: None,
        events_behind: Callable[[int], int] = lambda progress: 0,
        backfill_report: Callable[[str], dict[str, Any] | None] = lambda name: None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.watermarks = watermarks
        self.cfg = cfg
        self.metrics = metrics
        self.stall_after_s = stall_after_s
        self.attempt_slow_s = attempt_slow_s
        # stage -> what its running attempt waits for (the executor's words).
        self._waiting_for = waiting_for
        # health.paused_max_lag_events: a paused stage further behind is a problem (0: none).
        self.paused_max_lag_events = paused_max_lag_events
        # progress -> events (LSN distance) from the oldest batch above it to the head.
        self._events_behind = events_behind
        # stage -> its backfill's progress for status (None: not backfilling).
        self._backfill_report = backfill_report
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
        for name in wm.forget_stages(set(current)):
            # Paused before a restart (or a reload) that no longer has it: like
            # its progress, the pause is forgotten; it holds nothing back.
            log.warning(
                "stage.pause_dropped",
                stage=name,
                stages=list(current),
                message=f"stage {name} was paused but is no longer configured: its pause "
                "is forgotten with its progress",
            )
        self._names = current
        return current

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    def progress(self, name: str) -> int:
        return self.watermarks.stages.get(name, self.watermarks.batch_id)

    def position(self, name: str) -> int:
        """The last batch ``name`` took: its progress, or the last one it holds
        for a coalesced merge (``Held``), which is not progress."""
        st = self._states.get(name)
        held = st.held if st is not None and st.held is not None else 0
        return max(self.progress(name), held)

    def participants(self, batch_id: int) -> list[str]:
        """The stages level with ``batch_id`` and free (not paused, stopped,
        backfilling or in flight): they run it live."""
        return [n for n in self._names if self.position(n) == batch_id - 1 and self._free(n)]

    def active(self) -> list[str]:
        """The stages that take batches: not paused, stopped, backfilling or in flight."""
        return [n for n in self._names if self._free(n)]

    def _free(self, name: str) -> bool:
        st = self._states.get(name)
        held = st is not None and (st.in_flight or st.stopped is not None)
        return not held and not self.is_paused(name) and not self.is_backfilling(name)

    def floor(self) -> int:
        """The last batch every stage committed (a held batch is not: the
        watermarks, the WAL's retention and the plan log keep it)."""
        return min((self.progress(n) for n in self._names), default=self.watermarks.batch_id)

    # -- outcomes ------------------------------------------------------------

    def attempt_started(self, name: str, batch_id: int) -> None:
        """``name`` begins an attempt at ``batch_id`` (slow after attempt_slow_s)."""
        st = self._states.setdefault(name, StageState(name))
        if st.attempt_since is None or st.attempt_batch_id != batch_id:
            st.attempt_since, st.attempt_batch_id = self._clock(), batch_id

    def in_flight(self, name: str, batch_id: int) -> None:
        """The executor stopped waiting for ``name``'s attempt at ``batch_id``;
        its outcome comes later (``succeeded``/``failed``)."""
        st = self._states.setdefault(name, StageState(name))
        st.in_flight = True
        if st.attempt_since is None:
            st.attempt_since, st.attempt_batch_id = self._clock(), batch_id
        running = self._clock() - st.attempt_since
        (log.warning if running >= self.attempt_slow_s else log.debug)(
            "stage_attempt_in_flight",
            stage=name,
            batch_id=batch_id,
            running_s=round(running, 3),
            waiting_for=self._waiting_for(name),
            message=f"stage {name} is still at batch {batch_id}; the other stages go on",
        )

    def held(self, name: str, batch_id: int) -> None:
        """``name`` took ``batch_id`` and holds it for a coalesced merge with the
        next ones (``Held``): it takes the next batch; its progress stays."""
        st = self._states.setdefault(name, StageState(name))
        st.held = batch_id
        st.in_flight = False
        st.attempt_since = st.attempt_batch_id = None

    def holds(self, name: str) -> int:
        """How many batches ``name`` holds for its coalesced merge."""
        return self.position(name) - self.progress(name) if name in self._names else 0

    def succeeded(self, name: str, batch_id: int) -> None:
        st = self._states.setdefault(name, StageState(name))
        st.attempt_since = st.attempt_batch_id = None
        st.in_flight = False
        if st.held is not None and st.held <= batch_id:
            st.held = None
        if batch_id <= self.progress(name):
            return  # a coalesced merge's batches, recorded at its last one
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
        st.in_flight = False  # attempt_since stays: the batch is still not done
        # The batches it held are gone with the failed merge: it re-runs them
        # from their plans (the WAL kept them: they were not progress).
        st.held = None
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
        cause = retry_cannot_cure(exc) if isinstance(exc, BaseException) else None
        if cause is not None:
            # Not retried: the same batch would fail the same way.
            st.stopped = type(cause).__name__
            st.next_due = float("inf")
            log.error(
                "stage_stopped",
                stage=name,
                batch_id=batch_id,
                error=st.error,
                message=stopped_message(name, st.stopped, st.error),
            )
            return st.next_due
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
        """Stages behind the live batches that may catch up (a paused or a
        backfilling one may not)."""
        return [n for n in self._names if self.position(n) < live_id and self._free(n)]

    def next_due(self, live_id: int) -> float | None:
        """When (planner clock) the next behind or backfilling stage may run;
        None if none is."""
        todo = [*self.behind(live_id), *self.backfilling()]
        return min((self._states[n].next_due for n in todo), default=None)

    # -- backfill (a new CDC stream filling from the WAL) ---------------------

    def is_backfilling(self, name: str) -> bool:
        return name in self.watermarks.backfill

    def backfilling(self) -> list[str]:
        """Backfilling stages that may run a chunk (not paused, stopped or in flight)."""
        return [
            n
            for n in self._names
            if self.is_backfilling(n) and not self.is_paused(n)
            if not (self._states[n].in_flight or self._states[n].stopped)
        ]

    def backfill_due(self) -> str | None:
        """A backfilling stage whose backoff allows a chunk now."""
        now = self._clock()
        st = self._states
        return next((n for n in self.backfilling() if st[n].next_due <= now), None)

    def chunk_committed(self, name: str) -> None:
        """A backfill chunk committed: the stage's failure streak ends (its
        progress does not move: chunks are below it)."""
        st = self._states.setdefault(name, StageState(name))
        st.in_flight = False
        if st.failing_since is not None:
            log.info("stage_recovered", stage=name, failed_attempts=st.attempts)
        self._reset(name)
        st.last_commit_wall = self._wall()

    def due(self, live_id: int, skip: Collection[str] = ()) -> tuple[int, list[str]] | None:
        """The oldest batch that behind stages due now (not in ``skip``) need,
        and those stages."""
        now = self._clock()
        ready = [
            n for n in self.behind(live_id) if self._states[n].next_due <= now and n not in skip
        ]
        if not ready:
            return None
        oldest = min(self.position(n) for n in ready)
        return oldest + 1, [n for n in ready if self.position(n) == oldest]

    # -- pause and resume (an operator's choice) -----------------------------

    def is_paused(self, name: str) -> bool:
        return name in self.watermarks.paused

    def pause(self, name: str, *, reason: str | None = None, by: str | None = None) -> bool:
        """Pause ``name`` from its next batch on; False if it was paused already
        (then nothing changes: the first pause's time, reason and author stay).

        A batch that runs for it right now still commits. Its failure streak
        ends here: a paused stage is not retried, so it is not failing.
        """
        self._require(name)
        if self.is_paused(name):
            return False
        pause = Pause(self._wall(), _text(by), _text(reason))
        self.watermarks.paused[name] = pause
        self._reset(name)
        log.info(
            "stage.paused",
            stage=name,
            reason=pause.reason,
            by=pause.by,
            batch_id=self.progress(name),
        )
        self._publish(name)
        return True

    def resume(self, name: str) -> bool:
        """Resume ``name``: it catches up on the batches it missed, at once and
        then with the usual backoff. A stage stopped by an error retrying
        cannot cure tries again. False if it was neither paused nor stopped."""
        self._require(name)
        st = self._states.setdefault(name, StageState(name))
        if st.stopped is not None:
            log.info(
                "stage.resumed", stage=name, stopped_by=st.stopped, batch_id=self.progress(name)
            )
            st.stopped = None
            st.next_due = 0.0
            self._publish(name)
            return True
        pause = self.watermarks.paused.pop(name, None)
        if pause is None:
            return False
        self._reset(name)
        log.info(
            "stage.resumed",
            stage=name,
            paused_s=round(max(self._wall() - pause.since, 0.0), 3),
            batch_id=self.progress(name),
            behind_events=self.events_behind(name),
        )
        self._publish(name)
        return True

    def _require(self, name: str) -> None:
        if name not in self._names:
            raise UnknownStageError(name, self._names)

    def _reset(self, name: str) -> None:
        st = self._states.setdefault(name, StageState(name))
        st.attempts = 0
        st.failing_since = st.failing_since_wall = None
        st.next_due = 0.0
        if not st.in_flight:
            st.attempt_since = st.attempt_batch_id = None

    def events_behind(self, name: str) -> int:
        """Events (an LSN distance: an upper bound) from the first event of the
        oldest batch ``name`` has not committed to the WAL head; 0 when level."""
        if name not in self._names:
            return 0
        return self._events_behind(self.progress(name))

    def over_limit(self, name: str) -> bool:
        """Paused, and further behind than ``health.paused_max_lag_events``."""
        limit = self.paused_max_lag_events
        return bool(limit) and self.is_paused(name) and self.events_behind(name) > limit

    def backlog_ratio(self, name: str) -> float:
        """A paused stage's events behind over its limit (0 when not paused or no limit)."""
        limit = self.paused_max_lag_events
        if not limit or not self.is_paused(name):
            return 0.0
        return self.events_behind(name) / limit

    # -- reporting -----------------------------------------------------------

    def failing_for_s(self, name: str) -> float:
        st = self._states.get(name)
        if st is None or st.failing_since is None or self.is_paused(name):
            return 0.0
        return max(self._clock() - st.failing_since, 0.0)

    def stalled(self, name: str) -> bool:
        """Failing for longer than ``stall_after_s`` (health.stall_after_s)."""
        return self.failing_for_s(name) > self.stall_after_s

    def attempt_for_s(self, name: str) -> float:
        """How long ``name`` has been trying the batch it is on: one attempt
        running, or failed ones and their backoff (0: it has none to do)."""
        st = self._states.get(name)
        if st is None or st.attempt_since is None or self.is_paused(name) or st.stopped:
            return 0.0
        return max(self._clock() - st.attempt_since, 0.0)

    def slow(self, name: str) -> bool:
        """It has not committed the batch it is on within ``attempt_slow_s``
        (health.attempt_slow_s): an attempt hangs, or attempts keep failing."""
        return self.attempt_for_s(name) > self.attempt_slow_s

    def waiting_for(self, name: str) -> str | None:
        """What a slow stage waits for: its running attempt (the executor's
        words), or its next retry after the last error."""
        st = self._states.get(name)
        if st is None or st.attempt_since is None:
            return None
        running = self._waiting_for(name)
        if running is not None:
            return running
        if st.error is not None and not st.in_flight:
            wait = max(st.next_due - self._clock(), 0.0)
            return f"its attempt {st.attempts + 1} in {wait:.1f} s, after {st.error}"
        return None

    def any_in_flight(self) -> bool:
        return any(self._states[n].in_flight for n in self._names if n in self._states)

    def failing(self, name: str) -> bool:
        st = self._states.get(name)
        return st is not None and st.attempts > 0

    def stopped(self, name: str) -> bool:
        st = self._states.get(name)
        return st is not None and st.stopped is not None

    def report(self, live_id: int) -> list[dict[str, Any]]:
        """Per stage, for ``/v1/status``."""
        now = self._clock()
        return [self.entry(name, live_id, now) for name in self._names]

    def entry(self, name: str, live_id: int, now: float | None = None) -> dict[str, Any]:
        """One stage's ``/v1/status`` entry."""
        now = self._clock() if now is None else now
        st = self._states.setdefault(name, StageState(name))
        done = self.progress(name)
        pause = self.watermarks.paused.get(name)
        failing = st.failing_since is not None and pause is None
        return {
            "name": name,
            "batch_id": done,
            "behind_batches": max(live_id - done, 0),
            "held_batches": self.holds(name),
            "behind_events": self.events_behind(name),
            "failing": failing,
            "stalled": self.stalled(name),
            "slow": self.slow(name),
            "attempt_batch_id": st.attempt_batch_id,
            "attempt_for_s": round(self.attempt_for_s(name), 3),
            "in_flight": st.in_flight,
            "waiting_for": self.waiting_for(name),
            "stopped": st.stopped is not None,
            "stopped_by": st.stopped,
            "failing_since": st.failing_since_wall if failing else None,
            "failing_for_s": round(self.failing_for_s(name), 3),
            "attempts": st.attempts,
            "last_error": st.error,
            "last_error_batch_id": st.error_batch_id,
            "next_retry_in_s": round(max(st.next_due - now, 0.0), 3)
            if failing and st.stopped is None
            else None,
            "last_commit_at": st.last_commit_wall,
            "paused": pause is not None,
            "paused_since": pause.since if pause else None,
            "paused_for_s": round(max(self._wall() - pause.since, 0.0), 3) if pause else None,
            "paused_by": pause.by if pause else None,
            "paused_reason": pause.reason if pause else None,
            "paused_over_limit": self.over_limit(name),
            "backfilling": self.is_backfilling(name),
            "backfill": self._backfill_report(name),
        }

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
        m.stage_slow.labels(stage=name).set_function(lambda: float(self.slow(name)))
        m.stage_attempt_seconds.labels(stage=name).set_function(lambda: self.attempt_for_s(name))
        m.stage_stopped.labels(stage=name).set_function(lambda: float(self.stopped(name)))
        m.stage_paused.labels(stage=name).set_function(lambda: float(self.is_paused(name)))
        m.stage_lag_events.labels(stage=name).set_function(lambda: self.events_behind(name))
        m.stage_paused_backlog_ratio.labels(stage=name).set_function(
            lambda: self.backlog_ratio(name)
        )
        m.stage_backfill_remaining.labels(stage=name).set_function(
            lambda: (self._backfill_report(name) or {}).get("events_remaining", 0)
        )


def stopped_message(name: str, error_class: str, error: str | None) -> str:
    """What an operator reads for a stage stopped by an error retrying cannot cure."""
    return (
        f"stage {name} stopped on {error_class}, which retrying cannot cure: {error}. "
        "The WAL keeps its batches. Fix what the error names (docs/operating.md, "
        f'"A stopped stage"), then `eventplane resume {name}`'
    )


def slow_problem(stage: dict[str, Any], limit: float) -> dict[str, Any]:
    """The problem of a stage whose attempt runs longer than ``health.attempt_slow_s``."""
    name = stage["name"]
    waits = stage.get("waiting_for") or "its attempt"
    return {
        "part": f"stage {name}",
        "stage": name,
        "slow": True,
        "attempt_batch_id": stage["attempt_batch_id"],
        "attempt_for_s": stage["attempt_for_s"],
        "waiting_for": stage.get("waiting_for"),
        "behind_batches": stage["behind_batches"],
        "message": f"stage {name} is slow: batch {stage['attempt_batch_id']} has run "
        f"{stage['attempt_for_s']:.0f} s (limit {limit:g} s), waiting for {waits}; "
        "the other stages go on without it",
    }


def paused_problem(stage: dict[str, Any], limit: int) -> dict[str, Any]:
    """The problem of a paused stage whose backlog passed
    ``health.paused_max_lag_events``: what it holds, and the two ways out."""
    name = stage["name"]
    why = f" ({stage['paused_reason']})" if stage.get("paused_reason") else ""
    return {
        "part": f"stage {name}",
        "stage": name,
        "paused": True,
        "since": stage["paused_since"],
        "behind_batches": stage["behind_batches"],
        "behind_events": stage["behind_events"],
        "message": f"stage {name} is paused{why} and {stage['behind_events']:,} events behind, "
        f"over health.paused_max_lag_events = {limit:,}: the WAL keeps all of them. "
        f"Resume it (`eventplane resume {name}`), or remove it from the config and "
        "restart to give up on its backlog",
    }


def _text(value: str | None) -> str | None:
    """A pause's reason or author as stored: one line, bounded, None if empty."""
    if value is None:
        return None
    text = " ".join(str(value).split())[:PAUSE_TEXT_CHARS]
    return text or None


def stage_names(executor: Any) -> Sequence[str]:
    """The stages an executor runs (``stage_names()``), or none if it does not say."""
    names = getattr(executor, "stage_names", None)
    return tuple(names()) if callable(names) else ()
