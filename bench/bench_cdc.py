"""Executor throughput vs Spark Structured Streaming, same events, same run, same session.

``python -m bench.bench_cdc [--events N] [--batch-rows R] [--master local[*]]``

- **eventplane**: WAL-less micro-batches (``Record``s of msgpack ``StoredEvent``
  payloads, as the consumers hand them over) -> ``SparkExecutor.execute`` ->
  Arrow -> DataFrame with VARIANT ``new``/``old`` -> exactly-once CDC commit
  (stage, intent, rename, ledger). Timed from the first ``execute`` to the
  last commit; the clock includes decoding, Arrow, Spark and the commit.
- **peer**: what a Spark user builds instead: the same events landed as NDJSON
  files (``batch-rows`` lines per file), read by Structured Streaming
  (``readStream.json`` with a schema; ``new``/``old`` read as JSON text and
  parsed to VARIANT), written by the Parquet file sink partitioned by
  ``collection`` with a checkpoint, ``trigger(availableNow=True)``. Timed from
  ``start()`` to termination. Landing the files is not timed, like building
  the batches on our side.

Both sides get one untimed warm-up run first (JIT, class loading), then the
timed run; each output is counted afterwards to prove every event landed once.
End-to-end numbers (HTTP ingest -> WAL -> consumers -> Spark) are added once
the daemon is wired (daemon/app.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.batch import MicroBatch, Slice
from daemon.config import CdcConfig, CdcStream, Config, DaemonConfig, SparkConfig
from daemon.events import StoredEvent, encode
from daemon.metrics import Metrics
from daemon.spark import build_session
from daemon.spark_executor import SparkExecutor
from wal.record import Record

CORES = 4
COLLECTIONS = ("orders", "users", "payments", "shipments")
BASE_TS_NS = 1_700_000_000_000_000_000


@dataclass(frozen=True, slots=True)
class Result:
    name: str
    events: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0


def _event(i: int) -> tuple[str, str, str, bytes, bytes | None]:
    collection = COLLECTIONS[i % len(COLLECTIONS)]
    key = f"k{(i * 7919) % 100_000}"
    op = "insert" if i % 3 == 0 else "update"
    new = b'{"amount":%d,"qty":%d,"status":"paid","sku":"sku-%06d"}' % (i % 5000, i % 7, i % 1000)
    old = None if op == "insert" else b'{"amount":%d}' % (i % 4000)
    return collection, op, key, new, old


def make_batches(events: int, batch_rows: int) -> list[MicroBatch]:
    """The consumers' hand-over: one slice per core, LSN order, ~150-byte events."""
    batches = []
    seq = dict.fromkeys(range(CORES), 0)
    lsn = 1
    batch_id = 1
    while lsn <= events:
        per_core: dict[int, list[Record]] = {}
        for _ in range(min(batch_rows, events - lsn + 1)):
            collection, op, key, new, old = _event(lsn)
            core = zlib.crc32(f"{collection}\0{key}".encode()) % CORES
            seq[core] += 1
            payload = encode(StoredEvent(collection, op, key, new, old, BASE_TS_NS + lsn * 1000))
            per_core.setdefault(core, []).append(Record(lsn, core, seq[core], payload))
            lsn += 1
        slices = {c: Slice(c, r[0].lsn, r[-1].lsn, r) for c, r in sorted(per_core.items())}
        batches.append(MicroBatch(batch_id, slices))
        batch_id += 1
    return batches


def land_json(batches: Sequence[MicroBatch], folder: Path) -> tuple[int, int]:
    """The same events as NDJSON files, one file per batch, each landed atomically.

    Returns (mean producer event size, mean landed line size) in bytes: a landed
    line also carries the LSN, core, sequence and ingest time, so both sides
    write the same table.
    """
    from daemon.events import decode

    folder.mkdir(parents=True)
    event_bytes = line_bytes = lines = 0
    for b in batches:
        rows = []
        for s in b.slices.values():
            for r in s.records:
                e = decode(r.payload)
                new = (e.new or b"null").decode()
                old = (e.old or b"null").decode()
                event = (
                    f'"collection":"{e.collection}","op":"{e.op}","key":"{e.key}",'
                    f'"new":{new},"old":{old}'
                )
                event_bytes += len(event) + 2
                rows.append(
                    f'{{"lsn":{r.lsn},"core":{r.core},"seq":{r.seq},{event},'
                    f'"ingest_ts_us":{e.ingest_ts_ns // 1000}}}'
                )
        text = "\n".join(rows) + "\n"
        line_bytes += len(text)
        lines += len(rows)
        tmp = folder / f".b{b.batch_id:06d}.json.tmp"
        tmp.write_text(text)
        tmp.rename(folder / f"b{b.batch_id:06d}.json")
    return event_bytes // max(lines, 1), line_bytes // max(lines, 1)


async def run_eventplane(spark: Any, batches: Sequence[MicroBatch], root: Path) -> float:
    cfg = Config(
        daemon=DaemonConfig(data_dir=root / "var", cores=CORES),
        spark=SparkConfig(),
        cdc=CdcConfig(streams=(CdcStream("all", ("*",), root / "cdc"),)),
    )
    ex = SparkExecutor(cfg, Metrics(), wal_id="bench", session=spark)
    await ex.start()
    started = time.perf_counter()
    for b in batches:
        await ex.execute(b)
    seconds = time.perf_counter() - started
    await ex.stop()
    return seconds


