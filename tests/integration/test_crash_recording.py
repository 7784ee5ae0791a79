"""SIGKILL the real daemon under HTTP load: nothing acknowledged is ever lost.

Scenario:
1. Start the daemon (production code, with an executor that fsyncs what it
   receives to a file) and post events from 4 concurrent producers.
2. SIGKILL it at a random moment; repeat from 1 on the same data dir.
3. Start it once more without load and wait until every core's watermark
   reaches the WAL head, then stop it with SIGTERM.
4. Every acknowledged LSN was delivered; every WAL LSN was delivered (none
   skipped); a batch re-run after a crash has the same id and the same rows;
   per core, LSNs grow within and across batches.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests.integration.harness import DaemonProcess, Loader, read_record, write_config

KILLS = 10


def _wait_caught_up(daemon: DaemonProcess, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = daemon.status()
        head = st["wal"]["head_lsn"]
        if all(c["lag"] == 0 for c in st["cores"]) and st["cores"]:
            return int(head)
        time.sleep(0.1)
    raise TimeoutError(f"consumers did not catch up: {daemon.status()}")


@pytest.mark.crash
def test_sigkill_under_http_load_loses_no_acknowledged_event(tmp_path: Path) -> None:
    rng = random.Random(20261122)
    config = write_config(tmp_path, cores=4, interval_ms=50, segment_bytes=1 << 20)
    record = tmp_path / "delivered.log"
    acked: set[int] = set()

    # Steps 1-2. Load, then SIGKILL at a random moment, KILLS times.
    for _ in range(KILLS):
        daemon = DaemonProcess.recording(config, record).start()
        loader = Loader(daemon.ingest_url, batch=200, producers=4)
        loader.start()
        time.sleep(rng.uniform(0.2, 1.2))
        daemon.kill()
        loader.stop()
        acked |= loader.acked_lsns()
    assert len(acked) > 10_000, "the load was too light to prove anything"

    # Step 3. Recover and drain.
    daemon = DaemonProcess.recording(config, record).start()
    head = _wait_caught_up(daemon)
    assert daemon.stop() == 0, daemon.tail()

    # Step 4. Check what the executor saw.
    deliveries = read_record(record)
    delivered = {lsn for d in deliveries for lsn, _ in d.rows}
    assert not (acked - delivered), f"acked but never delivered: {sorted(acked - delivered)[:20]}"
    assert delivered == set(range(1, head + 1)), "an LSN in the WAL was skipped or invented"

    by_id: dict[int, list[tuple[int, int]]] = {}
    for d in deliveries:
        if d.batch_id in by_id:
            assert by_id[d.batch_id] == d.rows, f"batch {d.batch_id} re-ran with other rows"
        by_id[d.batch_id] = d.rows
    last_per_core: dict[int, int] = defaultdict(int)
    for batch_id in sorted(by_id):
        for lsn, core in by_id[batch_id]:
            assert lsn > last_per_core[core], f"core {core}: LSN {lsn} out of order"
            last_per_core[core] = lsn
