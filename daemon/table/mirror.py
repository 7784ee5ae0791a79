"""Mirror tables: a collection's current state, one row per key, as a Delta table.

A ``[[cdc.mirrors]]`` entry's table is a fold of its collection's change log
(invariant 22): after the mirror's stage committed batch B, it holds, per
key, the event of the highest LSN up to B's, unless that event is a delete.
Layout of ``path``::

    <path>/_delta_log/                    Delta's transaction log: the table
    <path>/bucket=<n>/part-*.parquet      data files, bucket = crc32(key) % buckets
    <path>/_eventplane/lock               flock: one writer per mirror
    <path>/_eventplane/quarantine/        a strict mirror's events that do not fit

Commit protocol for batch B of mirror M (:meth:`MirrorTable.commit`):

0. **Idempotency.** The table's ``txn`` of ``eventplane/<WAL id>/mirror/<M>``
   is at or above B: the batch is in the table, nothing is written.
1. **Reduce.** The batch's rows of the collection, the highest LSN per key
   (a current-state mirror that is not strict: in Arrow, :func:`newest_in_arrow`);
   the typed columns cast from ``new`` (:func:`cast`). A strict mirror's
   events that do not fit go to the quarantine first (a stream's rows,
   :mod:`daemon.table.quarantine`), and the quarantine's events of the keys
   the merge writes at a higher LSN are marked superseded.
2. **Merge.** One delta-rs MERGE of those rows into the buckets they touch
   (a literal ``bucket IN (...)`` prunes the rest), with the ``txn``
   (app id, B) in its own commit: an insert or update upserts, a delete
   removes the key (``t.lsn < s.lsn`` guards both: a row never goes back);
   then the new log entries and their data files are fsynced.

On S3 (invariant 18, :mod:`daemon.table.fence`), opening a table that
exists first commits the fence; step 2 reads the log and checks the lease:
every commit since this writer's last is its own (another writer's stops
the mirror for good, taken over); the merge commits with no automatic
retry, at the version after the one read, or fails and goes back to that
check. Compaction's commits are checked and fenced the same way.

A crash anywhere before step 2's commit leaves the table as it was; after
it, the re-run stops at step 0. A merge that changes nothing (deletes of
unknown keys only) commits nothing, which is the same table.
Compaction (OPTIMIZE, then VACUUM) runs after a commit in the same thread,
never beside a merge (delta-rs fails a merge that an OPTIMIZE overtook), and
so do a quarantine's replay and purge (:meth:`MirrorTable.replay_quarantine`:
one merge of the events, exactly once by its own ``txn``, never of a
superseded one: a delete leaves no row whose LSN a merge could compare).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Context, Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import msgspec
import structlog

from daemon.config import HISTORY_COLUMNS, MIRROR_COLUMNS, CdcMirror
from daemon.errors import IdentityMismatchError
from daemon.events import StoredEvent, encode
from daemon.events import decode as decode_stored
from daemon.plane.batch import MicroBatch
from daemon.table import quarantine
from daemon.table.crash import crash_point
from daemon.table.durable import append_line, atomic_write_json, fsync_dir, fsync_file
from daemon.table.errors import CdcLayoutError, CdcStreamLockedError
from daemon.table.fence import Fence
from daemon.table.layout import META_DIR
from daemon.table.location import LOG_DIR
from wal import lockfile

log = structlog.get_logger("eventplane.mirror")

# Delta's properties of a mirror's table (no deletion vectors: delta-rs
# writes none, and some readers cannot read them; a checkpoint every 10
# commits, as Spark's default).
MIRROR_PROPERTIES = {
    "delta.enableDeletionVectors": "false",
    "delta.checkpointInterval": "10",
}
# Commits between two compactions (OPTIMIZE, then VACUUM) of a mirror.
COMPACT_EVERY = 50
# VACUUM keeps the files the snapshots of the last this many hours read.
VACUUM_RETAIN_HOURS = 168
# Attempts of one merge to a table on S3 whose version a commit of this
# writer took (the store client's retry of a PUT whose answer was lost: the
# next attempt finds the merge in the log).
COMMIT_ATTEMPTS = 8
# The txn app id, under the mirror's, of quarantine replays (its version: the replay's id).
REPLAY_APP = "/replay"
# In the quarantine: the set-aside events a newer event of their key merged
# since supersedes (LSN -> that event's LSN), which a replay must not write.
SUPERSEDED_FILE = "superseded.json"
# In the quarantine: the LSNs each replay took out (written or superseded).
REPLAY_LOG = "replayed.jsonl"
# What a quarantine file of the earlier layout (``events``) is renamed with.
EARLIER_LAYOUT = ".earlier-layout"
_INT64 = (-(2**63), 2**63 - 1)
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
# Wide enough for any decimal(38, s) and for telling a value that does not fit.
_DECIMALS = Context(prec=200)


def app_id(wal_id: str, name: str) -> str:
    """The Delta ``txnAppId`` of a mirror's batch commits."""
    return f"eventplane/{wal_id}/mirror/{name}"


def bucket_of(key: str, buckets: int) -> int:
    """The bucket (the table's partition) of ``key``: crc32 of its UTF-8 bytes."""
    return zlib.crc32(key.encode("utf-8")) % buckets


# -- casting -----------------------------------------------------------------


def json_type(value: Any) -> str:
    """A parsed JSON value's type, as a refusal names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float | Decimal):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


# msgspec decodes a document 7x faster than json.loads with the same values
# (big integers, exact fractions, the last of duplicate names); what it
# refuses (NaN, a lone surrogate) json.loads reads, as before.
_DOC_DECODER = msgspec.json.Decoder(float_hook=Decimal)


def parse_doc(text: str | bytes) -> Any:
    """``new`` as JSON with exact numbers (a fraction is a ``Decimal``)."""
    try:
        return _DOC_DECODER.decode(text)
    except msgspec.DecodeError:
        return json.loads(text, parse_float=Decimal)


class NoFit(Exception):
    """A value that the column's type cannot hold."""


def cast(value: Any, kind: str) -> Any:
    """``value`` (parsed by :func:`parse_doc`) as a column of type ``kind``
    holds it, None for null; raises :class:`NoFit`. The rules: a JSON number
    fills long (if integral and in range), double and decimal(p,s) (if it
    fits p,s without rounding); an ISO-8601 string or epoch milliseconds fills
    timestamp (no offset: UTC) and date (the UTC day); a string is never read
    as a number, nor a number as a string; boolean takes true and false only."""
    if value is None:
        return None
    number = isinstance(value, int | Decimal) and not isinstance(value, bool)
    if kind == "string":
        if isinstance(value, str):
            return value
    elif kind == "boolean":
        if isinstance(value, bool):
            return value
    elif kind == "long":
        if number:
            exact = Decimal(value)
            if exact == exact.to_integral_value() and _INT64[0] <= exact <= _INT64[1]:
                return int(exact)
    elif kind == "double":
        if number:
            out = float(value)
            if abs(out) != float("inf"):
                return out
    elif kind.startswith("decimal("):
        if number:
            return _decimal(Decimal(value), kind)
    elif kind in ("timestamp", "date"):
        moment = _moment(value)
        if moment is not None:
            return moment if kind == "timestamp" else moment.date()
    raise NoFit(kind)


