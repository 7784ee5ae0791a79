"""Batch -> Arrow -> DataFrame: steps 1-2 of :mod:`daemon.spark.executor`.

Pure functions; the executor, the benchmarks and the tests use them. A
batch's slices become Arrow record batches a chunk at a time
(``batch_table``, ``write_batch_file``), and the batch DataFrame
(``FRAME_COLUMNS``, ``new``/``old`` parsed to VARIANT) reads them either from
an uncompressed Parquet file in the inbox (local masters) or from the Arrow
table itself (``batch_dataframe``, ``batch_frame``). pyspark and pyarrow are
imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from daemon.config import MicrobatchConfig
from daemon.events import StoredEvent
from daemon.plane.batch import MicroBatch
from daemon.plane.parts import Rows
from daemon.spark import rawinbox
from daemon.table.layout import CDC_COLUMNS, INBOX_SCHEMA, JSON_COLUMNS
from daemon.table.sparkio import SelectList
from wal.reader import RecordBatch
from wal.record import Record

# Columns of the batch DataFrame: the CDC contract plus what triggers need.
EXTRA_COLUMNS = ("depth", "source")
BATCH_COLUMNS = (*CDC_COLUMNS, *EXTRA_COLUMNS)
# The DataFrame ``batch_frame`` returns also carries the payloads' JSON text
# (the input file's columns, no extra work), which only CDC tables write;
# stages get ``BATCH_COLUMNS``, handlers ``CDC_COLUMNS``.
FRAME_COLUMNS = (*BATCH_COLUMNS, *JSON_COLUMNS)

# A msgpack array header (0xdd + uint32 count) in front of the concatenated
# payloads turns a slice into one msgpack document: one C-level decode per
# slice instead of one Python call per event.
_events_decoder = msgspec.msgpack.Decoder(list[StoredEvent])
# Inbox file names never repeat within a process: a retried batch gets a new
# file, so no reader-side cache can serve the previous attempt's bytes.
_inbox_seq = itertools.count(1)
# Below this many rows a batch stays one task: a Spark task costs ~10 ms to
# schedule, about what parsing 5k rows to VARIANT takes.
_MIN_ROW_GROUP = 5_000
# Most rows held as Arrow before a row group of the inbox file is written
# (fewer when ``microbatch.build_max_bytes`` says so).
_MAX_ROW_GROUP = 131_072
# Arrow bytes of an inbox row beyond its payload's length: five fixed-width
# columns (32 B) and six string offsets (24 B), plus event_time (8 B) and
# event_id's offset (4 B); the strings are at most the payload (measured: 171
# Arrow bytes per 133-byte payload before event_id/event_time).
_ROW_FIXED_BYTES = 68
# ``microbatch.build_max_bytes``'s default, for callers without a config.
BUILD_MAX_BYTES = MicrobatchConfig().build_max_bytes
# Rows decoded into Python objects at a time while building a batch's table.
TABLE_CHUNK_ROWS = 16_384
# How the inbox file is written: uncompressed (it lives for one job, in the page
# cache), and dictionary-encoded only where values repeat. With plain payload
# and key columns pyarrow wrote 200k rows in 256 ns/row instead of 397, and
# Spark's job over a 1M-row file cost 7-13 % less JVM CPU.
INBOX_WRITE_OPTIONS: dict[str, Any] = {
    "compression": "none",
    "use_dictionary": ["collection", "op", "source"],
}


def batch_table(batch: MicroBatch) -> Any:
    """The batch's rows as one Arrow table, slices in core order, LSN order within.

    Rows are read ``TABLE_CHUNK_ROWS`` at a time, the delivered parts joined
    into whole chunks, each chunk a field at a time for all its events
    (:mod:`daemon.spark.unpack`; one Python object per event only for a chunk
    that reader refuses). The table itself (about 1.2x the payload bytes) is
    what the batch holds.
    """
    import pyarrow as pa

    bid = batch.batch_id
    chunks = [
        _record_batch(*chunk, bid)
        for c in sorted(batch.slices)
        for chunk in _chunks(batch.slices[c].records, TABLE_CHUNK_ROWS)
    ]
    return pa.Table.from_batches(chunks or [_record_batch((), (), (), b"", None, bid)])


# ``(lsns, cores, seqs, concatenated payloads, each payload's start in them)``:
# sequences of ints or numpy arrays (pa.array takes either), and a numpy array.
_Chunk = tuple[Any, Any, Any, bytes, Any]


def _parts(records: Sequence[Record]) -> Sequence[Sequence[Record] | RecordBatch]:
    """A slice's rows as the planner delivered them: ``Rows`` parts, or one list."""
    return records.parts() if isinstance(records, Rows) else [records]


