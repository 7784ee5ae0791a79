"""Shared Delta tables written by real processes: two executor processes
(tests/spark/crash_worker.py, each its own WAL id, ``[daemon] name`` and
Spark), appending at once to one table on disk or on S3 (SeaweedFS), each
SIGKILLed at a crash point between the write and the ledger, then run again:
every (writer, lsn) is in the table once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from daemon.table.crash import ENV_CRASH_AT
from daemon.table.delta import app_id, log_commits
from daemon.table.lease import S3Store
from daemon.table.location import LocalFiles, S3Files, TableFiles
from tests import requires
from tests.s3.server import S3Server
from tests.spark.support import batch_lsns, make_batches
from tests.spark.test_crash import REPO
from tests.spark.test_delta_shared import writer_lsns

pytestmark = [pytest.mark.spark, pytest.mark.crash, pytest.mark.timeout(900)]

BATCHES = 5
PER_BATCH = 200
# Each writer's crash: ep-1 with batch 3's files in the table, not in its log;
# ep-2 with batch 2 committed, not in its ledger.
CRASHES = {"ep-1": "delta.before_commit@3", "ep-2": "delta.after_commit@2"}


@pytest.fixture(autouse=True)
def _needs_delta(spark: Any) -> None:
    requires.delta_jars()


def start(root: Path, name: str, wal_id: str, tables: Path, s3: str, crash_at: str) -> Any:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYSPARK_PYTHON": sys.executable}
    env.pop(ENV_CRASH_AT, None)
    if crash_at:
        env[ENV_CRASH_AT] = crash_at
    cmd = [sys.executable, "-m", "tests.spark.crash_worker", str(root),
           "--batches", str(BATCHES), "--per-batch", str(PER_BATCH), "--master", "local[1]",
           "--format", "delta", "--wal-id", wal_id, "--daemon-name", name]  # fmt: skip
    # On S3 each process's own state is under its root (as under its data_dir).
    cmd += ["--s3", s3] if s3 else ["--tables", str(tables)]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def run_both(tmp_path: Path, s3: str, *, crash: bool) -> dict[str, tuple[int, str, str]]:
    """Both writers at once; ``{name: (returncode, stdout, stderr)}``."""
    procs = {
        name: start(
            tmp_path / name, name, f"wal-{name}", tmp_path / "lake", s3, CRASHES[name] * crash
        )
        for name in CRASHES
    }
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        out[name] = (proc.returncode, stdout, stderr)
    return out


def check_exactly_once(files: TableFiles, uri: str, options: dict[str, str] | None) -> None:
    """Every (writer, lsn) once, through delta-rs and through DuckDB; each
    writer's txn versions 1..BATCHES once; no data file outside the snapshot."""
    import duckdb
    from deltalake import DeltaTable

    lsns = batch_lsns(make_batches(BATCHES, PER_BATCH))
    want = sorted((name, n) for name in CRASHES for n in lsns)
    assert writer_lsns(uri, options) == want
    dataset = DeltaTable(uri, storage_options=options).to_pyarrow_dataset()  # noqa: F841
    got = duckdb.sql("SELECT writer, lsn, count(*) FROM dataset GROUP BY ALL").fetchall()
    assert sorted((w, n) for w, n, _ in got) == want and {c for _, _, c in got} == {1}
    for name in CRASHES:
        versions = [
            int(t["version"])
            for _, actions in log_commits(files, -1)
            for t in actions.get("txn", [])
            if t["appId"] == app_id(f"wal-{name}", "all")
        ]
        assert versions == list(range(1, BATCHES + 1)), name
    import pyarrow as pa

    adds = pa.table(DeltaTable(uri, storage_options=options).get_add_actions(flatten=True))
    listed = {unquote(p) for p in adds["path"].to_pylist()}
    on_store = {rel for _, rel in files.published()}
    assert on_store == listed  # the crashed attempt's files went at the next open


def check_crashed(first: dict[str, tuple[int, str, str]]) -> None:
    for name, (rc, stdout, stderr) in first.items():
        assert rc == -signal.SIGKILL, (name, stdout[-2000:], stderr[-3000:])
    assert "committed 2" in first["ep-1"][1] and "committed 3" not in first["ep-1"][1]
    assert "committed 1" in first["ep-2"][1] and "committed 2" not in first["ep-2"][1]


def check_finished(second: dict[str, tuple[int, str, str]]) -> int:
    """Both ran to the end; their commit retries (another's commit took the version)."""
    retries = 0
    for name, (rc, stdout, stderr) in second.items():
        assert rc == 0, (name, stdout[-2000:], stderr[-3000:])
        assert f"committed {BATCHES}" in stdout
        retries += int(stdout.split("retries ", 1)[1].split()[0])
    return retries


def test_two_writer_processes_sigkilled_mid_commit_leave_each_writer_lsn_once_on_disk(
    tmp_path: Path,
) -> None:
    """1. ep-1 and ep-2 (own WALs, own Spark) append batches 1-5 of the same
       LSNs to one table folder at once; ep-1 is SIGKILLed in batch 3 with its
       files in the table's folders, not in the log; ep-2 in batch 2 with it
       committed, not in its ledger.
    2. Both run again, at once: ep-1 removes its orphans (only its own), ep-2
       rolls its commit forward; both finish.
    3. delta-rs and DuckDB read every (writer, lsn) once."""
    check_crashed(run_both(tmp_path, "", crash=True))
    retries = check_finished(run_both(tmp_path, "", crash=False))
    table = tmp_path / "lake" / "all"
    check_exactly_once(LocalFiles(table), str(table), None)
    print(f"commit retries: {retries}")


