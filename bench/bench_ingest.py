"""HTTP ingest benchmark: eventplane's ingest against peers behind the same HTTP, same run.

Every server runs in its own subprocess (so the client's CPU is not counted)
on loopback, with fsync on, and gets the same NDJSON bodies: 1000 events of
about 150 bytes each, ``--clients`` concurrent producers.

Servers:

- ``eventplane``: :class:`daemon.ingest.server.IngestServer` + :class:`wal.Wal`
  (fsync "always"): validate whole, shard, encode, one append per request,
  group commit, ack after fdatasync.
- ``daemon``: the whole daemon, ``eventplane run``: the same ingest and WAL,
  plus rings, per-core consumers, micro-batch planning and watermarks (no
  CDC stream or trigger configured, so batches commit at once, without Spark).
- ``fsync``: the floor. A bare aiohttp handler that appends the body to a file
  and fdatasyncs it per request: no parsing, no validation, no group commit.
- ``sqlite``: the usual alternative. aiohttp, ``json.loads`` per line, one
  SQLite transaction per request (WAL journal, ``synchronous=FULL``).

Measured per server:

1. throughput: closed loop, each client posts its next request as soon as the
   previous one is acknowledged; events/s over ``--duration`` after warm-up;
2. ack latency p50/p99 in an open loop at half that server's throughput
   (requests are scheduled at fixed times and latency counts from the
   scheduled time, so a stall cannot hide queued requests);
3. server CPU-µs per event (user + system, all threads, from /proc/<pid>/stat)
   over the throughput run.

Run: ``python -m bench.bench_ingest`` (``--duration 3`` for a quick look;
``--repeat 3`` reports the best of three runs on a busy machine).

``--baseline TREE`` is the A/B form: each of ``--peers`` (``eventplane``,
``daemon``) from this tree and from another source tree (for example an
unpacked ``main``), ``--repeat`` closed-loop rounds alternating between the
two, medians of each and the CPU-per-event ratio, with the load average at the
start and the end.

``--keys`` measures what idempotent requests cost instead: two eventplane
ingest servers (the same code and config, de-duplication window on), one
fed requests without a key and one fed a fresh ``Idempotency-Key`` on every
request, their closed-loop runs alternating ``--repeat`` times so drift on a
shared machine hits both alike; it reports the median of each and the ratio.

``--secure`` measures what TLS and a producer token cost the same way: a
plain eventplane ingest server and one with TLS (a P-256 certificate made
with ``openssl``) and a token scoped to the bench's four collections,
closed-loop runs alternating ``--repeat`` times, medians and the ratios
(docs/security.md; aim: at most 10 % more CPU per event at 1000 events per
request). Then the TLS handshake rate, one connection after another from one
client: full handshakes, and resumed ones (the session of the previous
connection offered again).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import cpu_seconds

MiB = 1 << 20
PEERS = ("eventplane", "daemon", "fsync", "sqlite")
KEYED = "keyed"  # eventplane ingest + WAL, every request with an Idempotency-Key
KEYS_AIM = 0.95  # issue 14: keyed throughput at most 5 % lower
SECURE = "secure"  # eventplane ingest + WAL behind TLS and a producer token
SECURE_CPU_AIM = 1.10  # issue 29: TLS + token at most 10 % more CPU per event
BENCH_TOKEN = "bench-producer-token"
TARGET_EVENTS_PER_S = 250_000  # issue 3, section 7
TARGET_P99_MS = 25.0


# -- the servers (subprocess side) --------------------------------------------------


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def _serve_eventplane(
    directory: Path, port_file: Path, cores: int, secure: bool = False
) -> None:
    import hashlib

    from daemon.config import Config, DaemonConfig, IngestConfig, Listen, ProducerToken, TlsConfig
    from daemon.ingest.server import IngestServer
    from daemon.service.app import tune_gc
    from daemon.service.metrics import Metrics
    from wal import Wal

    defaults = IngestConfig()
    wal = await asyncio.to_thread(
        Wal.open,
        directory / "wal",
        segment_bytes=64 * MiB,
        fsync="always",
        fsync_interval_ms=100,
        max_group_bytes=8 * MiB,
        request_window_s=defaults.idempotency_window_s,  # as `eventplane run` opens it
        request_max_keys=defaults.idempotency_max_keys,
    )
    tls, tokens = TlsConfig(), ()
    if secure:  # the benchmark side made the certificate (_make_certificate)
        tls = TlsConfig(directory / "tls.crt", directory / "tls.key")
        digest = hashlib.sha256(BENCH_TOKEN.encode()).hexdigest()
        scope = ("orders", "customers", "payments", "shipments")  # make_bodies' collections
        tokens = (ProducerToken("bench", collections=scope, sha256=digest),)
    cfg = Config(
        daemon=DaemonConfig(data_dir=directory, cores=cores),
        ingest=IngestConfig(
            listen=Listen("127.0.0.1", 0), max_lag_events=1 << 62, tls=tls, tokens=tokens
        ),
    )
    server = IngestServer(cfg, wal, Metrics(), lag=lambda: 0)
    tune_gc()  # as `eventplane run` does
    await server.start()
    await asyncio.to_thread(port_file.write_text, str(server.port))
    await _wait_for_signal()
    await server.stop(5.0)
    await wal.aclose()


def _fsync_write(fd: int, body: bytes) -> None:
    os.write(fd, body)
    os.fdatasync(fd)


async def _serve_fsync(directory: Path, port_file: Path) -> None:
    from aiohttp import web

    fd = os.open(directory / "events.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        await asyncio.to_thread(_fsync_write, fd, body)
        return web.json_response({"accepted": body.count(b"\n")})

    await _run_app(web, handle, port_file)
    os.close(fd)


async def _serve_sqlite(directory: Path, port_file: Path) -> None:
    from aiohttp import web

    db = sqlite3.connect(directory / "events.db", check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute(
        "CREATE TABLE events (lsn INTEGER PRIMARY KEY, collection TEXT, op TEXT, key TEXT, "
        "new TEXT, old TEXT, ingest_ts_ns INTEGER)"
    )
    lock = threading.Lock()

    def store(rows: list[tuple[Any, ...]]) -> tuple[int, int]:
        with lock:
            db.execute("BEGIN")
            cur = db.executemany(
                "INSERT INTO events (collection, op, key, new, old, ingest_ts_ns) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                rows,
            )
            last = db.execute("SELECT last_insert_rowid()").fetchone()[0]
            db.execute("COMMIT")
            return last - cur.rowcount + 1, last

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        ts = time.time_ns()
        rows = []
        for line in body.splitlines():
            if line.strip():
                e = json.loads(line)
                new, old = e.get("new"), e.get("old")
                rows.append(
                    (
                        e["collection"],
                        e["op"],
                        e["key"],
                        None if new is None else json.dumps(new),
                        None if old is None else json.dumps(old),
                        ts,
                    )
                )
        first, last = await asyncio.to_thread(store, rows)
        return web.json_response({"accepted": len(rows), "first_lsn": first, "last_lsn": last})

    await _run_app(web, handle, port_file)
    db.close()


async def _run_app(web: Any, handle: Any, port_file: Path) -> None:
    app = web.Application(client_max_size=64 * MiB)
    app.router.add_post("/v1/events", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    await asyncio.to_thread(port_file.write_text, str(site.port))
    await _wait_for_signal()
    await runner.cleanup()


def serve(kind: str, directory: Path, port_file: Path, cores: int) -> int:
    import uvloop

    from daemon.service import logs

    logs.configure("warning", "console")
    if kind in ("eventplane", KEYED, SECURE):
        coro = _serve_eventplane(directory, port_file, cores, secure=kind == SECURE)
    elif kind == "fsync":
        coro = _serve_fsync(directory, port_file)
    else:
        coro = _serve_sqlite(directory, port_file)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(coro)
    return 0


# -- the client (benchmark side) -----------------------------------------------------


def make_bodies(count: int, per_request: int, seed: int = 7, payload_bytes: int = 0) -> list[bytes]:
    """Deterministic CDC-like events of about 150 bytes as NDJSON request bodies;
    with ``payload_bytes``, ``new`` holds line items up to about that many bytes."""
    rng = random.Random(seed)
    collections = ["orders", "customers", "payments", "shipments"]
    bodies = []
    n = 0
    for _ in range(count):
        lines = []
        for _ in range(per_request):
            key = f"k{rng.randrange(1_000_000):07d}"  # drawn first, as it always was
            new: dict[str, Any] = {
                "amount": round(rng.random() * 1000, 2),
                "status": "paid",
                "n": n,
            }
            if payload_bytes:
                items: list[dict[str, Any]] = []
                new["items"] = items
                while len(json.dumps(new, separators=(",", ":"))) < payload_bytes - 40:
                    items.append(
                        {"sku": f"s{rng.randrange(10**5)}", "qty": rng.randrange(1, 9),
                         "price": round(rng.random() * 100, 2)}
                    )  # fmt: skip
            e = {
                "collection": collections[n % 4],
                "op": "update",
                "key": key,
                "new": new,
                "old": {"status": "open"},
            }
            lines.append(json.dumps(e, separators=(",", ":")))
            n += 1
        bodies.append(("\n".join(lines) + "\n").encode())
    return bodies


@dataclass
class Result:
    peer: str
    events_per_s: float = 0.0
    cpu_us_per_event: float = 0.0
    latency_rate: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    achieved_rate: float = 0.0
    errors: list[str] = field(default_factory=list)
    runs: list[tuple[float, float]] = field(default_factory=list)  # --keys: (events/s, CPU)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, kind: str, workdir: Path, cores: int, tree: Path | None = None) -> None:
        """``tree``: run the server from that source tree (its ``daemon``/``wal``
        packages) instead of this one; ``--baseline`` uses it."""
        self.kind = kind
        self.keyed = kind == KEYED
        self.secure = kind == SECURE
        self.tree = tree
        self.dir = workdir / (kind if tree is None else f"{kind}-baseline")
        self.dir.mkdir(parents=True)
        if kind == "daemon":
            self._start_daemon(cores)
            return
        port_file = self.dir / "port"
        if self.secure:
            _make_certificate(self.dir)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.bench_ingest", "--serve", kind, "--dir", str(self.dir),
             "--port-file", str(port_file), "--cores", str(cores)],
            stdout=subprocess.DEVNULL,
            cwd=self.tree,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{kind} server did not start (exit {self.proc.poll()})")
            time.sleep(0.05)
        scheme = "https" if self.secure else "http"
        self.port = int(port_file.read_text())
        self.url = f"{scheme}://127.0.0.1:{self.port}/v1/events"

    def _start_daemon(self, cores: int) -> None:
        import urllib.error
        import urllib.request

        ingest, admin = _free_port(), _free_port()
        config = self.dir / "config.toml"
        config.write_text(
            f'[daemon]\ndata_dir = "data"\ncores = {cores}\n'
            f'[ingest]\nlisten = "127.0.0.1:{ingest}"\n'
            f'[admin]\nlisten = "127.0.0.1:{admin}"\n'
            '[log]\nlevel = "warning"\nformat = "json"\n'
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.cli.main", "run", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            cwd=self.tree,
        )
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"eventplane run did not get ready (exit {self.proc.poll()})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin}/readyz", timeout=1):
                    break
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        self.url = f"http://127.0.0.1:{ingest}/v1/events"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _make_certificate(directory: Path) -> None:
    """A self-signed P-256 certificate for 127.0.0.1 (its own CA), as docs/security.md
    makes them."""
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", "tls.key", "-out", "tls.crt", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        cwd=directory, check=True, capture_output=True,
    )  # fmt: skip


_NDJSON = {"Content-Type": "application/x-ndjson"}
_SECURE = {**_NDJSON, "Authorization": f"Bearer {BENCH_TOKEN}"}
_keys = iter(range(1 << 62))
_KEY_PREFIX = f"bench-{os.getpid()}-{time.time_ns()}"
# The secure server's client context (closed_loop sets it per server).
_ssl: dict[str, Any] = {}


async def _post(session: Any, url: str, body: bytes, keyed: bool = False) -> int:
    headers = {**_NDJSON, "Idempotency-Key": f"{_KEY_PREFIX}-{next(_keys)}"} if keyed else _NDJSON
    ctx = _ssl.get(url)
    if ctx is not None:
        headers = _SECURE
    async with session.post(url, data=body, headers=headers, ssl=ctx or True) as resp:
        payload = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {payload[:300]!r}")
        return int(json.loads(payload)["accepted"])


async def closed_loop(
    server: Server, bodies: list[bytes], clients: int, warmup_s: float, duration_s: float
) -> tuple[float, float]:
    """(events/s, server CPU-µs per event) with ``clients`` back-to-back producers."""
    import aiohttp

    counted = {"events": 0}
    measuring = asyncio.Event()
    stop_at = time.monotonic() + warmup_s + duration_s

    async def producer(i: int) -> None:
        async with aiohttp.ClientSession() as session:
            k = i
            while time.monotonic() < stop_at:
                n = await _post(session, server.url, bodies[k % len(bodies)], server.keyed)
                k += clients
                if measuring.is_set():
                    counted["events"] += n

    tasks = [asyncio.create_task(producer(i)) for i in range(clients)]
    await asyncio.sleep(warmup_s)
    cpu0, t0 = cpu_seconds(server.proc.pid), time.monotonic()
    measuring.set()
    await asyncio.gather(*tasks)
    cpu1, t1 = cpu_seconds(server.proc.pid), time.monotonic()
    events = counted["events"]
    return events / (t1 - t0), (cpu1 - cpu0) * 1e6 / max(events, 1)


async def open_loop(
    server: Server, bodies: list[bytes], clients: int, rate: float, duration_s: float
) -> tuple[float, float, float]:
    """(p50 ms, p99 ms, achieved events/s) at ``rate`` events/s, latency from schedule."""
    import aiohttp

    per_request = bodies[0].count(b"\n")
    interval = clients * per_request / rate  # each client's gap between requests
    latencies: list[float] = []
    done = {"events": 0}
    start = time.monotonic() + 0.2

    async def producer(i: int) -> None:
        async with aiohttp.ClientSession() as session:
            k = 0
            while True:
                due = start + (i / clients) * interval + k * interval
                if due - start > duration_s:
                    return
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                body = bodies[(i + k) % len(bodies)]
                done["events"] += await _post(session, server.url, body, server.keyed)
                latencies.append(time.monotonic() - due)
                k += 1

    t0 = time.monotonic()
    await asyncio.gather(*(producer(i) for i in range(clients)))
    elapsed = time.monotonic() - t0
    latencies.sort()
    if not latencies:
        raise RuntimeError("no request completed in the latency run")
    p50 = latencies[len(latencies) // 2] * 1e3
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3
    return p50, p99, done["events"] / elapsed


async def run_peer(kind: str, args: argparse.Namespace, workdir: Path) -> Result:
    result = Result(kind)
    bodies = make_bodies(64, args.batch, payload_bytes=args.payload_bytes)
    server = Server(kind, workdir, args.cores)
    try:
        # Best of --repeat runs: on a shared machine the best run is the one
        # least disturbed by other processes, for every server alike.
        for _ in range(args.repeat):
            eps, cpu = await closed_loop(server, bodies, args.clients, args.warmup, args.duration)
            if eps > result.events_per_s:
                result.events_per_s, result.cpu_us_per_event = eps, cpu
        result.latency_rate = result.events_per_s / 2
        for _ in range(args.repeat):
            p50, p99, achieved = await open_loop(
                server, bodies, args.clients, result.latency_rate, args.duration
            )
            if not result.achieved_rate or p99 < result.p99_ms:
                result.p50_ms, result.p99_ms, result.achieved_rate = p50, p99, achieved
    except Exception as exc:  # a peer that fails is reported, not fatal to the others
        result.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        server.stop()
    return result


LABELS = {
    "eventplane": "eventplane ingest + WAL",
    "daemon": "eventplane run (whole daemon)",
    "fsync": "aiohttp + fdatasync/request",
    "sqlite": "aiohttp + SQLite (FULL)",
    KEYED: "eventplane, Idempotency-Key",
    SECURE: "eventplane, TLS + token",
}


def _client_context(server: Server) -> Any:
    import ssl

    ctx = ssl.create_default_context(cafile=str(server.dir / "tls.crt"))
    _ssl[server.url] = ctx
    return ctx


def handshakes_per_s(server: Server, resume: bool, duration_s: float) -> float:
    """Connections per second, one after another: TLS handshake, a small GET (so a
    TLS 1.3 session ticket arrives), close; ``resume`` offers the last session."""
    import socket

    ctx = _client_context(server)
    session = None
    count = 0
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        with (
            socket.create_connection(("127.0.0.1", server.port)) as raw,
            ctx.wrap_socket(raw, server_hostname="127.0.0.1", session=session) as tls,
        ):
            tls.sendall(b"GET /nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            while tls.recv(65536):
                pass
            if resume:
                session = tls.session
        count += 1
    return count / duration_s


async def run_secure(args: argparse.Namespace, workdir: Path) -> list[Result]:
    """Plain and TLS + token eventplane ingest, closed-loop runs alternating; medians;
    then the handshake rates (full, resumed)."""
    bodies = make_bodies(64, args.batch, payload_bytes=args.payload_bytes)
    servers = [Server("eventplane", workdir, args.cores), Server(SECURE, workdir, args.cores)]
    _client_context(servers[1])
    runs: dict[str, list[tuple[float, float]]] = {s.kind: [] for s in servers}
    try:
        for _ in range(args.repeat):
            for server in servers:
                runs[server.kind].append(
                    await closed_loop(server, bodies, args.clients, args.warmup, args.duration)
                )
        rates = [
            await asyncio.to_thread(handshakes_per_s, servers[1], resume, args.duration / 2)
            for resume in (False, True)
        ]
    finally:
        for server in servers:
            server.stop()
    results = []
    for kind, got in runs.items():
        eps = sorted(e for e, _c in got)
        cpu = sorted(c for _e, c in got)
        result = Result(kind, eps[len(eps) // 2], cpu[len(cpu) // 2])
        result.runs = got
        results.append(result)
    args.handshakes = rates
    return results


def render_secure(results: list[Result], args: argparse.Namespace) -> str:
    plain, secure = results
    ratio = secure.events_per_s / max(plain.events_per_s, 1e-9)
    cpu = secure.cpu_us_per_event / max(plain.cpu_us_per_event, 1e-9)
    full, resumed = args.handshakes
    lines = [
        f"TLS + token cost: eventplane ingest + WAL, fsync on, {args.batch} events/request, "
        f"{args.clients} clients, {args.repeat} alternating runs of {args.duration:g} s, "
        f"medians; {os.cpu_count()} CPUs; load average before: {args.load_before}",
        "",
        f"{'requests':<30} {'events/s':>10} {'CPU µs/ev':>10}",
        f"{'-' * 30} {'-' * 10} {'-' * 10}",
    ]
    for r in results:
        spread = " ".join(f"{e / 1000:.0f}k" for e, _c in r.runs)
        lines.append(
            f"{LABELS[r.peer]:<30} {r.events_per_s:>10,.0f} {r.cpu_us_per_event:>10.2f}"
            f"   runs: {spread}"
        )
    verdict = "met" if cpu <= SECURE_CPU_AIM else "MISSED"
    lines += [
        "",
        f"secure / plain: {ratio:.3f}x events/s, {cpu:.3f}x CPU per event "
        f"(aim: <= {SECURE_CPU_AIM:.2f}x CPU per event: {verdict})",
        f"TLS handshakes, one client, one after another: {full:,.0f}/s full, "
        f"{resumed:,.0f}/s resumed",
    ]
    return "\n".join(lines)


async def run_keys(args: argparse.Namespace, workdir: Path) -> list[Result]:
    """Unkeyed and keyed eventplane ingest, closed-loop runs alternating; medians."""
    bodies = make_bodies(64, args.batch, payload_bytes=args.payload_bytes)
    servers = [Server("eventplane", workdir, args.cores), Server(KEYED, workdir, args.cores)]
    runs: dict[str, list[tuple[float, float]]] = {s.kind: [] for s in servers}
    try:
        for _ in range(args.repeat):
            for server in servers:
                runs[server.kind].append(
                    await closed_loop(server, bodies, args.clients, args.warmup, args.duration)
                )
    finally:
        for server in servers:
            server.stop()
    results = []
    for kind, got in runs.items():
        eps = sorted(e for e, _c in got)
        cpu = sorted(c for _e, c in got)
        result = Result(kind, eps[len(eps) // 2], cpu[len(cpu) // 2])
        result.runs = got
        results.append(result)
    return results


async def run_baseline(args: argparse.Namespace, workdir: Path) -> list[Result]:
    """Each peer from this tree and from ``--baseline``, closed-loop runs alternating
    (the first side alternating too); medians per side."""
    bodies = make_bodies(64, args.batch, payload_bytes=args.payload_bytes)
    results: list[Result] = []
    for peer in args.peer_list:
        servers = [
            Server(peer, workdir, args.cores),
            Server(peer, workdir, args.cores, args.baseline),
        ]
        runs: list[list[tuple[float, float]]] = [[], []]
        try:
            for i in range(args.repeat):
                for side in (0, 1) if i % 2 == 0 else (1, 0):
                    runs[side].append(
                        await closed_loop(
                            servers[side], bodies, args.clients, args.warmup, args.duration
                        )
                    )
        finally:
            for server in servers:
                server.stop()
        for side, got in enumerate(runs):
            eps = sorted(e for e, _c in got)
            cpu = sorted(c for _e, c in got)
            result = Result(peer if side == 0 else f"{peer} (baseline)")
            result.events_per_s, result.cpu_us_per_event = eps[len(eps) // 2], cpu[len(cpu) // 2]
            result.runs = got
            results.append(result)
    return results


def render_baseline(results: list[Result], args: argparse.Namespace) -> str:
    lines = [
        f"this tree against {args.baseline}: HTTP ingest, fsync on, {args.batch} events/request, "
        f"{args.clients} clients, {args.repeat} alternating runs of {args.duration:g} s per "
        f"side, medians; {os.cpu_count()} CPUs",
        f"load average at the start: {args.load_before}; at the end: {_load()}",
        "",
        f"{'server':<42} {'events/s':>10} {'CPU µs/ev':>10}   runs: CPU µs/ev",
        f"{'-' * 42} {'-' * 10} {'-' * 10}",
    ]
    for r in results:
        base = r.peer.removesuffix(" (baseline)")
        label = LABELS[base] + (" baseline" if r.peer != base else "")
        spread = " ".join(f"{c:.2f}" for _e, c in r.runs)
        lines.append(f"{label:<42} {r.events_per_s:>10,.0f} {r.cpu_us_per_event:>10.2f}   {spread}")
    lines.append("")
    for ours, base in zip(results[::2], results[1::2], strict=True):
        lines.append(
            f"{LABELS[ours.peer]}: this tree / baseline = "
            f"{ours.cpu_us_per_event / max(base.cpu_us_per_event, 1e-9):.3f}x CPU per event, "
            f"{ours.events_per_s / max(base.events_per_s, 1e-9):.3f}x events/s"
        )
    return "\n".join(lines)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def render_keys(results: list[Result], args: argparse.Namespace) -> str:
    plain, keyed = results
    ratio = keyed.events_per_s / max(plain.events_per_s, 1e-9)
    cpu = keyed.cpu_us_per_event / max(plain.cpu_us_per_event, 1e-9)
    lines = [
        f"Idempotency-Key cost: eventplane ingest + WAL, fsync on, {args.batch} events/request, "
        f"{args.clients} clients, {args.repeat} alternating runs of {args.duration:g} s, "
        f"medians; {os.cpu_count()} CPUs; load average before: {args.load_before}",
        "",
        f"{'requests':<30} {'events/s':>10} {'CPU µs/ev':>10}",
        f"{'-' * 30} {'-' * 10} {'-' * 10}",
    ]
    for r in results:
        spread = " ".join(f"{e / 1000:.0f}k" for e, _c in r.runs)
        lines.append(
            f"{LABELS[r.peer]:<30} {r.events_per_s:>10,.0f} {r.cpu_us_per_event:>10.2f}"
            f"   runs: {spread}"
        )
    verdict = "met" if ratio >= KEYS_AIM else "MISSED"
    lines += [
        "",
        f"keyed / unkeyed: {ratio:.3f}x events/s, {cpu:.3f}x CPU per event "
        f"(aim: >= {KEYS_AIM:.2f}x events/s: {verdict})",
    ]
    return "\n".join(lines)


def render(results: list[Result], args: argparse.Namespace) -> str:
    lines = [
        f"HTTP ingest, fsync on, {args.batch} events/request, {args.clients} clients, "
        f"{args.duration:g} s per run (best of {args.repeat}), {os.cpu_count()} CPUs "
        "(client and server share them)",
        f"load average before the run: {args.load_before}",
        "latency: open loop at half each server's events/s; p50/p99 from the scheduled send",
        "",
        f"{'server':<30} {'events/s':>10} {'CPU µs/ev':>10} "
        f"{'offered/s':>10} {'achieved/s':>10} {'p50 ms':>8} {'p99 ms':>8}",
        f"{'-' * 30} {'-' * 10} {'-' * 10} {'-' * 10} {'-' * 10} {'-' * 8} {'-' * 8}",
    ]
    for r in results:
        if r.errors:
            lines.append(f"{LABELS[r.peer]:<30} failed: {'; '.join(r.errors)}")
            continue
        lines.append(
            f"{LABELS[r.peer]:<30} {r.events_per_s:>10,.0f} {r.cpu_us_per_event:>10.2f} "
            f"{r.latency_rate:>10,.0f} {r.achieved_rate:>10,.0f} {r.p50_ms:>8.2f} {r.p99_ms:>8.2f}"
        )
    ours = next((r for r in results if r.peer == "eventplane" and not r.errors), None)
    if ours is not None:
        lines.append("")
        for r in results:
            if r.peer not in ("eventplane", "daemon") and not r.errors and r.events_per_s:
                lines.append(
                    f"eventplane vs {LABELS[r.peer]}: {ours.events_per_s / r.events_per_s:.2f}x "
                    f"events/s, {ours.cpu_us_per_event / max(r.cpu_us_per_event, 1e-9):.2f}x "
                    "CPU per event"
                )
        ok_rate = "met" if ours.events_per_s >= TARGET_EVENTS_PER_S else "MISSED"
        ok_p99 = "met" if ours.p99_ms <= TARGET_P99_MS else "MISSED"
        lines.append(
            f"targets: >= {TARGET_EVENTS_PER_S:,} events/s ({ok_rate}); "
            f"p99 <= {TARGET_P99_MS:g} ms at half rate ({ok_p99})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated subset")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1000, help="events per request")
    parser.add_argument(
        "--payload-bytes",
        type=int,
        default=0,
        help="make each event's new about this many bytes (line items); 0: about 50",
    )
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--cores", type=int, default=4, help="daemon.cores for eventplane")
    parser.add_argument("--repeat", type=int, default=1, help="report the best of N runs")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--keys", action="store_true", help="measure Idempotency-Key on every request vs none"
    )
    parser.add_argument(
        "--secure", action="store_true", help="measure TLS + a producer token vs plain"
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="A/B: also run each of --peers (eventplane, daemon) from this source tree, "
        "rounds alternating (--repeat of them); report CPU per event of both and the ratio",
    )
    parser.add_argument("--serve", choices=(*PEERS, KEYED, SECURE), help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args.serve, args.dir, args.port_file, args.cores)

    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        parser.error(f"unknown peer(s) {unknown}; choose from {', '.join(PEERS)}")
    args.load_before = _load()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-ingest-", dir=os.environ.get("BENCH_DIR")) as d:
        import uvloop

        if args.baseline is not None:
            bad = [p for p in peers if p not in ("eventplane", "daemon")]
            if bad:
                parser.error(f"--baseline runs eventplane and daemon only, not {bad}")
            args.peer_list = peers
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                results = runner.run(run_baseline(args, Path(d)))
            print(render_baseline(results, args))
            if args.json:
                args.json.write_text(json.dumps([r.__dict__ for r in results], indent=2))
            return 0
        if args.keys:
            args.repeat = max(args.repeat, 3)
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                results = runner.run(run_keys(args, Path(d)))
            print(render_keys(results, args))
            return 0
        if args.secure:
            args.repeat = max(args.repeat, 3)
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                results = runner.run(run_secure(args, Path(d)))
            print(render_secure(results, args))
            return 0
        for peer in peers:
            print(f"running {peer} ...", file=sys.stderr, flush=True)
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                results.append(runner.run(run_peer(peer, args, Path(d))))
    print(render(results, args))
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in results], indent=2))
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