def _chunks(records: Sequence[Record], size: int) -> Iterator[_Chunk]:
    """The rows in chunks of ``size`` (the last may be smaller), parts joined.

    Consumers deliver a slice in many small parts (a ring run each: tens of
    rows at 20k events/s), and the cost of a chunk is mostly per chunk, not
    per row: parts are cut and joined into whole chunks first.
    """
    pieces: list[tuple[Any, ...]] = []  # lsns, cores, seqs, lengths, data
    held = 0
    for part in _parts(records):
        n = len(part)
        i = 0
        while i < n:
            j = min(n, i + size - held)
            pieces.append(_piece(part, i, j))
            held += j - i
            i = j
            if held == size:
                yield _joined(pieces)
                pieces, held = [], 0
    if pieces:
        yield _joined(pieces)


def _piece(part: Sequence[Record] | RecordBatch, i: int, j: int) -> tuple[Any, ...]:
    """Rows ``i:j`` of one part as ``(lsns, cores, seqs, lengths, payload bytes)``."""
    import numpy as np

    if isinstance(part, RecordBatch):
        offs = np.frombuffer(part.offsets, np.uint64)[i : j + 1].astype(np.int64)
        lsns = np.frombuffer(part.lsns, np.uint64)[i:j].astype(np.int64)
        first = part.first_seq + i
        data = memoryview(part.data)[int(offs[0]) : int(offs[-1])]
        cores = np.full(j - i, part.core, np.int32)
        return lsns, cores, np.arange(first, first + j - i, dtype=np.int64), np.diff(offs), data
    lsn_col, core_col, seq_col, payloads = zip(*part[i:j], strict=True)
    return (
        np.array(lsn_col, np.int64),
        np.array(core_col, np.int32),
        np.array(seq_col, np.int64),
        np.fromiter(map(len, payloads), np.int64, j - i),
        b"".join(payloads),
    )


def _joined(pieces: list[tuple[Any, ...]]) -> _Chunk:
    import numpy as np

    lsns, cores, seqs, lengths, data = zip(*pieces, strict=True)
    lengths_all = np.concatenate(lengths)
    starts = np.zeros(len(lengths_all), np.int64)
    np.cumsum(lengths_all[:-1], out=starts[1:])
    return (
        np.concatenate(lsns),
        np.concatenate(cores),
        np.concatenate(seqs),
        b"".join(data),
        starts,
    )


