"""A CDC stream paused under load stays paused across a SIGKILL and a restart, and
catches up exactly once when resumed (invariants 6, 7, 9, 14).

Scenario (a real daemon, real Spark in ``local[2]``, real HTTP load, two CDC
streams, ``[health] paused_max_lag_events = 3000``):
1. Events flow into both streams.
2. ``eventplane pause cdc:b --reason ...``: ``cdc:a`` keeps committing, ``cdc:b``
   does not and is shown paused, neither failing nor stalled; past 3,000
   events behind, /healthz answers 503 naming it and the fix, ``eventplane
   status`` exits 1; the WAL keeps what it needs.
3. The daemon is SIGKILLed under load; the watermarks file on disk has the
   pause. Restarted, ``cdc:b`` is still paused (same time, reason, author),
   ``cdc:a`` goes on.
4. Load stops; ``eventplane resume cdc:b``: it catches up, health clears.
5. After a clean stop, each table holds every LSN of the WAL exactly once,
   every acknowledged one among them.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.faults.support import cli as run_cli
from tests.faults.support import healthz, metric, spark_config, stage, wait_for
from tests.integration.harness import DaemonProcess, Loader

pytestmark = [pytest.mark.spark, pytest.mark.crash]

LIMIT = 3000


def _config(tmp_path: Path) -> Path:
    streams = {"a": tmp_path / "cdc" / "a", "b": tmp_path / "cdc" / "b"}
    return spark_config(tmp_path, streams, extra=f"\n[health]\npaused_max_lag_events = {LIMIT}\n")


def _lsns(spark: Any, path: Path) -> Counter[int]:
    return Counter(r.lsn for r in spark.read.parquet(str(path)).select("lsn").collect())


@pytest.mark.timeout(900)
def test_paused_stream_survives_sigkill_and_restart_then_catches_up_exactly_once(
    tmp_path: Path, spark: Any
) -> None:
    config = _config(tmp_path)
    daemon = DaemonProcess.production(config)
    daemon.start(timeout_s=120)
    loader = Loader(daemon.ingest_url, batch=100, producers=2, pause_s=0.1)
    try:
        wait_for("spark ready", lambda: daemon.status()["spark"]["ready"], 180, daemon)
        loader.start()
        # Step 1. Both streams commit.
        wait_for(
            "both streams commit",
            lambda: all(stage(daemon.status(), s)["batch_id"] > 0 for s in ("cdc:a", "cdc:b")),
            120,
            daemon,
        )

        # Step 2. Pause cdc:b under load.
        cli = run_cli(daemon, "pause", "cdc:b", "--reason", "lake maintenance")
        assert cli.returncode == 0, cli.stdout + cli.stderr
        assert cli.stdout.startswith("stage cdc:b paused; now paused for "), cli.stdout
        code, body = wait_for(
            "healthz reports the paused stage over its limit",
            lambda: (lambda h: h if h[0] == 503 else None)(healthz(daemon)),
            120,
            daemon,
        )
        (problem,) = body["problems"]
        assert problem["stage"] == "cdc:b" and problem["paused"] is True
        assert problem["behind_events"] > LIMIT
        assert "eventplane resume cdc:b" in problem["message"], problem["message"]
        status = daemon.status()
        paused = stage(status, "cdc:b")
        assert paused["paused"] and paused["paused_over_limit"], paused
        assert not paused["failing"] and not paused["stalled"], paused
        assert paused["paused_reason"] == "lake maintenance" and "@" in paused["paused_by"]
        assert not status["needs_restart"]
        held_at = paused["batch_id"]
        wait_for(
            "cdc:a keeps committing while cdc:b is paused",
            lambda: stage(daemon.status(), "cdc:a")["batch_id"] > held_at + 3,
            60,
            daemon,
        )
        st = daemon.status()
        assert stage(st, "cdc:b")["batch_id"] == held_at
        assert st["wal"]["retained_floor"] <= min(c["watermark"] for c in st["cores"]) + 1
        assert metric(daemon, 'eventplane_stage_paused{stage="cdc:b"}') == 1.0
        assert metric(daemon, 'eventplane_stage_paused{stage="cdc:a"}') == 0.0
        assert metric(daemon, 'eventplane_stage_stalled{stage="cdc:b"}') == 0.0
        assert metric(daemon, "eventplane_healthy") == 0.0
        shown = run_cli(daemon, "status")
        assert shown.returncode == 1, shown.stdout + shown.stderr
        assert "PAUSED, OVER ITS LIMIT" in shown.stdout and "lake maintenance" in shown.stdout

        # Step 3. SIGKILL under load; the pause is on disk; restart.
        daemon.kill()
        on_disk = json.loads((tmp_path / "data" / "watermarks.json").read_text())
        assert on_disk["version"] == 3
        assert on_disk["paused"]["cdc:b"]["reason"] == "lake maintenance"
        daemon = DaemonProcess.production(config)
        daemon.start(timeout_s=120)
        wait_for("spark ready again", lambda: daemon.status()["spark"]["ready"], 180, daemon)
        again = stage(daemon.status(), "cdc:b")
        # Stage progress reaches the watermarks file with the next flush
        # (consumer.watermark_flush_ms): a batch cdc:b committed just before the
        # kill may be recorded lower, and is re-run as a no-op (its ledger has it).
        assert again["paused"] and again["batch_id"] <= held_at, again
        held_at = again["batch_id"]
        assert again["paused_since"] == paused["paused_since"]
        assert (again["paused_reason"], again["paused_by"]) == (
            paused["paused_reason"],
            paused["paused_by"],
        )
        a_before = stage(daemon.status(), "cdc:a")["batch_id"]
        wait_for(
            "cdc:a commits after the restart",
            lambda: stage(daemon.status(), "cdc:a")["batch_id"] > a_before + 2,
            120,
            daemon,
        )
        assert stage(daemon.status(), "cdc:b")["batch_id"] == held_at

        # Step 4. Load stops; resume; cdc:b catches up and health clears.
        loader.stop()
        backlog = stage(daemon.status(), "cdc:b")
        resumed_at = time.monotonic()
        cli = run_cli(daemon, "resume", "cdc:b")
        assert cli.returncode == 0, cli.stdout + cli.stderr
        assert cli.stdout.startswith("stage cdc:b resumed"), cli.stdout
        wait_for(
            "cdc:b catches up",
            lambda: (
                stage(daemon.status(), "cdc:b")["behind_batches"] == 0
                and all(c["lag"] == 0 for c in daemon.status()["cores"])
            ),
            300,
            daemon,
        )
        caught_up_s = time.monotonic() - resumed_at
        wait_for("healthz clears", lambda: healthz(daemon)[0] == 200, 60, daemon)
        final = daemon.status()
        assert not stage(final, "cdc:b")["paused"] and stage(final, "cdc:b")["batch_id"] > held_at
        head = final["wal"]["head_lsn"]
    finally:
        loader.stop()
        code = daemon.stop()
    assert code == 0, daemon.tail()
    on_disk = json.loads((tmp_path / "data" / "watermarks.json").read_text())
    assert on_disk["version"] == 2 and "paused" not in on_disk

    # Step 5. Every LSN exactly once in each table; every acknowledged one there.
    acked = loader.acked_lsns()
    assert len(acked) > 2 * LIMIT, "the load was too light to prove anything"
    for name in ("a", "b"):
        seen = _lsns(spark, tmp_path / "cdc" / name)
        missing = sorted(acked - set(seen))
        assert max(seen.values()) == 1, name
        assert not missing, f"{name}: acknowledged but missing {missing[:10]}"
        assert set(seen) == set(range(1, head + 1)), name
    print(
        f"cdc:b resumed {backlog['behind_batches']} batches / {backlog['behind_events']:,} events"
        f" behind, caught up in {caught_up_s:.1f} s; {len(acked):,} events acknowledged"
    )
