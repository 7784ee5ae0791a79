"""A mirror whose table is on S3 (a real SeaweedFS server on loopback,
tests/s3/server.py): each batch is one merge into the table in the bucket, a
re-run writes nothing, delta-rs and Polars read it from the bucket, and the
table has one writer: the lease, and the fence in its log (invariant 18), so a
writer paused or cut off lands nothing after a takeover."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from daemon.config import CdcMirror
from daemon.spark import frame
from daemon.table.deltacommit import WRITER_KEY
from daemon.table.fence import log_commits
from daemon.table.layout import META_DIR
from daemon.table.lease import (
    LeaseError,
    LeaseHeldError,
    S3Store,
    TableTakenOverError,
    break_lease,
)
from daemon.table.location import S3Files
from daemon.table.mirror import MirrorTable, fold, reduce
from tests.s3.server import S3Server
from tests.table.mirror_worker import WAL_ID, batches, mirror_on_s3
from tests.table.test_mirror import COLUMNS, CORES, commit, make_batch

pytestmark = pytest.mark.timeout(300)


def on_s3(s3_server: S3Server, uri: str, state: Path) -> CdcMirror:
    return CdcMirror("orders", "orders", state, COLUMNS, buckets=4, uri=uri, s3=s3_server.config())


def test_a_mirror_in_a_bucket_is_merged_once_per_batch_and_has_one_writer(
    tmp_path: Path, s3_server: S3Server
) -> None:
    import polars as pl
    from deltalake import DeltaTable

    uri = f"s3://{s3_server.bucket}/m-{uuid.uuid4().hex[:8]}/orders"
    m = MirrorTable(on_s3(s3_server, uri, tmp_path / "a"), wal_id="w1", cores=CORES)
    m.open()
    try:
        batches = [
            make_batch(
                1,
                [
                    (1, "orders", "insert", "a", {"amount": 1}),
                    (2, "orders", "insert", "b", {"amount": 2}),
                ],
            ),
            make_batch(
                2, [(3, "orders", "delete", "a", None), (4, "orders", "update", "c", {"amount": 4})]
            ),
        ]
        for b in batches:
            assert not commit(m, b).noop
        table = DeltaTable(uri, storage_options=s3_server.storage_options())
        version = table.version()
        assert commit(m, batches[1]).noop
        table.update_incremental()
        assert table.version() == version
        rows = {r["key"]: r["amount"] for r in table.to_pyarrow_table().to_pylist()}
        assert rows == {"b": 2.0, "c": 4.0}
        frame = pl.read_delta(uri, storage_options=s3_server.storage_options())
        assert frame.height == 2
        assert table.transaction_version(m.app_id) == 2
        assert m.status()["lease"]["held"] is True
        # Another daemon (another data_dir) is refused while this one writes.
        other = MirrorTable(on_s3(s3_server, uri, tmp_path / "b"), wal_id="w1", cores=CORES)
        with pytest.raises(LeaseHeldError):
            other.open()
    finally:
        m.close()
    # Released at close: the other one takes the table and knows its last batch.
    other.open()
    try:
        assert other.last_batch_id == 2
    finally:
        other.close()


def writers_from_fence(s3_server: S3Server, uri: str) -> tuple[int, list[str]]:
    """The newest fencing commit's version, and the writer of each commit
    from it on (commitInfo's ``eventplaneWriter``)."""
    commits = list(log_commits(S3Files(uri, s3_server.config()), -1))
    fence = max(
        v for v, a in commits if a.get("commitInfo", {}).get("operation") == "SET TBLPROPERTIES"
    )
    return fence, [str(a["commitInfo"].get(WRITER_KEY)) for v, a in commits if v >= fence]


def txn_versions(s3_server: S3Server, uri: str, app: str) -> list[int]:
    return [
        int(t["version"])
        for _, actions in log_commits(S3Files(uri, s3_server.config()), -1)
        for t in actions.get("txn", [])
        if t["appId"] == app
    ]


def mirror_rows(s3_server: S3Server, uri: str) -> dict[str, tuple[int, Any]]:
    from deltalake import DeltaTable

    rows = DeltaTable(uri, storage_options=s3_server.storage_options()).to_pyarrow_table()
    return {r["key"]: (r["lsn"], r["amount"]) for r in rows.to_pylist()}


def folded(cfg: CdcMirror, batches: list[Any]) -> dict[str, tuple[int, Any]]:
    state: dict[str, dict[str, Any]] = {}
    for b in batches:
        fold(cfg, state, reduce(cfg, frame.batch_table(b)))
    return {k: (r["lsn"], r["amount"]) for k, r in state.items()}


def break_the_lease(s3_server: S3Server, uri: str) -> None:
    files = S3Files(uri, s3_server.config())
    break_lease(
        S3Store(files.client, files.where.bucket), files.where.key(f"{META_DIR}/lease.json")
    )


def test_compaction_and_merges_after_a_takeover_never_land_and_name_the_new_writer(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """1. Writer A merges batches 1-2; its lease is broken (a daemon that
       looks gone), B opens the mirror: its fence is the next commit.
    2. A's compaction (its lease still valid by A's own clock) reads the log,
       finds B's fence and stops: TableTakenOverError naming B; A's status
       says taken over; a merge of A's after it fails too.
    3. B merges batches 3-4: nothing of A's after the fence, the mirror is the
       fold of batches 1-4."""
    uri = f"s3://{s3_server.bucket}/m-{uuid.uuid4().hex[:8]}/orders"
    four = batches(4)
    a = MirrorTable(
        mirror_on_s3(tmp_path / "a", uri, s3_server.config()), wal_id=WAL_ID, cores=CORES
    )
    a.open()
    b = MirrorTable(
        mirror_on_s3(tmp_path / "b", uri, s3_server.config()), wal_id=WAL_ID, cores=CORES
    )
    try:
        for batch in four[:2]:
            commit(a, batch)
        break_the_lease(s3_server, uri)
        b.open()
        assert b.last_batch_id == 2
        with pytest.raises(TableTakenOverError, match=r"took the table over.*SET TBLPROPERTIES"):
            a.compact()
        assert "took the table over" in a.status()["lease"]["taken_over"]
        with pytest.raises(LeaseError, match="took the table over"):
            commit(a, four[2])
        for batch in four[2:]:
            assert not commit(b, batch).noop
    finally:
        a.close()
        b.close()
    fence, writers = writers_from_fence(s3_server, uri)
    assert fence == 3 and writers == [b.fence.writer] * 3, (fence, writers)  # type: ignore[union-attr]
    assert mirror_rows(s3_server, uri) == folded(a.mirror, four)
    assert txn_versions(s3_server, uri, a.app_id) == [1, 2, 3, 4]


@pytest.mark.crash
@pytest.mark.parametrize("order", ["b_merges_first", "a_wakes_first"])
def test_a_mirror_writer_paused_before_its_merge_commit_never_lands_after_a_takeover(
    tmp_path: Path, s3_server: S3Server, order: str
) -> None:
    """1. Writer A (a real process; lease ttl 6 s, skew 1 s) creates the
       mirror, merges batches 1-2, then stops itself (SIGSTOP) at batch 3's
       ``mirror.before_merge_commit``: past its lease and log checks, the
       table read.
    2. Writer B (another state dir) is refused while A's lease lives, and
       opens the mirror once it expired: its fence is version 3.
    3. ``b_merges_first``: B merges batches 3 and 4, then A wakes (SIGCONT);
       ``a_wakes_first``: A wakes right after B's fence, B merges afterwards.
    4. A's merge loses its version (no automatic retry), A reads the log,
       finds B's fence and stops, naming the takeover: nothing of A's lands
       after the fence, the mirror is the fold of batches 1-4, the txn
       versions are 1-4, B's lease is held and not taken over."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from dataclasses import asdict

    from daemon.table.crash import ENV_PAUSE_AT
    from tests.spark.test_crash import REPO

    uri = f"s3://{s3_server.bucket}/m-{uuid.uuid4().hex[:8]}/orders"
    # One request with its retry, (1 + 1) x 2 s, fits the lease window, 6 - 1 s.
    short = s3_server.config(
        lease_ttl_s=6.0, lease_skew_s=1.0, connect_timeout_s=1.0, request_timeout_s=1.0,
        max_retries=1,
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), ENV_PAUSE_AT: "mirror.before_merge_commit@3"}
    argv = [sys.executable, "-m", "tests.table.mirror_worker", str(tmp_path / "a"),
            "--s3", json.dumps({"uri": uri, "s3": asdict(short)}), "--batches", "3"]  # fmt: skip
    stderr = tmp_path / "a.stderr"
    with stderr.open("wb") as err:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err)
    four = batches(4)
    b = MirrorTable(mirror_on_s3(tmp_path / "b", uri, short), wal_id=WAL_ID, cores=CORES)
    try:
        deadline = time.monotonic() + 60
        while b"pause point mirror.before_merge_commit" not in stderr.read_bytes():
            assert proc.poll() is None, stderr.read_text()
            assert time.monotonic() < deadline, stderr.read_text()
            time.sleep(0.05)
        paused = time.monotonic()
        with pytest.raises(LeaseHeldError, match="held by"):
            b.open()
        while True:  # A's lease expires ttl + skew after its last renewal
            try:
                b.open()
                break
            except LeaseHeldError:
                assert time.monotonic() - paused < 30
                time.sleep(0.3)
        assert b.last_batch_id == 2

        def b_merges() -> None:
            for batch in four[2:]:
                assert not commit(b, batch).noop

        if order == "b_merges_first":
            b_merges()
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=60)
        if order == "a_wakes_first":
            b_merges()
        status = b.status()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
        b.close()
    text = out.decode()
    assert proc.returncode == 1 and "committed 2" in text and "committed 3" not in text, text
    assert "TableTakenOverError" in text and "took the table over" in text, text
    fence, writers = writers_from_fence(s3_server, uri)
    # Versions 0-2 are A's (create, batches 1-2); then B's fence, B's 3 and 4 only.
    assert fence == 3 and writers == [b.fence.writer] * 3, (fence, writers)  # type: ignore[union-attr]
    assert mirror_rows(s3_server, uri) == folded(b.mirror, four)
    assert txn_versions(s3_server, uri, b.app_id) == [1, 2, 3, 4]
    assert status["lease"]["held"] is True and status["lease"]["taken_over"] is None
    assert status["last_batch_id"] == 4