def _record_batch(
    lsns: Sequence[int],
    cores: Sequence[int],
    seqs: Sequence[int],
    payloads: bytes,
    starts: Any,
    batch_id: int,
) -> Any:
    """One chunk (``_Chunk``) as an Arrow record batch; ``starts`` None takes
    the general path."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from daemon.spark.unpack import stored_columns  # numpy: imported with the first batch

    fields = None if starts is None else stored_columns(payloads, starts)
    if fields is None:
        fields = _decoded_columns(len(lsns), payloads)
    n = len(lsns)
    return pa.record_batch(
        {
            "lsn": pa.array(lsns, pa.int64()),
            "core": pa.array(cores, pa.int32()),
            "seq": pa.array(seqs, pa.int64()),
            "collection": fields["collection"],
            "op": fields["op"],
            "key": fields["key"],
            "new_json": fields["new"],
            "old_json": fields["old"],
            "ingest_ts": pc.divide(fields["ingest_ts_ns"], 1000).cast(pa.timestamp("us", tz="UTC")),
            # A column, not a literal in the plan: Spark inlines literals into
            # the Java it generates, so a new id per batch meant compiling the
            # job's code again each batch (20-40 ms; the same plan is cached).
            "batch_id": pa.repeat(pa.scalar(batch_id, pa.int64()), n),
            "event_id": fields["event_id"],
            "event_time": fields["event_time_us"].cast(pa.timestamp("us", tz="UTC")),
            "depth": fields["depth"],
            "source": fields["source"],
            "producer": fields["producer"],
        }
    )


def _decoded_columns(n: int, payloads: bytes) -> dict[str, Any]:
    """``unpack.stored_columns``'s columns through one Python object per event:
    the general path, for any payload msgspec reads (it raises on a bad one)."""
    import pyarrow as pa

    # The payloads are msgpack StoredEvents back to back: prefix an array
    # header and decode them in one call.
    header = b"\xdd" + n.to_bytes(4, "big")
    events = _events_decoder.decode(header + payloads)
    return {
        "collection": pa.array([e.collection for e in events], pa.string()),
        "op": pa.array([e.op for e in events], pa.string()),
        "key": pa.array([e.key for e in events], pa.string()),
        # Binary then one C-level UTF-8 check: 5x faster than str conversion.
        "new": pa.array([e.new for e in events], pa.binary()).cast(pa.string()),
        "old": pa.array([e.old for e in events], pa.binary()).cast(pa.string()),
        "ingest_ts_ns": pa.array([e.ingest_ts_ns for e in events], pa.int64()),
        "event_id": pa.array([e.event_id for e in events], pa.string()),
        "event_time_us": pa.array([e.event_time_us for e in events], pa.int64()),
        "depth": pa.array([e.depth for e in events], pa.int32()),
        "source": pa.array([e.source for e in events], pa.string()),
        "producer": pa.array([e.producer for e in events], pa.string()),
    }


def collection_counts(table: Any) -> dict[str, int]:
    import pyarrow.compute as pc

    counts = pc.value_counts(table["collection"])
    return {str(v): int(n) for v, n in zip(*counts.flatten(), strict=True)} if len(counts) else {}


def batch_dataframe(
    spark: Any, table: Any, batch_id: int, inbox: Path | None = None, parallelism: int = 1
) -> Any:
    """Arrow table -> the batch DataFrame (``FRAME_COLUMNS``, new/old as VARIANT).

    With ``inbox`` (a folder the Spark executors can read: local masters), the
    table goes to Spark as an uncompressed Parquet file written by pyarrow's C++
    writer; Spark's vectorized reader takes it from there. Measured here at
    100k rows, that is ~3x faster than ``createDataFrame(table)``, which ships
    the Arrow bytes inside task closures and converts them row by row. Without
    an inbox (Spark Connect, remote clusters) the table travels in the call.
    The file's row groups come in whole waves of ``parallelism``
    (``row_group_rows``): Spark splits Parquet input by row group, so every
    core reads, parses and writes its share. The caller removes the file once
    every consumer is done.
    """
    if inbox is not None:
        import pyarrow.parquet as pq

        file = _inbox_file(inbox, batch_id)
        rows_per_group = row_group_rows(table.num_rows, parallelism)
        pq.write_table(table, file, row_group_size=rows_per_group, **INBOX_WRITE_OPTIONS)
        raw = _read_inbox(spark, file)
    else:
        raw = spark.createDataFrame(table)
    return _contract_frame(raw)


@dataclass(frozen=True, slots=True)
class InboxFile:
    """A batch's rows written for Spark: a Parquet file, or a raw one (``splits``)."""

    path: Path
    rows: int
    # Rows per collection; None when not counted (the raw inbox counts only
    # when a CDC stream takes some collections, not all).
    counts: dict[str, int] | None
    splits: str | None = None  # the raw inbox's splits; None for Parquet


def write_inbox(
    batch: MicroBatch,
    inbox: Path,
    parallelism: int,
    max_bytes: int = BUILD_MAX_BYTES,
    raw: bool = False,
    count_collections: bool = True,
) -> InboxFile:
    """Write ``batch``'s rows into ``inbox``: raw (``daemon.spark.rawinbox``)
    when ``raw``, else as Parquet (``write_batch_file``)."""
    if raw:
        path = _inbox_file(inbox, batch.batch_id, rawinbox.SUFFIX)
        return write_raw_file(batch, path, parallelism, count_collections)
    path = _inbox_file(inbox, batch.batch_id)
    rows, counts = write_batch_file(batch, path, parallelism, max_bytes)
    return InboxFile(path, rows, counts)


