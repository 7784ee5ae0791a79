"""End-to-end trigger benchmark: the whole daemon against a Structured Streaming job, same run.

``python -m bench.bench_triggers --e2e [--seconds S] [--rate R] [--interval-ms MS]``

- **eventplane**: ``eventplane run`` in a subprocess (HTTP ingest with fsync
  "always" -> WAL -> rings/consumers -> planner -> Spark executor -> trigger
  engine -> webhook), embedded local Spark, the shipped micro-batch interval,
  one webhook trigger (``new:amount::double > 1000``, exactly 10 % of the
  events) pointing at a loopback aiohttp receiver in this process (its own
  thread and event loop). No CDC stream unless ``--cdc`` (the CDC commit runs
  before the triggers in each batch and would add its time to theirs).
- **peer**: what a Spark user writes instead, in its own subprocess too:
  producers land NDJSON files (write, fsync, rename: durable like the ack),
  ``readStream.json`` with a schema, ``trigger(processingTime=<interval>)``,
  ``foreachBatch``: ``parse_json`` of ``new``, the same filter, ``to_json`` +
  ``collect()``, one keep-alive ``http.client`` POST per 1024 rows to the same
  receiver.

Two runs per side, one side after the other (never both at once: the box has
few cores):

1. **latency**: an open-loop producer at ``--rate`` events/s, requests (or
   files) of ``--request-events`` on a fixed schedule, ``--warmup-seconds``
   unmeasured then ``--seconds`` measured. Every event has a unique key
   (``e<id>``); the receiver notes when each matched row arrives. Latency is
   from the request's *scheduled* send time (so a producer that falls behind
   cannot hide it) to the row's arrival; ack (land) latency likewise.
2. **max sustained**: ``--clients`` closed-loop producers, requests (files) of
   1000 events, as fast as they are taken for ``--max-seconds``; then the
   bench waits for every matched row. Reported: events/s acknowledged, and
   events/s *processed* = events / (first send -> last matched row received),
   the rate at which the trigger keeps up.

For the daemon's latency run the bench also explains where the time goes: the
daemon runs with ``log.level = "debug"`` (its executor logs each batch's
duration and Spark time), ``/v1/status`` is polled for the planner's batch
durations (close -> commit), and ``/metrics`` is scraped before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from bench.common import HookServer, post_events

TRIGGER = "big-orders"
COLLECTION = "orders"
WHEN = "new:amount::double > 1000"
# Event n matches iff n % MATCH_EVERY == 0: exactly 10 % of the events.
MATCH_EVERY = 10
# Requests (files) of the closed-loop max run: bench_cdc's end-to-end size.
MAX_REQUEST_EVENTS = 1000
# Distinct bodies the max run cycles through (built before the clock starts).
POOL_BODIES = 64
# Rows per webhook call: the engine's default batch_size, used by the peer too.
ROWS_PER_CALL = 1024
STATUS_POLL_S = 0.025
WAIT_POLL_S = 0.02
# Spark conf of both sides: the shipped config.toml's [spark.conf].
SPARK_CONF = {"spark.sql.shuffle.partitions": "4"}
# Keys of different runs never collide: run k uses ids from k * RUN_ID_SPAN.
RUN_ID_SPAN = 1_000_000_000


# --------------------------------------------------------------------------
# Events


def matches(n: int) -> bool:
    return n % MATCH_EVERY == 0


def event_line(n: int) -> bytes:
    """One ~170-byte producer event; ``amount`` > 1000 exactly when ``matches(n)``."""
    amount = 1000 + n % 9000 + 1 if matches(n) else n % 1000
    return (
        b'{"collection":"orders","op":"%s","key":"e%d","new":{"id":%d,"amount":%d,'
        b'"customer":"c%d","items":%d,"note":"%s"},"old":null}\n'
        % (b"insert" if n % 3 else b"update", n, n, amount, n % 10_000, n % 7 + 1, b"x" * 40)
    )


def ndjson(first: int, count: int) -> bytes:
    return b"".join(event_line(n) for n in range(first, first + count))


def key_id(key: str) -> int:
    return int(key[1:])


# --------------------------------------------------------------------------
# Receiver: every row's arrival time


class _RowId(msgspec.Struct):
    key: str
    lsn: int = -1
    batch_id: int = -1


class _Hook(msgspec.Struct):
    rows: list[_RowId]


_hook_decoder = msgspec.json.Decoder(_Hook)


@dataclass
class Arrivals:
    """Rows received, in arrival order: wall time, event id, LSN (-1 for the peer), batch id."""

    times: list[float] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    lsns: list[int] = field(default_factory=list)
    batches: list[int] = field(default_factory=list)

    def first_by_id(self) -> dict[int, tuple[float, int]]:
        """Event id -> (first arrival, batch id); repeats (at least once) are ignored."""
        out: dict[int, tuple[float, int]] = {}
        for t, i, b in zip(self.times, self.ids, self.batches, strict=True):
            out.setdefault(i, (t, b))
        return out


class RowReceiver(HookServer):
    """The loopback receiver (``bench.common.HookServer``), answering 200 at once;
    notes each row's arrival."""

    def __init__(self) -> None:
        super().__init__()
        self._got = Arrivals()
        self._lock = threading.Lock()

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        now = time.time()
        rows = _hook_decoder.decode(body).rows
        with self._lock:
            got = self._got
            got.times.extend([now] * len(rows))
            got.ids.extend(key_id(r.key) for r in rows)
            got.lsns.extend(r.lsn for r in rows)
            got.batches.extend(r.batch_id for r in rows)
        return web.Response(text="ok")

    def count(self) -> int:
        return len(self._got.times)

    def take(self) -> Arrivals:
        """Everything received since the last take."""
        with self._lock:
            got, self._got = self._got, Arrivals()
        return got

    def peek(self) -> Arrivals:
        with self._lock:
            g = self._got
            return Arrivals(list(g.times), list(g.ids), list(g.lsns), list(g.batches))


