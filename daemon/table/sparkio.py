"""How a CDC table's batches reach Spark: select lists and writer options built
once per session, the staging write's Hadoop options, and the batch's raw
inbox file for writes without a Spark job (``DirectWrite.java``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from daemon.table import quarantine

log = structlog.get_logger("eventplane.cdc")

# Hadoop options of step 1's write only (the batch's staging folder), for its
# fixed cost: without Hadoop's native library, the local file system forks a
# ``chmod`` process for every folder and file it creates (docs/performance.md,
# "The fixed cost of a batch"). 19 forks per 4-collection batch became none:
# - the plain local file system writes no ``.crc`` file beside each staged
#   file (the daemon fsyncs and renames the staged files itself, and never
#   publishes a ``.crc``). Uncached, so that the session's shared ``file:``
#   file system (whatever Hadoop's defaults or ``[spark.conf]`` made it)
#   stays as it is for everything else;
# - no ``_SUCCESS`` marker: a staged batch is complete when Spark's write
#   returns, and ``_staged_files`` skipped the marker anyway.
# - ``NIO_LOCAL_FS`` instead of Hadoop's plain file system where the JVM can
#   load it (``staging_write_options``): it sets permissions without a fork,
#   and the 9 left became none.
STAGING_WRITE_OPTIONS = {
    "fs.file.impl": "org.apache.hadoop.fs.RawLocalFileSystem",
    "fs.file.impl.disable.cache": "true",
    "mapreduce.fileoutputcommitter.marksuccessfuljobs": "false",
}
# Hadoop's plain local file system, setting permissions through java.nio
# instead of a forked ``chmod`` (jvm/src). In the jar make builds when javac
# exists (``session.HADOOP_JAR``), which a local master's driver JVM gets on
# its class path.
NIO_LOCAL_FS = "eventplane.hadoop.NioLocalFileSystem"
_staging_options: tuple[Any, dict[str, str]] | None = None
_staging_fallback_logged = False
# Step 1 without a Spark job (``RawInbox``): in the jar with the raw
# inbox's reader, whose rows it writes.
DIRECT_WRITE = "eventplane.inbox.DirectWrite"
_direct_usable: tuple[Any, str | None] | None = None  # (session, why not)
# The folders Hadoop's file committer (algorithm 1, application attempt 0)
# creates under a job's output before its tasks write: made by the daemon
# beforehand (``os.makedirs``, no fork), Hadoop finds them and creates none.
# Where a cluster names them otherwise, they stay empty and go with the
# staging folder.
STAGING_JOB_DIRS = Path("_temporary") / "0" / "_temporary"


def _py4j_jvm(spark: Any) -> Any:
    """The py4j view of ``spark``'s JVM; None under Spark Connect (no JVM here)."""
    return getattr(getattr(spark, "_sc", None), "_jvm", None)


@dataclass(frozen=True, slots=True)
class SelectList:
    """A select list built once per session, for a select per batch that
    costs one py4j command.

    ``DataFrame.select(*columns)`` hands the JVM a new Java list per call,
    built with one command per element (py4j's list conversion): 14 for the
    write's list, 12 for the batch's contract columns. Here the JVM's
    ``Seq`` of the Columns is made once and passed as it is. A Spark Connect
    session has no JVM here: its selects go the usual way.
    """

    columns: tuple[Any, ...]
    jseq: Any  # the JVM Seq of the Columns; None under Spark Connect

    @classmethod
    def build(cls, spark: Any, columns: list[Any]) -> SelectList:
        jvm = _py4j_jvm(spark)
        jseq = None if jvm is None else jvm.PythonUtils.toSeq([c._jc for c in columns])
        return cls(tuple(columns), jseq)

    def select(self, df: Any) -> Any:
        """``df.select(*columns)``."""
        if self.jseq is None:
            return df.select(*self.columns)
        from pyspark.sql.classic.dataframe import DataFrame

        return DataFrame(df._jdf.select(self.jseq), df.sparkSession)


@dataclass(frozen=True, slots=True)
class WriteOptions:
    """A writer's options built once per session, set with one py4j command.

    ``DataFrameWriter.options(**options)`` sends one command per option (9
    for step 1's write); here a Java map of them is made once and handed to
    the JVM writer's ``options(Map)``. Under Spark Connect (no JVM here)
    they are set the usual way.
    """

    options: dict[str, str]
    jmap: Any  # a java.util.HashMap of ``options``; None under Spark Connect

    @classmethod
    def build(cls, spark: Any, options: dict[str, str]) -> WriteOptions:
        jvm = _py4j_jvm(spark)
        jmap = None
        if jvm is not None:
            jmap = jvm.java.util.HashMap()
            for key, value in options.items():
                jmap.put(key, value)
        return cls(dict(options), jmap)

    def set_on(self, writer: Any) -> Any:
        """``writer.options(**options)``; returns ``writer``."""
        if self.jmap is None or not hasattr(writer, "_jwrite"):
            return writer.options(**self.options)
        writer._jwrite = writer._jwrite.options(self.jmap)
        return writer


