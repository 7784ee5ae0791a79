"""The daemon's lifecycle: ``startup()``, ``main_loop()``, ``shutdown()``.

Reading :meth:`Daemon.serve` tells the whole story:

1. startup — open the WAL (recovery runs here), start the event plane (the
   consumers boot into catch-up from their watermarks), start Spark in the
   background, bind the admin and ingest listeners, tell systemd READY=1.
2. main_loop — until asked to exit: apply SIGHUP reloads, and fail-stop if
   a component failed (systemd restarts us). A watchdog task on the same
   loop pings systemd and refreshes STATUS= while a restart would not help
   (``needs_restart``); a stalled stage makes the daemon unhealthy
   (``problems``) without withholding the pings: restarting does not bring a
   receiver or a full disk back.
3. shutdown — under one monotonic budget: ingest answers 503 and finishes
   in-flight requests (their group commit completes), the running micro-batch
   finishes, watermarks are flushed, Spark stops, the WAL closes.

Signal handlers only flip state: the first SIGTERM/SIGINT sets
``should_exit``, a second sets ``force_exit`` (skip the drain: everything
acknowledged is in the WAL already). SIGHUP asks for a reload of triggers, the
log level, the producer tokens (inline and ``ingest.tokens_file``), the admin
token and both listeners' TLS files, applied by the main loop between batches.

With ``[wal.archive] role = "standby"`` startup is short (``_startup_standby``):
the archive's manifest is read, never taken; no WAL, event plane or Spark;
the admin listener, and an ingest listener that answers every request 503
``standby`` naming the primary's host (docs/operating.md, "A standby").

A start-up failure is one ``startup.failed`` event (the step, the error, what
to do, the exit code), then the same drain; the process exits with the code
that event and ``shutdown.done`` name (2 for a configuration error, else 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import functools
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
import uvloop

from daemon import security
from daemon.config import Config
from daemon.errors import ArchiveRefusedError, ConfigError, DaemonError
from daemon.ingest.server import IngestServer
from daemon.plane.batch import BatchStage, Executor, NullExecutor
from daemon.plane.eventplane import EventPlane
from daemon.plane.stages import paused_problem, slow_problem, stopped_message
from daemon.service import logs
from daemon.service.admin import AdminServer
from daemon.service.deadline import Deadline
from daemon.service.metrics import Metrics
from daemon.service.sdnotify import Notifier, Watchdog
from daemon.table.lease import wall_clock
from wal import Wal
from wal.errors import WalClosedError

log = structlog.get_logger("eventplane")

# How often the main loop publishes status and checks health.
TICK_S = 0.5
# Exit codes: 0 clean stop; 1 a component failed (systemd Restart=on-failure acts);
# 2 invalid configuration (restarting will not help: fix the file).
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2


class Daemon:
    def __init__(self, cfg: Config, notifier: Notifier | None = None) -> None:
        self.cfg = cfg
        self.metrics = Metrics(cores=cfg.daemon.cores)
        self.metrics.bind_health(self.healthy, self.ready)
        self.metrics.init_triggers([t.name for t in cfg.triggers])
        self.notifier = notifier or Notifier.from_env()
        self.should_exit = False
        self.force_exit = False
        self.reload_requested = False
        self.exit_code = EXIT_OK
        self.started = False
        self._wakeup = asyncio.Event()
        self.wal: Wal | None = None
        self.executor: Executor | None = None
        self.plane: EventPlane | None = None
        self.ingest: IngestServer | None = None
        self.admin: AdminServer | None = None
        self.triggers: Any = None
        self.archive: Any = None  # daemon.walarchive.WalArchive under [wal.archive]
        # daemon.walarchive.ManifestWatch with [wal.archive] role = "standby", and
        # its copy of the archive (daemon.follow.Follower).
        self.standby: Any = None
        self.follower: Any = None
        self.took_over = False  # this process (or this data_dir) took the archive over
        self.takeover_error: str | None = None  # the last takeover refused, until one works
        archive = cfg.wal.archive
        self.role = archive.role if archive is not None else "primary"
        # What startup() is doing, for the one line a start-up failure prints.
        self.startup_step = "configuration"
        self._watchdog: Watchdog | None = None
        self._background: set[asyncio.Task[None]] = set()

    # -- signals: flip state only ------------------------------------------

    def request_exit(self, reason: str = "requested") -> None:
        """The injectable shutdown trigger; a second call forces a fast exit."""
        if self.should_exit:
            self.force_exit = True
            if self.ingest is not None:
                self.ingest.hurry()  # no drain grace for producers: exit now
            log.warning("shutdown.forced", reason=reason)
        else:
            self.should_exit = True
            log.info("shutdown.requested", reason=reason)
        self._wakeup.set()

    def fail(self, message: str) -> None:
        """A component failed outside the event plane: stop and exit non-zero."""
        log.error("component.failed", error=message)
        self.exit_code = EXIT_FAILED
        self.request_exit("failure")

    def request_reload(self) -> None:
        self.reload_requested = True
        self._wakeup.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_exit, "SIGTERM")
        loop.add_signal_handler(signal.SIGINT, self.request_exit, "SIGINT")
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)

    # -- the three phases ---------------------------------------------------

    async def serve(self) -> int:
        try:
            await self.startup()
        except Exception as exc:
            self.exit_code = EXIT_CONFIG if isinstance(exc, ConfigError) else EXIT_FAILED
            log_startup_failure(self.startup_step, exc, self.exit_code)
            await self.shutdown(Deadline(self.cfg.daemon.shutdown_timeout_s))
            return self.exit_code
        except BaseException:  # cancelled: undo what started, then let it propagate
            await self.shutdown(Deadline(self.cfg.daemon.shutdown_timeout_s))
            raise
        await self.main_loop()
        await self.shutdown(Deadline(self.cfg.daemon.shutdown_timeout_s))
        return self.exit_code

    async def startup(self) -> None:
        cfg = self.cfg
        t0 = time.monotonic()
        self.metrics.up_seconds.set(time.time())
        self.startup_step = f"the data dir {cfg.data_dir}"
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        if self.role == "standby":
            from daemon.restore import has_wal

            if not has_wal(cfg.wal_dir):
                await self._startup_standby(t0)
                return
            # A standby that took the archive over keeps its role across restarts.
            log.info("standby.is_primary", data_dir=str(cfg.data_dir), wal_dir=str(cfg.wal_dir))
            self.role = "primary"
            self.took_over = True

        if cfg.wal.archive is not None:
            # A wiped disk never silently becomes a new WAL (docs/operating.md,
            # "Losing the machine").
            from daemon.restore import archive_manifest
            from daemon.walarchive import live_holder

            self.startup_step = f"the WAL archive ([wal.archive] uri = {cfg.wal.archive.uri})"
            manifest = await asyncio.to_thread(archive_manifest, cfg)
            held = None if manifest is None else manifest.get("wal_id")
            if held:
                raise ArchiveRefusedError(
                    f"{cfg.wal_dir} holds no WAL, but the archive {cfg.wal.archive.uri} holds "
                    f"WAL {held}: run `eventplane restore --config <this config>` to rebuild "
                    "this data_dir from it (or point [wal.archive] uri at a new prefix)"
                    + live_holder(manifest, cfg.s3.lease_skew_s)
                )
        # Step 1. The WAL: recovery of a torn tail happens here. Its lock file
        # names us, so a second daemon on this data_dir is told who holds it.
        self.startup_step = f"the WAL in {cfg.wal_dir}"
        holder = {"data_dir": str(cfg.data_dir)}
        if cfg.source is not None:
            holder["config"] = str(cfg.source)
        self.wal = await asyncio.to_thread(
            Wal.open,
            cfg.wal_dir,
            segment_bytes=cfg.wal.segment_bytes,
            fsync=cfg.wal.fsync,
            fsync_interval_ms=cfg.wal.fsync_interval_ms,
            max_group_bytes=cfg.wal.max_group_bytes,
            holder=holder,
            request_window_s=cfg.ingest.idempotency_window_s,
            request_max_keys=cfg.ingest.idempotency_max_keys,
        )
        self.wal.on_group = self._observe_group
        log.info(
            "wal.opened",
            dir=str(cfg.wal_dir),
            head_lsn=self.wal.head_lsn(),
            retained_floor=self.wal.retained_floor(),
            wal_id=self.wal.wal_id,
        )

        # Step 1b. The WAL's archive (docs/wal.md, "The archive"): its manifest
        # taken, this WAL's id checked against it, the fence written.
        plane_wal: Any = self.wal
        if cfg.wal.archive is not None:
            from daemon.walarchive import ArchivedWal, WalArchive

            self.startup_step = f"the WAL archive ([wal.archive] uri = {cfg.wal.archive.uri})"
            self.archive = WalArchive(
                cfg.wal.archive, cfg.s3, self.wal, str(cfg.data_dir), self.metrics
            )
            try:
                await self.archive.open()
            except ArchiveRefusedError as exc:
                if not self.took_over:
                    raise
                raise ArchiveRefusedError(
                    f"{exc}. This data_dir took the archive over as its standby before; to "
                    f"follow the new primary as its standby again, move {cfg.wal_dir} away "
                    '(docs/operating.md, "A standby")'
                ) from exc
            self.archive.start()
            self.wal.set_batch_listener(self.archive.on_durable_batches)
            plane_wal = ArchivedWal(self.wal, self.archive)
            if self.archive.acks_archived:
                # Stages take only archived events: what this WAL holds from
                # before this start goes to the archive before they start.
                self.startup_step = "the WAL archive's upload of this WAL's unarchived events"
                await self._archive_backlog()

        # Step 2. What runs each micro-batch: Spark only when there is work for it.
        self.startup_step = "the micro-batch executor (CDC streams, handlers, Spark)"
        self.executor = self._build_executor()
        await self.executor.start()
        if self.triggers is not None:
            self.startup_step = "the trigger store"
            from daemon.service.triggers import validate_when_spark_ready

            await self.triggers.start()
            self._background.add(
                asyncio.create_task(
                    validate_when_spark_ready(self.executor, self.triggers, self.fail),
                    name="trigger-validation",
                )
            )

        # Step 3. Rings, consumers, planner, watermarks. Rings are fed after fsync.
        self.startup_step = "the event plane (watermarks, batch plans)"
        self.plane = EventPlane(cfg, plane_wal, self.executor, self.metrics)
        if self.archive is not None:
            self.archive.forward = self.plane.on_durable_batches
        else:
            self.wal.set_batch_listener(self.plane.on_durable_batches)
        await self.plane.start()

        # Step 4. Listeners: admin first so /healthz answers while ingest binds. Their
        # secrets first of all: a bad file is a configuration error (exit 2).
        self.startup_step = "the listeners' TLS files and the producer tokens"
        tokens = await asyncio.to_thread(security.load_tokens, cfg.ingest)
        admin_tls = security.ServerTls(cfg.admin.tls, "admin") if cfg.admin.tls.enabled else None
        ingest_tls = (
            security.ServerTls(cfg.ingest.tls, "ingest") if cfg.ingest.tls.enabled else None
        )
        for event, fields in security.open_warnings(cfg, security.ProducerAuth(tokens)):
            log.warning(event, **fields)
        self.startup_step = f"the admin listener ([admin] listen = {cfg.admin.listen})"
        from daemon.service.triggers import StagePauses

        self.admin = AdminServer(
            cfg,
            self.metrics,
            status=self.status,
            ready=self.ready,
            problems=self.problems,
            notices=self.notices,
            stages=StagePauses(self.plane, lambda: self.triggers),
            compaction=getattr(self.executor, "compaction", None),
            retention=getattr(self.executor, "run_retention", None),
            quarantine=getattr(self.executor, "quarantine_action", None),
            mirror_quarantine=getattr(self.executor, "mirror_quarantine_action", None),
            tls=admin_tls,
            role=self.role,
        )
        await self.admin.start()
        self.startup_step = f"the ingest listener ([ingest] listen = {cfg.ingest.listen})"
        self.ingest = IngestServer(
            cfg, self.wal, self.metrics, lag=self.plane.max_lag, tokens=tokens, tls=ingest_tls
        )
        self.ingest.archive = self.archive
        wal = self.wal
        self.metrics.ingest_idempotency_keys.set_function(lambda: float(wal.request_keys()))
        await self.ingest.start()

        self.started = True
        self.notifier.ready()
        self._watchdog = Watchdog(
            self.notifier, healthy=lambda: not self.needs_restart(), status=self.status_line
        )
        self._watchdog.start()
        log.info(
            "eventplane.ready",
            ingest=self.ingest.url,
            admin=self.admin.url,
            cores=cfg.daemon.cores,
            spark=hasattr(self.executor, "add_stage"),
            startup_s=round(time.monotonic() - t0, 3),
        )

    async def _startup_standby(self, t0: float) -> None:
        """A standby (invariant 21: it acknowledges nothing): the manifest read, the
        listeners bound; ingest answers 503 ``standby`` naming the primary's host.

        1. The archive's manifest: who holds it (an unreadable store is reported
           in status and logged, and read again; it does not stop the start).
        2. The ingest listener with its standby gate, then the admin listener:
           a standby's /healthz (its readiness) answers once ingest answers.
        """
        from daemon.walarchive import ManifestWatch

        cfg = self.cfg
        assert cfg.wal.archive is not None
        # Step 1. The manifest, read only
        self.startup_step = f"the WAL archive ([wal.archive] uri = {cfg.wal.archive.uri})"
        self.standby = ManifestWatch(cfg.wal.archive, cfg.s3)
        await self.standby.open()
        self.standby.start()
        # Step 1b. The archive's copy in this data_dir (daemon/follow.py)
        from daemon.follow import Follower

        self.startup_step = f"the standby's copy of the archive in {cfg.data_dir}"
        self.follower = Follower(cfg.wal.archive, cfg.s3, cfg.data_dir, self.metrics)
        self.follower.wal_id = (self.standby.manifest or {}).get("wal_id")
        self.follower.start()
        # Step 2. Listeners, ingest first (its /healthz says it answers)
        self.startup_step = "the listeners' TLS files and the producer tokens"
        tokens = await asyncio.to_thread(security.load_tokens, cfg.ingest)
        admin_tls = security.ServerTls(cfg.admin.tls, "admin") if cfg.admin.tls.enabled else None
        ingest_tls = (
            security.ServerTls(cfg.ingest.tls, "ingest") if cfg.ingest.tls.enabled else None
        )
        self.startup_step = f"the ingest listener ([ingest] listen = {cfg.ingest.listen})"
        self.ingest = IngestServer(
            cfg, _NoWal(), self.metrics, lag=lambda: 0, tokens=tokens, tls=ingest_tls
        )
        self.ingest.standby = self.standby.primary
        await self.ingest.start()
        self.startup_step = f"the admin listener ([admin] listen = {cfg.admin.listen})"
        self.admin = AdminServer(
            cfg,
            self.metrics,
            status=self.status,
            ready=self.ready,
            problems=self.problems,
            role=self.role,
            tls=admin_tls,
        )
        await self.admin.start()

        self.started = True
        self.notifier.ready()
        self._watchdog = Watchdog(
            self.notifier, healthy=lambda: not self.needs_restart(), status=self.status_line
        )
        self._watchdog.start()
        log.info(
            "eventplane.ready",
            role=self.role,
            ingest=self.ingest.url,
            admin=self.admin.url,
            primary=self.standby.primary(),
            startup_s=round(time.monotonic() - t0, 3),
        )

    async def main_loop(self) -> None:
        failed = asyncio.ensure_future(self._wait_failed())
        try:
            while not self.should_exit:
                due = self.standby is not None and self.standby.takeover_due()
                if due and await self._take_over():
                    failed.cancel()
                    failed = asyncio.ensure_future(self._wait_failed())
                self._wakeup.clear()
                waiter = asyncio.ensure_future(self._wakeup.wait())
                done, _ = await asyncio.wait(
                    {failed, waiter}, timeout=TICK_S, return_when=asyncio.FIRST_COMPLETED
                )
                waiter.cancel()
                if failed in done:
                    # wait_failed() returns the fatal error (or raises its own).
                    exc = failed.exception() or failed.result()
                    log.error("component.failed", error=str(exc), kind=type(exc).__name__)
                    self.exit_code = EXIT_FAILED
                    self.should_exit = True
                    break
                self._publish_wal_gauges()
                self._check_retry_loop()
                if self.reload_requested:
                    self.reload_requested = False
                    await self._reload()
        finally:
            failed.cancel()

    async def _wait_failed(self) -> BaseException:
        if self.plane is not None:
            return await self.plane.wait_failed()
        exc: BaseException = await self.standby.wait_failed()
        return exc

    async def _take_over(self) -> bool:
        """The primary stopped renewing the archive's manifest: restore the archive
        into this data_dir and become its primary (docs/operating.md, "A standby").
        True once this daemon is the primary.

        1. Read the manifest again: a renewal since the last read keeps us a standby.
        2. A last poll of the archive into the copy in ``follow/``.
        3. The restore (daemon/restore.py) from that copy: the next epoch and its
           fences (the old primary's next upload fails), the watermarks from the
           S3 tables. Refused (the old primary renewed first, a damaged object)
           or failed (the store failing again part-way): this daemon stays a
           standby, health says why, and the next tick tries again.
        4. The standby's listeners, watch and copy stop; the primary's start runs
           (``startup``): the WAL, the archive (its released manifest taken at
           once), the plane, Spark, the listeners.
        """
        from daemon.restore import RestoreRefused, restore

        cfg = self.cfg
        watch, follower = self.standby, self.follower
        t0 = time.monotonic()
        # Step 1. A fresh read of the manifest
        await asyncio.to_thread(watch.read)
        if not watch.takeover_due():
            return False
        manifest = watch.manifest or {}
        log.warning(
            "standby.takeover",
            holder=manifest.get("holder"),
            epoch=manifest.get("epoch"),
            renewed_s_ago=round(wall_clock() - float(manifest.get("renewed_at", 0)), 1),
        )
        # Step 2. The last poll
        await follower.stop()
        follower.wal_id = manifest.get("wal_id")
        await asyncio.to_thread(follower.poll_logged)
        # Step 3. The restore
        try:
            summary = await asyncio.to_thread(restore, cfg, fetch=follower.fetch)
        except Exception as exc:
            # Refused (the old primary renewed first, a damaged object), or the
            # store failing again part-way (a store just back may read before it
            # writes): nothing of the restore stays, so the next tick tries again.
            why = str(exc) if isinstance(exc, RestoreRefused) else f"{type(exc).__name__}: {exc}"
            if self.takeover_error != why:
                event = "refused" if isinstance(exc, RestoreRefused) else "failed"
                log.error(f"standby.takeover_{event}", error=why, retry_s=TICK_S)
            self.takeover_error = why
            follower.start()
            return False
        self.takeover_error = None
        log.info(
            "standby.restored",
            first_lsn=summary.first_lsn,
            last_lsn=summary.last_lsn,
            objects=summary.objects,
            from_copy=len(follower.cached),
            bytes=summary.bytes,
            epoch=summary.epoch,
            lost_from=summary.lost[0] if summary.lost else None,
            seconds=round(summary.seconds, 3),
        )
        # Step 4. Standby parts stop; the primary starts
        if self._watchdog is not None:
            await self._watchdog.stop()
            self._watchdog = None
        if self.ingest is not None:
            self.ingest.begin_drain()
            self.ingest.hurry()
            await self.ingest.stop(0.0)
        if self.admin is not None:
            await self.admin.stop(0.0)
        await watch.stop()
        follower.drop()
        self.standby = self.follower = self.ingest = self.admin = None
        self.role = "primary"
        self.took_over = True
        self.started = False
        self.metrics.standby_takeovers.inc()
        try:
            await self.startup()
        except Exception as exc:
            # Restored, not started (the old primary took the manifest back in
            # between, a bad listener file): exit; a restart starts as the primary
            # of this data_dir, or says who holds the archive.
            self.exit_code = EXIT_CONFIG if isinstance(exc, ConfigError) else EXIT_FAILED
            log_startup_failure(self.startup_step, exc, self.exit_code)
            self.should_exit = True
            return False
        log.warning(
            "standby.took_over",
            epoch=self.archive.epoch if self.archive is not None else None,
            head_lsn=self.wal.head_lsn() if self.wal is not None else None,
            seconds=round(time.monotonic() - t0, 3),
        )
        return True

    async def shutdown(self, deadline: Deadline) -> None:
        self.notifier.stopping()
        log.info("shutdown.begin", budget_s=deadline.budget, force=self.force_exit)
        if self._watchdog is not None:
            await self._stop_step("watchdog", self._watchdog.stop(), deadline)
        # Step 1. Stop taking events; in-flight requests finish and get their acks.
        if self.ingest is not None:
            self.ingest.begin_drain()
            await self._stop_step("ingest", self.ingest.stop(deadline.remaining()), deadline)
        # Step 2. Let the running micro-batch commit, flush watermarks.
        if self.plane is not None:
            budget = 0.0 if self.force_exit else deadline.remaining()
            await self._stop_step("plane", self.plane.stop(budget), deadline)
        for task in self._background:
            task.cancel()
        if self.triggers is not None:
            await self._stop_step("triggers", self.triggers.stop(deadline.remaining(0.1)), deadline)
        if self.executor is not None:
            await self._stop_step("executor", self.executor.stop(), deadline)
        if self.admin is not None:
            await self._stop_step("admin", self.admin.stop(deadline.remaining()), deadline)
        if self.standby is not None:
            await self._stop_step("standby", self.standby.stop(), deadline)
        if self.follower is not None:
            await self._stop_step("follow", self.follower.stop(), deadline)
        if self.archive is not None:
            await self._stop_step("archive", self.archive.stop(deadline.remaining(0.1)), deadline)
        # Step 3. Final group commit and close.
        if self.wal is not None:
            await self._stop_step("wal", self.wal.aclose(), deadline, floor=1.0)
        log.info("shutdown.done", exit_code=self.exit_code, left_s=round(deadline.remaining(), 3))

    async def _stop_step(
        self, name: str, step: Awaitable[Any], deadline: Deadline, floor: float = 0.1
    ) -> None:
        """Run one stop step within the budget; log (never swallow silently) its failure."""
        try:
            await asyncio.wait_for(
                asyncio.shield(asyncio.ensure_future(step)), timeout=deadline.remaining(floor)
            )
        except TimeoutError:
            log.error("shutdown.step_timeout", step=name)
            self.exit_code = self.exit_code or EXIT_FAILED
        except Exception:
            log.exception("shutdown.step_failed", step=name)
            self.exit_code = self.exit_code or EXIT_FAILED

    # -- wiring helpers -----------------------------------------------------

    def _build_executor(self) -> Executor:
        """Spark when there is work for it (CDC streams, mirrors, handlers or triggers).

        Without triggers at start no trigger stage is plugged in (an idle one
        would still make the executor cache each batch for a second reader); a
        SIGHUP that adds the first triggers plugs one in (``_add_trigger_stage``).
        """
        cfg = self.cfg
        stages: list[BatchStage] = []
        if cfg.triggers:
            from daemon.service.triggers import build_trigger_stage

            self.triggers = build_trigger_stage(cfg, lambda: self.wal, self.metrics)
            stages.append(self.triggers)
        if not (cfg.cdc.streams or cfg.cdc.mirrors or cfg.cdc.handlers or stages):
            return NullExecutor()
        if not (cfg.cdc.streams or cfg.cdc.handlers or stages):
            # Mirrors only: they need no Spark (daemon/spark/mirrors.py).
            from daemon.spark.mirrors import MirrorExecutor

            wal = self.wal.wal_id if self.wal is not None else ""
            return MirrorExecutor(cfg, self.metrics, wal_id=wal)
        from daemon.spark import session as sparkmod
        from daemon.spark.executor import SparkExecutor, uses_delta

        # The WAL id goes into every CDC ledger: a table of another WAL refuses to start.
        wal_id = self.wal.wal_id if self.wal is not None else ""
        s = cfg.spark
        # The JVM logs in the daemon's format (JSON lines under systemd).
        factory = functools.partial(
            sparkmod.build_session,
            s.master,
            s.app_name,
            s.ui,
            s.log_level,
            s.conf,
            s.remote,
            log_format=logs.current_format(),
            # The driver JVM's class data sharing archive (session.class_sharing).
            cds_dir=cfg.data_dir / "spark-cds" if s.class_sharing and not s.remote else None,
            delta=uses_delta(cfg),
        )
        return SparkExecutor(cfg, self.metrics, stages, wal_id=wal_id, session_factory=factory)

    async def _archive_backlog(self) -> None:
        """Wait until the archive holds this WAL's head (an outage: until it is back)."""
        from daemon.errors import ArchiveUnavailable

        while not self.should_exit:
            try:
                await self.archive.until_archived(self.wal.head_lsn() if self.wal else 0)
                return
            except ArchiveUnavailable as exc:
                if exc.fenced:
                    raise
                log.warning("archive.backlog_waits", error=str(exc))
                await asyncio.sleep(1.0)

    def _check_retry_loop(self) -> None:
        """The trigger retry loop gives up after repeated failures: fail-stop then."""
        task = getattr(self.triggers, "retry_task", None)
        if task is not None and task.done() and not task.cancelled() and task.exception():
            self.fail(f"trigger retry loop stopped: {task.exception()}")

    def _publish_wal_gauges(self) -> None:
        if self.wal is not None:
            self.metrics.wal_head_lsn.set(self.wal.head_lsn())
            self.metrics.wal_floor_lsn.set(self.wal.retained_floor())
            self.metrics.wal_segments.set(self.wal.segment_count())
            lost = self.wal.lost_ranges()
            self.metrics.wal_lost_lsns.set(sum(b - a + 1 for a, b in lost))
        if self.archive is not None:
            self.archive.publish()

    def _observe_group(self, events: int, nbytes: int, fsync_s: float) -> None:
        # Runs on the WAL writer thread: prometheus_client metrics are thread-safe.
        m = self.metrics
        m.wal_appends.inc(events)
        m.wal_bytes.inc(nbytes)
        m.wal_groups.inc()
        m.wal_fsync_latency.observe(fsync_s)

    async def _reload(self) -> None:
        from daemon import config as configmod

        log.info("reload.begin", source=str(self.cfg.source))
        self.notifier.reloading()
        try:
            await self._apply_reload(configmod)
        finally:
            self.notifier.ready()

    async def _apply_reload(self, configmod: Any) -> None:
        """Apply ``[[triggers]]``, ``[log] level`` and the listeners' secrets from the
        file, or none of them.

        1. Load and validate the whole file, read the tokens file and build both
           listeners' TLS contexts; any problem changes nothing.
        2. Triggers: the engine checks the new set with Spark and swaps it in
           between batches, or keeps the old set; a daemon that started
           without triggers but with Spark gets a trigger stage now. Without
           Spark at all (no streams, handlers or triggers at start) triggers
           cannot run until a restart starts it: said, and not applied.
        3. The secrets: producer tokens, the admin token, the TLS contexts of new
           handshakes (open connections keep theirs); the log level; then
           ``reload.done`` with what changed.
        """
        from daemon.service.triggers import trigger_changes

        # Step 1. Load the whole file, and the secrets it names
        try:
            new = await asyncio.to_thread(configmod.load, self.cfg.source)
            tokens = await asyncio.to_thread(security.load_tokens, new.ingest)
            tls_swaps = await asyncio.to_thread(self._tls_swaps, new)
        except DaemonError as exc:
            log.error("reload.rejected", error=str(exc))
            return
        # Step 2. Triggers
        names = [t.name for t in new.triggers]
        not_applied: list[str] = []
        before: dict[str, Any] = dict(self.triggers.triggers) if self.triggers is not None else {}
        if self.triggers is not None:
            errors = await self.triggers.reload_specs(new.triggers)
        elif new.triggers and not hasattr(self.executor, "add_stage"):
            errors = []
            not_applied = names
            log.error(
                "reload.triggers_need_restart",
                triggers=names,
                message="the daemon started without Spark (no [[cdc.streams]], "
                "[[cdc.handlers]] or [[triggers]]; mirrors need none), and triggers run "
                "inside Spark micro-batches: restart the daemon to start Spark and apply them",
            )
        elif new.triggers:
            errors = await self._add_trigger_stage(new)
        else:
            errors = []
        if errors:
            log.error("reload.triggers_rejected", errors=errors)
            return
        after: dict[str, Any] = dict(self.triggers.triggers) if self.triggers is not None else {}
        if not not_applied:
            self.metrics.init_triggers(names)
        # Step 3. Secrets, the log level; what changed
        for swap in tls_swaps:
            swap()
        if self.ingest is not None:
            self.ingest.set_tokens(tokens)
        if self.admin is not None:
            self.admin.set_access(new.admin)
        logs.set_level(new.log.level)
        done: dict[str, Any] = {
            f"triggers_{what}": which for what, which in trigger_changes(before, after).items()
        }
        if not_applied:
            done.update(triggers_not_applied=not_applied, restart_needed=True)
        log.info(
            "reload.done",
            log_level=new.log.level,
            producers=len(tokens),
            tls_reloaded=len(tls_swaps),
            **done,
        )

    def _tls_swaps(self, new: Config) -> list[Callable[[], None]]:
        """Step 1 of a reload for TLS: a new context per TLS listener, built now (its
        files read and checked); applying one is the returned call. A listener
        that starts or stops speaking TLS needs a restart: a ConfigError."""
        swaps: list[Callable[[], None]] = []
        for section, listener, tls in (
            ("ingest", self.ingest, new.ingest.tls),
            ("admin", self.admin, new.admin.tls),
        ):
            if listener is None:
                continue
            current = listener.tls
            if (current is None) != (not tls.enabled):
                raise ConfigError(
                    [f"{section}.tls_cert: turning TLS on or off needs a restart"], section
                )
            if current is not None:
                swaps.append(current.prepare(tls))
        return swaps

    async def _add_trigger_stage(self, new: Config) -> list[str]:
        """The first triggers of a daemon that started without any: a started,
        checked engine becomes a stage of the Spark executor's next batches.

        With Spark up, Spark analyses the set now (errors reject it); before
        that, the engine analyses it before its first batch.
        """
        from daemon.service.triggers import build_trigger_stage
        from triggers.spec import compile_specs

        # Only the trigger set is new: data_dir and the rest need a restart anyway.
        engine = build_trigger_stage(self.cfg, lambda: self.wal, self.metrics, new.triggers)
        executor: Any = self.executor
        _, errors = compile_specs(new.triggers)
        if not errors and executor.ready():
            errors = await asyncio.to_thread(engine.validate, executor.session)
        if errors:
            return errors
        await engine.start()
        self.triggers = engine
        executor.add_stage(engine)
        log.info("reload.trigger_stage_added", triggers=sorted(engine.triggers))
        return []

    # -- health and status --------------------------------------------------

    def ready(self) -> bool:
        """Started, not draining, and a primary: a standby takes no events."""
        return self.started and not self.should_exit and self.standby is None

    def healthy(self) -> bool:
        """True once started, while nothing is stalled or failed (``problems``)."""
        return self.started and not self.problems()

    def needs_restart(self) -> bool:
        """True when only a restart can cure the daemon: a component failed
        (fail-stop), or the Spark session cannot be rebuilt. The watchdog is
        withheld then, so systemd restarts the service (invariant 14)."""
        if not self.started:
            return False
        if self.standby is not None:
            return self.exit_code != EXIT_OK
        if self.exit_code != EXIT_OK or self.plane is None or self.plane.failure is not None:
            return True
        check = getattr(self.executor, "needs_restart", None)
        return bool(check()) if callable(check) else False

    def notices(self) -> list[dict[str, Any]]:
        """What health names while the daemon stays healthy: CDC streams and
        mirrors that hold rows in their quarantine (docs/cdc.md, "Quarantine",
        "Mirror tables")."""
        status = getattr(self.executor, "status", None)
        if not callable(status):
            return []
        out = []
        doc = status()
        for name, mirror in (doc.get("mirrors") or {}).items():
            held = mirror.get("quarantined") or 0
            if held:
                from daemon.spark.mirrors import quarantine_notice

                out.append(
                    {
                        "part": f"mirror {name}",
                        "quarantined": held,
                        "message": quarantine_notice(name, held),
                    }
                )
        for name, stream in (doc.get("streams") or {}).items():
            held = stream.get("quarantined") or 0
            if held:
                out.append(
                    {
                        "part": f"stream {name}",
                        "quarantined": held,
                        "message": f"stream {name} holds {held} row(s) it could not write in "
                        f"its quarantine: eventplane cdc quarantine list {name}",
                    }
                )
        return out

    def problems(self) -> list[dict[str, Any]]:
        """What makes the daemon unhealthy, one entry per stalled part (empty: healthy).

        A part is stalled when it has failed, or been held, for longer than
        ``health.stall_after_s`` without a commit in between: a stage (a CDC
        stream, the triggers, a handler) failing on its own, or the
        micro-batch path as a whole (Spark down, every stage failing). A
        paused stage is not a problem until its backlog passes
        ``health.paused_max_lag_events``. Two are problems at once: a stage
        whose attempt has run longer than ``health.attempt_slow_s`` (slow:
        the problem says what it waits for), and a stage stopped by an error
        that retrying cannot cure.
        """
        out: list[dict[str, Any]] = []
        plane = self.plane
        failure = plane.failure if plane is not None else None
        if failure is not None or self.exit_code != EXIT_OK:
            return [{"part": "daemon", "message": f"a component failed: {failure or 'see log'}"}]
        full = self.ingest.wal_full if self.ingest is not None else None
        if full is not None and not self._wal_has_room(full[1]):
            since, _, full_error = full
            out.append(
                {
                    "part": "wal",
                    "since": since,
                    "error": full_error,
                    "message": f"the WAL volume is full: ingest answers 507 "
                    f"(for {time.time() - since:.0f} s): {full_error}",
                }
            )
        archive = self.archive.problem(self.cfg.health.stall_after_s) if self.archive else None
        if self.standby is not None:
            limit = self.cfg.health.stall_after_s
            archive = self.standby.problem(limit) or (
                self.follower.problem(limit) if self.follower is not None else None
            )
            if self.takeover_error is not None:
                archive = f"the standby cannot take over: {self.takeover_error}"
        if archive is not None:
            out.append({"part": "wal archive", "message": archive})
        planner = plane.planner if plane is not None else None
        if planner is None:
            return out
        limit = self.cfg.health.stall_after_s
        blocked = planner.blocked_for_s()
        if blocked > limit:
            last = planner.last_batch or {}
            spark = getattr(self.executor, "status", None)
            error = last.get("error") or (spark().get("session_error") if callable(spark) else None)
            state = last.get("state") or "held"
            out.append(
                {
                    "part": "microbatch",
                    "stalled_for_s": round(blocked, 3),
                    "error": error,
                    "message": f"micro-batches have not committed for {blocked:.0f} s "
                    f"(batch {last.get('batch_id')} {state}; limit {limit:g} s)"
                    + (f": {error}" if error else ""),
                }
            )
        looping = getattr(self.triggers, "loop_failing", None)
        if looping is not None and time.monotonic() - looping[0] > limit:
            failing_for = time.monotonic() - looping[0]
            out.append(
                {
                    "part": "trigger retry queue",
                    "stalled_for_s": round(failing_for, 3),
                    "error": looping[1],
                    "message": f"the trigger retry queue has failed for {failing_for:.0f} s "
                    f"(limit {limit:g} s); queued actions wait: {looping[1]}",
                }
            )
        for stage in planner.stages.report(planner.live_id):
            if stage["stopped"]:
                out.append(
                    {
                        "part": f"stage {stage['name']}",
                        "stage": stage["name"],
                        "stopped": True,
                        "error_class": stage["stopped_by"],
                        "since": stage["failing_since"],
                        "behind_batches": stage["behind_batches"],
                        "error": stage["last_error"],
                        "message": stopped_message(
                            stage["name"], stage["stopped_by"], stage["last_error"]
                        ),
                    }
                )
            elif stage["slow"]:
                out.append(slow_problem(stage, self.cfg.health.attempt_slow_s))
            elif stage["stalled"]:
                out.append(
                    {
                        "part": f"stage {stage['name']}",
                        "stage": stage["name"],
                        "stalled_for_s": stage["failing_for_s"],
                        "since": stage["failing_since"],
                        "behind_batches": stage["behind_batches"],
                        "error": stage["last_error"],
                        "message": f"stage {stage['name']} has failed for "
                        f"{stage['failing_for_s']:.0f} s and is {stage['behind_batches']} "
                        f"batch(es) behind (limit {limit:g} s): {stage['last_error']}",
                    }
                )
            elif stage["paused_over_limit"]:
                out.append(paused_problem(stage, self.cfg.health.paused_max_lag_events))
        out.extend(self._paused_trigger_problems())
        return out

    def _paused_trigger_problems(self) -> list[dict[str, Any]]:
        """A paused trigger whose queued rows passed ``health.paused_max_lag_events``."""
        limit = self.cfg.health.paused_max_lag_events
        engine = self.triggers
        if not limit or engine is None:
            return []
        out = []
        for name, entry in engine.status()["triggers"]["paused"].items():
            if entry["queued_rows"] > limit:
                out.append(
                    {
                        "part": f"trigger {name}",
                        "stage": entry["name"],
                        "paused": True,
                        "since": entry["paused_since"],
                        "queued_rows": entry["queued_rows"],
                        "message": f"trigger {name} is paused and holds {entry['queued_rows']} "
                        f"queued rows, over health.paused_max_lag_events ({limit}); nothing "
                        f"is lost, but the trigger store grows: resume it (eventplane resume "
                        f"{entry['name']}), or raise the limit",
                    }
                )
        return out

    def _wal_has_room(self, needed: int) -> bool:
        """Space came back on the WAL's volume for the append that was refused
        (the next request clears the state; health should not wait for it)."""
        try:
            st = os.statvfs(self.cfg.wal_dir)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize > needed

    def status(self) -> dict[str, Any]:
        wal = self.wal
        problems = self.problems()
        out: dict[str, Any] = {
            "healthy": self.started and not problems,
            "problems": problems,
            "needs_restart": self.needs_restart(),
            "ready": self.ready(),
            "draining": self.should_exit,
            "role": self.role,
            "wal": None
            if wal is None
            else {
                "head_lsn": wal.head_lsn(),
                "retained_floor": wal.retained_floor(),
                "segments": wal.segment_count(),
                "idempotency_keys": wal.request_keys(),
                "lost": [list(r) for r in wal.lost_ranges()],
            },
        }
        if self.archive is not None and out["wal"] is not None:
            out["wal"]["archive"] = self.archive.status()
        if self.standby is not None:
            out["standby"] = self.standby.status()
            if self.follower is not None:
                out["standby"]["follow"] = self.follower.status()
            out["standby"]["takeover_error"] = self.takeover_error
        out["took_over"] = self.took_over
        if self.plane is not None:
            out.update(self.plane.status())
        executor_status = getattr(self.executor, "status", None)
        out["spark"] = (
            executor_status()
            if callable(executor_status)
            else {"ready": self.executor.ready() if self.executor else False, "last_error": None}
        )
        trig_status = getattr(self.triggers, "status", None)
        if callable(trig_status):
            out.update(trig_status())
        else:
            out.setdefault("dlq", {"entries": 0})
            out.setdefault("retry_queue", {"depth": 0})
        return out

    def status_line(self) -> str:
        if self.standby is not None:
            return f"standby primary={self.standby.primary() or '-'}"
        if self.plane is None or self.wal is None:
            return "starting"
        st = self.plane.status()
        modes = "".join("N" if c["mode"] == "normal" else "C" for c in st.get("cores", []))
        return f"head={self.wal.head_lsn()} modes={modes} max_lag={self.plane.max_lag()}"


class _NoWal:
    """A standby's ingest has no WAL: its gate answers every request first."""

    async def append(self, items: Any, request: Any = None) -> tuple[int, int]:
        raise WalClosedError("a standby has no WAL: it acknowledges nothing")

    def find_request(self, key: bytes) -> None:
        return None


# Ingest and the WAL allocate a few short-lived tuples per event. At CPython's
# default gen0 threshold (700) that is a collection every few hundred events,
# and each older-generation pass re-walks everything start-up built (modules,
# config, metrics). Freezing start-up's objects and collecting less often
# lifted the whole daemon from ~170k to ~230k events/s in
# `python -m bench.bench_ingest --peers daemon`; garbage cycles wait a little
# longer (at most GC_THRESHOLDS[0] new objects).
GC_THRESHOLDS = (50_000, 20, 100)


def tune_gc() -> None:
    """Move what start-up allocated out of the collector's way; collect less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


# glibc gives each thread that allocates its own malloc arena (up to 8 per
# core). Pending slices are allocated by the WAL replay threads (CatchUp) or
# the event loop (Normal) and freed by the loop when their batch commits, and
# the space one arena frees never serves an allocation in another: under
# overload each arena grew towards the whole slice budget (bench_overload:
# 190-240 MiB of free heap spread over the arenas after a minute, anonymous
# RSS 1.45x the budgets; with one arena, 0.84x). Almost every allocation
# happens under the GIL, so one arena costs no contention.
MALLOC_ARENAS = 1
_M_ARENA_MAX = -8  # <malloc.h>
# Arrow's buffers come from its bundled mimalloc, which keeps freed pages
# resident for a while before it purges them: writing a batch's inbox file
# peaked at 86 MiB resident for 26 MiB live; purging at once, 41 MiB, at the
# same speed. mimalloc reads the option when pyarrow is first imported.
MIMALLOC_PURGE_DELAY_MS = "0"


def tune_malloc() -> None:
    """One glibc arena (``MALLOC_ARENAS``); Arrow's mimalloc purges freed pages
    at once (``MIMALLOC_PURGE_DELAY_MS``). The operator's environment wins."""
    os.environ.setdefault("MIMALLOC_PURGE_DELAY", MIMALLOC_PURGE_DELAY_MS)
    if os.environ.get("MALLOC_ARENA_MAX"):
        return
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:  # glibc and musl have it; musl ignores the call
        mallopt(_M_ARENA_MAX, MALLOC_ARENAS)


# What to do about a start-up failure, by errno (the step names the path or address).
_ERRNO_HINTS = {
    errno.EADDRINUSE: "another process listens on that address: stop it or change the "
    "address in the config (`ss -ltnp` shows who holds it)",
    errno.EADDRNOTAVAIL: "no interface of this host has that address: change it in the config",
    errno.EACCES: "the daemon's user may not use it: check the owner and mode (`ls -ld`), "
    "under systemd ReadWritePaths=, or use a port >= 1024",
    errno.EPERM: "the daemon's user may not use it: check the owner and mode (`ls -ld`) "
    "and, under systemd, ReadWritePaths=",
    errno.EROFS: "the file system is read-only there: under systemd add the path to "
    "ReadWritePaths=, or point the config at a writable one",
    errno.ENOSPC: "the disk is full: free space, then start again",
    errno.EEXIST: "a file is where a directory should be: move it or change the path",
    errno.ENOTDIR: "a file is where a directory should be: move it or change the path",
}


def startup_hint(exc: BaseException) -> str:
    """One sentence on what to do about ``exc`` (docs/operating.md, Troubleshooting)."""
    if isinstance(exc, ConfigError):
        return "fix the configuration (`eventplane check-config --config PATH` lists every error)"
    if isinstance(exc, OSError) and exc.errno in _ERRNO_HINTS:
        return _ERRNO_HINTS[exc.errno]
    if isinstance(exc, DaemonError):
        return "see docs/operating.md, Troubleshooting, for this error"
    if isinstance(exc, OSError):
        return "check what the step names: that it exists, its type and its permissions"
    return "unexpected: the exception field has the traceback; please report it"


def log_startup_failure(step: str, exc: BaseException, exit_code: int) -> None:
    """One ``startup.failed`` event: what failed, where, what to do, the exit code.

    Expected failures (configuration, OS errors, the daemon's own errors) carry
    their message only; anything else also its traceback, as one field.
    """
    if isinstance(exc, ConfigError):
        error = "; ".join(exc.errors)
    else:
        error = f"{type(exc).__name__}: {exc}"
    hint = startup_hint(exc)
    expected = isinstance(exc, DaemonError | OSError)
    log.error(
        "startup.failed",
        step=step,
        error=error,
        hint=hint,
        exit_code=exit_code,
        message=f"start-up failed at {step}: {error.splitlines()[0]}; {hint}",
        exc_info=None if expected else exc,
    )


def run(cfg: Config, daemon_factory: Callable[[Config], Daemon] = Daemon) -> int:
    """Run the daemon until a signal; returns the process exit code."""
    tune_malloc()  # before any thread allocates
    logs.configure(cfg.log.level, cfg.log.format)
    logs.install_hooks()  # uncaught exceptions and warnings: one event each
    structlog.contextvars.bind_contextvars(pid=os.getpid())

    async def main() -> int:
        asyncio.get_running_loop().set_exception_handler(logs.loop_exception_handler)
        tune_gc()
        daemon = daemon_factory(cfg)
        daemon.install_signal_handlers()
        return await daemon.serve()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        try:
            code = runner.run(main())
        except Exception as exc:
            # serve() returns a code for start-up failures; this is past them.
            log.error(
                "eventplane.failed",
                error=f"{type(exc).__name__}: {exc}",
                exit_code=EXIT_FAILED,
                exc_info=None if isinstance(exc, DaemonError) else exc,
            )
            code = EXIT_FAILED
    _exit_past_stragglers(code)
    return code


def _exit_past_stragglers(code: int) -> None:
    """Exit now if a worker thread outlived the drain (a SIGTERM while the JVM
    starts: its thread would hold the interpreter's exit for as long as the
    start takes). Everything durable is closed by now; the JVM exits when its
    stdin closes with this process."""
    left = [
        t.name
        for t in threading.enumerate()
        if t is not threading.main_thread() and t.is_alive() and not t.daemon
    ]
    if not left:
        return
    log.warning("shutdown.threads_left", threads=left, exit_code=code)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
