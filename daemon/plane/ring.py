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
from array import array
from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from daemon.errors import LsnRegressionError
from daemon.plane.parts import pack
from wal.reader import RecordBatch
from wal.record import Record

if TYPE_CHECKING:
    from daemon.metrics import Metrics

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
    """One core's bounded FIFO of durable records, oldest first.

    The entries are *runs*: :class:`~wal.reader.RecordBatch` objects, each a
    stretch of records with consecutive sequences and ascending LSNs (the
    WAL's columnar listener hands one per core and group, see
    :meth:`RingSet.push_batches`). The bounds, the drops and ``emitted`` are
    per record, exactly as if the records were offered one by one; only the
    storage is per run, so a group costs the ring a few objects, not one per
    event.
    """

    __slots__ = (
        "_count",
        "_gauges",
        "_metrics",
        "_runs",
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
        self._runs: deque[RecordBatch] = deque()
        self._count = 0  # records in _runs
        self._metrics = metrics
        self.nbytes = 0
        # Sequence number of the last record offered, kept or dropped.
        self.emitted = 0
        # LSN of the last record offered, and of the last one dropped (0 = none).
        self.offered_lsn = 0
        self.last_drop_lsn = 0
        self.dropped = 0
        self.state = Backpressure.NORMAL
        # The per-core gauges settle() sets after every push and take, looked up
        # once: a labels() call per settle is measurable.
        self._gauges: tuple[Any, Any] | None = None
        if metrics is not None:
            metrics.backpressure_state.labels(core=str(core)).set(0)
            self._gauges = (
                metrics.ring_utilization.labels(core=str(core)),
                metrics.ring_bytes.labels(core=str(core)),
            )
            for gauge in self._gauges:
                gauge.set(0)

    def __len__(self) -> int:
        return self._count

    def fill(self) -> float:
        """Fill ratio 0..1: the larger of count and bytes."""
        return max(self._count / self.capacity, self.nbytes / self.max_bytes)

    def offer(self, record: Record) -> bool:
        """Keep ``record`` if it fits, else drop it. Never blocks. True if kept.

        Callers refresh the state with :meth:`settle` after a group.
        """
        run = RecordBatch(
            record.core,
            array("Q", (record.lsn,)),
            record.seq,
            array("Q", (0, len(record.payload))),
            record.payload,
        )
        return self.offer_run(run) == 0

    def offer_all(self, records: Sequence[Record]) -> int:
        """:meth:`offer` each of ``records`` (LSN order); returns how many were dropped.

        Records whose sequences continue each other, with growing LSNs, go in
        as one run.
        """
        dropped = 0
        start = 0
        n = len(records)
        for i in range(1, n + 1):
            if (
                i == n
                or records[i].seq != records[i - 1].seq + 1
                or records[i].lsn <= records[i - 1].lsn
            ):
                dropped += self.offer_run(pack(records[start:i]))
                start = i
        return dropped

    def offer_run(self, run: RecordBatch) -> int:
        """Offer a run's records in order; returns how many were dropped.

        When the whole run fits (the usual case) it goes in as it is. Otherwise
        each record is kept if it fits, else dropped (a later, smaller record
        may still fit: the consumer then sees a sequence gap), and the kept
        records go in as runs of their own.
        """
        n = len(run)
        if not n:
            return 0
        lsns = run.lsns
        self.emitted = run.first_seq + n - 1
        self.offered_lsn = lsns[-1]
        size = len(run.data)
        if self._count + n <= self.capacity and self.nbytes + size <= self.max_bytes:
            self._runs.append(run)
            self._count += n
            self.nbytes += size
            return 0
        # Step by step, as offers of single records would go.
        offs = run.offsets
        count, nbytes = self._count, self.nbytes
        kept: list[tuple[int, int]] = []  # [start, end) index ranges kept
        dropped = 0
        for i in range(n):
            k = offs[i + 1] - offs[i]
            if count >= self.capacity or nbytes + k > self.max_bytes:
                dropped += 1
                self.last_drop_lsn = lsns[i]
                continue
            count += 1
            nbytes += k
            if kept and kept[-1][1] == i:
                kept[-1] = (kept[-1][0], i + 1)
            else:
                kept.append((i, i + 1))
        for a, b in kept:
            self._runs.append(_slice(run, a, b))
        self._count, self.nbytes = count, nbytes
        self.dropped += dropped
        return dropped

    def take_runs(self, limit: int) -> list[RecordBatch]:
        """Remove and return runs holding up to ``limit`` records, oldest first
        (the last run is split when it would go past ``limit``)."""
        runs = self._runs
        if not runs or limit <= 0:
            return []
        out: list[RecordBatch] = []
        if self._count <= limit:  # the usual case: take everything
            out = list(runs)
            runs.clear()
            self._count = 0
            self.nbytes = 0
        else:
            left = limit
            freed = 0
            while left:
                run = runs[0]
                if len(run) <= left:
                    runs.popleft()
                else:
                    run, runs[0] = _slice(run, 0, left), _slice(run, left, len(run))
                out.append(run)
                left -= len(run)
                freed += len(run.data)
            self._count -= limit
            self.nbytes -= freed
        self.settle()
        return out

    def take(self, limit: int) -> list[Record]:
        """Remove and return up to ``limit`` records, oldest first."""
        return [r for run in self.take_runs(limit) for r in run.records()]

    def peek(self) -> Record | None:
        if not self._runs:
            return None
        run = self._runs[0]
        return Record(run.lsns[0], run.core, run.first_seq, run.payload(0))

    def discard_through(self, lsn: int) -> int:
        """Drop entries with LSN <= ``lsn`` (already delivered from the WAL)."""
        runs = self._runs
        n = 0
        freed = 0
        while runs and runs[0].lsns[0] <= lsn:
            run = runs[0]
            k = bisect_right(run.lsns, lsn)
            if k >= len(run):
                runs.popleft()
                freed += len(run.data)
            else:
                head, runs[0] = _slice(run, 0, k), _slice(run, k, len(run))
                freed += len(head.data)
                k = len(head)
            n += k
        if n:
            self._count -= n
            self.nbytes = self.nbytes - freed if runs else 0
            self.settle()
        return n

    def settle(self) -> None:
        """Recompute the backpressure state and publish gauges."""
        fill = self.fill()
        new = next_state(self.state, fill)
        gauges = self._gauges
        if gauges is not None:
            gauges[0].set(self._count / self.capacity)
            gauges[1].set(self.nbytes)
        if new is not self.state:
            self.state = new
            m = self._metrics
            if m is not None:
                core = str(self.core)
                m.backpressure_state.labels(core=core).set(int(new))
                m.backpressure_transitions.labels(core=core, to=new.name.lower()).inc()


def _slice(run: RecordBatch, a: int, b: int) -> RecordBatch:
    """Records ``a`` .. ``b - 1`` of ``run`` as a run of their own."""
    offs = run.offsets
    base = offs[a]
    # Offsets start at 0 in a RecordBatch (the Arrow layout): rebase unless they do.
    new_offs = offs[: b + 1] if a == 0 else array("Q", map(base.__rsub__, offs[a : b + 1]))
    return RecordBatch(
        run.core, run.lsns[a:b], run.first_seq + a, new_offs, run.data[base : offs[b]]
    )


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

    def push_batches(self, batches: Sequence[RecordBatch]) -> None:
        """:meth:`push_group` for the WAL's columnar listener: one durable group as
        one run per core (:meth:`wal.Wal.set_batch_listener`). Never blocks.

        The checks are per run: its LSNs ascend inside (the WAL builds them
        so), and the group must start above every LSN pushed before; the
        group's highest LSN becomes ``pushed_lsn``. Same errors as
        :meth:`push_group`.
        """
        rings = self.rings
        ncores = len(rings)
        last = self.pushed_lsn
        top = last
        for batch in batches:
            lsns = batch.lsns
            if not lsns:
                continue
            if lsns[0] <= last:
                raise LsnRegressionError(
                    f"WAL listener delivered LSN {lsns[0]} after LSN {last}; "
                    "durable groups must arrive in strictly increasing LSN order"
                )
            if not 0 <= batch.core < ncores:
                raise ValueError(
                    f"record LSN {lsns[0]} is for core {batch.core}, but daemon.cores = {ncores}"
                )
            top = max(top, lsns[-1])
        self.pushed_lsn = top
        for batch in batches:
            if not batch.lsns:
                continue
            ring = rings[batch.core]
            dropped = ring.offer_run(batch)
            ring.settle()
            if dropped and self._metrics is not None:
                self._metrics.ring_drops.labels(core=str(batch.core)).inc(dropped)

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
