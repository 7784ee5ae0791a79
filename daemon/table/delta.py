"""Exactly-once CDC tables in Delta Lake: one Delta commit per batch and stream.

Layout of a ``format = "delta"`` stream's ``path``::

    <path>/_delta_log/                       Delta's transaction log: the table
    <path>/collection=orders/part-*.parquet  data files (those the log lists)
    <path>/_eventplane/ledger.json           identity, last batch, per-core LSNs
    <path>/_eventplane/lock                  flock: one writer per stream
    <path>/_eventplane/quarantine/           rows set aside (quarantine.py)

Every reader that knows Delta (Spark, delta-rs and so pandas, Polars, DuckDB
over a delta-rs dataset) reads a snapshot: a version of the log, whose files
stay until VACUUM removes them after ``vacuum_retain_hours``.

Commit protocol for batch B of stream S:

0. **Idempotency.** B at or below the ledger's last batch: check that the
   re-run has the recorded LSN ranges, write nothing.
1. **Commit.** One Delta append of S's rows of B, with ``txnAppId`` =
   ``eventplane/<WAL id>/<stream>`` and ``txnVersion`` = B: Delta commits
   the files and that pair atomically, and skips a write whose version is not
   above the stored one (a re-run after a crash). The commit's
   ``userMetadata`` carries B, its per-core LSN ranges and row counts. Rows
   that fail alone go to the quarantine file first (``cdc.after_quarantine``).
2. **Ledger.** Append B (ranges, rows, Delta version) to the ledger (atomic
   replace + fsync): the daemon's copy of what step 1 committed.

Recovery when the stream opens: commits of the stream's app id above the
ledger's last batch (a crash between steps 1 and 2, ``delta.after_commit``)
are read from ``_delta_log`` and appended to the ledger from their
``userMetadata``; quarantine files of batches above it are removed (their
batch re-runs). The identity check (invariant 13) is the ledger's WAL id and
``cores``, also in the table's properties (``eventplane.wal_id``,
``eventplane.cores``) and in the app id.

A shared table (``writers = "shared"``: several daemons append to it, each
as its ``[daemon] name``) says so in ``eventplane.writers``, and names each
writer's WAL in ``eventplane.daemon.<name>.wal_id``: a daemon joins by
setting its own (another WAL under its name refuses). Its rows carry
``writer``, a partition column, so each writer's files sit in its own
``writer=<name>`` folders: its open removes orphans there only, its
roll-forward reads its own app id's commits only, and each commit is retried
onto the others' (no automatic rebase: the fence is re-checked each time,
``SHARED_COMMIT_ATTEMPTS``). On disk its state is ``_eventplane/writers/<name>/``;
on S3 its lease is ``_eventplane/writers/<name>/lease.json`` and its fence
counts only the commits of its name (:mod:`daemon.table.fence`). Its
compaction, VACUUM and retention run in one daemon at a time, the holder of
``_eventplane/maintainer.json`` (:mod:`daemon.table.maintainer`).
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

import structlog

from daemon.config import CdcStream
from daemon.errors import IdentityMismatchError
from daemon.plane.batch import MicroBatch
from daemon.table import deltacommit, fence, maintainer, quarantine, s3
from daemon.table.crash import crash_point
from daemon.table.durable import atomic_write_json, fsync_file
from daemon.table.errors import CdcLayoutError, CdcStreamLockedError
from daemon.table.layout import META_DIR, TABLE_COLUMNS
from daemon.table.lease import Holder, Keeper, Lease, LeaseError, LocalStore, S3Store, Store
from daemon.table.ledger import (
    KEEP_BATCHES,
    Ledger,
    _ranges_from_json,
    read_ledger,
)
from daemon.table.location import LocalFiles, S3Files, TableFiles, table_files
from daemon.table.parquet import CdcSink
from daemon.table.retention import RunResult
from daemon.table.sink import CommitResult, RecoveryReport
from daemon.table.sparkio import RawInbox, _py4j_jvm

log = structlog.get_logger("eventplane.cdc")

# The default layout: no VARIANT column (delta-rs, so Polars and DuckDB,
# cannot open a table that has one); the payloads are JSON text.
DELTA_COLUMNS = tuple(c for c in TABLE_COLUMNS if c not in ("new", "old"))
# Statistics only on the columns a query filters by: not on the payloads'
# text, whose min/max of 32 characters prunes nothing and costs CPU per row.
STATS_COLUMNS = (
    "lsn", "core", "seq", "op", "key", "ingest_ts", "batch_id", "event_time", "producer",
)  # fmt: skip
# Delta's properties of a table the daemon creates.
DELTA_PROPERTIES = {
    "delta.dataSkippingStatsColumns": ",".join(STATS_COLUMNS),
    # Deletion vectors are recent in delta-rs and other readers: kept off.
    "delta.enableDeletionVectors": "false",
    # A checkpoint (the whole state in one Parquet file) every 10 commits, as
    # Spark's default: explicit, so that delta-rs, which commits the batches
    # and defaults to 100, writes them as often.
    "delta.checkpointInterval": "10",
}


# A table on S3: the txn app id, under the stream's, of quarantine replays
# (the fences' is fence.FENCE_APP).
REPLAY_APP = "/replay"
# Attempts of one commit to a table on S3 that lost its version to this
# writer's own maintenance (OPTIMIZE, DELETE, VACUUM's two commits).
COMMIT_ATTEMPTS = 8
# The same in a shared table, where every other daemon's commits race too:
# 32 bounds a batch's retries against a few daemons committing about once a
# second each (metric eventplane_cdc_commit_retries_total counts them).
SHARED_COMMIT_ATTEMPTS = 32
# A shared table's properties: that it is shared, and each writer's WAL id.
SHARED_PROPERTY = "eventplane.writers"
DAEMON_PROPERTY = "eventplane.daemon."
# The partition column naming the daemon that wrote a row of a shared table.
WRITER_COLUMN = "writer"


def app_id(wal_id: str, stream: str) -> str:
    """The Delta ``txnAppId`` of a stream's batch commits."""
    return f"eventplane/{wal_id}/{stream}"


def sink_class(stream: CdcStream) -> type[CdcSink]:
    """The sink of the stream's ``format``."""
    return DeltaSink if stream.format == "delta" else CdcSink


def _files(table: Path | TableFiles) -> TableFiles:
    return LocalFiles(table) if isinstance(table, Path) else table


