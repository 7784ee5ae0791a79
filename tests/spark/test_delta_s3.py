"""Delta streams whose table is on S3 (a real SeaweedFS server on loopback,
tests/s3/server.py): exactly once, after a SIGKILL too; every reader reads it
from the bucket; maintenance; one writer per table (the lease)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from daemon.table import quarantine
from daemon.table.delta import app_id, log_commits
from daemon.table.layout import META_DIR
from daemon.table.lease import Holder, Lease, LeaseHeldError, S3Store
from daemon.table.ledger import read_ledger
from daemon.table.location import S3Files
from tests import requires
from tests.s3.server import S3Server
from tests.spark.support import batch_lsns, compact_now, make_batches, producer_of
from tests.spark.test_crash import run_worker

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]


@pytest.fixture(autouse=True)
def _needs_delta(spark: Any) -> None:
    requires.delta_jars()


@pytest.fixture
def table_uri(s3_server: S3Server) -> str:
    """A prefix of the bucket of this test's own."""
    return f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:8]}/all"


def on_s3(s3_server: S3Server, uri: str, **options: Any) -> dict[str, Any]:
    """``stream_options`` of a Delta stream whose table is at ``uri``."""
    return {"format": "delta", "uri": uri, "s3": s3_server.config(), **options}


def s3_lsns(s3_server: S3Server, uri: str) -> list[int]:
    """The LSNs delta-rs reads from the table in the bucket."""
    from deltalake import DeltaTable

    dt = DeltaTable(uri, storage_options=s3_server.storage_options())
    return sorted(dt.to_pyarrow_table(columns=["lsn"])["lsn"].to_pylist())


def s3_txn_versions(s3_server: S3Server, uri: str) -> list[int]:
    files = S3Files(uri, s3_server.config())
    return [
        int(t["version"])
        for _, actions in log_commits(files, -1)
        for t in actions.get("txn", [])
        if t["appId"] == app_id("wal-1", "all")
    ]


def keys(s3_server: S3Server, uri: str, under: str = "") -> list[str]:
    files = S3Files(uri, s3_server.config())
    return [files.where.rel(k) for k in files._keys(under)]


async def test_each_batch_is_one_commit_to_the_table_in_the_bucket_and_a_rerun_writes_nothing(
    executor_factory: Any, tmp_path: Path, s3_server: S3Server, table_uri: str
) -> None:
    """1. Three batches into a Delta stream on S3: one commit each (the
       stream's txn), the data files in the bucket, the daemon's own state
       (ledger) on its disk, none of it in the bucket but the lease.
    2. Batch 2 again: nothing is written.
    3. Status names the table's URI and a held lease; after stop the lease is gone."""
    ex = await executor_factory(stream_options=on_s3(s3_server, table_uri))
    batches = make_batches(3, 300)
    for b in batches:
        assert not await ex.execute(b)
    assert not await ex.execute(batches[1])

    assert s3_lsns(s3_server, table_uri) == batch_lsns(batches)
    assert s3_txn_versions(s3_server, table_uri) == [1, 2, 3]
    ledger = read_ledger(tmp_path / "cdc" / "all")
    assert ledger is not None and ledger.last_batch_id == 3 and ledger.table_format == "delta"
    in_bucket = keys(s3_server, table_uri)
    assert f"{META_DIR}/lease.json" in in_bucket
    assert not [k for k in in_bucket if k.startswith(META_DIR) and k != f"{META_DIR}/lease.json"]
    assert any(k.startswith("collection=orders/part-b000000000001-") for k in in_bucket)
    stream = ex.status()["streams"]["all"]
    assert stream["path"] == table_uri and stream["lease"]["held"] is True
    await ex.stop()
    assert f"{META_DIR}/lease.json" not in keys(s3_server, table_uri, META_DIR)


