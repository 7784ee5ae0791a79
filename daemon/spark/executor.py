"""The Spark executor: one planned micro-batch -> one DataFrame -> every consumer.

``SparkExecutor`` implements ``daemon.plane.batch.Executor``. ``start()`` checks
the configuration (handlers, stream paths, ledgers; raises ``ConfigError``) and
builds the SparkSession in the background (:mod:`daemon.spark.lifecycle`).
``execute(batch)`` runs all py4j work in one worker thread; per batch:

1. the slices' rows go into an inbox file (raw, or Parquet when the jar is
   missing; done ahead by ``prepare`` for a batch the planner closed early),
   or one Arrow table for non-local masters;
2. -> DataFrame (:mod:`daemon.spark.frame`), built only when something reads it;
3. each ``BatchStage.run_in_spark`` (triggers); its ``finish`` starts at once;
4. meanwhile each CDC stream commits its rows exactly once (``daemon.table``),
   then each mirror merges its collection's (``daemon.spark.mirrors``);
5. each ``[[cdc.handlers]]`` function gets ``(df, batch_id)``.

Steps 3-5 are stages (``stage_names()``); a failed stage does not stop the
others (invariant 6), a failure of steps 1-2 fails the batch. Each stream's
commit and each mirror's merge runs in the stage's own thread (its lane,
:mod:`daemon.spark.lanes`), and the batch waits for it at most half of
``health.attempt_slow_s`` (a failing stage: not at all); one still running
then is handed back as ``InFlight`` and lands later, so a stream or a mirror
hung on its store holds back only itself. A lost session
is rebuilt (:mod:`daemon.spark.lifecycle`); retention and quarantine actions
run beside the batches (:mod:`daemon.spark.maintenance`), compaction in its
own thread (``daemon.table.compact``). The why: docs/cdc.md, "The executor".
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import importlib
import shutil
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from daemon.config import Config
from daemon.errors import (
    ConfigError,
    DaemonError,
    ExecutorError,
    error_text,
)
from daemon.metrics import Metrics
from daemon.plane.batch import BatchStage, Held, InFlight, MicroBatch
from daemon.spark import deltajars, frame, rawinbox
from daemon.spark import session as sparkmod
from daemon.spark.lanes import Lanes, hand_back, outlives
from daemon.spark.lifecycle import SessionLife, State, _Status
from daemon.spark.maintenance import StreamMaintenance
from daemon.spark.mirrors import (
    Coalesced,
    MirrorQuarantine,
    close_mirrors,
    coalesce_due_s,
    coalescers,
    commit_mirrors,
    flush_at_stop,
    flush_mirrors,
    mirror_stage,
    mirrors_status,
    open_mirrors,
)
from daemon.table import sparkio
from daemon.table.compact import CompactionService
from daemon.table.crash import crash_point
from daemon.table.delta import sink_class
from daemon.table.layout import CDC_COLUMNS
from daemon.table.mirror import MirrorTable
from daemon.table.parquet import CdcSink
from daemon.table.sink import CommitResult

log = structlog.get_logger("eventplane.spark")

Handler = Callable[[Any, int], Any]

# ``prepare_seconds``: a preparation of fewer rows than this is mostly fixed
# cost and says little about the rate; each new rate moves the estimate by
# this share (an exponentially weighted mean over the last few batches).
PREP_SAMPLE_MIN_ROWS = 1000
PREP_EWMA = 0.3


def uses_inbox(cfg: Config) -> bool:
    """Local masters read the driver's files; remote ones may not share its disk."""
    return not cfg.spark.remote and cfg.spark.master.startswith("local")


def delta_needs(cfg: Config) -> dict[str, str]:
    """The streams that need Delta Lake's jars here, each with why: those
    Spark writes to (``deltajars.spark_append``); the direct write needs none."""
    return deltajars.needing(cfg, sparkmod.HADOOP_JAR.is_file())


def uses_delta(cfg: Config) -> bool:
    """The session loads Delta Lake: a stream needs its jars, and they are
    here (or Spark resolves them, or a Spark Connect server has its own)."""
    s = cfg.spark
    return bool(delta_needs(cfg)) and deltajars.unavailable(True, s.conf, s.remote) is None


class DeltaJarsMissingError(ExecutorError):
    """A stream needs Delta Lake's jars and they are not here: it fails alone
    (its every batch, until the jars are fetched and the daemon restarted)."""


def missing_parts(cfg: Config) -> list[dict[str, str]]:
    """The optional parts this daemon lacks, each with what it costs and the fix
    (the start-up log and ``/v1/status`` name them; ``eventplane setup`` adds them)."""
    parts = []
    # The daemon's jar counts only for a driver JVM the daemon starts.
    local = not cfg.spark.remote and cfg.spark.master.startswith("local")
    if local and not sparkmod.HADOOP_JAR.is_file():
        parts.append(
            {
                "part": "daemon jar",
                "path": str(sparkmod.HADOOP_JAR),
                "without": "each batch runs a Spark job, and no stream has a quarantine",
                "fix": "eventplane setup",
            }
        )
    needs = delta_needs(cfg)
    if needs and deltajars.unavailable(True, cfg.spark.conf, cfg.spark.remote) is not None:
        parts.append(
            {
                "part": "Delta Lake jars",
                "path": str(deltajars.JARS_DIR),
                "without": f"stream(s) {', '.join(sorted(needs))} fail at each batch",
                "fix": "eventplane setup --delta",
            }
        )
    return parts


