"""The trigger engine: a BatchStage that evaluates triggers in each micro-batch,
calls their actions, and keeps every failed call durably in a retry queue or
a dead-letter queue (DLQ).

Lifecycle::

    engine = TriggerEngine(cfg.triggers, data_dir=cfg.data_dir, emit=append, metrics=m)
    errors = await asyncio.to_thread(engine.validate, spark)   # startup: Spark analysis
    await engine.start()                                        # store + retry loop
    ... executor: result = engine.run_in_spark(spark, df, batch)   (Spark thread)
                  await engine.finish(batch, result)               (event loop)
    errors = await asyncio.to_thread(engine.reload, specs, spark)  # SIGHUP
    await engine.stop()

Per batch: ``run_in_spark`` evaluates every trigger's ``when`` (rows it fails
on are poison rows, for that trigger's DLQ); ``finish`` calls each trigger's
action per chunk, one after another in LSN order, and returns only when each
call succeeded or sits in SQLite (retry queue or DLQ), so the batch's
watermark never covers an action that could still be lost (invariants 6 and
8). Every call carries ``Idempotency-Key: <trigger>:<first_lsn>-<last_lsn>``,
fixed when its chunk is formed. A trigger whose action is failing, or that an
operator paused, has its chunks queued at once instead of attempted; the
retry queue's loop (:mod:`triggers.retries`) delivers them later.

Why, and the guarantees in full: docs/triggers.md ("Delivery guarantees",
"Retries and the DLQ", "Poison rows").
"""

from __future__ import annotations

import asyncio
import itertools
import operator
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import structlog

from triggers import actions, evaluate
from triggers import rows as rowsmod
from triggers.errors import (
    RetriableActionError,
    StoreError,
    TriggerConfigError,
    UnknownTriggerError,
)
from triggers.metrics import NullMetrics, TriggerMetrics
from triggers.retries import RetryQueue
from triggers.spec import (
    MAX_DEPTH,
    EmitAction,
    PythonAction,
    SqlAction,
    Trigger,
    TriggerSpecLike,
    WebhookAction,
    compile_specs,
)
from triggers.store import DeadRows, NewRetry, Pause, TriggerStore, store_path

log = structlog.get_logger("triggers")

# How often an idle loop looks at the store: `eventplane dlq replay` writes
# from another process and cannot wake us.
RETRY_POLL_S = 1.0
# 2**62 times any backoff is far above any max_backoff; avoids float overflow.
_MAX_EXPONENT = 62


