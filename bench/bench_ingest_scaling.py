"""Ingest across processes: a prototype of SO_REUSEPORT workers and one WAL owner.

A benchmark, not production code (docs/scaling.md has the design it tests).
It answers: what does splitting ingest into HTTP workers and a WAL owner cost
on this machine, and which part would bound it on a machine with more cores?

Sides, each a set of subprocesses on loopback, fsync on, the same NDJSON
bodies (1000 events of about 150 bytes, ``bench.bench_ingest.make_bodies``):

- ``today``: ``bench.bench_ingest``'s eventplane server, one process:
  :class:`daemon.ingest.server.IngestServer` + :class:`wal.Wal`.
- ``daemon`` (``--no-daemon`` skips it): ``eventplane run`` without Spark, the
  same ingest plus rings, consumers and planner: what the plane adds per event.
- ``w1``, ``w2``: one WAL owner process and 1 or 2 worker processes. Each
  worker is the daemon's own ``IngestServer`` (admission, body limits, parse,
  validate, shard, encode: steps 1-4 and 6 of ``daemon/ingest/server.py``) on
  one port shared with ``SO_REUSEPORT``; its WAL is a :class:`RemoteWal` that
  ships the request's encoded events to the owner over a Unix socket and
  waits for the owner's durable LSNs. The owner appends with the real
  ``wal.Wal`` group commit (step 5) and answers after the fdatasync, so a
  worker acknowledges only durable events (invariant 1). The owner holds the
  Idempotency-Key window (``wal/requests.py``) and the in-flight keys, so a
  retry that reaches another worker is still de-duplicated (invariant 15).
- ``w<N>floor`` (``--floor``): the same workers and a :class:`FloorOwner`
  that writes and fsyncs each message as it came, with no per-event work:
  the bound for an owner with a grouped append (docs/scaling.md, "The model").

The hand-off, one message per request each way:

1. worker -> owner: ``_REQ`` header (body length, request id, events, key
   length, digest), the key, the cores (u16 per event), the payload lengths
   (u32 per event), the payloads concatenated in request order;
2. owner: slices the payloads back into ``bytes`` (what ``Wal.append`` takes),
   claims the key, ``await wal.append(items, tag)``;
3. owner -> worker: ``_REP`` (request id, status, first LSN, last LSN).

Measured, sides alternating ``--repeat`` times in the same run:

1. per-event CPU of each part in this process (``--no-parts`` skips it: parse + validate
   + shard + encode, hand-off pack and unpack, a socket round trip of one
   request, the WAL append without and with fdatasync, records + ring push);
2. closed loop: events/s and CPU-µs per event per process group (owner,
   workers, today's single process) and of the client;
3. open loop at one fixed rate for every side: ack p50/p99;
4. the hand-off per request as the owner and the workers counted it: bytes,
   socket reads and writes;
5. a model: events/s and CPU per event for 2-16 cores from the measured parts.

``--check N`` sends N unique events through a fresh owner + 2 workers with an
``Idempotency-Key`` per request (with ``--kill-worker``, one worker SIGKILLs
itself right after handing its 5th request to the owner, before the answer; the
producers retry on the other), then reads the owner's WAL: every acknowledged
event must be there exactly once, at the LSNs its ack named, and the killed
worker's request must have been answered to its retry as a replay.

Run: ``python -m bench.bench_ingest_scaling`` (``--duration 3 --repeat 3``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain
from operator import itemgetter
from pathlib import Path
from typing import Any, Final
from zlib import crc32

from bench.bench_ingest import Server, _free_port, make_bodies
from bench.common import cpu_seconds

MiB: Final = 1 << 20
# worker -> owner: body length, request id, events, key length, digest
_REQ: Final = struct.Struct("<IQIH16s")
# owner -> worker: request id, status, first LSN, last LSN
_REP: Final = struct.Struct("<QBxxxxxxxQQ")
OK, FULL, UNAVAILABLE, KEY_REUSED = 0, 1, 2, 3
_NO_DIGEST: Final = bytes(16)
_core_of = itemgetter(0)
_payload_of = itemgetter(1)


# -- the hand-off (both sides) ----------------------------------------------------


def pack_request(
    rid: int, items: Sequence[tuple[int, bytes]], key: bytes = b"", digest: bytes = _NO_DIGEST
) -> bytes:
    """Worker side: one message for one request's encoded events (request order)."""
    payloads = list(map(_payload_of, items))
    cores = array("H", map(_core_of, items))
    lens = array("I", map(len, payloads))
    body = b"".join([key, cores.tobytes(), lens.tobytes(), *payloads])
    return _REQ.pack(len(body), rid, len(items), len(key), digest) + body


def unpack_request(message: bytes, n: int, key_len: int) -> tuple[bytes, list[tuple[int, bytes]]]:
    """Owner side: (key, items) from a message body; C-level slicing, no Python per event."""
    key = message[:key_len]
    pos = key_len
    cores = array("H")
    cores.frombytes(message[pos : pos + 2 * n])
    pos += 2 * n
    lens = array("I")
    lens.frombytes(message[pos : pos + 4 * n])
    pos += 4 * n
    starts = list(accumulate(lens, initial=pos))
    payloads = list(map(message.__getitem__, map(slice, starts, starts[1:])))
    return key, list(zip(cores, payloads, strict=True))