def staging_write_options(spark: Any) -> dict[str, str]:
    """The Hadoop options of a staging write (step 1, and a compaction's Spark
    write) in ``spark``'s session: ``STAGING_WRITE_OPTIONS``, with
    ``NIO_LOCAL_FS`` as the file system when the session's JVM runs the tasks
    and can load it. Decided once per session (a few py4j calls); without it
    the writes fork ``chmod`` as before, and the first session says why, once
    per process."""
    global _staging_options, _staging_fallback_logged
    cached = _staging_options
    if cached is not None and cached[0] is spark:
        return cached[1]
    options = dict(STAGING_WRITE_OPTIONS)
    reason = _nio_fs_missing(spark)
    if reason is None:
        options["fs.file.impl"] = NIO_LOCAL_FS
        _drop_yarn_defaults(spark)
    elif not _staging_fallback_logged:
        _staging_fallback_logged = True
        log.info("cdc_staging_forks_chmod", reason=reason)
    _staging_options = (spark, options)
    return options


def _drop_yarn_defaults(spark: Any) -> None:
    """Unset the session's Hadoop keys that only ``yarn-default.xml`` set (527
    of 1,100; the daemon's jar does it in one call). A local master never reads
    them, and every job serialises the whole configuration to its tasks, where
    every Parquet writer scans it (docs/performance.md, "The fixed cost of a
    batch"). Called with a local master only; a key a site file or
    ``spark.hadoop.*`` set stays."""
    from py4j.protocol import Py4JError

    conf = spark.sparkContext._jsc.hadoopConfiguration()
    try:
        drop = spark.sparkContext._jvm.eventplane.hadoop.HadoopDefaults.drop
        dropped = drop(conf, "yarn-default.xml")
    except Py4JError as exc:  # a jar built before the class existed: a cost only
        log.info("cdc_hadoop_defaults_kept", error=str(exc)[:200])
        return
    log.debug("cdc_hadoop_defaults_dropped", resource="yarn-default.xml", keys=dropped)


@dataclass(frozen=True, slots=True)
class RawInbox:
    """A batch's raw inbox file (``daemon.spark.rawinbox``) in ``spark``'s
    session, for step 1 (:meth:`CdcSink.commit`).

    ``rows``: what the write must write (``commit`` sets the stream's).
    ``direct``: step 1 writes the file's rows without a Spark job; else a
    Spark job writes the batch DataFrame, and the file serves only to find
    rows that fail alone. ``reread(collections, skip)``: a DataFrame of the
    batch's rows of those collections (empty: all) but the LSNs of ``skip``,
    whose reader parses only those rows' payloads. ``skip``: LSNs the
    direct write leaves out.
    """

    spark: Any
    path: Path
    splits: str
    batch_id: int
    rows: int
    direct: bool = True
    reread: Callable[[tuple[str, ...], tuple[int, ...]], Any] | None = None
    skip: tuple[int, ...] = ()


def writer_errors(spark: Any, rows: list[quarantine.QuarantinedRow]) -> list[str | None]:
    """For each row, None when the writer parses its payloads now, else why
    not (``JsonCheck.checkMany``, with the session's parse_json settings)."""
    from daemon.events import decode as decode_stored

    docs: list[bytes] = []
    for r in rows:
        event = decode_stored(r.payload)
        docs += [event.new or b"null", event.old or b"null"]
    conf = spark.conf
    verdicts = _py4j_jvm(spark).eventplane.inbox.JsonCheck.checkMany(
        bytearray(b"".join(docs)),
        ",".join(str(len(d)) for d in docs),
        conf.get("spark.sql.variant.allowDuplicateKeys") == "true",
        conf.get("spark.sql.variant.validateUnicodeInJsonParsing") == "true",
    )
    out: list[str | None] = []
    for i in range(len(rows)):
        new, old = verdicts[2 * i], verdicts[2 * i + 1]
        out.append(f"new: {new}" if new else f"old: {old}" if old else None)
    return out


def _java_strings(spark: Any, values: tuple[str, ...]) -> Any:
    """A Java ``String[]`` of ``values`` in ``spark``'s JVM."""
    array = spark.sparkContext._gateway.new_array(_py4j_jvm(spark).java.lang.String, len(values))
    for i, value in enumerate(values):
        array[i] = value
    return array


def direct_write_missing(spark: Any) -> str | None:
    """Why ``spark``'s session cannot write a batch without a Spark job (None:
    it can). Decided once per session; the raw inbox needs the same jar, so a
    session that reads one and lacks this class has a jar built before it."""
    global _direct_usable
    cached = _direct_usable
    if cached is not None and cached[0] is spark:
        return cached[1]
    from daemon.spark.session import daemon_class_missing

    reason = daemon_class_missing(spark, DIRECT_WRITE)
    _direct_usable = (spark, reason)
    return reason


def _nio_fs_missing(spark: Any) -> str | None:
    """Why ``NIO_LOCAL_FS`` cannot serve ``spark``'s writes (None: it can)."""
    from daemon.spark.session import daemon_class_missing

    return daemon_class_missing(spark, NIO_LOCAL_FS)
