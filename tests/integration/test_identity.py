"""Invariant 13 through the whole daemon: a CDC table of another WAL refuses to start."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.integration.harness import DaemonProcess, post_events
from tests.integration.test_cdc_crash import _config, _wait_spark_ready
from tests.integration.test_crash_recording import _wait_caught_up


@pytest.mark.spark
def test_cdc_table_of_another_wal_refuses_to_start_and_says_so(tmp_path: Path) -> None:
    """
    1. Run the daemon with a CDC stream; commit one batch; stop it.
    2. Remove the data dir (a new WAL gets a new id) but keep the CDC table.
    3. The daemon refuses to start, exits non-zero, and names the WAL mismatch.
    """
    config = _config(tmp_path)
    daemon = DaemonProcess.production(config).start(timeout_s=120)
    _wait_spark_ready(daemon)
    post_events(
        daemon.ingest_url,
        [{"collection": "c", "op": "insert", "key": "k", "new": {"a": 1}, "old": None}],
    )
    _wait_caught_up(daemon)
    assert daemon.stop() == 0, daemon.tail()

    shutil.rmtree(tmp_path / "data")
    daemon = DaemonProcess.production(config)
    with pytest.raises(RuntimeError, match="daemon exited with 1"):
        daemon.start(timeout_s=120)
    tail = daemon.tail()
    assert "was written by another event plane" in tail and "WAL id" in tail, tail
    assert '"event": "startup.failed"' in tail, tail
