"""Per-core watermarks: how far each core's events are committed downstream.

A core's watermark is the last LSN of the last committed micro-batch slice
for that core (invariant 6), or, when the core is idle and owes nothing, the
highest LSN the plane has seen (the heartbeat), so WAL retention keeps moving.

The file is replaced atomically (temp file, fsync, rename, directory fsync)
and carries the WAL's id and the ``cores`` count (invariant 13)::

    {"format": "eventplane-watermarks", "version": 3, "wal_id": "...",
     "cores": 4, "batch_id": 17, "lsns": [120, 118, 0, 119],
     "stages": {"cdc:all": 19, "triggers": 17},
     "paused": {"triggers": {"since": 1740830400.0, "by": "ops@host",
                             "reason": "receiver maintenance"}},
     "crc32": ...}

``batch_id`` is the id of the last batch that every stage committed: plans
above it are re-run after a restart, each for the stages whose own progress
(``stages``: stage name -> last batch it committed) is below it (invariant
6). ``paused`` lists the stages an operator paused (``eventplane pause``):
they run no batch until resumed, and hold the watermarks where they stopped.
``crc32`` covers the canonical JSON of every other field.

``backfill`` lists the CDC streams that fill from the retained WAL before
they join the live batches (docs/cdc.md, "Adding a stream: backfill"): the
first LSN asked for, the last LSN of each core it fills up to (the hand-over:
every later event of that core is in a batch above the stream's progress),
when it started and how many events it may take at most (an LSN distance)::

     "backfill": {"cdc:new": {"start": 1, "until": [118, 120], "since": ...,
                              "total": 120}}

Versions: 4 added ``backfill``, 3 ``paused``. A file is written as version 4
only while a stream backfills, as version 3 only while a stage is paused,
else as version 2, so the release before either feature reads it (let the
backfills finish and resume every stage before going back to it). Version 3,
version 2 (no ``paused``) and version 1 files (no ``stages``: every stage at
``batch_id``) are read.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon.errors import DaemonError, IdentityMismatchError, LsnRegressionError

if TYPE_CHECKING:
    from daemon.metrics import Metrics
    from daemon.plane.batch import MicroBatch

FORMAT = "eventplane-watermarks"
# Written while a stage is paused; without one the file is written as version
# 2 (``UNPAUSED_VERSION``), which the release before pausing can read.
VERSION = 4
PAUSED_VERSION = 3
UNPAUSED_VERSION = 2
# Versions this build reads: 1 had no per-stage progress, 2 no paused stages,
# 3 no backfills.
READ_VERSIONS = (1, 2, 3, 4)
FILENAME = "watermarks.json"


class WatermarkFileError(DaemonError):
    """The watermarks file is unreadable or damaged."""


@dataclass(frozen=True, slots=True)
class Pause:
    """Why and since when an operator paused a stage (kept in the watermarks file)."""

    since: float  # Unix time
    by: str | None = None
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"since": self.since, "by": self.by, "reason": self.reason}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Pause:
        by, reason = doc.get("by"), doc.get("reason")
        return cls(
            float(doc["since"]),
            None if by is None else str(by),
            None if reason is None else str(reason),
        )


@dataclass(frozen=True, slots=True)
class Backfill:
    """A CDC stream filling from the retained WAL before it joins the live batches."""

    start: int  # first LSN it takes
    until: tuple[int, ...]  # per core: the last LSN it takes (the hand-over)
    since: float  # Unix time it started
    total: int  # events it may take at most (an LSN distance, an upper bound)

    def to_json(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "until": list(self.until),
            "since": self.since,
            "total": self.total,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Backfill:
        return cls(
            int(doc["start"]),
            tuple(int(x) for x in doc["until"]),
            float(doc["since"]),
            int(doc["total"]),
        )


@dataclass(frozen=True, slots=True)
class WatermarkSnapshot:
    wal_id: str
    cores: int
    batch_id: int
    lsns: tuple[int, ...]
    # Stage name -> the last batch that stage committed (>= batch_id).
    stages: tuple[tuple[str, int], ...] = ()
    # Stage name -> its pause, for the stages an operator paused.
    paused: tuple[tuple[str, Pause], ...] = ()
    # Stage name -> its backfill, for the CDC streams still filling.
    backfill: tuple[tuple[str, Backfill], ...] = ()

    @property
    def version(self) -> int:
        """The file version that holds this snapshot (module docstring)."""
        if self.backfill:
            return VERSION
        return PAUSED_VERSION if self.paused else UNPAUSED_VERSION

    def floor(self) -> int:
        """The lowest watermark: everything at or below it is committed on every core."""
        return min(self.lsns) if self.lsns else 0


def _body(s: WatermarkSnapshot, version: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "format": FORMAT,
        "version": version,
        "wal_id": s.wal_id,
        "cores": s.cores,
        "batch_id": s.batch_id,
        "lsns": list(s.lsns),
    }
    if version >= 2:
        body["stages"] = dict(s.stages)
    if version >= 3:
        body["paused"] = {name: pause.to_json() for name, pause in s.paused}
    if version >= 4:
        body["backfill"] = {name: b.to_json() for name, b in s.backfill}
    return body


def _crc(body: dict[str, Any]) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def fsync_dir(path: Path) -> None:
    """Make a rename or create in ``path`` durable (POSIX needs the directory fsync)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Step 1 write temp; Step 2 fsync it; Step 3 rename over; Step 4 fsync the folder."""
    tmp = path.with_name(path.name + ".tmp")
    # Step 1. Write the whole new content next to the old file.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        # Step 2. Make the content durable before it becomes visible.
        os.fsync(fd)
    finally:
        os.close(fd)
    # Step 3. Atomically replace: readers see the old or the new file, never a mix.
    os.replace(tmp, path)
    # Step 4. Make the rename itself durable.
    fsync_dir(path.parent)


class WatermarkStore:
    """Reads and writes the watermarks file; checks identity on load."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self, wal_id: str, cores: int, *, plans_path: Path | None = None) -> WatermarkSnapshot:
        """Return the stored watermarks, or all zeros when the file does not exist.

        Raises IdentityMismatchError when the file was written for another WAL
        or another core count, with what changed and what to do.
        """
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return WatermarkSnapshot(wal_id, cores, 0, (0,) * cores)
        except OSError as exc:
            raise WatermarkFileError(f"{self.path}: cannot read ({exc.strerror})") from exc
        try:
            doc = json.loads(raw)
            crc = doc.pop("crc32")
            version = doc.get("version")
            if doc.get("format") != FORMAT or version not in READ_VERSIONS:
                raise ValueError(f"format {doc.get('format')!r} version {version!r}")
            snap = WatermarkSnapshot(
                str(doc["wal_id"]),
                int(doc["cores"]),
                int(doc["batch_id"]),
                tuple(int(x) for x in doc["lsns"]),
                tuple(sorted((str(k), int(v)) for k, v in doc.get("stages", {}).items())),
                tuple(
                    sorted((str(k), Pause.from_json(v)) for k, v in doc.get("paused", {}).items())
                ),
                tuple(
                    sorted(
                        (str(k), Backfill.from_json(v)) for k, v in doc.get("backfill", {}).items()
                    )
                ),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WatermarkFileError(
                f"{self.path}: not a valid watermarks file ({exc}); restore it from a backup, "
                "or move it aside to replay every core from the start of the WAL"
            ) from exc
        bad_until = any(len(b.until) != snap.cores for _, b in snap.backfill)
        if crc != _crc(_body(snap, version)) or len(snap.lsns) != snap.cores or bad_until:
            raise WatermarkFileError(
                f"{self.path}: checksum mismatch ({len(raw)} bytes); the file is damaged. "
                "Restore it from a backup, or move it aside to replay every core from the "
                "start of the WAL"
            )
        aside = f"{self.path}" + (f" and {plans_path}" if plans_path else "")
        if snap.wal_id != wal_id:
            raise IdentityMismatchError(
                f"{self.path} belongs to WAL {snap.wal_id}, but the WAL in use has id {wal_id}: "
                "the WAL directory was replaced or re-created, so these watermarks do not "
                "describe its events. Restore the WAL directory that matches, or, to process "
                f"the new WAL from its start, move {aside} aside"
            )
        if snap.cores != cores:
            raise IdentityMismatchError(
                f"{self.path} was written with daemon.cores = {snap.cores}, but the "
                f"configuration now says {cores}. Events are sharded by core, so the core "
                f"count is fixed for the life of a data_dir: set daemon.cores = {snap.cores} "
                "again, or start with a new data_dir"
            )
        return snap

    def save(self, snap: WatermarkSnapshot) -> None:
        body = _body(snap, snap.version)
        body["crc32"] = _crc(_body(snap, snap.version))
        atomic_write(self.path, json.dumps(body, separators=(",", ":")).encode() + b"\n")


class Watermarks:
    """The in-memory committed watermarks, and what was last persisted.

    Only committed effects move a watermark (invariant 6): :meth:`commit` once
    every stage committed a batch, :meth:`advance` for the idle heartbeat,
    :meth:`stage_done` for one stage's own progress. Retention uses
    :attr:`persisted`, never the in-memory values, so a crash before the next
    flush can always re-run the batches that the file does not cover.
    """

    def __init__(self, loaded: WatermarkSnapshot, metrics: Metrics | None = None) -> None:
        self.wal_id = loaded.wal_id
        self.cores = loaded.cores
        self.lsns = list(loaded.lsns)
        self.batch_id = loaded.batch_id
        # Stage name -> last batch it committed; never below ``batch_id``.
        self.stages: dict[str, int] = {n: max(b, loaded.batch_id) for n, b in loaded.stages}
        # Stage name -> its pause (``daemon.plane.stages``: paused stages run nothing).
        self.paused: dict[str, Pause] = dict(loaded.paused)
        # Stage name -> its backfill (CDC streams filling from the WAL, docs/cdc.md).
        self.backfill: dict[str, Backfill] = dict(loaded.backfill)
        self.persisted = loaded
        self._metrics = metrics
        for core, lsn in enumerate(self.lsns):
            self._publish(core, lsn)

    @property
    def dirty(self) -> bool:
        return self.persisted != self.snapshot()

    def snapshot(self) -> WatermarkSnapshot:
        return WatermarkSnapshot(
            self.wal_id,
            self.cores,
            self.batch_id,
            tuple(self.lsns),
            tuple(sorted(self.stages.items())),
            tuple(sorted(self.paused.items())),
            tuple(sorted(self.backfill.items())),
        )

    def stage_done(self, stage: str, batch_id: int) -> None:
        """``stage`` committed ``batch_id`` (batches of one stage commit in id order)."""
        last = self.stages.get(stage, self.batch_id)
        if batch_id <= last:
            raise LsnRegressionError(
                f"stage {stage!r} committed batch {batch_id} after batch {last}; "
                "a stage commits batches in id order"
            )
        self.stages[stage] = batch_id

    def forget_stages(self, keep: set[str]) -> list[str]:
        """Drop the progress and pause of stages that are no longer configured;
        returns the paused ones among them."""
        for name in [n for n in self.stages if n not in keep]:
            del self.stages[name]
        dropped = sorted(n for n in self.paused if n not in keep)
        for name in dropped:
            del self.paused[name]
        for name in [n for n in self.backfill if n not in keep]:
            del self.backfill[name]
        return dropped

    def commit(self, batch: MicroBatch) -> None:
        """Advance every core of a batch every stage committed to its slice's last LSN."""
        self.commit_ranges(batch.batch_id, batch.ranges())

    def commit_ranges(self, batch_id: int, ranges: Mapping[int, tuple[int, int]]) -> None:
        """:meth:`commit` by the batch's plan: core -> (first LSN, last LSN)."""
        if batch_id <= self.batch_id:
            raise LsnRegressionError(
                f"batch {batch_id} committed after batch {self.batch_id}; batch ids must grow"
            )
        for core, (_, last) in ranges.items():
            if last <= self.lsns[core]:
                raise LsnRegressionError(
                    f"batch {batch_id} would move core {core}'s watermark back from "
                    f"LSN {self.lsns[core]} to {last}"
                )
        for core, (_, last) in ranges.items():
            self.lsns[core] = last
            self._publish(core, last)
        self.batch_id = batch_id

    def advance(self, core: int, lsn: int) -> bool:
        """Heartbeat: move an idle core forward (never back). True if it moved."""
        if lsn <= self.lsns[core]:
            return False
        self.lsns[core] = lsn
        self._publish(core, lsn)
        return True

    def _publish(self, core: int, lsn: int) -> None:
        if self._metrics is not None:
            self._metrics.watermark_lsn.labels(core=str(core)).set(lsn)
