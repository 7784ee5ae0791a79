"""Per-core consumers and their mode machine (docs/design.md, "Consumer modes").

::

    boot ──► CatchUp ──[replay reached WAL head; stale ring entries dropped]──► Normal
                ▲                                                                │
                └──[sequence gap | tail drop | backpressure Suspended | memory]──┘

One asyncio task per core. A consumer reads either its ring (Normal) or the
WAL (CatchUp), never both at once, and delivers every event of its core to the
planner exactly once, in LSN order (invariants 3, 4); it dedupes by LSN, never
by sequence (invariant 5).

Hand-off from CatchUp to Normal, done on the event loop with no ``await`` in
between, so no WAL listener push can interleave:

1. Replay the WAL from the last delivered LSN ``L`` + 1 until a read comes
   back short (the durable head at that moment).
2. Drop ring entries with LSN <= ``L``: they were delivered from the WAL.
3. If the ring dropped a record with LSN > ``L``, that record is durable but
   was not replayed yet: go back to step 1.
4. Otherwise every record of this core above ``L`` that was offered to the
   ring is still in it, in order. The first one (if any) is the next event:
   expect its sequence; if the ring is empty, expect ``emitted`` + 1.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from daemon.errors import ConsumerFailedError, LsnRegressionError
from daemon.plane.parts import Part, join_small_parts, part_bytes
from daemon.plane.ring import Backpressure, Ring
from wal.errors import BelowRetainedFloorError
from wal.reader import RecordBatch

if TYPE_CHECKING:
    from daemon.config import ConsumerConfig
    from daemon.metrics import Metrics

log = structlog.get_logger(__name__)

# Records per worker-thread hop during replay: large enough that the hop
# (~50 µs) is noise next to decoding, small enough to keep memory per core low.
CHUNK_ROWS = 16_384
# Bytes per hop are bounded too, so one chunk of large events cannot blow the
# pending budget (invariant 11).
CHUNK_MAX_BYTES = 8 * 1024 * 1024


class Mode(enum.Enum):
    NORMAL = "normal"
    CATCHUP = "catchup"


class Reason(enum.Enum):
    """Why a consumer entered CatchUp (``reason`` label of catch-up entries)."""

    BOOT = "boot"
    GAP = "gap"
    TAIL_DROP = "tail_drop"
    BACKPRESSURE = "backpressure"
    MEMORY = "memory"


class WalReader(Protocol):
    """The part of :class:`wal.Wal` a consumer needs."""

    def read_batches(
        self, from_lsn: int, *, core: int | None = None, to_lsn: int | None = None
    ) -> Iterator[RecordBatch]: ...

    def head_lsn(self) -> int: ...


class SliceSink(Protocol):
    """Where delivered events go: the planner's pending slices."""

    def add(self, core: int, part: Part, nbytes: int | None = None) -> None: ...

    def has_room(self, core: int) -> bool: ...

    async def wait_room(self, core: int) -> None: ...

    def set_catching_up(self, core: int, flag: bool) -> None: ...


def _take(it: Iterator[RecordBatch], rows: int, max_bytes: int) -> tuple[list[RecordBatch], bool]:
    """Columnar batches up to about ``rows`` events or ``max_bytes``.

    Returns the batches and True if the iterator ran dry. Overshoots by at most
    one batch (one core's part of one WAL frame, bounded by the group size).
    Small parts come back joined (``join_small_parts``).
    """
    out: list[RecordBatch] = []
    n = 0
    nbytes = 0
    while n < rows and nbytes < max_bytes:
        batch = next(it, None)
        if batch is None:
            return join_small_parts(out), True
        if len(batch):
            out.append(batch)
            n += len(batch)
            nbytes += part_bytes(batch)
    return join_small_parts(out), False


def _close(it: Iterator[RecordBatch] | None) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        # ValueError: still running in a worker thread after a cancel; the
        # thread finishes its chunk and the generator is collected afterwards.
        with contextlib.suppress(ValueError):
            close()


def floor_error(core: int, exc: BelowRetainedFloorError) -> ConsumerFailedError:
    return ConsumerFailedError(
        f"core {core}: must replay from LSN {exc.requested_lsn}, but the WAL's retained floor "
        f"is LSN {exc.floor_lsn}: the events in between were removed, so this core cannot "
        "deliver them (invariant 9). The watermarks or plan log are older than the WAL; "
        "restore data_dir from one consistent backup (WAL, watermarks.json and plans.log "
        "together)"
    )


