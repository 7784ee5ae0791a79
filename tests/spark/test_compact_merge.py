"""Compaction's step 2 in process (pyarrow) and its Spark fallback: the merged
files read, in every reader, as the inputs did (docs/cdc.md, "Compaction")."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from daemon.table import compactmerge, compactplan
from daemon.table.compact import compact_stream
from daemon.table.compactmerge import ArrowLayout, sort_groups
from daemon.table.compactplan import DataFile
from daemon.table.layout import PARQUET_OPTIONS
from tests.spark.support import make_batches
from tests.spark.test_readers import READERS, expected, read_spark, shaped_batches

pytestmark = pytest.mark.spark

NO_DICTIONARY = {
    k.split("#", 1)[1]
    for k, v in PARQUET_OPTIONS.items()
    if k.startswith("parquet.") and v == "false"
}


def all_rows(spark: Any, path: Path) -> list[Any]:
    """Every column of every row as Spark reads it (VARIANT as its JSON)."""
    df = spark.read.parquet(str(path))
    cols = [f"to_json({c}) AS {c}" if c in ("new", "old") else c for c in df.columns]
    return sorted(df.selectExpr(*cols).collect())


@contextmanager
def spark_merges() -> Iterator[mock.MagicMock]:
    """Count the Spark jobs of step 2 (the fallback), letting them run."""
    with mock.patch.object(
        compactmerge, "write_merged_spark", wraps=compactmerge.write_merged_spark
    ) as spy:
        yield spy


@contextmanager
def spark_conf(spark: Any, conf: dict[str, str]) -> Iterator[None]:
    saved = {k: spark.conf.get(k) for k in conf}
    try:
        for k, v in conf.items():
            spark.conf.set(k, v)
        yield
    finally:
        for k, v in saved.items():
            spark.conf.set(k, v)


def footer(path: Path) -> tuple[Any, dict[bytes, bytes]]:
    import pyarrow.parquet as pq

    md = pq.read_metadata(path)
    return md.schema, dict(md.metadata or {})


async def test_the_in_process_merge_reads_the_same_in_spark_pyarrow_polars_duckdb(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """Batches with payloads of changing shapes, deletes, a pretty-printed
    payload: merged without a Spark job, every reader sees the same rows and
    values as before; Spark sees the same schema (``new``/``old`` VARIANT) and
    every column's value; each merged file has its inputs' Parquet schema and
    footer, lsn order, the sink's codec and dictionary options."""
    import pyarrow.parquet as pq

    ex = await executor_factory(stream_options={"compaction": False})
    batches = shaped_batches(6, 60)
    for b in batches:
        await ex.execute(b)
    table = tmp_path / "cdc" / "all"
    inputs = sorted(table.glob("collection=*/part-b*.parquet"))
    assert len(inputs) == 18
    schema_before = spark.read.parquet(str(table)).schema
    rows_before = all_rows(spark, table)
    input_footer = footer(inputs[0])

    with spark_merges() as spy:
        done = await asyncio.to_thread(compact_stream, ex.sinks[0], spark, full=True)
    assert spy.call_count == 0 and len(done) == 3  # no Spark job
    merged = sorted(table.glob("collection=*/part-c*.parquet"))
    assert len(merged) == 3 and not list(table.glob("collection=*/part-b*"))

    assert spark.read.parquet(str(table)).schema == schema_before
    assert str(schema_before["new"].dataType) == "VariantType()"
    assert all_rows(spark, table) == rows_before
    want = expected(batches)
    assert read_spark(spark, table) == want  # new:amount::double, new:addr.city::string
    for name, read in READERS.items():
        assert read(table) == want, name
    for f in merged:
        schema, meta = footer(f)
        assert schema.equals(input_footer[0]) and meta == input_footer[1]
        lsns = pq.read_table(f, columns=["lsn"]).column("lsn").to_pylist()
        assert lsns == sorted(lsns)
        md = pq.ParquetFile(f).metadata
        for g in range(md.num_row_groups):
            for c in range(md.num_columns):
                col = md.row_group(g).column(c)
                assert col.compression == "SNAPPY"
                dictionary = bool({"PLAIN_DICTIONARY", "RLE_DICTIONARY"} & set(col.encodings))
                if col.path_in_schema in NO_DICTIONARY:
                    assert not dictionary, col.path_in_schema
                elif col.path_in_schema in ("core", "op"):
                    assert dictionary, col.path_in_schema
        assert md.row_group(0).column(0).has_column_index  # as Spark writes them


