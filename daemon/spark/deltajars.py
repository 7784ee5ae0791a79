"""Delta Lake's jars, for the Delta streams that take a Spark append: which, where, how to get them.

A local Delta stream written by the direct write needs no jar: the daemon's
JVM writes the batch's Parquet files and delta-rs does the rest (the commit,
table creation, OPTIMIZE, VACUUM, DELETE). A stream needs Delta Spark only
for what Spark writes to it (:func:`spark_append`): ``variant = true``, or a
batch that takes a Spark append (Spark Connect, a cluster master,
``spark.direct_write = false``, no daemon jar). The pyspark wheel carries no
Delta Lake. ``make run`` fetches the two jars such a stream needs when its
config has one, ``make test`` always, with ``mvn dependency:copy`` (Maven
Central) into ``daemon/spark/jars/delta/`` (``python -m
daemon.spark.deltajars [--config PATH]``), and the session then puts them on
the driver's class path (``session.effective_conf``). Delta Spark's other
dependencies (Scala, Jackson, Hadoop, Parquet) are Spark's own. Without
them, such a stream fails alone at start with the missing artifact and the
fix (:func:`missing_message`); the others run. Users who prefer Spark's
resolver set ``spark.jars.packages`` to :data:`PACKAGE` instead.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from daemon.config import CdcStream, Config, SparkConfig
from daemon.spark import jarbuild

# Delta Lake built for Spark 4.2 (pyproject.toml pins pyspark==4.2.0).
DELTA_VERSION = "4.4.0"
PACKAGE = f"io.delta:delta-spark_4.2_2.13:{DELTA_VERSION}"
ARTIFACTS = (PACKAGE, f"io.delta:delta-storage:{DELTA_VERSION}")
# The jars' SHA-256, as Maven Central served them when DELTA_VERSION was locked: a
# fetched jar must match, like a Python package must match requirements.lock.
SHA256 = {
    PACKAGE: "27d4fd8b1f879535c573ed1c718177d6a27f24d3e626ba02e216369725721ead",
    ARTIFACTS[1]: "c46735481fa8e326b0957be02b4420cbcab4b325bb08009b7f2045a95133f1cc",
}
# The Maven plugin that fetches them (`mvn <plugin>:copy`).
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:2.8"
# EVENTPLANE_DELTA_JARS: another folder (one shared by several checkouts; the
# tests point it at an empty one to run as a fresh clone does).
JARS_DIR = Path(
    os.environ.get("EVENTPLANE_DELTA_JARS") or Path(__file__).with_name("jars") / "delta"
)
# The daemon's jar (session.HADOOP_JAR, which imports this module): without it
# Spark appends every batch.
DAEMON_JAR = jarbuild.JAR
# The session settings a Delta table's SQL (OPTIMIZE, VACUUM, DELETE) needs.
EXTENSION = "io.delta.sql.DeltaSparkSessionExtension"
CATALOG = "org.apache.spark.sql.delta.catalog.DeltaCatalog"


def jar_file(coordinate: str, folder: Path = JARS_DIR) -> Path:
    """Where ``group:artifact:version`` lies once fetched."""
    _, artifact, version = coordinate.split(":")
    return folder / f"{artifact}-{version}.jar"


def jars(folder: Path = JARS_DIR) -> list[Path]:
    return [jar_file(c, folder) for c in ARTIFACTS]


def missing(folder: Path = JARS_DIR) -> list[str]:
    """The artifacts not fetched yet, as Maven coordinates."""
    return [c for c in ARTIFACTS if not jar_file(c, folder).is_file()]


def resolved_by_spark(conf: Mapping[str, str]) -> bool:
    """The user's ``[spark.conf]`` has Spark's resolver fetch Delta itself."""
    return "io.delta:delta-spark" in conf.get("spark.jars.packages", "")


def missing_message(coordinates: list[str], folder: Path = JARS_DIR) -> str:
    first = coordinates[0]
    return (
        f"Delta Lake's jar {first} is not in {folder}. Fetch the jars with `make "
        f"delta-jars` (mvn, {len(ARTIFACTS)} jars), then restart; or let Spark resolve them: "
        f'[spark.conf] "spark.jars.packages" = "{PACKAGE}"'
    )


def spark_append(stream: CdcStream, spark: SparkConfig, daemon_jar: bool) -> str | None:
    """Why Spark writes to the Delta stream ``stream``, which then needs Delta's
    jars (None: it does not, or ``stream`` is not a Delta stream). A table on
    S3 has every batch committed by delta-rs; ``daemon_jar``: the daemon's jar
    (the direct write) is built."""
    if stream.format != "delta":
        return None
    if stream.variant:
        return "variant = true: Spark writes the VARIANT columns"
    if stream.uri:
        return None
    if spark.remote:
        return "spark.remote: Spark Connect appends each batch"
    if not spark.master.startswith("local"):
        return f"spark.master = {spark.master!r}: the cluster appends each batch"
    if not spark.direct_write:
        return "spark.direct_write = false: Spark appends each batch"
    if not daemon_jar:
        return "no daemon jar (javac was missing at install): Spark appends each batch"
    return None


def needing(cfg: Config, daemon_jar: bool) -> dict[str, str]:
    """The streams of ``cfg`` that need Delta's jars, each with why (:func:`spark_append`)."""
    out = {s.name: spark_append(s, cfg.spark, daemon_jar) for s in cfg.cdc.streams}
    return {name: why for name, why in out.items() if why is not None}


