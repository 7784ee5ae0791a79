"""Step 2 of a compaction: a plan's inputs merged into one sorted file per bin.

:func:`write_merged` writes one output per bin of a :class:`Plan` under a
staging folder no reader lists, rows sorted by ``lsn``:

1. :func:`arrow_layout`: when the inputs agree on their Parquet schema, footer
   key-values (Spark's schema) and codec (the daemon's own files do), and
2. :func:`sort_groups`: each bin's inputs split into groups whose ``lsn``
   ranges overlap fit ``ARROW_MAX_SORT_BYTES``, then
3. :func:`write_merged_arrow` merges them in this process with pyarrow, a row
   group at a time (up to ``ARROW_ROW_GROUP_INPUT_BYTES`` of input), with the
   inputs' schema and footer and the dictionary options of ``PARQUET_OPTIONS``;
4. otherwise, or when pyarrow's file came out different, one Spark job
   (:func:`write_merged_spark`) reads exactly those files (their common
   schema, else ``mergeSchema``) and writes them with ``PARQUET_OPTIONS``.

The caller (:func:`daemon.table.compact.run_compaction`) checks the row
counts and does the rest. The why and the memory bounds: docs/cdc.md,
"Compaction".
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from daemon.table.compactplan import DataFile, Plan
from daemon.table.errors import CompactionError
from daemon.table.layout import PARQUET_OPTIONS
from daemon.table.sparkio import staging_write_options

log = structlog.get_logger("eventplane.cdc")

# Footer key under which Spark records the schema it wrote.
SPARK_SCHEMA_KEY = b"org.apache.spark.sql.parquet.row.metadata"


def _common_schema(files: Iterable[Path]) -> Any:
    """The Spark schema every file's footer records, or None when they differ
    (or one records none)."""
    import pyarrow.parquet as pq
    from pyspark.sql.types import StructType

    found: set[bytes] = set()
    for f in files:
        found.add((pq.read_metadata(f).metadata or {}).get(SPARK_SCHEMA_KEY, b""))
        if len(found) > 1:
            return None
    text = found.pop() if found else b""
    if not text:
        return None
    try:
        return StructType.fromJson(json.loads(text))
    except (ValueError, KeyError, TypeError):
        return None


# --------------------------------------------------------------------------
# Step 2 in process: pyarrow merges files that agree on everything Spark wrote

# Codecs of the inputs the in-process merge writes again, as pyarrow names them,
# at the level Spark's Parquet writer (parquet-mr) uses by default; another codec
# (LZ4, BROTLI, LZO: framing or support differ) goes to the Spark job.
ARROW_CODECS: dict[str, tuple[str, int | None]] = {
    "SNAPPY": ("snappy", None),
    "ZSTD": ("zstd", 3),
    "GZIP": ("gzip", 6),
    "UNCOMPRESSED": ("none", None),
}
# File name suffix Spark gives each codec (``part-...-c000.snappy.parquet``).
_CODEC_SUFFIX = {"SNAPPY": ".snappy", "ZSTD": ".zstd", "GZIP": ".gz", "UNCOMPRESSED": ""}
# Parquet bytes of inputs read, sorted and written together as one row group
# of a merged file (in memory: 3-6x this decoded, twice while sorting).
ARROW_ROW_GROUP_INPUT_BYTES = 16 * 1024 * 1024
# Files whose ``lsn`` ranges overlap are sorted together, so they must fit in
# one row group: a group of more Parquet bytes than this (a batch file of
# over 16 MiB, or overlapping ones) goes to the Spark job, which spills. Files
# of different batches rarely overlap, so a group is usually one file.
ARROW_MAX_SORT_BYTES = ARROW_ROW_GROUP_INPUT_BYTES


class _ArrowMismatchError(CompactionError):
    """pyarrow wrote a file whose Parquet schema or footer differs from its inputs'."""


@dataclass(frozen=True, slots=True)
class ArrowLayout:
    """What every input's footer agrees on, and what the merged files repeat."""

    schema: Any  # pyarrow.parquet.ParquetSchema
    metadata: dict[bytes, bytes]  # Spark's footer keys: its schema, its version
    codec: str  # Parquet's name: SNAPPY, ZSTD, GZIP, UNCOMPRESSED
    dictionary: list[str]  # leaf columns written with a dictionary
    ranges: dict[str, tuple[int, int] | None]  # input -> lsn range (footer statistics)
    sizes: dict[str, int]  # input -> bytes


