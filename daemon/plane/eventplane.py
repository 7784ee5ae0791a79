"""The event plane: rings, consumers, planner, watermarks and retention, composed.

Wiring, in the daemon::

    wal = Wal.open(cfg.wal_dir, ...)
    plane = EventPlane(cfg, wal, executor, metrics)
    wal.set_batch_listener(plane.on_durable_batches)  # before ingest accepts anything
    await executor.start()
    await plane.start()                    # raises IdentityMismatchError etc.
    ...                                    # ingest uses plane.max_lag() for 429
    error = await plane.wait_failed()      # fail-stop: exit non-zero, systemd restarts
    ...
    await plane.stop(deadline.remaining()) # then executor.stop(), wal.aclose()

State files in ``daemon.data_dir``: ``watermarks.json`` (atomic replace) and
``plans.log`` (append + fsync); both carry the WAL id and ``cores``.

Retention (``wal.retention = "watermarks"``) runs after each watermark flush
and uses the *persisted* watermarks, so a crash before the next flush never
needs a segment that is gone: segments below
``min(persisted watermarks, first LSN of every plan not yet covered) + 1`` go.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from daemon.errors import ConsumerFailedError, DaemonError, LsnRegressionError
from daemon.plane.consumer import Consumer, WalReader, floor_error, read_range
from daemon.plane.parts import Part, join_small_parts, split_part
from daemon.plane.planlog import FILENAME as PLANS_FILENAME
from daemon.plane.planlog import PlanLog
from daemon.plane.planner import Planner
from daemon.plane.ring import RingSet
from daemon.plane.stages import StagesNotRunningError
from daemon.plane.tasks import uncancellable, wait_event
from daemon.plane.watermarks import FILENAME as WATERMARKS_FILENAME
from daemon.plane.watermarks import Watermarks, WatermarkSnapshot, WatermarkStore
from wal.errors import BelowRetainedFloorError
from wal.reader import RecordBatch
from wal.record import Record

if TYPE_CHECKING:
    from daemon.config import Config
    from daemon.metrics import Metrics
    from daemon.plane.batch import Executor

log = structlog.get_logger(__name__)

# WAL replay threads shared by every core. Replay is GIL-bound, so a thread per
# core buys nothing (bench/bench_consumer.py: 1, 2 and 6 threads within noise
# with 4 cores catching up); two let one chunk's disk wait overlap another's
# decoding, and the thread count stays fixed however many cores there are.
REPLAY_THREADS = 2


class PlaneWal(WalReader, Protocol):
    """The part of :class:`wal.Wal` the plane uses."""

    wal_id: str

    def retained_floor(self) -> int: ...

    def truncate_below(self, lsn: int) -> int: ...


class EventPlane:
    """Rings, per-core consumers, the micro-batch planner, watermarks, retention."""

    def __init__(
        self,
        cfg: Config,
        wal: PlaneWal,
        executor: Executor,
        metrics: Metrics,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.wal = wal
        self.executor = executor
        self.metrics = metrics
        self._sleep = sleep
        self._clock = clock
        self.cores = cfg.daemon.cores
        c = cfg.consumer
        # Every record at or below the head at construction is read by the
        # boot catch-up; every later one reaches on_durable_batches.
        self.rings = RingSet(
            self.cores, c.ring_capacity, c.ring_max_bytes, metrics, pushed_lsn=wal.head_lsn()
        )
        self._store = WatermarkStore(cfg.data_dir / WATERMARKS_FILENAME)
        self._plan_log = PlanLog(cfg.data_dir / PLANS_FILENAME, wal.wal_id, self.cores)
        self.watermarks: Watermarks | None = None
        self.planner: Planner | None = None
        self.consumers: list[Consumer] = []
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._failure: DaemonError | None = None
        self._failed = asyncio.Event()
        self._flush_now = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        # core -> LSN: flush the watermarks as soon as this core's commit covers it
        # (the end of a catch-up), so a crash does not repeat a long replay.
        self._flush_targets: dict[int, int] = {}
        self._state = "new"
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------
    # WAL listener

    def on_durable(self, records: Sequence[Record]) -> None:
        """WAL listener: one durable group, in LSN order, on the loop thread."""
        try:
            self.rings.push_group(records)
        except (DaemonError, ValueError) as exc:
            self._push_failed(exc)

    def on_durable_batches(self, batches: Sequence[RecordBatch]) -> None:
        """WAL batch listener (``Wal.set_batch_listener``, what the daemon wires):
        one durable group as one run per core, on the loop thread."""
        try:
            self.rings.push_batches(batches)
        except (DaemonError, ValueError) as exc:
            self._push_failed(exc)

    def _push_failed(self, exc: DaemonError | ValueError) -> None:
        # Not raised into the WAL writer's completion path: the daemon stops.
        err = exc if isinstance(exc, DaemonError) else ConsumerFailedError(str(exc))
        log.error("ring_push_failed", error=str(exc))
        self._fail(err)

    # ------------------------------------------------------------------
    # Lifecycle

    async def start(self) -> None:
        """Load state, re-plan unfinished batches, start the tasks.

        1. Load the watermarks; refuse a file of another WAL or core count.
        2. Open the plan log (same identity check); cut a torn tail.
        3. Refuse state that claims LSNs beyond the WAL head.
        4. Build the planner (re-runs plans above the watermarks' batch id) and
           one consumer per core, resuming after every planned LSN.
        5. Start the planner, the consumers and the ticker (heartbeat, flush).
        """
        if self._state != "new":
            raise DaemonError(f"EventPlane.start() called twice (state {self._state})")
        cfg = self.cfg
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        # Step 1. Watermarks.
        plans_path = self._plan_log.path
        loaded = await asyncio.to_thread(
            self._store.load, self.wal.wal_id, self.cores, plans_path=plans_path
        )
        # Step 2. Plan log.
        plans = await asyncio.to_thread(self._plan_log.open)
        # Step 3. Nothing may claim LSNs the WAL does not have.
        head = self.wal.head_lsn()
        claimed = max([*loaded.lsns, *(r[1] for p in plans.values() for r in p.values())])
        if claimed > head:
            self._plan_log.close()
            raise LsnRegressionError(
                f"{self._store.path} or {plans_path} covers LSN {claimed}, but the WAL head is "
                f"LSN {head}: the WAL lost events that were already processed (a crash with "
                'wal.fsync other than "always", or a WAL restored from an older backup). '
                "New events would reuse those LSNs. Restore the WAL that matches, or move "
                f"{self._store.path.name} and {plans_path.name} aside to reprocess this WAL"
            )
        if not self._store.path.exists():
            # Fix the identity from the first start on, even before any commit.
            await asyncio.to_thread(self._store.save, loaded)
        wm = self.watermarks = Watermarks(loaded, self.metrics)
        # Step 4. Planner and consumers.
        c = cfg.consumer

        async def load_slice(core: int, first: int, last: int) -> list[RecordBatch]:
            return await read_range(
                self.wal,
                core,
                first,
                last,
                retries=c.replay_retries,
                retry_ms=c.replay_retry_ms,
                sleep=self._sleep,
            )

        async def read_chunk(core: int, first: int, last: int, limit: int) -> list[Part]:
            """Up to ``limit`` events of ``core`` in ``first..last`` (a backfill chunk)."""

            def read() -> list[Part]:
                out: list[RecordBatch] = []
                rows = 0
                it = self.wal.read_batches(first, core=core, to_lsn=last)
                try:
                    for part in it:
                        if rows + len(part) > limit:
                            head, _ = split_part(part, limit - rows)
                            assert isinstance(head, RecordBatch)
                            part = head
                        out.append(part)
                        rows += len(part)
                        if rows >= limit:
                            break
                finally:
                    close = getattr(it, "close", None)
                    if callable(close):
                        close()  # releases the segment file at once
                return list(join_small_parts(out))

            try:
                return await asyncio.to_thread(read)
            except BelowRetainedFloorError as exc:
                raise floor_error(core, exc) from exc

        planner = self.planner = Planner(
            cores=self.cores,
            cfg=cfg.microbatch,
            pending_max_bytes=c.pending_max_bytes,
            executor=self.executor,
            plan_log=self._plan_log,
            watermarks=wm,
            metrics=self.metrics,
            plans=plans,
            load_slice=load_slice,
            on_commit=self._on_commit,
            sleep=self._sleep,
            clock=self._clock,
            stall_after_s=cfg.health.stall_after_s,
            attempt_slow_s=cfg.health.attempt_slow_s,
            paused_max_lag_events=cfg.health.paused_max_lag_events,
            head_lsn=lambda: self.rings.pushed_lsn,
            read_chunk=read_chunk,
            retained_floor=self.wal.retained_floor,
        )
        # A new CDC stream that starts below the live batches (docs/cdc.md,
        # "Adding a stream: backfill"): durable before any batch runs.
        try:
            if planner.prepare_backfills():
                snap = wm.snapshot()
                await asyncio.to_thread(self._store.save, snap)
                wm.persisted = snap
        except BaseException:
            self._plan_log.close()
            raise
        self._reader = concurrent.futures.ThreadPoolExecutor(
            max_workers=REPLAY_THREADS, thread_name_prefix="eventplane-replay"
        )
        self.consumers = [
            Consumer(
                core,
                c,
                self.rings[core],
                self.wal,
                planner,
                self.metrics,
                start_lsn=planner.resume_lsn(core),
                sleep=self._sleep,
                clock=self._clock,
                on_caught_up=self._on_caught_up,
                reader=self._reader,
            )
            for core in range(self.cores)
        ]
        log.info(
            "event_plane_starting",
            cores=self.cores,
            wal_id=self.wal.wal_id,
            head_lsn=head,
            watermarks=list(wm.lsns),
            batch_id=wm.batch_id,
            replans=[b for b in sorted(plans) if b > wm.batch_id],
        )
        # Step 5. Tasks, in dependency order: planner first, then its producers.
        self._state = "running"
        self._spawn("planner", planner.run)
        for consumer in self.consumers:
            self._spawn(f"consumer-{consumer.core}", consumer.run)
        self._spawn("ticker", self._tick)

    async def stop(self, timeout_s: float) -> None:
        """Stop within ``timeout_s``; progress made so far is flushed.

        1. Cancel the consumers: what they hold is not progress (the WAL has it).
        2. Let the running batch finish within the budget; start no new one.
           A batch cut short stays in the plan log and re-runs on restart.
        3. Stop the ticker; flush the watermarks and apply retention.
        4. Close the plan log.
        """
        if self._state != "running":
            self._state = "stopped"
            return
        self._state = "stopping"
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s

        def remaining(floor: float = 0.0) -> float:
            return max(floor, end - loop.time())

        # Step 1. Consumers.
        consumers = [t for n, t in self._tasks.items() if n.startswith("consumer-")]
        await self._cancel(consumers, remaining(0.1))
        # Step 2. The running batch.
        planner_task = self._tasks.get("planner")
        if self.planner is not None and planner_task is not None:
            self.planner.request_stop()
            done, _ = await asyncio.wait({planner_task}, timeout=remaining())
            if not done:
                log.warning(
                    "microbatch_cut_short", budget_s=timeout_s, batch=self.planner.last_batch
                )
                await self._cancel([planner_task], remaining(0.1))
        # Step 3. Ticker, then one last flush (a token slice even past the budget:
        # it is one small file write, and losing it only costs replay time).
        ticker = self._tasks.get("ticker")
        if ticker is not None:
            await self._cancel([ticker], remaining(0.1))
        try:
            await asyncio.wait_for(self.flush(), remaining(0.5))
        except Exception as exc:  # logged, not swallowed: stop must go on
            log.error("watermark_flush_failed", error=f"{type(exc).__name__}: {exc}")
        # Step 4. Plan log, once no append is in flight.
        try:
            if self.planner is not None:
                await asyncio.wait_for(self.planner.aclose(), remaining(0.5))
            else:
                self._plan_log.close()
        except Exception as exc:
            log.error("plan_log_close_failed", error=f"{type(exc).__name__}: {exc}")
        if self._reader is not None:
            # A chunk read still running finishes on its own; nothing waits for it.
            self._reader.shutdown(wait=False, cancel_futures=True)
        for task in self._tasks.values():
            if task.done() and not task.cancelled() and task.exception() is not None:
                log.debug("task_ended_with_error", task=task.get_name())
        self._tasks.clear()
        self._state = "stopped"
        log.info(
            "event_plane_stopped",
            watermarks=list(self.watermarks.lsns) if self.watermarks else None,
        )

    async def _cancel(self, tasks: list[asyncio.Task[None]], budget_s: float) -> None:
        for t in tasks:
            if not t.done():
                t.cancel(msg="event plane stopping")
        if tasks:
            _, pending = await asyncio.wait(set(tasks), timeout=budget_s)
            for t in pending:
                log.warning("task_did_not_stop", task=t.get_name(), budget_s=budget_s)

    # ------------------------------------------------------------------
    # Failure

    @property
    def failure(self) -> DaemonError | None:
        """The fatal error, once a component failed (fail-stop)."""
        return self._failure

    async def wait_failed(self) -> DaemonError:
        """Return the fatal error once one happens (the daemon then exits non-zero)."""
        await self._failed.wait()
        if self._failure is None:  # pragma: no cover - set together with the event
            raise DaemonError("event plane failure event set without an error")
        return self._failure

    def _fail(self, err: DaemonError) -> None:
        if self._failure is None:
            self._failure = err
            self._failed.set()
            log.error("event_plane_failed", error=str(err), error_type=type(err).__name__)

    def _spawn(self, name: str, routine: Callable[[], Coroutine[Any, Any, None]]) -> None:
        task = asyncio.create_task(self._supervise(name, routine), name=f"eventplane-{name}")
        task.add_done_callback(_retrieve)
        self._tasks[name] = task

    async def _supervise(self, name: str, routine: Callable[[], Coroutine[Any, Any, None]]) -> None:
        try:
            await routine()
        except asyncio.CancelledError:
            if self._state == "running":
                # Only stop() cancels these; anything else would silently stop
                # the plane (say, an executor leaking a CancelledError).
                self._fail(ConsumerFailedError(f"{name}: cancelled while the plane was running"))
            raise
        except DaemonError as exc:
            log.error("task_failed", task=name, error=str(exc), error_type=type(exc).__name__)
            self._fail(exc)
            raise
        except Exception as exc:
            log.exception("task_failed", task=name)
            err = ConsumerFailedError(f"{name}: unexpected {type(exc).__name__}: {exc}")
            self._fail(err)
            raise err from exc
        else:
            if self._state == "running" and name != "planner":
                err = ConsumerFailedError(f"{name}: ended while the plane was running")
                self._fail(err)

    # ------------------------------------------------------------------
    # Ticker: heartbeat, lag gauges, watermark flush

    async def _tick(self) -> None:
        flush_every = self.cfg.consumer.watermark_flush_ms / 1000
        period = min(self.cfg.microbatch.interval_ms / 1000, flush_every)
        last_flush = self._clock()
        while True:
            await wait_event(self._flush_now, period)
            now_requested = self._flush_now.is_set()
            self._flush_now.clear()
            self.heartbeat()
            self._publish_lag()
            if now_requested or self._clock() - last_flush >= flush_every:
                await self.flush()
                last_flush = self._clock()

    def heartbeat(self) -> None:
        """Advance idle cores that owe nothing to the highest pushed LSN.

        A core is idle when every record offered to its ring has been delivered
        (Normal mode, ring empty, nothing dropped) and none of its delivered
        rows waits in a pending slice, a running batch or a re-run plan. Then
        nothing of this core at or below ``pushed_lsn`` is outstanding.
        """
        wm, planner = self.watermarks, self.planner
        if wm is None or planner is None:
            return
        pushed = self.rings.pushed_lsn
        for consumer in self.consumers:
            if consumer.idle() and not planner.owes(consumer.core):
                wm.advance(consumer.core, pushed)

    async def flush(self) -> WatermarkSnapshot | None:
        """Persist dirty watermarks, then apply retention and prune the plan log."""
        return await uncancellable(self._flush())

    async def _flush(self) -> WatermarkSnapshot | None:
        wm, planner = self.watermarks, self.planner
        if wm is None or planner is None:
            return None
        async with self._flush_lock:
            if not wm.dirty:
                return wm.persisted
            snap = wm.snapshot()
            await asyncio.to_thread(self._store.save, snap)
            wm.persisted = snap
            log.debug("watermarks_flushed", batch_id=snap.batch_id, lsns=list(snap.lsns))
            await self._retain(snap)
            await planner.forget_through(snap.batch_id)
            return snap

    async def _retain(self, snap: WatermarkSnapshot) -> None:
        if self.cfg.wal.retention != "watermarks" or self.planner is None:
            return
        floor = snap.floor()
        plan_floor = self.planner.plan_floor(snap.batch_id)
        if plan_floor is not None:
            floor = min(floor, plan_floor)
        # What a new stream's backfill still has to read (docs/cdc.md).
        backfill_floor = self.planner.backfill_floor()
        if backfill_floor is not None:
            floor = min(floor, backfill_floor)
        if floor <= 0:
            return
        # What the archive keeps beyond that: the trigger retry queue's rows (a
        # restore on a new disk evaluates them again); the local WAL needs none.
        stage_floor = getattr(self.executor, "archive_floor", None)
        needed = stage_floor() if callable(stage_floor) else None
        keeping = getattr(self.wal, "truncate_below_keeping", None)
        if needed is not None and needed < floor and callable(keeping):
            removed = await asyncio.to_thread(keeping, floor + 1, needed + 1)
        else:
            removed = await asyncio.to_thread(self.wal.truncate_below, floor + 1)
        if removed:
            log.info("wal_retention", below_lsn=floor + 1, removed_segments=removed)

    def _on_commit(self) -> None:
        wm = self.watermarks
        if wm is None:
            return
        for core, target in list(self._flush_targets.items()):
            if wm.lsns[core] >= target:
                del self._flush_targets[core]
                self._flush_now.set()
        self._publish_lag()

    def _on_caught_up(self, core: int, lsn: int, replayed: int) -> None:
        if replayed:
            self._flush_targets[core] = lsn

    def _publish_lag(self) -> None:
        wm = self.watermarks
        if wm is None:
            return
        head = self.rings.pushed_lsn
        gauge = self.metrics.lag_events
        for core, lsn in enumerate(wm.lsns):
            gauge.labels(core=str(core)).set(max(head - lsn, 0))

    # ------------------------------------------------------------------
    # Pause and resume a stage (the admin API)

    async def pause_stage(
        self, name: str, *, reason: str | None = None, by: str | None = None
    ) -> dict[str, Any]:
        """Pause stage ``name``, durably (the watermarks file is written before
        this returns); its status entry with ``changed`` (False: already paused).

        Raises UnknownStageError for a name that is not a stage, and
        StagesNotRunningError unless the plane is running.
        """
        planner = self._running_planner()
        changed = planner.pause_stage(name, reason=reason, by=by)
        return await self._stage_answer(planner, name, changed)

    async def resume_stage(self, name: str) -> dict[str, Any]:
        """Resume stage ``name``, durably; it then catches up on what it missed."""
        planner = self._running_planner()
        changed = planner.resume_stage(name)
        return await self._stage_answer(planner, name, changed)

    def _running_planner(self) -> Planner:
        if self._state != "running" or self.planner is None:
            raise StagesNotRunningError(
                f"the event plane is {self._state}: stages can be paused or resumed "
                "only while it runs"
            )
        return self.planner

    async def _stage_answer(self, planner: Planner, name: str, changed: bool) -> dict[str, Any]:
        if changed:
            await self.flush()  # durable before the answer: it survives a crash
        return {"changed": changed, "stage": planner.stages.entry(name, planner.live_id)}

    # ------------------------------------------------------------------
    # Read side for ingest and the admin API

    def max_lag(self) -> int:
        """Events of the slowest core not yet committed (upper bound, LSN distance)."""
        wm = self.watermarks
        if wm is None:
            return 0
        return max(self.rings.pushed_lsn - min(wm.lsns), 0)

    def status(self) -> dict[str, Any]:
        wm, planner = self.watermarks, self.planner
        head = self.rings.pushed_lsn
        cores: list[dict[str, Any]] = []
        for core in range(self.cores):
            ring = self.rings[core]
            consumer = self.consumers[core] if self.consumers else None
            mark = wm.lsns[core] if wm else 0
            cores.append(
                {
                    "core": core,
                    "mode": consumer.mode.value if consumer and consumer.mode else None,
                    "watermark": mark,
                    "lag": max(head - mark, 0),
                    "ring_fill": round(ring.fill(), 4),
                    "ring": {
                        "events": len(ring),
                        "bytes": ring.nbytes,
                        "fill": round(ring.fill(), 4),
                        "dropped": ring.dropped,
                    },
                    "backpressure": ring.state.name.lower(),
                    "delivered_lsn": consumer.last_lsn if consumer else None,
                    "pending_rows": planner.pending_rows(core) if planner else 0,
                    "pending_bytes": planner.pending_bytes(core) if planner else 0,
                    "inflight_bytes": planner.inflight_bytes(core) if planner else 0,
                    "catchups": consumer.catchups if consumer else 0,
                    "catchup": consumer.status(head) if consumer else None,
                }
            )
        return {
            "state": self._state,
            "head_lsn": head,
            "batch_id": wm.batch_id if wm else 0,
            "persisted_batch_id": wm.persisted.batch_id if wm else 0,
            "last_batch": dict(planner.last_batch) if planner and planner.last_batch else None,
            "executor_ready": self.executor.ready(),
            "expected_run_s": round(planner.expected_run_s(), 4) if planner else 0.0,
            "stages": planner.stages.report(planner.live_id) if planner else [],
            "cores": cores,
            "failure": str(self._failure) if self._failure else None,
        }


def _retrieve(task: asyncio.Task[None]) -> None:
    # The error was logged and handed to wait_failed(); mark it retrieved.
    if not task.cancelled():
        task.exception()