def unavailable(needed: bool, conf: Mapping[str, str], remote: str) -> str | None:
    """Why a stream that ``needed`` Delta's jars cannot run here (None: it
    can). A Spark Connect server's class path is its own, so nothing is
    checked for it."""
    if not needed or remote or resolved_by_spark(conf):
        return None
    todo = missing()
    return missing_message(todo) if todo else None


def fetch(folder: Path = JARS_DIR) -> str | None:
    """Fetch the missing jars with ``mvn``; None on success, else why not."""
    todo = missing(folder)
    if not todo:
        return None
    mvn = shutil.which("mvn")
    if mvn is None:
        return "mvn is not installed (apt-get install maven)"
    folder.mkdir(parents=True, exist_ok=True)
    for coordinate in todo:
        cmd = [
            mvn,
            "--batch-mode",
            "--quiet",
            # The plugin by version too: a bare `dependency:copy` takes whichever
            # version the installed Maven defaults to (2.8 in Debian's 3.8.7).
            f"{DEPENDENCY_PLUGIN}:copy",
            f"-Dartifact={coordinate}",
            f"-DoutputDirectory={folder}",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        jar = jar_file(coordinate, folder)
        if done.returncode != 0 or not jar.is_file():
            lines = [ln for ln in (done.stdout + done.stderr).splitlines() if "ERROR" in ln]
            return f"mvn could not fetch {coordinate}: {lines[0] if lines else done.returncode}"
        digest = hashlib.sha256(jar.read_bytes()).hexdigest()
        if digest != SHA256[coordinate]:
            jar.unlink()
            return (
                f"{coordinate} as fetched has SHA-256 {digest}, not the locked "
                f"{SHA256[coordinate]} (daemon/spark/deltajars.py); removed it"
            )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m daemon.spark.deltajars [--config PATH]``: fetch the jars
    (with ``--config``: only if a stream of that config needs them). Fails
    only under ``CI``, whose Delta tests must run (tests/requires.py);
    elsewhere a missing jar never fails the install."""
    p = argparse.ArgumentParser(prog="python -m daemon.spark.deltajars")
    p.add_argument("--config", type=Path, help="fetch only if a stream of this config needs them")
    args = p.parse_args(argv)
    if args.config is not None:
        from daemon.config import load
        from daemon.errors import ConfigError

        try:
            cfg = load(args.config)
        except ConfigError:
            return 0  # `eventplane run` says what is wrong with it
        if not needing(cfg, DAEMON_JAR.is_file()):
            return 0
    if not missing():
        return 0
    why = fetch()
    if why is None:
        print(f"Delta Lake {DELTA_VERSION} jars in {JARS_DIR}")
        return 0
    if os.environ.get("CI"):
        print(f"error: {why}; CI runs the Delta tests, which need them", file=sys.stderr)
        return 1
    print(
        f"note: {why}; Delta streams that Spark writes are unavailable until they are fetched",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