def arrow_layout(folder: Path, plan: Plan) -> ArrowLayout | str:
    """The inputs' common layout, or why pyarrow does not merge them (a reason).

    pyarrow merges when every input has the same Parquet schema (columns,
    physical and logical types, repetition), the same footer key-values
    (``org.apache.spark.sql.parquet.row.metadata`` is what makes Spark read the
    binary ``new``/``old`` groups as VARIANT; it must describe the merged file
    exactly as it describes each input), no INT96 timestamps (Spark's own
    encoding and rebasing), and one codec that pyarrow writes as Spark does.
    Files from before a column existed fail the first test: Spark's
    ``mergeSchema`` gives their rows the new column as nulls.
    """
    import pyarrow.parquet as pq

    first: Any = None
    lsn = -1
    codecs: set[str] = set()
    ranges: dict[str, tuple[int, int] | None] = {}
    sizes: dict[str, int] = {}
    for f in plan.inputs:
        md = pq.read_metadata(folder / f.name)
        if first is None:
            first = md
            if SPARK_SCHEMA_KEY not in (md.metadata or {}):
                return f"{f.name} has no Spark schema in its footer"
            paths = [md.schema.column(i).path for i in range(md.num_columns)]
            if "lsn" not in paths:
                return f"{f.name} has no lsn column"
            lsn = paths.index("lsn")
            if any(md.schema.column(i).physical_type == "INT96" for i in range(md.num_columns)):
                return f"{f.name} has INT96 timestamps"
        elif not md.schema.equals(first.schema):
            return f"{f.name} and {plan.inputs[0].name} have different Parquet schemas"
        elif (md.metadata or {}) != (first.metadata or {}):
            return f"{f.name} and {plan.inputs[0].name} have different footer metadata"
        lo: int | None = None
        hi: int | None = None
        known = True
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            codecs.update(rg.column(c).compression for c in range(rg.num_columns))
            if rg.num_rows == 0:
                continue
            stats = rg.column(lsn).statistics
            if stats is None or not stats.has_min_max:
                known = False
                continue
            lo = stats.min if lo is None else min(lo, stats.min)
            hi = stats.max if hi is None else max(hi, stats.max)
        ranges[f.name] = (int(lo), int(hi)) if known and lo is not None and hi is not None else None
        sizes[f.name] = f.size
    if len(codecs) != 1 or next(iter(codecs)) not in ARROW_CODECS:
        return f"codecs {sorted(codecs)} (pyarrow writes one of {sorted(ARROW_CODECS)})"
    # The writer options of files that stay (a compacting stream's batch files
    # skip more, cdc.TRANSIENT_PARQUET_OPTIONS): Spark's default dictionary for
    # every column but those PARQUET_OPTIONS turns it off for. (The inputs' own
    # choice is no guide: Spark's writer drops a dictionary that does not pay
    # off on its first page, which in a 125-row batch file it rarely does.)
    dictionary = [
        p for p in paths if PARQUET_OPTIONS.get(f"parquet.enable.dictionary#{p}") != "false"
    ]
    return ArrowLayout(first.schema, dict(first.metadata), codecs.pop(), dictionary, ranges, sizes)


def sort_groups(bin_: Sequence[DataFile], layout: ArrowLayout) -> list[list[str]] | str:
    """A bin's inputs as groups of files whose lsn ranges overlap, in lsn order
    (sorting each group alone and writing the groups in order sorts the bin),
    or why not: a group over ``ARROW_MAX_SORT_BYTES``."""
    names = [f.name for f in bin_]
    known = sorted((r, n) for n in names if (r := layout.ranges.get(n)) is not None)
    groups: list[list[str]] = []
    if len(known) < len(names):  # a file without statistics: sort the bin as a whole
        groups = [names]
    else:
        hi = 0
        for (lo, top), n in known:
            if groups and lo <= hi:
                groups[-1].append(n)
                hi = max(hi, top)
            else:
                groups.append([n])
                hi = top
    for g in groups:
        size = sum(layout.sizes[n] for n in g)
        if size > ARROW_MAX_SORT_BYTES:
            return (
                f"{len(g)} inputs of {size} bytes overlap in lsn "
                f"(the in-process sort takes at most {ARROW_MAX_SORT_BYTES})"
            )
    return groups


