"""What a test needs from the machine: outside CI a test without it skips and
says why; with ``CI`` set (``.ci/run`` installs all of it) it fails, naming
what is missing, so a CI run cannot pass without running the test."""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest


def missing(what: str, fix: str) -> NoReturn:
    """Skip the test (fail it under ``CI``): ``what`` is not on this machine."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing, and CI must run this test: {fix}", pytrace=False)
    # Outside CI only: a developer's machine may lack a tool; CI never skips.
    pytest.skip(f"needs {what}: {fix}")


def command(name: str, fix: str) -> str:
    """The path of the executable ``name``."""
    path = shutil.which(name)
    if path is None:
        missing(f"the {name} command", fix)
    return path


def delta_jars() -> None:
    """Delta Lake's jars for the session (daemon/spark/deltajars.py)."""
    from daemon.spark import deltajars

    todo = deltajars.missing()
    if todo:
        missing(f"Delta Lake's jars ({', '.join(todo)})", "make delta-jars (mvn)")


def daemon_jar(reason: str | None) -> None:
    """The daemon's jar (jvm/), which make builds where javac exists; ``reason``
    is why the session cannot load it (None: it can)."""
    if reason is not None:
        missing("the daemon's jar", f"{reason}; make jar (javac: openjdk-17-jdk-headless)")
