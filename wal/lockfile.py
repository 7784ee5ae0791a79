"""Lock files that name their holder: an exclusive ``flock`` plus who holds it.

The flock is what fences: one holder at a time, and the kernel drops it with
the holder's process, so a crashed holder (even SIGKILLed) never blocks the
next one. Right after taking it, the holder replaces the file's content with
one JSON line saying who it is::

    {"pid": 4242, "host": "db-1", "since": "2026-11-25T10:00:00Z", "data_dir": "/srv/ep"}

``pid``, ``host`` and ``since`` (when the lock was taken, UTC) always; the
rest is what the caller passes (``data_dir``, ``config``, ``wal_id``, ...).
A process refused the lock reads that line to name the holder in its error.
The content is informational only: it is written without an fsync, a holder
that cannot write it still holds the lock, and a refusal whose file is empty
or unreadable says so instead of failing differently.

The WAL directory (``wal/LOCK``) and each CDC stream (``_eventplane/lock``)
use it; their errors wrap :class:`LockHeld`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

# A holder record is one short line; a longer file is not one of ours.
MAX_RECORD_BYTES = 4096
_SNIPPET = 60


class LockHeld(Exception):
    """Another open file description holds the lock; ``holder`` describes it."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is {holder}")
        self.path = path
        self.holder = holder


def take(path: Path, details: Mapping[str, str] | None = None) -> int:
    """Lock ``path`` (created if missing) without waiting, then write who holds it.

    Returns the locked fd: closing it (or the process ending) releases the
    lock. Raises :class:`LockHeld` when another holder has it; any other
    ``OSError`` of the open or the flock propagates.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        try:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise LockHeld(path, describe(fd)) from None
            raise
        finally:
            os.close(fd)
    _write_holder(path, fd, details or {})
    return fd


def _write_holder(path: Path, fd: int, details: Mapping[str, str]) -> None:
    record: dict[str, Any] = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **details,
    }
    data = (json.dumps(record, separators=(", ", ": ")) + "\n").encode()
    try:
        os.ftruncate(fd, 0)  # a previous holder's longer line must not show through
        os.pwrite(fd, data, 0)
    except OSError as exc:
        # The lock is held and fences; only the name is missing for whoever is refused.
        structlog.get_logger("wal").warning(
            "lock_holder_not_written", path=str(path), error=exc.strerror or str(exc)
        )


def describe(fd: int) -> str:
    """``held by pid N on host H since T (...)``, or why the holder cannot be named."""
    try:
        raw = os.pread(fd, MAX_RECORD_BYTES, 0)
    except OSError as exc:
        return f"held by a process that cannot be named (reading the lock file failed: {exc})"
    if not raw.strip():
        return (
            "held by a process that did not name itself (the lock file is empty: the holder "
            "is still starting, or is an eventplane older than this one)"
        )
    try:
        record = json.loads(raw)
        pid, host, since = int(record["pid"]), str(record["host"]), str(record["since"])
    except (ValueError, KeyError, TypeError):
        snippet = raw[:_SNIPPET].decode("utf-8", "replace")
        return (
            f"held by a process that cannot be named (the lock file holds {snippet!r}, "
            "not a holder record)"
        )
    notes = ["this process"] if pid == os.getpid() and host == socket.gethostname() else []
    notes += [f"{k} {v}" for k, v in record.items() if k not in ("pid", "host", "since")]
    where = f" ({', '.join(notes)})" if notes else ""
    return f"held by pid {pid} on host {host} since {since}{where}"
