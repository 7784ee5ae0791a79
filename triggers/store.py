"""The durable retry queue and dead-letter queue: one SQLite file (WAL mode).

Layout (``<data_dir>/triggers/queue.sqlite3``, ``PRAGMA user_version = 3``)::

    retry  one row per pending action call (a chunk of matched rows)
      id             INTEGER  autoincrement; delivery order among equally due entries
      trigger        TEXT     trigger name
      first_lsn      INTEGER  lowest LSN in rows
      last_lsn       INTEGER  highest LSN in rows
      rows           TEXT     JSON array of row documents (triggers.rows)
      attempts       INTEGER  attempts made so far (0 after a DLQ replay)
      next_due       REAL     Unix time the next attempt is due
      first_attempt  REAL     Unix time of the first attempt
      last_attempt   REAL     Unix time of the latest attempt (0 if none)
      last_error     TEXT     what the latest attempt got
      call_key       TEXT     the call's Idempotency-Key, fixed when the chunk was formed

    dlq  one row per dead-lettered row (matched, or one its trigger failed on)
      id, trigger, collection, key, op, lsn, attempts, last_error,
      first_attempt, last_attempt, row (the row document),
      call_key (the key of the chunk that held the row; NULL if none did)

    paused  one row per trigger an operator paused (``eventplane pause trigger:<name>``)
      trigger        TEXT     trigger name (primary key)
      since          REAL     Unix time of the pause
      by             TEXT     who paused it ('' if unknown)
      reason         TEXT     why ('' if none given)

A paused trigger's calls are queued as retry entries without being made
(``TriggerEngine``); :meth:`TriggerStore.due` leaves them out until it resumes.

A replay sends the rows of one ``call_key`` together under that key, never
with rows of another key, so a receiver that saw the key sees it again for
the same rows (version 1 files did not keep the key: their DLQ rows have
none and are regrouped by LSN, as then; their retry entries get the key
they were being sent with, ``<trigger>:<first_lsn>-<last_lsn>``).

A row its trigger's ``when`` failed on carries ``"stage": "when"`` in its
document (``triggers.rows.unevaluated``), attempts 0; replay moves it like any
other row and the engine evaluates ``when`` again before calling the action.
The mark lives in the document, not in a column.

A version 1 or 2 file is brought to version 3 when it is opened (one
transaction). An older eventplane refuses a newer file ("written by a newer
eventplane"), so going back to one means moving the store away.

Every write is one transaction with ``synchronous = FULL``: when a method
returns, its effect survives a crash or power loss. That is what lets
``TriggerEngine.finish`` count a queued action as done (invariant 6).

The engine calls this class from one worker thread; the ``eventplane dlq``
command opens the same file from another process (SQLite's locking and a
busy timeout make that safe).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triggers import rows as rowsmod
from triggers.errors import StoreError

SCHEMA_VERSION = 3
# A second process (the dlq command) may hold the write lock briefly.
BUSY_TIMEOUT_S = 10.0

_SCHEMA = (
    """CREATE TABLE retry (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    trigger TEXT NOT NULL,
    first_lsn INTEGER NOT NULL,
    last_lsn INTEGER NOT NULL,
    rows TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    next_due REAL NOT NULL,
    first_attempt REAL NOT NULL,
    last_attempt REAL NOT NULL,
    last_error TEXT NOT NULL,
    call_key TEXT NOT NULL
)""",
    "CREATE INDEX retry_due ON retry (next_due, id)",
    """CREATE TABLE dlq (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    trigger TEXT NOT NULL,
    collection TEXT NOT NULL,
    key TEXT NOT NULL,
    op TEXT NOT NULL,
    lsn INTEGER NOT NULL,
    attempts INTEGER NOT NULL,
    last_error TEXT NOT NULL,
    first_attempt REAL NOT NULL,
    last_attempt REAL NOT NULL,
    row TEXT NOT NULL,
    call_key TEXT
)""",
    "CREATE INDEX dlq_trigger ON dlq (trigger, id)",
    """CREATE TABLE paused (
    trigger TEXT PRIMARY KEY,
    since REAL NOT NULL,
    by TEXT NOT NULL,
    reason TEXT NOT NULL
)""",
)
# Version 1 -> 2: the call key. A version 1 retry entry was sent with the key
# its LSN range gives, so it keeps exactly that one; a version 1 DLQ row did not
# record its call, so it has none (NULL) and a replay regroups it by LSN.
_MIGRATE_1_TO_2 = (
    "ALTER TABLE retry ADD COLUMN call_key TEXT NOT NULL DEFAULT ''",
    "UPDATE retry SET call_key = trigger || ':' || first_lsn || '-' || last_lsn",
    "ALTER TABLE dlq ADD COLUMN call_key TEXT",
)
# Version 2 -> 3: operators' pauses of single triggers.
_MIGRATE_2_TO_3 = (_SCHEMA[-1],)
_RETRY_COLUMNS = (
    "id, trigger, first_lsn, last_lsn, rows, attempts, next_due, first_attempt, last_attempt, "
    "last_error, call_key"
)
_DLQ_COLUMNS = (
    "id, trigger, collection, key, op, lsn, attempts, last_error, first_attempt, last_attempt, "
    "row, call_key"
)
DLQ_COLUMNS = _DLQ_COLUMNS  # daemon/dlqcopy.py: the archive's copy has every column
REPLAYED = "replayed from the DLQ"


def store_path(data_dir: Path | str) -> Path:
    return Path(data_dir) / "triggers" / "queue.sqlite3"


@dataclass(frozen=True, slots=True)
class RetryEntry:
    id: int
    trigger: str
    first_lsn: int
    last_lsn: int
    rows: str  # JSON array of row documents
    attempts: int
    next_due: float
    first_attempt: float
    last_attempt: float
    last_error: str
    call_key: str  # the Idempotency-Key every attempt of this entry sends

    def chunk(self) -> rowsmod.Chunk:
        docs = rowsmod.split(self.rows)
        return rowsmod.Chunk(self.trigger, docs, self.first_lsn, self.last_lsn, self.call_key)


@dataclass(frozen=True, slots=True)
class NewRetry:
    chunk: rowsmod.Chunk
    attempts: int
    next_due: float
    first_attempt: float
    last_attempt: float
    last_error: str


@dataclass(frozen=True, slots=True)
class DeadRows:
    """Rows of one trigger that go to the DLQ with the same history."""

    trigger: str
    docs: Sequence[bytes]
    attempts: int
    last_error: str
    first_attempt: float
    last_attempt: float
    # The key of the chunk that held the rows, kept for their replay; None for
    # rows no chunk held (poison rows, rows stopped by the emit depth limit).
    call_key: str | None = None


@dataclass(frozen=True, slots=True)
class DlqEntry:
    id: int
    trigger: str
    collection: str
    key: str
    op: str
    lsn: int
    attempts: int
    last_error: str
    first_attempt: float
    last_attempt: float
    row: str
    call_key: str | None


@dataclass(frozen=True, slots=True)
class Pause:
    """An operator's pause of one trigger."""

    trigger: str
    since: float
    by: str
    reason: str


