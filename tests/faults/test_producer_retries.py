"""Exactly-once from the producer's first attempt to the CDC table (invariants 7, 15).

Scenario (a real daemon with real Spark and one CDC stream; producers using the
shipped ``daemon.client.SyncIngestClient``; a fault-injecting TCP proxy between
them, tests/faults/proxy.py):
1. Three producers send batches of logical events, each event with its own key,
   through the proxy, which drops answers after the daemon got the request,
   resets connections mid-body and delays chunks. Each producer moves on only
   once its batch is acknowledged; the client retries with the request's
   Idempotency-Key.
2. Meanwhile the daemon is SIGKILLed twice and SIGTERMed once, and restarted
   each time on the same ports.
3. Afterwards the table holds every logical event exactly once: nothing a
   producer sent is missing, nothing is there twice, although some requests
   reached the daemon more than once (replays counted by the client).
"""

from __future__ import annotations

import random
import signal
import threading
import time
import urllib.parse
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from daemon.client import Retry, SyncIngestClient
from tests.faults.proxy import FaultyProxy
from tests.faults.support import spark_config, stage, wait_for
from tests.integration.harness import DaemonProcess

pytestmark = [pytest.mark.spark, pytest.mark.crash]

PRODUCERS = 3
BATCH = 100
RESTARTS = (signal.SIGKILL, signal.SIGTERM, signal.SIGKILL)


class Producer(threading.Thread):
    """Sends batches of unique events until stopped; a batch counts once acknowledged."""

    def __init__(self, pid: int, url: str) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.url = url
        self.sent: list[str] = []  # keys of acknowledged events
        self.replays = 0
        self.retries = 0
        self.error: BaseException | None = None
        self.halt = threading.Event()

    def _count_retry(self, _retry: Retry) -> None:
        self.retries += 1

    def run(self) -> None:
        n = 0
        try:
            with SyncIngestClient(
                self.url, timeout_s=5.0, retry_for_s=600.0, max_wait_s=2.0,
                on_retry=self._count_retry,
            ) as client:  # fmt: skip
                while not self.halt.is_set():
                    keys = [f"p{self.pid}-{n + i}" for i in range(BATCH)]
                    events = [
                        {
                            "collection": f"c{(n + i) % 3}",
                            "op": "insert",
                            "key": key,
                            "new": {"producer": self.pid, "n": n + i},
                        }
                        for i, key in enumerate(keys)
                    ]
                    ack = client.send(events)
                    assert ack.accepted == BATCH
                    self.replays += ack.replayed
                    self.sent += keys
                    n += BATCH
                    time.sleep(0.02)
        except BaseException as exc:  # reported by the test
            self.error = exc


@pytest.mark.timeout(1500)
def test_producers_retrying_through_faults_and_restarts_store_every_event_exactly_once(
    tmp_path: Path, spark: Any
) -> None:
    daemon = DaemonProcess.production(spark_config(tmp_path))
    daemon.start(timeout_s=120)
    port = urllib.parse.urlsplit(daemon.ingest_url).port
    assert port is not None
    rng = random.Random(1125)
    proxy = FaultyProxy(
        port, seed=1125, drop_response=0.08, reset_mid_body=0.03, delay=0.05
    ).start()
    producers = [Producer(p, proxy.url) for p in range(PRODUCERS)]
    try:
        for p in producers:
            p.start()
        # Steps 1-2. Faults all along; restarts at random moments under load.
        for sig in RESTARTS:
            time.sleep(rng.uniform(2.0, 6.0))
            assert all(p.is_alive() for p in producers), [p.error for p in producers]
            daemon.signal(sig)
            daemon.wait(60)
            daemon.start(timeout_s=120)
        time.sleep(3.0)
        for p in producers:
            p.halt.set()
        for p in producers:
            p.join(timeout=660)
            assert not p.is_alive(), f"producer {p.pid} did not finish its last batch"
            assert p.error is None, f"producer {p.pid}: {p.error!r}"
        proxy.set_faults(drop_response=0, reset_mid_body=0, delay=0)
        # Everything acknowledged is committed by the stream before the check.
        head = daemon.status()["wal"]["head_lsn"]
        wait_for(
            "the CDC stream catches up",
            lambda: (
                all(c["lag"] == 0 for c in daemon.status()["cores"])
                and stage(daemon.status(), "cdc:all")["behind_batches"] == 0
                and daemon.status()["wal"]["head_lsn"] == head
            ),
            240,
            daemon,
        )
    finally:
        for p in producers:
            p.halt.set()
        proxy.close()
        code = daemon.stop()
    assert code == 0, daemon.tail()

    # Step 3. Each logical event exactly once.
    sent = [key for p in producers for key in p.sent]
    assert len(sent) == len(set(sent)) > PRODUCERS * BATCH * 5
    rows = spark.read.parquet(str(tmp_path / "cdc" / "all")).select("key").collect()
    seen = Counter(r.key for r in rows)
    duplicated = {k: c for k, c in seen.items() if c > 1}
    assert not duplicated, f"{len(duplicated)} events stored twice, e.g. {list(duplicated)[:5]}"
    missing = set(sent) - set(seen)
    assert not missing, f"{len(missing)} acknowledged events missing, e.g. {sorted(missing)[:5]}"
    assert set(seen) == set(sent), "the table holds events no producer sent"
    # The faults happened, and retries reached requests the daemon had stored.
    assert proxy.faults["drop_response"] > 0 and proxy.faults["reset_mid_body"] > 0
    assert sum(p.replays for p in producers) > 0, "no retry was answered from the window"
    print(
        f"{len(sent)} events in {len(sent) // BATCH} requests; faults {dict(proxy.faults)}; "
        f"client retries {sum(p.retries for p in producers)}, "
        f"replays {sum(p.replays for p in producers)}"
    )
