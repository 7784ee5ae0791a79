"""Whole pipeline: HTTP producers -> rows queryable in a table, eventplane vs two peers.

``python -m bench.bench_pipeline [--events N] [--rate R] [--peers landing,outbox]
[--format parquet|delta]``

Every side gets the same producers and the same events: ``--clients``
concurrent HTTP clients posting NDJSON bodies of 1000 events (~150-byte
payloads, four collections, keys reused so that most events are updates of
an earlier key) to ``POST /v1/events``, and each side ends with the rows
queryable in a Parquet table partitioned by ``collection`` whose ``new`` and
``old`` are VARIANT (``--format delta``: a Delta Lake table, below). The sides
run one after the other (never at once: the machine has 2 cores), each in its
own processes:

- **eventplane**: ``eventplane run`` (one CDC stream, embedded local Spark,
  ``wal.fsync = "always"``, the shipped micro-batch settings). Visible: the
  stream's ledger has committed the rows (docs/cdc.md).
- **landing** (landing files + Structured Streaming): a small aiohttp server
  appends each body to the current landing file and fdatasyncs before it
  answers (group commit: requests that arrive during an fsync share the next
  one), and renames the file into the watched folder (atomic, then the folder
  is fsynced) every ``--rotate-ms`` or 64 MiB. A Structured Streaming query over
  that folder (``readStream.json`` with a schema, ``parse_json`` of
  ``new``/``old``, Parquet file sink partitioned by ``collection``, checkpoint)
  runs in its own Spark driver process: ``trigger(availableNow=True)`` started
  after the last ack for throughput, ``trigger(processingTime=--interval-ms)``
  for latency. Visible: the query reported the batch's progress (after its
  sink commit), counted in rows.
- **outbox** (transactional outbox): PostgreSQL from Debian's ``postgresql``
  package, a cluster this bench creates in a temp folder and removes again
  (``synchronous_commit = on``, ``fsync = on``). An aiohttp server (asyncpg)
  turns the requests into binary ``COPY`` into ``outbox(id bigint primary
  key, collection, op, key, new jsonb, old jsonb, ingest_ts)`` with group
  commit (one writer: requests that arrive during a commit share the next
  transaction; one writer also means ids commit in order, so a reader by id
  never skips a late commit). A Spark driver process reads the rows above its
  high id over JDBC (Debian's ``libpostgresql-jdbc-java`` jar, ``spark.jars``),
  writes them to the Parquet table (``parse_json``, partitioned by
  ``collection``), then stores its new high id (file, fsync, rename). One pass
  after the last ack for throughput, a pass every ``--interval-ms`` for
  latency. Visible: the stored high id.

``--format delta``: every side writes a Delta Lake table instead, partitioned
by ``collection``, its payloads as JSON text ``new_json``/``old_json`` (no
VARIANT: the daemon's Delta layout, ``DELTA_COLUMNS`` in daemon/table/delta.py)
beside the same other columns. The eventplane stream has ``format = "delta"``
(visible: its ledger, as with Parquet); the landing query's sink is
``writeStream.format("delta")`` with its checkpoint; each outbox pass is one
Delta append with ``txnAppId`` and ``txnVersion`` = the pass's high id (a pass
run again writes nothing; the job takes its high id from the Delta log too).
The peers' drivers get the daemon's Delta session settings
(``daemon.spark.session``: the jars of ``make delta-jars`` on the driver's
class path, Delta's SQL extension and catalog); without those jars the bench
exits with the command that fetches them.

Measured per side:

1. an untimed warm-up (``--warmup-events`` in ``--warmup-drains`` parts,
   each posted and then waited for until visible);
2. **throughput**: ``--events`` posted closed-loop; timed from the first
   request to all rows visible (the peers start their Spark work after the
   last ack, as ``availableNow`` would be run);
3. **CPU seconds** over the throughput run from /proc, per million events:
   the server (the daemon's Python; the peers' HTTP servers), the Spark JVM
   (the daemon's JVM; the peers' driver process and its JVM), the database
   (every PostgreSQL process, reaped backends included) and the producers
   (their own process). Processes that exit during the run are counted
   through their parent's ``cutime``/``cstime``;
4. **ingest-to-visible latency**: an open-loop producer at ``--rate``
   events/s in requests of 200 events, ``--latency-warmup-seconds``
   unmeasured then ``--latency-seconds`` measured; each request's latency runs
   from its *scheduled* send time to the first poll (every 20 ms) that finds all
   of its events visible. The side's CPU over that run (its warm-up included,
   producers not) per wall second is shown as "CPU cores": what that freshness
   costs at that rate (a shorter ``--interval-ms`` buys freshness with it);
5. the table's row count (Parquet footers; Delta: its current snapshot, read
   through the Delta log with ``deltalake``) against every event sent.

The landing side's ``availableNow`` run alone (its Spark driver's time and
CPU, landing not counted) is also reported: that is ``bench_cdc``'s peer,
Structured Streaming over files already on disk, kept as a reference row.

``--rounds N`` runs every side N times, in reverse order every other round
(load on a shared machine drifts over minutes): the table shows each side's
fastest round with that round's CPU, and its lowest p99; every round is listed.
Results and analysis: docs/performance.md.

The PostgreSQL side needs ``pg_ctl``/``initdb`` (``/usr/lib/postgresql/*/bin``)
and the JDBC jar (``/usr/share/java/postgresql*.jar``); without them it is
skipped with the install command. As root, PostgreSQL runs as the
``postgres`` user the Debian package creates.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import dataclasses
import glob
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from bench.common import _stat, post_events

MiB = 1 << 20
REQUEST_EVENTS = 1000
LATENCY_REQUEST_EVENTS = 200
POLL_S = 0.02
ROTATE_BYTES = 64 * MiB
PEERS = ("landing", "outbox")
FORMATS = ("parquet", "delta")
TABLE_FORMATS = {
    "parquet": "Parquet (new/old VARIANT)",
    "delta": "Delta Lake (new_json/old_json JSON text)",
}
# The outbox job's Delta ``txnAppId``: each pass commits with ``txnVersion`` =
# the high id it read up to, so a pass re-run after a crash writes nothing.
OUTBOX_APP_ID = "bench-pipeline/outbox"
# The module the servers and Spark jobs run as (`python -m`).
MODULE = "bench.bench_pipeline"
SPARK_CONF = {"spark.sql.shuffle.partitions": "4", "spark.driver.memory": "4g"}
PG_PACKAGES = "postgresql libpostgresql-jdbc-java"
PG_INSTALL = f"apt-get install -y --no-install-recommends {PG_PACKAGES}"
PG_USER = "bench"
PG_TABLE = "outbox"
LABELS = {
    "eventplane": "eventplane: HTTP -> WAL -> Spark -> CDC table",
    "baseline": "eventplane from --baseline's tree (older code, or another PySpark: "
    "--baseline-python)",
    "landing": "landing files + Structured Streaming",
    "outbox": "PostgreSQL outbox + Spark JDBC",
    "reference": "reference: Structured Streaming over landed files (bench_cdc's peer)",
}
CPU_GROUPS = ("server", "spark", "database", "producers")


# --------------------------------------------------------------------------
# CPU from /proc


def own_cpu(pid: int) -> float:
    """User + system CPU of ``pid`` and of its children it has reaped."""
    f = _stat(pid)
    ticks = int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def tree_cpu(root: int) -> float:
    """CPU of ``root`` and every live descendant, plus what each has reaped: a
    figure that only grows while ``root`` lives, whoever comes and goes below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                children.setdefault(int(_stat(entry)[1]), []).append(int(entry))
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        with contextlib.suppress(OSError):
            total += own_cpu(pid)
        todo.extend(children.get(pid, ()))
    return total


