"""One maintainer for a shared Delta table (docs/cdc.md, "Shared tables"):
compaction (OPTIMIZE), VACUUM and retention run in the daemon that holds
``_eventplane/maintainer.json`` (daemon/table/maintainer.py). Two executors
in one process on a table on disk, as tests/spark/test_delta_shared.py; the
maintainer that dies is a real process, SIGKILLed with the lease held."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from daemon.table import delta, maintainer
from daemon.table.compact import compact_stream
from daemon.table.deltacommit import NAME_KEY
from daemon.table.layout import META_DIR
from daemon.table.location import S3Files, TableFiles
from tests import requires
from tests.s3.server import S3Server
from tests.spark.support import batch_lsns, make_batches
from tests.spark.test_crash import REPO
from tests.spark.test_delta_shared import writer_lsns

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

# No background compaction: each test's compact_stream call is the maintenance tick.
SHARED = {"format": "delta", "writers": "shared", "compaction": False}


@pytest.fixture(autouse=True)
def _needs_delta(spark: Any) -> None:
    requires.delta_jars()


def optimizers(table: Path | TableFiles) -> list[str]:
    """The daemon name of each OPTIMIZE commit in the table's log, in order."""
    return [
        str(actions["commitInfo"].get(NAME_KEY))
        for _, actions in delta.log_commits(table, -1)
        if actions.get("commitInfo", {}).get("operation") == "OPTIMIZE"
    ]


async def two_writers(executor_factory: Any, tmp_path: Path, batches: int) -> tuple[Any, Any]:
    """ep-1 and ep-2 on one table, each with ``batches`` batches committed (ep-1 first)."""
    kw = {"tables": tmp_path / "lake", "stream_options": SHARED}
    one = await executor_factory(root=tmp_path / "a", wal_id="wal-1", daemon_name="ep-1", **kw)
    two = await executor_factory(root=tmp_path / "b", wal_id="wal-2", daemon_name="ep-2", **kw)
    for b in make_batches(batches, 60):
        assert not await one.execute(b)
        assert not await two.execute(b)
    return one, two


def maintenance(ex: Any) -> dict[str, Any]:
    return dict(ex.status()["streams"]["all"]["maintenance"])


async def test_only_the_maintainer_compacts_a_shared_table_and_the_other_names_it(
    executor_factory: Any, tmp_path: Path, spark: Any
) -> None:
    """1. ep-1's tick takes the maintenance lease and compacts (OPTIMIZE, VACUUM).
    2. ep-2's tick is skipped: nothing compacted, its status names ep-1.
    3. ep-2's retention run is skipped too, saying who maintains the table."""
    one, two = await two_writers(executor_factory, tmp_path, 3)
    table = tmp_path / "lake" / "all"
    assert len(await asyncio.to_thread(compact_stream, one.sinks[0], spark, full=True)) == 1
    assert maintenance(one)["maintainer"] == "ep-1" and maintenance(one)["this_daemon"]
    assert await asyncio.to_thread(compact_stream, two.sinks[0], spark, full=True) == []
    assert await asyncio.to_thread(compact_stream, two.sinks[0], spark, full=True) == []
    status = maintenance(two)
    assert status["maintainer"] == "ep-1" and not status["this_daemon"]
    assert status["skipped"] == 2
    assert optimizers(table) == ["ep-1"]
    held = json.loads((table / META_DIR / maintainer.KEY).read_bytes().split(b"\n", 1)[1])
    assert held["name"] == "ep-1"
    sink = two.sinks[0]
    sink.stream = dataclasses.replace(sink.stream, retention_s=86400)
    result = await asyncio.to_thread(sink.apply_retention, spark)
    assert result.to_json()["skipped"] == "maintained by ep-1" and result.removed == []
    want = sorted((w, n) for w in ("ep-1", "ep-2") for n in batch_lsns(make_batches(3, 60)))
    assert writer_lsns(table) == want


