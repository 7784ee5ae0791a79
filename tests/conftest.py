"""Shared fixtures: the --soak flag, a session-scoped real SparkSession, free ports."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest

# The S3 server fixture (SeaweedFS on loopback) for tests/s3 and the Delta tests on S3.
pytest_plugins = ("tests.s3.server",)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", help="run long soak and crash loops")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--soak"):
        return
    skip = pytest.mark.skip(reason="soak test: run with --soak (make soak)")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The run's last lines count its skips: only the soak tests may skip
    (under ``CI`` a missing tool fails its test instead, tests/requires.py)."""
    skipped = terminalreporter.stats.get("skipped", [])
    soak = sum(1 for report in skipped if "soak" in report.keywords)
    others = len(skipped) - soak
    terminalreporter.write_line(f"skipped: {len(skipped)} ({soak} soak-only, {others} other)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One real local SparkSession for the whole test session (slow to start)."""
    os.environ.setdefault("PYSPARK_PYTHON", os.sys.executable)  # type: ignore[attr-defined]
    from daemon.spark import deltajars
    from daemon.spark.session import build_session  # only Spark tests pay for it

    session = build_session(
        master="local[2]",
        app_name="eventplane-tests",
        ui=False,
        log_level="ERROR",
        conf={"spark.sql.shuffle.partitions": "2"},
        # Delta Lake when its jars were fetched (tests/spark/test_delta.py skips otherwise).
        delta=not deltajars.missing(),
    )
    yield session
    session.stop()
