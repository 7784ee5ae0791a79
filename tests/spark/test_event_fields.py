"""The producer's ``id`` and ``time`` from an HTTP request to the CDC table's
``event_id``/``event_time``, and tables that hold files from before those columns."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import aiohttp
import msgspec
import pytest

from daemon.cli import cdc as cdccmd
from daemon.cli.main import build_parser
from daemon.config import Config, DaemonConfig, IngestConfig, Listen, ProducerToken
from daemon.events import StoredEvent, encode
from daemon.ingest.server import IngestServer
from daemon.plane.batch import MicroBatch, Slice
from daemon.service.metrics import Metrics
from daemon.table import layout, parquetwrite
from daemon.table.layout import SUMMARY_FILE
from daemon.table.parquet import CdcSink
from tests import requires
from tests.spark.support import CORES, core_of, make_batches, make_config
from wal import Wal
from wal.record import Record

pytestmark = pytest.mark.spark

MiB = 1 << 20
# 2025-01-02T03:04:05.123456Z as epoch microseconds.
T_US = 1_735_787_045_123_456
# What a table of the release before carried: no event columns, no JSON text columns.
OLD_COLUMNS = tuple(c for c in layout.CDC_COLUMNS if c not in ("event_id", "event_time"))


def batch_of(batch_id: int, records: Sequence[Record]) -> MicroBatch:
    per_core: dict[int, list[Record]] = {}
    for r in records:
        per_core.setdefault(r.core, []).append(r)
    return MicroBatch(
        batch_id,
        {c: Slice(c, rs[0].lsn, rs[-1].lsn, rs) for c, rs in sorted(per_core.items())},
    )


def records_of(events: Sequence[StoredEvent], first_lsn: int) -> list[Record]:
    seqs: dict[int, int] = {}
    out = []
    for lsn, ev in enumerate(events, start=first_lsn):
        c = core_of(ev.collection, ev.key)
        seqs[c] = seqs.get(c, 0) + 1
        out.append(Record(lsn, c, seqs[c], encode(ev)))
    return out


async def ingest_over_http(
    tmp_path: Path,
    events: list[dict[str, Any]],
    tokens: tuple[ProducerToken, ...] = (),
    token: str | None = None,
) -> list[Record]:
    """POST ``events`` to a real ingest server backed by a real WAL (with
    producer ``tokens``, sending ``token``); the records stored."""
    wal = await asyncio.to_thread(
        Wal.open,
        tmp_path / "wal",
        segment_bytes=4 * MiB,
        fsync="always",
        fsync_interval_ms=100,
        max_group_bytes=8 * MiB,
    )
    cfg = Config(
        daemon=DaemonConfig(data_dir=tmp_path / "ingest", cores=CORES),
        ingest=IngestConfig(listen=Listen("127.0.0.1", 0), tokens=tokens),
    )
    server = IngestServer(cfg, wal, Metrics(), lambda: 0)
    await server.start()
    try:
        body = b"".join(msgspec.json.encode(e) + b"\n" for e in events)
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                server.url + "/v1/events",
                data=body,
                headers={
                    "Content-Type": "application/x-ndjson",
                    **({"Authorization": f"Bearer {token}"} if token else {}),
                },
            ) as resp,
        ):
            assert resp.status == 200, await resp.text()
        return list(wal.read(1))
    finally:
        await server.stop(2.0)
        await wal.aclose()


def event_columns(spark: Any, path: Path | str) -> list[tuple[Any, ...]]:
    df = spark.read.parquet(str(path))
    return [
        tuple(r)
        for r in df.selectExpr("lsn", "key", "event_id", "unix_micros(event_time)")
        .orderBy("lsn")
        .collect()
    ]


async def test_event_sent_with_id_and_time_lands_in_cdc_with_them_and_one_without_has_nulls(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """Real HTTP into a real WAL; the WAL's records as one batch through the
    executor; a plain ``spark.read.parquet`` of the stream."""
    new = {"amount": 5}
    records = await ingest_over_http(
        tmp_path,
        [
            {"collection": "orders", "op": "insert", "key": "o1", "new": new,
             "id": "evt-1", "time": "2025-01-02T04:04:05.123456+01:00"},
            {"collection": "orders", "op": "insert", "key": "o2", "new": new,
             "id": "evt-2", "time": 1_735_787_045_123},
            {"collection": "orders", "op": "insert", "key": "o3", "new": new},
            {"collection": "users", "op": "insert", "key": "u1", "new": new,
             "time": "2025-01-02T03:04:05.123456Z"},
            {"collection": "users", "op": "insert", "key": "u2", "new": new,
             "id": "evt-5", "time": None},
        ],
    )  # fmt: skip
    ex = await executor_factory()

    await ex.execute(batch_of(1, records))

    import pyarrow.parquet as pq

    table = spark.read.parquet(str(tmp_path / "cdc" / "all"))
    assert dict(table.dtypes)["event_id"] == "string"
    assert dict(table.dtypes)["event_time"] == "timestamp"
    for f in (tmp_path / "cdc" / "all").glob("collection=*/part-*.parquet"):
        # TIMESTAMP_MICROS, UTC-adjusted, like ingest_ts (not INT96).
        assert str(pq.read_schema(f).field("event_time").type) == "timestamp[us, tz=UTC]"
    assert event_columns(spark, tmp_path / "cdc" / "all") == [
        (1, "o1", "evt-1", T_US),
        (2, "o2", "evt-2", 1_735_787_045_123_000),
        (3, "o3", None, None),
        (4, "u1", None, T_US),
        (5, "u2", "evt-5", None),
    ]


async def test_table_with_files_from_before_the_event_columns_reads_whole_with_them(
    spark: Any, tmp_path: Path, metrics: Metrics
) -> None:
    """1. An "old daemon" (the contract without event_id/event_time, no schema
       summary) commits batches 1-2: files without those columns.
    2. This daemon commits batch 3 with producer ids and times.
    3. A plain ``spark.read.parquet`` of the root, and of one collection folder,
       has both columns: null for the old rows, the values for the new ones
       (Spark reads the ``_common_metadata`` footer the stream wrote rather than
       whichever data file it lists first). ``mergeSchema`` agrees."""
    import pyarrow.parquet as pq

    from daemon.spark.executor import SparkExecutor

    cfg = make_config(tmp_path)
    path = tmp_path / "cdc" / "all"
    old_batches = make_batches(2, 60)
    with (
        mock.patch.object(parquetwrite, "TABLE_COLUMNS", OLD_COLUMNS),
        mock.patch.object(CdcSink, "_write_summaries", lambda self, files: None),
    ):
        old = SparkExecutor(cfg, metrics, (), wal_id="wal-1", session=spark)
        await old.start()
        try:
            for b in old_batches:
                await old.execute(b)
        finally:
            await old.stop()
    old_files = sorted(path.glob("collection=*/part-*.parquet"))
    assert old_files and not list(path.rglob(SUMMARY_FILE))
    assert all("event_id" not in pq.read_schema(f).names for f in old_files)

    events = [
        StoredEvent(c, "insert", f"n{i}", b'{"amount":1}', None, 1, 0, "", f"evt-{i}", T_US + i)
        for i, c in enumerate(["orders", "users"] * 5)
    ]
    new = SparkExecutor(cfg, metrics, (), wal_id="wal-1", session=spark)
    await new.start()
    try:
        await new.execute(batch_of(3, records_of(events, first_lsn=121)))
    finally:
        await new.stop()

    assert (path / SUMMARY_FILE).is_file()
    assert all((d / SUMMARY_FILE).is_file() for d in path.glob("collection=*"))
    for reader in (spark.read, spark.read.option("mergeSchema", "true")):
        table = reader.parquet(str(path))
        assert set(table.columns) == set(layout.TABLE_COLUMNS)
        assert table.count() == 130
    rows = event_columns(spark, path)
    assert [r[0] for r in rows] == list(range(1, 131))
    assert all(r[2:] == (None, None) for r in rows[:120])
    assert rows[120:] == [(121 + i, f"n{i}", f"evt-{i}", T_US + i) for i in range(10)]
    orders = event_columns(spark, path / "collection=orders")
    assert [r[2] for r in orders if r[0] > 120] == [f"evt-{i}" for i in range(0, 10, 2)]
    assert len(orders) == 60 + 5  # tests.spark.support: even LSNs are orders

    # eventplane cdc show: the newest rows with the producer's columns, then a
    # --limit that reaches into the old files (their rows show nulls).
    newest = ("130", "evt-9", "2025-01-02T03:04:05.123465Z")
    for limit, last in ((3, ("128", "evt-7", "2025-01-02T03:04:05.123463Z")),
                        (12, ("119", "null", "null"))):  # fmt: skip
        out = io.StringIO()
        args = build_parser().parse_args(["cdc", "show", "all", "--limit", str(limit)])
        assert cdccmd.main(args, cfg, session=spark, out=out) == 0
        lines = out.getvalue().splitlines()
        assert lines[1].split()[5:8] == ["key", "event_id", "event_time"]
        assert len(lines) == 3 + limit
        first, final = lines[3].split(), lines[-1].split()
        assert (first[0], first[6], first[7]) == newest
        assert (final[0], final[6], final[7]) == last


def test_a_summary_left_half_written_is_removed_when_the_stream_opens(tmp_path: Path) -> None:
    cfg = make_config(tmp_path)
    path = tmp_path / "cdc" / "all"
    (path / "collection=orders").mkdir(parents=True)
    litter = [path / f".{SUMMARY_FILE}.123.tmp", path / "collection=orders" / ".x.tmp"]
    litter[0].write_bytes(b"PAR1")
    litter[1].write_bytes(b"not ours")
    sink = CdcSink(cfg.cdc.streams[0], wal_id="wal-1", cores=CORES)
    sink.open()
    sink.close()
    assert not litter[0].exists()
    assert litter[1].exists()  # only the summary's own temp names are ours


async def test_the_producer_whose_token_sent_an_event_is_in_every_table_format(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """Who wrote it: two producers' requests over real HTTP with their tokens,
    one batch into a Parquet and a Delta stream: each row's ``producer`` is
    the token entry's name, for Spark and for delta-rs."""
    import hashlib

    from deltalake import DeltaTable

    requires.delta_jars()
    tokens = tuple(
        ProducerToken(name, collections=("*",), sha256=hashlib.sha256(name.encode()).hexdigest())
        for name in ("orders-svc", "billing")
    )
    new = {"amount": 5}
    records = await ingest_over_http(
        tmp_path,
        [{"collection": "orders", "op": "insert", "key": f"o{i}", "new": new} for i in range(3)],
        tokens,
        "orders-svc",
    )
    records += await ingest_over_http(
        tmp_path / "b",
        [{"collection": "bills", "op": "insert", "key": "b1", "new": new, "id": "evt-9"}],
        tokens,
        "billing",
    )
    # The second WAL's LSNs start at 1 too: one LSN sequence for the batch.
    records = [Record(i + 1, r.core, i + 1, r.payload) for i, r in enumerate(records)]
    delta = await executor_factory(streams=(("lake", ("*",)),), stream_options={"format": "delta"})
    await delta.execute(batch_of(1, records))
    expected = [(1, "orders-svc"), (2, "orders-svc"), (3, "orders-svc"), (4, "billing")]
    rows = spark.read.format("delta").load(str(tmp_path / "cdc" / "lake"))
    assert [tuple(r) for r in rows.select("lsn", "producer").orderBy("lsn").collect()] == expected
    dt = DeltaTable(str(tmp_path / "cdc" / "lake")).to_pyarrow_table(columns=["lsn", "producer"])
    assert sorted(zip(dt["lsn"].to_pylist(), dt["producer"].to_pylist(), strict=True)) == expected
    await delta.stop()
    flat = await executor_factory(streams=(("flat", ("*",)),))
    await flat.execute(batch_of(1, records))
    table = spark.read.parquet(str(tmp_path / "cdc" / "flat"))
    assert [tuple(r) for r in table.select("lsn", "producer").orderBy("lsn").collect()] == expected