def _overlap(files: list[Path]) -> None:
    """Rewrite two input files so that their lsn ranges interleave (rows dealt
    alternately), keeping their Parquet schema and Spark's footer."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    a, b = files
    meta = dict(pq.read_metadata(a).metadata or {})
    both = pa.concat_tables([pq.read_table(a), pq.read_table(b)])
    both = both.take(pc.sort_indices(both.column("lsn"))).replace_schema_metadata(None)
    idx = pa.array(range(both.num_rows))
    for path, parity in ((a, 0), (b, 1)):
        part = both.filter(pc.equal(pc.bit_wise_and(idx, 1), parity))
        with pq.ParquetWriter(path, part.schema, store_schema=False) as w:
            w.write_table(part)
            w.add_key_value_metadata(meta)


@pytest.mark.parametrize("bounded", [False, True], ids=["in-process", "bounded"])
async def test_inputs_whose_lsns_overlap_are_sorted_together_or_go_to_spark(
    spark: Any, executor_factory: Any, tmp_path: Path, bounded: bool
) -> None:
    """Two files whose lsn ranges interleave: the in-process merge sorts them
    as one group; above the bound on what it sorts in memory, the Spark job
    merges. Either way one file, in lsn order, with every row once."""
    import pyarrow.parquet as pq

    ex = await executor_factory(stream_options={"compaction": False})
    batches = make_batches(4, 80)
    for b in batches:
        await ex.execute(b)
    table = tmp_path / "cdc" / "all"
    folder = table / "collection=orders"
    _overlap(sorted(folder.glob("part-b00000000000[23]-*.parquet")))
    rows_before = all_rows(spark, table)
    # Bounded: any one file fits, the two that overlap do not.
    largest = max(f.stat().st_size for f in table.glob("collection=*/part-b*"))
    bound = largest + 1 if bounded else compactmerge.ARROW_MAX_SORT_BYTES

    with mock.patch.object(compactmerge, "ARROW_MAX_SORT_BYTES", bound), spark_merges() as spy:
        await asyncio.to_thread(compact_stream, ex.sinks[0], spark, full=True)
    # users' files never overlap: merged in process either way
    assert spy.call_count == (1 if bounded else 0)
    assert all_rows(spark, table) == rows_before
    (merged,) = folder.glob("part-c*.parquet")
    lsns = pq.read_table(merged, columns=["lsn"]).column("lsn").to_pylist()
    assert lsns == sorted(lsns) and len(lsns) == len(set(lsns)) == 160


@pytest.mark.parametrize(
    ("conf", "first_only", "spark_jobs"),
    [
        # zstd: pyarrow writes it at parquet-mr's level, in process
        ({"spark.sql.parquet.compression.codec": "zstd"}, False, 0),
        # INT96 timestamps: Spark's own encoding, merged by Spark
        ({"spark.sql.parquet.outputTimestampType": "INT96"}, False, 2),
        # snappy and zstd inputs in one bin: the Spark job writes the session's codec
        ({"spark.sql.parquet.compression.codec": "zstd"}, True, 2),
    ],
    ids=["zstd", "int96", "mixed-codecs"],
)
async def test_what_pyarrow_does_not_write_as_spark_goes_to_the_spark_job(
    spark: Any,
    executor_factory: Any,
    tmp_path: Path,
    conf: dict[str, str],
    first_only: bool,
    spark_jobs: int,
) -> None:
    ex = await executor_factory(stream_options={"compaction": False})
    batches = make_batches(4, 40)
    with spark_conf(spark, conf):
        for b in batches[: 2 if first_only else 4]:
            await ex.execute(b)
    for b in batches[2 if first_only else 4 :]:
        await ex.execute(b)
    table = tmp_path / "cdc" / "all"
    rows_before = all_rows(spark, table)
    with spark_merges() as spy:
        done = await asyncio.to_thread(compact_stream, ex.sinks[0], spark, full=True)
    assert len(done) == 2 and spy.call_count == spark_jobs
    assert all_rows(spark, table) == rows_before  # timestamps included


def test_sort_groups_joins_overlapping_lsn_ranges_and_bounds_them() -> None:
    files = [DataFile(n, 10, i, i) for i, n in enumerate("abcde")]
    ranges: dict[str, tuple[int, int] | None] = {
        "a": (1, 10),
        "b": (11, 20),
        "c": (15, 30),  # overlaps b
        "d": (40, 50),
        "e": (31, 35),  # an older batch file can hold later lsns: lsn order counts
    }
    layout = ArrowLayout(None, {}, "SNAPPY", [], ranges, dict.fromkeys("abcde", 10))
    assert sort_groups(files, layout) == [["a"], ["b", "c"], ["e"], ["d"]]
    ranges["d"] = None  # no statistics: the whole bin is one group
    assert sort_groups(files, layout) == [["a", "b", "c", "d", "e"]]
    with mock.patch.object(compactmerge, "ARROW_MAX_SORT_BYTES", 49):
        assert "overlap" in str(sort_groups(files, layout))


async def test_a_table_mixing_the_previous_layout_is_merged_by_spark_with_every_row(
    spark: Any, executor_factory: Any, tmp_path: Path
) -> None:
    """Files of the previous payload layout (shredded, annotated, before
    event_id, event_time and the JSON columns) beside current ones: their
    schemas differ, so each partition goes to the Spark job (``mergeSchema``),
    and Spark reads every row and payload value as before."""
    from tests.spark.test_readers import write_mixed_table

    ex = await executor_factory(stream_options={"compaction": False})
    batches = shaped_batches(4, 50)
    await write_mixed_table(spark, ex, batches)
    table = tmp_path / "cdc" / "all"
    layout = compactmerge.arrow_layout(
        table / "collection=orders", compactplan.plan_stream(ex.sinks[0], full=True)[0]
    )
    assert isinstance(layout, str) and "different Parquet schemas" in layout

    with spark_merges() as spy:
        done = await asyncio.to_thread(compact_stream, ex.sinks[0], spark, full=True)
    assert len(done) == 3 and spy.call_count == 3
    assert not list(table.glob("collection=*/part-b*"))
    assert read_spark(spark, table) == expected(batches)
