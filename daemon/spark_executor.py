"""The Spark executor: one planned micro-batch -> one DataFrame -> every consumer.

``SparkExecutor`` implements ``daemon.batch.Executor``:

- ``start()`` checks what can be checked without Spark (handler imports, CDC
  stream paths, ledger identity, interrupted commits) and raises on a bad
  configuration; then it builds the SparkSession in the background, with
  backoff on failure. The WAL and ingest never wait for Spark; ``ready()``
  tells the planner when batches can be handed over.
- ``execute(batch)`` runs all py4j work in the executor's own worker thread
  (one thread: Spark work is serialized, and a minutes-long job never holds a
  slot of the loop's shared default pool). Per batch, in that thread:

  1. slices -> Arrow, a chunk of rows at a time (payloads decoded per chunk);
     for a batch the planner closed ahead, done already by ``prepare`` in a
     second thread while the previous batch ran in Spark;
  2. Arrow -> DataFrame with ``new``/``old`` parsed to VARIANT
     (``batch_frame``; on local masters the chunks stream into a Parquet file
     in ``<data_dir>/spark-inbox``, 3x faster than ``createDataFrame`` and
     never one whole-batch table in memory); persisted when more than one
     consumer reads it;
  3. each CDC stream commits its rows exactly once (``daemon.cdc``);
  4. each ``BatchStage.run_in_spark`` (triggers) computes its result;
  5. each ``[[cdc.handlers]]`` function gets ``(df, batch_id)``.

  Back on the loop, each stage's ``finish`` completes its effects. ``execute``
  returns only when all of it is done (invariant 6); any failure raises, so
  the planner retries the batch with the same id and rows (and counts it in
  ``eventplane_microbatch_outcomes_total``); ``status()`` shows it.
- ``stop()`` waits for the batch in flight, closes the streams and stops the
  session it built.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import importlib
import itertools
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import structlog

from daemon import spark as sparkmod
from daemon.batch import BatchStage, MicroBatch
from daemon.cdc import CDC_COLUMNS, CdcSink, CommitResult, crash_point
from daemon.config import Config, MicrobatchConfig
from daemon.errors import ConfigError, DaemonError, ExecutorError
from daemon.events import StoredEvent
from daemon.metrics import Metrics
from daemon.planner import Rows
from wal.reader import RecordBatch
from wal.record import Record

log = structlog.get_logger("eventplane.spark")

# Columns of the batch DataFrame: the CDC contract plus what triggers need.
EXTRA_COLUMNS = ("depth", "source")
BATCH_COLUMNS = (*CDC_COLUMNS, *EXTRA_COLUMNS)

Handler = Callable[[Any, int], Any]

# A msgpack array header (0xdd + uint32 count) in front of the concatenated
# payloads turns a slice into one msgpack document: one C-level decode per
# slice instead of one Python call per event.
_events_decoder = msgspec.msgpack.Decoder(list[StoredEvent])
# Inbox file names never repeat within a process: a retried batch gets a new
# file, so no reader-side cache can serve the previous attempt's bytes.
_inbox_seq = itertools.count(1)
# Below this many rows a batch stays one task: a Spark task costs ~10 ms to
# schedule, about what parsing 5k rows to VARIANT takes.
_MIN_ROW_GROUP = 5_000
# Most rows held as Arrow before a row group of the inbox file is written
# (fewer when ``microbatch.build_max_bytes`` says so).
_MAX_ROW_GROUP = 131_072
# Arrow bytes of an inbox row beyond its payload's length: five fixed-width
# columns (32 B) and six string offsets (24 B); the strings are at most the
# payload (measured: 171 Arrow bytes per 133-byte payload).
_ROW_FIXED_BYTES = 56
# ``microbatch.build_max_bytes``'s default, for callers without a config.
BUILD_MAX_BYTES = MicrobatchConfig().build_max_bytes
# Rows decoded into Python objects at a time while building a batch's table.
TABLE_CHUNK_ROWS = 16_384
# How the inbox file is written: uncompressed (it lives for one job, in the page
# cache), and dictionary-encoded only where values repeat. With plain payload
# and key columns pyarrow wrote 200k rows in 256 ns/row instead of 397, and
# Spark's job over a 1M-row file cost 7-13 % less JVM CPU.
INBOX_WRITE_OPTIONS: dict[str, Any] = {
    "compression": "none",
    "use_dictionary": ["collection", "op", "source"],
}


class State(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"


# --------------------------------------------------------------------------
# Batch -> Arrow -> DataFrame (pure functions; the bench and tests use them)


def batch_table(batch: MicroBatch) -> Any:
    """The batch's rows as one Arrow table, slices in core order, LSN order within.

    Rows are decoded ``TABLE_CHUNK_ROWS`` at a time, so the Python objects of
    decoding (about 1 KiB per event) exist for one chunk only; the table itself
    (about 1.2x the payload bytes) is what the batch holds. Columnar parts
    (WAL replay) are decoded straight from their contiguous payload bytes,
    without a ``Record`` per event.
    """
    import pyarrow as pa

    bid = batch.batch_id
    chunks = [
        _record_batch(*chunk, bid)
        for c in sorted(batch.slices)
        for chunk in _chunks(batch.slices[c].records, TABLE_CHUNK_ROWS)
    ]
    return pa.Table.from_batches(chunks or [_record_batch((), (), (), b"", bid)])


_Chunk = tuple[Sequence[int], Sequence[int], Sequence[int], bytes]


def _parts(records: Sequence[Record]) -> Sequence[Sequence[Record] | RecordBatch]:
    """A slice's rows as the planner delivered them: ``Rows`` parts, or one list."""
    return records.parts() if isinstance(records, Rows) else [records]