async def test_every_reader_reads_the_table_from_the_bucket(
    executor_factory: Any, s3_server: S3Server, table_uri: str
) -> None:
    """delta-rs (pyarrow), pandas and Polars read the same rows from S3, with
    the statistics a filter prunes files by."""
    import polars as pl
    import pyarrow as pa
    from deltalake import DeltaTable

    ex = await executor_factory(stream_options=on_s3(s3_server, table_uri))
    batches = make_batches(4, 100)
    for b in batches:
        assert not await ex.execute(b)
    opts = s3_server.storage_options()
    dt = DeltaTable(table_uri, storage_options=opts)
    everything = batch_lsns(batches)
    assert sorted(dt.to_pandas(columns=["lsn"])["lsn"]) == everything
    polars = pl.read_delta(table_uri, storage_options=opts, columns=["lsn", "new_json", "producer"])
    assert sorted(polars["lsn"].to_list()) == everything
    who = dict(zip(polars["lsn"].to_list(), polars["producer"].to_list(), strict=True))
    assert who == {n: producer_of(n) for n in everything}
    assert json.loads(polars.filter(pl.col("lsn") == 7)["new_json"][0])["amount"] == 70
    # Each file's add action has the statistics a filter on lsn prunes by.
    adds = pa.table(dt.get_add_actions(flatten=True)).to_pydict()
    assert None not in adds["min.lsn"] and None not in adds["max.lsn"]
    assert min(adds["min.lsn"]) == 1 and max(adds["max.lsn"]) == everything[-1]
    first = batch_lsns(batches[:1])
    picked = dt.to_pyarrow_table(columns=["lsn"], filters=[("lsn", "<=", first[-1])])
    assert sorted(picked["lsn"].to_pylist()) == first


