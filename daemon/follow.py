"""A standby's copy of the WAL archive: the continuous part of a restore
(docs/operating.md, "A standby").

A standby keeps ``<data_dir>/follow/``: the objects of ``<uri>/wal/`` in
*packs*, one file per poll named by its first object's number and the time, so a takeover
downloads only what came since the last poll.

Each poll (every ``[wal.archive] poll_ms``, in a thread of its own):

1. List ``<uri>/wal/``. Cached objects the listing no longer has were pruned by
   the primary (every stage had them): a pack goes with its last object.
2. Download each listed object not cached, in number order, and check it whole
   (wal/archive.py: header, body and frame CRCs, the manifest's WAL id, its
   number); a bad object is not kept: the restore at a takeover names it.
   :data:`DOWNLOADS` at a time, into one pack written to a temp name and
   renamed (the directory fsynced); it is a copy, not the record: an object a
   crash cut short is read from the store again at the takeover.
3. The lag, measured before the downloads: the archive's last LSN (the header
   of the newest object) minus the cache's, and the age of the oldest object
   not cached yet (its ``LastModified``).

A takeover runs the restore (daemon/restore.py) with :meth:`Follower.fetch`
as its source: a cached object is read from disk (and checked again), any
other is downloaded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import shutil
import struct
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import structlog

from daemon.errors import ArchiveUnavailable
from daemon.table.s3 import Location, client, explain
from wal.archive import (
    OBJECT_HEADER_SIZE,
    ArchiveFormatError,
    ObjectHeader,
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
DOWNLOADS: Final = 4  # objects downloading at once
# A pack: the objects one poll downloaded, each as its length (u32, big-endian), then its bytes.
_LEN: Final = struct.Struct(">I")


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
        self._where: dict[int, tuple[Path, int, int]] = {}  # number -> (pack, offset, length)
        self._packs: dict[Path, set[int]] = {}  # pack -> the numbers it still holds
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
        self._pool = concurrent.futures.ThreadPoolExecutor(DOWNLOADS, thread_name_prefix="follow")
        self._load()

    # ---------------------------------------------------------------- cache

    def _load(self) -> None:
        """The copy a start finds (a standby restarted): each pack's records,
        headers checked; a pack a crash cut short keeps its whole records."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.dir.iterdir()):
            if not path.name.replace("-", "").isdigit():
                path.unlink()  # a temp file of a poll killed midway
                continue
            data = path.read_bytes()
            at = 0
            while at + _LEN.size <= len(data):
                (n,) = _LEN.unpack_from(data, at)
                body = data[at + _LEN.size : at + _LEN.size + n]
                if len(body) < max(n, OBJECT_HEADER_SIZE):
                    break
                try:
                    head = parse_header(body[:OBJECT_HEADER_SIZE])
                except ArchiveFormatError:
                    break
                self._index(head.number, head.first_lsn, head.last_lsn, path, at + _LEN.size, n)
                at += _LEN.size + n
            if path in self._packs:
                self.cached_bytes += len(data)
            else:
                path.unlink()
        self._advance()

    def _index(self, number: int, first: int, last: int, pack: Path, at: int, n: int) -> None:
        self.cached[number] = (first, last)
        self._where[number] = (pack, at, n)
        self._packs.setdefault(pack, set()).add(number)

    def _forget(self, number: int) -> None:
        """``number`` was pruned; its pack goes with its last object."""
        del self.cached[number]
        pack = self._where.pop(number)[0]
        left = self._packs[pack]
        left.discard(number)
        if not left:
            del self._packs[pack]
            with contextlib.suppress(FileNotFoundError):
                self.cached_bytes -= pack.stat().st_size
                pack.unlink()

    def _advance(self) -> None:
        """The followed LSN: the end of the cached objects, taken in number order."""
        last = 0
        for number in sorted(self.cached):
            first, end = self.cached[number]
            if last and first > last + 1:
                break
            last = max(last, end)
        self.followed_lsn = last

    def read(self, number: int) -> bytes | None:
        """Object ``number``'s bytes from the copy (None: not in it)."""
        where = self._where.get(number)
        if where is None:
            return None
        pack, at, n = where
        try:
            with pack.open("rb") as f:
                f.seek(at)
                return f.read(n)
        except FileNotFoundError:
            return None

    def fetch(self, s3: Any, bucket: str, key: str, number: int) -> bytes:
        """The restore's source of object ``number``: the copy if it is whole
        (a pack the machine's crash cut short is not), else the store."""
        body = self.read(number)
        if body is not None:
            try:
                parse_object(body)
                return body
            except ArchiveFormatError:
                log.warning("follow.copy_damaged", object=object_name(number))
        got: bytes = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        return got

    def drop(self) -> None:
        """After a takeover: the restored WAL holds everything the copy had."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.cached.clear()
        self._where.clear()
        self._packs.clear()
        self.cached_bytes = 0

    # ---------------------------------------------------------------- poll

    def poll(self) -> int:
        """Steps 1-3 of the module doc (any thread); the objects downloaded."""
        with self._lock:
            return self._poll()

    def _poll(self) -> int:
        s3 = self._s3 = self._s3 if self._s3 is not None else client(self.s3cfg, self_checked=True)
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
            self._forget(number)
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
        # Step 2. Download (DOWNLOADS at once), check, keep
        kept: list[tuple[ObjectHeader, bytes]] = []
        bodies = self._pool.map(
            lambda n: s3.get_object(Bucket=self.where.bucket, Key=prefix + object_name(n))[
                "Body"
            ].read(),
            missing,
        )
        for number, body in zip(missing, bodies, strict=True):
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
            kept.append((head, body))
        if kept:
            # One pack per poll: a file per object costs more than its download.
            pack = self.dir / f"{object_name(kept[0][0].number)}-{time.time_ns()}"
            tmp = self.dir / f".{pack.name}.tmp"
            with tmp.open("wb") as f:
                at = 0
                for head, body in kept:
                    f.write(_LEN.pack(len(body)))
                    f.write(body)
                    self._index(
                        head.number, head.first_lsn, head.last_lsn, pack, at + _LEN.size, len(body)
                    )
                    at += _LEN.size + len(body)
            os.rename(tmp, pack)
            fsync_dir(self.dir)
            self.cached_bytes += at
        done = len(kept)
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
