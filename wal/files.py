"""Files of a WAL directory: lock, identity, segment creation, torn-tail cutting, fsyncs.

Every function here that creates, renames, truncates or removes a file makes
the change durable (file fsync, then directory fsync) before it returns.
"""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import structlog

from wal import lockfile
from wal.errors import WalCorruptionError, WalLockedError
from wal.format import encode_segment_header, segment_name
from wal.segments import Damage, Segment

IDENTITY: Final = "IDENTITY"
LOCK: Final = "LOCK"
# A write that found no room: the volume is full (ENOSPC) or the owner's quota
# is used up (EDQUOT). Only a *write* failing so is undone and retried by the
# next group; an fsync failing with the same errno is fatal like any other.
NO_SPACE: Final = frozenset({errno.ENOSPC, errno.EDQUOT})


class OutOfSpace(OSError):
    """A write (never an fsync) failed with ENOSPC or EDQUOT; the cause is the original error.

    Raised only around write calls (:func:`create_segment`, the writer's frame
    write), so the writer can tell a write that did not fit (roll the group
    back, ``WalFullError``) from an fsync failing with the same errno (fatal).
    """


def _log() -> Any:
    return structlog.get_logger("wal")


def fsync_dir(directory: Path) -> None:
    """Make a create, rename or unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def lock_directory(directory: Path, holder: Mapping[str, str] | None = None) -> int:
    """Exclusive advisory lock on ``directory/LOCK``; released with the fd or the process.

    The file then names the holder (pid, host, since, plus ``holder``), and a
    refusal quotes it (``wal.lockfile``); the lock alone fences.
    """
    try:
        return lockfile.take(directory / LOCK, holder)
    except lockfile.LockHeld as exc:
        raise WalLockedError(
            f"{directory} is in use by another process or Wal: its lock {exc}; "
            "stop that process before opening or repairing this WAL"
        ) from None


def read_identity(directory: Path) -> bytes | None:
    """The wal_id in ``IDENTITY`` (16 bytes) or None when there is no IDENTITY file."""
    path = directory / IDENTITY
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise WalCorruptionError(
            f"cannot read IDENTITY: {exc}", segment=IDENTITY, offset=0
        ) from exc
    try:
        return uuid.UUID(hex=text).bytes
    except ValueError as exc:
        raise WalCorruptionError(
            f"IDENTITY does not hold a WAL id (32 hex digits): {text[:40]!r}",
            segment=IDENTITY,
            offset=0,
        ) from exc


def write_identity(directory: Path, wal_id: bytes) -> None:
    """Write IDENTITY atomically (temp file, fsync, rename, directory fsync)."""
    tmp = directory / (IDENTITY + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        data = (wal_id.hex() + "\n").encode("ascii")
        if os.write(fd, data) != len(data):
            raise OSError(errno.EIO, "short write of IDENTITY")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, directory / IDENTITY)
    fsync_dir(directory)


def save_aside(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``<path>.broken`` (``.broken.2``, ... if taken), fsynced."""
    target = path.with_name(path.name + ".broken")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.broken.{n}")
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return target


def cut_torn_tail(directory: Path, damage: Damage) -> Path:
    """Recovery: move the torn bytes aside, truncate the segment, sync; returns the .broken file."""
    path = damage.path
    if damage.whole_file:  # torn creation: the file holds a partial header and nothing else
        target = save_aside(path, path.read_bytes())
        path.unlink()
    else:
        with path.open("rb") as f:
            f.seek(damage.offset)
            cut = f.read()
        target = save_aside(path, cut)
        fd = os.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, damage.offset)
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(directory)
    _log().warning(
        "wal.torn_tail_cut",
        segment=damage.segment,
        offset=damage.offset,
        bytes=damage.file_size - damage.offset,
        next_lsn=damage.next_lsn,
        reason=damage.reason,
        saved_as=target.name,
    )
    return target


def create_segment(directory: Path, wal_id: bytes, number: int, first_lsn: int) -> Segment:
    """Create a segment holding only its header; file and directory fsynced before return.

    When the volume has no room for the file or its header, raises
    :class:`OutOfSpace` having removed what it created, so a later call can
    create the segment again. Every other failure (fsyncs included) propagates
    as it is and may leave a partial file, which recovery moves aside.
    """
    path = directory / segment_name(first_lsn)
    header = encode_segment_header(wal_id, number, first_lsn)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as exc:
        if exc.errno in NO_SPACE:
            raise OutOfSpace(exc.errno, exc.strerror, path.name) from exc
        raise
    try:
        try:
            view = memoryview(header)
            while view:  # a short write on a filling volume: the next one says ENOSPC
                n = os.write(fd, view)
                if n <= 0:
                    raise OSError(errno.EIO, f"write of the header of {path.name} wrote {n}")
                view = view[n:]
        except OSError as exc:
            if exc.errno not in NO_SPACE:
                raise
            os.close(fd)
            fd = -1
            # Nothing of the file was ever synced; unlink it durably so that
            # neither the next rotation nor a recovery finds a partial header.
            path.unlink()
            fsync_dir(directory)
            raise OutOfSpace(exc.errno, exc.strerror, path.name) from exc
        os.fsync(fd)
    finally:
        if fd >= 0:
            os.close(fd)
    fsync_dir(directory)
    return Segment(path=path, number=number, first_lsn=first_lsn, sealed=False)
