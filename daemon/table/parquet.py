"""Exactly-once CDC tables: Parquet partitioned by ``collection``, one ledger per stream.

A stream's ``path`` holds ``collection=X/part-b<B>-...parquet`` (published
files, named by batch; ``part-c<C>-...`` after a compaction) and, under
``_eventplane/`` (which no reader lists), ``ledger.json`` (the commit
record), ``pending/b<B>.json`` (intents), ``staging/b<B>/``, ``lock``,
``generation`` (snapshot.py) and ``compact/`` (compact.py).

Commit protocol for batch B (:meth:`CdcSink.commit`, steps marked in the code):

0. **Idempotency.** B at or below the ledger's last id: same ranges, or refuse.
1. **Stage.** B's rows written under ``staging/b<B>/`` (:mod:`daemon.table.parquetwrite`).
2. **Intent.** fsync the staged files, write ``pending/b<B>.json``: the point
   of no return.
3. **Publish.** Rename each staged file into its partition folder; fsync.
4. **Ledger.** Append B's ranges, rows and files to the ledger: committed.
5. **Clean.** Remove the intent and the staging folder.

Recovery (:meth:`CdcSink.open`) rolls intents forward, deletes staging
folders without one and orphans, recovers compactions and retention. Crash
points: ``CRASH_POINTS`` (daemon/table/crash.py). The why: docs/cdc.md,
"Exactly-once commit protocol" and "Crash points".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog

from daemon.config import CdcStream
from daemon.errors import IdentityMismatchError, LsnRegressionError
from daemon.plane.batch import MicroBatch
from daemon.table import compact, quarantine, retention, snapshot
from daemon.table.crash import crash_point
from daemon.table.durable import atomic_write_json, fsync_dir, fsync_file
from daemon.table.errors import (
    CdcError,
    CdcLayoutError,
    CdcLedgerMismatchError,
    CdcQuarantineLimitError,
    CdcRecoveryError,
    CdcStreamLockedError,
)
from daemon.table.layout import (
    META_DIR,
    SUMMARY_FILE,
    _published,
    committed_files,
)
from daemon.table.ledger import (
    KEEP_BATCHES,
    Ledger,
    LedgerEntry,
    _ranges_from_json,
    _ranges_to_json,
    read_ledger,
)
from daemon.table.parquetwrite import ParquetWrite
from daemon.table.sink import CommitResult, RecoveryReport, TableSink
from daemon.table.sparkio import (
    RawInbox,
    SelectList,
    WriteOptions,
    writer_errors,
)
from wal import lockfile

log = structlog.get_logger("eventplane.cdc")


class CdcSink(ParquetWrite):
    """One CDC stream: stages with Spark, publishes with renames, commits in its ledger.

    ``open`` and ``commit`` block (file system, py4j); the executor calls them
    from its worker thread. One batch at a time; a compaction may run in
    another thread meanwhile, and ``commit_lock`` orders the steps where the
    two touch the same folders and the ledger (publish, ledger, swap).
    """

    # Step 1 may write a raw inbox file without a Spark job (DirectWrite).
    writes_direct = True

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
        self.stream = stream
        self.daemon_name = daemon_name  # [daemon] name: a shared table's writer (delta.py)
        # Called once per commit attempt that lost its version to another commit.
        self.on_commit_retry: Callable[[], None] | None = None
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
        # Leaf partitions a compaction claimed (daemon/table/compact.py), by
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
            compact.recover(self, report)
            self._remove_orphans(report)
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

    def table_status(self) -> dict[str, Any]:
        """More of the table's state for ``/v1/status`` (the Delta sink's lease)."""
        return {}

    def _lock(self) -> None:
        # The lock file names this daemon (pid, host, since, data_dir, WAL id),
        # so a second writer is told who holds the stream; the flock fences.
        holder = {"stream": self.name, "wal_id": self.wal_id}
        if self.data_dir is not None:
            holder["data_dir"] = str(self.data_dir)
        try:
            self._lock_fd = lockfile.take(self.meta / "lock", holder)
        except lockfile.LockHeld as exc:
            error = CdcStreamLockedError(
                f"stream {self.name!r}: {self.path} is locked by another process (another "
                f"eventplane daemon writes it): its lock {exc}; stop that one or use another path"
            )
            error.lock_text = str(exc)
            raise error from None

    def _load_or_create_ledger(self) -> Ledger:
        ledger = read_ledger(self.path, self.meta)
        if ledger is None:
            ledger = self._new_ledger()
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

    def _new_ledger(self) -> Ledger:
        ledger = Ledger(self.name, self.wal_id, self.cores)
        ledger.partition_by = list(self.stream.partition_by)
        return ledger

    def _check_layout(self, ledger: Ledger) -> None:
        """Refuse a partition_by other than the table's: Spark's partition
        discovery fails on a folder that mixes ``collection=x/part-*`` and
        ``collection=x/date=d/part-*``. An empty table takes the new layout.
        A Delta table's folder is refused too (daemon/table/delta.py)."""
        if ledger.table_format != "parquet":
            raise CdcLayoutError(
                f'stream {self.name!r}: format = "parquet" but {self.path} holds a '
                f"{ledger.table_format} table (batches up to {ledger.last_batch_id}). Set "
                f'format = "{ledger.table_format}", or point the stream\'s path at a new folder.'
            )
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
        self,
        df: Any,
        batch: MicroBatch,
        rows: int,
        raw: RawInbox | None,
        staging: Path,
        set_aside_first: Callable[[MicroBatch, list[quarantine.QuarantinedRow]], None]
        | None = None,
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
           ``set_aside_first`` makes the rows durable before that write, for a
           format whose write is its commit (Delta).
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
        if set_aside and set_aside_first is not None:
            set_aside_first(batch, set_aside)
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

    def _append_ledger(
        self,
        batch_id: int,
        ranges: dict[int, tuple[int, int]],
        rows: int,
        files: list[str],
        quarantined: int = 0,
        delta_version: int | None = None,
    ) -> None:
        """``delta_version``: a Delta stream's table version after the commit."""
        entry = LedgerEntry(batch_id, ranges, rows, files, time.time(), quarantined)
        with self.commit_lock:  # a compaction records itself in the same file
            candidate = self.ledger.copy()
            candidate.append(entry, self.keep_batches)
            if delta_version is not None:
                candidate.delta_version = max(candidate.delta_version, delta_version)
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
            # Steps 2-5.
            self._replay_batch(spark, frame_of, bid, ok)
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

    def _replay_batch(
        self,
        spark: Any,
        frame_of: Callable[[MicroBatch], Any],
        bid: int,
        ok: list[quarantine.QuarantinedRow],
    ) -> None:
        """Steps 2-5 of :meth:`replay_quarantine` for the rows ``ok`` of batch ``bid``."""
        # Step 2. Stage.
        staging = self.meta / "staging" / f"r{bid:012d}"
        try:
            self._write_staged(self._select(frame_of(quarantine.batch_of(bid, ok))), staging)
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


def _implements(sink: CdcSink) -> TableSink:
    """mypy checks here that ``CdcSink`` is a ``TableSink``."""
    return sink
