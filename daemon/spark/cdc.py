"""Exactly-once CDC tables: Parquet partitioned by ``collection``, one ledger per stream.

Layout of a stream's ``path``::

    <path>/collection=orders/part-b000000000042-00000-<uuid>.c000.snappy.parquet
    <path>/_eventplane/ledger.json          committed batches (the commit record)
    <path>/_eventplane/pending/b<id>.json   commit intent: staged file -> final file
    <path>/_eventplane/staging/b<id>/       where Spark writes a batch (invisible)
    <path>/_eventplane/lock                 flock: one writer per stream; names the holder
    <path>/_eventplane/generation           seqlock around changes that remove files (snapshot.py)
    <path>/_common_metadata                 the table's schema (also in each collection=...)
    <path>/_eventplane/compact/c<id>.json   compaction intent (daemon/spark/compact.py)
    <path>/_eventplane/compact/c<id>/       where a compaction builds a partition folder

Readers (``spark.read.parquet(path)``, pyarrow, DuckDB) skip every path
component that starts with ``_`` or ``.``, so only published files are seen.
Published names carry the batch id, which is how recovery recognises them;
files a compaction merged are named ``part-c<id>-b<first>-b<last>-...`` (the
batches they hold) and are never orphans (:mod:`daemon.spark.compact`).
Publishing and the ledger write take ``CdcSink.commit_lock``, under which a
compaction swaps a partition folder and records itself.

Commit protocol for batch B of stream S (the steps are marked in the code):

0. **Idempotency.** If the ledger's last committed id >= B, the batch is
   committed: check that its recorded per-core LSN ranges equal the batch's
   (same id must mean same rows) and return without writing. A pending commit
   intent left by an earlier attempt is completed first (roll forward).
1. **Stage.** Spark writes the stream's rows of B under ``staging/b<B>/``,
   which is emptied first, so a failed attempt's leftovers are replaced. A
   batch in a raw inbox file is written without a Spark job, by Spark's own
   Parquet writer in the driver, one thread per split (:class:`RawInbox`,
   ``DirectWrite.java``): the same files, without the job's fixed cost.
2. **Intent.** fsync every staged file, then write ``pending/b<B>.json``
   listing each staged file and its final name (atomic replace + fsync).
   This is the point of no return: from here the commit only rolls forward.
3. **Publish.** Rename each staged file to its final name in its
   ``collection=...`` folder (each rename is atomic, so a reader never sees a
   partial file), then fsync the touched folders.
4. **Ledger.** Append ``(B, per-core LSN ranges, rows, files)`` to the ledger,
   which also carries the WAL id and ``cores`` (identity, invariant 13);
   atomic replace + fsync. The batch is committed for this stream.
5. **Clean.** Remove the intent and the staging folder.

After step 4 the stream makes sure the table root and every ``collection=...``
folder hold a ``_common_metadata`` file (a Parquet footer without rows) with
the schema of the files it writes (:meth:`CdcSink._write_summaries`): Spark
infers a table's schema from that file when it is there, and otherwise from
any one data file, so a table with files from before ``event_id`` and
``event_time`` existed would show those columns or not by chance.

Recovery when a stream opens (before the first batch):

- a ledger from another WAL or another ``cores`` count refuses to start;
- every intent above the ledger's last id is rolled forward (steps 3-5;
  renames already done are recognised), intents at or below it are removed;
- staging folders without an intent are rolled back (deleted): Spark wrote
  them, but nothing was promised;
- interrupted compactions roll forward (their folder swap happened) or back
  (:func:`daemon.spark.compact.recover`);
- published-looking files (``part-b<id>-*``) with an id above the ledger's
  last and no intent are orphans and are deleted, as are temp files;
- partitions a retention run had hidden (``.expired-*``) are logged if they
  were not yet, and deleted (``daemon/spark/retention.py``).

``partition_by`` (``[[cdc.streams]]``) adds ``date``/``hour`` folders under
each ``collection=...`` (``time_columns``); the ledger records it, and a
stream whose ``partition_by`` changed after its first commit refuses to open.

Crash points: ``EVENTPLANE_CRASH_AT=<name>[@<n>]`` makes the process SIGKILL
itself the n-th time (default: first) it reaches ``crash_point(name)``; the
names are in ``CRASH_POINTS``. Crash tests aim at each step with them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog

from daemon import snapshot
from daemon.config import CdcStream
from daemon.errors import DaemonError, IdentityMismatchError, LsnRegressionError
from daemon.plane.batch import MicroBatch, Slice
from daemon.spark import quarantine
from daemon.spark.durable import atomic_write_json, fsync_dir, fsync_file
from wal import lockfile
from wal.record import Record

log = structlog.get_logger("eventplane.cdc")

LEDGER_FORMAT = 1
META_DIR = "_eventplane"
# Ranges of this many recent batches are kept for the re-run check; older
# re-runs are still no-ops (id <= last), just without the range comparison.
# A restart re-runs the batches committed since the last watermark flush
# (``consumer.watermark_flush_ms``, 5 s by default) and the two the planner
# had planned: 128 covers 25 batches a second at the default. The ledger
# is rewritten on every commit: with 8 files per batch it is 121 KiB and
# takes 1.5 ms; 1024 batches made it 960 KiB and 10 ms, and 4 MiB and 25 ms
# with 40 files per batch (fsync included, ad-hoc script).
KEEP_BATCHES = 128
_PUBLISHED = re.compile(r"^part-b(\d{12})-")
# A compaction's merged file: compaction id, first and last batch it holds.
_COMPACTED = re.compile(r"^part-c(\d{12})-b(\d{12})-b(\d{12})-")
# Compactions the ledger remembers (the ledger is rewritten on every commit).
KEEP_COMPACTIONS = 16
# Contract columns of a CDC table (README, "CDC tables"), in order.
CDC_COLUMNS = (
    "lsn",
    "core",
    "seq",
    "collection",
    "op",
    "key",
    "new",
    "old",
    "ingest_ts",
    "batch_id",
    "event_id",
    "event_time",
)
# The payloads' JSON text, written next to ``new``/``old`` (VARIANT) in every
# file. pyarrow, pandas and Polars cannot decode VARIANT; they (and DuckDB)
# query this text with their own JSON functions (docs/cdc.md, "Reading a table").
JSON_COLUMNS = ("new_json", "old_json")
# Columns of a CDC table's files, in order (``collection`` is the partition).
TABLE_COLUMNS = (*CDC_COLUMNS, *JSON_COLUMNS)
# Parquet writer options of the CDC write. ``lsn`` and ``seq`` are unique by
# construction and ``key`` nearly so within a batch: Parquet would build a
# dictionary for them alongside the plain values, then drop it at the first
# page. Ten 100k-row batches measured 18-20 % less JVM CPU without those
# dictionaries, and the same bytes on disk (docs/cdc.md, "Tuning the write").
# A producer's ``event_id`` is meant to be unique too.
PARQUET_OPTIONS = {
    "parquet.enable.dictionary#lsn": "false",
    "parquet.enable.dictionary#seq": "false",
    "parquet.enable.dictionary#key": "false",
    "parquet.enable.dictionary#event_id": "false",
    # The payloads' text is nearly as unique: 200k events wrote with 13-16 %
    # less JVM CPU without its dictionary, in the same bytes (docs/cdc.md,
    # "Payload layout"; 15 % more only where payloads repeat a lot).
    "parquet.enable.dictionary#new_json": "false",
    "parquet.enable.dictionary#old_json": "false",
}
# What a batch's write skips on top, in a stream that compacts: its files live
# only until a compaction merges them, which writes with ``PARQUET_OPTIONS``
# (the files that stay). So the batch write drops what pays off only in files
# that stay:
# - the dictionary of the VARIANT values. It saves bytes where payloads repeat
#   (18 % of the bench's, whose 1M events hold 35k distinct documents) and
#   nothing where they do not;
# - min/max statistics of the payload columns, which no query prunes by.
# 300k-event batches took 24 % less JVM CPU with both (1.42 against 1.87 CPU s,
# medians of 6 rounds in one session; docs/cdc.md, "Tuning the write").
# A stream without compaction keeps its batch files: they get PARQUET_OPTIONS.
_PAYLOAD_LEAVES = ("new.value", "new.metadata", "old.value", "old.metadata", *JSON_COLUMNS)
TRANSIENT_PARQUET_OPTIONS = {
    **PARQUET_OPTIONS,
    "parquet.enable.dictionary#new.value": "false",
    "parquet.enable.dictionary#old.value": "false",
    **{f"parquet.column.statistics.enabled#{leaf}": "false" for leaf in _PAYLOAD_LEAVES},
}
# Hadoop options of step 1's write only (the batch's staging folder), for its
# fixed cost: without Hadoop's native library, the local file system forks a
# ``chmod`` process for every folder and file it creates (docs/performance.md,
# "The fixed cost of a batch"). 19 forks per 4-collection batch became none:
# - the plain local file system writes no ``.crc`` file beside each staged
#   file (the daemon fsyncs and renames the staged files itself, and never
#   publishes a ``.crc``). Uncached, so that the session's shared ``file:``
#   file system (whatever Hadoop's defaults or ``[spark.conf]`` made it)
#   stays as it is for everything else;
# - no ``_SUCCESS`` marker: a staged batch is complete when Spark's write
#   returns, and ``_staged_files`` skipped the marker anyway.
# - ``NIO_LOCAL_FS`` instead of Hadoop's plain file system where the JVM can
#   load it (``staging_write_options``): it sets permissions without a fork,
#   and the 9 left became none.
STAGING_WRITE_OPTIONS = {
    "fs.file.impl": "org.apache.hadoop.fs.RawLocalFileSystem",
    "fs.file.impl.disable.cache": "true",
    "mapreduce.fileoutputcommitter.marksuccessfuljobs": "false",
}
# Hadoop's plain local file system, setting permissions through java.nio
# instead of a forked ``chmod`` (jvm/src). In the jar make builds when javac
# exists (``session.HADOOP_JAR``), which a local master's driver JVM gets on
# its class path.
NIO_LOCAL_FS = "eventplane.hadoop.NioLocalFileSystem"
_staging_options: tuple[Any, dict[str, str]] | None = None
_staging_fallback_logged = False
# Step 1 without a Spark job (``RawInbox``): in the jar with the raw
# inbox's reader, whose rows it writes.
DIRECT_WRITE = "eventplane.inbox.DirectWrite"
_direct_usable: tuple[Any, str | None] | None = None  # (session, why not)
# The folders Hadoop's file committer (algorithm 1, application attempt 0)
# creates under a job's output before its tasks write: made by the daemon
# beforehand (``os.makedirs``, no fork), Hadoop finds them and creates none.
# Where a cluster names them otherwise, they stay empty and go with the
# staging folder.
STAGING_JOB_DIRS = Path("_temporary") / "0" / "_temporary"
# The table's schema for readers that infer it: Spark (without ``mergeSchema``)
# reads this file's footer first and only falls back to one data file's.
SUMMARY_FILE = "_common_metadata"
# Footer key under which Spark records the schema it wrote (and reads back).
SPARK_SCHEMA_KEY = b"org.apache.spark.sql.parquet.row.metadata"

# --------------------------------------------------------------------------
# Crash points

ENV_CRASH_AT = "EVENTPLANE_CRASH_AT"
COMMIT_CRASH_POINTS = (
    "cdc.before_stage",  # nothing of the batch written
    "cdc.after_stage",  # staged files exist, no intent
    "cdc.after_quarantine",  # set-aside rows durable, no intent, not committed
    "cdc.after_intent",  # intent durable, nothing published
    "cdc.mid_publish",  # first file renamed, others still staged
    "cdc.after_publish",  # all files visible, ledger not updated
    "cdc.after_ledger",  # committed, intent and staging not cleaned
    "executor.after_commit",  # every sink and stage done, execute() not returned
)
# Retention of one partition (daemon/spark/retention.py):
RETENTION_CRASH_POINTS = (
    "cdc.retention.before_rename",  # partition visible, nothing done
    "cdc.retention.after_rename",  # partition hidden (.expired-*), not logged
    "cdc.retention.after_log",  # hidden and logged, files not deleted
    "cdc.retention.mid_delete",  # hidden, logged, first file deleted
)
# A compaction's steps (daemon/spark/compact.py): rolled back up to the swap,
# forward after it.
COMPACT_CRASH_POINTS = (
    "cdc.compact.after_write",  # merged files staged, no intent
    "cdc.compact.after_intent",  # intent durable, partition untouched
    "cdc.compact.mid_build",  # new folder partly built (hidden)
    "cdc.compact.before_swap",  # new folder complete and durable, not swapped
    "cdc.compact.after_swap",  # merged files visible, ledger not updated
    "cdc.compact.after_ledger",  # recorded; old folder, intent not removed
    "cdc.compact.mid_clean",  # old folder removed, intent not yet
)
# A replay of quarantined rows (CdcSink.replay_quarantine): rolled back before
# its intent, forward after it.
REPLAY_CRASH_POINTS = (
    "cdc.replay_after_intent",  # rows staged and listed, nothing published
    "cdc.replay_after_publish",  # rows visible, still in the quarantine file
)
CRASH_POINTS = (
    COMMIT_CRASH_POINTS + RETENTION_CRASH_POINTS + COMPACT_CRASH_POINTS + REPLAY_CRASH_POINTS
)
_crash_hits: dict[str, int] = {}
_crash_lock = threading.Lock()


def crash_point(name: str) -> None:
    """SIGKILL this process here if ``$EVENTPLANE_CRASH_AT`` names this point.

    ``name@n`` fires at the n-th arrival, so a full-daemon test can let some
    batches commit first. Costs one environment lookup when unset.
    """
    wanted = os.environ.get(ENV_CRASH_AT)
    if not wanted:
        return
    target, _, nth = wanted.partition("@")
    if target != name:
        return
    with _crash_lock:
        _crash_hits[name] = hits = _crash_hits.get(name, 0) + 1
    if hits < (int(nth) if nth.isdigit() else 1):
        return
    # os.write: unbuffered, so the line survives the kill; tests look for it.
    os.write(2, f"eventplane: crash point {name} reached (hit {hits}); SIGKILL\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(10)  # SIGKILL is asynchronous only in theory; never run past it


# --------------------------------------------------------------------------
# Errors


class CdcError(DaemonError):
    """Base error of CDC streams."""


class CdcLedgerMismatchError(CdcError):
    """A committed batch id came back with different LSN ranges."""


class CdcRecoveryError(CdcError):
    """An interrupted commit cannot be completed from what is on disk."""


class CdcStreamLockedError(CdcError):
    """Another process writes this stream."""


class CdcQuarantineLimitError(CdcError):
    """More rows of a batch fail alone than ``quarantine_max_rows``."""


class CdcLayoutError(CdcError):
    """The stream's partition_by differs from the layout its table was written with."""


