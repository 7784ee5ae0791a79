"""A stream's ledger: the commit record of its batches, ``_eventplane/ledger.json``.

It carries the WAL id and the ``cores`` count (identity, invariant 13), the
last committed batch, the per-core high LSNs, the newest batches' ranges
(for the re-run check) and the newest compactions. Rewritten whole, with an
atomic replace, on every commit.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from daemon.table.errors import CdcError
from daemon.table.layout import META_DIR

LEDGER_FORMAT = 1
# Ranges of this many recent batches are kept for the re-run check; older
# re-runs are still no-ops (id <= last), just without the range comparison.
# A restart re-runs the batches committed since the last watermark flush
# (``consumer.watermark_flush_ms``, 5 s by default) and the two the planner
# had planned: 128 covers 25 batches a second at the default. The ledger
# is rewritten on every commit: with 8 files per batch it is 121 KiB and
# takes 1.5 ms; 1024 batches made it 960 KiB and 10 ms, and 4 MiB and 25 ms
# with 40 files per batch (fsync included, ad-hoc script).
KEEP_BATCHES = 128
# Compactions the ledger remembers (the ledger is rewritten on every commit).
KEEP_COMPACTIONS = 16


def _ranges_to_json(ranges: Mapping[int, tuple[int, int]]) -> dict[str, list[int]]:
    return {str(c): [a, b] for c, (a, b) in sorted(ranges.items())}


def _ranges_from_json(raw: Mapping[str, Any]) -> dict[int, tuple[int, int]]:
    return {int(c): (int(v[0]), int(v[1])) for c, v in raw.items()}


@dataclass(slots=True)
class LedgerEntry:
    batch_id: int
    ranges: dict[int, tuple[int, int]]
    rows: int
    files: list[str]
    committed_at: float
    quarantined: int = 0  # rows the batch set aside (quarantine.py); not in ``rows``

    def to_json(self) -> dict[str, Any]:
        out = {
            "batch_id": self.batch_id,
            "ranges": _ranges_to_json(self.ranges),
            "rows": self.rows,
            "files": self.files,
            "committed_at": self.committed_at,
        }
        if self.quarantined:
            out["quarantined"] = self.quarantined
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> LedgerEntry:
        return cls(
            int(raw["batch_id"]),
            _ranges_from_json(raw["ranges"]),
            int(raw["rows"]),
            [str(f) for f in raw["files"]],
            float(raw["committed_at"]),
            int(raw.get("quarantined", 0)),
        )


@dataclass(slots=True)
class Ledger:
    """The commit record of one stream. Lives in ``_eventplane/ledger.json``."""

    stream: str
    wal_id: str
    cores: int
    last_batch_id: int = 0
    high_lsn: dict[int, int] = field(default_factory=dict)  # core -> last committed LSN
    rows_total: int = 0
    batches: list[LedgerEntry] = field(default_factory=list)  # newest last, bounded
    # The table's partition columns ([[cdc.streams]] partition_by) when it was
    # created; ledgers from before the key existed were ["collection"].
    partition_by: list[str] = field(default_factory=lambda: ["collection"])
    # Compactions (daemon/table/compact.py): the last id, and the newest
    # records (id, partition, inputs, outputs, batch range), bounded.
    last_compaction_id: int = 0
    compactions: list[dict[str, Any]] = field(default_factory=list)
    # The table's format ([[cdc.streams]] format); a Delta stream's ledger also
    # holds the Delta table version of its last commit (daemon/table/delta.py).
    table_format: str = "parquet"
    delta_version: int = -1

    def copy(self) -> Ledger:
        return replace(
            self,
            high_lsn=dict(self.high_lsn),
            batches=list(self.batches),
            compactions=list(self.compactions),
            partition_by=list(self.partition_by),
        )

    def add_compaction(self, record: dict[str, Any], keep: int = KEEP_COMPACTIONS) -> None:
        self.compactions.append(record)
        del self.compactions[:-keep]
        self.last_compaction_id = max(self.last_compaction_id, int(record["id"]))

    def entry(self, batch_id: int) -> LedgerEntry | None:
        for e in reversed(self.batches):
            if e.batch_id == batch_id:
                return e
            if e.batch_id < batch_id:
                return None
        return None

    def append(self, entry: LedgerEntry, keep: int = KEEP_BATCHES) -> None:
        self.batches.append(entry)
        del self.batches[:-keep]
        self.last_batch_id = entry.batch_id
        self.rows_total += entry.rows
        for core, (_, last) in entry.ranges.items():
            self.high_lsn[core] = max(self.high_lsn.get(core, 0), last)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": LEDGER_FORMAT,
            "stream": self.stream,
            "wal_id": self.wal_id,
            "cores": self.cores,
            "last_batch_id": self.last_batch_id,
            "high_lsn": {str(c): v for c, v in sorted(self.high_lsn.items())},
            "rows_total": self.rows_total,
            "batches": [e.to_json() for e in self.batches],
            "partition_by": self.partition_by,
            "last_compaction_id": self.last_compaction_id,
            "compactions": self.compactions,
            **(
                {"table_format": self.table_format, "delta_version": self.delta_version}
                if self.table_format != "parquet"
                else {}
            ),
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Ledger:
        if raw.get("format") != LEDGER_FORMAT:
            raise CdcError(f"ledger format {raw.get('format')!r} is not {LEDGER_FORMAT}")
        return cls(
            stream=str(raw["stream"]),
            wal_id=str(raw["wal_id"]),
            cores=int(raw["cores"]),
            last_batch_id=int(raw["last_batch_id"]),
            high_lsn={int(c): int(v) for c, v in raw["high_lsn"].items()},
            rows_total=int(raw.get("rows_total", 0)),
            batches=[LedgerEntry.from_json(e) for e in raw["batches"]],
            partition_by=[str(c) for c in raw.get("partition_by", ["collection"])],
            last_compaction_id=int(raw.get("last_compaction_id", 0)),
            compactions=[dict(c) for c in raw.get("compactions", [])],
            table_format=str(raw.get("table_format", "parquet")),
            delta_version=int(raw.get("delta_version", -1)),
        )


def read_ledger(path: Path, meta: Path | None = None) -> Ledger | None:
    """The stream's ledger, or None when nothing was ever committed there
    (``meta``: the stream's state folder, when not ``path``'s ``_eventplane``)."""
    file = (meta or path / META_DIR) / "ledger.json"
    try:
        raw = json.loads(file.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CdcError(f"{file}: unreadable ledger ({exc}); restore it from backup") from exc
    try:
        return Ledger.from_json(raw)
    except (KeyError, TypeError, ValueError, CdcError) as exc:
        raise CdcError(f"{file}: malformed ledger ({exc}); restore it from backup") from exc
