"""Micro-batch planner: per-core pending slices, a durable plan log, and the run loop.

Consumers add delivered records to their core's pending slice. The planner
closes one slice per core into a :class:`~daemon.batch.MicroBatch` and runs
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
3. ``await executor.execute(batch)``; on failure retry with exponential
   backoff, same id and same rows, forever (a batch is never dropped).
4. Commit: advance the watermarks of the batch's cores.

While batch N runs (step 3), an executor that prepares (``Preparer``) gets
batch N+1 early: once N+1 is due, it goes through steps 1-2 and
``executor.prepare``; it runs right after N's step 4 (``run``).

After a crash, plans above the persisted watermarks' ``batch_id`` are read
back from the WAL and re-run first with their own ids (the executor's sinks
dedupe by batch id), and consumers resume after the highest planned LSN.

Plan log format, one line per entry, each ``<crc32 of json, 8 hex> <json>\\n``;
the first line is the identity header (invariant 13)::

    0a1b2c3d {"format":"eventplane-plans","version":1,"wal_id":"...","cores":4}
    9f8e7d6c {"batch_id":1,"slices":{"0":[1,9],"2":[3,12]}}

A torn last line (crash mid-append) is cut off at open: its batch never ran,
because step 3 starts only after step 2's fsync returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import threading
import time
import zlib
from array import array
from bisect import bisect_right
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from itertools import accumulate
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, overload

import structlog

from daemon.batch import Executor, MicroBatch, Preparer, Slice
from daemon.errors import DaemonError, IdentityMismatchError, LsnRegressionError
from daemon.watermarks import atomic_write
from wal.reader import RecordBatch
from wal.record import Record

if TYPE_CHECKING:
    from daemon.config import MicrobatchConfig
    from daemon.metrics import Metrics
    from daemon.watermarks import Watermarks

log = structlog.get_logger(__name__)

FORMAT = "eventplane-plans"
VERSION = 1
FILENAME = "plans.log"
# Rewrite the plan log once this many of its entries are covered by persisted
# watermarks: about 17 minutes of 1 s batches, a few tens of KiB of file.
COMPACT_AFTER = 1024
# In-memory cost of one Record (a ring entry) beyond its payload: the tuple
# (80 B), two ints (64 B), the bytes object's header with pymalloc's rounding
# (~46 B) and the container's slot (8 B). Measured with pymalloc's own block
# counts on CPython 3.11: 198 B for ~130-byte events with exact-size payloads.
RECORD_OVERHEAD_BYTES = 200
# The same for one event of a columnar RecordBatch: a u64 LSN and a u64 offset,
# in arrays built by appending (CPython over-allocates them by ~1/16).
COLUMNAR_OVERHEAD_BYTES = 18
# ... and for each columnar part: the RecordBatch, its two arrays (with their
# over-allocation) and the planner's (part, bytes) entry. Measured 130-530 B
# per part (pymalloc and glibc counts); a part can be one event, so it counts.
PART_OVERHEAD_BYTES = 512

# The close deadline (module docstring) expects the next run to take this
# many times the slowest of the last RECENT_BATCHES runs: room for the next
# one's variance, and for delivery before and the actions' hand-off after.
RECENT_BATCHES = 8
RUN_TIME_MARGIN = 1.25

Ranges = dict[int, tuple[int, int]]
T = TypeVar("T")
_payload = itemgetter(3)

# Delivered rows come in parts: columnar batches from WAL replay (CatchUp) and
# from the ring (Normal: the consumer packs each in-order run, see ``pack``);
# record lists are accepted too. Pending rows stay columnar because a Record
# per event costs ~0.2 KiB of heap beyond its payload and, being a tuple
# subclass, is never untracked by the cyclic GC: a million of them pending made
# replay 3-5x slower. A ~130-byte event costs 330 B as a Record, 150 B packed.
Part = list[Record] | RecordBatch


def part_bytes(part: Part) -> int:
    """Memory a pending part holds (what the pending budget counts)."""
    if isinstance(part, RecordBatch):
        return len(part.data) + COLUMNAR_OVERHEAD_BYTES * len(part) + PART_OVERHEAD_BYTES
    return sum(map(len, map(_payload, part))) + RECORD_OVERHEAD_BYTES * len(part)


def first_lsn(part: Part) -> int:
    return part.lsns[0] if isinstance(part, RecordBatch) else part[0].lsn


def last_lsn(part: Part) -> int:
    return part.lsns[-1] if isinstance(part, RecordBatch) else part[-1].lsn


_lsn = itemgetter(0)


def pack(records: Sequence[Record]) -> RecordBatch:
    """Records of one core with consecutive sequences, as one columnar part.

    The consumer packs what it takes from the ring (~80 ns per event), so a
    pending event costs its payload plus ``COLUMNAR_OVERHEAD_BYTES`` instead of
    a Record's ``RECORD_OVERHEAD_BYTES``, and the Records die young, leaving
    no long-lived small objects to pin pymalloc's arenas.
    """
    payloads = list(map(_payload, records))
    first = records[0]
    return RecordBatch(
        first.core,
        array("Q", map(_lsn, records)),
        first.seq,
        array("Q", accumulate(map(len, payloads), initial=0)),
        b"".join(payloads),
    )


# Replayed parts under this many events are joined with their neighbours
# (``join_small_parts``); bigger ones already spread PART_OVERHEAD_BYTES thin.
SMALL_PART_EVENTS = 256


def join_small_parts(parts: Sequence[RecordBatch]) -> list[RecordBatch]:
    """Runs of small parts whose sequences continue each other, as one part each.

    WAL replay yields one part per frame section: with small frames (one
    request of a few events per group commit) that is an object and
    ``PART_OVERHEAD_BYTES`` of budget per event or two. Joining costs ~40 ns
    per joined event; parts of ``SMALL_PART_EVENTS`` or more pass as they are.
    A sequence gap (sequences restart with the process) ends a run.
    """
    out: list[RecordBatch] = []
    run: list[RecordBatch] = []
    for part in parts:
        if run and (
            len(part) >= SMALL_PART_EVENTS
            or part.first_seq != run[-1].first_seq + len(run[-1])
            or part.core != run[-1].core
        ):
            out.append(_join(run))
            run = []
        if len(part) >= SMALL_PART_EVENTS:
            out.append(part)
        else:
            run.append(part)
    if run:
        out.append(_join(run))
    return out


def _join(run: list[RecordBatch]) -> RecordBatch:
    if len(run) == 1:
        return run[0]
    lsns = array("Q")
    offsets = array("Q", (0,))
    base = 0
    for part in run:
        lsns.extend(part.lsns)
        offsets.extend(map(base.__add__, part.offsets[1:]))
        base += len(part.data)
    first = run[0]
    return RecordBatch(first.core, lsns, first.first_seq, offsets, b"".join(p.data for p in run))


def split_part(part: Part, k: int) -> tuple[Part, Part]:
    """The first ``k`` events and the rest."""
    if not isinstance(part, RecordBatch):
        return part[:k], part[k:]
    offs = part.offsets
    cut = offs[k]
    head = RecordBatch(part.core, part.lsns[:k], part.first_seq, offs[: k + 1], part.data[:cut])
    tail = RecordBatch(
        part.core,
        part.lsns[k:],
        part.first_seq + k,
        array("Q", map(cut.__rsub__, offs[k:])),
        part.data[cut:],
    )
    return head, tail


class Rows(Sequence[Record]):
    """A slice's rows, in LSN order: a lazy ``Sequence[Record]`` over parts.

    Iterating makes the Record objects; :meth:`parts` hands the columnar
    batches (Arrow layout) to executors that can use them without that.
    """

    __slots__ = ("_ends", "_parts")

    def __init__(self, parts: Sequence[Part] = ()) -> None:
        self._parts = list(parts)
        self._ends = list(accumulate(map(len, self._parts)))

    def parts(self) -> list[Part]:
        return list(self._parts)

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __iter__(self) -> Iterator[Record]:
        for part in self._parts:
            yield from (part.records() if isinstance(part, RecordBatch) else part)

    @overload
    def __getitem__(self, index: int) -> Record: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Record]: ...

    def __getitem__(self, index: int | slice) -> Record | Sequence[Record]:
        if isinstance(index, slice):
            return list(self)[index]
        n = len(self)
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError(f"row {index} out of range ({n} rows)")
        k = bisect_right(self._ends, i)
        part = self._parts[k]
        j = i - (self._ends[k - 1] if k else 0)
        if isinstance(part, RecordBatch):
            return Record(part.lsns[j], part.core, part.first_seq + j, part.payload(j))
        return part[j]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Rows({len(self)} rows in {len(self._parts)} parts)"


async def uncancellable(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion even if the caller is cancelled.

    File steps (write + fsync + rename) run in worker threads that a cancel
    cannot stop; the lock they hold must stay held until the thread is done,
    or a later step (a flush at shutdown, ``close``) would race the orphan.
    """
    task = asyncio.ensure_future(coro)
    task.add_done_callback(_retrieve)
    return await asyncio.shield(task)