def load_handler(ref: str) -> Handler:
    """Import ``"pkg.mod:func"``; raise ValueError with the reason."""
    module_name, _, func_name = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time error of user code is a config error
        raise ValueError(
            f"cannot import module {module_name!r} ({type(exc).__name__}: {exc})"
        ) from exc
    func = getattr(module, func_name, None)
    if func is None:
        raise ValueError(f"module {module_name!r} has no attribute {func_name!r}")
    if not callable(func):
        raise ValueError(f"{ref} is not callable")
    return func  # type: ignore[no-any-return]


# --------------------------------------------------------------------------


@dataclass(slots=True)
class _Outcome:
    rows: int
    commits: list[CommitResult]
    stage_results: list[tuple[BatchStage, Any]]
    spark_seconds: float
    failures: dict[str, BaseException] = field(default_factory=dict)
    ran: int = 0  # stages asked for that exist
    # Streams and mirrors whose commit or merge was still running when the
    # batch stopped waiting.
    in_flight: dict[str, InFlight] = field(default_factory=dict)
    # Mirrors that hold the batch for a coalesced merge (merge_interval_ms).
    held: dict[str, Held] = field(default_factory=dict)


def sink_stage(sink: CdcSink) -> str:
    """The stage name of a CDC stream."""
    return f"cdc:{sink.name}"


def handler_stage(ref: str) -> str:
    """The stage name of a ``[[cdc.handlers]]`` function."""
    return f"handler:{ref}"


