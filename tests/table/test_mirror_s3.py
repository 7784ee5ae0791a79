"""A mirror whose table is on S3 (a real SeaweedFS server on loopback,
tests/s3/server.py): each batch is one merge into the table in the bucket, a
re-run writes nothing, delta-rs and Polars read it from the bucket, and the
table has one writer (the lease)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from daemon.config import CdcMirror
from daemon.table.lease import LeaseHeldError
from daemon.table.mirror import MirrorTable
from tests.s3.server import S3Server
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
