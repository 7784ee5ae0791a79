"""Per-core ring buffers and their backpressure state (docs/design.md, data flow).

The WAL listener hands every durable group to :meth:`RingSet.push_group` on
the event loop, in LSN order, after the fsync (invariant 2). Each core's ring
is bounded by entry count and by payload bytes (invariant 11). A push never
blocks: when a record does not fit it is dropped, but the ring still records
it as *emitted* (``emitted`` is the core's sequence number of the last record
offered). The consumer compares ``emitted`` with the last sequence it took;
that is how a dropped tail is noticed even when nothing arrives after it.

Backpressure has hysteresis so the state does not flap around one threshold:

=========  ===========  ===========
state      enter at     leave below
=========  ===========  ===========
Throttled  85 % fill    75 % fill
Suspended  95 % fill    85 % fill
=========  ===========  ===========

Fill is the larger of the count ratio and the byte ratio. Every ring is
touched only on the event loop thread, so no locks are needed.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from operator import itemgetter
from typing import TYPE_CHECKING

from daemon.errors import LsnRegressionError
from wal.record import Record

_payload = itemgetter(3)

if TYPE_CHECKING:
    from daemon.service.metrics import Metrics

# Thresholds of docs/consumers.md (backpressure).
THROTTLE_AT = 0.85
THROTTLE_LEAVE = 0.75
SUSPEND_AT = 0.95
SUSPEND_LEAVE = 0.85


class Backpressure(enum.IntEnum):
    """Values match the ``eventplane_backpressure_state`` gauge."""

    NORMAL = 0
    THROTTLED = 1
    SUSPENDED = 2


def next_state(state: Backpressure, fill: float) -> Backpressure:
    """The hysteresis table above, as a pure function (tested on its own)."""
    if fill >= SUSPEND_AT:
        return Backpressure.SUSPENDED
    if state is Backpressure.SUSPENDED:
        if fill >= SUSPEND_LEAVE:
            return Backpressure.SUSPENDED
        return Backpressure.THROTTLED if fill >= THROTTLE_LEAVE else Backpressure.NORMAL
    if state is Backpressure.THROTTLED:
        return Backpressure.THROTTLED if fill >= THROTTLE_LEAVE else Backpressure.NORMAL
    return Backpressure.THROTTLED if fill >= THROTTLE_AT else Backpressure.NORMAL


class Ring:
    """One core's bounded FIFO of durable records, oldest first."""

    __slots__ = (
        "_entries",
        "_metrics",
        "capacity",
        "core",
        "dropped",
        "emitted",
        "last_drop_lsn",
        "max_bytes",
        "nbytes",
        "offered_lsn",
        "state",
    )

    def __init__(
        self, core: int, capacity: int, max_bytes: int, metrics: Metrics | None = None
    ) -> None:
        self.core = core
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._entries: deque[Record] = deque()
        self._metrics = metrics
        self.nbytes = 0
        # Sequence number of the last record offered, kept or dropped.
        self.emitted = 0
        # LSN of the last record offered, and of the last one dropped (0 = none).
        self.offered_lsn = 0
        self.last_drop_lsn = 0
        self.dropped = 0
        self.state = Backpressure.NORMAL
        if metrics is not None:
            metrics.backpressure_state.labels(core=str(core)).set(0)
            metrics.ring_utilization.labels(core=str(core)).set(0)
            metrics.ring_bytes.labels(core=str(core)).set(0)

    def __len__(self) -> int:
        return len(self._entries)

    def fill(self) -> float:
        """Fill ratio 0..1: the larger of count and bytes."""
        return max(len(self._entries) / self.capacity, self.nbytes / self.max_bytes)

    def offer(self, record: Record) -> bool:
        """Keep ``record`` if it fits, else drop it. Never blocks. True if kept.

        Callers refresh the state with :meth:`settle` after a group.
        """
        self.emitted = record.seq
        self.offered_lsn = record.lsn
        size = len(record.payload)
        if len(self._entries) >= self.capacity or self.nbytes + size > self.max_bytes:
            self.dropped += 1
            self.last_drop_lsn = record.lsn
            return False
        self._entries.append(record)
        self.nbytes += size
        return True

    def offer_all(self, records: list[Record]) -> int:
        """:meth:`offer` each of ``records`` (LSN order); returns how many were dropped.

        One call per core and group: when all of them fit, they go in at once.
        """
        entries = self._entries
        if len(entries) + len(records) <= self.capacity:
            size = sum(map(len, map(_payload, records)))
            if self.nbytes + size <= self.max_bytes:
                entries.extend(records)
                self.nbytes += size
                last = records[-1]
                self.emitted = last.seq
                self.offered_lsn = last.lsn
                return 0
        offer = self.offer
        return sum(not offer(r) for r in records)

    def take(self, limit: int) -> list[Record]:
        """Remove and return up to ``limit`` records, oldest first."""
        entries = self._entries
        n = min(limit, len(entries))
        if n == 0:
            return []
        if n == len(entries):  # the usual case: take everything, at C speed
            out = list(entries)
            entries.clear()
            self.nbytes = 0
        else:
            popleft = entries.popleft
            out = [popleft() for _ in range(n)]
            self.nbytes -= sum(map(len, map(_payload, out)))
        self.settle()
        return out

    def peek(self) -> Record | None:
        return self._entries[0] if self._entries else None

    def discard_through(self, lsn: int) -> int:
        """Drop entries with LSN <= ``lsn`` (already delivered from the WAL)."""
        entries = self._entries
        n = 0
        freed = 0
        while entries and entries[0].lsn <= lsn:
            freed += len(entries.popleft().payload)
            n += 1
        if n:
            self.nbytes = self.nbytes - freed if entries else 0
            self.settle()
        return n

    def settle(self) -> None:
        """Recompute the backpressure state and publish gauges."""
        fill = self.fill()
        new = next_state(self.state, fill)
        m = self._metrics
        if m is not None:
            core = str(self.core)
            m.ring_utilization.labels(core=core).set(len(self._entries) / self.capacity)
            m.ring_bytes.labels(core=core).set(self.nbytes)
        if new is not self.state:
            self.state = new
            if m is not None:
                core = str(self.core)
                m.backpressure_state.labels(core=core).set(int(new))
                m.backpressure_transitions.labels(core=core, to=new.name.lower()).inc()


