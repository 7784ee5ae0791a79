"""Retention of a time-partitioned CDC stream: whole partitions, atomically for readers.

A stream with ``partition_by = ["collection", "date"]`` (or ``[..., "hour"]``)
keeps each UTC day (hour) of ``ingest_ts`` in its own folder::

    <path>/collection=orders/date=2026-11-25/part-b000000000042-...parquet

With ``retention = "30d"`` a time partition is *expired* when its whole time
range ended more than 30 days ago (``end <= now - retention``) **and** the
table already holds a newer partition (``end <= start of the newest time
partition``): a partition is only removed once the stream's committed rows
have moved past it, so a stream that is behind (a stage catching up, a
backfill; both write rows with their original ``ingest_ts``) cannot write
into a partition after it was removed. See docs/cdc.md, "Time partitioning
and retention", for the limits of that guard.

Removal of one partition (the steps have crash points, ``CRASH_POINTS``):

1. rename ``<...>/date=X`` to the hidden sibling ``<...>/.expired-date=X-<id>``
   and fsync the parent: readers skip names starting with ``.``, so the whole
   partition disappears in one rename, never file by file. Given the
   daemon's sink, the rename is under its ``commit_lock`` and skips a
   partition a compaction claimed (``CdcSink.compacting``; it goes at the
   next run): a compaction never swaps a folder retention removed;
2. append the removal (counted from the hidden folder) to
   ``_eventplane/retention.json`` (atomic replace);
3. delete the hidden folder, file by file.

Recovery (``recover``, when the stream opens): every hidden ``.expired-*``
folder is a partition already gone for readers; one the log does not have is
logged (its files counted from what is left), then it is deleted.
"""

from __future__ import annotations

import calendar
import contextlib
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from daemon.config import CdcStream
from daemon.table.crash import crash_point
from daemon.table.durable import atomic_write_json, fsync_dir
from daemon.table.errors import CdcError
from daemon.table.layout import META_DIR
from daemon.table.sink import MaintainedTable
from daemon.table.snapshot import table_change

log = structlog.get_logger("eventplane.cdc")

LOG_FILE = "retention.json"
LOG_FORMAT = 1
HIDDEN_PREFIX = ".expired-"
KEEP_RECORDS = 256  # removals kept in the log; totals count them all
_SPAN = {"date": 86_400, "hour": 3_600}


@dataclass(slots=True)
class Partition:
    """One time partition (the deepest time folder) of a stream."""

    rel: str  # "collection=orders/date=2026-11-25" (or ".../hour=07")
    start: float  # epoch seconds, UTC
    end: float
    files: int = 0
    bytes: int = 0
    rows: int | None = None


@dataclass(slots=True)
class Plan:
    stream: str
    cutoff: float  # now - retention
    expired: list[Partition]
    kept: list[Partition]

    @property
    def oldest_kept(self) -> str | None:
        return min(self.kept, key=lambda p: p.start).rel if self.kept else None

    def to_json(self) -> dict[str, Any]:
        return {
            "stream": self.stream,
            "cutoff": self.cutoff,
            "expired": [asdict(p) for p in self.expired],
            "partitions_kept": len(self.kept),
            "oldest_kept": self.oldest_kept,
            "files": sum(p.files for p in self.expired),
            "bytes": sum(p.bytes for p in self.expired),
            "rows": sum(p.rows or 0 for p in self.expired),
        }


@dataclass(slots=True)
class RetentionLog:
    """``_eventplane/retention.json``: what retention removed from the stream."""

    stream: str
    last_run_at: float | None = None
    partitions_removed: int = 0
    files_removed: int = 0
    bytes_removed: int = 0
    rows_removed: int = 0
    removed: list[dict[str, Any]] = field(default_factory=list)  # newest last, bounded

    def add(self, record: dict[str, Any]) -> None:
        self.removed.append(record)
        del self.removed[:-KEEP_RECORDS]
        self.partitions_removed += 1
        self.files_removed += int(record["files"])
        self.bytes_removed += int(record["bytes"])
        self.rows_removed += int(record.get("rows") or 0)

    def to_json(self) -> dict[str, Any]:
        return {"format": LOG_FORMAT, **asdict(self)}


