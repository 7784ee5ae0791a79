"""Trigger benchmark: the engine's stage against a hand-written peer, same run.

Both sides get the same batch DataFrames, built the way the Spark executor
builds them (Arrow table -> ``createDataFrame`` -> ``parse_json`` for VARIANT),
and deliver to the same loopback aiohttp receiver (its own thread and event
loop, answering 200 at once), in chunks of ``--batch-size`` rows:

Both sides run on every batch, alternating which goes first, so JVM warm-up
and background load fall on both alike.

- engine: ``TriggerEngine.run_in_spark`` (worker thread) then ``finish`` on the
  loop, exactly the BatchStage protocol the executor drives; one Spark job for
  all triggers, rows rendered to JSON by Spark and collected through Arrow;
- peer: what one writes by hand: per trigger, ``df.filter(expr)`` selecting
  ``to_json(new/old)``, ``collect()`` to Row objects, rows to dicts with
  ``json.loads``, ``json.dumps`` of each chunk, ``aiohttp`` POST per chunk.

Measured per side:

- matched rows/s and batch events/s through the stage (``--warmup`` batches first, unmeasured);
- webhook call latency p50/p99 (one POST round trip, measured by the sender);
- batch start -> row received p50/p99: from the moment the stage gets the
  DataFrame to the receiver holding the row (the trigger part of the
  ingest -> webhook latency; the daemon adds WAL + planning + interval).

Run: ``python -m bench.bench_triggers`` (``--events 20000 --batches 2`` for a
quick run; ``--triggers 4`` splits the matches over four triggers).

``--e2e`` measures the whole daemon instead (ingest -> webhook received at a
steady rate, and the max sustained rate) against a Structured Streaming job:
see ``bench/triggers_e2e.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from bench.common import HookServer

THRESHOLD = 1000.0  # amounts are uniform in [0, top); those above THRESHOLD match


@dataclass
class Received:
    """What the receiver saw: per request, its receive time, rows and POST duration."""

    times: list[float] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)


class Receiver(HookServer):
    """The loopback receiver (``bench.common.HookServer``): counts rows per request."""

    def __init__(self) -> None:
        super().__init__()
        self.got = Received()

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        now = time.perf_counter()
        rows = len(msgspec.json.decode(body)["rows"])
        self.got.times.append(now)
        self.got.rows.append(rows)
        return web.Response(text="ok")

    def reset(self) -> Received:
        got, self.got = self.got, Received()
        return got


# --------------------------------------------------------------------------
# Data


def make_table(events: int, match: float, first_lsn: int, seed: int, batch_id: int) -> Any:
    """An Arrow table shaped like the executor's ``batch_table`` output."""
    import pyarrow as pa

    rng = random.Random(seed)
    top = THRESHOLD / (1.0 - match)  # P(amount > THRESHOLD) = match
    lsns = list(range(first_lsn, first_lsn + events))
    news = [
        json.dumps({"amount": round(rng.random() * top, 2), "customer": f"c{rng.randrange(10_000)}",
                    "items": rng.randrange(1, 9), "note": "x" * 40})
        for _ in lsns
    ]  # fmt: skip
    ts = time.time_ns() // 1000
    return pa.table(
        {
            "lsn": pa.array(lsns, pa.int64()),
            "core": pa.array([n % 4 for n in lsns], pa.int32()),
            "seq": pa.array(lsns, pa.int64()),
            "collection": pa.array(["orders"] * events, pa.string()),
            "op": pa.array(["insert" if n % 3 else "update" for n in lsns], pa.string()),
            "key": pa.array([f"o{n % 50_000}" for n in lsns], pa.string()),
            "new_json": pa.array(news, pa.string()),
            "old_json": pa.array([None] * events, pa.string()),
            "ingest_ts": pa.array([ts] * events, pa.timestamp("us", tz="UTC")),
            "batch_id": pa.array([batch_id] * events, pa.int64()),
            "depth": pa.array([0] * events, pa.int32()),
            "source": pa.array([""] * events, pa.string()),
        }
    )


def when_for(i: int, triggers: int) -> str:
    """Trigger i of n matches amounts in its slice of (THRESHOLD, top)."""
    if triggers == 1:
        return f"new:amount::double > {THRESHOLD:g}"
    # Split by LSN so each trigger gets an equal share of the matches.
    return f"new:amount::double > {THRESHOLD:g} AND lsn % {triggers} = {i}"


# --------------------------------------------------------------------------
# The two sides


@dataclass
class Run:
    seconds: float = 0.0
    events: int = 0
    matched: int = 0
    starts: list[float] = field(default_factory=list)
    calls: list[float] = field(default_factory=list)  # webhook call durations, s


