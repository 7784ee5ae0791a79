"""CDC payload layouts: write cost and which readers open the table, same rows, same run.

``python -m bench.bench_layout [--events N] [--batch-rows R] [--rounds K] [--payload P]``

Each layout writes the same batches the way ``CdcSink`` stages them
(``select`` of the table's columns, ``partitionBy("collection")``,
``PARQUET_OPTIONS``) from the same input files (``frame.write_batch_file``,
``new``/``old`` parsed to VARIANT), in one SparkSession whose confs are
switched per layout:

- **previous default**: Spark's defaults, the daemon's layout until
  2026-11-25: VARIANT shredded per file, annotated as Parquet VARIANT, no
  JSON columns;
- **unshredded VARIANT**: ``spark.sql.variant.writeShredding.enabled=false``
  and ``spark.sql.parquet.variant.annotateLogicalType.enabled=false``, no JSON
  columns (every reader opens it, only Spark and DuckDB can decode ``new``);
- **+ JSON text, dictionary**: the same plus ``new_json``/``old_json``;
- **current layout**: the same with no Parquet dictionary for the JSON columns
  (``daemon.table.layout.PARQUET_OPTIONS``): what the daemon writes now;
- **current layout, zstd**: with ``spark.sql.parquet.compression.codec=zstd``
  (a ``[spark.conf]`` choice; the others use Spark's default, snappy).

Rounds rotate the order of the layouts (this 2-core machine is shared); the
best JVM CPU seconds and wall seconds of each layout count. After the rounds
each layout's output is opened by pyarrow (dataset), Polars (scan_parquet)
and DuckDB (read_parquet), and the table says who could read it.

``--payload bench``: ``bench.bench_cdc``'s events (a 57-byte ``new`` of one
shape that repeats a lot, so it compresses well); ``varied`` (default): one
document shape per collection with random ids, amounts and e-mail addresses
(a 97-byte ``new``), closer to real documents.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import process_tree, total_cpu_seconds
from daemon.events import Op, StoredEvent, encode
from daemon.plane.batch import MicroBatch, Slice
from wal.record import Record

CORES = 4
COLLECTIONS = ("orders", "users", "payments", "shipments")
BASE_TS_NS = 1_700_000_000_000_000_000
SHRED = "spark.sql.variant.writeShredding.enabled"
ANNOTATE = "spark.sql.parquet.variant.annotateLogicalType.enabled"
CODEC = "spark.sql.parquet.compression.codec"


@dataclass(frozen=True, slots=True)
class Layout:
    name: str
    confs: dict[str, str]
    json_columns: bool
    json_dictionary: bool = False


_SNAPPY = {CODEC: "snappy"}
_CURRENT = {SHRED: "false", ANNOTATE: "false"}
LAYOUTS = (
    Layout(
        "previous default (shredded, annotated)",
        {SHRED: "true", ANNOTATE: "true", **_SNAPPY},
        False,
    ),
    Layout("unshredded VARIANT, unannotated", {**_CURRENT, **_SNAPPY}, False),
    Layout("+ JSON text, dictionary", {**_CURRENT, **_SNAPPY}, True, True),
    Layout("current layout (+ JSON text, no dictionary)", {**_CURRENT, **_SNAPPY}, True),
    Layout("current layout, zstd", {**_CURRENT, CODEC: "zstd"}, True),
)


@dataclass(slots=True)
class Measured:
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    bytes: int = 0
    readers: str = ""


def _bench_event(i: int, rnd: random.Random) -> tuple[bytes, bytes | None, Op]:
    op: Op = "insert" if i % 3 == 0 else "update"
    new = b'{"amount":%d,"qty":%d,"status":"paid","sku":"sku-%06d"}' % (i % 5000, i % 7, i % 1000)
    old = None if op == "insert" else b'{"amount":%d}' % (i % 4000)
    return new, old, op


def _varied_event(i: int, rnd: random.Random) -> tuple[bytes, bytes | None, Op]:
    # One document shape per collection (i % 4 picks both), as in real tables.
    op: Op = "insert" if i % 3 == 0 else "update"
    doc: dict[str, Any] = {
        "amount": round(rnd.uniform(0, 10_000), 2),
        "id": f"{rnd.getrandbits(128):032x}",
    }
    shape = i % len(COLLECTIONS)
    if shape == 0:
        doc.update(qty=rnd.randint(1, 99), status=rnd.choice(["paid", "new", "void"]))
    elif shape == 1:
        doc.update(email=f"u{rnd.randint(0, 10**9)}@example.com", tags=["a", "b"])
    elif shape == 2:
        doc.update(
            addr={
                "city": rnd.choice(["Oslo", "Lima", "Pune"]),
                "zip": f"{rnd.randint(10_000, 99_999)}",
            }
        )
    else:
        doc.update(note="n" * rnd.randint(10, 40), ok=rnd.random() < 0.5)
    new = json.dumps(doc, separators=(",", ":")).encode()
    old = None if op == "insert" else b'{"amount":%.2f}' % rnd.uniform(0, 10_000)
    return new, old, op


def make_batches(events: int, batch_rows: int, payload: str) -> tuple[list[MicroBatch], float]:
    """Batches of ``batch_rows`` events over four collections; the mean ``new`` size."""
    make = _varied_event if payload == "varied" else _bench_event
    rnd = random.Random(7)
    batches = []
    seq = dict.fromkeys(range(CORES), 0)
    new_bytes = 0
    lsn = 1
    while lsn <= events:
        per_core: dict[int, list[Record]] = {}
        for _ in range(min(batch_rows, events - lsn + 1)):
            collection = COLLECTIONS[lsn % len(COLLECTIONS)]
            key = f"k{(lsn * 7919) % 100_000}"
            new, old, op = make(lsn, rnd)
            new_bytes += len(new)
            core = zlib.crc32(f"{collection}\0{key}".encode()) % CORES
            seq[core] += 1
            ev = StoredEvent(collection, op, key, new, old, BASE_TS_NS + lsn * 1000)
            per_core.setdefault(core, []).append(Record(lsn, core, seq[core], encode(ev)))
            lsn += 1
        slices = {c: Slice(c, r[0].lsn, r[-1].lsn, r) for c, r in sorted(per_core.items())}
        batches.append(MicroBatch(len(batches) + 1, slices))
    return batches, new_bytes / max(events, 1)


def write(spark: Any, layout: Layout, inputs: list[Path], out: Path) -> None:
    """The CDC sink's staged write of every batch, in ``layout``."""
    from daemon.spark import frame
    from daemon.table.layout import CDC_COLUMNS, JSON_COLUMNS, PARQUET_OPTIONS, TABLE_COLUMNS

    for k, v in layout.confs.items():
        spark.conf.set(k, v)
    columns = TABLE_COLUMNS if layout.json_columns else CDC_COLUMNS
    options = dict(PARQUET_OPTIONS)
    if layout.json_dictionary or not layout.json_columns:
        for c in JSON_COLUMNS:
            options.pop(f"parquet.enable.dictionary#{c}", None)
    shutil.rmtree(out, ignore_errors=True)
    for i, file in enumerate(inputs):
        df = frame._contract_frame(frame._read_inbox(spark, file)).select(*columns)
        writer = df.write.mode("overwrite").partitionBy("collection").options(**options)
        writer.parquet(str(out / f"b{i:06d}"))