def read_inbox(
    spark: Any,
    file: InboxFile,
    batch_id: int,
    collections: Sequence[str] = (),
    skip: Sequence[int] = (),
) -> Any:
    """The batch DataFrame (``FRAME_COLUMNS``) over an inbox file. A raw
    inbox's reader parses the payloads of ``collections``' rows only (empty:
    all) but those of the LSNs in ``skip``; the other rows' ``new`` and
    ``old`` are NULL, for the caller's filter to drop."""
    if file.splits is None:
        return _contract_frame(_read_inbox(spark, file.path))
    raw = rawinbox.read(spark, file.path, file.splits, batch_id, collections, skip)
    return _contract_frame(raw, parsed=True)


def batch_frame(
    spark: Any,
    batch: MicroBatch,
    inbox: Path | None,
    parallelism: int,
    max_bytes: int = BUILD_MAX_BYTES,
    count_collections: bool = True,
) -> tuple[Any, dict[str, int] | None]:
    """Steps 1-2 for the executor: ``(DataFrame, rows per collection)``.

    With an inbox the rows go to a file: raw when the session can read one
    (``rawinbox.missing``), else Parquet, streamed a chunk at a time, so the
    batch never exists as one Arrow table in this process; without an inbox,
    the table is built and handed over.
    """
    if inbox is None:
        table = batch_table(batch)
        return batch_dataframe(spark, table, batch.batch_id), collection_counts(table)
    raw = rawinbox.missing(spark) is None
    file = write_inbox(batch, inbox, parallelism, max_bytes, raw, count_collections)
    return read_inbox(spark, file, batch.batch_id), file.counts


