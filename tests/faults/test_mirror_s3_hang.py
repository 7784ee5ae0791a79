"""A mirror's S3 store hangs (a partition): the mirror on disk keeps committing
within seconds, health names only the S3 mirror within ``attempt_slow_s``
plus a few seconds, the S3 mirror catches up by itself when the store
returns, and each mirror is the fold of the acknowledged events
(invariants 6, 14 and 22).

Scenario (a real daemon with mirrors only, so no JVM, and a real SeaweedFS
behind the test's TCP proxy, tests/faults/proxy.py):
1. Two mirrors of ``orders``: ``lake`` on S3 (through the proxy), listed
   first, so its merge comes first in each batch, and ``disk`` on the test's
   disk; ``[health] attempt_slow_s = 3``, ``stall_after_s`` at its default
   (60 s), so only slowness can turn health red this soon. Producers post
   random inserts, updates and deletes.
2. Both commit; then the proxy stalls (connections accepted, never
   answered). ``disk`` never goes ``attempt_slow_s`` + 2 s without a commit,
   ``/healthz`` answers 503 naming ``mirror:lake`` within ``attempt_slow_s``
   + a few seconds, and for the whole outage nothing names ``mirror:disk``.
3. The proxy lets bytes flow again: ``lake`` commits again by itself and
   health clears; the producers stop, every request that got no answer is
   sent again with its ``Idempotency-Key``, and both mirrors catch up.
4. After a clean stop, each mirror is the fold of the acknowledged events in
   LSN order, and no batch id is in two of its merges.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest

from tests.faults.proxy import FaultyProxy
from tests.faults.support import healthz, stage, wait_for
from tests.integration.harness import DaemonProcess, write_config
from tests.integration.test_crash_recording import _wait_caught_up
from tests.integration.test_mirror_crash import Producers, fold, post
from tests.s3.server import start_weed

ATTEMPT_SLOW_S = 3.0
# Within this much of the store going away: the disk mirror's next commit and
# health's 503 (attempt_slow_s, one batch, the status poll, a loaded machine).
PROMPT_S = ATTEMPT_SLOW_S + 6.0
# The longest mirror:disk may go without a commit while the store hangs: a
# hung merge holds the batch for half of attempt_slow_s, then the batches go
# on without it (a merge held to the end of its request timeouts, below,
# would hold a batch about 10 s).
GAP_S = ATTEMPT_SLOW_S + 2.0
# The partition lasts at least this long; it outlives every check made during it.
OUTAGE_S = 10.0
pytestmark = [pytest.mark.crash]


@pytest.mark.timeout(300)
def test_a_partitioned_store_holds_back_only_its_mirror_and_it_catches_up_to_the_fold(
    tmp_path: Path,
) -> None:
    from deltalake import DeltaTable

    (tmp_path / "weed").mkdir()
    weed = start_weed(tmp_path / "weed")
    server = weed.server
    proxy = FaultyProxy(int(server.endpoint.rsplit(":", 1)[1]), seed=44).start()
    uri = f"s3://{server.bucket}/mirrors/lake"
    # [s3]: each request bounded inside the lease window (30 - 5 s): (1 + 4) x 2
    # = 10 s at most, so a request held by the partition ends soon after the
    # store is back; and a hung merge outlives attempt_slow_s by far.
    extra = f"""
[s3]
endpoint = "{proxy.url}"
path_style = true
access_key_id = "{server.access_key}"
secret_access_key = "{server.secret_key}"
connect_timeout_s = 1
request_timeout_s = 4
max_retries = 1

[[cdc.mirrors]]
name = "lake"
collection = "orders"
path = "{uri}"
columns = {{ amount = "double", n = "long" }}
buckets = 4

[[cdc.mirrors]]
name = "disk"
collection = "orders"
path = "{tmp_path / "disk"}"
columns = {{ amount = "double", n = "long" }}
buckets = 4

