"""The de-duplication window: idempotency keys of recent appends, durable with them.

An append may carry a :class:`~wal.format.RequestTag` (key, digest). The tag
is written in the same frame as the append's events (the frame's request
table), so it is durable exactly when they are. The writer thread adds it to
the window after the frame's fdatasync and before the append returns; a
caller that looks a key up therefore never misses an acknowledged append.

The window is bounded twice: entries older than ``window_s`` (by the frame's
write time) and the oldest entries beyond ``max_keys`` are forgotten. It is
rebuilt on open from two sources:

- the request tables of the retained segments (read by the recovery scan);
- ``REQUESTS``, a snapshot of the window's entries below the retained floor,
  written (atomic replace, fsynced) by retention just before it removes
  segments, so keys outlive the segments that held them.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Final

import structlog

from wal.files import fsync_dir
from wal.format import MAX_REQUEST_KEY_BYTES, RequestEntry, RequestTag, crc32c

SNAPSHOT: Final = "REQUESTS"
_SNAPSHOT_MAGIC: Final = b"EPWALREQ"
_SNAPSHOT_HEADER: Final = struct.Struct(
    "<"
    "8s"  # magic
    "H"  # version: 1
    "6x"
    "16s"  # wal_id
    "I"  # entries
    "I"  # CRC32C of the entries that follow
)
_SNAPSHOT_ENTRY: Final = struct.Struct(
    "<"
    "Q"  # first LSN
    "Q"  # last LSN
    "Q"  # written at, Unix ms
    "H"  # key length; the key follows
    "16s"  # digest
)
DIGEST_BYTES: Final = 16


def check_tag(tag: RequestTag) -> None:
    if not 1 <= len(tag.key) <= MAX_REQUEST_KEY_BYTES:
        raise ValueError(f"request key of {len(tag.key)} bytes: 1 to {MAX_REQUEST_KEY_BYTES}")
    if len(tag.digest) != DIGEST_BYTES:
        raise ValueError(f"request digest of {len(tag.digest)} bytes: exactly {DIGEST_BYTES}")


class RequestWindow:
    """Recent request keys -> their entries; bounded by age and count; thread-safe.

    The writer thread adds, the event loop looks up, retention snapshots.
    ``window_s = 0`` keeps nothing (keys are still written to the frames).
    """

    def __init__(self, window_s: float, max_keys: int) -> None:
        if window_s < 0 or max_keys < 0:
            raise ValueError("request window: window_s and max_keys must be >= 0")
        self.window_ms = int(window_s * 1000)
        self.max_keys = max_keys if window_s > 0 else 0
        self._entries: OrderedDict[bytes, RequestEntry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entries: Iterable[RequestEntry], now_ms: int | None = None) -> None:
        """Add in LSN order (a later entry for a key replaces the earlier one), then evict."""
        if not self.max_keys:
            return
        now = _now_ms() if now_ms is None else now_ms
        with self._lock:
            d = self._entries
            for entry in entries:
                d.pop(entry.key, None)  # re-inserted at the young end
                d[entry.key] = entry
            self._evict(now)

    def get(self, key: bytes, now_ms: int | None = None) -> RequestEntry | None:
        """The entry of ``key`` if it is in the window (not older than ``window_s``)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        now = _now_ms() if now_ms is None else now_ms
        if entry.written_ms < now - self.window_ms:
            return None
        return entry

    def below(self, lsn: int, now_ms: int | None = None) -> list[RequestEntry]:
        """The entries (in window) whose events are all below ``lsn``, oldest first."""
        now = _now_ms() if now_ms is None else now_ms
        with self._lock:
            self._evict(now)
            return [e for e in self._entries.values() if e.last_lsn < lsn]

    def _evict(self, now_ms: int) -> None:
        d = self._entries
        while len(d) > self.max_keys:
            d.popitem(last=False)
        oldest = now_ms - self.window_ms
        while d:
            entry = next(iter(d.values()))
            if entry.written_ms >= oldest:
                break
            d.popitem(last=False)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def save_snapshot(directory: Path, wal_id: bytes, entries: list[RequestEntry]) -> None:
    """Write ``REQUESTS`` (temp file, fsync, rename, directory fsync)."""
    body = bytearray()
    for e in entries:
        body += _SNAPSHOT_ENTRY.pack(e.first_lsn, e.last_lsn, e.written_ms, len(e.key), e.digest)
        body += e.key
    head = _SNAPSHOT_HEADER.pack(_SNAPSHOT_MAGIC, 1, wal_id, len(entries), crc32c(body))
    tmp = directory / (SNAPSHOT + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, head + body)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, directory / SNAPSHOT)
    fsync_dir(directory)


def load_snapshot(directory: Path, wal_id: bytes) -> list[RequestEntry]:
    """The entries of ``REQUESTS``; none if there is no file. A damaged file is
    logged and ignored: the keys it held may then be stored again by a retry."""
    path = directory / SNAPSHOT
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    why = None
    entries: list[RequestEntry] = []
    if len(data) < _SNAPSHOT_HEADER.size:
        why = f"{len(data)} bytes, shorter than its header"
    else:
        magic, version, file_wal_id, count, crc = _SNAPSHOT_HEADER.unpack_from(data)
        body = memoryview(data)[_SNAPSHOT_HEADER.size :]
        if magic != _SNAPSHOT_MAGIC or version != 1:
            why = f"bad magic {bytes(magic)!r} or version {version}"
        elif file_wal_id != wal_id:
            why = f"written for WAL {file_wal_id.hex()}"
        elif crc32c(body) != crc:
            why = "CRC mismatch"
        else:
            pos = 0
            for _ in range(count):
                first, last, written, key_len, digest = _SNAPSHOT_ENTRY.unpack_from(body, pos)
                pos += _SNAPSHOT_ENTRY.size
                key = bytes(body[pos : pos + key_len])
                pos += key_len
                entries.append(RequestEntry(key, bytes(digest), first, last, written))
    if why is not None:
        structlog.get_logger("wal").error(
            "wal.requests_snapshot_damaged",
            path=str(path),
            reason=why,
            effect="idempotency keys of removed segments are forgotten",
        )
        return []
    return entries