def run_peer(spark: Any, src: Path, out: Path, files_per_trigger: int) -> float:
    from pyspark.sql import functions as F
    from pyspark.sql.types import (
        IntegerType,
        LongType,
        StringType,
        StructField,
        StructType,
    )

    schema = StructType(
        [
            StructField("lsn", LongType()),
            StructField("core", IntegerType()),
            StructField("seq", LongType()),
            StructField("collection", StringType()),
            StructField("op", StringType()),
            StructField("key", StringType()),
            # A JSON object read with a string schema keeps its raw text.
            StructField("new", StringType()),
            StructField("old", StringType()),
            StructField("ingest_ts_us", LongType()),
        ]
    )
    reader = spark.readStream.schema(schema)
    if files_per_trigger:
        reader = reader.option("maxFilesPerTrigger", files_per_trigger)
    df = reader.json(str(src)).select(
        "lsn",
        "core",
        "seq",
        "collection",
        "op",
        "key",
        F.parse_json("new").alias("new"),
        F.parse_json("old").alias("old"),
        F.timestamp_micros("ingest_ts_us").alias("ingest_ts"),
        F.lit(-1).cast("bigint").alias("batch_id"),
    )
    started = time.perf_counter()
    query = (
        df.writeStream.format("parquet")
        .partitionBy("collection")
        .option("path", str(out / "table"))
        .option("checkpointLocation", str(out / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    seconds = time.perf_counter() - started
    if query.exception() is not None:
        raise RuntimeError(f"peer query failed: {query.exception()}")
    return seconds


def count_once(spark: Any, path: Path, expected: int) -> None:
    rows = spark.read.parquet(str(path)).selectExpr("count(*) AS n", "count(DISTINCT lsn) AS d")
    n, d = rows.first()
    if n != expected or d != expected:
        raise SystemExit(f"{path}: {n} rows, {d} distinct LSNs; expected {expected} once each")


def render(
    results: Sequence[Result],
    *,
    sizes: tuple[int, int],
    batch_rows: int,
    master: str,
    rounds: int,
) -> str:
    peer = results[-1]
    head = (
        f"{results[0].events:,} events (~{sizes[0]} B as producer JSON, ~{sizes[1]} B as a "
        f"landed line), {batch_rows:,} per batch/file, Spark {master}, "
        f"{len(COLLECTIONS)} collections, best of {rounds} alternating round(s)"
    )
    rows = ["| system | events | seconds | events/s | vs peer |", "|---|---:|---:|---:|---:|"]
    for r in results:
        ratio = r.rate / peer.rate if peer.rate else 0.0
        rows.append(f"| {r.name} | {r.events:,} | {r.seconds:.2f} | {r.rate:,.0f} | {ratio:.2f}x |")
    return head + "\n\n" + "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_cdc", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument(
        "--batch-rows",
        type=int,
        default=100_000,
        help="rows per micro-batch and lines per landed JSON file (default 100000)",
    )
    p.add_argument("--master", default="local[*]")
    p.add_argument(
        "--peer-files-per-trigger",
        type=int,
        default=0,
        help="maxFilesPerTrigger for the peer (default 0: all files in one batch)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="alternating timed rounds per side; the best counts (default 2)",
    )
    p.add_argument("--warmup-events", type=int, default=20_000)
    p.add_argument("--dir", type=Path, help="work folder (default: a temp folder, removed)")
    p.add_argument("--json", action="store_true", help="print results as JSON too")
    args = p.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="bench-cdc-", dir=args.dir))
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    try:
        spark = build_session(
            args.master,
            "eventplane-bench",
            False,
            "ERROR",
            {"spark.sql.shuffle.partitions": "4", "spark.driver.memory": "4g"},
        )
        print(f"preparing {args.events:,} events ...", file=sys.stderr)
        batches = make_batches(args.events, args.batch_rows)
        sizes = land_json(batches, root / "landing")
        warm = make_batches(args.warmup_events, args.batch_rows)
        land_json(warm, root / "warm-landing")

        print("warm-up ...", file=sys.stderr)
        asyncio.run(run_eventplane(spark, warm, root / "warm-ep"))
        run_peer(spark, root / "warm-landing", root / "warm-peer", args.peer_files_per_trigger)

        ours: list[float] = []
        peers: list[float] = []
        for n in range(args.rounds):
            print(f"round {n + 1}: eventplane executor ...", file=sys.stderr)
            ours.append(asyncio.run(run_eventplane(spark, batches, root / f"ep{n}")))
            count_once(spark, root / f"ep{n}" / "cdc", args.events)
            print(f"round {n + 1}: peer, Structured Streaming ...", file=sys.stderr)
            out = root / f"peer{n}"
            peers.append(run_peer(spark, root / "landing", out, args.peer_files_per_trigger))
            count_once(spark, out / "table", args.events)
            shutil.rmtree(root / f"ep{n}", ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)

        results = [
            Result(
                "eventplane executor: batches -> Arrow -> VARIANT -> exactly-once CDC",
                args.events,
                min(ours),
            ),
            Result(
                "peer: Structured Streaming, JSON files -> Parquet + checkpoint, availableNow",
                args.events,
                min(peers),
            ),
        ]
        print(
            render(
                results,
                sizes=sizes,
                batch_rows=args.batch_rows,
                master=args.master,
                rounds=args.rounds,
            )
        )
        if args.json:
            print(
                json.dumps(
                    {
                        "results": [
                            {
                                "name": r.name,
                                "events": r.events,
                                "seconds": r.seconds,
                                "events_per_s": r.rate,
                            }
                            for r in results
                        ],
                        "rounds": {"eventplane": ours, "peer": peers},
                    }
                )
            )
        spark.stop()
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
