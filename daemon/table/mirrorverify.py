"""``eventplane cdc mirror verify NAME``: a mirror compared with a fold of its
change log (invariant 22; docs/cdc.md, "Mirror tables").

1. **The mirror.** One snapshot of its table: its rows, and the batches it
   holds (``first``: its first merge's batch id, so a mirror added later,
   which started at the head, is compared with the log from there; ``last``:
   its ``txn`` version).
2. **The log.** A CDC stream that takes the mirror's collection, a Delta
   table (delta-rs reads it, on disk or on S3), one snapshot that holds batch
   ``last`` (its own ``txn``): its rows of the collection of batches
   ``first..last``.
3. **The fold.** Those rows reduced as one batch (:func:`daemon.table.mirror.reduce`
   over the whole log: the highest LSN per key, or every version), which is
   what the mirror's merges of them, batch by batch, must have made.
4. **The comparison**, row by row (by key; a history mirror by key and
   ``valid_from_lsn``), every column.

Read-only: it runs beside the daemon.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from daemon.config import CdcMirror, CdcStream, Config
from daemon.table.delta import app_id as stream_app_id
from daemon.table.mirror import app_id, arrow_schema, reduce

# The log's columns a fold reads, as the batch table names them.
LOG_COLUMNS = ("collection", "lsn", "op", "key", "new_json", "ingest_ts", "producer")


class VerifyError(Exception):
    """The mirror cannot be compared (no log that holds its batches); the
    message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Difference:
    row: str  # the key, as a user names it ("k3"; a history row: "k3", version from LSN 17)
    column: str  # "" when the whole row is in one side only
    mirror: Any
    log: Any


@dataclass(frozen=True, slots=True)
class Verdict:
    mirror: str
    stream: str
    first_batch: int
    last_batch: int
    rows: int  # rows compared (the union of both sides)
    differences: list[Difference]


def _storage(uri: str, s3: Any) -> dict[str, str] | None:
    if not uri:
        return None
    from daemon.table.s3 import storage_options

    return storage_options(s3)


