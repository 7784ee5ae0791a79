"""Shared fixtures: the --soak flag, a session-scoped real SparkSession, free ports."""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The S3 server fixture (SeaweedFS on loopback) for tests/s3 and the Delta tests on S3.
pytest_plugins = ("tests.s3.server",)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", help="run long soak and crash loops")


# The files that run long, in the order they start under pytest-xdist: whole
# daemons, injected faults, then the other crash tests and the benchmarks'
# smoke runs (each boots daemons and JVMs for tens of seconds), so the quick
# files fill the gaps at the end instead of a long file starting last.
def _start_rank(item: pytest.Item) -> int:
    path = item.path.as_posix()
    if "/tests/integration/" in path:
        return 0
    if "/tests/faults/" in path:
        return 1
    if "crash" in item.keywords or path.endswith("_smoke.py"):
        return 2
    return 3


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its order is the schedule
        # pytest-xdist (`make test`: `-n 3 --dist loadfile --no-loadscope-reorder`)
        # hands out whole files in the workers' collection order (without
        # reordering them by their number of tests): the files that run long go
        # first. A stable sort, so each file keeps its own order; every worker
        # sorts alike.
        rank: dict[Path, int] = {}
        for item in items:
            rank[item.path] = min(rank.get(item.path, 3), _start_rank(item))
        items.sort(key=lambda item: rank[item.path])
    if config.getoption("--soak"):
        return
    skip = pytest.mark.skip(reason="soak test: run with --soak (make soak)")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _class_data_archive(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """The run's class data sharing archive for its daemons' JVMs (tests/cds.py):
    the first worker of a large run records it in the folder every worker
    shares, and the others wait for it."""
    from tests import cds

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    os.environ[cds.ENV] = str(root)
    if len(request.session.items) >= cds.MIN_TESTS:
        recorder = cds.Recorder(root)
        error = recorder.record() if recorder.claim() else cds.wait(root)
        if error:
            print(f"\nno class data sharing archive for the test daemons: {error}")
    yield


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The run's last lines count its skips: only the soak tests may skip
    (under ``CI`` a missing tool fails its test instead, tests/requires.py)."""
    skipped = terminalreporter.stats.get("skipped", [])
    soak = sum(1 for report in skipped if "soak" in report.keywords)
    others = len(skipped) - soak
    terminalreporter.write_line(f"skipped: {len(skipped)} ({soak} soak-only, {others} other)")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (where connect() and
    bind to port 0 take theirs)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# The tests' listeners take their ports from below the ephemeral range, so no
# outgoing connection (Spark's, an S3 client's, a test's) can take a port in
# the seconds between free_port() and the bind (a daemon binds its ingest
# listener after its Spark session is up). Each xdist worker has a slice of
# its own and goes round it in order; a port something listens on is skipped.
PORTS_PER_WORKER = 1_500
_PORTS_END = _ephemeral_low()
_SLICES = (_PORTS_END - 10_000) // PORTS_PER_WORKER  # none under port 10,000
_handed = itertools.count()


def _worker_index() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(worker[2:]) if worker[2:].isdigit() else 0


def free_port() -> int:
    """A loopback TCP port nothing listens on, for a listener a test starts."""
    if _SLICES < 1:  # an unusual ephemeral range: the kernel's choice
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    first = _PORTS_END - (_worker_index() % _SLICES + 1) * PORTS_PER_WORKER
    for _ in range(PORTS_PER_WORKER):
        port = first + next(_handed) % PORTS_PER_WORKER
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}-{first + PORTS_PER_WORKER - 1}")


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