def _ranges_to_json(ranges: Mapping[int, tuple[int, int]]) -> dict[str, list[int]]:
    return {str(c): [a, b] for c, (a, b) in sorted(ranges.items())}


def _ranges_from_json(raw: Mapping[str, Any]) -> dict[int, tuple[int, int]]:
    return {int(c): (int(v[0]), int(v[1])) for c, v in raw.items()}


# --------------------------------------------------------------------------
# Ledger


@dataclass(slots=True)
class LedgerEntry:
    batch_id: int
    ranges: dict[int, tuple[int, int]]
    rows: int
    files: list[str]
    committed_at: float
    quarantined: int = 0  # rows the batch set aside (quarantine.py); not in ``rows``

    def to_json(self) -> dict[str, Any]:
        out = {
            "batch_id": self.batch_id,
            "ranges": _ranges_to_json(self.ranges),
            "rows": self.rows,
            "files": self.files,
            "committed_at": self.committed_at,
        }
        if self.quarantined:
            out["quarantined"] = self.quarantined
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> LedgerEntry:
        return cls(
            int(raw["batch_id"]),
            _ranges_from_json(raw["ranges"]),
            int(raw["rows"]),
            [str(f) for f in raw["files"]],
            float(raw["committed_at"]),
            int(raw.get("quarantined", 0)),
        )


