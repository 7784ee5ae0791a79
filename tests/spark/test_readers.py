"""Every reader: one CDC table, the same rows and payload values in Spark, pyarrow,
pandas, Polars and DuckDB (docs/cdc.md, "Payload layout").

The table is written by the real executor and CDC sink, in batches whose
payloads change shape from batch to batch and from collection to collection
(the case that made Spark's per-file shredding unreadable for pyarrow). Each
reader decodes the payload with its own JSON functions; all must agree with
the events that were sent.
"""

from __future__ import annotations

import io
import json
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from daemon.cli import cdc as cdccmd
from daemon.cli.main import build_parser
from daemon.events import StoredEvent, encode
from daemon.plane.batch import MicroBatch, Slice
from daemon.table.layout import CDC_COLUMNS, META_DIR
from daemon.table.rewrite import previous_layout_files
from daemon.table.snapshot import snapshot
from tests.spark.support import BASE_TS_NS, CORES, make_config
from wal.record import Record

pytestmark = pytest.mark.spark

# What each reader returns per row: lsn -> (collection, op, key, new amount,
# new addr.city, old amount). Amounts as float (JSON ints and decimals alike).
Row = tuple[str, str, str, float | None, str | None, float | None]

PRETTY = '{\n  "amount" : 12.5,\n  "addr" : { "city" : "Z\\u00fcrich", "zip" : "8001" }\n}'


def _new(lsn: int, batch: int, collection: str) -> str | None:
    """Payload shapes differ per batch and per collection; some lack the fields."""
    if collection == "payments" and lsn % 4 == 0:
        return PRETTY  # the producer's text as sent: spaces, newlines, an escape
    shape = (batch + len(collection)) % 4
    if shape == 0:
        return json.dumps({"amount": lsn * 10, "status": "paid", "sku": f"s{lsn}"})
    if shape == 1:
        return json.dumps(
            {"amount": lsn + 0.25, "addr": {"city": f"c{lsn % 3}", "zip": "0150"}, "tags": ["a"]}
        )
    if shape == 2:
        return json.dumps({"email": f"u{lsn}@example.com", "verified": lsn % 2 == 0})
    return json.dumps({"amount": -lsn, "addr": {"city": "Lima"}, "deep": {"a": [1, {"b": 2}]}})


def _event(lsn: int, batch: int) -> StoredEvent:
    collection = ("orders", "users", "payments")[lsn % 3]
    op = ("insert", "update", "delete")[lsn % 3 if lsn % 5 else 0]
    new = None if op == "delete" else _new(lsn, batch, collection)
    old = None if op == "insert" else json.dumps({"amount": lsn % 7, "v": batch})
    return StoredEvent(
        collection,
        op,  # type: ignore[arg-type]
        f"k{lsn % 23}",
        new.encode() if new is not None else None,
        old.encode() if old is not None else None,
        BASE_TS_NS + lsn * 1000,
    )