def table_exists(table: Path | TableFiles) -> bool:
    return bool(_files(table).log_versions(-1))


def log_commits(table: Path | TableFiles, after: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(version, actions)`` of each commit file of the table (a folder or a
    :class:`~daemon.table.location.TableFiles`) above version ``after``
    (:func:`daemon.table.fence.log_commits`)."""
    return fence.log_commits(_files(table), after)


class DeltaSink(CdcSink):
    """One CDC stream as a Delta table. Shares with the Parquet sink its lock,
    ledger, row selection and quarantine; commits through Delta (module doc)."""

    def __init__(
        self,
        stream: CdcStream,
        *,
        wal_id: str,
        cores: int,
        keep_batches: int = KEEP_BATCHES,
        data_dir: Path | None = None,
        daemon_name: str = "",
    ) -> None:
        super().__init__(
            stream,
            wal_id=wal_id,
            cores=cores,
            keep_batches=keep_batches,
            data_dir=data_dir,
            daemon_name=daemon_name,
        )
        self.shared = stream.writers == "shared"
        if self.shared and not daemon_name:
            raise CdcLayoutError(
                f'stream {self.name!r} has writers = "shared": set [daemon] name (this '
                f"daemon's name among the table's writers)"
            )
        # The table's partition columns: a shared table's end with the writer's name.
        self.partition_by = (
            (*stream.partition_by, WRITER_COLUMN) if self.shared else stream.partition_by
        )
        if self.shared and not stream.uri:
            # The table's folder is every writer's: each keeps its state apart.
            self.meta = self.path / META_DIR / "writers" / daemon_name
        self.app_id = app_id(wal_id, stream.name)
        # Where the table's files are (this folder or an S3 prefix) and, on
        # S3, the writer's lease next to them (daemon/table/lease.py).
        self.files = table_files(stream)
        self.location = stream.location
        self.keeper: Keeper | None = None
        # A shared table: its maintenance lease (None: this daemon maintains it).
        self.maintainer: maintainer.Maintainer | None = None
        self._created = False  # the Delta table exists (checked on the first commit)
        self.commits_since_optimize = 0
        # The batch step 1 writes: (batch, rows written, rows set aside).
        self._pending: tuple[MicroBatch, int, int] | None = None
        # The table's version after step 1 (read from the log it committed to).
        self._version = -1
        self._dt: Any = None  # the delta-rs table of the direct path (_delta_table)
        # On S3: this process's identity in each commit's commitInfo and its
        # side of the fence in the table's log (daemon/table/fence.py).
        what = f"stream {self.name!r} ({self.location})"
        self.fence = fence.Fence(
            self.files,
            self.app_id,
            what,
            "cdc",
            name=daemon_name if self.shared else "",
            stream=self.name,
        )
        self.writer = self.fence.writer
        # Step 1 writes a raw inbox file's rows without a Spark job and commits
        # them with delta-rs; VARIANT columns (which delta-rs cannot open) take
        # a Spark append.
        missing = deltacommit.available()
        self.writes_direct = not stream.variant and missing is None
        if not self.writes_direct:
            why = "variant = true (delta-rs cannot open VARIANT)" if stream.variant else missing
            log.info("cdc_delta_spark_append", stream=stream.name, why=why)

    # -- lifecycle ---------------------------------------------------------

    def open(self) -> RecoveryReport:
        """Lock the stream, check its identity, take in commits the ledger missed."""
        self.meta.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            self._take_lease()
            self.maintainer = self._maintainer()
            created = read_ledger(self.path, self.meta) is None
            self._ledger = self._load_or_create_ledger()
            self._check_table_identity(created)
            # (delta-rs cannot open a VARIANT table; a shared one has none.)
            if not self.stream.variant and table_exists(self.files):
                table = self._maintenance_table()
                self._check_sharing(dict(table.metadata().configuration))
                if self.shared:
                    self._join_shared(table)
            report = RecoveryReport()
            self._roll_forward(report)
            if self._fence():  # a commit that landed before the fence is taken in too
                self._roll_forward(report)
            # Files of a direct commit that a crash interrupted (never in the log).
            self._remove_orphans(report)
            if (self.meta / "staging").is_dir():
                self._remove_staging(report)
            self._complete_replays()
            quarantine.recover(self.meta, self.ledger.last_batch_id, set())
            self.quarantined = quarantine.count(self.meta)
        except BaseException:
            self.close()
            raise
        if report.rolled_forward:
            log.warning("cdc_recovered", stream=self.name, rolled_forward=report.rolled_forward)
        return report

    def _lock(self) -> None:
        """The stream's lock; in a shared table on disk, its writer's name's."""
        try:
            super()._lock()
        except CdcStreamLockedError as exc:
            if not self.shared:
                raise
            raise CdcStreamLockedError(
                f"stream {self.name!r}: two daemons named {self.daemon_name!r} write the "
                f"shared table {self.location}: this one (WAL id {self.wal_id}) and the "
                f"holder of {exc.lock_text}. Give each daemon its own [daemon] name."
            ) from None

    def _take_lease(self) -> None:
        """A table on S3: take the writer's lease, ``_eventplane/lease.json``
        under the table's prefix (one writer per table)."""
        files = self.files
        if not isinstance(files, S3Files):
            return
        cfg = files.cfg
        problem = s3.check(cfg, self.location)
        if problem is not None:
            raise s3.S3Error(f"stream {self.name!r}: {self.location}: {problem}")
        holder = Holder.this_process(str(self.data_dir or self.path), self.wal_id, self.name)
        # A shared table: one lease per writer's name (the others append beside it).
        under = f"{META_DIR}/writers/{self.daemon_name}" if self.shared else META_DIR
        lease = Lease(
            S3Store(files.client, files.where.bucket),
            files.where.key(f"{under}/lease.json"),
            holder,
            ttl_s=cfg.lease_ttl_s,
            skew_s=cfg.lease_skew_s,
        )
        self.keeper = Keeper(lease, f"stream {self.name!r} ({self.location})")
        self.keeper.start()
        self.fence.keeper = self.keeper

    def _maintainer(self) -> maintainer.Maintainer | None:
        """A shared table opened by a daemon (a WAL): its maintenance lease,
        ``_eventplane/maintainer.json``, taken at the first maintenance tick."""
        if not self.shared or not self.wal_id:
            return None
        files = self.files
        store: Store
        if isinstance(files, S3Files):
            store = S3Store(files.client, files.where.bucket)
            key = files.where.key(f"{META_DIR}/{maintainer.KEY}")
            ttl_s, skew_s = files.cfg.lease_ttl_s, files.cfg.lease_skew_s
        else:
            store, key = LocalStore(self.path / META_DIR), maintainer.KEY
            ttl_s, skew_s = maintainer.LOCAL_TTL_S, maintainer.LOCAL_SKEW_S
        holder = Holder.this_process(str(self.data_dir or self.path), self.wal_id, self.name)
        lease = maintainer.MaintainerLease(
            store, key, holder, ttl_s=ttl_s, skew_s=skew_s, name=self.daemon_name
        )
        return maintainer.Maintainer(lease, f"stream {self.name!r} ({self.location})")

    def _maintains(self) -> bool:
        """Before compaction, VACUUM or retention: this daemon maintains the
        table (always, unless shared: then while it holds the maintenance lease)."""
        return self.maintainer is None or self.maintainer.tick()

    def _fence(self) -> bool:
        """A takeover's first act on a table on S3, before any orphan goes:
        the fencing commit (:meth:`daemon.table.fence.Fence.commit`). A stale
        writer's commit (no automatic retry: :meth:`_commit_fenced`) then loses
        its version to it, and a maintenance commit rebased onto it conflicts
        with its ``metaData``: nothing of the old writer lands after it. False
        when there is no table."""
        if not isinstance(self.files, S3Files) or not table_exists(self.files):
            return False
        self.fence.commit(self._delta_table())
        return True

    def _commit_properties(self) -> Any:
        """A maintenance commit's properties: this writer's identity in commitInfo."""
        return self.fence.properties()

    def _check_fence(self, table: Any, *, advance: bool = True) -> None:
        """On S3: the commits since the last checked version are all this
        writer's, else it stops for good (:meth:`daemon.table.fence.Fence.check`)."""
        self.fence.check(table, advance=advance)

    def close(self) -> None:
        kept, self.maintainer = self.maintainer, None
        if kept is not None:
            kept.stop()
        keeper, self.keeper = self.keeper, None
        if keeper is not None:
            keeper.stop()
        super().close()

    def table_status(self) -> dict[str, Any]:
        status: dict[str, Any] = {}
        if self.keeper is not None:
            status["lease"] = self.keeper.status()
        if self.maintainer is not None:
            status["maintenance"] = self.maintainer.status()
        return status

    def _check_layout(self, ledger: Ledger) -> None:
        wanted = list(self.stream.partition_by)
        if ledger.table_format != "delta":
            raise CdcLayoutError(
                f'stream {self.name!r} is a Delta stream (format = "delta", the default of an '
                f"entry without a format line) but {self.location} holds a "
                f"{ledger.table_format} table (batches up to {ledger.last_batch_id}). "
                f'To keep writing it, add format = "{ledger.table_format}" to this '
                f"[[cdc.streams]] entry; to move to Delta, point the stream's path at a new "
                f'folder (start = "earliest" fills it from the retained WAL), see docs/cdc.md, '
                f'"Moving a stream to Delta".'
            )
        if ledger.partition_by == wanted:
            return
        if not table_exists(self.files):
            ledger.partition_by = wanted
            atomic_write_json(self.meta / "ledger.json", ledger.to_json())
            return
        raise CdcLayoutError(
            f"stream {self.name!r}: partition_by = {wanted} but the Delta table at "
            f"{self.location} is partitioned by {ledger.partition_by}. Set partition_by back, or "
            f"point the stream's path at a new folder."
        )

    def _load_or_create_ledger(self) -> Ledger:
        if self.shared:  # the ledger on disk is the name's: another WAL's is a second daemon
            ledger = read_ledger(self.path, self.meta)
            if (
                ledger is not None
                and ledger.wal_id
                and self.wal_id
                and ledger.wal_id != self.wal_id
            ):
                self._two_daemons(ledger.wal_id)
        return super()._load_or_create_ledger()

    def _two_daemons(self, theirs: str) -> NoReturn:
        raise IdentityMismatchError(
            f"stream {self.name!r}: two daemons named {self.daemon_name!r} write the "
            f"shared Delta table at {self.location}: the table's writer of that name "
            f"is WAL id {theirs}, this daemon's WAL id is {self.wal_id}. Give each "
            f"daemon its own [daemon] name (a name stays with its WAL: keep it across "
            f"a restore or a takeover)."
        )

    def _new_ledger(self) -> Ledger:
        ledger = super()._new_ledger()
        ledger.table_format = "delta"
        return ledger

    def _check_table_identity(self, created_ledger: bool) -> None:
        """A table at the path that this stream's ledger does not know (the
        ledger was just created) must hold this stream's commits only; another
        daemon's (another WAL id) refuse in ``_roll_forward``."""
        if not created_ledger or not table_exists(self.files):
            return
        apps = {
            t.get("appId")
            for _, actions in log_commits(self.files, -1)
            for t in actions.get("txn", [])
        }
        if self.app_id not in apps and not any(str(a).startswith("eventplane/") for a in apps):
            raise IdentityMismatchError(
                f"stream {self.name!r}: {self.location} holds a Delta table without a ledger of "
                f"this stream ({META_DIR}/ledger.json) nor any eventplane commit: eventplane "
                f"did not write it. Point the stream's path at a new folder."
            )

    def _roll_forward(self, report: RecoveryReport) -> None:
        """Step 2 for commits Delta holds and the ledger does not (a crash
        between the two): appended from their ``userMetadata``."""
        for version, actions in log_commits(self.files, self.ledger.delta_version):
            apps = [
                t for t in actions.get("txn", []) if str(t.get("appId")).startswith("eventplane/")
            ]
            # A fence's or a replay's txn is under the stream's app id.
            other = next(
                (t["appId"] for t in apps if t["appId"].split("/")[:3] != self.app_id.split("/")),
                None,
            )
            if other is not None and not self.shared:  # a shared table's other writers'
                raise IdentityMismatchError(
                    f"stream {self.name!r}: the Delta table at {self.location} holds commits of "
                    f"another event plane (Delta app id {other}, version {version}; this one "
                    f"writes as {self.app_id}). Its committed LSNs mean nothing to this WAL. "
                    f"Point [[cdc.streams]] path at a new folder, or move the old one away."
                )
            mine = [t for t in apps if t["appId"] == self.app_id]
            info = actions.get("commitInfo", {})
            meta = json.loads(info.get("userMetadata") or "{}").get("eventplane")
            if not mine or meta is None:
                continue
            bid = int(mine[0]["version"])
            if bid <= self.ledger.last_batch_id:
                continue
            ranges = _ranges_from_json(meta["ranges"])
            quarantined = int(meta.get("quarantined", 0))
            self._append_ledger(bid, ranges, int(meta["rows"]), [], quarantined, version)
            report.rolled_forward.append(bid)

    # -- commit ------------------------------------------------------------

    def commit(
        self, df: Any, batch: MicroBatch, rows: int, raw: RawInbox | None = None
    ) -> CommitResult:
        """Commit this stream's rows of ``batch`` exactly once (protocol: module doc)."""
        started = time.monotonic()
        bid = batch.batch_id
        # Step 0. Idempotency.
        if bid <= self.ledger.last_batch_id:
            self._check_rerun(batch)
            return CommitResult(self.name, bid, rows, 0, True, 0.0)
        self._check_lsns(batch)
        set_aside: list[quarantine.QuarantinedRow] = []
        written = rows
        version = self.ledger.delta_version
        if rows:
            crash_point("cdc.before_stage")
            self._pending = (batch, rows, 0)
            if raw is not None and raw.direct and not self.writes_direct:
                raw = replace(raw, direct=False)
            # Step 1. Commit (rows that fail alone are set aside first: _set_aside).
            staging = self._staging_dir(bid)
            try:
                set_aside = self._stage(df, batch, rows, raw, staging, self._set_aside)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            written = rows - len(set_aside)
            version = max(version, self._version)
            self.commits_since_optimize += 1
            crash_point("delta.after_commit")
        # Step 2. Ledger.
        self._append_ledger(bid, batch.ranges(), written, [], len(set_aside), version)
        self.quarantined += len(set_aside)
        crash_point("cdc.after_ledger")
        seconds = time.monotonic() - started
        return CommitResult(self.name, bid, written, 0, False, seconds, len(set_aside))

    def _set_aside(self, batch: MicroBatch, rows: list[quarantine.QuarantinedRow]) -> None:
        """Before the write without them: the rows are durable in the quarantine."""
        quarantine.write_batch(self.meta, self.name, batch.batch_id, rows)
        crash_point("cdc.after_quarantine")
        assert self._pending is not None
        self._pending = (batch, self._pending[1] - len(rows), len(rows))

    def _table_columns(self) -> tuple[str, ...]:
        return TABLE_COLUMNS if self.stream.variant else DELTA_COLUMNS

    def _write_staged(self, df: Any, staging: Path) -> None:
        """Step 1's Delta commit: given a :class:`RawInbox`, the direct write
        into ``staging`` and a commit of its files (:meth:`_commit_files`);
        else a Spark append of the DataFrame ``df``. Tests wrap this to inject
        write failures."""
        assert self._pending is not None, "a Delta write outside commit()"
        batch, rows, quarantined = self._pending
        meta = {
            "batch_id": batch.batch_id,
            "ranges": {str(c): [a, b] for c, (a, b) in sorted(batch.ranges().items())},
            "rows": rows,
            "quarantined": quarantined,
        }
        if isinstance(df, RawInbox) or self.files.remote:
            # Staged on the daemon's disk, committed by delta-rs (a table on
            # S3 takes this path for a Spark-written batch too).
            if not self._created:
                if isinstance(df, RawInbox):
                    assert df.reread is not None, "the first commit needs the batch's schema"
                    self._create_table(df.spark, self._select(df.reread((), ())))
                else:
                    self._create_table(df.sparkSession, df)
            super()._write_staged(df, staging)
            self._commit_files(staging, batch.batch_id, meta)
            return
        spark = df.sparkSession
        if not self._created:
            self._create_table(spark, df)
        self._append(df, meta, {"txnAppId": self.app_id, "txnVersion": str(batch.batch_id)})
        self._version = self._table_version()

    def _commit_files(self, staging: Path, bid: int, meta: dict[str, Any]) -> None:
        """The direct path's commit of batch ``bid``'s staged files:

        a. fsync them and rename them into the table's partition folders
           (``part-b<B>-*``): no snapshot lists them yet;
           ``delta.before_commit`` after it;
        b. one Delta commit of their ``add`` actions, with the stream's
           ``txn`` and ``userMetadata`` (delta-rs, :mod:`daemon.table.deltacommit`);
        c. fsync the new log entries (Delta's writers do not): the ledger
           that follows never names a commit a power loss could take back.

        A commit that failed leaves no file behind (one whose outcome the log
        cannot tell yet leaves them: the next attempt or the next open decides);
        files of a crash before (b) are removed when the stream opens
        (``_remove_orphans``); an error after the commit is logged, not raised."""
        files = self._final_files(staging, bid)
        if not files:  # every row of the stream was set aside
            return
        actions = [
            deltacommit.add_action(staging / rel, final, STATS_COLUMNS) for rel, final in files
        ]
        if self.keeper is not None:
            self.keeper.check()
        if isinstance(self.files, S3Files):
            try:
                self.files.upload(staging, files)
            except Exception:
                self._forget_upload(files)
                raise
        else:
            for rel, _ in files:
                fsync_file(staging / rel)
            self._publish_files(bid, files, staging)
        crash_point("delta.before_commit")
        table = self._delta_table()
        try:
            if self.keeper is not None:
                self.keeper.check()  # the upload took a while: fenced again
            if isinstance(self.files, S3Files) or self.shared:
                if not self._commit_fenced(table, actions, meta, self.app_id, bid):
                    self._unlink(files)  # an earlier attempt committed it
            elif self._in_log(table, bid):
                # An earlier attempt committed it (its error came after the commit).
                self._unlink(files)
            else:
                deltacommit.commit(
                    table,
                    actions,
                    partition_by=list(self.partition_by),
                    app_id=self.app_id,
                    version=bid,
                    user_metadata={"eventplane": meta},
                    writer=self.writer,
                    name=self.fence.name,
                )
        except LeaseError:
            raise  # not this writer's table now: its files are for the holder's open to judge
        except Exception as exc:
            committed = self._in_log(table, bid)
            if committed is False:
                self._unlink(files)  # never in the log: nothing of this attempt stays
            if not committed:
                raise  # unknown: the files stay; the next open removes them if uncommitted
            log.warning(
                "cdc_delta_error_after_commit", stream=self.name, batch_id=bid, error=str(exc)
            )
        table.update_incremental()
        self._version = int(table.version())
        self._fsync_log(self._version)

    def _in_log(self, table: Any, bid: int) -> bool | None:
        """Batch ``bid`` is in the table (a ``txn`` of this stream's app id at
        or above it); None when the log cannot be read now."""
        try:
            table.update_incremental()
            if isinstance(self.files, S3Files):
                self._check_fence(table)  # another writer's txn is not this one's
            done = table.transaction_version(self.app_id)
        except LeaseError:
            raise
        except Exception as exc:
            log.warning("cdc_delta_log_unreadable", stream=self.name, error=str(exc))
            return None
        return done is not None and int(done) >= bid

    def _commit_fenced(
        self, table: Any, actions: list[Any], meta: dict[str, Any], app: str, version: int | None
    ) -> bool:
        """A commit to a table on S3, fenced by the store, or to a shared
        table (the fence on S3 only: on disk each writer's lock is its own), with the ``txn``
        (``app``, ``version``; None: the last one plus 1):

        1. Read the log: the commits since the last checked version are this
           writer's (:meth:`_check_fence`; another's stops here).
        2. The txn is in it: done (an earlier call's commit: returns False).
        3. Commit with no automatic retry (``delta.before_log_commit`` before
           it): the entry lands at the version after the one read, or fails.
        4. It failed (another commit took that version): back to 1, so a
           conflict with this writer's own maintenance is retried.
        """
        from deltalake.exceptions import CommitFailedError

        attempts = SHARED_COMMIT_ATTEMPTS if self.shared else COMMIT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            # Step 1. Read the log.
            table.update_incremental()
            if isinstance(self.files, S3Files):
                self._check_fence(table)
            # Step 2. Committed already?
            done = table.transaction_version(app)
            if version is None:
                version = int(done or 0) + 1
            if done is not None and int(done) >= version:
                return attempt > 1
            crash_point("delta.before_log_commit")
            # Step 3. Commit.
            try:
                deltacommit.commit(
                    table,
                    actions,
                    partition_by=list(self.partition_by),
                    app_id=app,
                    version=version,
                    user_metadata={"eventplane": meta},
                    writer=self.writer,
                    name=self.fence.name,
                    retries=0,
                )
                return True
            except CommitFailedError as exc:
                # Step 4. Whose commit took the version?
                if attempt == attempts:
                    raise
                if self.on_commit_retry is not None:
                    self.on_commit_retry()
                log.info("cdc_delta_commit_conflict", stream=self.name, app=app, error=str(exc))
        raise AssertionError("unreachable")

    def _forget_upload(self, files: list[tuple[str, str]]) -> None:
        """After a failed upload: remove what of it arrived, if the store
        answers (else the next open's orphan removal or VACUUM will)."""
        try:
            self._unlink(files)
        except Exception as exc:
            log.info("cdc_upload_not_removed", stream=self.name, error=str(exc))

    def _unlink(self, files: list[tuple[str, str]]) -> None:
        self.files.remove([final for _, final in files])

    def _fsync_log(self, upto: int) -> None:
        self.files.sync_log(range(self.ledger.delta_version + 1, upto + 1))

    def _delta_table(self) -> Any:
        """The stream's table as delta-rs sees it: loaded once, then updated."""
        if self._dt is None:
            self._dt = self._maintenance_table()
        return self._dt

    def _append(self, df: Any, meta: dict[str, Any], options: dict[str, str]) -> None:
        """One Delta append of ``df``: a commit whose ``userMetadata`` is
        ``{"eventplane": meta}``."""
        writer = df.write.format("delta").mode("append")
        for key, value in options.items():
            writer = writer.option(key, value)
        body = json.dumps({"eventplane": meta}, separators=(",", ":"))
        writer.option("userMetadata", body).save(str(self.path))

    def _append_staged(self, df: Any, bid: int, meta: dict[str, Any]) -> None:
        """:meth:`_append` for a table on S3: ``df`` staged on disk, uploaded,
        committed by delta-rs after a lease check and the fence
        (:meth:`_commit_fenced`), with a ``txn`` of the replays' own (the
        intent's replay id decides its recovery)."""
        staging = self.meta / "staging" / f"r{bid:012d}"
        try:
            CdcSink._write_staged(self, df, staging)
            files = self._final_files(staging, bid)
            actions = [deltacommit.add_action(staging / r, f, STATS_COLUMNS) for r, f in files]
            if self.keeper is not None:
                self.keeper.check()
            assert isinstance(self.files, S3Files)
            self.files.upload(staging, files)
            if self.keeper is not None:
                self.keeper.check()  # the upload took a while
            self._commit_fenced(self._delta_table(), actions, meta, self.app_id + REPLAY_APP, None)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _append_local(self, df: Any, bid: int, meta: dict[str, Any]) -> None:
        """:meth:`_append` for a local table without VARIANT columns, by
        delta-rs (no Delta jar): ``df`` written as Parquet into staging,
        published into the table's folders (fsynced), one commit of their
        ``add`` actions (no ``txn``: a replay's intent decides). Files of a
        crash before the commit are in no snapshot; VACUUM removes them."""
        staging = self.meta / "staging" / f"r{bid:012d}"
        try:
            CdcSink._write_staged(self, df, staging)
            files = self._final_files(staging, bid)
            actions = [deltacommit.add_action(staging / r, f, STATS_COLUMNS) for r, f in files]
            for rel, _ in files:
                fsync_file(staging / rel)
            self._publish_files(bid, files, staging)
            table = self._delta_table()
            table.update_incremental()
            deltacommit.commit(
                table,
                actions,
                partition_by=list(self.partition_by),
                user_metadata={"eventplane": meta},
                writer=self.writer,
                name=self.fence.name,
            )
            table.update_incremental()
            self.files.sync_log(range(int(table.version()), int(table.version()) + 1))
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _create_table(self, spark: Any, df: Any) -> None:
        """Before the stream's first append in this process: create the table
        if there is none (version 0, with Delta's properties and this
        daemon's ``eventplane.*`` ones), add the batch's columns the table
        lacks (the ``producer`` column of tables written before it). Another
        daemon's table refuses. delta-rs does it all, on disk as on S3; a
        ``variant = true`` table (whose schema delta-rs cannot hold) takes
        Spark's SQL and Delta's jars."""
        if self.stream.variant and not self.files.remote:
            self._create_spark_table(spark, df)
            return
        from deltalake import DeltaTable, Field, Schema

        if not table_exists(self.files):
            schema = json.loads(df.schema.json())
            if self.shared:
                column = {"name": WRITER_COLUMN, "type": "string", "nullable": True, "metadata": {}}
                schema["fields"].append(column)
            DeltaTable.create(
                self.files.uri,
                Schema.from_json(json.dumps(schema)),
                mode="ignore",
                partition_by=list(self.partition_by),
                configuration={**DELTA_PROPERTIES, **self._our_properties()},
                storage_options=self.files.storage_options,
                raise_if_key_not_exists=False,
                commit_properties=self._commit_properties(),
            )
        table = self._maintenance_table()
        props = dict(table.metadata().configuration)
        if self.shared:
            self._check_sharing(props)
            self._join_shared(table)
        elif not self._check_properties(props):
            if self.files.remote:
                raise IdentityMismatchError(
                    f"stream {self.name!r}: the Delta table at {self.location} does not name "
                    f"an event plane (no eventplane.* properties): eventplane did not create "
                    f"it. Point [[cdc.streams]] path at a new prefix."
                )
            # A local table this stream's ledger knows (_check_table_identity)
            # but created before its properties were set: name this daemon.
            table.alter.set_table_properties(
                self._our_properties(), commit_properties=self._commit_properties()
            )
        have = {f.name for f in table.schema().fields}
        added = [f for f in df.schema if f.name not in have]
        if added:
            table.alter.add_columns(
                [Field(f.name, f.dataType.simpleString()) for f in added],
                commit_properties=self._commit_properties(),
            )
            log.info("cdc_delta_columns_added", stream=self.name, columns=[f.name for f in added])
        self._created = True

    def _create_spark_table(self, spark: Any, df: Any) -> None:
        """:meth:`_create_table` of a local ``variant = true`` table, by Spark:
        an empty write (version 0), then the ``eventplane.*`` properties
        (Delta takes them from ALTER TABLE only) and the missing columns."""
        path = str(self.path)
        if not table_exists(self.files):
            writer = spark.createDataFrame([], df.schema).write.format("delta").mode("append")
            writer = writer.partitionBy(*self.stream.partition_by)
            for key, value in DELTA_PROPERTIES.items():
                writer = writer.option(key, value)
            writer.save(path)
        props = {
            r["key"]: r["value"] for r in spark.sql(f"SHOW TBLPROPERTIES delta.`{path}`").collect()
        }
        theirs = self._check_properties(props)
        if not theirs:
            pairs = ", ".join(f"'{k}' = '{v}'" for k, v in self._our_properties().items())
            spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ({pairs})")
        have = set(spark.read.format("delta").load(path).columns)
        added = [f"`{f.name}` {f.dataType.simpleString()}" for f in df.schema if f.name not in have]
        if added:
            spark.sql(f"ALTER TABLE delta.`{path}` ADD COLUMNS ({', '.join(added)})")
            log.info("cdc_delta_columns_added", stream=self.name, columns=added)
        self._created = True

    def _daemon(self) -> dict[str, str]:
        """This daemon's properties in a shared table: its WAL and ``cores``."""
        key = DAEMON_PROPERTY + self.daemon_name
        return {f"{key}.wal_id": self.wal_id, f"{key}.cores": str(self.cores)}

    def _check_sharing(self, props: dict[str, str]) -> None:
        """The table is shared exactly when this stream says ``writers = "shared"``."""
        shared = props.get(SHARED_PROPERTY) == "shared"
        if shared == self.shared:
            return
        if shared:
            names = ", ".join(sorted(_writer_names(props)))
            raise IdentityMismatchError(
                f'stream {self.name!r} has writers = "single" (the default) but the Delta '
                f'table at {self.location} is shared ({SHARED_PROPERTY} = "shared"; its '
                f"writers: {names}): a single writer would take the other daemons' commits "
                f'for another event plane\'s. Set writers = "shared" and [daemon] name to '
                f"join them, or point [[cdc.streams]] path at another table."
            )
        wal = props.get("eventplane.wal_id")
        raise IdentityMismatchError(
            f'stream {self.name!r} has writers = "shared" but the Delta table at '
            f"{self.location} is not a shared table (no {SHARED_PROPERTY} property"
            f"{'; its writer is WAL id ' + wal if wal else ''}): its one writer does not "
            f'expect others. Set writers = "single" (or remove the line), or point path at '
            f"a new folder for a shared table."
        )

    def _join_shared(self, table: Any) -> None:
        """This daemon's name in the shared table: its own WAL's, set by its
        first open (a ``metaData`` commit, retried onto the others'). Another
        WAL under the name, or this WAL under another name, refuses."""
        from deltalake.exceptions import CommitFailedError

        if not self.wal_id:  # an offline command (eventplane cdc compact): it appends nothing
            return
        for attempt in range(1, SHARED_COMMIT_ATTEMPTS + 1):
            table.update_incremental()
            names = _writer_names(dict(table.metadata().configuration))
            theirs = names.get(self.daemon_name)
            if theirs is not None and theirs != self.wal_id:
                self._two_daemons(theirs)
            other = [n for n, w in names.items() if w == self.wal_id and n != self.daemon_name]
            if other:
                raise IdentityMismatchError(
                    f"stream {self.name!r}: this daemon's WAL (id {self.wal_id}) writes the "
                    f"shared Delta table at {self.location} as {other[0]!r}, not as "
                    f"{self.daemon_name!r}: set [daemon] name = {other[0]!r} again (its "
                    f"commits and rows carry that name)."
                )
            if theirs is not None:
                return
            try:
                table.alter.set_table_properties(
                    self._daemon(), False, commit_properties=self._commit_properties()
                )
            except CommitFailedError:
                if attempt == SHARED_COMMIT_ATTEMPTS:
                    raise
                continue
            log.info("cdc_shared_table_joined", stream=self.name, writer=self.daemon_name)
            return

    def _our_properties(self) -> dict[str, str]:
        if self.shared:
            return {"eventplane.stream": self.name, SHARED_PROPERTY: "shared", **self._daemon()}
        return {
            "eventplane.stream": self.name,
            "eventplane.wal_id": self.wal_id,
            "eventplane.cores": str(self.cores),
        }

    def _check_properties(self, props: dict[str, str]) -> dict[str, str]:
        """The table's ``eventplane.*`` properties, if they are this stream's;
        another daemon's refuse."""
        ours = self._our_properties()
        theirs = {k: props[k] for k in ours if k in props}
        if theirs and theirs != ours:
            raise IdentityMismatchError(
                f"stream {self.name!r}: the Delta table at {self.location} was written by "
                f"another event plane (table properties {theirs}; this one: {ours}). Point "
                f"[[cdc.streams]] path at a new folder, or move the old one away."
            )
        return theirs

    def _table_version(self) -> int:
        """The table's version after this process's last commit, read by
        delta-rs (a compaction may have committed since: the ledger's version
        is then later, never earlier, than the batch's own commit)."""
        return int(self._maintenance_table().version())

    # -- maintenance ---------------------------------------------------------

    def compact(self, spark: Any, *, full: bool, on_progress: Callable[[Any], None] | None) -> Any:
        """Compaction is Delta's OPTIMIZE (bin-packing into files of about
        ``target_file_bytes``), committed beside the appends: Delta's
        concurrency control lets a blind append and a compaction both commit.
        Then VACUUM removes the files no snapshot of the last
        ``vacuum_retain_hours`` reads.
        With the direct write, delta-rs runs both, on one core (a batch's
        p99 beside compaction in a loop: 1.02x, against 2.3x with Spark's
        OPTIMIZE job, which takes both cores); a ``variant = true`` table
        (which delta-rs cannot open) takes Spark's.
        Due once ``compact_min_files`` batches committed since the last one
        (``full``: now). Returns the :class:`~daemon.table.compactplan.Progress`
        shown in status, or None when not due, or when another daemon
        maintains the shared table (:meth:`_maintains`)."""
        from daemon.table.compactplan import Progress

        if not self._maintains():
            return None
        if not full and self.commits_since_optimize < self.stream.compact_min_files:
            return None
        progress = Progress(self.name, "*", "optimize", 0, 0, 1, 0, self.ledger.last_batch_id)
        progress.step = "writing"
        if on_progress is not None:
            on_progress(progress)
        pending = self.commits_since_optimize
        if self.writes_direct:
            # A table of its own: the commit thread's is not shared across threads.
            metrics = self._guarded_table().optimize.compact(
                target_size=self.stream.target_file_bytes,
                max_concurrent_tasks=1,
                commit_properties=self._commit_properties(),
            )
        else:
            _activate(spark)
            spark.conf.set(
                "spark.databricks.delta.optimize.maxFileSize", str(self.stream.target_file_bytes)
            )
            metrics = spark.sql(f"OPTIMIZE delta.`{self.path}`").collect()[0]["metrics"]
        self.commits_since_optimize = max(0, self.commits_since_optimize - pending)
        # The merged-away files go once no snapshot of the window reads them.
        self._vacuum(spark)
        progress.inputs = int(metrics["numFilesRemoved"])
        progress.outputs = [f"{int(metrics['numFilesAdded'])} files"]
        progress.step = "done"
        progress.finished_at = time.time()
        log.info("cdc.compaction_done", stream=self.name, **progress.to_json())
        return progress

    def _maintenance_table(self) -> Any:
        """The table's newest snapshot, for a maintenance thread (delta-rs)."""
        from deltalake import DeltaTable

        return DeltaTable(self.files.uri, storage_options=self.files.storage_options)

    def _guarded_table(self) -> Any:
        """:meth:`_maintenance_table` for a maintenance commit; on S3 after
        the lease and fence checks (a commit rebased onto a later fence
        conflicts with its metaData)."""
        table = self._maintenance_table()
        if isinstance(self.files, S3Files):
            if self.keeper is not None:
                self.keeper.check()
            self._check_fence(table, advance=False)
        return table

    def apply_retention(self, spark: Any, now: float | None = None) -> RunResult:
        """Retention on a Delta table: a DELETE of the expired time partitions
        (a metadata-only commit: whole files go), then VACUUM, which removes
        the files no snapshot of the last ``vacuum_retain_hours`` reads."""
        s = self.stream
        assert s.retention_s is not None
        started = time.monotonic()
        if not self._maintains():
            assert self.maintainer is not None
            return RunResult(self.name, [], None, 0.0, maintainer=self.maintainer.maintainer)
        cutoff = (time.time() if now is None else now) - s.retention_s
        day = time.strftime("%Y-%m-%d", time.gmtime(cutoff))
        where = f"date < '{day}'"
        if "hour" in s.partition_by:
            where = f"({where}) OR (date = '{day}' AND hour < '{time.gmtime(cutoff).tm_hour:02d}')"
        before = max(self.files.log_versions(-1), default=-1)
        if self.writes_direct:
            deleted = self._guarded_table().delete(
                where, commit_properties=self._commit_properties()
            )
            rows = int(deleted.get("num_deleted_rows", 0))
        else:
            _activate(spark)
            deleted = spark.sql(f"DELETE FROM delta.`{self.path}` WHERE {where}").collect()
            rows = int(deleted[0][0]) if deleted else 0
        removed = self._deleted_partitions(before) if rows else []
        if removed:
            # The DELETE's row count is the table's, not a partition's: the first carries it.
            removed[0]["rows"] = rows
        self._vacuum(spark)
        log.info(
            "cdc.retention_removed",
            stream=self.name,
            where=where,
            rows=rows,
            partitions=len(removed),
            files=sum(r["files"] for r in removed),
            bytes=sum(r["bytes"] for r in removed),
        )
        return RunResult(self.name, removed, None, time.monotonic() - started)

    def _deleted_partitions(self, before: int) -> list[dict[str, Any]]:
        """Per partition, the files and bytes that the retention DELETE
        committed after version ``before`` removed: its commit's ``remove``
        actions (a batch or a compaction committing meanwhile is another
        operation, and is not counted)."""
        per: dict[str, dict[str, Any]] = {}
        for version in self.files.log_versions(before):
            lines = self.files.read_log(version).decode("utf-8").splitlines()
            actions = [json.loads(line) for line in lines if line.strip()]
            info: dict[str, Any] = next((a["commitInfo"] for a in actions if "commitInfo" in a), {})
            if info.get("operation") != "DELETE":
                continue
            for action in actions:
                remove = action.get("remove")
                if remove is None:
                    continue
                values = remove.get("partitionValues") or {}
                # A file's partitionValues need not list its columns in the table's order.
                order = [c for c in self.stream.partition_by if c in values]
                keys = order + sorted(set(values) - set(order))
                name = "/".join(f"{k}={values[k]}" for k in keys)
                entry = per.setdefault(name, {"partition": name, "files": 0, "bytes": 0})
                entry["files"] += 1
                entry["bytes"] += int(remove.get("size") or 0)
        return [dict(entry, rows=0) for _, entry in sorted(per.items())]

    def vacuum_window_hours(self) -> int:
        """VACUUM keeps the files a snapshot of the last this many hours reads
        (``vacuum_retain_hours``); the seam where a test shortens the window to
        see files go while readers read."""
        return self.stream.vacuum_retain_hours

    def _vacuum(self, spark: Any) -> None:
        hours = self.vacuum_window_hours()
        if self.writes_direct:
            table = self._guarded_table()
            # full: also files no snapshot ever listed (a crashed attempt's),
            # once older than the window, as Spark's VACUUM does. Not with a
            # 0 h window (only a test's, vacuum_window_hours): a batch's files
            # committed after this snapshot are "never listed" and as old.
            table.vacuum(
                retention_hours=hours,
                dry_run=False,
                enforce_retention_duration=False,
                full=hours > 0,
                commit_properties=self._commit_properties(),
            )
            # Log entries older than delta.logRetentionDuration, up to a
            # checkpoint (the batch commits leave them: deltacommit.commit).
            table.cleanup_metadata()
            return
        # Delta refuses a window under its 7-day default unless told: the
        # configured window is the user's decision (docs/cdc.md).
        spark.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "false")
        spark.sql(f"VACUUM delta.`{self.path}` RETAIN {hours:d} HOURS").collect()

    # -- quarantine ----------------------------------------------------------

    def _replay_batch(
        self,
        spark: Any,
        frame_of: Callable[[MicroBatch], Any],
        bid: int,
        ok: list[quarantine.QuarantinedRow],
    ) -> None:
        """A replay's steps after the writer's check, for the rows ``ok`` of
        batch ``bid`` (the Parquet sink's :meth:`replay_quarantine` runs it):

        2. Intent ``quarantine/r<batch>.json``: the rows, a replay id, and the
           table's version before the append.
        3. One Delta append of the rows whose ``userMetadata`` names the
           replay id (``cdc.replay_after_intent`` before it,
           ``cdc.replay_after_publish`` after it).
        4. Take the rows out of the quarantine, then remove the intent.

        Recovery (:meth:`_complete_replays`): an intent whose replay id is in
        the log after its version rolls forward (step 4), else it is removed
        and its rows stay quarantined.
        """
        df = self._select(frame_of(quarantine.batch_of(bid, ok)))
        if not self._created:
            self._create_table(spark, df)
        # Step 2. Intent.
        replay_id = uuid.uuid4().hex
        lsns = [r.lsn for r in ok]
        atomic_write_json(
            quarantine.replay_file(self.meta, bid),
            {
                "stream": self.name,
                "lsns": lsns,
                "replay_id": replay_id,
                "after_version": self._table_version(),
            },
        )
        crash_point("cdc.replay_after_intent")
        # Step 3. The append.
        meta = {"replay_id": replay_id, "batch_id": bid, "lsns": lsns}
        if self.files.remote:
            self._append_staged(df, bid, meta)
        elif self.stream.variant:
            self._append(df, meta, {})
        else:
            self._append_local(df, bid, meta)
        crash_point("cdc.replay_after_publish")
        # Step 4. Out of the quarantine; the intent goes last.
        quarantine.drop(self.meta, lsns)
        quarantine.replay_file(self.meta, bid).unlink(missing_ok=True)

    def _final_files(self, staging: Path, bid: int) -> list[tuple[str, str]]:
        """:meth:`_staged_files`; in a shared table each under this writer's
        ``writer=<name>`` folder (its partition value, and its own files)."""
        files = self._staged_files(staging, bid)
        if not self.shared:
            return files
        folder = f"{WRITER_COLUMN}={self.daemon_name}"
        return [(rel, str(Path(final).parent / folder / Path(final).name)) for rel, final in files]

    def _remove_orphans(self, report: RecoveryReport) -> None:
        """Files of batches above the ledger's last (after the roll-forward:
        never committed) go; in a shared table, this writer's only (the
        others' batches are numbered by their own WALs)."""
        last = self.ledger.last_batch_id
        mine = f"{WRITER_COLUMN}={self.daemon_name}"
        orphans = [
            rel
            for batch_id, rel in self.files.published()
            if batch_id > last and (not self.shared or mine in rel.split("/")[:-1])
        ]
        self.files.remove(orphans)
        report.orphans_removed.extend(orphans)

    def _complete_replays(self) -> None:
        """Recovery of replays (step 4 or back): their commit is in the log or not."""
        for bid, path in quarantine.replay_intents(self.meta):
            raw = json.loads(path.read_bytes())
            committed = any(
                json.loads(a.get("commitInfo", {}).get("userMetadata") or "{}")
                .get("eventplane", {})
                .get("replay_id")
                == raw["replay_id"]
                for _, a in log_commits(self.files, int(raw["after_version"]))
            )
            if committed:
                quarantine.drop(self.meta, [int(x) for x in raw["lsns"]])
            log.warning(
                "cdc_quarantine_replay_recovered",
                stream=self.name,
                batch_id=bid,
                rows=len(raw["lsns"]),
                outcome="rolled forward" if committed else "rolled back",
            )
            path.unlink()


def _activate(spark: Any) -> None:
    """Make ``spark`` the active session of this thread's JVM thread: Delta's
    commands (VACUUM) look it up, and a maintenance thread has none."""
    _py4j_jvm(spark).org.apache.spark.sql.SparkSession.setActiveSession(spark._jsparkSession)


def _writer_names(props: dict[str, str]) -> dict[str, str]:
    """A shared table's writers: ``{name: WAL id}`` from its properties."""
    tail = ".wal_id"
    return {
        k[len(DAEMON_PROPERTY) : -len(tail)]: v
        for k, v in props.items()
        if k.startswith(DAEMON_PROPERTY) and k.endswith(tail)
    }
