"""Trigger faults hold back nothing else (invariants 6, 7, 8, 14).

Scenario (a real daemon, real Spark, real HTTP in and out):
1. One CDC stream and three webhook triggers on ``orders``: ``big``
   (``new:amount::double > 1000``, its receiver always answers 500), ``hang``
   (its receiver never answers in time) and ``all`` (a healthy receiver).
2. Producers post orders over HTTP; one in 500 has ``"amount": "lots"``,
   a poison row for ``big``'s condition (an ANSI cast error).
3. While that runs: every stage keeps committing and health stays green (the
   failing targets and the poison rows are durably queued, not stalls);
   status names the failing triggers; the DLQ grows.
4. After a clean stop: the CDC table holds every acknowledged event exactly
   once; ``all`` received every acknowledged order; ``big``'s DLQ holds every
   poison row with Spark's error, and every row ``big`` matched.
"""

from __future__ import annotations

import json
import threading
import urllib.error
from pathlib import Path
from typing import Any

import pytest

from tests.faults.receivers import Receiver
from tests.faults.support import healthz, metric, spark_config, stage, wait_for
from tests.integration.harness import DaemonProcess, post_events
from triggers.store import TriggerStore, store_path

pytestmark = [pytest.mark.spark, pytest.mark.crash]
POISON_EVERY = 500


def _config(tmp_path: Path, down: Receiver, hang: Receiver, ok: Receiver) -> Path:
    retry = "retry = { max_attempts = 2, initial_backoff_ms = 100, max_backoff_ms = 200 }"
    triggers = f"""
[[triggers]]
name = "big"
collection = "orders"
when = "new:amount::double > 1000"
action = {{ type = "webhook", url = "{down.url}" }}
{retry}

[[triggers]]
name = "hang"
collection = "orders"
action = {{ type = "webhook", url = "{hang.url}", timeout_s = 1.0 }}
{retry}

[[triggers]]
name = "all"
collection = "orders"
action = {{ type = "webhook", url = "{ok.url}" }}

# Every row of "hang" and half of "big"'s are dead-lettered, and the producers
# run until the waits below are met: on a slow machine that is over 100k rows,
# past the default cap, whose eviction of the oldest (the first poison rows)
# this test is not about.
[dlq]
max_entries = 10000000
"""
    return spark_config(tmp_path, extra=triggers, stall_after_s=5.0)


class Orders(threading.Thread):
    """Producers of orders; every POISON_EVERY-th has an amount that is not a number."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.acked: dict[int, dict[str, Any]] = {}  # lsn -> the event
        self.halt = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.halt.is_set():
            events = [
                {
                    "collection": "orders",
                    "op": "insert",
                    "key": f"o{n}",
                    "new": {"amount": "lots" if n % POISON_EVERY == 7 else n % 2000},
                    "old": None,
                }
                for n in range(i, i + 50)
            ]
            try:
                resp = post_events(self.url, events, timeout=10)
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                self.halt.wait(0.1)
                continue
            for lsn, event in zip(
                range(resp["first_lsn"], resp["last_lsn"] + 1), events, strict=True
            ):
                self.acked[lsn] = event
            i += 50
            # ~250 orders/s: a poison row every 2 s, and no backlog that the
            # waits below would spend minutes clearing beside the suite.
            self.halt.wait(0.2)


@pytest.mark.timeout(600)
def test_poison_rows_and_failing_receivers_hold_back_no_table_and_lose_nothing(
    tmp_path: Path, spark: Any
) -> None:
    down, hang, ok = Receiver(status=500), Receiver(delay_s=30.0), Receiver()
    daemon = DaemonProcess.production(_config(tmp_path, down, hang, ok))
    daemon.start(timeout_s=120)
    producers = Orders(daemon.ingest_url)
    try:
        wait_for("spark ready", lambda: daemon.status()["spark"]["ready"], 180, daemon)
        producers.start()
        # Step 3. Stages keep committing; health stays green; status says what fails.
        first = stage(daemon.status(), "cdc:all")["batch_id"]
        wait_for(
            "cdc:all keeps committing",
            lambda: stage(daemon.status(), "cdc:all")["batch_id"] > first + 5,
            # A deadline, not a pace: five batches take ~15 s alone and 4x that
            # beside the suite's other workers on 2 cores.
            240,
            daemon,
        )
        wait_for(
            "status names the failing triggers",
            lambda: {"big", "hang"} <= set(daemon.status()["triggers"]["failing"]),
            60,
            daemon,
        )
        st = daemon.status()
        assert all(not s["failing"] for s in st["stages"]), st["stages"]
        assert st["healthy"] is True and st["problems"] == []
        assert healthz(daemon)[0] == 200
        assert (metric(daemon, "eventplane_dlq_entries") or 0) > 0
        producers.halt.set()
        producers.join(timeout=30)
        wait_for(
            "caught up",
            lambda: all(c["lag"] == 0 for c in daemon.status()["cores"]),
            120,
            daemon,
        )
        wait_for(
            "all received every order",
            lambda: ok.lsns() >= set(producers.acked),
            120,
            daemon,
        )
    finally:
        producers.halt.set()
        code = daemon.stop()
        for r in (down, hang, ok):
            r.close()
    assert code == 0, daemon.tail()
    assert "dlq_evicted" not in daemon.log_path.read_text(), "the DLQ cap evicted rows"

    # Step 4. Exactly once in the table; poison rows and big's rows in its DLQ.
    acked = producers.acked
    rows = spark.read.parquet(str(tmp_path / "cdc" / "all")).select("lsn").collect()
    seen = [r.lsn for r in rows]
    assert sorted(seen) == sorted(acked), "CDC table != acknowledged events"
    store = TriggerStore(store_path(tmp_path / "data"))
    try:
        dead = store.dlq_list("big", limit=1_000_000)
        pending = {lsn for e in store.pending("big") for lsn in range(e.first_lsn, e.last_lsn + 1)}
    finally:
        store.close()
    poison = {lsn for lsn, e in acked.items() if e["new"]["amount"] == "lots"}
    matched = {
        lsn
        for lsn, e in acked.items()
        if e["new"]["amount"] not in ("lots",) and e["new"]["amount"] > 1000
    }
    assert poison and matched
    dead_lsns = {e.lsn for e in dead}
    assert poison <= dead_lsns, "a poison row is missing from big's DLQ"
    assert all(
        "lots" in e.last_error or "CAST" in e.last_error.upper() for e in dead if e.lsn in poison
    )
    assert matched <= dead_lsns | pending, (
        "a matched row of big is neither dead-lettered nor queued"
    )
    assert json.loads(next(e.row for e in dead if e.lsn in poison))["new"] == {"amount": "lots"}