def load_average() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


# --------------------------------------------------------------------------
# Events: bench_cdc's, so that every benchmark posts the same bodies


def event_keys(first: int, count: int) -> list[tuple[str, str]]:
    from bench.bench_cdc import _event

    return [(c, k) for c, _op, k, _n, _o in (_event(i) for i in range(first, first + count))]


def write_events(path: Path, first: int, count: int) -> None:
    from bench.bench_cdc import _ndjson

    with open(path, "wb") as f:
        for i in range(first, first + count, REQUEST_EVENTS):
            f.write(_ndjson(i, min(REQUEST_EVENTS, first + count - i))[0])


# --------------------------------------------------------------------------
# Producers (their own process, so that their CPU is theirs alone)


def produce(args: argparse.Namespace) -> int:
    """Post the events file's lines in requests of ``--per-request``: closed loop
    with ``--clients``, or open loop at ``--rate`` events/s; results to ``--out``."""
    import uvloop

    lines = Path(args.events_file).read_bytes().splitlines(keepends=True)
    k = args.per_request
    bodies = [b"".join(lines[i : i + k]) for i in range(0, len(lines), k)]
    del lines
    out: dict[str, Any] = {}

    async def run() -> None:
        import aiohttp

        limit = args.clients if not args.rate else 256
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit)) as session:
            t0 = os.times()
            out["started"] = time.time()
            if not args.rate:
                todo = iter(bodies)

                async def producer() -> None:
                    for body in todo:
                        await post_events(session, args.produce, body)

                await asyncio.gather(*(producer() for _ in range(args.clients)))
            else:
                period = k / args.rate
                start = time.time() + 0.1
                requests: list[list[float]] = [[] for _ in bodies]

                async def one(i: int) -> None:
                    ack = await post_events(session, args.produce, bodies[i])
                    acked = time.time()
                    requests[i] = [start + i * period, acked, ack["first_lsn"], ack["last_lsn"]]

                tasks = []
                for i in range(len(bodies)):
                    await asyncio.sleep(max(0.0, start + i * period - time.time()))
                    tasks.append(asyncio.create_task(one(i)))
                await asyncio.gather(*tasks)
                out["requests"] = requests
            out["acked"] = time.time()
            t1 = os.times()
            out["cpu"] = (t1.user - t0.user) + (t1.system - t0.system)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run())
    Path(args.out).write_text(json.dumps(out))
    return 0


def run_producers(
    url: str, events_file: Path, per_request: int, clients: int, rate: int, out: Path
) -> dict[str, Any]:
    argv = [sys.executable, "-m", "bench.bench_pipeline", "--produce", url,
            "--events-file", str(events_file), "--per-request", str(per_request),
            "--clients", str(clients), "--rate", str(rate), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"producers failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")
    return dict(json.loads(out.read_text()))


# --------------------------------------------------------------------------
# The peers' HTTP servers (their own process)


