"""When the planner closes a batch, and how much each core's slice takes.

Consumers add delivered parts to their core's pending slice (``_Pending``);
this mixin of :class:`~daemon.plane.planner.Planner` decides when a batch is
due and closes one slice per core into a :class:`~daemon.plane.batch.MicroBatch`:

1. Due by time: the oldest pending row has waited ``interval_ms`` less the
   expected run (``close_due``); with none running, at least ``IDLE_MIN_WAIT``
   of the interval (``idle_close_due``).
2. Due by size: a core reached ``max_rows`` (``catchup_max_rows`` while it
   catches up) or its memory budget (``_due_by_size``).
3. Closing ahead: while batch N runs, N+1 closes when N is expected to commit
   less N+1's preparation (``ahead_due``), at once only when a slice cannot
   grow (``_ahead_full``).
4. A slice takes everything its core has pending, up to ``catchup_max_rows``
   (``_close``, ``_take``).

Why these rules: docs/design.md, "Micro-batches", and docs/performance.md.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from daemon.plane.batch import MicroBatch, Preparer, Slice
from daemon.plane.parts import Part, Rows, first_lsn, last_lsn, part_bytes, split_part
from daemon.plane.planlog import Ranges

if TYPE_CHECKING:
    from daemon.config import MicrobatchConfig

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


class ClosingPolicy:
    """The planner's closing policy (a mixin of ``Planner``, which owns the state)."""

    cfg: MicrobatchConfig
    _clock: Callable[[], float]
    _pending: list[_Pending]
    _preparer: Preparer | None
    _run_times: deque[float]
    _eta_runs: dict[bool, deque[float]]
    _next_id: int
    _open: dict[int, Ranges]
    _open_bytes: dict[int, dict[int, int]]

    def _due_rows(self, p: _Pending) -> int:
        """Pending rows that make a batch due before its deadline. A slice takes up
        to ``catchup_max_rows`` whatever the mode: a backlog that built up while
        a batch ran goes out in few large batches, not many ``max_rows`` ones."""
        return self.cfg.catchup_max_rows if p.catching_up else self.cfg.max_rows

    def _deadline_passed(self) -> bool:
        due = self.idle_close_due()
        return due is not None and due <= self._clock()

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
