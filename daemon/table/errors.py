"""Typed errors of CDC tables."""

from __future__ import annotations

from daemon.errors import DaemonError


class CdcError(DaemonError):
    """Base error of CDC streams."""


class CdcLedgerMismatchError(CdcError):
    """A committed batch id came back with different LSN ranges."""

    retriable = False  # the table and the WAL disagree: a person must decide


class CdcRecoveryError(CdcError):
    """An interrupted commit cannot be completed from what is on disk."""


class CdcStreamLockedError(CdcError):
    """Another process writes this stream."""

    lock_text = ""  # the held lock, and whose it is (wal.lockfile.LockHeld)


class CdcQuarantineLimitError(CdcError):
    """More rows of a batch fail alone than ``quarantine_max_rows``."""


class CdcLayoutError(CdcError):
    """The stream's partition_by differs from the layout its table was written with."""

    retriable = False  # the config or the table must change first


class CompactionError(CdcError):
    """A compaction failed; it was rolled back (or rolls forward on its next run)."""


class CompactionUnsupportedError(CompactionError):
    """The file system cannot swap two folders atomically (renameat2 RENAME_EXCHANGE)."""


class PartitionGoneError(CompactionError):
    """The planned partition (or some of its files) went before the compaction
    claimed it: retention removed it. Nothing was done; not a failure."""