# --------------------------------------------------------------------------
# What the producers did


@dataclass
class Sent:
    """One request (file): scheduled send time, actual send, ack (landed), first event id."""

    due: float
    first_id: int
    count: int
    sent: float = 0.0
    acked: float = 0.0
    first_lsn: int = -1


@dataclass
class LatencyRun:
    side: str
    rate: int
    seconds: float
    sent: list[Sent]
    arrivals: Arrivals
    warmup: int  # the first ``warmup`` requests are not measured
    missing: int = 0  # matched rows of measured requests that never arrived

    def measured(self) -> list[Sent]:
        return self.sent[self.warmup :]

    def row_latencies(self) -> list[tuple[float, Sent, float, int]]:
        """(latency s, request, arrival, batch id) per matched row of the measured requests."""
        seen = self.arrivals.first_by_id()
        out = []
        for s in self.measured():
            for n in range(s.first_id, s.first_id + s.count):
                if matches(n) and n in seen:
                    t, b = seen[n]
                    out.append((t - s.due, s, t, b))
        return out

    def acks(self) -> list[float]:
        return [s.acked - s.due for s in self.measured()]


@dataclass
class MaxRun:
    side: str
    clients: int
    events: int  # acknowledged (landed)
    matched: int  # matched rows expected (= received, or the run failed)
    started: float
    acked_until: float  # last ack of the producers
    done: float  # last matched row received
    duplicates: int = 0

    @property
    def ingest_rate(self) -> float:
        return self.events / (self.acked_until - self.started)

    @property
    def processed_rate(self) -> float:
        return self.events / (self.done - self.started)

    @property
    def matched_rate(self) -> float:
        return self.matched / (self.done - self.started)


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _schedule(rate: int, seconds: float, request_events: int) -> tuple[int, float]:
    """(requests, period s) of an open-loop run."""
    return max(1, round(rate * seconds / request_events)), request_events / rate


def warmup_requests(args: argparse.Namespace) -> int:
    """Requests (files) of the latency run's warm-up: the first ones sent."""
    return round(int(args.rate) * float(args.warmup_seconds) / int(args.request_events))


def expected_ids(sent: Iterable[Sent]) -> set[int]:
    return {n for s in sent for n in range(s.first_id, s.first_id + s.count) if matches(n)}


def wait_for_ids(
    receiver: RowReceiver, want: set[int], timeout_s: float, alive: Callable[[], None]
) -> int:
    """Wait until every id in ``want`` arrived; returns how many never did."""
    deadline = time.monotonic() + timeout_s
    missing = set(want)
    done = 0
    while missing and time.monotonic() < deadline:
        alive()
        got = receiver.peek().ids
        missing.difference_update(got[done:])
        done = len(got)
        if missing:
            time.sleep(0.1)
    return len(missing)


# --------------------------------------------------------------------------
# The daemon


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class DaemonProc:
    proc: subprocess.Popen[bytes]
    ingest: str
    admin: str
    log: Path

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise SystemExit(f"daemon exited with {self.proc.returncode}:\n{self.tail()}")

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"{self.admin}{path}", timeout=5) as r:
            return bytes(r.read())


def daemon_config(
    root: Path, master: str, interval_ms: int, hook_url: str, cdc: bool
) -> tuple[Path, str, str]:
    ingest, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    spark_conf = "\n".join(f'"{k}" = "{v}"' for k, v in SPARK_CONF.items())
    cdc_stream = '[[cdc.streams]]\nname = "all"\ncollections = "*"\npath = "cdc"\n' if cdc else ""
    config = root / "config.toml"
    config.write_text(f"""
[daemon]
data_dir = "data"
[ingest]
listen = "{ingest}"
[admin]
listen = "{admin}"
[wal]
fsync = "always"
[spark]
master = "{master}"
log_level = "ERROR"
[spark.conf]
{spark_conf}
[microbatch]
interval_ms = {interval_ms}
[log]
# debug: the executor logs each batch's duration and Spark time (a few lines a batch)
level = "debug"
format = "json"
{cdc_stream}
[[triggers]]
name = "{TRIGGER}"
collection = "{COLLECTION}"
on = ["insert", "update"]
when = "{WHEN}"
action = {{ type = "webhook", url = "{hook_url}" }}
""")
    return config, f"http://{ingest}", f"http://{admin}"