def shaped_batches(n_batches: int, per_batch: int, first_lsn: int = 1) -> list[MicroBatch]:
    batches = []
    seq = dict.fromkeys(range(CORES), 0)
    lsn = first_lsn
    for b in range(n_batches):
        per_core: dict[int, list[Record]] = {}
        for _ in range(per_batch):
            ev = _event(lsn, b)
            c = zlib.crc32(f"{ev.collection}\0{ev.key}".encode()) % CORES
            seq[c] += 1
            per_core.setdefault(c, []).append(Record(lsn, c, seq[c], encode(ev)))
            lsn += 1
        slices = {c: Slice(c, r[0].lsn, r[-1].lsn, r) for c, r in sorted(per_core.items())}
        batches.append(MicroBatch(first_lsn // per_batch + b + 1, slices))
    return batches


def _events(batches: Sequence[MicroBatch]) -> Iterator[tuple[int, StoredEvent]]:
    from daemon.events import decode

    for b in batches:
        for s in b.slices.values():
            for r in s.records:
                yield r.lsn, decode(r.payload)


def expected(batches: Sequence[MicroBatch]) -> dict[int, Row]:
    def num(doc: Any) -> float | None:
        v = doc.get("amount") if isinstance(doc, dict) else None
        return None if v is None else float(v)

    out = {}
    for lsn, e in _events(batches):
        new = json.loads(e.new) if e.new is not None else None
        old = json.loads(e.old) if e.old is not None else None
        city = new.get("addr", {}).get("city") if isinstance(new, dict) else None
        out[lsn] = (e.collection, e.op, e.key, num(new), city, num(old))
    return out


def _opt_float(v: Any) -> float | None:
    return None if v is None or v != v else float(v)  # NaN (pandas' missing) -> None


def _opt_str(v: Any) -> str | None:
    return None if v is None or (isinstance(v, float) and v != v) else str(v)


# --------------------------------------------------------------------------
# The readers, each with its own means (the snippets of docs/cdc.md)


def read_spark(spark: Any, path: Path, files: Sequence[str] = ()) -> dict[int, Row]:
    """``files``: a snapshot's list (``eventplane cdc files``) instead of the folder."""
    df = spark.read.option("basePath", str(path)).parquet(*(files or [str(path)]))
    rows = df.selectExpr(
        "lsn",
        "collection",
        "op",
        "key",
        "new:amount::double AS amount",
        "new:addr.city::string AS city",
        "old:amount::double AS old_amount",
    ).collect()
    return {r.lsn: (r.collection, r.op, r.key, r.amount, r.city, r.old_amount) for r in rows}


def _pyarrow_json(column: Any, schema: Any) -> Any:
    """pyarrow's own JSON reader over a column of JSON texts: one table row per value."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pj

    texts = pc.fill_null(column.combine_chunks(), "{}")
    one = pc.binary_join(pa.ListArray.from_arrays([0, len(texts)], texts), "\n")[0]
    options = pj.ParseOptions(
        explicit_schema=schema, unexpected_field_behavior="ignore", newlines_in_values=True
    )
    return pj.read_json(pa.BufferReader(one.as_py().encode()), parse_options=options)


def read_pyarrow(path: Path, files: Sequence[str] = ()) -> dict[int, Row]:
    import pyarrow as pa
    import pyarrow.dataset as ds

    source = list(files) or str(path)
    dataset = ds.dataset(
        source, format="parquet", partitioning="hive", partition_base_dir=str(path)
    )
    table = dataset.to_table(columns=["lsn", "collection", "op", "key", "new_json", "old_json"])
    new = _pyarrow_json(
        table["new_json"],
        pa.schema([("amount", pa.float64()), ("addr", pa.struct([("city", pa.string())]))]),
    )
    old = _pyarrow_json(table["old_json"], pa.schema([("amount", pa.float64())]))
    cities = new["addr"].combine_chunks().field("city")
    return {
        lsn: (coll, op, key, amount, city, old_amount)
        for lsn, coll, op, key, amount, city, old_amount in zip(
            table["lsn"].to_pylist(),
            table["collection"].to_pylist(),
            table["op"].to_pylist(),
            table["key"].to_pylist(),
            new["amount"].to_pylist(),
            cities.to_pylist(),
            old["amount"].to_pylist(),
            strict=True,
        )
    }


def read_pandas(path: Path, files: Sequence[str] = ()) -> dict[int, Row]:
    import pandas as pd

    df = pd.read_parquet(list(files) or path)
    new = pd.json_normalize([json.loads(t) if pd.notna(t) else {} for t in df["new_json"]])
    old = pd.json_normalize([json.loads(t) if pd.notna(t) else {} for t in df["old_json"]])
    return {
        int(df["lsn"].iat[i]): (
            str(df["collection"].iat[i]),
            df["op"].iat[i],
            df["key"].iat[i],
            _opt_float(new["amount"].iat[i]),
            _opt_str(new["addr.city"].iat[i]),
            _opt_float(old["amount"].iat[i]),
        )
        for i in range(len(df))
    }


def read_polars(path: Path, files: Sequence[str] = ()) -> dict[int, Row]:
    import polars as pl

    df = (
        pl.scan_parquet(list(files) or f"{path}/collection=*/*.parquet", hive_partitioning=True)
        .select(
            "lsn",
            "collection",
            "op",
            "key",
            pl.col("new_json").str.json_path_match("$.amount").cast(pl.Float64).alias("amount"),
            pl.col("new_json").str.json_path_match("$.addr.city").alias("city"),
            pl.col("old_json").str.json_path_match("$.amount").cast(pl.Float64).alias("old"),
        )
        .collect()
    )
    return {r[0]: tuple(r[1:]) for r in df.iter_rows()}  # type: ignore[misc]


def read_duckdb(path: Path, files: Sequence[str] = ()) -> dict[int, Row]:
    import duckdb

    source: Any = list(files) or f"{path}/collection=*/*.parquet"
    with duckdb.connect() as con:
        rows = con.execute(
            """
            SELECT lsn, collection, op, key,
                   (new_json ->> '$.amount')::DOUBLE,
                   new_json ->> '$.addr.city',
                   (old_json ->> '$.amount')::DOUBLE
            FROM read_parquet(?, hive_partitioning = true)
            """,
            [source],
        ).fetchall()
    return {r[0]: tuple(r[1:]) for r in rows}


READERS = {
    "pyarrow": read_pyarrow,
    "pandas": read_pandas,
    "polars": read_polars,
    "duckdb": read_duckdb,
}


# --------------------------------------------------------------------------


async def test_every_reader_sees_the_same_rows_and_payload_values(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """Four batches, three collections (partitions), payload shapes that change per
    batch and per collection, deletes without ``new``, one pretty-printed payload:
    Spark, pyarrow, pandas, Polars and DuckDB all read every row once, with the
    payload fields the producers sent."""
    ex = await executor_factory()
    batches = shaped_batches(4, 60)
    for b in batches:
        await ex.execute(b)
    table = tmp_path / "cdc" / "all"
    want = expected(batches)
    assert len(want) == 240
    assert {r[3] for r in want.values()} > {None, 12.5}  # the pretty payload is in
    assert {r[4] for r in want.values()} >= {None, "Zürich", "Lima", "c1"}

    assert read_spark(spark, table) == want
    for name, read in READERS.items():
        assert read(table) == want, name


async def test_every_reader_reads_a_snapshot_file_list_with_the_same_rows(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """The exact-read path of docs/cdc.md ("Reading while compaction runs"):
    given the file list of a snapshot (``eventplane cdc files``) instead of the
    folder, Spark, pyarrow, pandas, Polars and DuckDB read every row once with
    the same values and the ``collection`` partition column."""
    ex = await executor_factory()
    batches = shaped_batches(3, 60)
    for b in batches:
        await ex.execute(b)
    table = tmp_path / "cdc" / "all"
    want = expected(batches)
    files = snapshot(table).files
    assert len(files) == 9  # 3 batches x 3 collections

    assert read_spark(spark, table, files) == want
    for name, read in READERS.items():
        assert read(table, files) == want, name


async def test_every_file_of_a_table_has_one_physical_schema(
    executor_factory: Any, tmp_path: Path
) -> None:
    """Whatever the payloads' shapes, every file has the same columns and types:
    ``new``/``old`` as an unshredded {value, metadata} group with no VARIANT
    annotation, and the payloads' JSON text as strings."""
    import pyarrow.parquet as pq

    ex = await executor_factory()
    for b in shaped_batches(3, 40):
        await ex.execute(b)
    files = sorted((tmp_path / "cdc" / "all").glob("collection=*/part-*.parquet"))
    assert len(files) >= 6
    schemas = {pq.read_schema(f).remove_metadata() for f in files}
    assert len(schemas) == 1
    (schema,) = schemas
    assert (
        str(schema.field("new").type) == "struct<value: binary not null, metadata: binary not null>"
    )
    assert str(schema.field("new_json").type) == "string"
    for f in files:
        text = str(pq.ParquetFile(f).schema)
        assert "Variant" not in text, f


# The columns of a table written before 2026-11-25 (also before event_id/event_time).
PREVIOUS_COLUMNS = tuple(c for c in CDC_COLUMNS if c not in ("event_id", "event_time"))


async def write_mixed_table(spark: Any, ex: Any, batches: Sequence[MicroBatch]) -> None:
    """The first half of ``batches`` in the previous layout (Spark's defaults:
    shredded, annotated, no JSON columns, no event_id/event_time), the rest in
    the current one."""
    previous = {
        "spark.sql.variant.writeShredding.enabled": "true",
        "spark.sql.parquet.variant.annotateLogicalType.enabled": "true",
    }
    saved = {k: spark.conf.get(k) for k in previous}
    half = len(batches) // 2
    try:
        for k, v in previous.items():
            spark.conf.set(k, v)
        with mock.patch("daemon.table.parquetwrite.TABLE_COLUMNS", PREVIOUS_COLUMNS):
            for b in batches[:half]:
                await ex.execute(b)
    finally:
        for k, v in saved.items():
            spark.conf.set(k, v)
    for b in batches[half:]:
        await ex.execute(b)


def _layouts(table: Path) -> set[bool]:
    """For each file: does it have the JSON columns (the current layout)?"""
    import pyarrow.parquet as pq

    return {"new_json" in pq.read_schema(f).names for f in table.glob("collection=*/*.parquet")}


async def test_spark_reads_a_table_mixing_previous_and_current_files(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """Files written before this layout and after it sit in one table: Spark
    reads every row and payload; pyarrow and Polars refuse the old files."""
    ex = await executor_factory()
    batches = shaped_batches(4, 50)
    await write_mixed_table(spark, ex, batches)
    table = tmp_path / "cdc" / "all"
    assert _layouts(table) == {True, False}

    assert read_spark(spark, table) == expected(batches)
    for name in ("pyarrow", "polars"):
        with pytest.raises(Exception, match=r"struct fields|no variant set|new_json"):
            READERS[name](table)


async def test_rewrite_turns_a_mixed_table_into_one_every_reader_reads(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """``eventplane cdc rewrite`` (daemon stopped) rewrites the previous layout's
    files in place: same names, same ledger, one physical schema in every file,
    and every reader sees every row once with the producers' payload values; a
    second run has nothing to do."""
    import pyarrow.parquet as pq

    ex = await executor_factory()
    batches = shaped_batches(4, 50)
    await write_mixed_table(spark, ex, batches)
    table = tmp_path / "cdc" / "all"
    old_files = previous_layout_files(table, last_batch_id=2)
    assert old_files and all(
        f.name.startswith(("part-b000000000001", "part-b000000000002")) for f in old_files
    )
    names = sorted(p.relative_to(table) for p in table.glob("collection=*/*.parquet"))
    ledger = (table / META_DIR / "ledger.json").read_bytes()
    cfg = make_config(tmp_path)
    args = build_parser().parse_args(["cdc", "rewrite", "all"])

    # The running daemon holds the stream: refused, nothing touched.
    assert cdccmd.main(args, cfg, session=spark, out=io.StringIO()) == 1
    assert _layouts(table) == {True, False}
    await ex.stop()
    out = io.StringIO()
    assert cdccmd.main(args, cfg, session=spark, out=out) == 0

    assert f"rewrote {len(old_files)} files (100 rows)" in out.getvalue()
    assert _layouts(table) == {True}
    files = sorted(table.glob("collection=*/*.parquet"))
    assert sorted(p.relative_to(table) for p in files) == names
    assert len({pq.read_schema(f).remove_metadata() for f in files}) == 1  # one schema
    assert (table / META_DIR / "ledger.json").read_bytes() == ledger
    assert not list((table / META_DIR / "staging").iterdir())
    want = expected(batches)
    assert read_spark(spark, table) == want
    for name, read in READERS.items():
        assert read(table) == want, name
    again = io.StringIO()
    assert cdccmd.main(args, cfg, session=spark, out=again) == 0
    assert "every file has the current layout" in again.getvalue()
