"""The daemon's SparkSession: embedded ``local[*]``, a cluster master, or Spark Connect.

``build_session`` is blocking (it starts a JVM or opens a gRPC channel): the
executor calls it from its worker thread, never on the event loop.

Defaults the daemon applies unless ``[spark.conf]`` says otherwise (user keys
always win):

- ``spark.sql.session.timeZone = UTC``: ``ingest_ts`` is a UTC instant; a
  host-local zone would make the same table read differently per machine.
- ``spark.sql.parquet.outputTimestampType = TIMESTAMP_MICROS``: Spark's
  legacy INT96 is read as nanoseconds (or not at all) by non-Spark readers.
- ``spark.sql.variant.allowDuplicateKeys = true``: ingest accepts any JSON
  object; a duplicate key (last one wins, as in most JSON parsers) must not
  turn into a batch that fails forever.
- ``spark.sql.maxConcurrentOutputFileWriters = 16``: partitioned writes keep
  one writer per collection instead of sorting each batch by collection.
- ``spark.sql.variant.writeShredding.enabled = false`` and
  ``spark.sql.parquet.variant.annotateLogicalType.enabled = false``: the CDC
  tables' VARIANT columns have one physical schema in every file, which every
  Parquet reader can open (docs/cdc.md, "Payload layout").
- UI off and the console progress bar off: a daemon has no terminal and the
  UI port is an attack surface nobody asked for.
- With a ``local`` master, ``spark.driver.bindAddress`` and
  ``spark.driver.host`` = ``127.0.0.1``: the embedded Spark's driver and
  block-manager ports listen on loopback only.
- With a ``local`` master, the daemon's jar (``HADOOP_JAR``, when make built
  it) on the driver's class path: the file system of the CDC staging writes
  (docs/cdc.md, "Step 1's file system").
- Spark's JVM log at ``log_level`` (WARN by default) from the first line on,
  through a generated log4j2 file: JSON lines named like the daemon's own
  with ``log_format = "json"``, text otherwise. The Python side goes through
  stdlib logging. In JSON mode the JVM's stderr is piped through this
  process, so what the JVM prints before log4j exists ("WARNING: Using
  incubator modules") becomes a ``spark.jvm_output`` event too.

The driver JVM's options (``spark.driver.extraJavaOptions``) compose
(``driver_java_options``): the log4j file, the daemon's JVM defaults
(``_JVM_DEFAULTS``, none at present: docs/performance.md, "The daemon's JVM",
says what was measured), then the user's options, which replace any of ours
that set the same thing. With ``[spark] class_sharing`` the driver JVM maps
Spark's classes from a class data sharing archive under
``<data_dir>/spark-cds`` that the first JVM recorded at its exit
(``class_sharing``).

A session can be lost while the daemon runs: the driver JVM dies (OOM killer,
SIGKILL), its SparkContext stops (a cluster master lost for good), or a Spark
Connect server restarts and forgets the client's session. ``session_exited``
(free) and ``probe_session`` (one bounded call) tell, and ``forget_session``
drops PySpark's process-global references to a lost session so that the next
``build_session`` starts a new JVM (or a new Connect session) instead of
returning the dead one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from daemon.spark import jarbuild

# PySpark 4.2 warns (FutureWarning) that it does not fully support pandas 3; the
# daemon never hands pandas objects to Spark (batches travel as Arrow), so the
# warning says nothing about our paths. Filtered narrowly, by message.
_PANDAS3_WARNING = "PySpark does not yet fully support pandas"

_DAEMON_DEFAULTS: dict[str, str] = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
    "spark.sql.variant.allowDuplicateKeys": "true",
    "spark.ui.showConsoleProgress": "false",
    # A batch touches a handful of collections: one open Parquet writer per
    # collection per task beats sorting every row by collection first (Spark
    # falls back to the sort past 16 partitions in one task). Measured ~20 %
    # off a 100k-row CDC write here.
    "spark.sql.maxConcurrentOutputFileWriters": "16",
    # Batches arrive as one Arrow table; the default 10k rows per Arrow batch
    # (= per partition) would split a 100k-row batch into 10 tiny tasks.
    "spark.sql.execution.arrow.maxRecordsPerBatch": "50000",
    # The CDC tables' payload layout (docs/cdc.md, "Payload layout"): VARIANT
    # columns written whole, as a plain {value, metadata} group. Shredded, each
    # file had its own struct for them and pyarrow (so pandas) refused the
    # table; annotated with Parquet's VARIANT logical type, Polars cannot read
    # the files' footers at all. Spark reads them as VARIANT either way.
    "spark.sql.variant.writeShredding.enabled": "false",
    "spark.sql.parquet.variant.annotateLogicalType.enabled": "false",
}

# JVM options the daemon's driver starts with (embedded or cluster driver; not
# Spark Connect), ahead of the user's spark.driver.extraJavaOptions
# (``driver_java_options``). Measured on the whole pipeline (docs/performance.md,
# "The daemon's JVM").
_JVM_DEFAULTS: tuple[str, ...] = ()

# log4j2 configuration for the driver JVM: one console appender on stderr
# (journald keeps it next to the daemon's own lines), the level from config,
# the layout from the daemon's log format (``_LAYOUTS``).
_LOG4J2 = """\
rootLogger.level = {level}
rootLogger.appenderRef.stderr.ref = stderr
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
{layout}
# A batch of 100k rows is one multi-MiB Arrow task by design; do not warn per batch.
logger.tsm.name = org.apache.spark.scheduler.TaskSetManager
logger.tsm.level = ERROR
"""

# One JSON object per line with the field names of the daemon's structlog lines
# (daemon.service.logs): ``timestamp`` (ISO 8601 UTC, microseconds), ``level``
# (Python's names: warning, not WARN), ``event`` (the message), ``logger``
# (the Java logger), ``thread``, and ``exception``: a Java stack trace as one
# string, present only when there is one. The jar (log4j-layout-template-json)
# ships in pyspark/jars next to log4j-core.
_JSON_EVENT_TEMPLATE = (
    '{"timestamp": {"$resolver": "timestamp", "pattern": '
    '{"format": "yyyy-MM-dd\'T\'HH:mm:ss.SSSSSS\'Z\'", "timeZone": "UTC"}}, '
    '"level": {"$resolver": "pattern", "pattern": '
    '"%level{TRACE=debug, DEBUG=debug, INFO=info, WARN=warning, ERROR=error, FATAL=critical}", '
    '"stackTraceEnabled": false}, '
    '"event": {"$resolver": "message", "stringified": true}, '
    '"logger": {"$resolver": "logger", "field": "name"}, '
    '"thread": {"$resolver": "thread", "field": "name"}, '
    '"exception": {"$resolver": "exception", "field": "stackTrace", '
    '"stackTrace": {"stringified": true}}}'
)

_LAYOUTS = {
    "console": (
        "appender.stderr.layout.type = PatternLayout\n"
        "appender.stderr.layout.pattern = "
        "%d{yyyy-MM-dd'T'HH:mm:ss.SSSXXX} %p spark %c{1}: %m%n%ex"
    ),
    "json": (
        "appender.stderr.layout.type = JsonTemplateLayout\n"
        f"appender.stderr.layout.eventTemplate = {_JSON_EVENT_TEMPLATE}"
    ),
}


def log4j2_text(level: str, log_format: str = "console") -> str:
    """The driver JVM's log4j2 properties for ``level`` and ``log_format``
    (``json`` or ``console``)."""
    return _LOG4J2.format(level=level.upper(), layout=_LAYOUTS[log_format])


def _log4j2_file(level: str, log_format: str = "console") -> Path:
    """Write (once per level and format) the log4j2 file the driver JVM starts with."""
    name = f"eventplane-log4j2-{level.lower()}-{log_format}.properties"
    path = Path(tempfile.gettempdir()) / name
    text = log4j2_text(level, log_format)
    try:
        if path.read_text(encoding="utf-8") == text:
            return path
    except OSError:
        pass
    tmp = path.with_suffix(f".{id(text)}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


def effective_conf(
    master: str,
    log_level: str,
    conf: Mapping[str, str],
    ui: bool,
    remote: str = "",
    log_format: str = "console",
    delta: bool = False,
) -> dict[str, str]:
    """The conf the builder gets: daemon defaults, then the user's ``[spark.conf]``.

    ``log_format`` (``json`` or ``console``, the daemon's resolved ``[log]
    format``) picks the JVM log's layout. ``delta``: a Delta stream is
    configured (``_add_delta``).
    """
    out = dict(_DAEMON_DEFAULTS)
    if not remote:
        out["spark.ui.enabled"] = "true" if ui else "false"
        out["spark.log.level"] = log_level.upper()
        out["spark.driver.extraJavaOptions"] = driver_java_options(
            _log4j2_file(log_level, log_format), conf.get("spark.driver.extraJavaOptions", "")
        )
        if master.startswith("local"):
            # Embedded Spark talks to itself only: its driver and block-manager
            # ports listen on loopback, not on every interface.
            out["spark.driver.bindAddress"] = "127.0.0.1"
            out["spark.driver.host"] = "127.0.0.1"
        if master.startswith("local") or master.startswith("spark://"):
            # Python workers (UDFs in trigger `when` or handlers) run this interpreter
            # when executors share the machine; remote clusters set their own.
            out["spark.pyspark.python"] = sys.executable
    else:
        # Spark Connect: static and JVM settings belong to the server; the client
        # may only set runtime SQL confs.
        out.pop("spark.ui.showConsoleProgress", None)
    out.update({k: v for k, v in conf.items() if k != "spark.driver.extraJavaOptions" or remote})
    if not remote and master.startswith("local"):
        _add_daemon_jar(out)
    if delta and not remote:
        _add_delta(out, master)
    return out


def _add_delta(out: dict[str, str], master: str) -> None:
    """Delta Lake's jars and SQL extension, for ``format = "delta"`` streams.

    The jars (``deltajars``) go on the driver's class path with a local
    master, as the daemon's own jar does, and into ``spark.jars`` for a
    cluster's executors; nothing when the user's ``spark.jars.packages``
    resolves Delta. The extension and catalog are what Delta's SQL (OPTIMIZE,
    VACUUM, DELETE) needs; a user's own extensions are kept.
    """
    from daemon.spark import deltajars

    if not deltajars.resolved_by_spark(out) and not deltajars.missing():
        files = [str(p) for p in deltajars.jars()]
        key = "spark.driver.extraClassPath" if master.startswith("local") else "spark.jars"
        sep = os.pathsep if key == "spark.driver.extraClassPath" else ","
        current = [p for p in out.get(key, "").split(sep) if p]
        out[key] = sep.join([*current, *(f for f in files if f not in current)])
    extensions = [e for e in out.get("spark.sql.extensions", "").split(",") if e.strip()]
    if deltajars.EXTENSION not in extensions:
        out["spark.sql.extensions"] = ",".join([*extensions, deltajars.EXTENSION])
    out.setdefault("spark.sql.catalog.spark_catalog", deltajars.CATALOG)
    # Delta rebuilds the table's state (to find the batch's txnVersion) on
    # every commit, in this many tasks: its default of 50 made a commit of
    # 1,000 rows take 3.5 s here, 1 took 1.0 s (docs/cdc.md, "Table formats").
    out.setdefault("spark.databricks.delta.snapshotPartitions", "1")
    # VACUUM lists the table's folders in a job of this many tasks: Spark's
    # default, 10,000, kept a small table's VACUUM busy for a minute here.
    out.setdefault("spark.sql.sources.parallelPartitionDiscovery.parallelism", "8")


def _flag(option: str) -> str:
    """What a JVM option sets: ``-XX:+UseParallelGC`` -> ``gc`` (one collector
    at most), ``-XX:CICompilerCount=2`` -> ``-XX:CICompilerCount``,
    ``-Dkey=value`` -> ``-Dkey``, ``-Xss4m`` -> ``-Xss``."""
    if re.fullmatch(r"-XX:[+-]Use\w*GC", option):
        return "gc"
    if option.startswith(("-Xshare", "-XX:SharedArchiveFile", "-XX:ArchiveClassesAtExit")):
        return "cds"
    if option.startswith("-XX:"):
        return "-XX:" + re.sub(r"^[+-]", "", option[4:]).split("=", 1)[0]
    if option.startswith("-D"):
        return option.split("=", 1)[0]
    m = re.match(r"-X(ss|ms|mx|mn)", option)
    return m.group(0) if m else option


def driver_java_options(log4j_file: Path, user: str = "") -> str:
    """``spark.driver.extraJavaOptions`` for a JVM the daemon starts: the log4j
    file, the daemon's JVM defaults (``_JVM_DEFAULTS``), then the user's
    options from ``[spark.conf]``. An option of ours that sets what one of the
    user's sets (the same flag, or another garbage collector) is left out: the
    user's wins, and two collectors would stop the JVM from starting."""
    theirs = {_flag(o) for o in shlex.split(user)}
    ours = [f"-Dlog4j2.configurationFile=file:{log4j_file}", *_JVM_DEFAULTS]
    kept = [o for o in ours if _flag(o) not in theirs]
    return " ".join([*kept, user] if user.strip() else kept)


