"""What a Delta commit costs a batch, against the Parquet format, and beside OPTIMIZE.

``python -m bench.bench_delta [--rows 4000] [--batches 20]``

One stream of every collection (bench_cdc's events), embedded ``local[2]``
Spark with the daemon's jar and Delta Lake, one session for every side:

1. ``parquet`` and ``delta`` batches alternate, so both see the same machine:
   both write the batch without a Spark job (docs/cdc.md, "Batches without a
   Spark job"); the Parquet stream then renames the files into its folders,
   the Delta stream commits them with delta-rs (docs/cdc.md, "Table formats").
2. ``delta + OPTIMIZE``: Delta batches again while another thread runs the
   stream's compaction (OPTIMIZE and VACUUM, as the daemon's compaction
   thread does) on the same table in a loop (compaction beside appends).

Reports per batch the median and p99 wall time and the median CPU (this
process and its JVM), and the ratios to ``parquet`` and to ``delta``. Five
untimed warm-up batches per side first.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, os.getcwd())  # the working directory's tree, not this file's

from bench.bench_cdc import executor_config, make_batches
from bench.common import process_tree, total_cpu_seconds
from daemon.plane.batch import MicroBatch
from daemon.service import logs
from daemon.service.metrics import Metrics
from daemon.spark import deltajars
from daemon.spark.executor import SparkExecutor
from daemon.spark.session import build_session
from daemon.table.delta import DeltaSink

WARMUP = 5


def _renumber(batch: MicroBatch, batch_id: int) -> MicroBatch:
    return MicroBatch(batch_id, batch.slices)


async def _timed(ex: SparkExecutor, batch: MicroBatch, pids: list[int]) -> tuple[float, float]:
    cpu, wall = total_cpu_seconds(pids), time.perf_counter()
    failures = await ex.execute(batch)
    if failures:
        raise SystemExit(f"batch {batch.batch_id} failed: {failures}")
    return time.perf_counter() - wall, total_cpu_seconds(pids) - cpu


async def run(rows: int, count: int) -> dict[str, list[tuple[float, float]]]:
    spark = build_session("local[2]", "bench-delta", False, "ERROR", {}, delta=True)
    pids = process_tree(os.getpid())
    batches = make_batches((WARMUP + count) * rows * 2, rows)
    out: dict[str, list[tuple[float, float]]] = {"parquet": [], "delta": [], "delta + OPTIMIZE": []}
    with tempfile.TemporaryDirectory(prefix="bench-delta-") as tmp:
        executors = {}
        for fmt in ("parquet", "delta"):
            cfg = executor_config(Path(tmp) / fmt)
            streams = tuple(replace(s, format=fmt, compaction=False) for s in cfg.cdc.streams)
            cfg = replace(cfg, cdc=replace(cfg.cdc, streams=streams))
            executors[fmt] = SparkExecutor(cfg, Metrics(), wal_id="bench", session=spark)
            await executors[fmt].start()
        try:
            # 1. Both formats, alternating, on the same batches.
            n = WARMUP + count
            for i in range(n):
                for fmt, ex in executors.items():
                    sample = await _timed(ex, _renumber(batches[i], i + 1), pids)
                    if i >= WARMUP:
                        out[fmt].append(sample)
            # 2. Delta again, with OPTIMIZE in a loop beside it.
            stop = threading.Event()
            optimized = [0]

            (sink,) = executors["delta"].sinks
            assert isinstance(sink, DeltaSink)

            def optimize() -> None:
                # The daemon's own compaction of the stream (OPTIMIZE, then VACUUM).
                while not stop.is_set():
                    sink.compact(spark, full=True, on_progress=None)
                    optimized[0] += 1

            thread = threading.Thread(target=optimize, daemon=True)
            thread.start()
            try:
                for i in range(n, n + count):
                    batch = _renumber(batches[i], i + 1)
                    out["delta + OPTIMIZE"].append(await _timed(executors["delta"], batch, pids))
            finally:
                stop.set()
                thread.join()
            print(f"OPTIMIZE ran {optimized[0]} times beside the last {count} Delta batches")
        finally:
            for ex in executors.values():
                await ex.stop()
            spark.stop()
    return out


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rows", type=int, default=4000, help="rows per batch")
    p.add_argument("--batches", type=int, default=20, help="timed batches per side")
    args = p.parse_args(argv)
    if deltajars.missing():
        print(deltajars.missing_message(deltajars.missing()), file=sys.stderr)
        return 2
    logs.configure("error", "console")
    got: dict[str, Any] = asyncio.run(run(args.rows, args.batches))
    base = {k: statistics.median(w for w, _ in v) for k, v in got.items()}
    print(f"{args.rows} rows per batch, {args.batches} timed batches per side")
    print(
        f"{'side':<18}{'wall p50 ms':>12}{'wall p99 ms':>12}{'CPU p50 ms':>12}"
        f"{'x parquet':>11}{'x delta':>9}"
    )
    for kind, samples in got.items():
        walls = [w for w, _ in samples]
        cpu = statistics.median(c for _, c in samples)
        print(
            f"{kind:<18}{base[kind] * 1000:>12.1f}{_p99(walls) * 1000:>12.1f}{cpu * 1000:>12.1f}"
            f"{base[kind] / base['parquet']:>11.2f}{base[kind] / base['delta']:>9.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
