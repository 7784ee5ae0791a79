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
from daemon.table.lease import LeaseHeldError
from daemon.table.ledger import read_ledger
from daemon.table.location import S3Files
from tests.s3.server import S3Server
from tests.spark.support import batch_lsns, compact_now, make_batches, producer_of
from tests.spark.test_crash import run_worker

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]


@pytest.fixture(autouse=True)
def _needs_delta(spark: Any) -> None:
    from daemon.spark import deltajars

    if deltajars.missing():
        pytest.skip("needs Delta Lake's jars (make delta-jars)")


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

    # Every batch's events are from 2023 (tests.spark.support): all expired.
    result = await ex.run_retention("all")
    assert result["rows"] == 480, result
    assert s3_lsns(s3_server, table_uri) == []


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
    rows = cdc.latest_rows_s3(stream, 5)
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
        ex = await executor_factory(stream_options={**on_s3(s3_server, table_uri), "s3": slow})
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


@pytest.mark.crash
async def test_a_stalled_writer_never_commits_after_another_took_its_table_over(
    executor_factory: Any, tmp_path: Path, s3_server: S3Server, table_uri: str
) -> None:
    """1. Writer A (a real process, lease ttl 6 s, skew 1 s) commits batches
       1-2, then is frozen (SIGSTOP) before batch 3.
    2. Writer B (another data_dir) is refused while A's lease lives, takes
       the table once it expired, and commits batches 3 and 4.
    3. A thaws (SIGCONT) and tries batch 3: its deadline passed and its
       renewal finds B's lease (412), so it refuses to commit. The table holds
       each batch once, B's."""
    import sys
    import time

    from tests.spark.test_crash import REPO

    short = s3_server.config(lease_ttl_s=6.0, lease_skew_s=1.0)
    s3 = json.dumps({"uri": table_uri, "s3": asdict(short)})
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYSPARK_PYTHON": sys.executable}
    a_root = tmp_path / "a"
    a_root.mkdir()
    argv = ["-m", "tests.spark.crash_worker", str(a_root), "--batches", "3", "--per-batch",
            "100", "--format", "delta", "--s3", s3, "--pause-before", "3"]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *argv, cwd=REPO, env=env, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        lines: list[str] = []
        while "paused 3" not in lines:
            line = await asyncio.wait_for(proc.stdout.readline(), 240)
            assert line, lines  # the worker ended before batch 3
            lines.append(line.decode().strip())
        assert "committed 2" in lines, lines
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()

        options = on_s3(s3_server, table_uri, s3=short)
        with pytest.raises(LeaseHeldError, match="held by"):
            await executor_factory(stream_options=options)
        await asyncio.sleep(max(0.0, 7.5 - (time.monotonic() - stopped)))
        b = await executor_factory(stream_options=options)
        batches = make_batches(4, 100)
        assert not await b.execute(batches[2])
        assert not await b.execute(batches[3])

        os.kill(proc.pid, signal.SIGCONT)
        raw, _ = await asyncio.wait_for(proc.communicate(b"go\n"), 120)
        out = raw.decode()
    finally:
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            await proc.wait()
    assert proc.returncode != 0 and "committed 3" not in out
    assert "not committing" in out and "LeaseError" in out, out
    assert s3_lsns(s3_server, table_uri) == batch_lsns(batches)
    assert s3_txn_versions(s3_server, table_uri) == [1, 2, 3, 4]