class SparkExecutor(SessionLife, StreamMaintenance, MirrorQuarantine):
    """Runs micro-batches on Spark; see the module docstring for the flow."""

    def __init__(
        self,
        cfg: Config,
        metrics: Metrics,
        stages: Sequence[BatchStage] = (),
        *,
        wal_id: str = "",
        session: Any | None = None,
        session_factory: Callable[[], Any] | None = None,
        sleep: Callable[[float], Any] = asyncio.sleep,
    ) -> None:
        """``wal_id`` is written into (and checked against) every stream's ledger.

        ``session``: use this SparkSession and never stop it (tests share one).
        ``session_factory``: how to build one (default: ``build_session`` from
        ``cfg.spark``); it runs in the worker thread.
        """
        self.cfg = cfg
        self.metrics = metrics
        self.wal_id = wal_id
        self._stages: list[BatchStage] = list(stages)
        self._session = session
        self._owns_session = session is None
        self._factory = session_factory or self._default_factory
        self._sleep = sleep
        self._sinks: list[CdcSink] = []
        self._mirrors: list[MirrorTable] = []
        self._coalesced: dict[str, Coalesced] = {}  # mirrors' held batches, by stage
        # Each stream's and mirror's own thread, by stage name (daemon.spark.lanes).
        self._lanes = Lanes()
        self.compaction: CompactionService | None = None
        self._inbox: Path | None = cfg.data_dir / "spark-inbox" if uses_inbox(cfg) else None
        self._cores: int | None = None  # Spark's default parallelism, asked once
        # How the batches reach Spark, asked with _cores: "raw" (``rawinbox``),
        # "parquet (why not raw)" or "arrow" (no inbox: the table travels in
        # the call); None before the first batch. status() shows it.
        self._inbox_kind: str | None = None
        # How the CDC tables are written, decided with _inbox_kind: "direct"
        # (no Spark job, docs/cdc.md) or "spark job (why not direct)".
        self._cdc_write: str | None = None
        # What this process started without (start(): a part added later counts
        # only after a restart, so status reports the start's view, not the disk's).
        self._missing_parts: list[dict[str, str]] = []
        self._direct = False  # _cdc_write == "direct"
        # Streams that need Delta's jars, missing here: their error (start()).
        self._no_delta: dict[str, str] = {}
        self._built: Any | None = None  # what the factory returned, even if unused
        self._handlers: list[tuple[str, Handler]] = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eventplane-spark")
        # Builds the inbox file of the batch after the running one (``prepare``).
        self._prep_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eventplane-prep")
        self._prepared: dict[int, Future[frame.InboxFile]] = {}
        # The inbox files a run of a batch reads now: a retry of the batch
        # (another file of the same batch id) must not remove them while an
        # earlier run's commit still reads its file, nor the other way round.
        self._inbox_reading: set[Path] = set()
        self._inbox_lock = threading.Lock()
        # Seconds per row the recent preparations took (``prepare_seconds``).
        self._prep_s_per_row: float | None = None
        self._ready = asyncio.Event()
        self._lock = asyncio.Lock()
        self._boot_task: asyncio.Task[None] | None = None
        self._retention_task: asyncio.Task[None] | None = None
        # Per stream with retention: last run, partitions removed, oldest kept.
        self._retention: dict[str, dict[str, Any]] = {}
        self._retention_lock = asyncio.Lock()  # one run at a time (loop or on demand)
        self._status = _Status()

    # -- wiring ------------------------------------------------------------

    def add_stage(self, stage: BatchStage) -> None:
        """Plug a consumer of each batch's DataFrame in (triggers). Runs in order added."""
        self._stages.append(stage)

    @property
    def session(self) -> Any | None:
        return self._session

    def archive_floor(self) -> int | None:
        """The lowest LSN - 1 the WAL archive keeps for a stage after its batch
        committed (the trigger retry queue's rows, invariant 9); None: none."""
        floors = [
            floor
            for st in self._stages
            if callable(fn := getattr(st, "archive_floor", None)) and (floor := fn()) is not None
        ]
        return min(floors) if floors else None

    @property
    def sinks(self) -> Sequence[CdcSink]:
        return tuple(self._sinks)

    def stage_names(self) -> list[str]:
        """Every stage of a batch, in the order they run (``daemon.plane.stages``)."""
        return [
            *(st.name for st in self._stages),
            *(sink_stage(s) for s in self._sinks),
            *(mirror_stage(m) for m in self._mirrors),
            *(handler_stage(ref) for ref, _ in self._handlers),
        ]

    def _sink_of(self, stage: str) -> CdcSink | None:
        return next((s for s in self._sinks if sink_stage(s) == stage), None)

    def stream_start(self, stage: str) -> str | int | None:
        """Where the CDC stream of ``stage`` starts when new ([[cdc.streams]] start);
        None when ``stage`` is not a stream (``Planner.prepare_backfills``)."""
        sink = self._sink_of(stage)
        return None if sink is None else sink.stream.start

    def stream_position(self, stage: str) -> tuple[int, dict[int, int]]:
        """The stream's ledger: its last committed batch id, and per core the
        last committed LSN (where a backfill goes on after a restart)."""
        sink = self._sink_of(stage)
        if sink is None:
            raise ExecutorError(f"no CDC stream for stage {stage!r}")
        ledger = sink.ledger
        return ledger.last_batch_id, dict(ledger.high_lsn)

    def _default_factory(self) -> Any:
        s = self.cfg.spark
        return sparkmod.build_session(
            s.master, s.app_name, s.ui, s.log_level, s.conf, s.remote, delta=uses_delta(self.cfg)
        )

    # -- Executor protocol -------------------------------------------------

    async def start(self) -> None:
        """Check configuration now (raises ConfigError); build Spark in the background."""
        self._handlers = self._load_handlers()
        self._check_stream_paths()
        self._missing_parts = missing_parts(self.cfg)
        for part in self._missing_parts:
            log.warning(
                "optional_part_missing",
                message=f"{part['part']} {part['path']} is missing: {part['without']}; "
                f"`{part['fix']}` adds it",
                **part,
            )
        self._no_delta = self._streams_without_delta()
        if self._inbox is not None:
            # Batch files of a previous process: their batches re-run from the plan.
            shutil.rmtree(self._inbox, ignore_errors=True)
            try:
                self._inbox.mkdir(parents=True)
            except OSError as exc:
                raise ConfigError(
                    [f"daemon.data_dir: cannot create {self._inbox} ({exc.strerror})"]
                ) from exc
        loop = asyncio.get_running_loop()
        self._sinks = await loop.run_in_executor(self._pool, self._open_sinks)
        try:
            self._mirrors = await loop.run_in_executor(
                self._pool, open_mirrors, self.cfg, self.wal_id, self.metrics
            )
            self._coalesced = coalescers(self._mirrors)
        except BaseException:
            await loop.run_in_executor(self._pool, self._close_in_thread)
            raise
        for sink in self._sinks:
            self._status.streams[sink.name] = sink.last_batch_id
        if any(s.stream.retention_s is not None for s in self._sinks):
            self._retention_task = asyncio.create_task(self._retention_loop(), name="cdc-retention")
        self.compaction = CompactionService(
            self._sinks, lambda: self._session if self.ready() else None, self.metrics
        )
        self.compaction.start()
        if self._session is not None:
            await loop.run_in_executor(self._pool, self._adopt, self._session)
            self._mark_ready()
        else:
            self._boot_task = asyncio.create_task(self._boot(), name="spark-session-boot")

    def _streams_without_delta(self) -> dict[str, str]:
        """The streams that need Delta's jars when they are missing, each with
        the error its batches fail with: those streams fail alone."""
        s = self.cfg.spark
        missing = deltajars.unavailable(True, s.conf, s.remote)
        if missing is None:
            return {}
        out = {
            name: f"stream {name!r} needs Delta Lake's jars ({why}). {missing}"
            for name, why in delta_needs(self.cfg).items()
        }
        for name, message in out.items():
            log.error("cdc_stream_needs_delta_jars", stream=name, message=message)
        return out

    def ready(self) -> bool:
        return self._status.state is State.READY

    def needs_restart(self) -> bool:
        """The session failed to build (or rebuild) ``health.session_restart_attempts``
        times in a row: only a new process (a fresh JVM, environment, classpath)
        may help. A successful build resets the count."""
        return self._status.session_failures >= self.cfg.health.session_restart_attempts

    async def wait_ready(self) -> None:
        """Return once batches can run (tests, and callers that prefer to wait)."""
        await self._ready.wait()
        if self._status.state is not State.READY:
            raise ExecutorError("the Spark executor stopped before it became ready")

    async def execute(
        self,
        batch: MicroBatch,
        stages: Collection[str] | None = None,
        *,
        wait_s: float | None = None,
    ) -> dict[str, BaseException]:
        """Run ``batch`` for ``stages`` (all when None); the stages that failed,
        and as ``InFlight`` the streams and mirrors whose commit or merge outlived
        ``wait_s`` (default half of ``health.attempt_slow_s``) and goes on in its
        own thread."""
        if self._status.state in (State.STOPPING, State.STOPPED):
            raise ExecutorError(f"batch {batch.batch_id}: the Spark executor is stopped")
        # Free check first: a JVM that died while no batch ran fails this one at
        # once (the planner then holds the batch until the new session is up).
        lost = self._exited()
        if lost is not None:
            self._lose(lost)
            exc = ExecutorError(
                f"micro-batch {batch.batch_id}: the Spark session was lost ({lost}); rebuilding it"
            )
            self._record_failure(batch, exc)
            raise exc
        await self.wait_ready()  # consumers hold their batches until Spark is up
        wanted = set(self.stage_names() if stages is None else stages)
        # Half of attempt_slow_s: the stages done meanwhile hear of it (the
        # planner records them when this returns) before they could look slow.
        wait = self.cfg.health.attempt_slow_s / 2 if wait_s is None else max(wait_s, 0.0)
        async with self._lock:
            return await self._execute_locked(batch, wanted, wait)

    def prepare(self, batch: MicroBatch) -> None:
        """Start writing ``batch``'s inbox file while the batch before it runs in Spark.

        A hint from the planner, which closed and planned ``batch`` early: the
        Python half of a batch (~0.1 µs per event raw, ~0.6 µs as Parquet)
        then overlaps the Spark half of the previous one instead of following
        it with Spark idle. ``execute`` uses the file if it was written and
        builds it itself otherwise (no inbox, a failed write, a retry).
        """
        if self._inbox is None or self._cores is None or batch.batch_id in self._prepared:
            return
        if self._status.state in (State.STOPPING, State.STOPPED):
            return
        future = self._prep_pool.submit(
            self._write_prepared, batch, self._inbox, self._cores, self._inbox_kind == "raw"
        )
        self._prepared[batch.batch_id] = future

    def _write_prepared(
        self, batch: MicroBatch, inbox: Path, cores: int, raw: bool
    ) -> frame.InboxFile:
        """``prepare``'s work, in its thread; times it for ``prepare_seconds``."""
        started = time.monotonic()
        result = frame.write_inbox(
            batch, inbox, cores, self.cfg.microbatch.build_max_bytes, raw, self._count_collections()
        )
        rows = result.rows
        if rows >= PREP_SAMPLE_MIN_ROWS:
            rate = (time.monotonic() - started) / rows
            old = self._prep_s_per_row
            # One float, replaced whole: the event loop reads it without a lock.
            self._prep_s_per_row = rate if old is None else old + PREP_EWMA * (rate - old)
        return result

    def prepare_seconds(self, rows: int) -> float:
        """How long preparing a batch of ``rows`` is expected to take, from the
        recent preparations' seconds per row (0 before the first). The planner
        closes the next batch this much before the running one should commit."""
        rate = self._prep_s_per_row
        return 0.0 if rate is None else rate * rows

    def _take_prepared(self, batch: MicroBatch) -> frame.InboxFile | None:
        """The prepared inbox file of ``batch`` (waiting for it), or None. Worker thread."""
        future = self._prepared.pop(batch.batch_id, None)
        if future is None:
            return None
        try:
            return future.result()
        except Exception as exc:  # the inline build below reports a real problem again
            log.warning("batch_prepare_failed", batch_id=batch.batch_id, error=repr(exc))
            self._remove_inbox_files(batch.batch_id)
            return None

    def _remove_inbox_files(self, batch_id: int, own: Path | None = None) -> None:
        """A run's inbox file ``own``; without one (its write failed part-way)
        the batch's files no other run reads."""
        if self._inbox is None:
            return
        with self._inbox_lock:
            if own is not None:
                self._inbox_reading.discard(own)
                own.unlink(missing_ok=True)
                return
            for f in self._inbox.glob(f"b{batch_id:012d}-*"):
                if f not in self._inbox_reading:
                    f.unlink(missing_ok=True)

    def _count_collections(self) -> bool:
        """Whether a batch's rows per collection are needed: by a CDC stream
        that takes some collections, not all (``_rows_for``), or a mirror (a
        batch without its collection's rows is not decoded for it)."""
        return bool(self._mirrors) or any(s.stream.collections != ("*",) for s in self._sinks)

    async def stop(self) -> None:
        """Wait for the batch in flight, close streams, stop the session we built."""
        if self._status.state is State.STOPPED:
            return
        self._status.state = State.STOPPING
        self._ready.set()  # release waiters; they see STOPPING and raise
        if self._retention_task is not None:
            self._retention_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retention_task
        if self._boot_task is not None and not self._boot_task.done():
            self._boot_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._boot_task
        loop = asyncio.get_running_loop()
        if self.compaction is not None:
            await asyncio.to_thread(self.compaction.stop)
        async with self._lock:
            try:
                # Queued behind any build still running in the thread, so a session
                # that finishes building after cancellation is stopped too.
                await loop.run_in_executor(self._pool, self._close_in_thread)
            finally:
                self._status.state = State.STOPPED
                self._pool.shutdown(wait=False)
                # A prepared file's batch re-runs from the plan log after a restart.
                self._prep_pool.shutdown(wait=False, cancel_futures=True)
                self._prepared.clear()
        log.info("spark_executor_stopped")

    def status(self) -> dict[str, Any]:
        st = self._status
        spark = self.cfg.spark
        return {
            "ready": st.state is State.READY,
            "state": st.state.value,
            "spark": {"remote": spark.remote} if spark.remote else {"master": spark.master},
            "inbox": self._inbox_kind,
            "cdc_write": self._cdc_write,
            "missing_parts": self._missing_parts,
            "session_error": st.session_error,
            "session_attempts": st.session_attempts,
            "session_failures": st.session_failures,
            "session_rebuilds": st.session_rebuilds,
            "session_lost": st.session_lost,
            "session_lost_at": st.session_lost_at,
            "last_rebuild_at": st.last_rebuild_at,
            "last_batch_id": st.last_batch_id,
            "last_batch_rows": st.last_batch_rows,
            "last_batch_duration_s": st.last_batch_duration_s,
            "last_committed_at": st.last_committed_at,
            "batches_committed": st.batches_committed,
            "batches_failed": st.batches_failed,
            "last_error": st.last_error,
            "last_error_batch_id": st.last_error_batch_id,
            "last_error_at": st.last_error_at,
            "streams": {
                s.name: {
                    "path": s.stream.location,
                    "last_batch_id": st.streams.get(s.name),
                    "quarantined": s.quarantined,
                    **({"retention": self._retention[s.name]} if s.name in self._retention else {}),
                    "compaction": self.compaction.status(s.name) if self.compaction else None,
                    **s.table_status(),
                }
                for s in self._sinks
            },
            "mirrors": mirrors_status(self._mirrors, self._coalesced),
            "stages": [s.name for s in self._stages],
            "handlers": [ref for ref, _ in self._handlers],
        }

    # -- start-up ----------------------------------------------------------

    def _load_handlers(self) -> list[tuple[str, Handler]]:
        errors: list[str] = []
        out: list[tuple[str, Handler]] = []
        for i, h in enumerate(self.cfg.cdc.handlers):
            try:
                out.append((h.function, load_handler(h.function)))
            except ValueError as exc:
                errors.append(f"cdc.handlers[{i}].function: {exc}")
        if errors:
            raise ConfigError(errors, str(self.cfg.source or "config"))
        return out

    def _check_stream_paths(self) -> None:
        errors: list[str] = []
        seen: list[tuple[int, Path]] = []

        def overlaps(key: str, p: Path, who: str) -> None:
            for j, q in seen:
                if p == q or p.is_relative_to(q) or q.is_relative_to(p):
                    errors.append(
                        f"{key}: {p} overlaps cdc.streams[{j}].path ({q}); "
                        f"{who} needs its own folder (a reader of one would see both)"
                    )

        for i, s in enumerate(self.cfg.cdc.streams):
            p = Path(s.path).resolve()
            overlaps(f"cdc.streams[{i}].path", p, "each stream")
            seen.append((i, p))
            try:
                (p / "_eventplane").mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                errors.append(f"cdc.streams[{i}].path: cannot create {p} ({exc.strerror})")
        for i, m in enumerate(self.cfg.cdc.mirrors):
            overlaps(f"cdc.mirrors[{i}].path", Path(m.path).resolve(), "a mirror")
        if errors:
            raise ConfigError(errors, str(self.cfg.source or "config"))

    def _open_sinks(self) -> list[CdcSink]:
        sinks: list[CdcSink] = []
        try:
            for s in self.cfg.cdc.streams:
                sink = sink_class(s)(
                    s,
                    wal_id=self.wal_id,
                    cores=self.cfg.daemon.cores,
                    data_dir=self.cfg.data_dir,
                    daemon_name=self.cfg.daemon.name,
                )
                sink.on_commit_retry = self.metrics.cdc_commit_retries.labels(s.name).inc
                sink.open()
                sinks.append(sink)
                self.metrics.cdc_quarantined_rows.labels(sink.name).set(sink.quarantined)
                if sink.quarantined:
                    log.warning(
                        "cdc_quarantine_not_empty",
                        stream=sink.name,
                        rows=sink.quarantined,
                        message=f"stream {sink.name!r} holds {sink.quarantined} rows in its "
                        "quarantine: eventplane cdc quarantine list " + sink.name,
                    )
        except BaseException:
            for sink in sinks:
                sink.close()
            raise
        return sinks

    def _close_in_thread(self) -> None:
        flush_at_stop(self._mirrors, self._coalesced, self._lanes, self.cfg, self.metrics)
        close_mirrors(self._mirrors, self._lanes)
        for sink in self._sinks:
            if self._lanes.busy(sink_stage(sink)):
                # Closing would pull the table's state from under the commit;
                # its lease expires by itself, and a restart recovers the table.
                log.warning(
                    "cdc_commit_in_flight_at_stop",
                    stream=sink.name,
                    waiting_for=self.waiting_for(sink_stage(sink)),
                )
                continue
            sink.close()
        self._lanes.close()
        # _built covers a session whose build finished after stop() cancelled the boot.
        session = self._session or self._built
        if self._owns_session and session is not None:
            try:
                session.stop()
            except Exception:
                log.exception("spark_session_stop_failed")
        self._session = self._built = None

    # -- one batch -----------------------------------------------------------

    async def _execute_locked(
        self, batch: MicroBatch, wanted: set[str], wait_s: float
    ) -> dict[str, BaseException]:
        """Run ``batch`` (module docstring, steps 1-5) and every stage's ``finish``.

        1. The worker thread runs steps 1-5; as soon as a stage's
           ``run_in_spark`` returns, its ``finish`` starts on the loop
           (``hand_over`` -> ``start``), while the thread goes on with the CDC
           commits.
        2. Once the thread is done, every stage's ``finish`` is awaited: the
           batch is done only when all are (invariant 6), and a ``finish``
           that fails is that stage's failure alone.
        3. A batch that fails whole (steps 1-2) still waits for the ``finish``
           calls already started, then raises; cancelled, it cancels them.
        """
        started = time.monotonic()
        bound = log.bind(batch_id=batch.batch_id)
        loop = asyncio.get_running_loop()
        ctx = contextvars.copy_context()
        finishing: dict[str, asyncio.Task[None]] = {}
        ready_at: dict[str, float] = {}
        taking = [True]  # False once the batch is over: a late hand-over starts nothing

        def start(stage: BatchStage, result: Any) -> None:
            # On the loop. The thread's hand-over and the fallback after it may
            # both come: the first starts the stage's finish.
            if taking[0] and stage.name not in finishing:
                ready_at[stage.name] = time.monotonic() - started
                finishing[stage.name] = loop.create_task(
                    stage.finish(batch, result), name=f"finish-{stage.name}-{batch.batch_id}"
                )

        def hand_over(stage: BatchStage, result: Any) -> None:
            # Worker thread: the stage's result is ready; its finish starts now.
            loop.call_soon_threadsafe(start, stage, result)

        try:
            try:
                try:
                    # Step 1. Spark work in the worker thread; finishes start as results come.
                    outcome = await loop.run_in_executor(
                        self._pool, ctx.run, self._run_in_spark, batch, wanted, hand_over, wait_s
                    )
                except Exception:
                    # Step 3. Calls already under way complete (at least once:
                    # the batch re-runs); their outcome does not change this failure.
                    taking[0] = False
                    await _settle(finishing)
                    raise
                for stage, result in outcome.stage_results:
                    start(stage, result)  # a no-op for those the thread handed over
                taking[0] = False
                # Step 2. Every stage's finish, whatever the others did.
                outcome.failures.update(await _settle(finishing))
            except asyncio.CancelledError:
                taking[0] = False
                await _cancel_all(finishing)
                raise
            crash_point("executor.after_commit")
            if outcome.failures and len(outcome.failures) == outcome.ran:
                # Nothing of the batch committed: it fails whole, as one error.
                raise next(iter(outcome.failures.values()))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Logged once, by the planner (microbatch_failed: attempt, retry delay).
            self._record_failure(batch, exc)
            await self._check_session()
            if isinstance(exc, DaemonError):
                raise
            raise ExecutorError(
                f"micro-batch {batch.batch_id} ({batch.rows} rows) failed: {error_text(exc)}"
            ) from exc
        seconds = time.monotonic() - started
        for name, failure in outcome.failures.items():
            self._record_failure(batch, failure, name)
        if outcome.failures:
            await self._check_session()
        self._record_success(batch, outcome, seconds)
        bound.debug(
            "microbatch_committed",
            rows=outcome.rows,
            seconds=round(seconds, 4),
            spark_seconds=round(outcome.spark_seconds, 4),
            # When each stage's finish started (its Spark part was done), from
            # the batch's start: what a trigger's freshness depends on.
            stage_ready_seconds={k: round(v, 4) for k, v in ready_at.items()},
            streams={c.stream: ("noop" if c.noop else c.rows) for c in outcome.commits},
            failed_stages=sorted(outcome.failures),
            in_flight=sorted(outcome.in_flight),
        )
        return {**outcome.failures, **outcome.in_flight, **outcome.held}

    def coalesce_due_s(self) -> float | None:
        """Seconds until a mirror's coalesced merge is due; None when none holds batches."""
        return coalesce_due_s(self._coalesced)

    async def flush_coalesced(
        self, *, force: bool = False
    ) -> dict[str, tuple[int, BaseException | None]]:
        """The mirrors' held batches that are due (all when ``force``) merged,
        each in its lane (``daemon.spark.mirrors.flush_mirrors``)."""
        if not self._coalesced or self._status.state is not State.READY:
            return {}
        loop = asyncio.get_running_loop()
        wait = self.cfg.health.attempt_slow_s / 2
        async with self._lock:
            return await loop.run_in_executor(
                self._pool,
                functools.partial(
                    flush_mirrors,
                    self._mirrors,
                    self._coalesced,
                    force=force,
                    lanes=self._lanes,
                    wait_s=wait,
                    metrics=self.metrics,
                    landed_failure=lambda exc, stage: None,
                ),
            )

    def _run_in_spark(
        self,
        batch: MicroBatch,
        wanted: set[str],
        hand_over: Callable[[BatchStage, Any], None] = lambda stage, result: None,
        wait_s: float = float("inf"),
    ) -> _Outcome:
        """Steps 1-5 of the module docstring for the ``wanted`` stages. Runs in the
        worker thread. Steps 1-2 raise; a stage's failure is its own.
        ``hand_over(stage, result)`` gets each stage's result as soon as it is
        ready (it must not block: it starts the stage's finish on the loop)."""
        started = time.monotonic()
        spark = self._session
        if spark is None:
            raise ExecutorError("no SparkSession (the executor was stopped)")
        sinks = [s for s in self._sinks if sink_stage(s) in wanted]
        stages = [st for st in self._stages if st.name in wanted]
        handlers = [(ref, f) for ref, f in self._handlers if handler_stage(ref) in wanted]
        failures: dict[str, BaseException] = {}
        mirrors = 0  # mirror stages that ran (step 4b)
        commits: list[CommitResult] = []
        results: list[tuple[BatchStage, Any]] = []
        in_flight: dict[str, InFlight] = {}
        held: dict[str, Held] = {}
        reading: list[InFlight] = []  # streams' commits in flight: they read the inbox
        cached = False
        made: list[Any] = []  # the batch DataFrame, once something needs it
        file: frame.InboxFile | None = None
        try:
            nrows = batch.rows
            parallelism = self._parallelism(spark)
            file = self._take_prepared(batch)
            if file is None and self._inbox is not None:
                raw = rawinbox.missing(spark) is None
                file = frame.write_inbox(
                    batch,
                    self._inbox,
                    parallelism,
                    self.cfg.microbatch.build_max_bytes,
                    raw,
                    self._count_collections(),
                )
            if file is None:  # no inbox: the rows go over as one Arrow table
                df, counts = frame.batch_frame(spark, batch, None, parallelism)
                made.append(df)
            else:
                counts = file.counts
                with self._inbox_lock:
                    self._inbox_reading.add(file.path)
            inbox = file

            def batch_df() -> Any:
                if not made:
                    assert inbox is not None
                    made.append(frame.read_inbox(spark, inbox, batch.batch_id))
                return made[0]

            # A raw inbox file: the streams write it without a Spark job, or
            # (spark.direct_write = false) find in it the rows that fail alone.
            source = None
            if file is not None and file.splits is not None:
                source = sparkio.RawInbox(
                    spark,
                    file.path,
                    file.splits,
                    batch.batch_id,
                    nrows,
                    direct=self._direct,
                    reread=functools.partial(frame.read_inbox, spark, file, batch.batch_id),
                )
            direct = source if source is not None and source.direct else None
            todo = [(sink, self._rows_for(sink, nrows, counts)) for sink in sinks]
            pending = [t for t in todo if t[1] and t[0].last_batch_id < batch.batch_id]
            # With a raw inbox file the streams write its rows without a Spark
            # job (CdcSink.commit): they need no DataFrame.
            readers = {
                s.name
                for s, _rows in pending
                if not (direct and s.writes_direct) and s.name not in self._no_delta
            }
            # Steps 3-5: each stage on its own; one failing holds back only itself.
            # Step 3. Stages first: their finish (webhook calls) runs on the loop
            # while this thread writes the CDC tables. They read the batch before
            # it is persisted: their job then parses only their collections' rows
            # and builds no cache (measured against a cache they would build for
            # one CDC stream: 24-43 % less time to the trigger's result, 7-17 %
            # less CPU per batch; docs/triggers.md, "End to end").
            # Stages see the batch columns, without the payloads' JSON text.
            staged = batch_df().select(*frame.BATCH_COLUMNS) if stages else None
            for st in stages:
                try:
                    result = st.run_in_spark(spark, staged, batch)
                except Exception as exc:
                    failures[st.name] = exc
                    continue
                results.append((st, result))
                hand_over(st, result)
            if len(readers) + len(handlers) > 1:
                # Persisted only now: a plan persisted before the stages ran
                # would have had their job build the cache.
                made[:] = [batch_df().persist()]
                cached = True
            # Step 4. Each CDC stream commits its rows exactly once, in its
            # own thread; one that outlives ``wait_s`` goes on there (InFlight).
            for sink, rows in todo:
                if sink.name in self._no_delta:
                    failures[sink_stage(sink)] = DeltaJarsMissingError(self._no_delta[sink.name])
                    continue
                try:
                    df = batch_df() if sink.name in readers else None
                    what = f"its commit of batch {batch.batch_id} to {sink.stream.location}"
                    call = functools.partial(sink.commit, df, batch, rows, source)
                    running = self._lanes.submit(sink_stage(sink), what, call)
                    if outlives(running, wait_s):
                        marker = self._in_flight(sink, batch, running)
                        in_flight[marker.stage] = marker
                        reading.append(marker)
                    else:
                        commits.append(running.result())
                except Exception as exc:
                    failures[sink_stage(sink)] = exc
            # Step 4b. Each mirror merges its collection's rows exactly once, in
            # its own thread, waited for as a stream's commit is.
            mirrors = commit_mirrors(
                self._mirrors,
                batch,
                wanted,
                counts,
                lanes=self._lanes,
                wait_s=wait_s,
                failures=failures,
                in_flight=in_flight,
                metrics=self.metrics,
                landed_failure=functools.partial(self._record_failure, batch),
                coalesced=self._coalesced,
                held=held,
            )
            # Step 5. Handlers.
            if handlers:
                contract = batch_df().select(*CDC_COLUMNS)
                for ref, func in handlers:
                    try:
                        func(contract, batch.batch_id)
                    except Exception as exc:
                        failures[handler_stage(ref)] = exc
        finally:

            def clean_up() -> None:
                if cached:
                    try:
                        made[0].unpersist(blocking=False)
                    except Exception as exc:  # a dead JVM took the cache with it
                        log.warning("batch_unpersist_failed", error=f"{type(exc).__name__}: {exc}")
                # Even when the JVM died mid-batch.
                self._remove_inbox_files(batch.batch_id, None if file is None else file.path)

            if reading:
                # A commit still running reads the inbox file and the cache:
                # they go once the last one is over. A mirror's merge reads
                # neither (it has its decoded rows).
                left = [len(reading)]
                lock = threading.Lock()

                def one_done(_: Future[None]) -> None:
                    with lock:
                        left[0] -= 1
                        last = left[0] == 0
                    if last:
                        clean_up()

                for marker in reading:
                    marker.done.add_done_callback(one_done)
            else:
                clean_up()
        ran = len(sinks) + len(stages) + len(handlers) + mirrors
        spark_s = time.monotonic() - started
        return _Outcome(nrows, commits, results, spark_s, failures, ran, in_flight, held)

    def _in_flight(self, sink: CdcSink, batch: MicroBatch, running: Future[Any]) -> InFlight:
        """The marker of ``sink``'s commit that goes on in its lane; its ``done``
        resolves once the commit is over, after the executor's own bookkeeping."""

        def landed(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is None:
                result: CommitResult = f.result()
                st = self._status
                st.streams[result.stream] = max(st.streams.get(result.stream) or 0, result.batch_id)
                if result.quarantined:  # as _record_success counts a waited-for commit's
                    self.metrics.cdc_quarantined.labels(result.stream).inc(result.quarantined)
                self.metrics.cdc_quarantined_rows.labels(sink.name).set(sink.quarantined)
            else:
                self._record_failure(batch, exc, sink_stage(sink))

        return hand_back(sink_stage(sink), batch.batch_id, running, landed)

    async def _in_stream_thread(self, sink: CdcSink, what: str, call: Callable[[], Any]) -> Any:
        """Run ``call`` in ``sink``'s own thread (its lane), after the commits
        queued there: work on a stream's table never runs beside its commit."""
        return await asyncio.wrap_future(self._lanes.submit(sink_stage(sink), what, call))

    def waiting_for(self, stage: str) -> str | None:
        """What the running attempt of ``stage`` waits for (a stream's commit to
        its table, a mirror's merge), or None when none of its calls runs."""
        return self._lanes.waiting_for(stage)

    def _parallelism(self, spark: Any) -> int:
        if self._cores is None:
            self._cores = int(spark.sparkContext.defaultParallelism) if self._inbox else 1
            if self._inbox is None:
                self._inbox_kind = "arrow"
            else:
                why = rawinbox.missing(spark)
                self._inbox_kind = "raw" if why is None else f"parquet ({why})"
            why_not = self._why_not_direct(spark)
            self._direct = why_not is None
            self._cdc_write = "direct" if why_not is None else f"spark job ({why_not})"
        return self._cores

    def _why_not_direct(self, spark: Any) -> str | None:
        """Why batches are not written without a Spark job (None: they are):
        ``status()``'s ``cdc_write`` says it."""
        if self._inbox_kind != "raw":
            return "no raw inbox"
        if not self.cfg.spark.direct_write:
            return "spark.direct_write = false"
        return sparkio.direct_write_missing(spark)

    @staticmethod
    def _rows_for(sink: CdcSink, nrows: int, counts: dict[str, int] | None) -> int:
        if sink.stream.collections == ("*",):
            return nrows
        if counts is None:
            raise ExecutorError(f"stream {sink.name}: the batch's rows per collection are unknown")
        return sum(counts.get(c, 0) for c in sink.stream.collections)

    def _record_success(self, batch: MicroBatch, outcome: _Outcome, seconds: float) -> None:
        st = self._status
        st.last_batch_id = batch.batch_id
        st.last_batch_rows = outcome.rows
        st.last_batch_duration_s = seconds
        st.last_committed_at = time.time()
        st.batches_committed += 1
        for c in outcome.commits:
            st.streams[c.stream] = max(st.streams.get(c.stream) or 0, c.batch_id)
            if c.quarantined:
                self.metrics.cdc_quarantined.labels(c.stream).inc(c.quarantined)
        for sink in self._sinks:
            self.metrics.cdc_quarantined_rows.labels(sink.name).set(sink.quarantined)
        # The eventplane_microbatch_* series are the planner's: it sees every
        # batch and attempt, whatever executor runs them.

    def _record_failure(
        self, batch: MicroBatch, exc: BaseException, stage: str | None = None
    ) -> None:
        st = self._status
        st.batches_failed += 1
        where = f"stage {stage}: " if stage else ""
        st.last_error = f"{where}{error_text(exc)}"
        st.last_error_batch_id = batch.batch_id
        st.last_error_at = time.time()


async def _settle(tasks: dict[str, asyncio.Task[None]]) -> dict[str, BaseException]:
    """Wait for every task; the failed ones by name (a task cancelled on its own
    counts as failed)."""
    if tasks:
        await asyncio.wait(tasks.values())
    failures: dict[str, BaseException] = {}
    for name, task in tasks.items():
        if task.cancelled():
            failures[name] = ExecutorError(f"stage {name}: its finish was cancelled")
        elif (exc := task.exception()) is not None:
            failures[name] = exc
    return failures


async def _cancel_all(tasks: dict[str, asyncio.Task[None]]) -> None:
    """Cancel the tasks and wait until they are over (the caller was cancelled)."""
    for task in tasks.values():
        task.cancel()
    if tasks:
        await asyncio.wait(tasks.values())