def _decimal(value: Decimal, kind: str) -> Decimal:
    p, s = (int(x) for x in kind[len("decimal(") : -1].split(","))
    try:
        exact = value.quantize(Decimal(1).scaleb(-s), context=_DECIMALS)
    except InvalidOperation:
        raise NoFit(kind) from None
    if exact != value or abs(exact) >= Decimal(10) ** (p - s):
        raise NoFit(kind)
    return exact


def _moment(value: Any) -> dt.datetime | None:
    """An ISO-8601 string or epoch milliseconds as a UTC datetime."""
    try:
        if isinstance(value, str):
            if len(value) == 10:  # a date: its midnight, UTC
                day = dt.date.fromisoformat(value)
                return dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC)
            moment = dt.datetime.fromisoformat(value)
            if moment.tzinfo is None:
                return moment.replace(tzinfo=dt.UTC)
            return moment.astimezone(dt.UTC)
        if isinstance(value, int | Decimal) and not isinstance(value, bool):
            exact = Decimal(value)
            if exact == exact.to_integral_value():
                return _EPOCH + dt.timedelta(milliseconds=int(exact))
    except (ValueError, OverflowError):
        return None
    return None


def check_new(doc: Any, columns: tuple[tuple[str, str], ...]) -> tuple[str, str, str] | None:
    """The first typed column that ``doc`` (a parsed ``new``) does not fit, as
    ``(field, value type, column type)``; None when every one fits."""
    if not isinstance(doc, dict):
        return None
    for name, kind in columns:
        try:
            cast(doc.get(name), kind)
        except NoFit:
            return name, json_type(doc.get(name)), kind
    return None


def arrow_type(kind: str) -> Any:
    import pyarrow as pa

    simple = {
        "string": pa.string(),
        "long": pa.int64(),
        "double": pa.float64(),
        "boolean": pa.bool_(),
        "timestamp": pa.timestamp("us", tz="UTC"),
        "date": pa.date32(),
    }
    if kind in simple:
        return simple[kind]
    p, s = (int(x) for x in kind[len("decimal(") : -1].split(","))
    return pa.decimal128(p, s)


def _nullable(schema: Any) -> Any:
    """``schema`` with every field nullable (a history merge's closing rows
    carry only the key and the closing event)."""
    import pyarrow as pa

    return pa.schema([f.with_nullable(True) for f in schema])


def arrow_schema(mirror: CdcMirror) -> Any:
    """The mirror table's columns (docs/cdc.md, "Mirror tables")."""
    import pyarrow as pa

    fixed = [
        pa.field("key", pa.string(), nullable=False),
        pa.field("bucket", pa.int32(), nullable=False),
        pa.field("lsn", pa.int64(), nullable=False),
        pa.field("op", pa.string(), nullable=False),
        pa.field("updated_at", pa.timestamp("us", tz="UTC")),
        pa.field("producer", pa.string()),
        pa.field("doc", pa.string()),
    ]
    assert [f.name for f in fixed] == list(MIRROR_COLUMNS)
    if mirror.history:
        ts = pa.timestamp("us", tz="UTC")
        fixed += [
            pa.field("valid_from_lsn", pa.int64()),
            pa.field("valid_to_lsn", pa.int64()),  # null while current
            pa.field("valid_from", ts),
            pa.field("valid_to", ts),
            pa.field("is_current", pa.bool_()),
        ]
        assert [f.name for f in fixed[len(MIRROR_COLUMNS) :]] == list(HISTORY_COLUMNS)
    return pa.schema(fixed + [pa.field(n, arrow_type(k)) for n, k in mirror.columns])


# -- the fold of one batch ------------------------------------------------------


@dataclass(slots=True)
class Reduced:
    """A batch's rows of a mirror's collection, reduced (commit step 1)."""

    # Current state: one per key, the highest LSN's. History: one per insert
    # or update (a version), in LSN order per key.
    rows: list[dict[str, Any]]
    events: int  # the collection's events in the batch
    cast_failures: dict[str, int] = field(default_factory=dict)  # column -> values nulled
    # A strict mirror's events that do not fit (an emit action's: ingest
    # refuses a producer's), set aside before the reduction.
    set_aside: list[dict[str, Any]] = field(default_factory=list)
    # History: per key of the batch, its first event, which closes the
    # version the table holds as current (``valid_to_lsn``, ``valid_to``).
    closes: list[dict[str, Any]] = field(default_factory=list)
    # :func:`newest_in_arrow`'s reduction: the rows as an Arrow table of the
    # mirror's schema (the merge's source); ``rows`` is then empty.
    source: Any = None

    @property
    def keys(self) -> int:
        """The rows the merge writes (one per key; history: one per version)."""
        return len(self.rows) if self.source is None else int(self.source.num_rows)

    def row_dicts(self) -> list[dict[str, Any]]:
        """The rows as dicts, wherever they are held."""
        return self.rows if self.source is None else self.source.to_pylist()


def reduce(mirror: CdcMirror, table: Any) -> Reduced:
    """``table`` (a batch's rows as ``daemon.spark.frame.batch_table`` makes them)
    reduced to the mirror's rows: its collection's, the highest LSN per key
    (history: every version, :func:`versions`), typed columns cast (a value
    that does not fit: null, counted per column; a strict mirror sets the
    event aside instead)."""
    evs, set_aside, count = _events(mirror, table)
    return fold_events(mirror, evs, count, set_aside)


def fold_events(
    mirror: CdcMirror,
    evs: list[dict[str, Any]],
    count: int,
    set_aside: list[dict[str, Any]] | None = None,
) -> Reduced:
    """:func:`reduce`'s second half: the events ``evs`` (as :func:`_events`
    makes them) folded into the mirror's rows."""
    set_aside = set_aside or []
    if mirror.history:
        return versions(mirror, evs, count, set_aside)
    latest: dict[str, dict[str, Any]] = {}
    for ev in evs:
        held = latest.get(ev["key"])
        if held is None or held["lsn"] < ev["lsn"]:
            latest[ev["key"]] = ev
    failures: dict[str, int] = {}
    rows = [_row(mirror, ev, failures) for ev in latest.values()]
    return Reduced(rows, count, failures, set_aside)


