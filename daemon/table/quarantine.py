"""A CDC stream's quarantine: rows the stream cannot write, set aside durably.

When a stream's write of a batch fails, the stream asks which of its rows
fail alone (``DirectWrite.badRows``: each row's payload parsed on its own, as
the writer parses it). None: the failure was the moment's (a full disk, a
dead engine), and the batch is retried as before. Some: those rows go here,
with the writer's error and the event as it was stored, and the rest of the
batch commits (``CdcSink.commit``). Each acknowledged event is then in
exactly one place: the table, the quarantine, or the purge log.

Files, under ``<path>/_eventplane/quarantine/``::

    b<batch>.json    the rows batch <batch> set aside; written and fsynced
                     before the batch's intent or ledger entry, so a file
                     above the ledger's last batch with no intent is from an
                     attempt that never committed, and recovery removes it
    r<batch>.json    a replay's intent: rows written back into the table,
                     staged files and their final names (roll forward)
    purged.jsonl     the purge log: one line per purge, who, when, and the
                     rows themselves (appended and fsynced before the rows
                     leave their b<batch>.json)

A strict mirror's quarantine (:mod:`daemon.table.mirror`) has the same files
and rows, under the mirror's path, and ``superseded.json`` besides.

``docs/cdc.md``, "Quarantine", is the user's page.
"""

from __future__ import annotations

import base64
import getpass
import json
import os
import re
import socket
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.events import decode as decode_stored
from daemon.plane.batch import MicroBatch, Slice
from daemon.table.durable import append_line, atomic_write_json
from wal.record import Record

QUARANTINE_DIR = "quarantine"
PURGE_LOG = "purged.jsonl"
_BATCH_FILE = re.compile(r"^b(\d{12})\.json$")
_REPLAY_FILE = re.compile(r"^r(\d{12})\.json$")
# Characters of a payload shown by ``list`` (the whole event is in the file).
SHOWN_PAYLOAD_CHARS = 200


@dataclass(frozen=True, slots=True)
class QuarantinedRow:
    """One row set aside: where it came from, why, and the event as stored."""

    lsn: int
    core: int
    seq: int
    batch_id: int
    collection: str
    op: str
    key: str
    error: str
    payload: bytes  # the stored event (daemon.events.StoredEvent, msgpack), as the WAL holds it
    at: float  # when it was set aside (epoch seconds)

    @classmethod
    def of(cls, record: Record, batch_id: int, error: str, at: float) -> QuarantinedRow:
        event = decode_stored(record.payload)
        return cls(
            record.lsn,
            record.core,
            record.seq,
            batch_id,
            event.collection,
            event.op,
            event.key,
            error,
            bytes(record.payload),
            at,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "lsn": self.lsn,
            "core": self.core,
            "seq": self.seq,
            "batch_id": self.batch_id,
            "collection": self.collection,
            "op": self.op,
            "key": self.key,
            "error": self.error,
            "at": self.at,
            "payload": base64.b64encode(self.payload).decode("ascii"),
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> QuarantinedRow:
        return cls(
            int(raw["lsn"]),
            int(raw["core"]),
            int(raw["seq"]),
            int(raw["batch_id"]),
            str(raw["collection"]),
            str(raw["op"]),
            str(raw["key"]),
            str(raw["error"]),
            base64.b64decode(raw["payload"]),
            float(raw["at"]),
        )

    def record(self) -> Record:
        """The row as the WAL record it was (for a replay's write)."""
        return Record(self.lsn, self.core, self.seq, self.payload)

    def shown(self) -> dict[str, Any]:
        """The row for a person or a script: the event's fields, payloads as
        text (bytes that are not UTF-8 shown as ``\\xNN``), and the error."""
        event = decode_stored(self.payload)

        def text(raw: bytes | None) -> str | None:
            return None if raw is None else raw.decode("utf-8", "backslashreplace")

        return {
            "lsn": self.lsn,
            "batch_id": self.batch_id,
            "core": self.core,
            "collection": self.collection,
            "op": self.op,
            "key": self.key,
            "error": self.error,
            "set_aside_at": self.at,
            "new": text(event.new),
            "old": text(event.old),
            "ingest_ts_ns": event.ingest_ts_ns,
            "event_id": event.event_id,
            "event_time_us": event.event_time_us,
            "producer": event.producer,
        }


def directory(meta: Path) -> Path:
    return meta / QUARANTINE_DIR


def batch_file(meta: Path, batch_id: int) -> Path:
    return directory(meta) / f"b{batch_id:012d}.json"


def replay_file(meta: Path, replay_id: int) -> Path:
    return directory(meta) / f"r{replay_id:012d}.json"


def rows_of(batch: MicroBatch, bad: Sequence[tuple[int, str]]) -> list[QuarantinedRow]:
    """The batch's records of the ``(lsn, error)`` pairs, as quarantined rows."""
    errors = dict(bad)
    now = time.time()
    out: list[QuarantinedRow] = []
    for core in sorted(batch.slices):
        for rec in batch.slices[core].records:
            error = errors.get(rec.lsn)
            if error is not None:
                out.append(QuarantinedRow.of(rec, batch.batch_id, error, now))
    if len(out) != len(errors):
        missing = sorted(set(errors) - {r.lsn for r in out})
        raise ValueError(f"batch {batch.batch_id} has no events at LSNs {missing[:10]}")
    return out


def batch_of(batch_id: int, rows: Sequence[QuarantinedRow]) -> MicroBatch:
    """The rows as a micro-batch of id ``batch_id`` (a replay writes it)."""
    slices: dict[int, list[Record]] = {}
    for r in rows:
        slices.setdefault(r.core, []).append(r.record())
    return MicroBatch(
        batch_id,
        {c: Slice(c, recs[0].lsn, recs[-1].lsn, recs) for c, recs in sorted(slices.items())},
    )


def write_batch(
    meta: Path, owner: str, batch_id: int, rows: Sequence[QuarantinedRow], *, kind: str = "stream"
) -> None:
    """Step 2a of a commit: the batch's set-aside rows, durable (``kind``: a
    ``stream`` or a ``mirror``, whose name ``owner`` the file records)."""
    directory(meta).mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        batch_file(meta, batch_id),
        {kind: owner, "batch_id": batch_id, "rows": [r.to_json() for r in rows]},
    )


