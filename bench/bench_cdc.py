"""Executor throughput vs Spark Structured Streaming, same events, same run, same session.

``python -m bench.bench_cdc [--events N] [--batch-rows R] [--master local[*]]``

- **eventplane**: WAL-less micro-batches (``Record``s of msgpack ``StoredEvent``
  payloads, as the consumers hand them over) -> ``SparkExecutor.execute``, the
  next batch handed to ``prepare`` while one runs, as the planner does ->
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
With ``--e2e`` it also runs the whole daemon (``eventplane run`` in a
subprocess: HTTP ingest with fsync "always" -> WAL -> rings/consumers ->
planner -> this executor -> CDC table) on the same events, posted by
``--clients`` closed-loop producers in requests of 1000 events, timed from the
first request to the moment the stream's ledger holds every event. The daemon
is started and warmed up once; each round then runs executor, peer and end to
end back to back (the best round of each side counts); then the
ingest-to-visible latency at ``--rate`` events/s (open loop, requests of 200
events on a fixed schedule; visible = the ledger has committed every LSN of
the request on its core, polled every 20 ms).

Next to the time, each side's CPU seconds are reported: user + system time of
every process of that side (the executor and the peer: this process and its
JVM; end to end: the daemon, its JVM and this process, which runs the
producers). On a shared machine they drift less than wall time, and they
bound it: a side cannot finish faster than its CPU seconds over the CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
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

from bench.common import post_events, process_tree, total_cpu_seconds
from daemon.config import CdcConfig, CdcStream, Config, DaemonConfig, SparkConfig
from daemon.events import Op, StoredEvent, encode
from daemon.plane.batch import MicroBatch, Slice
from daemon.service.metrics import Metrics
from daemon.spark.executor import SparkExecutor
from daemon.spark.session import build_session
from wal.record import Record

E2E_REQUEST_EVENTS = 1000
LATENCY_REQUEST_EVENTS = 200
POLL_S = 0.02

CORES = 4
COLLECTIONS = ("orders", "users", "payments", "shipments")
BASE_TS_NS = 1_700_000_000_000_000_000


@dataclass(frozen=True, slots=True)
class Result:
    name: str
    events: int
    seconds: float
    cpu_seconds: float  # every process of that side, same round as ``seconds``

    @property
    def rate(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0

    @property
    def cpu_us_per_event(self) -> float:
        return self.cpu_seconds * 1e6 / self.events if self.events else 0.0


def _this_side(skip: Daemon | None) -> list[int]:
    """This process and its JVM: what the executor and the peer run in."""
    return process_tree(os.getpid(), frozenset({skip.proc.pid}) if skip else frozenset())


def _event(i: int) -> tuple[str, Op, str, bytes, bytes | None]:
    collection = COLLECTIONS[i % len(COLLECTIONS)]
    key = f"k{(i * 7919) % 100_000}"
    op: Op = "insert" if i % 3 == 0 else "update"
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


def executor_config(root: Path) -> Config:
    """The executor's config for the executor-only runs: one stream ``all`` of
    every collection under ``root/cdc``, state under ``root/var``."""
    return Config(
        daemon=DaemonConfig(data_dir=root / "var", cores=CORES),
        spark=SparkConfig(),
        cdc=CdcConfig(streams=(CdcStream("all", ("*",), root / "cdc", format="parquet"),)),
    )


async def run_eventplane(spark: Any, batches: Sequence[MicroBatch], root: Path) -> float:
    ex = SparkExecutor(executor_config(root), Metrics(), wal_id="bench", session=spark)
    await ex.start()
    started = time.perf_counter()
    for i, b in enumerate(batches):
        running = asyncio.ensure_future(ex.execute(b))
        if i + 1 < len(batches):
            # What the planner does with a full next batch: close it ahead and
            # let the executor build its input while this one runs in Spark.
            ex.prepare(batches[i + 1])
        await running
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


# --------------------------------------------------------------------------
# End to end: the daemon in a subprocess, HTTP producers here


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ndjson(first: int, count: int, poison_every: int = 0) -> tuple[bytes, list[tuple[str, str]]]:
    """NDJSON of events ``first..``; with ``poison_every``, every such event's
    ``amount`` is a string a ``new:amount::double`` cast rejects (bench_faults)."""
    lines, keys = [], []
    for i in range(first, first + count):
        collection, op, key, new, old = _event(i)
        if poison_every and i % poison_every == 0:
            new = b'{"amount":"lots","qty":0,"status":"paid","sku":"sku-poison"}'
        old_text = (old or b"null").decode()
        lines.append(
            f'{{"collection":"{collection}","op":"{op}","key":"{key}",'
            f'"new":{new.decode()},"old":{old_text}}}'
        )
        keys.append((collection, key))
    return ("\n".join(lines) + "\n").encode(), keys


@dataclass
class Daemon:
    proc: Any
    ingest: str
    admin: str
    table: Path
    log: Path

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def start_daemon(
    root: Path,
    master: str,
    interval_ms: int,
    max_rows: int,
    extra: str = "",
    src: Path | None = None,
    python: str = sys.executable,
) -> Daemon:
    """Start ``eventplane run`` on a config of its own under ``root``; ``src``: run
    the daemon package of that source tree (its folder is the process's working
    directory, which comes first on ``sys.path``) instead of this one's;
    ``python``: the interpreter (and so the PySpark) the daemon runs with."""
    import hashlib
    import subprocess
    import urllib.request

    root.mkdir(parents=True)
    # Every daemon a benchmark starts has a data_dir of its own, but they all
    # share the driver JVM's class data sharing archive, as a daemon restarted
    # on its data_dir does (docs/performance.md, "The daemon's JVM"); the
    # first one records it when its JVM exits. One folder per interpreter: a
    # daemon removes the archives of another PySpark from its folder, so two
    # venvs on two PySpark versions (a --baseline-python side, another
    # checkout's bench) would keep removing each other's.
    venv = hashlib.sha256(python.encode()).hexdigest()[:8]
    cds = Path(tempfile.gettempdir()) / f"eventplane-bench-spark-cds-{venv}"
    cds.mkdir(exist_ok=True)
    (root / "data").mkdir()
    (root / "data" / "spark-cds").symlink_to(cds, target_is_directory=True)
    ingest, admin = _free_port(), _free_port()
    config = root / "config.toml"
    config.write_text(f"""
