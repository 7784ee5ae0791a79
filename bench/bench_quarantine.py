"""What one quarantined row costs a batch: clean batches against batches with one bad row.

``python -m bench.bench_quarantine [--rows 4000] [--batches 20]``

One stream of every collection (bench_cdc's events), embedded ``local[2]``
Spark with the daemon's jar, batches written without a Spark job. Clean and
dirty batches alternate in one run on one session, so both kinds see the
same machine: a dirty batch holds one row whose ``new`` is not UTF-8, which
the first write refuses; the stream finds it (``DirectWrite.badRows``), sets
it aside and writes the others again (docs/cdc.md, "Quarantine"). Reports
wall time and CPU (this process and its JVM) per batch for each kind, and
the ratio. Five untimed warm-up batches first.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path.insert(0, os.getcwd())  # the working directory's tree, not this file's

from bench.bench_cdc import executor_config, make_batches
from bench.common import process_tree, total_cpu_seconds
from daemon.events import decode, encode
from daemon.plane.batch import MicroBatch, Slice
from daemon.service import logs
from daemon.service.metrics import Metrics
from daemon.spark.executor import SparkExecutor
from daemon.spark.session import build_session
from wal.record import Record

BAD_NEW = b'{"note":"\xff"}'
WARMUP = 5


def spoil(batch: MicroBatch) -> MicroBatch:
    """The batch with its middle row's ``new`` replaced by invalid UTF-8."""
    core = sorted(batch.slices)[0]
    s = batch.slices[core]
    records = list(s.records)
    i = len(records) // 2
    ev = decode(records[i].payload)
    bad = msgspec.structs.replace(ev, op="insert", new=BAD_NEW, old=None)
    records[i] = Record(records[i].lsn, records[i].core, records[i].seq, encode(bad))
    return MicroBatch(
        batch.batch_id, {**batch.slices, core: Slice(core, s.first_lsn, s.last_lsn, records)}
    )


async def run(rows: int, count: int) -> dict[str, list[tuple[float, float]]]:
    spark = build_session("local[2]", "bench-quarantine", False, "ERROR", {})
    pids = process_tree(os.getpid())
    batches = make_batches((WARMUP + count) * rows, rows)
    out: dict[str, list[tuple[float, float]]] = {"clean": [], "one bad row": []}
    with tempfile.TemporaryDirectory(prefix="bench-quarantine-") as tmp:
        ex = SparkExecutor(executor_config(Path(tmp)), Metrics(), wal_id="bench", session=spark)
        await ex.start()
        try:
            for i, b in enumerate(batches):
                dirty = i % 2 == 1
                batch = spoil(b) if dirty else b
                cpu, wall = total_cpu_seconds(pids), time.perf_counter()
                failures = await ex.execute(batch)
                if failures:
                    raise SystemExit(f"batch {b.batch_id} failed: {failures}")
                wall, cpu = time.perf_counter() - wall, total_cpu_seconds(pids) - cpu
                if i >= WARMUP:
                    out["one bad row" if dirty else "clean"].append((wall, cpu))
            held = ex.status()["streams"]["all"]["quarantined"]
            expected = sum(1 for i in range(len(batches)) if i % 2 == 1)
            if held != expected:
                raise SystemExit(f"{held} rows in quarantine, {expected} expected")
        finally:
            await ex.stop()
            spark.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4000, help="rows per batch")
    p.add_argument("--batches", type=int, default=20, help="timed batches (half of them dirty)")
    args = p.parse_args(argv)
    logs.configure("error", "console")  # one cdc_rows_quarantined warning per dirty batch
    got = asyncio.run(run(args.rows, args.batches))
    clean_wall = statistics.median(w for w, _ in got["clean"])
    clean_cpu = statistics.median(c for _, c in got["clean"])
    print(f"{args.rows} rows per batch, {args.batches} timed batches, medians per batch")
    print(f"{'batch':<14}{'batches':>8}{'wall ms':>10}{'CPU ms':>10}{'wall x':>8}{'CPU x':>8}")
    for kind, samples in got.items():
        wall = statistics.median(w for w, _ in samples)
        cpu = statistics.median(c for _, c in samples)
        print(
            f"{kind:<14}{len(samples):>8}{wall * 1000:>10.1f}{cpu * 1000:>10.1f}"
            f"{wall / clean_wall:>8.2f}{cpu / clean_cpu:>8.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