# Built from jvm/src (daemon/spark/jarbuild.py: make, the wheel's build, or
# `eventplane setup`) where javac exists; absent otherwise, and the daemon does
# without it.
HADOOP_JAR = jarbuild.JAR


def daemon_class_missing(spark: Any, name: str) -> str | None:
    """Why the tasks of ``spark``'s session cannot use class ``name`` of the
    daemon's jar (None: they can). One py4j call, made only for a local master:
    the jar is on the driver's class path only (``_add_daemon_jar``), so
    executors in other JVMs (a cluster, ``local-cluster``) would fail the
    tasks, and a Spark Connect session has no JVM here at all."""
    sc = getattr(spark, "_sc", None)
    jsc = getattr(sc, "_jsc", None)
    if sc is None or jsc is None:
        return "Spark Connect: the server's class path is its own"
    master = str(sc.master)
    if not re.fullmatch(r"local(\[[^\]]*\])?", master):
        return f"master {master}: its executors do not have the daemon's jar"
    if jsc.hadoopConfiguration().getClassByNameOrNull(name) is None:
        built = "exists" if HADOOP_JAR.is_file() else "was not built (`eventplane setup` builds it)"
        return (
            f"{name} is not on the driver JVM's class path: {HADOOP_JAR} {built}, "
            "and counts only for a JVM the daemon starts"
        )
    return None