@dataclass
class Counters:
    """What one end of the hand-off did (written as JSON when the process stops)."""

    messages: int = 0
    bytes_in: int = 0
    reads: int = 0  # data_received calls: one per recv that returned data
    bytes_out: int = 0
    writes: int = 0  # transport.write calls
    replays: int = 0


class _Framed(asyncio.Protocol):
    """A stream of length-prefixed messages; subclasses get whole messages."""

    def __init__(self, header: struct.Struct, counters: Counters) -> None:
        self._header = header
        self._buf = bytearray()
        self.counters = counters
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        c = self.counters
        c.reads += 1
        c.bytes_in += len(data)
        buf = self._buf
        buf += data
        size = self._header.size
        pos = 0
        while len(buf) - pos >= size:
            fields = self._header.unpack_from(buf, pos)
            body_len = self._body_len(fields)
            if len(buf) - pos - size < body_len:
                break
            body = bytes(buf[pos + size : pos + size + body_len])
            pos += size + body_len
            c.messages += 1
            self.message(fields, body)
        if pos:
            del buf[:pos]

    def send(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.counters.writes += 1
            self.counters.bytes_out += len(data)
            self.transport.write(data)

    def _body_len(self, fields: tuple[Any, ...]) -> int:
        return 0

    def message(self, fields: tuple[Any, ...], body: bytes) -> None:
        raise NotImplementedError


# -- the owner (subprocess) --------------------------------------------------------


class _OwnerConn(_Framed):
    """One worker's connection to the owner."""

    def __init__(self, owner: Owner) -> None:
        super().__init__(_REQ, owner.counters)
        self._owner = owner

    def _body_len(self, fields: tuple[Any, ...]) -> int:
        return int(fields[0])

    def message(self, fields: tuple[Any, ...], body: bytes) -> None:
        _len, rid, n, key_len, digest = fields
        key, items = unpack_request(body, n, key_len)
        asyncio.get_running_loop().create_task(self._owner.store(self, rid, items, key, digest))


class KeyReused(Exception):
    """An Idempotency-Key sent again with another body (the owner answers 422)."""


class Owner:
    """The WAL owner: appends what the workers send, answers with durable LSNs.

    1. A message's items are appended with one ``wal.append`` (one frame,
       consecutive LSNs, returns after the group's fdatasync).
    2. A keyed request is claimed here, the only place that sees every
       worker's requests: a key the window holds with the same digest is
       answered with its stored LSNs; a key still in flight waits for it;
       another digest is refused. (``IngestServer._claim``, moved.)
    3. The answer goes back on the connection the request came in on; a
       worker that died meanwhile gets nothing, and its producer's retry
       finds the key.
    """

    def __init__(self, wal: Any) -> None:
        self.wal = wal
        self.counters = Counters()
        self._in_flight: dict[bytes, tuple[bytes, asyncio.Future[tuple[int, int] | None]]] = {}

    async def store(
        self, conn: _OwnerConn, rid: int, items: list[tuple[int, bytes]], key: bytes, digest: bytes
    ) -> None:
        from wal.errors import WalFullError
        from wal.format import RequestTag

        status, first, last = OK, 0, 0
        try:
            if not key:
                # Step 1. One append.
                first, last = await self.wal.append(items)
            else:
                # Step 2. The claim, then the append.
                claimed = await self._claim(key, digest)
                if claimed is None:
                    future: asyncio.Future[tuple[int, int] | None] = (
                        asyncio.get_running_loop().create_future()
                    )
                    self._in_flight[key] = (digest, future)
                    stored = None
                    try:
                        stored = await self.wal.append(items, RequestTag(key, digest))
                    finally:
                        del self._in_flight[key]
                        future.set_result(stored)
                    first, last = stored
                else:
                    self.counters.replays += 1
                    first, last = claimed
        except KeyReused:
            status = KEY_REUSED
        except WalFullError:
            status = FULL
        except Exception:
            status = UNAVAILABLE
        # Step 3. The answer.
        conn.send(_REP.pack(rid, status, first, last))

    async def _claim(self, key: bytes, digest: bytes) -> tuple[int, int] | None:
        while True:
            held = self._in_flight.get(key)
            if held is not None:
                if held[0] != digest:
                    raise KeyReused(key)
                # Stored: the window has it now; not stored: this one may store it.
                await asyncio.shield(held[1])
                continue
            entry = self.wal.find_request(key)
            if entry is None:
                return None
            if entry.digest != digest:
                raise KeyReused(key)
            return int(entry.first_lsn), int(entry.last_lsn)


async def _serve_owner(directory: Path, sock_path: Path, ready: Path, stats: Path) -> None:
    from bench.bench_ingest import _wait_for_signal
    from daemon.config import IngestConfig
    from daemon.service.app import tune_gc
    from wal import Wal

    defaults = IngestConfig()
    wal = await asyncio.to_thread(
        Wal.open,
        directory,
        segment_bytes=64 * MiB,
        fsync="always",
        fsync_interval_ms=100,
        max_group_bytes=8 * MiB,
        request_window_s=defaults.idempotency_window_s,
        request_max_keys=defaults.idempotency_max_keys,
    )
    owner = Owner(wal)
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: _OwnerConn(owner), str(sock_path))
    tune_gc()
    await asyncio.to_thread(ready.write_text, "ready")
    await _wait_for_signal()
    server.close()
    await wal.aclose()
    await asyncio.to_thread(stats.write_text, json.dumps(owner.counters.__dict__))