def _chunks(records: Sequence[Record], size: int) -> Iterator[_Chunk]:
    """``(lsns, cores, seqs, concatenated payloads)`` of at most ``size`` rows each."""
    for part in _parts(records):
        n = len(part)
        if isinstance(part, RecordBatch):
            offs = part.offsets
            for i in range(0, n, size):
                j = min(i + size, n)
                first = part.first_seq + i
                data = part.data[offs[i] : offs[j]]
                yield part.lsns[i:j], [part.core] * (j - i), range(first, first + j - i), data
        else:
            for i in range(0, n, size):
                cols = tuple(zip(*part[i : i + size], strict=True))
                yield cols[0], cols[1], cols[2], b"".join(cols[3])


def _record_batch(
    lsns: Sequence[int], cores: Sequence[int], seqs: Sequence[int], payloads: bytes, batch_id: int
) -> Any:
    import pyarrow as pa
    import pyarrow.compute as pc

    # The payloads are msgpack StoredEvents back to back: prefix an array
    # header and decode them in one call.
    header = b"\xdd" + len(lsns).to_bytes(4, "big")
    events = _events_decoder.decode(header + payloads)
    ts_ns = pa.array([e.ingest_ts_ns for e in events], pa.int64())
    return pa.record_batch(
        {
            "lsn": pa.array(lsns, pa.int64()),
            "core": pa.array(cores, pa.int32()),
            "seq": pa.array(seqs, pa.int64()),
            "collection": pa.array([e.collection for e in events], pa.string()),
            "op": pa.array([e.op for e in events], pa.string()),
            "key": pa.array([e.key for e in events], pa.string()),
            # Binary then one C-level UTF-8 check: 5x faster than str conversion.
            "new_json": pa.array([e.new for e in events], pa.binary()).cast(pa.string()),
            "old_json": pa.array([e.old for e in events], pa.binary()).cast(pa.string()),
            "ingest_ts": pc.divide(ts_ns, 1000).cast(pa.timestamp("us", tz="UTC")),
            # A column, not a literal in the plan: Spark inlines literals into
            # the Java it generates, so a new id per batch meant compiling the
            # job's code again each batch (20-40 ms; the same plan is cached).
            "batch_id": pa.repeat(pa.scalar(batch_id, pa.int64()), len(lsns)),
            "depth": pa.array([e.depth for e in events], pa.int32()),
            "source": pa.array([e.source for e in events], pa.string()),
        }
    )