def _retrieve(task: asyncio.Future[Any]) -> None:
    # A caller cancelled mid-step logs its own cancel; a failure after that
    # has nobody to raise to, so log it here instead of "never retrieved".
    if not task.cancelled() and task.exception() is not None:
        log.error("file_step_failed", error=repr(task.exception()))


async def wait_event(event: asyncio.Event, seconds: float) -> bool:
    """Wait for ``event`` at most ``seconds``; True if it was set."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()
    return event.is_set()


class PlanLogError(DaemonError):
    """The plan log is damaged or could not be made durable (fatal)."""


class PlanMismatchError(DaemonError):
    """A re-run batch's rows read back from the WAL do not match its plan."""


def _line(doc: Mapping[str, Any]) -> bytes:
    body = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _parse(line: bytes) -> dict[str, Any] | None:
    """A checked entry, or None if the line is torn or fails its checksum."""
    if len(line) < 10 or not line.endswith(b"\n") or line[8:9] != b" ":
        return None
    body = line[9:-1]
    try:
        if int(line[:8], 16) != zlib.crc32(body):
            return None
        doc = json.loads(body)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


class PlanLog:
    """Append-only, fsynced record of planned batches. Methods block: call them
    from a worker thread (the planner does)."""

    def __init__(self, path: Path, wal_id: str, cores: int) -> None:
        self.path = path
        self.wal_id = wal_id
        self.cores = cores
        self._fd: int | None = None
        self.entries = 0  # plan lines currently in the file

    def _header(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "wal_id": self.wal_id, "cores": self.cores}

    def open(self) -> dict[int, Ranges]:
        """Read every plan, check identity, cut a torn tail, open for appends."""
        plans: dict[int, Ranges] = {}
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            atomic_write(self.path, _line(self._header()))
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            return plans
        lines = data.splitlines(keepends=True)
        good = 0  # bytes of valid prefix
        for i, line in enumerate(lines):
            doc = _parse(line)
            if doc is None:
                if i == len(lines) - 1:
                    log.warning(
                        "plan_log_torn_tail", path=str(self.path), offset=good, bytes=len(line)
                    )
                    break
                raise PlanLogError(
                    f"{self.path} @ offset {good}: damaged entry ({len(line)} bytes) before "
                    "the end of the file. Batches planned there cannot be re-run safely; "
                    "restore the data_dir from a backup"
                )
            if i == 0:
                self._check_header(doc)
            else:
                try:
                    bid = int(doc["batch_id"])
                    ranges = {int(c): (int(r[0]), int(r[1])) for c, r in doc["slices"].items()}
                except (KeyError, TypeError, ValueError, IndexError) as exc:
                    raise PlanLogError(f"{self.path} @ offset {good}: bad entry: {exc}") from exc
                plans[bid] = ranges
            good += len(line)
        if good == 0:
            # Only a torn header: the file was being created when the process died.
            atomic_write(self.path, _line(self._header()))
        elif good != len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        self.entries = len(plans)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        return plans

    def _check_header(self, doc: dict[str, Any]) -> None:
        if doc.get("format") != FORMAT:
            raise PlanLogError(f"{self.path}: not a plan log (format {doc.get('format')!r})")
        if doc.get("wal_id") != self.wal_id:
            raise IdentityMismatchError(
                f"{self.path} belongs to WAL {doc.get('wal_id')}, but the WAL in use has id "
                f"{self.wal_id}: the WAL directory was replaced or re-created. Restore the "
                "matching WAL directory, or move the plan log and watermarks.json aside to "
                "process the new WAL from its start"
            )
        if doc.get("cores") != self.cores:
            raise IdentityMismatchError(
                f"{self.path} was written with daemon.cores = {doc.get('cores')}, but the "
                f"configuration now says {self.cores}; the core count is fixed for the life "
                f"of a data_dir: set daemon.cores = {doc.get('cores')} again, or use a new "
                "data_dir"
            )

    def append(self, batch_id: int, ranges: Ranges) -> None:
        """Write one plan and fsync it. An fsync failure is fatal (invariant 10)."""
        if self._fd is None:
            raise PlanLogError(f"{self.path}: plan log is not open")
        line = _line({"batch_id": batch_id, "slices": {str(c): list(r) for c, r in ranges.items()}})
        try:
            view = memoryview(line)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            os.fsync(self._fd)
        except OSError as exc:
            raise PlanLogError(
                f"{self.path}: cannot make plan of batch {batch_id} durable ({exc.strerror}); "
                "stopping, as a failed fsync cannot be retried safely"
            ) from exc
        self.entries += 1

    def rewrite(self, keep: Mapping[int, Ranges]) -> None:
        """Replace the file atomically with the header and ``keep`` only."""
        data = _line(self._header()) + b"".join(
            _line({"batch_id": b, "slices": {str(c): list(r) for c, r in keep[b].items()}})
            for b in sorted(keep)
        )
        atomic_write(self.path, data)
        old, self._fd = self._fd, os.open(self.path, os.O_WRONLY | os.O_APPEND)
        if old is not None:
            os.close(old)
        self.entries = len(keep)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


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
        on_commit: Callable[[MicroBatch], None] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cores = cores
        self.cfg = cfg
        self.pending_max_bytes = pending_max_bytes
        self.executor = executor
        self.plan_log = plan_log
        self.watermarks = watermarks
        self.metrics = metrics
        self._load_slice = load_slice
        self._on_commit = on_commit
        self._sleep = sleep
        self._clock = clock
        self._pending = [_Pending() for _ in range(cores)]
        # Plans still in the file, id -> ranges; pruned once the persisted
        # watermarks cover them.
        self._logged: dict[int, Ranges] = dict(plans)
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
        self._file_lock = asyncio.Lock()
        self.last_batch: dict[str, Any] | None = None

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
        """True while the core has rows that are delivered but not committed."""
        if self._pending[core].rows or any(core in r for r in self._open.values()):
            return True
        return any(core in self._logged[b] for b in self._recovered)

    def plan_floor(self, persisted_batch_id: int) -> int | None:
        """Lowest LSN - 1 that a plan above ``persisted_batch_id`` still needs."""
        firsts = [
            first
            for b, ranges in self._logged.items()
            if b > persisted_batch_id
            for first, _ in ranges.values()
        ]
        return min(firsts) - 1 if firsts else None

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
        # Re-run planned batches that did not commit before the restart, in order.
        while self._recovered and not self._stopping:
            bid = self._recovered[0]
            started = self._clock()
            batch = await self._reload(bid, self._logged[bid])
            await self._execute(batch)
            self._commit(batch, started)
            self._recovered.pop(0)
        held = False
        ahead: MicroBatch | None = None
        while not self._stopping:
            if ahead is not None:
                # Closed, planned and prepared while the previous batch ran.
                batch, ahead = ahead, None
            else:
                if not await self._wait_due():
                    break
                if not self.executor.ready():
                    if not held:
                        log.info("microbatch_held", reason="executor not ready")
                        held = True
                    await self._sleep(min(self.cfg.interval_ms / 1000, 0.1))
                    continue
                if held:
                    log.info("microbatch_resumed")
                    held = False
                closed = await self._close_and_plan()
                if closed is None:
                    continue
                batch, closed = closed, None
            started = self._clock()
            ahead = await self._execute_closing_ahead(batch)
            self._commit(batch, started)
            self._reaper.give(batch)
            del batch
        # A batch closed ahead stays planned: a restart re-runs it from the plan log.

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

    async def _execute_closing_ahead(self, batch: MicroBatch) -> MicroBatch | None:
        """Step 3 for ``batch``; meanwhile close, plan and prepare the next one once
        it is due: a core's slice reached its row limit or cannot grow
        (``_due_by_size``), or its oldest row reached the close deadline.
        Returns that batch.

        Only with an executor that prepares (``Preparer``): the next batch's
        input is then built while this one runs in Spark, instead of after it
        with Spark idle. It commits after this one; ids, plans and watermarks
        keep their order, and a crash re-runs both plans in order.
        """
        if self._preparer is None:
            await self._execute(batch)
            return None
        running = asyncio.ensure_future(self._execute(batch))
        ahead: MicroBatch | None = None
        try:
            while not running.done():
                due = self.close_due() if ahead is None and not self._stopping else None
                if due is not None and (self._due_by_size() or due <= self._clock()):
                    ahead = await self._close_and_plan()
                    if ahead is not None:
                        self._preparer.prepare(ahead)
                    continue
                self._wake.clear()
                woken = asyncio.ensure_future(self._wake.wait())
                timeout = None if due is None else due - self._clock()
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
        return ahead

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

    async def _wait_due(self) -> bool:
        """Wait until a batch is due. False when stopping."""
        while not self._stopping:
            if self._due_by_size():
                return True
            due = self.close_due()
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
        oldest = min((p.parts[0][2] for p in self._pending if p.parts), default=None)
        if oldest is None:
            return None
        return oldest + self.cfg.interval_ms / 1000 - self.expected_run_s()

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
        batch = MicroBatch(batch_id, slices)
        self._open[batch_id] = dict(ranges)
        log.info("microbatch_rerun", batch_id=batch_id, rows=batch.rows, cores=sorted(ranges))
        return batch

    async def _execute(self, batch: MicroBatch) -> None:
        # The executor's and the stages' log lines carry the batch id too.
        with structlog.contextvars.bound_contextvars(batch_id=batch.batch_id):
            await self._execute_with_retries(batch)

    async def _execute_with_retries(self, batch: MicroBatch) -> None:
        delay = self.cfg.retry_initial_ms / 1000
        attempt = 0
        info: dict[str, Any] = {
            "batch_id": batch.batch_id,
            "rows": batch.rows,
            "ranges": batch.ranges(),
            "state": "running",
            "attempts": 0,
            "error": None,
            "duration_s": None,
        }
        self.last_batch = info
        while True:
            while not self.executor.ready():
                info["state"] = "held"
                await self._sleep(min(self.cfg.interval_ms / 1000, 0.1))
            attempt += 1
            info["attempts"] = attempt
            info["state"] = "running"
            attempt_started = self._clock()
            try:
                await self.executor.execute(batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.metrics.batch_outcomes.labels(outcome="failed").inc()
                info["state"] = "retrying"
                info["error"] = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "microbatch_failed",
                    batch_id=batch.batch_id,
                    attempt=attempt,
                    error=info["error"],
                    retry_in_s=delay,
                )
                await self._sleep(delay)
                delay = min(delay * 2, self.cfg.retry_max_ms / 1000)
                continue
            self._run_times.append(self._clock() - attempt_started)
            return

    def _commit(self, batch: MicroBatch, started: float) -> None:
        self.watermarks.commit(batch)
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
        if self.last_batch is not None and self.last_batch["batch_id"] == batch.batch_id:
            self.last_batch.update(state="committed", duration_s=round(elapsed, 6))
        log.debug("microbatch_committed", batch_id=batch.batch_id, rows=batch.rows)
        if self._on_commit is not None:
            self._on_commit(batch)

    # ------------------------------------------------------------------
    # Plan log upkeep (called after watermarks were persisted)

    async def forget_through(self, persisted_batch_id: int) -> None:
        """Drop plans the persisted watermarks cover; compact the file now and then."""
        for b in [b for b in self._logged if b <= persisted_batch_id]:
            del self._logged[b]
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
