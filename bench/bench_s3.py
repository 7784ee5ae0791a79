"""What a Delta batch costs when the stream's table is on S3, and in requests.

``python -m bench.bench_s3 [--rows 4000] [--batches 20] [--counted 10]``

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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

sys.path.insert(0, os.getcwd())  # the working directory's tree, not this file's

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rows", type=int, default=4000, help="rows per batch")
    p.add_argument("--batches", type=int, default=20, help="timed batches per side (part 1)")
    p.add_argument(
        "--counted", type=int, default=10, help="counted batches per configuration (part 2)"
    )
    args = p.parse_args(argv)
    if deltajars.missing():
        print(deltajars.missing_message(deltajars.missing()), file=sys.stderr)
        return 2
    logs.configure("error", "console")
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp:
        samples, results, idle = asyncio.run(run(args.rows, args.batches, args.counted, Path(tmp)))
    cfg = S3Config()
    print(f"\n{args.rows} rows per batch, {args.batches} timed batches per side, Delta, local[2]")
    report_timing(samples, args.rows)
    print(
        f"\nS3 requests per batch (mean of {args.counted} counted batches after "
        f"{WARMUP_COUNTED}; {args.rows} rows; 'lease': per batch, apart from the total)"
    )
    report_requests(results, idle, (cfg.lease_ttl_s - cfg.lease_skew_s) / 3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