[daemon]
data_dir = "data"
cores = {CORES}
[ingest]
listen = "127.0.0.1:{ingest}"
[admin]
listen = "127.0.0.1:{admin}"
[wal]
fsync = "always"
[spark]
master = "{master}"
log_level = "ERROR"
[spark.conf]
"spark.sql.shuffle.partitions" = "4"
"spark.driver.memory" = "4g"
[microbatch]
interval_ms = {interval_ms}
max_rows = {max_rows}
[log]
level = "warning"
format = "json"
[[cdc.streams]]
name = "all"
collections = "*"
path = "cdc"
{extra}
""")
    log = root / "daemon.log"
    env = {**os.environ, "PYSPARK_PYTHON": python}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [python, "-m", "daemon.cli.main", "run", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=src,
        )
    d = Daemon(proc, f"http://127.0.0.1:{ingest}", f"http://127.0.0.1:{admin}", root / "cdc", log)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"daemon exited with {proc.returncode}:\n{d.tail()}")
        try:
            with urllib.request.urlopen(f"{d.admin}/v1/status", timeout=2) as r:
                if json.load(r).get("spark", {}).get("ready"):
                    return d
        except OSError:
            pass
        time.sleep(0.5)
    stop_daemon(d)
    raise SystemExit(f"daemon's Spark not ready after 300 s:\n{d.tail()}")


def stop_daemon(d: Daemon) -> None:
    import signal
    import subprocess

    from bench.jvm_threads import find_jvm

    jvm = find_jvm(d.proc.pid) if d.proc.poll() is None else None
    if d.proc.poll() is None:
        d.proc.send_signal(signal.SIGTERM)
        try:
            d.proc.wait(60)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait(10)
    # The driver JVM outlives the daemon by a moment (and by the time it takes
    # to record its class data sharing archive, the first time): the next
    # side must not share the cores with it.
    deadline = time.monotonic() + 120
    while jvm is not None and time.monotonic() < deadline:
        try:
            with open(f"/proc/{jvm}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    break  # exited, not yet reaped
        except OSError:
            break  # gone
        time.sleep(0.1)


def _ledger_state(table: Path) -> tuple[int, dict[int, int]]:
    from daemon.table.ledger import read_ledger

    try:
        ledger = read_ledger(table)
    except Exception:  # mid-replace on a slow disk: read again next poll
        return -1, {}
    return (ledger.rows_total, dict(ledger.high_lsn)) if ledger else (0, {})


async def e2e_throughput(
    d: Daemon, events: int, clients: int, first: int = 1, already: int = 0
) -> tuple[float, float]:
    """(seconds until all visible, seconds until all acknowledged), from the first post.

    Posts events ``first .. first + events - 1``; ``already`` events were committed
    before (the warm-up), so "all visible" means the ledger holds both.
    """
    import aiohttp

    last = first + events - 1
    bodies = [
        _ndjson(i, min(E2E_REQUEST_EVENTS, last - i + 1))[0]
        for i in range(first, last + 1, E2E_REQUEST_EVENTS)
    ]
    todo = iter(bodies)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:

        async def producer() -> None:
            for body in todo:
                await post_events(session, d.ingest, body)

        started = time.perf_counter()
        await asyncio.gather(*(producer() for _ in range(clients)))
        acked = time.perf_counter() - started
    while _ledger_state(d.table)[0] < already + events:
        if d.proc.poll() is not None:
            raise SystemExit(f"daemon died:\n{d.tail()}")
        await asyncio.sleep(POLL_S)
    return time.perf_counter() - started, acked


async def e2e_latency(
    d: Daemon, first_event: int, rate: int, seconds: float, poison_every: int = 0
) -> list[float]:
    """Ingest-to-visible latency of each request, in seconds (open loop at ``rate``)."""
    import aiohttp

    n_req = max(1, int(rate * seconds / LATENCY_REQUEST_EVENTS))
    requests = [
        _ndjson(first_event + i * LATENCY_REQUEST_EVENTS, LATENCY_REQUEST_EVENTS, poison_every)
        for i in range(n_req)
    ]
    period = LATENCY_REQUEST_EVENTS / rate
    snapshots: list[tuple[float, dict[int, int]]] = []
    done = asyncio.Event()

    async def poll() -> None:
        while not done.is_set():
            snapshots.append((time.perf_counter(), _ledger_state(d.table)[1]))
            await asyncio.sleep(POLL_S)

    sent: list[tuple[float, dict[int, int]]] = []  # (scheduled time, per-core LSN needed)
    poller = asyncio.create_task(poll())
    async with aiohttp.ClientSession() as session:
        t0 = time.perf_counter() + 0.1

        async def one(i: int) -> None:
            due = t0 + i * period
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            ack = await post_events(session, d.ingest, requests[i][0])
            sent.append((due, _needs(ack["first_lsn"], requests[i][1])))

        await asyncio.gather(*(one(i) for i in range(n_req)))
    deadline = time.perf_counter() + 300
    while time.perf_counter() < deadline:
        if snapshots and all(_visible_at(snapshots[-1:], need) for _, need in sent):
            break
        await asyncio.sleep(POLL_S)
    done.set()
    await poller
    latencies = []
    for due, need in sent:
        at = _visible_at(snapshots, need)
        if at is None:
            raise SystemExit(f"request due at {due:.3f} never became visible:\n{d.tail()}")
        latencies.append(at - due)
    return latencies


def _needs(first_lsn: int, keys: list[tuple[str, str]]) -> dict[int, int]:
    """Per core, the highest LSN of the request on that core."""
    from daemon.shard import core_of

    need: dict[int, int] = {}
    for i, (collection, key) in enumerate(keys):
        c = core_of(collection, key, CORES)
        need[c] = max(need.get(c, 0), first_lsn + i)
    return need


def _visible_at(
    snapshots: Sequence[tuple[float, dict[int, int]]], need: dict[int, int]
) -> float | None:
    for t, high in snapshots:  # high LSNs only grow: the first match is the time
        if all(high.get(c, 0) >= lsn for c, lsn in need.items()):
            return t
    return None


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


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
    rows = [
        "| system | events | seconds | events/s | vs peer | CPU s | CPU us/event | CPU vs peer |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = r.rate / peer.rate if peer.rate else 0.0
        # > 1 means this side spends less CPU per event than the peer.
        cpu_ratio = peer.cpu_seconds / r.cpu_seconds if r.cpu_seconds else 0.0
        rows.append(
            f"| {r.name} | {r.events:,} | {r.seconds:.2f} | {r.rate:,.0f} | {ratio:.2f}x "
            f"| {r.cpu_seconds:.1f} | {r.cpu_us_per_event:.2f} | {cpu_ratio:.2f}x |"
        )
    cores = os.cpu_count() or 1
    note = (
        f"CPU: user + system seconds of every process of that side (the JVM included; end "
        f"to end also counts the producers); {cores} CPUs here, so a side needs at least "
        f"CPU s / {cores} of wall time."
    )
    return head + "\n\n" + "\n".join(rows) + "\n\n" + note


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
    p.add_argument(
        "--warmup-events",
        type=int,
        default=200_000,
        help="untimed events per side first: the JVM's JIT needs a few 100k-row batches",
    )
    p.add_argument("--dir", type=Path, help="work folder (default: a temp folder, removed)")
    p.add_argument("--json", action="store_true", help="print results as JSON too")
    p.add_argument(
        "--e2e",
        action="store_true",
        help="also run the whole daemon over HTTP (see the module docstring)",
    )
    p.add_argument("--clients", type=int, default=8, help="e2e producers (default 8)")
    p.add_argument(
        "--rate", type=int, default=20_000, help="e2e latency run: events/s (default 20000)"
    )
    p.add_argument("--latency-seconds", type=float, default=10.0)
    p.add_argument(
        "--interval-ms",
        type=int,
        default=1000,
        help="e2e daemon's microbatch.interval_ms (default 1000, the shipped value)",
    )
    args = p.parse_args(argv)

    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
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
        # The prepared input is not part of what is measured: keep the collector from
        # walking a million prepared records during the timed runs.
        gc.collect()
        gc.freeze()

        print("warm-up ...", file=sys.stderr)
        asyncio.run(run_eventplane(spark, warm, root / "warm-ep"))
        run_peer(spark, root / "warm-landing", root / "warm-peer", args.peer_files_per_trigger)

        d: Daemon | None = None
        warm_n = args.warmup_events
        if args.e2e:
            print("end to end: starting eventplane run ...", file=sys.stderr)
            d = start_daemon(root / "e2e", args.master, args.interval_ms, args.batch_rows)
        extra: list[Result] = []
        latency: list[float] = []
        # (seconds, CPU seconds) of each timed round
        ours: list[tuple[float, float]] = []
        peers: list[tuple[float, float]] = []
        e2e: list[tuple[float, float]] = []
        try:
            if d is not None:
                # Warm-up (JIT, first-job set-up), not timed, like the other sides'.
                asyncio.run(e2e_throughput(d, warm_n, args.clients, first=args.events + 1))
            for n in range(args.rounds):
                # The sides alternate within a round: load from other jobs on this
                # shared machine moves every side's figure by 2x between minutes.
                print(f"round {n + 1}: eventplane executor ...", file=sys.stderr)
                side = _this_side(d)
                cpu = total_cpu_seconds(side)
                seconds = asyncio.run(run_eventplane(spark, batches, root / f"ep{n}"))
                ours.append((seconds, total_cpu_seconds(side) - cpu))
                count_once(spark, root / f"ep{n}" / "cdc", args.events)
                print(f"round {n + 1}: peer, Structured Streaming ...", file=sys.stderr)
                out = root / f"peer{n}"
                cpu = total_cpu_seconds(side)
                seconds = run_peer(spark, root / "landing", out, args.peer_files_per_trigger)
                peers.append((seconds, total_cpu_seconds(side) - cpu))
                count_once(spark, out / "table", args.events)
                shutil.rmtree(root / f"ep{n}", ignore_errors=True)
                shutil.rmtree(out, ignore_errors=True)
                if d is not None:
                    print(f"round {n + 1}: end to end over HTTP ...", file=sys.stderr)
                    # The same events every round: new LSNs, the same rows otherwise.
                    # CPU: the daemon and its JVM, and this process (the producers).
                    jvm = [p for p in process_tree(d.proc.pid) if p != d.proc.pid]
                    sides = ([d.proc.pid], jvm, [os.getpid()])  # daemon, its JVM, producers
                    before = [total_cpu_seconds(pids) for pids in sides]
                    visible, acked = asyncio.run(
                        e2e_throughput(
                            d, args.events, args.clients, already=warm_n + n * args.events
                        )
                    )
                    py, java, producers = (
                        total_cpu_seconds(pids) - b for pids, b in zip(sides, before, strict=True)
                    )
                    e2e.append((visible, py + java + producers))
                    print(
                        f"  all acknowledged after {acked:.2f}s, all visible after {visible:.2f}s;"
                        f" CPU s: daemon {py:.2f}, its JVM {java:.2f}, producers {producers:.2f}",
                        file=sys.stderr,
                    )
            if d is not None:
                print(f"end to end: latency at {args.rate:,} events/s ...", file=sys.stderr)
                first = args.events + warm_n + 1
                latency = asyncio.run(e2e_latency(d, first, args.rate, args.latency_seconds))
        finally:
            if d is not None:
                stop_daemon(d)
        if d is not None:
            total = warm_n + args.rounds * args.events + len(latency) * LATENCY_REQUEST_EVENTS
            count_once(spark, d.table, total)
            extra.append(
                Result(
                    "eventplane end to end: HTTP (fsync) -> WAL -> consumers -> Spark -> CDC",
                    args.events,
                    *min(e2e),
                )
            )

        results = [
            *extra,
            Result(
                "eventplane executor: batches -> Arrow -> VARIANT -> exactly-once CDC",
                args.events,
                *min(ours),
            ),
            Result(
                "peer: Structured Streaming, JSON files -> Parquet + checkpoint, availableNow",
                args.events,
                *min(peers),
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
        if latency:
            print(
                f"\ningest-to-visible latency at {args.rate:,} events/s "
                f"(microbatch.interval_ms = {args.interval_ms}, {len(latency)} requests of "
                f"{LATENCY_REQUEST_EVENTS}): p50 {_percentile(latency, 0.5) * 1000:.0f} ms, "
                f"p99 {_percentile(latency, 0.99) * 1000:.0f} ms"
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
                        "rounds": {"eventplane": ours, "peer": peers, "e2e": e2e},
                        "cpu_seconds": {r.name: r.cpu_seconds for r in results},
                        "latency_s": {
                            "p50": _percentile(latency, 0.5),
                            "p99": _percentile(latency, 0.99),
                        }
                        if latency
                        else None,
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