class TriggerEngine(RetryQueue):
    """BatchStage ``"triggers"`` (see ``daemon.plane.batch.BatchStage``)."""

    name = "triggers"

    def __init__(
        self,
        specs: Sequence[TriggerSpecLike],
        *,
        data_dir: Path | str,
        emit: actions.EmitFn | None = None,
        http: aiohttp.ClientSession | None = None,
        metrics: TriggerMetrics | None = None,
        dlq_max_entries: int = 100_000,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        max_depth: int = MAX_DEPTH,
        poll_s: float = RETRY_POLL_S,
    ) -> None:
        triggers, errors = compile_specs(specs)
        self._triggers: dict[str, Trigger] = {t.name: t for t in triggers}
        self._compile_errors = errors
        self._validated = False
        self._spark: Any = None
        self._sql_lock = threading.Lock()
        # The batch job's Columns, rebuilt only when the trigger set or session changes.
        self._selection: evaluate.Selection | None = None
        self._data_dir = Path(data_dir)
        self._emit = emit
        self._http = http
        self._own_http: aiohttp.ClientSession | None = None
        self._metrics: TriggerMetrics = metrics if metrics is not None else NullMetrics()
        self._dlq_max = dlq_max_entries
        # Wall clock: retry due times live in a file and must survive restarts.
        self._clock = clock
        self._rng = rng or random.Random()
        self._max_depth = max_depth
        self._poll_s = poll_s
        self._store: TriggerStore | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._retry_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._depth = 0
        self._dlq_size = 0
        # Trigger name -> the retriable error of its last failed call, while its
        # action is failing: its new chunks skip the first attempt (module doc).
        self._failing: dict[str, str] = {}
        # (monotonic time of the first failed pass, the last error) while the
        # retry loop's passes fail; None while they work.
        self.loop_failing: tuple[float, str] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Triggers an operator paused (a copy of the store's table), and the rows
        # a paused trigger holds in the retry queue: counted from the store when
        # it is paused or the store opens, then kept up by finish() (the retry
        # loop leaves its entries alone), so no retry pass parses the queue.
        self._paused: dict[str, Pause] = {}
        self._queued_rows: dict[str, int] = {}
        # The lowest first LSN in the retry queue (None: empty), written only in
        # the store's thread, right after the writes that change it.
        self._oldest_pending: int | None = None

    # ------------------------------------------------------------ properties

    @property
    def triggers(self) -> Mapping[str, Trigger]:
        """The active set (swapped whole by :meth:`reload`)."""
        return self._triggers

    @property
    def store_path(self) -> Path:
        return store_path(self._data_dir)

    @property
    def retry_task(self) -> asyncio.Task[None] | None:
        """The supervised retry loop: it ends only when cancelled (or on a bug)."""
        return self._retry_task

    # ------------------------------------------------------------ validation

    def validate(self, spark: Any) -> list[str]:
        """Check every spec, with Spark analyzing ``when`` and action expressions.

        Blocking (py4j): call it in a worker thread. Returns one message per
        problem, each naming the trigger and quoting Spark; an empty list
        means the engine may run batches.
        """
        errors = list(self._compile_errors)
        errors += evaluate.analyze(list(self._triggers.values()), spark, self._sql_lock)
        self._spark = spark
        self._validated = not errors
        return errors

    def on_session(self, spark: Any) -> None:
        """The executor built a new SparkSession (``daemon.plane.batch.SessionAware``).

        Called in the Spark worker thread between batches. After a rebuild the
        old session's JVM is gone, and with it the batch job's Columns: they
        are dropped, and the next ``run_in_spark`` analyses the set again on
        the new session before using it.
        """
        if spark is self._spark:
            return
        self._spark = spark
        self._selection = None
        self._validated = False

    def reload(self, specs: Sequence[TriggerSpecLike], spark: Any) -> list[str]:
        """SIGHUP: validate a new set whole; swap it in only if it has no errors.

        The swap is one reference assignment; ``run_in_spark`` takes the set
        once per batch and ``finish`` uses that batch's set, so a reload takes
        effect between batches. Blocking (py4j): call it in a worker thread.
        """
        triggers, errors = compile_specs(specs)
        if not errors:
            errors = evaluate.analyze(triggers, spark, self._sql_lock)
        if errors:
            for message in errors:
                log.error("trigger_reload_rejected", error=message)
            log.error(
                "trigger_reload_kept_old_set",
                errors=len(errors),
                kept=sorted(self._triggers),
                message=f"trigger reload rejected with {len(errors)} error(s); "
                "the previous triggers stay active",
            )
            return errors
        old, new = self._triggers, {t.name: t for t in triggers}
        self._triggers = new
        self._spark = spark
        self._validated = True
        self._compile_errors = []
        log.info(
            "triggers_reloaded",
            added=sorted(new.keys() - old.keys()),
            removed=sorted(old.keys() - new.keys()),
            changed=sorted(n for n in new.keys() & old.keys() if new[n] != old[n]),
            active=sorted(n for n, t in new.items() if t.enabled),
        )
        self._wake_from_any_thread()  # enabled/disabled changes what the loop may deliver
        return []

    async def reload_specs(self, specs: Sequence[TriggerSpecLike]) -> list[str]:
        """SIGHUP from the event loop: :meth:`reload` in a worker thread.

        Before Spark is up (no session seen yet) only the Spark-free checks
        run; the first batch then has Spark analyze the new set before using it.
        """
        spark = self._spark
        if spark is not None:
            return await asyncio.to_thread(self.reload, specs, spark)
        triggers, errors = compile_specs(specs)
        if errors:
            for message in errors:
                log.error("trigger_reload_rejected", error=message)
            return errors
        self._triggers = {t.name: t for t in triggers}
        self._compile_errors = []
        self._validated = False
        log.info("triggers_reloaded", active=sorted(self._triggers), spark_checked=False)
        return []

    # ------------------------------------------------------------- lifecycle

    async def start(self, *, retry_loop: bool = True) -> None:
        """Open the store (pending retries become due now) and start the retry loop."""
        self._loop = asyncio.get_running_loop()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trigger-store")
        self._store = await self._db(TriggerStore, self.store_path, self._dlq_max)
        self._paused = await self._db(self._store.pauses)
        self._queued_rows = await self._db(self._store.queued_rows, list(self._paused))
        due = await self._db(self._store.make_all_due, self._clock())
        depth = await self._refresh_gauges()
        log.info(
            "trigger_store_opened",
            path=str(self.store_path),
            pending=depth,
            made_due=due,
            paused=sorted(self._paused),
        )
        if self._http is None:
            self._own_http = aiohttp.ClientSession()
        if retry_loop:
            self._wake = asyncio.Event()
            self._retry_task = asyncio.create_task(self._retry_loop(), name="trigger-retry-loop")

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop (an interrupted call stays queued), close HTTP and the store."""
        task, self._retry_task = self._retry_task, None
        if task is not None:
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not done:
                log.error("trigger_retry_loop_stuck", timeout_s=timeout_s)
            elif not task.cancelled() and task.exception() is not None:
                log.error("trigger_retry_loop_had_failed", error=repr(task.exception()))
        if self._own_http is not None:
            await self._own_http.close()
            self._own_http = None
        if self._store is not None:
            store, self._store = self._store, None
            try:
                await self._db(store.close)
            except Exception:
                log.exception("trigger_store_close_failed")
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    async def __aenter__(self) -> TriggerEngine:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # ------------------------------------------------------------ BatchStage

    def run_in_spark(self, spark: Any, df: Any, batch: Any) -> evaluate.Evaluation:
        """Evaluate every enabled trigger over the batch (Spark worker thread)."""
        if not self._validated:
            # Not validated yet (Spark came up after the engine): check now, in
            # this thread; a failing set fails the batch, which is retried.
            errors = self.validate(spark)
            if errors:
                raise TriggerConfigError(errors)
        triggers = self._triggers  # one set per batch, even if a reload lands meanwhile
        result = evaluate.evaluate(
            spark,
            df,
            triggers,
            int(batch.batch_id),
            self._sql_lock,
            selection=self._selection,
            held=set(self._paused),
        )
        self._selection = result.selection
        if result.batch_error is not None:
            log.warning(
                "trigger_batch_split",
                batch_id=int(batch.batch_id),
                error=result.batch_error,
                culprits=sorted(result.poisoned),
                jobs=result.isolation_jobs,
                seconds=round(result.spark_seconds, 3),
                message="the batch's trigger job failed; the batch was split to isolate the "
                "failing rows, which go to their trigger's DLQ",
            )
        return result

    async def finish(self, batch: Any, result: Any) -> None:
        """Deliver the batch's matched rows; return once every call is done or durable.

        1. Count fires per trigger; rows a trigger failed on (poison) become
           DLQ rows of that trigger.
        2. Per trigger (triggers concurrently): one call per chunk of
           ``batch_size`` rows, in LSN order; sql actions already ran in Spark.
        3. Failed calls become retry entries (retriable, attempts left) or DLQ
           rows, all written with the poison rows in one SQLite transaction.
        4. Refresh the gauges and wake the retry loop.
        """
        if not isinstance(result, evaluate.Evaluation):
            raise TypeError(f"finish() expects run_in_spark's Evaluation, got {type(result)!r}")
        if not result.matched and not result.poisoned:
            return
        store = self._require_store()
        retries: list[NewRetry] = []
        dead: list[DeadRows] = []
        batch_id = int(batch.batch_id)
        # Step 1. Count fires per trigger; poison rows to the DLQ
        for name, rows in result.matched.items():
            self._metrics.trigger_fires.labels(name).inc(len(rows))
        now = self._clock()
        for name, poisoned in result.poisoned.items():
            capped = name in result.capped
            dead += self._poisoned(name, poisoned, now, capped=capped, batch_id=batch_id)
        # Step 2. Call each trigger's action, chunk by chunk
        async with asyncio.TaskGroup() as tg:
            for name, rows in result.matched.items():
                t = result.triggers[name]
                sql = result.sql.get(name)
                tg.create_task(self._first_attempts(t, rows, sql, batch_id, retries, dead))
        # Step 3. Make every failure durable before the batch may commit
        if retries or dead:
            evicted = await self._db(self._record, store, retries, dead)
            self._evicted(evicted)
            for r in retries:
                if r.chunk.trigger in self._paused:
                    name = r.chunk.trigger
                    self._queued_rows[name] = self._queued_rows.get(name, 0) + len(r.chunk)
            log.info(
                "trigger_batch_failures_queued",
                batch_id=batch_id,
                retry_entries=len(retries),
                dlq_rows=sum(len(d.docs) for d in dead),
            )
            # Step 4. Refresh gauges, wake the retry loop
            await self._refresh_gauges()
            self._wake.set()

    async def _first_attempts(
        self,
        t: Trigger,
        rows: list[rowsmod.Row],
        sql: evaluate.SqlOutcome | None,
        batch_id: int,
        retries: list[NewRetry],
        dead: list[DeadRows],
    ) -> None:
        chunks = rowsmod.chunks(t.name, rows, t.batch_size)
        if sql is not None:
            # The statement ran in the Spark thread over all matched rows at once.
            self._metrics.trigger_action_latency.labels(t.name).observe(sql.seconds)
            if sql.error is None:
                self._metrics.trigger_successes.labels(t.name).inc()
                return
            self._metrics.trigger_failures.labels(t.name, "retriable").inc()
            log.warning("trigger_action_failed", trigger=t.name, batch_id=batch_id,
                        rows=len(rows), error=sql.error, retriable=True)  # fmt: skip
            now = self._clock()
            failure = RetriableActionError(sql.error)
            for c in chunks:
                self._plan(t, c, 1, now, now, failure, retries, dead)
            return
        deferred = 0
        for chunk in chunks:
            first = self._clock()
            remaining = self._split_depth(t, chunk, 0, first, first, dead)
            if remaining is None:
                continue
            pause = self._paused.get(t.name)
            if pause is not None:
                # Paused by an operator: queued, not called, until it resumes.
                message = "not attempted: the trigger is paused" + (
                    f" ({pause.reason})" if pause.reason else ""
                )
                retries.append(NewRetry(remaining, 0, first, first, 0.0, message))
                deferred += len(remaining)
                continue
            failing = self._failing.get(t.name)
            if failing is not None:
                # The action is failing: queue without a call, due now, so the
                # retry loop delivers it as soon as the target answers again.
                message = f"not attempted: the action was failing ({failing})"
                retries.append(NewRetry(remaining, 0, first, first, 0.0, message))
                deferred += len(remaining)
                continue
            exc = await self._call(t, remaining, batch_id=batch_id)
            if exc is not None:
                self._plan(t, remaining, 1, first, self._clock(), exc, retries, dead)
        if deferred:
            paused = t.name in self._paused
            (log.info if paused else log.warning)(
                "trigger_calls_deferred",
                trigger=t.name,
                batch_id=batch_id,
                rows=deferred,
                reason="paused" if paused else self._failing.get(t.name),
            )

    # ------------------------------------------------------------ one call

    async def _call(self, t: Trigger, chunk: rowsmod.Chunk, **context: Any) -> BaseException | None:
        """Call the action once; record metrics; return the failure, if any."""
        started = time.perf_counter()
        try:
            await self._dispatch(t, chunk)
        except Exception as exc:
            retriable, _ = actions.classify(exc)
            kind = "retriable" if retriable else "permanent"
            if retriable:
                self._failing[t.name] = actions.describe(exc)
            self._metrics.trigger_failures.labels(t.name, kind).inc()
            log.warning(
                "trigger_action_failed",
                trigger=t.name,
                action=t.action.kind,
                first_lsn=chunk.first_lsn,
                last_lsn=chunk.last_lsn,
                idempotency_key=chunk.idempotency_key,
                rows=len(chunk),
                error=actions.describe(exc),
                retriable=retriable,
                **context,
            )
            return exc
        finally:
            self._metrics.trigger_action_latency.labels(t.name).observe(
                time.perf_counter() - started
            )
        self._metrics.trigger_successes.labels(t.name).inc()
        if self._failing.pop(t.name, None) is not None:
            log.info("trigger_action_recovered", trigger=t.name)
        return None

    async def _dispatch(self, t: Trigger, chunk: rowsmod.Chunk) -> None:
        action = t.action
        if isinstance(action, WebhookAction):
            http = self._http or self._own_http
            if http is None:
                raise RetriableActionError("the trigger engine is not started")
            await actions.call_webhook(http, action, chunk, self._clock())
        elif isinstance(action, PythonAction):
            await actions.call_python(action, chunk)
        elif isinstance(action, EmitAction):
            await actions.call_emit(self._emit, t, action, chunk)
        elif isinstance(action, SqlAction):
            await actions.call_sql(self._spark, self._sql_lock, t, action, chunk)

    def _split_depth(
        self,
        t: Trigger,
        chunk: rowsmod.Chunk,
        attempts: int,
        first: float,
        now: float,
        dead: list[DeadRows],
    ) -> rowsmod.Chunk | None:
        """Emit only: rows whose derived event would exceed the cascade depth go to the DLQ."""
        if not isinstance(t.action, EmitAction):
            return chunk
        ok: list[bytes] = []
        too_deep: list[bytes] = []
        for doc in chunk.docs:
            (too_deep if rowsmod.meta(doc).depth + 1 > self._max_depth else ok).append(doc)
        if not too_deep:
            return chunk
        message = (
            f"emit cascade stopped: trigger {t.name!r} matched {len(too_deep)} event(s) already "
            f"at depth {self._max_depth}, the limit; they went to the DLQ instead of emitting "
            f"depth {self._max_depth + 1}"
        )
        log.error(
            "trigger_cascade_depth_exceeded",
            trigger=t.name,
            max_depth=self._max_depth,
            rows=len(too_deep),
            lsns=[rowsmod.meta(d).lsn for d in too_deep[:10]],
            message=message,
        )
        self._metrics.trigger_failures.labels(t.name, "depth_limit").inc()
        # No call carried these rows under the chunk's key (the split comes before
        # every call): they get no key, so the key keeps naming the rows sent with it.
        dead.append(DeadRows(t.name, too_deep, attempts, message, first, now))
        return rowsmod.Chunk.from_docs(t.name, ok, chunk.idempotency_key) if ok else None

    def _poisoned(
        self,
        name: str,
        poisoned: Sequence[evaluate.PoisonRow],
        now: float,
        *,
        capped: bool = False,
        **context: Any,
    ) -> list[DeadRows]:
        """Rows the trigger could not evaluate: logged, counted, DLQ rows (attempts 0)."""
        self._metrics.trigger_failures.labels(name, "poison").inc(len(poisoned))
        log.error(
            "trigger_rows_poisoned",
            trigger=name,
            rows=len(poisoned),
            lsns=[p.lsn for p in poisoned[:10]],
            error=poisoned[0].error,
            capped=capped,
            message=(
                f"trigger {name!r} failed on too many rows to isolate them one by one "
                "(MAX_POISON_ROWS_PER_BATCH or MAX_SPLIT_JOBS_PER_BATCH); the rest of its rows "
                f"in the batch went to its DLQ unevaluated, {len(poisoned)} in all"
                if capped
                else f"trigger {name!r} failed on {len(poisoned)} row(s); they went to its DLQ"
            )
            + " (fix the trigger, reload, then `eventplane dlq replay`)",
            **context,
        )
        return [
            DeadRows(name, [p.doc for p in run], 0, error, now, now)
            for error, run in itertools.groupby(poisoned, key=operator.attrgetter("error"))
        ]

    def backoff_s(self, t: Trigger, attempts: int) -> float:
        """initial * 2^(attempts-1), capped at max, with equal jitter (never below half)."""
        nominal = min(
            t.max_backoff_s, t.initial_backoff_s * 2.0 ** min(attempts - 1, _MAX_EXPONENT)
        )
        return nominal / 2 + self._rng.random() * nominal / 2

    def _plan(
        self,
        t: Trigger,
        chunk: rowsmod.Chunk,
        attempts: int,
        first: float,
        now: float,
        exc: BaseException,
        retries: list[NewRetry],
        dead: list[DeadRows],
    ) -> None:
        """After a failed attempt: the retry queue or the DLQ."""
        retriable, retry_after = actions.classify(exc)
        message = actions.describe(exc)
        if retriable and attempts < t.max_attempts:
            delay = self.backoff_s(t, attempts)
            if retry_after is not None:
                delay = max(delay, retry_after)
            retries.append(NewRetry(chunk, attempts, now + delay, first, now, message))
            return
        if retriable:
            message = f"gave up after {attempts} attempt(s): {message}"
        log.error(
            "trigger_rows_dead_lettered",
            trigger=t.name,
            rows=len(chunk),
            first_lsn=chunk.first_lsn,
            last_lsn=chunk.last_lsn,
            idempotency_key=chunk.idempotency_key,
            attempts=attempts,
            error=message,
        )
        dead.append(
            DeadRows(t.name, chunk.docs, attempts, message, first, now, chunk.idempotency_key)
        )

    # ------------------------------------------------------------ pause

    def is_paused(self, name: str) -> bool:
        return name in self._paused

    async def pause_trigger(self, name: str, *, reason: str = "", by: str = "") -> bool:
        """Pause one trigger, durably (in the store before this returns); False
        if it was paused already (the first pause's time, reason and author stay).
        Raises :class:`UnknownTriggerError` for a name not configured."""
        if name not in self._triggers:
            raise UnknownTriggerError(name, sorted(self._triggers))
        store = self._require_store()
        since = self._clock()
        if not await self._db(store.pause, name, since, by, reason):
            return False
        self._paused[name] = Pause(name, since, by, reason)
        self._queued_rows.update(await self._db(store.queued_rows, [name]))
        log.info("trigger.paused", trigger=name, reason=reason or None, by=by or None)
        await self._refresh_gauges()
        return True

    async def resume_trigger(self, name: str) -> bool:
        """Resume a paused trigger: its queued calls are due at once (oldest
        first). False if it was not paused. A name no longer configured may be
        resumed (its entries then go to the DLQ as orphans, as always)."""
        if name not in self._triggers and name not in self._paused:
            raise UnknownTriggerError(name, sorted(self._triggers))
        store = self._require_store()
        pause = await self._db(store.resume, name)
        self._paused.pop(name, None)
        if pause is None:
            return False
        queued = self._queued_rows.get(name, 0)
        log.info(
            "trigger.resumed",
            trigger=name,
            paused_s=round(max(self._clock() - pause.since, 0.0), 3),
            queued_rows=queued,
        )
        await self._refresh_gauges()
        self._wake.set()
        return True

    def pause_entry(self, name: str) -> dict[str, Any]:
        """A trigger's pause as status and the pause command show it."""
        pause = self._paused.get(name)
        return {
            "name": f"trigger:{name}",
            "paused": pause is not None,
            "paused_since": pause.since if pause else None,
            "paused_for_s": round(max(self._clock() - pause.since, 0.0), 3) if pause else None,
            "paused_by": (pause.by or None) if pause else None,
            "paused_reason": (pause.reason or None) if pause else None,
            # Rows a paused trigger holds in the retry queue: what resuming
            # delivers (after a resume, what it held then).
            "queued_rows": self._queued_rows.get(name, 0),
        }

    # ------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        """For ``/v1/status``: retry depth and DLQ size as of the last refresh
        (every retry pass, at most ``poll_s`` old) and the active triggers."""
        return {
            "retry_queue": {"depth": self._depth},
            "dlq": {"entries": self._dlq_size},
            "triggers": {
                "active": sorted(n for n, t in self._triggers.items() if t.enabled),
                "disabled": sorted(n for n, t in self._triggers.items() if not t.enabled),
                # Triggers whose action is failing (new chunks queue without a call).
                "failing": dict(sorted(self._failing.items())),
                # Triggers an operator paused: evaluated, their calls queued.
                "paused": {n: self.pause_entry(n) for n in sorted(self._paused)},
            },
            "retry_loop": None
            if self.loop_failing is None
            else {
                "failing_for_s": round(time.monotonic() - self.loop_failing[0], 3),
                "error": self.loop_failing[1],
            },
        }

    # ------------------------------------------------------------ helpers

    def archive_floor(self) -> int | None:
        """The LSN below which the WAL archive may go: below the oldest row the
        retry queue still has to deliver (invariant 9), so a restore from the
        archive evaluates it again (docs/operating.md, "Losing the machine");
        None when the queue is empty. The local WAL needs none of it (the
        queue holds whole rows)."""
        oldest = self._oldest_pending
        return None if oldest is None else oldest - 1

    def _record(
        self, store: TriggerStore, retries: Sequence[NewRetry], dead: Sequence[DeadRows]
    ) -> int:
        """``store.record`` and the retry queue's floor with it (the store's thread)."""
        evicted = store.record(retries, dead)
        if retries:
            low = min(r.chunk.first_lsn for r in retries)
            oldest = self._oldest_pending
            self._oldest_pending = low if oldest is None else min(oldest, low)
        return evicted

    def _read_floor(self, store: TriggerStore) -> None:
        self._oldest_pending = store.oldest_pending_lsn()

    def _require_store(self) -> TriggerStore:
        if self._store is None:
            raise StoreError("the trigger engine is not started (call start() first)")
        return self._store

    async def _refresh_gauges(self) -> int:
        store = self._require_store()
        depth = self._depth = await self._db(store.retry_depth)
        await self._db(self._read_floor, store)
        before, self._dlq_size = self._dlq_size, await self._db(store.dlq_size)
        if self._paused and self._dlq_size < before:
            # Rows left the DLQ from outside: `eventplane dlq replay` (another
            # process) may have moved a paused trigger's rows back to the retry
            # queue, where they now wait with its other queued rows.
            self._queued_rows.update(await self._db(store.queued_rows, list(self._paused)))
        self._metrics.retry_depth.set(depth)
        self._metrics.dlq_entries.set(self._dlq_size)
        for name in self._triggers.keys() | self._paused.keys():
            held = self._queued_rows.get(name, 0) if name in self._paused else 0
            self._metrics.trigger_paused_rows.labels(name).set(held)
        return depth

    def _held(self) -> list[str]:
        """Triggers whose queued calls wait: disabled in the config, or paused."""
        disabled = {n for n, t in self._triggers.items() if not t.enabled}
        return sorted(disabled | self._paused.keys())

    def _wake_from_any_thread(self) -> None:
        """reload() runs in a worker thread; asyncio.Event is not thread-safe."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._wake.set()
        else:
            loop.call_soon_threadsafe(self._wake.set)

    def _evicted(self, count: int) -> None:
        if count:
            self._metrics.dlq_evicted.inc(count)
            log.warning(
                "dlq_evicted",
                entries=count,
                max_entries=self._dlq_max,
                message=f"the DLQ is full ({self._dlq_max} entries): evicted the {count} oldest",
            )