def write_merged_arrow(
    folder: Path, plan: Plan, out: Path, layout: ArrowLayout, groups: list[list[list[str]]]
) -> None:
    """Step 2 in this process: one file per bin under ``out`` (``groups[i]``:
    bin i's inputs by :func:`sort_groups`), rows sorted by lsn, with the inputs'
    Parquet schema, codec and footer key-values and the dictionary options of
    files that stay (``PARQUET_OPTIONS``). Raises ``_ArrowMismatchError`` when
    a written file's schema or footer is not the inputs'."""
    import pyarrow.parquet as pq

    codec, level = ARROW_CODECS[layout.codec]
    arrow_schema = layout.schema.to_arrow_schema().remove_metadata()
    out.mkdir(parents=True, exist_ok=True)
    for i, bin_groups in enumerate(groups):
        dest = out / f"part-{i:05d}-{uuid.uuid4()}-c000{_CODEC_SUFFIX[layout.codec]}.parquet"
        with pq.ParquetWriter(
            dest,
            arrow_schema,
            compression=codec,
            compression_level=level,
            use_dictionary=layout.dictionary,
            write_statistics=True,
            write_page_index=True,  # Spark writes column and offset indexes too
            store_schema=False,  # no ARROW:schema key: the footer stays Spark's
        ) as writer:
            # Groups are disjoint and in lsn order: sorting the rows of several
            # whole groups at once sorts each. So whole groups are read
            # together, up to ARROW_ROW_GROUP_INPUT_BYTES, sorted once and
            # written as one row group.
            chunk: list[str] = []
            size = 0
            for group in bin_groups:
                more = sum(layout.sizes[n] for n in group)
                if chunk and size + more > ARROW_ROW_GROUP_INPUT_BYTES:
                    _write_row_group(writer, folder, chunk, arrow_schema)
                    chunk, size = [], 0
                chunk += group
                size += more
            if chunk:
                _write_row_group(writer, folder, chunk, arrow_schema)
            writer.add_key_value_metadata(layout.metadata)
        written = pq.read_metadata(dest)
        if not written.schema.equals(layout.schema) or written.metadata != layout.metadata:
            raise _ArrowMismatchError(
                f"pyarrow wrote {dest.name} with another schema or footer than its inputs "
                f"({written.schema} vs {layout.schema})"
            )


def _write_row_group(writer: Any, folder: Path, names: list[str], schema: Any) -> None:
    """The files' rows (whole groups), sorted by lsn, as one row group."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds
    from pyarrow.fs import LocalFileSystem

    # A dataset scan in one thread: a compaction takes at most one core from the
    # batches, and for files of a few hundred rows it costs half the CPU of
    # opening each with pq.ParquetFile (whose Python side is per file).
    paths = [str(folder / n) for n in names]
    rows = ds.dataset(paths, schema=schema, format="parquet", filesystem=LocalFileSystem())
    table = rows.to_table(use_threads=False)
    lsn = table.column("lsn")
    ordered = lsn.null_count == 0 and pc.all(pc.less(lsn[:-1], lsn[1:])).as_py()
    if len(lsn) > 1 and not ordered:
        table = table.take(pc.sort_indices(lsn))
    writer.write_table(table, row_group_size=max(table.num_rows, 1))


def write_merged(spark: Any, folder: Path, plan: Plan, out: Path) -> None:
    """Step 2: one output file per bin under ``out`` (tests wrap it).

    In this process with pyarrow when the inputs agree (:func:`arrow_layout`;
    the daemon's own files always do), else, or when pyarrow's file came out
    different, with a Spark job (:func:`write_merged_spark`).
    """
    layout = arrow_layout(folder, plan)
    reason = layout if isinstance(layout, str) else ""
    if isinstance(layout, ArrowLayout):
        groups: list[list[list[str]]] = []
        for b in plan.bins:
            g = sort_groups(b, layout)
            if isinstance(g, str):
                reason = g
                break
            groups.append(g)
        else:
            try:
                write_merged_arrow(folder, plan, out, layout, groups)
                return
            except _ArrowMismatchError as exc:
                reason = str(exc)
                shutil.rmtree(out, ignore_errors=True)
    log.info("cdc.compaction_with_spark", partition=plan.partition, reason=reason[:500])
    write_merged_spark(spark, folder, plan, out)


def write_merged_spark(spark: Any, folder: Path, plan: Plan, out: Path) -> None:
    """Step 2 as a Spark job: one output file per bin under ``out``."""
    # One schema for every bin: the inputs' Spark schema when their footers
    # agree (no Spark job), else the union Spark merges (a file from before a
    # column existed must not decide the output's columns).
    schema = _common_schema(folder / f.name for f in plan.inputs)
    if schema is None:
        reader = spark.read.option("mergeSchema", "true").option("basePath", str(folder))
        schema = reader.parquet(*(str(folder / f.name) for f in plan.inputs)).schema
    frames = []
    for b in plan.bins:
        df = (
            spark.read.schema(schema)
            .option("basePath", str(folder))
            .parquet(*(str(folder / f.name) for f in b))
        )
        frames.append(df.coalesce(1))
    merged = frames[0]
    for df in frames[1:]:
        merged = merged.union(df)  # keeps the partitions: one task (file) per bin
    writer = merged.sortWithinPartitions("lsn").write.mode("overwrite")
    # The staging write's file system: no ``.crc`` or ``_SUCCESS`` beside the
    # merged files (``_outputs`` skipped them) and, where the daemon's jar is
    # loaded, no forked ``chmod`` per file and folder.
    writer.options(**PARQUET_OPTIONS, **staging_write_options(spark)).parquet(str(out))