@pytest.mark.crash
@pytest.mark.parametrize("point", ["delta.before_commit", "delta.after_commit"])
async def test_sigkill_at_a_commit_step_of_a_table_on_s3_recovers_to_exactly_once(
    executor_factory: Any, tmp_path: Path, s3_server: S3Server, table_uri: str, point: str
) -> None:
    """A real executor process SIGKILLs itself at ``point`` in batch 3 of a
    stream on S3 (files uploaded, not committed / committed, not in the
    ledger). The next executor takes the dead process's lease at once (same
    daemon, its pid gone), removes the uploaded orphans or rolls the commit
    forward; batches 3 and 4 then leave every event in the table or the
    quarantine once."""
    s3 = json.dumps({"uri": table_uri, "s3": asdict(s3_server.config())})
    proc = run_worker(
        tmp_path, batches=4, crash_at=f"{point}@3", bad_every=50, table_format="delta", s3=s3
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert "committed 2" in proc.stdout and "committed 3" not in proc.stdout
    uploaded = [k for k in keys(s3_server, table_uri) if "part-b000000000003-" in k]
    assert uploaded  # the crash left batch 3's files in the bucket

    ex = await executor_factory(stream_options=on_s3(s3_server, table_uri))
    ledger = read_ledger(tmp_path / "cdc" / "all")
    assert ledger is not None
    committed = point == "delta.after_commit"
    assert ledger.last_batch_id == (3 if committed else 2)
    left = [k for k in keys(s3_server, table_uri) if "part-b000000000003-" in k]
    assert bool(left) == committed

    batches = make_batches(4, 150, bad_every=50)
    await ex.execute(batches[2])
    await ex.execute(batches[3])
    everything = batch_lsns(batches)
    assert s3_lsns(s3_server, table_uri) == [n for n in everything if n % 50]
    held = [r.lsn for r in quarantine.load(tmp_path / "cdc" / "all" / META_DIR)]
    assert held == [n for n in everything if n % 50 == 0]
    assert s3_txn_versions(s3_server, table_uri) == [1, 2, 3, 4]


async def test_compaction_vacuum_and_retention_run_on_the_table_in_the_bucket(
    executor_factory: Any, s3_server: S3Server, table_uri: str
) -> None:
    """Twelve batches, a compaction (delta-rs OPTIMIZE + VACUUM on S3): one
    file per collection, the rows the same; then retention deletes every row
    older than the cutoff through a Delta DELETE."""
    from deltalake import DeltaTable

    options = on_s3(
        s3_server, table_uri, compact_min_files=4, vacuum_retain_hours=1, retention_check_s=3600
    )
    ex = await executor_factory(
        stream_options=options, partition_by=("collection", "date"), retention_s=86_400
    )
    batches = make_batches(12, 40)
    for b in batches:
        assert not await ex.execute(b)
    opts = s3_server.storage_options()
    before = len(DeltaTable(table_uri, storage_options=opts).file_uris())
    status = await compact_now(ex, "all")
    assert status is not None and status["last_error"] is None, status
    dt = DeltaTable(table_uri, storage_options=opts)
    assert len(dt.file_uris()) < before
    assert s3_lsns(s3_server, table_uri) == batch_lsns(batches)

    # A batch after the compaction's commits (this writer's own, by its
    # commitInfo identity) commits, without a takeover.
    (more,) = make_batches(13, 40)[12:]
    assert not await ex.execute(more)
    # Every batch's events are from 2023 (tests.spark.support): all expired.
    result = await ex.run_retention("all")
    assert result["rows"] == 520, result
    assert s3_lsns(s3_server, table_uri) == []
    assert ex.status()["streams"]["all"]["lease"]["taken_over"] is None


async def test_a_replay_on_s3_commits_once_with_a_txn_of_its_own_behind_the_fence(
    spark: Any, executor_factory: Any, tmp_path: Path, s3_server: S3Server, table_uri: str
) -> None:
    """1. The writer refuses duplicate keys: rows 3, 6 and 9 of a stream on
       S3 are set aside.
    2. The cause fixed, replay: they are in the table once, in a commit with
       the replays' txn (``<app id>/replay``, version 1) and this writer's
       identity; a replay again writes nothing.
    3. A restart fences the table (``<app id>/fence``) and reads it all back."""
    from daemon.table.deltacommit import WRITER_KEY
    from tests.spark import quarantine_worker

    key = "spark.sql.variant.allowDuplicateKeys"
    before = spark.conf.get(key)
    ex = await executor_factory(stream_options=on_s3(s3_server, table_uri))
    spark.conf.set(key, "false")
    try:
        assert not await ex.execute(quarantine_worker.batch())
    finally:
        spark.conf.set(key, before)
    meta = tmp_path / "cdc" / "all" / META_DIR
    assert [r.lsn for r in quarantine.load(meta)] == [3, 6, 9]

    done = await ex.quarantine_action("all", "replay", None)
    again = await ex.quarantine_action("all", "replay", None)
    assert done["lsns"] == [3, 6, 9] and done["quarantined"] == 0
    assert again["replayed"] == 0
    assert s3_lsns(s3_server, table_uri) == list(range(1, 13))
    commits = list(log_commits(S3Files(table_uri, s3_server.config()), -1))
    replays = [a for _, a in commits if a.get("txn", [{}])[0].get("appId", "").endswith("/replay")]
    assert [a["txn"][0]["version"] for a in replays] == [1]
    assert len({a["commitInfo"].get(WRITER_KEY) for _, a in commits}) == 1
    await ex.stop()

    ex = await executor_factory(stream_options=on_s3(s3_server, table_uri))
    fence_app = app_id("wal-1", "all") + "/fence"
    fences = [t for _, a in log_commits(S3Files(table_uri, s3_server.config()), -1)
              for t in a.get("txn", []) if t["appId"] == fence_app]  # fmt: skip
    assert [t["version"] for t in fences] == [1]
    assert s3_lsns(s3_server, table_uri) == list(range(1, 13))


async def test_a_second_writer_is_refused_with_the_holder_named(
    executor_factory: Any, tmp_path: Path, s3_server: S3Server, table_uri: str
) -> None:
    """Two daemons (two data_dirs) on one table: the second does not start,
    its error names the first (host, pid, data_dir, WAL id, stream)."""
    import os

    await executor_factory(stream_options=on_s3(s3_server, table_uri))
    other = tmp_path / "other"
    other.mkdir()
    from daemon.service.metrics import Metrics
    from daemon.spark.executor import SparkExecutor
    from tests.spark.support import make_config

    cfg = make_config(other, stream_options=on_s3(s3_server, table_uri))
    second = SparkExecutor(cfg, Metrics(), wal_id="wal-2")
    with pytest.raises(LeaseHeldError, match="held by") as refused:
        await second.start()
    message = str(refused.value)
    assert f"pid {os.getpid()}" in message and "WAL wal-1" in message, message
    await second.stop()


async def test_cdc_show_reads_the_bucket_and_cdc_lease_names_or_breaks_the_holder(
    executor_factory: Any, s3_server: S3Server, table_uri: str
) -> None:
    """``eventplane cdc show`` reads a table on S3 with delta-rs (no JVM);
    ``eventplane cdc lease`` names the running holder; after a stop there is
    none; a dead holder's lease goes with ``--break --yes``."""
    import io

    from daemon.cli import cdc
    from daemon.table.lease import Holder, Lease, S3Store

    ex = await executor_factory(stream_options=on_s3(s3_server, table_uri))
    batches = make_batches(3, 50)
    for b in batches:
        assert not await ex.execute(b)
    (stream,) = ex.cfg.cdc.streams
    rows = cdc.latest_rows_delta(stream, 5)
    assert [r["lsn"] for r in rows] == batch_lsns(batches)[::-1][:5]
    assert rows[0]["new"].startswith("{") and rows[0]["ingest_ts"].endswith("Z")

    out = io.StringIO()
    assert cdc.lease(stream, break_it=False, yes=False, out=out) == 0
    assert f"pid {os.getpid()}" in out.getvalue() and "expires in" in out.getvalue()
    await ex.stop()
    out = io.StringIO()
    cdc.lease(stream, break_it=False, yes=False, out=out)
    assert "no lease" in out.getvalue()

    files = S3Files(table_uri, s3_server.config())
    key = files.where.key(f"{META_DIR}/lease.json")
    gone = Holder("elsewhere", 1, "/srv/eventplane", "wal-9", "all")
    Lease(S3Store(files.client, files.where.bucket), key, gone).take()
    out = io.StringIO()
    assert cdc.lease(stream, break_it=True, yes=True, out=out) == 0
    assert "host elsewhere" in out.getvalue() and "lease broken" in out.getvalue()
    assert S3Store(files.client, files.where.bucket).get(key) is None


async def test_a_slow_store_makes_batches_slower_never_wrong(
    executor_factory: Any, s3_server: S3Server, table_uri: str
) -> None:
    """Every request to and answer from the store waits up to 150 ms per
    64 KiB (a delaying proxy in front of the server): the batches take
    longer, each still commits once with every row; a commit that outlives
    health.attempt_slow_s comes back in flight and lands the same."""
    from dataclasses import replace as with_

    from daemon.plane.batch import InFlight
    from tests.faults.proxy import FaultyProxy

    port = int(s3_server.endpoint.rsplit(":", 1)[1])
    with FaultyProxy(port, seed=28, delay=1.0, max_delay_s=0.15) as proxy:
        slow = with_(s3_server.config(), endpoint=proxy.url)
        ex = await executor_factory(
            stream_options={**on_s3(s3_server, table_uri), "s3": slow}, attempt_slow_s=1.0
        )
        batches = make_batches(4, 200)
        for b in batches:
            for marker in (await ex.execute(b)).values():
                assert isinstance(marker, InFlight), marker
                await asyncio.wrap_future(marker.done)
        assert proxy.faults["delay"] > 20, proxy.faults
        seconds = ex.status()["last_batch_duration_s"]
        await ex.stop()  # releases the lease through the proxy
    assert s3_lsns(s3_server, table_uri) == batch_lsns(batches)
    assert s3_txn_versions(s3_server, table_uri) == [1, 2, 3, 4]
    assert seconds > 0.1  # a batch's requests waited


def read_every_listed_file(s3_server: S3Server, uri: str) -> int:
    """GET and parse each file the table's newest snapshot lists (one missing
    or cut short fails); their row count."""
    import io

    import pyarrow.parquet as pq
    from deltalake import DeltaTable

    files = S3Files(uri, s3_server.config())
    dt = DeltaTable(uri, storage_options=s3_server.storage_options())
    rows = 0
    for uri_of_file in dt.file_uris():
        key = uri_of_file.split("://", 1)[1].split("/", 1)[1]
        body = files.client.get_object(Bucket=files.where.bucket, Key=key)
        rows += pq.read_table(io.BytesIO(body["Body"].read())).num_rows
    return rows


def writers_after_fence(s3_server: S3Server, uri: str) -> tuple[int, list[str]]:
    """The newest fencing commit's version, and the writer of each commit
    from it on (commitInfo's ``eventplaneWriter``)."""
    from daemon.table.deltacommit import WRITER_KEY

    commits = list(log_commits(S3Files(uri, s3_server.config()), -1))
    fence = max(
        v for v, a in commits if a.get("commitInfo", {}).get("operation") == "SET TBLPROPERTIES"
    )
    return fence, [str(a["commitInfo"].get(WRITER_KEY)) for v, a in commits if v >= fence]


@pytest.mark.crash
@pytest.mark.parametrize("order", ["b_commits_first", "a_wakes_first"])
async def test_a_writer_paused_before_its_log_commit_never_lands_after_a_takeover(
    executor_factory: Any, tmp_path: Path, s3_server: S3Server, table_uri: str, order: str
) -> None:
    """1. Writer A (a real process; lease ttl 8 s, skew 1 s) commits batches
       1-2, uploads batch 3's files and reads the log, then stops itself
       (SIGSTOP) at ``delta.before_log_commit``, past every lease check.
    2. Writer B (another data_dir) is refused while A's lease lives (a bare
       lease take: a whole executor start could outlast the lease on a busy
       machine), takes it once it expired: its open commits the fence, then removes A's batch 3
       files (orphans to B).
    3. ``b_commits_first``: B commits batches 3 and 4, then A wakes (SIGCONT);
       ``a_wakes_first``: A wakes right after B's fence, B commits afterwards.
    4. A's commit loses its version (no automatic retry), A reads the log,
       finds B's fence and stops: nothing of A's lands after the fence, every
       file the table lists exists, every batch is in the table once."""
    import sys
    import time

    from daemon.table.crash import ENV_PAUSE_AT
    from tests.spark.test_crash import REPO

    # One request with its retry, (1 + 2) x 2 s, fits the lease window, 8 - 1 s.
    short = s3_server.config(
        lease_ttl_s=8.0, lease_skew_s=1.0, connect_timeout_s=1.0, request_timeout_s=2.0,
        max_retries=1,
    )  # fmt: skip
    s3 = json.dumps({"uri": table_uri, "s3": asdict(short)})
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYSPARK_PYTHON": sys.executable,
           ENV_PAUSE_AT: "delta.before_log_commit@3"}  # fmt: skip
    a_root = tmp_path / "a"
    a_root.mkdir()
    argv = ["-m", "tests.spark.crash_worker", str(a_root), "--batches", "3", "--per-batch",
            "100", "--format", "delta", "--s3", s3]  # fmt: skip
    err = (tmp_path / "a.stderr").open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *argv, cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=err
    )
    timeline: dict[str, float] = {}
    t0 = time.monotonic()

    def mark(what: str) -> None:
        timeline[what] = round(time.monotonic() - t0, 1)

    try:
        deadline = time.monotonic() + 240
        while b"pause point delta.before_log_commit" not in (tmp_path / "a.stderr").read_bytes():
            assert proc.returncode is None and time.monotonic() < deadline
            await asyncio.sleep(0.1)
        t0 = time.monotonic()  # A is stopped from here
        mark("a_paused")
        assert [k for k in keys(s3_server, table_uri) if "part-b000000000003-" in k]

        options = on_s3(s3_server, table_uri, s3=short)
        files = S3Files(table_uri, short)
        probe = Lease(
            S3Store(files.client, files.where.bucket),
            files.where.key(f"{META_DIR}/lease.json"),
            Holder.this_process(str(tmp_path / "b"), "wal-1", "all"),
            ttl_s=short.lease_ttl_s,
            skew_s=short.lease_skew_s,
        )
        with pytest.raises(LeaseHeldError, match="held by"):
            await asyncio.to_thread(probe.take)
        mark("b_refused")
        # A's lease lives at least ttl - renew interval + skew after its last renewal.
        assert time.monotonic() - t0 < short.lease_ttl_s - probe.renew_s + short.lease_skew_s
        await asyncio.sleep(max(0.0, 9.5 - (time.monotonic() - t0)))
        b = await executor_factory(stream_options=options)
        mark("b_fenced")
        # A's batch 3 was never in the log, so B removed its files (on failure:
        # A's own account of its attempts, which decides the order of events).
        left = [k for k in keys(s3_server, table_uri) if "part-b000000000003-" in k]
        assert not left, (left, (tmp_path / "a.stderr").read_text()[-4000:])
        batches = make_batches(4, 100)

        async def b_commits() -> None:
            assert not await b.execute(batches[2])
            assert not await b.execute(batches[3])
            mark("b_committed_3_4")

        if order == "b_commits_first":
            await b_commits()
        os.kill(proc.pid, signal.SIGCONT)
        mark("a_woken")
        raw, _ = await asyncio.wait_for(proc.communicate(), 120)
        mark("a_exited")
        if order == "a_wakes_first":
            await b_commits()
    finally:
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            await proc.wait()
        err.close()
    out = raw.decode()
    print(f"\npause timeline ({order}), seconds after A stopped: {timeline}")
    assert proc.returncode != 0 and "committed 2" in out and "committed 3" not in out, out
    assert "took the table over" in out, out
    fence, writers = writers_after_fence(s3_server, table_uri)
    # Versions 0-2 are A's (create, batches 1-2); then B's fence, B's 3 and 4 only.
    assert fence == 3 and len(set(writers)) == 1 and len(writers) == 3, (fence, writers)
    (stream,) = b.status()["streams"].values()
    assert stream["lease"]["held"] is True and stream["lease"]["taken_over"] is None
    assert read_every_listed_file(s3_server, table_uri) == 400
    assert s3_lsns(s3_server, table_uri) == batch_lsns(batches)
    assert s3_txn_versions(s3_server, table_uri) == [1, 2, 3, 4]