async def test_a_maintainer_that_stops_cleanly_hands_maintenance_over_at_the_next_tick(
    executor_factory: Any, tmp_path: Path, spark: Any
) -> None:
    """1. ep-1 maintains the table; ep-2's tick is skipped.
    2. ep-1 stops: its lease goes at once.
    3. ep-2's next tick takes it and compacts, without waiting for a ttl."""
    one, two = await two_writers(executor_factory, tmp_path, 3)
    table = tmp_path / "lake" / "all"
    assert len(await asyncio.to_thread(compact_stream, one.sinks[0], spark, full=True)) == 1
    assert await asyncio.to_thread(compact_stream, two.sinks[0], spark, full=True) == []
    await one.stop()
    assert not (table / META_DIR / maintainer.KEY).exists()
    for b in make_batches(5, 60)[3:]:
        assert not await two.execute(b)
    started = time.monotonic()
    assert len(await asyncio.to_thread(compact_stream, two.sinks[0], spark, full=True)) == 1
    assert time.monotonic() - started < maintainer.LOCAL_TTL_S
    assert maintenance(two)["maintainer"] == "ep-2" and maintenance(two)["this_daemon"]
    assert optimizers(table) == ["ep-1", "ep-2"]


HOLDER = """
import sys, time
from pathlib import Path
from daemon.table.lease import Holder, LocalStore
from daemon.table.maintainer import KEY, Maintainer, MaintainerLease
lease = MaintainerLease(LocalStore(Path(sys.argv[1])), KEY,
    Holder.this_process(sys.argv[2], "wal-1", "all"), ttl_s=4.0, skew_s=1.0, name="ep-1")
assert Maintainer(lease, "ep-1's table").tick()
print("maintaining", flush=True)
time.sleep(600)
"""