def collection_counts(table: Any) -> dict[str, int]:
    import pyarrow.compute as pc

    counts = pc.value_counts(table["collection"])
    return {str(v): int(n) for v, n in zip(*counts.flatten(), strict=True)} if len(counts) else {}


def batch_dataframe(
    spark: Any, table: Any, batch_id: int, inbox: Path | None = None, parallelism: int = 1
) -> Any:
    """Arrow table -> the batch DataFrame (``BATCH_COLUMNS``, new/old as VARIANT).

    With ``inbox`` (a folder the Spark executors can read: local masters), the
    table goes to Spark as an uncompressed Parquet file written by pyarrow's C++
    writer; Spark's vectorized reader takes it from there. Measured here at
    100k rows, that is ~3x faster than ``createDataFrame(table)``, which ships
    the Arrow bytes inside task closures and converts them row by row. Without
    an inbox (Spark Connect, remote clusters) the table travels in the call.
    The file's row groups come in whole waves of ``parallelism``
    (``row_group_rows``): Spark splits Parquet input by row group, so every
    core reads, parses and writes its share. The caller removes the file once
    every consumer is done.
    """
    if inbox is not None:
        import pyarrow.parquet as pq

        file = _inbox_file(inbox, batch_id)
        rows_per_group = row_group_rows(table.num_rows, parallelism)
        pq.write_table(table, file, row_group_size=rows_per_group, **INBOX_WRITE_OPTIONS)
        raw = _read_inbox(spark, file)
    else:
        raw = spark.createDataFrame(table)
    return _contract_frame(raw)


def batch_frame(
    spark: Any,
    batch: MicroBatch,
    inbox: Path | None,
    parallelism: int,
    max_bytes: int = BUILD_MAX_BYTES,
) -> tuple[Any, int, dict[str, int]]:
    """Steps 1-2 for the executor: ``(DataFrame, rows, rows per collection)``.

    With an inbox the rows are streamed into the Parquet file a chunk at a
    time (``write_batch_file``), so the batch never exists as one Arrow table
    in this process; without one, the table is built and handed over.
    """
    if inbox is None:
        table = batch_table(batch)
        df = batch_dataframe(spark, table, batch.batch_id)
        return df, table.num_rows, collection_counts(table)
    file = _inbox_file(inbox, batch.batch_id)
    rows, counts = write_batch_file(batch, file, parallelism, max_bytes)
    return _contract_frame(_read_inbox(spark, file)), rows, counts