def _add_daemon_jar(out: dict[str, str]) -> None:
    """Append ``HADOOP_JAR`` to ``spark.driver.extraClassPath`` if it exists.

    Hadoop resolves ``fs.file.impl`` through the class loader its
    Configuration captured where it was made. A ``spark.jars`` jar also
    served a local write here, but it lives in Spark's own class loaders
    (the driver's context loader, the executor's); the driver's class path
    is the JVM's own, which every class loader sees, on whatever thread.
    With a local master the tasks run in the driver JVM, so it is their
    class path too. pyspark hands the setting to ``spark-submit``, which
    puts it on the ``java`` command line: it counts only for a JVM this
    process starts.
    """
    if not HADOOP_JAR.is_file():
        return
    current = out.get("spark.driver.extraClassPath", "")
    jar = str(HADOOP_JAR)
    if jar not in current.split(os.pathsep):
        out["spark.driver.extraClassPath"] = f"{current}{os.pathsep}{jar}" if current else jar


def build_session(
    master: str,
    app_name: str,
    ui: bool = False,
    log_level: str = "WARN",
    conf: Mapping[str, str] | None = None,
    remote: str = "",
    log_format: str = "console",
    cds_dir: Path | None = None,
    delta: bool = False,
    quiet: bool = False,
) -> Any:
    """Create (or join) the process's SparkSession. Blocking; call off the event loop.

    ``remote`` (``sc://host:port``) selects Spark Connect and replaces ``master``;
    the client then needs ``pyspark[connect]``'s gRPC packages. ``log_format``:
    the JVM log's layout (``json`` lines or ``console`` text, on stderr).
    ``cds_dir``: the folder of the driver JVM's class data sharing archive
    (``class_sharing``); None: none. ``delta``: with Delta Lake (``_add_delta``).
    ``quiet``: the JVM's start-up lines (``STARTUP_NOISE``) are not shown, for
    commands that print a table on the terminal (``eventplane cdc show``).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_PANDAS3_WARNING, category=FutureWarning)
        from pyspark.sql import SparkSession

        conf = dict(conf or {})
        user = conf.get("spark.driver.extraJavaOptions", "")
        # The heap's size decides the archive's layout (compressed pointers):
        # an archive is kept per driver memory and per user JVM options.
        salt = f"{conf.get('spark.driver.memory', '')} {user} {'delta' if delta else ''}"
        cds = driver_class_sharing(cds_dir, remote, user, salt)
        if cds is not None and cds.options:
            conf["spark.driver.extraJavaOptions"] = " ".join([*cds.options, user]).strip()
        settings = effective_conf(master, log_level, conf, ui, remote, log_format, delta)
        if (log_format == "json" or quiet) and not remote:
            _launch_jvm_with_json_stderr(master, app_name, settings, quiet=quiet)
        builder = SparkSession.builder.appName(app_name)
        builder = builder.remote(remote) if remote else builder.master(master)
        for key, value in settings.items():
            builder = builder.config(key, value)
        session = builder.getOrCreate()
        if not remote:
            session.sparkContext.setLogLevel(log_level.upper())
        if cds is not None and cds.recording:
            cds.remember_jvm(session)
        prime_pyspark_imports()
        return session


# What every driver JVM prints on start-up before a command's own output:
# the launcher's module warning and log4j's default-level notice.
STARTUP_NOISE = (
    "WARNING: Using incubator modules",
    "Setting default log level to",
    "To adjust logging level use sc.setLogLevel",
)


def _launch_jvm_with_json_stderr(
    master: str, app_name: str, settings: Mapping[str, str], *, quiet: bool = False
) -> None:
    """Start the driver JVM with its stderr piped through this process, so that
    every line it writes is one JSON object in ``log.format = "json"``.

    The JVM's log4j lines are JSON already (``_LOG4J2_JSON``); what the JVM
    prints before log4j exists (``WARNING: Using incubator modules``, which
    Spark's launcher always causes) becomes a ``spark.jvm_output`` event. The
    gateway is PySpark's own (``launch_gateway``), started with the same conf
    the builder would give it; ``getOrCreate`` then uses it. Nothing to do if
    a gateway runs already. ``quiet``: the lines of ``STARTUP_NOISE`` are
    dropped and the others copied as they are (a command's terminal).
    """
    import subprocess
    import threading

    from pyspark import SparkConf
    from pyspark.core.context import SparkContext
    from pyspark.java_gateway import launch_gateway

    with SparkContext._lock:
        if SparkContext._gateway is not None:
            return
        conf = SparkConf(loadDefaults=False).setMaster(master).setAppName(app_name)
        for key, value in settings.items():
            conf.set(key, value)
        launch: Any = launch_gateway  # untyped in PySpark
        gateway = launch(conf, popen_kwargs={"stderr": subprocess.PIPE})
        SparkContext._gateway = gateway
        SparkContext._jvm = gateway.jvm
    pump = threading.Thread(
        target=_pump_jvm_stderr,
        args=(gateway.proc.stderr, quiet),
        name="spark-stderr",
        daemon=True,
    )
    pump.start()


def _pump_jvm_stderr(stream: Any, quiet: bool = False) -> None:
    """Copy the JVM's stderr to ours line by line; a line that is not a JSON
    object is logged as one, or (``quiet``) copied unless it is start-up
    noise (the pipe must never fill: the JVM would block)."""
    import json

    import structlog

    log = structlog.get_logger("eventplane.spark")
    out = sys.stderr
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        if not line:
            continue
        if quiet:
            if not line.startswith(STARTUP_NOISE):
                out.write(line + "\n")
                out.flush()
            continue
        try:
            is_json = isinstance(json.loads(line), dict)
        except ValueError:
            is_json = False
        if is_json:
            out.write(line + "\n")
            out.flush()
        else:
            log.warning("spark.jvm_output", line=line)


def prime_pyspark_imports() -> None:
    """Import PySpark modules that warn at import time, with that warning filtered.

    ``pyspark.testing.utils`` (imported lazily by ``pyspark.sql.types`` on some
    conversion paths) checks the pandas version at import and warns; importing
    it here once keeps that warning out of batch code and out of tests.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_PANDAS3_WARNING, category=FutureWarning)
        import pyspark.testing.utils  # noqa: F401


# -- class data sharing ----------------------------------------------------------

# A JVM that loads and verifies Spark's classes from its jars spends seconds of
# CPU on it at every start; mapped from a class data sharing archive, it does
# not (measured: about half of a new driver's CPU up to its first write;
# docs/performance.md, "The daemon's JVM").
CDS_CHECK_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class ClassSharing:
    """The driver JVM's class data sharing, for one start (``class_sharing``)."""

    options: tuple[str, ...]
    archive: Path
    pending: Path
    jvm_file: Path
    recording: bool  # this JVM writes the archive when it exits

    def remember_jvm(self, session: Any) -> None:
        """Record the java binary and class path of the JVM that will write the
        pending archive: the next start checks the archive with them."""
        system = session.sparkContext._jvm.java.lang.System
        doc = {
            "java": str(Path(system.getProperty("java.home")) / "bin" / "java"),
            "classpath": system.getProperty("java.class.path"),
        }
        tmp = self.jvm_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc), encoding="utf-8")
        tmp.replace(self.jvm_file)