def readers(out: Path) -> str:
    """Which non-Spark readers open every row of the table written at ``out``."""
    import duckdb
    import polars as pl
    import pyarrow.dataset as ds

    glob = f"{out}/*/collection=*/*.parquet"
    ok = []
    checks = {
        "pyarrow": lambda: ds.dataset(out, format="parquet", partitioning="hive").to_table(),
        "polars": lambda: pl.scan_parquet(glob, hive_partitioning=True).collect(),
        "duckdb": lambda: duckdb.sql(f"SELECT * FROM read_parquet('{glob}')").fetchall(),
    }
    for name, check in checks.items():
        try:
            check()
            ok.append(name)
        except Exception:
            pass
    return ", ".join(ok) or "none"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--batch-rows", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--payload", choices=("varied", "bench"), default="varied")
    ap.add_argument("--master", default="local[2]")
    args = ap.parse_args(argv)

    from daemon.spark import frame
    from daemon.spark.session import build_session

    root = Path(tempfile.mkdtemp(prefix="bench-layout-"))
    spark = build_session(args.master, "bench-layout", False, "ERROR", {})
    try:
        jvm = [p for p in process_tree(os.getpid()) if p != os.getpid()]
        batches, mean_new = make_batches(args.events, args.batch_rows, args.payload)
        inputs = []
        for b in batches:
            f = root / "inbox" / f"b{b.batch_id:06d}.parquet"
            f.parent.mkdir(parents=True, exist_ok=True)
            frame.write_batch_file(b, f, int(spark.sparkContext.defaultParallelism))
            inputs.append(f)
        print(
            f"{args.events:,} events ({args.payload} payloads, mean new {mean_new:.0f} B) in "
            f"batches of {args.batch_rows:,}, {args.master}, {args.rounds} rounds",
            flush=True,
        )
        for layout in LAYOUTS:  # warm-up: JIT, class loading
            write(spark, layout, inputs, root / "warm")
        results = {layout.name: Measured() for layout in LAYOUTS}
        for r in range(args.rounds):
            order = LAYOUTS[r % len(LAYOUTS) :] + LAYOUTS[: r % len(LAYOUTS)]
            for layout in order:
                out = root / f"out-{LAYOUTS.index(layout)}"
                cpu, t0 = total_cpu_seconds(jvm), time.perf_counter()
                write(spark, layout, inputs, out)
                m = results[layout.name]
                m.wall.append(time.perf_counter() - t0)
                m.cpu.append(total_cpu_seconds(jvm) - cpu)
                m.bytes = sum(p.stat().st_size for p in out.rglob("*.parquet"))
        for i, layout in enumerate(LAYOUTS):
            results[layout.name].readers = readers(root / f"out-{i}")
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)

    base = results[LAYOUTS[0].name]
    print()
    print(
        "| layout | best wall s | best JVM CPU s | CPU vs previous | bytes/event | "
        "bytes vs previous | non-Spark readers that open it |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for layout in LAYOUTS:
        m = results[layout.name]
        print(
            f"| {layout.name} | {min(m.wall):.2f} | {min(m.cpu):.2f} | "
            f"{min(m.cpu) / min(base.cpu):.2f}x | {m.bytes / args.events:.1f} | "
            f"{m.bytes / base.bytes:.2f}x | {m.readers} |"
        )
    print()
    for layout in LAYOUTS:
        cpu = ", ".join(f"{c:.2f}" for c in results[layout.name].cpu)
        print(f"JVM CPU s per round, {layout.name}: {cpu}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