class _Recorder:
    """TriggerMetrics that keeps exact action latencies (the histogram's buckets are coarse)."""

    def __init__(self, sink: list[float]) -> None:
        self._sink = sink

    def labels(self, *values: str) -> _Recorder:
        return self

    def observe(self, amount: float) -> None:
        self._sink.append(amount)

    def inc(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass


class RecordingMetrics:
    def __init__(self, calls: list[float]) -> None:
        nothing = _Recorder([])
        self.trigger_fires = self.trigger_successes = self.trigger_failures = nothing
        self.retry_depth = self.dlq_entries = self.dlq_evicted = nothing
        self.trigger_action_latency = _Recorder(calls)


class EngineSide:
    """The engine as the executor drives it: run_in_spark in a thread, then finish."""

    name = "engine"
    prefix = "t"

    def __init__(self, spark: Any, url: str, triggers: int, batch_size: int, data_dir: Path):
        from triggers import Spec, TriggerEngine

        self.spark = spark
        self.calls: list[float] = []
        specs = [
            Spec(name=f"{self.prefix}{i}", collection="orders", on=("insert", "update"),
                 when=when_for(i, triggers), batch_size=batch_size,
                 action={"type": "webhook", "url": url})
            for i in range(triggers)
        ]  # fmt: skip
        self.http = aiohttp.ClientSession()
        self.engine = TriggerEngine(
            specs, data_dir=data_dir, http=self.http, metrics=RecordingMetrics(self.calls)
        )

    async def start(self) -> None:
        errors = await asyncio.to_thread(self.engine.validate, self.spark)
        if errors:
            raise SystemExit("\n".join(errors))
        await self.engine.start(retry_loop=False)

    async def batch(self, batch_id: int, df: Any) -> int:
        from daemon.plane.batch import MicroBatch

        batch = MicroBatch(batch_id, {})
        result = await asyncio.to_thread(self.engine.run_in_spark, self.spark, df, batch)
        await self.engine.finish(batch, result)
        return sum(len(v) for v in result.matched.values())

    async def stop(self) -> None:
        await self.engine.stop()
        await self.http.close()


class PeerSide:
    """What one writes by hand: per trigger filter + collect, json, aiohttp POST per chunk."""

    name = "peer"
    prefix = "p"

    def __init__(self, spark: Any, url: str, triggers: int, batch_size: int) -> None:
        self.spark, self.url, self.triggers, self.batch_size = spark, url, triggers, batch_size
        self.calls: list[float] = []
        self.http: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.http = aiohttp.ClientSession()

    async def batch(self, batch_id: int, df: Any) -> int:
        from pyspark.sql import functions as F

        assert self.http is not None
        matched = 0
        for i in range(self.triggers):
            cond = F.expr(f"collection = 'orders' AND op IN ('insert', 'update') "
                          f"AND ({when_for(i, self.triggers)})")  # fmt: skip
            picked = df.filter(cond).select(
                "lsn", "core", "seq", "collection", "op", "key",
                F.to_json("new").alias("new"), F.to_json("old").alias("old"),
                F.col("ingest_ts").cast("string").alias("ingest_ts"), "batch_id",
            )  # fmt: skip
            rows = await asyncio.to_thread(picked.collect)
            rows.sort(key=lambda r: r["lsn"])
            name = f"{self.prefix}{i}"
            for c in range(0, len(rows), self.batch_size):
                part = rows[c : c + self.batch_size]
                docs = []
                for r in part:
                    d = r.asDict()
                    d["new"] = json.loads(d["new"]) if d["new"] is not None else None
                    d["old"] = json.loads(d["old"]) if d["old"] is not None else None
                    d["idempotency_key"] = f"{name}:{d['lsn']}"
                    docs.append(d)
                body = json.dumps({"trigger": name, "rows": docs})
                key = f"{name}:{part[0]['lsn']}-{part[-1]['lsn']}"
                headers = {"Content-Type": "application/json", "Idempotency-Key": key}
                call_started = time.perf_counter()
                async with self.http.post(self.url, data=body, headers=headers) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"peer got HTTP {resp.status}")
                self.calls.append(time.perf_counter() - call_started)
            matched += len(rows)
        return matched

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.close()


