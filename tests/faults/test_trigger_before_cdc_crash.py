"""A SIGKILL between a batch's trigger calls and its CDC commit (invariants 7, 8).

The trigger job runs before the CDC commit and its calls go out while the
table is written, so a crash may now come after a batch's calls and before
its rows are in the table. Scenario (a real daemon, real Spark, real HTTP):

1. A daemon with one CDC stream and one webhook trigger on every order kills
   itself (``EVENTPLANE_CRASH_AT=cdc.before_stage@1``) when the first batch's
   CDC commit begins, after the trigger job ran.
2. Restarted on the same data_dir, it re-runs that batch from its plan: the
   receiver gets every acknowledged order (at least once: the calls made
   before the kill may come again), and the table holds every acknowledged
   event exactly once.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from tests.faults.receivers import Receiver
from tests.faults.support import spark_config, stage, wait_for
from tests.integration.harness import DaemonProcess, post_events
from tests.spark.support import read_table

pytestmark = [pytest.mark.spark, pytest.mark.crash]


@pytest.mark.timeout(600)
def test_sigkill_after_the_trigger_job_before_the_cdc_commit_redelivers_and_commits_once(
    tmp_path: Path, spark: Any
) -> None:
    hook = Receiver()
    trigger = f"""
[[triggers]]
name = "all-orders"
collection = "orders"
action = {{ type = "webhook", url = "{hook.url}" }}
"""
    config = spark_config(tmp_path, extra=trigger)
    events = [
        {"collection": "orders", "op": "insert", "key": f"o{n}", "new": {"amount": n}}
        for n in range(300)
    ]
    # Step 1. The first batch's CDC commit kills the daemon.
    daemon = DaemonProcess.production(config, env={"EVENTPLANE_CRASH_AT": "cdc.before_stage@1"})
    daemon.start(timeout_s=120)
    try:
        wait_for("spark ready", lambda: daemon.status()["spark"]["ready"], 180, daemon)
        resp = post_events(daemon.ingest_url, events)
        assert daemon.wait(180) == -signal.SIGKILL, daemon.tail()
    finally:
        daemon.stop()
    acked = set(range(resp["first_lsn"], resp["last_lsn"] + 1))
    assert not list((tmp_path / "cdc" / "all").glob("collection=*"))  # nothing committed

    # Step 2. Restart: the batch re-runs; every order reaches the receiver and
    # the table, the table once.
    daemon = DaemonProcess.production(config)
    daemon.start(timeout_s=120)
    try:
        wait_for("receiver got every order", lambda: hook.lsns() >= acked, 180, daemon)
        wait_for(
            "cdc:all committed the batch",
            lambda: (
                stage(daemon.status(), "cdc:all")["batch_id"] >= 1
                and all(c["lag"] == 0 for c in daemon.status()["cores"])
            ),
            180,
            daemon,
        )
    finally:
        assert daemon.stop() == 0, daemon.tail()
        hook.close()
    lsns = [r.lsn for r in read_table(spark, tmp_path / "cdc" / "all")]
    assert sorted(lsns) == sorted(acked)
