"""Step 1 of a Parquet stream's commit: a batch's rows written as Parquet files.

:class:`ParquetWrite` holds the write half of :class:`~daemon.table.parquet.CdcSink`
(which inherits it; the Delta sink overrides parts):

1. :meth:`~ParquetWrite._write_staged` empties the staging folder, then writes
   a DataFrame with Spark (:meth:`~ParquetWrite._select`: the table's columns,
   time partition columns and the stream's collection filter, built once per
   session) or a raw inbox file in the driver JVM without a job
   (:meth:`~ParquetWrite._write_direct`, ``DirectWrite.java``);
2. with the writer options of :meth:`~ParquetWrite._write_options`
   (``PARQUET_OPTIONS``, or ``TRANSIENT_PARQUET_OPTIONS`` when compaction
   rewrites the files, plus the staging file system's);
3. :meth:`~ParquetWrite._bad_rows` finds rows the direct write cannot parse
   (the quarantine's input);
4. after the commit, :meth:`~ParquetWrite._write_summaries` keeps the table's
   schema in ``_common_metadata`` files. The why: docs/cdc.md, "Tuning the write".
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from daemon.config import CdcStream
from daemon.table.durable import fsync_dir, fsync_file
from daemon.table.errors import CdcError
from daemon.table.layout import (
    PARQUET_OPTIONS,
    SPARK_SCHEMA_KEY,
    SUMMARY_FILE,
    TABLE_COLUMNS,
    TRANSIENT_PARQUET_OPTIONS,
    time_columns,
)
from daemon.table.sparkio import (
    STAGING_JOB_DIRS,
    RawInbox,
    SelectList,
    WriteOptions,
    _java_strings,
    _py4j_jvm,
    staging_write_options,
)

log = structlog.get_logger("eventplane.cdc")


class ParquetWrite:
    """Step 1's writes and the schema summaries of a :class:`CdcSink`; the
    state below is set (and explained) in ``CdcSink.__init__``."""

    stream: CdcStream
    path: Path
    _summarized: set[Path]
    _columns: tuple[Any, tuple[str, ...], SelectList, Any | None] | None
    _options: tuple[Any, dict[str, str], WriteOptions] | None
    _direct_args: tuple[Any, ...] | None

    if TYPE_CHECKING:

        @property
        def name(self) -> str: ...

    def _taken(self) -> tuple[str, ...]:
        """The stream's collections for a reader's filter (empty: all)."""
        return () if self.stream.collections == ("*",) else self.stream.collections

    def _bad_rows(self, raw: RawInbox, limit: int) -> list[tuple[int, str]]:
        """``(lsn, error)`` of the stream's rows of ``raw`` whose payloads the
        writer cannot parse alone, at most ``limit`` + 1 (``DirectWrite.badRows``)."""
        spark = raw.spark
        found = _py4j_jvm(spark).eventplane.inbox.DirectWrite.badRows(
            spark._jsparkSession,
            str(raw.path),
            raw.splits,
            raw.batch_id,
            _java_strings(spark, self._taken()),
            limit,
        )
        out = []
        for entry in found:
            lsn, _, error = str(entry).partition("\t")
            out.append((int(lsn), error))
        return out

    def _select(self, df: Any, skip: tuple[int, ...] = ()) -> Any:
        columns, keep = self._write_columns(df.sparkSession)
        out = columns.select(df)
        if keep is not None:
            out = out.where(keep)
        if skip:
            from pyspark.sql import functions as F

            out = out.where(~F.col("lsn").isin(list(skip)))
        return out

    def _write_columns(self, spark: Any) -> tuple[SelectList, Any | None]:
        """The write's select list (the table's columns, then the time partition
        columns) and the filter on the stream's collections (None: all), built
        once per session. A Column is an expression object in the JVM, and each
        one took py4j calls on every batch; a rebuilt session (a new JVM) gets
        new ones. The table's column list is part of the key: tests that write
        an earlier layout put another one in place for some batches."""
        cached = self._columns
        table = self._table_columns()
        if cached is None or cached[0] is not spark or cached[1] is not table:
            from pyspark.sql import functions as F

            columns = [F.col(c) for c in table]
            columns += [col.alias(name) for name, col in time_columns(self.stream.partition_by)]
            keep = None
            if self.stream.collections != ("*",):
                keep = F.col("collection").isin(list(self.stream.collections))
            cached = self._columns = (spark, table, SelectList.build(spark, columns), keep)
        return cached[2], cached[3]

    def _table_columns(self) -> tuple[str, ...]:
        """The columns of the table's files, in order (read at each write:
        tests put an earlier layout in place for some batches)."""
        return TABLE_COLUMNS

    def _write_staged(self, df: Any, staging: Path) -> None:
        """The write of step 1 (tests wrap this to inject write failures): a
        Spark write of the DataFrame ``df``, or, given a :class:`RawInbox`, the
        direct write of its rows (:meth:`_write_direct`).

        The staging folder starts empty (a failed attempt's leftovers go), with
        the committer's job folders made here (``STAGING_JOB_DIRS``); Spark then
        appends into it, which keeps those folders.
        """
        shutil.rmtree(staging, ignore_errors=True)
        (staging / STAGING_JOB_DIRS).mkdir(parents=True)
        if isinstance(df, RawInbox):
            self._write_direct(df, staging)
            return
        partition_by = self.stream.partition_by
        writer = df.write.mode("append").partitionBy(*partition_by)
        self._write_options(df.sparkSession).set_on(writer).parquet(str(staging))

    def _write_direct(self, raw: RawInbox, staging: Path) -> None:
        """Step 1 in the driver JVM (``DirectWrite.java``): the stream's rows
        of the inbox file, one thread per split as a job has one task per
        split, into a file per split and partition folder, with Spark's
        Parquet writer and this write's options. The time partitions are
        computed as ``time_columns`` computes them."""
        spark = raw.spark
        cached = self._direct_args
        table = self._table_columns()  # part of the key, as in _write_columns
        if cached is None or cached[0] is not spark or cached[1] is not table:
            # Java String arrays are a py4j command per element: made once per session.
            taken = () if self.stream.collections == ("*",) else self.stream.collections
            lists = (table, taken, self.stream.partition_by)
            cached = self._direct_args = (spark, table, *(_java_strings(spark, x) for x in lists))
        args = [
            spark._jsparkSession,
            str(raw.path),
            raw.splits,
            raw.batch_id,
            str(staging),
            self._write_options(spark).jmap,
            *cached[2:],
        ]
        if raw.skip:
            skip = spark.sparkContext._gateway.new_array(
                spark.sparkContext._gateway.jvm.long, len(raw.skip)
            )
            for i, lsn in enumerate(raw.skip):
                skip[i] = lsn
            args.append(skip)
        written = _py4j_jvm(spark).eventplane.inbox.DirectWrite.write(*args)
        if written != raw.rows:
            raise CdcError(
                f"stream {self.name!r}: the direct write of batch {raw.batch_id} wrote "
                f"{written} rows, {raw.rows} expected"
            )

    def _write_options(self, spark: Any) -> WriteOptions:
        """Step 1's writer options (Parquet's and the staging write's), built
        once per session and staging choice."""
        staging = staging_write_options(spark)
        cached = self._options
        if cached is None or cached[0] is not spark or cached[1] is not staging:
            parquet = TRANSIENT_PARQUET_OPTIONS if self.stream.compaction else PARQUET_OPTIONS
            built = WriteOptions.build(spark, {**parquet, **staging})
            cached = self._options = (spark, staging, built)
        return cached[2]

    def _write_summaries(self, files: list[tuple[str, str]]) -> None:
        """The table's schema, as the footer of a file just written, in
        ``_common_metadata`` at the root and in every ``collection=...`` folder.

        Spark's schema inference (``mergeSchema`` off, the default) reads a
        ``_common_metadata`` footer when the folder it reads has one, and
        otherwise one data file's, whichever its listing gives first. A table
        that holds files from before a column existed would then lose that
        column by chance (tests/spark/test_cdc.py). Readers that skip ``_``
        names (pyarrow, DuckDB, Trino) ignore the file; it holds no rows, so
        what a reader counts is unchanged.

        The first commit of a process checks every folder; later ones only new
        folders. A file whose Spark schema differs (an older daemon's) is
        replaced atomically. Not part of the commit: a failure is logged and
        retried at the next commit.
        """
        # The root and each top-level partition folder (collection=...), also
        # when the table is partitioned further by time: those are the folders
        # readers point at, and retention never removes them.
        folders = {self.path / Path(final).parts[0] for _, final in files}
        if self.path not in self._summarized:
            folders.add(self.path)
            folders.update(
                d for d in self.path.iterdir() if d.is_dir() and not d.name.startswith(("_", "."))
            )
        todo = sorted(folders - self._summarized)
        if not todo:
            return
        try:
            import pyarrow.parquet as pq

            schema = pq.read_schema(self.path / files[0][1])
            wanted = (schema.metadata or {}).get(SPARK_SCHEMA_KEY)
            for folder in todo:
                target = folder / SUMMARY_FILE
                try:
                    current = (pq.read_schema(target).metadata or {}).get(SPARK_SCHEMA_KEY)
                except (OSError, ValueError):  # missing, or not a Parquet footer
                    current = None
                if current is None or current != wanted:
                    tmp = folder / f".{SUMMARY_FILE}.{os.getpid()}.tmp"
                    pq.write_metadata(schema, tmp)
                    fsync_file(tmp)
                    os.replace(tmp, target)
                    fsync_dir(folder)
                self._summarized.add(folder)
        except (OSError, ValueError) as exc:
            log.warning("cdc_summary_failed", stream=self.name, error=str(exc))
