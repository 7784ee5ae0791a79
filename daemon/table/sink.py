"""What the executor asks of a CDC table, whatever its format (``TableSink``),
and what maintenance (compaction, retention) uses of one (``MaintainedTable``).

Compaction and retention take a ``MaintainedTable``, so they need not import
the sink that calls their recovery when it opens (``daemon.table.parquet``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from daemon.config import CdcStream
from daemon.plane.batch import MicroBatch
from daemon.table.ledger import Ledger
from daemon.table.sparkio import RawInbox


@dataclass(frozen=True, slots=True)
class CommitResult:
    stream: str
    batch_id: int
    rows: int
    files: int
    noop: bool  # the batch was committed before (a re-run)
    seconds: float
    quarantined: int = 0  # rows set aside in the stream's quarantine


@dataclass(slots=True)
class RecoveryReport:
    rolled_forward: list[int] = field(default_factory=list)
    intents_removed: list[int] = field(default_factory=list)
    staging_removed: list[str] = field(default_factory=list)
    orphans_removed: list[str] = field(default_factory=list)
    compactions_rolled_forward: list[int] = field(default_factory=list)
    compactions_rolled_back: list[int] = field(default_factory=list)


@runtime_checkable
class TableSink(Protocol):
    """One CDC stream's table, as the executor drives it (``daemon.spark.executor``).

    ``open`` locks the table and finishes or undoes what a crash interrupted;
    ``commit`` writes a batch's rows of the stream exactly once (a re-run of a
    committed batch is a no-op); ``close`` releases the table. The Parquet
    folder format (``daemon.table.parquet.CdcSink``) is the one there is.
    """

    stream: CdcStream
    quarantined: int  # rows in the stream's quarantine

    @property
    def name(self) -> str: ...

    @property
    def last_batch_id(self) -> int: ...

    def open(self) -> RecoveryReport: ...

    def table_status(self) -> dict[str, Any]: ...

    def close(self) -> None: ...

    def commit(
        self, df: Any, batch: MicroBatch, rows: int, raw: RawInbox | None = None
    ) -> CommitResult: ...

    def replay_quarantine(
        self, spark: Any, frame_of: Callable[[MicroBatch], Any], lsns: set[int] | None = None
    ) -> dict[str, Any]: ...

    def purge_quarantine(self, lsns: set[int] | None, by: str | None = None) -> int: ...


class MaintainedTable(Protocol):
    """The parts of a stream's table that compaction and retention use."""

    stream: CdcStream
    path: Path
    meta: Path
    compacting: set[str]  # leaf partitions a compaction claimed, under commit_lock
    _ledger: Ledger | None

    @property
    def name(self) -> str: ...

    @property
    def ledger(self) -> Ledger: ...

    @property
    def commit_lock(self) -> contextlib.AbstractContextManager[Any]: ...

    def record_compaction(self, record: dict[str, Any]) -> None: ...
