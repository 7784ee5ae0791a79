"""The S3 store of a stream's table goes away for 30 s under load: only that
stream stops, health names it, it resumes by itself when the store returns,
and every acknowledged event is in its table exactly once.

Scenario (a real daemon, real Spark, real HTTP, a real SeaweedFS server of
the test's own, tests/s3/server.py):
1. Two streams: ``good`` (Parquet on the test's disk) and ``lake`` (Delta on
   S3); ``[health] stall_after_s = 3``. Producers post into both.
2. The S3 server stops for ``OUTAGE_S``. ``good`` keeps committing; ``lake``
   fails: /healthz answers 503 naming ``cdc:lake``; its writer's lease is
   not renewed, so it stops committing before the lease could expire; the
   WAL keeps what ``lake`` still needs.
3. The server starts again: the lease is renewed (nobody else took it),
   ``lake`` catches up by itself, health clears.
4. After a clean stop, each table holds every acknowledged event once.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests import requires
from tests.faults.support import healthz, spark_config, stage, wait_for
from tests.integration.harness import DaemonProcess, Loader
from tests.s3.server import Weed, start_weed

OUTAGE_S = 30.0
STALL_AFTER_S = 3.0
pytestmark = [pytest.mark.spark, pytest.mark.crash]


@pytest.mark.timeout(600)
def test_an_s3_outage_of_30_s_stops_only_its_stream_which_resumes_exactly_once(
    tmp_path: Path, spark: Any
) -> None:
    from deltalake import DeltaTable

    requires.delta_jars()
    (tmp_path / "weed").mkdir()
    weed = start_weed(tmp_path / "weed")
    server = weed.server
    uri = f"s3://{server.bucket}/cdc/lake"
    lake = f"""
[s3]
endpoint = "{server.endpoint}"
path_style = true
access_key_id = "{server.access_key}"
secret_access_key = "{server.secret_key}"
connect_timeout_s = 2
request_timeout_s = 10
max_retries = 1

[[cdc.streams]]
name = "lake"
collections = "*"
path = "{uri}"
format = "delta"
"""
    config = spark_config(
        tmp_path, {"good": tmp_path / "cdc" / "good"}, extra=lake, stall_after_s=STALL_AFTER_S
    )
    # Retries at most 5 s apart (the default 30 s would add up to 30 s to the resume).
    text = config.read_text().replace("[microbatch]\n", "[microbatch]\nretry_max_ms = 5000\n", 1)
    config.write_text(text)
    daemon = DaemonProcess.production(config)
    loaders: list[Loader] = []  # made once the daemon listens
    timeline: list[tuple[str, float]] = []
    try:
        try:
            _outage(daemon, loaders, weed, timeline)
        finally:
            code = daemon.stop()
        # Step 4. Every acknowledged event once, on disk and in the bucket.
        assert code == 0, daemon.tail()
        acked = loaders[0].acked_lsns()
        assert acked
        rows = spark.read.parquet(str(tmp_path / "cdc" / "good")).select("lsn").collect()
        good = Counter(r.lsn for r in rows)
        dt = DeltaTable(uri, storage_options=server.storage_options())
        in_bucket = Counter(dt.to_pyarrow_table(columns=["lsn"])["lsn"].to_pylist())
        for seen in (good, in_bucket):
            assert set(seen) == acked and max(seen.values()) == 1
    finally:
        weed.stop()
    print("outage timeline (s after the store stopped):", timeline)


def _outage(
    daemon: DaemonProcess, loaders: list[Loader], weed: Weed, timeline: list[tuple[str, float]]
) -> None:
    """Steps 1-3 (module doc)."""
    daemon.start(timeout_s=120)
    wait_for("spark ready", lambda: daemon.status()["spark"]["ready"], 180, daemon)
    loader = Loader(daemon.ingest_url, batch=100, producers=2, pause_s=0.1)
    loaders.append(loader)
    loader.start()
    # Step 1. Both streams commit.
    wait_for(
        "both streams commit",
        lambda: all(stage(daemon.status(), s)["batch_id"] > 0 for s in ("cdc:good", "cdc:lake")),
        120,
        daemon,
    )
    # Step 2. The store goes away.
    weed.stop()
    down = time.monotonic()
    _, body = wait_for(
        "healthz reports cdc:lake",
        lambda: (lambda h: h if h[0] == 503 else None)(healthz(daemon)),
        STALL_AFTER_S + 60,
        daemon,
    )
    timeline.append(("health 503 names cdc:lake", time.monotonic() - down))
    assert [p.get("stage") for p in body["problems"]] == ["cdc:lake"], body
    status = daemon.status()
    assert stage(status, "cdc:good")["failing"] is False
    before = stage(status, "cdc:good")["batch_id"]
    wait_for(
        "cdc:good keeps committing",
        lambda: stage(daemon.status(), "cdc:good")["batch_id"] > before + 2,
        60,
        daemon,
    )
    st = daemon.status()
    assert st["wal"]["retained_floor"] <= min(c["watermark"] for c in st["cores"]) + 1
    time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down)))
    lease = daemon.status()["spark"]["streams"]["lake"]["lease"]
    assert lease["held"] is False and lease["error"], lease  # fenced: 30 s > ttl - skew
    # Step 3. The store returns: the stream resumes by itself.
    weed.start()
    timeline.append(("store back", time.monotonic() - down))
    wait_for(
        "cdc:lake commits again",
        lambda: not stage(daemon.status(), "cdc:lake")["failing"],
        120,
        daemon,
    )
    timeline.append(("cdc:lake commits again", time.monotonic() - down))
    loader.stop()
    wait_for("healthz clears", lambda: healthz(daemon)[0] == 200, 120, daemon)
    wait_for(
        "cdc:lake catches up",
        lambda: (
            stage(daemon.status(), "cdc:lake")["behind_batches"] == 0
            and all(c["lag"] == 0 for c in daemon.status()["cores"])
        ),
        120,
        daemon,
    )
    timeline.append(("caught up, health 200", time.monotonic() - down))
    assert daemon.status()["spark"]["streams"]["lake"]["lease"]["held"] is True