@dataclass(slots=True)
class Ledger:
    """The commit record of one stream. Lives in ``_eventplane/ledger.json``."""

    stream: str
    wal_id: str
    cores: int
    last_batch_id: int = 0
    high_lsn: dict[int, int] = field(default_factory=dict)  # core -> last committed LSN
    rows_total: int = 0
    batches: list[LedgerEntry] = field(default_factory=list)  # newest last, bounded
    # The table's partition columns ([[cdc.streams]] partition_by) when it was
    # created; ledgers from before the key existed were ["collection"].
    partition_by: list[str] = field(default_factory=lambda: ["collection"])
    # Compactions (daemon/spark/compact.py): the last id, and the newest
    # records (id, partition, inputs, outputs, batch range), bounded.
    last_compaction_id: int = 0
    compactions: list[dict[str, Any]] = field(default_factory=list)

    def copy(self) -> Ledger:
        return replace(
            self,
            high_lsn=dict(self.high_lsn),
            batches=list(self.batches),
            compactions=list(self.compactions),
            partition_by=list(self.partition_by),
        )

    def add_compaction(self, record: dict[str, Any], keep: int = KEEP_COMPACTIONS) -> None:
        self.compactions.append(record)
        del self.compactions[:-keep]
        self.last_compaction_id = max(self.last_compaction_id, int(record["id"]))

    def entry(self, batch_id: int) -> LedgerEntry | None:
        for e in reversed(self.batches):
            if e.batch_id == batch_id:
                return e
            if e.batch_id < batch_id:
                return None
        return None

    def append(self, entry: LedgerEntry, keep: int = KEEP_BATCHES) -> None:
        self.batches.append(entry)
        del self.batches[:-keep]
        self.last_batch_id = entry.batch_id
        self.rows_total += entry.rows
        for core, (_, last) in entry.ranges.items():
            self.high_lsn[core] = max(self.high_lsn.get(core, 0), last)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": LEDGER_FORMAT,
            "stream": self.stream,
            "wal_id": self.wal_id,
            "cores": self.cores,
            "last_batch_id": self.last_batch_id,
            "high_lsn": {str(c): v for c, v in sorted(self.high_lsn.items())},
            "rows_total": self.rows_total,
            "batches": [e.to_json() for e in self.batches],
            "partition_by": self.partition_by,
            "last_compaction_id": self.last_compaction_id,
            "compactions": self.compactions,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Ledger:
        if raw.get("format") != LEDGER_FORMAT:
            raise CdcError(f"ledger format {raw.get('format')!r} is not {LEDGER_FORMAT}")
        return cls(
            stream=str(raw["stream"]),
            wal_id=str(raw["wal_id"]),
            cores=int(raw["cores"]),
            last_batch_id=int(raw["last_batch_id"]),
            high_lsn={int(c): int(v) for c, v in raw["high_lsn"].items()},
            rows_total=int(raw.get("rows_total", 0)),
            batches=[LedgerEntry.from_json(e) for e in raw["batches"]],
            partition_by=[str(c) for c in raw.get("partition_by", ["collection"])],
            last_compaction_id=int(raw.get("last_compaction_id", 0)),
            compactions=[dict(c) for c in raw.get("compactions", [])],
        )


