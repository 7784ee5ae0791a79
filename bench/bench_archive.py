"""What the WAL archive costs: the whole daemon (``eventplane run``, no stage)
with no archive, with ``ack = "local"`` and with ``ack = "archived"``, against
a SeaweedFS server on loopback (tests/s3/server.py), and again through a proxy
that holds each request to the store 20 ms +- 10 ms (about S3 Standard's PUT).

Per configuration and client count: throughput (closed loop), the share of
one core the daemon used in it (below 100%: it waited, for its clients or its
uploads), ack p50/p99 in an open loop at half that throughput, the daemon's
CPU-µs per event and the store's (SeaweedFS shares the cores; S3 would not),
the archive's PUTs per second and per million events, and the PUT p50/p99
(the daemon's histogram, interpolated within its buckets)
(bench/bench_ingest.py's loops; 1000 events of ~150 bytes per request).
Then the issue's aims at the most clients, each "met" or "MISSED". ``--modes``
and ``--clients`` take a subset.

``--pin`` gives the daemon CPU 0 alone and the store, the proxy and the
clients CPU 1: a store off the machine, as S3 is, within one 2-core machine.
The daemon's throughput then shows what archiving costs the daemon itself,
not the store's CPU taken from it. ``--rounds N`` measures every
configuration N times, interleaved, and reports the medians; each ratio of
the aims is the median of the rounds' own ratios (:func:`verdicts`).

Run: ``python -m bench.bench_archive`` (``--duration 3`` for a quick look).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.bench_ingest import _free_port, closed_loop, make_bodies, open_loop
from bench.common import cpu_seconds, start_daemon

MODES = ("none", "local", "archived")


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` on ``cpus``; threads it starts later inherit it."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


class DelayProxy:
    """TCP proxy to ``port``; each request waits 10-30 ms once, before its head.

    Requests are told apart by their framing (the head, then Content-Length
    bytes of body), not by a pause: a PUT sends its head, waits for the
    store's ``100 Continue`` and only then its body, and that body is not a
    second request. Its own process: in the clients' process it would wait
    for their GIL between chunks, and add latency a store off the machine
    does not have."""

    def __init__(self, port: int, seed: int = 1) -> None:
        self.port = _free_port()
        spawn = multiprocessing.get_context("spawn")
        ready = spawn.Event()
        self.proc = spawn.Process(
            target=_proxy_main, args=(port, self.port, seed, ready), daemon=True
        )
        self.proc.start()
        if not ready.wait(30):
            raise RuntimeError("the delay proxy did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.join(5)


class RequestFraming:
    """Where the HTTP/1.1 requests on one connection begin: :meth:`feed` takes
    the next bytes sent and says whether they begin a request."""

    def __init__(self) -> None:
        self.head = b""  # the current request's head so far
        self.body_left = 0  # bytes of the current request's body still to come

    def feed(self, chunk: bytes) -> bool:
        starts = not self.head and not self.body_left
        pos = 0
        while pos < len(chunk):
            if self.body_left:
                took = min(self.body_left, len(chunk) - pos)
                self.body_left -= took
                pos += took
                continue
            seen = len(self.head)
            self.head += chunk[pos:]
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return starts
            pos += end + 4 - seen
            length = re.search(rb"\r\ncontent-length:\s*(\d+)", self.head[:end].lower())
            self.body_left = int(length.group(1)) if length else 0
            self.head = b""
        return starts


def _proxy_main(upstream: int, port: int, seed: int, ready: Any) -> None:
    rng = random.Random(seed)

    async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter, delay: bool) -> None:
        framing = RequestFraming()
        try:
            while chunk := await r.read(65536):
                if delay and framing.feed(chunk):
                    await asyncio.sleep(rng.uniform(0.010, 0.030))
                w.write(chunk)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            w.close()

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", upstream)
        except OSError:
            cw.close()
            return
        await asyncio.gather(pump(cr, uw, delay=True), pump(ur, cw, delay=False))

    async def serve() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        ready.set()
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


class Daemon:
    def __init__(
        self, root: Path, mode: str, endpoint: str, server: Any, flush_ms: int, extra: str = ""
    ) -> None:
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
        (self.dir / "config.toml").write_text(text + extra)
        self.proc = start_daemon(self.dir, self.admin, f"daemon ({mode})")
        self.url = f"http://127.0.0.1:{ingest}/v1/events"
        self.keyed = False  # what bench_ingest's loops ask of a server

    def counters(self) -> dict[str, float]:
        """The archive's successful PUTs and its PUT-latency histogram's
        cumulative buckets (``le`` in seconds -> count)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/metrics", timeout=5) as r:
            text = r.read().decode()
        out: dict[str, float] = {"puts": 0.0}
        for line in text.splitlines():
            if line.startswith('eventplane_wal_archive_puts_total{result="ok"}'):
                out["puts"] = float(line.split()[-1])
            elif line.startswith("eventplane_wal_archive_upload_seconds_bucket{"):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                out[le] = float(line.split()[-1])
        return out

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def quantile(q: float, before: dict[str, float], after: dict[str, float]) -> float:
    """The ``q`` quantile (ms) of the PUTs between two :meth:`Daemon.counters`,
    interpolated within its histogram bucket (Prometheus' histogram_quantile)."""
    bounds = sorted(
        (float(le), after[le] - before.get(le, 0.0)) for le in after if le not in ("puts", "+Inf")
    )
    total = after.get("+Inf", 0.0) - before.get("+Inf", 0.0)
    if total <= 0:
        return float("nan")
    rank, low, below = q * total, 0.0, 0.0
    for bound, count in bounds:
        if count >= rank:
            inside = count - below
            return 1000 * (low + (bound - low) * ((rank - below) / inside if inside else 1.0))
        low, below = bound, count
    return 1000 * low