def newest_in_arrow(mirror: CdcMirror, tables: list[Any]) -> Reduced | None:
    """:func:`reduce` of the batches' rows ``tables`` (one or several, as
    :meth:`MirrorTable.commit_many` folds them) for a current-state mirror that
    is not strict, in Arrow: the highest LSN per key chosen by a group-by and
    only those rows turned into Python values (their typed columns): a commit
    of 300k changes takes 1.2 s instead of 4.3. None where it does not apply: a history
    or strict mirror, or rows that hold an LSN twice (never from one WAL) so
    that a key keeps two rows."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if mirror.history or mirror.strict:
        return None
    cols = ["lsn", "op", "key", "new_json", "ingest_ts", "producer"]
    parts = [t.filter(pc.equal(t["collection"], mirror.collection)).select(cols) for t in tables]
    mine = pa.concat_tables(parts) if len(parts) != 1 else parts[0]
    if mine.num_rows == 0:
        return Reduced([], 0)
    newest = mine.group_by("key").aggregate([("lsn", "max")])
    kept = mine.filter(pc.is_in(mine["lsn"], value_set=newest["lsn_max"]))
    if kept.num_rows != newest.num_rows:
        return None  # a key kept twice: the fold of one dict per event decides
    schema = arrow_schema(mirror)
    deleted = pc.equal(kept["op"], "delete")
    doc = pc.if_else(deleted, pa.scalar(None, pa.string()), kept["new_json"].cast(pa.string()))
    keys = kept["key"].to_pylist()
    failures: dict[str, int] = {}
    typed: list[list[Any]] = [[] for _ in mirror.columns]
    for text in doc.to_pylist() if mirror.columns else ():
        for values, value in zip(typed, _typed(mirror, text, failures), strict=True):
            values.append(value)
    buckets = [bucket_of(key, mirror.buckets) for key in keys]
    fixed = [
        kept["key"],
        pa.array(buckets, pa.int32()),
        kept["lsn"],
        kept["op"],
        kept["ingest_ts"],
        kept["producer"],
        doc,
    ]
    arrays = [
        *fixed,
        *(pa.array(v, arrow_type(k)) for v, (_, k) in zip(typed, mirror.columns, strict=True)),
    ]
    source = pa.Table.from_arrays(
        [a.cast(f.type) for a, f in zip(arrays, schema, strict=True)], schema=schema
    )
    return Reduced([], mine.num_rows, failures, source=source)


def versions(
    mirror: CdcMirror, evs: list[dict[str, Any]], count: int, set_aside: list[dict[str, Any]]
) -> Reduced:
    """A history mirror's rows of the events ``evs``: per key, in LSN order,
    each insert or update opens a version that the key's next event (any op)
    closes; the last one opened stays current. The key's first event closes
    the version the table holds (:attr:`Reduced.closes`)."""
    per_key: dict[str, list[dict[str, Any]]] = {}
    for ev in sorted(evs, key=lambda e: e["lsn"]):
        per_key.setdefault(ev["key"], []).append(ev)
    failures: dict[str, int] = {}
    rows: list[dict[str, Any]] = []
    closes: list[dict[str, Any]] = []
    for key, seq in per_key.items():
        first = seq[0]
        closes.append({"key": key, "bucket": bucket_of(key, mirror.buckets), **_closing(first)})
        for ev, nxt in zip(seq, [*seq[1:], None], strict=True):
            if ev["op"] == "delete":
                continue
            row = _row(mirror, ev, failures)
            row["valid_from_lsn"], row["valid_from"] = ev["lsn"], ev["ts"]
            row.update(_closing(nxt))
            rows.append(row)
    return Reduced(rows, count, failures, set_aside, closes)


def _closing(ev: dict[str, Any] | None) -> dict[str, Any]:
    """The history columns a version gets from the event that closes it (None: current)."""
    if ev is None:
        return {"valid_to_lsn": None, "valid_to": None, "is_current": True}
    return {"valid_to_lsn": ev["lsn"], "valid_to": ev["ts"], "is_current": False}


def _events(
    mirror: CdcMirror, table: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """The mirror's events of ``table`` (``lsn``, ``op``, ``key``, ``doc``,
    ``ts``, ``p``), a strict mirror's that do not fit set aside (in LSN
    order), and how many events of the collection there were."""
    import pyarrow.compute as pc

    mine = table.filter(pc.equal(table["collection"], mirror.collection))
    out: list[dict[str, Any]] = []
    set_aside: list[dict[str, Any]] = []
    cols = ("lsn", "op", "key", "new_json", "ingest_ts", "producer")
    for lsn, op, key, new, ts, producer in zip(*(mine[c].to_pylist() for c in cols), strict=True):
        ev = {"lsn": lsn, "op": op, "key": key, "doc": new, "ts": ts, "p": producer}
        error = misfit(mirror, ev)
        if error is not None:
            set_aside.append({**ev, "error": error})
            continue
        out.append(ev)
    set_aside.sort(key=lambda e: e["lsn"])  # the batch is in core order
    return out, set_aside, mine.num_rows


def misfit(mirror: CdcMirror, ev: dict[str, Any]) -> str | None:
    """Why a strict mirror sets the event ``ev`` aside (its first typed column
    that ``new`` does not fit), or None: it takes it."""
    if not mirror.strict or ev["op"] == "delete" or ev["doc"] is None:
        return None
    bad = check_new(parse_doc(ev["doc"]), mirror.columns)
    if bad is None:
        return None
    field_name, value_type, column_type = bad
    return f'field "new.{field_name}": a {value_type} does not fit the {column_type} column'


def held_rows(
    mirror: CdcMirror, batch: MicroBatch, events: list[dict[str, Any]]
) -> list[quarantine.QuarantinedRow]:
    """The set-aside ``events`` of ``batch`` as quarantine rows: the records as
    the WAL stored them when the batch has them; a rebuild's batch is the
    log's rows (no records), whose events are stored again from their columns."""
    if batch.slices:
        return quarantine.rows_of(batch, [(e["lsn"], e["error"]) for e in events])
    now = time.time()
    out = []
    for e in events:
        new = e["doc"].encode() if isinstance(e["doc"], str) else e["doc"]
        ts_ns = (e["ts"] - _EPOCH) // dt.timedelta(microseconds=1) * 1000
        event = StoredEvent(mirror.collection, e["op"], e["key"], new, None, ts_ns, producer=e["p"])
        out.append(
            quarantine.QuarantinedRow(
                e["lsn"],
                0,
                0,
                batch.batch_id,
                mirror.collection,
                e["op"],
                e["key"],
                e["error"],
                encode(event),
                now,
            )
        )
    return out


