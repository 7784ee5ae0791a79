"""Consistent reads of a CDC table while compaction and retention run.

The reader API of docs/cdc.md, "Reading while compaction runs": readers
import it from here (``from daemon.snapshot import consistent``). It lives in
:mod:`daemon.table.snapshot`, with the rest of the table's code.
"""

from __future__ import annotations

from daemon.table.snapshot import (
    Snapshot,
    SnapshotError,
    TableBusyError,
    consistent,
    data_files,
    read_generation,
    snapshot,
)

__all__ = [
    "Snapshot",
    "SnapshotError",
    "TableBusyError",
    "consistent",
    "data_files",
    "read_generation",
    "snapshot",
]
