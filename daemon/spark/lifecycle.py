"""The executor's state and its SparkSession's life: build, warm-up, loss, rebuild.

:class:`SessionLife` is the session half of
:class:`~daemon.spark.executor.SparkExecutor` (which inherits it):

1. ``_boot`` builds the session in the worker thread (``_build``: the factory,
   then ``_adopt`` by each ``SessionAware`` stage and ``_warm_up``, the batch
   path once on synthetic rows), retrying with backoff; the WAL and ingest
   never wait for it, and ``_mark_ready`` lets the planner hand batches over.
2. A lost session (the driver JVM died, its SparkContext stopped, a Spark
   Connect server forgot it) is noticed before a batch for free (``_exited``)
   or after a failed one (``_check_session`` -> ``_probe``); ``_lose`` holds
   the batches and boots a new one, after ``_forget`` drops PySpark's
   references to the old. The failed batch re-runs with the same id and rows.
   ``needs_restart()`` turns true after ``health.session_restart_attempts``
   failed builds in a row. The why: docs/cdc.md, "The executor".
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from daemon.config import Config
from daemon.metrics import Metrics
from daemon.plane.batch import BatchStage, SessionAware
from daemon.spark import session as sparkmod

log = structlog.get_logger("eventplane.spark")


class State(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass(slots=True)
class _Status:
    state: State = State.STARTING
    session_error: str | None = None  # the last failed build, until one succeeds
    session_attempts: int = 0  # builds tried since the session was (last) lost
    session_failures: int = 0  # failed builds in a row (needs_restart)
    session_rebuilds: int = 0  # sessions rebuilt after one was lost
    session_lost: str | None = None  # why the last session was lost
    session_lost_at: float | None = None
    last_rebuild_at: float | None = None
    last_batch_id: int | None = None
    last_batch_rows: int | None = None
    last_batch_duration_s: float | None = None
    last_committed_at: float | None = None
    batches_committed: int = 0
    batches_failed: int = 0
    last_error: str | None = None
    last_error_batch_id: int | None = None
    last_error_at: float | None = None
    streams: dict[str, int] = field(default_factory=dict)  # name -> last committed batch


class SessionLife:
    """Builds, warms up and rebuilds the session of a :class:`SparkExecutor`,
    whose ``__init__`` sets the state below."""

    cfg: Config
    metrics: Metrics
    _status: _Status
    _pool: ThreadPoolExecutor
    _session: Any | None
    _owns_session: bool
    _built: Any | None
    _factory: Callable[[], Any]
    _sleep: Callable[[float], Any]
    _stages: list[BatchStage]
    _inbox: Path | None
    _cores: int | None
    _ready: asyncio.Event
    _boot_task: asyncio.Task[None] | None

    if TYPE_CHECKING:

        def status(self) -> dict[str, Any]: ...

        def _parallelism(self, spark: Any) -> int: ...

    async def _boot(self, lost: Any | None = None) -> None:
        """Build the session, retrying with backoff; a routine that only ends by success.

        ``lost``: the session this one replaces; PySpark forgets it first.
        """
        loop = asyncio.get_running_loop()
        mb = self.cfg.microbatch
        st = self._status
        delay = mb.retry_initial_ms / 1000
        started = time.monotonic()
        st.session_attempts = 0
        if lost is not None:
            await loop.run_in_executor(self._pool, self._forget, lost)
        while True:
            st.session_attempts += 1
            try:
                session = await loop.run_in_executor(self._pool, self._build)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                st.session_failures += 1
                st.session_error = f"{type(exc).__name__}: {exc}"
                log.error(
                    "spark_session_failed",
                    attempt=st.session_attempts,
                    failures_in_a_row=st.session_failures,
                    retry_in_s=delay,
                    error=st.session_error,
                    rebuild=lost is not None,
                )
                await self._sleep(delay)
                delay = min(delay * 2, mb.retry_max_ms / 1000)
                continue
            if st.state is not State.STARTING:  # stop() raced us
                return
            self._session = session
            st.session_error = None
            st.session_failures = 0
            seconds = round(time.monotonic() - started, 3)
            if lost is not None:
                st.session_rebuilds += 1
                st.last_rebuild_at = time.time()
                self.metrics.spark_session_rebuilds.inc()
                log.info(
                    "spark_session_rebuilt",
                    seconds=seconds,
                    attempts=st.session_attempts,
                    reason=st.session_lost,
                    **self.status()["spark"],
                )
            else:
                log.info("spark_session_ready", seconds=seconds, **self.status()["spark"])
            self._mark_ready()
            return

    def _build(self) -> Any:
        """Worker thread: build, and remember the session even if boot is cancelled;
        then warm it up (``_warm_up``) before any batch runs on it."""
        session = self._factory()
        self._built = session
        self._adopt(session)
        self._warm_up(session)
        return session

    def _warm_up(self, session: Any) -> None:
        """Worker thread: run the batch path once on synthetic rows into a scratch
        table (daemon/spark/warmup.py), so that the first real batch finds the
        JVM's classes loaded and its hot code compiled. Local masters only: the
        driver JVM is the one that writes. A failure is logged, never raised:
        without the warm-up the first batch is only slower."""
        rows = self.cfg.spark.warmup_rows
        if rows <= 0 or self.cfg.spark.remote or not self.cfg.spark.master.startswith("local"):
            return
        if self._status.state is not State.STARTING:  # stop() came meanwhile
            return
        from daemon.spark import warmup

        try:
            done = warmup.warm_session(
                session, self.cfg, rows, self._parallelism(session), self._inbox is not None
            )
        except Exception as exc:
            log.warning("spark_warmup_failed", error=f"{type(exc).__name__}: {exc}")
            return
        log.info("spark_session_warmed", **done)

    def _adopt(self, session: Any) -> None:
        """Worker thread, between batches: stages that keep the session take this one."""
        self._cores = None  # the new session's parallelism is asked again
        for stage in self._stages:
            if isinstance(stage, SessionAware):
                stage.on_session(session)

    # -- a lost session ------------------------------------------------------

    def _connect(self) -> bool:
        return bool(self.cfg.spark.remote)

    def _exited(self) -> str | None:
        """Why the session we own is gone, known without asking Spark (or None)."""
        if not self._owns_session or self._status.state is not State.READY:
            return None
        return sparkmod.session_exited(self._session, self._connect())

    def _probe(self) -> str | None:
        """Worker thread, after a batch failed: why the session is lost (or None)."""
        try:
            return sparkmod.probe_session(self._session, self._connect())
        except Exception:  # a probe that breaks must not hide the batch's own error
            log.exception("spark_session_probe_failed")
            return None

    def _forget(self, session: Any) -> None:
        """Worker thread: drop PySpark's references to a lost session (bounded)."""
        try:
            sparkmod.forget_session(session, self._connect())
        except Exception:  # the build that follows reports what is still wrong
            log.exception("spark_session_forget_failed")

    async def _check_session(self) -> None:
        """After a failed batch: rebuild the session if it is lost."""
        if not self._owns_session or self._status.state is not State.READY:
            return
        loop = asyncio.get_running_loop()
        reason = await loop.run_in_executor(self._pool, self._probe)
        if reason is not None and self._status.state is State.READY:
            self._lose(reason)

    def _lose(self, reason: str) -> None:
        """The session is gone: hold batches and rebuild it in the background."""
        st = self._status
        lost, self._session, self._built = self._session, None, None
        st.state = State.STARTING
        st.session_lost = reason
        st.session_lost_at = time.time()
        self._ready.clear()
        log.error(
            "spark_session_lost",
            reason=reason,
            rebuilds_before=st.session_rebuilds,
            **self.status()["spark"],
        )
        self._boot_task = asyncio.create_task(self._boot(lost), name="spark-session-rebuild")

    def _mark_ready(self) -> None:
        self._status.state = State.READY
        self._ready.set()