async def read_range(
    wal: WalReader,
    core: int,
    first: int,
    last: int,
    *,
    retries: int,
    retry_ms: int,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> list[RecordBatch]:
    """Every record of ``core`` in ``first..last`` (inclusive), with bounded retries.

    Used to rebuild a planned batch after a restart. Fails at once below the
    retained floor, and after ``retries`` failed attempts otherwise.
    """
    attempt = 0
    while True:
        try:
            return await asyncio.to_thread(
                lambda: list(wal.read_batches(first, core=core, to_lsn=last))
            )
        except BelowRetainedFloorError as exc:
            raise floor_error(core, exc) from exc
        except Exception as exc:
            attempt += 1
            if attempt > retries:
                raise ConsumerFailedError(
                    f"core {core}: reading LSN {first}..{last} from the WAL failed "
                    f"{attempt} times, last with {type(exc).__name__}: {exc}"
                ) from exc
            log.warning(
                "replay_retry",
                core=core,
                from_lsn=first,
                attempt=attempt,
                error=f"{type(exc).__name__}: {exc}",
            )
            await sleep(retry_ms / 1000)


# A long catch-up logs its progress this often (operators watch the journal).
PROGRESS_LOG_S = 10.0


class CatchupProgress:
    __slots__ = ("last_logged", "reason", "replayed", "start_lsn", "started")

    def __init__(self, reason: Reason, start_lsn: int, started: float) -> None:
        self.reason = reason
        self.start_lsn = start_lsn
        self.started = started
        self.replayed = 0
        self.last_logged = started


class Consumer:
    """One core's consumer task: :meth:`run` until cancelled or fail-stop."""

    def __init__(
        self,
        core: int,
        cfg: ConsumerConfig,
        ring: Ring,
        wal: WalReader,
        sink: SliceSink,
        metrics: Metrics,
        *,
        start_lsn: int,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        chunk_rows: int = CHUNK_ROWS,
        chunk_bytes: int | None = None,
        on_caught_up: Callable[[int, int, int], None] | None = None,
        reader: concurrent.futures.Executor | None = None,
    ) -> None:
        self.core = core
        self.cfg = cfg
        self.ring = ring
        self.wal = wal
        self.sink = sink
        self.metrics = metrics
        self._sleep = sleep
        self._clock = clock
        self.chunk_rows = chunk_rows
        self.chunk_bytes = chunk_bytes or max(1, min(CHUNK_MAX_BYTES, cfg.pending_max_bytes // 8))
        self._on_caught_up = on_caught_up
        # Where WAL reads run. The plane shares one small pool among all cores:
        # replay is GIL-bound, and more threads only fight over the GIL.
        self._reader = reader
        self.mode: Mode | None = None
        self.last_lsn = start_lsn  # last LSN delivered to the sink
        self.last_seq = 0  # sequence of the last ring entry taken (Normal only)
        self.progress: CatchupProgress | None = None
        self.catchups = 0
        self._label = str(core)
        self._delivered = metrics.delivered_events.labels(core=self._label)
        self._replayed = metrics.replayed_events.labels(core=self._label)

    # ------------------------------------------------------------------

    async def run(self) -> None:
        structlog.contextvars.bind_contextvars(core=self.core)
        self._enter_catchup(Reason.BOOT)
        while True:
            if self.mode is Mode.CATCHUP:
                await self._catch_up()
                self._enter_normal()
            elif self.mode is Mode.NORMAL:
                reason = await self._poll_ring()
                self._enter_catchup(reason)
            else:  # pragma: no cover - the two modes above are the whole machine
                raise ConsumerFailedError(f"core {self.core}: unknown mode {self.mode!r}")

    def idle(self) -> bool:
        """True when every record offered to the ring so far has been delivered."""
        return (
            self.mode is Mode.NORMAL and len(self.ring) == 0 and self.ring.emitted == self.last_seq
        )

    def status(self, head_lsn: int) -> dict[str, Any] | None:
        """Catch-up progress, or None in Normal mode."""
        p = self.progress
        if p is None:
            return None
        elapsed = max(self._clock() - p.started, 1e-9)
        lsn_rate = (self.last_lsn - p.start_lsn) / elapsed
        remaining = max(head_lsn - self.last_lsn, 0)
        return {
            "reason": p.reason.value,
            "replayed": p.replayed,
            "rate": round(p.replayed / elapsed, 1),
            "remaining_lsns": remaining,
            "eta_s": round(remaining / lsn_rate, 3) if lsn_rate > 0 else None,
            "elapsed_s": round(elapsed, 3),
        }

    def _log_progress(self) -> None:
        """Every PROGRESS_LOG_S of a catch-up: events replayed, rate and ETA."""
        p = self.progress
        now = self._clock()
        if p is None or now - p.last_logged < PROGRESS_LOG_S:
            return
        p.last_logged = now
        log.info("catchup_progress", **(self.status(self.wal.head_lsn()) or {}))

    # ------------------------------------------------------------------
    # Transitions

    def _enter_catchup(self, reason: Reason) -> None:
        previous = self.mode
        self.mode = Mode.CATCHUP
        self.catchups += 1
        self.progress = CatchupProgress(reason, self.last_lsn, self._clock())
        self.sink.set_catching_up(self.core, True)
        self.metrics.consumer_mode.labels(core=self._label).set(1)
        self.metrics.catchup_entries.labels(core=self._label, reason=reason.value).inc()
        log.info(
            "consumer_mode_changed",
            mode=Mode.CATCHUP.value,
            previous=previous.value if previous else None,
            reason=reason.value,
            lsn=self.last_lsn,
            ring_events=len(self.ring),
            ring_emitted=self.ring.emitted,
            last_seq=self.last_seq,
        )

    def _enter_normal(self) -> None:
        p = self.progress
        self.mode = Mode.NORMAL
        self.progress = None
        self.sink.set_catching_up(self.core, False)
        self.metrics.consumer_mode.labels(core=self._label).set(0)
        elapsed = self._clock() - p.started if p else 0.0
        replayed = p.replayed if p else 0
        log.info(
            "consumer_mode_changed",
            mode=Mode.NORMAL.value,
            previous=Mode.CATCHUP.value,
            reason="caught_up",
            lsn=self.last_lsn,
            replayed=replayed,
            seconds=round(elapsed, 6),
        )
        if self._on_caught_up is not None:
            self._on_caught_up(self.core, self.last_lsn, replayed)

    # ------------------------------------------------------------------
    # Normal: poll the ring

    async def _poll_ring(self) -> Reason:
        """Deliver from the ring until something sends us to CatchUp."""
        ring, sink, core = self.ring, self.sink, self.core
        drain = self.cfg.drain_max
        poll_min = self.cfg.poll_min_ms / 1000
        poll_max = self.cfg.poll_max_ms / 1000
        patience = self.cfg.idle_polls_before_backoff
        empty_polls = 0
        while True:
            if ring.state is Backpressure.SUSPENDED:
                return Reason.BACKPRESSURE
            if not sink.has_room(core):
                return Reason.MEMORY
            taken = ring.take_runs(drain)
            if taken:
                empty_polls = 0
                good = self._in_order_runs(taken)
                if good:
                    self._deliver_runs(good)
                if len(good) != len(taken):
                    return Reason.GAP
                # Let the listener, the planner and the other cores run.
                await asyncio.sleep(0)
                continue
            if ring.emitted > self.last_seq:
                return Reason.TAIL_DROP
            empty_polls += 1
            await self._sleep(poll_min if empty_polls <= patience else poll_max)

    def _in_order_runs(self, runs: list[RecordBatch]) -> list[RecordBatch]:
        """The longest prefix of runs that continues our sequence with growing LSNs.

        Inside a run sequences grow by one and LSNs ascend (the ring only holds
        such runs), so only where each run starts is checked: a run that does
        not start at the next sequence, or not above the last delivered LSN, is
        a gap, and it and everything after it go back to the WAL.
        """
        expected = self.last_seq + 1
        prev_lsn = self.last_lsn
        for i, run in enumerate(runs):
            if run.first_seq != expected or run.lsns[0] <= prev_lsn:
                return runs[:i]
            expected += len(run)
            prev_lsn = run.lsns[-1]
        return runs

    def _deliver_runs(self, runs: list[RecordBatch]) -> None:
        # In-order runs continue each other: small ones are joined into one part.
        sink, core = self.sink, self.core
        n = 0
        for part in join_small_parts(runs) if len(runs) > 1 else runs:
            sink.add(core, part)
            n += len(part)
        last = runs[-1]
        self.last_lsn = last.lsns[-1]
        self.last_seq = last.first_seq + len(last) - 1
        self._delivered.inc(n)

    # ------------------------------------------------------------------
    # CatchUp: replay the WAL, then hand off to the ring

    async def _catch_up(self) -> None:
        ring = self.ring
        while True:
            # Step 1. Replay from L + 1 to the durable head.
            replayed = await self._replay_pass()
            # Steps 2-4 run without an await: no push can interleave.
            # Step 2. Drop ring entries the WAL already delivered.
            ring.discard_through(self.last_lsn)
            # Step 3. A record dropped above L is durable but not yet replayed.
            if ring.last_drop_lsn > self.last_lsn:
                if replayed == 0:
                    # The WAL's read view trails its listener; give it a moment.
                    await self._sleep(self.cfg.poll_min_ms / 1000)
                continue
            # Step 4. The ring holds exactly the records above L: continue from it.
            first = ring.peek()
            self.last_seq = first.seq - 1 if first is not None else ring.emitted
            return

    async def _replay_pass(self) -> int:
        """Deliver this core's records from the WAL until a read comes back short."""
        core, sink = self.core, self.sink
        it: Iterator[RecordBatch] | None = None
        failures = 0
        total = 0
        try:
            while True:
                if not sink.has_room(core):
                    # Memory bound (invariant 11): the WAL keeps what we cannot hold.
                    await sink.wait_room(core)
                from_lsn = self.last_lsn + 1
                try:
                    loop = asyncio.get_running_loop()
                    if it is None:
                        it, chunk, dry = await loop.run_in_executor(
                            self._reader, self._open, from_lsn
                        )
                    else:
                        chunk, dry = await loop.run_in_executor(
                            self._reader, _take, it, self.chunk_rows, self.chunk_bytes
                        )
                except BelowRetainedFloorError as exc:
                    raise floor_error(core, exc) from exc
                except Exception as exc:
                    _close(it)
                    it = None
                    failures += 1
                    if failures > self.cfg.replay_retries:
                        raise ConsumerFailedError(
                            f"core {core}: WAL replay from LSN {from_lsn} failed {failures} "
                            f"times, last with {type(exc).__name__}: {exc}. Check the disk "
                            "and `eventplane wal verify`; the daemon stops rather than skip "
                            "events"
                        ) from exc
                    log.warning(
                        "replay_retry",
                        from_lsn=from_lsn,
                        attempt=failures,
                        error=f"{type(exc).__name__}: {exc}",
                    )
                    await self._sleep(self.cfg.replay_retry_ms / 1000)
                    continue
                failures = 0
                for batch in chunk:
                    self._deliver_replayed(batch)
                    total += len(batch)
                if dry:
                    return total
        finally:
            _close(it)

    def _open(self, from_lsn: int) -> tuple[Iterator[RecordBatch], list[RecordBatch], bool]:
        it = self.wal.read_batches(from_lsn, core=self.core)
        chunk, dry = _take(it, self.chunk_rows, self.chunk_bytes)
        return it, chunk, dry

    def _deliver_replayed(self, batch: RecordBatch) -> None:
        lsns = batch.lsns
        first, last = lsns[0], lsns[-1]
        if first <= self.last_lsn or last < first:
            raise LsnRegressionError(
                f"core {self.core}: WAL replay returned LSN {first}..{last} after "
                f"delivering LSN {self.last_lsn}"
            )
        if batch.core != self.core:
            raise ConsumerFailedError(
                f"core {self.core}: WAL replay returned events of core {batch.core}"
            )
        n = len(batch)
        self.sink.add(self.core, batch)
        self.last_lsn = last
        self._delivered.inc(n)
        self._replayed.inc(n)
        if self.progress is not None:
            self.progress.replayed += n
            self._log_progress()
        # Keep the ring from filling with entries we already have.
        self.ring.discard_through(last)