def _mirror_snapshot(mirror: CdcMirror) -> tuple[list[dict[str, Any]], str, int, int]:
    """Step 1: the mirror's rows, the WAL id that wrote it, its first and last batch ids."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        table = DeltaTable(mirror.location, storage_options=_storage(mirror.uri, mirror.s3))
    except TableNotFoundError:
        raise VerifyError(
            f"mirror {mirror.name!r}: no table at {mirror.location} yet (the daemon makes it "
            f"when it starts)"
        ) from None
    wal_id = str(dict(table.metadata().configuration).get("eventplane.wal_id", ""))
    last = table.transaction_version(app_id(wal_id, mirror.name))
    if last is None:
        raise VerifyError(f"mirror {mirror.name!r}: no batch merged yet; nothing to compare")
    first = first_batch(table)
    return table.to_pyarrow_table().to_pylist(), wal_id, first, int(last)


def first_batch(table: Any) -> int:
    """The first batch the mirror's delta-rs ``table`` holds: its first merge's
    (a rebuild's merge holds batches ``first_batch..batch_id``). A log cleaned
    up to a checkpoint lists only the merges since: then 1 (the log is folded
    from its start, and a mirror that started at the head differs)."""
    history = table.history()
    notes = [
        json.loads(h["userMetadata"])["eventplane"]
        for h in history
        if h.get("operation") == "MERGE" and "userMetadata" in h
    ]
    merged = [int(n.get("first_batch", n["batch_id"])) for n in notes]
    whole = any(h.get("version") == 0 for h in history)
    return min(merged) if merged and whole else 1


def check_holds(stream: CdcStream, dataset: Any, first: int) -> None:
    """Refuse a log whose oldest batch is after ``first`` (a stream that started
    later, or whose retention removed the oldest partitions)."""
    import pyarrow.compute as pc

    oldest = pc.min(dataset.to_table(columns=["batch_id"]).column("batch_id")).as_py()
    if oldest is not None and oldest > first:
        raise VerifyError(
            f"stream {stream.name!r} starts at batch {oldest}, after the mirror's first "
            f"({first}): it does not hold the mirror's whole change log (a later start, or "
            f"its retention removed the oldest partitions)"
        )


def log_stream(cfg: Config, mirror: CdcMirror) -> CdcStream:
    """A Delta stream of ``cfg`` that takes the mirror's collection, without
    VARIANT columns (delta-rs reads it)."""
    for stream in cfg.cdc.streams:
        if stream.format == "delta" and not stream.variant and stream.wants(mirror.collection):
            return stream
    raise VerifyError(
        f"mirror {mirror.name!r}: no CDC stream in the config is a Delta table (without "
        f"variant) that takes the collection {mirror.collection!r}, so there is no change log "
        f'to fold; add one with start = "earliest" (docs/cdc.md, "Adding a stream: backfill")'
    )


def _log_rows(stream: CdcStream, wal_id: str, collection: str, first: int, last: int) -> Any:
    """Step 2: the stream's rows of batches ``first..last``, as an Arrow table."""
    import pyarrow.compute as pc
    from deltalake import DeltaTable

    options = _storage(stream.uri, stream.s3)
    table = DeltaTable(stream.location, storage_options=options)
    held = table.transaction_version(stream_app_id(wal_id, stream.name))
    if held is None or int(held) < last:
        raise VerifyError(
            f"stream {stream.name!r} holds batches up to {held or 0}, the mirror up to {last}: "
            f"the log is behind the mirror (is the stream paused?); verify once it caught up"
        )
    dataset = table.to_pyarrow_dataset()
    check_holds(stream, dataset, first)
    mine = pc.field("collection") == collection
    batches = (pc.field("batch_id") >= first) & (pc.field("batch_id") <= last)
    return dataset.to_table(columns=list(LOG_COLUMNS), filter=mine & batches)


def _identity(mirror: CdcMirror, row: dict[str, Any]) -> tuple[str, int]:
    return (row["key"], row["valid_from_lsn"] if mirror.history else 0)


def _shown(mirror: CdcMirror, ident: tuple[str, int]) -> str:
    key, since = ident
    return f"{key!r}, version from LSN {since}" if mirror.history else repr(key)


def compare(
    mirror: CdcMirror, got: list[dict[str, Any]], want: list[dict[str, Any]]
) -> Iterator[Difference]:
    """Step 4: each difference between the mirror's rows ``got`` and the fold's
    ``want``, in key order: a row on one side only, else each column that differs."""
    columns = arrow_schema(mirror).names
    have = {_identity(mirror, r): r for r in got}
    fold = {_identity(mirror, r): r for r in want}
    for ident in sorted(set(have) | set(fold)):
        a, b = have.get(ident), fold.get(ident)
        if a is None or b is None:
            yield Difference(
                _shown(mirror, ident),
                "",
                "present" if a else "absent",
                "present" if b else "absent",
            )
            continue
        for column in columns:
            if a.get(column) != b.get(column):
                yield Difference(_shown(mirror, ident), column, a.get(column), b.get(column))


def verify(cfg: Config, mirror: CdcMirror, *, limit: int = 10) -> Verdict:
    """Steps 1-4; at most ``limit`` differences kept."""
    got, wal_id, first, last = _mirror_snapshot(mirror)  # Step 1.
    stream = log_stream(cfg, mirror)
    log = _log_rows(stream, wal_id, mirror.collection, first, last)  # Step 2.
    reduced = reduce(mirror, log)  # Step 3.
    want = [r for r in reduced.rows if mirror.history or r["op"] != "delete"]
    differences = []
    for d in compare(mirror, got, want):  # Step 4.
        differences.append(d)
        if len(differences) >= limit:
            break
    rows = len({_identity(mirror, r) for r in got} | {_identity(mirror, r) for r in want})
    return Verdict(mirror.name, stream.name, first, last, rows, differences)
