"""A mirror against the peer users build today: landing files, Structured
Streaming ``foreachBatch`` and Delta ``MERGE INTO``, fed the same events in the
same run (issue 45).

``python -m bench.bench_mirror_peer [--keys N] [--events N] [--rate R] [--duration S]``

Both sides get the same bodies from the same producer code (bench_mirror_fresh's:
keyed changes of one collection ``orders``, 90 % updates, 5 % inserts of new
keys, 5 % deletes, uniform keys), one side after the other (2 cores: at once
would measure contention), each in its own processes:

- **eventplane**: ``eventplane run`` with one ``[[cdc.mirrors]]`` of ``orders``
  on local disk (bench_mirror_fresh's ``Daemon``: ``daemon.cores = 1``, 16
  buckets, ``wal.fsync = "always"``), ``microbatch.interval_ms`` =
  ``--interval-ms`` and the mirror's ``merge_interval_ms`` =
  ``--merge-interval-ms`` (0: a merge per batch).
- **peer**: bench_pipeline's landing server (aiohttp; group commit, each
  request's events fdatasynced before its 2xx, the file renamed into the
  watched folder every ``--rotate-ms``) that numbers every event (``seq``,
  its own LSN, as the daemon's WAL does: the ack's ``first_lsn``/``last_lsn``),
  and a Spark driver process (bench_pipeline's ``SparkDriver``, ``local[*]``,
  Delta's jars, 4 shuffle partitions) running one Structured Streaming query:
  the file source over the landing folder (``readStream.json`` with a schema),
  ``trigger(processingTime=--interval-ms)`` (so one MERGE per interval as the
  daemon's, "equal merge interval"), ``foreachBatch``: the batch reduced to the
  highest ``seq`` per key (``max(struct(seq, ...))`` by key, Delta's own
  change-data example), then ``MERGE INTO`` a Delta table (delete when matched,
  ``op = 'delete'`` and newer; update when matched and newer; insert when not
  matched and not a delete), the batch's seq range in the commit's
  ``userMetadata`` (``spark.databricks.delta.commitInfo.userMetadata``).
  Exactly once: the query's checkpoint, and a MERGE that only takes a newer seq.

Per side, one process tree started fresh:

1. **preload** and **warm-up** (untimed): ``--keys`` inserts, until visible,
   then ``--warmup-events`` changes in ``--warmup-parts`` parts, each posted
   closed loop and waited for (several merges: the peer's JVM compiles its
   MERGE);
2. **throughput**: ``--events`` changes posted closed loop by ``--clients``
   clients, timed from the first request to the commit that makes the last
   event visible; the side's CPU over it (``tree_cpu``: the daemon's process
   tree; the landing server's and the Spark driver's with its JVM), per event;
3. **freshness**: an open loop at ``--rate`` events/s (requests of 200) for
   ``--duration`` s; each request's freshness runs from its 2xx to the first
   poll (delta-rs, every ``--poll-ms``) that sees a MERGE commit covering its
   last LSN/seq (the daemon's ``eventplane.ranges``, the peer's
   ``peer.last``); the side's CPU over it, per event;
4. **the final table**, read with delta-rs: per key its ``doc``, ``amount``,
   ``status``.

Every key's changes go to one client (``change_bodies(shards=clients)``), which
posts them in turn: whatever the interleaving of the clients, each side
receives every key's changes in the same order, so both tables must equal the
fold of the bodies in order. The bench prints both comparisons (each side
against that fold, and the two tables with each other, row for row), and a
table: events/s and its ratio, CPU s and µs/event, freshness p50/p99, and the
ratios against the aims (eventplane >= 1.5x the peer's throughput, freshness
p99 <= 1/3 of the peer's). Results: bench/RESULTS.md, "bench_mirror_peer".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.bench_mirror_fresh import (
    Daemon,
    Watcher,
    _post,
    _q,
    change_bodies,
    freshness,
    open_loop,
    preload,
    preload_bodies,
    wait_covered,
)
from bench.bench_pipeline import (
    Lander,
    ServerProc,
    SparkDriver,
    load_average,
    serve,
    spark_job,
    tree_cpu,
)

MODULE = "bench.bench_mirror_peer"
SIDES = ("eventplane", "peer")
COLLECTION = "orders"
THROUGHPUT_AIM = 1.5  # eventplane's events/s over the peer's, at least
FRESHNESS_AIM = 1 / 3  # eventplane's freshness p99 over the peer's, at most
USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"
LATENCY_REQUEST_EVENTS = 200
LABELS = {
    "eventplane": "eventplane mirror (HTTP -> WAL -> delta-rs MERGE)",
    "peer": "landing files + Structured Streaming foreachBatch MERGE INTO",
}


# --------------------------------------------------------------------------
# Pure parts: the landing server's numbering, the fold, the comparison


def stamp(body: bytes, first: int) -> bytes:
    """``body``'s NDJSON lines, each numbered: ``"seq"`` as its first field,
    ``first`` for the first line, one more for each next."""
    out = []
    for i, line in enumerate(body.splitlines()):
        line = line.strip()
        if not line.startswith(b"{"):
            raise ValueError(f"not a JSON object: {line[:80]!r}")
        rest = line[1:].lstrip()
        sep = b"" if rest.startswith(b"}") else b","
        out.append(b'{"seq":%d%s%s\n' % (first + i, sep, rest))
    return b"".join(out)


class SeqLander(Lander):
    """bench_pipeline's Lander whose files hold every event with its position
    (the ack's LSNs) as ``seq``."""

    def _data(self, group: list[tuple[bytes, int, asyncio.Future[tuple[int, int]]]]) -> bytes:
        out, seq = [], self.position
        for body, n, _f in group:
            out.append(stamp(body, seq + 1))
            seq += n
        return b"".join(out)


@dataclass(frozen=True, slots=True)
class Change:
    """One event as the mirror folds it: its sequence, key, op and ``new``."""

    seq: int
    key: str
    op: str
    new: Any = None


def latest_per_key(batch: Iterable[Change]) -> dict[str, Change]:
    """foreachBatch's dedupe (and the daemon's reduction): the highest seq per key."""
    latest: dict[str, Change] = {}
    for c in batch:
        held = latest.get(c.key)
        if held is None or held.seq < c.seq:
            latest[c.key] = c
    return latest


def merge(state: dict[str, Change], batch: Iterable[Change]) -> None:
    """The MERGE INTO of one batch on ``state`` (key -> its row's change): when
    matched and newer, a delete deletes and anything else updates; when not
    matched, anything but a delete inserts."""
    for key, c in latest_per_key(batch).items():
        held = state.get(key)
        if held is not None and held.seq >= c.seq:
            continue
        if c.op == "delete":
            state.pop(key, None)
        else:
            state[key] = c


def changes(bodies: Iterable[bytes], first_seq: int = 1) -> list[Change]:
    """The events of ``bodies``, in order, numbered from ``first_seq``."""
    out = []
    seq = first_seq
    for body in bodies:
        for line in body.splitlines():
            ev = json.loads(line)
            out.append(Change(seq, ev["key"], ev["op"], ev.get("new")))
            seq += 1
    return out


Row = tuple[str, Any, Any]  # (canonical doc JSON, amount, status)


def row_of(doc: Any) -> Row:
    """A table row's compared values from its ``doc`` (parsed ``new``)."""
    if isinstance(doc, str | bytes):
        doc = json.loads(doc)
    amount = doc.get("amount") if isinstance(doc, dict) else None
    status = doc.get("status") if isinstance(doc, dict) else None
    return (json.dumps(doc, sort_keys=True), None if amount is None else float(amount), status)


def expected_rows(bodies: Iterable[bytes]) -> dict[str, Row]:
    """What a mirror of every event of ``bodies`` in order holds: key -> row."""
    state: dict[str, Change] = {}
    merge(state, changes(bodies))
    return {k: row_of(c.new) for k, c in state.items()}


@dataclass
class Comparison:
    """Two tables (key -> row) row for row."""

    left: int
    right: int
    only_left: list[str] = field(default_factory=list)
    only_right: list[str] = field(default_factory=list)
    differ: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not (self.only_left or self.only_right or self.differ)

    def describe(self, left: str, right: str) -> str:
        if self.equal:
            return f"equal: {self.left:,} keys, every row the same"

        def some(keys: list[str]) -> str:
            return ", ".join(sorted(keys)[:5]) + (" ..." if len(keys) > 5 else "")

        parts = [f"NOT equal ({self.left:,} keys in {left}, {self.right:,} in {right})"]
        if self.only_left:
            parts.append(f"{len(self.only_left):,} keys only in {left} ({some(self.only_left)})")
        if self.only_right:
            parts.append(f"{len(self.only_right):,} keys only in {right} ({some(self.only_right)})")
        if self.differ:
            parts.append(f"{len(self.differ):,} keys whose rows differ ({some(self.differ)})")
        return "; ".join(parts)


def compare(left: Mapping[str, Row], right: Mapping[str, Row]) -> Comparison:
    out = Comparison(len(left), len(right))
    for key, row in left.items():
        other = right.get(key)
        if other is None:
            out.only_left.append(key)
        elif other != row:
            out.differ.append(key)
    out.only_right = [k for k in right if k not in left]
    return out


def open_loop_plan(
    rate: float, duration_s: float, clients: int, per_request: int
) -> tuple[int, float]:
    """(requests, duration) for bench_mirror_fresh's ``open_loop`` such that
    each client sends the same number of requests and every body is sent once:
    client i sends bodies i, i + clients, ... (its shard) while its schedule is
    within the duration, which ends 1/16 of a period before the next round."""
    interval = clients * per_request / rate
    rounds = max(1, round(duration_s / interval))
    return rounds * clients, (rounds - 1 / (2 * clients)) * interval


# --------------------------------------------------------------------------
# Results


@dataclass
class SideResult:
    name: str
    keys: int = 0
    preload_s: float = 0.0
    warmup_s: float = 0.0
    events: int = 0  # the throughput run's
    seconds: float = 0.0  # first request to the last event visible
    cpu_s: float = 0.0
    merges: int = 0
    lat_events: int = 0
    lat_rate: float = 0.0
    ack_p99_s: float = 0.0
    p50_s: float = 0.0
    p99_s: float = 0.0
    max_s: float = 0.0
    lat_cpu_s: float = 0.0
    lat_merges: int = 0
    lat_wall_s: float = 0.0
    poll_ms: float = 0.0
    rows: int = 0
    gaps: int = 0  # the peer's MERGEs that left an earlier seq for a later one
    against_fold: str = ""
    load: str = ""
    error: str = ""

    @property
    def rate(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0

    @property
    def cpu_us(self) -> float:
        return self.cpu_s * 1e6 / self.events if self.events else 0.0

    @property
    def lat_cpu_us(self) -> float:
        return self.lat_cpu_s * 1e6 / self.lat_events if self.lat_events else 0.0


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def render(results: Sequence[SideResult], rate: float) -> str:
    """The table a person reads; each side's ratios are over the peer's (the
    aims: eventplane's events/s ratio >= 1.5, its p99 ratio <= 0.33)."""
    by = {r.name: r for r in results}
    peer = by.get("peer")
    base = peer if peer is not None and not peer.error else None
    head = (
        "| side | events/s | x peer | CPU s | CPU µs/event | freshness p50 s | p99 s "
        f"| p99 x peer | CPU µs/event at {rate:,.0f}/s | merges | merges at {rate:,.0f}/s |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in results:
        if r.error:
            lines.append(f"| {LABELS.get(r.name, r.name)} | failed: {r.error[:200]} |")
            continue
        ratio = _ratio(r.rate, base.rate) if base else math.nan
        fresh = _ratio(r.p99_s, base.p99_s) if base else math.nan
        lines.append(
            f"| {LABELS.get(r.name, r.name)} | {r.rate:,.0f} | {ratio:.2f} | {r.cpu_s:.1f} "
            f"| {r.cpu_us:.1f} | {r.p50_s:.2f} | {r.p99_s:.2f} | {fresh:.2f} "
            f"| {r.lat_cpu_us:.1f} | {r.merges} | {r.lat_merges} |"
        )
    return "\n".join(lines)


def verdict(results: Sequence[SideResult]) -> list[str]:
    """The aims, each with its figure and whether it is met."""
    by = {r.name: r for r in results}
    ep, peer = by.get("eventplane"), by.get("peer")
    if ep is None or peer is None or ep.error or peer.error:
        return ["aims: not judged (a side is missing or failed)"]
    through = _ratio(ep.rate, peer.rate)
    fresh = _ratio(ep.p99_s, peer.p99_s)
    met = {True: "met", False: "NOT met"}
    return [
        f"throughput: eventplane {ep.rate:,.0f} events/s, the peer {peer.rate:,.0f}: "
        f"{through:.2f}x (aim >= {THROUGHPUT_AIM}x): {met[through >= THROUGHPUT_AIM]}",
        f"freshness p99: eventplane {ep.p99_s:.2f} s, the peer {peer.p99_s:.2f} s: "
        f"{fresh:.2f}x (aim <= {FRESHNESS_AIM:.2f}x): {met[fresh <= FRESHNESS_AIM]}",
    ]


# --------------------------------------------------------------------------
# The peer's Spark job (its own driver process; bench_pipeline.spark_job drives it)


class MirrorJob:
    """Structured Streaming over the landing folder, foreachBatch MERGE INTO the mirror."""

    def __init__(self, spark: Any, directory: Path) -> None:
        from pyspark.sql.types import DoubleType, LongType, StringType, StructField, StructType

        self.spark, self.dir = spark, directory
        self.table = directory / "mirror"
        self.query: Any = None
        columns = [("key", StringType()), ("seq", LongType()), ("op", StringType())]
        columns += [("doc", StringType()), ("amount", DoubleType()), ("status", StringType())]
        schema = StructType([StructField(n, t) for n, t in columns])
        spark.createDataFrame([], schema).write.format("delta").mode("ignore").save(str(self.table))

    def _upsert(self, df: Any, batch_id: int) -> None:
        from pyspark.sql import functions as F

        session = df.sparkSession
        df = df.persist()
        try:
            first, last, count = df.agg(F.min("seq"), F.max("seq"), F.count("*")).first()
            if not count:
                return
            latest = (
                df.groupBy("key")
                .agg(F.max(F.struct("seq", "op", "new")).alias("c"))
                .select("key", "c.seq", "c.op", F.col("c.new").alias("doc"))
                .withColumn("amount", F.get_json_object("doc", "$.amount").cast("double"))
                .withColumn("status", F.get_json_object("doc", "$.status"))
            )
            latest.createOrReplaceTempView("peer_batch")
            meta = {"peer": {"batch": batch_id, "first": first, "last": last, "events": count}}
            session.conf.set(USER_METADATA, json.dumps(meta, separators=(",", ":")))
            session.sql(
                f"MERGE INTO delta.`{self.table}` AS t USING peer_batch AS s ON t.key = s.key "
                "WHEN MATCHED AND s.seq > t.seq AND s.op = 'delete' THEN DELETE "
                "WHEN MATCHED AND s.seq > t.seq THEN UPDATE SET * "
                "WHEN NOT MATCHED AND s.op <> 'delete' THEN INSERT *"
            )
        finally:
            df.unpersist()

    def stream(self, interval_ms: int) -> None:
        from pyspark.sql.types import LongType, StringType, StructField, StructType

        # A JSON object read with a string schema keeps its raw text.
        names = ("collection", "op", "key", "new", "old")
        schema = StructType(
            [StructField("seq", LongType())] + [StructField(n, StringType()) for n in names]
        )
        self.query = (
            self.spark.readStream.schema(schema)
            .json(str(self.dir / "landing"))
            .writeStream.foreachBatch(self._upsert)
            .option("checkpointLocation", str(self.dir / "checkpoint"))
            .trigger(processingTime=f"{interval_ms} milliseconds")
            .start()
        )

    def drain(self) -> None:
        raise RuntimeError("the mirror peer only streams")

    def stop(self) -> None:
        if self.query is not None:
            query, self.query = self.query, None
            query.stop()
            if query.exception() is not None:
                raise RuntimeError(f"streaming query failed: {query.exception()}")


# --------------------------------------------------------------------------
# The sides


class PeerWatcher(Watcher):
    """bench_mirror_fresh's Watcher on the peer's table. Each MERGE's
    ``userMetadata`` says its batch's first and last seq and its event count;
    every seq is landed once and merged in one batch, so once the counts of the
    MERGEs seen add up to the highest seq seen, every seq up to it is in the
    table. A batch that skipped a file (a listing that missed a rename) leaves
    the coverage where it was until the batch that takes the file; ``gaps``
    counts such MERGEs."""

    def __init__(self, path: Path, poll_s: float) -> None:
        super().__init__(path, poll_s)
        self.gaps = 0
        self.merged = 0  # events in the MERGEs seen
        self.top = 0  # the highest seq in them

    def last_of(self, meta: str) -> int:
        doc = json.loads(meta)["peer"]
        self.merged += int(doc["events"])
        self.top = max(self.top, int(doc["last"]))
        if self.merged == self.top:
            return self.top
        self.gaps += 1
        return self.covered


class EventplaneSide:
    name = "eventplane"

    def __init__(self, root: Path, args: argparse.Namespace) -> None:
        self.daemon = Daemon(root, args.interval_ms, args.merge_interval_ms)
        self.url = self.daemon.url
        self.mirror = self.daemon.mirror
        self.watcher = Watcher(self.mirror, args.poll_ms / 1e3)

    def cpu(self) -> float:
        return tree_cpu(self.daemon.proc.pid)

    def rows(self) -> dict[str, Row]:
        return read_rows(self.mirror)

    def stop(self) -> None:
        self.daemon.stop()


class PeerSide:
    name = "peer"

    def __init__(self, root: Path, args: argparse.Namespace) -> None:
        self.dir = root / f"peer-{time.monotonic_ns()}"
        self.server = ServerProc(
            "landing", self.dir, ["--rotate-ms", str(args.rotate_ms)], module=MODULE
        )
        self.url = f"{self.server.url}/v1/events"
        self.spark: SparkDriver | None = None
        try:
            self.spark = SparkDriver("mirror", self.dir, args.master, [], module=MODULE)
            self.spark.command(f"stream {args.interval_ms}", "streaming")
        except Exception:
            self.stop()
            raise
        self.mirror = self.dir / "mirror"
        self.watcher = PeerWatcher(self.mirror, args.poll_ms / 1e3)

    def cpu(self) -> float:
        assert self.spark is not None
        return tree_cpu(self.server.proc.pid) + tree_cpu(self.spark.proc.pid)

    def rows(self) -> dict[str, Row]:
        return read_rows(self.mirror)

    def stop(self) -> None:
        if self.spark is not None:
            try:
                self.spark.command("stop", "stopped")
            finally:
                self.spark.stop()
        self.server.stop()


def read_rows(path: Path) -> dict[str, Row]:
    """A mirror table's current rows (delta-rs): key -> row."""
    from deltalake import DeltaTable

    t = DeltaTable(str(path)).to_pyarrow_table(columns=["key", "doc", "amount", "status"])
    out: dict[str, Row] = {}
    for key, doc, amount, status in zip(
        *(t.column(c).to_pylist() for c in ("key", "doc", "amount", "status")), strict=True
    ):
        canonical = json.dumps(json.loads(doc), sort_keys=True)
        out[key] = (canonical, amount, status)
    return out


async def closed_loop(url: str, bodies: Sequence[bytes], clients: int) -> tuple[int, int]:
    """Client i posts bodies i, i + clients, ... in turn, each after the last's
    2xx: (events acknowledged, the highest last LSN)."""
    import aiohttp

    done = {"events": 0, "lsn": 0}

    async def producer(i: int) -> None:
        async with aiohttp.ClientSession() as session:
            for body in bodies[i::clients]:
                n, lsn = await _post(session, url, body)
                done["events"] += n
                done["lsn"] = max(done["lsn"], lsn)

    await asyncio.gather(*(producer(i) for i in range(clients)))
    return done["events"], done["lsn"]


@dataclass
class Plan:
    keys: int
    preload: list[bytes]
    warmup: list[list[bytes]]  # parts, each posted then waited for
    run: list[bytes]
    lat: list[bytes]
    lat_duration_s: float

    def all_bodies(self) -> list[bytes]:
        return self.preload + [b for part in self.warmup for b in part] + self.run + self.lat


def make_plan(args: argparse.Namespace) -> Plan:
    keys = args.keys - args.keys % args.clients  # a whole number of keys per shard
    warm_requests = math.ceil(args.warmup_events / args.per_request)
    warm_requests += -warm_requests % args.clients
    warm, next_key = change_bodies(
        keys, False, warm_requests, args.per_request, 47, keys, shards=args.clients
    )
    parts = max(1, args.warmup_parts)
    cut = [round(len(warm) * i / parts / args.clients) * args.clients for i in range(parts + 1)]
    warmup = [warm[cut[i] : cut[i + 1]] for i in range(parts) if cut[i + 1] > cut[i]]
    requests = math.ceil(args.events / args.per_request)
    requests += -requests % args.clients
    run, next_key = change_bodies(
        keys,
        False,
        requests,
        args.per_request,
        45,
        next_key,
        shards=args.clients,
        first_n=warm_requests * args.per_request,
    )
    lat_requests, lat_duration = open_loop_plan(
        args.rate, args.duration, args.clients, LATENCY_REQUEST_EVENTS
    )
    lat, _ = change_bodies(
        keys,
        False,
        lat_requests,
        LATENCY_REQUEST_EVENTS,
        46,
        next_key,
        shards=args.clients,
        first_n=(warm_requests + requests) * args.per_request,
    )
    return Plan(keys, preload_bodies(keys), warmup, run, lat, lat_duration)


def run_side(side: EventplaneSide | PeerSide, plan: Plan, args: argparse.Namespace) -> SideResult:
    w = side.watcher
    w.start()
    r = SideResult(side.name, keys=plan.keys)
    try:
        t0 = time.monotonic()
        last = asyncio.run(preload(side, plan.preload))
        wait_covered(w, last, timeout_s=args.timeout)
        r.preload_s = time.monotonic() - t0
        say(f"{side.name}: preloaded {plan.keys:,} keys in {r.preload_s:.1f} s")
        t0 = time.monotonic()
        for part in plan.warmup:
            _, last = asyncio.run(closed_loop(side.url, part, args.clients))
            wait_covered(w, last, timeout_s=args.timeout)
        r.warmup_s = time.monotonic() - t0
        say(f"{side.name}: warmed up in {r.warmup_s:.1f} s ({len(plan.warmup)} parts)")

        merges0 = len(w.commits)
        cpu0, t0 = side.cpu(), time.monotonic()
        r.events, last = asyncio.run(closed_loop(side.url, plan.run, args.clients))
        acked = time.monotonic()
        wait_covered(w, last, timeout_s=args.timeout)
        r.seconds = next(t for t, lsn in w.commits[merges0:] if lsn >= last) - t0
        r.cpu_s = side.cpu() - cpu0
        r.merges = len(w.commits) - merges0
        say(
            f"{side.name}: {r.events:,} changes acknowledged in {acked - t0:.1f} s, "
            f"visible after {r.seconds:.1f} s ({r.rate:,.0f} events/s, {r.merges} merges)"
        )

        merges0 = len(w.commits)
        w.reset_polls()
        cpu0, t0 = side.cpu(), time.monotonic()
        acks, latencies, elapsed, r.lat_events = asyncio.run(
            open_loop(side, plan.lat, args.rate, plan.lat_duration_s, args.clients)
        )
        wait_covered(w, max(lsn for _, lsn in acks), timeout_s=args.timeout)
        r.lat_cpu_s = side.cpu() - cpu0
        r.lat_wall_s = time.monotonic() - t0
        r.poll_ms = w.poll_period_ms()
        commits = w.commits[merges0:]
        r.lat_merges = len(commits)
        fresh = freshness(acks, commits)
        latencies.sort()
        r.lat_rate = r.lat_events / elapsed
        r.ack_p99_s = _q(latencies, 0.99)
        r.p50_s, r.p99_s, r.max_s = _q(fresh, 0.5), _q(fresh, 0.99), fresh[-1]
        say(
            f"{side.name}: open loop {r.lat_rate:,.0f} events/s, freshness p50 {r.p50_s:.2f} s "
            f"p99 {r.p99_s:.2f} s max {r.max_s:.2f} s ({r.lat_merges} merges, "
            f"poll {r.poll_ms:.1f} ms)"
        )
        if isinstance(w, PeerWatcher):
            r.gaps = w.gaps
        r.load = load_average()
    finally:
        w.stop()
    return r


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=f"python -m {MODULE}", description=(__doc__ or "").splitlines()[0]
    )
    p.add_argument("--keys", type=int, default=100_000, help="keys preloaded (100000)")
    p.add_argument("--events", type=int, default=1_000_000, help="throughput run (1000000)")
    p.add_argument("--per-request", type=int, default=1000, help="throughput run (1000)")
    p.add_argument(
        "--warmup-events", type=int, default=200_000, help="untimed, after the preload (200000)"
    )
    p.add_argument(
        "--warmup-parts", type=int, default=4, help="the warm-up in parts each waited for (4)"
    )
    p.add_argument("--clients", type=int, default=8, help="producers (8)")
    p.add_argument("--rate", type=float, default=20_000, help="freshness run events/s (20000)")
    p.add_argument("--duration", type=float, default=20.0, help="freshness run s (20)")
    p.add_argument(
        "--interval-ms",
        type=int,
        default=1000,
        help="the daemon's microbatch.interval_ms and the peer's processingTime trigger (1000)",
    )
    p.add_argument(
        "--merge-interval-ms", type=int, default=0, help="the daemon mirror's (0: every batch)"
    )
    p.add_argument("--rotate-ms", type=int, default=100, help="landing file rotation (100)")
    p.add_argument("--poll-ms", type=float, default=10.0, help="the readers' poll (10)")
    p.add_argument("--sides", default=",".join(SIDES), help="in this order (eventplane,peer)")
    p.add_argument("--master", default="local[*]")
    p.add_argument("--timeout", type=float, default=900.0, help="wait for visibility (900 s)")
    p.add_argument("--json", type=Path, help="also write the results here")
    # Internal: the subprocesses.
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--spark", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--port-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return serve(args, SeqLander)
    if args.spark:
        args.format = "delta"
        return spark_job(args, lambda spark: MirrorJob(spark, Path(args.dir)))

    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if [s for s in sides if s not in SIDES]:
        p.error(f"--sides: choose from {', '.join(SIDES)}")
    if "peer" in sides:
        from daemon.spark import deltajars

        missing = deltajars.missing()
        if missing:
            p.exit(2, deltajars.missing_message(missing) + "\n")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    print(f"command: python -m {MODULE} {' '.join(argv if argv is not None else sys.argv[1:])}")
    load_before = load_average()
    print(f"machine: {os.cpu_count()} CPUs, load average {load_before} at the start", flush=True)
    plan = make_plan(args)
    say(f"expected final table: folding {len(plan.all_bodies()):,} bodies ...")
    expected = expected_rows(plan.all_bodies())
    root = Path(tempfile.mkdtemp(prefix="bench-mirror-peer-"))
    results: list[SideResult] = []
    tables: dict[str, dict[str, Row]] = {}
    try:
        for name in sides:
            say(f"{name}: starting ...")
            side: EventplaneSide | PeerSide | None = None
            try:
                side = EventplaneSide(root, args) if name == "eventplane" else PeerSide(root, args)
                r = run_side(side, plan, args)
                try:
                    tables[name] = side.rows()
                except Exception as exc:  # the figures stand; the comparison is missing
                    r.against_fold = f"NOT compared, the table was not read: {exc}"
                else:
                    r.rows = len(tables[name])
                    r.against_fold = compare(tables[name], expected).describe(name, "the fold")
            except Exception as exc:  # one side failing is reported, the other still runs
                say(f"{name} failed: {type(exc).__name__}: {exc}")
                r = SideResult(name, error=f"{type(exc).__name__}: {exc}")
            finally:
                if side is not None:
                    side.stop()
            results.append(r)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load_after = load_average()

    print(
        f"\n{plan.keys:,} keys preloaded, {sum(map(len, plan.warmup)) * args.per_request:,} "
        f"changes of warm-up in {len(plan.warmup)} parts (untimed); throughput: "
        f"{len(plan.run) * args.per_request:,} changes, {args.clients} clients closed loop, "
        f"{args.per_request} per request; "
        f"freshness: {args.rate:,.0f} events/s open loop for {plan.lat_duration_s:.1f} s; "
        f"interval_ms = processingTime = {args.interval_ms}, merge_interval_ms = "
        f"{args.merge_interval_ms}, landing rotation {args.rotate_ms} ms\n"
    )
    print(render(results, args.rate))
    print()
    for line in verdict(results):
        print(line)
    for r in results:
        if not r.error:
            print(f"{r.name}'s table against the fold of the bodies in order: {r.against_fold}")
    if len(tables) == 2:
        both = compare(tables["eventplane"], tables["peer"])
        print(f"eventplane's table against the peer's: {both.describe('eventplane', 'the peer')}")
    for r in results:
        if not r.error:
            print(
                f"{r.name}: preload {r.preload_s:.1f} s, warm-up {r.warmup_s:.1f} s; "
                f"freshness run {r.lat_rate:,.0f} events/s, "
                f"ack p99 {r.ack_p99_s * 1e3:.0f} ms, max {r.max_s:.2f} s, CPU {r.lat_cpu_s:.1f} s "
                f"over {r.lat_wall_s:.1f} s, poll {r.poll_ms:.1f} ms; {r.rows:,} rows; "
                f"{r.gaps} MERGEs with a gap; load {r.load} after"
            )
    print(f"load average before: {load_before}; after: {load_after}")
    if args.json:
        doc = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "load_average": {"before": load_before, "after": load_after},
            "sides": [
                {**r.__dict__, "rate": r.rate, "cpu_us": r.cpu_us, "lat_cpu_us": r.lat_cpu_us}
                for r in results
            ],
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    equal = len(tables) == 2 and compare(tables["eventplane"], tables["peer"]).equal
    failed = any(r.error for r in results)
    return 1 if failed or (len(sides) == 2 and not equal) else 0


if __name__ == "__main__":
    sys.exit(main())
