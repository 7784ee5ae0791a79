"""Spark's driver JVM SIGKILLed under load: the daemon rebuilds the session by
itself, and CDC stays exactly-once (invariants 7, 14).

Scenario (a real daemon, real Spark in ``local[2]``, real HTTP load, a real
webhook trigger):
1. Events flow; batches commit to the CDC table and the trigger fires.
2. Three times, each once the previous rebuild committed a batch again: the
   daemon's JVM child is SIGKILLed. Status shows the session not ready, then
   rebuilt (a new JVM, the old one reaped), and a batch commits again within
   ``KILL_TO_COMMIT_S``; the daemon never exits.
3. Load stops: health is back to 200, every core catches up, the triggers
   stage is level (it adopted each new session), the rebuild metric says 3.
4. After a clean SIGTERM stop the table holds every acknowledged LSN exactly
   once.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.faults.support import healthz, metric, spark_config, stage, wait_for
from tests.integration.harness import DaemonProcess, Loader
from tests.integration.test_triggers_daemon import Receiver

pytestmark = [pytest.mark.spark, pytest.mark.crash]

KILLS = 3
# Generous: a JVM start takes 5-40 s on a loaded 2-core CI box, then a batch.
KILL_TO_COMMIT_S = 120.0


def _config(tmp_path: Path, hook_port: int) -> Path:
    trigger = f"""
[[triggers]]
name = "big-c0"
collection = "c0"
on = ["insert", "update"]
when = "new:amount::double > 1900"
action = {{ type = "webhook", url = "http://127.0.0.1:{hook_port}/hook" }}
"""
    return spark_config(tmp_path, extra=trigger)


def jvm_children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` and whose command line runs java."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"java" in cmdline:
            found.append(int(entry.name))
    return found


def _committed_after_rebuild(spark: dict[str, Any], before: int) -> bool:
    rebuilt_at = spark.get("last_rebuild_at")
    return (
        spark["session_rebuilds"] > before
        and rebuilt_at is not None
        and (spark.get("last_committed_at") or 0) >= rebuilt_at
    )


@pytest.mark.timeout(1200)
def test_killed_spark_jvm_is_rebuilt_and_cdc_stays_exactly_once(tmp_path: Path, spark: Any) -> None:
    receiver = Receiver()
    daemon = DaemonProcess.production(_config(tmp_path, receiver.port))
    daemon.start(timeout_s=120)
    assert daemon.proc is not None
    figures: list[dict[str, Any]] = []
    loader = Loader(daemon.ingest_url, batch=100, producers=2, pause_s=0.1)
    try:
        wait_for("spark ready", lambda: daemon.status()["spark"]["ready"], 180, daemon)
        loader.start()
        # Step 1. Batches commit.
        wait_for(
            "a first batch commits",
            lambda: stage(daemon.status(), "cdc:all")["batch_id"] > 0,
            120,
            daemon,
        )
        # Step 2. Kill the JVM three times.
        for kill in range(1, KILLS + 1):
            before = daemon.status()["spark"]["session_rebuilds"]
            (jvm,) = wait_for("one JVM child", lambda: jvm_children(daemon.proc.pid), 60, daemon)
            hooks_before = len(receiver.rows())
            killed_at = time.monotonic()
            os.kill(jvm, signal.SIGKILL)
            saw_down = False
            deadline = killed_at + KILL_TO_COMMIT_S
            while True:
                st = daemon.status()
                sp = st["spark"]
                saw_down = saw_down or not sp["ready"] or sp["state"] != "ready"
                if _committed_after_rebuild(sp, before):
                    break
                assert daemon.proc.poll() is None, daemon.tail(60)
                assert time.monotonic() < deadline, (
                    f"kill {kill}: no batch committed within {KILL_TO_COMMIT_S} s\n"
                    + daemon.tail(60)
                )
                time.sleep(0.1)
            seconds = time.monotonic() - killed_at
            assert saw_down, f"kill {kill}: status never showed the session down"
            assert "killed by signal 9" in sp["session_lost"], sp
            assert sp["session_rebuilds"] == before + 1
            children = jvm_children(daemon.proc.pid)
            assert len(children) == 1 and children[0] != jvm, children
            assert not Path(f"/proc/{jvm}").exists(), "the killed JVM was not reaped"
            figures.append(
                {
                    "kill": kill,
                    "to_commit_s": round(seconds, 1),
                    "rebuild_s": round(sp["last_rebuild_at"] - sp["session_lost_at"], 1),
                    "hooks_before": hooks_before,
                }
            )

        # Step 3. Load stops; health, catch-up, the triggers stage, the metric.
        loader.stop()
        wait_for("healthz 200", lambda: healthz(daemon)[0] == 200, 120, daemon)
        wait_for(
            "every core catches up",
            lambda: all(c["lag"] == 0 for c in daemon.status()["cores"]),
            180,
            daemon,
        )
        status = daemon.status()
        assert status["healthy"] and not status["needs_restart"], status["problems"]
        triggers = stage(status, "triggers")
        assert triggers["behind_batches"] == 0 and not triggers["failing"], triggers
        assert len(receiver.rows()) > figures[-1]["hooks_before"], "no webhook after the rebuild"
        assert metric(daemon, "eventplane_spark_session_rebuilds_total") == float(KILLS)
        assert daemon.proc.poll() is None
    finally:
        loader.stop()
        code = daemon.stop()
        receiver.close()
    assert code == 0, daemon.tail()

    # Step 4. Every acknowledged event exactly once.
    acked = loader.acked_lsns()
    assert acked
    seen = Counter(
        r.lsn for r in spark.read.parquet(str(tmp_path / "cdc" / "all")).select("lsn").collect()
    )
    assert set(seen) == acked
    assert max(seen.values()) == 1
    for f in figures:
        print(
            f"kill {f['kill']}: next batch committed {f['to_commit_s']} s after the SIGKILL "
            f"(session rebuilt in {f['rebuild_s']} s)"
        )