def read_log(path: Path, stream: str) -> RetentionLog:
    file = path / META_DIR / LOG_FILE
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        return RetentionLog(stream)
    try:
        import json

        doc = json.loads(raw)
        doc.pop("format", None)
        return RetentionLog(**doc)
    except (ValueError, TypeError) as exc:
        raise CdcError(f"{file}: unreadable retention log ({exc})") from exc


def _write_log(path: Path, rlog: RetentionLog) -> None:
    atomic_write_json(path / META_DIR / LOG_FILE, rlog.to_json())


# --------------------------------------------------------------------------
# Finding partitions


def _range(values: dict[str, str]) -> tuple[float, float] | None:
    """(start, end) epoch seconds of a partition's ``date`` (and ``hour``) values."""
    try:
        start = calendar.timegm(time.strptime(values["date"], "%Y-%m-%d"))
        span = _SPAN["date"]
        if "hour" in values:
            hour = int(values["hour"])
            if not 0 <= hour <= 23:
                return None
            start += hour * 3_600
            span = _SPAN["hour"]
    except (KeyError, ValueError):
        return None
    return float(start), float(start + span)


def _visible_dirs(folder: Path) -> Iterator[Path]:
    try:
        entries = sorted(folder.iterdir())
    except FileNotFoundError:
        return
    for d in entries:
        if d.is_dir() and not d.name.startswith(("_", ".")) and "=" in d.name:
            yield d


def time_partitions(
    path: Path, partition_by: tuple[str, ...], *, count: bool = True
) -> list[Partition]:
    """Every visible time partition of the table, with its files, bytes and rows
    (rows from the Parquet footers; None when a footer cannot be read)."""
    depth = len(partition_by)
    if depth < 2:
        return []
    out: list[Partition] = []

    def walk(folder: Path, level: int, values: dict[str, str]) -> None:
        for d in _visible_dirs(folder):
            col, _, value = d.name.partition("=")
            if col != partition_by[level]:
                continue
            got = {**values, col: value}
            if level + 1 < depth:
                walk(d, level + 1, got)
                continue
            span = _range(got)
            if span is None:
                continue  # not a folder this daemon writes; left alone
            part = Partition(str(d.relative_to(path)), span[0], span[1])
            if count:
                _count(d, part)
            out.append(part)

    walk(path, 0, {})
    return out


def _count(folder: Path, part: Partition) -> None:
    rows: int | None = 0
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
        for n in names:
            if n.startswith(("_", ".")):
                continue
            f = Path(root) / n
            part.files += 1
            part.bytes += f.stat().st_size
            if rows is not None:
                try:
                    import pyarrow.parquet as pq

                    rows += pq.read_metadata(f).num_rows
                except (OSError, ValueError):
                    rows = None
    part.rows = rows


def plan(stream: CdcStream, now: float | None = None, *, count: bool = True) -> Plan:
    """Which partitions retention would remove now (nothing is changed);
    ``count=False`` leaves their files, bytes and rows at 0 (no footer read)."""
    now = time.time() if now is None else now
    path = Path(stream.path)
    parts = time_partitions(path, stream.partition_by, count=count)
    if stream.retention_s is None:
        return Plan(stream.name, float("-inf"), [], parts)
    cutoff = now - stream.retention_s
    newest = max((p.start for p in parts), default=float("-inf"))
    expired = [p for p in parts if p.end <= cutoff and p.end <= newest]
    gone = {p.rel for p in expired}
    kept = [p for p in parts if p.rel not in gone]
    return Plan(stream.name, cutoff, expired, kept)


# --------------------------------------------------------------------------
# Removing


@dataclass(slots=True)
class RunResult:
    stream: str
    removed: list[dict[str, Any]]
    oldest_kept: str | None
    seconds: float
    deferred: list[str] = field(default_factory=list)  # claimed by a compaction
    # A shared table another daemon maintains: its name (this run removed nothing).
    maintainer: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "stream": self.stream,
            "removed": self.removed,
            "deferred": self.deferred,
            "partitions": len(self.removed),
            "files": sum(r["files"] for r in self.removed),
            "bytes": sum(r["bytes"] for r in self.removed),
            "rows": sum(r.get("rows") or 0 for r in self.removed),
            "oldest_kept": self.oldest_kept,
            "seconds": self.seconds,
            **({"skipped": f"maintained by {self.maintainer}"} if self.maintainer else {}),
        }


