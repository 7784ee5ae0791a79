"""The trigger store's volume fills up: only the triggers stage stops, health
says so, and it catches up by itself when space returns (invariants 6, 8, 14).

Scenario (a real daemon, real Spark, real HTTP, a real 8 MiB tmpfs under
``data_dir/triggers``, where the retry queue and the DLQ live):
1. A CDC stream and a webhook trigger whose receiver answers 500, so every
   matched row has to be queued durably in the store.
2. The tmpfs is filled to the last byte while producers keep posting.
3. The CDC stream keeps committing; the ``triggers`` stage fails (it cannot
   queue its failures), falls behind and is reported stalled; the retry loop
   keeps retrying instead of stopping the daemon.
4. Space returns and the receiver answers 200: the stage catches up, health
   clears, every matched row reaches the receiver, and the CDC table holds
   every acknowledged event exactly once.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.faults.receivers import Receiver
from tests.faults.support import fill, healthz, spark_config, stage, tmpfs, wait_for
from tests.integration.harness import DaemonProcess, Loader

pytestmark = [pytest.mark.spark, pytest.mark.crash]
STALL_AFTER_S = 3.0


def _config(tmp_path: Path, hook: Receiver) -> Path:
    trigger = f"""
[[triggers]]
name = "big-c0"
collection = "c0"
when = "new:amount::double > 1000"
action = {{ type = "webhook", url = "{hook.url}", timeout_s = 2.0 }}
retry = {{ max_attempts = 1000, initial_backoff_ms = 200, max_backoff_ms = 500 }}
"""
    return spark_config(tmp_path, extra=trigger, stall_after_s=STALL_AFTER_S)


@pytest.mark.timeout(600)
def test_full_trigger_store_volume_stalls_only_the_triggers_and_they_catch_up(
    tmp_path: Path, spark: Any
) -> None:
    hook = Receiver(status=500)
    with tmpfs(tmp_path / "data" / "triggers", size="8m") as store_volume:
        daemon = DaemonProcess.production(_config(tmp_path, hook)).start(timeout_s=120)
        loader = Loader(daemon.ingest_url, batch=100, producers=2, pause_s=0.1)
        try:
            wait_for("spark ready", lambda: daemon.status()["spark"]["ready"], 180, daemon)
            loader.start()
            wait_for(
                "failures queued", lambda: daemon.status()["retry_queue"]["depth"] > 0, 60, daemon
            )
            # Step 2. The store's volume fills up.
            filler = fill(store_volume)

            # Step 3. Only the triggers stage stops; health says so.
            def stage_reported() -> dict[str, Any] | None:
                code, body = healthz(daemon)
                stages = [p.get("stage") for p in body.get("problems", [])]
                return body if code == 503 and "triggers" in stages else None

            body = wait_for(
                "healthz reports the triggers stage", stage_reported, STALL_AFTER_S + 90, daemon
            )
            assert "full" in body["message"], body  # SQLite: database or disk is full
            st = daemon.status()
            assert stage(st, "triggers")["stalled"] and not stage(st, "cdc:all")["failing"]
            before = stage(st, "cdc:all")["batch_id"]
            wait_for(
                "cdc:all keeps committing",
                lambda: stage(daemon.status(), "cdc:all")["batch_id"] > before + 2,
                60,
                daemon,
            )
            assert not daemon.status()["needs_restart"]
            # Step 4. Space and the receiver return: everything catches up.
            loader.stop()
            filler.unlink()
            hook.status = 200
            wait_for(
                "triggers caught up",
                lambda: (
                    stage(daemon.status(), "triggers")["behind_batches"] == 0
                    and all(c["lag"] == 0 for c in daemon.status()["cores"])
                ),
                180,
                daemon,
            )
            wait_for("healthz clears", lambda: healthz(daemon)[0] == 200, 60, daemon)
            wait_for(
                "retry queue drained",
                lambda: daemon.status()["retry_queue"]["depth"] == 0,
                120,
                daemon,
            )
        finally:
            loader.stop()
            code = daemon.stop()
            hook.close()
        assert code == 0, daemon.tail()

    acked = loader.acked_lsns()
    table = spark.read.parquet(str(tmp_path / "cdc" / "all"))
    seen = Counter(r.lsn for r in table.select("lsn").collect())
    assert set(seen) >= acked and max(seen.values()) == 1
    matched = {
        r.lsn
        for r in table.where("collection = 'c0' AND new:amount::double > 1000")
        .select("lsn")
        .collect()
    }
    assert matched and matched <= hook.lsns(), "a matched row never reached the receiver"