def write_batch_file(
    batch: MicroBatch, path: Path, parallelism: int, max_bytes: int = BUILD_MAX_BYTES
) -> tuple[int, dict[str, int]]:
    """Write the batch's rows (``batch_table`` layout) to an uncompressed Parquet
    file, ``TABLE_CHUNK_ROWS`` at a time; returns ``(rows, rows per collection)``.

    Spark splits Parquet input by row group: a batch gets about
    ``parallelism`` row groups, so every core gets a share, but at least
    ``_MIN_ROW_GROUP`` rows each (a small batch stays one task) and at most
    ``_MAX_ROW_GROUP`` (what this process holds before writing) or, by the
    batch's mean event size, about ``max_bytes`` of Arrow data. The Arrow
    pool's freed memory goes back to the OS at the end, so between batches
    this holds nothing.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    total = sum(len(s.records) for s in batch.slices.values())
    row_bytes = -(-payload_bytes(batch) // max(1, total)) + _ROW_FIXED_BYTES
    group_rows = row_group_rows(total, parallelism, max_bytes // row_bytes)
    counts: dict[str, int] = {}
    rows = 0
    writer: Any = None
    pending: list[Any] = []  # record batches not yet written: one row group's worth
    pending_rows = 0
    try:
        for c in sorted(batch.slices):
            for chunk in _chunks(batch.slices[c].records, min(TABLE_CHUNK_ROWS, group_rows)):
                rb = _record_batch(*chunk, batch.batch_id)
                for name, n in collection_counts(rb).items():
                    counts[name] = counts.get(name, 0) + n
                rows += rb.num_rows
                if writer is None:
                    writer = pq.ParquetWriter(path, rb.schema, **INBOX_WRITE_OPTIONS)
                pending.append(rb)
                pending_rows += rb.num_rows
                if pending_rows >= group_rows:
                    # Whole row groups out; the rest (a zero-copy slice) waits.
                    table = pa.Table.from_batches(pending)
                    full = pending_rows - pending_rows % group_rows
                    writer.write_table(table.slice(0, full), row_group_size=group_rows)
                    rest = table.slice(full)
                    pending, pending_rows = rest.to_batches(), rest.num_rows
        if writer is None:  # no rows: a file with the schema and no row group
            schema = _record_batch((), (), (), b"", batch.batch_id).schema
            writer = pq.ParquetWriter(path, schema, **INBOX_WRITE_OPTIONS)
        if pending_rows:
            writer.write_table(pa.Table.from_batches(pending))
    finally:
        if writer is not None:
            writer.close()
        # Arrow's mimalloc keeps freed pages for reuse: 34-37 MiB were still
        # resident after a 1.9M-row batch (live peak 38 MiB); 3 MiB after this
        # call, which takes ~0.2 ms.
        pa.default_memory_pool().release_unused()
    return rows, counts


def payload_bytes(batch: MicroBatch) -> int:
    """Payload bytes of all the batch's rows (parts are summed, not iterated)."""
    n = 0
    for s in batch.slices.values():
        for part in _parts(s.records):
            if isinstance(part, RecordBatch):
                n += len(part.data)
            else:
                n += sum(len(r.payload) for r in part)
    return n


# The inbox file's columns as Spark reads them (``_record_batch``'s schema).
# Given up front, Spark plans the read without opening the file's footer on
# the driver: measured 0.1-0.4 s per batch here, time in which no task runs.
INBOX_SCHEMA = (
    "lsn BIGINT, core INT, seq BIGINT, collection STRING, op STRING, key STRING,"
    " new_json STRING, old_json STRING, ingest_ts TIMESTAMP, batch_id BIGINT, depth INT,"
    " source STRING"
)


def _read_inbox(spark: Any, file: Path) -> Any:
    return spark.read.schema(INBOX_SCHEMA).parquet(str(file))


