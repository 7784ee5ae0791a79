"""A new session's warm-up (daemon/spark/warmup.py): runs, leaves nothing, never fails a start."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from daemon.config import Config
from daemon.service.metrics import Metrics
from daemon.spark import warmup
from daemon.spark.executor import SparkExecutor
from daemon.table.ledger import read_ledger
from daemon.table.parquet import CdcSink
from tests.spark.support import SharedSession, make_batches, make_config, read_table

pytestmark = pytest.mark.spark


def _config(tmp_path: Path, rows: int) -> Config:
    cfg = make_config(tmp_path)
    return dataclasses.replace(cfg, spark=dataclasses.replace(cfg.spark, warmup_rows=rows))


def _data_files(path: Path) -> list[Path]:
    return [
        f
        for f in path.rglob("*.parquet")
        if not any(p.startswith(("_", ".")) for p in f.relative_to(path).parts)
    ]


async def test_a_new_session_is_warmed_up_and_the_warm_up_leaves_no_rows_files_or_ledger_entry(
    spark: Any, tmp_path: Path
) -> None:
    """1. The executor builds a session: the warm-up runs on it before ready.
    2. The real stream's table has no rows and its ledger no batch; the scratch
       folder and the inbox are empty.  3. Batch 1 then commits as batch 1."""
    cfg = _config(tmp_path, 3000)
    calls: list[int] = []
    real = warmup.warm_session

    def spy(session: Any, cfg: Config, rows: int, parallelism: int, use_inbox: bool) -> Any:
        calls.append(rows)
        return real(session, cfg, rows, parallelism, use_inbox)

    ex = SparkExecutor(cfg, Metrics(), session_factory=lambda: SharedSession(spark))
    with mock.patch.object(warmup, "warm_session", spy):
        await ex.start()
        await ex.wait_ready()
    try:
        assert calls == [3000]
        table = cfg.cdc.streams[0].path
        assert _data_files(table) == []
        ledger = read_ledger(table)
        assert ledger is not None and ledger.last_batch_id == 0 and ledger.rows_total == 0
        assert not (cfg.data_dir / warmup.WARMUP_DIR).exists()
        assert list((cfg.data_dir / "spark-inbox").iterdir()) == []

        (batch,) = make_batches(1, 50)
        assert await ex.execute(batch) == {}
        assert len(read_table(spark, table)) == 50
        assert read_ledger(table).last_batch_id == 1  # type: ignore[union-attr]
    finally:
        await ex.stop()


async def test_a_failing_warm_up_does_not_stop_the_executor_from_becoming_ready(
    spark: Any, tmp_path: Path
) -> None:
    cfg = _config(tmp_path, 3000)

    def broken(*args: Any) -> Any:
        raise RuntimeError("the JVM said no")

    ex = SparkExecutor(cfg, Metrics(), session_factory=lambda: SharedSession(spark))
    with mock.patch.object(warmup, "warm_session", broken):
        await ex.start()
        await ex.wait_ready()
    try:
        assert ex.ready() and ex.status()["session_error"] is None
        (batch,) = make_batches(1, 20)
        assert await ex.execute(batch) == {}
        assert len(read_table(spark, cfg.cdc.streams[0].path)) == 20
    finally:
        await ex.stop()


def test_warm_session_writes_the_scratch_table_and_removes_it_even_when_the_write_fails(
    spark: Any, tmp_path: Path
) -> None:
    cfg = _config(tmp_path, 500)
    folder = cfg.data_dir / warmup.WARMUP_DIR
    folder.mkdir(parents=True)
    (folder / "left-by-a-crash").write_text("x")  # an earlier warm-up that died midway
    seen: list[int] = []
    real_commit = CdcSink.commit

    def commit(self: CdcSink, df: Any, batch: Any, rows: int) -> Any:
        result = real_commit(self, df, batch, rows)
        seen.append(len(_data_files(self.path)))
        assert not (folder / "left-by-a-crash").exists()
        return result

    with mock.patch.object(CdcSink, "commit", commit):
        done = warmup.warm_session(spark, cfg, 500, 2, use_inbox=True)
    assert done["rows"] == 500 and seen and seen[0] > 0
    assert not folder.exists()

    def failing(self: CdcSink, df: Any, batch: Any, rows: int) -> Any:
        raise RuntimeError("disk full")

    with mock.patch.object(CdcSink, "commit", failing), pytest.raises(RuntimeError):
        warmup.warm_session(spark, cfg, 500, 2, use_inbox=True)
    assert not folder.exists()


def test_synthetic_batch_spreads_its_rows_over_the_cores_in_lsn_order() -> None:
    batch = warmup.synthetic_batch(1000, 4)
    assert batch.rows == 1000 and sorted(batch.slices) == [0, 1, 2, 3]
    for core, s in batch.slices.items():
        lsns = [r.lsn for r in s.records]
        assert lsns == sorted(lsns) and (s.first_lsn, s.last_lsn) == (lsns[0], lsns[-1])
        assert [r.seq for r in s.records] == list(range(1, len(lsns) + 1))
        assert all(r.core == core for r in s.records)
