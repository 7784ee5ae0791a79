"""The WAL benchmark still runs end to end (a tiny run; the figures are not checked here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from bench import bench_wal


def test_bench_wal_prints_a_table_against_sqlite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--events", "3000", "--request", "500", "--runs", "1", "--dir", str(tmp_path)]
    config = structlog.get_config()
    assert bench_wal.main(argv) == 0
    assert structlog.get_config() == config  # the bench's quiet logging does not leak
    out = capsys.readouterr().out
    for row in ("append, fsync per group commit", "full replay, columnar batches", "core 0 of 4"):
        assert row in out
    assert list(tmp_path.iterdir()) == []  # the scratch directory is removed
