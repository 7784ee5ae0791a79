"""A CDC stream added to a running data_dir with ``start = "earliest"`` fills
from the retained WAL while live traffic flows, survives a SIGKILL mid-way,
and ends with every LSN exactly once (docs/cdc.md, "Adding a stream: backfill";
invariants 6, 7, 9).

Scenario (a real daemon, real Spark in ``local[2]``, real HTTP load):
1. Stream a alone, under load, with ``wal.retention = "keep"`` so that LSN 1 is
   still in the WAL when b comes; then a clean stop (the load goes on, refused).
2. Restart with stream b (``start = "earliest"``, ``microbatch.max_rows = 500``
   so its backfill takes many chunks) and retention back to "watermarks":
   b is reported backfilling (not failing, not stalled) with its progress,
   a keeps committing, the WAL keeps LSN 1 for b although every watermark is
   far above it.
3. SIGKILL mid-backfill; the watermarks file holds the backfill.
4. Restart: b resumes after its last committed chunk, finishes, joins the live
   batches; load stops, everything commits.
5. Each table holds every LSN from 1 to the head exactly once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.faults.support import metric, spark_config, stage, wait_for
from tests.integration.harness import ROOT, DaemonProcess, Loader

pytestmark = [pytest.mark.spark, pytest.mark.crash]

FIRST_RUN_EVENTS = 12_000


def _lsns(spark: Any, path: Path) -> Counter[int]:
    return Counter(r.lsn for r in spark.read.parquet(str(path)).select("lsn").collect())


def _events(daemon: DaemonProcess, name: str) -> list[dict[str, Any]]:
    out = []
    for line in daemon.log_path.read_text(errors="replace").splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("event") == name:
            out.append(doc)
    return out


@pytest.mark.timeout(900)
def test_new_stream_backfills_from_earliest_across_sigkill_exactly_once_while_a_runs(
    tmp_path: Path, spark: Any
) -> None:
    a, b = tmp_path / "cdc" / "a", tmp_path / "cdc" / "b"
    config = spark_config(tmp_path, {"a": a})
    first = config.read_text()
    config.write_text(first.replace("[wal]\n", '[wal]\nretention = "keep"\n', 1))
    daemon = DaemonProcess.production(config)
    daemon.start(timeout_s=120)
    loader = Loader(daemon.ingest_url, batch=100, producers=2, pause_s=0.05)
    try:
        # Step 1. a alone, under load.
        wait_for("spark ready", lambda: daemon.status()["spark"]["ready"], 180, daemon)
        loader.start()
        wait_for(
            f"{FIRST_RUN_EVENTS} events committed by a",
            lambda: min(c["watermark"] for c in daemon.status()["cores"]) > FIRST_RUN_EVENTS,
            240,
            daemon,
        )
        assert daemon.stop() == 0, daemon.tail()

        # Step 2. b added, start = "earliest"; retention on again.
        second = first.replace("interval_ms = 200\n", "interval_ms = 200\nmax_rows = 500\n", 1)
        second += f'\n[[cdc.streams]]\nname = "b"\ncollections = "*"\npath = "{b}"\n'
        second += 'format = "parquet"\n'
        second += 'start = "earliest"\n'
        config.write_text(second)
        daemon = DaemonProcess.production(config)
        daemon.start(timeout_s=120)
        wait_for("spark ready again", lambda: daemon.status()["spark"]["ready"], 180, daemon)
        filling = wait_for(
            "b has committed a backfill chunk",
            lambda: (
                (st := stage(daemon.status(), "cdc:b"))["backfilling"]
                and st["backfill"]["events_done"] > 0
                and st
            ),
            120,
            daemon,
        )
        assert not filling["failing"] and not filling["stalled"], filling
        bf = filling["backfill"]
        assert bf["start_lsn"] == 1 and bf["events_total"] > FIRST_RUN_EVENTS, bf
        assert bf["events_remaining"] > 0, "the backfill ended before the SIGKILL"
        status = daemon.status()
        # Retention keeps what b still has to read, far below every watermark.
        nxt = stage(status, "cdc:b")["backfill"]["next_lsns"]
        assert status["wal"]["retained_floor"] <= min(nxt), (status["wal"], nxt)
        assert min(c["watermark"] for c in status["cores"]) > FIRST_RUN_EVENTS
        remaining = metric(daemon, 'eventplane_stage_backfill_remaining_events{stage="cdc:b"}')
        assert remaining is not None and remaining > 0
        shown = subprocess.run(
            [sys.executable, "-m", "daemon.cli.main", "status", "--url", daemon.admin_url],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert "backfilling from LSN 1: " in shown.stdout, shown.stdout
        a_at = stage(status, "cdc:a")["batch_id"]
        wait_for(
            "a keeps committing while b fills",
            lambda: stage(daemon.status(), "cdc:a")["batch_id"] > a_at + 2,
            60,
            daemon,
        )

        # Step 3. SIGKILL mid-backfill.
        assert stage(daemon.status(), "cdc:b")["backfilling"], "b finished too soon"
        daemon.kill()
        on_disk = json.loads((tmp_path / "data" / "watermarks.json").read_text())
        assert on_disk["version"] == 4 and on_disk["backfill"]["cdc:b"]["start"] == 1
        started = _events(daemon, "cdc.backfill_started")
        assert [e["stage"] for e in started] == ["cdc:b"]

        # Step 4. Restart: b resumes, finishes, joins the live batches.
        daemon = DaemonProcess.production(config)
        daemon.start(timeout_s=120)
        wait_for("spark ready a third time", lambda: daemon.status()["spark"]["ready"], 180, daemon)
        wait_for(
            "b's backfill is done",
            lambda: not stage(daemon.status(), "cdc:b")["backfilling"],
            300,
            daemon,
        )
        assert _events(daemon, "cdc.backfill_resumed"), daemon.tail()
        (done,) = _events(daemon, "cdc.backfill_done")
        assert done["stage"] == "cdc:b"
        loader.stop()
        wait_for(
            "both streams level, every core committed",
            lambda: (
                all(stage(daemon.status(), s)["behind_batches"] == 0 for s in ("cdc:a", "cdc:b"))
                and all(c["lag"] == 0 for c in daemon.status()["cores"])
            ),
            300,
            daemon,
        )
        head = daemon.status()["wal"]["head_lsn"]
    finally:
        loader.stop()
        code = daemon.stop()
    assert code == 0, daemon.tail()
    on_disk = json.loads((tmp_path / "data" / "watermarks.json").read_text())
    assert on_disk["version"] == 2 and "backfill" not in on_disk

    # Step 5. Every LSN exactly once in each table.
    acked = loader.acked_lsns()
    for path in (a, b):
        seen = _lsns(spark, path)
        assert max(seen.values()) == 1, path
        assert not acked - set(seen), path
        assert set(seen) == set(range(1, head + 1)), path
    print(f"{head:,} events; b backfilled {done['chunks']} chunks up to {done['until']}")