async def measure(
    d: Daemon, clients: int, args: argparse.Namespace, store_pid: int
) -> dict[str, float]:
    bodies = make_bodies(64, 1000)
    c0, t0, s0 = d.counters(), time.monotonic(), cpu_seconds(store_pid)
    eps, cpu = await closed_loop(d, bodies, clients, args.warmup, args.duration)  # type: ignore[arg-type]
    c1, t1, s1 = d.counters(), time.monotonic(), cpu_seconds(store_pid)
    events = eps * args.duration
    p50, p99, _ = await open_loop(d, bodies, clients, eps / 2, args.duration)  # type: ignore[arg-type]
    c2 = d.counters()
    return {
        "events_per_s": eps,
        "p50_ms": p50,
        "p99_ms": p99,
        "cpu_us": cpu,
        # The store's CPU (SeaweedFS shares these cores; S3 would not), warm-up included.
        "store_cpu_us": (s1 - s0) * 1e6 / max(eps * (t1 - t0), 1),
        "puts_per_s": (c1["puts"] - c0["puts"]) / (t1 - t0),
        "puts_per_m": (c1["puts"] - c0["puts"]) / max(events, 1) * 1e6,
        "put_p50_ms": quantile(0.5, c0, c2),
        "put_p99_ms": quantile(0.99, c0, c2),
    }