def newest_per_key(reduced: Reduced) -> dict[str, int]:
    """The highest LSN a merge of ``reduced`` writes per key (a delete's too)."""
    if reduced.source is not None:
        keys, lsns = (reduced.source[c].to_pylist() for c in ("key", "lsn"))
        return dict(zip(keys, lsns, strict=True))  # one row per key
    newest: dict[str, int] = {}
    for key, lsn in [(r["key"], r["lsn"]) for r in reduced.rows] + [
        (r["key"], r["valid_to_lsn"]) for r in reduced.closes
    ]:
        newest[key] = max(newest.get(key, lsn), lsn)
    return newest


def event_of(row: quarantine.QuarantinedRow) -> dict[str, Any]:
    """A quarantine row's event as :func:`_events` makes them (a replay's input)."""
    ev = decode_stored(row.payload)
    return {
        "lsn": row.lsn,
        "op": ev.op,
        "key": ev.key,
        "doc": None if ev.new is None else ev.new.decode("utf-8"),
        "ts": _EPOCH + dt.timedelta(microseconds=ev.ingest_ts_ns // 1000),
        "p": ev.producer,
    }


def _row(mirror: CdcMirror, ev: dict[str, Any], failures: dict[str, int]) -> dict[str, Any]:
    """The table's row of event ``ev``, typed columns cast (``failures`` counts
    the values that do not fit, per column)."""
    row: dict[str, Any] = {
        "key": ev["key"],
        "bucket": bucket_of(ev["key"], mirror.buckets),
        "lsn": ev["lsn"],
        "op": ev["op"],
        "updated_at": ev["ts"],
        "producer": ev["p"],
        "doc": None if ev["op"] == "delete" else ev["doc"],
    }
    for (name, _), value in zip(mirror.columns, _typed(mirror, row["doc"], failures), strict=True):
        row[name] = value
    return row


def _typed(mirror: CdcMirror, text: str | None, failures: dict[str, int]) -> list[Any]:
    """The typed columns' values of the document ``text`` (None: a delete's),
    a value that does not fit as None (``failures`` counts them per column);
    no typed columns: the document is not parsed."""
    if not mirror.columns:
        return []
    doc = parse_doc(text) if text is not None else None
    out = []
    for name, kind in mirror.columns:
        value = doc.get(name) if isinstance(doc, dict) else None
        try:
            out.append(cast(value, kind))
        except NoFit:
            out.append(None)
            failures[name] = failures.get(name, 0) + 1
    return out


def fold(mirror: CdcMirror, state: dict[str, dict[str, Any]], reduced: Reduced) -> None:
    """What a merge of ``reduced`` does to a mirror, on a dict key -> row: the
    reference the tests compare the table with."""
    for row in reduced.row_dicts():
        held = state.get(row["key"])
        if held is not None and held["lsn"] >= row["lsn"]:
            continue
        if row["op"] == "delete":
            state.pop(row["key"], None)
        else:
            state[row["key"]] = row


# -- the table ------------------------------------------------------------------


def replayed_lsns(meta: Path) -> set[int]:
    """The LSNs the replay log names (a torn last line: that replay never finished)."""
    path = quarantine.directory(meta) / REPLAY_LOG
    if not path.exists():
        return set()
    out: set[int] = set()
    for line in path.read_bytes().splitlines():
        try:
            out.update(int(x) for x in json.loads(line)["lsns"])
        except ValueError:
            continue
    return out


def superseded_marks(meta: Path) -> dict[int, int]:
    """The quarantine's events marked superseded (LSN -> the newer event's
    LSN); may name events no longer in it. Read-only: works beside the daemon."""
    path = quarantine.directory(meta) / SUPERSEDED_FILE
    if not path.exists():
        return {}
    return {int(a): int(b) for a, b in json.loads(path.read_bytes())["lsns"].items()}


def table_wal_id(mirror: CdcMirror) -> str | None:
    """The WAL id the mirror's table names (``eventplane.wal_id``), None when
    there is no table yet (a command that opens a mirror without the daemon)."""
    table = MirrorTable(mirror, wal_id="", cores=0)._table(create=False)
    if table is None:
        return None
    return dict(table.metadata().configuration).get("eventplane.wal_id")


@dataclass(frozen=True, slots=True)
class MirrorResult:
    mirror: str
    batch_id: int
    events: int  # the collection's events in the batch
    keys: int  # rows merged (one per key)
    noop: bool  # the table held the batch already, or it had no rows
    seconds: float
    cast_failures: Mapping[str, int]
    metrics: Mapping[str, Any]  # delta-rs's merge metrics


class MirrorTable:
    """One mirror's Delta table, as its stage drives it (module docstring)."""

    def __init__(self, mirror: CdcMirror, *, wal_id: str, cores: int) -> None:
        self.mirror = mirror
        self.wal_id = wal_id
        self.cores = cores
        self.app_id = app_id(wal_id, mirror.name)
        self.replay_app_id = self.app_id + REPLAY_APP
        self.path = Path(mirror.path)
        self.meta = self.path / META_DIR
        self.uri = mirror.uri or str(self.path)
        self.storage_options: dict[str, str] | None = None
        # On S3: this writer's side of the fence in the table's log.
        self.fence: Fence | None = None
        if mirror.uri:
            from daemon.table.location import S3Files

            assert mirror.s3 is not None
            files = S3Files(mirror.uri, mirror.s3)
            self.storage_options = files.storage_options
            what = f"mirror {mirror.name!r} ({mirror.uri})"
            self.fence = Fence(files, self.app_id, what, "mirror", mirror=mirror.name)
        self._lock_fd: int | None = None
        self.keeper: Any = None  # on S3: the writer's lease (daemon/table/lease.py)
        self._dt: Any = None
        self.commits_since_compaction = 0
        self.last_batch_id: int | None = None  # the table's txn version (open, commit)
        self.last_commit: dict[str, Any] | None = None
        self.last_compaction: dict[str, Any] | None = None
        self.cast_failures: dict[str, int] = {}
        self.quarantined = 0  # events a strict mirror set aside (_eventplane/quarantine/)
        # The quarantine's events a newer one of their key supersedes (LSN ->
        # its LSN), and the others' LSNs by key (what a merge may supersede).
        self._superseded: dict[int, int] = {}
        self._held: dict[str, list[int]] = {}

    @property
    def name(self) -> str:
        return self.mirror.name

    @property
    def stage(self) -> str:
        return f"mirror:{self.mirror.name}"

    # -- lifecycle ---------------------------------------------------------

    def open(self) -> None:
        """Lock the mirror, check an existing table is this mirror's, unchanged."""
        self.meta.mkdir(parents=True, exist_ok=True)
        holder = {"mirror": self.name, "wal_id": self.wal_id}
        try:
            self._lock_fd = lockfile.take(self.meta / "lock", holder)
        except lockfile.LockHeld as exc:
            raise CdcStreamLockedError(
                f"mirror {self.name!r}: {self.mirror.location} is locked by another process "
                f"(another eventplane daemon writes it): its lock {exc}; stop that one or use "
                f"another path"
            ) from None
        try:
            self._take_lease()
            table = self._table(create=False)
            if table is not None:
                self._check(table)
                if self.fence is not None:  # a takeover's first act
                    self.fence.commit(table)
                done = table.transaction_version(self.app_id)
                self.last_batch_id = None if done is None else int(done)
            else:  # made now, empty: a reader finds the table before the first row
                table = self._table(create=True)
                if self.fence is not None:
                    self.fence.check(table)  # its first version is this writer's
            self._complete_replays()
            self._set_aside_earlier_layout()
            purged = quarantine.purged_lsns(self.meta)
            if purged:  # a purge that logged its rows and stopped before removing them
                quarantine.drop(self.meta, purged)
            self._load_quarantine()
        except BaseException:
            self.close()
            raise

    def _take_lease(self) -> None:
        """A table on S3: the writer's lease, ``_eventplane/lease.json`` under
        its prefix (one writer per table, invariant 18), checked before each
        merge."""
        if not self.mirror.uri:
            return
        from daemon.table import s3
        from daemon.table.lease import Holder, Keeper, Lease, S3Store

        cfg = self.mirror.s3
        assert cfg is not None
        problem = s3.check(cfg, self.mirror.uri)
        if problem is not None:
            raise s3.S3Error(f"mirror {self.name!r}: {self.mirror.uri}: {problem}")
        where = s3.Location.parse(self.mirror.uri)
        holder = Holder.this_process(str(self.path), self.wal_id, self.stage)
        lease = Lease(
            S3Store(s3.client(cfg), where.bucket),
            where.key(f"{META_DIR}/lease.json"),
            holder,
            ttl_s=cfg.lease_ttl_s,
            skew_s=cfg.lease_skew_s,
        )
        self.keeper = Keeper(lease, f"mirror {self.name!r} ({self.mirror.uri})")
        self.keeper.start()
        assert self.fence is not None
        self.fence.keeper = self.keeper

    def close(self) -> None:
        keeper, self.keeper = self.keeper, None
        if keeper is not None:
            keeper.stop()
        self._dt = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _properties(self) -> dict[str, str]:
        return {
            "eventplane.mirror": self.name,
            "eventplane.collection": self.mirror.collection,
            "eventplane.wal_id": self.wal_id,
            "eventplane.cores": str(self.cores),
            "eventplane.buckets": str(self.mirror.buckets),
        }

    def _table(self, *, create: bool) -> Any:
        """The table, loaded once then updated; None when there is none and
        ``create`` is False."""
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        if self._dt is not None:
            return self._dt
        try:
            self._dt = DeltaTable(self.uri, storage_options=self.storage_options)
        except TableNotFoundError:
            if not create:
                return None
            self._dt = DeltaTable.create(
                self.uri,
                arrow_schema(self.mirror),
                mode="ignore",
                partition_by=["bucket"],
                configuration={**MIRROR_PROPERTIES, **self._properties()},
                storage_options=self.storage_options,
                raise_if_key_not_exists=False,
                commit_properties=self._properties_of_commit(),
            )
            log.info("mirror_table_created", mirror=self.name, path=self.mirror.location)
        return self._dt

    def _properties_of_commit(self, **options: Any) -> Any:
        """A commit's ``CommitProperties``; on S3 with this writer in
        commitInfo and no automatic retry (a commit whose version another
        took fails instead of being rebased onto it)."""
        from deltalake import CommitProperties

        if self.fence is None:
            return CommitProperties(**options)
        return self.fence.properties(max_commit_retries=0, **options)

    def _check(self, table: Any) -> None:
        """Invariant 13 and the fixed layout: another daemon's table refuses, so
        do a changed ``buckets`` and changed columns."""
        props = dict(table.metadata().configuration)
        ours = self._properties()
        where = f"mirror {self.name!r}: the Delta table at {self.mirror.location}"
        if "eventplane.mirror" not in props:
            raise IdentityMismatchError(
                f"{where} does not name an eventplane mirror (no eventplane.mirror property): "
                f"eventplane did not make it. Point the mirror's path at a new folder."
            )
        for key in ("eventplane.wal_id", "eventplane.cores", "eventplane.collection"):
            if props.get(key) != ours[key]:
                raise IdentityMismatchError(
                    f"{where} was made by another event plane or for another collection "
                    f"({key} = {props.get(key)!r}; this one: {ours[key]!r}). Point the mirror's "
                    f"path at a new folder, or move the old one away."
                )
        rebuild = (
            "a mirror's buckets, columns and history are fixed when its table is made; to "
            f"change them, rebuild the mirror: stop the daemon, run `eventplane cdc mirror "
            f"rebuild {self.name}` (on S3: point its path at a new prefix) "
            '(docs/cdc.md, "Mirror tables")'
        )
        if props.get("eventplane.buckets") != ours["eventplane.buckets"]:
            raise CdcLayoutError(
                f"{where} has {props.get('eventplane.buckets')} buckets, the config says "
                f"buckets = {self.mirror.buckets}: {rebuild}"
            )
        import pyarrow as pa

        have = pa.schema(table.schema().to_arrow())
        want = arrow_schema(self.mirror)
        shown_have = [(f.name, str(f.type)) for f in have]
        shown_want = [(f.name, str(f.type)) for f in want]
        if shown_have != shown_want:
            diff = [c for c in shown_want if c not in shown_have]
            gone = [c for c in shown_have if c not in shown_want]
            raise CdcLayoutError(
                f"{where} has other columns than the config's (the config adds or changes "
                f"{diff or 'none'}; the table has {gone or 'no others'}): {rebuild}"
            )

    # -- one batch -----------------------------------------------------------

    def done(self, batch_id: int) -> bool:
        """The table holds ``batch_id`` (commit step 0)."""
        table = self._table(create=False)
        if table is None:
            return False
        table.update_incremental()
        if self.fence is not None:
            self.fence.check(table)  # another writer's txn is not this one's
        version = table.transaction_version(self.app_id)
        return version is not None and int(version) >= batch_id

    def commit(
        self, table: Any, batch: MicroBatch, *, note: Mapping[str, Any] | None = None
    ) -> MirrorResult:
        """Merge the mirror's rows of ``batch`` (its rows as an Arrow table,
        ``daemon.spark.frame.batch_table``) exactly once (module docstring).
        ``note``: more of the commit's ``userMetadata`` (a rebuild's ``first_batch``)."""
        started = time.monotonic()
        bid = batch.batch_id
        if self.done(bid):  # Step 0.
            return MirrorResult(self.name, bid, 0, 0, True, 0.0, {}, {})
        reduced = newest_in_arrow(self.mirror, [table])  # Step 1.
        if reduced is None:
            reduced = reduce(self.mirror, table)
        if reduced.set_aside:
            self._set_aside(batch, reduced.set_aside)
        if not reduced.keys and not reduced.closes:
            return MirrorResult(self.name, bid, 0, 0, True, 0.0, {}, {})
        self._supersede(reduced)
        crash_point("mirror.before_commit")
        meta = {
            "batch_id": bid,
            "ranges": {str(c): [a, b] for c, (a, b) in sorted(batch.ranges().items())},
            "events": reduced.events,
            "keys": reduced.keys,
            **(note or {}),
        }
        metrics = self._merge(reduced, (self.app_id, bid), meta)  # Step 2.
        crash_point("mirror.after_commit")
        return self._committed(bid, reduced, metrics, started)

    def commit_many(self, tables: list[Any | None], batches: list[MicroBatch]) -> MirrorResult:
        """Merge the mirror's rows of ``batches`` (consecutive ids, each with its
        rows in ``tables``) in one commit whose ``txn`` is the last batch's id
        (``merge_interval_ms``, docs/cdc.md, "Coalesced merges"): the fold over
        all of them, the highest LSN per key (history: every version in LSN
        order). Step 0 skips the batches the table holds (a table None: the
        batch has no rows of the collection); a strict mirror's events that do
        not fit are set aside per batch, as :meth:`commit` does."""
        if len(batches) == 1 and tables[0] is not None:
            return self.commit(tables[0], batches[0])
        started = time.monotonic()
        last = batches[-1]
        bid = last.batch_id
        table = self._table(create=False)
        held = None
        if table is not None:
            if self.done(bid):  # Step 0: the whole group.
                return MirrorResult(self.name, bid, 0, 0, True, 0.0, {}, {})
            held = table.transaction_version(self.app_id)
        todo = [
            (rows, batch)
            for rows, batch in zip(tables, batches, strict=True)
            # None: none of the collection's rows; or in the table already.
            if rows is not None and (held is None or batch.batch_id > int(held))
        ]
        reduced = newest_in_arrow(self.mirror, [rows for rows, _ in todo])  # Step 1.
        if reduced is None:
            evs: list[dict[str, Any]] = []
            count = 0
            for rows, batch in todo:
                mine, set_aside, n = _events(self.mirror, rows)
                if set_aside:
                    self._set_aside(batch, set_aside)
                evs += mine
                count += n
            reduced = fold_events(self.mirror, evs, count)
        if not reduced.keys and not reduced.closes:
            return MirrorResult(self.name, bid, 0, 0, True, 0.0, {}, {})
        self._supersede(reduced)
        crash_point("mirror.before_commit")
        first = batches[0].batch_id
        meta = {
            "batch_id": bid,
            "ranges": {str(c): [a, b] for c, (a, b) in sorted(last.ranges().items())},
            "events": reduced.events,
            "keys": reduced.keys,
            "coalesced": [first, bid],
        }
        metrics = self._merge(reduced, (self.app_id, bid), meta)  # Step 2.
        crash_point("mirror.after_commit")
        return self._committed(bid, reduced, metrics, started, first=first)

    def _committed(
        self,
        bid: int,
        reduced: Reduced,
        metrics: dict[str, Any],
        started: float,
        first: int | None = None,
    ) -> MirrorResult:
        """After a merge of batch ``bid`` (of batches ``first..bid`` coalesced):
        the mirror's counters and last commit, compaction when due, the result."""
        self.last_batch_id = bid
        self.commits_since_compaction += 1
        for column, n in reduced.cast_failures.items():
            self.cast_failures[column] = self.cast_failures.get(column, 0) + n
        seconds = time.monotonic() - started
        self.last_commit = {
            "batch_id": bid,
            **({} if first is None else {"first_batch_id": first}),
            "events": reduced.events,
            "keys": reduced.keys,
            "seconds": round(seconds, 4),
            "at": time.time(),
        }
        if self.commits_since_compaction >= COMPACT_EVERY:
            self.compact()
        return MirrorResult(
            self.name,
            bid,
            reduced.events,
            reduced.keys,
            False,
            seconds,
            reduced.cast_failures,
            metrics,
        )

    def _set_aside(self, batch: MicroBatch, events: list[dict[str, Any]]) -> None:
        """A strict mirror's events that do not fit, durable before the merge
        (a re-run writes the same file again): each event is then in the table
        or in ``_eventplane/quarantine/b<batch>.json``, never both. The rows
        are a stream's quarantine rows (:mod:`daemon.table.quarantine`)."""
        bid = batch.batch_id
        # A re-run of a batch whose progress a crash lost: the events a replay
        # or a purge took out meanwhile stay out.
        out = quarantine.purged_lsns(self.meta) | replayed_lsns(self.meta)
        rows = [r for r in held_rows(self.mirror, batch, events) if r.lsn not in out]
        if not rows:
            return
        quarantine.write_batch(self.meta, self.name, bid, rows, kind="mirror")
        self._load_quarantine()
        log.warning("mirror_events_set_aside", mirror=self.name, batch_id=bid, events=len(rows))

    def _set_aside_earlier_layout(self) -> None:
        """A quarantine file of the layout before the streams' (``events``:
        no stored event, so no replay) is renamed out of the way, and said."""
        for path in sorted(quarantine.directory(self.meta).glob("b*.json")):
            raw = json.loads(path.read_bytes())
            if "rows" in raw or "events" not in raw:
                continue
            kept = path.with_name(path.name + EARLIER_LAYOUT)
            path.rename(kept)
            fsync_dir(path.parent)
            log.warning(
                "mirror_quarantine_earlier_layout",
                mirror=self.name,
                file=str(kept),
                events=len(raw["events"]),
                message="a quarantine file of an earlier eventplane holds these events without "
                "the event as stored: they cannot be replayed; it is kept, renamed",
            )

    def _load_quarantine(self) -> None:
        """The quarantine's count, its superseded events and the others' keys."""
        rows = quarantine.load(self.meta)
        lsns = {r.lsn for r in rows}
        marks = superseded_marks(self.meta)
        self._superseded = {a: b for a, b in marks.items() if a in lsns}
        self._held = {}
        for r in rows:
            if r.lsn not in self._superseded:
                self._held.setdefault(r.key, []).append(r.lsn)
        self.quarantined = len(rows)

    def _supersede(self, reduced: Reduced) -> None:
        """Before a merge: the quarantine's events of the keys it writes at a
        higher LSN are superseded, durably (``quarantine/superseded.json``).
        A replay must not write them (a delete leaves no row to compare LSNs
        with). Marked before the merge lands: the batch's events are the
        fold's whether this attempt or its re-run commits them."""
        if self._held:
            self._mark(newest_per_key(reduced))

    def _mark(self, newest: Mapping[str, int]) -> None:
        """The quarantine's events of the keys of ``newest`` below its LSN are
        superseded (:meth:`_supersede`)."""
        newest = {key: top for key, top in newest.items() if key in self._held}
        marks = {lsn: top for key, top in newest.items() for lsn in self._held[key] if lsn < top}
        if not marks:
            return
        self._superseded.update(marks)
        atomic_write_json(
            quarantine.directory(self.meta) / SUPERSEDED_FILE,
            {"mirror": self.name, "lsns": {str(a): b for a, b in sorted(self._superseded.items())}},
        )
        for key in newest:
            left = [lsn for lsn in self._held[key] if lsn not in marks]
            if left:
                self._held[key] = left
            else:
                del self._held[key]

    # -- the quarantine ----------------------------------------------------------

    def replay_quarantine(self, lsns: set[int] | None = None) -> dict[str, Any]:
        """Merge quarantined events (all, or those of ``lsns``) into the table
        as the config takes them now (a strict mirror refuses those that still
        do not fit: they stay), exactly once:

        1. Each event is checked: superseded (a newer event of its key is in
           the mirror, or was deleted from it) it is not written; in a history
           mirror that is refused (a version cannot go before the current one);
           still not fitting, it stays.
        2. Intent ``quarantine/r<replay>.json``: the LSNs leaving the
           quarantine and the replay's id (the last replay's + 1).
        3. One merge of the events, as a batch's (the table's ``lsn`` guards
           each key: a row never goes back), its ``txn`` ``<app id>/replay``
           at the replay's id (``mirror.replay_after_intent`` before it,
           ``mirror.replay_after_commit`` after it).
        4. The older events of their keys left in the quarantine are
           superseded now (:meth:`_mark`); the LSNs go to the replay log
           (which a re-run of their batch heeds), then leave the quarantine;
           the intent goes.

        Recovery (:meth:`_complete_replays`): an intent whose id the table's
        replay txn holds rolls forward (step 4), else it is removed and the
        events stay quarantined. Runs where the mirror's merges run."""
        self._complete_replays()
        held = [r for r in quarantine.load(self.meta) if lsns is None or r.lsn in lsns]
        events: list[dict[str, Any]] = []
        skipped: list[int] = []  # superseded: the fold of the log holds a newer event
        refused: list[dict[str, Any]] = []
        for row in held:
            newer = self._superseded.get(row.lsn)
            if newer is not None and self.mirror.history:
                refused.append(
                    {
                        "lsn": row.lsn,
                        "error": f"key {row.key!r} has a newer event (LSN {newer}) in the "
                        f"mirror: a history mirror cannot insert a version before its current "
                        f"one; `eventplane cdc mirror rebuild {self.name}` folds every version",
                    }
                )
            elif newer is not None:
                skipped.append(row.lsn)
            else:
                ev = event_of(row)
                error = misfit(self.mirror, ev)
                if error is None:
                    events.append(ev)
                else:
                    refused.append({"lsn": row.lsn, "error": error})
        written = [e["lsn"] for e in events]
        gone = sorted(written + skipped)
        if events:
            table = self._table(create=True)
            self._guard(table)
            replay_id = int(table.transaction_version(self.replay_app_id) or 0) + 1
            reduced = fold_events(self.mirror, events, len(events))
            newest = newest_per_key(reduced)
            intent = quarantine.replay_file(self.meta, replay_id)
            atomic_write_json(  # Step 2.
                intent,
                {"mirror": self.name, "lsns": gone, "replay_id": replay_id, "newest": newest},
            )
            crash_point("mirror.replay_after_intent")
            meta = {"replay_id": replay_id, "lsns": written, "events": len(events)}
            self._merge(reduced, (self.replay_app_id, replay_id), meta)  # Step 3.
            crash_point("mirror.replay_after_commit")
            for column, n in reduced.cast_failures.items():
                self.cast_failures[column] = self.cast_failures.get(column, 0) + n
            self._finish_replay(replay_id, gone, newest)  # Step 4.
            intent.unlink(missing_ok=True)
        elif skipped:
            self._finish_replay(0, skipped, {})
        self._load_quarantine()
        if gone:
            log.info(
                "mirror_quarantine_replayed",
                mirror=self.name,
                events=len(written),
                superseded=skipped,
            )
        return {
            "mirror": self.name,
            "replayed": len(written),
            "lsns": written,
            "superseded": skipped,
            "still_refused": refused,
            "quarantined": self.quarantined,
        }

    def _complete_replays(self) -> None:
        """Recovery of replays (step 4 or back): the table's replay txn holds theirs or not."""
        intents = quarantine.replay_intents(self.meta)
        if not intents:
            return
        table = self._table(create=False)
        done = 0 if table is None else int(table.transaction_version(self.replay_app_id) or 0)
        for replay_id, path in intents:
            raw = json.loads(path.read_bytes())
            committed = replay_id <= done
            if committed:
                self._load_quarantine()
                self._finish_replay(replay_id, [int(x) for x in raw["lsns"]], raw["newest"])
            log.warning(
                "mirror_quarantine_replay_recovered",
                mirror=self.name,
                replay_id=replay_id,
                events=len(raw["lsns"]),
                outcome="rolled forward" if committed else "rolled back",
            )
            path.unlink()

    def _finish_replay(self, replay_id: int, lsns: list[int], newest: Mapping[str, int]) -> None:
        """A replay's step 4 (its events merged): what they supersede, the
        replay log (``quarantine/replayed.jsonl``), then out."""
        self._mark({key: int(top) for key, top in newest.items()})
        append_line(
            quarantine.directory(self.meta) / REPLAY_LOG,
            {"mirror": self.name, "replay_id": replay_id, "at": time.time(), "lsns": lsns},
        )
        quarantine.drop(self.meta, lsns)

    def purge_quarantine(self, lsns: set[int] | None, by: str | None = None) -> int:
        """Remove quarantined events for good (logged with who and when: quarantine.purge)."""
        n = quarantine.purge(self.meta, self.name, lsns, by, kind="mirror")
        self._load_quarantine()
        if n:
            log.warning("mirror_quarantine_purged", mirror=self.name, events=n, by=by)
        return n

    def _merge(
        self, reduced: Reduced, txn: tuple[str, int], meta: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Commit step 2, its ``txn`` (app id, version) and ``userMetadata``'s
        ``eventplane`` (``meta``) in the commit; on S3 fenced (module docstring):

        a. The log, then the lease: every commit since this writer's last is
           its own (:meth:`_guard`); an earlier attempt's merge: done.
        b. The merge, committed with no automatic retry on S3
           (``mirror.before_merge_commit`` before it): at the version after
           the one read, or it fails and goes back to (a).
        """
        import pyarrow as pa
        from deltalake import PostCommitHookProperties, Transaction
        from deltalake.exceptions import CommitFailedError

        table = self._table(create=True)
        schema = arrow_schema(self.mirror)
        values = {name: f"s.{name}" for name in schema.names}
        touched = {r["bucket"] for r in reduced.rows + reduced.closes}
        if reduced.source is not None:
            touched.update(reduced.source["bucket"].unique().to_pylist())
        # A literal list of the target's buckets: delta-rs prunes the others.
        buckets = ", ".join(str(b) for b in sorted(touched))
        predicate = f"t.bucket IN ({buckets}) AND t.bucket = s.bucket AND t.key = s.key"
        if self.mirror.history:
            # One source row per key closes the table's current version (it is
            # the only kind that matches); one per version inserts it.
            source = pa.Table.from_pylist(
                [{**r, "_kind": "open"} for r in reduced.rows]
                + [
                    {**r, "lsn": r["valid_to_lsn"], "op": "close", "_kind": "close"}
                    for r in reduced.closes
                ],
                schema=_nullable(schema).append(pa.field("_kind", pa.string())),
            )
            predicate += " AND s._kind = 'close' AND t.is_current"
        elif reduced.source is not None:
            source = reduced.source
        else:
            source = pa.Table.from_pylist(reduced.rows, schema=schema)
        app, version = txn
        user = json.dumps({"eventplane": dict(meta)}, separators=(",", ":"))
        for attempt in range(1, COMMIT_ATTEMPTS + 1):
            # Step a. The log and the lease.
            self._guard(table)
            before = int(table.version())
            if attempt > 1 and int(table.transaction_version(app) or 0) >= version:
                return {}  # the last attempt's commit landed, its answer did not
            crash_point("mirror.before_merge_commit")
            # Step b. The merge and its commit.
            properties = self._properties_of_commit(
                custom_metadata={"userMetadata": user},
                app_transactions=[Transaction(app, version, int(time.time() * 1000))],
            )
            try:
                merger = table.merge(
                    source,
                    predicate,
                    source_alias="s",
                    target_alias="t",
                    commit_properties=properties,
                    post_commithook_properties=PostCommitHookProperties(cleanup_expired_logs=False),
                )
                if self.mirror.history:
                    close = {
                        "valid_to_lsn": "s.valid_to_lsn",
                        "valid_to": "s.valid_to",
                        "is_current": "false",
                    }
                    merger = merger.when_matched_update(
                        close, predicate="t.valid_from_lsn < s.valid_to_lsn"
                    ).when_not_matched_insert(values, predicate="s._kind = 'open'")
                else:
                    merger = (
                        merger.when_matched_delete(predicate="s.op = 'delete' AND t.lsn < s.lsn")
                        .when_matched_update(values, predicate="s.op <> 'delete' AND t.lsn < s.lsn")
                        .when_not_matched_insert(values, predicate="s.op <> 'delete'")
                    )
                metrics: dict[str, Any] = merger.execute()
            except CommitFailedError as exc:
                if self.fence is None or attempt == COMMIT_ATTEMPTS:
                    raise
                # Another commit took the version: (a) says whose.
                log.info("mirror_commit_conflict", mirror=self.name, error=str(exc))
                continue
            table.update_incremental()
            self._sync(before, int(table.version()))
            return metrics
        raise AssertionError("unreachable")

    def _guard(self, table: Any) -> None:
        """Before a commit: ``table`` updated; on S3 the log checked (every
        commit since this writer's last is its own, else the mirror stops for
        good and says who took it: :meth:`daemon.table.fence.Fence.check`),
        then the lease."""
        table.update_incremental()
        if self.fence is not None:
            self.fence.check(table)
        if self.keeper is not None:
            self.keeper.check()

    def _sync(self, before: int, after: int) -> None:
        """fsync the data files and log entries of versions ``before+1..after``
        (delta-rs does not): the stage's progress that follows never names a
        commit a power loss could take back. Nothing to do on S3."""
        if self.mirror.uri or after <= before:
            return
        log_dir = self.path / LOG_DIR
        folders: set[Path] = set()
        for version in range(before + 1, after + 1):
            entry = log_dir / f"{version:020d}.json"
            for line in entry.read_text().splitlines():
                add = json.loads(line).get("add") if line.strip() else None
                if add is not None:
                    from urllib.parse import unquote

                    file = self.path / unquote(add["path"])
                    fsync_file(file)
                    folders.add(file.parent)
            fsync_file(entry)
        for folder in folders:
            fsync_dir(folder)
        fsync_dir(log_dir)

    # -- maintenance -----------------------------------------------------------

    def compact(self) -> dict[str, Any]:
        """OPTIMIZE (bin-packing each bucket's files), then VACUUM of the files
        no snapshot of the last ``VACUUM_RETAIN_HOURS`` reads; in the commit's
        thread, so never beside a merge. On S3 each is fenced as a merge is
        (:meth:`_guard`, no automatic retry): one whose version another
        writer's commit took stops the mirror; its own cannot (one thread)."""
        started = time.monotonic()
        table = self._table(create=False)
        if table is None:
            return {}
        from deltalake.exceptions import CommitFailedError

        try:
            self._guard(table)
            metrics = table.optimize.compact(
                max_concurrent_tasks=1, commit_properties=self._properties_of_commit()
            )
            self._guard(table)
            table.vacuum(
                retention_hours=VACUUM_RETAIN_HOURS,
                dry_run=False,
                enforce_retention_duration=False,
                commit_properties=self._properties_of_commit(),
            )
        except CommitFailedError:
            if self.fence is not None:  # another writer's commit stops the mirror here
                table.update_incremental()
                self.fence.check(table)
            raise
        table.cleanup_metadata()
        table.update_incremental()
        self.commits_since_compaction = 0
        self.last_compaction = {
            "at": time.time(),
            "seconds": round(time.monotonic() - started, 3),
            "files_removed": int(metrics.get("numFilesRemoved", 0)),
            "files_added": int(metrics.get("numFilesAdded", 0)),
        }
        log.info("mirror_compacted", mirror=self.name, **self.last_compaction)
        return self.last_compaction

    def status(self) -> dict[str, Any]:
        return {
            "path": self.mirror.location,
            "collection": self.mirror.collection,
            "buckets": self.mirror.buckets,
            "strict": self.mirror.strict,
            "history": self.mirror.history,
            "last_batch_id": self.last_batch_id,
            "last_commit": self.last_commit,
            "last_compaction": self.last_compaction,
            "cast_failures": dict(self.cast_failures),
            "quarantined": self.quarantined,
            **({"lease": self.keeper.status()} if self.keeper is not None else {}),
        }
