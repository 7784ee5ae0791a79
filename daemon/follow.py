"""A standby's copy of the WAL archive: the continuous part of a restore
(docs/operating.md, "A standby").

A standby keeps ``<data_dir>/follow/``: each object of ``<uri>/wal/`` under
its number, so a takeover downloads only what came since the last poll.

Each poll (every ``[wal.archive] poll_ms``, in a thread of its own):

1. List ``<uri>/wal/``. Cached objects the listing no longer has were pruned by
   the primary (every stage had them): their files go.
2. Download each listed object not cached, in number order, and check it whole
   (wal/archive.py: header, body and frame CRCs, the manifest's WAL id, its
   number); a bad object is not kept: the restore at a takeover names it.
   Each file is written to a temp name, fsynced and renamed, so a file in the
   cache is always a whole, checked object.
3. The lag, measured before the downloads: the archive's last LSN (the header
   of the newest object) minus the cache's, and the age of the oldest object
   not cached yet (its ``LastModified``).

A takeover runs the restore (daemon/restore.py) with :meth:`Follower.fetch`
as its source: a cached object is read from disk (and checked again), any
other is downloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from daemon.errors import ArchiveUnavailable
from daemon.table.s3 import Location, client, explain
from wal.archive import (
    OBJECT_HEADER_SIZE,
    ArchiveFormatError,
    object_name,
    parse_header,
    parse_object,
)
from wal.files import fsync_dir

if TYPE_CHECKING:
    from daemon.config import S3Config, WalArchiveConfig
    from daemon.metrics import Metrics

log = structlog.get_logger("eventplane.follow")

DIRNAME = "follow"


class Follower:
    """A standby's poll of the archive into ``<data_dir>/follow/`` (module doc)."""

    def __init__(
        self,
        cfg: WalArchiveConfig,
        s3cfg: S3Config,
        data_dir: Path,
        metrics: Metrics | None = None,
        *,
        s3: Any = None,
    ) -> None:
        self.cfg, self.s3cfg, self.metrics = cfg, s3cfg, metrics
        self.where = Location.parse(cfg.uri)
        self.dir = data_dir / DIRNAME
        self._s3 = s3
        self.wal_id: str | None = None  # the manifest's, once the standby has read it
        self.cached: dict[int, tuple[int, int]] = {}  # number -> (first, last LSN); fences too
        self.cached_bytes = 0
        self.followed_lsn = 0  # the last LSN of the contiguous cache (0: none)
        self.archive_lsn = 0  # the archive's last LSN at the last poll
        self.lag_lsns = 0
        self.lag_s = 0.0
        self.polls = 0
        self.polled_at: float | None = None
        self.error: str | None = None
        self.error_since: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._lock = threading.Lock()  # one poll at a time (a cancelled task's thread runs on)
        self._load()

    # ---------------------------------------------------------------- cache

    def _load(self) -> None:
        """The cache a start finds (a standby restarted): checked headers only."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.dir.iterdir()):
            if not path.name.isdigit():
                path.unlink()  # a temp file of a poll killed midway
                continue
            try:
                with path.open("rb") as f:
                    head = parse_header(f.read(OBJECT_HEADER_SIZE))
            except (ArchiveFormatError, OSError):
                path.unlink()
                continue
            self.cached[int(path.name)] = (head.first_lsn, head.last_lsn)
            self.cached_bytes += path.stat().st_size
        self._advance()

    def _advance(self) -> None:
        """The followed LSN: the end of the cached objects, taken in number order."""
        last = 0
        for number in sorted(self.cached):
            first, end = self.cached[number]
            if last and first > last + 1:
                break
            last = max(last, end)
        self.followed_lsn = last

    def path(self, number: int) -> Path:
        return self.dir / object_name(number)

    def fetch(self, s3: Any, bucket: str, key: str, number: int) -> bytes:
        """The restore's source of object ``number``: the cache, else the store."""
        path = self.path(number)
        if number in self.cached and path.exists():
            return path.read_bytes()
        body: bytes = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        return body

    def drop(self) -> None:
        """After a takeover: the restored WAL holds everything the cache had."""
        shutil.rmtree(self.dir, ignore_errors=True)
        self.cached.clear()
        self.cached_bytes = 0

    # ---------------------------------------------------------------- poll

    def poll(self) -> int:
        """Steps 1-3 of the module doc (any thread); the objects downloaded."""
        with self._lock:
            return self._poll()

    def _poll(self) -> int:
        s3 = self._s3 = self._s3 if self._s3 is not None else client(self.s3cfg)
        prefix = self.where.key("wal/")
        listed: dict[int, float] = {}
        for page in s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.where.bucket, Prefix=prefix
        ):
            for item in page.get("Contents", []):
                name = item["Key"][len(prefix) :]
                if name.isdigit():
                    listed[int(name)] = item["LastModified"].timestamp()
        # Step 1. What the primary pruned goes here too
        for number in [n for n in self.cached if n not in listed]:
            with contextlib.suppress(FileNotFoundError):
                self.cached_bytes -= self.path(number).stat().st_size
                self.path(number).unlink()
            del self.cached[number]
        # Step 3 (before the downloads). The lag
        missing = sorted(n for n in listed if n not in self.cached)
        top = max(listed) if listed else 0
        if top and top not in self.cached:
            got = s3.get_object(
                Bucket=self.where.bucket,
                Key=prefix + object_name(top),
                Range=f"bytes=0-{OBJECT_HEADER_SIZE - 1}",
            )
            self.archive_lsn = parse_header(got["Body"].read()).last_lsn
        elif top:
            self.archive_lsn = self.cached[top][1]
        self._advance()
        self.lag_lsns = max(self.archive_lsn - self.followed_lsn, 0)
        self.lag_s = max(time.time() - listed[missing[0]], 0.0) if missing else 0.0
        # Step 2. Download, check, keep
        done = 0
        for number in missing:
            body = s3.get_object(Bucket=self.where.bucket, Key=prefix + object_name(number))[
                "Body"
            ].read()
            try:
                head, _frames = parse_object(body)
                if self.wal_id is not None and head.wal_id != self.wal_id:
                    raise ArchiveFormatError(
                        f"it is of WAL {head.wal_id}, the manifest's is {self.wal_id}"
                    )
                if head.number != number:
                    raise ArchiveFormatError(f"its header says object {head.number}")
            except ArchiveFormatError as exc:
                # Not kept: the takeover's restore reads it again and names it.
                log.warning("follow.object_damaged", object=object_name(number), error=str(exc))
                continue
            tmp = self.dir / f".{object_name(number)}.tmp"
            with tmp.open("wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, self.path(number))
            self.cached[number] = (head.first_lsn, head.last_lsn)
            self.cached_bytes += len(body)
            done += 1
        if done:
            fsync_dir(self.dir)
        self._advance()
        self.polls += 1
        self.polled_at = time.time()
        return done

    def poll_logged(self) -> None:
        """One poll; an error is kept for status and health, never raised."""
        try:
            self.poll()
        except Exception as exc:
            why = f"cannot follow {self.cfg.uri}: {explain(exc, self.s3cfg, self.where)}"
            if self.error is None:
                log.warning("follow.failed", error=why)
                self.error_since = time.time()
            self.error = why
        else:
            if self.error is not None:
                log.info("follow.again")
            self.error = self.error_since = None
        self.publish()

    def publish(self) -> None:
        m = self.metrics
        if m is None:
            return
        m.standby_followed_lsn.set(self.followed_lsn)
        m.standby_lag_lsns.set(self.lag_lsns)
        m.standby_lag_seconds.set(self.lag_s)

    def status(self) -> dict[str, Any]:
        return {
            "followed_lsn": self.followed_lsn,
            "archive_lsn": self.archive_lsn,
            "lag_lsns": self.lag_lsns,
            "lag_s": round(self.lag_s, 3),
            "objects": len(self.cached),
            "bytes": self.cached_bytes,
            "polled_s_ago": None
            if self.polled_at is None
            else round(time.time() - self.polled_at, 1),
            "error": self.error,
        }

    def problem(self, stall_after_s: float) -> str | None:
        if self.error is None or self.error_since is None:
            return None
        failing = time.time() - self.error_since
        if failing <= stall_after_s:
            return None
        return f"the standby has not followed the archive for {failing:.0f} s: {self.error}"

    # ---------------------------------------------------------------- task

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="standby-follow")

    async def _run(self) -> None:
        try:
            while True:
                await asyncio.to_thread(self.poll_logged)
                await asyncio.sleep(self.cfg.poll_ms / 1000)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("follow.task_failed")
            raise ArchiveUnavailable(f"the standby's follow of the archive failed: {exc}") from exc

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