class _FloorConn(_Framed):
    """A worker's connection to the floor owner: whole messages, never unpacked."""

    def __init__(self, owner: FloorOwner) -> None:
        super().__init__(_REQ, owner.counters)
        self._owner = owner

    def _body_len(self, fields: tuple[Any, ...]) -> int:
        return int(fields[0])

    def message(self, fields: tuple[Any, ...], body: bytes) -> None:
        self._owner.store(self, fields[1], fields[2], body)


class FloorOwner:
    """The floor of any owner (``--floor``): no per-event work at all. Messages are
    written as they came, with a group commit (one ``writev`` + ``fdatasync`` per
    group, in a thread), and answered with counted LSNs. Not a WAL: no frames, no
    CRC, no keys. What an owner with a grouped append could approach."""

    def __init__(self, fd: int) -> None:
        self.counters = Counters()
        self._fd = fd
        self._pending: list[tuple[_FloorConn, int, int, bytes]] = []
        self._busy = False
        self._next_lsn = 1

    def store(self, conn: _FloorConn, rid: int, n: int, body: bytes) -> None:
        self._pending.append((conn, rid, n, body))
        if not self._busy:
            self._busy = True
            asyncio.get_running_loop().create_task(self._commit())

    async def _commit(self) -> None:
        while self._pending:
            group, self._pending = self._pending[:1000], self._pending[1000:]
            await asyncio.to_thread(_write_synced, self._fd, [g[3] for g in group])
            for conn, rid, n, _body in group:
                first = self._next_lsn
                self._next_lsn += n
                conn.send(_REP.pack(rid, OK, first, first + n - 1))
        self._busy = False


def _write_synced(fd: int, buffers: list[bytes]) -> None:
    size = sum(map(len, buffers))
    written = os.writev(fd, buffers)
    if written != size:  # a short write: the rest in one piece
        os.write(fd, b"".join(buffers)[written:])
    os.fdatasync(fd)


async def _serve_floor(directory: Path, sock_path: Path, ready: Path, stats: Path) -> None:
    from bench.bench_ingest import _wait_for_signal
    from daemon.service.app import tune_gc

    await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
    fd = os.open(directory / "messages.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    owner = FloorOwner(fd)
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: _FloorConn(owner), str(sock_path))
    tune_gc()
    await asyncio.to_thread(ready.write_text, "ready")
    await _wait_for_signal()
    server.close()
    os.close(fd)
    await asyncio.to_thread(stats.write_text, json.dumps(owner.counters.__dict__))


# -- a worker (subprocess) ---------------------------------------------------------


class RemoteWal(_Framed):
    """The worker's WAL: :meth:`append` ships the items to the owner and waits for
    its durable LSNs. Duck-types ``daemon.ingest.server.WalAppender``."""

    def __init__(self, die_after: int = 0) -> None:
        super().__init__(_REP, Counters())
        self._ids = iter(range(1, 1 << 63))
        self._die_after = die_after  # --check --kill-worker: SIGKILL after this hand-off
        self._waiting: dict[int, asyncio.Future[tuple[int, int, int]]] = {}

    async def append(
        self, items: Sequence[tuple[int, bytes]], request: Any = None
    ) -> tuple[int, int]:
        from daemon.ingest.validate import Rejection
        from wal.errors import WalClosedError, WalFullError

        rid = next(self._ids)
        if request is None:
            message = pack_request(rid, items)
        else:
            message = pack_request(rid, items, request.key, request.digest)
        fut: asyncio.Future[tuple[int, int, int]] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        if self.transport is None or self.transport.is_closing():
            raise WalClosedError("the WAL owner is gone")
        self.send(message)
        if rid == self._die_after:
            # A worker killed mid-request: the owner has the request, its answer is lost.
            os.kill(os.getpid(), signal.SIGKILL)
        status, first, last = await fut
        if status == OK:
            return first, last
        if status == FULL:
            raise WalFullError("owner", 0, None, "ENOSPC")
        if status == KEY_REUSED:
            raise Rejection(422, "idempotency_key_reused", "key used for another body")
        raise WalClosedError("the WAL owner refused the append")

    def find_request(self, key: bytes) -> None:
        """Always None: the owner claims keys (:meth:`Owner._claim`), not the worker."""
        return None

    def message(self, fields: tuple[Any, ...], body: bytes) -> None:
        rid, status, first, last = fields
        fut = self._waiting.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result((status, first, last))

    def connection_lost(self, exc: Exception | None) -> None:
        from wal.errors import WalClosedError

        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(WalClosedError("the WAL owner went away"))
        self._waiting.clear()


