"""``eventplane cdc mirror rebuild NAME`` (daemon/table/mirrorrebuild.py), run
as a real process: it folds the Delta CDC stream into a new table with the
config's new ``buckets`` and switches to it in one step; SIGKILLed before the
switch it leaves the old mirror in place and serving, and the next rebuild
starts over."""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from daemon import config as configmod
from daemon.cli import cdc
from daemon.config import CdcMirror
from daemon.metrics import Metrics
from daemon.spark.executor import SparkExecutor
from daemon.table import mirrorrebuild
from daemon.table.crash import ENV_CRASH_AT, MIRROR_REBUILD_CRASH_POINTS
from daemon.table.errors import CdcLayoutError
from daemon.table.mirror import MirrorTable
from tests.spark.support import make_config
from tests.table.history_worker import events
from tests.table.test_mirror import COLUMNS, make_batch, read_rows

pytestmark = [pytest.mark.spark, pytest.mark.crash]
REPO = Path(__file__).resolve().parents[2]
WAL_ID = "wal-1"


def rebuild_process(config: Path, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    argv = [sys.executable, "-m", "daemon.cli.main", "cdc", "mirror", "rebuild", "orders",
            "--config", str(config)]  # fmt: skip
    full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    done = subprocess.run(argv, cwd=REPO, env=full, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.timeout(600)
async def test_a_rebuild_killed_before_its_switch_leaves_the_old_mirror_and_the_next_starts_over(
    spark: Any, tmp_path: Path, metrics: Metrics
) -> None:
    """1. The Spark executor writes eight batches to the stream ``all`` and the
       mirror ``orders`` (4 buckets); the config then says 8 buckets, which
       the mirror refuses at open, naming the rebuild.
    2. A rebuild while the mirror is open (a daemon) is refused: its lock.
    3. Rebuilds SIGKILLed at ``mid_fold`` and ``before_switch``: the old
       mirror is in place, unchanged, and opens with the old config.
    4. One SIGKILLed at ``after_switch``: the new table is in place.
    5. One more runs to the end (it starts over): the mirror has 8 buckets,
       opens with the new config, holds the fold (verify: equal), and the
       rebuild's folder is gone.
    6. A rebuild into a history mirror, in several merges: verify finds it equal."""
    from deltalake import DeltaTable

    cfg = make_config(tmp_path, stream_options={"format": "delta"})
    old = CdcMirror("orders", "orders", tmp_path / "orders", COLUMNS, buckets=4)
    cfg = dataclasses.replace(cfg, cdc=dataclasses.replace(cfg.cdc, mirrors=(old,)))
    ex = SparkExecutor(cfg, metrics, wal_id=WAL_ID, session=spark)
    await ex.start()
    try:
        for bid, evs in enumerate(events(8), 1):  # Step 1.
            assert await ex.execute(make_batch(bid, evs)) == {}
    finally:
        await ex.stop()
    before = read_rows(tmp_path / "orders")
    config = tmp_path / "eventplane.toml"
    config.write_text(
        f"""
[daemon]
data_dir = "{tmp_path / "var"}"
cores = {cfg.daemon.cores}

[[cdc.streams]]
name = "all"
collections = "*"
path = "{tmp_path / "cdc" / "all"}"

[[cdc.mirrors]]
name = "orders"
collection = "orders"
path = "{tmp_path / "orders"}"
columns = {{ amount = "double", status = "string", n = "long" }}
buckets = 8
"""
    )
    new = configmod.load(config)
    (mirror,) = new.cdc.mirrors
    with pytest.raises(CdcLayoutError, match="rebuild the mirror"):
        MirrorTable(mirror, wal_id=WAL_ID, cores=cfg.daemon.cores).open()

    held = MirrorTable(old, wal_id=WAL_ID, cores=cfg.daemon.cores)  # Step 2.
    held.open()
    try:
        rc, _, err = rebuild_process(config)
    finally:
        held.close()
    assert rc == 2 and "stop the daemon that writes it first" in err, err

    for point in MIRROR_REBUILD_CRASH_POINTS[:2]:  # Step 3.
        rc, _, err = rebuild_process(config, {ENV_CRASH_AT: point})
        assert rc == -signal.SIGKILL and f"crash point {point} reached" in err, (rc, err)
        assert read_rows(tmp_path / "orders") == before
        reopened = MirrorTable(old, wal_id=WAL_ID, cores=cfg.daemon.cores)
        reopened.open()
        reopened.close()
        assert (tmp_path / "orders.rebuild").exists()

    point = MIRROR_REBUILD_CRASH_POINTS[2]  # Step 4.
    rc, _, err = rebuild_process(config, {ENV_CRASH_AT: point})
    assert rc == -signal.SIGKILL and f"crash point {point} reached" in err, (rc, err)
    assert {r["bucket"] for r in read_rows(tmp_path / "orders").values()} - set(range(4))

    rc, out, err = rebuild_process(config)  # Step 5.
    assert rc == 0, err
    summary = out.splitlines()[-1]  # after the mirror's log lines
    assert summary.startswith("mirror 'orders' rebuilt from stream 'all' up to batch 8:"), out
    assert not (tmp_path / "orders.rebuild").exists()
    rows = read_rows(tmp_path / "orders")
    assert {k: (r["lsn"], r["doc"]) for k, r in rows.items()} == {
        k: (r["lsn"], r["doc"]) for k, r in before.items()
    }
    assert {r["bucket"] for r in rows.values()} - set(range(4)), "still 4 buckets"
    opened = MirrorTable(mirror, wal_id=WAL_ID, cores=cfg.daemon.cores)
    opened.open()
    try:
        assert opened.last_batch_id == 8
    finally:
        opened.close()
    text = io.StringIO()
    args = argparse.Namespace(
        cdc_command="mirror", mirror_command="verify", mirror="orders", limit=10
    )
    assert cdc.main(args, new, out=text) == 0, text.getvalue()

    # Step 6. In this process, in chunks of about 40 rows: into a history mirror.
    history = dataclasses.replace(mirror, history=True)
    with_history = dataclasses.replace(new, cdc=dataclasses.replace(new.cdc, mirrors=(history,)))
    with mock.patch.object(mirrorrebuild, "CHUNK_ROWS", 40):
        done = mirrorrebuild.rebuild(with_history, history)
    assert done.last_batch == 8 and done.events == 174
    merges = DeltaTable(str(tmp_path / "orders")).history()
    assert sum(h.get("operation") == "MERGE" for h in merges) >= 4
    text = io.StringIO()
    assert cdc.main(args, with_history, out=text) == 0, text.getvalue()
    assert text.getvalue().startswith("mirror 'orders' and the fold of stream 'all', batches 1-8")
