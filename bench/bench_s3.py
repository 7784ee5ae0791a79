"""What a Delta batch costs when the stream's table is on S3, and in requests.

``python -m bench.bench_s3 [--rows 4000] [--batches 20] [--counted 10] [--no-pipeline]``

A SeaweedFS server (``weed mini``, tests/s3/server.py) on loopback, started
here with its data in a temporary folder; embedded ``local[2]`` Spark with the
daemon's jar and Delta Lake, one session for every side:

1. ``local`` and ``s3`` batches alternate on the same batches (bench_cdc's
   events): a Delta stream whose table is on disk, one whose table is in the
   bucket (staged on disk, uploaded by boto3, committed by delta-rs). Per
   side: rows/s, wall p50/p99 per batch, CPU per batch of this process and
   its JVM, and of the S3 server (reported apart), and the ratio s3/local.
2. Requests per batch: the S3 side again, through a counting HTTP proxy in
   front of the server, for partition_by = collection and collection/date/
   hour, with batches of 1, 4 and 16 collections (one hour of ingest_ts per
   batch), and the requests of one batch. The writer's lease is counted
   apart: per batch, and on an open stream without batches (a PUT every
   (ttl - skew) / 3 s).
3. The pipeline (run after parts 1 and 2, about 1.5 minutes of the ~2.8 of
   the whole run; ``--no-pipeline`` leaves it out, ``--pipeline-only`` runs
   it alone): bench_pipeline's eventplane side, the real daemon on a generated
   config with one ``format = "delta"`` stream, run twice on the same events
   (``bench_pipeline.run_side``: a warm-up of ``--warmup-events`` in 4
   drains, ``--events`` posted by ``--clients`` closed-loop producers until
   visible in the stream's ledger, then its latency run at ``--rate`` events/s
   for 15 s): once with the table on disk, once with ``path =
   "s3://lake/pipeline/all"`` and an ``[s3]`` section for a SeaweedFS server
   started for this part; the row count at the end reads the table through
   delta-rs (``storage_options`` for the bucket). Per side: wall s and
   events/s of the throughput run, its CPU s per million events (the daemon's
   Python, its JVM; the S3 server's apart), the batches' plan-to-commit
   p50/p99/mean (the daemon's ``eventplane_microbatch_duration_seconds`` from
   ``/metrics`` before and after: p50/p99 interpolated within its buckets,
   the mean exact), the latency run's ingest-to-visible p50/p99 and commit
   p50/p99, and s3/local. The daemon gets bench_pipeline's config (bench_cdc's
   ``start_daemon``); its stream's ``path`` and the ``[s3]`` section are
   written into that config just before the process starts (``_table_at``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zlib
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import parse_qs, unquote, urlsplit

sys.path.insert(0, os.getcwd())  # the working directory's tree, not this file's

from bench import bench_pipeline as bp
from bench.bench_cdc import BASE_TS_NS, CORES, executor_config, make_batches
from bench.common import process_tree, total_cpu_seconds
from daemon.config import CdcStream, Config, S3Config
from daemon.events import StoredEvent, encode
from daemon.plane.batch import MicroBatch, Slice
from daemon.service import logs
from daemon.service.metrics import Metrics
from daemon.spark import deltajars
from daemon.spark.executor import SparkExecutor
from daemon.spark.session import build_session
from wal.record import Record

WARMUP = 5  # untimed batches per side in part 1
WARMUP_COUNTED = 2  # uncounted batches per configuration in part 2 (the first creates the table)
PARTITIONINGS = (("collection",), ("collection", "date", "hour"))
SPREADS = (1, 4, 16)  # collections per batch in part 2
# Columns of the request table, in order (the proxy's kinds of request).
KINDS = ("PUT data", "PUT log", "multipart", "GET", "HEAD", "LIST", "DELETE", "other")
LEASE_RENEW, LEASE_OTHER = "lease renew", "lease other"
HISTOGRAM = "eventplane_microbatch_duration_seconds"  # part 3: a batch, plan to commit
WARM_DRAINS = 4  # part 3: the warm-up in this many drained parts (bench_pipeline's)


# -- the counting proxy ----------------------------------------------------------


def classify(method: str, target: str, headers: dict[str, str]) -> str:
    """The kind of one S3 request (path-style ``/bucket/key?query``)."""
    url = urlsplit(target)
    query = parse_qs(url.query, keep_blank_values=True)
    _, _, key = unquote(url.path).lstrip("/").partition("/")
    if "/_eventplane/" in f"/{key}":  # the writer's lease (and the opening probe)
        renew = method == "PUT" and key.endswith("lease.json") and "if-match" in headers
        return LEASE_RENEW if renew else LEASE_OTHER
    if "uploads" in query or "uploadId" in query:
        return "multipart"
    if method == "POST" and "delete" in query:
        return "DELETE"  # DeleteObjects: one request for up to 1000 keys
    if method == "GET" and (not key or "list-type" in query or "prefix" in query):
        return "LIST"
    if method == "PUT" and key:
        return "PUT log" if "/_delta_log/" in f"/{key}" else "PUT data"
    if method in ("GET", "HEAD", "DELETE") and key:
        return method
    return "other"


class CountingProxy:
    """A TCP proxy on loopback in front of the S3 server, in a thread and event
    loop of its own, that reads the requests on each client-to-server stream
    (HTTP/1.1, keep-alive: request line and headers, then the body by its
    Content-Length or chunks) and counts them by kind; bytes pass unchanged."""

    def __init__(self, upstream: str) -> None:
        host_port = upstream.split("://", 1)[1]
        self._host, port = host_port.rsplit(":", 1)
        self._port = int(port)
        self.endpoint = ""
        self.counts: Counter[str] = Counter()
        self.body_bytes = 0
        self.requests: list[str] = []  # "<kind> <method> <target>" of each request
        self._guard = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-s3-proxy", daemon=True)
        self._server: asyncio.Server | None = None

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start within 10 s")

    def snapshot(self) -> tuple[Counter[str], int]:
        with self._guard:
            return Counter(self.counts), self.body_bytes

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._client, "127.0.0.1", 0)
        )
        port = self._server.sockets[0].getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        self._ready.set()
        self._loop.run_forever()

    async def _client(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        try:
            sreader, swriter = await asyncio.open_connection(self._host, self._port)
        except OSError:
            cwriter.close()
            return
        up = asyncio.ensure_future(self._requests(creader, swriter))
        down = asyncio.ensure_future(self._copy(sreader, cwriter))
        with contextlib.suppress(asyncio.CancelledError):  # the proxy stops
            await asyncio.wait((up, down), return_when=asyncio.FIRST_COMPLETED)
        for task in (up, down):
            task.cancel()
        for w in (cwriter, swriter):
            w.close()

    async def _copy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward and count each request of a keep-alive connection."""
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                writer.write(head)
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (line.partition(":") for line in lines[1:] if line)
                }
                kind = classify(method, target, headers)
                if headers.get("transfer-encoding", "").lower() == "chunked":
                    size = await self._chunked(reader, writer)
                else:
                    size = int(headers.get("content-length", "0"))
                    await self._forward(reader, writer, size)
                with self._guard:
                    self.counts[kind] += 1
                    self.requests.append(f"{kind:<12} {method} {unquote(target)}")
                    self.body_bytes += size
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return

    @staticmethod
    async def _forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while n > 0:
            chunk = await reader.read(min(n, 65536))
            if not chunk:
                raise asyncio.IncompleteReadError(b"", n)
            writer.write(chunk)
            n -= len(chunk)
            await writer.drain()

    async def _chunked(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
        total = 0
        while True:
            line = await reader.readuntil(b"\r\n")
            writer.write(line)
            size = int(line.split(b";", 1)[0], 16)
            if size == 0:
                while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                    writer.write(trailer)
                writer.write(trailer)
                return total
            await self._forward(reader, writer, size + 2)  # the chunk and its CRLF
            total += size

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            # The connections the clients kept open (their pools).
            open_ = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in open_:
                task.cancel()
            await asyncio.gather(*open_, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


# -- batches and executors ---------------------------------------------------------


def spread_batches(count: int, rows: int, collections: int) -> list[MicroBatch]:
    """``count`` batches of ``rows`` events each spread over ``collections``
    collections (``c00``, ``c01``, ...), otherwise as bench_cdc's make_batches."""
    names = [f"c{i:02d}" for i in range(collections)]
    seq = dict.fromkeys(range(CORES), 0)
    out = []
    lsn = 1
    for bid in range(1, count + 1):
        per_core: dict[int, list[Record]] = {}
        for _ in range(rows):
            collection, key = names[lsn % collections], f"k{(lsn * 7919) % 100_000}"
            core = zlib.crc32(f"{collection}\0{key}".encode()) % CORES
            seq[core] += 1
            new = b'{"amount":%d,"qty":%d,"status":"paid"}' % (lsn % 5000, lsn % 7)
            event = StoredEvent(collection, "insert", key, new, None, BASE_TS_NS + lsn * 1000)
            per_core.setdefault(core, []).append(Record(lsn, core, seq[core], encode(event)))
            lsn += 1
        slices = {c: Slice(c, r[0].lsn, r[-1].lsn, r) for c, r in sorted(per_core.items())}
        out.append(MicroBatch(bid, slices))
    return out


def delta_config(root: Path, *, uri: str = "", s3: S3Config | None = None, **kw: Any) -> Config:
    """bench_cdc's executor config, its stream ``all`` a Delta one (on S3 given ``uri``)."""
    cfg = executor_config(root)
    stream: CdcStream = replace(
        cfg.cdc.streams[0], format="delta", compaction=False, uri=uri, s3=s3, **kw
    )
    return replace(cfg, cdc=replace(cfg.cdc, streams=(stream,)))


def _renumber(batch: MicroBatch, batch_id: int) -> MicroBatch:
    return MicroBatch(batch_id, batch.slices)


async def _execute(ex: SparkExecutor, batch: MicroBatch) -> None:
    failures = await ex.execute(batch)
    if failures:
        raise SystemExit(f"batch {batch.batch_id} failed: {failures}")


@dataclass
class Sample:
    wall: float
    cpu: float  # this process and its JVM
    server_cpu: float  # the S3 server


@dataclass
class Counted:
    partition_by: tuple[str, ...]
    collections: int
    per_batch: list[Counter[str]]
    body_bytes: int
    last: list[str]  # the requests of the last counted batch


@dataclass
class Idle:
    seconds: float
    counts: Counter[str]


async def run(
    rows: int, count: int, counted: int, tmp: Path
) -> tuple[dict[str, list[Sample]], list[Counted], Idle]:
    from tests.s3.server import start_weed

    (tmp / "weed").mkdir()
    weed = start_weed(tmp / "weed")
    assert weed.proc is not None
    server_pid = weed.proc.pid
    proxy = CountingProxy(weed.server.endpoint)
    proxy.start()
    spark = build_session("local[2]", "bench-s3", False, "ERROR", {}, delta=True)
    pids = process_tree(os.getpid(), frozenset({server_pid}))
    server = process_tree(server_pid)
    try:
        # 1. The table on disk and in the bucket, alternating, on the same batches.
        samples: dict[str, list[Sample]] = {"local": [], "s3": []}
        configs = {
            "local": delta_config(tmp / "local"),
            "s3": delta_config(
                tmp / "s3", uri=f"s3://{weed.server.bucket}/timed/all", s3=weed.server.config()
            ),
        }
        executors = {
            side: SparkExecutor(cfg, Metrics(), wal_id="bench", session=spark)
            for side, cfg in configs.items()
        }
        for ex in executors.values():
            await ex.start()
        batches = make_batches((WARMUP + count) * rows, rows)
        try:
            for i, batch in enumerate(batches):
                for side, ex in executors.items():
                    cpu, srv = total_cpu_seconds(pids), total_cpu_seconds(server)
                    wall = time.perf_counter()
                    await _execute(ex, _renumber(batch, i + 1))
                    wall = time.perf_counter() - wall
                    cpu, srv = total_cpu_seconds(pids) - cpu, total_cpu_seconds(server) - srv
                    if i >= WARMUP:
                        samples[side].append(Sample(wall, cpu, srv))
        finally:
            for ex in executors.values():
                await ex.stop()

        # 2. Requests per batch, through the proxy.
        results: list[Counted] = []
        through = replace(weed.server.config(), endpoint=proxy.endpoint)
        for n, partition_by in enumerate(PARTITIONINGS):
            for spread in SPREADS:
                name = f"p{n}-c{spread}"
                cfg = delta_config(
                    tmp / name,
                    uri=f"s3://{weed.server.bucket}/{name}/all",
                    s3=through,
                    partition_by=partition_by,
                )
                ex = SparkExecutor(cfg, Metrics(), wal_id="bench", session=spark)
                await ex.start()
                per_batch: list[Counter[str]] = []
                body, first = 0, 0
                try:
                    for b in spread_batches(WARMUP_COUNTED + counted, rows, spread):
                        last, last_bytes = proxy.snapshot()
                        first = len(proxy.requests)
                        await _execute(ex, b)
                        now, now_bytes = proxy.snapshot()
                        if b.batch_id > WARMUP_COUNTED:
                            per_batch.append(now - last)
                            body += now_bytes - last_bytes
                    trace = proxy.requests[first:]
                finally:
                    await ex.stop()
                results.append(Counted(partition_by, spread, per_batch, body, trace))

        # 3. The lease of an open stream without batches, through the proxy.
        cfg = delta_config(tmp / "idle", uri=f"s3://{weed.server.bucket}/idle/all", s3=through)
        ex = SparkExecutor(cfg, Metrics(), wal_id="bench", session=spark)
        await ex.start()
        before, _ = proxy.snapshot()
        idle_s = 2 * (through.lease_ttl_s - through.lease_skew_s) / 3 + 2
        await asyncio.sleep(idle_s)
        idle = Idle(idle_s, proxy.snapshot()[0] - before)
        await ex.stop()
    finally:
        spark.stop()
        proxy.stop()
        weed.stop()
    return samples, results, idle


# -- part 3: the pipeline, the table on disk and in the bucket -------------------------


@contextlib.contextmanager
def _table_at(uri: str, section: str) -> Any:
    """bench_cdc's start_daemon writes its stream's ``path = "cdc"``: the daemon
    it starts in here reads ``path = "<uri>"`` and the TOML ``section`` (its
    ``[s3]``) instead; the config is rewritten just before the process starts."""
    real = subprocess.Popen

    def popen(argv: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(argv, list) and "--config" in argv:
            config = Path(argv[argv.index("--config") + 1])
            text = config.read_text()
            assert 'path = "cdc"' in text, text
            config.write_text(text.replace('path = "cdc"', f'path = "{uri}"', 1) + section)
        return real(argv, *args, **kwargs)

    with mock.patch.object(subprocess, "Popen", popen):
        yield


class PipeSide(bp.EventplaneSide):
    """bench_pipeline's eventplane side on a Delta stream, its table on disk or,
    given ``uri``, in the bench's bucket; the S3 server's CPU is counted as a
    group of its own (``s3 server``), and the daemon's batch duration histogram
    is read at each ``batches()``."""

    def __init__(self, name: str, root: Path, args: argparse.Namespace, weed: Any, uri: str = ""):
        super().__init__(root, args.master, args.interval_ms, fmt="delta")
        self.name, self.weed, self.uri = name, weed, uri
        # At each batches(): (last batch id, the histogram's {le: cumulative count}, its sum).
        self.marks: list[tuple[int, dict[float, float], float]] = []

    def start(self) -> None:
        if not self.uri:
            super().start()
            return
        s3 = self.weed.server
        section = (
            f'\n[s3]\nendpoint = "{s3.endpoint}"\nregion = "{s3.region}"\npath_style = true\n'
            f'access_key_id = "{s3.access_key}"\nsecret_access_key = "{s3.secret_key}"\n'
        )
        with _table_at(self.uri, section):
            super().start()
        # The stream's ledger stays on the daemon's disk (docs/cdc.md, "Tables on S3").
        self.table = self.d.table = self.root / "data" / "tables" / "all"

    def cpu(self) -> dict[str, float]:
        return {**super().cpu(), "s3 server": bp.tree_cpu(self.weed.proc.pid)}

    def batches(self) -> int | None:
        # run_side asks before and after the throughput run and after the latency run.
        got = super().batches()
        with urllib.request.urlopen(f"{self.d.admin}/metrics", timeout=10) as r:
            text = r.read().decode()
        buckets, total = {}, 0.0
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name.startswith(f"{HISTOGRAM}_bucket{{"):
                le = name.split('le="', 1)[1].split('"', 1)[0]
                buckets[float(le)] = float(value)  # "+Inf" too
            elif name == f"{HISTOGRAM}_sum":
                total = float(value)
        self.marks.append((got or 0, buckets, total))
        return got

    def count(self) -> int:
        """The table's rows, read through delta-rs (from the bucket: storage_options)."""
        import deltalake

        if not self.uri:
            table = deltalake.DeltaTable(str(self.table))
        else:
            table = deltalake.DeltaTable(
                self.uri, storage_options=self.weed.server.storage_options()
            )
        return int(table.to_pyarrow_dataset().count_rows())


def quantile(buckets: dict[float, float], q: float) -> float:
    """The ``q`` quantile of a Prometheus histogram's cumulative buckets, linear
    within the bucket it falls in (as PromQL's histogram_quantile)."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if not total:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for le in bounds:
        if buckets[le] >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / (buckets[le] - below)
        lower, below = le, buckets[le]
    return lower


@dataclass
class Phase:
    """The batches of one run of a side (throughput or latency), from the
    daemon's eventplane_microbatch_duration_seconds."""

    batches: int
    p50: float
    p99: float
    mean: float


@dataclass
class Piped:
    side: str
    result: bp.SideResult
    phases: dict[str, Phase]


def _phases(side: PipeSide) -> dict[str, Phase]:
    out = {}
    assert len(side.marks) == 3, side.marks
    pairs = ((side.marks[0], side.marks[1]), (side.marks[1], side.marks[2]))
    for name, (a, b) in zip(("throughput", "latency"), pairs, strict=True):
        diff = {le: n - a[1].get(le, 0.0) for le, n in b[1].items()}
        n = diff.get(float("inf"), 0.0)
        mean = (b[2] - a[2]) / n if n else float("nan")
        out[name] = Phase(int(n), quantile(diff, 0.5), quantile(diff, 0.99), mean)
    return out


def pipeline(args: argparse.Namespace, say: Any) -> tuple[list[Piped], str, str]:
    """bench_pipeline's eventplane side twice on the same events, the Delta table
    on disk and then in the bucket of a SeaweedFS server started here."""
    from tests.s3.server import start_weed

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    root = Path(tempfile.mkdtemp(prefix="bench-s3-pipeline-"))
    load_before = bp.load_average()
    out: list[Piped] = []
    try:
        # bench_pipeline's plan (its main() builds it inline), on its events.
        warm, n = args.warmup_events, args.events
        lat_requests = max(1, round(args.rate * 15 / bp.LATENCY_REQUEST_EVENTS))
        parts = [warm * i // WARM_DRAINS for i in range(WARM_DRAINS + 1)]
        plan = bp.Plan(
            warm, root / "run.ndjson", warm + 1, n,
            root / "lat.ndjson", warm + n + 1, lat_requests * bp.LATENCY_REQUEST_EVENTS,
            round(args.rate * 5 / bp.LATENCY_REQUEST_EVENTS),
            args.clients, args.rate, args.interval_ms,
            warm_parts=tuple(
                (root / f"warm{i}.ndjson", parts[i + 1] - parts[i]) for i in range(WARM_DRAINS)
            ),
        )  # fmt: skip
        say(f"pipeline: writing the events ({load_before} load average) ...")
        for i, (part, count) in enumerate(plan.warm_parts):
            bp.write_events(part, 1 + parts[i], count)
        bp.write_events(plan.run_file, plan.run_first, n)
        bp.write_events(plan.lat_file, plan.lat_first, plan.lat_events)
        (root / "weed").mkdir()
        weed = start_weed(root / "weed")
        try:
            for name, uri in (("local", ""), ("s3", f"s3://{weed.server.bucket}/pipeline/all")):
                side = PipeSide(name, root / name, args, weed, uri)
                work = root / f"{name}-producers"
                work.mkdir()
                # run_side counts the table's rows with count_rows(side.table, "delta").
                with mock.patch.object(bp, "count_rows", lambda *_, s=side: s.count()):
                    try:
                        res = bp.run_side(side, plan, work, say)
                    finally:
                        side.stop()
                if res.error:
                    raise SystemExit(f"pipeline, {name}: {res.error}")
                out.append(Piped(name, res, _phases(side)))
        finally:
            weed.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out, load_before, bp.load_average()


# -- the report ---------------------------------------------------------------------


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def report_timing(samples: dict[str, list[Sample]], rows: int) -> None:
    print(
        f"{'side':<7}{'batches':>8}{'rows/s':>9}{'wall p50 ms':>12}{'wall p99 ms':>12}"
        f"{'CPU ms/batch':>13}{'S3 server CPU ms':>17}"
    )
    figures: dict[str, tuple[float, ...]] = {}
    for side, got in samples.items():
        walls = [s.wall for s in got]
        figures[side] = (
            len(got) * rows / sum(walls),
            statistics.median(walls) * 1000,
            _p99(walls) * 1000,
            statistics.mean(s.cpu for s in got) * 1000,
            statistics.mean(s.server_cpu for s in got) * 1000,
        )
        rate, p50, p99, cpu, srv = figures[side]
        server = f"{srv:>17.1f}" if side == "s3" else f"{'-':>17}"
        print(f"{side:<7}{len(got):>8}{rate:>9.0f}{p50:>12.1f}{p99:>12.1f}{cpu:>13.1f}{server}")
    ratio = [s / lo for s, lo in zip(figures["s3"][:4], figures["local"][:4], strict=True)]
    print(
        f"{'s3/local':<7}{'':>8}{ratio[0]:>9.2f}{ratio[1]:>12.2f}{ratio[2]:>12.2f}"
        f"{ratio[3]:>13.2f}{'':>17}"
    )


def report_requests(results: list[Counted], idle: Idle, renew_s: float) -> None:
    print(
        f"{'partition_by':<24}{'colls':>6}"
        + "".join(f"{k:>10}" for k in KINDS)
        + f"{'total':>8}{'max':>6}{'KiB up':>8}{'lease':>7}"
    )
    for r in results:
        n = len(r.per_batch)
        mean = {k: sum(c[k] for c in r.per_batch) / n for k in (*KINDS, LEASE_RENEW, LEASE_OTHER)}
        totals = [sum(c[k] for k in KINDS) for c in r.per_batch]
        print(
            f"{'/'.join(r.partition_by):<24}{r.collections:>6}"
            + "".join(f"{mean[k]:>10.1f}" for k in KINDS)
            + f"{statistics.mean(totals):>8.1f}{max(totals):>6}"
            + f"{r.body_bytes / n / 1024:>8.0f}{mean[LEASE_RENEW] + mean[LEASE_OTHER]:>7.1f}"
        )
    others = sum(n for k, n in idle.counts.items() if k != LEASE_RENEW)
    print(
        f"an open stream without batches, {idle.seconds:.0f} s: {idle.counts[LEASE_RENEW]} lease "
        f"renewals (PUT If-Match on _eventplane/lease.json, every (ttl - skew) / 3 = "
        f"{renew_s:.1f} s), {others} other requests"
    )
    r = next(r for r in results if r.collections == 4)
    print(f"\nThe requests of one batch ({'/'.join(r.partition_by)}, {r.collections} collections):")
    for line in r.last:
        print(f"  {line}")


def report_pipeline(piped: list[Piped]) -> None:
    print(
        f"{'side':<9}{'events':>9}{'wall s':>8}{'events/s':>10}{'daemon':>8}{'JVM':>7}"
        f"{'total':>7}{'S3 srv':>8}{'batches':>8}{'commit p50':>11}{'p99':>7}{'mean':>7}"
        f"{'lat p50':>8}{'p99':>7}{'batches':>8}{'commit p50':>11}{'p99':>7}"
    )
    figures: dict[str, list[float]] = {}
    for p in piped:
        r, run, lat = p.result, p.phases["throughput"], p.phases["latency"]
        mil = r.per_million
        row = [
            r.events, r.visible_s, r.rate, mil(r.cpu["server"]), mil(r.cpu["spark"]),
            mil(r.cpu["server"] + r.cpu["spark"]), mil(r.cpu["s3 server"]), run.batches,
            run.p50 * 1000, run.p99 * 1000, run.mean * 1000,
            bp.pct(r.latencies, 0.5) * 1000, bp.pct(r.latencies, 0.99) * 1000, lat.batches,
            lat.p50 * 1000, lat.p99 * 1000,
        ]  # fmt: skip
        figures[p.side] = row
        print(
            f"{p.side:<9}{row[0]:>9,}{row[1]:>8.2f}{row[2]:>10,.0f}{row[3]:>8.2f}{row[4]:>7.2f}"
            f"{row[5]:>7.2f}{row[6]:>8.2f}{row[7]:>8}{row[8]:>11.0f}{row[9]:>7.0f}{row[10]:>7.0f}"
            f"{row[11]:>8.0f}{row[12]:>7.0f}{row[13]:>8}{row[14]:>11.0f}{row[15]:>7.0f}"
        )
    if {"local", "s3"} <= figures.keys():
        q = [
            s / lo if lo else float("nan")
            for s, lo in zip(figures["s3"], figures["local"], strict=True)
        ]
        print(
            f"{'s3/local':<9}{'':>9}{q[1]:>8.2f}{q[2]:>10.2f}{q[3]:>8.2f}{q[4]:>7.2f}{q[5]:>7.2f}"
            f"{'':>8}{'':>8}{q[8]:>11.2f}{q[9]:>7.2f}{q[10]:>7.2f}{q[11]:>8.2f}{q[12]:>7.2f}"
            f"{'':>8}{q[14]:>11.2f}{q[15]:>7.2f}"
        )
    for p in piped:
        print(
            f"{p.side}: ledger batches (throughput, latency run) {p.result.batches}; latency run "
            f"{p.result.achieved:,.0f} events/s, {p.result.latency_cores:.2f} CPU cores "
            f"(S3 server included), commit mean {p.phases['latency'].mean * 1000:.0f} ms; "
            f"rows checked {p.result.rows_checked:,} (every event sent)"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rows", type=int, default=4000, help="rows per batch")
    p.add_argument("--batches", type=int, default=20, help="timed batches per side (part 1)")
    p.add_argument(
        "--counted", type=int, default=10, help="counted batches per configuration (part 2)"
    )
    p.add_argument("--no-pipeline", action="store_true", help="parts 1 and 2 only")
    p.add_argument("--pipeline-only", action="store_true", help="part 3 only")
    p.add_argument("--events", type=int, default=400_000, help="part 3: throughput run")
    p.add_argument("--warmup-events", type=int, default=200_000, help="part 3: untimed first")
    p.add_argument("--clients", type=int, default=8, help="part 3: closed-loop producers")
    p.add_argument("--rate", type=int, default=20_000, help="part 3: latency run events/s")
    p.add_argument("--interval-ms", type=int, default=100, help="part 3: microbatch.interval_ms")
    p.add_argument("--master", default="local[*]", help="part 3: the daemon's spark.master")
    args = p.parse_args(argv)
    if deltajars.missing():
        print(deltajars.missing_message(deltajars.missing()), file=sys.stderr)
        return 2
    if not args.pipeline_only:
        logs.configure("error", "console")
        with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp:
            samples, results, idle = asyncio.run(
                run(args.rows, args.batches, args.counted, Path(tmp))
            )
        cfg = S3Config()
        print(
            f"\n{args.rows} rows per batch, {args.batches} timed batches per side, Delta, local[2]"
        )
        report_timing(samples, args.rows)
        print(
            f"\nS3 requests per batch (mean of {args.counted} counted batches after "
            f"{WARMUP_COUNTED}; {args.rows} rows; 'lease': per batch, apart from the total)"
        )
        report_requests(results, idle, (cfg.lease_ttl_s - cfg.lease_skew_s) / 3)
    if not args.no_pipeline:
        took = time.monotonic()
        piped, before, after = pipeline(args, lambda text: print(text, file=sys.stderr, flush=True))
        took = time.monotonic() - took
        print(
            f"\nThe pipeline ({took:.0f} s; bench_pipeline's eventplane side, "
            'format = "delta", '
            f"interval_ms = {args.interval_ms}, {args.master}): {args.warmup_events:,} warm-up "
            f"events, {args.events:,} timed, then the latency run at {args.rate:,} events/s; "
            "CPU s per million events (daemon = its Python, JVM = its Spark, S3 srv = weed); "
            "commit = a batch's plan to commit, ms (the daemon's histogram in /metrics, "
            "p50/p99 interpolated within its buckets 50/100/250/500 ms, mean exact); "
            "lat = ingest to visible, ms"
        )
        report_pipeline(piped)
        print(f"load average before: {before}; after: {after}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