async def run_both(
    spark: Any, frames: Sequence[tuple[Any, int]], receiver: Receiver, args: Any, data_dir: Path
) -> dict[str, tuple[Run, list[float]]]:
    """Both sides on every batch, alternating which goes first, so JVM warm-up
    and background load fall on both alike. Returns per side its run and the
    per-row batch-start -> received latencies (ms)."""
    sides: list[Any] = [
        EngineSide(spark, receiver.url, args.triggers, args.batch_size, data_dir),
        PeerSide(spark, receiver.url, args.triggers, args.batch_size),
    ]
    runs = {s.name: Run() for s in sides}
    latencies: dict[str, list[float]] = {s.name: [] for s in sides}
    for side in sides:
        await side.start()
    try:
        for n, (df, events) in enumerate(frames):
            order = sides if n % 2 == 0 else sides[::-1]
            for side in order:
                receiver.reset()
                started = time.perf_counter()
                matched = await side.batch(n + 1, df)
                seconds = time.perf_counter() - started
                got = receiver.reset()
                if n < args.warmup:
                    side.calls.clear()
                    continue
                run = runs[side.name]
                run.seconds += seconds
                run.events += events
                run.matched += matched
                run.starts.append(started)
                for t, rows in zip(got.times, got.rows, strict=True):
                    latencies[side.name].extend([(t - started) * 1000] * rows)
    finally:
        for side in sides:
            await side.stop()
    for side in sides:
        runs[side.name].calls = list(side.calls)
    return {name: (runs[name], latencies[name]) for name in runs}


# --------------------------------------------------------------------------
# Report


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_triggers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--events", type=int, default=100_000, help="events per batch")
    ap.add_argument("--batches", type=int, default=4, help="measured batches")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured batches first (JIT, codegen)")
    ap.add_argument("--match", type=float, default=0.10, help="fraction of events matched")
    ap.add_argument("--triggers", type=int, default=1, help="triggers sharing the matches")
    ap.add_argument("--batch-size", type=int, default=1024, help="rows per webhook call")
    ap.add_argument(
        "--master", help="Spark master (stage: local[2]; --e2e: the shipped default, local[*])"
    )
    ap.add_argument(
        "--e2e",
        action="store_true",
        help="the whole daemon (ingest -> webhook) against a Structured Streaming job: "
        "see bench/triggers_e2e.py",
    )
    from bench import triggers_e2e

    triggers_e2e.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.e2e:
        from daemon.config import SparkConfig

        args.master = args.master or SparkConfig().master
        return triggers_e2e.run(args)
    args.master = args.master or "local[2]"

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    from daemon.spark.frame import batch_dataframe
    from daemon.spark.session import build_session

    print(f"Spark {args.master}: starting...", flush=True)
    spark = build_session(master=args.master, app_name="bench-triggers", log_level="ERROR",
                          conf={"spark.sql.shuffle.partitions": "2"})  # fmt: skip
    receiver = Receiver()
    receiver.start()
    tmp = Path(tempfile.mkdtemp(prefix="bench-triggers-"))
    try:
        frames = []
        for b in range(args.warmup + args.batches):
            table = make_table(args.events, args.match, 1 + b * args.events, seed=b, batch_id=b + 1)
            frames.append((batch_dataframe(spark, table, b + 1), args.events))
        print(
            f"{args.batches} measured batches (after {args.warmup} warm-up) of {args.events:,} "
            "events, "
            f"{args.match:.0%} matched by {args.triggers} trigger(s), "
            f"{args.batch_size} rows per webhook call",
            flush=True,
        )
        results = asyncio.run(run_both(spark, frames, receiver, args, tmp))
    finally:
        receiver.stop()
        spark.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    stats: dict[str, dict[str, float]] = {}
    for name, (run, per_row) in results.items():
        calls_ms = [c * 1000 for c in run.calls]
        stats[name] = {
            "matched rows/s": run.matched / run.seconds,
            "batch events/s": run.events / run.seconds,
            "stage time per batch (ms)": run.seconds / max(len(run.starts), 1) * 1000,
            "webhook call p50 (ms)": pct(calls_ms, 0.50),
            "webhook call p99 (ms)": pct(calls_ms, 0.99),
            "batch start -> row received p50 (ms)": pct(per_row, 0.50),
            "batch start -> row received p99 (ms)": pct(per_row, 0.99),
            "matched rows": float(run.matched),
        }
    if stats["engine"]["matched rows"] != stats["peer"]["matched rows"]:
        print("MISMATCH: engine and peer matched different row counts", file=sys.stderr)
        return 1
    higher_better = {"matched rows/s", "batch events/s"}
    width = max(len(k) for k in stats["engine"])
    print(f"\n{'metric':<{width}}  {'engine':>12}  {'peer':>12}  {'engine vs peer':>14}")
    for key in stats["engine"]:
        e, p = stats["engine"][key], stats["peer"][key]
        if key == "matched rows":
            print(f"{key:<{width}}  {e:>12,.0f}  {p:>12,.0f}  {'same':>14}")
            continue
        ratio = (e / p if key in higher_better else p / e) if e and p else float("nan")
        print(f"{key:<{width}}  {e:>12,.1f}  {p:>12,.1f}  {ratio:>13.2f}x")
    print("\n(engine vs peer: > 1 means the engine is better, on every line)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