class RingSet:
    """All cores' rings; :meth:`push_group` is the WAL listener's target."""

    __slots__ = ("_metrics", "pushed_lsn", "rings")

    def __init__(
        self,
        cores: int,
        capacity: int,
        max_bytes: int,
        metrics: Metrics | None = None,
        *,
        pushed_lsn: int = 0,
    ) -> None:
        self.rings = [Ring(c, capacity, max_bytes, metrics) for c in range(cores)]
        self._metrics = metrics
        # Highest LSN offered to any ring. Groups arrive whole and in LSN order,
        # so every record at or below it has been offered to its core's ring.
        self.pushed_lsn = pushed_lsn

    def __getitem__(self, core: int) -> Ring:
        return self.rings[core]

    def __len__(self) -> int:
        return len(self.rings)

    def push_group(self, records: Sequence[Record]) -> None:
        """Offer one durable group, in LSN order. Never blocks.

        Raises :class:`LsnRegressionError` if LSNs do not grow, and
        ``ValueError`` for a record of a core this daemon does not have (the
        WAL was written with another ``cores``); both are fatal to the plane.
        """
        if not records:
            return
        rings = self.rings
        ncores = len(rings)
        first, last = records[0].lsn, records[-1].lsn
        if first <= self.pushed_lsn or [r.lsn for r in records] != list(range(first, last + 1)):
            # A WAL group has consecutive LSNs; anything else is checked one by one.
            self._check_lsns(records)
        cores = [r.core for r in records]
        if min(cores) < 0 or max(cores) >= ncores:
            bad = next(r for r in records if not 0 <= r.core < ncores)
            raise ValueError(
                f"record LSN {bad.lsn} is for core {bad.core}, but daemon.cores = {ncores}"
            )
        buckets: list[list[Record]] = [[] for _ in rings]
        for core, record in zip(cores, records, strict=True):
            buckets[core].append(record)
        self.pushed_lsn = last
        for core, bucket in enumerate(buckets):
            if not bucket:
                continue
            ring = rings[core]
            dropped = ring.offer_all(bucket)
            ring.settle()
            if dropped and self._metrics is not None:
                self._metrics.ring_drops.labels(core=str(core)).inc(dropped)

    def _check_lsns(self, records: Sequence[Record]) -> None:
        last = self.pushed_lsn
        for record in records:
            lsn = record.lsn
            if lsn <= last:
                raise LsnRegressionError(
                    f"WAL listener delivered LSN {lsn} after LSN {last}; "
                    "durable groups must arrive in strictly increasing LSN order"
                )
            last = lsn
