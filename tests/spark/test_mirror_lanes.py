"""A mirror's merge runs in a lane of its own, in both executors: one that hangs
on its store is handed back in flight after the wait while the other stages
commit, health can say what it waits for, it lands by itself, and a re-run
of its batch writes nothing (invariants 6 and 22). The planner's side of an
attempt in flight, with stand-in stages, is tests/core/test_slow_stages.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from daemon import events
from daemon.config import CdcMirror, Config
from daemon.metrics import Metrics
from daemon.plane.batch import InFlight
from daemon.spark.executor import SparkExecutor
from daemon.spark.mirrors import MirrorExecutor
from daemon.table import mirror as mirrormod
from daemon.table.mirror import MirrorTable
from tests.core.test_stages import make
from tests.spark.support import make_config
from tests.table.test_mirror import COLUMNS, make_batch, read_rows
from wal.record import Record

# How long a batch waits for a merge or a commit here: well over what one of
# these batches takes on a busy machine (a fraction of a second), and what a
# hung one costs the test.
WAIT_S = 2.0


class Hang:
    """Wraps a mirror's real commit: a batch in ``hold`` waits for ``release``
    first (a store that does not answer), then commits for real."""

    def __init__(self, table: MirrorTable) -> None:
        self.real = table.commit
        self.hold: set[int] = set()
        self.release = threading.Event()
        self.threads: list[str] = []

    def __call__(self, rows: Any, batch: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        if batch.batch_id in self.hold:
            assert self.release.wait(60), "never released"
        return self.real(rows, batch)


def with_mirrors(cfg: Config, root: Path, *names: str, streams: bool = True) -> Config:
    mirrors = tuple(CdcMirror(n, "orders", root / n, COLUMNS, buckets=4) for n in names)
    cdc = dataclasses.replace(cfg.cdc, mirrors=mirrors, **({} if streams else {"streams": ()}))
    return dataclasses.replace(cfg, cdc=cdc)


B1 = [(1, "orders", "insert", "a", {"amount": 1}), (2, "orders", "insert", "b", {"amount": 2})]
B2 = [(3, "orders", "update", "a", {"amount": 3}), (4, "orders", "delete", "b", None)]
B3 = [(5, "orders", "insert", "c", {"amount": 5})]


async def test_a_hung_mirror_merge_is_in_flight_while_the_other_mirror_commits_and_lands_once(
    tmp_path: Path, metrics: Metrics
) -> None:
    """The executor of a mirrors-only daemon:
    1. ``slow``'s merge of batch 1 hangs: it comes back ``InFlight`` after the
       wait, ``fast`` has committed batch 1;
    2. ``fast`` commits batch 2 meanwhile, and ``waiting_for`` names the merge;
    3. released, the merge lands, in ``slow``'s lane, where its compaction
       runs too; a re-run of batch 1 writes nothing (its txn); batch 2 follows."""
    cfg = with_mirrors(make_config(tmp_path), tmp_path, "slow", "fast", streams=False)
    ex = MirrorExecutor(cfg, metrics, wal_id="wal-1")
    await ex.start()
    try:
        slow = ex._mirrors[0]
        hang = Hang(slow)
        hang.hold.add(1)
        slow.commits_since_compaction = mirrormod.COMPACT_EVERY - 1  # due at its next merge
        real_compact = slow.compact

        def compact() -> Any:
            hang.threads.append(f"compact in {threading.current_thread().name}")
            return real_compact()

        with (
            mock.patch.object(slow, "commit", side_effect=hang),
            mock.patch.object(slow, "compact", side_effect=compact),
        ):
            b1, b2 = make_batch(1, B1), make_batch(2, B2)
            got = await ex.execute(b1, wait_s=WAIT_S)  # Step 1.
            marker = got.pop("mirror:slow")
            assert isinstance(marker, InFlight) and marker.batch_id == 1 and got == {}
            assert set(read_rows(tmp_path / "fast")) == {"a", "b"}

            assert await ex.execute(b2, {"mirror:fast"}, wait_s=WAIT_S) == {}  # Step 2.
            assert set(read_rows(tmp_path / "fast")) == {"a"}
            waits = ex.waiting_for("mirror:slow")
            assert waits is not None
            assert waits.startswith(f"its merge of batch 1 into {tmp_path / 'slow'}, running for")
            assert ex.waiting_for("mirror:fast") is None

            hang.release.set()  # Step 3.
            assert await asyncio.wait_for(asyncio.wrap_future(marker.done), 60) is None
            lane = "eventplane-lane-mirror:slow"
            assert hang.threads == [lane, f"compact in {lane}"]
            version = slow._table(create=False).version()
            assert await ex.execute(b1, {"mirror:slow"}, wait_s=WAIT_S) == {}
            slow._table(create=False).update_incremental()
            assert slow._table(create=False).version() == version
            assert await ex.execute(b2, {"mirror:slow"}, wait_s=WAIT_S) == {}
        assert {k: r["amount"] for k, r in read_rows(tmp_path / "slow").items()} == {"a": 3.0}
        assert ex.status()["mirrors"]["slow"]["last_batch_id"] == 2
    finally:
        await ex.stop()


def order(lsn: int, op: str, key: str, amount: float | None = None) -> Record:
    """An event of ``orders`` as the WAL holds it, on core 0."""
    body = None if amount is None else json.dumps({"amount": amount}).encode()
    event = events.StoredEvent("orders", op, key, body, None, lsn * 1000, producer="p1")  # type: ignore[arg-type]
    return Record(lsn, 0, lsn, events.encode(event))


async def test_the_planner_runs_ahead_of_a_hung_mirror_merge_and_the_mirror_catches_up(
    tmp_path: Path, metrics: Metrics
) -> None:
    """The planner with the executor of a mirrors-only daemon:
    1. ``slow``'s merge of batch 2 hangs: the planner gets it back in flight;
    2. ``fast`` commits batches 2-4 meanwhile and ``slow`` takes none; past
       attempt_slow_s, health calls ``slow`` slow and names the merge;
    3. released, it lands, catches up 3-4 from the plans, the watermarks
       reach batch 4, and both mirrors hold the same rows."""
    cfg = with_mirrors(
        make_config(tmp_path, attempt_slow_s=2 * WAIT_S), tmp_path, "slow", "fast", streams=False
    )
    ex = MirrorExecutor(cfg, metrics, wal_id="wal-t")
    await ex.start()
    now = [100.0]
    wal: list[Record] = []
    planner = make(tmp_path, ex, wal, clock=lambda: now[0], attempt_slow_s=2 * WAIT_S)

    async def feed(*records: Record) -> None:
        for record in records:  # one batch each
            wal.append(record)
            planner.add(0, [record])
            await planner.run_once()

    try:
        slow = ex._mirrors[0]
        hang = Hang(slow)
        hang.hold.add(2)
        with mock.patch.object(slow, "commit", side_effect=hang):
            await feed(order(1, "insert", "a", 1), order(2, "insert", "b", 2))  # Step 1.
            await feed(order(3, "update", "a", 3), order(4, "delete", "b"))  # Step 2.
            assert set(read_rows(tmp_path / "fast")) == {"a"}
            assert set(read_rows(tmp_path / "slow")) == {"a"}
            entry = planner.stages.entry("mirror:slow", planner.live_id)
            assert entry["in_flight"] and entry["batch_id"] == 1 and not entry["slow"]
            now[0] += 2 * WAIT_S + 0.5
            entry = planner.stages.entry("mirror:slow", planner.live_id)
            assert entry["slow"] and entry["attempt_batch_id"] == 2
            assert entry["waiting_for"].startswith("its merge of batch 2 into")
            assert not planner.stages.entry("mirror:fast", planner.live_id)["slow"]
            assert planner.watermarks.batch_id == 1  # the WAL keeps what slow needs

            hang.release.set()  # Step 3.
            deadline = time.monotonic() + 60
            while planner.stages.entry("mirror:slow", planner.live_id)["in_flight"]:
                assert time.monotonic() < deadline, "the merge never landed"
                await asyncio.sleep(0.05)
            await planner._run_behind()
        assert planner.watermarks.batch_id == 4
        lsns = {
            n: {k: r["lsn"] for k, r in read_rows(tmp_path / n).items()} for n in ("slow", "fast")
        }
        assert lsns == {"slow": {"a": 3}, "fast": {"a": 3}}
    finally:
        await ex.stop()


async def test_a_hung_merge_that_fails_when_it_lands_is_the_mirrors_error_alone(
    tmp_path: Path, metrics: Metrics
) -> None:
    cfg = with_mirrors(make_config(tmp_path), tmp_path, "slow", "fast", streams=False)
    ex = MirrorExecutor(cfg, metrics, wal_id="wal-1")
    await ex.start()
    try:
        slow = ex._mirrors[0]
        hang = Hang(slow)
        hang.hold.add(1)
        hang.real = mock.Mock(side_effect=OSError("s3: read timeout"))
        with mock.patch.object(slow, "commit", side_effect=hang):
            marker = (await ex.execute(make_batch(1, B1), wait_s=WAIT_S))["mirror:slow"]
            assert isinstance(marker, InFlight)
            hang.release.set()
            with pytest.raises(OSError, match="read timeout"):
                await asyncio.wait_for(asyncio.wrap_future(marker.done), 60)
        assert ex.status()["last_error"] == "stage mirror:slow: OSError: s3: read timeout"
        assert set(read_rows(tmp_path / "fast")) == {"a", "b"}
    finally:
        await ex.stop()


@pytest.mark.spark
async def test_a_hung_mirror_merge_holds_back_neither_the_stream_beside_it_nor_its_batch(
    spark: Any, tmp_path: Path, metrics: Metrics
) -> None:
    """The Spark executor: 1. batch 1 warms the stream and the mirror up;
    2. the mirror's merge of batch 2 hangs: it comes back ``InFlight`` after
    half of attempt_slow_s, the CDC stream has committed batch 2; 3. the
    stream commits batch 3 meanwhile; 4. released, the merge lands in the
    mirror's lane and the mirror takes batch 3."""
    cfg = with_mirrors(make_config(tmp_path, attempt_slow_s=2 * WAIT_S), tmp_path, "orders")
    ex = SparkExecutor(cfg, metrics, wal_id="wal-1", session=spark)
    await ex.start()
    try:
        hang = Hang(ex._mirrors[0])
        hang.hold.add(2)
        b1, b2, b3 = make_batch(1, B1), make_batch(2, B2), make_batch(3, B3)
        with mock.patch.object(ex._mirrors[0], "commit", side_effect=hang):
            assert await ex.execute(b1, wait_s=float("inf")) == {}  # Step 1.
            got = await ex.execute(b2)  # Step 2: waits half of attempt_slow_s.
            marker = got.pop("mirror:orders")
            assert isinstance(marker, InFlight) and marker.batch_id == 2 and got == {}
            assert ex.status()["streams"]["all"]["last_batch_id"] == 2
            assert await ex.execute(b3, {"cdc:all"}) == {}  # Step 3.
            assert ex.status()["streams"]["all"]["last_batch_id"] == 3
            waits = ex.waiting_for("mirror:orders")
            assert waits is not None and waits.startswith("its merge of batch 2 into")
            hang.release.set()  # Step 4.
            assert await asyncio.wait_for(asyncio.wrap_future(marker.done), 60) is None
            assert set(hang.threads) == {"eventplane-lane-mirror:orders"}
            assert await ex.execute(b3, {"mirror:orders"}) == {}
        rows = read_rows(tmp_path / "orders")
        assert {k: r["lsn"] for k, r in rows.items()} == {"a": 3, "c": 5}
        lsns = {
            r.lsn for r in spark.read.parquet(str(tmp_path / "cdc" / "all")).select("lsn").collect()
        }
        assert lsns == {1, 2, 3, 4, 5}
    finally:
        await ex.stop()
