"""The DLQ's copy in the WAL archive (docs/operating.md, "Losing the machine").

The DLQ lives in ``<data_dir>/triggers/queue.sqlite3``; nothing in the WAL
holds it. The archive's holder keeps a copy under the archive's ``uri``:

- ``dlq/<epoch>.jsonl``: a header line (``wal_id``, ``epoch``,
  ``written_at``, ``entries``) then one line per DLQ row with every column,
  ids included, in id order. The holder of an epoch writes only its epoch's
  key, so a holder fenced off cannot overwrite a newer holder's copy; a
  restore reads the highest epoch's.
- Written by the archive (``WalArchive._copy_dlq``) every :data:`COPY_S` seconds when the DLQ
  changed (its row count, highest id and id sum), and not at all once the
  archive is fenced. So the copy trails the DLQ by at most ``COPY_S``; a row
  dead-lettered in that window is not lost for good: its events are in the
  archive from the retry queue's oldest row on, and the restored trigger
  stage evaluates them again (daemon/restore.py).
- Its order relative to the WAL objects does not matter: a DLQ row holds its
  rows whole (it is replayed from itself, not from the WAL).
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any, Final

from triggers.store import DLQ_COLUMNS, TriggerStore

PREFIX: Final = "dlq/"
COPY_S: Final = 5.0  # the longest the copy trails the DLQ
_COLUMNS = [c.strip() for c in DLQ_COLUMNS.split(",")]

Fingerprint = tuple[int, int, int]


def key_of(epoch: int) -> str:
    return f"{PREFIX}{epoch:010d}.jsonl"


def read_dlq(path: Path, since: Fingerprint | None = None) -> tuple[Fingerprint, list[Any]] | None:
    """The DLQ's fingerprint and rows (None: no store file; rows empty when the
    fingerprint is ``since``): a read-only connection of its own, beside the
    trigger engine's."""
    if not path.exists():
        return None
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    try:
        got = db.execute("SELECT COUNT(*), COALESCE(MAX(id), 0), COALESCE(SUM(id), 0) FROM dlq")
        mark: Fingerprint = tuple(int(x) for x in got.fetchone())  # type: ignore[assignment]
        if mark == since:
            return mark, []
        rows = db.execute(f"SELECT {DLQ_COLUMNS} FROM dlq ORDER BY id").fetchall()
        return mark, rows
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):  # created, not yet initialised
            return None
        raise
    finally:
        db.close()


def encode(wal_id: str, epoch: int, rows: list[Any]) -> bytes:
    head = {"wal_id": wal_id, "epoch": epoch, "written_at": time.time(), "entries": len(rows)}
    lines = [json.dumps(head)]
    lines += (json.dumps(dict(zip(_COLUMNS, row, strict=True))) for row in rows)
    return ("\n".join(lines) + "\n").encode()


def decode(body: bytes, where: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header and rows of a copy; ValueError naming ``where`` if it is not whole."""
    lines = body.decode().splitlines()
    try:
        head = json.loads(lines[0])
        rows = [json.loads(line) for line in lines[1:]]
    except (IndexError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: not a DLQ copy ({exc})") from exc
    if len(rows) != head.get("entries") or any(set(r) != set(_COLUMNS) for r in rows):
        raise ValueError(f"{where}: {len(rows)} rows, the header says {head.get('entries')}")
    return head, rows


def epochs(s3: Any, where: Any) -> list[int]:
    """The epochs that have a copy, ascending."""
    prefix = where.key(PREFIX)
    out: list[int] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=where.bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            name = item["Key"][len(prefix) :].removesuffix(".jsonl")
            if name.isdigit():
                out.append(int(name))
    return sorted(out)


def restore_dlq(s3: Any, where: Any, wal_id: str, into: Path) -> tuple[int, int, float] | None:
    """Write the newest copy's rows into a new trigger store at ``into``:
    ``(entries, epoch, written_at)``, or None when the archive holds none.
    A copy of another WAL, or one not whole, raises ValueError."""
    have = epochs(s3, where)
    if not have:
        return None
    key = where.key(key_of(have[-1]))
    body = s3.get_object(Bucket=where.bucket, Key=key)["Body"].read()
    head, rows = decode(body, key)
    if head.get("wal_id") != wal_id:
        raise ValueError(f"{key} is of WAL {head.get('wal_id')}, the archive's is {wal_id}")
    store = TriggerStore(into)
    try:
        store.dlq_insert([tuple(r[c] for c in _COLUMNS) for r in rows])
    finally:
        store.close()
    return len(rows), int(head["epoch"]), float(head["written_at"])