def _cds_key(salt: str = "") -> str:
    """What an archive is valid for: the PySpark install (its version and jars),
    the java binary and ``salt`` (the JVM's options); another one gets an
    archive of its own."""
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    names = sorted(p.name for p in jars.glob("*.jar")) if jars.is_dir() else []
    java_home = os.environ.get("JAVA_HOME")
    java = Path(java_home) / "bin" / "java" if java_home else shutil.which("java")
    java_real = Path(java).resolve() if java else Path("java")
    try:
        stamp = (java_real.parent.parent / "lib" / "modules").stat().st_mtime_ns
    except OSError:
        stamp = 0
    text = json.dumps([pyspark.__version__, str(jars), names, str(java_real), stamp, salt])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def driver_class_sharing(
    folder: Path | None, remote: str, user: str, salt: str = ""
) -> ClassSharing | None:
    """``class_sharing`` for a driver JVM this process starts, unless there is
    none (Spark Connect), no folder, or the user's ``extraJavaOptions`` set
    ``-Xshare`` or an archive of their own (theirs wins)."""
    if folder is None or remote or "cds" in map(_flag, shlex.split(user)):
        return None
    return class_sharing(folder, salt)


def _archive_maps(archive: Path, jvm_file: Path) -> bool:
    """Whether the JVM recorded in ``jvm_file`` maps ``archive`` (a JVM killed
    while it wrote the archive leaves one that does not)."""
    try:
        doc = json.loads(jvm_file.read_text(encoding="utf-8"))
        done = subprocess.run(
            # A cut archive crashes the JVM (SIGBUS): no crash report, no core.
            [doc["java"], "-Xshare:on", f"-XX:SharedArchiveFile={archive}",
             "-XX:ErrorFile=/dev/null", "-XX:-CreateCoredumpOnCrash",
             "-cp", doc["classpath"], "-version"],
            capture_output=True, timeout=CDS_CHECK_TIMEOUT_S, check=False,
        )  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def class_sharing(folder: Path, salt: str = "") -> ClassSharing:
    """The driver JVM's class data sharing archive under ``folder``.

    1. An archive for this PySpark and java (``_cds_key``) exists: the JVM
       maps it (``-XX:SharedArchiveFile``).
    2. Else, a pending archive that the last JVM wrote when it exited is
       checked (``_archive_maps``, with that JVM's java and class path) and,
       if it maps, becomes the archive (a rename) and is used.
    3. Else (none, or one that does not map, which is removed) this JVM
       records one when it exits (``-XX:ArchiveClassesAtExit``; a normal exit
       or SIGTERM writes it, a SIGKILL does not). JDK 13 or later.

    The JVM's own ``cds`` log lines (one per class it cannot archive, such as
    a signed jar's) are off. A problem with the folder gives no options.
    Files of other keys (an upgraded PySpark or java, other JVM options) are
    removed: one archive is 170 MB.
    """
    key = _cds_key(salt)
    with contextlib.suppress(OSError):
        for old in folder.glob("spark-*"):
            if not old.name.startswith(f"spark-{key}."):
                old.unlink(missing_ok=True)
    archive = folder / f"spark-{key}.jsa"
    pending = folder / f"spark-{key}.pending.jsa"
    jvm_file = folder / f"spark-{key}.jvm.json"
    quiet = "-Xlog:cds*=off"
    # Step 1. An archive made before.
    if archive.is_file():
        return ClassSharing((f"-XX:SharedArchiveFile={archive}", quiet), archive, pending,
                            jvm_file, False)  # fmt: skip
    # Step 2. The one the last JVM wrote at its exit, once it is known to map.
    if pending.is_file():
        if _archive_maps(pending, jvm_file):
            pending.replace(archive)
            return ClassSharing((f"-XX:SharedArchiveFile={archive}", quiet), archive, pending,
                                jvm_file, False)  # fmt: skip
        pending.unlink(missing_ok=True)
    # Step 3. This JVM writes one when it exits.
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return ClassSharing((), archive, pending, jvm_file, False)
    return ClassSharing((f"-XX:ArchiveClassesAtExit={pending}", quiet), archive, pending,
                        jvm_file, True)  # fmt: skip


