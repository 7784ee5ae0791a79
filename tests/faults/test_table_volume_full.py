"""A CDC stream whose volume is full holds back only itself, health says so,
and it catches up exactly once when space returns (invariants 6, 7, 14).

Scenario (a real daemon, real Spark, real HTTP, a real size-limited tmpfs):
1. Two streams: ``good`` on the test's disk, ``small`` on a 32 MiB tmpfs;
   ``[health] stall_after_s = 3``. Events flow into both.
2. The tmpfs is filled to the last byte; producers keep posting.
3. ``good`` keeps committing every acknowledged event; ``small`` fails and
   falls behind; within stall_after_s + a few seconds /healthz answers 503
   naming ``cdc:small``, ``eventplane status`` exits 1, the stage's metric is
   stalled, and the WAL keeps what ``small`` still needs.
4. The filler is removed: ``small`` catches up by itself, health clears.
5. After a clean stop, each table holds every acknowledged event exactly once.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.faults.support import fill, healthz, metric, spark_config, stage, tmpfs, wait_for
from tests.integration.harness import ROOT, DaemonProcess, Loader

STALL_AFTER_S = 3.0
pytestmark = [pytest.mark.spark, pytest.mark.crash]


def _config(tmp_path: Path, small: Path) -> Path:
    streams = {"good": tmp_path / "cdc" / "good", "small": small / "cdc"}
    return spark_config(tmp_path, streams, stall_after_s=STALL_AFTER_S)


def _lsns(spark: Any, path: Path) -> Counter[int]:
    rows = spark.read.parquet(str(path)).select("lsn").collect()
    return Counter(r.lsn for r in rows)


@pytest.mark.timeout(600)
def test_full_table_volume_stalls_only_its_stream_and_it_catches_up_exactly_once(
    tmp_path: Path, spark: Any
) -> None:
    with tmpfs(tmp_path / "small", size="32m") as small:
        daemon = DaemonProcess.production(_config(tmp_path, small))
        daemon.start(timeout_s=120)
        try:
            wait_for("spark ready", lambda: daemon.status()["spark"]["ready"], 180, daemon)
            loader = Loader(daemon.ingest_url, batch=100, producers=2, pause_s=0.1)
            loader.start()
            # Step 1. Both streams commit.
            wait_for(
                "both streams commit",
                lambda: all(
                    stage(daemon.status(), s)["batch_id"] > 0 for s in ("cdc:good", "cdc:small")
                ),
                120,
                daemon,
            )
            # Step 2. The small volume fills up.
            filler = fill(small)
            full_since = time.monotonic()
            # Step 3. Health reports the stalled stage; the good one keeps going.
            code, body = wait_for(
                "healthz reports cdc:small",
                lambda: (lambda h: h if h[0] == 503 else None)(healthz(daemon)),
                STALL_AFTER_S + 60,
                daemon,
            )
            reported_after = time.monotonic() - full_since
            assert [p.get("stage") for p in body["problems"]] == ["cdc:small"]
            assert "No space left on device" in body["message"], body["message"]
            status = daemon.status()
            assert status["healthy"] is False and not status["needs_restart"]
            assert stage(status, "cdc:good")["failing"] is False
            behind = stage(status, "cdc:small")
            assert behind["stalled"] and behind["behind_batches"] >= 1
            assert metric(daemon, 'eventplane_stage_stalled{stage="cdc:small"}') == 1.0
            assert metric(daemon, 'eventplane_stage_stalled{stage="cdc:good"}') == 0.0
            assert metric(daemon, "eventplane_healthy") == 0.0
            cli = subprocess.run(
                [sys.executable, "-m", "daemon.cli.main", "status", "--url", daemon.admin_url],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=False,
            )
            assert cli.returncode == 1, cli.stdout + cli.stderr
            assert "cdc:small" in cli.stdout and "STALLED" in cli.stdout
            # The good stream keeps committing while the small one is stalled.
            before = stage(daemon.status(), "cdc:good")["batch_id"]
            wait_for(
                "cdc:good keeps committing",
                lambda: stage(daemon.status(), "cdc:good")["batch_id"] > before + 2,
                60,
                daemon,
            )
            # The WAL keeps everything the small stream has not committed.
            st = daemon.status()
            assert st["wal"]["retained_floor"] <= min(c["watermark"] for c in st["cores"]) + 1

            # Step 4. Space returns: the stage catches up by itself, health clears.
            loader.stop()
            filler.unlink()
            wait_for("healthz clears", lambda: healthz(daemon)[0] == 200, 120, daemon)
            wait_for(
                "cdc:small catches up",
                lambda: (
                    stage(daemon.status(), "cdc:small")["behind_batches"] == 0
                    and all(c["lag"] == 0 for c in daemon.status()["cores"])
                ),
                120,
                daemon,
            )
        finally:
            code = daemon.stop()
        assert code == 0, daemon.tail()

        # Step 5. Every acknowledged event exactly once in each table.
        acked = loader.acked_lsns()
        assert acked
        for path in (tmp_path / "cdc" / "good", small / "cdc"):
            seen = _lsns(spark, path)
            assert set(seen) == acked, path
            assert max(seen.values()) == 1, path
        print(f"health reported the full volume after {reported_after:.1f} s")