def start_daemon(
    root: Path,
    master: str,
    interval_ms: int,
    hook_url: str,
    cdc: bool,
    timeout_s: float = 300,
    src: Path | None = None,
) -> DaemonProc:
    """``src``: run the daemon package of that source tree (``--baseline``; its
    folder is the process's working directory, first on ``sys.path``)."""
    root.mkdir(parents=True)
    config, ingest, admin = daemon_config(root, master, interval_ms, hook_url, cdc)
    log = root / "daemon.log"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    env.pop("NOTIFY_SOCKET", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.cli.main", "run", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=src,
        )
    d = DaemonProc(proc, ingest, admin, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        d.check()
        try:
            status = json.loads(d.get("/v1/status"))
            validated = "triggers_validated" in log.read_text(errors="replace")
            if status.get("spark", {}).get("ready") and validated:
                return d
        except OSError:
            pass
        time.sleep(0.5)
    stop_process(proc)
    raise SystemExit(f"daemon's Spark not ready after {timeout_s:.0f} s:\n{d.tail()}")


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


async def paced_requests(
    ingest: str, rate: int, seconds: float, request_events: int, first_id: int
) -> list[Sent]:
    """Open loop: one request of ``request_events`` every period, whatever the answers do."""
    n, period = _schedule(rate, seconds, request_events)
    sent: list[Sent] = []
    tasks: list[asyncio.Task[None]] = []

    async def one(session: aiohttp.ClientSession, data: bytes, s: Sent) -> None:
        s.sent = time.time()
        ack = await post_events(session, ingest, data)
        s.acked = time.time()
        s.first_lsn = int(ack["first_lsn"])

    connector = aiohttp.TCPConnector(limit=128)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.time() + 0.2
        for i in range(n):
            first = first_id + i * request_events
            data = ndjson(first, request_events)  # built before its slot, not in it
            s = Sent(t0 + i * period, first, request_events)
            delay = s.due - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            sent.append(s)
            tasks.append(asyncio.create_task(one(session, data, s)))
        await asyncio.gather(*tasks)
    return sent


def body_pool(first_id: int) -> list[bytes]:
    return [
        ndjson(first_id + p * MAX_REQUEST_EVENTS, MAX_REQUEST_EVENTS) for p in range(POOL_BODIES)
    ]


# Offsets of the matched events inside every pool body (the same in each: 1000 % 10 == 0).
def _pool_offsets(first_id: int) -> list[int]:
    return [j for j in range(MAX_REQUEST_EVENTS) if matches(first_id + j)]


async def closed_loop_requests(
    ingest: str, clients: int, seconds: float, pool: Sequence[bytes]
) -> tuple[float, float, list[int]]:
    """(start, last ack, first LSN of every acknowledged request)."""
    firsts: list[int] = []
    stop_at = 0.0

    async def producer(session: aiohttp.ClientSession, k: int) -> None:
        i = k
        while time.time() < stop_at:
            ack = await post_events(session, ingest, pool[i % len(pool)])
            firsts.append(int(ack["first_lsn"]))
            i += clients

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.time()
        stop_at = started + seconds
        await asyncio.gather(*(producer(session, k) for k in range(clients)))
        return started, time.time(), firsts


class StatusPoller(threading.Thread):
    """Polls ``/v1/status``: the planner's close -> commit time per batch, and the lag."""

    def __init__(self, d: DaemonProc) -> None:
        super().__init__(name="bench-status", daemon=True)
        self.d = d
        self.planner_s: dict[int, float] = {}
        self.max_lag = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(STATUS_POLL_S):
            try:
                st = json.loads(self.d.get("/v1/status"))
            except (OSError, ValueError):
                continue
            last = st.get("last_batch") or {}
            if last.get("state") == "committed" and last.get("duration_s") is not None:
                self.planner_s[int(last["batch_id"])] = float(last["duration_s"])
            lags = [int(c.get("lag") or 0) for c in st.get("cores", [])]
            self.max_lag = max([self.max_lag, *lags])

    def stop(self) -> None:
        self._halt.set()
        self.join(5)


@dataclass
class BatchTimes:
    """One batch as the daemon's logs and status tell it (wall-clock seconds)."""

    batch_id: int
    rows: int
    exec_end: float  # executor: execute() returned (triggers' finish done)
    exec_s: float  # executor: whole execute()
    spark_s: float  # executor: the Spark-thread part (inbox file, trigger job, collect)
    planner_s: float | None = None  # planner: close -> commit, when /v1/status caught it
    # executor: run start -> the trigger stage's result ready (its calls start);
    # None from a daemon that does not log it (it then called after spark_s).
    ready_s: float | None = None

    @property
    def exec_start(self) -> float:
        return self.exec_end - self.exec_s

    @property
    def trigger_s(self) -> float:
        """Run start -> the webhook calls start."""
        return self.spark_s if self.ready_s is None else self.ready_s

    @property
    def spark_end(self) -> float:
        return self.exec_start + self.trigger_s


def _ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def batch_times(log: Path, planner_s: Mapping[int, float]) -> dict[int, BatchTimes]:
    """Per batch id, from the executor's JSON debug lines and the polled planner durations."""
    out: dict[int, BatchTimes] = {}
    for line in log.read_text(errors="replace").splitlines():
        if '"microbatch_committed"' not in line or '"spark_seconds"' not in line:
            continue  # the planner logs the same event without timings
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        bid = int(doc["batch_id"])
        out[bid] = BatchTimes(
            bid,
            int(doc.get("rows", 0)),
            _ts(doc["timestamp"]),
            float(doc["seconds"]),
            float(doc["spark_seconds"]),
            planner_s.get(bid),
            (doc.get("stage_ready_seconds") or {}).get("triggers"),
        )
    return out


HISTOGRAMS = (
    "eventplane_ingest_ack_latency_seconds",
    "eventplane_wal_fsync_duration_seconds",
    "eventplane_microbatch_duration_seconds",
    "eventplane_trigger_action_duration_seconds",
)


def scrape(d: DaemonProc) -> dict[str, float]:
    """Sums and counts of the histograms in ``HISTOGRAMS``, summed over label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(d.get("/metrics").decode()):
        for s in family.samples:
            base = s.name.removesuffix("_sum").removesuffix("_count")
            if base in HISTOGRAMS and base != s.name:
                out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


@dataclass
class Breakdown:
    """Per matched row of the measured window, where its ingest -> received time went (ms)."""

    parts: dict[str, list[float]]
    rows: int
    batches: int
    batch_rows: list[int]
    period_ms: list[float]  # Spark job start -> next start
    exec_ms: list[float]  # executor per batch
    plan_ms: list[float]  # planner close -> commit minus executor: plan fsync + hand-over
    metrics: dict[str, float]  # mean ms per observation over the window
    max_lag: int


def breakdown(
    run: LatencyRun,
    batches: Mapping[int, BatchTimes],
    metrics_delta: Mapping[str, float],
    max_lag: int,
) -> Breakdown:
    parts: dict[str, list[float]] = {
        "ack: HTTP + WAL group commit + fsync": [],
        "ack -> batch runs: waiting for the batch to close, plan fsync, previous batch": [],
        "Spark until the trigger's result: inbox file + trigger job + collect": [],
        "trigger's result -> row received: webhook POSTs": [],
    }
    keys = list(parts)
    used: set[int] = set()
    for _lat, s, arrived, bid in run.row_latencies():
        b = batches.get(bid)
        if b is None:
            continue
        used.add(bid)
        values = (s.acked - s.due, b.exec_start - s.acked, b.trigger_s, arrived - b.spark_end)
        for k, v in zip(keys, values, strict=True):
            parts[k].append(v * 1000)
    mine = [batches[b] for b in sorted(used)]
    starts = [b.exec_start for b in mine]
    mean: dict[str, float] = {}
    for name in HISTOGRAMS:
        n = metrics_delta.get(name + "_count", 0.0)
        if n:
            mean[name] = metrics_delta.get(name + "_sum", 0.0) / n * 1000
    return Breakdown(
        parts,
        len(parts[keys[0]]),
        len(mine),
        [b.rows for b in mine],
        [(b - a) * 1000 for a, b in itertools.pairwise(starts)],
        [b.exec_s * 1000 for b in mine],
        [(b.planner_s - b.exec_s) * 1000 for b in mine if b.planner_s is not None],
        mean,
        max_lag,
    )


def run_daemon_side(
    root: Path,
    args: argparse.Namespace,
    receiver: RowReceiver,
    src: Path | None = None,
    cpu: dict[str, float] | None = None,
) -> tuple[LatencyRun | None, MaxRun | None, Breakdown | None]:
    """The daemon's runs. ``src``: the daemon of that source tree (``--baseline``);
    ``cpu`` gets the daemon's CPU-seconds (its process tree) over the measured window."""
    from bench.bench_pipeline import tree_cpu

    side = "baseline" if src is not None else "eventplane"
    print(f"{side}: starting the daemon (Spark boots in it) ...", file=sys.stderr, flush=True)
    d = start_daemon(root, args.master, args.interval_ms, receiver.url, args.cdc, src=src)
    latency = maxrun = explained = None
    try:
        if not args.skip_latency:
            receiver.take()
            poller = StatusPoller(d)
            poller.start()
            total = args.warmup_seconds + args.seconds
            print(
                f"{side}: {args.rate:,} events/s for {total:g} s "
                f"({args.warmup_seconds:g} s warm-up) ...",
                file=sys.stderr,
                flush=True,
            )
            before: dict[str, float] = {}
            t_measure = time.time() + args.warmup_seconds + 0.2

            async def paced() -> list[Sent]:
                task = asyncio.create_task(
                    paced_requests(d.ingest, args.rate, total, args.request_events, RUN_ID_SPAN)
                )
                await asyncio.sleep(max(0.0, t_measure - time.time()))
                before.update(await asyncio.to_thread(scrape, d))
                cpu_start = tree_cpu(d.proc.pid)
                sent = await task
                if cpu is not None:
                    cpu["latency_cpu_s"] = tree_cpu(d.proc.pid) - cpu_start
                return sent

            sent = asyncio.run(paced())
            missing = wait_for_ids(receiver, expected_ids(sent), args.drain_timeout, d.check)
            after = scrape(d)
            poller.stop()
            warm = warmup_requests(args)
            got = receiver.take()
            latency = LatencyRun(side, args.rate, args.seconds, sent, got, warm, missing)
            delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
            explained = breakdown(
                latency, batch_times(d.log, poller.planner_s), delta, poller.max_lag
            )
        if not args.skip_max:
            maxrun = daemon_max_run(d, args, receiver)
    finally:
        stop_process(d.proc)
    return latency, maxrun, explained


def daemon_max_run(d: DaemonProc, args: argparse.Namespace, receiver: RowReceiver) -> MaxRun:
    first_id = 2 * RUN_ID_SPAN
    pool = body_pool(first_id)
    offsets = _pool_offsets(first_id)
    receiver.take()
    print(
        f"eventplane: {args.clients} closed-loop producers for {args.max_seconds:g} s ...",
        file=sys.stderr,
        flush=True,
    )
    started, acked_until, firsts = asyncio.run(
        closed_loop_requests(d.ingest, args.clients, args.max_seconds, pool)
    )
    events = len(firsts) * MAX_REQUEST_EVENTS
    want = {f + j for f in firsts for j in offsets}
    print(
        f"eventplane: {events:,} events acknowledged in {acked_until - started:.1f} s; "
        f"waiting for {len(want):,} matched rows ...",
        file=sys.stderr,
        flush=True,
    )
    deadline = time.monotonic() + args.drain_timeout
    while receiver.count() < len(want) and time.monotonic() < deadline:
        d.check()
        time.sleep(WAIT_POLL_S)
    got = receiver.take()
    arrived = {lsn: t for lsn, t in zip(got.lsns, got.times, strict=True) if lsn in want}
    if len(arrived) < len(want):
        raise SystemExit(
            f"eventplane max run: {len(want) - len(arrived):,} of {len(want):,} matched rows "
            f"did not arrive within {args.drain_timeout:g} s"
        )
    return MaxRun(
        "eventplane",
        args.clients,
        events,
        len(want),
        started,
        acked_until,
        max(arrived.values()),
        duplicates=len(got.lsns) - len(arrived),
    )


# --------------------------------------------------------------------------
# The peer: Structured Streaming over landed files, in its own process


def land(folder: Path, name: str, data: bytes) -> None:
    """Write, fsync, rename: the file is durable before Spark can list it
    (Spark's file source skips names starting with a dot)."""
    tmp = folder / f".{name}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, folder / name)


def paced_files(
    folder: Path, rate: int, seconds: float, request_events: int, first_id: int
) -> list[Sent]:
    """Open loop: one file of ``request_events`` every period (one lander thread)."""
    n, period = _schedule(rate, seconds, request_events)
    sent: list[Sent] = []
    t0 = time.time() + 0.2
    for i in range(n):
        first = first_id + i * request_events
        data = ndjson(first, request_events)
        s = Sent(t0 + i * period, first, request_events)
        delay = s.due - time.time()
        if delay > 0:
            time.sleep(delay)
        s.sent = time.time()
        land(folder, f"p{first:012d}.json", data)
        s.acked = time.time()
        sent.append(s)
    return sent


def closed_loop_files(
    folder: Path, clients: int, pool: Sequence[bytes], *, files: int | None, seconds: float
) -> tuple[float, float, int]:
    """(start, last landing, files landed) of ``clients`` lander threads: ``files``
    files as fast as they go, or (``files`` None) as many as fit in ``seconds``."""
    counter = itertools.count()  # next() is atomic under the GIL
    landed = [0] * clients
    started = time.time()
    stop_at = started + seconds

    def lander(k: int) -> None:
        while True:
            i = next(counter)
            if (files is not None and i >= files) or (files is None and time.time() >= stop_at):
                return
            land(folder, f"m{i:09d}.json", pool[i % len(pool)])
            landed[k] += 1

    threads = [threading.Thread(target=lander, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return started, time.time(), sum(landed)


def start_peer(
    root: Path, master: str, interval_ms: int, hook_url: str, timeout_s: float = 300
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    landing = root / "landing"
    landing.mkdir(parents=True)
    ready = root / "ready"
    log = root / "peer.log"
    argv = [
        sys.executable,
        "-m",
        "bench.triggers_e2e",
        "--landing",
        str(landing),
        "--checkpoint",
        str(root / "checkpoint"),
        "--url",
        hook_url,
        "--interval-ms",
        str(interval_ms),
        "--master",
        master,
        "--ready-file",
        str(ready),
    ]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            tail = log.read_text(errors="replace")[-3000:]
            raise SystemExit(f"the peer streaming job did not start:\n{tail}")
        time.sleep(0.2)
    return proc, landing, log


def run_peer_side(
    root: Path, args: argparse.Namespace, receiver: RowReceiver, same_events: int | None
) -> tuple[LatencyRun | None, MaxRun | None]:
    """Both peer runs; the max run lands ``same_events`` (what the daemon acknowledged
    in its max run) as fast as the landers go, else lands for ``--max-seconds``."""
    print("peer: starting the Structured Streaming job ...", file=sys.stderr, flush=True)
    proc, landing, log = start_peer(root, args.master, args.interval_ms, receiver.url)

    def alive() -> None:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise SystemExit(f"the peer job exited with {proc.returncode}:\n{tail}")

    latency = maxrun = None
    try:
        if not args.skip_latency:
            receiver.take()
            total = args.warmup_seconds + args.seconds
            print(f"peer: {args.rate:,} events/s for {total:g} s ...", file=sys.stderr, flush=True)
            sent = paced_files(landing, args.rate, total, args.request_events, 3 * RUN_ID_SPAN)
            missing = wait_for_ids(receiver, expected_ids(sent), args.drain_timeout, alive)
            warm = warmup_requests(args)
            latency = LatencyRun(
                "peer", args.rate, args.seconds, sent, receiver.take(), warm, missing
            )
        if not args.skip_max:
            first_id = 4 * RUN_ID_SPAN
            pool = body_pool(first_id)
            per_file = len(_pool_offsets(first_id))
            receiver.take()
            files = None if same_events is None else -(-same_events // MAX_REQUEST_EVENTS)
            what = f"{args.max_seconds:g} s" if files is None else f"{files:,} files"
            print(f"peer: {args.clients} closed-loop landers, {what} ...", file=sys.stderr,
                  flush=True)  # fmt: skip
            started, landed_until, files = closed_loop_files(
                landing, args.clients, pool, files=files, seconds=args.max_seconds
            )
            want = files * per_file
            deadline = time.monotonic() + args.drain_timeout
            while receiver.count() < want and time.monotonic() < deadline:
                alive()
                time.sleep(WAIT_POLL_S)
            got = receiver.take()
            if len(got.times) < want:
                raise SystemExit(
                    f"peer max run: {want - len(got.times):,} of {want:,} matched "
                    f"rows did not arrive within {args.drain_timeout:g} s"
                )
            maxrun = MaxRun(
                "peer",
                args.clients,
                files * MAX_REQUEST_EVENTS,
                want,
                started,
                landed_until,
                max(got.times[:want]),
                len(got.times) - want,
            )
    finally:
        stop_process(proc)
    return latency, maxrun


def peer_job(argv: Sequence[str] | None = None) -> int:
    """The peer's streaming job (its own process): files -> filter -> POST per 1024 rows."""
    import http.client
    from urllib.parse import urlsplit

    p = argparse.ArgumentParser(prog="python -m bench.triggers_e2e")
    p.add_argument("--landing", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--interval-ms", type=int, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--ready-file", required=True)
    args = p.parse_args(argv)

    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType, StructField, StructType

    from daemon.spark.session import build_session

    spark = build_session(args.master, "bench-peer-streaming", False, "ERROR", SPARK_CONF)
    url = urlsplit(args.url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80, timeout=60)

    def post(body: bytes) -> None:
        headers = {"Content-Type": "application/json"}
        for attempt in (1, 2):  # one reconnect: the receiver may close an idle connection
            try:
                conn.request("POST", url.path, body=body, headers=headers)
                resp = conn.getresponse()
                resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                if attempt == 2:
                    raise
                continue
            if resp.status != 200:
                raise RuntimeError(f"receiver answered {resp.status}")
            return

    def handle(df: Any, batch_id: int) -> None:
        # A JSON object read with a string schema keeps its raw text: parse it
        # to VARIANT like the daemon does, then the same condition.
        docs = (
            df.where((F.col("collection") == COLLECTION) & F.col("op").isin("insert", "update"))
            .select("key", "op", F.parse_json("new").alias("new"), F.parse_json("old").alias("old"))
            .where(F.expr(WHEN))
            .select(
                F.to_json(
                    F.struct("key", "op", "new", "old", F.lit(batch_id).alias("batch_id"))
                ).alias("doc")
            )
            .collect()
        )
        for i in range(0, len(docs), ROWS_PER_CALL):
            rows = ",".join(r["doc"] for r in docs[i : i + ROWS_PER_CALL])
            post(b'{"trigger":"peer","rows":[' + rows.encode() + b"]}")

    schema = StructType(
        [StructField(name, StringType()) for name in ("collection", "op", "key", "new", "old")]
    )
    query = (
        spark.readStream.schema(schema)
        .json(args.landing)
        .writeStream.foreachBatch(handle)
        .trigger(processingTime=f"{args.interval_ms} milliseconds")
        .option("checkpointLocation", args.checkpoint)
        .start()
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    Path(args.ready_file).write_text("ready\n")
    while not stop.is_set() and query.isActive:
        query.awaitTermination(0.5)
    failed = query.exception()
    query.stop()
    spark.stop()
    if failed is not None:
        print(f"peer query failed: {failed}", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------
# Report


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f}"


@dataclass
class Line:
    system: str
    metric: str
    value: float
    unit: str
    peer: float | None = None  # the peer's value of the same metric, for the ratio
    higher_better: bool = False

    def ratio(self) -> str:
        if self.peer is None or not self.value or not self.peer:
            return ""
        r = self.value / self.peer if self.higher_better else self.peer / self.value
        return f"{r:.2f}x"

    def shown(self) -> str:
        return f"{self.value:,.0f} {self.unit}"


def latency_lines(
    run: LatencyRun, peer: LatencyRun | None, system: str, start: str, ack: str
) -> list[Line]:
    lat = [r[0] * 1000 for r in run.row_latencies()]
    acks = [a * 1000 for a in run.acks()]
    p_lat = [r[0] * 1000 for r in peer.row_latencies()] if peer else []
    p_acks = [a * 1000 for a in peer.acks()] if peer else []
    lines = []
    for label, q in (("p50", 0.5), ("p99", 0.99), ("max", 1.0)):
        lines.append(
            Line(
                system,
                f"{start} -> webhook received {label}",
                pct(lat, q),
                "ms",
                pct(p_lat, q) if peer else None,
            )
        )
    for label, q in (("p50", 0.5), ("p99", 0.99)):
        lines.append(
            Line(system, f"{ack} {label}", pct(acks, q), "ms", pct(p_acks, q) if peer else None)
        )
    lines.append(Line(system, "matched rows measured", len(lat), "", None))
    return lines


def max_lines(run: MaxRun, peer: MaxRun | None, system: str, took: str) -> list[Line]:
    return [
        Line(system, "events in the run", run.events, ""),
        # No ratio: an HTTP request with validation and a WAL append is not a file write.
        Line(system, f"events/s {took}", run.ingest_rate, "ev/s"),
        Line(
            system,
            "events/s processed (all matched rows received)",
            run.processed_rate,
            "ev/s",
            peer.processed_rate if peer else None,
            True,
        ),
        Line(
            system,
            "matched rows/s received",
            run.matched_rate,
            "rows/s",
            peer.matched_rate if peer else None,
            True,
        ),
        Line(
            system,
            "backlog drain after the producers stopped",
            (run.done - run.acked_until) * 1000,
            "ms",
            None,
        ),
    ]


def render(lines: Sequence[Line]) -> str:
    rows = ["| system | metric | value | vs peer |", "|---|---|---:|---:|"]
    rows += [f"| {x.system} | {x.metric} | {x.shown()} | {x.ratio()} |" for x in lines]
    return "\n".join(rows)


def render_breakdown(b: Breakdown) -> str:
    out = [
        f"where the daemon's time went ({b.rows:,} matched rows in {b.batches} batches; "
        "per row, ms):",
        "",
        "| part | p50 | p99 | mean |",
        "|---|---:|---:|---:|",
    ]
    for name, values in b.parts.items():
        mean = sum(values) / max(len(values), 1)
        out.append(f"| {name} | {pct(values, 0.5):,.0f} | {pct(values, 0.99):,.0f} | {mean:,.0f} |")
    out += [
        "",
        f"per batch: rows p50 {pct(b.batch_rows, 0.5):,.0f}; Spark job start -> next start "
        f"p50 {pct(b.period_ms, 0.5):,.0f} ms, max {max(b.period_ms, default=0):,.0f} ms; "
        f"executor p50 {pct(b.exec_ms, 0.5):,.0f} ms, max {max(b.exec_ms, default=0):,.0f} ms; "
        f"plan fsync + hand-over p50 {pct(b.plan_ms, 0.5):,.1f} ms "
        f"({len(b.plan_ms)} batches seen committed in /v1/status); "
        f"max lag seen {b.max_lag:,} events",
    ]
    if b.metrics:
        means = ", ".join(f"{k.removeprefix('eventplane_')} {v:,.1f}" for k, v in b.metrics.items())
        out.append(f"daemon /metrics over the window, mean ms per observation: {means}")
    return "\n".join(out)


@dataclass
class Round:
    """One latency run of one side in ``--baseline`` mode."""

    side: str
    round: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    trigger_p50_ms: float  # run start -> the trigger's calls start, per batch
    exec_p50_ms: float  # whole run (CDC commit included), per batch
    cpu_s: float  # the daemon's process tree over the measured window
    load_before: str
    load_after: str
    missing: int


def _work_root_and_receiver(args: argparse.Namespace) -> tuple[Path, RowReceiver]:
    """The run's work folder (under ``--dir`` if given) and the started receiver."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-triggers-e2e-", dir=args.dir))
    receiver = RowReceiver()
    receiver.start()
    return root, receiver


def compare(args: argparse.Namespace) -> int:
    """``--baseline DIR``: the daemon of this tree and the one of DIR, latency runs
    only, taking turns (reverse order every other round), ``--rounds`` each."""
    root, receiver = _work_root_and_receiver(args)
    args.skip_max = True
    sides: list[tuple[str, Path | None]] = [("eventplane", None), ("baseline", args.baseline)]
    rounds: list[Round] = []
    load_start = load_average()
    try:
        for n in range(args.rounds):
            for name, src in sides if n % 2 == 0 else sides[::-1]:
                cpu: dict[str, float] = {}
                load_before = load_average()
                lat, _, explained = run_daemon_side(
                    root / f"round{n + 1}" / name, args, receiver, src=src, cpu=cpu
                )
                if lat is None or explained is None:
                    continue
                ms = [r[0] * 1000 for r in lat.row_latencies()]
                trig = explained.parts[list(explained.parts)[2]]
                rounds.append(
                    Round(
                        name,
                        n + 1,
                        pct(ms, 0.5),
                        pct(ms, 0.99),
                        pct(ms, 1.0),
                        pct(trig, 0.5),
                        pct(explained.exec_ms, 0.5),
                        cpu.get("latency_cpu_s", float("nan")),
                        load_before,
                        load_average(),
                        lat.missing,
                    )
                )
                print(
                    f"{name} round {n + 1}: p50 {rounds[-1].p50_ms:,.0f} ms, "
                    f"p99 {rounds[-1].p99_ms:,.0f} ms, max {rounds[-1].max_ms:,.0f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        receiver.stop()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"\ningest -> webhook received, one webhook trigger matching 10 % ({WHEN}), Spark "
        f"{args.master}, interval {args.interval_ms} ms, {args.rate:,} events/s in requests of "
        f"{args.request_events} for {args.seconds:g} s after {args.warmup_seconds:g} s warm-up; "
        f"CDC stream: {'yes' if args.cdc else 'no'}; baseline: {args.baseline}\n"
    )
    print(
        "| round | side | p50 | p99 | max | trigger's result p50 | run p50 | daemon CPU-s "
        "| load before | load after |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---|")
    for r in rounds:
        print(
            f"| {r.round} | {r.side} | {r.p50_ms:,.0f} ms | {r.p99_ms:,.0f} ms | "
            f"{r.max_ms:,.0f} ms | {r.trigger_p50_ms:,.0f} ms | {r.exec_p50_ms:,.0f} ms | "
            f"{r.cpu_s:.1f} | {r.load_before} | {r.load_after} |"
        )
    by_round: dict[int, dict[str, Round]] = {}
    for r in rounds:
        by_round.setdefault(r.round, {})[r.side] = r
    ratios = [
        (x["baseline"].p99_ms / x["eventplane"].p99_ms, x["baseline"].cpu_s / x["eventplane"].cpu_s)
        for x in by_round.values()
        if "baseline" in x and "eventplane" in x and x["eventplane"].p99_ms
    ]
    if ratios:
        shown = ", ".join(f"{p:.2f}x" for p, _ in ratios)
        cpu_shown = ", ".join(f"{c:.2f}x" for _, c in ratios)
        print(f"\np99 baseline / eventplane per round: {shown} (> 1: this tree is faster)")
        print(f"daemon CPU-s baseline / eventplane per round: {cpu_shown}")
    print(f"\nload average at the start: {load_start}; at the end: {load_average()}")
    if args.json:
        text = json.dumps({"rounds": [vars(r) for r in rounds]}, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 1 if any(r.missing for r in rounds) else 0


def run(args: argparse.Namespace) -> int:
    """The whole e2e benchmark; prints the table (and writes JSON if asked)."""
    if args.baseline is not None:
        return compare(args)
    root, receiver = _work_root_and_receiver(args)
    load_before = load_average()
    try:
        ep_lat, ep_max, explained = run_daemon_side(root / "eventplane", args, receiver)
        peer_lat = peer_max = None
        if not args.no_peer:
            same = ep_max.events if ep_max is not None else None
            peer_lat, peer_max = run_peer_side(root / "peer", args, receiver, same)
    finally:
        receiver.stop()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    load_after = load_average()

    ep = "eventplane (daemon)"
    ss = "peer (Structured Streaming)"
    lines: list[Line] = []
    if ep_lat is not None:
        lines += latency_lines(ep_lat, peer_lat, ep, "ingest", "ack (request -> 200)")
    if peer_lat is not None:
        lines += latency_lines(peer_lat, None, ss, "land", "land (write + fsync + rename)")
    if ep_max is not None:
        lines += max_lines(ep_max, peer_max, ep, "acknowledged")
    if peer_max is not None:
        lines += max_lines(peer_max, None, ss, "landed")
    print(
        f"\nend to end, one webhook trigger matching 10 % ({WHEN}), Spark {args.master}, "
        f"interval {args.interval_ms} ms, latency at {args.rate:,} events/s in requests "
        f"(files) of {args.request_events} for {args.seconds:g} s after {args.warmup_seconds:g} "
        f"s warm-up; max run: {args.clients} closed-loop producers, {MAX_REQUEST_EVENTS} "
        f"events per request (file), {args.max_seconds:g} s; CDC stream: "
        f"{'yes' if args.cdc else 'no'}\n"
    )
    print(render(lines))
    print("\n(vs peer: > 1 means eventplane is better; latency from the scheduled send time)")
    for run_ in (ep_lat, peer_lat):
        if run_ is not None and run_.missing:
            print(f"WARNING: {run_.side}: {run_.missing} matched rows never arrived")
    if explained is not None:
        print("\n" + render_breakdown(explained))
    print(f"\nload average before: {load_before}; after: {load_after} ({os.cpu_count()} CPUs)")
    if args.json:
        doc = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "load_average": {"before": load_before, "after": load_after},
            "lines": [
                {
                    "system": x.system,
                    "metric": x.metric,
                    "value": x.value,
                    "unit": x.unit,
                    "vs_peer": x.ratio() or None,
                }
                for x in lines
            ],
            "breakdown_ms": None
            if explained is None
            else {
                name: {"p50": pct(v, 0.5), "p99": pct(v, 0.99), "mean": sum(v) / max(len(v), 1)}
                for name, v in explained.parts.items()
            },
        }
        text = json.dumps(doc, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    missing = sum(r.missing for r in (ep_lat, peer_lat) if r is not None)
    return 1 if missing else 0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``--e2e`` flags of ``python -m bench.bench_triggers``."""
    from daemon.config import MicrobatchConfig

    g = ap.add_argument_group("end to end (--e2e)")
    g.add_argument("--seconds", type=float, default=30.0, help="measured latency run (30)")
    g.add_argument("--warmup-seconds", type=float, default=10.0, help="unmeasured first (10)")
    g.add_argument("--rate", type=int, default=10_000, help="latency run events/s (10000)")
    g.add_argument(
        "--request-events",
        type=int,
        default=200,
        help="events per request (file) in the latency run (200)",
    )
    g.add_argument("--max-seconds", type=float, default=30.0, help="max sustained run (30)")
    g.add_argument("--clients", type=int, default=4, help="max run producers (4)")
    g.add_argument(
        "--interval-ms",
        type=int,
        default=MicrobatchConfig().interval_ms,
        help="microbatch.interval_ms and the peer's processingTime (the shipped default, "
        f"{MicrobatchConfig().interval_ms})",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=600.0,
        help="most seconds to wait for the matched rows after a run (600)",
    )
    g.add_argument("--cdc", action="store_true", help="also give the daemon a CDC stream")
    g.add_argument("--no-peer", action="store_true", help="the daemon only")
    g.add_argument("--skip-latency", action="store_true")
    g.add_argument("--skip-max", action="store_true")
    g.add_argument(
        "--baseline",
        type=Path,
        help="compare with the daemon of this source tree (for example `git archive` of an "
        "older commit, unpacked): latency runs only, no peer, the two daemons taking turns",
    )
    g.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --baseline: latency runs per side, in reverse order every other round (1)",
    )
    g.add_argument("--dir", type=Path, help="work folder, kept (default: a temp folder, removed)")
    g.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-': stdout)")


if __name__ == "__main__":
    sys.exit(peer_job())
