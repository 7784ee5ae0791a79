"""The plan log: an append-only, fsynced record of planned batches.

Step 2 of the batch protocol (:mod:`daemon.plane.planner`) appends
``batch_id -> {core: (first_lsn, last_lsn)}`` here before the batch runs;
after a crash the planner re-runs the plans above the persisted watermarks.

Plan log format, one line per entry, each ``<crc32 of json, 8 hex> <json>\\n``;
the first line is the identity header (invariant 13)::

    0a1b2c3d {"format":"eventplane-plans","version":1,"wal_id":"...","cores":4}
    9f8e7d6c {"batch_id":1,"slices":{"0":[1,9],"2":[3,12]}}

A torn last line (crash mid-append) is cut off at open: its batch never ran,
because step 3 starts only after step 2's fsync returned.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from daemon.errors import DaemonError, IdentityMismatchError
from daemon.plane.watermarks import atomic_write

log = structlog.get_logger(__name__)

FORMAT = "eventplane-plans"
VERSION = 1
FILENAME = "plans.log"

Ranges = dict[int, tuple[int, int]]


class PlanLogError(DaemonError):
    """The plan log is damaged or could not be made durable (fatal)."""


def _line(doc: Mapping[str, Any]) -> bytes:
    body = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _parse(line: bytes) -> dict[str, Any] | None:
    """A checked entry, or None if the line is torn or fails its checksum."""
    if len(line) < 10 or not line.endswith(b"\n") or line[8:9] != b" ":
        return None
    body = line[9:-1]
    try:
        if int(line[:8], 16) != zlib.crc32(body):
            return None
        doc = json.loads(body)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


class PlanLog:
    """Append-only, fsynced record of planned batches. Methods block: call them
    from a worker thread (the planner does)."""

    def __init__(self, path: Path, wal_id: str, cores: int) -> None:
        self.path = path
        self.wal_id = wal_id
        self.cores = cores
        self._fd: int | None = None
        self.entries = 0  # plan lines currently in the file

    def _header(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "wal_id": self.wal_id, "cores": self.cores}

    def open(self) -> dict[int, Ranges]:
        """Read every plan, check identity, cut a torn tail, open for appends."""
        plans: dict[int, Ranges] = {}
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            atomic_write(self.path, _line(self._header()))
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            return plans
        lines = data.splitlines(keepends=True)
        good = 0  # bytes of valid prefix
        for i, line in enumerate(lines):
            doc = _parse(line)
            if doc is None:
                if i == len(lines) - 1:
                    log.warning(
                        "plan_log_torn_tail", path=str(self.path), offset=good, bytes=len(line)
                    )
                    break
                raise PlanLogError(
                    f"{self.path} @ offset {good}: damaged entry ({len(line)} bytes) before "
                    "the end of the file. Batches planned there cannot be re-run safely; "
                    "restore the data_dir from a backup"
                )
            if i == 0:
                self._check_header(doc)
            else:
                try:
                    bid = int(doc["batch_id"])
                    ranges = {int(c): (int(r[0]), int(r[1])) for c, r in doc["slices"].items()}
                except (KeyError, TypeError, ValueError, IndexError) as exc:
                    raise PlanLogError(f"{self.path} @ offset {good}: bad entry: {exc}") from exc
                plans[bid] = ranges
            good += len(line)
        if good == 0:
            # Only a torn header: the file was being created when the process died.
            atomic_write(self.path, _line(self._header()))
        elif good != len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        self.entries = len(plans)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        return plans

    def _check_header(self, doc: dict[str, Any]) -> None:
        if doc.get("format") != FORMAT:
            raise PlanLogError(f"{self.path}: not a plan log (format {doc.get('format')!r})")
        if doc.get("wal_id") != self.wal_id:
            raise IdentityMismatchError(
                f"{self.path} belongs to WAL {doc.get('wal_id')}, but the WAL in use has id "
                f"{self.wal_id}: the WAL directory was replaced or re-created. Restore the "
                "matching WAL directory, or move the plan log and watermarks.json aside to "
                "process the new WAL from its start"
            )
        if doc.get("cores") != self.cores:
            raise IdentityMismatchError(
                f"{self.path} was written with daemon.cores = {doc.get('cores')}, but the "
                f"configuration now says {self.cores}; the core count is fixed for the life "
                f"of a data_dir: set daemon.cores = {doc.get('cores')} again, or use a new "
                "data_dir"
            )

    def append(self, batch_id: int, ranges: Ranges) -> None:
        """Write one plan and fsync it. An fsync failure is fatal (invariant 10)."""
        if self._fd is None:
            raise PlanLogError(f"{self.path}: plan log is not open")
        line = _line({"batch_id": batch_id, "slices": {str(c): list(r) for c, r in ranges.items()}})
        try:
            view = memoryview(line)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            os.fsync(self._fd)
        except OSError as exc:
            raise PlanLogError(
                f"{self.path}: cannot make plan of batch {batch_id} durable ({exc.strerror}); "
                "stopping, as a failed fsync cannot be retried safely"
            ) from exc
        self.entries += 1

    def rewrite(self, keep: Mapping[int, Ranges]) -> None:
        """Replace the file atomically with the header and ``keep`` only."""
        data = _line(self._header()) + b"".join(
            _line({"batch_id": b, "slices": {str(c): list(r) for c, r in keep[b].items()}})
            for b in sorted(keep)
        )
        atomic_write(self.path, data)
        old, self._fd = self._fd, os.open(self.path, os.O_WRONLY | os.O_APPEND)
        if old is not None:
            os.close(old)
        self.entries = len(keep)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
