"""The daemon's jar: built from its Java sources with ``javac``, wherever those are.

The jar (``session.HADOOP_JAR``) holds the local file system of the CDC
staging writes, the raw inbox reader, the direct write of a batch and the
writers' payload check (docs/design.md, "Where each step lives", ``jvm/``). It is optional:
without it the daemon works, slower per batch and without a quarantine, and
says so at start and in ``eventplane status``.

Three callers build it, with one function (:func:`build`):

1. ``make`` (``scripts/build-jar.sh``) in a checkout, from ``jvm/src``;
2. the wheel's build (``setup.py``), which also ships the sources in the
   wheel (``daemon/spark/jvm``), so that
3. ``eventplane setup`` can build it after ``pip install`` of a wheel that
   was built without ``javac``.

The class path is pyspark's own jars folder: the jar runs in the JVM of the
pyspark it was built against (pyspark is pinned, ``requirements.lock``).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
JAR = HERE / "jars" / "eventplane-hadoop.jar"
# The sources as a wheel ships them, and as a checkout has them.
INSTALLED_SOURCES = HERE / "jvm"
CHECKOUT_SOURCES = HERE.parent.parent / "jvm" / "src"
# Spark 4 runs on Java 17+: class files for 17 load on every JVM it runs on.
JAVA_RELEASE = "17"
JDK_FIX = "apt-get install openjdk-17-jdk-headless (or any JDK 17+ with javac)"


class JarBuildError(Exception):
    """The jar could not be built; the message says why and what to do."""


def sources() -> Path | None:
    """The folder of the ``.java`` files: a checkout's, else the installed copy."""
    for folder in (CHECKOUT_SOURCES, INSTALLED_SOURCES):
        if folder.is_dir() and any(folder.rglob("*.java")):
            return folder
    return None


def pyspark_jars() -> Path:
    import pyspark  # only a build needs it

    return Path(pyspark.__file__).parent / "jars"


def outdated(jar: Path = JAR) -> bool:
    """The jar is missing, or (in a checkout) a source is newer than it. An
    installer's file times say nothing of which was built first: an installed
    jar is as new as the sources it came with."""
    if not jar.is_file():
        return True
    if not CHECKOUT_SOURCES.is_dir():
        return False
    built = jar.stat().st_mtime
    return any(f.stat().st_mtime > built for f in CHECKOUT_SOURCES.rglob("*.java"))


def build(out: Path = JAR, src: Path | None = None) -> float:
    """Compile ``src`` into ``out`` (replaced atomically); the seconds it took.

    Raises :class:`JarBuildError` when ``javac`` or ``jar`` is missing, there
    are no sources, or the compiler fails (its first error lines included).
    """
    started = time.monotonic()
    src = sources() if src is None else src
    if src is None:
        raise JarBuildError(
            f"no Java sources in {CHECKOUT_SOURCES} or {INSTALLED_SOURCES}: "
            "reinstall eventplane from its wheel or a checkout"
        )
    javac, jar = shutil.which("javac"), shutil.which("jar")
    if javac is None or jar is None:
        raise JarBuildError(f"javac not found: {JDK_FIX}, then run `eventplane setup`")
    files = sorted(str(f) for f in src.rglob("*.java"))
    with tempfile.TemporaryDirectory(prefix="eventplane-jar-") as tmp:
        classes = Path(tmp) / "classes"
        cmd = [javac, "-nowarn", "--release", JAVA_RELEASE, "-cp", f"{pyspark_jars()}/*"]
        compiled = subprocess.run(
            [*cmd, "-d", str(classes), *files],
            capture_output=True,
            text=True,
            check=False,
        )
        if compiled.returncode != 0:
            lines = (compiled.stderr or compiled.stdout).strip().splitlines()[:5]
            raise JarBuildError(f"javac failed on {src}: " + " | ".join(lines))
        staged = Path(tmp) / "out.jar"
        packed = subprocess.run(
            [jar, "--create", "--file", str(staged), "-C", str(classes), "."],
            capture_output=True,
            text=True,
            check=False,
        )
        if packed.returncode != 0:
            raise JarBuildError(f"jar failed: {packed.stderr.strip()}")
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staged), str(out))
    return time.monotonic() - started


def main() -> int:
    """``python -m daemon.spark.jarbuild``: build when outdated; never fails make."""
    import sys

    if not outdated():
        return 0
    try:
        took = build()
    except JarBuildError as exc:
        print(f"note: {exc}; {JAR} not built (CDC staging writes will fork chmod)", file=sys.stderr)
        return 0
    print(f"built {JAR} in {took:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