async def _serve_worker(
    sock_path: Path, port: int, cores: int, ready: Path, stats: Path, die_after: int
) -> None:
    from bench.bench_ingest import _wait_for_signal
    from daemon.config import Config, DaemonConfig, IngestConfig, Listen
    from daemon.ingest import server as ingest_server
    from daemon.service.app import tune_gc
    from daemon.service.metrics import Metrics

    class ReusePortSite(ingest_server._CappedSite):
        """``_CappedSite`` bound with SO_REUSEPORT: the hook the prototype needs."""

        async def start(self) -> None:
            await ingest_server.web.BaseSite.start(self)
            loop = asyncio.get_running_loop()
            self._listener = await loop.create_server(
                self._factory,
                self._host,
                self._port,
                backlog=self._backlog,
                reuse_address=True,
                reuse_port=True,
            )
            self._server = self._listener

    ingest_server._CappedSite = ReusePortSite  # type: ignore[misc]
    loop = asyncio.get_running_loop()
    _t, remote = await loop.create_unix_connection(
        functools.partial(RemoteWal, die_after), str(sock_path)
    )
    cfg = Config(
        daemon=DaemonConfig(data_dir=sock_path.parent, cores=cores),
        ingest=IngestConfig(listen=Listen("127.0.0.1", port), max_lag_events=1 << 62),
    )
    server = ingest_server.IngestServer(cfg, remote, Metrics(), lag=lambda: 0)  # type: ignore[arg-type]
    tune_gc()
    await server.start()
    await asyncio.to_thread(ready.write_text, "ready")
    await _wait_for_signal()
    await server.stop(5.0)
    await asyncio.to_thread(stats.write_text, json.dumps(remote.counters.__dict__))


def _run(coro: Any) -> int:
    import uvloop

    from daemon.service import logs

    logs.configure("warning", "console")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(coro)
    return 0


# -- the sides (benchmark side) ----------------------------------------------------


def _wait_file(path: Path, procs: Sequence[subprocess.Popen[bytes]], what: str) -> None:
    deadline = time.monotonic() + 30
    while not path.exists():
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.05)


class Split:
    """One WAL owner and ``workers`` HTTP workers on one SO_REUSEPORT port."""

    keyed = False

    def __init__(
        self,
        name: str,
        workdir: Path,
        workers: int,
        cores: int,
        die_after: int = 0,
        floor: bool = False,
    ) -> None:
        self.name = name
        self.floor = floor
        self.dir = workdir / name
        self.dir.mkdir(parents=True)
        me = [sys.executable, "-m", "bench.bench_ingest_scaling"]
        owner = [*me, "--serve-owner", str(self.dir), "--cores", str(cores)]
        self.owner = subprocess.Popen(
            [*owner, "--floor"] if floor else owner, stdout=subprocess.DEVNULL
        )
        _wait_file(self.dir / "owner.ready", [self.owner], "the WAL owner")
        port = _free_port()
        self.workers: list[subprocess.Popen[bytes]] = []
        for i in range(workers):
            proc = subprocess.Popen(
                [*me, "--serve-worker", str(self.dir), "--worker", str(i), "--port", str(port),
                 "--cores", str(cores), "--die-after", str(die_after if i == 0 else 0)],
                stdout=subprocess.DEVNULL,
            )  # fmt: skip
            self.workers.append(proc)
            _wait_file(self.dir / f"worker{i}.ready", [self.owner, proc], f"worker {i}")
        self.url = f"http://127.0.0.1:{port}/v1/events"

    def groups(self) -> dict[str, list[int]]:
        live = [p.pid for p in self.workers if p.poll() is None]
        return {"owner": [self.owner.pid], "workers": live}

    def stop(self) -> dict[str, Any]:
        for proc in self.workers:
            _stop(proc)
        _stop(self.owner)
        stats: dict[str, Any] = {"workers": Counters()}
        with contextlib.suppress(FileNotFoundError, ValueError):
            stats["owner"] = Counters(**json.loads((self.dir / "owner.stats").read_text()))
        for i in range(len(self.workers)):
            with contextlib.suppress(FileNotFoundError, ValueError):
                got = json.loads((self.dir / f"worker{i}.stats").read_text())
                for k, v in got.items():
                    setattr(stats["workers"], k, getattr(stats["workers"], k) + v)
        return stats


class Today:
    """One process from ``bench.bench_ingest``: ``eventplane`` (ingest + WAL) or
    ``daemon`` (``eventplane run`` without Spark: rings, consumers, planner too)."""

    keyed = False

    def __init__(self, workdir: Path, cores: int, kind: str = "eventplane") -> None:
        self.name = "today" if kind == "eventplane" else kind
        self._server = Server(kind, workdir, cores)
        self.url = self._server.url

    def groups(self) -> dict[str, list[int]]:
        return {"process": [self._server.proc.pid]}

    def stop(self) -> dict[str, Any]:
        self._server.stop()
        return {}


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Run:
    events_per_s: float
    cpu_us: dict[str, float]  # group -> CPU-µs per event
    client_cpu_us: float


