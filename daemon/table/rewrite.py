"""Rewrite a CDC table's files of the previous payload layout into the current one.

Until 2026-11-25 the daemon wrote Spark 4.3's default layout: ``new``/``old``
shredded per file (each file its own struct for them) and annotated as
Parquet VARIANT, without the ``new_json``/``old_json`` columns. Spark reads a
table mixing those files with current ones; pyarrow (so pandas) and Polars do
not (docs/cdc.md, "Payload layout"). ``rewrite_previous_layout`` turns every
such file into the current layout under its own name:

1. one Spark job per partition folder reads its files, adds
   ``new_json``/``old_json`` as ``to_json(new)``/``to_json(old)`` (and, null,
   any column added since, such as ``event_id``/``event_time``), and writes
   each source file's rows into one file of its own under
   ``_eventplane/staging/rewrite-<pid>/`` (where no reader looks, and which
   the next ``CdcSink.open`` deletes if this dies);
2. each new file is checked to hold the source's row count, fsynced, and
   renamed over its source (``os.replace``: atomic), then the folder fsynced.

A reader sees each file either before or after its rename, with the same
rows, so the table stays exactly-once at every step; a rerun picks up the
files not yet done. The caller holds the stream's lock (``CdcSink.open``), so
no batch is committed meanwhile. The ledger is unchanged: names stay.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from daemon.table.durable import fsync_dir, fsync_file
from daemon.table.errors import CdcError
from daemon.table.layout import (
    INBOX_SCHEMA,
    JSON_COLUMNS,
    PARQUET_OPTIONS,
    TABLE_COLUMNS,
    committed_files,
)
from daemon.table.parquet import CdcSink

_SOURCE = "_file"
# Spark types of the table's columns but new/old (the batch input file's).
_TYPES = dict(col.strip().split(" ", 1) for col in INBOX_SCHEMA.split(","))


@dataclass(frozen=True, slots=True)
class RewriteResult:
    files: int
    rows: int
    seconds: float


def previous_layout_files(path: Path, last_batch_id: int) -> list[Path]:
    """Committed files of the table without the JSON columns, oldest batch first."""
    import pyarrow.parquet as pq

    out = []
    for batch_id, f in reversed(committed_files(path)):
        if batch_id <= last_batch_id and JSON_COLUMNS[0] not in pq.read_schema(f).names:
            out.append(f)
    return out


def rewrite_previous_layout(spark: Any, sink: CdcSink) -> RewriteResult:
    """Rewrite the open ``sink``'s previous-layout files in place (module doc)."""
    started = time.monotonic()
    files = previous_layout_files(sink.path, sink.last_batch_id)
    by_folder: dict[Path, list[Path]] = {}
    for f in files:
        by_folder.setdefault(f.parent, []).append(f)
    staging = sink.meta / "staging" / f"rewrite-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    rows = 0
    try:
        # One job per partition folder: names are unique within a folder (Spark
        # gives one task's files in every partition the same name).
        for i, folder in enumerate(sorted(by_folder)):
            rows += _rewrite_folder(spark, sink, by_folder[folder], staging / str(i))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return RewriteResult(len(files), rows, time.monotonic() - started)


def _rewrite_folder(spark: Any, sink: CdcSink, files: list[Path], staging: Path) -> int:
    import pyarrow.parquet as pq
    from pyspark.sql import functions as F

    by_name = {f.name: f for f in files}
    df = spark.read.parquet(*map(str, files))
    cols = [
        F.to_json(c.removesuffix("_json")).alias(c)
        if c in JSON_COLUMNS
        else F.col(c)
        if c in df.columns
        else F.lit(None).cast(_TYPES[c]).alias(c)  # a column added since: null, as Spark reads it
        for c in TABLE_COLUMNS
        if c != "collection"
    ]
    out = df.select(*cols, F.col("_metadata.file_name").alias(_SOURCE))
    # One task, so one file, per source file: never two files for one file's rows.
    writer = out.repartition(_SOURCE).write.mode("overwrite").partitionBy(_SOURCE)
    writer.options(**PARQUET_OPTIONS).parquet(str(staging))
    rows = 0
    for made_dir in sorted(staging.glob(f"{_SOURCE}=*")):
        source = by_name[unquote(made_dir.name.split("=", 1)[1])]
        made = [p for p in made_dir.iterdir() if not p.name.startswith(("_", "."))]
        want = pq.read_metadata(source).num_rows
        if len(made) != 1 or pq.read_metadata(made[0]).num_rows != want:
            raise CdcError(
                f"stream {sink.name!r}: rewriting {source} gave {len(made)} file(s), not one "
                f"with its {want} rows; it was left as it was"
            )
        fsync_file(made[0])
        os.replace(made[0], source)
        fsync_dir(source.parent)
        rows += want
    return rows