def verdicts(runs: dict[tuple[str, str, int], list[dict[str, float]]], flush_ms: int) -> list[str]:
    """The issue's aims at the most clients measured, per store: met or MISSED.

    A throughput ratio is the median over the rounds of each round's own
    ratio (the range after it): a round's two configurations ran seconds
    apart, so the machine's drift over minutes cancels, which a ratio of the
    medians would not. The ack p99 aim is checked on the medians."""
    lines = []
    clients = max(c for _, _, c in runs)

    def ratio(a: tuple[str, str, int], b: tuple[str, str, int]) -> tuple[str, float] | None:
        if a not in runs or b not in runs:
            return None
        got = [x["events_per_s"] / y["events_per_s"] for x, y in zip(runs[a], runs[b], strict=True)]
        mid = statistics.median(got)
        spread = f" (rounds {min(got):.2f}-{max(got):.2f})" if len(got) > 1 else ""
        return f"{mid:.2f}x{spread}", mid

    for store in dict.fromkeys(s for s, _, _ in runs):
        local, archived = (store, "local", clients), (store, "archived", clients)
        got = ratio(local, ("loopback", "none", clients))
        if got is not None:
            text, mid = got
            lines.append(
                f"{store}, {clients} clients: local with an archive {text} of no "
                f"archive (aim >= 0.95x): {'met' if mid >= 0.95 else 'MISSED'}"
            )
        got = ratio(archived, local)
        if got is not None:
            text, mid = got
            lines.append(
                f"{store}, {clients} clients: archived {text} of local "
                f"(aim >= 0.8x): {'met' if mid >= 0.8 else 'MISSED'}"
            )
        if archived in runs:
            p99 = statistics.median(r["p99_ms"] for r in runs[archived])
            bound = flush_ms + 2 * statistics.median(r["put_p99_ms"] for r in runs[archived])
            lines.append(
                f"{store}, {clients} clients: archived ack p99 {p99:.1f} ms "
                f"(aim <= flush_ms + 2 x PUT p99 = {bound:.1f} ms): "
                f"{'met' if p99 <= bound else 'MISSED'}"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--clients", default="8,32")
    parser.add_argument("--flush-ms", type=int, default=100)
    parser.add_argument("--no-proxy", action="store_true", help="skip the 20 ms store")
    parser.add_argument("--modes", default=",".join(MODES), help="a subset of " + ",".join(MODES))
    parser.add_argument("--pin", action="store_true", help="the daemon on CPU 0, the rest on 1")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved; medians reported")
    args = parser.parse_args(argv)
    from tests.s3.server import start_weed

    root = Path(tempfile.mkdtemp(prefix="bench-archive-"))
    (root / "weed").mkdir()
    weed = start_weed(root / "weed")
    assert weed.proc is not None
    if args.pin:
        if len(os.sched_getaffinity(0)) < 2:
            parser.error("--pin needs 2 CPUs")
        os.sched_setaffinity(0, {1})  # this process (the clients) and the proxy it starts
        pin(weed.proc.pid, {1})
        print("pinned: the daemon on CPU 0; SeaweedFS, the proxy and the clients on CPU 1\n")
    proxy = None if args.no_proxy else DelayProxy(int(weed.server.endpoint.rsplit(":", 1)[1]))
    if proxy is not None and args.pin:
        pin(proxy.proc.pid, {1})
    stores = [("loopback", weed.server.endpoint)]
    if proxy is not None:
        stores.append(("+20 ms", f"http://127.0.0.1:{proxy.port}"))
    modes = [m for m in MODES if m in args.modes.split(",")]
    configs = [
        (store, endpoint, mode, clients)
        for store, endpoint in stores
        for mode in modes
        if store == "loopback" or mode != "none"
        for clients in (int(c) for c in args.clients.split(","))
    ]
    runs: dict[tuple[str, str, int], list[dict[str, float]]] = {}
    try:
        # Rounds interleave the configurations: a shared machine's speed drifts
        # over minutes, and each figure is the median of its rounds.
        for round_no in range(1, args.rounds + 1):
            for store, endpoint, mode, clients in configs:
                d = Daemon(root, mode, endpoint, weed.server, args.flush_ms)
                if args.pin:
                    pin(d.proc.pid, {0})
                try:
                    r = asyncio.run(measure(d, clients, args, weed.proc.pid))
                finally:
                    d.stop()
                runs.setdefault((store, mode, clients), []).append(r)
                print(
                    f"round {round_no}: {store} {mode} {clients} clients: "
                    f"{r['events_per_s']:,.0f} events/s",
                    file=sys.stderr,
                    flush=True,
                )
        print(
            "| store | mode | clients | events/s | daemon busy | ack p50 ms | ack p99 ms "
            "| CPU µs/event | store CPU µs/event | PUTs/s | PUTs per M events | PUT p50 ms "
            "| PUT p99 ms |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for (store, mode, clients), got in runs.items():
            r = {k: statistics.median(one[k] for one in got) for k in got[0]}
            print(
                f"| {store} | {mode} | {clients} | {r['events_per_s']:,.0f} "
                f"| {r['cpu_us'] * r['events_per_s'] / 1e4:.0f}% "
                f"| {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['cpu_us']:.1f} "
                f"| {r['store_cpu_us']:.1f} | {r['puts_per_s']:.1f} "
                f"| {r['puts_per_m']:,.0f} | {r['put_p50_ms']:.1f} "
                f"| {r['put_p99_ms']:.1f} |",
                flush=True,
            )
        print()
        for line in verdicts(runs, args.flush_ms):
            print(line)
    finally:
        if proxy is not None:
            proxy.stop()
        weed.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
