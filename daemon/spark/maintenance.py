"""Work on a stream's table the executor runs beside the batches: retention and quarantine.

:class:`StreamMaintenance` is that half of
:class:`~daemon.spark.executor.SparkExecutor` (which inherits it):

- ``_retention_loop`` runs ``run_retention`` for each stream with
  ``retention`` every ``retention_check_s``, in a thread of its own (never the
  batch thread); ``run_retention`` is also the admin API's on-demand run, one
  at a time, its result in ``status()`` and the ``cdc_retention_*`` metrics.
- ``quarantine_action`` replays or purges a stream's quarantined rows in the
  batch thread, so never beside one of its commits.

The why: docs/cdc.md, "Time partitioning and retention" and "Quarantine".
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import structlog

from daemon.errors import ExecutorError, UnknownStreamError
from daemon.metrics import Metrics
from daemon.plane.batch import MicroBatch
from daemon.spark import frame
from daemon.table.delta import DeltaSink
from daemon.table.parquet import CdcSink

log = structlog.get_logger("eventplane.spark")


class StreamMaintenance:
    """Retention runs and quarantine actions of a :class:`SparkExecutor`'s
    streams; its ``__init__`` sets the state below."""

    metrics: Metrics
    _sinks: list[CdcSink]
    _session: Any | None
    _pool: ThreadPoolExecutor
    _retention: dict[str, dict[str, Any]]
    _retention_lock: asyncio.Lock

    if TYPE_CHECKING:

        def ready(self) -> bool: ...

        async def _in_stream_thread(
            self, sink: CdcSink, what: str, call: Callable[[], Any]
        ) -> Any: ...

    # -- retention -----------------------------------------------------------

    async def _retention_loop(self) -> None:
        """Each stream with ``retention``: remove its expired partitions every
        ``retention_check_s`` (daemon/table/retention.py). Runs in a thread of
        its own, never in the batch thread: a batch does not wait for it."""
        due = {s.name: 0.0 for s in self._sinks if s.stream.retention_s is not None}
        while True:
            now = time.monotonic()
            for sink in self._sinks:
                if sink.name not in due or due[sink.name] > now:
                    continue
                due[sink.name] = now + sink.stream.retention_check_s
                await self.run_retention(sink.name)
            await asyncio.sleep(max(0.05, min(due.values()) - time.monotonic()))

    async def run_retention(self, stream: str) -> dict[str, Any]:
        """One retention run of ``stream`` now; its result (also in ``status()``)."""
        from daemon.table import retention

        sink = next((s for s in self._sinks if s.name == stream), None)
        if sink is None or sink.stream.retention_s is None:
            raise ExecutorError(f"no CDC stream {stream!r} with retention")
        entry = self._retention.setdefault(stream, {"partitions_removed": 0})
        try:
            async with self._retention_lock:
                if isinstance(sink, DeltaSink):
                    spark = self._session if self.ready() else None
                    if spark is None:
                        raise ExecutorError("Spark is not ready: retention runs once it is")
                    result = await asyncio.to_thread(sink.apply_retention, spark)
                else:
                    result = await asyncio.to_thread(retention.apply, sink.stream, sink=sink)
        except Exception as exc:
            self.metrics.cdc_retention_runs.labels(stream, "failed").inc()
            entry.update(last_run_at=time.time(), last_error=f"{type(exc).__name__}: {exc}")
            log.warning("cdc.retention_failed", stream=stream, error=entry["last_error"])
            return {"stream": stream, "error": entry["last_error"]}
        self.metrics.cdc_retention_runs.labels(stream, "ok").inc()
        self.metrics.cdc_retention_removed.labels(stream).inc(len(result.removed))
        entry.update(
            last_run_at=time.time(),
            last_error=None,
            partitions_removed=entry["partitions_removed"] + len(result.removed),
            oldest_kept=result.oldest_kept,
        )
        return result.to_json()

    # -- quarantine ----------------------------------------------------------

    async def quarantine_action(
        self, stream: str, action: str, lsns: set[int] | None, by: str | None = None
    ) -> dict[str, Any]:
        """``replay`` or ``purge`` the quarantined rows of ``stream`` (all, or
        ``lsns``) in the stream's own thread, where its commits run (its
        lane, :mod:`daemon.spark.lanes`), so never beside one of them: a
        commit still in flight after its batch stopped waiting finishes first."""
        sink = next((s for s in self._sinks if s.name == stream), None)
        if sink is None:
            raise UnknownStreamError(f"no CDC stream {stream!r}")
        if action == "purge":
            n = await self._in_stream_thread(
                sink,
                f"a quarantine purge of {sink.stream.location}",
                functools.partial(sink.purge_quarantine, lsns, by),
            )
            result: dict[str, Any] = {"stream": stream, "purged": n}
        elif action == "replay":
            spark = self._session
            if spark is None or not self.ready():
                raise ExecutorError("Spark is not ready: try the replay again shortly")

            def frame_of(batch: MicroBatch) -> Any:
                return frame.batch_frame(spark, batch, None, 1)[0]

            result = await self._in_stream_thread(
                sink,
                f"a quarantine replay into {sink.stream.location}",
                functools.partial(sink.replay_quarantine, spark, frame_of, lsns),
            )
        else:
            raise ExecutorError(f"unknown quarantine action {action!r}")
        self.metrics.cdc_quarantined_rows.labels(stream).set(sink.quarantined)
        return {**result, "quarantined": sink.quarantined}