class TriggerStore:
    def __init__(self, path: Path | str, dlq_max_entries: int = 100_000) -> None:
        self.path = Path(path)
        self.dlq_max_entries = dlq_max_entries
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(
                self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open the trigger store {self.path}: {exc}") from exc
        self._db = db
        try:
            db.execute("PRAGMA journal_mode = WAL")
            # FULL: a commit is on disk when it returns (NORMAL may lose it on power loss).
            db.execute("PRAGMA synchronous = FULL")
            self._create_or_migrate(db)
        except sqlite3.Error as exc:
            db.close()
            raise StoreError(f"cannot initialise the trigger store {self.path}: {exc}") from exc
        except BaseException:
            db.close()
            raise

    def _create_or_migrate(self, db: sqlite3.Connection) -> None:
        """Create the layout, or bring an older file to this version, in one transaction.

        IMMEDIATE: the daemon and the ``eventplane dlq`` command may open an old
        file at the same time; the second one waits and then finds version 2.
        """
        db.execute("BEGIN IMMEDIATE")
        try:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path}: layout version {version} was written by a newer eventplane "
                    f"(this one reads {SCHEMA_VERSION}); upgrade, or move the file away"
                )
            steps = {
                0: _SCHEMA,
                1: _MIGRATE_1_TO_2 + _MIGRATE_2_TO_3,
                2: _MIGRATE_2_TO_3,
            }.get(version, ())
            for statement in steps:
                db.execute(statement)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Cursor]:
        # IMMEDIATE takes the write lock up front, so a concurrent dlq command
        # waits on the busy timeout instead of failing half-way.
        cur = self._db.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            yield cur
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        else:
            cur.execute("COMMIT")
        finally:
            cur.close()

    # ------------------------------------------------------------------ writes

    def record(self, retries: Sequence[NewRetry], dead: Sequence[DeadRows]) -> int:
        """Queue retries and dead-letter rows in one transaction; returns DLQ evictions."""
        if not retries and not dead:
            return 0
        with self._tx() as cur:
            self._insert_retries(cur, retries)
            self._insert_dead(cur, dead)
            return self._evict(cur) if dead else 0

    def succeeded(self, entry_id: int) -> None:
        with self._tx() as cur:
            cur.execute("DELETE FROM retry WHERE id = ?", (entry_id,))

    def reschedule(
        self, entry_id: int, attempts: int, next_due: float, last_attempt: float, error: str
    ) -> None:
        with self._tx() as cur:
            cur.execute(
                "UPDATE retry SET attempts = ?, next_due = ?, last_attempt = ?, last_error = ? "
                "WHERE id = ?",
                (attempts, next_due, last_attempt, error, entry_id),
            )

    def dead_letter(
        self, entry: RetryEntry, dead: Sequence[DeadRows], requeue: Sequence[NewRetry] = ()
    ) -> int:
        """Replace a retry entry by DLQ rows (and what is left of it), atomically.

        Returns DLQ evictions.
        """
        with self._tx() as cur:
            cur.execute("DELETE FROM retry WHERE id = ?", (entry.id,))
            self._insert_retries(cur, requeue)
            self._insert_dead(cur, dead)
            return self._evict(cur)

    def pause(self, trigger: str, since: float, by: str, reason: str) -> bool:
        """Record a pause; False (and nothing changes) if the trigger is paused already."""
        with self._tx() as cur:
            cur.execute(
                "INSERT OR IGNORE INTO paused (trigger, since, by, reason) VALUES (?, ?, ?, ?)",
                (trigger, since, by, reason),
            )
            return cur.rowcount == 1

    def resume(self, trigger: str) -> Pause | None:
        """Remove a pause; the pause that was removed, or None if there was none."""
        with self._tx() as cur:
            row = cur.execute(
                "SELECT trigger, since, by, reason FROM paused WHERE trigger = ?", (trigger,)
            ).fetchone()
            if row is None:
                return None
            cur.execute("DELETE FROM paused WHERE trigger = ?", (trigger,))
            return Pause(*row)

    def pauses(self) -> dict[str, Pause]:
        rows = self._db.execute("SELECT trigger, since, by, reason FROM paused").fetchall()
        return {r[0]: Pause(*r) for r in rows}

    def queued_rows(self, triggers: Collection[str]) -> dict[str, int]:
        """Rows waiting in the retry queue for each of ``triggers`` (parses their
        entries: the engine asks when a trigger is paused or the store opens)."""
        out = dict.fromkeys(triggers, 0)
        if not out:
            return out
        marks = ",".join("?" * len(out))
        rows = self._db.execute(
            "SELECT trigger, SUM(json_array_length(rows)) FROM retry "
            f"WHERE trigger IN ({marks}) GROUP BY trigger",
            tuple(out),
        ).fetchall()
        out.update((r[0], int(r[1] or 0)) for r in rows)
        return out

    def make_all_due(self, now: float) -> int:
        """After a restart every pending retry is due at once (issue 5)."""
        with self._tx() as cur:
            cur.execute("UPDATE retry SET next_due = ? WHERE next_due > ?", (now, now))
            return cur.rowcount

    def _insert_retries(self, cur: sqlite3.Cursor, retries: Sequence[NewRetry]) -> None:
        cur.executemany(
            "INSERT INTO retry (trigger, first_lsn, last_lsn, rows, attempts, next_due, "
            "first_attempt, last_attempt, last_error, call_key) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (
                    r.chunk.trigger,
                    r.chunk.first_lsn,
                    r.chunk.last_lsn,
                    rowsmod.join(r.chunk.docs).decode(),
                    r.attempts,
                    r.next_due,
                    r.first_attempt,
                    r.last_attempt,
                    r.last_error,
                    r.chunk.idempotency_key,
                )
                for r in retries
            ],
        )

    def _insert_dead(self, cur: sqlite3.Cursor, dead: Sequence[DeadRows]) -> None:
        values = []
        for d in dead:
            for doc in d.docs:
                m = rowsmod.meta(doc)
                values.append(
                    (
                        d.trigger, m.collection, m.key, m.op, m.lsn, d.attempts,
                        d.last_error, d.first_attempt, d.last_attempt, doc.decode(), d.call_key,
                    )
                )  # fmt: skip
        cur.executemany(
            "INSERT INTO dlq (trigger, collection, key, op, lsn, attempts, last_error, "
            "first_attempt, last_attempt, row, call_key) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            values,
        )

    def _evict(self, cur: sqlite3.Cursor) -> int:
        size = int(cur.execute("SELECT COUNT(*) FROM dlq").fetchone()[0])
        excess = size - self.dlq_max_entries
        if excess <= 0:
            return 0
        cur.execute(
            "DELETE FROM dlq WHERE id IN (SELECT id FROM dlq ORDER BY id LIMIT ?)", (excess,)
        )
        return excess

    # ------------------------------------------------------------------- reads

    def due(self, now: float, exclude: Collection[str] = (), limit: int = 256) -> list[RetryEntry]:
        """Entries due at ``now``, oldest due first; ``exclude`` names disabled triggers."""
        marks = ",".join("?" * len(exclude))
        sql = (
            f"SELECT {_RETRY_COLUMNS} FROM retry WHERE next_due <= ? "
            + (f"AND trigger NOT IN ({marks}) " if exclude else "")
            + "ORDER BY next_due, id LIMIT ?"
        )
        cur = self._db.execute(sql, (now, *exclude, limit))
        return [RetryEntry(*row) for row in cur.fetchall()]

    def next_due(self, exclude: Collection[str] = ()) -> float | None:
        marks = ",".join("?" * len(exclude))
        sql = "SELECT MIN(next_due) FROM retry" + (
            f" WHERE trigger NOT IN ({marks})" if exclude else ""
        )
        value = self._db.execute(sql, tuple(exclude)).fetchone()[0]
        return None if value is None else float(value)

    def pending(self, trigger: str | None = None) -> list[RetryEntry]:
        where, args = ("WHERE trigger = ?", (trigger,)) if trigger else ("", ())
        cur = self._db.execute(f"SELECT {_RETRY_COLUMNS} FROM retry {where} ORDER BY id", args)
        return [RetryEntry(*row) for row in cur.fetchall()]

    def oldest_pending_lsn(self) -> int | None:
        """The lowest first LSN of the retry queue's entries (None: it is empty)."""
        value = self._db.execute("SELECT MIN(first_lsn) FROM retry").fetchone()[0]
        return None if value is None else int(value)

    def retry_depth(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM retry").fetchone()[0])

    def dlq_size(self, trigger: str | None = None) -> int:
        if trigger is None:
            return int(self._db.execute("SELECT COUNT(*) FROM dlq").fetchone()[0])
        sql = "SELECT COUNT(*) FROM dlq WHERE trigger = ?"
        return int(self._db.execute(sql, (trigger,)).fetchone()[0])

    def dlq_list(self, trigger: str | None = None, limit: int = 100) -> list[DlqEntry]:
        """Oldest first (DLQ ids grow with time)."""
        where, args = ("WHERE trigger = ?", (trigger,)) if trigger else ("", ())
        cur = self._db.execute(
            f"SELECT {_DLQ_COLUMNS} FROM dlq {where} ORDER BY id LIMIT ?", (*args, limit)
        )
        return [DlqEntry(*row) for row in cur.fetchall()]

    def dlq_get(self, entry_id: int) -> DlqEntry | None:
        cur = self._db.execute(f"SELECT {_DLQ_COLUMNS} FROM dlq WHERE id = ?", (entry_id,))
        row = cur.fetchone()
        return None if row is None else DlqEntry(*row)

    # ------------------------------------------------------------- operations

    def dlq_insert(self, rows: Sequence[tuple[Any, ...]]) -> None:
        """DLQ rows as they were, ids included (a restore's copy, daemon/dlqcopy.py)."""
        marks = ", ".join("?" * len(_DLQ_COLUMNS.split(",")))
        with self._tx() as cur:
            cur.executemany(f"INSERT INTO dlq ({_DLQ_COLUMNS}) VALUES ({marks})", rows)

    def dlq_replay(
        self,
        *,
        entry_id: int | None = None,
        trigger: str | None = None,
        chunk_sizes: Mapping[str, int] | None = None,
        default_chunk: int = 1024,
    ) -> int:
        """Move DLQ rows back to the retry queue, due at once, attempts reset.

        Due time 0 rather than this process's "now": the daemon's clock
        decides, so clock skew between the CLI and the daemon cannot delay it.

        Rows keep their call: the rows of one ``call_key`` become one entry
        with that key (whatever ``batch_size`` is now), never merged with rows
        of another key. Rows without one (no chunk ever held them: poison
        rows, rows of version 1 files) are regrouped per trigger in LSN order
        into chunks of the trigger's ``batch_size``, keyed by their LSN range.
        Returns how many rows moved.
        """
        if (entry_id is None) == (trigger is None):
            raise ValueError("give exactly one of entry_id and trigger")
        with self._tx() as cur:
            if entry_id is not None:
                found = cur.execute(
                    "SELECT id, trigger, lsn, row, first_attempt, call_key FROM dlq WHERE id = ?",
                    (entry_id,),
                ).fetchall()
            else:
                found = cur.execute(
                    "SELECT id, trigger, lsn, row, first_attempt, call_key FROM dlq "
                    "WHERE trigger = ? ORDER BY lsn, id",
                    (trigger,),
                ).fetchall()
            retries = _regroup(found, chunk_sizes or {}, default_chunk)
            self._insert_retries(cur, retries)
            cur.executemany("DELETE FROM dlq WHERE id = ?", [(r[0],) for r in found])
            return len(found)

    def dlq_purge(self, trigger: str | None = None) -> int:
        with self._tx() as cur:
            if trigger is None:
                cur.execute("DELETE FROM dlq")
            else:
                cur.execute("DELETE FROM dlq WHERE trigger = ?", (trigger,))
            return cur.rowcount


def _regroup(
    found: Sequence[tuple[int, str, int, str, float, str | None]],
    sizes: Mapping[str, int],
    default_chunk: int,
) -> list[NewRetry]:
    """DLQ rows ``(id, trigger, lsn, row, first_attempt, call_key)`` -> retry entries.

    One entry per ``call_key``, holding each of its LSNs once (a batch re-run
    may have dead-lettered the same call twice); rows without a key in
    ``batch_size`` chunks of LSN order. Entries come out per trigger in order
    of their first LSN, which is the order the retry loop delivers them in.
    """
    keyed: dict[tuple[str, str], dict[int, tuple[bytes, float]]] = {}
    keyless: dict[str, list[tuple[int, bytes, float]]] = {}
    for _id, name, lsn, row, first, key in found:
        if key is None:
            keyless.setdefault(name, []).append((lsn, row.encode(), first))
        else:
            keyed.setdefault((name, key), {}).setdefault(lsn, (row.encode(), first))
    retries: list[NewRetry] = []
    for (name, key), by_lsn in keyed.items():
        lsns = sorted(by_lsn)
        docs = [by_lsn[lsn][0] for lsn in lsns]
        chunk = rowsmod.Chunk(name, docs, lsns[0], lsns[-1], key)
        first = min(f for _, f in by_lsn.values())
        retries.append(NewRetry(chunk, 0, 0.0, first, 0.0, REPLAYED))
    for name, items in keyless.items():
        items.sort(key=lambda item: item[0])
        size = sizes.get(name, default_chunk)
        for i in range(0, len(items), size):
            part = items[i : i + size]
            chunk = rowsmod.Chunk.of(name, [rowsmod.Row(lsn, doc) for lsn, doc, _ in part])
            first = min(f for _, _, f in part)
            retries.append(NewRetry(chunk, 0, 0.0, first, 0.0, REPLAYED))
    retries.sort(key=lambda r: (r.chunk.trigger, r.chunk.first_lsn, r.chunk.last_lsn))
    return retries