def write_raw_file(
    batch: MicroBatch, path: Path, parallelism: int, count_collections: bool = True
) -> InboxFile:
    """Write the batch's payloads as they are to a raw inbox file (module
    ``daemon.spark.rawinbox``), in chunks of at most ``rawinbox.CHUNK_ROWS``
    events and, by the batch's mean event size, about ``rawinbox.CHUNK_BYTES``.

    The file has one split (one Spark task) per core, of equal rows, but at
    least ``_MIN_ROW_GROUP`` rows each. A task holds one chunk at a time, so a
    split can be as large as it likes; and each task writes a file per table
    partition, so more tasks than cores only mean more, smaller files: with
    two splits per core a batch cost 26 % more JVM CPU per row (Parquet's
    dictionaries, pages and footers per file; docs/performance.md, "Batches
    without a Spark job").
    """
    total = batch.rows
    row_bytes = -(-payload_bytes(batch) // max(1, total)) + _ROW_FIXED_BYTES
    chunk_rows = max(1, min(rawinbox.CHUNK_ROWS, rawinbox.CHUNK_BYTES // row_bytes))

    def chunks() -> Iterator[tuple[int, Any, Any, bytes, Any]]:
        for c in sorted(batch.slices):
            for lsns, _cores, seqs, data, starts in _chunks(batch.slices[c].records, chunk_rows):
                yield c, lsns, seqs, data, starts

    groups = max(1, min(parallelism, total // _MIN_ROW_GROUP))
    rows, counts, splits = rawinbox.write(path, chunks(), total, groups, count_collections)
    return InboxFile(path, rows, counts, splits)


def write_batch_file(
    batch: MicroBatch, path: Path, parallelism: int, max_bytes: int = BUILD_MAX_BYTES
) -> tuple[int, dict[str, int]]:
    """Write the batch's rows (``batch_table`` layout) to an uncompressed Parquet
    file, ``TABLE_CHUNK_ROWS`` at a time; returns ``(rows, rows per collection)``.

    Spark splits Parquet input by row group: a batch gets about
    ``parallelism`` row groups, so every core gets a share, but at least
    ``_MIN_ROW_GROUP`` rows each (a small batch stays one task) and at most
    ``_MAX_ROW_GROUP`` (what this process holds before writing) or, by the
    batch's mean event size, about ``max_bytes`` of Arrow data. The Arrow
    pool's freed memory goes back to the OS at the end, so between batches
    this holds nothing.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    total = batch.rows
    row_bytes = -(-payload_bytes(batch) // max(1, total)) + _ROW_FIXED_BYTES
    group_rows = row_group_rows(total, parallelism, max_bytes // row_bytes)
    counts: dict[str, int] = {}
    rows = 0
    writer: Any = None
    pending: list[Any] = []  # record batches not yet written: one row group's worth
    pending_rows = 0
    try:
        for c in sorted(batch.slices):
            for chunk in _chunks(batch.slices[c].records, min(TABLE_CHUNK_ROWS, group_rows)):
                rb = _record_batch(*chunk, batch.batch_id)
                for name, n in collection_counts(rb).items():
                    counts[name] = counts.get(name, 0) + n
                rows += rb.num_rows
                if writer is None:
                    writer = pq.ParquetWriter(path, rb.schema, **INBOX_WRITE_OPTIONS)
                pending.append(rb)
                pending_rows += rb.num_rows
                if pending_rows >= group_rows:
                    # Whole row groups out; the rest (a zero-copy slice) waits.
                    table = pa.Table.from_batches(pending)
                    full = pending_rows - pending_rows % group_rows
                    writer.write_table(table.slice(0, full), row_group_size=group_rows)
                    rest = table.slice(full)
                    pending, pending_rows = rest.to_batches(), rest.num_rows
        if writer is None:  # no rows: a file with the schema and no row group
            schema = _record_batch((), (), (), b"", None, batch.batch_id).schema
            writer = pq.ParquetWriter(path, schema, **INBOX_WRITE_OPTIONS)
        if pending_rows:
            writer.write_table(pa.Table.from_batches(pending))
    finally:
        if writer is not None:
            writer.close()
        # Arrow's mimalloc keeps freed pages for reuse: 34-37 MiB were still
        # resident after a 1.9M-row batch (live peak 38 MiB); 3 MiB after this
        # call, which takes ~0.2 ms.
        pa.default_memory_pool().release_unused()
    return rows, counts


def payload_bytes(batch: MicroBatch) -> int:
    """Payload bytes of all the batch's rows (parts are summed, not iterated)."""
    n = 0
    for s in batch.slices.values():
        for part in _parts(s.records):
            if isinstance(part, RecordBatch):
                n += len(part.data)
            else:
                n += sum(len(r.payload) for r in part)
    return n


def _read_inbox(spark: Any, file: Path) -> Any:
    return spark.read.schema(INBOX_SCHEMA).parquet(str(file))


def row_group_rows(total: int, parallelism: int, max_rows: int = _MAX_ROW_GROUP) -> int:
    """Rows per row group (= per Spark task) for a batch of ``total`` rows.

    The group count is a multiple of ``parallelism`` and the groups are equal,
    so every wave of tasks keeps every core busy: 300k rows on 2 cores as
    131k + 131k + 38k left one core idle for the whole last wave; as 4 x 75k
    both cores finish together. Groups stay within ``max_rows`` (capped at
    ``_MAX_ROW_GROUP``: what this process holds before writing) and, but for
    a small batch that stays one task, at least ``_MIN_ROW_GROUP`` (or
    ``max_rows``, if that is less: large events).
    """
    most = max(1, min(_MAX_ROW_GROUP, max_rows))
    cores = max(1, parallelism)
    groups = -(-total // most)  # fewest groups within the maximum
    groups = max(cores, -(-groups // cores) * cores)  # whole waves
    return max(min(_MIN_ROW_GROUP, most), -(-total // groups))


def _inbox_file(inbox: Path, batch_id: int, suffix: str = ".parquet") -> Path:
    return inbox / f"b{batch_id:012d}-{next(_inbox_seq)}{suffix}"


def _contract_frame(raw: Any, parsed: bool = False) -> Any:
    """The batch DataFrame (``FRAME_COLUMNS``) over ``batch_table``-shaped rows;
    ``parsed``: they have ``new``/``old`` as VARIANT already (the raw inbox's
    reader parsed them), else ``parse_json`` makes them from the JSON text."""
    return _contract_columns(raw.sparkSession, parsed).select(raw)


# Per kind (parsed or not): the session and its select list.
_contract_cache: dict[bool, tuple[Any, SelectList]] = {}


def _contract_columns(spark: Any, parsed: bool) -> SelectList:
    """The contract's select list, built once per session: Columns are
    unresolved expressions, and building them, or a Java list of them, is a
    py4j call each."""
    cached = _contract_cache.get(parsed)
    if cached is None or cached[0] is not spark:
        from pyspark.sql import functions as F

        made = {} if parsed else {"new": F.parse_json("new_json"), "old": F.parse_json("old_json")}
        cols = [made[c].alias(c) if c in made else F.col(c) for c in FRAME_COLUMNS]
        cached = _contract_cache[parsed] = (spark, SelectList.build(spark, cols))
    return cached[1]