def row_group_rows(total: int, parallelism: int, max_rows: int = _MAX_ROW_GROUP) -> int:
    """Rows per row group (= per Spark task) for a batch of ``total`` rows.

    The group count is a multiple of ``parallelism`` and the groups are equal,
    so every wave of tasks keeps every core busy: 300k rows on 2 cores as
    131k + 131k + 38k left one core idle for the whole last wave; as 4 x 75k
    both cores finish together. Groups stay within ``max_rows`` (capped at
    ``_MAX_ROW_GROUP``: what this process holds before writing) and, but for
    a small batch that stays one task, at least ``_MIN_ROW_GROUP`` (or
    ``max_rows``, if that is less: large events).
    """
    most = max(1, min(_MAX_ROW_GROUP, max_rows))
    cores = max(1, parallelism)
    groups = -(-total // most)  # fewest groups within the maximum
    groups = max(cores, -(-groups // cores) * cores)  # whole waves
    return max(min(_MIN_ROW_GROUP, most), -(-total // groups))


def _inbox_file(inbox: Path, batch_id: int) -> Path:
    return inbox / f"b{batch_id:012d}-{next(_inbox_seq)}.parquet"


def _contract_frame(raw: Any) -> Any:
    """The batch DataFrame (``BATCH_COLUMNS``) over ``batch_table``-shaped rows."""
    return raw.select(*_contract_columns(raw.sparkSession))


_contract_cache: tuple[Any, list[Any]] | None = None


def _contract_columns(spark: Any) -> list[Any]:
    """The contract's select list, built once per session: Columns are
    unresolved expressions, and building them is a py4j call each."""
    global _contract_cache
    if _contract_cache is None or _contract_cache[0] is not spark:
        from pyspark.sql import functions as F

        parsed = {"new": F.parse_json("new_json"), "old": F.parse_json("old_json")}
        cols = [parsed[c].alias(c) if c in parsed else F.col(c) for c in BATCH_COLUMNS]
        _contract_cache = (spark, cols)
    return _contract_cache[1]


def uses_inbox(cfg: Config) -> bool:
    """Local masters read the driver's files; remote ones may not share its disk."""
    return not cfg.spark.remote and cfg.spark.master.startswith("local")


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


@dataclass(slots=True)
class _Status:
    state: State = State.STARTING
    session_error: str | None = None
    session_attempts: int = 0
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


class SparkExecutor:
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
        self._inbox: Path | None = cfg.data_dir / "spark-inbox" if uses_inbox(cfg) else None
        self._cores: int | None = None  # Spark's default parallelism, asked once
        self._built: Any | None = None  # what the factory returned, even if unused
        self._handlers: list[tuple[str, Handler]] = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eventplane-spark")
        # Builds the inbox file of the batch after the running one (``prepare``).
        self._prep_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eventplane-prep")
        self._prepared: dict[int, tuple[Future[tuple[int, dict[str, int]]], Path]] = {}
        self._ready = asyncio.Event()
        self._lock = asyncio.Lock()
        self._boot_task: asyncio.Task[None] | None = None
        self._status = _Status()

    # -- wiring ------------------------------------------------------------

    def add_stage(self, stage: BatchStage) -> None:
        """Plug a consumer of each batch's DataFrame in (triggers). Runs in order added."""
        self._stages.append(stage)

    @property
    def session(self) -> Any | None:
        return self._session

    @property
    def sinks(self) -> Sequence[CdcSink]:
        return tuple(self._sinks)

    def _default_factory(self) -> Any:
        s = self.cfg.spark
        return sparkmod.build_session(s.master, s.app_name, s.ui, s.log_level, s.conf, s.remote)

    # -- Executor protocol -------------------------------------------------

    async def start(self) -> None:
        """Check configuration now (raises ConfigError); build Spark in the background."""
        self._handlers = self._load_handlers()
        self._check_stream_paths()
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
        for sink in self._sinks:
            self._status.streams[sink.name] = sink.last_batch_id
        if self._session is not None:
            self._mark_ready()
        else:
            self._boot_task = asyncio.create_task(self._boot(), name="spark-session-boot")

    def ready(self) -> bool:
        return self._status.state is State.READY

    async def wait_ready(self) -> None:
        """Return once batches can run (tests, and callers that prefer to wait)."""
        await self._ready.wait()
        if self._status.state is not State.READY:
            raise ExecutorError("the Spark executor stopped before it became ready")

    async def execute(self, batch: MicroBatch) -> None:
        if self._status.state in (State.STOPPING, State.STOPPED):
            raise ExecutorError(f"batch {batch.batch_id}: the Spark executor is stopped")
        await self.wait_ready()  # consumers hold their batches until Spark is up
        async with self._lock:
            await self._execute_locked(batch)

    def prepare(self, batch: MicroBatch) -> None:
        """Start writing ``batch``'s inbox file while the batch before it runs in Spark.

        A hint from the planner, which closed and planned ``batch`` early: the
        Python half of a batch (decode, Arrow, Parquet; ~1.5 us per event)
        then overlaps the Spark half of the previous one instead of following
        it with Spark idle. ``execute`` uses the file if it was written and
        builds it itself otherwise (no inbox, a failed write, a retry).
        """
        if self._inbox is None or self._cores is None or batch.batch_id in self._prepared:
            return
        if self._status.state in (State.STOPPING, State.STOPPED):
            return
        file = _inbox_file(self._inbox, batch.batch_id)
        future = self._prep_pool.submit(
            write_batch_file, batch, file, self._cores, self.cfg.microbatch.build_max_bytes
        )
        self._prepared[batch.batch_id] = (future, file)

    def _take_prepared(self, batch: MicroBatch) -> tuple[Path, int, dict[str, int]] | None:
        """The prepared inbox file of ``batch`` (waiting for it), or None. Worker thread."""
        prepared = self._prepared.pop(batch.batch_id, None)
        if prepared is None:
            return None
        future, file = prepared
        try:
            rows, counts = future.result()
        except Exception as exc:  # the inline build below reports a real problem again
            log.warning("batch_prepare_failed", batch_id=batch.batch_id, error=repr(exc))
            file.unlink(missing_ok=True)
            return None
        return file, rows, counts

    async def stop(self) -> None:
        """Wait for the batch in flight, close streams, stop the session we built."""
        if self._status.state is State.STOPPED:
            return
        self._status.state = State.STOPPING
        self._ready.set()  # release waiters; they see STOPPING and raise
        if self._boot_task is not None and not self._boot_task.done():
            self._boot_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._boot_task
        loop = asyncio.get_running_loop()
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
            "session_error": st.session_error,
            "session_attempts": st.session_attempts,
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
                s.name: {"path": str(s.path), "last_batch_id": st.streams.get(s.name)}
                for s in self._sinks
            },
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
        for i, s in enumerate(self.cfg.cdc.streams):
            p = Path(s.path).resolve()
            for j, q in seen:
                if p == q or p.is_relative_to(q) or q.is_relative_to(p):
                    errors.append(
                        f"cdc.streams[{i}].path: {p} overlaps cdc.streams[{j}].path ({q}); "
                        f"each stream needs its own folder (a reader of one would see both)"
                    )
            seen.append((i, p))
            try:
                (p / "_eventplane").mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                errors.append(f"cdc.streams[{i}].path: cannot create {p} ({exc.strerror})")
        if errors:
            raise ConfigError(errors, str(self.cfg.source or "config"))

    def _open_sinks(self) -> list[CdcSink]:
        sinks: list[CdcSink] = []
        try:
            for s in self.cfg.cdc.streams:
                sink = CdcSink(s, wal_id=self.wal_id, cores=self.cfg.daemon.cores)
                sink.open()
                sinks.append(sink)
        except BaseException:
            for sink in sinks:
                sink.close()
            raise
        return sinks

    async def _boot(self) -> None:
        """Build the session, retrying with backoff; a routine that only ends by success."""
        loop = asyncio.get_running_loop()
        mb = self.cfg.microbatch
        delay = mb.retry_initial_ms / 1000
        while True:
            self._status.session_attempts += 1
            started = time.monotonic()
            try:
                session = await loop.run_in_executor(self._pool, self._build)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._status.session_error = f"{type(exc).__name__}: {exc}"
                log.error(
                    "spark_session_failed",
                    attempt=self._status.session_attempts,
                    retry_in_s=delay,
                    error=self._status.session_error,
                )
                await self._sleep(delay)
                delay = min(delay * 2, mb.retry_max_ms / 1000)
                continue
            if self._status.state is not State.STARTING:  # stop() raced us
                return
            self._session = session
            self._status.session_error = None
            self._mark_ready()
            log.info(
                "spark_session_ready",
                seconds=round(time.monotonic() - started, 3),
                **self.status()["spark"],
            )
            return

    def _build(self) -> Any:
        """Worker thread: build, and remember the session even if boot is cancelled."""
        session = self._factory()
        self._built = session
        return session

    def _mark_ready(self) -> None:
        self._status.state = State.READY
        self._ready.set()

    def _close_in_thread(self) -> None:
        for sink in self._sinks:
            sink.close()
        # _built covers a session whose build finished after stop() cancelled the boot.
        session = self._session or self._built
        if self._owns_session and session is not None:
            try:
                session.stop()
            except Exception:
                log.exception("spark_session_stop_failed")
        self._session = self._built = None

    # -- one batch -----------------------------------------------------------

    async def _execute_locked(self, batch: MicroBatch) -> None:
        started = time.monotonic()
        bound = log.bind(batch_id=batch.batch_id)
        loop = asyncio.get_running_loop()
        ctx = contextvars.copy_context()
        try:
            outcome = await loop.run_in_executor(self._pool, ctx.run, self._run_in_spark, batch)
            for stage, result in outcome.stage_results:
                await stage.finish(batch, result)
            crash_point("executor.after_commit")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Logged once, by the planner (microbatch_failed: attempt, retry delay).
            self._record_failure(batch, exc)
            if isinstance(exc, DaemonError):
                raise
            raise ExecutorError(
                f"micro-batch {batch.batch_id} ({batch.rows} rows) failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        seconds = time.monotonic() - started
        self._record_success(batch, outcome, seconds)
        bound.debug(
            "microbatch_committed",
            rows=outcome.rows,
            seconds=round(seconds, 4),
            spark_seconds=round(outcome.spark_seconds, 4),
            streams={c.stream: ("noop" if c.noop else c.rows) for c in outcome.commits},
        )

    def _run_in_spark(self, batch: MicroBatch) -> _Outcome:
        """Steps 1-5 of the module docstring. Runs in the worker thread."""
        started = time.monotonic()
        spark = self._session
        if spark is None:
            raise ExecutorError("no SparkSession (the executor was stopped)")
        cached = False
        try:
            prepared = self._take_prepared(batch)
            if prepared is None:
                parallelism = self._parallelism(spark)
                df, nrows, counts = batch_frame(
                    spark, batch, self._inbox, parallelism, self.cfg.microbatch.build_max_bytes
                )
            else:
                file, nrows, counts = prepared
                df = _contract_frame(_read_inbox(spark, file))
            todo = [(sink, self._rows_for(sink, counts)) for sink in self._sinks]
            pending = [t for t in todo if t[1] and t[0].last_batch_id < batch.batch_id]
            readers = len(pending) + len(self._stages) + len(self._handlers)
            if readers > 1:
                df, cached = df.persist(), True
            commits = [sink.commit(df, batch, rows) for sink, rows in todo]
            results = [(st, st.run_in_spark(spark, df, batch)) for st in self._stages]
            if self._handlers:
                contract = df.select(*CDC_COLUMNS)
                for _, func in self._handlers:
                    func(contract, batch.batch_id)
        finally:
            if cached:
                df.unpersist(blocking=False)
            if self._inbox is not None:
                for f in self._inbox.glob(f"b{batch.batch_id:012d}-*.parquet"):
                    f.unlink(missing_ok=True)
        return _Outcome(nrows, commits, results, time.monotonic() - started)

    def _parallelism(self, spark: Any) -> int:
        if self._cores is None:
            self._cores = int(spark.sparkContext.defaultParallelism) if self._inbox else 1
        return self._cores

    @staticmethod
    def _rows_for(sink: CdcSink, counts: dict[str, int]) -> int:
        if sink.stream.collections == ("*",):
            return sum(counts.values())
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
        # The eventplane_microbatch_* series are the planner's: it sees every
        # batch and attempt, whatever executor runs them.

    def _record_failure(self, batch: MicroBatch, exc: BaseException) -> None:
        st = self._status
        st.batches_failed += 1
        st.last_error = f"{type(exc).__name__}: {exc}"[:2000]
        st.last_error_batch_id = batch.batch_id
        st.last_error_at = time.time()
