"""The retry queue's loop: failed action calls are attempted again until they land.

A call that failed in ``finish`` sits in the store's retry queue (SQLite,
``triggers.store``) with its rows, key and next due time. This mixin of
:class:`~triggers.engine.TriggerEngine` works through it, off the batch path:

1. ``_retry_loop`` runs a pass whenever woken, an entry is due, or every
   ``poll_s`` (``eventplane dlq replay`` writes from another process); a pass
   that fails (the store's volume is full, say) is retried with backoff.
2. ``deliver_due`` takes up to ``RETRY_PASS_LIMIT`` due entries, one trigger's
   one after another (oldest first), triggers concurrently; an entry of a
   trigger no longer configured goes to the DLQ.
3. ``_retry_one`` evaluates replayed poison rows again with Spark, drops rows
   past the emit cascade depth, calls the action, and then deletes the entry,
   reschedules it (backoff with jitter) or moves it to the DLQ.

Why and how to operate it: docs/triggers.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import operator
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import structlog

from triggers import evaluate
from triggers import rows as rowsmod
from triggers.errors import RetriableActionError, StoreError
from triggers.metrics import TriggerMetrics
from triggers.spec import Trigger
from triggers.store import DeadRows, NewRetry, RetryEntry, TriggerStore

log = structlog.get_logger("triggers")

# Entries attempted per retry pass; the next pass starts right away if more are due.
RETRY_PASS_LIMIT = 256
# Longest wait between two failing retry passes (store errors, not action
# failures): the loop retries for as long as the store fails.
RETRY_LOOP_BACKOFF_MAX_S = 30.0
T = TypeVar("T")


class RetryQueue:
    """The retry queue's loop (a mixin of ``TriggerEngine``, which owns the state)."""

    _triggers: dict[str, Trigger]
    _clock: Callable[[], float]
    _spark: Any
    _validated: bool
    _metrics: TriggerMetrics
    _wake: asyncio.Event
    _poll_s: float
    loop_failing: tuple[float, str] | None
    _pool: ThreadPoolExecutor | None
    _require_store: Callable[[], TriggerStore]
    _held: Callable[[], list[str]]
    _refresh_gauges: Callable[[], Awaitable[int]]
    _evicted: Callable[[int], None]
    _call: Callable[..., Awaitable[BaseException | None]]
    _split_depth: Callable[..., rowsmod.Chunk | None]
    _poisoned: Callable[..., list[DeadRows]]
    _plan: Callable[..., None]
    backoff_s: Callable[[Trigger, int], float]

    async def deliver_due(self) -> int:
        """One retry pass: attempt every entry due now; returns how many were attempted.

        Entries of one trigger go one after another (oldest due first);
        triggers run concurrently. Entries of disabled triggers wait; entries
        of triggers no longer configured go to the DLQ.
        """
        store = self._require_store()
        triggers = self._triggers
        entries = await self._db(store.due, self._clock(), self._held(), RETRY_PASS_LIMIT)
        groups: dict[str, list[RetryEntry]] = {}
        for entry in entries:
            groups.setdefault(entry.trigger, []).append(entry)
        async with asyncio.TaskGroup() as tg:
            for name, group in groups.items():
                tg.create_task(self._retry_group(triggers.get(name), name, group))
        await self._refresh_gauges()  # also sees `eventplane dlq` changes made elsewhere
        return len(entries)

    async def _retry_group(self, t: Trigger | None, name: str, group: list[RetryEntry]) -> None:
        store = self._require_store()
        for entry in group:
            if t is None:
                message = (
                    f"trigger {name!r} is no longer configured; last error: {entry.last_error}"
                )
                log.error("trigger_retry_orphaned", trigger=name, entry=entry.id, message=message)
                dead = DeadRows(name, entry.chunk().docs, entry.attempts, message,
                                entry.first_attempt, entry.last_attempt,
                                entry.call_key)  # fmt: skip
                self._evicted(await self._db(store.dead_letter, entry, [dead], []))
                continue
            await self._retry_one(t, entry)

    async def _retry_one(self, t: Trigger, entry: RetryEntry) -> None:
        """One retry entry: evaluate replayed poison rows again, then call the action.

        1. Rows marked unevaluated (a replayed poison row) get ``when``
           evaluated again with Spark: the ones that match join the call, the
           others are done, the ones that still fail go back to the DLQ.
           Without Spark (or before it checked the set) the entry waits.
        2. Emit only: rows past the cascade depth go to the DLQ.
        3. Call the action; success deletes the entry, a failure reschedules
           it or moves it to the DLQ (an evaluated chunk replaces the entry).
        """
        store = self._require_store()
        now = self._clock()
        first = entry.first_attempt or now
        dead: list[DeadRows] = []
        chunk = entry.chunk()
        # Step 1. Evaluate replayed poison rows again
        evaluated = any(rowsmod.is_unevaluated(d) for d in chunk.docs)
        if evaluated:
            if self._spark is None or not self._validated:
                log.info("trigger_retry_waits_for_spark", trigger=t.name, entry=entry.id)
                await self._db(store.reschedule, entry.id, entry.attempts,
                               now + self.backoff_s(t, 1), entry.last_attempt,
                               "waiting for Spark to evaluate `when` on replayed rows")  # fmt: skip
                return
            try:
                again = await self._evaluate_again(t, entry, chunk, now, dead)
            except Exception as err:  # Spark itself failed: an attempt, the rows keep their mark
                failure = RetriableActionError(
                    f"cannot evaluate `when` on replayed rows: {evaluate.spark_message(err)}"
                )
                log.warning("trigger_retry_evaluation_failed", trigger=t.name, entry=entry.id,
                            error=str(failure))  # fmt: skip
                retries: list[NewRetry] = []
                self._plan(t, entry.chunk(), entry.attempts + 1, first, now, failure, retries, dead)
                self._evicted(await self._db(store.dead_letter, entry, dead, retries))
                return
            if again is None:  # nothing matched; rows that failed again are in `dead`
                self._evicted(await self._db(store.dead_letter, entry, dead, []))
                return
            chunk = again
        # Step 2. Emit cascade depth
        remaining = self._split_depth(t, chunk, entry.attempts, first, now, dead)
        if remaining is None:
            self._evicted(await self._db(store.dead_letter, entry, dead, []))
            return
        chunk = remaining
        # Step 3. Call the action
        exc = await self._call(t, chunk, retry_entry=entry.id, attempt=entry.attempts + 1)
        attempts = entry.attempts + 1
        now = self._clock()
        if exc is None:
            log.info("trigger_retry_delivered", trigger=t.name, entry=entry.id, attempts=attempts,
                     first_lsn=chunk.first_lsn, last_lsn=chunk.last_lsn)  # fmt: skip
            if dead or evaluated:
                self._evicted(await self._db(store.dead_letter, entry, dead, []))
            else:
                await self._db(store.succeeded, entry.id)
            return
        retries = []
        self._plan(t, chunk, attempts, first, now, exc, retries, dead)
        if retries and not dead and not evaluated:
            r = retries[0]
            await self._db(store.reschedule, entry.id, attempts, r.next_due, now, r.last_error)
        else:
            self._evicted(await self._db(store.dead_letter, entry, dead, retries))

    async def _evaluate_again(
        self,
        t: Trigger,
        entry: RetryEntry,
        chunk: rowsmod.Chunk,
        now: float,
        dead: list[DeadRows],
    ) -> rowsmod.Chunk | None:
        """Step 1 of :meth:`_retry_one`: the chunk to call (None: nothing to call)."""
        unevaluated = [d for d in chunk.docs if rowsmod.is_unevaluated(d)]
        known = [d for d in chunk.docs if not rowsmod.is_unevaluated(d)]
        result = await asyncio.to_thread(evaluate.reevaluate, self._spark, t, unevaluated)
        matched = result.matched.get(t.name, [])
        poisoned = result.poisoned.get(t.name, [])
        if poisoned:
            dead += self._poisoned(t.name, poisoned, now, capped=t.name in result.capped,
                                   retry_entry=entry.id)  # fmt: skip
        self._metrics.trigger_fires.labels(t.name).inc(len(matched))
        log.info(
            "trigger_replay_evaluated",
            trigger=t.name,
            entry=entry.id,
            rows=len(unevaluated),
            matched=len(matched),
            failed=len(poisoned),
            not_matched=len(unevaluated) - len(matched) - len(poisoned),
        )
        rows = [rowsmod.Row(rowsmod.meta(d).lsn, d) for d in known] + matched
        rows.sort(key=operator.attrgetter("lsn"))
        # Rows that were never evaluated never reached a receiver: their call gets
        # its key now, from the rows that match. Evaluated rows keep the entry's.
        key = chunk.idempotency_key if known else None
        return rowsmod.Chunk.of(t.name, rows, key) if rows else None

    async def _retry_loop(self) -> None:
        """Supervised: CancelledError exits. A failing pass (the store's volume is
        full, say) is retried with backoff for as long as it fails: a restart
        would not free the disk. ``status()`` and the daemon's health show it."""
        failures = 0
        while True:
            self._wake.clear()
            try:
                await self.deliver_due()
                if failures:
                    log.info("trigger_retry_pass_recovered", failed_passes=failures)
                failures = 0
                self.loop_failing = None
                delay = await self._next_wait()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                # A pass runs triggers in a TaskGroup: say what failed inside it.
                cause: BaseException = exc
                while isinstance(cause, BaseExceptionGroup) and cause.exceptions:
                    cause = cause.exceptions[0]
                error = f"{type(cause).__name__}: {cause}"
                since = time.monotonic() if self.loop_failing is None else self.loop_failing[0]
                if self.loop_failing is None:
                    log.exception("trigger_retry_pass_failed", consecutive=failures, error=error)
                else:
                    log.error("trigger_retry_pass_failed", consecutive=failures, error=error)
                self.loop_failing = (since, error)
                delay = min(self._poll_s * 2**failures, RETRY_LOOP_BACKOFF_MAX_S)
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=delay)

    async def _next_wait(self) -> float:
        store = self._require_store()
        due = await self._db(store.next_due, self._held())
        if due is None:
            return self._poll_s
        return min(max(due - self._clock(), 0.0), self._poll_s)

    async def _db(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a store call on the store's own thread (SQLite blocks on fsync)."""
        if self._pool is None:
            raise StoreError("the trigger engine is not started (call start() first)")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))
