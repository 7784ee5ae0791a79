"""CDC compaction: reads of a compacted table vs the same rows in few files, and
ingest with compaction running vs without. Same events, same run, same session.

``python -m bench.bench_compaction [--events N] [--batches B] [--rounds R]``

1. **Ingest.** The executor commits the events as ``--batches`` micro-batches
   (``bench_cdc``'s events: four collections), once with compaction off and
   once with the daemon's background service on (default policy: 128 MiB
   target, ``compact_min_files`` 16; ``compact_interval_s`` ``--interval``,
   20 s by default: the daemon's default looks every 60 s, i.e. every ~60
   batches at 1 s batches, and a bench batch takes about a third of a
   second), in
   alternating order for ``--rounds`` rounds; the best of each counts, and
   each round's own ratio is printed too (its two sides ran back to back). Timed
   from the first ``execute`` to the last commit, with the CPU seconds of this
   process and its JVM over the same span (a shared machine moves wall time
   more than CPU time), and on the "on" side the CPU seconds of the
   compaction thread inside step 2 (``write_merged``: the in-process pyarrow
   merge; a Spark fallback's JVM time is not in it) and how many merges fell
   back to a Spark job.
2. **Tables.** From the same events: ``small`` (the compaction-off run: one
   file per collection per batch), ``tiered`` (the compaction-on run, after
   its service had its last look), ``full`` (``small`` after ``eventplane cdc
   compact``, i.e. ``compact_stream(full=True)``) and ``few`` (the same events
   as one batch: the "same rows as few large files" peer). Each is checked
   to hold every event once.
3. **Reads.** Per table, with a fresh DataFrame each time and Spark's cache
   cleared: ``count()`` and a filtered aggregate (``op = 'update'``, by
   collection, count and ``sum(new:amount::double)``), alternating tables,
   ``--reads`` times; the median counts, with the ratio to ``few``.

Files per partition are printed for each table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.bench_cdc import CORES, make_batches
from bench.common import process_tree, total_cpu_seconds
from daemon.config import CdcConfig, CdcStream, Config, DaemonConfig, SparkConfig
from daemon.plane.batch import MicroBatch
from daemon.service.metrics import Metrics
from daemon.spark.executor import SparkExecutor
from daemon.spark.session import build_session
from daemon.table import compact, compactmerge, compactplan
from daemon.table.parquet import CdcSink


def _config(root: Path, table: Path, **stream: Any) -> Config:
    return Config(
        daemon=DaemonConfig(data_dir=root / "var", cores=CORES),
        spark=SparkConfig(),
        cdc=CdcConfig(
            streams=(CdcStream("all", ("*",), table, **{"format": "parquet", **stream}),)
        ),
    )


class MergeClock:
    """CPU seconds of the calling thread inside ``compact.write_merged`` (the
    service's step 2), and Spark fallbacks, while installed."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.merges = 0
        self.spark = 0
        self._write = compact.write_merged
        self._spark = compactmerge.write_merged_spark

    def __enter__(self) -> MergeClock:
        def write(*args: Any) -> None:
            started = time.thread_time()
            try:
                self._write(*args)
            finally:
                self.cpu += time.thread_time() - started
                self.merges += 1

        def spark(*args: Any) -> None:
            self.spark += 1
            self._spark(*args)

        compact.write_merged = write  # type: ignore[assignment]
        compactmerge.write_merged_spark = spark  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        compact.write_merged = self._write  # type: ignore[assignment]
        compactmerge.write_merged_spark = self._spark  # type: ignore[assignment]


async def ingest(
    spark: Any,
    root: Path,
    table: Path,
    batches: Sequence[MicroBatch],
    *,
    compaction: bool,
    interval: float = 20.0,
    clock: MergeClock | None = None,
) -> tuple[float, float, int]:
    """Commit every batch; seconds, CPU seconds (this process and its JVM) and
    compactions the service ran meanwhile (``clock``: step 2's CPU, counted
    until the last commit)."""
    shutil.rmtree(table, ignore_errors=True)
    stream = {"compaction": compaction, "compact_interval_s": interval}
    ex = SparkExecutor(_config(root, table, **stream), Metrics(), wal_id="bench", session=spark)
    await ex.start()
    try:
        pids = process_tree(os.getpid())
        cpu = total_cpu_seconds(pids)
        started = time.perf_counter()
        for i, b in enumerate(batches):
            running = asyncio.ensure_future(ex.execute(b))
            if i + 1 < len(batches):
                ex.prepare(batches[i + 1])  # what the planner does with a full next batch
            await running
        seconds = time.perf_counter() - started
        cpu = total_cpu_seconds(pids) - cpu
        if clock is not None:
            clock.__exit__()  # the look after the run below is not counted
        assert ex.compaction is not None
        done = ex.compaction.status("all") or {}
        if compaction:  # the service stops (after its running compaction), and
            # its next look runs here: the table as the background leaves it
            await asyncio.to_thread(ex.compaction.stop, 300.0)
            done = ex.compaction.status("all") or {}
            more = await asyncio.to_thread(compact.compact_stream, ex.sinks[0], spark, full=False)
            done["compactions"] = int(done.get("compactions") or 0) + len(more)
        return seconds, cpu, int(done.get("compactions") or 0)
    finally:
        await ex.stop()


def files_per_partition(table: Path) -> dict[str, int]:
    return {d.name: len(compactplan.data_files(d)) for d in compactplan.partitions(table)}


def check_once(spark: Any, table: Path, events: int) -> None:
    df = spark.read.parquet(str(table))
    n, distinct = df.selectExpr("count(*)", "count(distinct lsn)").first()
    if (n, distinct) != (events, events):
        raise SystemExit(f"{table}: {n} rows, {distinct} distinct LSNs; expected {events}")


def read_once(spark: Any, table: Path, query: str) -> float:
    spark.catalog.clearCache()
    started = time.perf_counter()
    df = spark.read.parquet(str(table))
    if query == "count":
        df.count()
    else:
        agg = df.where("op = 'update'").selectExpr("collection", "new:amount::double AS amount")
        agg.groupBy("collection").agg({"amount": "sum", "*": "count"}).collect()
    return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--events", type=int, default=400_000)
    p.add_argument("--batches", type=int, default=400, help="micro-batches (default 400)")
    p.add_argument("--rounds", type=int, default=2, help="ingest rounds per side (best counts)")
    p.add_argument("--reads", type=int, default=7, help="reads per table and query (median)")
    p.add_argument("--master", default="local[2]")
    p.add_argument(
        "--interval", type=float, default=20.0, help="compact_interval_s of the 'on' side (20)"
    )
    p.add_argument("--dir", type=Path, help="work folder (default: a temp folder, removed)")
    p.add_argument("--json", action="store_true", help="print results as JSON too")
    args = p.parse_args(argv)

    root = args.dir or Path(tempfile.mkdtemp(prefix="bench-compaction-"))
    spark = build_session(
        args.master,
        "eventplane-bench",
        False,
        "ERROR",
        {"spark.sql.shuffle.partitions": "4", "spark.driver.memory": "2g"},
    )
    try:
        return asyncio.run(run(spark, root, args))
    finally:
        spark.stop()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


async def run(spark: Any, root: Path, args: argparse.Namespace) -> int:
    events = args.events
    batches = make_batches(events, max(1, events // args.batches))
    tables = {name: root / name for name in ("small", "tiered", "full", "few")}

    # Warm-up: JIT and class loading for both sides.
    warm = make_batches(20_000, 2_000)
    await ingest(spark, root, root / "warm", warm, compaction=False)

    # 1. Ingest, compaction off and on, alternating.
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    compactions = 0
    merges: list[tuple[float, int, int]] = []  # per "on" round: CPU s, merges, Spark jobs
    for r in range(args.rounds):
        for on in (False, True) if r % 2 == 0 else (True, False):
            target = tables["tiered" if on else "small"]
            clock = MergeClock().__enter__() if on else None
            try:
                seconds, cpu, n = await ingest(
                    spark, root, target, batches, compaction=on, interval=args.interval, clock=clock
                )
            finally:
                if clock is not None:
                    clock.__exit__()
            times[on].append((seconds, cpu))
            if clock is not None:
                compactions = n
                merges.append((clock.cpu, clock.merges, clock.spark))
            print(
                f"round {r + 1}: compaction {'on ' if on else 'off'} {seconds:.2f} s, "
                f"{cpu:.1f} CPU s"
                + (
                    f" ({n} compactions; step 2: {clock.merges} merges, "
                    f"{clock.cpu:.2f} CPU s in process, {clock.spark} Spark jobs)"
                    if clock is not None
                    else ""
                ),
                flush=True,
            )

    # 2. The other tables: full compaction of a copy of "small"; one big batch.
    shutil.copytree(tables["small"], tables["full"])
    sink = CdcSink(
        CdcStream("all", ("*",), tables["full"], format="parquet"), wal_id="bench", cores=CORES
    )
    sink.open()
    started = time.perf_counter()
    full = await asyncio.to_thread(compact.compact_stream, sink, spark, full=True)
    full_s = time.perf_counter() - started
    sink.close()
    one = make_batches(events, events)
    await ingest(spark, root, tables["few"], one, compaction=False)
    for t in tables.values():
        check_once(spark, t, events)

    # 3. Reads, alternating tables.
    reads: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.reads):
        for query in ("count", "aggregate"):
            for name, t in tables.items():
                reads.setdefault((name, query), []).append(read_once(spark, t, query))
    med = {k: statistics.median(v) for k, v in reads.items()}

    best = {on: min(v) for on, v in times.items()}  # best round by time
    print()
    print(f"{events:,} events in {len(batches)} micro-batches, {args.master}")
    print()
    print("| ingest | best s | events/s | vs off | CPU s | CPU vs off |")
    print("|---|---:|---:|---:|---:|---:|")
    for on in (False, True):
        (s, c), (s0, c0) = best[on], best[False]
        label = f"on ({compactions} compactions)" if on else "off"
        print(
            f"| compaction {label} | {s:.2f} | {events / s:,.0f} | {s0 / s:.2f}x "
            f"| {c:.1f} | {c / c0:.2f}x |"
        )
    # Each round runs both sides back to back: their ratio moves less with the
    # other jobs on a shared machine than the best of each side does.
    pairs = [times[False][r][0] / times[True][r][0] for r in range(args.rounds)]
    cpus = [times[True][r][1] / times[False][r][1] for r in range(args.rounds)]
    print(
        "per round, events/s on vs off: "
        + ", ".join(f"{x:.2f}x" for x in pairs)
        + f" (median {statistics.median(pairs):.2f}x); CPU on vs off: "
        + ", ".join(f"{x:.2f}x" for x in cpus)
        + f" (median {statistics.median(cpus):.2f}x); least CPU s: off "
        + f"{min(c for _, c in times[False]):.1f}, on {min(c for _, c in times[True]):.1f}"
    )
    for i, (cpu, n, jobs) in enumerate(merges):
        print(
            f"step 2 of compaction, 'on' round {i + 1}: {n} merges, {cpu:.2f} CPU s in "
            f"process, {jobs} Spark jobs"
        )
    print()
    print(f"full compaction of `small`: {len(full)} partitions in {full_s:.2f} s")
    print()
    print("| table | files per partition | count() s | vs few | aggregate s | vs few |")
    print("|---|---|---:|---:|---:|---:|")
    for name, t in tables.items():
        fpp = files_per_partition(t)
        shown = f"{min(fpp.values())}-{max(fpp.values())}" if fpp else "0"
        c, a = med[(name, "count")], med[(name, "aggregate")]
        print(
            f"| {name} | {shown} | {c:.3f} | {c / med[('few', 'count')]:.2f}x "
            f"| {a:.3f} | {a / med[('few', 'aggregate')]:.2f}x |"
        )
    if args.json:
        print(
            json.dumps(
                {
                    "ingest_s_cpu_s": {"off": times[False], "on": times[True]},
                    "compactions": compactions,
                    "step2_cpu_s_merges_spark_jobs": merges,
                    "per_round_events_per_s_on_vs_off": pairs,
                    "reads_median_s": {f"{n}/{q}": v for (n, q), v in med.items()},
                    "files_per_partition": {n: files_per_partition(t) for n, t in tables.items()},
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