def test_two_writer_processes_sigkilled_mid_commit_leave_each_writer_lsn_once_on_s3(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """As on disk, with the table in a SeaweedFS bucket: each writer's lease
    is its name's, and its fence counts only its name's commits."""
    import uuid

    uri = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:8]}/all"
    s3 = json.dumps({"uri": uri, "s3": asdict(s3_server.config())})
    check_crashed(run_both(tmp_path, s3, crash=True))
    second_began = time.time()
    retries = check_finished(run_both(tmp_path, s3, crash=False))
    files = S3Files(uri, s3_server.config())
    check_exactly_once(files, uri, s3_server.storage_options())
    left = [files.where.rel(k) for k in files._keys("_eventplane/")]
    maintainer = "_eventplane/maintainer.json"
    assert [k for k in left if k != maintainer] == []  # each writer's lease went when it stopped
    if maintainer in left:
        # Only a SIGKILLed first run's maintenance lease may stay (nobody
        # released it; the second run ended before it expired): the second
        # run's daemons released theirs when they stopped.
        held = S3Store(files.client, files.where.bucket).get(files.where.key(maintainer))
        assert held is not None and json.loads(held[0])["renewed_at"] < second_began
    print(f"commit retries: {retries}")


async def test_a_paused_writer_of_a_shared_table_lands_nothing_after_its_names_takeover(
    executor_factory: Any, tmp_path: Path, s3_server: S3Server
) -> None:
    """Invariant 23 (18 per name) on S3:

    1. Writer A (a real process, ep-1 of WAL wal-1; lease ttl 8 s) commits
       batches 1-2 to a shared table, uploads batch 3's files, reads the log
       and stops itself (SIGSTOP) at ``delta.before_log_commit``.
    2. ep-2 (another WAL) commits its batch 1: another name's commit, which
       ep-1's fence does not count.
    3. Once A's lease expired, B (ep-1 of wal-1 again, another data_dir: a
       takeover) opens: its fence commit, A's batch 3 files removed; B commits
       batches 3 and 4.
    4. A wakes (SIGCONT): its commit loses its version, it reads the log,
       finds its name's fence by another process and stops. Every (writer,
       lsn) is in the table once; ep-1's txn versions are 1-4 once."""
    import asyncio
    import time
    import uuid

    from daemon.table.crash import ENV_PAUSE_AT

    uri = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:8]}/all"
    short = s3_server.config(
        lease_ttl_s=8.0, lease_skew_s=1.0, connect_timeout_s=1.0, request_timeout_s=2.0,
        max_retries=1,
    )  # fmt: skip
    s3 = json.dumps({"uri": uri, "s3": asdict(short)})
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYSPARK_PYTHON": sys.executable,
           ENV_PAUSE_AT: "delta.before_log_commit@3"}  # fmt: skip
    argv = ["-m", "tests.spark.crash_worker", str(tmp_path / "a"), "--batches", "3",
            "--per-batch", "100", "--format", "delta", "--s3", s3, "--wal-id", "wal-1",
            "--daemon-name", "ep-1"]  # fmt: skip
    err = (tmp_path / "a.stderr").open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *argv, cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=err
    )
    options = {"format": "delta", "uri": uri, "s3": short, "writers": "shared"}
    files = S3Files(uri, short)

    def ep1_batch3() -> list[str]:
        return [r for _, r in files.published() if "writer=ep-1" in r and "-b000000000003-" in r]

    batches = make_batches(4, 100)
    try:
        deadline = time.monotonic() + 240
        while b"pause point delta.before_log_commit" not in (tmp_path / "a.stderr").read_bytes():
            assert proc.returncode is None and time.monotonic() < deadline
            await asyncio.sleep(0.1)
        paused = time.monotonic()
        assert ep1_batch3()
        other = await executor_factory(
            root=tmp_path / "c", wal_id="wal-2", daemon_name="ep-2", stream_options=options
        )
        assert not await other.execute(batches[0])
        await asyncio.sleep(max(0.0, 9.5 - (time.monotonic() - paused)))
        b = await executor_factory(
            root=tmp_path / "b", wal_id="wal-1", daemon_name="ep-1", stream_options=options
        )
        assert not ep1_batch3()  # the new holder removed the paused one's upload
        # `eventplane cdc lease` shows the name's lease: B's, the new holder.
        import io

        from daemon.cli import cdc
        from daemon.configtypes import CdcStream

        shown = io.StringIO()
        stream = CdcStream(
            "all", ("*",), tmp_path / "b", format="delta", uri=uri, s3=short, writers="shared"
        )
        assert cdc.lease(stream, break_it=False, yes=False, out=shown, name="ep-1") == 0
        assert "lease held by" in shown.getvalue() and str(tmp_path / "b") in shown.getvalue()
        assert not await b.execute(batches[2])
        assert not await b.execute(batches[3])
        os.kill(proc.pid, signal.SIGCONT)
        raw, _ = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            await proc.wait()
        err.close()
    out = raw.decode()
    assert proc.returncode != 0 and "committed 2" in out and "committed 3" not in out, out
    assert "took the table over" in out, out
    lsns = batch_lsns(batches)
    want = sorted([("ep-1", n) for n in lsns] + [("ep-2", n) for n in batch_lsns(batches[:1])])
    assert writer_lsns(uri, s3_server.storage_options()) == want
    versions = [
        int(t["version"])
        for _, actions in log_commits(files, -1)
        for t in actions.get("txn", [])
        if t["appId"] == app_id("wal-1", "all")
    ]
    assert versions == [1, 2, 3, 4]
