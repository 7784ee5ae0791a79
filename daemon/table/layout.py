"""A CDC table's columns, writer options and file names, and its committed files.

Published data files are named for the batch that wrote them
(``part-b<batch>-...``) or the compaction that merged them
(``part-c<id>-b<first>-b<last>-...``); recovery, compaction and readers of
the ledger recognise files by these names.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any

META_DIR = "_eventplane"
_PUBLISHED = re.compile(r"^part-b(\d{12})-")
# A compaction's merged file: compaction id, first and last batch it holds.
_COMPACTED = re.compile(r"^part-c(\d{12})-b(\d{12})-b(\d{12})-")
# Contract columns of a CDC table (README, "CDC tables"), in order.
CDC_COLUMNS = (
    "lsn",
    "core",
    "seq",
    "collection",
    "op",
    "key",
    "new",
    "old",
    "ingest_ts",
    "batch_id",
    "event_id",
    "event_time",
    "producer",
)
# The payloads' JSON text, written next to ``new``/``old`` (VARIANT) in every
# file. pyarrow, pandas and Polars cannot decode VARIANT; they (and DuckDB)
# query this text with their own JSON functions (docs/cdc.md, "Reading a table").
JSON_COLUMNS = ("new_json", "old_json")
# Columns of a CDC table's files, in order (``collection`` is the partition).
TABLE_COLUMNS = (*CDC_COLUMNS, *JSON_COLUMNS)
# Parquet writer options of the CDC write. ``lsn`` and ``seq`` are unique by
# construction and ``key`` nearly so within a batch: Parquet would build a
# dictionary for them alongside the plain values, then drop it at the first
# page. Ten 100k-row batches measured 18-20 % less JVM CPU without those
# dictionaries, and the same bytes on disk (docs/cdc.md, "Tuning the write").
# A producer's ``event_id`` is meant to be unique too.
PARQUET_OPTIONS = {
    "parquet.enable.dictionary#lsn": "false",
    "parquet.enable.dictionary#seq": "false",
    "parquet.enable.dictionary#key": "false",
    "parquet.enable.dictionary#event_id": "false",
    # The payloads' text is nearly as unique: 200k events wrote with 13-16 %
    # less JVM CPU without its dictionary, in the same bytes (docs/cdc.md,
    # "Payload layout"; 15 % more only where payloads repeat a lot).
    "parquet.enable.dictionary#new_json": "false",
    "parquet.enable.dictionary#old_json": "false",
}
# What a batch's write skips on top, in a stream that compacts: its files live
# only until a compaction merges them, which writes with ``PARQUET_OPTIONS``
# (the files that stay). So the batch write drops what pays off only in files
# that stay:
# - the dictionary of the VARIANT values. It saves bytes where payloads repeat
#   (18 % of the bench's, whose 1M events hold 35k distinct documents) and
#   nothing where they do not;
# - min/max statistics of the payload columns, which no query prunes by.
# 300k-event batches took 24 % less JVM CPU with both (1.42 against 1.87 CPU s,
# medians of 6 rounds in one session; docs/cdc.md, "Tuning the write").
# A stream without compaction keeps its batch files: they get PARQUET_OPTIONS.
_PAYLOAD_LEAVES = ("new.value", "new.metadata", "old.value", "old.metadata", *JSON_COLUMNS)
TRANSIENT_PARQUET_OPTIONS = {
    **PARQUET_OPTIONS,
    "parquet.enable.dictionary#new.value": "false",
    "parquet.enable.dictionary#old.value": "false",
    **{f"parquet.column.statistics.enabled#{leaf}": "false" for leaf in _PAYLOAD_LEAVES},
}
# The inbox file's columns as Spark reads them (``_record_batch``'s schema).
# Given up front, Spark plans the read without opening the file's footer on
# the driver: measured 0.1-0.4 s per batch here, time in which no task runs.
INBOX_SCHEMA = (
    "lsn BIGINT, core INT, seq BIGINT, collection STRING, op STRING, key STRING,"
    " new_json STRING, old_json STRING, ingest_ts TIMESTAMP, batch_id BIGINT,"
    " event_id STRING, event_time TIMESTAMP, depth INT, source STRING, producer STRING"
)
# The table's schema for readers that infer it: Spark (without ``mergeSchema``)
# reads this file's footer first and only falls back to one data file's.
SUMMARY_FILE = "_common_metadata"
# Footer key under which Spark records the schema it wrote (and reads back).
SPARK_SCHEMA_KEY = b"org.apache.spark.sql.parquet.row.metadata"


def time_columns(partition_by: tuple[str, ...]) -> list[tuple[str, Any]]:
    """The time partition columns of ``partition_by``, as ``(name, Column)``:
    ``date``, the UTC day of ``ingest_ts`` as ``yyyy-MM-dd``, and ``hour``,
    ``00``..``23``. Computed from epoch seconds, so Spark's session time zone
    does not matter."""
    if "date" not in partition_by and "hour" not in partition_by:
        return []
    from pyspark.sql import functions as F

    secs = F.unix_seconds(F.col("ingest_ts"))
    out = []
    if "date" in partition_by:
        day = F.floor(secs / 86_400).cast("int")
        out.append(("date", F.date_add(F.lit("1970-01-01").cast("date"), day).cast("string")))
    if "hour" in partition_by:
        hour = F.pmod(F.floor(secs / 3_600), F.lit(24)).cast("string")
        out.append(("hour", F.lpad(hour, 2, "0")))
    return out


def _published(path: Path) -> list[tuple[int, Path]]:
    """(batch_id, file) of every ``part-b<id>-*`` file in the table's visible
    partition folders, at any depth (``collection=x/date=d/hour=h``). Folders
    whose names start with ``_`` or ``.`` are not read by readers and skipped
    (``_eventplane``, a partition being expired)."""
    out: list[tuple[int, Path]] = []
    for root, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
        if root == str(path):
            continue  # files at the root are not data
        for n in names:
            m = _PUBLISHED.match(n)
            if m:
                out.append((int(m.group(1)), Path(root) / n))
    return out


def file_batch(name: str) -> int | None:
    """The newest batch a published or compacted data file holds, from its name."""
    m = _PUBLISHED.match(name)
    if m:
        return int(m.group(1))
    m = _COMPACTED.match(name)
    return int(m.group(3)) if m else None


def committed_files(path: Path) -> list[tuple[int, Path]]:
    """(batch_id, file) for every published file of a stream, newest batch first.

    A compacted file counts as its newest batch: every row of a batch B is in a
    file whose key is >= B, so the files keyed >= B hold all of B's rows.
    """
    out: list[tuple[int, Path]] = []
    with contextlib.suppress(FileNotFoundError):
        for root, dirs, names in os.walk(path):
            dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
            if root == str(path):
                continue  # files at the root are not data
            for n in names:
                b = file_batch(n)
                if b is not None:
                    out.append((b, Path(root) / n))
    out.sort(key=lambda t: (-t[0], str(t[1])))
    return out