def _write_sync(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.fdatasync(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Lander:
    """Append bodies to one landing file with group commit; rotate it into the
    watched folder by rename (atomic) when it is ``rotate_s`` old or large."""

    def __init__(self, staging: Path, folder: Path, rotate_s: float) -> None:
        self.staging, self.folder, self.rotate_s = staging, folder, rotate_s
        self.position = 0  # events appended so far: the ack's first/last positions
        self.seq = 0
        self.queue: list[tuple[bytes, int, asyncio.Future[tuple[int, int]]]] = []
        self.wake = asyncio.Event()
        self.lock = asyncio.Lock()
        self.files = 0
        self._open()

    def _open(self) -> None:
        self.seq += 1
        self.path = self.staging / f"land-{self.seq:09d}.json"
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.size = 0
        self.first_write = 0.0

    async def append(self, body: bytes) -> tuple[int, int]:
        fut: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        self.queue.append((body, body.count(b"\n"), fut))
        self.wake.set()
        return await fut

    def _data(self, group: list[tuple[bytes, int, asyncio.Future[tuple[int, int]]]]) -> bytes:
        """What one group appends: its bodies as posted (a subclass may number
        the events: the first one's position is ``self.position + 1``)."""
        return b"".join(body for body, _n, _f in group)

    async def writer(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            group, self.queue = self.queue, []
            if not group:
                continue
            async with self.lock:
                data = self._data(group)
                try:
                    await asyncio.to_thread(_write_sync, self.fd, data)
                except OSError as exc:
                    for _b, _n, fut in group:
                        fut.set_exception(exc)
                    continue
                if not self.size:
                    self.first_write = time.monotonic()
                self.size += len(data)
                for _b, n, fut in group:
                    fut.set_result((self.position + 1, self.position + n))
                    self.position += n
                if self.size >= ROTATE_BYTES:
                    await self._rotate()

    async def _rotate(self) -> None:
        """Publish the current file (the caller holds the lock); its data is synced."""
        if not self.size:
            return
        fd, path = self.fd, self.path
        self._open()
        os.close(fd)
        await asyncio.to_thread(os.rename, path, self.folder / path.name)
        await asyncio.to_thread(_fsync_dir, self.folder)
        self.files += 1

    async def ticker(self) -> None:
        while True:
            await asyncio.sleep(self.rotate_s / 4)
            if self.size and time.monotonic() - self.first_write >= self.rotate_s:
                async with self.lock:
                    await self._rotate()

    async def rotate_now(self) -> int:
        async with self.lock:
            await self._rotate()
        return self.files


class OutboxEvent(msgspec.Struct):
    collection: str
    op: str
    key: str
    new: msgspec.Raw
    old: msgspec.Raw


class Outbox:
    """Requests -> binary COPY into the outbox table, one transaction per group."""

    COLUMNS = ("id", "collection", "op", "key", "new", "old")

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.decoder = msgspec.json.Decoder(OutboxEvent)
        self.next_id = 1
        self.queue: list[tuple[list[tuple[Any, ...]], asyncio.Future[tuple[int, int]]]] = []
        self.wake = asyncio.Event()

    async def open(self) -> None:
        await self.conn.execute(
            f"CREATE TABLE IF NOT EXISTS {PG_TABLE} (id bigint PRIMARY KEY, "
            "collection text NOT NULL, op text NOT NULL, key text NOT NULL, new jsonb, "
            "old jsonb, ingest_ts timestamptz NOT NULL DEFAULT now())"
        )
        self.next_id = int(await self.conn.fetchval(f"SELECT coalesce(max(id), 0) FROM {PG_TABLE}"))
        self.next_id += 1

    @staticmethod
    def _json(raw: Any) -> str | None:
        b = bytes(raw)
        return None if b == b"null" else b.decode()

    async def append(self, body: bytes) -> tuple[int, int]:
        rows = [
            (e.collection, e.op, e.key, self._json(e.new), self._json(e.old))
            for e in self.decoder.decode_lines(body)
        ]
        fut: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        self.queue.append((rows, fut))
        self.wake.set()
        return await fut

    async def writer(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            group, self.queue = self.queue, []
            if not group:
                continue
            records: list[tuple[Any, ...]] = []
            ranges = []
            for rows, _f in group:
                first = self.next_id
                records.extend((first + j, *r) for j, r in enumerate(rows))
                self.next_id += len(rows)
                ranges.append((first, self.next_id - 1))
            try:
                async with self.conn.transaction():
                    await self.conn.copy_records_to_table(
                        PG_TABLE, records=records, columns=self.COLUMNS
                    )
            except Exception as exc:
                for _r, fut in group:
                    fut.set_exception(exc)
                continue
            for (_r, fut), got in zip(group, ranges, strict=True):
                fut.set_result(got)


async def _serve(kind: str, args: argparse.Namespace, lander: type[Lander] = Lander) -> None:
    from aiohttp import web

    directory = Path(args.dir)
    tasks: list[asyncio.Task[None]] = []
    store: Lander | Outbox
    if kind == "landing":
        (directory / "staging").mkdir(parents=True, exist_ok=True)
        (directory / "landing").mkdir(parents=True, exist_ok=True)
        store = lander(directory / "staging", directory / "landing", args.rotate_ms / 1000)
        tasks.append(asyncio.create_task(store.ticker()))
    else:
        import asyncpg  # type: ignore[import-untyped]

        conn = await asyncpg.connect(
            host="127.0.0.1", port=args.pg_port, user=PG_USER, database="postgres"
        )
        store = Outbox(conn)
        await store.open()
    tasks.append(asyncio.create_task(store.writer()))

    async def events(request: web.Request) -> web.Response:
        body = await request.read()
        if not body.endswith(b"\n"):
            body += b"\n"
        first, last = await store.append(body)
        return web.json_response(
            {"accepted": last - first + 1, "first_lsn": first, "last_lsn": last}
        )

    async def rotate(request: web.Request) -> web.Response:
        files = await store.rotate_now() if isinstance(store, Lander) else 0
        return web.json_response({"files": files})

    app = web.Application(client_max_size=64 * MiB)
    app.router.add_post("/v1/events", events)
    app.router.add_post("/rotate", rotate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    await asyncio.to_thread(Path(args.port_file).write_text, str(port))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    for t in tasks:
        t.cancel()


def serve(args: argparse.Namespace, lander: type[Lander] = Lander) -> int:
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_serve(args.serve, args, lander))
    return 0


# --------------------------------------------------------------------------
# The peers' Spark jobs (their own driver process, commands on stdin)


def _write_atomic(path: Path, text: str, durable: bool = False) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        _fsync_dir(path.parent)


def _payload_columns(fmt: str) -> list[Any]:
    """The peers' payload columns from ``new``/``old`` JSON text: VARIANT ``new``
    and ``old`` in a Parquet table, the text itself (``new_json``/``old_json``,
    as the daemon's Delta layout) in a Delta table."""
    from pyspark.sql import functions as F

    if fmt == "delta":
        return [F.col("new").alias("new_json"), F.col("old").alias("old_json")]
    return [F.parse_json("new").alias("new"), F.parse_json("old").alias("old")]


class LandingJob:
    """Structured Streaming over the landing folder into the table (``fmt``)."""

    def __init__(self, spark: Any, directory: Path, fmt: str) -> None:
        from pyspark.sql.streaming.listener import StreamingQueryListener

        self.spark, self.dir, self.fmt = spark, directory, fmt
        self.visible = directory / "visible"
        self.query: Any = None
        job = self

        class Progress(StreamingQueryListener):
            total = 0

            def onQueryStarted(self, event: Any) -> None:
                pass

            def onQueryProgress(self, event: Any) -> None:
                n = int(event.progress.numInputRows)
                if n:
                    Progress.total += n
                    _write_atomic(job.visible, str(Progress.total))

            def onQueryIdle(self, event: Any) -> None:
                pass

            def onQueryTerminated(self, event: Any) -> None:
                pass

        spark.streams.addListener(Progress())

    def _start(self, trigger: dict[str, Any]) -> Any:
        from pyspark.sql import functions as F
        from pyspark.sql.types import StringType, StructField, StructType

        # A JSON object read with a string schema keeps its raw text.
        names = ("collection", "op", "key", "new", "old")
        schema = StructType([StructField(n, StringType()) for n in names])
        df = (
            self.spark.readStream.schema(schema)
            .json(str(self.dir / "landing"))
            .select(
                "collection",
                "op",
                "key",
                *_payload_columns(self.fmt),
                F.current_timestamp().alias("ingest_ts"),
            )
        )
        return (
            df.writeStream.format(self.fmt)
            .partitionBy("collection")
            .option("path", str(self.dir / "table"))
            .option("checkpointLocation", str(self.dir / "checkpoint"))
            .trigger(**trigger)
            .start()
        )

    def drain(self) -> None:
        query = self._start({"availableNow": True})
        query.awaitTermination()
        if query.exception() is not None:
            raise RuntimeError(f"availableNow query failed: {query.exception()}")

    def stream(self, interval_ms: int) -> None:
        self.query = self._start({"processingTime": f"{interval_ms} milliseconds"})

    def stop(self) -> None:
        if self.query is not None:
            query, self.query = self.query, None
            query.stop()
            if query.exception() is not None:
                raise RuntimeError(f"streaming query failed: {query.exception()}")


class OutboxJob:
    """Rows above the stored high id over JDBC -> the table (``fmt``) -> new high id."""

    def __init__(self, spark: Any, directory: Path, port: int, fmt: str) -> None:
        self.spark, self.dir, self.fmt = spark, directory, fmt
        self.table = directory / "table"
        self.url = f"jdbc:postgresql://127.0.0.1:{port}/postgres"
        self.state = directory / "high_id"
        self.high = int(self.state.read_text()) if self.state.exists() else 0
        if fmt == "delta":
            # A pass that committed but died before storing its high id: the
            # Delta log holds it (the commit's txnVersion).
            self.high = max(self.high, _delta_txn_version(self.table, OUTBOX_APP_ID))
        jvm = spark.sparkContext._jvm
        self.conn = jvm.java.sql.DriverManager.getConnection(self.url, PG_USER, "")
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _max_id(self) -> int:
        stmt = self.conn.createStatement()
        try:
            rs = stmt.executeQuery(f"SELECT coalesce(max(id), 0) FROM {PG_TABLE}")
            rs.next()
            return int(rs.getLong(1))
        finally:
            stmt.close()

    def one_pass(self, partitions: int) -> int:
        lo, hi = self.high, self._max_id()
        if hi <= lo:
            return 0
        parts = max(1, min(partitions, (hi - lo) // 50_000))
        reader = (
            self.spark.read.format("jdbc")
            .option("url", self.url)
            .option("user", PG_USER)
            .option("driver", "org.postgresql.Driver")
            .option(
                "dbtable",
                f"(SELECT id, collection, op, key, new::text AS new, old::text AS old, "
                f"ingest_ts FROM {PG_TABLE} WHERE id > {lo} AND id <= {hi}) AS b",
            )
            .option("fetchsize", "10000")
        )
        if parts > 1:
            reader = (
                reader.option("partitionColumn", "id")
                .option("lowerBound", str(lo + 1))
                .option("upperBound", str(hi + 1))
                .option("numPartitions", str(parts))
            )
        rows = reader.load().select(
            "id", "collection", "op", "key", *_payload_columns(self.fmt), "ingest_ts"
        )
        write = rows.write.format(self.fmt).mode("append").partitionBy("collection")
        if self.fmt == "delta":
            # Delta skips a commit whose txnVersion is not above the one it holds
            # for the app id: the same pass run again writes nothing.
            write = write.option("txnAppId", OUTBOX_APP_ID).option("txnVersion", str(hi))
        write.save(str(self.table))
        _write_atomic(self.state, str(hi), durable=True)
        self.high = hi
        return hi - lo

    def drain(self) -> None:
        self.one_pass(4)

    def stream(self, interval_ms: int) -> None:
        period = interval_ms / 1000

        def loop() -> None:
            try:
                while not self._halt.is_set():
                    started = time.monotonic()
                    self.one_pass(4)
                    self._halt.wait(max(0.0, started + period - time.monotonic()))
            except BaseException as exc:
                self._error = exc

        self._halt.clear()
        self._thread = threading.Thread(target=loop, name="outbox-passes", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._halt.set()
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise RuntimeError(f"outbox pass failed: {self._error}")


def _delta_txn_version(table: Path, app_id: str) -> int:
    """The last ``txnVersion`` the Delta table at ``table`` holds for ``app_id``
    (0: none, or no table yet)."""
    import deltalake

    if not deltalake.DeltaTable.is_deltatable(str(table)):
        return 0
    return deltalake.DeltaTable(str(table)).transaction_version(app_id) or 0


def spark_job(args: argparse.Namespace, make_job: Callable[[Any], Any] | None = None) -> int:
    """The peer's Spark driver: ``ready``, then ``drain`` / ``stream MS`` / ``stop``.

    ``make_job``: the job (``drain``, ``stream``, ``stop``) from the session,
    instead of ``--spark``'s (another bench's peer)."""
    # Replies go to the real stdout; anything else writing to fd 1 (the JVM) goes to stderr.
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from daemon.spark.session import build_session

    conf = dict(SPARK_CONF)
    if args.spark == "outbox":
        conf["spark.jars"] = args.jar
        conf["spark.driver.extraClassPath"] = args.jar
    # Delta: the daemon's own session settings for it (daemon.spark.session._add_delta):
    # the jars of `make delta-jars` on the driver's class path, Delta's extension
    # and catalog.
    spark = build_session(
        args.master,
        f"bench-pipeline-{args.spark}",
        False,
        "ERROR",
        conf,
        delta=args.format == "delta",
    )
    job: Any = (
        make_job(spark)
        if make_job is not None
        else LandingJob(spark, Path(args.dir), args.format)
        if args.spark == "landing"
        else OutboxJob(spark, Path(args.dir), args.pg_port, args.format)
    )
    reply.write("ready\n")
    for line in sys.stdin:
        cmd = line.split()
        try:
            if cmd[0] == "drain":
                t = time.perf_counter()
                job.drain()
                reply.write(f"done {time.perf_counter() - t:.6f}\n")
            elif cmd[0] == "stream":
                job.stream(int(cmd[1]))
                reply.write("streaming\n")
            elif cmd[0] == "stop":
                job.stop()
                reply.write("stopped\n")
            else:
                break
        except Exception as exc:
            reply.write(f"error {type(exc).__name__}: {str(exc)[:2000]!r}\n")
    with contextlib.suppress(Exception):
        job.stop()
    spark.stop()
    return 0


# --------------------------------------------------------------------------
# Bench side: processes of one side


def _stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-3000:]
    except OSError:
        return ""


class ServerProc:
    """A peer's HTTP server process (``python -m <module> --serve KIND``)."""

    def __init__(
        self, kind: str, directory: Path, extra: Sequence[str], module: str = MODULE
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        port_file = directory / "port"
        self.log = directory / "server.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, "--serve", kind,
                 "--dir", str(directory), "--port-file", str(port_file), *extra],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                _stop_process(self.proc)
                raise RuntimeError(f"{kind} server did not start:\n{_tail(self.log)}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"

    def post(self, path: str) -> dict[str, Any]:
        req = urllib.request.Request(f"{self.url}{path}", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            return dict(json.load(r))

    def stop(self) -> None:
        _stop_process(self.proc)


class SparkDriver:
    """A peer's Spark job process, driven line by line."""

    def __init__(
        self, kind: str, directory: Path, master: str, extra: Sequence[str], module: str = MODULE
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.log = directory / "spark.log"
        env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, "--spark", kind,
                 "--dir", str(directory), "--master", master, *extra],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env,
            )  # fmt: skip
        self._expect("ready")

    def _expect(self, word: str) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode().strip()
        if not line.startswith(word):
            _stop_process(self.proc)
            raise RuntimeError(
                f"peer Spark job: expected {word!r}, got {line!r}\n{_tail(self.log)}"
            )
        return line

    def command(self, cmd: str, answer: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{cmd}\n".encode())
        self.proc.stdin.flush()
        return self._expect(answer)

    def stop(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.write(b"quit\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                _stop_process(self.proc)


# --------------------------------------------------------------------------
# PostgreSQL: Debian's binaries, a cluster of our own in a temp folder


@dataclass
class PgTools:
    bindir: Path
    jar: Path


def find_pg() -> PgTools | str:
    """Debian's PostgreSQL binaries and JDBC jar, or what is missing and how to get it."""
    missing = []
    bindir = None

    def version(path: str) -> tuple[int, ...]:
        name = Path(path).parent.name
        return tuple(int(p) for p in name.split(".") if p.isdigit()) or (0,)

    for cand in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version, reverse=True):
        if all(os.access(Path(cand) / b, os.X_OK) for b in ("initdb", "pg_ctl", "postgres")):
            bindir = Path(cand)
            break
    if bindir is None and shutil.which("pg_ctl") and shutil.which("initdb"):
        bindir = Path(str(shutil.which("pg_ctl"))).parent
    if bindir is None:
        missing.append("pg_ctl/initdb (Debian package postgresql)")
    jar = None
    env_jar = os.environ.get("PG_JDBC_JAR")
    jars = [env_jar] if env_jar else []
    jars.append("/usr/share/java/postgresql.jar")
    jars += sorted(glob.glob("/usr/share/java/postgresql*.jar"))
    for cand in jars:
        if cand and Path(cand).is_file():
            jar = Path(cand).resolve()
            break
    if jar is None:
        missing.append("the PostgreSQL JDBC jar (Debian package libpostgresql-jdbc-java)")
    try:
        import asyncpg  # noqa: F401
    except ImportError:
        missing.append("asyncpg (pip install -e '.[dev]')")
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            missing.append("the postgres user (Debian package postgresql creates it)")
    if missing:
        return f"missing {', '.join(missing)}; install with: {PG_INSTALL}"
    assert bindir is not None and jar is not None
    return PgTools(bindir, jar)


class PgCluster:
    """initdb + pg_ctl in a temp folder; as root, run as the ``postgres`` user."""

    def __init__(self, tools: PgTools) -> None:
        from bench.bench_cdc import _free_port

        self.tools = tools
        self.port = _free_port()
        # /tmp, not the bench folder: the postgres user must be able to reach it.
        self.root = Path(tempfile.mkdtemp(prefix="bench-pipeline-pg-"))
        self.user = "postgres" if os.geteuid() == 0 else None
        if self.user:
            pw = pwd.getpwnam(self.user)
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"

    def _run(self, *argv: str) -> None:
        proc = subprocess.run(
            [str(self.tools.bindir / argv[0]), *argv[1:]],
            capture_output=True,
            user=self.user,
            cwd=self.root,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{argv[0]} failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}"
                f"\n{_tail(self.log)}"
            )

    def start(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", PG_USER, "-A", "trust", "-E", "UTF8",
                  "--locale=C", "--no-sync")  # fmt: skip
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.root}'",
            "fsync": "on",
            "synchronous_commit": "on",
            "max_wal_size": "'4GB'",
            "logging_collector": "off",
        }
        with open(self.data / "postgresql.conf", "a") as f:
            f.write("".join(f"{k} = {v}\n" for k, v in settings.items()))
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "120", "start")

    @property
    def postmaster(self) -> int:
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)


# --------------------------------------------------------------------------
# The sides, as the bench drives them


class Side:
    name = ""
    url = ""
    table = Path()
    fmt = "parquet"  # the table's format (--format)
    reference: tuple[float, float] | None = None  # landing: (availableNow s, its CPU s)

    def start(self) -> None:
        raise NotImplementedError

    def cpu(self) -> dict[str, float]:
        """Cumulative CPU seconds per group (producers excluded)."""
        raise NotImplementedError

    def drain(self, expected: int) -> None:
        """Return once ``expected`` events (since the start) are visible."""
        raise NotImplementedError

    def stream(self, interval_ms: int) -> None:
        pass

    def stop_stream(self) -> None:
        pass

    def snapshot(self) -> Any:
        raise NotImplementedError

    def batches(self) -> int | None:
        """Micro-batches committed so far (None: the side does not count them)."""
        return None

    def need(self, first_lsn: int, last_lsn: int, first_event: int, count: int) -> Any:
        return last_lsn

    def covered(self, snap: Any, need: Any) -> bool:
        return bool(snap >= need)

    def stop(self) -> None:
        raise NotImplementedError


class EventplaneSide(Side):
    name = "eventplane"

    def __init__(
        self,
        root: Path,
        master: str,
        interval_ms: int,
        src: Path | None = None,
        python: str = sys.executable,
        fmt: str = "parquet",
    ) -> None:
        self.root, self.master, self.interval_ms = root, master, interval_ms
        self.fmt = fmt
        # ``--baseline``: the daemon runs from this source tree instead of ours,
        # with ``--baseline-python``'s interpreter.
        self.src, self.python = src, python
        if src is not None:
            self.name = "baseline"
        self.d: Any = None

    def start(self) -> None:
        from bench.bench_cdc import start_daemon

        # The stream's table format (docs/cdc.md, "Table formats"); either way the
        # rows are visible once the stream's ledger has committed them. Delta is
        # the default here; a --baseline tree's Parquet is left unsaid (it may
        # predate the key, and a tree from before Delta was the default takes it).
        baseline_parquet = self.src is not None and self.fmt == "parquet"
        extra = "" if baseline_parquet else f'format = "{self.fmt}"'
        self.d = start_daemon(
            self.root,
            self.master,
            self.interval_ms,
            100_000,
            extra,
            src=self.src,
            python=self.python,
        )
        self.url, self.table = self.d.ingest, self.d.table

    def cpu(self) -> dict[str, float]:
        own = own_cpu(self.d.proc.pid)
        return {"server": own, "spark": tree_cpu(self.d.proc.pid) - own}

    def jvm_threads(self) -> dict[str, float]:
        """The daemon's JVM's CPU seconds so far, per thread kind (bench.jvm_threads)."""
        from bench import jvm_threads

        jvm = jvm_threads.find_jvm(self.d.proc.pid)
        return jvm_threads.sample(jvm) if jvm is not None else {}

    def drain(self, expected: int) -> None:
        from bench.bench_cdc import _ledger_state

        deadline = time.monotonic() + 1800
        while _ledger_state(self.table)[0] < expected:
            if self.d.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon: rows not visible:\n{self.d.tail()}")
            time.sleep(POLL_S)

    def snapshot(self) -> Any:
        from bench.bench_cdc import _ledger_state

        return _ledger_state(self.table)[1]

    def batches(self) -> int | None:
        from daemon.table.ledger import read_ledger

        ledger = read_ledger(self.table)
        return ledger.last_batch_id if ledger else 0

    def need(self, first_lsn: int, last_lsn: int, first_event: int, count: int) -> Any:
        from bench.bench_cdc import _needs

        return _needs(first_lsn, event_keys(first_event, count))

    def covered(self, snap: Any, need: Any) -> bool:
        return all(snap.get(c, 0) >= lsn for c, lsn in need.items())

    def stop(self) -> None:
        from bench.bench_cdc import stop_daemon

        if self.d is not None:
            stop_daemon(self.d)


class LandingSide(Side):
    name = "landing"

    def __init__(self, root: Path, master: str, rotate_ms: int, fmt: str = "parquet") -> None:
        self.root, self.master, self.rotate_ms, self.fmt = root, master, rotate_ms, fmt
        self.table = root / "table"
        self.server: ServerProc | None = None
        self.spark: SparkDriver | None = None

    def start(self) -> None:
        self.server = ServerProc("landing", self.root, ["--rotate-ms", str(self.rotate_ms)])
        self.url = self.server.url
        self.spark = SparkDriver("landing", self.root, self.master, ["--format", self.fmt])

    def cpu(self) -> dict[str, float]:
        assert self.server and self.spark
        return {"server": tree_cpu(self.server.proc.pid), "spark": tree_cpu(self.spark.proc.pid)}

    def drain(self, expected: int) -> None:
        assert self.server and self.spark
        self.server.post("/rotate")
        cpu = tree_cpu(self.spark.proc.pid)
        seconds = float(self.spark.command("drain", "done").split()[1])
        self.reference = (seconds, tree_cpu(self.spark.proc.pid) - cpu)

    def stream(self, interval_ms: int) -> None:
        assert self.spark
        self.spark.command(f"stream {interval_ms}", "streaming")

    def stop_stream(self) -> None:
        assert self.spark
        self.spark.command("stop", "stopped")

    def snapshot(self) -> Any:
        try:
            return int((self.root / "visible").read_text() or 0)
        except (OSError, ValueError):
            return 0

    def stop(self) -> None:
        for p in (self.spark, self.server):
            if p is not None:
                p.stop()


class OutboxSide(Side):
    name = "outbox"

    def __init__(self, root: Path, master: str, tools: PgTools, fmt: str = "parquet") -> None:
        self.root, self.master, self.tools, self.fmt = root, master, tools, fmt
        self.table = root / "table"
        self.pg: PgCluster | None = None
        self.server: ServerProc | None = None
        self.spark: SparkDriver | None = None

    def start(self) -> None:
        self.pg = PgCluster(self.tools)
        self.pg.start()
        port = ["--pg-port", str(self.pg.port)]
        self.server = ServerProc("outbox", self.root, port)
        self.url = self.server.url
        jar = ["--jar", str(self.tools.jar), "--format", self.fmt]
        self.spark = SparkDriver("outbox", self.root, self.master, [*port, *jar])

    def cpu(self) -> dict[str, float]:
        assert self.server and self.spark and self.pg
        return {
            "server": tree_cpu(self.server.proc.pid),
            "spark": tree_cpu(self.spark.proc.pid),
            "database": tree_cpu(self.pg.postmaster),
        }

    def drain(self, expected: int) -> None:
        assert self.spark
        self.spark.command("drain", "done")

    def stream(self, interval_ms: int) -> None:
        assert self.spark
        self.spark.command(f"stream {interval_ms}", "streaming")

    def stop_stream(self) -> None:
        assert self.spark
        self.spark.command("stop", "stopped")

    def snapshot(self) -> Any:
        try:
            return int((self.root / "high_id").read_text() or 0)
        except (OSError, ValueError):
            return 0

    def stop(self) -> None:
        for p in (self.spark, self.server):
            if p is not None:
                p.stop()
        if self.pg is not None:
            self.pg.stop()


# --------------------------------------------------------------------------
# Running a side


@dataclass
class SideResult:
    name: str
    events: int = 0
    acked_s: float = 0.0
    visible_s: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    offered: int = 0
    achieved: float = 0.0
    reference: tuple[float, float] | None = None
    rows_checked: int | None = None
    # Micro-batches committed in the throughput run and in the latency run.
    batches: tuple[int, int] | None = None
    # CPU seconds per wall second over the latency run (its warm-up included,
    # producers not): what the side's freshness at that rate costs.
    latency_cores: float | None = None
    # ``--jvm-threads`` (eventplane sides): the JVM's CPU per thread kind from
    # session ready to the first batch committed, over the rest of the warm-up,
    # and over the throughput run; the first batch's rows and when it was
    # committed (s after the warm-up's first request).
    jvm: dict[str, dict[str, float]] = field(default_factory=dict)
    first_batch: dict[str, float] = field(default_factory=dict)
    error: str = ""
    skipped: str = ""

    @property
    def rate(self) -> float:
        return self.events / self.visible_s if self.visible_s else 0.0

    @property
    def cpu_total(self) -> float:
        return sum(self.cpu.values())

    def per_million(self, seconds: float) -> float:
        return seconds * 1e6 / self.events if self.events else 0.0


@dataclass
class Plan:
    warm: int
    run_file: Path
    run_first: int
    events: int
    lat_file: Path
    lat_first: int
    lat_events: int
    lat_warm_requests: int
    clients: int
    rate: int
    interval_ms: int
    jvm_threads: bool = False
    # The warm-up's parts: (events file, events), each drained before the next.
    warm_parts: tuple[tuple[Path, int], ...] = ()


def count_rows(table: Path, fmt: str = "parquet") -> int:
    """Rows in the table: Parquet, its data files' footers (``_``/``.`` paths
    skipped); Delta, the files of its current snapshot, from the Delta log (the
    folder may hold files no longer in the table)."""
    if fmt == "delta":
        import deltalake

        return int(deltalake.DeltaTable(str(table)).to_pyarrow_dataset().count_rows())
    import pyarrow.parquet as pq

    n = 0
    for f in table.rglob("*.parquet"):
        rel = f.relative_to(table).parts
        if any(p.startswith(("_", ".")) for p in rel):
            continue
        n += pq.ParquetFile(f).metadata.num_rows
    return n


def run_side(side: Side, plan: Plan, work: Path, say: Callable[[str], None]) -> SideResult:
    res = SideResult(side.name)
    say(f"{side.name}: starting ...")
    starting = time.time()
    side.start()
    ready_s = time.time() - starting
    watch = plan.jvm_threads and isinstance(side, EventplaneSide)
    jvm: list[dict[str, float]] = []
    first: dict[str, float] = {}
    stop_watch = threading.Event()
    watcher: threading.Thread | None = None
    if watch:
        from daemon.table.ledger import read_ledger

        assert isinstance(side, EventplaneSide)
        ep = side
        jvm.append(ep.jvm_threads())
        began = time.time()

        def first_batch() -> None:
            # The first batch after start: its run time, when it became visible,
            # and the JVM's CPU up to then.
            # One last look after the warm-up's drain: a first batch that took
            # every warm-up row commits just before the drain returns.
            last = False
            while not last:
                last = stop_watch.is_set()
                try:
                    ledger = read_ledger(ep.table)
                except Exception:  # mid-replace: read again next poll
                    ledger = None
                if ledger is not None and ledger.last_batch_id:
                    jvm.append(ep.jvm_threads())
                    first["visible_s"] = time.time() - began
                    first["ready_s"] = ready_s
                    first["rows"] = float(ledger.rows_total)
                    return
                stop_watch.wait(POLL_S)

        watcher = threading.Thread(target=first_batch, name="bench-first-batch", daemon=True)
        watcher.start()
    parts = plan.warm_parts
    say(f"{side.name}: warm-up, {plan.warm:,} events in {len(parts)} drains ...")
    # Several drains: each side's JVM runs its commit path a few times before
    # the timed run (a peer's first Delta commits in a new JVM take 3-13 s).
    warmed = 0
    for part, count in parts:
        run_producers(side.url, part, REQUEST_EVENTS, plan.clients, 0, work / "warm.json")
        warmed += count
        side.drain(warmed)
    if watcher is not None:
        stop_watch.set()
        watcher.join()

    say(f"{side.name}: throughput, {plan.events:,} events ...")
    if watch:
        jvm.append(side.jvm_threads())  # type: ignore[attr-defined]
    before = side.cpu()
    batches_before = side.batches()
    got = run_producers(side.url, plan.run_file, REQUEST_EVENTS, plan.clients, 0, work / "run.json")
    side.drain(plan.warm + plan.events)
    done = time.time()
    after = side.cpu()
    batches_run = side.batches()
    if watch:
        from bench import jvm_threads

        jvm.append(side.jvm_threads())  # type: ignore[attr-defined]
        if len(jvm) == 4:
            res.jvm["start to first batch"] = jvm_threads.diff(jvm[0], jvm[1])
            res.jvm["rest of the warm-up"] = jvm_threads.diff(jvm[1], jvm[2])
        res.jvm["throughput run"] = jvm_threads.diff(jvm[-2], jvm[-1])
        res.first_batch = first
    res.events = plan.events
    res.acked_s = got["acked"] - got["started"]
    res.visible_s = done - got["started"]
    res.cpu = {k: after[k] - before[k] for k in after}
    res.cpu["producers"] = float(got["cpu"])
    res.reference = side.reference
    say(
        f"  acknowledged after {res.acked_s:.2f} s, visible after {res.visible_s:.2f} s; CPU s: "
        + ", ".join(f"{k} {v:.2f}" for k, v in res.cpu.items())
        + (
            f"; {batches_run - batches_before} batches"
            if batches_run is not None and batches_before is not None
            else ""
        )
    )

    say(f"{side.name}: latency at {plan.rate:,} events/s ...")
    side.stream(plan.interval_ms)
    snaps: list[tuple[float, Any]] = []
    halt = threading.Event()

    def poll() -> None:
        while not halt.is_set():
            snaps.append((time.time(), side.snapshot()))
            halt.wait(POLL_S)

    poller = threading.Thread(target=poll, name="bench-visible", daemon=True)
    poller.start()
    lat_cpu, lat_t0 = side.cpu(), time.monotonic()
    try:
        got = run_producers(
            side.url, plan.lat_file, LATENCY_REQUEST_EVENTS, 1, plan.rate, work / "lat.json"
        )
        reqs = got["requests"]
        needs = [
            side.need(
                int(r[2]),
                int(r[3]),
                plan.lat_first + i * LATENCY_REQUEST_EVENTS,
                LATENCY_REQUEST_EVENTS,
            )
            for i, r in enumerate(reqs)
        ]
        deadline = time.monotonic() + 600
        while not (snaps and all(side.covered(snaps[-1][1], n) for n in needs)):
            if time.monotonic() > deadline:
                raise RuntimeError("latency run: rows not visible after 600 s")
            time.sleep(POLL_S)
        lat_cpu_end, lat_t1 = side.cpu(), time.monotonic()
        res.latency_cores = sum(lat_cpu_end[k] - lat_cpu[k] for k in lat_cpu) / (lat_t1 - lat_t0)
        time.sleep(2 * POLL_S)
    finally:
        halt.set()
        poller.join()
        side.stop_stream()
    batches_lat = side.batches()
    if batches_before is not None and batches_run is not None and batches_lat is not None:
        res.batches = (batches_run - batches_before, batches_lat - batches_run)
    res.offered = plan.rate
    res.achieved = plan.lat_events / (got["acked"] - got["started"])
    times = [t for t, _s in snaps]
    for i, (r, need) in enumerate(zip(reqs, needs, strict=True)):
        if i < plan.lat_warm_requests:
            continue
        due = float(r[0])
        j = bisect.bisect_left(times, due)
        while j < len(snaps) and not side.covered(snaps[j][1], need):
            j += 1
        if j == len(snaps):
            raise RuntimeError(f"{side.name}: request {i} never became visible")
        res.latencies.append(times[j] - due)
    total = plan.warm + plan.events + plan.lat_events
    if not isinstance(side, EventplaneSide):
        side.stop()  # the peers' files are complete once their processes end
    res.rows_checked = count_rows(side.table, side.fmt)
    if res.rows_checked != total:
        res.error = f"table holds {res.rows_checked:,} rows, {total:,} were sent"
    return res


# --------------------------------------------------------------------------
# Report


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def best_of(results: Iterable[SideResult]) -> list[SideResult]:
    """Per side, in first-seen order: the fastest round's figures (time and its CPU)
    with the latencies of the round whose p99 was lowest."""
    by: dict[str, list[SideResult]] = {}
    for r in results:
        by.setdefault(r.name, []).append(r)
    out = []
    for runs in by.values():
        ok = [r for r in runs if r.events and not r.error]
        if not ok:
            out.append(runs[0])
            continue
        best = min(ok, key=lambda r: r.visible_s)
        low = min(ok, key=lambda r: pct(r.latencies, 0.99) if r.latencies else float("inf"))
        out.append(
            dataclasses.replace(
                best,
                latencies=low.latencies,
                achieved=low.achieved,
                latency_cores=low.latency_cores,
            )
        )
    return out


def _as_json(r: SideResult) -> dict[str, Any]:
    return {
        "name": r.name,
        "events": r.events,
        "acked_s": r.acked_s,
        "visible_s": r.visible_s,
        "events_per_s": r.rate,
        "cpu_s": r.cpu,
        "cpu_s_per_million": r.per_million(r.cpu_total),
        "latency_p50_s": pct(r.latencies, 0.5) if r.latencies else None,
        "latency_p99_s": pct(r.latencies, 0.99) if r.latencies else None,
        "latency_requests": len(r.latencies),
        "latencies_s": r.latencies,
        "reference": r.reference,
        "rows_checked": r.rows_checked,
        "batches": r.batches,
        "latency_cores": r.latency_cores,
        "jvm_threads": r.jvm,
        "first_batch": r.first_batch,
        "error": r.error,
        "skipped": r.skipped,
    }


def render_jvm(rounds: Sequence[tuple[int, SideResult]], events: int) -> str:
    """``--jvm-threads``: per eventplane round, the JVM's CPU by thread kind."""
    from bench import jvm_threads

    out = ["the daemon's JVM by thread (--jvm-threads):"]
    for n, r in rounds:
        if not r.jvm:
            continue
        fb = r.first_batch
        if fb:
            out.append(
                f"\nround {n}, {r.name}: Spark ready {fb['ready_s']:.2f} s after the daemon "
                f"started; first batch committed {fb['visible_s']:.2f} s after the "
                f"warm-up's first request ({fb['rows']:,.0f} rows committed then)"
            )
        for phase, delta in r.jvm.items():
            per = events if phase == "throughput run" else 0
            out.append("")
            out.append(jvm_threads.render(delta, per, f"round {n}, {r.name}, {phase}:"))
    return "\n".join(out)


def render_rounds(rounds: Sequence[tuple[int, SideResult]]) -> str:
    out = [
        "every round:",
        "",
        "| round | side | acked s | wall s | CPU s/M (server / Spark) | batches (run / latency) "
        "| p50 ms | p99 ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n, r in rounds:
        if r.events:
            cpu = " / ".join(f"{r.per_million(r.cpu.get(g, 0.0)):.1f}" for g in ("server", "spark"))
            batches = f"{r.batches[0]} / {r.batches[1]}" if r.batches else "-"
            out.append(
                f"| {n} | {r.name} | {r.acked_s:.2f} | {r.visible_s:.2f} "
                f"| {r.per_million(r.cpu_total):.1f} ({cpu}) | {batches} "
                f"| {pct(r.latencies, 0.5) * 1000:,.0f} | {pct(r.latencies, 0.99) * 1000:,.0f} |"
            )
        else:
            out.append(f"| {n} | {r.name} | {r.skipped or r.error} | | | | | |")
    return "\n".join(out)


def render(results: Sequence[SideResult], args: argparse.Namespace) -> str:
    ep = next((r for r in results if r.name == "eventplane" and not r.error), None)
    out = [
        f"{args.events:,} events per side ({REQUEST_EVENTS} per request, {args.clients} "
        f"clients, bench_cdc's ~150-byte events, 4 collections, keys reused), Spark "
        f"{args.master}, interval {args.interval_ms} ms, landing rotation {args.rotate_ms} ms; "
        f"{os.cpu_count()} CPUs; best of {args.rounds} round(s); every side writes a "
        f"{TABLE_FORMATS[args.format]} table partitioned by collection (--format {args.format})",
        "",
        "| side | wall s | events/s | ep x | CPU s/M: server | Spark | database | producers "
        "| total | ep x |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = []
    for r in results:
        if r.skipped:
            out.append(f"| {LABELS[r.name]} | skipped: {r.skipped} |||||||||")
            continue
        if r.error and not r.events:
            out.append(f"| {LABELS[r.name]} | failed: {r.error} |||||||||")
            continue
        rows.append(r)
        cpu = [r.per_million(r.cpu.get(g, 0.0)) for g in CPU_GROUPS]
        total = r.per_million(r.cpu_total)
        t_ratio = f"{ep.rate / r.rate:.2f}x" if ep and r.rate else ""
        c_ratio = f"{total / ep.per_million(ep.cpu_total):.2f}x" if ep and ep.cpu_total else ""
        cells = " | ".join(f"{c:.1f}" if c else "-" for c in cpu)
        out.append(
            f"| {LABELS[r.name]} | {r.visible_s:.2f} | {r.rate:,.0f} | {t_ratio} | {cells} "
            f"| {total:.1f} | {c_ratio} |"
        )
        if r.reference is not None:
            s, c = r.reference
            rate = r.events / s if s else 0.0
            t_ratio = f"{ep.rate / rate:.2f}x" if ep and rate else ""
            c_ratio = f"{r.per_million(c) / ep.per_million(ep.cpu_total):.2f}x" if ep else ""
            out.append(
                f"| {LABELS['reference']} | {s:.2f} | {rate:,.0f} | {t_ratio} | - | "
                f"{r.per_million(c):.1f} | - | - | {r.per_million(c):.1f} | {c_ratio} |"
            )
    out += [
        "",
        "(wall s: first request -> all rows visible; ep x: eventplane's events/s over the "
        "side's, and the side's CPU over eventplane's: above 1 eventplane is better)",
        "",
        f"ingest-to-visible latency, open loop at {args.rate:,} events/s in requests of "
        f"{LATENCY_REQUEST_EVENTS}, {args.latency_seconds:g} s measured after "
        f"{args.latency_warmup_seconds:g} s:",
        "",
        "| side | requests | achieved/s | p50 ms | p99 ms | max ms | p99 ep x | CPU cores |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p99 = pct(r.latencies, 0.99)
        ratio = f"{p99 / pct(ep.latencies, 0.99):.2f}x" if ep and ep.latencies else ""
        cores = "-" if r.latency_cores is None else f"{r.latency_cores:.2f}"
        out.append(
            f"| {LABELS[r.name]} | {len(r.latencies)} | {r.achieved:,.0f} "
            f"| {pct(r.latencies, 0.5) * 1000:,.0f} | {p99 * 1000:,.0f} "
            f"| {max(r.latencies, default=float('nan')) * 1000:,.0f} | {ratio} | {cores} |"
        )
    peers = [r for r in rows if r.name not in ("eventplane", "baseline")]
    if ep is not None and peers:
        best_rate = max(r.rate for r in peers)
        best_p99 = min(pct(r.latencies, 0.99) for r in peers)
        ep_cpu = ep.per_million(ep.cpu_total)
        low_cpu = min(r.per_million(r.cpu_total) for r in peers)
        ep_p99 = pct(ep.latencies, 0.99)
        verdict = {True: "met", False: "MISSED"}
        out += [
            "",
            "targets:",
            f"- throughput >= 1.0x the best peer: {ep.rate / best_rate:.2f}x "
            f"({verdict[ep.rate >= best_rate]})",
            f"- p99 at {args.rate:,} events/s <= 1/3 of the best peer's: {ep_p99 * 1000:,.0f} ms "
            f"vs {best_p99 * 1000:,.0f} ms, {ep_p99 / best_p99:.2f} of it "
            f"({verdict[ep_p99 * 3 <= best_p99]})",
            f"- CPU s per million events below every peer's: {ep_cpu:.1f} vs {low_cpu:.1f} "
            f"({verdict[ep_cpu < low_cpu]})",
        ]
    return "\n".join(out)


# --------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_pipeline", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--events", type=int, default=1_000_000, help="throughput run (1000000)")
    p.add_argument("--warmup-events", type=int, default=200_000, help="untimed first (200000)")
    p.add_argument(
        "--warmup-drains", type=int, default=4, help="warm-up in this many drained parts (4)"
    )
    p.add_argument("--clients", type=int, default=8, help="closed-loop producers (8)")
    p.add_argument("--rate", type=int, default=20_000, help="latency run events/s (20000)")
    p.add_argument("--latency-seconds", type=float, default=10.0)
    p.add_argument("--latency-warmup-seconds", type=float, default=5.0)
    p.add_argument(
        "--interval-ms",
        type=int,
        default=1000,
        help="eventplane's microbatch.interval_ms, the landing query's processingTime and "
        "the outbox job's pass interval (1000, the shipped default)",
    )
    p.add_argument("--rotate-ms", type=int, default=100, help="landing file rotation (100)")
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated subset of peers")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="parquet",
        help="the table every side writes: Parquet folders with VARIANT payloads, or a Delta "
        "Lake table with the payloads as JSON text (needs `make delta-jars`) (parquet)",
    )
    p.add_argument("--no-eventplane", action="store_true", help="run the peers only")
    p.add_argument(
        "--baseline",
        type=Path,
        help="also run eventplane from this source tree (for example `git archive` of an "
        "older commit, unpacked), as the side 'baseline', taking turns with the others: "
        "a before/after comparison in one run",
    )
    p.add_argument(
        "--baseline-python",
        default=sys.executable,
        help="the interpreter the baseline's daemon runs with, for example the baseline "
        "tree's own .venv/bin/python to compare another PySpark (default: this one)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every side this many times, in reverse order every other round; the "
        "table shows each side's fastest round and its lowest p99 (1)",
    )
    p.add_argument(
        "--jvm-threads",
        action="store_true",
        help="eventplane sides: print the daemon JVM's CPU by thread kind (JIT, GC, "
        "Spark tasks, ...) from start to the first batch, over the warm-up and over "
        "the throughput run, and when the first batch committed",
    )
    p.add_argument("--master", default="local[*]")
    p.add_argument("--dir", type=Path, help="work folder, kept (default: a temp folder)")
    p.add_argument("--json", type=Path, help="also write the results here")
    # Internal: the subprocesses.
    p.add_argument("--produce", help=argparse.SUPPRESS)
    p.add_argument("--events-file", help=argparse.SUPPRESS)
    p.add_argument("--per-request", type=int, default=REQUEST_EVENTS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--serve", choices=PEERS, help=argparse.SUPPRESS)
    p.add_argument("--spark", choices=PEERS, help=argparse.SUPPRESS)
    p.add_argument("--port-file", help=argparse.SUPPRESS)
    p.add_argument("--pg-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--jar", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.produce:
        return produce(args)
    if args.serve:
        return serve(args)
    if args.spark:
        return spark_job(args)
    if args.format == "delta":
        from daemon.spark import deltajars

        missing = deltajars.missing()
        if missing:
            p.exit(2, deltajars.missing_message(missing) + "\n")

    peers = [x.strip() for x in args.peers.split(",") if x.strip()]
    unknown = [x for x in peers if x not in PEERS]
    if unknown:
        p.error(f"unknown peer(s) {unknown}; choose from {', '.join(PEERS)}")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-pipeline-", dir=args.dir))
    load_before = load_average()
    results: list[SideResult] = []
    rounds: list[tuple[int, SideResult]] = []
    try:
        say(f"writing the events ({load_before} load average) ...")
        warm, n = args.warmup_events, args.events
        lat_requests = max(
            1,
            round(
                args.rate
                * (args.latency_seconds + args.latency_warmup_seconds)
                / LATENCY_REQUEST_EVENTS
            ),
        )
        plan = Plan(
            warm, root / "run.ndjson", warm + 1, n,
            root / "lat.ndjson", warm + n + 1, lat_requests * LATENCY_REQUEST_EVENTS,
            round(args.rate * args.latency_warmup_seconds / LATENCY_REQUEST_EVENTS),
            args.clients, args.rate, args.interval_ms, args.jvm_threads,
        )  # fmt: skip
        k = max(1, args.warmup_drains)
        cuts = [warm * i // k for i in range(k + 1)]
        plan.warm_parts = tuple(
            (root / f"warm{i}.ndjson", cuts[i + 1] - cuts[i])
            for i in range(k)
            if cuts[i + 1] > cuts[i]
        )
        for i, (part, count) in enumerate(plan.warm_parts):
            write_events(part, 1 + cuts[i], count)
        write_events(plan.run_file, plan.run_first, n)
        write_events(plan.lat_file, plan.lat_first, plan.lat_events)

        tools = find_pg() if "outbox" in peers else None
        if isinstance(tools, str):
            say(f"outbox peer skipped: {tools}")

        def make_sides(where: Path) -> list[Side | SideResult]:
            sides: list[Side | SideResult] = []
            if not args.no_eventplane:
                sides.append(
                    EventplaneSide(
                        where / "eventplane", args.master, args.interval_ms, fmt=args.format
                    )
                )
            if args.baseline is not None:
                sides.append(
                    EventplaneSide(
                        where / "baseline",
                        args.master,
                        args.interval_ms,
                        args.baseline.resolve(),
                        # The daemon starts in the baseline's folder: a relative path
                        # is taken from here.
                        os.path.abspath(args.baseline_python)
                        if os.sep in args.baseline_python
                        else args.baseline_python,
                        args.format,
                    )
                )
            if "landing" in peers:
                sides.append(
                    LandingSide(where / "landing", args.master, args.rotate_ms, args.format)
                )
            if isinstance(tools, str):
                sides.append(SideResult("outbox", skipped=tools))
            elif tools is not None:
                sides.append(OutboxSide(where / "outbox", args.master, tools, args.format))
            return sides

        for n in range(args.rounds):
            # Sides take turns in reverse order every other round: load from other
            # work on a shared machine drifts over minutes.
            sides = make_sides(root / f"round{n + 1}")
            for side in sides if n % 2 == 0 else sides[::-1]:
                if isinstance(side, SideResult):
                    rounds.append((n + 1, side))
                    continue
                say(f"round {n + 1} of {args.rounds}:")
                work = root / f"round{n + 1}" / f"{side.name}-producers"
                work.mkdir(parents=True)
                try:
                    rounds.append((n + 1, run_side(side, plan, work, say)))
                except Exception as exc:  # one side failing is reported, the others still run
                    say(f"{side.name} failed: {exc}")
                    failed = SideResult(side.name, error=f"{type(exc).__name__}: {exc}")
                    rounds.append((n + 1, failed))
                finally:
                    side.stop()
        results = best_of(r for _n, r in rounds)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    load_after = load_average()
    print(render(results, args))
    if args.rounds > 1:
        print("\n" + render_rounds(rounds))
    if args.jvm_threads:
        print("\n" + render_jvm(rounds, args.events))
    print(f"\nload average before: {load_before}; after: {load_after}")
    if args.json:
        doc = {
            "format": args.format,
            "load_average": {"before": load_before, "after": load_after},
            "args": {k: str(v) for k, v in vars(args).items()},
            "sides": [_as_json(r) for r in results],  # best of the rounds
            "rounds": [{"round": n, **_as_json(r)} for n, r in rounds],
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    errors = [(n, r) for n, r in rounds if r.error]
    for n, r in errors:
        print(f"ERROR: round {n}, {r.name}: {r.error}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
