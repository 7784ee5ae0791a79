"""What the WAL archive costs: the whole daemon (``eventplane run``, no stage)
with no archive, with ``ack = "local"`` and with ``ack = "archived"``, against
a SeaweedFS server on loopback (tests/s3/server.py), and again through a proxy
that holds each request to the store 20 ms +- 10 ms (about S3 Standard's PUT).

Per configuration and client count: throughput (closed loop), ack p50/p99 in
an open loop at half that throughput, the daemon's CPU-µs per event, and the
archive's PUTs per second and per million events (bench/bench_ingest.py's
loops; 1000 events of ~150 bytes per request).

Run: ``python -m bench.bench_archive`` (``--duration 3`` for a quick look).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.bench_ingest import _free_port, closed_loop, make_bodies, open_loop

MODES = ("none", "local", "archived")


class DelayProxy:
    """TCP proxy to ``port``; the first chunk of each request waits 10-30 ms."""

    def __init__(self, port: int, seed: int = 1) -> None:
        self.upstream, self.port = port, _free_port()
        self._rng = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._main, daemon=True).start()
        self._ready.wait(10)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self._ready.set()
        async with server:
            await server.serve_forever()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            cw.close()
            return
        await asyncio.gather(self._pump(cr, uw, delay=True), self._pump(ur, cw, delay=False))

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, delay: bool) -> None:
        last = 0.0
        try:
            while chunk := await r.read(65536):
                now = time.monotonic()
                if delay and now - last > 0.005:  # a new request on this connection
                    await asyncio.sleep(self._rng.uniform(0.010, 0.030))
                last = time.monotonic()
                w.write(chunk)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            w.close()


class Daemon:
    def __init__(self, root: Path, mode: str, endpoint: str, server: Any, flush_ms: int) -> None:
        self.dir = root / f"{mode}-{time.monotonic_ns()}"
        self.dir.mkdir()
        ingest, self.admin = _free_port(), _free_port()
        text = (
            f'[daemon]\ndata_dir = "data"\ncores = 4\n'
            f'[ingest]\nlisten = "127.0.0.1:{ingest}"\n'
            f'[admin]\nlisten = "127.0.0.1:{self.admin}"\n'
            '[log]\nlevel = "warning"\nformat = "json"\n'
        )
        if mode != "none":
            text += (
                f'[s3]\nendpoint = "{endpoint}"\npath_style = true\n'
                f'access_key_id = "{server.access_key}"\n'
                f'secret_access_key = "{server.secret_key}"\n'
                f'[wal.archive]\nuri = "s3://{server.bucket}/{self.dir.name}"\n'
                f'ack = "{mode}"\nflush_ms = {flush_ms}\n'
            )
        (self.dir / "config.toml").write_text(text)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.cli.main", "run", "--config", "config.toml"],
            cwd=self.dir,
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon ({mode}) did not start")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/readyz", timeout=1):
                    break
            except OSError:
                time.sleep(0.1)
        self.url = f"http://127.0.0.1:{ingest}/v1/events"
        self.keyed = False  # what bench_ingest's loops ask of a server

    def puts(self) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/metrics", timeout=5) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith('eventplane_wal_archive_puts_total{result="ok"}'):
                return float(line.split()[-1])
        return 0.0

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def measure(d: Daemon, clients: int, args: argparse.Namespace) -> dict[str, float]:
    bodies = make_bodies(64, 1000)
    puts0, t0 = d.puts(), time.monotonic()
    eps, cpu = await closed_loop(d, bodies, clients, args.warmup, args.duration)  # type: ignore[arg-type]
    puts1, t1 = d.puts(), time.monotonic()
    events = eps * args.duration
    p50, p99, _ = await open_loop(d, bodies, clients, eps / 2, args.duration)  # type: ignore[arg-type]
    return {
        "events_per_s": eps,
        "p50_ms": p50,
        "p99_ms": p99,
        "cpu_us": cpu,
        "puts_per_s": (puts1 - puts0) / (t1 - t0),
        "puts_per_m": (puts1 - puts0) / max(events, 1) * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--clients", default="8,32")
    parser.add_argument("--flush-ms", type=int, default=100)
    parser.add_argument("--no-proxy", action="store_true", help="skip the 20 ms store")
    args = parser.parse_args(argv)
    from tests.s3.server import start_weed

    root = Path(tempfile.mkdtemp(prefix="bench-archive-"))
    (root / "weed").mkdir()
    weed = start_weed(root / "weed")
    proxy = None if args.no_proxy else DelayProxy(int(weed.server.endpoint.rsplit(":", 1)[1]))
    stores = [("loopback", weed.server.endpoint)]
    if proxy is not None:
        stores.append(("+20 ms", f"http://127.0.0.1:{proxy.port}"))
    print(
        "| store | mode | clients | events/s | ack p50 ms | ack p99 ms | CPU µs/event "
        "| PUTs/s | PUTs per M events |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        for store, endpoint in stores:
            for mode in MODES:
                if store != "loopback" and mode == "none":
                    continue
                for clients in (int(c) for c in args.clients.split(",")):
                    d = Daemon(root, mode, endpoint, weed.server, args.flush_ms)
                    try:
                        r = asyncio.run(measure(d, clients, args))
                    finally:
                        d.stop()
                    print(
                        f"| {store} | {mode} | {clients} | {r['events_per_s']:,.0f} "
                        f"| {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['cpu_us']:.1f} "
                        f"| {r['puts_per_s']:.1f} | {r['puts_per_m']:,.0f} |",
                        flush=True,
                    )
    finally:
        weed.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