[health]
attempt_slow_s = {ATTEMPT_SLOW_S}
"""
    config = write_config(tmp_path, cores=2, interval_ms=200, extra=extra)
    text = config.read_text().replace("[microbatch]\n", "[microbatch]\nretry_max_ms = 1000\n", 1)
    config.write_text(text)
    daemon = DaemonProcess.production(config)
    rng = random.Random(44)
    acked: list[tuple[int, list[dict[str, Any]]]] = []
    timeline: list[tuple[str, float]] = []
    try:
        try:
            daemon.start(timeout_s=60)
            producers = Producers(daemon.ingest_url, rng, threads=2)
            producers.start()
            try:
                _partition(daemon, proxy, timeline)
            finally:
                producers.stop()
            # Step 3. Every request sent is acknowledged; both mirrors catch up.
            acked += producers.acked
            for key, evs in producers.unanswered:
                acked.append((post(daemon.ingest_url, evs, key), evs))
            _wait_caught_up(daemon, timeout_s=120)
            status = daemon.status()
            assert status["problems"] == [], status["problems"]
        finally:
            code = daemon.stop()
        assert code == 0, daemon.tail()
        # Step 4. Each mirror is the fold of the acknowledged events, merged once.
        assert sum(len(e) for _, e in acked) > 1_000, "the load was too light to prove anything"
        want = fold(acked)
        for table in (
            DeltaTable(str(tmp_path / "disk")),
            DeltaTable(uri, storage_options=server.storage_options()),
        ):
            rows = table.to_pyarrow_table().to_pylist()
            got = {r["key"]: (r["lsn"], json.loads(r["doc"])) for r in rows}
            assert len(got) == len(rows), f"{table.table_uri}: a key has two rows"
            missing = sorted(set(want) - set(got))[:5]
            extra_keys = sorted(set(got) - set(want))[:5]
            assert got == want, f"{table.table_uri}: missing {missing}, extra {extra_keys}"
            merges = [
                json.loads(h["userMetadata"])["eventplane"]["batch_id"]
                for h in table.history()
                if h.get("operation") == "MERGE"
            ]
            assert merges and len(merges) == len(set(merges)), f"{table.table_uri}: merged twice"
    finally:
        proxy.close()
        weed.stop()
        print("partition timeline (s after the store went away):", timeline)


class Watch:
    """From the partition on: every stage health names, and the longest time
    mirror:disk went without a commit."""

    def __init__(self, daemon: DaemonProcess, batch_id: int) -> None:
        self.daemon = daemon
        self.named: set[str | None] = set()  # None: a problem of no stage
        self.batch_id = batch_id
        self.moved = time.monotonic()
        self.longest = 0.0

    def poll(self) -> dict[str, Any]:
        """One look at /healthz and /v1/status; mirror:disk's entry."""
        _, body = healthz(self.daemon)
        status = self.daemon.status()
        self.named |= {p.get("stage") for p in body.get("problems", [])}
        self.named |= {p.get("stage") for p in status["problems"]}
        disk = stage(status, "mirror:disk")
        now = time.monotonic()
        self.longest = max(self.longest, now - self.moved)
        if disk["batch_id"] > self.batch_id:
            self.batch_id, self.moved = disk["batch_id"], now
        return disk


def _partition(
    daemon: DaemonProcess, proxy: FaultyProxy, timeline: list[tuple[str, float]]
) -> None:
    """Steps 1-3 up to the catch-up (module doc)."""
    # Step 1. Both mirrors commit, lake level with the live batches.
    wait_for(
        "both mirrors commit, lake level",
        lambda: (
            (lambda st: st["batch_id"] > 0 and st["behind_batches"] <= 1)(
                stage(daemon.status(), "mirror:lake")
            )
            and stage(daemon.status(), "mirror:disk")["batch_id"] > 0
        ),
        60,
        daemon,
    )
    wait_for("healthy before", lambda: healthz(daemon)[0] == 200, 60, daemon)
    at_stop = stage(daemon.status(), "mirror:disk")["batch_id"]
    # Step 2. The partition.
    proxy.stall(True)
    down = time.monotonic()
    watch = Watch(daemon, at_stop)
    wait_for(
        "mirror:disk commits", lambda: watch.poll()["batch_id"] > at_stop + 1, PROMPT_S, daemon
    )
    timeline.append(("disk commits", round(time.monotonic() - down, 1)))

    def lake_named() -> bool:
        watch.poll()
        return "mirror:lake" in watch.named

    wait_for("healthz names mirror:lake", lake_named, PROMPT_S, daemon)
    timeline.append(("health names mirror:lake", round(time.monotonic() - down, 1)))
    before = stage(daemon.status(), "mirror:disk")["batch_id"]

    def disk_goes_on() -> bool:
        disk = watch.poll()
        return time.monotonic() - down >= OUTAGE_S and disk["batch_id"] > before + 3

    wait_for("mirror:disk keeps committing", disk_goes_on, OUTAGE_S + 30, daemon)
    disk = watch.poll()
    timeline.append(("longest without a disk commit", round(watch.longest, 1)))
    assert watch.named == {"mirror:lake"}, watch.named
    assert watch.longest < GAP_S, f"mirror:disk went {watch.longest:.1f} s without a commit"
    assert not disk["failing"] and not disk["slow"], disk
    # Step 3. The store returns: lake commits again by itself, health clears.
    at_lake = stage(daemon.status(), "mirror:lake")["batch_id"]
    proxy.stall(False)
    up = time.monotonic()
    timeline.append(("store back", round(up - down, 1)))
    wait_for(
        "mirror:lake commits again",
        lambda: (lambda s: not s["failing"] and not s["slow"] and s["batch_id"] > at_lake)(
            stage(daemon.status(), "mirror:lake")
        ),
        60,
        daemon,
    )
    timeline.append(("lake commits again", round(time.monotonic() - down, 1)))
    wait_for("health clears", lambda: healthz(daemon)[0] == 200, 60, daemon)
    timeline.append(("health 200", round(time.monotonic() - down, 1)))
