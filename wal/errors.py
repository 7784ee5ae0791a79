"""Typed errors of the WAL. Corruption errors carry segment, offset and byte counts."""

from __future__ import annotations


class WalError(Exception):
    """Base error of the write-ahead log."""

    retriable = False


class WalCorruptionError(WalError):
    """A frame or segment failed its checks where a torn tail is not possible."""

    def __init__(self, message: str, *, segment: str, offset: int, length: int = 0) -> None:
        super().__init__(f"{segment} @ offset {offset}: {message}")
        self.segment = segment
        self.offset = offset
        self.length = length


class WalFatalError(WalError):
    """A write or fsync failed: the WAL refuses every later append (invariant 10)."""


class WalFullError(WalError):
    """A group's write found its volume full (ENOSPC) or the quota used up (EDQUOT).

    Nothing of the failed appends was stored: the writer cut the partial frame,
    gave their LSNs back, and takes the next append as usual, so the WAL resumes
    by itself once space returns. Only a *write* is retried this way; a failed
    fsync stays fatal (:class:`WalFatalError`, docs/wal.md "A full volume").
    """

    retriable = True

    def __init__(self, directory: str, nbytes: int, free_bytes: int | None, reason: str) -> None:
        free = "unknown" if free_bytes is None else f"{free_bytes}"
        super().__init__(
            f"the WAL volume of {directory} is full ({reason}): writing {nbytes} bytes failed "
            f"with {free} bytes free on the volume. Nothing of this request was stored; free "
            "space on that volume (or raise the quota) and retry: the WAL takes new appends as "
            "soon as they fit"
        )
        self.directory = directory
        self.nbytes = nbytes
        self.free_bytes = free_bytes


class WalClosedError(WalError):
    """The WAL is closed or closing."""


class BelowRetainedFloorError(WalError):
    """A read asked for LSNs that retention already removed."""

    def __init__(self, requested_lsn: int, floor_lsn: int) -> None:
        super().__init__(
            f"cannot read from LSN {requested_lsn}: the WAL's retained floor is LSN {floor_lsn} "
            f"(segments below it were removed by retention)"
        )
        self.requested_lsn = requested_lsn
        self.floor_lsn = floor_lsn


class WalReadError(WalError):
    """A transient read failure during replay; the caller retries (bounded)."""

    retriable = True


class WalLockedError(WalError):
    """Another process (or another Wal in this one) has the WAL directory open."""
