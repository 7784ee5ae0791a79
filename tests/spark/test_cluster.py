"""Beyond one machine, on loopback: a standalone master + worker, and Spark Connect.

Both start from the installed pyspark distribution: ``bin/spark-class`` for the
master and worker, ``bin/spark-submit`` of Spark Connect's server class (the
wheel ships its jar in ``jars/`` but no ``sbin/start-connect-server.sh``). The
executor runs in a subprocess (one SparkContext per process) and the shared
test session reads the CDC table.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port
from tests.spark.support import batch_lsns, make_batches
from tests.spark.test_crash import PER_BATCH, run_worker

pytestmark = pytest.mark.spark


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def _env(tmp: Path) -> dict[str, str]:
    return {
        **os.environ,
        "SPARK_HOME": str(spark_home()),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOG_DIR": str(tmp / "logs"),
        "SPARK_PID_DIR": str(tmp / "pids"),
        "SPARK_NO_DAEMONIZE": "1",
        "PYSPARK_PYTHON": sys.executable,
    }


def _start(
    cmd: list[str], tmp: Path, name: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        cmd,
        env={**_env(tmp), **(env or {})},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group (bash wrappers exec or fork java), then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _tail(tmp: Path) -> str:
    out = []
    for p in sorted(tmp.rglob("*.log")) + sorted((tmp / "logs").glob("*.out")):
        out.append(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}")
    return "\n".join(out)


def _wait(check: Any, timeout: float, what: str, tmp: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    pytest.fail(f"{what} not up after {timeout:.0f}s\n{_tail(tmp)}")


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def standalone(tmp_path: Path) -> Iterator[str]:
    """A Spark standalone master and one 1-core worker on 127.0.0.1."""
    home = tmp_path / "cluster"
    (home / "logs").mkdir(parents=True)
    spark_class = str(spark_home() / "bin" / "spark-class")
    port, ui, worker_ui = free_port(), free_port(), free_port()
    master = _start(
        [
            spark_class,
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--webui-port",
            str(ui),
        ],
        home,
        "master",
    )
    worker = None
    try:
        _wait(lambda: _port_open(port), 120, "standalone master", home)
        worker = _start(
            [
                spark_class,
                "org.apache.spark.deploy.worker.Worker",
                f"spark://127.0.0.1:{port}",
                "--host",
                "127.0.0.1",
                "--cores",
                "1",
                "--memory",
                "1g",
                "--webui-port",
                str(worker_ui),
                "--work-dir",
                str(home / "work"),
            ],
            home,
            "worker",
        )

        def worker_alive() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=2) as r:
                    state = json.load(r)
            except (OSError, ValueError):  # once an HTML page, as the UI had just started
                return False
            return any(w.get("state") == "ALIVE" for w in state.get("workers", []))

        _wait(worker_alive, 120, "standalone worker", home)
        yield f"spark://127.0.0.1:{port}"
    finally:
        if worker is not None:
            _stop(worker)
        _stop(master)


def test_standalone_cluster_writes_the_cdc_table_exactly_once(
    spark: Any, standalone: str, tmp_path: Path
) -> None:
    proc = run_worker(tmp_path, batches=3, master=standalone)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "committed 3" in proc.stdout
    rows = spark.read.parquet(str(tmp_path / "cdc" / "all")).select("lsn").collect()
    assert sorted(r.lsn for r in rows) == batch_lsns(make_batches(3, PER_BATCH))


# The server's main class, what Spark's sbin/start-connect-server.sh submits (the
# pyspark wheel has the class, in jars/spark-connect_2.13-*.jar, not the script).
CONNECT_SERVER = "org.apache.spark.sql.connect.service.SparkConnectServer"


def _start_connect(home: Path, port: int, name: str = "connect") -> subprocess.Popen[bytes]:
    """The server in the foreground, as ``start-connect-server.sh --wait`` runs it:
    ``spark-submit`` knows the class and needs no application jar; Spark's
    daemon scripts set ``SPARK_CONNECT_MODE=0`` so that a value inherited from
    the environment cannot make the server's own session a Connect client."""
    (home / "logs").mkdir(parents=True, exist_ok=True)
    server = _start(
        [
            str(spark_home() / "bin" / "spark-submit"),
            "--class",
            CONNECT_SERVER,
            "--name",
            "Spark Connect server",
            "--master",
            "local[1]",
            "--conf",
            f"spark.connect.grpc.binding.port={port}",
            "--conf",
            "spark.connect.grpc.binding.address=127.0.0.1",
            "--conf",
            "spark.ui.enabled=false",
            "--conf",
            "spark.sql.session.timeZone=UTC",
        ],
        home,
        name,
        {"SPARK_CONNECT_MODE": "0"},
    )
    _wait(lambda: _port_open(port), 180, "Spark Connect server", home)
    return server


@pytest.fixture
def connect_server(tmp_path: Path) -> Iterator[str]:
    """The distribution's Spark Connect server (local[1]) on 127.0.0.1 only."""
    port = free_port()
    server = _start_connect(tmp_path / "connect", port)
    try:
        yield f"sc://127.0.0.1:{port}"
    finally:
        _stop(server)


def test_spark_connect_server_writes_the_cdc_table_exactly_once(
    spark: Any, connect_server: str, tmp_path: Path
) -> None:
    proc = run_worker(tmp_path, batches=3, remote=connect_server)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "committed 3" in proc.stdout
    rows = spark.read.parquet(str(tmp_path / "cdc" / "all")).select("lsn").collect()
    assert sorted(r.lsn for r in rows) == batch_lsns(make_batches(3, PER_BATCH))


@pytest.mark.timeout(900)
def test_restarted_spark_connect_server_is_used_again_and_cdc_stays_exactly_once(
    spark: Any, tmp_path: Path
) -> None:
    """1. An executor on a Connect server commits batch 1.
    2. The server is stopped and a new one started on the same port: it knows
       nothing of the client's session.
    3. Batch 2 fails, the executor sees the session is gone, builds a new one
       on the new server, and batches 2-3 commit; the table holds each row once."""
    home, port = tmp_path / "connect", free_port()
    server = _start_connect(home, port)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env["PYSPARK_PYTHON"] = sys.executable
    cmd = [sys.executable, "-m", "tests.spark.crash_worker", str(tmp_path), "--batches", "3",
           "--per-batch", str(PER_BATCH), "--remote", f"sc://127.0.0.1:{port}",
           "--pause-before", "2", "--retries", "20"]  # fmt: skip
    worker = subprocess.Popen(
        cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        assert worker.stdout is not None
        lines: list[str] = []
        for raw in worker.stdout:
            lines.append(raw.decode(errors="replace").rstrip())
            if lines[-1] == "paused 2":
                break
        assert "committed 1" in lines, "\n".join(lines[-40:])
        _stop(server)  # Step 2. A new server, the same address.
        server = _start_connect(home, port, "connect-2")
        out, _ = worker.communicate(b"go\n", timeout=600)
        lines += out.decode(errors="replace").splitlines()
    finally:
        if worker.poll() is None:
            worker.kill()
        _stop(server)
    text = "\n".join(lines[-60:])
    assert worker.returncode == 0, text
    assert "committed 3" in lines, text
    assert any(line.startswith("failed 2 attempt") for line in lines), text  # it did fail
    rows = spark.read.parquet(str(tmp_path / "cdc" / "all")).select("lsn").collect()
    assert sorted(r.lsn for r in rows) == batch_lsns(make_batches(3, PER_BATCH))