def read_ledger(path: Path) -> Ledger | None:
    """The stream's ledger, or None when nothing was ever committed there."""
    file = path / META_DIR / "ledger.json"
    try:
        raw = json.loads(file.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CdcError(f"{file}: unreadable ledger ({exc}); restore it from backup") from exc
    try:
        return Ledger.from_json(raw)
    except (KeyError, TypeError, ValueError, CdcError) as exc:
        raise CdcError(f"{file}: malformed ledger ({exc}); restore it from backup") from exc


# --------------------------------------------------------------------------
# The sink


@dataclass(frozen=True, slots=True)
class CommitResult:
    stream: str
    batch_id: int
    rows: int
    files: int
    noop: bool  # the batch was committed before (a re-run)
    seconds: float
    quarantined: int = 0  # rows set aside in the stream's quarantine


@dataclass(slots=True)
class RecoveryReport:
    rolled_forward: list[int] = field(default_factory=list)
    intents_removed: list[int] = field(default_factory=list)
    staging_removed: list[str] = field(default_factory=list)
    orphans_removed: list[str] = field(default_factory=list)
    compactions_rolled_forward: list[int] = field(default_factory=list)
    compactions_rolled_back: list[int] = field(default_factory=list)


class CdcSink:
    """One CDC stream: stages with Spark, publishes with renames, commits in its ledger.

    ``open`` and ``commit`` block (file system, py4j); the executor calls them
    from its worker thread. One batch at a time; a compaction may run in
    another thread meanwhile, and ``commit_lock`` orders the steps where the
    two touch the same folders and the ledger (publish, ledger, swap).
    """

    def __init__(
        self,
        stream: CdcStream,
        *,
        wal_id: str,
        cores: int,
        keep_batches: int = KEEP_BATCHES,
        data_dir: Path | None = None,
    ) -> None:
        self.stream = stream
        self.path = Path(stream.path)
        self.meta = self.path / META_DIR
        self.wal_id = wal_id
        self.cores = cores
        self.keep_batches = keep_batches
        self.data_dir = data_dir  # the writing daemon's, named in the lock file
        self._ledger: Ledger | None = None
        self._lock_fd: int | None = None
        # Folders whose _common_metadata this process checked or wrote.
        self._summarized: set[Path] = set()
        # (session, table columns, select list, collection filter) of the write
        # (_write_columns).
        self._columns: tuple[Any, tuple[str, ...], SelectList, Any | None] | None = None
        # (session, its staging options, the write's options) (_write_staged).
        self._options: tuple[Any, dict[str, str], WriteOptions] | None = None
        # (session, table columns, then the table columns, collections and
        # partition_by as Java String arrays) (_write_direct).
        self._direct_args: tuple[Any, ...] | None = None
        self.commit_lock = threading.RLock()
        # Leaf partitions a compaction claimed (daemon/spark/compact.py), by
        # relative path; retention leaves them alone. Under commit_lock.
        self.compacting: set[str] = set()
        # Rows in the stream's quarantine (quarantine.py), counted at open.
        self.quarantined = 0

    @property
    def name(self) -> str:
        return self.stream.name

    @property
    def ledger(self) -> Ledger:
        if self._ledger is None:
            raise CdcError(f"stream {self.name!r} is not open")
        return self._ledger

    @property
    def last_batch_id(self) -> int:
        return self.ledger.last_batch_id

    # -- lifecycle ---------------------------------------------------------

    def open(self) -> RecoveryReport:
        """Lock the stream, check its identity, finish or undo interrupted commits."""
        for d in (self.path, self.meta, self.meta / "pending", self.meta / "staging"):
            d.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            self._ledger = self._load_or_create_ledger()
            # A change killed between its two generation bumps ends here, and
            # a reader whose listing spans this restart lists again.
            snapshot.open_generation(self.path)
            report = RecoveryReport()
            self._remove_temp_files()
            self._complete_pending(report)
            pending = {bid for bid, _ in self._intents()}
            quarantine.recover(self.meta, self.ledger.last_batch_id, pending)
            self._complete_replays()
            self.quarantined = quarantine.count(self.meta)
            self._remove_staging(report)
            from daemon.spark import compact

            compact.recover(self, report)
            self._remove_orphans(report)
            from daemon.spark import retention  # it imports this module

            retention.recover(self.path, self.name)
        except BaseException:
            self.close()
            raise
        if (
            report.rolled_forward
            or report.staging_removed
            or report.orphans_removed
            or report.compactions_rolled_forward
            or report.compactions_rolled_back
        ):
            log.warning(
                "cdc_recovered",
                stream=self.name,
                rolled_forward=report.rolled_forward,
                intents_removed=report.intents_removed,
                staging_removed=report.staging_removed,
                orphans_removed=report.orphans_removed,
                compactions_rolled_forward=report.compactions_rolled_forward,
                compactions_rolled_back=report.compactions_rolled_back,
            )
        return report

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _lock(self) -> None:
        # The lock file names this daemon (pid, host, since, data_dir, WAL id),
        # so a second writer is told who holds the stream; the flock fences.
        holder = {"stream": self.name, "wal_id": self.wal_id}
        if self.data_dir is not None:
            holder["data_dir"] = str(self.data_dir)
        try:
            self._lock_fd = lockfile.take(self.meta / "lock", holder)
        except lockfile.LockHeld as exc:
            raise CdcStreamLockedError(
                f"stream {self.name!r}: {self.path} is locked by another process (another "
                f"eventplane daemon writes it): its lock {exc}; stop that one or use another path"
            ) from None

    def _load_or_create_ledger(self) -> Ledger:
        ledger = read_ledger(self.path)
        if ledger is None:
            ledger = Ledger(self.name, self.wal_id, self.cores)
            ledger.partition_by = list(self.stream.partition_by)
            atomic_write_json(self.meta / "ledger.json", ledger.to_json())
            return ledger
        self._check_layout(ledger)
        changed = []
        if ledger.cores != self.cores:
            changed.append(f"cores {ledger.cores} -> {self.cores}")
        if ledger.wal_id and self.wal_id and ledger.wal_id != self.wal_id:
            changed.append(f"WAL id {ledger.wal_id} -> {self.wal_id}")
        if changed:
            raise IdentityMismatchError(
                f"stream {self.name!r}: {self.path} was written by another event plane "
                f"({', '.join(changed)}). Its committed LSNs mean nothing to this WAL. "
                f"Point [[cdc.streams]] path at a new folder, or move the old one away."
            )
        if not ledger.wal_id and self.wal_id:
            ledger.wal_id = self.wal_id
            atomic_write_json(self.meta / "ledger.json", ledger.to_json())
        return ledger

    def _check_layout(self, ledger: Ledger) -> None:
        """Refuse a partition_by other than the table's: Spark's partition
        discovery fails on a folder that mixes ``collection=x/part-*`` and
        ``collection=x/date=d/part-*``. An empty table takes the new layout."""
        wanted = list(self.stream.partition_by)
        if ledger.partition_by == wanted:
            return
        if ledger.last_batch_id == 0 and not committed_files(self.path):
            ledger.partition_by = wanted
            atomic_write_json(self.meta / "ledger.json", ledger.to_json())
            return
        raise CdcLayoutError(
            f"stream {self.name!r}: partition_by = {wanted} but {self.path} was written "
            f"with partition_by = {ledger.partition_by} (batches up to "
            f"{ledger.last_batch_id}). One folder cannot mix layouts: readers' partition "
            f"discovery fails on it. Set partition_by back to {ledger.partition_by}, or "
            f'point the stream\'s path at a new folder (and add start = "earliest" to fill '
            f"it from the retained WAL)."
        )

    # -- commit ------------------------------------------------------------

    def commit(
        self, df: Any, batch: MicroBatch, rows: int, raw: RawInbox | None = None
    ) -> CommitResult:
        """Commit this stream's rows of ``batch`` exactly once (protocol: module doc).

        ``df`` is the batch DataFrame with the contract columns; ``rows`` is how
        many of its rows this stream takes (counted from Arrow, no Spark job).
        ``raw``: the batch's raw inbox file, which step 1 then writes without a
        Spark job (the executor passes it when the session can,
        :func:`direct_write_missing`); ``df`` is then not read (and may be
        None).
        """
        started = time.monotonic()
        # Step 0. Idempotency: finish an interrupted commit, skip a committed batch.
        self._complete_pending(RecoveryReport())
        if batch.batch_id <= self.ledger.last_batch_id:
            self._check_rerun(batch)
            return CommitResult(self.name, batch.batch_id, rows, 0, True, 0.0)
        self._check_lsns(batch)

        bid = batch.batch_id
        staging = self._staging_dir(bid)
        files: list[tuple[str, str]] = []
        set_aside: list[quarantine.QuarantinedRow] = []
        written = rows
        if rows:
            crash_point("cdc.before_stage")
            try:
                # Step 1. Stage: Spark writes where no reader looks; rows that
                # fail alone are set aside (_stage).
                set_aside = self._stage(df, batch, rows, raw, staging)
                written = rows - len(set_aside)
                crash_point("cdc.after_stage")
                files = self._staged_files(staging, bid) if written else []
                if written and not files:
                    raise CdcError(
                        f"stream {self.name!r}: Spark wrote no files for batch {bid} "
                        f"({written} rows expected) under {staging}"
                    )
                # Step 2. Intent: staged bytes and set-aside rows durable, then
                # the staged->final map.
                for rel, _ in files:
                    fsync_file(staging / rel)
                if set_aside:
                    quarantine.write_batch(self.meta, self.name, bid, set_aside)
                    crash_point("cdc.after_quarantine")
                if files:
                    self._write_intent(batch, written, files, len(set_aside))
            except BaseException:
                # Nothing was promised yet: roll back this attempt's staging.
                shutil.rmtree(staging, ignore_errors=True)
                raise
            crash_point("cdc.after_intent")
            # Step 3. Publish: atomic renames into the visible partition folders.
            self._publish(bid, files)
            crash_point("cdc.after_publish")
        # Step 4. Ledger: the batch is committed for this stream.
        self._append_ledger(
            bid, batch.ranges(), written, [final for _, final in files], len(set_aside)
        )
        if set_aside:
            self.quarantined += len(set_aside)
        crash_point("cdc.after_ledger")
        if files:
            # Under the commit lock: a compaction's swap must not replace a
            # folder between this write and the swap's relink (the summary
            # would go with the old folder, and _summarized would not retry).
            with self.commit_lock:
                self._write_summaries(files)
        # Step 5. Clean: intent and staging are no longer needed.
        self._clean(bid)
        return CommitResult(
            self.name,
            bid,
            written,
            len(files),
            False,
            time.monotonic() - started,
            len(set_aside),
        )

    def _stage(
        self, df: Any, batch: MicroBatch, rows: int, raw: RawInbox | None, staging: Path
    ) -> list[quarantine.QuarantinedRow]:
        """Step 1: write the stream's rows of ``batch`` into ``staging``; the
        rows it set aside (none when the first write succeeds).

        1. Write them (without a Spark job when ``raw.direct``).
        2. It failed: ask which of the stream's rows fail alone
           (:meth:`_bad_rows`: each row's payloads parsed on their own, as the
           writer parses them). None while the first write read the stream's
           rows only: the failure was the moment's, and the batch is retried.
        3. More than ``quarantine_max_rows``: the writer, not the rows, is
           broken; the batch fails (and is retried), its error says so.
        4. Write again without them (a Spark job reads the stream's own rows
           of the inbox, so another stream's bad row cannot fail it). If that
           fails too, it fails the batch like any failed write.
        """
        direct = raw is not None and raw.direct
        try:
            # Step 1. The write.
            if raw is not None and raw.direct:
                self._write_staged(replace(raw, rows=rows), staging)
            else:
                self._write_staged(self._select(df), staging)
            return []
        except Exception as exc:
            if raw is None or (self.stream.quarantine_max_rows == 0 and direct):
                raise  # without a raw inbox no row can be checked alone
            failure = exc
        # Step 2. Which rows fail alone.
        limit = self.stream.quarantine_max_rows
        bad = self._bad_rows(raw, limit) if limit else []
        if not bad and (direct or raw.reread is None):
            raise failure
        # Step 3. A bound: a writer that refuses rows wholesale is not a bad row.
        if len(bad) > limit:
            raise CdcQuarantineLimitError(
                f"stream {self.name!r}: more than {limit} rows of batch {batch.batch_id} fail "
                f"on their own (quarantine_max_rows), first: LSN {bad[0][0]}: {bad[0][1]}. "
                f"That is the writer failing, not bad rows: the batch is retried, nothing is "
                f"set aside. Fix the cause, or raise [[cdc.streams]] quarantine_max_rows."
            ) from failure
        set_aside = quarantine.rows_of(batch, bad)
        skip = tuple(r.lsn for r in set_aside)
        if set_aside:
            log.warning(
                "cdc_rows_quarantined",
                stream=self.name,
                batch_id=batch.batch_id,
                rows=len(skip),
                lsns=list(skip[:10]),
                error=set_aside[0].error,
            )
        # Step 4. The write without them.
        try:
            if direct:
                self._write_staged(replace(raw, rows=rows - len(skip), skip=skip), staging)
            else:
                assert raw.reread is not None
                own = raw.reread(self._taken(), skip)
                self._write_staged(self._select(own, skip), staging)
        except Exception as exc:
            raise exc from failure
        return set_aside

    def _taken(self) -> tuple[str, ...]:
        """The stream's collections for a reader's filter (empty: all)."""
        return () if self.stream.collections == ("*",) else self.stream.collections

    def _bad_rows(self, raw: RawInbox, limit: int) -> list[tuple[int, str]]:
        """``(lsn, error)`` of the stream's rows of ``raw`` whose payloads the
        writer cannot parse alone, at most ``limit`` + 1 (``DirectWrite.badRows``)."""
        spark = raw.spark
        found = _py4j_jvm(spark).eventplane.inbox.DirectWrite.badRows(
            spark._jsparkSession,
            str(raw.path),
            raw.splits,
            raw.batch_id,
            _java_strings(spark, self._taken()),
            limit,
        )
        out = []
        for entry in found:
            lsn, _, error = str(entry).partition("\t")
            out.append((int(lsn), error))
        return out

    def _select(self, df: Any, skip: tuple[int, ...] = ()) -> Any:
        columns, keep = self._write_columns(df.sparkSession)
        out = columns.select(df)
        if keep is not None:
            out = out.where(keep)
        if skip:
            from pyspark.sql import functions as F

            out = out.where(~F.col("lsn").isin(list(skip)))
        return out

    def _write_columns(self, spark: Any) -> tuple[SelectList, Any | None]:
        """The write's select list (the table's columns, then the time partition
        columns) and the filter on the stream's collections (None: all), built
        once per session. A Column is an expression object in the JVM, and each
        one took py4j calls on every batch; a rebuilt session (a new JVM) gets
        new ones. The table's column list is part of the key: tests that write
        an earlier layout put another one in place for some batches."""
        cached = self._columns
        table = TABLE_COLUMNS
        if cached is None or cached[0] is not spark or cached[1] is not table:
            from pyspark.sql import functions as F

            columns = [F.col(c) for c in table]
            columns += [col.alias(name) for name, col in time_columns(self.stream.partition_by)]
            keep = None
            if self.stream.collections != ("*",):
                keep = F.col("collection").isin(list(self.stream.collections))
            cached = self._columns = (spark, table, SelectList.build(spark, columns), keep)
        return cached[2], cached[3]

    def _write_staged(self, df: Any, staging: Path) -> None:
        """The write of step 1 (tests wrap this to inject write failures): a
        Spark write of the DataFrame ``df``, or, given a :class:`RawInbox`, the
        direct write of its rows (:meth:`_write_direct`).

        The staging folder starts empty (a failed attempt's leftovers go), with
        the committer's job folders made here (``STAGING_JOB_DIRS``); Spark then
        appends into it, which keeps those folders.
        """
        shutil.rmtree(staging, ignore_errors=True)
        (staging / STAGING_JOB_DIRS).mkdir(parents=True)
        if isinstance(df, RawInbox):
            self._write_direct(df, staging)
            return
        partition_by = self.stream.partition_by
        writer = df.write.mode("append").partitionBy(*partition_by)
        self._write_options(df.sparkSession).set_on(writer).parquet(str(staging))

    def _write_direct(self, raw: RawInbox, staging: Path) -> None:
        """Step 1 in the driver JVM (``DirectWrite.java``): the stream's rows
        of the inbox file, one thread per split as a job has one task per
        split, into a file per split and partition folder, with Spark's
        Parquet writer and this write's options. The time partitions are
        computed as ``time_columns`` computes them."""
        spark = raw.spark
        cached = self._direct_args
        table = TABLE_COLUMNS  # part of the key, as in _write_columns
        if cached is None or cached[0] is not spark or cached[1] is not table:
            # Java String arrays are a py4j command per element: made once per session.
            taken = () if self.stream.collections == ("*",) else self.stream.collections
            lists = (table, taken, self.stream.partition_by)
            cached = self._direct_args = (spark, table, *(_java_strings(spark, x) for x in lists))
        args = [
            spark._jsparkSession,
            str(raw.path),
            raw.splits,
            raw.batch_id,
            str(staging),
            self._write_options(spark).jmap,
            *cached[2:],
        ]
        if raw.skip:
            skip = spark.sparkContext._gateway.new_array(
                spark.sparkContext._gateway.jvm.long, len(raw.skip)
            )
            for i, lsn in enumerate(raw.skip):
                skip[i] = lsn
            args.append(skip)
        written = _py4j_jvm(spark).eventplane.inbox.DirectWrite.write(*args)
        if written != raw.rows:
            raise CdcError(
                f"stream {self.name!r}: the direct write of batch {raw.batch_id} wrote "
                f"{written} rows, {raw.rows} expected"
            )

    def _write_options(self, spark: Any) -> WriteOptions:
        """Step 1's writer options (Parquet's and the staging write's), built
        once per session and staging choice."""
        staging = staging_write_options(spark)
        cached = self._options
        if cached is None or cached[0] is not spark or cached[1] is not staging:
            parquet = TRANSIENT_PARQUET_OPTIONS if self.stream.compaction else PARQUET_OPTIONS
            built = WriteOptions.build(spark, {**parquet, **staging})
            cached = self._options = (spark, staging, built)
        return cached[2]

    def _staging_dir(self, batch_id: int) -> Path:
        return self.meta / "staging" / f"b{batch_id:012d}"

    def _intent_file(self, batch_id: int) -> Path:
        return self.meta / "pending" / f"b{batch_id:012d}.json"

    @staticmethod
    def _staged_files(staging: Path, batch_id: int) -> list[tuple[str, str]]:
        """(staged, final) paths relative to staging and to the table, sorted."""
        out: list[tuple[str, str]] = []
        for root, dirs, names in os.walk(staging):
            dirs[:] = sorted(d for d in dirs if not d.startswith(("_", ".")))
            rel_dir = Path(root).relative_to(staging)
            for n in sorted(names):
                if n.startswith(("_", ".")):
                    continue  # _SUCCESS, .crc checksums
                stem = n[len("part-") :] if n.startswith("part-") else n
                final = rel_dir / f"part-b{batch_id:012d}-{stem}"
                out.append((str(rel_dir / n), str(final)))
        return out

    def _write_intent(
        self, batch: MicroBatch, rows: int, files: list[tuple[str, str]], quarantined: int = 0
    ) -> None:
        atomic_write_json(
            self._intent_file(batch.batch_id),
            {
                "stream": self.name,
                "batch_id": batch.batch_id,
                "ranges": _ranges_to_json(batch.ranges()),
                "rows": rows,
                "files": [list(f) for f in files],
                "quarantined": quarantined,
            },
        )

    def _publish(
        self, batch_id: int, files: list[tuple[str, str]], staging: Path | None = None
    ) -> None:
        with self.commit_lock:  # a compaction swaps partition folders under it
            self._publish_files(batch_id, files, staging)

    def _publish_files(
        self, batch_id: int, files: list[tuple[str, str]], staging: Path | None = None
    ) -> None:
        staging = staging or self._staging_dir(batch_id)
        touched: set[Path] = set()
        for i, (rel, final_rel) in enumerate(files):
            src, dst = staging / rel, self.path / final_rel
            if not dst.parent.is_dir():
                dst.parent.mkdir(parents=True, exist_ok=True)
                # New folders (collection=x, then date=d, ...) are entries of
                # their parents: fsync each folder from the table root down.
                touched.update(d for d in dst.parent.parents if self.path in (d, *d.parents))
            if src.exists():
                if dst.exists():
                    # Both names: a rename whose source removal did not survive a
                    # power loss. The published copy is the same bytes; keep it.
                    src.unlink()
                else:
                    os.rename(src, dst)
            elif not dst.exists():
                raise CdcRecoveryError(
                    f"stream {self.name!r}: batch {batch_id} lists {rel} but neither the "
                    f"staged file {src} nor the published file {dst} exists. Restore the "
                    f"file, or remove {self._intent_file(batch_id)} and re-run the batch."
                )
            touched.add(dst.parent)
            if i == 0:
                crash_point("cdc.mid_publish")
        for d in sorted(touched):
            fsync_dir(d)

    def _write_summaries(self, files: list[tuple[str, str]]) -> None:
        """The table's schema, as the footer of a file just written, in
        ``_common_metadata`` at the root and in every ``collection=...`` folder.

        Spark's schema inference (``mergeSchema`` off, the default) reads a
        ``_common_metadata`` footer when the folder it reads has one, and
        otherwise one data file's, whichever its listing gives first. A table
        that holds files from before a column existed would then lose that
        column by chance (tests/spark/test_cdc.py). Readers that skip ``_``
        names (pyarrow, DuckDB, Trino) ignore the file; it holds no rows, so
        what a reader counts is unchanged.

        The first commit of a process checks every folder; later ones only new
        folders. A file whose Spark schema differs (an older daemon's) is
        replaced atomically. Not part of the commit: a failure is logged and
        retried at the next commit.
        """
        # The root and each top-level partition folder (collection=...), also
        # when the table is partitioned further by time: those are the folders
        # readers point at, and retention never removes them.
        folders = {self.path / Path(final).parts[0] for _, final in files}
        if self.path not in self._summarized:
            folders.add(self.path)
            folders.update(
                d for d in self.path.iterdir() if d.is_dir() and not d.name.startswith(("_", "."))
            )
        todo = sorted(folders - self._summarized)
        if not todo:
            return
        try:
            import pyarrow.parquet as pq

            schema = pq.read_schema(self.path / files[0][1])
            wanted = (schema.metadata or {}).get(SPARK_SCHEMA_KEY)
            for folder in todo:
                target = folder / SUMMARY_FILE
                try:
                    current = (pq.read_schema(target).metadata or {}).get(SPARK_SCHEMA_KEY)
                except (OSError, ValueError):  # missing, or not a Parquet footer
                    current = None
                if current is None or current != wanted:
                    tmp = folder / f".{SUMMARY_FILE}.{os.getpid()}.tmp"
                    pq.write_metadata(schema, tmp)
                    fsync_file(tmp)
                    os.replace(tmp, target)
                    fsync_dir(folder)
                self._summarized.add(folder)
        except (OSError, ValueError) as exc:
            log.warning("cdc_summary_failed", stream=self.name, error=str(exc))

    def _append_ledger(
        self,
        batch_id: int,
        ranges: dict[int, tuple[int, int]],
        rows: int,
        files: list[str],
        quarantined: int = 0,
    ) -> None:
        entry = LedgerEntry(batch_id, ranges, rows, files, time.time(), quarantined)
        with self.commit_lock:  # a compaction records itself in the same file
            candidate = self.ledger.copy()
            candidate.append(entry, self.keep_batches)
            atomic_write_json(self.meta / "ledger.json", candidate.to_json())
            self._ledger = candidate  # only after it is durable

    def record_compaction(self, record: dict[str, Any]) -> None:
        """Append a compaction's record to the ledger (atomic replace + fsync)."""
        with self.commit_lock:
            candidate = self.ledger.copy()
            candidate.add_compaction(record)
            atomic_write_json(self.meta / "ledger.json", candidate.to_json())
            self._ledger = candidate

    def _clean(self, batch_id: int) -> None:
        try:
            self._intent_file(batch_id).unlink(missing_ok=True)
            shutil.rmtree(self._staging_dir(batch_id), ignore_errors=True)
        except OSError as exc:  # committed already; the next open removes leftovers
            log.warning("cdc_clean_failed", stream=self.name, batch_id=batch_id, error=str(exc))

    # -- quarantine ----------------------------------------------------------

    def replay_quarantine(
        self,
        spark: Any,
        frame_of: Callable[[MicroBatch], Any],
        lsns: set[int] | None = None,
    ) -> dict[str, Any]:
        """Write quarantined rows (all, or those of ``lsns``) into the table,
        exactly once; the rows the writer still refuses stay. Per batch file
        of the quarantine:

        1. Check each row's payloads with the writer's parse (``JsonCheck``).
        2. Stage the rows that pass with a Spark job (``frame_of`` makes their
           DataFrame) under ``staging/r<batch>/``.
        3. Intent ``quarantine/r<batch>.json``: its rows and files. From here
           the replay rolls forward (recovery: :meth:`_complete_replays`).
        4. Publish the files (named for the batch that set the rows aside).
        5. Take the rows out of the quarantine, then remove intent and staging.

        Runs where the stream's batches run (never beside a commit).
        """
        held = [r for r in quarantine.load(self.meta) if lsns is None or r.lsn in lsns]
        written: list[int] = []
        refused: list[dict[str, Any]] = []
        by_batch: dict[int, list[quarantine.QuarantinedRow]] = {}
        for row in held:
            by_batch.setdefault(row.batch_id, []).append(row)
        for bid, rows in sorted(by_batch.items()):
            # Step 1. The writer's verdict on each row now.
            errors = writer_errors(spark, rows)
            ok = [r for r, e in zip(rows, errors, strict=True) if e is None]
            refused += [{"lsn": r.lsn, "error": e} for r, e in zip(rows, errors, strict=True) if e]
            if not ok:
                continue
            # Step 2. Stage.
            staging = self.meta / "staging" / f"r{bid:012d}"
            slices: dict[int, list[Record]] = {}
            for r in ok:
                slices.setdefault(r.core, []).append(r.record())
            batch = MicroBatch(
                bid,
                {
                    c: Slice(c, recs[0].lsn, recs[-1].lsn, recs)
                    for c, recs in sorted(slices.items())
                },
            )
            try:
                self._write_staged(self._select(frame_of(batch)), staging)
                files = self._staged_files(staging, bid)
                for rel, _ in files:
                    fsync_file(staging / rel)
                # Step 3. Intent.
                atomic_write_json(
                    quarantine.replay_file(self.meta, bid),
                    {"stream": self.name, "lsns": [r.lsn for r in ok], "files": files},
                )
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            crash_point("cdc.replay_after_intent")
            # Steps 4-5.
            self._finish_replay(bid, [r.lsn for r in ok], files)
            written += [r.lsn for r in ok]
        self.quarantined = quarantine.count(self.meta)
        if written:
            log.info("cdc_quarantine_replayed", stream=self.name, rows=len(written))
        return {
            "stream": self.name,
            "replayed": len(written),
            "lsns": written,
            "still_refused": refused,
            "quarantined": self.quarantined,
        }

    def _finish_replay(self, bid: int, lsns: list[int], files: list[tuple[str, str]]) -> None:
        staging = self.meta / "staging" / f"r{bid:012d}"
        # Step 4. Publish.
        self._publish(bid, files, staging)
        crash_point("cdc.replay_after_publish")
        # Step 5. Out of the quarantine; the intent and staging go last.
        quarantine.drop(self.meta, lsns)
        quarantine.replay_file(self.meta, bid).unlink(missing_ok=True)
        shutil.rmtree(staging, ignore_errors=True)

    def _complete_replays(self) -> None:
        """Recovery: replays whose intent is durable roll forward."""
        for bid, path in quarantine.replay_intents(self.meta):
            raw = json.loads(path.read_bytes())
            files = [(str(a), str(b)) for a, b in raw["files"]]
            self._finish_replay(bid, [int(x) for x in raw["lsns"]], files)

    def purge_quarantine(self, lsns: set[int] | None, by: str | None = None) -> int:
        """Remove quarantined rows for good (logged with who and when: quarantine.purge)."""
        n = quarantine.purge(self.meta, self.name, lsns, by)
        self.quarantined = quarantine.count(self.meta)
        if n:
            log.warning("cdc_quarantine_purged", stream=self.name, rows=n, by=by)
        return n

    # -- checks ------------------------------------------------------------

    def _check_rerun(self, batch: MicroBatch) -> None:
        entry = self.ledger.entry(batch.batch_id)
        if entry is not None and entry.ranges != batch.ranges():
            raise CdcLedgerMismatchError(
                f"stream {self.name!r}: batch {batch.batch_id} was committed with LSN ranges "
                f"{entry.ranges} but came back with {batch.ranges()}. The batch plan changed "
                f"after commit; refusing to write it twice. Check the planner's plan files."
            )

    def _check_lsns(self, batch: MicroBatch) -> None:
        ledger = self.ledger
        for core, (first, last) in sorted(batch.ranges().items()):
            if not 0 <= core < self.cores:
                raise CdcError(f"batch {batch.batch_id}: core {core} outside 0..{self.cores - 1}")
            if last < first:
                raise LsnRegressionError(
                    f"batch {batch.batch_id}: core {core} range {first}..{last} is reversed"
                )
            high = ledger.high_lsn.get(core, 0)
            if first <= high:
                raise LsnRegressionError(
                    f"stream {self.name!r}: batch {batch.batch_id} starts core {core} at LSN "
                    f"{first}, but batches up to {ledger.last_batch_id} already committed that "
                    f"core up to LSN {high}; writing it would duplicate rows. A batch plan "
                    f"was lost or re-planned under a new id."
                )

    # -- recovery ----------------------------------------------------------

    def _intents(self) -> Iterator[tuple[int, Path]]:
        found = []
        for p in (self.meta / "pending").iterdir():
            m = re.fullmatch(r"b(\d{12})\.json", p.name)
            if m:
                found.append((int(m.group(1)), p))
        yield from sorted(found)

    def _complete_pending(self, report: RecoveryReport) -> None:
        for bid, intent in self._intents():
            if bid <= self.ledger.last_batch_id:
                # Step 5 was interrupted: the batch is in the ledger.
                self._clean(bid)
                report.intents_removed.append(bid)
                continue
            try:
                raw = json.loads(intent.read_bytes())
                ranges = _ranges_from_json(raw["ranges"])
                rows = int(raw["rows"])
                files = [(str(a), str(b)) for a, b in raw["files"]]
                quarantined = int(raw.get("quarantined", 0))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CdcRecoveryError(
                    f"stream {self.name!r}: commit intent {intent} is unreadable ({exc}). "
                    f"It was written atomically, so the disk or an operator changed it."
                ) from exc
            # Steps 3-5 of the interrupted commit.
            self._publish(bid, files)
            self._append_ledger(bid, ranges, rows, [final for _, final in files], quarantined)
            self._clean(bid)
            report.rolled_forward.append(bid)
            log.warning("cdc_commit_rolled_forward", stream=self.name, batch_id=bid, rows=rows)

    def _remove_temp_files(self) -> None:
        for d in (self.meta, self.meta / "pending"):
            for p in d.iterdir():
                if p.name.startswith(".") and p.name.endswith(".tmp"):
                    p.unlink(missing_ok=True)
        # An interrupted _write_summaries: in the root or a collection folder.
        for d in (self.path, *self.path.glob("collection=*")):
            for p in d.glob(f".{SUMMARY_FILE}.*.tmp"):
                p.unlink(missing_ok=True)

    def _remove_staging(self, report: RecoveryReport) -> None:
        for p in sorted((self.meta / "staging").iterdir()):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            report.staging_removed.append(p.name)

    def _remove_orphans(self, report: RecoveryReport) -> None:
        last = self.ledger.last_batch_id
        for batch_id, f in _published(self.path):
            if batch_id > last:
                f.unlink()
                report.orphans_removed.append(str(f.relative_to(self.path)))


def _py4j_jvm(spark: Any) -> Any:
    """The py4j view of ``spark``'s JVM; None under Spark Connect (no JVM here)."""
    return getattr(getattr(spark, "_sc", None), "_jvm", None)


@dataclass(frozen=True, slots=True)
class SelectList:
    """A select list built once per session, for a select per batch that
    costs one py4j command.

    ``DataFrame.select(*columns)`` hands the JVM a new Java list per call,
    built with one command per element (py4j's list conversion): 14 for the
    write's list, 12 for the batch's contract columns. Here the JVM's
    ``Seq`` of the Columns is made once and passed as it is. A Spark Connect
    session has no JVM here: its selects go the usual way.
    """

    columns: tuple[Any, ...]
    jseq: Any  # the JVM Seq of the Columns; None under Spark Connect

    @classmethod
    def build(cls, spark: Any, columns: list[Any]) -> SelectList:
        jvm = _py4j_jvm(spark)
        jseq = None if jvm is None else jvm.PythonUtils.toSeq([c._jc for c in columns])
        return cls(tuple(columns), jseq)

    def select(self, df: Any) -> Any:
        """``df.select(*columns)``."""
        if self.jseq is None:
            return df.select(*self.columns)
        from pyspark.sql.classic.dataframe import DataFrame

        return DataFrame(df._jdf.select(self.jseq), df.sparkSession)


@dataclass(frozen=True, slots=True)
class WriteOptions:
    """A writer's options built once per session, set with one py4j command.

    ``DataFrameWriter.options(**options)`` sends one command per option (9
    for step 1's write); here a Java map of them is made once and handed to
    the JVM writer's ``options(Map)``. Under Spark Connect (no JVM here)
    they are set the usual way.
    """

    options: dict[str, str]
    jmap: Any  # a java.util.HashMap of ``options``; None under Spark Connect

    @classmethod
    def build(cls, spark: Any, options: dict[str, str]) -> WriteOptions:
        jvm = _py4j_jvm(spark)
        jmap = None
        if jvm is not None:
            jmap = jvm.java.util.HashMap()
            for key, value in options.items():
                jmap.put(key, value)
        return cls(dict(options), jmap)

    def set_on(self, writer: Any) -> Any:
        """``writer.options(**options)``; returns ``writer``."""
        if self.jmap is None or not hasattr(writer, "_jwrite"):
            return writer.options(**self.options)
        writer._jwrite = writer._jwrite.options(self.jmap)
        return writer


def staging_write_options(spark: Any) -> dict[str, str]:
    """The Hadoop options of a staging write (step 1, and a compaction's Spark
    write) in ``spark``'s session: ``STAGING_WRITE_OPTIONS``, with
    ``NIO_LOCAL_FS`` as the file system when the session's JVM runs the tasks
    and can load it. Decided once per session (a few py4j calls); without it
    the writes fork ``chmod`` as before, and the first session says why, once
    per process."""
    global _staging_options, _staging_fallback_logged
    cached = _staging_options
    if cached is not None and cached[0] is spark:
        return cached[1]
    options = dict(STAGING_WRITE_OPTIONS)
    reason = _nio_fs_missing(spark)
    if reason is None:
        options["fs.file.impl"] = NIO_LOCAL_FS
        _drop_yarn_defaults(spark)
    elif not _staging_fallback_logged:
        _staging_fallback_logged = True
        log.info("cdc_staging_forks_chmod", reason=reason)
    _staging_options = (spark, options)
    return options


def _drop_yarn_defaults(spark: Any) -> None:
    """Unset the session's Hadoop keys that only ``yarn-default.xml`` set (527
    of 1,100; the daemon's jar does it in one call). A local master never reads
    them, and every job serialises the whole configuration to its tasks, where
    every Parquet writer scans it (docs/performance.md, "The fixed cost of a
    batch"). Called with a local master only; a key a site file or
    ``spark.hadoop.*`` set stays."""
    from py4j.protocol import Py4JError

    conf = spark.sparkContext._jsc.hadoopConfiguration()
    try:
        drop = spark.sparkContext._jvm.eventplane.hadoop.HadoopDefaults.drop
        dropped = drop(conf, "yarn-default.xml")
    except Py4JError as exc:  # a jar built before the class existed: a cost only
        log.info("cdc_hadoop_defaults_kept", error=str(exc)[:200])
        return
    log.debug("cdc_hadoop_defaults_dropped", resource="yarn-default.xml", keys=dropped)


@dataclass(frozen=True, slots=True)
class RawInbox:
    """A batch's raw inbox file (``daemon.spark.rawinbox``) in ``spark``'s
    session, for step 1 (:meth:`CdcSink.commit`).

    ``rows``: what the write must write (``commit`` sets the stream's).
    ``direct``: step 1 writes the file's rows without a Spark job; else a
    Spark job writes the batch DataFrame, and the file serves only to find
    rows that fail alone. ``reread(collections, skip)``: a DataFrame of the
    batch's rows of those collections (empty: all) but the LSNs of ``skip``,
    whose reader parses only those rows' payloads. ``skip``: LSNs the
    direct write leaves out.
    """

    spark: Any
    path: Path
    splits: str
    batch_id: int
    rows: int
    direct: bool = True
    reread: Callable[[tuple[str, ...], tuple[int, ...]], Any] | None = None
    skip: tuple[int, ...] = ()


def writer_errors(spark: Any, rows: list[quarantine.QuarantinedRow]) -> list[str | None]:
    """For each row, None when the writer parses its payloads now, else why
    not (``JsonCheck.checkMany``, with the session's parse_json settings)."""
    from daemon.events import decode as decode_stored

    docs: list[bytes] = []
    for r in rows:
        event = decode_stored(r.payload)
        docs += [event.new or b"null", event.old or b"null"]
    conf = spark.conf
    verdicts = _py4j_jvm(spark).eventplane.inbox.JsonCheck.checkMany(
        bytearray(b"".join(docs)),
        ",".join(str(len(d)) for d in docs),
        conf.get("spark.sql.variant.allowDuplicateKeys") == "true",
        conf.get("spark.sql.variant.validateUnicodeInJsonParsing") == "true",
    )
    out: list[str | None] = []
    for i in range(len(rows)):
        new, old = verdicts[2 * i], verdicts[2 * i + 1]
        out.append(f"new: {new}" if new else f"old: {old}" if old else None)
    return out


def _java_strings(spark: Any, values: tuple[str, ...]) -> Any:
    """A Java ``String[]`` of ``values`` in ``spark``'s JVM."""
    array = spark.sparkContext._gateway.new_array(_py4j_jvm(spark).java.lang.String, len(values))
    for i, value in enumerate(values):
        array[i] = value
    return array


def direct_write_missing(spark: Any) -> str | None:
    """Why ``spark``'s session cannot write a batch without a Spark job (None:
    it can). Decided once per session; the raw inbox needs the same jar, so a
    session that reads one and lacks this class has a jar built before it."""
    global _direct_usable
    cached = _direct_usable
    if cached is not None and cached[0] is spark:
        return cached[1]
    from daemon.spark.session import daemon_class_missing

    reason = daemon_class_missing(spark, DIRECT_WRITE)
    _direct_usable = (spark, reason)
    return reason


def _nio_fs_missing(spark: Any) -> str | None:
    """Why ``NIO_LOCAL_FS`` cannot serve ``spark``'s writes (None: it can)."""
    from daemon.spark.session import daemon_class_missing

    return daemon_class_missing(spark, NIO_LOCAL_FS)


def time_columns(partition_by: tuple[str, ...]) -> list[tuple[str, Any]]:
    """The time partition columns of ``partition_by``, as ``(name, Column)``:
    ``date``, the UTC day of ``ingest_ts`` as ``yyyy-MM-dd``, and ``hour``,
    ``00``..``23``. Computed from epoch seconds, so Spark's session time zone
    does not matter."""
    if "date" not in partition_by and "hour" not in partition_by:
        return []
    from pyspark.sql import functions as F

    secs = F.unix_seconds(F.col("ingest_ts"))
    out = []
    if "date" in partition_by:
        day = F.floor(secs / 86_400).cast("int")
        out.append(("date", F.date_add(F.lit("1970-01-01").cast("date"), day).cast("string")))
    if "hour" in partition_by:
        hour = F.pmod(F.floor(secs / 3_600), F.lit(24)).cast("string")
        out.append(("hour", F.lpad(hour, 2, "0")))
    return out


def _published(path: Path) -> list[tuple[int, Path]]:
    """(batch_id, file) of every ``part-b<id>-*`` file in the table's visible
    partition folders, at any depth (``collection=x/date=d/hour=h``). Folders
    whose names start with ``_`` or ``.`` are not read by readers and skipped
    (``_eventplane``, a partition being expired)."""
    out: list[tuple[int, Path]] = []
    for root, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
        if root == str(path):
            continue  # files at the root are not data
        for n in names:
            m = _PUBLISHED.match(n)
            if m:
                out.append((int(m.group(1)), Path(root) / n))
    return out


def file_batch(name: str) -> int | None:
    """The newest batch a published or compacted data file holds, from its name."""
    m = _PUBLISHED.match(name)
    if m:
        return int(m.group(1))
    m = _COMPACTED.match(name)
    return int(m.group(3)) if m else None


def committed_files(path: Path) -> list[tuple[int, Path]]:
    """(batch_id, file) for every published file of a stream, newest batch first.

    A compacted file counts as its newest batch: every row of a batch B is in a
    file whose key is >= B, so the files keyed >= B hold all of B's rows.
    """
    out: list[tuple[int, Path]] = []
    with contextlib.suppress(FileNotFoundError):
        for root, dirs, names in os.walk(path):
            dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
            if root == str(path):
                continue  # files at the root are not data
            for n in names:
                b = file_batch(n)
                if b is not None:
                    out.append((b, Path(root) / n))
    out.sort(key=lambda t: (-t[0], str(t[1])))
    return out
