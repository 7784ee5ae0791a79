"""The shipped config.toml on a fresh clone: a Delta table, no Delta jar.

One scenario (``fresh_clone_run``, run once for the module), then what it proves:

1. The shipped ``config.toml`` (its ports free, the warm-up write off), plus a
   second stream with ``variant = true``, which needs Delta Lake's jars;
   ``EVENTPLANE_DELTA_JARS`` points at an empty folder, as on a fresh clone.
2. A daemon under load, SIGKILLed once the default stream has committed.
3. A second daemon: more load, then every acknowledged event committed by the
   default stream; the variant stream fails alone, its error naming the fix.
4. The readers: delta-rs, Polars and DuckDB (over delta-rs) without a JVM,
   and Spark with the Delta jars, each see every acknowledged event once.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port
from tests.integration.harness import ROOT, DaemonProcess, Loader
from tests.integration.test_cdc_crash import _wait_spark_ready

pytestmark = [pytest.mark.spark, pytest.mark.crash]

VARIANT_STREAM = """
[[cdc.streams]]
name = "wide"
collections = "*"
path = "var/cdc/wide"
variant = true
"""


def _stage(daemon: DaemonProcess, stream: str) -> dict[str, Any]:
    stages = daemon.status()["stages"]
    return next(s for s in stages if s["name"] == f"cdc:{stream}")


def _wait(what: str, done: Any, daemon: DaemonProcess, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}:\n{daemon.tail()}")
        time.sleep(0.1)


def _jvm_cmdline(root: int) -> str:
    """The command line of the daemon's JVM (a descendant running java)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "java" in cmd.split("\0")[0]:
            return cmd.replace("\0", " ")
        todo.extend(children.get(pid, ()))
    raise AssertionError("no JVM under the daemon")


@pytest.fixture(scope="module")
def fresh_clone_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("fresh-clone")
    # Step 1. The shipped config, on free ports, without the warm-up write.
    text = (ROOT / "config.toml").read_text()
    text = text.replace("127.0.0.1:8470", f"127.0.0.1:{free_port()}")
    text = text.replace("127.0.0.1:9470", f"127.0.0.1:{free_port()}")
    text = re.sub(r"(?m)^warmup_rows = \d+", "warmup_rows = 0", text)
    assert 'format = "parquet"' not in text
    config = tmp / "config.toml"
    config.write_text(text + VARIANT_STREAM)
    (tmp / "no-jars").mkdir()
    env = {"EVENTPLANE_DELTA_JARS": str(tmp / "no-jars")}

    # Step 2. Load, then SIGKILL once the default stream has committed.
    daemon = DaemonProcess.production(config, env=env).start(timeout_s=120)
    _wait_spark_ready(daemon)
    loader = Loader(daemon.ingest_url, batch=200, producers=2, pause_s=0.05)
    loader.start()
    try:
        _wait(
            "no commit of the default stream",
            lambda: _stage(daemon, "all")["batch_id"] >= 2,
            daemon,
        )
    finally:
        daemon.kill()
        loader.stop()
    acked = loader.acked_lsns()

    # Step 3. A second daemon: more load, then everything committed.
    daemon = DaemonProcess.production(config, env=env).start(timeout_s=120)
    _wait_spark_ready(daemon)
    loader = Loader(daemon.ingest_url, batch=200, producers=2, pause_s=0.05)
    loader.start()
    time.sleep(1.0)
    loader.stop()
    acked |= loader.acked_lsns()
    head = daemon.status()["wal"]["head_lsn"]
    ledger = tmp / "var" / "cdc" / "all" / "_eventplane" / "ledger.json"
    # LSNs are dense from 1: the default stream holds them all once its rows reach head.
    _wait(
        "the default stream did not catch up",
        lambda: (
            json.loads(ledger.read_bytes())["rows_total"] >= head
            and _stage(daemon, "wide")["attempts"]
        ),
        daemon,
    )
    run = {
        "table": tmp / "var" / "cdc" / "all",
        "acked": acked,
        "head": head,
        "wide": _stage(daemon, "wide"),
        "jvm": _jvm_cmdline(daemon.proc.pid if daemon.proc else 0),
        "log": "",
    }
    assert daemon.stop() == 0, daemon.tail()
    run["log"] = daemon.log_path.read_text()
    return run


def _check_once(lsns: list[int], run: dict[str, Any], reader: str) -> None:
    assert len(lsns) == len(set(lsns)), f"{reader}: duplicated LSNs"
    assert not (run["acked"] - set(lsns)), f"{reader}: acked but missing"
    assert set(lsns) == set(range(1, run["head"] + 1)), reader


def test_the_default_stream_needs_no_delta_jar_and_reads_exactly_once_without_a_jvm(
    fresh_clone_run: dict[str, Any],
) -> None:
    import duckdb
    import polars as pl
    from deltalake import DeltaTable

    run = fresh_clone_run
    assert len(run["acked"]) > 1000, "the load was too light to prove anything"
    assert "delta-spark" not in run["jvm"] and "DeltaSparkSessionExtension" not in run["jvm"]
    assert not any((Path(run["table"]).parent.parent.parent / "no-jars").iterdir())
    dt = DeltaTable(str(run["table"]))
    _check_once(dt.to_pyarrow_table(columns=["lsn"]).column("lsn").to_pylist(), run, "delta-rs")
    _check_once(pl.read_delta(str(run["table"]), columns=["lsn"])["lsn"].to_list(), run, "Polars")
    dataset = dt.to_pyarrow_dataset()  # noqa: F841  (DuckDB reads the Python variable)
    rows = duckdb.sql("SELECT lsn FROM dataset").fetchall()
    _check_once([r[0] for r in rows], run, "DuckDB")


def test_spark_with_delta_jars_reads_the_same_table_exactly_once(
    fresh_clone_run: dict[str, Any], spark: Any
) -> None:
    from tests.requires import delta_jars

    delta_jars()  # under CI a missing jar fails the test (tests/requires.py)
    df = spark.read.format("delta").load(str(fresh_clone_run["table"]))
    _check_once(df.select("lsn").toArrow().column("lsn").to_pylist(), fresh_clone_run, "Spark")


def test_a_stream_that_needs_delta_jars_fails_alone_naming_the_fix(
    fresh_clone_run: dict[str, Any],
) -> None:
    wide = fresh_clone_run["wide"]
    assert wide["batch_id"] == 0 and wide["failing"], wide
    error = wide["last_error"]
    assert "stream 'wide' needs Delta Lake's jars (variant = true" in error, error
    assert "make delta-jars" in error and "spark.jars.packages" in error, error
    assert '"event": "cdc_stream_needs_delta_jars"' in fresh_clone_run["log"]
