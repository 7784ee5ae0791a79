"""``eventplane setup [--delta]``: add the optional parts an installed daemon lacks.

1. The daemon's jar (daemon/spark/jarbuild.py): built with ``javac`` when it is
   missing or older than its sources; a wheel built on a machine with ``javac``
   carries it already.
2. Delta Lake's jars (daemon/spark/deltajars.py), fetched with ``mvn`` and
   checked against their SHA-256, when the config's streams need them or
   ``--delta`` asks.

Each part gets one line: what was there, what was done, or what to install.
Exit 0 when every part that is needed is there, 1 otherwise. The daemon's
start-up log and ``eventplane status`` name a missing part with this command.
"""

from __future__ import annotations

import sys
from typing import TextIO

from daemon.config import Config
from daemon.spark import deltajars, jarbuild


def _jar_line(out: TextIO) -> bool:
    jar = jarbuild.JAR
    if not jarbuild.outdated():
        size = jar.stat().st_size // 1024
        print(f"daemon jar: {jar} ({size} KiB), up to date", file=out)
        return True
    try:
        took = jarbuild.build()
    except jarbuild.JarBuildError as exc:
        print(f"daemon jar: not built: {exc}", file=out)
        return False
    print(f"daemon jar: built {jar} in {took:.1f} s", file=out)
    return True


def _delta_line(needed: bool, out: TextIO) -> bool:
    todo = deltajars.missing()
    if not todo:
        print(f"Delta Lake jars: {deltajars.JARS_DIR}, version {deltajars.DELTA_VERSION}", file=out)
        return True
    if not needed:
        print(
            "Delta Lake jars: not needed by this config (`eventplane setup --delta` fetches them)",
            file=out,
        )
        return True
    why = deltajars.fetch()
    if why is not None:
        print(f"Delta Lake jars: not fetched: {why}", file=out)
        return False
    print(f"Delta Lake jars: fetched {deltajars.DELTA_VERSION} into {deltajars.JARS_DIR}", file=out)
    return True


def needs_delta_jars(cfg: Config) -> bool:
    """Whether the daemon started on ``cfg`` would load Delta Lake's jars."""
    from daemon.spark.executor import delta_needs

    return bool(delta_needs(cfg))


def main(cfg: Config, delta: bool, out: TextIO = sys.stdout) -> int:
    ok = _jar_line(out)
    ok = _delta_line(delta or needs_delta_jars(cfg), out) and ok
    return 0 if ok else 1