# -- a lost session ------------------------------------------------------------

# How long a probe may wait for the driver JVM or the Connect server. A live
# driver answers ``isStopped()`` in milliseconds even mid-job; one that does
# not answer within this is hung or gone, and the probe's thread is left
# behind (a py4j call to a stopped-but-alive JVM never returns by itself).
PROBE_TIMEOUT_S = 15.0
# How long a probe that got no answer waits for the JVM process to be seen
# exiting, so that the reason names the exit.
EXIT_GRACE_S = 1.0
# How long ``forget_session`` waits for a still-running JVM to exit once its
# stdin closed (PySpark's gateway exits on EOF), before it kills it.
JVM_EXIT_WAIT_S = 10.0
# Spark Connect errors after which the client's session is gone for good (the
# server restarted or expired it): only a new session helps.
CONNECT_SESSION_GONE = (
    "INVALID_HANDLE.SESSION_NOT_FOUND",
    "INVALID_HANDLE.SESSION_CHANGED",
    "INVALID_HANDLE.SESSION_CLOSED",
)


def _gateway_proc(session: Any) -> subprocess.Popen[bytes] | None:
    """The driver JVM PySpark launched for a classic session (None: not ours)."""
    sc = getattr(session, "_sc", None)
    gateway = getattr(sc, "_gateway", None)
    proc = getattr(gateway, "proc", None)
    return proc if isinstance(proc, subprocess.Popen) else None