def apply(
    stream: CdcStream, now: float | None = None, *, sink: MaintainedTable | None = None
) -> RunResult:
    """Remove the expired partitions of ``stream``. The caller holds the stream
    (the daemon's open ``sink``, or the CLI with the stream's lock).

    With ``sink`` (the daemon, whose compactions run beside retention), each
    rename happens under its ``commit_lock`` and skips a partition a
    compaction claimed (``sink.compacting``); that one goes at the next run.
    The compaction claims under the same lock and checks that the partition
    is still there, so it never builds or swaps a partition retention removed.
    """
    started = time.monotonic()
    path = Path(stream.path)
    p = plan(stream, now)
    rlog = read_log(path, stream.name)
    removed: list[dict[str, Any]] = []
    deferred: list[str] = []
    for part in p.expired:
        src = path / part.rel
        hidden = src.parent / f"{HIDDEN_PREFIX}{src.name}-{uuid.uuid4().hex[:12]}"
        crash_point("cdc.retention.before_rename")
        # Step 1: one rename takes the whole partition away from every reader
        # (and snapshot readers list again: daemon/table/snapshot.py).
        with sink.commit_lock if sink is not None else contextlib.nullcontext():
            if sink is not None and part.rel in sink.compacting:
                deferred.append(part.rel)
                log.info("cdc.retention_deferred", stream=stream.name, partition=part.rel)
                continue
            with table_change(path):
                os.rename(src, hidden)
        fsync_dir(src.parent)
        crash_point("cdc.retention.after_rename")
        # A compaction may have merged its files since the plan counted them.
        part = Partition(part.rel, part.start, part.end)
        _count(hidden, part)
        # Step 2: the record.
        record = _record(stream.name, part, hidden.name)
        rlog.add(record)
        _write_log(path, rlog)
        crash_point("cdc.retention.after_log")
        # Step 3: the bytes.
        _delete(hidden)
        _remove_empty_parents(path, src.parent)
        log.info("cdc.retention_removed", **record)
        removed.append(record)
    rlog.last_run_at = time.time()
    _write_log(path, rlog)
    return RunResult(stream.name, removed, p.oldest_kept, time.monotonic() - started, deferred)


def _record(stream: str, part: Partition, hidden: str, recovered: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "stream": stream,
        "partition": part.rel,
        "hidden": hidden,
        "files": part.files,
        "bytes": part.bytes,
        "rows": part.rows,
        "removed_at": time.time(),
    }
    if recovered:
        out["recovered"] = True
    return out


def _delete(hidden: Path) -> None:
    first = True
    for root, dirs, names in os.walk(hidden, topdown=False):
        for n in names:
            (Path(root) / n).unlink(missing_ok=True)
            if first:
                first = False
                crash_point("cdc.retention.mid_delete")
        for d in dirs:
            shutil.rmtree(Path(root) / d, ignore_errors=True)
    shutil.rmtree(hidden, ignore_errors=True)


def _remove_empty_parents(path: Path, folder: Path) -> None:
    """A date folder whose hours all went is empty; drop it (never the
    top-level ``collection=...`` folder, which holds ``_common_metadata``)."""
    while folder != path and folder.parent != path:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


def recover(path: Path, stream: str) -> list[str]:
    """Finish removals a crash interrupted: log and delete every hidden
    ``.expired-*`` folder. Returns the partitions finished."""
    hidden: list[Path] = []
    for root, dirs, _ in os.walk(path):
        if root == os.fspath(path):
            dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
            continue
        hidden += [Path(root) / d for d in dirs if d.startswith(HIDDEN_PREFIX)]
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
    if not hidden:
        return []
    rlog = read_log(path, stream)
    logged = {r.get("hidden") for r in rlog.removed}
    done: list[str] = []
    for h in sorted(hidden):
        name = h.name[len(HIDDEN_PREFIX) :].rsplit("-", 1)[0]
        rel = str((h.parent / name).relative_to(path))
        if h.name not in logged:
            part = Partition(rel, 0.0, 0.0)
            _count(h, part)
            record = _record(stream, part, h.name, recovered=True)
            rlog.add(record)
            _write_log(path, rlog)
            log.info("cdc.retention_removed", **record)
        _delete(h)
        _remove_empty_parents(path, h.parent)
        done.append(rel)
    log.warning("cdc_retention_recovered", stream=stream, partitions=done)
    return done
