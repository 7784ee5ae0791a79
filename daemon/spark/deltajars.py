"""Delta Lake's jars for ``format = "delta"`` streams: which, where, how to get them.

The pyspark wheel carries no Delta Lake. ``make run`` and ``make test`` fetch
the two jars a Delta stream needs with ``mvn dependency:copy`` (Maven Central)
into ``daemon/spark/jars/delta/`` (``python -m daemon.spark.deltajars``), and
the session puts them on the driver's class path (``session.effective_conf``).
Delta Spark's other dependencies (Scala, Jackson, Hadoop, Parquet) are Spark's
own. Offline, the fetch says so and the Parquet format works as before; a
Delta stream is then refused at start with the missing artifact and the fix
(:func:`missing_message`). Users who prefer Spark's resolver set
``spark.jars.packages`` to :data:`PACKAGE` instead.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

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
JARS_DIR = Path(__file__).with_name("jars") / "delta"
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
        f"Delta Lake's jar {first} is not in {folder} (a Delta stream needs "
        f"{', '.join(ARTIFACTS)}). Fetch them with `make delta-jars` (mvn dependency:copy "
        f"-Dartifact={first} -DoutputDirectory={folder}, and the same for the others), or let "
        f'Spark resolve them: [spark.conf] "spark.jars.packages" = "{PACKAGE}"'
    )


def unavailable(streams_use_delta: bool, conf: Mapping[str, str], remote: str) -> str | None:
    """Why a configured Delta stream cannot run here (None: it can). A Spark
    Connect server's class path is its own, so nothing is checked for it."""
    if not streams_use_delta or remote or resolved_by_spark(conf):
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
            "dependency:copy",
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


def main() -> int:
    """``python -m daemon.spark.deltajars``: fetch the jars. Fails only under
    ``CI``, whose Delta tests must run (tests/requires.py); elsewhere a
    missing jar never fails the install."""
    if not missing():
        return 0
    why = fetch()
    if why is None:
        print(f"Delta Lake {DELTA_VERSION} jars in {JARS_DIR}")
        return 0
    if os.environ.get("CI"):
        print(f"error: {why}; CI runs the Delta tests, which need them", file=sys.stderr)
        return 1
    print(f"note: {why}; Delta streams are unavailable until they are fetched", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