@dataclass
class SideResult:
    name: str
    runs: list[Run] = field(default_factory=list)
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    achieved: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)

    def median(self) -> Run:
        runs = sorted(self.runs, key=lambda r: r.events_per_s)
        return runs[len(runs) // 2]


def _group_cpu(side: Today | Split) -> dict[str, float]:
    return {g: sum(cpu_seconds(p) for p in pids) for g, pids in side.groups().items()}


async def closed_loop(
    side: Today | Split, bodies: list[bytes], clients: int, warmup_s: float, duration_s: float
) -> Run:
    """Events/s and CPU-µs per event per process group, back-to-back producers."""
    import aiohttp

    from bench.bench_ingest import _post

    counted = [0]
    measuring = asyncio.Event()
    stop_at = time.monotonic() + warmup_s + duration_s

    async def producer(i: int) -> None:
        async with aiohttp.ClientSession() as session:
            k = i
            while time.monotonic() < stop_at:
                n = await _post(session, side.url, bodies[k % len(bodies)])
                k += clients
                if measuring.is_set():
                    counted[0] += n

    tasks = [asyncio.create_task(producer(i)) for i in range(clients)]
    await asyncio.sleep(warmup_s)
    cpu0, me0, t0 = _group_cpu(side), time.process_time(), time.monotonic()
    measuring.set()
    await asyncio.gather(*tasks)
    cpu1, me1, t1 = _group_cpu(side), time.process_time(), time.monotonic()
    events = max(counted[0], 1)
    per = {g: (cpu1[g] - cpu0[g]) * 1e6 / events for g in cpu1}
    per["total"] = sum(per.values())
    return Run(counted[0] / (t1 - t0), per, (me1 - me0) * 1e6 / events)


# -- per-part costs (in this process) ------------------------------------------------


def _best_ns(fn: Any, events: int, repeat: int) -> float:
    """Best-of-``repeat`` CPU ns per event of ``fn()`` (process time: all threads)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time_ns()
        fn()
        best = min(best, (time.process_time_ns() - t0) / events)
    return best


def measure_parts(bodies: list[bytes], cores: int, workdir: Path, repeat: int) -> dict[str, float]:
    """CPU-ns per event of each part of ingest, in this process."""
    from daemon.config import Config, DaemonConfig, IngestConfig
    from daemon.ingest.server import IngestServer
    from daemon.ingest.validate import _decode_one
    from daemon.plane.ring import RingSet
    from daemon.service.metrics import Metrics
    from daemon.shard import collection_seed
    from wal import Wal
    from wal.format import encode_frame

    cfg = Config(daemon=DaemonConfig(data_dir=workdir, cores=cores), ingest=IngestConfig())
    server = IngestServer(cfg, None, Metrics(), lag=lambda: 0)  # type: ignore[arg-type]
    per_request = bodies[0].count(b"\n")
    events = per_request * len(bodies)
    parts: dict[str, float] = {}
    parsed = [server._parse(b, True) for b in bodies]
    parts["parse + validate + shard + encode"] = _best_ns(
        lambda: [server._parse(b, True) for b in bodies], events, repeat
    )
    lines = [x for b in bodies for x in b.split(b"\n") if x]
    parts["  of which: JSON decode (msgspec)"] = _best_ns(
        lambda: list(map(_decode_one, lines)), events, repeat
    )
    decoded = list(map(_decode_one, lines))
    seeds = {c: collection_seed(c) for c in {e.collection for e in decoded}}
    keys = [(e.key, seeds[e.collection]) for e in decoded]
    parts["  of which: shard (CRC-32 of the key)"] = _best_ns(
        lambda: [(crc32(k.encode(), seed) * cores) >> 32 for k, seed in keys], events, repeat
    )
    packed = [pack_request(i, items) for i, items in enumerate(parsed)]
    parts["hand-off pack (worker)"] = _best_ns(
        lambda: [pack_request(i, items) for i, items in enumerate(parsed)], events, repeat
    )
    size = _REQ.size
    heads = [_REQ.unpack_from(m) for m in packed]
    parts["hand-off unpack (owner)"] = _best_ns(
        lambda: [unpack_request(m[size:], h[2], h[3]) for m, h in zip(packed, heads, strict=True)],
        events,
        repeat,
    )
    parts["hand-off socket round trip"] = _best_ns(
        lambda: _socket_round_trips(packed), events, repeat
    )

    async def appends(wal: Any) -> None:
        # 8 concurrent requests as in the closed loop: group commit coalesces them.
        sem = asyncio.Semaphore(8)

        async def one(items: list[tuple[int, bytes]]) -> None:
            async with sem:
                await wal.append(items)

        await asyncio.gather(*(one(items) for items in parsed))

    # The frame encoding alone, over groups of 8 requests as the closed loop makes
    # them: what stays in the owner with a grouped append (docs/scaling.md, "The model").
    eight = [list(chain.from_iterable(parsed[i : i + 8])) for i in range(0, len(parsed), 8)]
    columns = [
        (
            list(map(_core_of, g)),
            list(map(_payload_of, g)),
            array("I", map(len, map(_payload_of, g))),
        )
        for g in eight
    ]
    frame_ns = _best_ns(
        lambda: [encode_frame(1, 1, c, p, n, {}) for c, p, n in columns], events, repeat
    )
    groups: list[tuple[int, float]] = []

    def wal_cost(fsync: str, rings: bool) -> float:
        wal = Wal.open(workdir / f"wal-{fsync}-{rings}", fsync=fsync)  # type: ignore[arg-type]
        if fsync == "always":
            wal.on_group = lambda n, _size, synced: groups.append((n, synced))
        try:
            import uvloop

            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                if rings:
                    ring_set = RingSet(cores, 1 << 30, 1 << 40)

                    async def listen() -> None:
                        wal.set_batch_listener(ring_set.push_batches)

                    runner.run(listen())
                return _best_ns(lambda: runner.run(appends(wal)), events, repeat)
        finally:
            wal.close()

    parts["WAL enqueue + group commit (fsync never)"] = wal_cost("never", False)
    parts["  of which: frame encoding (encode_frame)"] = frame_ns
    always = wal_cost("always", False)
    parts["WAL fdatasync (always - never)"] = max(
        0.0, always - parts["WAL enqueue + group commit (fsync never)"]
    )
    parts["records + ring push (listener)"] = max(
        0.0, wal_cost("never", True) - parts["WAL enqueue + group commit (fsync never)"]
    )
    # Wall time, not CPU: what bounds the group commit's rate.
    parts["fdatasync wall µs per group (median)"] = statistics.median(g[1] for g in groups) * 1e6
    parts["events per group (median)"] = statistics.median(g[0] for g in groups)
    return parts


def _socket_round_trips(messages: list[bytes]) -> None:
    """Each message through a Unix socket pair and a 32-byte answer back (both ends here)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        a.setblocking(False)
        b.setblocking(False)
        answer = bytes(_REP.size)
        for m in messages:
            view = memoryview(m)
            got = 0
            while got < len(m):
                if view:
                    with contextlib.suppress(BlockingIOError):
                        view = view[a.send(view) :]
                with contextlib.suppress(BlockingIOError):
                    got += len(b.recv(1 << 20))
            b.send(answer)
            a.recv(_REP.size)


# -- the model ---------------------------------------------------------------------


def model(owner_us: float, worker_us: float, cores_list: Sequence[int]) -> list[str]:
    """Events/s a machine with ``k`` cores could take: the owner's one core bounds
    its part; the workers share the other ``k - 1`` cores."""
    lines = [
        f"{'cores':>5} {'owner bound ev/s':>17} {'workers bound ev/s':>19} "
        f"{'expected ev/s':>14} {'bottleneck':>10} {'CPU µs/ev':>10}",
        f"{'-' * 5} {'-' * 17} {'-' * 19} {'-' * 14} {'-' * 10} {'-' * 10}",
    ]
    for k in cores_list:
        owner_cap = 1e6 / owner_us
        workers_cap = (k - 1) * 1e6 / worker_us if k > 1 else 0.0
        expected = min(owner_cap, workers_cap)
        neck = "owner" if owner_cap <= workers_cap else "workers"
        lines.append(
            f"{k:>5} {owner_cap:>17,.0f} {workers_cap:>19,.0f} {expected:>14,.0f} "
            f"{neck:>10} {owner_us + worker_us:>10.2f}"
        )
    return lines


# -- the check -------------------------------------------------------------------------


async def check(args: argparse.Namespace, workdir: Path) -> tuple[bool, str]:
    """Unique events through owner + 2 workers, keyed; optionally a worker SIGKILLed
    half way. Every acknowledged event must be in the WAL once, at its LSNs."""
    import aiohttp

    per_request = args.batch
    nreq = max(1, args.check // per_request)
    bodies = make_bodies(nreq, per_request, seed=11)
    side = Split("check", workdir, 2, args.cores, die_after=5 if args.kill_worker else 0)
    acks: dict[int, tuple[int, int]] = {}
    retries = [0]
    next_req = iter(range(nreq))
    prefix = f"check-{os.getpid()}-{time.time_ns()}"

    async def producer() -> None:
        for i in next_req:
            headers = {"Content-Type": "application/x-ndjson", "Idempotency-Key": f"{prefix}-{i}"}
            deadline = time.monotonic() + 30
            while True:
                try:
                    # A fresh connection per attempt: after a kill, SO_REUSEPORT
                    # sends it to a live worker.
                    async with (
                        aiohttp.ClientSession() as session,
                        session.post(side.url, data=bodies[i], headers=headers) as resp,
                    ):
                        payload = await resp.read()
                        if resp.status == 200:
                            got = json.loads(payload)
                            acks[i] = (got["first_lsn"], got["last_lsn"])
                            break
                        if resp.status not in (503, 507):
                            raise RuntimeError(f"HTTP {resp.status}: {payload[:200]!r}")
                except (aiohttp.ClientError, ConnectionError):
                    pass
                retries[0] += 1
                if time.monotonic() > deadline:
                    raise RuntimeError(f"request {i} was not acknowledged within 30 s")
                await asyncio.sleep(0.02)

    try:
        await asyncio.gather(*(producer() for _ in range(args.clients)))
    finally:
        killed = side.workers[0].poll() == -signal.SIGKILL
        stats = side.stop()
    from daemon.events import decode
    from wal import Wal

    problems: list[str] = []
    with Wal.open(side.dir / "wal") as wal:
        records = list(wal.read(1))
    by_lsn = {r.lsn: r for r in records}
    seen: dict[bytes, int] = {}
    for r in records:
        ev = decode(r.payload)
        ident = ev.new or b""
        seen[ident] = seen.get(ident, 0) + 1
    twice = sum(1 for v in seen.values() if v > 1)
    if twice:
        problems.append(f"{twice} events are in the WAL more than once")
    acked = 0
    for i, (first, last) in acks.items():
        lines = [x for x in bodies[i].split(b"\n") if x]
        if last - first + 1 != len(lines):
            problems.append(f"request {i}: ack names {last - first + 1} LSNs for {len(lines)}")
            continue
        for lsn, line in zip(range(first, last + 1), lines, strict=True):
            rec = by_lsn.get(lsn)
            want = json.loads(line)
            got = decode(rec.payload) if rec is not None else None
            if (
                got is None
                or got.key != want["key"]
                or json.loads(got.new or b"null") != want["new"]
            ):
                problems.append(f"request {i}: LSN {lsn} does not hold its event")
                break
            acked += 1
    missing = nreq - len(acks)
    if missing:
        problems.append(f"{missing} requests were never acknowledged")
    replays = stats["owner"].replays if "owner" in stats else 0
    if args.kill_worker and not killed:
        problems.append("the worker was not killed")
    elif args.kill_worker and not replays:
        problems.append("the killed worker's request was not answered to its retry as a replay")
    report = (
        f"check: {acked:,} acknowledged events in {len(acks)} requests, {len(records):,} "
        f"records in the WAL, {retries[0]} retries, "
        f"{replays} answered as replays, "
        f"worker killed: {'yes' if killed else 'no'}; "
        + ("every acknowledged event is in the WAL once" if not problems else "; ".join(problems))
    )
    return not problems, report


# -- the run ---------------------------------------------------------------------------


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


async def run_sides(args: argparse.Namespace, workdir: Path) -> list[SideResult]:
    from bench.bench_ingest import open_loop

    bodies = make_bodies(64, args.batch)
    sides: list[Today | Split] = [Today(workdir, args.cores)]
    if args.daemon:
        sides.append(Today(workdir, args.cores, "daemon"))
    for w in args.workers:
        sides.append(Split(f"w{w}", workdir, w, args.cores))
    if args.floor:
        w = max(args.workers)
        sides.append(Split(f"w{w}floor", workdir, w, args.cores, floor=True))
    results = {s.name: SideResult(s.name) for s in sides}
    try:
        for r in range(args.repeat):
            # Alternate, and rotate who goes first, so drift hits every side alike.
            order = sides[r % len(sides) :] + sides[: r % len(sides)]
            for side in order:
                print(f"  round {r + 1}: {side.name} ...", file=sys.stderr, flush=True)
                results[side.name].runs.append(
                    await closed_loop(side, bodies, args.clients, args.warmup, args.duration)
                )
        rate = args.rate
        args.rate_used = rate
        for side in sides:
            p50, p99, achieved = await open_loop(
                side,  # type: ignore[arg-type]
                bodies,
                args.clients,
                rate,
                args.duration,
            )
            res = results[side.name]
            res.p50_ms, res.p99_ms, res.achieved = p50, p99, achieved
    finally:
        for side in sides:
            results[side.name].stats = side.stop()
    return list(results.values())


LABELS = {
    "today": "today: ingest + WAL, 1 process",
    "daemon": "eventplane run, no Spark",
}


def render(results: list[SideResult], parts: dict[str, float], args: argparse.Namespace) -> str:
    lines = [
        f"Ingest across processes: {args.batch} events/request, {args.clients} clients, "
        f"fsync always, daemon.cores {args.cores}, {os.cpu_count()} CPUs shared with the "
        f"client; {args.repeat} alternating rounds of {args.duration:g} s, medians",
        f"load average: start {args.load_before}, end {_load()}",
        "",
    ]
    if parts:
        lines += [
            "Per-part CPU, this process (best of the repeats; last two: wall time, count):",
            f"{'part':<42} {'ns/event':>9}",
            f"{'-' * 42} {'-' * 9}",
        ]
        lines += [f"{k:<42} {v:>9.0f}" for k, v in parts.items() if "per group" not in k]
        lines += [f"{k:<42} {v:>9.0f}" for k, v in parts.items() if "per group" in k]
        lines.append("")
    groups = sorted({g for r in results for g in r.median().cpu_us} - {"total"})
    head = f"{'side':<32} {'events/s':>10} {'ratio':>6} " + " ".join(
        f"{g + ' µs/ev':>14}" for g in [*groups, "total"]
    )
    head += f" {'client µs/ev':>12} {'p50 ms':>7} {'p99 ms':>7}"
    lines += [head, "-" * len(head)]
    today = next(r for r in results if r.name == "today").median()
    for r in results:
        m = r.median()
        if r.name.endswith("floor"):
            label = f"{r.name[1:-5]} worker(s) + floor owner"
        else:
            label = LABELS.get(r.name, f"{r.name[1:]} worker(s) + WAL owner")
        cells = " ".join(
            f"{m.cpu_us[g]:>14.2f}" if g in m.cpu_us else f"{'':>14}" for g in [*groups, "total"]
        )
        lines.append(
            f"{label:<32} {m.events_per_s:>10,.0f} {m.events_per_s / today.events_per_s:>6.2f} "
            f"{cells} {m.client_cpu_us:>12.2f} {r.p50_ms:>7.2f} {r.p99_ms:>7.2f}"
        )
    lines.append("")
    lines.append(
        f"latency: open loop at {args.rate_used:,.0f} events/s for every side (--rate), "
        "from the scheduled send; achieved counts the ramp and the tail"
    )
    for r in results:
        spread = " ".join(f"{x.events_per_s / 1000:.0f}k" for x in r.runs)
        lines.append(f"  {r.name}: events/s per round {spread}; achieved {r.achieved:,.0f}/s")
    lines.append("")
    lines.append("Hand-off per request (whole run, counted by the processes):")
    for r in results:
        st = r.stats
        if "owner" not in st:
            continue
        o, w = st["owner"], st["workers"]
        n = max(o.messages, 1)
        lines.append(
            f"  {r.name}: {o.bytes_in / n / 1024:.1f} KiB to the owner in {o.reads / n:.2f} "
            f"reads, {w.writes / max(w.messages, 1):.2f} worker writes; answers "
            f"{o.bytes_out / n:.0f} B in {w.reads / max(w.messages, 1):.2f} worker reads"
        )
    if parts:
        inside = (
            parts["parse + validate + shard + encode"]
            + parts["WAL enqueue + group commit (fsync never)"]
            + parts["WAL fdatasync (always - never)"]
        ) / 1000
        lines.append(
            f"Today's {today.cpu_us['total']:.2f} µs/event less parse/encode and WAL "
            f"({inside:.2f}): {today.cpu_us['total'] - inside:.2f} µs/event of HTTP "
            "(aiohttp, the event loop, the body read, the ack)"
        )
    split = [r for r in results if r.name[0] == "w" and not r.name.endswith("floor")]
    if split and parts:
        best = max(split, key=lambda r: r.median().events_per_s).median()
        owner_us = best.cpu_us.get("owner", 0.0)
        worker_us = best.cpu_us.get("workers", 0.0)
        lines += [
            "",
            f"Model: owner {owner_us:.2f} µs/event on one core, workers {worker_us:.2f} "
            "µs/event on the other cores (from the best split side above; the client "
            "excluded, as producers run elsewhere)",
            *model(owner_us, worker_us, (2, 4, 8, 16)),
        ]
        daemon = next((r for r in results if r.name == "daemon"), None)
        if daemon is not None:
            plane = daemon.median().cpu_us["total"] - today.cpu_us["total"]
            lines += [
                "",
                f"Model with the plane in the owner: + {plane:.2f} µs/event (eventplane run "
                "minus today, this run: rings, consumers, planner; no Spark)",
                *model(owner_us + plane, worker_us, (2, 4, 8, 16)),
            ]
        floor = next((r for r in results if r.name.endswith("floor")), None)
        if floor is not None:
            floor_us = floor.median().cpu_us.get("owner", 0.0)
            lines += [
                "",
                f"Model with the floor owner: {floor_us:.2f} µs/event (no per-event work: "
                "what a grouped append could approach; the plane not counted)",
                *model(max(floor_us, 1e-3), worker_us, (2, 4, 8, 16)),
            ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1000, help="events per request")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3, help="alternating rounds")
    parser.add_argument("--cores", type=int, default=4, help="daemon.cores (shards)")
    parser.add_argument(
        "--workers", default="1,2", help="worker counts of the split sides, comma-separated"
    )
    parser.add_argument(
        "--rate", type=float, default=100_000, help="open-loop events/s, the same for every side"
    )
    parser.add_argument("--no-parts", action="store_true", help="skip the per-part timings")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="add a side whose owner only writes and fsyncs the messages (no WAL)",
    )
    parser.add_argument(
        "--no-daemon", dest="daemon", action="store_false", help="skip the eventplane run side"
    )
    parser.add_argument("--check", type=int, default=0, help="verify N events instead")
    parser.add_argument(
        "--kill-worker", action="store_true", help="--check: a worker dies mid-request"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--serve-owner", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--serve-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--die-after", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_owner:
        d = args.serve_owner
        serve = _serve_floor if args.floor else _serve_owner
        return _run(serve(d / "wal", d / "owner.sock", d / "owner.ready", d / "owner.stats"))
    if args.serve_worker:
        d, i = args.serve_worker, args.worker
        return _run(
            _serve_worker(
                d / "owner.sock", args.port, args.cores, d / f"worker{i}.ready",
                d / f"worker{i}.stats", args.die_after,
            )
        )  # fmt: skip
    args.workers = [int(x) for x in args.workers.split(",") if x.strip()]
    from daemon.service import logs

    logs.configure("warning", "console")
    args.load_before = _load()
    import uvloop

    with tempfile.TemporaryDirectory(prefix="bench-scaling-", dir=os.environ.get("BENCH_DIR")) as d:
        if args.check:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                ok, report = runner.run(check(args, Path(d)))
            print(f"{report}\nload average: start {args.load_before}, end {_load()}")
            return 0 if ok else 1
        parts: dict[str, float] = {}
        if not args.no_parts:
            print("measuring the parts ...", file=sys.stderr, flush=True)
            parts = measure_parts(make_bodies(16, args.batch), args.cores, Path(d), args.repeat)
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            results = runner.run(run_sides(args, Path(d)))
    print(render(results, parts, args))
    if args.json:
        out = {
            "parts_ns_per_event": parts,
            "load_before": args.load_before,
            "load_after": _load(),
            "rate": args.rate_used,
            "sides": [
                {
                    "name": r.name,
                    "runs": [x.__dict__ for x in r.runs],
                    "median": r.median().__dict__,
                    "p50_ms": r.p50_ms,
                    "p99_ms": r.p99_ms,
                    "stats": {k: v.__dict__ for k, v in r.stats.items()},
                }
                for r in results
            ],
        }
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
