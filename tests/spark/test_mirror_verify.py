"""``eventplane cdc mirror verify NAME`` (daemon/table/mirrorverify.py): the
Spark executor writes a Delta CDC stream and two mirrors of its batches (one
current-state, one with history); verify finds each equal to the fold of the
stream, then finds a row a delta-rs write changed by hand, naming its key."""

from __future__ import annotations

import argparse
import dataclasses
import io
import uuid
from pathlib import Path
from typing import Any

import pytest

from daemon.cli import cdc
from daemon.config import CdcMirror, Config
from daemon.metrics import Metrics
from daemon.spark.executor import SparkExecutor
from tests.s3.server import S3Server
from tests.spark.support import make_config
from tests.table.history_worker import events
from tests.table.test_mirror import COLUMNS, make_batch

pytestmark = pytest.mark.spark


def run_verify(cfg: Config, name: str) -> tuple[int, str]:
    out = io.StringIO()
    args = argparse.Namespace(cdc_command="mirror", mirror_command="verify", mirror=name, limit=10)
    return cdc.main(args, cfg, out=out), out.getvalue()


async def test_verify_passes_an_untouched_mirror_and_names_the_key_of_a_row_changed_by_hand(
    spark: Any, tmp_path: Path, metrics: Metrics, s3_server: S3Server
) -> None:
    """1. Eight batches of inserts, updates and deletes over 12 keys (a key
       changes several times in a batch) go to the stream ``all`` and to the
       mirrors ``orders``, ``orders_history`` and ``orders_s3`` (in a bucket).
    2. Verify: each equals the fold, exit 0, a one-line summary.
    3. A delta-rs update changes ``amount`` of one key in each mirror: verify
       exits 1 and names that key and column, the mirror's and the log's value.
    4. A mirror with no log (no stream takes its collection) exits 2."""
    from deltalake import DeltaTable

    cfg = make_config(tmp_path, stream_options={"format": "delta"})
    uri = f"s3://{s3_server.bucket}/v-{uuid.uuid4().hex[:8]}/orders"
    s3 = CdcMirror(
        "orders_s3", "orders", tmp_path / "s3", COLUMNS, 4, uri=uri, s3=s3_server.config()
    )
    mirrors = (
        CdcMirror("orders", "orders", tmp_path / "orders", COLUMNS, buckets=4),
        CdcMirror(
            "orders_history", "orders", tmp_path / "orders_history", COLUMNS, 4, history=True
        ),
        s3,
    )
    where = {
        "orders": (str(tmp_path / "orders"), None),
        "orders_history": (str(tmp_path / "orders_history"), None),
        "orders_s3": (uri, s3_server.storage_options()),
    }
    cfg = dataclasses.replace(cfg, cdc=dataclasses.replace(cfg.cdc, mirrors=mirrors))
    ex = SparkExecutor(cfg, metrics, wal_id="wal-1", session=spark)
    await ex.start()
    try:
        for bid, evs in enumerate(events(8), 1):  # Step 1.
            assert await ex.execute(make_batch(bid, evs)) == {}
    finally:
        await ex.stop()

    for name in where:  # Step 2.
        rc, text = run_verify(cfg, name)
        assert rc == 0, text
        assert text.startswith(f"mirror {name!r} and the fold of stream 'all', batches 1-8: equal,")
        assert len(text.splitlines()) == 1

    for name, (location, options) in where.items():  # Step 3.
        table = DeltaTable(location, storage_options=options)
        rows = table.to_pyarrow_table().to_pylist()
        current = [r for r in rows if r.get("is_current", True)]
        victim = min(current, key=lambda r: r["key"])
        table.update(
            updates={"amount": "123456.0"},
            predicate=f"key = '{victim['key']}' AND lsn = {victim['lsn']}",
        )
        rc, text = run_verify(cfg, name)
        assert rc == 1, text
        lines = text.splitlines()
        assert "differ (first 1 differences)" in lines[0], text
        shown = repr(victim["key"])
        if name == "orders_history":
            shown += f", version from LSN {victim['lsn']}"
        want = f"  key {shown}: column amount: mirror 123456.0, log {float(victim['lsn'])}"
        assert lines[1:] == [want], text

    no_log = dataclasses.replace(cfg, cdc=dataclasses.replace(cfg.cdc, streams=()))
    rc, _ = run_verify(no_log, "orders")  # Step 4.
    assert rc == 2
