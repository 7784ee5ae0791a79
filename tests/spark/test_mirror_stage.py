"""A mirror beside a CDC stream in the Spark executor: its own stage
(``mirror:<name>``), run with the batch after the streams, without a Spark
job; each stage runs alone when it is the only one level with a batch (a
paused or failing mirror holds back only itself), status shows it, and
Spark's Delta reader reads what delta-rs wrote."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from daemon.config import CdcConfig, CdcMirror
from daemon.errors import ExecutorError, UnknownStreamError
from daemon.metrics import Metrics
from daemon.spark.executor import SparkExecutor
from tests import requires
from tests.spark.support import make_config
from tests.table.test_mirror import COLUMNS, make_batch, read_rows

pytestmark = pytest.mark.spark


async def test_the_mirror_stage_commits_beside_a_stream_and_alone(
    spark: Any, tmp_path: Path, metrics: Metrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_config(tmp_path)
    mirror = CdcMirror("orders", "orders", tmp_path / "mirror", COLUMNS, buckets=4)
    cfg = dataclasses.replace(cfg, cdc=dataclasses.replace(cfg.cdc, mirrors=(mirror,)))
    assert isinstance(cfg.cdc, CdcConfig)
    ex = SparkExecutor(cfg, metrics, wal_id="wal-1", session=spark)
    await ex.start()
    try:
        assert ex.stage_names() == ["cdc:all", "mirror:orders"]
        b1 = make_batch(
            1,
            [
                (1, "orders", "insert", "a", {"amount": "x"}),
                (2, "other", "insert", "a", {"amount": 2}),
            ],
        )
        assert await ex.execute(b1) == {}
        assert {k: r["lsn"] for k, r in read_rows(tmp_path / "mirror").items()} == {"a": 1}
        value = metrics.mirror_cast_failures.labels("orders", "amount")._value.get()
        assert value == 1

        # Batch 2 for the stream alone (the mirror paused or behind): the mirror waits.
        b2 = make_batch(
            2,
            [
                (3, "orders", "update", "a", {"amount": 3}),
                (4, "orders", "insert", "b", {"amount": 4}),
            ],
        )
        assert await ex.execute(b2, {"cdc:all"}) == {}
        assert set(read_rows(tmp_path / "mirror")) == {"a"}
        # The mirror's failure is its own: the stream commits batch 3 meanwhile.
        b3 = make_batch(3, [(5, "orders", "delete", "a", None)])
        with monkeypatch.context() as patched:
            patched.setattr(ex._mirrors[0], "commit", _fail)
            with pytest.raises(ExecutorError, match="the mirror's volume is gone"):
                await ex.execute(b2, {"mirror:orders"})
            assert await ex.execute(b3, {"cdc:all"}) == {}
        # Resumed, it catches up batch by batch.
        assert await ex.execute(b2, {"mirror:orders"}) == {}
        assert await ex.execute(b3, {"mirror:orders"}) == {}
        rows = read_rows(tmp_path / "mirror")
        assert {k: (r["lsn"], r["amount"]) for k, r in rows.items()} == {"b": (4, 4.0)}
        # Spark with the Delta package reads the rows delta-rs reads.
        requires.delta_jars()
        seen = spark.read.format("delta").load(str(tmp_path / "mirror")).collect()
        assert {r.key: (r.lsn, r.op, r.amount) for r in seen} == {"b": (4, "insert", 4.0)}
        status = ex.status()["mirrors"]["orders"]
        assert status["last_batch_id"] == 3 and status["cast_failures"] == {"amount": 1}
        lsns = {
            r.lsn for r in spark.read.parquet(str(tmp_path / "cdc" / "all")).select("lsn").collect()
        }
        assert lsns == {1, 2, 3, 4, 5}
        # The mirror's quarantine (empty) is the Spark executor's to replay too.
        done = await ex.mirror_quarantine_action("orders", "replay", None)
        assert (done["mirror"], done["replayed"], done["quarantined"]) == ("orders", 0, 0)
        with pytest.raises(UnknownStreamError, match="no mirror 'nope'"):
            await ex.mirror_quarantine_action("nope", "purge", None)
    finally:
        await ex.stop()


def _fail(*_: Any) -> Any:
    raise OSError("the mirror's volume is gone")


async def test_a_coalescing_mirror_beside_a_stream_holds_its_batches_and_merges_them_once(
    spark: Any, tmp_path: Path, metrics: Metrics
) -> None:
    """In the Spark executor: the stream commits each batch, the mirror
    (``merge_interval_ms``) hands them back ``Held``; ``flush_coalesced``
    merges both in one commit whose txn is the last batch's."""
    from daemon.plane.batch import Held
    from tests.table.test_mirror_coalesce import mirror_commits

    cfg = make_config(tmp_path)
    mirror = CdcMirror(
        "orders", "orders", tmp_path / "mirror", COLUMNS, buckets=4, merge_interval_ms=600_000
    )
    cfg = dataclasses.replace(cfg, cdc=dataclasses.replace(cfg.cdc, mirrors=(mirror,)))
    ex = SparkExecutor(cfg, metrics, wal_id="wal-1", session=spark)
    await ex.start()
    try:
        b1 = make_batch(1, [(1, "orders", "insert", "a", {"amount": 1})])
        b2 = make_batch(
            2, [(2, "orders", "update", "a", {"amount": 2}), (3, "other", "insert", "x", {})]
        )
        for batch in (b1, b2):
            got = await ex.execute(batch)
            assert set(got) == {"mirror:orders"} and isinstance(got["mirror:orders"], Held)
        assert mirror_commits(tmp_path / "mirror") == []
        assert ex.status()["mirrors"]["orders"]["held_batch_ids"] == [1, 2]
        assert 0 < (ex.coalesce_due_s() or 0) <= 600
        assert await ex.flush_coalesced(force=True) == {"mirror:orders": (2, None)}
        assert mirror_commits(tmp_path / "mirror") == [(1, 2)]
        rows = read_rows(tmp_path / "mirror")
        assert {k: (r["lsn"], r["amount"]) for k, r in rows.items()} == {"a": (2, 2.0)}
        assert ex.coalesce_due_s() is None
    finally:
        await ex.stop()
