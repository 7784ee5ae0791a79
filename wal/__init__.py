"""eventplane's write-ahead log: segmented, checksummed, group-committed. See docs/wal.md."""

from wal.errors import (
    BelowRetainedFloorError,
    WalClosedError,
    WalCorruptionError,
    WalError,
    WalFatalError,
    WalFullError,
    WalLockedError,
    WalReadError,
)
from wal.log import FsyncMode, Wal
from wal.reader import ReadIterator, RecordBatch
from wal.record import Record

__all__ = [
    "BelowRetainedFloorError",
    "FsyncMode",
    "ReadIterator",
    "Record",
    "RecordBatch",
    "Wal",
    "WalClosedError",
    "WalCorruptionError",
    "WalError",
    "WalFatalError",
    "WalFullError",
    "WalLockedError",
    "WalReadError",
]