def session_exited(session: Any, connect: bool = False) -> str | None:
    """Why ``session`` can no longer run anything, from what is known without
    asking Spark (a ``waitpid`` at most; safe on the event loop); None if it
    may be alive.

    ``connect``: the session is a Spark Connect client (``[spark] remote``).
    """
    if connect:
        if getattr(session, "is_stopped", False):
            return "the Spark Connect session is closed"
        return None
    sc = getattr(session, "_sc", None)
    if sc is not None and getattr(sc, "_jsc", None) is None:
        return "the SparkContext was stopped"
    proc = _gateway_proc(session)
    if proc is not None and proc.poll() is not None:
        code = proc.returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"the Spark driver JVM (pid {proc.pid}) {how}"
    return None


def _bounded(call: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
    """Run ``call`` in a thread of its own for at most ``timeout_s``.

    ``(True, result)``, ``(False, exception)``, or ``(False, None)`` on a
    timeout (the thread is a daemon and is left to finish on its own).
    """
    out: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            out.append((True, call()))
        except BaseException as exc:  # reported to the caller, never lost
            out.append((False, exc))

    thread = threading.Thread(target=run, name="eventplane-spark-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return out[0] if out else (False, None)


def probe_session(
    session: Any, connect: bool = False, timeout_s: float = PROBE_TIMEOUT_S
) -> str | None:
    """Why ``session`` is lost, or None if it answers. Blocking for at most
    ``timeout_s`` (one cheap call to the JVM or the Connect server): call it
    from a worker thread, after a batch failed.

    Classic sessions (local or cluster master): the driver JVM exited, does
    not answer ``isStopped()`` (a network error, or no answer in time), or its
    SparkContext is stopped; a cluster's driver context stops when the master
    is gone for good. Spark Connect: the client is closed or the server no
    longer knows the session; a server that is merely unreachable is not a
    lost session (the batch retries, and reconnects once it is back).
    """
    reason = session_exited(session, connect)
    if reason is not None or session is None:
        return reason
    if connect:
        ok, value = _bounded(lambda: session.version, timeout_s)
        if getattr(session, "is_stopped", False):
            return "the Spark Connect session is closed"
        if not ok and value is not None:
            text = str(value)
            gone = next((code for code in CONNECT_SESSION_GONE if code in text), None)
            if gone is not None:
                return f"the Spark Connect server no longer knows this session ({gone})"
        return None
    jsc = session._sc._jsc
    ok, value = _bounded(lambda: jsc.sc().isStopped(), timeout_s)
    if ok:
        return "the SparkContext was stopped" if value else None
    proc = _gateway_proc(session)
    if proc is not None:
        # A killed JVM refuses connections a moment before it can be reaped:
        # give it that moment, so the reason names the exit.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(EXIT_GRACE_S)
        reason = session_exited(session)
        if reason is not None:
            return reason
    if value is None:
        return f"the Spark driver JVM did not answer within {timeout_s:g} s"
    return f"the Spark driver JVM does not answer ({type(value).__name__}: {value})"


def forget_session(session: Any, connect: bool = False, timeout_s: float = JVM_EXIT_WAIT_S) -> None:
    """Drop a lost session so that ``build_session`` makes a new one. Blocking
    (bounded): call it from the worker thread that builds sessions.

    PySpark keeps the session process-wide, and ``getOrCreate`` returns it
    while those references stand, dead JVM or not:

    - ``SparkContext._gateway`` / ``_jvm``: the py4j gateway; while set,
      ``SparkContext`` never launches a JVM again. Its connections and its
      Python-side server are closed; its finalizer thread is told to end.
    - ``SparkContext._active_spark_context`` and the context's ``_jsc``:
      ``SparkContext.getOrCreate`` returns the active one.
    - ``SparkSession._instantiatedSession`` / ``_activeSession`` and
      ``SQLContext._instantiatedContext``: the builder's default session.
    - The context's accumulator server (a thread and a socket per context).

    A driver JVM still running (its context stopped, or hung) is stopped the
    way PySpark's gateway is meant to end: its stdin is closed, and it is
    killed if it has not exited after ``timeout_s``. Spark Connect: the
    client's channel is closed without a release call (the server may be
    gone) and the default and active sessions are cleared.
    """
    if connect:
        _forget_connect(session, timeout_s)
    else:
        _forget_classic(session, timeout_s)


def _forget_connect(session: Any, timeout_s: float) -> None:
    from pyspark.sql.connect.session import SparkSession as RemoteSparkSession

    client = getattr(session, "client", None)
    if client is not None:
        _bounded(client.close, timeout_s)
    with RemoteSparkSession._lock:
        if RemoteSparkSession._default_session is session:
            RemoteSparkSession._default_session = None
        if getattr(RemoteSparkSession._active_session, "session", None) is session:
            RemoteSparkSession._active_session.session = None


def _forget_classic(session: Any, timeout_s: float) -> None:
    from pyspark.core.context import SparkContext
    from pyspark.sql import SparkSession, SQLContext

    sc = getattr(session, "_sc", None)
    proc = _gateway_proc(session)
    with SparkContext._lock:
        # The globals are the lost session's unless another context took over.
        ours = SparkContext._active_spark_context in (None, sc)
        gateway = SparkContext._gateway if ours else None
        if ours:
            SparkContext._gateway = None
            SparkContext._jvm = None
            SparkContext._active_spark_context = None
            SQLContext._instantiatedContext = None
        for attr in ("_instantiatedSession", "_activeSession"):
            if getattr(getattr(SparkSession, attr), "_sc", None) is sc:
                setattr(SparkSession, attr, None)
        if sc is not None:
            sc._jsc = None
            server = getattr(sc, "_accumulatorServer", None)
            if server is not None:
                sc._accumulatorServer = None
                _bounded(server.shutdown, timeout_s)
    if gateway is not None:
        # close(), not shutdown(): shutdown sends a command to the JVM, and
        # py4j retries it without end when the JVM is gone.
        _bounded(gateway.close, timeout_s)
        deque = getattr(getattr(gateway, "_gateway_client", None), "finalizer_deque", None)
        if deque is not None:  # py4j's ClientServer: one finalizer thread per gateway
            from py4j.clientserver import SHUTDOWN_FINALIZER_WORKER

            deque.appendleft(SHUTDOWN_FINALIZER_WORKER)
    if proc is not None and proc.poll() is None:
        if proc.stdin is not None:
            proc.stdin.close()  # PySpark's gateway server exits at EOF on stdin
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)
