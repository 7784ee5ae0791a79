"""The production daemon with Spark, SIGKILLed under load: CDC stays exactly-once.

Scenario (one data dir throughout):
1. For each named crash point in the CDC commit and the executor, start the
   daemon with ``EVENTPLANE_CRASH_AT=<point>@2`` (one batch commits first),
   post events from 4 producers until the daemon kills itself there.
2. Then SIGKILL it at random moments under load, enough times to reach
   ``KILLS`` in all.
3. Start it once more without load, wait until every core's watermark
   reaches the WAL head (every batch committed), stop it with SIGTERM.
4. ``spark.read.parquet(path)`` holds every acknowledged event exactly once,
   every WAL LSN exactly once and nothing else; per key, LSNs grow with
   batch_id.

The same for a Delta stream (``format = "delta"``, its own crash points, read
with ``spark.read.format("delta")``), with fewer kills in CI.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from daemon.table.crash import COMMIT_CRASH_POINTS, DELTA_CRASH_POINTS
from tests import requires
from tests.integration.harness import DaemonProcess, Loader, write_config
from tests.integration.test_crash_recording import _wait_caught_up

# Daemon lifetimes per format, named crash points included (a Parquet one takes
# about 8 s, a Delta one 14 s): in CI each named point and one random moment
# (7 + 1 and 5 + 1); `make soak` (--soak) runs SOAK_KILLS.
KILLS = {"parquet": 8, "delta": 6}
SOAK_KILLS = {"parquet": 40, "delta": 16}
CRASH_POINTS = {"parquet": COMMIT_CRASH_POINTS, "delta": DELTA_CRASH_POINTS}
# Paced producers (~16k events/s): the point is to hit commit steps with
# batches in flight, not to pile up a backlog Spark needs minutes to clear.
PAUSE_S = 0.05


def _wait_spark_ready(daemon: DaemonProcess, timeout_s: float = 120.0) -> None:
    """Return once Spark is ready, or once the daemon has died: a daemon that
    restarts with a backlog runs its first batch as soon as Spark is ready, and
    may reach its crash point before this poll sees "ready" (the caller checks
    how it died)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert daemon.proc is not None
        try:
            if daemon.status()["spark"]["ready"]:
                return
        except OSError:
            if daemon.proc.poll() is not None:
                return
            raise
        time.sleep(0.1)
    raise TimeoutError("Spark did not become ready:\n" + daemon.tail())


def _config(tmp_path: Path, table_format: str = "parquet") -> Path:
    table = tmp_path / "cdc" / "all"
    extra = f"""
[spark]
master = "local[2]"
log_level = "ERROR"

[spark.conf]
"spark.sql.shuffle.partitions" = "2"

[[cdc.streams]]
name = "all"
collections = "*"
path = "{table}"
format = "{table_format}"
"""
    return write_config(tmp_path, cores=4, interval_ms=200, extra=extra)


@pytest.mark.spark
@pytest.mark.crash
# Each daemon lifetime boots Spark (5-40 s depending on machine load).
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("table_format", ["parquet", "delta"])
def test_sigkill_at_commit_steps_and_random_points_keeps_cdc_exactly_once(
    tmp_path: Path, spark: Any, table_format: str, request: pytest.FixtureRequest
) -> None:
    if table_format == "delta":
        requires.delta_jars()
    rng = random.Random(4)
    config = _config(tmp_path, table_format)
    acked: set[int] = set()
    kills = 0

    # Step 1. Each named crash point, reached by the second batch.
    # The batch commit (compaction and retention: tests/spark). Setting rows aside
    # needs a row the writer refuses, which ingest never takes: tests/spark/test_crash.py.
    for point in (p for p in CRASH_POINTS[table_format] if p != "cdc.after_quarantine"):
        daemon = DaemonProcess.production(config, env={"EVENTPLANE_CRASH_AT": f"{point}@2"})
        daemon.start(timeout_s=120)
        _wait_spark_ready(daemon)
        loader = Loader(daemon.ingest_url, batch=200, producers=4, pause_s=PAUSE_S)
        loader.start()
        try:
            rc = daemon.wait(timeout_s=120)
        finally:
            loader.stop()
        assert rc == -9, f"{point}: expected death by SIGKILL, got {rc}\n{daemon.tail()}"
        assert f"crash point {point} reached" in daemon.log_path.read_text()
        acked |= loader.acked_lsns()
        kills += 1

    # Step 2. Random moments, with Spark up and batches in flight.
    budget = (SOAK_KILLS if request.config.getoption("--soak") else KILLS)[table_format]
    while kills < budget:
        daemon = DaemonProcess.production(config).start(timeout_s=120)
        _wait_spark_ready(daemon)
        loader = Loader(daemon.ingest_url, batch=200, producers=4, pause_s=PAUSE_S)
        loader.start()
        time.sleep(rng.uniform(0.3, 2.0))
        daemon.kill()
        loader.stop()
        acked |= loader.acked_lsns()
        kills += 1
    assert len(acked) > 2_000, "the load was too light to prove anything"

    # Step 3. Recover and let every batch commit.
    daemon = DaemonProcess.production(config).start(timeout_s=120)
    head = _wait_caught_up(daemon, timeout_s=180)
    assert daemon.stop() == 0, daemon.tail()

    # Step 4. What a plain reader sees (aggregates in Spark; only LSNs come back).
    table = tmp_path / "cdc" / "all"
    df = spark.read.format(table_format).load(str(table))
    dupes = df.groupBy("lsn").count().filter("count > 1").limit(10).collect()
    assert not dupes, f"duplicated LSNs in the CDC table: {dupes}"
    lsns = set(df.select("lsn").toArrow().column("lsn").to_pylist())
    assert not (acked - lsns), f"acked but missing: {sorted(acked - lsns)[:10]}"
    assert lsns == set(range(1, head + 1))
    out_of_order = spark.sql(
        f"""
        SELECT count(*) AS n FROM (
          SELECT lsn, lag(lsn) OVER (PARTITION BY collection, key ORDER BY batch_id, lsn) AS prev
          FROM {table_format}.`{table}`
        ) WHERE prev > lsn
        """
    ).first()
    assert out_of_order is not None and out_of_order.n == 0, "per-key LSNs go back with batch_id"