def _batch_files(meta: Path) -> Iterator[tuple[int, Path]]:
    d = directory(meta)
    if not d.is_dir():
        return
    found = []
    for p in d.iterdir():
        m = _BATCH_FILE.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    yield from sorted(found)


def _read_rows(path: Path) -> list[QuarantinedRow]:
    raw = json.loads(path.read_bytes())
    return [QuarantinedRow.from_json(r) for r in raw["rows"]]


def load(meta: Path) -> list[QuarantinedRow]:
    """Every row in the quarantine, in LSN order; rows a pending replay is
    writing back are left out (they are the table's once it rolls forward)."""
    replaying = {lsn for _, lsns in replays(meta) for lsn in lsns}
    rows = [r for _, p in _batch_files(meta) for r in _read_rows(p) if r.lsn not in replaying]
    return sorted(rows, key=lambda r: r.lsn)


def count(meta: Path) -> int:
    return len(load(meta))


def drop(meta: Path, lsns: Iterable[int]) -> int:
    """Remove the rows of ``lsns`` from their batch files (each rewritten
    atomically, removed when empty); how many were removed."""
    gone = set(lsns)
    removed = 0
    for _, path in _batch_files(meta):
        raw = json.loads(path.read_bytes())
        keep = [r for r in raw["rows"] if int(r["lsn"]) not in gone]
        if len(keep) == len(raw["rows"]):
            continue
        removed += len(raw["rows"]) - len(keep)
        if keep:
            raw["rows"] = keep
            atomic_write_json(path, raw)
        else:
            path.unlink()
    return removed


def recover(meta: Path, last_batch_id: int, intents: set[int]) -> list[int]:
    """At open: remove the batch files of attempts that never committed (above
    the ledger's last batch, no intent), and rows a purge logged but had not
    yet removed. Returns the batches whose files were removed."""
    removed = []
    for bid, path in _batch_files(meta):
        if bid > last_batch_id and bid not in intents:
            path.unlink()
            removed.append(bid)
    purged = purged_lsns(meta)
    if purged:
        drop(meta, purged)
    return removed


def replay_intents(meta: Path) -> list[tuple[int, Path]]:
    """Pending replay intents: ``(batch, path)``, by batch."""
    d = directory(meta)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _REPLAY_FILE.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def replays(meta: Path) -> list[tuple[int, list[int]]]:
    """Pending replay intents: ``(batch, LSNs being written back)``."""
    out = []
    for bid, p in replay_intents(meta):
        raw = json.loads(p.read_bytes())
        out.append((bid, [int(x) for x in raw["lsns"]]))
    return out


def purged_lsns(meta: Path) -> set[int]:
    log = directory(meta) / PURGE_LOG
    if not log.exists():
        return set()
    out: set[int] = set()
    for line in log.read_bytes().splitlines():
        if line.strip():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a torn last line: that purge never finished (its rows are still here)
            out.update(int(r["lsn"]) for r in entry["rows"])
    return out


def purge(
    meta: Path, owner: str, lsns: set[int] | None, by: str | None = None, *, kind: str = "stream"
) -> int:
    """Remove rows from the quarantine for good (all, or those of ``lsns``),
    after logging them (who, when, the rows) in the purge log; how many.
    ``kind``: the quarantine's owner is a ``stream`` or a ``mirror``."""
    rows = [r for r in load(meta) if lsns is None or r.lsn in lsns]
    if not rows:
        return 0
    append_line(
        directory(meta) / PURGE_LOG,
        {
            kind: owner,
            "at": time.time(),
            "by": by or who(),
            "lsns": [r.lsn for r in rows],
            "rows": [r.to_json() for r in rows],
        },
    )
    return drop(meta, {r.lsn for r in rows})


def who() -> str:
    """The user and host a purge is recorded under."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()} (pid {os.getpid()})"