async def test_a_maintainer_that_dies_is_replaced_once_its_lease_expires(
    executor_factory: Any, tmp_path: Path, spark: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1. A process named ep-1 takes the maintenance lease (ttl 4 s, skew 1 s)
       and is SIGKILLed: the lease stays.
    2. ep-2's tick within ttl + skew is skipped, naming ep-1.
    3. Its tick after ttl + skew takes the lease and compacts."""
    monkeypatch.setattr(maintainer, "LOCAL_TTL_S", 4.0)
    monkeypatch.setattr(maintainer, "LOCAL_SKEW_S", 1.0)
    kw = {"tables": tmp_path / "lake", "stream_options": SHARED}
    two = await executor_factory(root=tmp_path / "b", wal_id="wal-2", daemon_name="ep-2", **kw)
    for b in make_batches(3, 60):
        assert not await two.execute(b)
    table = tmp_path / "lake" / "all"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, str(table / META_DIR), str(tmp_path / "a"),
        cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = b""
        while line.strip() != b"maintaining":  # its log lines come first
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert line, "the holder process ended"
    finally:
        proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), 10)
    killed = time.monotonic()
    assert (table / META_DIR / maintainer.KEY).exists()
    assert await asyncio.to_thread(compact_stream, two.sinks[0], spark, full=True) == []
    assert time.monotonic() - killed < 4.0  # the refusal above was inside the ttl
    assert maintenance(two)["maintainer"] == "ep-1"
    await asyncio.sleep(max(0.0, killed + 5.5 - time.monotonic()))
    assert len(await asyncio.to_thread(compact_stream, two.sinks[0], spark, full=True)) == 1
    assert maintenance(two)["maintainer"] == "ep-2"
    assert optimizers(table) == ["ep-2"]


async def test_a_compaction_racing_the_other_writers_appends_fails_none_and_keeps_each_row_once(
    executor_factory: Any, tmp_path: Path, spark: Any, metrics: Any
) -> None:
    """1. ep-1 maintains the table. Each time ep-2 has read the log and is
       about to commit a batch, ep-1 commits an OPTIMIZE first: ep-2's commit
       loses its version, reads the log again and lands on the next one.
    2. Then ep-1 compacts in a loop while ep-2 appends 12 more batches.
    3. No append failed; every (writer, lsn) is in the table once."""
    from unittest import mock

    one, two = await two_writers(executor_factory, tmp_path, 3)
    table = tmp_path / "lake" / "all"
    batches = make_batches(18, 60)
    real = delta.crash_point
    raced: list[int] = []

    def optimize_first(point: str) -> None:
        if point == "delta.before_log_commit":  # each attempt: the retry's too
            done = one.sinks[0].compact(spark, full=True, on_progress=None)
            if done is not None and done.inputs:
                raced.append(done.inputs)
        real(point)

    with mock.patch.object(delta, "crash_point", side_effect=optimize_first):
        for b in batches[3:6]:
            assert not await two.execute(b)
    assert len(raced) == 3
    assert metrics.cdc_commit_retries.labels("all")._value.get() >= 3
    stop = asyncio.Event()

    async def compact_loop() -> int:
        n = 0
        while not stop.is_set():
            n += len(await asyncio.to_thread(compact_stream, one.sinks[0], spark, full=True))
        return n

    looping = asyncio.create_task(compact_loop())
    try:
        for b in batches[6:]:
            assert not await two.execute(b)
    finally:
        stop.set()
        compactions = await looping
    assert compactions >= 1
    assert set(optimizers(table)) == {"ep-1"}
    # OPTIMIZE commits landed between ep-2's appends of the loop, not only before or after.
    commits = list(delta.log_commits(table, -1))
    looped = [
        v
        for v, actions in commits
        for t in actions.get("txn", [])
        if t["appId"] == delta.app_id("wal-2", "all") and int(t["version"]) > 6
    ]
    between = [
        v
        for v, actions in commits
        if actions.get("commitInfo", {}).get("operation") == "OPTIMIZE"
        and min(looped) < v < max(looped)
    ]
    assert between
    want = sorted(
        [("ep-1", n) for n in batch_lsns(batches[:3])] + [("ep-2", n) for n in batch_lsns(batches)]
    )
    assert writer_lsns(table) == want


async def test_on_s3_one_daemon_maintains_a_shared_table_and_hands_it_over_when_it_stops(
    executor_factory: Any, tmp_path: Path, spark: Any, s3_server: S3Server
) -> None:
    """The same on S3 (SeaweedFS): the lease is the object
    ``_eventplane/maintainer.json`` beside the writers' leases, with the
    ``[s3]`` lease timings; ep-1 compacts, ep-2 is skipped naming it; ep-1
    stops, its lease goes, ep-2's next tick compacts."""

    uri = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:8]}/all"
    cfg = s3_server.config(lease_ttl_s=8.0, lease_skew_s=1.0)
    options = {**SHARED, "uri": uri, "s3": cfg}
    one = await executor_factory(
        root=tmp_path / "a", wal_id="wal-1", daemon_name="ep-1", stream_options=options
    )
    two = await executor_factory(
        root=tmp_path / "b", wal_id="wal-2", daemon_name="ep-2", stream_options=options
    )
    for b in make_batches(3, 60):
        assert not await one.execute(b)
        assert not await two.execute(b)
    files = S3Files(uri, cfg)
    assert len(await asyncio.to_thread(compact_stream, one.sinks[0], spark, full=True)) == 1
    assert await asyncio.to_thread(compact_stream, two.sinks[0], spark, full=True) == []
    assert maintenance(two)["maintainer"] == "ep-1" and not maintenance(two)["this_daemon"]
    key = f"{META_DIR}/{maintainer.KEY}"
    assert key in [files.where.rel(k) for k in files._keys(f"{META_DIR}/")]
    await one.stop()
    assert key not in [files.where.rel(k) for k in files._keys(f"{META_DIR}/")]
    for b in make_batches(5, 60)[3:]:  # files to merge again
        assert not await two.execute(b)
    assert len(await asyncio.to_thread(compact_stream, two.sinks[0], spark, full=True)) == 1
    assert maintenance(two)["maintainer"] == "ep-2"
    assert optimizers(files) == ["ep-1", "ep-2"]
